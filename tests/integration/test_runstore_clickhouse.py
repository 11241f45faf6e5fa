"""What only the ClickHouse run store does: exactly once without transactions (insert tokens, views
repaired by replaying the last batch), whole partitions dropped as they age, and the insert-only
user's DDL, tested as text because chDB has no users (CREATE USER fails there with ACCESS_DENIED)."""
from __future__ import annotations

import shutil
import tempfile
import time

import pytest

from qag import entries
from qag.runstore import StoreSettings, open_store
from qag.runstore.clickhouse import writer_user_sql
from qag.runstore.sql import chunks_of


@pytest.fixture()
def ch():
    tmp = tempfile.mkdtemp(prefix="qag-ch-")
    stores = []

    def make(**settings):
        s = open_store(f"chdb://{tmp}/ch", StoreSettings(**settings))
        s.ensure_schema()
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close()
    shutil.rmtree(tmp, ignore_errors=True)


def recs(n, start=0, slot=0, status=200):
    now = time.time_ns() // 1000
    return [(slot, start + i + 1, entries.encode_run(at_us=now, key_name="k", query="q", status=status, rows=1,
                                              request_id=f"r{start + i}")) for i in range(n)]


@pytest.mark.parametrize("n", [20_000, 66_000])
def test_replaying_a_large_last_batch_writes_nothing(ch, n):
    """A restarted recorder replays its last insert (recover()): with the default read and insert
    block sizes a batch above ~10,000 runs was replayed in several blocks whose tokens did not match
    the insert's, and written twice. 66,000 runs also goes as two inserts (one block each at most)."""
    store = ch()
    batch = store.prepare("src", chunks_of(recs(n)))
    assert len(batch.inserts) == (1 if n <= 64_000 else 2)
    store.commit(batch)
    again = ch()  # a new recorder: positions() replays the last insert
    assert again.positions("src") == {0: n}
    assert again.counts() == {"qag_events": n, "qag_history": n, "usage_calls": n}


def test_a_retried_insert_lands_once(ch):
    store = ch()
    batch = store.prepare("src", chunks_of(recs(1000)))
    store.commit(batch)
    store.commit(batch)  # the client saw an error after the server had written it: same ids, same token
    assert store.counts() == {"qag_events": 1000, "qag_history": 1000, "usage_calls": 1000}


def test_a_view_that_missed_the_last_batch_is_repaired_on_recover(ch):
    store = ch()
    store.write_batch("src", recs(500))
    # A crash between the events part and the views' parts: simulated by writing with the views away.
    for v in ("qag_history_mv", "qag_usage_minute_mv"):
        store.client.command(f"DETACH TABLE {v}")
    store.write_batch("src", recs(700, start=500))
    for v in ("qag_history_mv", "qag_usage_minute_mv"):
        store.client.command(f"ATTACH TABLE {v}")
    assert store.counts() == {"qag_events": 1200, "qag_history": 500, "usage_calls": 500}
    assert store.positions("src") == {0: 1200}  # positions() replays the last batch first
    assert store.counts() == {"qag_events": 1200, "qag_history": 1200, "usage_calls": 1200}
    store.recover("src")  # and replaying again changes nothing
    assert store.counts() == {"qag_events": 1200, "qag_history": 1200, "usage_calls": 1200}
    ids = [e["request_id"] for e in store.events_after(0, limit=5000)]
    assert ids == [f"r{i}" for i in range(1200)]


def test_ids_resume_above_the_stored_ones_after_a_restart(ch):
    a = ch()
    _first, last, _n = a.write_batch("src", recs(10))
    a.close()
    b = ch()
    f2, _l2, _ = b.write_batch("src", recs(10, start=10))
    assert f2 > last


def test_sampling_keeps_every_failure_and_usage_stays_exact(ch):
    store = ch(history_sample_rate=0.1)
    store.write_batch("s", recs(5000) + recs(500, start=5000, status=503))
    c = store.counts()
    assert c["qag_events"] == 5500 and c["usage_calls"] == 5500
    kept = store.history(status="5xx", limit=1000)[0]
    assert len(kept) == 500
    assert 300 <= c["qag_history"] - 500 <= 700  # ~10% of 5,000 successes
    store2 = ch(history_sample_rate=1.0)  # a changed rate recreates the view
    store2.write_batch("s", recs(100, start=6000))
    assert store2.counts()["qag_history"] == c["qag_history"] + 100


def test_whole_partitions_are_dropped_as_they_age(ch):
    store = ch(events_retention_hours=1, history_retention_days=1)
    store.write_batch("s", recs(100))
    assert store.prune() == 0
    in_three_days = time.time_ns() // 1_000_000 + 3 * 86_400_000
    assert store.prune(now_ms_=in_three_days) == 1  # one partition per call: never a long stall
    assert store.prune(now_ms_=in_three_days) == 1
    assert store.prune(now_ms_=in_three_days) == 0
    c = store.counts()
    assert c["qag_events"] == 0 and c["qag_history"] == 0 and c["usage_calls"] == 100


