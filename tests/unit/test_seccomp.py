"""The bwrap seccomp filter: its BPF logic in an interpreter, then for real under bwrap."""

from __future__ import annotations

import errno
import json
import os
import platform
import shutil
import struct
import subprocess

import pytest

from strata.run import seccomp

ARCH_I386 = 0x40000003
RET_EPERM = seccomp.SECCOMP_RET_ERRNO | errno.EPERM
RET_ENOSYS = seccomp.SECCOMP_RET_ERRNO | errno.ENOSYS
HEADER = "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"
DENIED_NAMES = sorted(seccomp.DENIED)


def instructions() -> list[tuple[int, int, int, int]]:
    data = seccomp.program()
    return [seccomp.SOCK_FILTER.unpack_from(data, i) for i in range(0, len(data), 8)]


def run_filter(nr: int, *, arch: int = seccomp.AUDIT_ARCH_X86_64, arg0: int = 0) -> int:
    """What the filter returns for one call: a small classic-BPF interpreter."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    prog = instructions()
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        pc += 1
        if code == seccomp.BPF_LD_W_ABS:
            (acc,) = struct.unpack_from("=I", data, k)
        elif code == seccomp.BPF_JEQ_K:
            pc += jt if acc == k else jf
        elif code == seccomp.BPF_JGE_K:
            pc += jt if acc >= k else jf
        elif code == seccomp.BPF_JSET_K:
            pc += jt if acc & k else jf
        elif code == seccomp.BPF_RET_K:
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")


def test_program_shape() -> None:
    data = seccomp.program()
    assert len(data) % 8 == 0
    prog = instructions()
    assert len(DENIED_NAMES) + 6 < len(prog) < 100  # well under BPF_MAXINSNS (4096)
    assert prog[-1][0] == seccomp.BPF_RET_K and prog[-2][0] == seccomp.BPF_RET_K
    for at, (code, jt, jf, _k) in enumerate(prog):
        if code in (seccomp.BPF_JEQ_K, seccomp.BPF_JGE_K, seccomp.BPF_JSET_K):
            assert at + 1 + max(jt, jf) < len(prog)  # every jump lands inside


def test_policy_in_interpreter() -> None:
    allow = seccomp.SECCOMP_RET_ALLOW
    assert run_filter(0, arch=ARCH_I386) == seccomp.SECCOMP_RET_KILL_PROCESS
    assert run_filter(0) == allow  # read
    assert run_filter(0x40000000 + 0) == RET_EPERM  # x32 read
    for name, nr in seccomp.DENIED.items():
        assert run_filter(nr) == RET_EPERM, name
    assert run_filter(seccomp.NR_CLONE3) == RET_ENOSYS
    fork_flags = 0x01200011  # CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID | SIGCHLD
    assert run_filter(seccomp.NR_CLONE, arg0=fork_flags) == allow
    thread_flags = 0x003D0F00  # what pthread_create passes
    assert run_filter(seccomp.NR_CLONE, arg0=thread_flags) == allow
    for bit in range(32):
        flag = 1 << bit
        want = RET_EPERM if flag & seccomp.CLONE_NAMESPACES else allow
        assert run_filter(seccomp.NR_CLONE, arg0=flag | 17) == want, hex(flag)
    for nr in (101, 135, 133, 259, 322, 57, 58, 59):  # ptrace personality mknod(at) fork...
        assert run_filter(nr) == allow, nr


@pytest.mark.skipif(not os.path.exists(HEADER), reason="no kernel headers")
def test_numbers_match_kernel_headers() -> None:
    numbers: dict[str, int] = {}
    with open(HEADER) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[0] == "#define" and parts[1].startswith("__NR_"):
                numbers[parts[1][5:]] = int(parts[2])
    for name, nr in seccomp.DENIED.items():
        assert numbers[name] == nr, name
    assert numbers["clone"] == seccomp.NR_CLONE
    assert numbers["clone3"] == seccomp.NR_CLONE3


def test_memfd_holds_program() -> None:
    fd = seccomp.memfd()
    try:
        assert os.get_inheritable(fd)
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0
        assert os.read(fd, 1 << 16) == seccomp.program()
        with pytest.raises(PermissionError):  # sealed
            os.pwrite(fd, b"x", 0)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ for real, under bwrap

BWRAP = "/usr/bin/bwrap"
PYTHON = "/usr/bin/python3"

PROBE = r"""
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def call(*args):
    ctypes.set_errno(0)
    ret = libc.syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    return 0 if ret >= 0 else ctypes.get_errno()

