"""Bucket tier benchmarks, on moto (S3 protocol) over loopback.

Every figure sits beside the same work done with obstore straight against the
same server in the same run: a raw conditional PUT, a raw ranged GET, raw PUT
throughput. Loopback moto answers in about a millisecond; real S3 Express
answers in 5-10 ms and S3 Standard in 50-100 ms (SlateDB's tuning notes), so
the latency figures here are the floor that strata adds to whatever the
bucket costs.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import obstore

from bench.engine import _pct
from bench.report import row
from strata.engine import tierreads as tiermod  # FETCH_BACK_AFTER lives there
from strata.engine.bucket import Bucket
from strata.engine.local import LocalStore, init_store
from strata.engine.seal import KEY_FILE, BucketKey, read_key_file
from strata.engine.tier import restore
from strata.engine.txn import Transaction

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bucketutil import BUCKET, Moto  # noqa: E402

KIB = 1024
MIB = 1024 * KIB


def _raw_put_p50(bucket: Bucket, n: int) -> float:
    data = os.urandom(128 * KIB)
    lat = []
    for i in range(n):
        t0 = time.perf_counter()
        bucket.put_new(f"raw/put-{os.urandom(8).hex()}-{i}", data)
        lat.append(time.perf_counter() - t0)
    return _pct(lat, 0.5)


def _raw_get_p50(bucket: Bucket, n: int) -> float:
    bucket.put("raw/big", os.urandom(8 * MIB))
    lat = []
    for i in range(n):
        off = (i * 131 * KIB) % (7 * MIB)
        t0 = time.perf_counter()
        bucket.get_range("raw/big", off, off + 128 * KIB)
        lat.append(time.perf_counter() - t0)
    return _pct(lat, 0.5)


def _raw_put_rate(bucket: Bucket, size: int, count: int) -> float:
    data = os.urandom(size)
    t0 = time.perf_counter()
    for i in range(count):
        obstore.put(bucket._store, f"raw/tput-{i}", data)
    return size * count / (time.perf_counter() - t0)


def bench_strict(root: str, url: str, n: int) -> tuple[float, float, float]:
    """Strict publish p50, and PUTs per commit with 16 publishers."""
    path = os.path.join(root, "strict")
    init_store(path, bucket=url + "/strict", sync="bucket")
    with LocalStore(path) as s:
        s.create_volume("v")
        datas = [os.urandom(128 * KIB) for _ in range(8)]
        lat = []
        t = Transaction(s, "v")
        for i in range(n):
            t0 = time.perf_counter()
            t.write(f"f{i % 32}", datas[i % 8] + i.to_bytes(4, "little"))
            t.commit()
            lat.append(time.perf_counter() - t0)
        assert s._tier is not None
        before = s._tier.stats["segments"]
        commits = 16 * max(n // 8, 10)

        def worker(k: int) -> None:
            for i in range(commits // 16):
                tx = Transaction(s, "v")
                tx.write(f"w{k}-{i % 4}", i.to_bytes(4, "little") * 1024)
                tx.commit()

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(16)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        rate = commits / (time.perf_counter() - t0)
        puts = s._tier.stats["segments"] - before
    return _pct(lat, 0.5), puts / commits, rate


def bench_default(root: str, url: str, n: int) -> tuple[float, float, float]:
    """Default-mode publish p50 (local fsync only), the loss window, and upload rate."""
    path = os.path.join(root, "default")
    init_store(path, bucket=url + "/default")
    with LocalStore(path) as s:
        s.create_volume("v")
        lat = []
        t = Transaction(s, "v")
        end = time.monotonic() + 3.0
        i = 0
        while time.monotonic() < end or i < n:
            data = os.urandom(128 * KIB)  # nothing deduplicates: packs fill and seal
            t0 = time.perf_counter()
            t.write(f"f{i % 64}", data)
            t.commit()
            lat.append(time.perf_counter() - t0)
            i += 1
        time.sleep(1.0)
        assert s._tier is not None
        window = s._tier.stats["max_unshipped_ms"] / 1000
        # Upload throughput: the sealed packs of this run, uploaded again by the tier's
        # own code path under fresh names.
        sealed = [num for num in s._tier.local.numbers() if s._tier._sealed(num)]
        s._tier.log.epoch = (s._tier.log.epoch or 0) + 10**9  # new names, same bytes
        t0 = time.perf_counter()
        done = 0
        for num in sealed:
            s._tier._upload(num)
            done += s._tier.local.size(num)
        rate = done / (time.perf_counter() - t0) if done else 0.0
    return _pct(lat, 0.5), window, rate


def _build(path: str, url: str, files: int, big: int) -> None:
    init_store(path, bucket=url)
    rng = random.Random(1)
    with LocalStore(path) as s:
        s.create_volume("data")
        t = Transaction(s, "data")
        for d in range(100):
            t.mkdir(f"d{d:02d}")
        for i in range(files):
            t.write(f"d{i % 100:02d}/f{i:06d}", b"x%d\n" % i)
        t.commit()
        if big:
            s.create_volume("bulk")
            t = Transaction(s, "bulk")
            for i in range(big):
                t.write(f"b{i:06d}", rng.randbytes(5000))
                if i % 20_000 == 19_999:
                    t.commit()
                    t = Transaction(s, "bulk")
            t.commit()


def bench_restore(root: str, url: str, files: int, big: int, name: str) -> tuple[float, int]:
    """Seconds from `restore` to the first listing of the 100k-file volume's root."""
    src = os.path.join(root, f"src-{name}")
    _build(src, f"{url}/{name}", files, big)
    with LocalStore(src) as s:
        objects = s.index.count_objects()
    key = read_key_file(os.path.join(src, KEY_FILE))  # kept apart, as a user would
    shutil.rmtree(src)
    dst = os.path.join(root, f"dst-{name}")
    t0 = time.perf_counter()
    restore(f"{url}/{name}", dst, key=key)
    with LocalStore(dst) as s:
        names = Transaction(s, "data").listdir("")
        elapsed = time.perf_counter() - t0  # not the close (it waits for a checkpoint)
    assert len(names) == 100
    shutil.rmtree(dst)
    return elapsed, objects


