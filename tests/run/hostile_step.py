"""A hostile step: real attacks on its sandbox, each attempt reported with its outcome.

Run inside a sandbox as ``python3 -c "$SOURCE" '<json targets>'`` (the test passes
this file's text), so it is standard library only and imports nothing of the
tests or of strata. argv[1] is a JSON object; its "mode" picks what to do:

* ``probe`` (the default) tries every attack below against the targets the test
  found on the host, each in its own try/except under an alarm so none hangs
  (sockets time out after 2 s), and prints one JSON line at the end::

      {"attempts": [{"name": ..., "target": ..., "succeeded": bool, "detail": ...}]}

  An attack that succeeds is a hole in the sandbox. The attacks: connect(2) to
  host unix sockets (the store's server and step service among them: a connect
  to the store's socket also asks ``GET /v1/whoami``); reading host files (the
  store's packs and index, another running step's scratch files, /etc/shadow, a
  file the test planted) and listing host directories; searching the store and
  scratch directories for a secret string; /proc/1 and /proc/<host pid> (root
  and environ); ptrace(PTRACE_ATTACH) of host processes; mknod of a device in
  /tmp and in a volume; mount(2) of a tmpfs; unshare(CLONE_NEWUSER) (and then
  mount in it); /dev/loop-control; running a setuid-root binary planted in a
  volume as an ordinary user; opening a device node planted in a volume;
  writing under /sys and /proc/sys and to /proc/sysrq-trigger (only opened for
  writing where a write would harm the host); keyctl and add_key; raw and packet
  sockets on a real network; TCP to host loopback services; host paths in
  /proc/self/mountinfo; sharing any of the host's namespaces.

* ``forkbomb`` forks sleeping children until fork fails (EAGAIN), a cap or a
  time limit, kills them all and prints ``{"mode": "forkbomb", "forked": N, ...}``;
  it exits 0.

* ``diskfill`` writes 1 MiB chunks to a file until ENOSPC, a cap or a time limit
  and prints ``{"mode": "diskfill", "bytes": N, "errno": E, ...}``; it exits 0 on
  ENOSPC, 1 otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from typing import Any

ATTEMPTS: list[dict[str, Any]] = []
SOCKET_TIMEOUT = 2.0
ATTACK_LIMIT = 10  # seconds one attack may take before the alarm stops it
NOBODY = 4242      # an unprivileged id to drop to (not 65534: an unmapped owner shows as that)


class Timeout(Exception):
    """An attack ran past its alarm."""


def _on_alarm(signum: int, frame: object) -> None:
    raise Timeout(f"timed out after {ATTACK_LIMIT}s")


def describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno:
        return f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror}"
    return f"{type(exc).__name__}: {exc}"


def attempt(name: str, target: object, fn: Any, *args: Any, limit: int = ATTACK_LIMIT) -> None:
    """Run one attack; it returns (succeeded, detail). Any exception is a failure."""
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(limit)
    try:
        ok, detail = fn(*args)
    except Timeout as exc:
        ok, detail = False, str(exc)
    except Exception as exc:
        ok, detail = False, describe(exc)
    finally:
        signal.alarm(0)
    ATTEMPTS.append({"name": name, "target": str(target), "succeeded": bool(ok),
                     "detail": str(detail)[:600]})


# ------------------------------------------------------------------ libc


_LIBC: list[Any] = []


def libc() -> Any:
    if not _LIBC:
        import ctypes
        lib = ctypes.CDLL(None, use_errno=True)
        lib.syscall.restype = ctypes.c_long
        lib.ptrace.restype = ctypes.c_long
        lib.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                              ctypes.c_ulong, ctypes.c_char_p]
        lib.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.unshare.argtypes = [ctypes.c_int]
        _LIBC.append(lib)
    return _LIBC[0]


def check(rc: int) -> int:
    """A libc call's result, or OSError with its errno."""
    if rc < 0:
        import ctypes
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return rc


