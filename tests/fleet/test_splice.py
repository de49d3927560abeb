"""The kernel splice (fleet/splice.py) on real loopback sockets.

A client, the two sockets of a member, and an owner: joined, the client's
bytes reach the owner and the owner's the client without the member reading
either; `held` counts what the member's kernel holds for an end that does
not read; parted, the member's sockets are its own again. Where the kernel or
the privileges refuse a splice, `Splice.create` says None and the tunnels
copy in Python (tests/fleet/test_tunnel.py runs both ways).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from strata.fleet.splice import Splice


@pytest.fixture
def splice() -> Iterator[Splice]:
    sp = Splice.create()
    if sp is None:
        pytest.skip("no kernel splice here (needs root and sockmaps)")
    try:
        yield sp
    finally:
        sp.close()


def _pair() -> tuple[socket.socket, socket.socket]:
    """(the connecting end, the accepted end) of one loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(5)
    return a, b


def _recv(s: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        piece = s.recv(n - len(got))
        assert piece, "closed"
        got += piece
    return got


def test_joined_sockets_pass_bytes_both_ways_unread_and_part_again(splice: Splice) -> None:
    client, member_down = _pair()
    member_up, owner = _pair()
    handle = splice.join(member_down, member_up)
    assert handle is not None and splice.joined == 1
    for i in range(50):
        client.sendall(b"request %d" % i)
        assert _recv(owner, len(b"request %d" % i)) == b"request %d" % i
        owner.sendall(b"answer %d" % i * 100)
        assert _recv(client, len(b"answer %d" % i * 100)) == b"answer %d" % i * 100
    member_down.setblocking(False)
    with pytest.raises(BlockingIOError):
        member_down.recv(1)  # the member's end saw none of it
    splice.part(handle)
    client.sendall(b"plain")
    member_down.settimeout(5)
    assert _recv(member_down, 5) == b"plain"  # parted: the member reads again
    for s in (client, member_down, member_up, owner):
        s.close()


def test_held_counts_what_waits_for_an_end_that_does_not_read(splice: Splice) -> None:
    client, member_down = _pair()
    member_up, owner = _pair()
    handle = splice.join(member_down, member_up)
    assert handle is not None
    assert splice.held(member_down, member_up) < 1024
    chunk = b"x" * 65536
    for _ in range(24 * 16):  # 24 MiB the owner never reads
        client.sendall(chunk)
    assert splice.held(member_down, member_up) > 16 << 20
    owner.close()  # an end closing: its peer's end sees it
    member_up.settimeout(5)
    with pytest.raises(OSError):
        for _ in range(100):
            member_up.sendall(chunk)
            if not member_up.recv(1):
                raise OSError("closed")
    splice.part(handle)
    for s in (client, member_down, member_up):
        s.close()
