"""Launching the step's command: no sandbox, bubblewrap, or gVisor (runsc).

The boundary itself is written down in docs/sandbox.md; this module builds
it. A bwrap or gVisor step sees its volumes at /storage/NAME, a root that is
never the host's (run/rootfs.py's default, a workspace, or an image), a
private /tmp, /dev and /proc, and no network unless asked. Under bwrap it
runs as root of a user namespace whose ids are an unprivileged host range of
its own (run/identity.py), with a short list of capabilities inside it, a
seccomp filter (run/seccomp.py), no_new_privs, and nosuid,nodev on every
mount. `none` runs the command as the caller, on the host: trusted code only.

Memory and process count are capped with cgroups (v1 or v2) when they can be
made, else with RLIMIT_AS and RLIMIT_NPROC; the command joins them through a
one-line shell before anything of it runs. Time is capped with a deadline
after which the whole process group is killed. The command dies with its
runner (bwrap's --die-with-parent, else PR_SET_PDEATHSIG, set by `setpriv
--pdeathsig` where it exists so that no Python runs between fork and exec).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import resource
import shlex
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from strata.engine.errors import InvalidInput
from strata.run import rootfs, seccomp
from strata.run.imagecfg import ImageProcess

log = logging.getLogger(__name__)

SANDBOXES = ("none", "bwrap", "gvisor")
# What root keeps inside a sandbox: Docker's default set less CAP_MKNOD, CAP_NET_RAW
# and CAP_SETFCAP. Owning, reading and writing its own files, becoming any user of its
# namespace (package managers drop to their own), binding low ports. Under bwrap these
# are capabilities of the step's user namespace only: nothing of the host's.
ROOT_CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
             "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
             "CAP_SYS_CHROOT", "CAP_AUDIT_WRITE")
DEFAULT_PIDS = 4096  # processes and threads of one step


@dataclass
class Outcome:
    status: int          # exit status (128 + signal when killed), as a shell reports it
    timed_out: bool = False
    oom: bool = False


@dataclass
class Launch:
    """How to start a step's command: its argv, environment and inherited descriptors."""

    cmd: list[str]
    env: dict[str, str]
    pass_fds: tuple[int, ...] = ()
    dies_with_parent: bool = False  # bwrap sees to it; else the runner's wrapper does
    # Host tasks per task of the step: gVisor's Sentry runs its own threads and, on
    # the ptrace platform, a stub process per address space of the step.
    pids_scale: int = 1
    pids_slack: int = 0
    # gVisor writes a host file it is handed at offsets of its own, from 0: a caller's
    # `> log` would be overwritten from the top. Such stdout/stderr go through a pipe.
    pipe_files: bool = False


@dataclass
class Jail:
    """What a sandbox is built from, made by the runner before the command starts.

    `stage` is the step's staging directory (volumes at stage/storage, a root
    view at stage/root); `userns` the path of the step's user namespace
    (bwrap only), `id_base` the host id its root maps to.
    """

    stage: str
    userns: str | None = None
    id_base: int = 0
    root: str | None = None      # a root filesystem in place of rootfs.default_root()
    fds: list[int] = field(default_factory=list)  # closed once the command started