def mount_tmpfs(target: str) -> None:
    check(libc().mount(b"none", target.encode(), b"tmpfs", 0, b"size=1m"))


def umount(target: str) -> None:
    with contextlib.suppress(OSError):
        check(libc().umount2(target.encode(), 2))  # MNT_DETACH


# ------------------------------------------------------------------ helpers


def read_head(path: str, n: int = 64) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        return os.read(fd, n)
    finally:
        os.close(fd)


def proc_start(pid: int) -> int | None:
    """A process's start time (clock ticks since boot): who a pid is, on this kernel."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rpartition(b")")[2].split()
    return int(fields[19]) if len(fields) > 19 else None


def in_child(fn: Any, timeout: float = 5.0) -> dict[str, Any]:
    """fn() in a forked child (which may change its own credentials); its JSON answer."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            os.close(r)
            answer = fn()
        except BaseException as exc:
            answer = {"ok": False, "detail": describe(exc)}
        try:
            os.write(w, json.dumps(answer).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.waitpid(pid, 0)
    if not data:
        return {"ok": False, "detail": "the child gave no answer"}
    result: dict[str, Any] = json.loads(data)
    return result


# ------------------------------------------------------------------ sockets


def unix_connect(path: str) -> tuple[bool, str]:
    address = "\0" + path[1:] if path.startswith("@") else path
    last: OSError | None = None
    for kind in (socket.SOCK_STREAM, socket.SOCK_SEQPACKET, socket.SOCK_DGRAM):
        s = socket.socket(socket.AF_UNIX, kind)
        s.settimeout(SOCKET_TIMEOUT)
        try:
            s.connect(address)
        except OSError as exc:
            s.close()
            last = exc
            if exc.errno == errno.EPROTOTYPE:
                continue  # another socket type
            raise
        try:
            detail = f"connected ({kind.name})"
            if kind == socket.SOCK_STREAM and os.path.basename(path).startswith("serve.sock"):
                s.sendall(b"GET /v1/whoami HTTP/1.0\r\n\r\n")
                answer = b""
                with contextlib.suppress(OSError):
                    while len(answer) < 4096:
                        chunk = s.recv(4096)
                        if not chunk:
                            break
                        answer += chunk
                detail += f"; whoami answered {answer[:300]!r}"
            return True, detail
        finally:
            s.close()
    assert last is not None
    raise last


def tcp_connect(host: str, port: int) -> tuple[bool, str]:
    with socket.create_connection((host, port), timeout=SOCKET_TIMEOUT) as s:
        return True, f"connected to {s.getpeername()}"


def raw_socket(family: int, kind: int, proto: int, host_net: str) -> tuple[bool, str]:
    """A raw socket is a hole only on a real network: the host's, or any with an interface."""
    s = socket.socket(family, kind, proto)
    s.close()
    try:
        net = os.readlink("/proc/self/ns/net")
    except OSError as exc:
        net = describe(exc)
    try:
        interfaces = [name for _i, name in socket.if_nameindex() if name != "lo"]
    except OSError as exc:
        interfaces = []
        net += f"; interfaces unknown ({describe(exc)})"
    shared = net == host_net
    whose = "the host's" if shared else "its own"
    return shared or bool(interfaces), (f"created; network namespace {net} ({whose}), "
                                        f"interfaces besides lo: {interfaces}")


# ------------------------------------------------------------------ files


def read_file(path: str, head_hex: str) -> tuple[bool, str]:
    data = read_head(path, 64)
    want = bytes.fromhex(head_hex)
    if want and not data.startswith(want):
        return False, f"readable, but not the host's file (starts {data[:16]!r})"
    return True, f"read {len(data)} bytes: {data[:32]!r}"


def list_dir(path: str, host_names: list[str]) -> tuple[bool, str]:
    names = os.listdir(path)
    seen = sorted(set(names) & set(host_names))
    if not host_names:
        return False, f"the host directory is empty; saw {len(names)} entries: {names[:5]}"
    return bool(seen), f"listed {len(names)} entries, {len(seen)} of them the host's: {seen[:8]}"


def search_secret(top: str, secrets: list[str]) -> tuple[bool, str]:
    wanted = [s.encode() for s in secrets if s]
    overlap = max((len(s) for s in wanted), default=1)
    errors: list[str] = []
    files = 0
    budget = 256 << 20
    deadline = time.monotonic() + 15
    walked = False
    for dirpath, _dirs, names in os.walk(top, onerror=lambda e: errors.append(describe(e))):
        walked = True
        for name in names:
            if budget <= 0 or time.monotonic() > deadline:
                return False, f"gave up after {files} files (budget)"
            path = os.path.join(dirpath, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
            except OSError as exc:
                errors.append(describe(exc))
                continue
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                files += 1
                tail = b""
                while budget > 0:
                    chunk = os.read(fd, 1 << 20)
                    if not chunk:
                        break
                    budget -= len(chunk)
                    window = tail + chunk
                    for secret in wanted:
                        if secret in window:
                            return True, f"found the secret in {path}"
                    tail = window[-overlap:]
            except OSError as exc:
                errors.append(describe(exc))
            finally:
                os.close(fd)
    if not walked:
        return False, f"could not walk it: {errors[:1]}"
    return False, f"not found in {files} readable files ({len(errors)} errors: {errors[:2]})"


# ------------------------------------------------------------------ processes


def proc_root(pid: str, marker_path: str, marker: str) -> tuple[bool, str]:
    root = f"/proc/{pid}/root"
    listing = sorted(os.listdir(root))[:12]
    try:
        data = read_head(root + marker_path, 4096)
    except OSError as exc:
        return False, f"listed {listing}; host marker file: {describe(exc)}"
    if marker.encode() in data:
        return True, f"read the host's marker file through {root}"
    return False, f"listed {listing}; a marker file with other content"


def proc_environ(pid: str, marker: str) -> tuple[bool, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        data = f.read()
    if marker.encode() in data:
        return True, "the host marker variable is in it"
    names = [v.split(b"=", 1)[0].decode(errors="replace") for v in data.split(b"\0") if v]
    return False, f"readable, no host marker ({len(names)} variables: {names[:6]})"


def ptrace_attach(pid: int, start: int | None) -> tuple[bool, str]:
    PTRACE_ATTACH, PTRACE_DETACH = 16, 17
    lib = libc()
    check(lib.ptrace(PTRACE_ATTACH, pid, None, None))
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # the SIGSTOP the attach sends
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG | 0x40000000)[0] == pid:  # __WALL
                    break
            time.sleep(0.01)
    finally:
        lib.ptrace(PTRACE_DETACH, pid, None, None)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGCONT)
    try:
        now = proc_start(pid)
    except OSError as exc:
        return True, f"attached (its start time unreadable: {describe(exc)})"
    if start is not None and now != start:
        return False, f"attached to pid {pid}, a process of the sandbox, not the host's"
    return True, "attached to the host process"


# ------------------------------------------------------------------ privileges


def mknod_device(directory: str) -> tuple[bool, str]:
    path = os.path.join(directory, f"hostile-null-{os.getpid()}")
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            return False, f"made the node, could not open it: {describe(exc)}"
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
        return True, "made a (1,3) device node and wrote to it"
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def mount_attack() -> tuple[bool, str]:
    target = f"/tmp/hostile-mnt-{os.getpid()}"
    os.makedirs(target, exist_ok=True)
    try:
        mount_tmpfs(target)
        umount(target)
        return True, "mounted a tmpfs"
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(target)


def unshare_userns() -> tuple[bool, str]:
    uid, gid = os.getuid(), os.getgid()

    def child() -> dict[str, Any]:
        check(libc().unshare(0x10000000))  # CLONE_NEWUSER
        notes = [f"in a new user namespace as uid {os.getuid()}"]
        with open("/proc/self/status") as f:
            caps = [ln.split()[1] for ln in f if ln.startswith("CapEff:")]
        notes.append(f"CapEff {caps[0] if caps else '?'}")
        try:
            with open("/proc/self/setgroups", "w") as f:
                f.write("deny")
            with open("/proc/self/uid_map", "w") as f:
                f.write(f"0 {uid} 1")
            with open("/proc/self/gid_map", "w") as f:
                f.write(f"0 {gid} 1")
            notes.append(f"mapped, now uid {os.getuid()}")
        except OSError as exc:
            notes.append(f"no id map ({describe(exc)})")
        try:
            check(libc().unshare(0x00020000))  # CLONE_NEWNS
            target = f"/tmp/hostile-userns-{os.getpid()}"
            os.makedirs(target, exist_ok=True)
            mount_tmpfs(target)
            notes.append("and mounted a tmpfs")
        except OSError as exc:
            notes.append(f"mount: {describe(exc)}")
        return {"ok": True, "detail": "; ".join(notes)}

    answer = in_child(child)
    return bool(answer["ok"]), str(answer["detail"])


def setuid_exec(path: str) -> tuple[bool, str]:
    st = os.stat(path)
    seen = f"mode {stat.filemode(st.st_mode)} owner {st.st_uid}"
    if not st.st_mode & stat.S_ISUID:
        return False, f"no setuid bit visible ({seen})"
    drop = os.geteuid() == 0

    def become_nobody() -> None:
        if drop:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)

    p = subprocess.run([path], capture_output=True, timeout=5, preexec_fn=become_nobody,
                       close_fds=True)
    out = p.stdout.decode(errors="replace").strip()
    ids = {k: int(v) for k, v in re.findall(r"\b(uid|euid)=(\d+)", out)}
    if "uid" not in ids:
        return False, f"{seen}; ran (exit {p.returncode}) but said {out[:80]!r} " \
                      f"{p.stderr[:120]!r}"
    euid = ids.get("euid", ids["uid"])
    if euid != ids["uid"]:
        return True, f"{seen}; ran as uid {ids['uid']} with euid {euid}: {out[:120]}"
    return False, f"{seen}; euid stayed {euid}"


