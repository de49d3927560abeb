"""strata.logs: owner-only rotating files that stdout/stderr follow, text or JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import logging, os, sys
    from strata import logs
    logs.MAX_BYTES = 4096
    path = sys.argv[1]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1); os.dup2(fd, 2)   # as a background process's launcher does
    logs.setup(path)
    log = logging.getLogger("strata.test")
    for i in range(200):
        log.info("line %d %s", i, "x" * 40)
    log.debug("hidden")
    print("after rotation", flush=True)
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
""")


def _run(tmp_path, **env: str) -> str:
    path = str(tmp_path / "serve.log")
    subprocess.run([sys.executable, "-c", CHILD, path], check=True,
                   env={**os.environ, **env}, stdin=subprocess.DEVNULL)
    return path


def test_log_rotates_owner_only_and_stdio_follows(tmp_path) -> None:
    path = _run(tmp_path)
    names = sorted(os.listdir(tmp_path))
    assert names == ["serve.log", "serve.log.1", "serve.log.2", "serve.log.3"]
    for n in names:
        assert os.stat(tmp_path / n).st_mode & 0o777 == 0o600
    text = open(path).read()
    assert "line 199" in text and "hidden" not in text
    assert "after rotation" in text  # print() follows the newest file
    assert "ValueError: boom" in text and "ERROR strata.test[" in text


def test_json_lines_and_level(tmp_path) -> None:
    path = _run(tmp_path, STRATA_LOG_JSON="1", STRATA_LOG_LEVEL="debug")
    docs = [json.loads(line) for line in open(path) if line.startswith("{")]
    assert docs[-1]["level"] == "error" and "ValueError: boom" in docs[-1]["traceback"]
    assert {"time", "level", "logger", "pid", "message"} <= set(docs[0])
    assert any(d["message"] == "hidden" and d["level"] == "debug" for d in docs)
