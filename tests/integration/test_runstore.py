"""Run stores against real engines: SQLite (a file), PostgreSQL (qag_rec_test) and ClickHouse (chDB).

100,000 runs through each store: events, history and usage each account for every one, none lost,
none duplicated; a reader resuming from any id misses none and repeats none."""
from __future__ import annotations

import bisect
import os
import random
import shutil
import tempfile
import threading
import time

import pytest

from qag.entries import encode_run
from qag.runstore import StoreSettings, open_store
from tests.conftest import pg_fresh_db

N = 100_000
KEYS = [f"key{i}" for i in range(7)] + [None]
QUERIES = [f"q{i}" for i in range(5)]


def pg_fresh(name="qag_rec_test") -> str:
    return pg_fresh_db(name)


def make_url(kind, tmp, db="qag_rec_test"):
    if kind == "sqlite":
        return os.path.join(tmp, "runs.db")
    if kind == "postgresql":
        return pg_fresh(db)  # one database per test: the module's burst stays open in qag_rec_test
    return f"chdb://{tmp}/ch"


def run(i, now_us, slot=None):
    """The i-th run of the burst: deterministic fields so every total can be checked."""
    status = 500 if i % 17 == 0 else (404 if i % 29 == 0 else 200)
    return encode_run(at_us=now_us - (N - i) * 500, key_name=KEYS[i % len(KEYS)], query=QUERIES[i % len(QUERIES)],
                     version=1 + i % 3, connection="pg", status=status,
                     code=None if status == 200 else ("query_failed" if status == 500 else "query_not_found"),
                     rows=i % 11, duration_us=100 + i % 1000, bytes=64, request_id=f"req-{i}",
                     served_by=f"worker:{i % 2}", transport="http", route="/q/{name}")


