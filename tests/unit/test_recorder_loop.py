"""The recorder's batching and exactly-once bookkeeping, against in-process rings (the ring API of
shm, without shared memory) and a real SQLite database in memory. The same loop runs against a real
segment in tests/integration/test_recorder_shm.py."""
import threading
import time

import pytest

from qag.entries import encode_run
from qag.recorder import resume_positions, run_recorder
from qag.runstore.sql import SqlRunStore


class FakeRing:
    def __init__(self):
        self.recs = []  # (pos_after, payload)
        self.tail = 0
        self.head = 0
        self.capacity = 1 << 20
        self.lock = threading.Lock()

    def push(self, payload, wait_ms=0):
        with self.lock:
            self.head += 8 + ((len(payload) + 7) & ~7)
            self.recs.append((self.head, payload))
        return True

    def read_from(self, pos, max_records):
        with self.lock:
            assert self.tail <= pos <= self.head, (self.tail, pos, self.head)
            out = [r for r in self.recs if r[0] > pos]
            return out[:max_records]

    def read(self, max_records):
        return self.read_from(self.tail, max_records)

    def release(self, pos):
        with self.lock:
            assert self.tail <= pos <= self.head
            self.tail = pos
            self.recs = [r for r in self.recs if r[0] > pos]


class FakeSource:
    name = "fake"

    def __init__(self, n):
        self.rings = [FakeRing() for _ in range(n)]

    def ring_count(self):
        return len(self.rings)

    def ring(self, i):
        return self.rings[i]


class ObservedStore(SqlRunStore):
    """The real SQLite store, remembering batch sizes and able to fail its next commits."""

    def __init__(self):
        super().__init__(":memory:")
        self.ensure_schema()
        self.sizes = []
        self.fail_next = 0
        self.tails_at_commit = []

    def commit(self, batch):
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("store down")
        out = super().commit(batch)
        self.sizes.append(len(batch.rows))
        return out

    def request_ids(self):
        # the event stream: every run, each in qag_history or qag_events (written once)
        return [e["request_id"] for e in self.events_after(0, limit=100_000)]


def fill(source, per_ring, prefix="r"):
    for s, ring in enumerate(source.rings):
        for i in range(per_ring):
            ring.push(encode_run(key_name=f"k{s}", query="q", request_id=f"{prefix}{s}-{i}"))


def run_until_drained(source, store, timeout=20, **kw):
    stop = threading.Event()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("state", run_recorder(source, store, stop, **kw)))
    t.start()
    deadline = time.monotonic() + timeout
    while any(r.tail != r.head for r in source.rings) and time.monotonic() < deadline:
        time.sleep(0.005)
    stop.set()
    t.join(timeout)
    assert not t.is_alive()
    return out["state"]


def test_batches_never_exceed_batch_max_and_every_run_is_written_once():
    src, store = FakeSource(3), ObservedStore()
    fill(src, 4000)
    state = run_until_drained(src, store, batch_max=1000, batch_ms=1000)
    ids = store.request_ids()
    assert len(ids) == 12000 and len(set(ids)) == 12000
    assert max(store.sizes) <= 1000 and sum(store.sizes) == 12000
    assert state.records == 12000
    assert all(r.tail == r.head for r in src.rings)
    assert store.positions(state.source_id) == {i: r.head for i, r in enumerate(src.rings)}


def test_a_partial_batch_is_written_after_batch_ms():
    src, store = FakeSource(1), ObservedStore()
    stop = threading.Event()
    t = threading.Thread(target=run_recorder, args=(src, store, stop), kwargs={"batch_max": 1000, "batch_ms": 30})
    t.start()
    try:
        time.sleep(0.05)
        t0 = time.monotonic()
        fill(src, 3)
        while len(store.request_ids()) < 3 and time.monotonic() - t0 < 5:
            time.sleep(0.002)
        elapsed = time.monotonic() - t0
        assert len(store.request_ids()) == 3
        assert 0.02 <= elapsed < 1.0, elapsed  # waited for the batch window, not for batch_max
        assert store.sizes == [3]
    finally:
        stop.set()
        t.join(10)


def test_rings_are_released_only_after_a_commit_and_failed_writes_are_retried():
    src, store = FakeSource(2), ObservedStore()
    fill(src, 500)
    store.fail_next = 3
    stop = threading.Event()
    t = threading.Thread(target=run_recorder, args=(src, store, stop), kwargs={"batch_max": 10000, "batch_ms": 5})
    t.start()
    time.sleep(0.08)  # the first attempts fail (50, 100 ms backoff...)
    assert all(r.tail == 0 for r in src.rings), "a tail moved before its batch committed"
    deadline = time.monotonic() + 10
    while any(r.tail != r.head for r in src.rings) and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    t.join(10)
    ids = store.request_ids()
    assert len(ids) == 1000 and len(set(ids)) == 1000