def test_a_record_with_wrong_types_is_dropped_not_fatal(ch):
    import msgpack

    store = ch()
    bad = msgpack.packb([1, "yesterday", "k", "q", 1, "c", 200, None, 1, 1, 1, "bad", "worker:0", "http", "/"])
    extra = msgpack.packb([1, time.time_ns() // 1000, "k", "q", 1, "c", 200, None, 1, 1, 1, "later-minor",
                           "worker:0", "http", "/", "a field from 1.1"])
    store.write_batch("s", [(0, 1, entries.encode_run(request_id="a")), (0, 2, bad), (0, 3, extra), (0, 4, b"\xc1")])
    assert [e["request_id"] for e in store.events_after(0)] == ["a", "later-minor"]
    assert store.bad_records == 2 and store.positions("s") == {0: 4}


def test_insert_only_user_ddl_text():
    sql = writer_user_sql("runs", "qag_writer", "s3cret'x", reader="qag_reader", reader_password="r")
    lines = sql.strip().splitlines()
    assert lines[0] == "CREATE USER IF NOT EXISTS qag_writer IDENTIFIED WITH sha256_password BY 's3cret\\'x';"
    writer = [ln for ln in lines if ln.startswith("GRANT") and ln.endswith("TO qag_writer;")]
    assert writer == ["GRANT INSERT, SELECT ON `runs`.qag_events TO qag_writer;"]
    # nothing that changes or removes data, for either user
    for word in ("ALTER", "DELETE", "DROP", "TRUNCATE", "ALL", "CREATE TABLE", "OPTIMIZE"):
        assert word not in sql.replace("CREATE USER", "")
    assert "GRANT SELECT ON `runs`.qag_history TO qag_reader;" in lines
    with pytest.raises(ValueError):
        writer_user_sql("runs; DROP TABLE x")


def test_init_text_creates_the_schema_and_returns_the_grants(ch):
    store = ch()
    text = store.init_text(password="pw")
    assert "GRANT INSERT, SELECT ON `default`.qag_events TO qag_writer;" in text
    tables = {r[0] for r in store.client.query("SELECT name FROM system.tables WHERE database = currentDatabase()")
              .result_rows}
    assert {"qag_events", "qag_history", "qag_usage_minute", "qag_history_mv", "qag_usage_minute_mv"} <= tables


def test_chdb_really_has_no_users(ch):
    """Why the DDL above is tested as text: chDB refuses CREATE USER."""
    store = ch()
    with pytest.raises(Exception, match="ACCESS_DENIED|497|Not enough privileges|not supported"):
        store.client.command("CREATE USER qag_probe IDENTIFIED WITH sha256_password BY 'x'")


def test_a_batch_across_midnight_is_two_inserts_one_per_day(ch):
    from qag.runstore.eventid import IdClock, id_ms

    store = ch()
    midnight = time.time_ns() // 1_000_000 // 86_400_000 * 86_400_000
    store.clock = IdClock(0, clock=lambda: midnight - 1)  # 2,048 ids left in the old day
    batch = store.prepare("s", chunks_of(recs(3000)))
    assert len(batch.inserts) == 2
    (f1, _b1), (f2, _b2) = batch.inserts
    assert id_ms(f1) == midnight - 1 and id_ms(f2) == midnight and f2 - f1 == 2048
    store.commit(batch)
    parts = store.client.query("SELECT uniqExact(partition) FROM system.parts WHERE table = 'qag_events' "
                               "AND active AND database = currentDatabase()").result_rows[0][0]
    assert parts == 2
    assert store.counts()["qag_events"] == 3000 and store.positions("s") == {0: 3000}


def test_several_writers_share_one_clickhouse_without_colliding_and_settle_before_delivery(ch):
    """One recorder per host, one ClickHouse: writer numbers keep ids apart, and with independent
    commits an event is delivered once older than the settle delay."""
    a = ch(writers=2, writer_id=0, events_settle_ms=1500)
    b = ch(writers=2, writer_id=1, events_settle_ms=1500)
    for k in range(6):
        first, _last, _n = (a if k % 2 else b).write_batch(f"host{k % 2}", recs(500, start=k * 500, slot=0))
    # the newest batch is too fresh: another writer may still commit ids below it
    assert all(e["event_id"] < first for e in a.events_after(0, limit=10_000))
    time.sleep(1.6)
    ev = a.events_after(0, limit=10_000)
    ids = [e["event_id"] for e in ev]
    assert len(ev) == 3000 and len(set(ids)) == 3000 and ids == sorted(ids)
    assert {e["event_id"] % 2 for e in ev} == {0, 1}
    assert sorted(e["request_id"] for e in ev) == sorted(f"r{i}" for i in range(3000))