class StepCgroup:
    """Child cgroups of ours that limit one step's memory and process count."""

    def __init__(self, name: str, *, memory: int | None, pids: int | None) -> None:
        self.procs: list[str] = []   # cgroup.procs files the command joins
        self.paths: list[str] = []
        self.memory_ok = self.pids_ok = False
        self._events: tuple[str, int] | None = None
        mine = _own_cgroup()
        for controller, limit in (("memory", memory), ("pids", pids)):
            if limit is None:
                continue
            path = self._make(mine, controller, name, limit)
            if path is None:
                continue
            if controller == "memory":
                self.memory_ok = True
                v1 = not path.startswith(_v2_base())
                self._events = (os.path.join(path, "memory.oom_control" if v1
                                             else "memory.events"), 1 if v1 else 2)
            else:
                self.pids_ok = True
            if os.path.join(path, "cgroup.procs") not in self.procs:
                self.procs.append(os.path.join(path, "cgroup.procs"))

    def _make(self, mine: dict[str, str], controller: str, name: str, limit: int) -> str | None:
        v1 = mine.get(controller)
        if v1 is not None and os.path.isdir(f"/sys/fs/cgroup/{controller}"):
            path = os.path.join(f"/sys/fs/cgroup/{controller}" + v1, name)
            files = ({"memory.limit_in_bytes": limit} if controller == "memory"
                     else {"pids.max": limit})
            if self._mkdir(path, files, optional=("memory.memsw.limit_in_bytes",), limit=limit):
                return path
        if "" in mine:
            path = os.path.join(_v2_base() + mine[""], name)
            files = {"memory.max": limit} if controller == "memory" else {"pids.max": limit}
            if self._mkdir(path, files, limit=limit):
                return path
        return None

    def _mkdir(self, path: str, files: dict[str, int], optional: tuple[str, ...] = (),
               limit: int = 0) -> bool:
        _sweep(os.path.dirname(path))
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(path)
            if path not in self.paths:
                self.paths.append(path)
            for fname, value in files.items():
                with open(os.path.join(path, fname), "w") as f:
                    f.write(str(value))
        except OSError:
            return False
        for fname in optional:
            with contextlib.suppress(OSError), open(os.path.join(path, fname), "w") as f:
                f.write(str(limit))
        return True

    def gate(self) -> list[str]:
        """A command prefix that joins the cgroups, then execs the rest (nothing runs first)."""
        if not self.procs:
            return []
        files = " ".join(shlex.quote(p) for p in self.procs)
        return ["/bin/sh", "-c", f'for f in {files}; do echo $$ > "$f" || exit 125; done; '
                'exec "$@"', "strata-gate"]

    def oom_killed(self) -> bool:
        if self._events is None:
            return False
        with contextlib.suppress(OSError), open(self._events[0]) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill" and int(value) > 0:
                    return True
        return False

    def remove(self) -> None:
        """Remove the cgroups now, or from a thread once their last task has left.

        A sandbox's processes take a moment to go after its init died (gVisor's
        Sentry and gofer tens of milliseconds): the step's answer does not wait
        for that. What a runner that exits first leaves, the sweep removes.
        """
        busy = [p for p in self.paths if not _rmdir(p)]
        if busy:
            threading.Thread(target=_remove_later, args=(busy,), daemon=True).start()


def _rmdir(path: str) -> bool:
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _remove_later(paths: list[str]) -> None:
    delay = 0.0005
    deadline = time.monotonic() + 5.0
    while paths and time.monotonic() < deadline:
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
        paths = [p for p in paths if not _rmdir(p)]


SWEEP_AGE = 60.0  # seconds: an empty step cgroup this old belongs to a dead runner
_swept: dict[str, float] = {}


def _sweep(parent: str) -> None:
    """Remove empty step cgroups that runners killed before their cleanup left behind.

    rmdir fails on a cgroup that still has a process, so a running step's
    survives; young ones are left alone (their command may not have joined yet).
    """
    now = time.time()
    if now - _swept.get(parent, 0.0) < SWEEP_AGE:
        return
    _swept[parent] = now
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            if not name.startswith("strata-"):
                continue
            path = os.path.join(parent, name)
            with contextlib.suppress(OSError):
                if now - os.stat(path).st_mtime > SWEEP_AGE:
                    os.rmdir(path)


def _v2_base() -> str:
    return "/sys/fs/cgroup/unified" if os.path.isdir("/sys/fs/cgroup/unified") else (
        "/sys/fs/cgroup")


def _own_cgroup() -> dict[str, str]:
    out: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            _n, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(","):
                out[c] = path
    return out