def test_resume_skips_what_was_written_before_a_crash_but_not_released():
    src, store = FakeSource(2), ObservedStore()
    fill(src, 100)
    # A batch committed (positions durable) whose process died before releasing the rings.
    r0 = src.rings[0]
    batch = [(0, p, pl) for p, pl in r0.read_from(0, 60)]  # write_batch takes flat (slot, pos, payload)
    store.write_batch("fake", batch)
    assert r0.tail == 0
    cursor = resume_positions(src.rings, store.positions("fake"))
    assert cursor == {0: batch[-1][1], 1: 0} and r0.tail == batch[-1][1]
    run_until_drained(src, store, batch_max=50)
    ids = store.request_ids()
    assert len(ids) == 200 and len(set(ids)) == 200


def test_positions_from_another_segment_are_ignored():
    src = FakeSource(1)
    fill(src, 5)
    assert resume_positions(src.rings, {0: 10**9}) == {0: 0}


def test_no_ring_starves_the_others():
    src, store = FakeSource(2), ObservedStore()
    fill(src, 3000)
    first_batch_slots = []
    orig = store.prepare

    def prepare(source, chunks):
        if not first_batch_slots:
            first_batch_slots.extend(sorted({s for s, recs in chunks if recs}))
        return orig(source, chunks)

    store.prepare = prepare
    run_until_drained(src, store, batch_max=4000, batch_ms=1000)
    assert first_batch_slots == [0, 1]


def test_undecodable_payloads_are_counted_and_skipped_not_fatal():
    src, store = FakeSource(1), ObservedStore()
    src.rings[0].push(b"\xc1not a record")
    fill(src, 10)
    state = run_until_drained(src, store)
    assert len(store.request_ids()) == 10
    assert state.bad_records == 1
    assert src.rings[0].tail == src.rings[0].head


def test_stop_flushes_what_was_read_and_publish_reports_progress():
    src, store = FakeSource(1), ObservedStore()
    fill(src, 50)
    seen = []
    stop = threading.Event()
    stop.set()  # stop at once: what is read in the first pass is still written
    state = run_recorder(src, store, stop, batch_ms=10_000, publish=lambda s: seen.append(s.last_event_id))
    assert state.records == 50 and len(store.request_ids()) == 50
    assert seen and seen[-1] == state.last_event_id > 0
    assert state.lag_bytes == {0: 0}


@pytest.mark.parametrize("rate", [0.0, 0.25])
def test_history_sampling_keeps_failures_and_usage_stays_exact(rate):
    store = SqlRunStore(":memory:")
    store.settings = type(store.settings)(history_sample_rate=rate)
    store.ensure_schema()
    recs = [(0, i + 1, encode_run(status=500 if i % 10 == 0 else 200, code="query_failed" if i % 10 == 0 else None,
                                 key_name="k", query="q", request_id=str(i), rows=2)) for i in range(4000)]
    store.write_batch("s", recs)
    hist = store._read("SELECT status, count(*) FROM qag_history GROUP BY status")
    by = dict(hist)
    assert by[500] == 400  # every failure
    assert abs(by.get(200, 0) - rate * 3600) <= 3600 * 0.05 + 1
    (usage,) = store.usage(per="day")
    assert (usage["calls"], usage["errors"], usage["rows"]) == (4000, 400, 8000)


def test_stop_drains_but_producers_that_keep_going_cannot_keep_it_alive():
    src, store = FakeSource(1), ObservedStore()
    stop, quit_ = threading.Event(), threading.Event()

    def produce():
        i = 0
        while not quit_.is_set():
            src.rings[0].push(encode_run(request_id=f"x{i}"))
            i += 1
            time.sleep(0.0002)

    p = threading.Thread(target=produce)
    p.start()
    t = threading.Thread(target=run_recorder, args=(src, store, stop), kwargs={"batch_ms": 5, "stop_grace_s": 0.3})
    t.start()
    time.sleep(0.2)
    stop.set()
    t.join(5)
    alive = t.is_alive()
    quit_.set()
    p.join()
    assert not alive
    ids = store.request_ids()
    assert len(ids) == len(set(ids)) > 0
    assert src.rings[0].tail == store.positions("fake")[0]  # released exactly what was written


def test_a_write_that_keeps_failing_at_stop_leaves_the_runs_in_the_rings():
    src, store = FakeSource(1), ObservedStore()
    fill(src, 10)
    store.fail_next = 10**6
    stop = threading.Event()
    stop.set()
    state = run_recorder(src, store, stop, stop_grace_s=0.2)
    assert state.records == 0 and src.rings[0].tail == 0 and state.errors >= 1


