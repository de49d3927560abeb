"""Hosts for fleet tests: a namespace per member, the bucket's namespace as the router.

Like tests/netnsutil.py (a veth pair from each host, and from the test
process, to the bucket's namespace), plus routing: the bucket's namespace
forwards, so members reach each other and the test's clients reach every
member, all through it. That makes each kind of cut one rule there:

- `cut(host)`: the host's link goes down (cut from everyone);
- `cut_bucket(host)`: the host cannot reach moto, but clients and members
  still reach it (iptables INPUT in the bucket's namespace);
- `cut_clients(host)`: clients and other members cannot reach it, the
  bucket still can (iptables FORWARD).

Addresses are 10.<N>.<10+i>.0/24 with N from the pid, moved on past any
10.N route already here, so two runs at once (and the split-brain test's
10.213) do not collide. Names are claimed, and a killed run's leftovers
swept, by netnsutil.claim_tag.

`BucketProxy` runs tests/fleet/bucketproxy.py in the bucket's namespace, in
front of moto: the members' way to the bucket, which the test can make
answer 500, answer slowly, or lose the answers to conditional PUTs.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from netnsutil import claim_tag


def _run(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True)


def _free_octet(first: int) -> int:
    """The first N from `first` (wrapping in 100..199) with no 10.N route here."""
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
    used = {int(m) for m in re.findall(r"^10\.(\d+)\.", routes, re.MULTILINE)}
    for step in range(100):
        octet = 100 + (first - 100 + step) % 100
        if octet not in used:
            return octet
    raise RuntimeError("no free 10.N/16 for the fleet's hosts")


class FleetHosts:
    def __init__(self, names: list[str]) -> None:
        tag = claim_tag("sf")
        self.octet = _free_octet(100 + os.getpid() % 100)
        self.bucket_ns = f"sf{tag}bk"
        self.ns = {name: f"sf{tag}{name}" for name in names}
        self.address: dict[str, str] = {}          # each host's own address
        self.bucket_address: dict[str, str] = {}   # how each host reaches the bucket
        self._links: dict[str, tuple[str, str]] = {}
        self._made: list[str] = []
        self._tag = tag
        self._route = False

    def __enter__(self) -> FleetHosts:
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
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "netns", "exec", self.bucket_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for i, host in enumerate([*self.ns, "test"]):
            mine, theirs = f"sf{self._tag}{host[:3]}0", f"sf{self._tag}{host[:3]}1"
            _run("ip", "link", "add", mine, "type", "veth", "peer", "name", theirs)
            if host != "test":
                _run("ip", "link", "set", mine, "netns", self.ns[host])
            _run("ip", "link", "set", theirs, "netns", self.bucket_ns)
            net = f"10.{self.octet}.{i + 10}"
            where = ["-n", self.ns[host]] if host != "test" else []
            _run("ip", *where, "addr", "add", f"{net}.2/24", "dev", mine)
            _run("ip", *where, "link", "set", mine, "up")
            _run("ip", "-n", self.bucket_ns, "addr", "add", f"{net}.1/24", "dev", theirs)
            _run("ip", "-n", self.bucket_ns, "link", "set", theirs, "up")
            if host != "test":
                _run("ip", *where, "route", "add", "default", "via", f"{net}.1")
            else:
                _run("ip", "route", "add", f"10.{self.octet}.0.0/16", "via", f"{net}.1")
                self._route = True
            self._links[host] = (mine, theirs)
            self.bucket_address[host] = f"{net}.1"
            self.address[host] = f"{net}.2"

    def exec_prefix(self, host: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.ns[host])

    def exec_prefix_bucket(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.bucket_ns)

    def _ipt(self, *args: str) -> None:
        _run("ip", "netns", "exec", self.bucket_ns, "iptables", *args)

    def cut(self, host: str) -> None:
        _run("ip", "-n", self.bucket_ns, "link", "set", self._links[host][1], "down")

    def heal(self, host: str) -> None:
        _run("ip", "-n", self.bucket_ns, "link", "set", self._links[host][1], "up")

    def cut_bucket(self, host: str) -> None:
        self._ipt("-I", "INPUT", "-s", self.address[host], "-j", "DROP")

    def heal_bucket(self, host: str) -> None:
        self._ipt("-D", "INPUT", "-s", self.address[host], "-j", "DROP")

    def cut_clients(self, host: str) -> None:
        self._ipt("-I", "FORWARD", "-d", self.address[host], "-j", "DROP")
        self._ipt("-I", "FORWARD", "-s", self.address[host], "-j", "DROP")

    def heal_clients(self, host: str) -> None:
        self._ipt("-D", "FORWARD", "-d", self.address[host], "-j", "DROP")
        self._ipt("-D", "FORWARD", "-s", self.address[host], "-j", "DROP")

    def close(self) -> None:
        if self._route:
            subprocess.run(["ip", "route", "del", f"10.{self.octet}.0.0/16"],
                           capture_output=True)
        if "test" in self._links:
            subprocess.run(["ip", "link", "del", self._links["test"][0]], capture_output=True)
        for ns in self._made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()


class BucketProxy:
    """The faulty bucket (tests/fleet/bucketproxy.py) in the bucket's namespace."""

    def __init__(self, hosts: FleetHosts, upstream_port: int, log: Path) -> None:
        self.hosts = hosts
        self.port = upstream_port + 1 if upstream_port < 65000 else upstream_port - 1
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def endpoint(self, host: str) -> str:
        """The address `host` reaches the bucket at, through the proxy."""
        return f"http://{self.hosts.bucket_address[host]}:{self.port}"

    def start(self, upstream_port: int) -> BucketProxy:
        script = Path(__file__).with_name("bucketproxy.py")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [*self.hosts.exec_prefix_bucket(), sys.executable, str(script), "0.0.0.0",
                 str(self.port), "127.0.0.1", str(upstream_port)], stdout=out, stderr=out)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection((self.hosts.bucket_address["test"], self.port),
                                         timeout=0.2).close()
                return self
            except OSError:
                assert time.monotonic() < deadline and self.proc.poll() is None, \
                    self.log.read_text()
                time.sleep(0.05)

    def set(self, **faults: Any) -> dict[str, int]:
        """Set faults (bucketproxy.py names them); answers what was done so far."""
        req = urllib.request.Request(self.endpoint("test") + "/__fault__",
                                     data=json.dumps(faults).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - the test's
            done: dict[str, int] = json.loads(resp.read())
            return done

    def clear(self) -> dict[str, int]:
        return self.set(fail_status=None, fail_every=1, delay=0.0, lose_answers=0)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(15)
            self.proc = None
