"""Hosts of the tests' own: network namespaces joined to a "bucket" host by veth pairs.

`Hosts(["a", "b"])` makes one namespace per host plus a namespace for the
bucket (where moto runs), and a veth pair from each host, and from the test
process itself, to the bucket's namespace. Each link is its own /24, so
cutting one host's link (`cut`) leaves the others talking. Files are shared
(namespaces split the network only), so servers on every host are still
reached over their unix sockets.

A test run that is killed leaves its namespaces, links and routes behind,
and a later run whose tag or addresses match would fail to set up.
`claim_tag(prefix)` therefore records which process owns a tag
(/run/strata-tests/netns/PREFIXTAG holds its pid) and first removes what
dead owners, or runs from before the record existed, left behind.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REGISTRY = Path("/run/strata-tests/netns")
# Every namespace and root-namespace link the test helpers make is named
# PREFIX + a four-digit tag + the rest: st (netnsutil), sf (fleet), sw (workspace).
_NAMED = re.compile(r"^(st|sf|sw)(\d{4})")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner_alive(prefix_tag: str) -> bool:
    try:
        return _alive(int((REGISTRY / prefix_tag).read_text()))
    except (OSError, ValueError):
        return False


def sweep_leftovers() -> None:
    """Delete namespaces and links whose owning test process is gone.

    Routes through a deleted link go with it.
    """
    names = subprocess.run(["ip", "netns", "list"], capture_output=True,
                           text=True).stdout.split()
    links = [line.split(":")[1].strip().split("@")[0] for line in subprocess.run(
        ["ip", "-o", "link"], capture_output=True, text=True).stdout.splitlines()
        if line.count(":") >= 2]
    for name in [*names, *links]:
        m = _NAMED.match(name)
        if m is None or _owner_alive(m.group(0)):
            continue
        if name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        else:
            subprocess.run(["ip", "link", "del", name], capture_output=True)
    if REGISTRY.is_dir():
        for record in REGISTRY.iterdir():
            if not _owner_alive(record.name):
                record.unlink(missing_ok=True)


def claim_tag(prefix: str) -> str:
    """This process's tag for names starting with `prefix`, after a sweep."""
    tag = f"{os.getpid() % 10000:04d}"
    sweep_leftovers()
    REGISTRY.mkdir(parents=True, exist_ok=True)
    (REGISTRY / f"{prefix}{tag}").write_text(str(os.getpid()))
    return tag


class Hosts:
    def __init__(self, names: list[str]) -> None:
        tag = claim_tag("st")
        self.bucket_ns = f"st{tag}bk"
        self.ns = {name: f"st{tag}{name}" for name in names}
        self._links: dict[str, tuple[str, str]] = {}  # host -> (its end, the bucket's end)
        self.bucket_address: dict[str, str] = {}      # how each host reaches the bucket
        self._made: list[str] = []
        self._tag = tag

    def __enter__(self) -> Hosts:
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _setup(self) -> None:
        for ns in [self.bucket_ns, *self.ns.values()]:
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        for i, host in enumerate([*self.ns, "test"]):
            mine, theirs = f"st{self._tag}{host[:3]}0", f"st{self._tag}{host[:3]}1"
            _ip("link", "add", mine, "type", "veth", "peer", "name", theirs)
            if host != "test":
                _ip("link", "set", mine, "netns", self.ns[host])
            _ip("link", "set", theirs, "netns", self.bucket_ns)
            net = f"10.213.{i + 10}"
            where = ["-n", self.ns[host]] if host != "test" else []
            _ip(*where, "addr", "add", f"{net}.2/24", "dev", mine)
            _ip(*where, "link", "set", mine, "up")
            _ip("-n", self.bucket_ns, "addr", "add", f"{net}.1/24", "dev", theirs)
            _ip("-n", self.bucket_ns, "link", "set", theirs, "up")
            self._links[host] = (mine, theirs)
            self.bucket_address[host] = f"{net}.1"

    def exec_prefix(self, host: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.ns[host])

    def cut(self, host: str) -> None:
        """Take `host` off the network (its link goes down on the bucket's side)."""
        _ip("-n", self.bucket_ns, "link", "set", self._links[host][1], "down")

    def heal(self, host: str) -> None:
        _ip("-n", self.bucket_ns, "link", "set", self._links[host][1], "up")

    def close(self) -> None:
        if "test" in self._links:  # the test's end lives in this namespace
            subprocess.run(["ip", "link", "del", self._links["test"][0]], capture_output=True)
        for ns in self._made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
