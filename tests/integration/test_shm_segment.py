"""A real POSIX segment across real processes: life, versions, generations, cache, counters, lock takeover."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import struct
import subprocess
import sys
import time
import uuid
import zlib
from pathlib import Path

import msgpack
import posix_ipc
import pytest

import shm
from shm import LayoutError, Segment
from tests.conftest import shm_name

ROOT = Path(__file__).resolve().parents[2]
FORK = mp.get_context("fork")
SIZE = 2 * 1024 * 1024


@pytest.fixture()
def name():
    yield from shm_name("qag-test")


def _run(target, *args, timeout=30):
    p = FORK.Process(target=target, args=args)
    p.start()
    p.join(timeout)
    assert p.exitcode == 0, f"child {target.__name__} exited {p.exitcode}"


def _raw_word(name: str, off: int, value: int | None = None) -> int:
    """Read (or write) a u64 of the segment with plain mmap + struct, bypassing shm."""
    import mmap
    m = posix_ipc.SharedMemory(name)
    with mmap.mmap(m.fd, m.size) as mm:
        m.close_fd()
        if value is not None:
            struct.pack_into("<Q", mm, off, value)
        return struct.unpack_from("<Q", mm, off)[0]


# ---- life (LAYOUT.md [Life]) ------------------------------------------------------------------------------------

def test_create_attach_unlink(name):
    seg = Segment.create(name, SIZE, slots=4)
    other = Segment.attach(name)
    st = other.stat()
    assert st["layout_version"] == f"{shm.MAJOR}.{shm.MINOR}" == "1.1"
    assert st["size"] == SIZE and st["slots"] == 4 and st["creator_pid"] == os.getpid()
    assert other.ring_count() == 4
    assert Path("/dev/shm", name[1:]).exists()
    other.close()
    seg.close()
    seg.unlink()
    assert not Path("/dev/shm", name[1:]).exists()
    assert not Path("/dev/shm", "sem." + name[1:] + "-w").exists()
    with pytest.raises(LayoutError, match="no shared-memory segment"):
        Segment.attach(name)


def test_default_size_and_names():
    a = shm.segment_name("/srv/qag|127.0.0.1:8080")
    assert a.startswith("/qag-") and a == shm.segment_name("/srv/qag|127.0.0.1:8080")
    assert a != shm.segment_name("/srv/qag|127.0.0.1:8081")
    n = shm.segment_name(f"test-default-{uuid.uuid4()}")
    seg = Segment.create(n)
    try:
        st = seg.stat()
        assert st["size"] == shm.DEFAULT_SIZE == 64 * 1024 * 1024 and st["slots"] == 16
        assert all(r["offset"] % 4096 == 0 for r in st["regions"].values())
    finally:
        seg.close()
        seg.unlink()


def _create_and_die(name):
    seg = Segment.create(name, SIZE, slots=2)
    seg.bump("key", "alice")
    seg.cache_put(b"k", b"old")
    os.kill(os.getpid(), signal.SIGKILL)


def test_stale_segment_is_replaced(name):
    p = FORK.Process(target=_create_and_die, args=(name,))
    p.start()
    p.join(10)
    assert p.exitcode == -signal.SIGKILL
    stale = Segment.attach(name)
    assert stale.gen("key", "alice") == 1 and stale.stat()["creator_pid"] == p.pid
    stale.close()
    seg = Segment.create(name, SIZE, slots=2)  # creator dead: replaced, not refused
    try:
        assert seg.stat()["creator_pid"] == os.getpid()
        assert seg.gen("key", "alice") == 0 and seg.cache_get(b"k") is None
        assert seg.bump("key", "alice") == 1  # the new writers' lock works (the old one could be held)
    finally:
        seg.close()


def _create_and_wait(name, ready, done):
    seg = Segment.create(name, SIZE, slots=2)
    ready.set()
    done.wait(20)
    seg.close()


def test_live_segment_is_not_replaced(name):
    ready, done = FORK.Event(), FORK.Event()
    p = FORK.Process(target=_create_and_wait, args=(name, ready, done))
    p.start()
    try:
        assert ready.wait(10)
        with pytest.raises(LayoutError, match=f"creator pid {p.pid}"):
            Segment.create(name, SIZE, slots=2)
        Segment.create(name, SIZE, slots=2, force=True).close()
    finally:
        done.set()
        p.join(10)


def test_major_version_mismatch_refused_naming_both(name):
    seg = Segment.create(name, SIZE, slots=2)
    try:
        word = _raw_word(name, 0)
        _raw_word(name, 0, (word & 0xFFFFFFFF) | 2 << 32 | 3 << 48)
        with pytest.raises(LayoutError) as e:
            Segment.attach(name)
        assert "2.3" in str(e.value) and "1.1" in str(e.value)
        _raw_word(name, 0, (word & 0xFFFFFFFF) | 1 << 32 | 7 << 48)  # a newer minor is accepted
        newer = Segment.attach(name)
        assert newer.version == "1.7"
        newer.close()
        _raw_word(name, 0, 0)  # creator still writing (H1: magic last)
        with pytest.raises(LayoutError, match="not initialised"):
            Segment.attach(name)
    finally:
        seg.close()


# ---- generations (LAYOUT.md [Generations]) ------------------------------------------------------------------------

def _bump_many(name, kind, ident, n):
    seg = Segment.attach(name)
    for _ in range(n):
        seg.bump(kind, ident)
    seg.close()


def test_generations_monotonic_across_processes(name):
    seg = Segment.create(name, SIZE, slots=2)
    try:
        procs = [FORK.Process(target=_bump_many, args=(name, "key", "alice", 300)) for _ in range(3)]
        for p in procs:
            p.start()
        last, seen = 0, 0
        while any(p.is_alive() for p in procs):
            g = seg.gen("key", "alice")
            assert g >= last, "a generation went backwards"
            last = g
            seen += 1
        for p in procs:
            p.join(10)
            assert p.exitcode == 0
        assert seg.gen("key", "alice") == 900  # no lost increment: bumps are serialised by the lock
        assert seg.global_gen() == 900
        assert seg.gen("query", "alice") == 0 and seg.gen("connection", "alice") == 0
        st = seg.stat()
        assert st["generations"]["key"] == {str(zlib.crc32(b"alice") & (st["gen_slots"] - 1)): 900}
        assert st["generations"]["global"] == 900
        assert seg.gen_at(seg.gen_index("key", "alice")) == 900
    finally:
        seg.close()


def test_bump_visible_to_other_process_before_return(name):
    seg = Segment.create(name, SIZE, slots=2)
    other = Segment.attach(name)
    try:
        for i in range(1, 200):
            assert seg.bump("connection", "main") == i
            assert other.gen("connection", "main") == i  # G2: visible once bump() returned
    finally:
        other.close()
        seg.close()


# ---- cache (LAYOUT.md [Cache]) ----------------------------------------------------------------------------------

def _put_entries(name, n):
    seg = Segment.attach(name)
    for i in range(n):
        assert seg.cache_put(b"plan:%d" % i, msgpack.packb({"i": i, "sql": f"SELECT {i}", "gen": 0}))
    seg.close()


def test_cache_put_get_across_processes(name):
    seg = Segment.create(name, SIZE, slots=2)
    try:
        _run(_put_entries, name, 100)
        for i in range(100):
            entry = msgpack.unpackb(seg.cache_get(b"plan:%d" % i))
            assert entry == {"i": i, "sql": f"SELECT {i}", "gen": 0} and seg.gen("query", f"q{i}") == entry["gen"]
        seg.bump("query", "q7")  # [Cache entries]: the entry carries its generation; a bumped one is stale
        assert seg.gen("query", "q7") != msgpack.unpackb(seg.cache_get(b"plan:7"))["gen"]
        assert seg.cache_get(b"plan:100") is None
        stats = seg.cache_stats()
        assert stats["used"] == 100 and stats["puts"] == 100 and stats["hits"] == 101 and stats["misses"] == 1
        big = b"x" * stats["max_entry"]
        assert seg.cache_put(b"big", big) is False and seg.cache_stats()["rejects"] == 1
        assert seg.cache_put(b"big", big[:-3]) is True and seg.cache_get(b"big") == big[:-3]
        assert seg.cache_put(b"plan:1", b"replaced") and seg.cache_get(b"plan:1") == b"replaced"
        assert seg.cache_stats()["used"] == 101
    finally:
        seg.close()


def test_cache_eviction_fifo_within_a_set(name):
    seg = Segment.create(name, SIZE, slots=2)
    try:
        sets = seg.cache_stats()["slots"] // 8
        same_set = [k for k in (b"k%d" % i for i in range(20000)) if zlib.crc32(k) % sets == 0][:9]
        for k in same_set:
            assert seg.cache_put(k, k * 2)
        assert seg.cache_get(same_set[0]) is None  # oldest of the 9 evicted (C2)
        assert all(seg.cache_get(k) == k * 2 for k in same_set[1:])
        assert seg.cache_stats()["evictions"] == 1
    finally:
        seg.close()


# ---- counters (LAYOUT.md [Series], [Counters]) ------------------------------------------------------------------

ROUTE = (("route", "/q/{name}"), ("status", "200"))


def _count(name, slot, n):
    seg = Segment.attach(name)
    seg.set_slot(slot, "worker")
    for i in range(n):
        seg.counter_add(slot, "qag_requests_total", ROUTE)
        seg.counter_add(slot, "qag_errors_total", (("code", "param_invalid"),), 1)
        seg.histogram_observe(slot, "qag_request_duration_seconds", (("route", "/q/{name}"),), 0.001 * (i % 7))
    seg.counter_add(slot, "qag_requests_total", (("status", "404"), ("route", "/q/{name}")), 5)  # label order free
    seg.gauge_set(slot, "qag_pool_in_use", (), 3)
    seg.set_heartbeat(slot, 99)
    os.kill(os.getpid(), signal.SIGKILL)  # dies without any cleanup: its counts must stay


def test_counters_summed_across_processes_and_kept_after_death(name):
    seg = Segment.create(name, SIZE, slots=4)
    try:
        procs = [FORK.Process(target=_count, args=(name, s, 500)) for s in (0, 1, 2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
            assert p.exitcode == -signal.SIGKILL
        out = {(m["name"], tuple(m["labels"])): m for m in seg.collect()}
        assert out[("qag_requests_total", ROUTE)]["value"] == 1500
        assert out[("qag_requests_total", (("route", "/q/{name}"), ("status", "404")))]["value"] == 15
        assert out[("qag_errors_total", (("code", "param_invalid"),))]["value"] == 1500
        h = out[("qag_request_duration_seconds", (("route", "/q/{name}"),))]
        assert h["count"] == 1500 and h["buckets"][-1][1] == 1500
        assert h["sum"] == pytest.approx(3 * sum(0.001 * (i % 7) for i in range(500)))
        assert h["buckets"][3] == (0.001, 3 * sum(1 for i in range(500) if i % 7 <= 1))
        assert out[("qag_pool_in_use", ())]["value"] == 9
        st = seg.stat()
        s1 = st["process_slots"][1]
        assert s1["role"] == "worker" and s1["pid"] == procs[1].pid and not s1["alive"] and s1["heartbeat_value"] == 99
        assert s1["counters"]['qag_requests_total{route="/q/{name}",status="200"}'] == 500
        # a replacement worker claims slot 1: counters continue, its gauges restart from zero (M1)
        seg.set_slot(1, "worker")
        seg.counter_add(1, "qag_requests_total", ROUTE)
        out = {(m["name"], tuple(m["labels"])): m for m in seg.collect()}
        assert out[("qag_requests_total", ROUTE)]["value"] == 1501
        assert out[("qag_pool_in_use", ())]["value"] == 6
        assert seg.stat()["process_slots"][1]["alive"]
        with pytest.raises(ValueError, match="is a counter"):
            seg.histogram_observe(0, "qag_requests_total", ROUTE, 1.0)
        with pytest.raises(IndexError):
            seg.counter_add(4, "qag_requests_total", ROUTE)
    finally:
        seg.close()


def test_prometheus_collector_renders_the_sum(name):
    from prometheus_client import CollectorRegistry, generate_latest

    from shm.prometheus import ShmCollector
    seg = Segment.create(name, SIZE, slots=2)
    try:
        seg.counter_add(0, "qag_requests_total", ROUTE, 2)
        seg.counter_add(1, "qag_requests_total", ROUTE, 3)
        seg.histogram_observe(1, "qag_query_duration_seconds", (), 0.02)
        reg = CollectorRegistry()
        reg.register(ShmCollector(Segment.attach(name), help={"qag_requests_total": "Calls."}))
        text = generate_latest(reg).decode()
        assert '# HELP qag_requests_total Calls.' in text
        assert 'qag_requests_total{route="/q/{name}",status="200"} 5.0' in text
        assert 'qag_query_duration_seconds_bucket{le="0.025"} 1.0' in text
        assert 'qag_query_duration_seconds_bucket{le="0.01"} 0.0' in text
        assert 'qag_query_duration_seconds_count 1.0' in text
    finally:
        seg.close()


def test_series_table_full_raises(name):
    seg = Segment.create(name, SIZE, slots=2)
    try:
        max_series = seg.stat()["series"]["max"]
        for i in range(max_series):
            seg.counter_add(0, "c", (("i", str(i)),))
        with pytest.raises(shm.SegmentFull):
            seg.counter_add(0, "c", (("i", "one-too-many"),))
    finally:
        seg.close()


# ---- writers' lock (LAYOUT.md [Writer lock]) ----------------------------------------------------------------------

def _hold_lock_and_die(name):
    seg = Segment.attach(name)
    seg._lock.acquire()  # fault injection: die while holding the writers' lock
    os.kill(os.getpid(), signal.SIGKILL)


def test_dead_lock_holder_is_taken_over(name):
    seg = Segment.create(name, SIZE, slots=2)
    try:
        p = FORK.Process(target=_hold_lock_and_die, args=(name,))
        p.start()
        p.join(10)
        assert p.exitcode == -signal.SIGKILL
        assert seg.stat()["lock"]["owner_pid"] == p.pid
        t0 = time.monotonic()
        assert seg.bump("key", "alice") == 1  # K3: no deadlock
        assert time.monotonic() - t0 < 2
        lock = seg.stat()["lock"]
        assert lock["takeovers"] == 1 and lock["owner_pid"] == 0
        assert seg.cache_put(b"a", b"b") and seg.bump("key", "alice") == 2
    finally:
        seg.close()


@pytest.mark.parametrize("owner_start", [0, 123456], ids=["died-before-claim", "died-inside-release"])
def test_ownerless_held_lock_is_taken_over(name, owner_start):
    """K3: the lock held with no owner recorded (its holder died between sem_wait and K2, or between the
    two stores of release) is taken over once lock_seq has not moved for 1 s."""
    seg = Segment.create(name, SIZE, slots=2)
    try:
        seg.bump("key", "a")
        posix_ipc.Semaphore(name + "-w").acquire(0)  # held, and no process will ever post it
        _raw_word(name, 584, owner_start)  # lock_owner_start; lock_owner_pid stays 0
        t0 = time.monotonic()
        assert seg.bump("key", "a") == 2
        assert 0.9 < time.monotonic() - t0 < 4
        assert seg.stat()["lock"]["takeovers"] == 1
        assert seg.bump("key", "a") == 3  # and released normally afterwards
    finally:
        seg.close()


def test_crashed_vector_is_repaired_on_takeover(name):
    """segment_crashed.bin mapped as a live segment with its writers' lock held: C4 miss, then K3 + K4."""
    data = (ROOT / "shm" / "vectors" / "segment_crashed.bin").read_bytes()
    m = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=len(data))
    import mmap
    with mmap.mmap(m.fd, len(data)) as mm:
        mm[:] = data
    m.close_fd()
    posix_ipc.Semaphore(name + "-w", posix_ipc.O_CREX, initial_value=0).close()  # held by the dead writer
    posix_ipc.Semaphore(name + "-r", posix_ipc.O_CREX, initial_value=1).close()
    seg = Segment.attach(name)
    try:
        assert seg.cache_get(b"p:alice\x00orders_by_id") is None  # odd slot: a miss, not a hang
        assert seg.cache_stats()["busy_misses"] == 1
        assert seg.cache_get(b"row:key:alice") == b"\x01\x02\x03"
        assert seg.gen("key", "alice") == 2
        assert seg.cache_put(b"row:key:bob", b"\x04")  # takes the lock over and repairs slot 96
        st = seg.stat()
        assert st["lock"]["takeovers"] == 1 and st["lock"]["dirty_cache_slot"] == 0
        assert st["cache"]["repairs"] == 1 and st["cache"]["used"] == 4
        assert seg.cache_put(b"p:alice\x00orders_by_id", b"rebuilt")
        assert seg.cache_get(b"p:alice\x00orders_by_id") == b"rebuilt"
    finally:
        seg.close()


def test_semaphore_fence_mode_works(name):
    """[Memory ordering]: QAG_SHM_FENCE=sem (the aarch64 path) runs the same protocol on this host."""
    seg = Segment.create(name, SIZE, slots=2)
    try:
        code = (
            "import shm, shm.fence as f; assert f.MODE == 'sem';"
            f"s = shm.Segment.attach({name!r}); s.bump('key','k'); s.cache_put(b'a', b'b' * 100);"
            "assert s.cache_get(b'a') == b'b' * 100; r = s.ring(0); assert r.push(b'rec');"
            "assert r.read(5)[0][1] == b'rec'; s.close(); print('ok')"
        )
        env = {**os.environ, "QAG_SHM_FENCE": "sem", "PYTHONPATH": str(ROOT)}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30,
                             check=False)
        assert out.stdout.strip() == "ok", out.stderr
        assert seg.gen("key", "k") == 1 and seg.cache_get(b"a") == b"b" * 100
    finally:
        seg.close()
