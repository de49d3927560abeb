"""Launching the step's command: no sandbox, bubblewrap, or gVisor (runsc).

Every sandbox sees the volumes at /storage/NAME (`STRATA_STORAGE` says where)
and a private /tmp; bwrap and gVisor see the host root read-only and no
network unless asked. Memory is capped with a memory cgroup (v1 or v2) when
one can be created, else with RLIMIT_AS; time with a deadline after which the
whole process group is killed. The command dies with its runner
(PR_SET_PDEATHSIG), set by `setpriv --pdeathsig` where it exists so that no
Python runs between fork and exec (else by a preexec function).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from strata.engine.errors import InvalidInput

SANDBOXES = ("none", "bwrap", "gvisor")
# What root keeps in a workspace-root bwrap sandbox: owning, reading and writing any
# file there, and becoming any user (package managers drop to their own users).
ROOT_CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER",
             "CAP_FSETID", "CAP_SETUID", "CAP_SETGID", "CAP_KILL")


@dataclass
class Outcome:
    status: int          # exit status (128 + signal when killed), as a shell reports it
    timed_out: bool = False
    oom: bool = False


class MemoryCgroup:
    """A child memory cgroup of ours with a hard limit, or nothing if we cannot."""

    def __init__(self, limit: int, name: str) -> None:
        self.path: str | None = None
        self.procs_file = ""
        self.version = 0
        mine = _own_cgroup()
        v1 = mine.get("memory")
        if v1 is not None and os.path.isdir("/sys/fs/cgroup/memory"):
            path = os.path.join("/sys/fs/cgroup/memory" + v1, name)
            with contextlib.suppress(OSError):
                os.mkdir(path)
                with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
                    f.write(str(limit))
                with contextlib.suppress(OSError), open(
                        os.path.join(path, "memory.memsw.limit_in_bytes"), "w") as f:
                    f.write(str(limit))
                self.path, self.version = path, 1
        if self.path is None and "" in mine:
            base = "/sys/fs/cgroup/unified" if os.path.isdir("/sys/fs/cgroup/unified") else (
                "/sys/fs/cgroup")
            path = os.path.join(base + mine[""], name)
            with contextlib.suppress(OSError):
                os.mkdir(path)
                with open(os.path.join(path, "memory.max"), "w") as f:
                    f.write(str(limit))
                self.path, self.version = path, 2
        if self.path is not None:
            self.procs_file = os.path.join(self.path, "cgroup.procs")

    def oom_killed(self) -> bool:
        if self.path is None:
            return False
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        with contextlib.suppress(OSError), open(os.path.join(self.path, name)) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill" and int(value) > 0:
                    return True
        return False

    def remove(self) -> None:
        if self.path is None:
            return
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.02)


def _own_cgroup() -> dict[str, str]:
    out: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            _n, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(","):
                out[c] = path
    return out


def build_command(sandbox: str, argv: list[str], storage: str, *, network: bool,
                  workdir: str, run_id: str, memory: int | None, root: str | None = None
                  ) -> tuple[list[str], dict[str, str]]:
    """The command line that runs `argv` in `sandbox`, and its environment.

    With `root` (an attached workspace), that directory is the sandbox's whole
    root filesystem, writable, in place of the host's read-only one.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    if root is not None:
        return _root_command(sandbox, argv, root, storage, env, network=network,
                             workdir=workdir, run_id=run_id, memory=memory)
    if sandbox == "none":
        env["STRATA_STORAGE"] = storage
        return argv, env
    env["STRATA_STORAGE"] = "/storage"
    if sandbox == "bwrap":
        _need("bwrap", "bubblewrap (bwrap)")
        # The host root read-only, entry by entry (a bind of / itself would leave no
        # place to create /storage), then private /dev, /proc and /tmp.
        cmd = ["bwrap"]
        for name in sorted(os.listdir("/")):
            if name in ("proc", "dev", "tmp", "storage"):
                continue
            path = "/" + name
            if os.path.islink(path):
                cmd += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                cmd += ["--ro-bind", path, path]
        cmd += ["--dev", "/dev", "--proc", "/proc",
               "--tmpfs", "/tmp", "--bind", storage, "/storage", "--unshare-all",
               "--die-with-parent", "--new-session", "--chdir", "/storage",
               "--setenv", "STRATA_STORAGE", "/storage"]
        if network:
            cmd.append("--share-net")
        return [*cmd, "--", *argv], env
    if sandbox == "gvisor":
        _need("runsc", "gVisor (runsc)")
        config = _oci_config(argv, env, storage, network=network, memory=memory)
        return _runsc(config, workdir, run_id, network=network), env
    raise InvalidInput(f"unknown sandbox {sandbox!r} (use {', '.join(SANDBOXES)})")


def _need(tool: str, name: str) -> None:
    if shutil.which(tool) is None:
        raise InvalidInput(f"{name} is not installed")