def bench_cold_read(root: str, url: str, n: int) -> float:
    """p50 of a 128 KiB read of a block whose pack was evicted (only in the bucket).

    A pack whose windows miss twice is fetched back whole in the background;
    that is turned off here so that every read measured is a cold ranged read.
    """
    src = os.path.join(root, "cold")
    init_store(src, bucket=url + "/cold", pack_size_limit=MIB)
    lat = []
    fetch_back, tiermod.FETCH_BACK_AFTER = tiermod.FETCH_BACK_AFTER, 1 << 30
    try:
        with LocalStore(src) as s:
            s.create_volume("v")
            for i in range(n):
                t = Transaction(s, "v")
                t.write(f"f{i}", os.urandom(128 * KIB))
                t.commit()
            assert s._tier is not None
            s._tier.flush()
            assert s._tier.evict(0)
            t = Transaction(s, "v")
            for i in range(n):
                s._tier._windows.clear()  # cold: no window left from the last read
                t0 = time.perf_counter()
                t.read(f"f{i}")
                lat.append(time.perf_counter() - t0)
            assert s._tier.stats["ranged_reads"] >= n // 2
    finally:
        tiermod.FETCH_BACK_AFTER = fetch_back
    shutil.rmtree(src)
    return _pct(lat, 0.5)


SEAL_MODES = (("unsealed", {"unauthenticated": True}),  # bucket format 1, as before keys
              ("sealed", {"encrypt": False}),             # keyed BLAKE3 tags only
              ("encrypted", {}))                          # the default: ChaCha20-Poly1305


def bench_seal_cost(root: str, url: str, quick: bool) -> dict[str, tuple[float, float]]:
    """Upload and cold-read throughput (bytes/s) of one store per sealing mode.

    The same work in each: 1 MiB files of random bytes in 1 MiB packs; the
    sealed packs uploaded again by the tier's own code under fresh names
    (as bench_default does); then every pack evicted and every file read
    back cold (no window cached, no fetch-back), through ranged GETs.
    """
    files = 12 if quick else 40
    out: dict[str, tuple[float, float]] = {}
    fetch_back, tiermod.FETCH_BACK_AFTER = tiermod.FETCH_BACK_AFTER, 1 << 30
    try:
        for mode, opts in SEAL_MODES:
            path = os.path.join(root, f"seal-{mode}")
            init_store(path, bucket=f"{url}/seal-{mode}", pack_size_limit=MIB,
                       **opts)
            rng = random.Random(7)
            with LocalStore(path) as s:
                s.create_volume("v")
                for i in range(files):
                    t = Transaction(s, "v")
                    t.write(f"f{i}", rng.randbytes(MIB))
                    t.commit()
                tier = s._tier
                assert tier is not None
                tier.flush()
                sealed = [n for n in tier.local.numbers() if tier._sealed(n)]
                tier.log.epoch = (tier.log.epoch or 0) + 10**9  # new names, same bytes
                t0 = time.perf_counter()
                done = 0
                for n in sealed:
                    tier._upload(n)
                    done += tier.local.size(n)
                up = done / (time.perf_counter() - t0)
                tier.flush()
                assert tier.evict(0)
                t = Transaction(s, "v")
                t0 = time.perf_counter()
                for i in range(files):
                    tier._windows.clear()
                    t.read(f"f{i}")
                cold = files * MIB / (time.perf_counter() - t0)
                out[mode] = (up, cold)
            shutil.rmtree(path)
    finally:
        tiermod.FETCH_BACK_AFTER = fetch_back
    return out


def seal_cpu_rate(encrypt: bool) -> tuple[float, float]:
    """Seal and open rates (bytes/s) of a 4 MiB object in memory: the cost without a network."""
    key = BucketKey(os.urandom(32), encrypt=encrypt)
    data = os.urandom(4 * MIB)
    t0 = time.perf_counter()
    for _ in range(8):
        sealed = key.seal("packs/x", data)
    seal = 8 * len(data) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(8):
        key.open("packs/x", sealed)
    return seal, 8 * len(data) / (time.perf_counter() - t0)


