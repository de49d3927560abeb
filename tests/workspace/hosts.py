"""Hosts for workspace tests: a network namespace and a mount namespace each.

A host reaches the server in the root namespace over its own veth pair
(10.214.N.2 -> 10.214.N.1). Its processes share one mount namespace, held
by a sleeper process, so its mounts are its own. `lose()` is host loss:
SIGKILL every process of the host and drop its network; its mount namespace
then dies with its mounts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

from netnsutil import claim_tag


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Host:
    def __init__(self, index: int, env: dict[str, str]) -> None:
        tag = claim_tag("sw")
        self.ns = f"sw{tag}h{index}"
        self.link = f"sw{tag}h{index}"
        self.server_address = f"10.214.{index}.1"
        self.env = env
        _ip("netns", "add", self.ns)
        try:
            _ip("link", "add", self.link, "type", "veth", "peer", "name", "eth0",
                "netns", self.ns)
            _ip("addr", "add", f"{self.server_address}/24", "dev", self.link)
            _ip("link", "set", self.link, "up")
            _ip("-n", self.ns, "addr", "add", f"10.214.{index}.2/24", "dev", "eth0")
            _ip("-n", self.ns, "link", "set", "eth0", "up")
            _ip("-n", self.ns, "link", "set", "lo", "up")
            self.sleeper = subprocess.Popen(
                ["ip", "netns", "exec", self.ns, "unshare", "--mount", "--propagation",
                 "private", "sleep", "infinity"], start_new_session=True)
            self.pid = self._wait_for_sleeper()
            self.mnt_ns = os.readlink(f"/proc/{self.pid}/ns/mnt")
        except BaseException:
            self.close()
            raise

    def _wait_for_sleeper(self) -> int:
        own = os.readlink("/proc/self/ns/mnt")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for pid in _children(self.sleeper.pid):
                if os.readlink(f"/proc/{pid}/ns/mnt") != own and _comm(pid) == "sleep":
                    return pid
            if _comm(self.sleeper.pid) == "sleep" and \
                    os.readlink(f"/proc/{self.sleeper.pid}/ns/mnt") != own:
                return self.sleeper.pid
            time.sleep(0.01)
        raise RuntimeError("the host's sleeper did not start")

    def cmd(self, *args: str) -> list[str]:
        return ["nsenter", "-t", str(self.pid), "-m", "-n", "--", *args]

    def run(self, *args: str, check: bool = True, timeout: float = 120
            ) -> subprocess.CompletedProcess[str]:
        p = subprocess.run(self.cmd(*args), env=self.env, capture_output=True, text=True,
                           timeout=timeout)
        if check:
            assert p.returncode == 0, (args, p.returncode, p.stdout, p.stderr)
        return p

    def popen(self, *args: str, **kw: object) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.cmd(*args), env=self.env, **kw)  # type: ignore[call-overload,no-any-return]

    def processes(self) -> list[int]:
        """Every process in this host's mount namespace."""
        mine = getattr(self, "mnt_ns", None)
        out: list[int] = []
        if mine is None:
            return out
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if os.readlink(f"/proc/{name}/ns/mnt") == mine:
                        out.append(int(name))
                except OSError:
                    continue
        return out

    def freeze(self, sig: int = signal.SIGSTOP) -> None:
        for pid in self.processes():
            if pid != self.pid:
                with contextlib.suppress(ProcessLookupError):  # a short one (`date`) ended
                    os.kill(pid, sig)

    def lose(self) -> None:
        """Host loss: every process SIGKILLed at once, and the network gone.

        Then its FUSE connections are aborted: a daemon killed with requests in
        flight leaves them waiting, and the loop device and ext4 above alive,
        on this machine that outlives the "host".
        """
        from strata.workspace.ext4 import abort_fuse, fuse_connections
        try:
            with open(f"/proc/{self.pid}/mountinfo") as f:
                conns = fuse_connections(f.read())
        except OSError:
            conns = []
        subprocess.run(["ip", "link", "set", self.link, "down"], capture_output=True)
        for _ in range(3):
            for pid in self.processes():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        self.sleeper.wait(10)
        abort_fuse(conns)
        self.close()

    def close(self) -> None:
        if getattr(self, "sleeper", None) is not None and self.sleeper.poll() is None:
            # As in `lose`: a daemon that is the last process of this namespace would
            # otherwise wait forever on itself to flush the filesystem it unmounts.
            from strata.workspace.ext4 import abort_fuse, fuse_connections
            try:
                with open(f"/proc/{getattr(self, 'pid', 0)}/mountinfo") as f:
                    conns = fuse_connections(f.read())
            except OSError:  # the sleeper never started: nothing was mounted
                conns = []
            for pid in self.processes():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.sleeper.wait(10)
            abort_fuse(conns)
        subprocess.run(["ip", "link", "del", self.link], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""
