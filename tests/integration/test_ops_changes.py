"""The change watcher against a real segment and real stores: it resumes from the position it left in the
segment (shm/LAYOUT.md W1), bumps every generation when it cannot tell (W3, G4), and workers' generations are
trusted only while it is caught up (W2); change numbers commit in order on PostgreSQL (store migration 2)."""
from __future__ import annotations

import threading
import time

import pytest

import shm
from qag.server.arbiter import watcher_slot
from qag.server.changes import ChangeWatcher, WatchedGenerations, watcher_current
from qag.store import Store
from tests.conftest import pg_fresh_db


@pytest.fixture()
def seg():
    name = shm.segment_name(f"ops-changes-{time.time_ns()}")
    s = shm.Segment.create(name, 4 << 20, slots=8)
    yield s
    s.unlink()
    s.close()


def _store(home) -> Store:
    st = Store(home=str(home))
    st.migrate()
    return st


def _watcher(store, seg) -> ChangeWatcher:
    return ChangeWatcher(store, seg, watcher_slot(seg.slots), threading.Event())


def test_w3_new_segment_bumps_everything_then_w1_publishes_position(tmp_path, seg):
    store = _store(tmp_path)
    store.create_key("t", "a", {"queries": ["*"]}, True, None, "")
    slot = watcher_slot(seg.slots)
    w = _watcher(store, seg)
    assert not watcher_current(seg, slot)  # claimed, not caught up yet
    before = (seg.gen("key", "a"), seg.gen("query", "anything"), seg.global_gen())
    w.catch_up()
    assert (seg.gen("key", "a"), seg.gen("query", "anything")) == (before[0] + 1, before[1] + 1)
    assert w.full_bumps == 1 and w.applied == 0
    assert seg.heartbeat(slot)[1] == store.change_position() + 1
    assert watcher_current(seg, slot)


def test_w1_restarted_watcher_applies_what_it_missed_and_only_that(tmp_path, seg):
    store = _store(tmp_path)
    store.create_key("t", "a", {"queries": ["*"]}, True, None, "")
    store.create_key("t", "b", {"queries": ["*"]}, True, None, "")
    _watcher(store, seg).catch_up()
    # the watcher dies here; a revocation commits while none runs
    store.update_key("t", "a", None, {"active": False})
    ga, gb, gq = seg.gen("key", "a"), seg.gen("key", "b"), seg.gen("query", "q")
    w = _watcher(store, seg)
    assert w.position == store.change_position() - 1
    w.catch_up()
    assert seg.gen("key", "a") == ga + 1  # the missed revocation is applied ...
    assert (seg.gen("key", "b"), seg.gen("query", "q")) == (gb, gq)  # ... and nothing else is invalidated
    assert w.full_bumps == 0 and w.applied == 1


def test_w3_position_the_store_has_not_reached_bumps_everything(tmp_path, seg):
    store = _store(tmp_path / "one")
    for n in "abc":
        store.create_key("t", n, {"queries": ["*"]}, True, None, "")
    _watcher(store, seg).catch_up()
    other = _store(tmp_path / "two")  # a store restored from an older backup, say
    gq = seg.gen("query", "q")
    w = _watcher(other, seg)
    w.catch_up()
    assert w.full_bumps == 1 and seg.gen("query", "q") == gq + 1
    assert seg.heartbeat(watcher_slot(seg.slots))[1] == other.change_position() + 1


def test_w2_generations_are_trusted_only_while_the_watcher_is_caught_up(tmp_path, seg):
    store = _store(tmp_path)
    w = _watcher(store, seg)
    gens = WatchedGenerations(seg, watcher_slot(seg.slots), stale_s=0.3)
    first, second = gens.gen("key", "a"), gens.gen("key", "a")
    assert first != second and first >= 1 << 62  # not caught up: no cached entry can match
    w.catch_up()
    assert gens.current() and gens.gen("key", "a") == seg.gen("key", "a")
    assert gens.global_gen() == seg.global_gen()
    time.sleep(0.4)  # no beat for longer than stale_s: a hung watcher
    assert not gens.current() and gens.gen("key", "a") >= 1 << 62
    w.catch_up()
    assert gens.current()
    w.not_current("the store went away")
    assert not gens.current()


def test_change_numbers_commit_in_order_on_postgresql():
    """A change that took its number first but commits last cannot be overtaken: the next change waits for it
    (so "applied up to N" never skips a change still in flight)."""
    import psycopg2
    dsn = pg_fresh_db("qag_ops_changes_seq")
    store = Store(home="/nonexistent", database_url=dsn)
    store.migrate()
    store.create_key("t", "a", {"queries": ["*"]}, True, None, "")
    first = psycopg2.connect(dsn)
    cur = first.cursor()
    cur.execute("UPDATE qag_change_seq SET n = n + 1 WHERE id = 1")  # the store's audit() protocol, held open
    second = threading.Thread(target=store.update_key, args=("t", "a", None, {"active": False}))
    second.start()
    second.join(0.5)
    assert second.is_alive(), "a second change took a number while the first was uncommitted"
    cur.execute("SELECT n FROM qag_change_seq WHERE id = 1")
    n = cur.fetchone()[0]
    cur.execute("INSERT INTO qag_audit (at, actor, action, entity, name, seq) VALUES ('x', 't', 'u', 'api_key', "
                "'a', %s)", (n,))
    first.commit()
    second.join(5)
    assert not second.is_alive()
    assert store.changes_since(n - 1) == [(n, "api_key", "a"), (n + 1, "api_key", "a")]
    first.close()
    store.close()


@pytest.mark.parametrize("engine", ["sqlite", "postgres"])
def test_a_change_written_without_a_number_gets_one_and_is_applied(tmp_path, seg, engine):
    """A writer that does not take a sequence number (a host on the previous version, a script) still reaches
    every watcher: the store numbers the audit row itself (migration 3)."""
    if engine == "postgres":
        store = Store(home=str(tmp_path), database_url=pg_fresh_db("qag_ops_changes_nonumber"))
        store.migrate()
    else:
        store = _store(tmp_path)
    store.create_key("t", "a", {"queries": ["*"]}, True, None, "")
    w = _watcher(store, seg)
    w.catch_up()
    ga = seg.gen("key", "a")

    def old_writer(cur):  # what the code before migration 2 wrote: no seq
        cur.execute("UPDATE qag_api_keys SET active = 0 WHERE name = 'a'")
        cur.execute("INSERT INTO qag_audit (at, actor, action, entity, name) VALUES ('x', 'old', 'update', "
                    "'api_key', 'a')")
    store.run(old_writer, write=True)
    w.catch_up(check_position=False)
    assert seg.gen("key", "a") == ga + 1
    assert store.changes_since(store.change_position() - 1) == [(store.change_position(), "api_key", "a")]
    store.close()
