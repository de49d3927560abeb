"""A seccomp filter for bwrap sandboxes, in the spirit of Docker's default profile.

`program()` is a classic BPF program (an array of `struct sock_filter`, native byte
order) as bubblewrap's `--seccomp FD` reads it; `memfd()` puts it in a file
descriptor to pass. bwrap installs the filter last, after it has built the
namespaces and mounts, so bwrap itself is not bound by it; the command it runs,
and all that command's children, are. The filter is x86_64 only.

What it owns is the kernel surface that namespaces and dropped capabilities leave
open, or that a step never needs and has been a rich source of kernel bugs:

* Other ABIs. A system call made through another architecture's entry point
  (i386 `int 0x80`) kills the process, since the numbers below would not mean
  the same there; x32 calls (the 0x40000000 bit) fail with EPERM.
* Mounts and the root (mount, umount2, pivot_root, the new mount API): the
  sandbox's file system view is bwrap's to set up, not the step's.
* Namespaces (unshare, setns, and `clone` with any CLONE_NEW* flag): the step
  stays in the namespaces bwrap made; it can neither make new ones (a user
  namespace would give back every capability inside it) nor join others.
  `clone3` fails with ENOSYS rather than EPERM: its flags sit in memory, where
  a filter cannot look, and on ENOSYS glibc falls back to `clone`, whose flags
  it can (Docker does the same).
* The kernel itself: loading and removing modules, kexec, reboot, swap,
  process accounting, quotas, the kernel log (syslog), I/O port access
  (iopl, ioperm).
* The clocks: setting the system time or adjusting it (settimeofday,
  clock_settime, clock_adjtime, adjtimex) would change it for the whole host.
* Large, bug-prone attack surface that builds do not use: bpf,
  perf_event_open, userfaultfd, io_uring, the kernel keyring (keyctl, add_key,
  request_key), fanotify_init.
* Escaping path checks: open_by_handle_at opens files by handle, bypassing the
  mount view (the "shocker" container escape); name_to_handle_at goes with it.
* Obsolete calls (uselib, nfsservctl, _sysctl, ustat, sysfs, lookup_dcookie).

Some calls Docker restricts are allowed on purpose: `ptrace` (the pid namespace
already hides every process outside the sandbox, and debuggers and sanitizers
need it), `mknod`/`mknodat` (capabilities decide who may make device nodes),
`personality`, `process_madvise` and `pidfd_getfd`. All else is allowed.

Denied calls fail with EPERM, which programs already handle as "not allowed
here", rather than killing the process.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct

log = logging.getLogger(__name__)

# seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6].
_OFF_NR = 0
_OFF_ARCH = 4
_OFF_ARG0_LO = 16  # low 32 bits of args[0] (little-endian x86_64)

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000

SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000

# Classic BPF opcodes (linux/filter.h), the only ones used.
BPF_LD_W_ABS = 0x20    # BPF_LD | BPF_W | BPF_ABS: A = u32 at offset k
BPF_JEQ_K = 0x15       # BPF_JMP | BPF_JEQ | BPF_K: A == k
BPF_JGE_K = 0x35       # BPF_JMP | BPF_JGE | BPF_K: A >= k
BPF_JSET_K = 0x45      # BPF_JMP | BPF_JSET | BPF_K: A & k != 0
BPF_RET_K = 0x06       # BPF_RET | BPF_K: return k

SOCK_FILTER = struct.Struct("=HBBI")  # struct sock_filter {u16 code; u8 jt, jf; u32 k}

NR_CLONE = 56
NR_CLONE3 = 435

# The namespace flags of clone(2). CLONE_NEWTIME (0x80) is not among them: in
# clone()'s flags the low byte is the exit signal, so the kernel never reads 0x80
# there as CLONE_NEWTIME (only unshare and clone3 take it, and both are refused).
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NAMESPACES = (CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC
                    | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET)

# x86_64 numbers, from arch/x86/entry/syscalls/syscall_64.tbl.
DENIED: dict[str, int] = {
    # Mounts and the root.
    "mount": 165, "umount2": 166, "pivot_root": 155,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
    "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    # Namespaces.
    "unshare": 272, "setns": 308,
    # The kernel itself.
    "init_module": 175, "finit_module": 313, "delete_module": 176,
    "kexec_load": 246, "kexec_file_load": 320, "reboot": 169,
    "swapon": 167, "swapoff": 168, "acct": 163,
    "quotactl": 179, "quotactl_fd": 443, "syslog": 103,
    "iopl": 172, "ioperm": 173,
    # The clocks.
    "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159,
    # Attack surface.
    "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "keyctl": 250, "add_key": 248, "request_key": 249, "fanotify_init": 300,
    # Escaping path checks.
    "open_by_handle_at": 304, "name_to_handle_at": 303,
    # Obsolete.
    "uselib": 134, "nfsservctl": 180, "_sysctl": 156, "ustat": 136, "sysfs": 139,
    "lookup_dcookie": 212,
}

# One instruction before its jumps are resolved: (code, k, jump-if-true, jump-if-false),
# each jump a label or None for "the next instruction".
_Insn = tuple[int, int, str | None, str | None]


def _assemble(insns: list[_Insn | str]) -> bytes:
    """Pack instructions, resolving label jumps (a str entry marks a label) to offsets."""
    labels: dict[str, int] = {}
    code: list[_Insn] = []
    for item in insns:
        if isinstance(item, str):
            labels[item] = len(code)
        else:
            code.append(item)

    def offset(at: int, label: str | None) -> int:
        if label is None:
            return 0
        off = labels[label] - at - 1
        if not 0 <= off <= 255:
            raise ValueError(f"BPF jump from {at} to {label!r} out of range ({off})")
        return off

    out = bytearray()
    for at, (op, k, jt, jf) in enumerate(code):
        out += SOCK_FILTER.pack(op, offset(at, jt), offset(at, jf), k)
    return bytes(out)


def _build() -> bytes:
    insns: list[_Insn | str] = [
        (BPF_LD_W_ABS, _OFF_ARCH, None, None),
        (BPF_JEQ_K, AUDIT_ARCH_X86_64, None, "kill"),
        (BPF_LD_W_ABS, _OFF_NR, None, None),
        (BPF_JGE_K, X32_SYSCALL_BIT, "eperm", None),
        (BPF_JEQ_K, NR_CLONE, "clone", None),
        (BPF_JEQ_K, NR_CLONE3, "enosys", None),
    ]
    insns += [(BPF_JEQ_K, nr, "eperm", None) for nr in DENIED.values()]
    insns += [
        (BPF_RET_K, SECCOMP_RET_ALLOW, None, None),
        # Classic BPF jumps only forward, so clone has its own "allow".
        "clone",
        (BPF_LD_W_ABS, _OFF_ARG0_LO, None, None),
        (BPF_JSET_K, CLONE_NAMESPACES, "eperm", None),
        (BPF_RET_K, SECCOMP_RET_ALLOW, None, None),
        "kill",
        (BPF_RET_K, SECCOMP_RET_KILL_PROCESS, None, None),
        "enosys",
        (BPF_RET_K, SECCOMP_RET_ERRNO | errno.ENOSYS, None, None),
        "eperm",
        (BPF_RET_K, SECCOMP_RET_ERRNO | errno.EPERM, None, None),
    ]
    return _assemble(insns)


_PROGRAM = _build()


def program() -> bytes:
    """The filter as bwrap's --seccomp FD expects it (raw sock_filter array)."""
    return _PROGRAM


def memfd() -> int:
    """A memfd (inheritable, offset 0) holding program(), to pass to bwrap --seccomp.

    The caller owns (and closes) it. Use a fresh one per bwrap: bwrap reads up to
    end of file from the shared offset, so a second reader would find nothing.
    The contents are sealed against change.
    """
    fd = os.memfd_create("strata-seccomp", os.MFD_ALLOW_SEALING)
    try:
        data = program()
        written = 0
        while written < len(data):
            written += os.write(fd, data[written:])
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK
                    | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
        os.lseek(fd, 0, os.SEEK_SET)
        os.set_inheritable(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
