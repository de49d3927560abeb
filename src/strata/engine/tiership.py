"""Shipping: every pack byte written goes to the bucket's owner log.

The tier's writer records each append and each cut as a chunk (pack number,
offset, bytes); `ship` writes the chunks pending, in order, as `segment`
records of the owner log. In the default mode the background pass ships
about twice a second; with `strict` (`--sync bucket`) a writer's `datasync`
ships before it returns. An outage keeps the chunks for the next try; any
other failure (a successor's claim above all) stops the tier for good.
Reading segments back is restore's job (engine/tierrestore.py).
"""

from __future__ import annotations

import logging
import threading
import time

from strata.engine import pack as packfmt
from strata.engine.errors import BucketUnavailable, StoreFailed
from strata.engine.packstore import PackWriter
from strata.engine.tierdrop import DROP_MIN
from strata.engine.tierstate import Chunk, TierState

_log = logging.getLogger(__name__)  # `_log`: `self.log` is the owner log

SHIP_INTERVAL = 0.5        # default mode: seconds between segment records
SHIP_BYTES = 8 << 20       # ... or sooner once this much is pending
SEGMENT_MAX = 32 << 20     # bytes of chunks in one segment record
RESHIP_CHUNK = 4 << 20     # an unsealed pack shipped again at open goes in chunks this big


class Shipping(TierState):
    """Chunks pending, and the segment records that carry them to the log."""

    def _reship(self, number: int) -> None:
        """Ship an unsealed pack whole again, as it is after recovery.

        A killed owner may have written bytes it never shipped (the default mode
        ships after acknowledging), and appends from here on ship only what is
        new: without this, a restore would rebuild the pack with a hole. Chunks
        apply in log order, so this copy wins over whatever was shipped before.
        """
        size = self.local.size(number)
        for offset in range(0, size, RESHIP_CHUNK):
            self._record((number, offset, self.local.pread(number, RESHIP_CHUNK, offset)))
        self._record((number, size, None))  # and nothing past it

    def unshipped_for(self) -> float:
        """Seconds the oldest byte written and not yet in the bucket has waited (0: none)."""
        with self._lock:
            since = [t for t in (self._shipping_since,
                                 self._pending_since if self._pending else None)
                     if t is not None]
        return time.monotonic() - min(since) if since else 0.0

    def _sealed(self, number: int) -> bool:
        return packfmt.is_sealed_at(lambda n, o: self.local.pread(number, n, o),
                                    self.local.size(number), packfmt.pack_name(number))

    def _record(self, chunk: Chunk) -> None:
        with self._lock:
            if not self._pending:
                self._pending_since = time.monotonic()
            self._pending.append(chunk)
            self._pending_bytes += len(chunk[2] or b"")
            self._changed = True

    def ship(self) -> None:
        """Write every pending chunk to the log, in order (one record per SEGMENT_MAX)."""
        with self._ship_lock:
            self._check()
            with self._lock:
                todo, self._pending, self._pending_bytes = self._pending, [], 0
                since = self._pending_since if todo else None
                self._shipping_since = since
            try:
                while todo:
                    size, cut = 0, 0
                    while cut < len(todo) and (cut == 0 or size < SEGMENT_MAX):
                        size += len(todo[cut][2] or b"")
                        cut += 1
                    part = todo[:cut]
                    seq = self.log.append("segment", chunks=[list(c) for c in part])
                    todo = todo[cut:]  # only once it is in the bucket
                    with self._lock:
                        for n, _o, _d in part:
                            self._first_seq.setdefault(n, seq)
                        if size >= DROP_MIN:  # given back once a checkpoint passes it
                            self._own_segments[seq] = size
                    self.stats["segments"] += 1
                    self.stats["segment_bytes"] += size
                    _log.debug("shipped log record %d: %d chunk(s), %d bytes", seq,
                               len(part), size)
            except BucketUnavailable as exc:
                # An outage: keep the chunks, in order, for the next try. Strict mode's
                # publish is not acknowledged (it may land once the bucket is back, so a
                # retry with the same txid is the safe one); the default mode goes on.
                with self._lock:
                    self._pending[:0] = todo
                    self._pending_bytes += sum(len(c[2] or b"") for c in todo)
                    self._pending_since = since  # the oldest kept: these came first
                    self._shipping_since = None
                self.stats["outages"] += 1
                _log.debug("shipping: %d chunk(s) kept for the next try", len(todo))
                raise BucketUnavailable(f"the bucket is unavailable: {exc}") from exc
            except BaseException as exc:
                _log.error("shipping failed: %s; the bucket tier stops", exc, exc_info=True)
                self.failed = exc
                raise StoreFailed(f"the bucket tier stopped: {exc}") from exc
            finally:
                with self._lock:
                    self._shipping_since = None
            self._shipped_at = time.monotonic()
            self.stats["last_ship"] = time.time()
            if since is not None:
                # The loss window: how long a written byte waited to be in the bucket.
                self.stats["max_unshipped_ms"] = max(self.stats["max_unshipped_ms"],
                                                     (self._shipped_at - since) * 1000)


class TierWriter(PackWriter):
    def __init__(self, tier: Shipping, inner: PackWriter, number: int, offset: int) -> None:
        self.tier = tier
        self.inner = inner
        self.number = number
        self.offset = offset

    def write(self, data: bytes | memoryview) -> int:
        self.tier._check()
        n = self.inner.write(data)
        self.tier._record((self.number, self.offset, bytes(data[:n])))
        self.offset += n
        return n

    def truncate(self, size: int) -> None:
        self.inner.truncate(size)
        self.offset = size
        self.tier._record((self.number, size, None))

    def datasync(self) -> None:
        if not self.tier.strict:
            self.inner.datasync()
            self.tier._check()
            self._gate()
            return
        # Acknowledged means on the disk and in the bucket: the two at once.
        failed: list[BaseException] = []

        def local() -> None:
            try:
                self.inner.datasync()
            except BaseException as exc:  # noqa: BLE001 - raised below, in order
                failed.append(exc)

        sync = threading.Thread(target=local, name="strata-datasync")
        sync.start()
        try:
            self.tier.ship()
        finally:
            sync.join()
        if failed:
            raise failed[0]
        self._gate()

    def seal_sync(self) -> None:
        # Local only, in both modes: the seal's chunk ships with the next sync or pass,
        # in order. Neither an outage (strict mode) nor the acknowledgement gate may
        # refuse it: the seal is written already, and the journal moves past it only
        # once this returns.
        self.inner.datasync()
        self.tier._check()

    def _gate(self) -> None:
        # Last, once the bytes are durable: a withheld acknowledgement is retried
        # with the same txid, which finds the publish if it landed.
        gate = self.tier.ack_gate
        if gate is not None:
            gate()

    def close(self) -> None:
        self.inner.close()
