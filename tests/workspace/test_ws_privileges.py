"""Hardening II, finding 4: what a workspace image holds never raises privilege on the host.

A read-write token of a workspace can publish any ext4 image it likes; the
attach mounted it with setuid bits and device nodes honoured, and a planted
setuid-root program gave uid 65534 euid 0. Every attach is nosuid,nodev.
(What is left: the kernel's ext4 parser still reads the image; docs/workspaces.md.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from ws_harness import WsEnv

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="planting setuid-root files needs root")


def test_an_attached_workspace_ignores_setuid_bits_and_devices(wsenv: WsEnv) -> None:
    seed = wsenv.root / "seed"
    seed.mkdir()
    shutil.copy2("/usr/bin/id", seed / "id")
    os.chown(seed / "id", 0, 0)
    os.chmod(seed / "id", 0o4755)
    os.mknod(seed / "null", 0o20666, os.makedev(1, 3))
    os.chmod(seed / "null", 0o666)
    wsenv.run("workspace", "create", "box", "--size", "256M", "--seed", str(seed))
    outside = Path(tempfile.mkdtemp(prefix="strata-wspriv-", dir="/var/tmp"))
    os.chmod(outside, 0o755)  # uid 65534 must reach it (pytest's directory is root's)
    try:
        d = wsenv.attach("box", str(outside / "box"))
        assert os.stat(d / "id").st_mode & 0o4000
        r = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                            str(d / "id"), "-u"], capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.strip() == "65534", (r.stdout, r.stderr)
        r = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                            "sh", "-c", f"echo x > {d / 'null'}"], capture_output=True, text=True)
        assert r.returncode != 0, r.stderr
        opts = [ln.split()[5] for ln in open("/proc/self/mountinfo") if ln.split()[4] == str(d)]
        assert opts and "nosuid" in opts[0] and "nodev" in opts[0], opts
        wsenv.detach(d)
    finally:
        shutil.rmtree(outside, ignore_errors=True)
