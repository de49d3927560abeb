"""Where strata's long-running processes log, and how.

Each long-running process logs through `logging.getLogger(__name__)` in
every module and calls `setup(path)` once, early, with its own log file:

- the server: STORE/serve.log;
- the step service: STORE/steps.log;
- a mount process: SCRATCH/mount.log (beside its state.json);
- a workspace daemon: its state directory's daemon.log.

The file is owner-only (it names volumes, paths and errors) and rotates at
`MAX_BYTES`, keeping `BACKUPS` older files (serve.log.1 …). The process's
stdout and stderr point at the same file, so a crash's traceback lands
beside the log lines; after a rotation they follow the new file.

The level comes from `--log-level` or STRATA_LOG_LEVEL (default info), and
`--log-json` or STRATA_LOG_JSON=1 writes one JSON object per line for log
collectors. Both are environment variables underneath, so a server or step
service that the CLI starts inherits them.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import sys
import time

MAX_BYTES = 16 * 1024 * 1024
BACKUPS = 3
LEVELS = ("debug", "info", "warning", "error")
LEVEL_ENV = "STRATA_LOG_LEVEL"
JSON_ENV = "STRATA_LOG_JSON"

_TEXT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, pid, message, and a traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name,
            "pid": record.process, "message": record.getMessage()}
        if record.exc_info:
            doc["traceback"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


class _OwnerOnlyRotating(logging.handlers.RotatingFileHandler):
    """Rotates like its parent; files are 0600, and fds 1 and 2 follow the newest file."""

    def __init__(self, path: str, *, own_stdio: bool) -> None:
        self.own_stdio = own_stdio
        super().__init__(path, maxBytes=MAX_BYTES, backupCount=BACKUPS, encoding="utf-8",
                         delay=False)

    def _open(self):  # type: ignore[no-untyped-def]  # the parent's signature is untyped
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)  # one an older strata made 0644
        stream = open(fd, "a", encoding="utf-8")  # noqa: SIM115 - the handler closes it
        if self.own_stdio:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(fd, 1)
            os.dup2(fd, 2)
        return stream


def level() -> int:
    name = os.environ.get(LEVEL_ENV, "info").strip().lower() or "info"
    return getattr(logging, name.upper(), logging.INFO) if name in LEVELS else logging.INFO


def want_json() -> bool:
    return os.environ.get(JSON_ENV, "").strip().lower() in ("1", "true", "yes")


def configure_from_args(log_level: str | None, log_json: bool) -> None:
    """The CLI's global options, as environment for this process and what it starts."""
    if log_level:
        os.environ[LEVEL_ENV] = log_level
    if log_json:
        os.environ[JSON_ENV] = "1"


def setup(path: str | None) -> None:
    """Send this process's `strata` loggers to `path` (rotating), or to stderr if None.

    A process started in the background already has its stdout and stderr on
    `path`; they then follow the file through rotations. A process whose
    stderr is elsewhere (a `strata serve` in the foreground) keeps it, and
    also sees warnings and errors there (every level if one was asked for).
    """
    root = logging.getLogger("strata")
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    fmt: logging.Formatter = JsonFormatter() if want_json() else logging.Formatter(_TEXT)
    handlers: list[logging.Handler] = []
    stdio_is_log = path is not None and _same_file(2, path)
    if not stdio_is_log:
        console = logging.StreamHandler(os.fdopen(os.dup(2), "w", buffering=1))
        if path is not None and LEVEL_ENV not in os.environ:
            console.setLevel(logging.WARNING)
        handlers.append(console)
    if path is not None:
        handlers.append(_OwnerOnlyRotating(path, own_stdio=stdio_is_log))
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)
    root.setLevel(level())
    root.propagate = False


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
