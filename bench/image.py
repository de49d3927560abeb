"""Image import throughput, beside `umoci unpack` of the same image in the same run.

The image is real and made by umoci: two gzip layers (`umoci raw add-layer`),
the first a tar of this machine's /usr/lib/python3.11 and /usr/share/doc
(thousands of small files and some large ones), the second a few changes
with a whiteout and an opaque directory. `umoci unpack` of it onto the local
disk is the baseline; strata's import is timed in process (the engine's own
speed) and through the CLI and the store's server (what a user runs). Each
figure is the median of three; the throughput is the image's uncompressed
bytes over that time. Nothing here asserts.
"""

from __future__ import annotations

import io
import os
import shutil
import statistics
import subprocess
import tarfile
import tempfile
import time
from typing import Any

from bench.cli_env import CliEnv
from bench.report import row

SOURCES = ("/usr/lib/python3.11", "/usr/share/doc")


def _layer_one(path: str, limit: int) -> int:
    """A tar of the sources, up to `limit` bytes of file content; the bytes it holds."""
    total = 0
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for src in SOURCES:
            for dirpath, dirs, files in os.walk(src):
                dirs.sort()
                for name in sorted(files):
                    full = os.path.join(dirpath, name)
                    if total >= limit or not os.path.isfile(full) or os.path.islink(full):
                        continue
                    tf.add(full, full.lstrip("/"), recursive=False)
                    total += os.path.getsize(full)
    return total


def _layer_two(path: str) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for name in ("usr/share/doc/.wh..wh..opq", "usr/lib/python3.11/.wh.os.py"):
            tf.addfile(tarfile.TarInfo(name))
        data = b"changed in layer 2\n"
        ti = tarfile.TarInfo("usr/share/doc/README")
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))


def _build(root: str, limit: int) -> tuple[str, int]:
    layout = os.path.join(root, "layout")
    subprocess.run(["umoci", "init", "--layout", layout], check=True)
    subprocess.run(["umoci", "new", "--image", f"{layout}:b"], check=True)
    size = _layer_one(os.path.join(root, "l1.tar"), limit)
    _layer_two(os.path.join(root, "l2.tar"))
    for tar in ("l1.tar", "l2.tar"):
        subprocess.run(["umoci", "raw", "add-layer", "--image", f"{layout}:b",
                        os.path.join(root, tar)], check=True, capture_output=True)
        os.unlink(os.path.join(root, tar))
    return layout, size


def _median(times: list[float]) -> float:
    return statistics.median(times)


def run(base: str, quick: bool = False) -> list[dict[str, Any]]:
    if shutil.which("umoci") is None:
        print("image benchmarks skipped: umoci is not installed (make apt-deps)")
        return []
    from strata.engine.local import LocalStore, init_store
    from strata.image.importer import import_image

    root = tempfile.mkdtemp(prefix="strata-bench-image-", dir=base)
    env = CliEnv(os.path.join(root, "cli"))
    try:
        layout, size = _build(root, (24 if quick else 160) << 20)
        mb = size / 1e6
        rounds = 3
        umoci = []
        for i in range(rounds):
            bundle = os.path.join(root, f"bundle{i}")
            t0 = time.perf_counter()
            subprocess.run(["umoci", "unpack", "--image", f"{layout}:b", bundle], check=True,
                           capture_output=True)
            umoci.append(time.perf_counter() - t0)
            shutil.rmtree(bundle)
        embedded = []
        for i in range(rounds):
            store = os.path.join(root, f"store{i}")
            init_store(store)
            with LocalStore(store) as s:
                t0 = time.perf_counter()
                import_image(s, layout, "img", "b")
                embedded.append(time.perf_counter() - t0)
            shutil.rmtree(store)
        cli = []
        for i in range(rounds):  # a fresh store each time: nothing to deduplicate against
            env = CliEnv(os.path.join(root, f"cli{i}"))
            env.cli("init")
            env.cli("volume", "list")  # the server is up before the clock starts
            t0 = time.perf_counter()
            env.cli("image", "import", layout, "img:b")
            cli.append(time.perf_counter() - t0)
            env.close()
            shutil.rmtree(env.root)
        base_t = _median(umoci)
        what = "umoci unpack, same image"
        return [
            row(f"image import, in process ({mb:.0f} MB, 2 layers)", _median(embedded), "s",
                base_t, what),
            row(f"image import through the CLI and server ({mb:.0f} MB)", _median(cli), "s",
                base_t, what),
            row("image import throughput, in process", mb / _median(embedded), "MB/s",
                mb / base_t, what, lower_is_better=False),
            row("image import throughput, CLI", mb / _median(cli), "MB/s", mb / base_t, what,
                lower_is_better=False),
        ]
    finally:
        env.close()
        shutil.rmtree(root, ignore_errors=True)
