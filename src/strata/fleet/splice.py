"""The kernel carries a tunnel's bytes: two TCP sockets joined by a BPF sockmap.

A carried tunnel (fleet/tunnel.py) copies bytes between the client's socket
and the owner's. In Python each request then wakes the member twice (the
request in, the answer back), about 0.12 ms a request on this machine. Joined
here, neither wakes it: the kernel hands what arrives on one socket straight
to the other's send path (measured: 0.02-0.03 ms a round trip on loopback).

The parts, made once per member with the bpf(2) system call (so root, or
CAP_BPF and CAP_NET_ADMIN; without them, or on a kernel without sockmaps,
`Splice.create` returns None and tunnels copy in Python as before):

- `socks`, a SOCKMAP: slot -> socket;
- `peers`, a HASH: a socket's cookie (SO_COOKIE, unique for the boot) -> the
  slot of the socket its bytes go to;
- a stream verdict program attached to `socks`, run for each buffer that
  arrives on a socket in it:

      cookie = bpf_get_socket_cookie(skb)
      slot = peers[cookie]                  # none: SK_PASS, the member reads it
      return bpf_sk_redirect_map(skb, socks, slot, 0)   # to the peer's egress

The kernel queues what it moves without a bound of its own: an end that
stops reading (a client that sends requests and never reads the answers, or
a stalled owner under an upload) would let the member's kernel take all the
other end sends. So only callers with the fleet's secret are joined (a
bearer token's holder, a sandbox, is copied in Python, which stops reading
from one end while the other's buffer is full), and the member cuts a joined
tunnel that holds more than `tunnel.SPLICE_HOLD` (16 MiB) at a sweep
(`held`, from each socket's TCP_INFO byte counters).

A pair is joined while neither end has anything in flight (the client is
waiting for its `200`, the owner has answered the tunnel's POST): the
owner's socket enters first, so no byte can be redirected to a slot that is
not filled yet. Closing either socket takes it out of `socks`; `part` also
takes the cookies out of `peers` and frees the slots. The member still
watches both sockets: an end closing (an EOF or a reset) reaches it as
before, and it closes the other.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import socket
import struct
from typing import Any

log = logging.getLogger(__name__)

SO_COOKIE = 57
_NR_BPF = {"x86_64": 321, "aarch64": 280}
# bpf(2) commands, map, program and attach types (linux/bpf.h).
_MAP_CREATE, _MAP_UPDATE, _MAP_DELETE, _PROG_LOAD, _PROG_ATTACH = 0, 2, 3, 5, 8
_MAP_HASH, _MAP_SOCKMAP = 1, 15
_PROG_SK_SKB = 14
_SK_SKB_VERDICT, _SK_SKB_STREAM_VERDICT = 38, 5
_HELPER_LOOKUP, _HELPER_COOKIE, _HELPER_REDIRECT_MAP = 1, 46, 52
SLOTS = 8192  # sockets joined at once (two a tunnel); past it, tunnels copy in Python


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, dst | (src << 4), off, imm)


def _ld_map(dst: int, fd: int) -> bytes:
    """Load the map `fd` into register `dst` (16 bytes: BPF_PSEUDO_MAP_FD)."""
    return _insn(0x18, dst, 1, 0, fd) + _insn(0)


def _program(peers: int, socks: int) -> bytes:
    return b"".join([
        _insn(0xbf, 6, 1),                      # r6 = skb
        _insn(0x85, imm=_HELPER_COOKIE),        # r0 = bpf_get_socket_cookie(skb)
        _insn(0x7b, 10, 0, -8),                 # *(u64 *)(fp - 8) = r0
        _ld_map(1, peers),                      # r1 = peers
        _insn(0xbf, 2, 10),                     # r2 = fp
        _insn(0x07, 2, imm=-8),                 # r2 -= 8
        _insn(0x85, imm=_HELPER_LOOKUP),        # r0 = lookup(peers, &cookie)
        _insn(0x15, 0, 0, 7),                   # if r0 == 0: goto pass
        _insn(0x61, 3, 0, 0),                   # r3 = *(u32 *)r0 (the peer's slot)
        _insn(0xbf, 1, 6),                      # r1 = skb
        _ld_map(2, socks),                      # r2 = socks
        _insn(0xb7, 4, imm=0),                  # r4 = 0 (egress)
        _insn(0x85, imm=_HELPER_REDIRECT_MAP),  # r0 = bpf_sk_redirect_map(...)
        _insn(0x95),                            # return r0
        _insn(0xb7, 0, imm=1),                  # pass: return SK_PASS
        _insn(0x95),
    ])


# struct tcp_info (linux/tcp.h): tcpi_bytes_received at 128, tcpi_bytes_sent and
# tcpi_bytes_retrans at 200 and 208 (kernels since 4.19).
_TCP_INFO_LEN = 216


def _counters(sock: Any) -> tuple[int, int]:
    """(bytes received, bytes sent less retransmitted) of a TCP socket."""
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    received, = struct.unpack_from("<Q", raw, 128)
    sent, retrans = struct.unpack_from("<QQ", raw, 200)
    return received, sent - retrans


class Splice:
    """A member's joined socket pairs (see the module docstring)."""

    def __init__(self, nr: int) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._nr = nr
        self._fds: list[int] = []
        try:
            self.peers = self._map(_MAP_HASH, 8, 4)
            self.socks = self._map(_MAP_SOCKMAP, 4, 4)
            self.prog = self._load(_program(self.peers, self.socks))
            self._fds.append(self.prog)
            try:
                self._call(_PROG_ATTACH, struct.pack("IIII", self.socks, self.prog,
                                                     _SK_SKB_VERDICT, 0))
            except OSError:  # kernels before 5.13 have the stream verdict only
                self._call(_PROG_ATTACH, struct.pack("IIII", self.socks, self.prog,
                                                     _SK_SKB_STREAM_VERDICT, 0))
        except BaseException:
            self.close()
            raise
        self._free = list(range(SLOTS - 1, -1, -1))
        self.joined = 0  # pairs joined since start

    @classmethod
    def create(cls) -> Splice | None:
        """The member's splice, or None where the kernel or the privileges say no."""
        if os.environ.get("STRATA_FLEET_SPLICE", "1") == "0":
            return None
        nr = _NR_BPF.get(platform.machine())
        if nr is None:
            return None
        try:
            return cls(nr)
        except OSError as exc:
            log.info("tunnels copy in Python: no kernel splice (%s)", exc)
            return None

    def _call(self, cmd: int, attr: bytes) -> int:
        buf = ctypes.create_string_buffer(attr, 128)
        got = int(self._libc.syscall(self._nr, cmd, buf, 128))
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return got

    def _map(self, kind: int, key: int, value: int) -> int:
        fd = self._call(_MAP_CREATE, struct.pack("IIII", kind, key, value, SLOTS))
        self._fds.append(fd)
        return fd

    def _load(self, code: bytes) -> int:
        licence = ctypes.create_string_buffer(b"GPL")  # the socket helpers are GPL-only
        insns = ctypes.create_string_buffer(code, len(code))
        logbuf = ctypes.create_string_buffer(4096)
        try:
            return self._call(_PROG_LOAD, struct.pack(
                "IIQQIIQ", _PROG_SK_SKB, len(code) // 8, ctypes.addressof(insns),
                ctypes.addressof(licence), 1, len(logbuf), ctypes.addressof(logbuf)))
        except OSError as exc:
            verifier = logbuf.value.decode(errors="replace").strip()[-300:]
            raise OSError(exc.errno, f"{exc.strerror}: {verifier}") from None

    def _update(self, fd: int, key: bytes, value: bytes) -> None:
        k = ctypes.create_string_buffer(key, len(key))
        v = ctypes.create_string_buffer(value, len(value))
        self._call(_MAP_UPDATE, struct.pack("IIQQQ", fd, 0, ctypes.addressof(k),
                                            ctypes.addressof(v), 0))

    def _delete(self, fd: int, key: bytes) -> None:
        k = ctypes.create_string_buffer(key, len(key))
        try:
            self._call(_MAP_DELETE, struct.pack("IIQQQ", fd, 0, ctypes.addressof(k), 0, 0))
        except OSError:
            pass  # gone with its socket already

    def join(self, client: socket.socket, owner: socket.socket) -> tuple[int, ...] | None:
        """Join two idle sockets; what `part` takes, or None (copy in Python)."""
        if len(self._free) < 2:
            return None
        a, b = self._free.pop(), self._free.pop()
        ca = client.getsockopt(socket.SOL_SOCKET, SO_COOKIE, 8)
        cb = owner.getsockopt(socket.SOL_SOCKET, SO_COOKIE, 8)
        handle = (a, b, int.from_bytes(ca, "little"), int.from_bytes(cb, "little"))
        try:
            self._update(self.socks, struct.pack("I", b), struct.pack("I", owner.fileno()))
            self._update(self.peers, ca, struct.pack("I", b))
            self._update(self.socks, struct.pack("I", a), struct.pack("I", client.fileno()))
            self._update(self.peers, cb, struct.pack("I", a))
        except OSError as exc:
            log.debug("tunnel not spliced: %s", exc)
            self.part(handle)
            return None
        self.joined += 1
        return handle

    def part(self, handle: tuple[int, ...]) -> None:
        a, b, ca, cb = handle
        for cookie in (ca, cb):
            self._delete(self.peers, cookie.to_bytes(8, "little"))
        for slot in (a, b):
            self._delete(self.socks, struct.pack("I", slot))
            self._free.append(slot)

    @staticmethod
    def held(client: Any, owner: Any) -> int:
        """Bytes a joined pair's sockets took in and have not sent on, the larger way.

        Each direction: what one socket received less what the other sent
        (TCP_INFO's byte counters), so the kernel's queue between them plus
        the sender's unsent buffer. 0 for an end already closed.
        """
        try:
            a, b = _counters(client), _counters(owner)
        except (AttributeError, OSError, struct.error):
            return 0
        return max(a[0] - b[1], b[0] - a[1])

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