@pytest.fixture(scope="module", params=["sqlite", "postgresql", "clickhouse"])
def loaded(request):
    """A store holding the 100,000-run burst (2 producer slots, batches of 5,000)."""
    kind = request.param
    tmp = tempfile.mkdtemp(prefix=f"qag-rs-{kind}-")
    url = make_url(kind, tmp)
    store = open_store(url, StoreSettings())
    store.ensure_schema()
    now_us = time.time_ns() // 1000
    recs = [(i % 2, i // 2 + 1, run(i, now_us)) for i in range(N)]
    t = time.perf_counter()
    for j in range(0, N, 5000):
        store.write_batch("burst", recs[j:j + 5000])
    rate = N / (time.perf_counter() - t)
    print(f"{kind}: {rate:,.0f} runs/s written")
    store.all_events = all_events(store)  # read once, compared by several tests
    yield kind, store, now_us
    store.close()
    shutil.rmtree(tmp, ignore_errors=True)


def all_events(store, key=None, page=10_000):
    out, last = [], 0
    while True:
        items = store.events_after(last, key_name=key, limit=page)
        if not items:
            return out
        out += items
        last = items[-1]["event_id"]


def all_history(store):
    out, cursor = [], None
    while True:
        items, cursor = store.history(limit=1000, cursor=cursor)
        out += items
        if cursor is None:
            return out


def test_every_run_once_in_events_history_and_usage(loaded):
    _kind, store, _now = loaded
    ev = store.all_events
    assert len(ev) == N
    assert len({e["request_id"] for e in ev}) == N
    ids = [e["event_id"] for e in ev]
    assert ids == sorted(ids) and len(set(ids)) == N and ids[-1] < 2**53

    hist, cursor, pages = [], None, 0
    while True:
        items, cursor = store.history(limit=1000, cursor=cursor)
        hist += items
        pages += 1
        if cursor is None:
            break
    assert pages == N // 1000
    assert len(hist) == N and len({h["request_id"] for h in hist}) == N
    assert [h["event_id"] for h in hist] == ids[::-1]  # newest first

    usage = store.usage(per="minute")
    assert sum(u["calls"] for u in usage) == N
    assert sum(u["errors"] for u in usage) == sum(1 for i in range(N) if i % 17 == 0 or i % 29 == 0)
    assert sum(u["rows"] for u in usage) == sum(i % 11 for i in range(N))
    assert store.positions("burst") == {0: N // 2, 1: N // 2}


def test_run_item_fields(loaded):
    _kind, store, now_us = loaded
    items, _ = store.history(limit=1)
    item = items[0]
    assert list(item) == ["event_id", "at", "query", "version", "key_name", "connection_name", "status", "code",
                          "rows", "duration_ms", "request_id", "served_by", "error"]
    assert item["error"] is None  # history's own field (administrators): the database's words of a failure
    assert "error" not in store.events_after(0, limit=1)[0], "the event stream never carries it"
    i = N - 1
    assert item["request_id"] == f"req-{i}" and item["query"] == QUERIES[i % 5] and item["version"] == 1 + i % 3
    assert item["key_name"] == KEYS[i % len(KEYS)] and item["connection_name"] == "pg"
    assert item["duration_ms"] == (100 + i % 1000) / 1000 and item["served_by"] == "worker:1"
    at = now_us - (N - i) * 500
    assert item["at"] == time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at // 10**6)) + f".{at // 1000 % 1000:03d}Z"


def test_history_filters(loaded):
    _kind, store, now_us = loaded
    items, _ = store.history(key="key3", query="q1", limit=1000)
    want = [i for i in range(N) if KEYS[i % 8] == "key3" and i % 5 == 1]
    assert [x["request_id"] for x in items] == [f"req-{i}" for i in reversed(want)][:1000]
    items, cur = store.history(status="5xx", limit=1000)
    assert all(x["status"] == 500 for x in items) and len(items) == 1000 and cur
    items, _ = store.history(status=404, key="key0", limit=1000)
    assert {x["status"] for x in items} == {404} and {x["key_name"] for x in items} == {"key0"}
    # a time window: runs i in [40000, 40100)
    since, until = now_us - (N - 40000) * 500, now_us - (N - 40100) * 500
    items, _ = store.history(since=since, until=until, limit=1000)
    assert sorted(int(x["request_id"][4:]) for x in items) == list(range(40000, 40100))
    with pytest.raises(ValueError):
        store.history(cursor="not-a-cursor")


def test_usage_periods_and_partial_minute_edges(loaded):
    _kind, store, now_us = loaded
    # runs i in [12345, 67890): the window starts and ends inside minutes, so its edges come from events
    since, until = now_us - (N - 12345) * 500, now_us - (N - 67890) * 500
    for per in ("minute", "hour", "day"):
        got = store.usage(per=per, since=since, until=until)
        assert sum(u["calls"] for u in got) == 67890 - 12345, per
        assert sum(u["rows"] for u in got) == sum(i % 11 for i in range(12345, 67890))
    got = store.usage(per="day", key="key2", query="q2")
    assert sum(u["calls"] for u in got) == sum(1 for i in range(N) if i % 8 == 2 and i % 5 == 2)
    assert all(u["period"].endswith("T00:00:00.000Z") for u in got)


def test_resuming_from_any_id_misses_none_and_repeats_none(loaded):
    _kind, store, _now = loaded
    ev = store.all_events
    ids = [e["event_id"] for e in ev]
    rnd = random.Random(5)
    starts = [0, ids[0] - 1, ids[-1]] + rnd.sample(ids, 60) + [rnd.randrange(ids[0], ids[-1]) for _ in range(60)]
    for s in starts:
        k = bisect.bisect_right(ids, s)
        got = store.events_after(s, limit=500)
        assert [g["event_id"] for g in got] == ids[k:k + 500]
    # a client that reconnects at random points, carrying its last id, sees the whole log once
    seen, last = [], 0
    while True:
        got = store.events_after(last, limit=rnd.randint(1, 10000))
        if not got:
            break
        seen += [g["event_id"] for g in got]
        # usually from the last id it got; sometimes from an earlier one it had (a lost tail)
        last = got[-1]["event_id"] if rnd.random() < 0.9 else rnd.choice(seen[-2000:])
        seen = seen[:bisect.bisect_right(seen, last)]
    assert seen == ids
    # a key sees its own runs only
    mine = all_events(store, key="key5", page=3000)
    assert [e["event_id"] for e in mine] == [e["event_id"] for e in ev if e["key_name"] == "key5"]


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_sql_retention_deletes_in_bounded_chunks(kind, tmp_path):
    # history keeps failures only: the 2,700 successes live in qag_events alone (each run is written once)
    store = open_store(make_url(kind, str(tmp_path), "qag_rec_test_retention"), StoreSettings(
        events_retention_hours=1, history_retention_days=2, usage_retention_days=3, history_sample_rate=0.0))
    store.ensure_schema()
    now = time.time_ns() // 1000
    store.write_batch("s", [(0, i + 1, run(i, now)) for i in range(3000)])
    failures = sum(1 for i in range(3000) if i % 17 == 0 or i % 29 == 0)
    assert store.counts() == {"qag_events": 3000, "qag_history": failures, "usage_calls": 3000}
    assert store.prune(1000) == 0  # nothing old yet
    later = time.time_ns() // 1_000_000 + 2 * 3_600_000  # events expire, history and usage not yet
    deleted = [store.prune(1000, now_ms_=later) for _ in range(4)]
    assert deleted == [1000, 1000, 3000 - failures - 2000, 0]
    c = store.counts()
    # (counts() reads the event window at the real time: history's failures are still in it)
    assert c["qag_events"] == failures and c["qag_history"] == failures and c["usage_calls"] == 3000
    much_later = later + 5 * 86_400_000
    while store.prune(1000, now_ms_=much_later):
        pass
    assert store.counts() == {"qag_events": 0, "qag_history": 0, "usage_calls": 0}
    store.close()


def test_postgresql_concurrent_writers_commit_in_id_order():
    """Two recorders (two hosts) on one PostgreSQL: a reader that only ever asks for ids above the last
    it saw still sees every run, because ids are minted under a row lock held until commit."""
    url = pg_fresh("qag_rec_test_order")
    stores = [open_store(url, StoreSettings()) for _ in range(2)]
    stores[0].ensure_schema()
    reader = open_store(url, StoreSettings())
    now = time.time_ns() // 1000
    done = threading.Event()

    def write(w):
        for b in range(40):
            stores[w].write_batch(f"host{w}", [(0, b * 100 + i + 1, run(w * 10000 + b * 100 + i, now))
                                               for i in range(100)])

    ts = [threading.Thread(target=write, args=(w,)) for w in range(2)]
    for t in ts:
        t.start()
    seen, last = [], 0
    while True:
        finished = done.is_set()
        got = reader.events_after(last, limit=10_000)
        if got:
            seen += [g["event_id"] for g in got]
            last = got[-1]["event_id"]
        elif finished:
            break
        if not any(t.is_alive() for t in ts):
            done.set()
    allids = [e["event_id"] for e in all_events(reader)]
    assert len(allids) == 8000 and seen == allids
    for s in stores + [reader]:
        s.close()


def test_sql_record_with_wrong_types_is_dropped_not_fatal(tmp_path):
    import msgpack

    for url in (str(tmp_path / "t.db"), pg_fresh("qag_rec_test_types")):
        store = open_store(url, StoreSettings())
        store.ensure_schema()
        bad = msgpack.packb([1, "yesterday", "k", "q", 1, "c", 200, None, 1, 1, 1, "bad", "worker:0", "http", "/"])
        nul = encode_run(key_name="a\x00b", request_id="nul")
        recs = [(0, 1, encode_run(request_id="a")), (0, 2, bad), (0, 3, nul), (0, 4, encode_run(request_id="b\tc\\d"))]
        store.write_batch("s", recs)
        assert [e["request_id"] for e in store.events_after(0)] == ["a", "b\tc\\d"]
        assert store.bad_records == 2 and store.positions("s") == {0: 4}
        store.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_sql_each_run_written_once_and_sampled_history_keeps_the_stream_whole(kind, tmp_path):
    """Each run lands in one table: history when it keeps it (failures always), else qag_events; the
    event stream reads both, so it still holds every run once, in id order, and usage stays exact."""
    store = open_store(make_url(kind, str(tmp_path), "qag_rec_test_once"), StoreSettings(history_sample_rate=0.3))
    store.ensure_schema()
    now = time.time_ns() // 1000
    n = 6000
    for b in range(3):  # three batches: ids and positions continue across them
        store.write_batch("s", [(i % 2, i + 1, run(i, now)) for i in range(b * 2000, (b + 1) * 2000)])
    ev = all_events(store, page=700)
    assert [e["request_id"] for e in ev] == [f"req-{i}" for i in range(n)]
    failures = {f"req-{i}" for i in range(n) if i % 17 == 0 or i % 29 == 0}
    hist = {e["request_id"] for e in all_history(store)}
    assert failures <= hist and 0.2 < (len(hist) - len(failures)) / (n - len(failures)) < 0.4
    only_events = {r[0] for r in store._read("SELECT request_id FROM qag_events")}
    assert only_events.isdisjoint(hist) and len(only_events) + len(hist) == n
    assert store.counts() == {"qag_events": n, "qag_history": len(hist), "usage_calls": n}
    (day,) = store.usage(per="day", since=now - 86_400_000_000, until=now + 1)
    assert (day["calls"], day["errors"], day["rows"]) == (n, len(failures), sum(i % 11 for i in range(n)))
    # a key sees its own runs only, from both tables
    assert [e["request_id"] for e in all_events(store, key="key2")] == [
        f"req-{i}" for i in range(n) if KEYS[i % len(KEYS)] == "key2"]
    store.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_sql_store_of_layout_1_is_migrated_once(kind, tmp_path):
    """A store written by the layout that copied every run into both tables: ensure_schema() drops the
    event table's copies of history's runs once, so the stream (which now reads both) repeats none."""
    url = make_url(kind, str(tmp_path), "qag_rec_test_migrate")
    store = open_store(url, StoreSettings())
    store.ensure_schema()
    now = time.time_ns() // 1000
    store.write_batch("s", [(0, i + 1, run(i, now)) for i in range(500)])
    # back to layout 1: every run in qag_events too, no layout mark
    cols = ("event_id, at_us, key_name, query, version, connection_name, status, code, \"rows\", duration_us, "
            "bytes, request_id, served_by, transport, route")
    with store._lock:
        if store.pg:
            with store.conn.cursor() as cur:
                cur.execute(f"INSERT INTO qag_events ({cols}) SELECT {cols} FROM qag_history")
                cur.execute("DROP TABLE qag_runstore_layout")
            store.conn.commit()
        else:
            store.conn.execute(f"INSERT INTO qag_events ({cols}) SELECT {cols} FROM qag_history")
            store.conn.execute("DROP TABLE qag_runstore_layout")
    assert len(all_events(store)) == 1000  # the copies, seen twice before the migration
    again = open_store(url, StoreSettings())
    again.ensure_schema()
    again.ensure_schema()  # idempotent
    assert [e["request_id"] for e in all_events(again)] == [f"req-{i}" for i in range(500)]
    assert again.counts() == {"qag_events": 500, "qag_history": 500, "usage_calls": 500}
    store.close()
    again.close()