def test_retention_runs_under_sustained_load_in_bounded_chunks():
    src, store = FakeSource(1), ObservedStore()
    calls = []
    orig = store.prune
    store.prune = lambda n: calls.append(n) or orig(n)
    stop, quit_ = threading.Event(), threading.Event()

    def produce():
        i = 0
        while not quit_.is_set():
            src.rings[0].push(encode_run(request_id=f"s{i}"))
            i += 1
            if i % 20 == 0:
                time.sleep(0.001)

    p = threading.Thread(target=produce)
    p.start()
    t = threading.Thread(target=run_recorder, args=(src, store, stop),
                         kwargs={"batch_ms": 2, "prune_every_s": 0.05, "prune_rows": 123})
    t.start()
    time.sleep(0.6)
    quit_.set()
    p.join()
    stop.set()
    t.join(10)
    assert len(calls) >= 3 and set(calls) == {123}


def test_a_corrupt_ring_is_skipped_to_its_head_and_the_others_go_on():
    from shm import RingError  # what a ring raises for a record failing its checksum or length

    src, store = FakeSource(2), ObservedStore()
    fill(src, 100)
    bad = src.rings[1]
    good_read = bad.read_from

    def read_from(pos, n):
        recs = good_read(pos, n)
        if pos < bad.head and any(p > 40 * 88 for p, _ in recs):  # a record near the 40th fails its crc
            raise RingError(f"ring 1: record at position {pos} fails its crc32")
        return recs

    bad.read_from = read_from
    state = run_until_drained(src, store, batch_max=30)
    ids = store.request_ids()
    assert len([i for i in ids if i.startswith("r0-")]) == 100  # the healthy ring: every run
    assert len(ids) == len(set(ids))
    assert state.corrupt_skips == 1 and "crc32" in state.last_error
    assert bad.tail == bad.head


def test_after_a_write_is_abandoned_at_stop_no_later_batch_commits():
    """Batch N gives up at stop; batch N+1 must not commit, or its positions would release N's runs."""
    src, store = FakeSource(1), ObservedStore()
    fill(src, 40)
    orig_commit = store.commit
    first = []

    def commit(batch):
        if not first:
            first.append(batch)
        if batch is first[0]:  # the store refuses batch N only: N+1 would go through
            raise ConnectionError("store down")
        return orig_commit(batch)

    store.commit = commit
    stop = threading.Event()
    stop.set()
    state = run_recorder(src, store, stop, batch_max=10, stop_grace_s=0.3)
    assert state.records == 0 and store.request_ids() == [] and src.rings[0].tail == 0


def test_caught_up_it_polls_once_per_idle_period_not_once_per_run():
    """Runs arriving one by one (a worker serving calls) are picked up by a poll every idle_sleep_ms,
    not by waking for each: a recorder that woke several times per run cost the workers on its cores
    23% more CPU per call (bench/recorder.py --ab). Every run is still written."""
    src, store = FakeSource(1), ObservedStore()
    ring = src.rings[0]
    reads = [0]
    plain = ring.read_from

    def counted(pos, n):
        reads[0] += 1
        return plain(pos, n)

    ring.read_from = counted
    stop = threading.Event()
    t = threading.Thread(target=run_recorder, args=(src, store, stop),
                         kwargs={"batch_ms": 50, "idle_sleep_ms": 10})
    t.start()
    t0 = time.monotonic()
    for i in range(300):  # one run every ~2 ms for ~0.6 s
        ring.push(encode_run(request_id=f"t{i}"))
        time.sleep(0.002)
    elapsed = time.monotonic() - t0
    stop.set()
    t.join(10)
    assert store.request_ids() == [f"t{i}" for i in range(300)]
    # about one read per 10 ms poll (plus one per batch and the stop's drain); per run would be >= 300
    assert reads[0] <= elapsed / 0.010 * 1.5 + 30, (reads[0], elapsed)


def test_a_ring_failing_otherwise_than_by_a_corrupt_record_stops_the_recorder():
    """Only shm.RingError (recognised by its class) skips a ring; any other failure of a read is raised."""
    src, store = FakeSource(1), ObservedStore()
    fill(src, 10)

    def read_from(pos, n):
        raise ValueError("not a ring error")

    src.rings[0].read_from = read_from
    with pytest.raises(ValueError, match="not a ring error"):
        run_recorder(src, store, threading.Event())
    assert src.rings[0].tail == 0 and store.request_ids() == []


def test_the_recorder_process_batches_by_the_hint_each_store_declares():
    from qag.recorder.__main__ import batch_max_hint
    from qag.runstore.clickhouse import ClickHouseRunStore

    assert batch_max_hint(":memory:") == SqlRunStore(":memory:").batch_max_hint == 5000
    assert batch_max_hint("postgresql://u@h/db") == SqlRunStore.PG_BATCH_MAX_HINT == 20_000
    assert batch_max_hint("chdb:///tmp/x") == batch_max_hint("https://h") == ClickHouseRunStore.batch_max_hint == 64_000