def open_device(path: str) -> tuple[bool, str]:
    st = os.stat(path)
    kind = "char" if stat.S_ISCHR(st.st_mode) else "not a char device"
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    os.close(fd)
    return True, f"opened the planted {kind} {os.major(st.st_rdev)},{os.minor(st.st_rdev)}"


def open_for_writing(path: str) -> tuple[bool, str]:
    """Open only: writing these (sysrq, uevent_helper, ...) would harm the host."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    os.close(fd)
    return True, "opened for writing (nothing written)"


def rewrite_same(path: str) -> tuple[bool, str]:
    """Write back the value already there: a real write that changes nothing."""
    with open(path, "rb") as f:
        value = f.read()
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value)
    finally:
        os.close(fd)
    return True, f"wrote {value.strip()[:40]!r} to it"


def make_cgroup(parent: str) -> tuple[bool, str]:
    path = os.path.join(parent, f"hostile-{os.getpid()}")
    os.mkdir(path)
    with contextlib.suppress(OSError):
        os.rmdir(path)
    return True, "made a cgroup"


def keyctl_session() -> tuple[bool, str]:
    import ctypes
    # keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, 0)
    rc = check(libc().syscall(ctypes.c_long(250), ctypes.c_long(0), ctypes.c_long(-3),
                              ctypes.c_long(0)))
    return True, f"session keyring id {rc}"


def add_key() -> tuple[bool, str]:
    import ctypes
    lib = libc()
    key = check(lib.syscall(ctypes.c_long(248), ctypes.c_char_p(b"user"),
                            ctypes.c_char_p(b"strata-hostile"),
                            ctypes.c_char_p(b"x"), ctypes.c_size_t(1),
                            ctypes.c_long(-2)))  # KEY_SPEC_PROCESS_KEYRING
    lib.syscall(ctypes.c_long(250), ctypes.c_long(3), ctypes.c_long(key))  # KEYCTL_REVOKE
    return True, f"added key {key}"


def open_plain(path: str) -> tuple[bool, str]:
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    os.close(fd)
    return True, "opened"


# ------------------------------------------------------------------ the view


def mountinfo_leak(host_paths: list[str]) -> tuple[bool, str]:
    with open("/proc/self/mountinfo") as f:
        lines = f.read().splitlines()
    hits = [ln for ln in lines if any(p and p in ln for p in host_paths)]
    if hits:
        return True, f"leaks host paths ({len(hits)} lines): {hits[0][:400]}"
    return False, f"{len(lines)} mounts, no host path"


def shared_namespace(kind: str, host: str) -> tuple[bool, str]:
    mine = os.readlink(f"/proc/self/ns/{kind}")
    if mine == host:
        return True, f"shares the host's {kind} namespace {host}"
    return False, f"own {kind} namespace {mine}"


# ------------------------------------------------------------------ modes


def probe(t: dict[str, Any]) -> None:
    host_ns: dict[str, str] = t.get("host_ns", {})
    marker: str = t.get("marker", "")
    host_marker: dict[str, str] = t.get("host_marker", {})
    marker_path, marker_content = host_marker.get("path", ""), host_marker.get("content", "")

    attempt("mountinfo-leak", "/proc/self/mountinfo", mountinfo_leak, t.get("host_paths", []))
    for kind, host in sorted(host_ns.items()):
        attempt("shared-namespace", kind, shared_namespace, kind, host)
    for path in t.get("unix_sockets", []):
        attempt("unix-connect", path, unix_connect, path)
    for host, port in t.get("tcp", []):
        attempt("tcp-connect", f"{host}:{port}", tcp_connect, host, int(port))
    for f in t.get("files", []):
        attempt("read-file", f["path"], read_file, f["path"], f.get("head", ""))
    for path, names in sorted(t.get("dirs", {}).items()):
        attempt("list-dir", path, list_dir, path, names)
    search = t.get("search", {})
    for top in search.get("dirs", []):
        attempt("search-secret", top, search_secret, top, search.get("secrets", []), limit=30)
    attempt("proc1-root", "/proc/1/root", proc_root, "1", marker_path, marker_content)
    attempt("proc1-environ", "/proc/1/environ", proc_environ, "1", marker)
    for p in t.get("pids", []):
        pid, what = int(p["pid"]), f"{p['pid']} ({p.get('what', '?')})"
        attempt("proc-environ", what, proc_environ, str(pid), marker)
        attempt("proc-root", what, proc_root, str(pid), marker_path, marker_content)
        attempt("ptrace-attach", what, ptrace_attach, pid, p.get("start"))
    for d in ["/tmp", *t.get("storage", [])]:
        attempt("mknod", d, mknod_device, d)
    attempt("mount-tmpfs", "/tmp", mount_attack)
    attempt("unshare-userns", "CLONE_NEWUSER", unshare_userns)
    attempt("open-loop-control", "/dev/loop-control", open_plain, "/dev/loop-control")
    if t.get("setuid"):
        attempt("setuid-exec", t["setuid"], setuid_exec, t["setuid"])
    if t.get("device"):
        attempt("open-planted-device", t["device"], open_device, t["device"])
    for path in ("/sys/kernel/uevent_helper", "/sys/fs/cgroup/cgroup.procs",
                 "/sys/fs/cgroup/release_agent", "/sys/kernel/mm/transparent_hugepage/enabled",
                 "/proc/sys/vm/drop_caches", "/proc/sysrq-trigger",
                 "/proc/sys/kernel/core_pattern"):
        attempt("write-sys", path, open_for_writing, path)
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir("/sys/fs/cgroup"))[:16]:
            agent = f"/sys/fs/cgroup/{name}/release_agent"
            if os.path.exists(agent):
                attempt("write-sys", agent, open_for_writing, agent)
    attempt("write-sys", "/proc/sys/kernel/hostname", rewrite_same, "/proc/sys/kernel/hostname")
    hierarchies = ["/sys/fs/cgroup"]
    with contextlib.suppress(OSError):
        hierarchies += [f"/sys/fs/cgroup/{n}" for n in sorted(os.listdir("/sys/fs/cgroup"))]
    for d in [h for h in hierarchies if os.path.exists(f"{h}/cgroup.procs")][:16] or [
            "/sys/fs/cgroup"]:
        attempt("make-cgroup", d, make_cgroup, d)
    attempt("keyctl", "session keyring", keyctl_session)
    attempt("add-key", "process keyring", add_key)
    host_net = host_ns.get("net", "")
    attempt("raw-socket", "AF_INET/SOCK_RAW/ICMP", raw_socket, socket.AF_INET, socket.SOCK_RAW,
            socket.IPPROTO_ICMP, host_net)
    attempt("packet-socket", "AF_PACKET/SOCK_RAW", raw_socket, socket.AF_PACKET,
            socket.SOCK_RAW, socket.htons(3), host_net)  # ETH_P_ALL


def forkbomb(t: dict[str, Any]) -> dict[str, Any]:
    cap, seconds = int(t.get("cap", 20000)), float(t.get("seconds", 20))
    prctl = None
    with contextlib.suppress(Exception):
        prctl = libc().prctl
    children: list[int] = []
    stopped_by, err = "cap", None
    t0 = time.monotonic()
    while len(children) < cap:
        if time.monotonic() - t0 >= seconds:
            stopped_by = "time"
            break
        try:
            pid = os.fork()
        except OSError as exc:
            stopped_by, err = errno.errorcode.get(exc.errno or 0, str(exc.errno)), exc.errno
            break
        if pid == 0:  # a child: sleep (dying with the parent) and never return
            try:
                if prctl is not None:
                    prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
                time.sleep(seconds + 10)
            finally:
                os._exit(0)
        children.append(pid)
    elapsed = time.monotonic() - t0
    for pid in children:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for pid in children:
        with contextlib.suppress(OSError):
            os.waitpid(pid, 0)
    return {"mode": "forkbomb", "forked": len(children), "stopped_by": stopped_by,
            "errno": err, "seconds": round(elapsed, 3)}


def diskfill(t: dict[str, Any]) -> dict[str, Any]:
    path, cap = t["path"], int(t.get("cap", 8 << 30))
    seconds = float(t.get("seconds", 120))
    chunk = os.urandom(1 << 20)  # incompressible
    written, err, stopped_by = 0, None, "cap"
    t0 = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        while written < cap:
            if time.monotonic() - t0 >= seconds:
                stopped_by = "time"
                break
            view = memoryview(chunk)
            while view:
                n = os.write(fd, view)
                written += n
                view = view[n:]
        os.fsync(fd)
    except OSError as exc:
        err = exc.errno
        stopped_by = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    return {"mode": "diskfill", "path": path, "bytes": written, "errno": err,
            "stopped_by": stopped_by, "seconds": round(time.monotonic() - t0, 3)}


def main() -> int:
    targets: dict[str, Any] = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    mode = targets.get("mode", "probe")
    status = 0
    if mode == "forkbomb":
        report = forkbomb(targets)
    elif mode == "diskfill":
        report = diskfill(targets)
        status = 0 if report["errno"] == errno.ENOSPC else 1
    else:
        probe(targets)
        report = {"attempts": ATTEMPTS}
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