def clone(flags):
    ctypes.set_errno(0)
    pid = libc.syscall(ctypes.c_long(56), ctypes.c_long(flags), None, None, None,
                       ctypes.c_long(0))
    if pid == 0:
        os._exit(0)
    if pid < 0:
        return ctypes.get_errno()
    os.waitpid(pid, 0)
    return 0

out = {
    "mount": call(165, b"none", b"/nonexistent-strata", b"tmpfs", 0, None),
    "keyctl": call(250, 0, 0, 0, 0, 0),
    "bpf": call(321, 0, None, 0),
    "userfaultfd": call(323, 0),
    "clone3": call(435, None, 0),
    "clone_newuser": clone(0x10000000 | 17),
    "clone_plain": clone(17),
    "pid": os.getpid(),
}
child = os.fork()
if child == 0:
    os._exit(7)
out["fork"] = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
with open("/etc/hostname" if os.path.exists("/etc/hostname") else "/proc/self/stat") as f:
    out["read"] = len(f.read()) > 0
# Last: if it succeeds (unfiltered) the process loses its capabilities, which
# would change the answers above.
out["unshare"] = call(272, 0x10000000)
print(json.dumps(out))
"""

# An i386 system call (int 0x80) from a 64-bit process: getpid is 20 there.
I386_PROBE = r"""
import ctypes, mmap
buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
buf.write(b"\xb8\x14\x00\x00\x00\xcd\x80\xc3")  # mov eax, 20; int 0x80; ret
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
print(ctypes.CFUNCTYPE(ctypes.c_int)(addr)(), flush=True)
"""


def bwrap_python(code: str, *, filtered: bool) -> subprocess.CompletedProcess[str]:
    cmd = [BWRAP, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid"]
    fds: tuple[int, ...] = ()
    if filtered:
        fd = seccomp.memfd()
        fds = (fd,)
        cmd += ["--seccomp", str(fd)]
    try:
        return subprocess.run([*cmd, "--", PYTHON, "-c", code], pass_fds=fds,
                              capture_output=True, text=True, timeout=60)
    finally:
        for fd in fds:
            os.close(fd)


def bwrap_probe(*, filtered: bool) -> dict[str, object]:
    proc = bwrap_python(PROBE, filtered=filtered)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout)
    return result


needs_bwrap = pytest.mark.skipif(
    not (os.path.exists(BWRAP) and os.path.exists(PYTHON) and shutil.which("bwrap")
         and platform.machine() == "x86_64" and os.getuid() == 0),
    reason="needs root, x86_64, /usr/bin/bwrap and /usr/bin/python3")


@needs_bwrap
def test_bwrap_enforces_filter() -> None:
    out = bwrap_probe(filtered=True)
    assert out["unshare"] == errno.EPERM
    assert out["mount"] == errno.EPERM
    assert out["keyctl"] == errno.EPERM
    assert out["bpf"] == errno.EPERM
    assert out["userfaultfd"] == errno.EPERM
    assert out["clone3"] == errno.ENOSYS
    assert out["clone_newuser"] == errno.EPERM
    assert out["clone_plain"] == 0
    assert out["fork"] == 7
    assert isinstance(out["pid"], int) and out["pid"] > 1  # bwrap's init is pid 1
    assert out["read"] is True


@needs_bwrap
def test_bwrap_without_filter_differs() -> None:
    """The control: the same probe unfiltered, so the errors above are the filter's.

    Only the answers that do not hang on host settings (user namespaces and
    userfaultfd may be switched off by sysctl) are checked.
    """
    out = bwrap_probe(filtered=False)
    assert out["mount"] == errno.ENOENT  # the path is checked before the capability
    assert out["keyctl"] not in (0, errno.EPERM)  # bad arguments
    assert out["bpf"] not in (0, errno.EPERM)
    assert out["clone3"] == errno.EINVAL  # size 0
    assert out["fork"] == 7


@needs_bwrap
def test_bwrap_kills_other_arch() -> None:
    """An i386 call is killed (SIGSYS; bwrap exits 128 + 31), though it works unfiltered."""
    plain = bwrap_python(I386_PROBE, filtered=False)
    if plain.returncode != 0:
        pytest.skip(f"no i386 emulation here: {plain.returncode} {plain.stderr[-200:]}")
    assert int(plain.stdout) > 1
    proc = bwrap_python(I386_PROBE, filtered=True)
    assert proc.stdout == ""
    assert proc.returncode == 128 + 31, proc.stderr  # SIGSYS
