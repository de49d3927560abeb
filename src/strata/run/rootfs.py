"""The root filesystem of a step that brings none: the host's programs, nothing of its data.

The default root is a skeleton directory that strata makes and shares
read-only between steps: the host's /usr (and, on a host without merged
/usr, /bin, /sbin and /lib*) bound read-only, an /etc made up here (passwd
and group with root and nobody, hosts, hostname, resolv.conf only with
--network, nsswitch.conf) plus copies of a short list of the host's /etc
entries that programs need to run and that hold no secrets (the dynamic
linker's cache, alternatives, certificates, time zone...; copied, not bound:
thirty binds cost gVisor about 70 ms a start), and empty mount points for
/tmp, /root, /var/tmp and /run, each a private tmpfs. Nothing else of the
host is there: no store, scratch, home, /var, /run, /mnt or /sys.

This module only builds directories and mount lists; run/sandbox.py turns
them into bwrap arguments or an OCI config.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import uuid

from strata.run.identity import RUN_DIR, ensure_dir

log = logging.getLogger(__name__)

HOSTNAME = "strata-step"

# Host /etc entries a program may need and that hold nothing private. (Not passwd,
# group, shadow, hosts, ssh, machine-id, hostname...: those are made up or absent.)
HOST_ETC = (
    "alternatives", "bash.bashrc", "ca-certificates", "ca-certificates.conf", "debian_version",
    "environment", "ethertypes", "gai.conf", "gitconfig", "host.conf", "inputrc",
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "login.defs", "magic",
    "magic.mime", "mailcap", "mime.types", "networks", "os-release", "profile", "profile.d",
    "protocols", "python3", "python3.11", "rpc", "services", "shells", "ssl", "terminfo",
    "timezone", "xattr.conf",
)
# The top-level directories of an operating system's programs (merged /usr: symlinks).
OS_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Empty mount points in the skeleton: tmpfs for each of these, and /storage.
TMPFS = {"/tmp": 0o1777, "/var/tmp": 0o1777, "/root": 0o700, "/run": 0o755}


def _generated(network: bool) -> dict[str, bytes]:
    resolv = b""
    if network:
        with contextlib.suppress(OSError):
            with open("/etc/resolv.conf", "rb") as f:
                resolv = f.read(64 * 1024)
    return {
        "passwd": b"root:x:0:0:root:/root:/bin/sh\n"
                  b"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": b"root:x:0:\nnogroup:x:65534:\n",
        "hosts": f"127.0.0.1\tlocalhost {HOSTNAME}\n::1\tlocalhost ip6-localhost "
                 f"ip6-loopback\n".encode(),
        "hostname": f"{HOSTNAME}\n".encode(),
        "resolv.conf": resolv,
        "nsswitch.conf": b"passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n"
                         b"networks: files\nprotocols: files\nservices: files\n",
    }


class Root:
    """The default root: a skeleton directory and what is mounted on it."""

    def __init__(self, skeleton: str, binds: list[tuple[str, str]]) -> None:
        self.skeleton = skeleton  # a read-only view of this is the sandbox's /
        self.binds = binds        # (host path, path inside), each read-only


_MADE: dict[bool, Root] = {}


def default_root(network: bool) -> Root:
    """The shared skeleton for steps with or without a network, made once per process.

    Its name is a hash of what it holds, so processes that agree share one
    and a change on the host (a new resolv.conf) makes a new one.
    """
    made = _MADE.get(network)
    if made is not None and os.path.isdir(made.skeleton):
        return made
    files = _generated(network)
    os_entries: list[tuple[str, str | None]] = []  # (name, symlink target or None)
    for name in OS_DIRS:
        path = "/" + name
        if os.path.islink(path):
            os_entries.append((name, os.readlink(path)))
        elif os.path.isdir(path):
            os_entries.append((name, None))
    etc_entries: list[tuple[str, str | None, bool]] = []  # (name, link target, is dir)
    stamps = []  # what the copies were made from: a change on the host makes a new skeleton
    for name in HOST_ETC:
        path = "/etc/" + name
        if os.path.islink(path):
            etc_entries.append((name, os.readlink(path), False))
        elif os.path.exists(path):
            etc_entries.append((name, None, os.path.isdir(path)))
            for top, dirs, names in os.walk(path):
                for n in (top, *(os.path.join(top, d) for d in dirs + names)):
                    with contextlib.suppress(OSError):
                        st = os.lstat(n)
                        stamps.append((n, st.st_mtime_ns, st.st_size))
    digest = hashlib.blake2b(repr((sorted(files.items()), os_entries, etc_entries, stamps))
                             .encode(), digest_size=12).hexdigest()
    ensure_dir(RUN_DIR, 0o755)
    base = os.path.join(RUN_DIR, "rootfs")
    ensure_dir(base, 0o755)
    skeleton = os.path.join(base, digest)
    if not os.path.isdir(skeleton):
        _make_skeleton(base, skeleton, files, os_entries, etc_entries)
    binds = [("/" + name, "/" + name) for name, target in os_entries if target is None]
    root = Root(skeleton, binds)
    _MADE[network] = root
    return root


def _private(directory: str, names: list[str]) -> set[str]:
    out = set()
    for name in names:
        with contextlib.suppress(OSError):
            st = os.lstat(os.path.join(directory, name))
            if name == "private" or (not os.path.islink(os.path.join(directory, name))
                                     and not st.st_mode & 0o004):
                out.add(name)
    return out


def _make_skeleton(base: str, skeleton: str, files: dict[str, bytes],
                   os_entries: list[tuple[str, str | None]],
                   etc_entries: list[tuple[str, str | None, bool]]) -> None:
    tmp = os.path.join(base, f".tmp-{uuid.uuid4().hex}")
    try:
        os.mkdir(tmp, 0o755)
        for name, target in os_entries:
            if target is None:
                os.mkdir(os.path.join(tmp, name), 0o755)
            else:
                os.symlink(target, os.path.join(tmp, name))
        etc = os.path.join(tmp, "etc")
        os.mkdir(etc, 0o755)
        for name, data in files.items():
            with open(os.open(os.path.join(etc, name), os.O_WRONLY | os.O_CREAT, 0o644),
                      "wb") as f:
                f.write(data)
        for name, target, is_dir in etc_entries:
            path = os.path.join(etc, name)
            if target is not None:
                os.symlink(target, path)
            elif is_dir:
                # Only what anyone may read: no /etc/ssl/private, no 0600 file.
                shutil.copytree("/etc/" + name, path, symlinks=True, ignore=_private)
            elif os.stat("/etc/" + name).st_mode & 0o004:
                shutil.copy2("/etc/" + name, path)
        for path, mode in (*TMPFS.items(), ("/storage", 0o755), ("/proc", 0o555),
                           ("/dev", 0o755), ("/home", 0o755)):
            os.makedirs(tmp + path, exist_ok=True)
            os.chmod(tmp + path, mode)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, skeleton)
        except OSError:
            if not os.path.isdir(skeleton):  # else another process made the same one first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