def _root_command(sandbox: str, argv: list[str], root: str, storage: str,
                  env: dict[str, str], *, network: bool, workdir: str, run_id: str,
                  memory: int | None) -> tuple[list[str], dict[str, str]]:
    """`argv` with `root` as the whole root, and the step's volumes (if any) at /storage.

    The caller has made `ROOT/storage` (the mount point) when there are volumes.
    """
    env = {k: v for k, v in env.items() if k in ("PATH", "LANG", "TERM", "HOME")}
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    if storage:
        env["STRATA_STORAGE"] = "/storage"
    if sandbox == "bwrap":
        _need("bwrap", "bubblewrap (bwrap)")
        cmd = ["bwrap", "--bind", root, "/", "--dev", "/dev", "--proc", "/proc",
               "--perms", "1777", "--tmpfs", "/tmp", "--die-with-parent", "--new-session"]
        if storage:
            cmd += ["--bind", storage, "/storage"]
        cmd += ["--chdir", "/storage" if storage else "/"]
        if os.getuid() == 0:
            # A whole system's files belong to many users (apt's `_apt`, daemons'), and
            # a user namespace maps only one: root inside could not touch the rest. So
            # no user namespace, and root keeps just the file-ownership capabilities;
            # the sandbox sees only the workspace, its own /dev, /proc and /tmp.
            cmd += ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try",
                    "--cap-drop", "ALL"]
            for cap in ROOT_CAPS:
                cmd += ["--cap-add", cap]
            if not network:
                cmd.append("--unshare-net")
        else:
            cmd.append("--unshare-all")
            if network:
                cmd.append("--share-net")
        return [*cmd, "--", *argv], env
    if sandbox == "gvisor":
        _need("runsc", "gVisor (runsc)")
        config = _oci_config(argv, env, storage, network=network, memory=memory, root=root)
        return _runsc(config, workdir, run_id, network=network), env
    raise InvalidInput(f"a workspace root needs a sandbox (bwrap or gvisor), not {sandbox!r}")


def _runsc(config: dict[str, object], workdir: str, run_id: str, *, network: bool
           ) -> list[str]:
    """Write the OCI bundle under `workdir`; the runsc command that runs it."""
    bundle = os.path.join(workdir, "bundle")
    os.makedirs(bundle, exist_ok=True)
    with open(os.path.join(bundle, "config.json"), "w") as f:
        json.dump(config, f)
    return ["runsc", "--root", os.path.join(workdir, "runsc-root"),
            "--network=host" if network else "--network=none", "--platform=ptrace",
            "--ignore-cgroups", "run", "--bundle", bundle, f"strata-{run_id}"]


def _oci_config(argv: list[str], env: dict[str, str], storage: str, *, network: bool,
                memory: int | None, root: str | None = None) -> dict[str, object]:
    namespaces = [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
    if not network:
        namespaces.append({"type": "network"})
    linux: dict[str, object] = {"namespaces": namespaces}
    if memory:
        linux["resources"] = {"memory": {"limit": memory}}
    mounts: list[dict[str, object]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "nodev", "mode=1777"]},
    ]
    if storage:  # the step's volumes (a workspace root alone has none)
        mounts.append({"destination": "/storage", "type": "bind", "source": storage,
                       "options": ["rbind", "rw"]})
    return {
        "ociVersion": "1.0.0",
        "process": {"terminal": False, "user": {"uid": os.getuid(), "gid": os.getgid()},
                    "args": argv, "cwd": "/storage" if storage else "/",
                    "env": [f"{k}={v}" for k, v in env.items()]},
        "root": {"path": root or "/", "readonly": root is None},
        "hostname": "strata-step",
        "mounts": mounts,
        "linux": linux,
    }


def run_command(cmd: list[str], env: dict[str, str], *, cwd: str, timeout: float | None,
                memory: int | None, cgroup_name: str,
                on_start: Callable[[int], None] | None = None) -> Outcome:
    """Run to completion in its own process group; kill it all at the end or the deadline.

    `on_start` gets the process group id as soon as the command is started.
    """
    cg = MemoryCgroup(memory, cgroup_name) if memory else None
    wrapper = None if memory else pdeathsig_wrapper()
    prctl = _prctl() if wrapper is None else None

    def preexec() -> None:
        os.setpgrp()
        if prctl is not None:
            prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with the runner
        if cg is not None and cg.path is not None:
            with open(cg.procs_file, "w") as f:
                f.write(str(os.getpid()))
        elif memory:
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    if wrapper is not None:
        # No Python between fork and exec: the interpreter can vfork, which from a
        # process the size of the step service's workers costs 1 ms, not 15.
        _check_executable(cmd[0], env, cwd)
        proc = subprocess.Popen([*wrapper, "--", *cmd], env=env, cwd=cwd, process_group=0)
    else:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, preexec_fn=preexec)
    timed_out = False
    try:
        if on_start is not None:
            on_start(proc.pid)
        proc.wait(timeout=timeout)
        # What the command left running in its group dies with it, as in a sandbox's
        # pid namespace: nothing may write to the volumes once they are scanned.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    finally:
        oom = cg.oom_killed() if cg is not None else False
        if cg is not None:
            cg.remove()
    rc = proc.returncode
    status = 128 - rc if rc < 0 else rc
    return Outcome(status, timed_out, oom)


_WRAPPER: list[list[str] | None] = []


def pdeathsig_wrapper() -> list[str] | None:
    """`setpriv --pdeathsig KILL`, if this machine's setpriv has it (asked once).

    It sets what the preexec function would (the command dies with its
    runner) and execs the command, so Popen needs no Python in the child.
    """
    if not _WRAPPER:
        path = shutil.which("setpriv")
        found = None
        if path is not None:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                out = subprocess.run([path, "--help"], capture_output=True, text=True,
                                     timeout=10).stdout
                if "--pdeathsig" in out:
                    found = [path, "--pdeathsig", "KILL"]
        _WRAPPER.append(found)
    return _WRAPPER[0]


def _check_executable(name: str, env: dict[str, str], cwd: str) -> None:
    """Fail as Popen would for a command that cannot run (the wrapper would exit 127)."""
    if "/" in name:
        found = os.path.join(cwd, name) if os.access(os.path.join(cwd, name), os.X_OK) else None
    else:
        found = shutil.which(name, path=env.get("PATH", os.defpath))
    if found is None or os.path.isdir(found):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name)


def _prctl() -> Callable[..., int] | None:
    """The C library's prctl, loaded before forking (no imports between fork and exec)."""
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
