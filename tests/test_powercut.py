"""Power cut, not just SIGKILL: acknowledged publishes survive losing the page cache.

A SIGKILL keeps the page cache, so a store that never fsynced would pass
tests/test_crash.py. Here the store lives on tests/dropfs.py, a FUSE
filesystem that remembers every unsynced write and undoes them all on the
"power cut". Each round: mount, let tests/crash_writer.py publish from
several threads (every 15th file 5 MB, so its blocks go ahead of the publish
through put_objects and only the publish's fsync makes them durable),
SIGKILL it at a random point, cut the power, unmount, and open the store on
what was synced (the backing directory itself). Every acknowledged publish
must be there, byte-exact, and fsck must be clean. The
same loop with fsync and fdatasync turned into no-ops in the writer must
find acknowledged publishes missing: the test can fail.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crash_writer import content_of
from strata.engine.errors import StrataError
from strata.engine.local import LocalStore, init_store
from strata.engine.txn import Transaction

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse")


def _mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


class DropMount:
    def __init__(self, backing: Path, mountpoint: Path) -> None:
        self.backing, self.mountpoint = backing, mountpoint
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> DropMount:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "dropfs.py"),
                                      str(self.backing), str(self.mountpoint)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 20
        while not _mounted(self.mountpoint):
            assert self.proc.poll() is None, self.proc.communicate()[1].decode()
            assert time.monotonic() < deadline, "dropfs did not mount"
            time.sleep(0.01)
        return self

    def power_cut(self) -> str:
        """Undo every unsynced write and unmount."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGUSR1)
        out, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, err.decode()
        self.proc = None
        return out.decode()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        if _mounted(self.mountpoint):
            subprocess.run(["umount", "-l", str(self.mountpoint)], check=False)


def run_rounds(tmp: Path, rounds: int, seed: int, *, fsync: bool = True) -> list[str]:
    """Crash the store `rounds` times; return the acknowledged publishes that were lost."""
    backing, mnt = tmp / "backing", tmp / "mnt"
    backing.mkdir()
    mnt.mkdir()
    init_store(str(backing / "store"))
    with LocalStore(str(backing / "store")) as s:
        s.create_volume("v")
        t = Transaction(s, "v")
        for i in range(3):
            t.mkdir(f"t{i}")
        t.commit()
    rng = random.Random(seed)
    env = {**os.environ, "STRATA_TEST_NO_FSYNC": "0" if fsync else "1",
           "STRATA_TEST_BIG_EVERY": "15"}
    lost: list[str] = []
    acked_total = 0
    for run in range(rounds):
        out = tmp / f"acks-{run}.txt"
        with DropMount(backing, mnt) as m, open(out, "wb") as sink:
            proc = subprocess.Popen([sys.executable, str(HERE / "crash_writer.py"),
                                     str(mnt / "store"), str(run), "3"],
                                    stdout=sink, stderr=subprocess.PIPE, env=env)
            deadline = time.monotonic() + 30
            while out.stat().st_size == 0 and proc.poll() is None:
                assert time.monotonic() < deadline, "writer never acknowledged a publish"
                time.sleep(0.005)
            time.sleep(rng.uniform(0.05, 0.6))
            proc.send_signal(signal.SIGKILL)
            _, err = proc.communicate()
            m.power_cut()
        if proc.returncode != -signal.SIGKILL:
            # Without fsync the previous cut may leave a store the writer cannot use.
            assert not fsync, f"writer died by itself: {err.decode()}"
            lost.append(f"round {run}: the writer failed: {err.decode()[-300:]}")
            break
        acked: dict[str, str] = {}
        for line in out.read_bytes().split(b"\n")[:-1]:  # whole lines only
            _tag, _thread, _r, _n, sid, path = line.decode().split()
            acked[path] = sid
        acked_total += len(acked)
        try:
            s = LocalStore(str(backing / "store"))
        except (StrataError, OSError) as exc:
            lost.append(f"round {run}: the store does not open: {exc!r}")
            break
        with s:
            try:
                head: Transaction | None = Transaction(s, "v")
            except Exception as exc:  # noqa: BLE001 - the head's snapshot or pack is gone
                lost.append(f"round {run}: the head does not read: {exc!r}")
                head = None
            for path, sid in sorted(acked.items()):
                try:
                    ok = (head is not None
                          and Transaction(s, "v", base=sid).read(path) == content_of(path)
                          and head.read(path) == content_of(path))
                except Exception:  # noqa: BLE001 - missing snapshot, object or path
                    ok = False
                if not ok:
                    lost.append(f"round {run}: {path} (acknowledged as {sid[:12]})")
            if fsync:
                report = s.fsck()
                assert report["ok"], report
    assert acked_total >= 3 or (lost and not fsync), "too few publishes to judge"
    return lost


def test_acknowledged_publishes_survive_a_power_cut(tmp_path: Path) -> None:
    lost = run_rounds(tmp_path, rounds=6, seed=int(time.time()))
    assert lost == [], "\n".join(lost[:20])


def test_without_fsync_a_power_cut_loses_acknowledged_publishes(tmp_path: Path) -> None:
    """The same rounds with fsync turned off in the writer: the check must catch it."""
    lost = run_rounds(tmp_path, rounds=2, seed=1, fsync=False)
    assert lost, "a store that never fsyncs passed the power-cut check"
