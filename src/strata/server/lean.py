"""The lean stream: object reads and publishes on the owner's unix socket, without HTTP.

A second unix socket beside the store's own (`serve.sock.lean`, mode 0600
like it, published and handed off the same way) carries a persistent stream
of length-prefixed msgpack frames, one request and then its answer at a
time per connection (docs/api.md, "The lean stream"). It serves only the
hot calls: `get` (one object), `get_many` (a batch read), `get_file` (a file
node and the blocks of a range, one round trip), `publish`, and `list` (what
`strata ls` shows, in one round trip). The HTTP API stays the whole surface;
a client falls back to it whenever this socket is missing, full, or answers
"changing owner".

Each connection has a thread of its own, outside the event loop: it reads a
frame, calls the engine and writes the answer, with no hop between threads
(a publish waits for the group commit's fdatasync in that thread). At most
MAX_CONNECTIONS are served at once; the next one is closed at once, and its
client uses HTTP for a moment.

Rules, as on the HTTP side:
- a connection on the unix socket is the store's owner (the socket is
  0600 in a 0700 directory), exactly as the HTTP middleware decides;
- every byte is untrusted: the frame length is checked against MAX_BODY and
  held in the stream's body budget before the body is read; the request is
  decoded and every field checked before the store is touched;
- answers are bounded like the HTTP ones (MAX_BATCH_GET ids, MAX_BATCH_ANSWER
  bytes, held in the stream's answer budget until written);
- a request counts as in flight once its body has arrived, so a handoff or
  stop drains it (`drain`) without waiting for a client still sending;
  once the store is gone a connection gets "changing owner" and is closed.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack

from strata.engine.errors import InvalidInput, StrataError, Unavailable
from strata.engine.local import LocalStore
from strata.engine.names import check_branch, check_hex_id, check_volume, split_path
from strata.engine.objects import (
    FILENODE,
    ID_LEN,
    K_DIR,
    K_SYMLINK,
    TREE,
    Entry,
    FileNode,
    TreeNode,
)
from strata.engine.tree import Trees
from strata.server import app as api
from strata.server import wire
from strata.server.bodies import (
    ANSWER_BUDGET,
    BODY_BUDGET,
    MAX_BATCH_ANSWER,
    MAX_BATCH_GET,
    BlockingBudget,
    TooLarge,
)
from strata.server.tokens import OWNER

log = logging.getLogger(__name__)

FRAME = struct.Struct(">I")
MAX_CONNECTIONS = 256  # connections served at once (a thread each)
MAX_LIST_PATHS = 16   # paths one `list` looks up
MAX_PATH_NAMES = 2048  # names one `get_path` follows (a 4 KiB path has at most 2,048)
LISTED_ENTRY_BYTES = 64  # an entry of a `list` answer without its name, about (for the budget)
IO_TIMEOUT = 60.0     # a frame started must arrive within this (an idle connection may wait)


class LeanServer:
    def __init__(self, state: api.ServerState, listener: socket.socket) -> None:
        self.state = state
        self.listener = listener
        self.budget = BlockingBudget(BODY_BUDGET)
        self.answers = BlockingBudget(ANSWER_BUDGET)
        self.inflight = 0
        self._cond = threading.Condition()  # guards inflight, connections, closed
        self.connections: set[socket.socket] = set()
        self.closed = False
        self._acceptor = threading.Thread(target=self._accept, name="strata-lean-accept",
                                          daemon=True)

    def start(self) -> None:
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _addr = self.listener.accept()
            except OSError as exc:
                if self.closed:
                    return
                log.debug("lean stream accept failed: %s", exc)
                time.sleep(0.01)  # EMFILE and the like: try again
                continue
            with self._cond:
                refuse = self.closed or len(self.connections) >= MAX_CONNECTIONS
                if not refuse:
                    self.connections.add(conn)
            if refuse:
                conn.close()  # the client falls back to HTTP
                continue
            threading.Thread(target=self.serve, args=(conn,), name="strata-lean",
                             daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        try:
            while True:
                conn.settimeout(None)  # an idle connection may wait for its next request
                head = _recv_exactly(conn, FRAME.size)
                conn.settimeout(IO_TIMEOUT)
                (length,) = FRAME.unpack(head)
                if length > wire.MAX_BODY:
                    # The frame cannot be skipped safely: answer, then hang up.
                    self._answer(conn, TooLarge(f"request frame over {wire.MAX_BODY} bytes"))
                    return
                if not self._one(conn, length):
                    return
        except (EOFError, OSError):
            return  # the client hung up, perhaps mid-frame, or stalled: nothing to answer
        except Exception:
            # A fault of ours: this connection ends (its client falls back to HTTP), the
            # others go on.
            log.exception("lean stream connection failed")
        finally:
            with self._cond:
                self.connections.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        """The request counts as in flight, if the store is being served (else raises)."""
        state = self.state
        with self._cond:
            state.need_store()  # under the lock: `drain` cannot miss this request
            self.inflight += 1
        state.last_request = time.monotonic()
        try:
            yield
        finally:
            with self._cond:
                self.inflight -= 1
                if self.inflight == 0:
                    self._cond.notify_all()

    def _one(self, conn: socket.socket, length: int) -> bool:
        """One request; False when the connection must close (the store has gone)."""
        try:
            with contextlib.ExitStack() as answer_held:  # an answer's bytes, until sent
                with self.budget.hold(length):
                    # In flight once the body is here: a drain never waits for a slow sender.
                    body = _recv_exactly(conn, length)
                    with self._counted():
                        result = self._dispatch(body, answer_held)
                _send(conn, [0, result])
        except StrataError as exc:
            if exc.http_status == 500:  # the store's fault, not the client's (Corrupt, ...)
                log.error("lean request answered 500: %s", exc, exc_info=exc)
            self._answer(conn, exc)
            return not (isinstance(exc, Unavailable) and self.state.mode != "serving")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, OverflowError) as exc:
            self._answer(conn, InvalidInput(f"malformed request: {exc}"))
        return True

    def _dispatch(self, body: bytes, answer_held: contextlib.ExitStack) -> Any:
        try:
            # unpackb bounds every string, array and map by the body's own length.
            req = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError,
                msgpack.StackError) as exc:
            raise InvalidInput(f"lean request is not msgpack: {exc}") from None
        if not isinstance(req, list) or not req or not isinstance(req[0], str):
            raise InvalidInput("a lean request is [op, args...]")
        op, args = req[0], req[1:]
        if op == "get" and len(args) == 1:
            return self._get(_oid(args[0]), answer_held)
        if op == "get_many" and len(args) == 1 and isinstance(args[0], list):
            return self._get_many([_oid(o) for o in args[0]], answer_held)
        if op == "publish" and len(args) == 1 and isinstance(args[0], bytes):
            return self._publish(args[0])
        if (op == "get_file" and len(args) == 3 and isinstance(args[1], int)
                and isinstance(args[2], int)):
            return self._get_file(_oid(args[0]), args[1], args[2], answer_held)
        if op == "get_path" and len(args) == 2 and isinstance(args[1], list):
            return self._get_path(_oid(args[0]), args[1], answer_held)
        if op == "list" and len(args) == 4:
            return self._list(*args, answer_held=answer_held)
        raise InvalidInput(f"no lean operation {op!r} taking these arguments")

    def _get(self, oid: bytes, answer_held: contextlib.ExitStack) -> bytes:
        store = self.state.need_store()
        n = store.object_size(oid)  # NotFound for an unknown id
        answer_held.enter_context(self.answers.hold(n))
        raw = store.get_object(oid)
        self._served(1, len(raw))
        return raw

    def _get_many(self, ids: list[bytes], answer_held: contextlib.ExitStack) -> list[bytes]:
        """The first objects of `ids` that fit one answer (at least one): as HTTP's batch read."""
        if not ids:
            return []
        if len(ids) > MAX_BATCH_GET:
            raise InvalidInput(f"at most {MAX_BATCH_GET} ids per batch read")
        return self._read_fitting(self.state.need_store(), ids, 0, answer_held)

    def _read_fitting(self, store: LocalStore, ids: list[bytes], used: int,
                      answer_held: contextlib.ExitStack) -> list[bytes]:
        """The objects of the first `ids` that fit one answer beside `used` bytes.

        At least one when nothing else is in the answer. Their bytes are held in
        the answer budget until the answer is sent.
        """
        total, count = used, 0
        for oid in ids:
            n = store.object_size(oid)  # NotFound for an unknown id
            if total + n > MAX_BATCH_ANSWER and (count or used):
                break
            total += n
            count += 1
        answer_held.enter_context(self.answers.hold(total))
        raws = [store.get_object(o) for o in ids[:count]]
        self._served(len(raws), sum(len(r) for r in raws))
        return raws

    def _get_file(self, ref: bytes, offset: int, end: int,
                  answer_held: contextlib.ExitStack) -> list[Any]:
        """A file's root node, then the nodes below it and the chunks of [offset, end).

        The objects come in the order `FileNode.range_ids` walks the range
        (each node before what it names, holes left out, each id once), so
        the client, walking the same way, knows which id each one is. As many
        as fit one answer.
        """
        if not 0 <= offset <= end:
            raise InvalidInput("a file range is 0 <= offset <= end")
        store = self.state.need_store()
        raw = store.get_object(ref)
        try:
            node = FileNode.decode(raw)
            nodes: dict[bytes, bytes] = {}
            want: list[bytes] = []
            for kind, oid in node.range_ids(offset, end, nodes.__getitem__):
                want.append(oid)
                if len(want) >= MAX_BATCH_GET:
                    break
                if kind == FILENODE:
                    nodes[oid] = store.get_object(oid)
        except (ValueError, TypeError, KeyError, IndexError):
            raise InvalidInput(f"{ref.hex()} is not a file node") from None
        self._served(1, len(raw))
        return [raw, self._read_fitting(store, want, len(raw), answer_held)]

    def _get_path(self, oid: bytes, names: list[Any],
                  answer_held: contextlib.ExitStack) -> list[list[bytes]]:
        """`[id, raw]` of the tree nodes a lookup of `names` below directory node `oid` reads.

        For each name, the nodes from the directory's root node to the leaf
        that holds (or would hold) it; then on into that entry's directory,
        until a name is missing or is no directory. As many as fit one
        answer. The nodes are decoded here and kept in the store's node
        cache, where the publish that usually follows finds them.
        """
        if len(names) > MAX_PATH_NAMES or not all(isinstance(n, bytes) for n in names):
            raise InvalidInput(f"get_path takes at most {MAX_PATH_NAMES} names, as bins")
        store = self.state.need_store()
        if store.object_kind(oid) != TREE:
            raise InvalidInput(f"{oid.hex()} is not a tree node")
        cache = store.node_cache
        out: list[list[bytes]] = []
        total = 0
        cur: bytes | None = oid
        for name in names:
            node_id = cur
            while node_id is not None:
                raw = store.get_object(node_id)
                if total + len(raw) > MAX_BATCH_ANSWER and out:
                    cur = None
                    break
                total += len(raw)
                out.append([node_id, raw])
                node = cache.get(node_id)
                if node is None:  # decoded once, for this answer and the publish after it
                    try:
                        node = TreeNode.decode(raw)
                    except (ValueError, TypeError, KeyError, IndexError):
                        raise InvalidInput(f"{node_id.hex()} is not a tree node") from None
                    cache.put(node_id, node, len(raw))
                if node.level == 0:
                    e = dict(node.entries).get(name)
                    cur = e.ref if e is not None and e.kind == K_DIR else None
                    break
                firsts = [c[0] for c in node.children]
                node_id = node.children[max(bisect.bisect_right(firsts, name) - 1, 0)][1]
            if cur is None:
                break
        answer_held.enter_context(self.answers.hold(total))
        self._served(len(out), total)
        return out

    def _publish(self, body: bytes) -> dict[str, Any]:
        heads, prefetch = api.publish_now(self.state, OWNER, wire.decode_publish(body))
        return {"heads": heads, "prefetch": [[oid, raw] for oid, raw in prefetch]}

    def _list(self, volume: Any, branch: Any, prefix: Any, paths: Any, *,
              answer_held: contextlib.ExitStack) -> dict[str, Any]:
        """Entries at some paths of one snapshot, and each directory's children.

        What `strata ls` needs in one round trip, so that the CLI imports no tree code.
        """
        if not isinstance(volume, str) or not isinstance(paths, list) or not (
                (isinstance(branch, str) and prefix is None)
                or (branch is None and isinstance(prefix, str))):
            raise InvalidInput("list takes a volume, a branch or a snapshot prefix, and paths")
        if not 1 <= len(paths) <= MAX_LIST_PATHS or not all(isinstance(p, bytes) for p in paths):
            raise InvalidInput(f"list takes 1 to {MAX_LIST_PATHS} paths, as bins")
        check_volume(volume)
        store = self.state.need_store()
        if prefix is not None:
            if len(prefix) < 8 or any(c not in "0123456789abcdef" for c in prefix):
                raise InvalidInput("a snapshot prefix is at least 8 lowercase hex digits")
            store.list_branches(volume)  # the volume must exist
            sid = store.find_snapshot(prefix)
        else:
            sid = store.head(volume, check_branch(str(branch)))
        trees = Trees(store)
        root = store.snapshot(sid).root
        found: list[Any] = []
        size = 0  # about what the answer takes, held in the answer budget like a read's
        for raw in paths:
            e = trees.resolve(root, split_path(raw.decode("utf-8", "surrogateescape")))
            if e is None:
                found.append(None)
            elif e.kind == K_DIR and e.ref is not None:
                children = [[n, _shown(c)] for n, c in trees.iter_dir(e.ref)]
                size += sum(len(n) + LISTED_ENTRY_BYTES for n, _c in children)
                found.append([_shown(e), children])
            else:
                found.append([_shown(e), None])
        answer_held.enter_context(self.answers.hold(size))
        return {"snapshot": sid, "found": found}

    def _served(self, objects: int, nbytes: int) -> None:
        with self._cond:
            self.state.served["objects_served"] += objects
            self.state.served["bytes_served"] += nbytes

    def _answer(self, conn: socket.socket, exc: StrataError) -> None:
        body = wire.error_body(exc)
        if isinstance(exc, api.ChangingOwner):
            body["retry_after"] = exc.retry_after
        _send(conn, [exc.http_status, body])

    def busy(self) -> bool:
        return self.inflight > 0

    def drain(self) -> None:
        """Wait until no request is in flight (the caller has stopped serving the store)."""
        with self._cond:
            self._cond.wait_for(lambda: self.inflight == 0)

    def close(self) -> None:
        """Stop accepting and hang up every connection (a request being answered ends)."""
        with self._cond:
            self.closed = True
            conns = list(self.connections)
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the acceptor
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(timeout=5)
        self.listener.close()


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            raise EOFError
        got += k
    return bytes(buf)


def _send(conn: socket.socket, answer: list[Any]) -> None:
    data = msgpack.packb(answer, use_bin_type=True)
    if len(data) <= 256 * 1024:
        conn.sendall(FRAME.pack(len(data)) + data)  # one write, one wake-up
    else:
        conn.sendall(FRAME.pack(len(data)))
        conn.sendall(data)


def _shown(e: Entry) -> list[Any]:
    """An entry's list form (docs/format.md) for showing: no content reference or bytes."""
    v = e.to_list()
    v[6] = None  # ref
    if e.kind != K_SYMLINK:
        v[7] = None  # a small file's inline content
    return v


def _oid(value: Any) -> bytes:
    if isinstance(value, str):
        check_hex_id(value)
        return bytes.fromhex(value)
    if not isinstance(value, bytes) or len(value) != ID_LEN:
        raise InvalidInput(f"an object id is {ID_LEN} bytes")
    return value
