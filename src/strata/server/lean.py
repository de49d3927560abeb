"""The lean stream: object reads and publishes on the owner's unix socket, without HTTP.

A second unix socket beside the store's own (`serve.sock.lean`, mode 0600
like it, published and handed off the same way) carries a persistent stream
of length-prefixed msgpack frames, one request and then its answer at a
time per connection (docs/api.md, "The lean stream"). It serves only the
hot calls: `get` (one object), `get_many` (a batch read), `publish`. The
HTTP API stays the whole surface; a client falls back to it whenever this
socket is missing or answers "changing owner".

Rules, as on the HTTP side:
- a connection on the unix socket is the store's owner (the socket is
  0600 in a 0700 directory), exactly as the HTTP middleware decides;
- every byte is untrusted: the frame length is checked against MAX_BODY and
  held in the server's body budget before the body is read; the request is
  decoded and every field checked before the store is touched;
- answers are bounded like the HTTP ones (MAX_BATCH_GET ids, MAX_BATCH_ANSWER
  bytes, held in the answer budget until written);
- requests count as in flight, so a handoff or stop drains them; once the
  store is gone a connection gets "changing owner" and is closed.

Reads of small objects run on the event loop (a pread of a few pages; no
executor hop). A publish still runs on the executor: the engine's call
includes the group commit's fdatasync wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from typing import Any

import msgpack

from strata.engine.errors import InvalidInput, StrataError, Unavailable
from strata.engine.names import check_hex_id
from strata.engine.objects import ID_LEN
from strata.server import app as api
from strata.server import wire
from strata.server.tokens import OWNER

FRAME = struct.Struct(">I")
INLINE_READ = 256 * 1024  # objects (and small batches) up to this size are read on the loop
INLINE_IDS = 16  # a batch of at most this many ids is sized on the loop


class LeanServer:
    def __init__(self, state: api.ServerState) -> None:
        self.state = state
        self.connections: set[asyncio.StreamWriter] = set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections.add(writer)
        try:
            while True:
                head = await reader.readexactly(FRAME.size)
                (length,) = FRAME.unpack(head)
                if length > wire.MAX_BODY:
                    # The frame cannot be skipped safely: answer, then hang up.
                    await self._answer(writer, api.TooLarge(
                        f"request frame over {wire.MAX_BODY} bytes"))
                    return
                keep = await self._one(reader, writer, length)
                if not keep:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return  # the client hung up, perhaps mid-frame: nothing to answer
        finally:
            self.connections.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   length: int) -> bool:
        """One request; False when the connection must close (the store has gone)."""
        state = self.state
        state.last_request = time.monotonic()
        try:
            state.need_store()
            state.inflight += 1
            state.idle.clear()
            try:
                async with state.budget.hold(length):
                    body = await reader.readexactly(length)
                    result = await self._dispatch(body)
            finally:
                state.inflight -= 1
                if state.inflight == 0:
                    state.idle.set()
        except StrataError as exc:
            await self._answer(writer, exc)
            return not (isinstance(exc, Unavailable) and state.mode != "serving")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, OverflowError) as exc:
            await self._answer(writer, InvalidInput(f"malformed request: {exc}"))
            return True
        await self._send(writer, [0, result])
        return True

    async def _dispatch(self, body: bytes) -> Any:
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
            return await self._get(_oid(args[0]))
        if op == "get_many" and len(args) == 1 and isinstance(args[0], list):
            return await self._get_many([_oid(o) for o in args[0]])
        if op == "publish" and len(args) == 1 and isinstance(args[0], bytes):
            return await self._publish(args[0])
        raise InvalidInput(f"no lean operation {op!r} taking these arguments")

    async def _get(self, oid: bytes) -> bytes:
        state = self.state
        store = state.need_store()
        n = store.object_size(oid)  # NotFound for an unknown id
        if n <= INLINE_READ:
            raw = store.get_object(oid)
        else:
            async with state.answers.hold(n):
                raw = await state.run(store.get_object, oid)
        state.served["objects_served"] += 1
        state.served["bytes_served"] += len(raw)
        return raw

    async def _get_many(self, ids: list[bytes]) -> list[bytes]:
        """The first objects of `ids` that fit one answer (at least one): as HTTP's batch read."""
        if not ids:
            return []
        if len(ids) > api.MAX_BATCH_GET:
            raise InvalidInput(f"at most {api.MAX_BATCH_GET} ids per batch read")
        state = self.state
        store = state.need_store()

        def sizes() -> list[int]:
            out: list[int] = []
            total = 0
            for oid in ids:
                n = store.object_size(oid)
                if out and total + n > api.MAX_BATCH_ANSWER:
                    break
                out.append(n)
                total += n
            return out

        # A small batch (a file's few blocks) is read on the loop: no executor hops.
        got = sizes() if len(ids) <= INLINE_IDS else await state.run(sizes)
        todo = ids[:len(got)]
        if sum(got) <= INLINE_READ:
            raws = [store.get_object(o) for o in todo]
        else:
            async with state.answers.hold(sum(got)):
                raws = await state.run(lambda: [store.get_object(o) for o in todo])
        state.served["objects_served"] += len(raws)
        state.served["bytes_served"] += sum(len(r) for r in raws)
        return raws

    async def _publish(self, body: bytes) -> dict[str, Any]:
        changesets, objects, txid = wire.decode_publish(body)
        heads, prefetch = await self.state.run(api.publish_now, self.state, OWNER, changesets,
                                               objects, txid)
        return {"heads": heads, "prefetch": [[oid, raw] for oid, raw in prefetch]}

    async def _answer(self, writer: asyncio.StreamWriter, exc: StrataError) -> None:
        body = wire.error_body(exc)
        if isinstance(exc, api.ChangingOwner):
            body["retry_after"] = exc.retry_after
        await self._send(writer, [exc.http_status, body])

    async def _send(self, writer: asyncio.StreamWriter, answer: list[Any]) -> None:
        data = msgpack.packb(answer, use_bin_type=True)
        writer.write(FRAME.pack(len(data)))
        writer.write(data)
        await writer.drain()

    def close(self) -> None:
        for w in list(self.connections):
            with contextlib.suppress(Exception):
                w.close()


def _oid(value: Any) -> bytes:
    if isinstance(value, str):
        check_hex_id(value)
        return bytes.fromhex(value)
    if not isinstance(value, bytes) or len(value) != ID_LEN:
        raise InvalidInput(f"an object id is {ID_LEN} bytes")
    return value