def sandbox_env(sandbox: str, storage: str, *, root: bool,
                image: ImageProcess | None = None) -> dict[str, str]:
    """The command's environment: the caller's, less strata's own, with the sandbox's HOME.

    An image's own Env comes over the few variables a rooted step takes from
    the caller (its PATH is the one its programs are found on).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    if root:  # a workspace or an image: its own system, so only the basics cross over
        env = {k: v for k, v in env.items() if k in ("PATH", "LANG", "TERM")}
        env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    if sandbox == "none":
        env["STRATA_STORAGE"] = storage
        return env
    env["HOME"] = "/root"
    if image is not None:
        env.update({k: v for k, v in image.env.items() if not k.startswith("STRATA_")})
    if storage:
        env["STRATA_STORAGE"] = "/storage"
    return env


def build_command(sandbox: str, argv: list[str], storage: str, *, network: bool,
                  workdir: str, run_id: str, memory: int | None, jail: Jail | None = None,
                  pids: int | None = DEFAULT_PIDS, image: ImageProcess | None = None
                  ) -> Launch:
    """How to run `argv` in `sandbox` with the volumes of `storage` at /storage.

    `jail` (made by the runner) says what the sandbox is built from; a bwrap
    step needs one, with its user namespace. Without volumes `storage` is "".
    `image` is what an image's config asks for (its environment, directory
    and user; `argv` is already its command).
    """
    root = jail.root if jail is not None else None
    env = sandbox_env(sandbox, storage, root=root is not None, image=image)
    cwd = image.cwd if image is not None and image.cwd else ("/storage" if storage else "/")
    uid, gid = (image.uid, image.gid) if image is not None else (0, 0)
    if sandbox == "none":
        if root is not None:
            raise InvalidInput(f"a root filesystem needs a sandbox (bwrap or gvisor), "
                               f"not {sandbox!r}")
        return Launch(argv, env)
    argv = _as_shell_would(argv, root)
    if sandbox == "bwrap":
        _need("bwrap", "bubblewrap (bwrap)")
        if jail is None or jail.userns is None:
            raise InvalidInput("a bwrap step needs its user namespace")
        if (uid, gid) != (0, 0):
            raise InvalidInput(f"the image runs as {uid}:{gid}; under bwrap a step runs as "
                               f"root of its namespace only (use --sandbox gvisor)")
        return _bwrap(argv, env, storage, jail, network=network, cwd=cwd)
    if sandbox == "gvisor":
        _need("runsc", "gVisor (runsc)")
        config = _oci_config(argv, env, storage, network=network, memory=memory, root=root,
                             pids=pids, cwd=cwd, user=(uid, gid))
        return Launch(_runsc(config, workdir, run_id, network=network), env, pids_scale=2,
                      pids_slack=512, pipe_files=True)
    raise InvalidInput(f"unknown sandbox {sandbox!r} (use {', '.join(SANDBOXES)})")


def _as_shell_would(argv: list[str], root: str | None) -> list[str]:
    """`argv` run by the sandbox's own sh, when its root has one.

    Then a command that is not there exits 127 and one that cannot run 126,
    as shells answer (bwrap and runsc would exit 1 with words of their own).
    """
    sh = os.path.join(root or "/", "bin/sh")
    if os.path.lexists(sh):
        return ["/bin/sh", "-c", 'exec "$@"', "sh", *argv]
    return argv


def _need(tool: str, name: str) -> None:
    if shutil.which(tool) is None:
        raise InvalidInput(f"{name} is not installed")


def _bwrap(argv: list[str], env: dict[str, str], storage: str, jail: Jail, *,
           network: bool, cwd: str = "/") -> Launch:
    """bwrap, started as root of the step's user namespace (nsenter), never the host's root.

    bwrap then makes the mount, pid, ipc, uts and cgroup namespaces (and the
    network one unless `network`) as that unprivileged user, so they belong to
    the step's user namespace; only the mounts listed here are in it.
    """
    assert jail.userns is not None
    filt = seccomp.memfd()
    jail.fds.append(filt)
    cmd = ["nsenter", f"--user={jail.userns}", "--setuid=0", "--setgid=0", "--",
           "bwrap", "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try",
           "--hostname", rootfs.HOSTNAME, "--die-with-parent", "--new-session",
           "--cap-drop", "ALL"]
    for cap in ROOT_CAPS:
        cmd += ["--cap-add", cap]
    if not network:
        cmd.append("--unshare-net")
    if jail.root is None:
        root = rootfs.default_root(network)
        cmd += ["--ro-bind", root.skeleton, "/"]
        for src, dest in root.binds:
            cmd += ["--ro-bind", src, dest]
    else:
        cmd += ["--bind", jail.root, "/"]
    cmd += ["--dev", "/dev", "--proc", "/proc"]
    for path, mode in rootfs.TMPFS.items():
        if jail.root is None or path == "/tmp":
            cmd += ["--perms", f"{mode:04o}", "--tmpfs", path]
    if storage:
        cmd += ["--bind", storage, "/storage"]
    cmd += ["--chdir", cwd, "--seccomp", str(filt)]
    if jail.root is None:
        cmd += ["--remount-ro", "/"]
    return Launch([*cmd, "--", *argv], env, pass_fds=(filt,), dies_with_parent=True)


def _runsc(config: dict[str, object], workdir: str, run_id: str, *, network: bool
           ) -> list[str]:
    """Write the OCI bundle under `workdir`; the runsc command that runs it."""
    bundle = os.path.join(workdir, "bundle")
    os.makedirs(bundle, exist_ok=True)
    with open(os.path.join(bundle, "config.json"), "w") as f:
        json.dump(config, f)
    return ["runsc", "--root", os.path.join(workdir, "runsc-root"), "--oci-seccomp",
            "--network=host" if network else "--network=none", "--platform=ptrace",
            "--ignore-cgroups", "run", "--bundle", bundle, f"strata-{run_id}"]


def _oci_config(argv: list[str], env: dict[str, str], storage: str, *, network: bool,
                memory: int | None, root: str | None = None, pids: int | None = None,
                cwd: str | None = None, user: tuple[int, int] = (0, 0)
                ) -> dict[str, object]:
    """The OCI bundle's config: the same view as bwrap's, for gVisor's own kernel.

    gVisor's Sentry is the step's kernel; its gofer serves only the mounts
    listed here. Root inside is gVisor's root, with ROOT_CAPS, never a host
    process's identity.
    """
    namespaces = [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
    if not network:
        namespaces.append({"type": "network"})
    # gVisor's own kernel applies the same filter as bwrap's (run/seccomp.py), and
    # refuses device nodes, which its tmpfs would otherwise make.
    linux: dict[str, object] = {"namespaces": namespaces, "seccomp": {
        "defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_X86_64"],
        "syscalls": [{"names": sorted({*seccomp.DENIED, "mknod", "mknodat"}),
                      "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM}]}}
    if memory:
        linux["resources"] = {"memory": {"limit": memory}}
    secure = ["nosuid", "nodev"]
    mounts: list[dict[str, object]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
    ]
    if root is None:
        skel = rootfs.default_root(network)
        root_path = skel.skeleton
        for src, dest in skel.binds:
            mounts.append({"destination": dest, "type": "bind", "source": src,
                           "options": ["rbind", "ro", *secure]})
        tmpfs = rootfs.TMPFS
    else:
        root_path = root
        tmpfs = {"/tmp": rootfs.TMPFS["/tmp"]}
    for path, mode in tmpfs.items():
        mounts.append({"destination": path, "type": "tmpfs", "source": "tmpfs",
                       "options": [*secure, f"mode={mode:04o}"]})
    if storage:  # the step's volumes (a workspace root alone has none)
        mounts.append({"destination": "/storage", "type": "bind", "source": storage,
                       "options": ["rbind", "rw", *secure]})
    caps = list(ROOT_CAPS)
    process: dict[str, object] = {
        "terminal": False, "user": {"uid": user[0], "gid": user[1]}, "args": argv,
        "cwd": cwd or ("/storage" if storage else "/"), "noNewPrivileges": True,
        "env": [f"{k}={v}" for k, v in env.items()],
        "capabilities": {"bounding": caps, "effective": caps, "permitted": caps,
                         "inheritable": caps}}
    if pids:
        process["rlimits"] = [{"type": "RLIMIT_NPROC", "hard": pids, "soft": pids}]
    return {
        "ociVersion": "1.0.0",
        "process": process,
        "root": {"path": root_path, "readonly": root is None},
        "hostname": rootfs.HOSTNAME,
        "mounts": mounts,
        "linux": linux,
    }


def run_command(launch: Launch, *, cwd: str, timeout: float | None, memory: int | None,
                cgroup_name: str, pids: int | None = DEFAULT_PIDS,
                on_start: Callable[[int], None] | None = None) -> Outcome:
    """Run to completion in its own process group; kill it all at the end or the deadline.

    `on_start` gets the process group id as soon as the command is started.
    """
    host_pids = pids * launch.pids_scale + launch.pids_slack if pids else None
    cg = StepCgroup(cgroup_name, memory=memory, pids=host_pids) if memory or pids else None
    limits = []  # what no cgroup could cap
    if memory and not (cg is not None and cg.memory_ok):
        limits.append((resource.RLIMIT_AS, memory))
    if pids and not (cg is not None and cg.pids_ok):
        limits.append((resource.RLIMIT_NPROC, pids))
    gate = cg.gate() if cg is not None else []
    wrapper = [] if launch.dies_with_parent else pdeathsig_wrapper()
    pumps = _Pumps(launch.pipe_files)
    try:
        if wrapper is not None and not limits:
            # No Python between fork and exec: the interpreter can vfork, which from a
            # process the size of the step service's workers costs 1 ms, not 15.
            missing = _check_executable(launch.cmd[0], launch.env, cwd)
            if missing is not None:
                raise _CannotRun(*missing)
            cmd = [*gate, *wrapper, *(["--"] if wrapper else []), *launch.cmd]
            proc = subprocess.Popen(cmd, env=launch.env, cwd=cwd, process_group=0,
                                    pass_fds=launch.pass_fds, stdout=pumps.out(1),
                                    stderr=pumps.out(2))
        else:
            prctl = _prctl() if not launch.dies_with_parent else None

            def preexec() -> None:
                os.setpgrp()
                if prctl is not None:
                    prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with the runner
                for which, value in limits:
                    resource.setrlimit(which, (value, value))

            try:
                proc = subprocess.Popen([*gate, *launch.cmd], env=launch.env, cwd=cwd,
                                        preexec_fn=preexec, pass_fds=launch.pass_fds,
                                        stdout=pumps.out(1), stderr=pumps.out(2))
            except (FileNotFoundError, PermissionError) as exc:
                raise _CannotRun(127 if isinstance(exc, FileNotFoundError) else 126,
                                 exc.strerror or str(exc)) from None
    except _CannotRun as exc:  # what a shell would say, and its status
        os.write(2, f"strata run: {launch.cmd[0]}: {exc.words}\n".encode(
            errors="surrogateescape"))
        pumps.close()
        if cg is not None:
            cg.remove()
        return Outcome(exc.status)
    except BaseException:
        pumps.close()
        if cg is not None:
            cg.remove()
        raise
    pumps.start()
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
        pumps.finish()
        oom = cg.oom_killed() if cg is not None else False
        if cg is not None:
            cg.remove()
    rc = proc.returncode
    status = 128 - rc if rc < 0 else rc
    return Outcome(status, timed_out, oom)


class _CannotRun(Exception):
    """The command is not there (127) or cannot be run (126)."""

    def __init__(self, status: int, words: str) -> None:
        super().__init__(words)
        self.status, self.words = status, words


class _Pumps:
    """Pipes in place of a regular-file stdout/stderr, copied to it where it stands.

    `write(2)` on the caller's descriptor appends at the file's current
    offset, shared with the caller, as the command would have written had it
    run on this kernel.
    """

    def __init__(self, wanted: bool) -> None:
        self.pipes: dict[int, tuple[int, int]] = {}  # our fd -> (read end, write end)
        self.threads: list[threading.Thread] = []
        if not wanted:
            return
        for fd in (1, 2):
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    self.pipes[fd] = os.pipe()

    def out(self, fd: int) -> int | None:
        """What the command gets as `fd`: a pipe's write end, or None (ours, inherited)."""
        return self.pipes[fd][1] if fd in self.pipes else None

    def start(self) -> None:
        for fd, (r, w) in self.pipes.items():
            os.close(w)  # the command holds it now: EOF when its last process is gone
            t = threading.Thread(target=_copy, args=(r, fd), daemon=True)
            t.start()
            self.threads.append(t)

    def finish(self) -> None:
        for t in self.threads:
            t.join(timeout=10)

    def close(self) -> None:
        for r, w in self.pipes.values():
            for end in (r, w):
                with contextlib.suppress(OSError):
                    os.close(end)


def _copy(src: int, dst: int) -> None:
    try:
        while data := os.read(src, 65536):
            view = memoryview(data)
            while view:
                view = view[os.write(dst, view):]
    except OSError:
        pass  # the caller's file went away: the command's output goes with it
    finally:
        os.close(src)


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


def _check_executable(name: str, env: dict[str, str], cwd: str) -> tuple[int, str] | None:
    """None if `name` can run; else the status and words a shell gives (127, 126)."""
    if "/" in name:
        path = os.path.join(cwd, name)
        if not os.path.lexists(path):
            return 127, "No such file or directory"
        if os.path.isdir(path) or not os.access(path, os.X_OK):
            return 126, "Permission denied"
        return None
    found = shutil.which(name, path=env.get("PATH", os.defpath))
    if found is None or os.path.isdir(found):
        return 127, "command not found"
    return None


def _prctl() -> Callable[..., int] | None:
    """The C library's prctl, loaded before forking (no imports between fork and exec)."""
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