def bench_takeover(root: str, url: str) -> float:
    """The old owner dies; seconds until the new host has served its first publish."""
    a = os.path.join(root, "owner-a")
    init_store(a, bucket=url + "/takeover", sync="bucket")
    s = LocalStore(a)
    s.create_volume("v")
    t = Transaction(s, "v")
    t.write("x", os.urandom(100 * KIB))
    t.commit()
    # Death: the process stops without closing (its lock dies with it in real life).
    t0 = time.perf_counter()
    b = os.path.join(root, "owner-b")
    restore(url + "/takeover", b, sync="bucket", key=read_key_file(os.path.join(a, KEY_FILE)))
    with LocalStore(b) as nb:
        tx = Transaction(nb, "v")
        tx.write("after", b"new owner")
        tx.commit()
    elapsed = time.perf_counter() - t0
    s._tier.failed = RuntimeError("dead")  # type: ignore[union-attr]
    try:
        s.close()
    except Exception:  # noqa: BLE001 - the old owner is fenced; its close may fail
        pass
    return elapsed


def run(root: str, *, quick: bool = False) -> list[dict[str, Any]]:
    work = os.path.join(root, "strata-bench-bucket")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    moto = Moto(Path(work)).start()
    os.environ.update(moto.env())
    url = f"s3://{BUCKET}/bench"
    rows: list[dict[str, Any]] = []
    try:
        raw = Bucket(url + "/raw")
        n = 60 if quick else 200
        put50 = _raw_put_p50(raw, n)
        get50 = _raw_get_p50(raw, n)
        put_rate = _raw_put_rate(raw, 16 * MIB, 4 if quick else 12)
        strict50, puts_per_commit, rate16 = bench_strict(work, url, n)
        rows.append(row("bucket: --sync bucket 128 KiB publish p50", strict50 * 1e3, "ms",
                        put50 * 1e3, "raw conditional PUT p50", "<= PUT + 1 ms",
                        met=strict50 <= put50 + 0.001))
        rows.append(row("bucket: PUTs per commit, 16 publishers (--sync bucket)",
                        puts_per_commit, "PUT", None, f"{rate16:,.0f} commits/s",
                        "well below 1", met=puts_per_commit < 0.5))
        local50, window, up_rate = bench_default(work, url, n)
        rows.append(row("bucket: default-mode 128 KiB publish p50", local50 * 1e3, "ms",
                        None, "local fsync only", ""))
        rows.append(row("bucket: default-mode loss window (max wait to be shipped)",
                        window, "s", None, "", "<= 5 s", met=window <= 5.0))
        rows.append(row("bucket: background pack upload throughput", up_rate / MIB, "MB/s",
                        put_rate / MIB, "raw obstore PUT", ">= 80% of raw",
                        lower_is_better=False, met=up_rate >= 0.8 * put_rate))
        cold = bench_cold_read(work, url, 30 if quick else 100)
        rows.append(row("bucket: cold 128 KiB read of an evicted block p50", cold * 1e3, "ms",
                        get50 * 1e3, "raw ranged GET p50", "<= 2x raw",
                        met=cold <= 2 * get50))
        cost = bench_seal_cost(work, url, quick)
        base_up, base_cold = cost["unsealed"]
        for mode in ("sealed", "encrypted"):
            up, cold = cost[mode]
            rows.append(row(f"bucket: pack upload throughput, {mode}", up / MIB, "MB/s",
                            base_up / MIB, "unsealed (format 1), same run", ">= 80%",
                            lower_is_better=False, met=up >= 0.8 * base_up))
            rows.append(row(f"bucket: cold read throughput, 1 MiB files, {mode}", cold / MIB,
                            "MB/s", base_cold / MIB, "unsealed (format 1), same run", ">= 80%",
                            lower_is_better=False, met=cold >= 0.8 * base_cold))
        for encrypt in (False, True):
            seal, opened = seal_cpu_rate(encrypt)
            what = "ChaCha20-Poly1305" if encrypt else "keyed BLAKE3"
            rows.append(row(f"bucket: seal / open in memory, {what}", seal / MIB, "MB/s",
                            opened / MIB, "open", "", lower_is_better=False))
        files = 20_000 if quick else 100_000
        small, small_objs = bench_restore(work, url, files, 0, "small")
        rows.append(row(f"bucket: restore to first ls, {files // 1000}k-file volume",
                        small, "s", None, f"{small_objs:,} objects", "<= 1 s", met=small <= 1.0))
        big, big_objs = bench_restore(work, url, files, 10 * small_objs // 2, "large")
        rows.append(row(f"bucket: restore to first ls, store {big_objs / small_objs:.0f}x larger",
                        big, "s", small, "the smaller store", "<= 1.5x",
                        met=big <= 1.5 * small))
        takeover = bench_takeover(work, url)
        rows.append(row("bucket: takeover, old owner's death to first publish served",
                        takeover, "s", None, "", "<= 10 s", met=takeover <= 10.0))
    finally:
        moto.stop()
        shutil.rmtree(work, ignore_errors=True)
    return rows
