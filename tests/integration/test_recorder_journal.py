"""The run journal (qag/recorder/journal.py) on a real directory, and the recorder spilling into it
while its store is away: framing (length + crc, a torn tail cut off, never misread), its bound, its
positions across restarts, and every run written to the store exactly once, in order, afterwards."""
from __future__ import annotations

import os
import threading
import time

import pytest

from qag import entries
from qag.recorder import run_recorder
from qag.recorder.journal import FILE_HEADER, FRAME_HEADER, Journal, JournalError, JournalFull
from qag.runstore.sql import SqlRunStore
from tests.conftest import unlink_segment
from tests.unit.test_recorder_loop import FakeSource, fill


def chunk(slot, start, n, prefix="r"):
    return (slot, [((start + i + 1) * 16, entries.encode_run(at_us=1, request_id=f"{prefix}{slot}-{start + i}"))
                   for i in range(n)])


def test_frames_read_back_in_order_and_survive_reopening(tmp_path):
    j = Journal(str(tmp_path / "j"), file_bytes=4096)
    ends = [j.append("src", {0: (k + 1) * 160}, [chunk(0, k * 10, 10)]) for k in range(20)]
    assert ends == sorted(ends) and j.pending_runs == 200
    assert len(j.files) > 1  # rotated at file_bytes
    got = j.read(0, 10**9)
    assert [f[0] for f in got] == ends
    assert [p[1] for f in got for p in f[2][0][1]] == [p[1] for k in range(20) for p in chunk(0, k * 10, 10)[1]]
    j.close()
    j2 = Journal(str(tmp_path / "j"), file_bytes=4096)
    assert (j2.drained, j2.end, j2.pending_runs, j2.torn_bytes) == (0, ends[-1], 200, 0)
    assert j2.ring_positions("src") == {0: 3200} and j2.ring_positions("other") == {}
    assert j2.id == j.id and j2.source == j.source


def test_a_torn_tail_is_cut_off_and_never_misread(tmp_path):
    d = str(tmp_path / "j")
    j = Journal(d)
    j.append("src", {0: 160}, [chunk(0, 0, 10)])
    end = j.append("src", {0: 320}, [chunk(0, 10, 10)])
    path = j.files[-1].path
    j.close()
    size = os.path.getsize(path)
    # a crash in the middle of the second frame: half of it on disk
    with open(path, "r+b") as f:
        f.truncate(size - 40)
    j = Journal(d)
    assert j.pending_runs == 10 and j.end < end and j.torn_bytes > 0
    assert [p[1] for p in j.read(0, 100)[0][2][0][1]] == [p[1] for p in chunk(0, 0, 10)[1]]
    assert os.path.getsize(path) == FILE_HEADER.size + j.end  # cut, so the next frame follows a whole one
    # a flipped byte inside the last frame's body: its crc fails, the frame is dropped
    e2 = j.append("src", {0: 320}, [chunk(0, 10, 10)])
    j.close()
    with open(path, "r+b") as f:
        f.seek(FILE_HEADER.size + e2 - 5)
        b = f.read(1)
        f.seek(FILE_HEADER.size + e2 - 5)
        f.write(bytes([b[0] ^ 0xFF]))
    j = Journal(d)
    assert j.pending_runs == 10 and j.torn_bytes == FRAME_HEADER.size + (e2 - j.end - FRAME_HEADER.size)
    # garbage after the last frame (a header that promises more than the file holds)
    j.close()
    with open(path, "ab") as f:
        f.write(FRAME_HEADER.pack(0x4652514A, 1 << 20, 5, 0) + b"xx")
    j = Journal(d)
    assert j.pending_runs == 10 and len(j.read(0, 100)) == 1


def test_the_bound_refuses_frames_past_it_and_draining_frees_room(tmp_path):
    j = Journal(str(tmp_path / "j"), max_bytes=5000, file_bytes=2000)
    ends = []
    with pytest.raises(JournalFull):
        while True:
            ends.append(j.append("src", {0: 1}, [chunk(0, len(ends) * 10, 10)]))
    assert j.pending_bytes <= 5000
    files_before = len(j.files)
    j.mark_drained(ends[-1])
    assert j.pending_bytes == 0 and j.pending_runs == 0
    assert len(j.files) == 1 and len(j.files) < files_before
    e = j.append("src", {0: 2}, [chunk(0, 0, 10)])
    assert e > ends[-1]  # positions only increase
    j.close()
    j = Journal(str(tmp_path / "j"), max_bytes=5000)
    assert j.drained == ends[-1] and j.end == e  # an emptied journal keeps its position across a restart


def test_one_recorder_per_journal(tmp_path):
    j = Journal(str(tmp_path / "j"))
    with pytest.raises(JournalError):
        Journal(str(tmp_path / "j"))
    j.close()
    Journal(str(tmp_path / "j")).close()


class FlakyStore(SqlRunStore):
    """The real SQLite store that can be 'down': every write and position read then fails."""

    def __init__(self, path):
        super().__init__(path)
        self.ensure_schema()
        self.down = False

    def _check(self):
        if self.down:
            raise ConnectionError("store down")

    def commit(self, batch):
        self._check()
        return super().commit(batch)

    def positions(self, source):
        self._check()
        return super().positions(source)

    def request_ids(self):
        return [e["request_id"] for e in self.events_after(0, limit=1_000_000)]


def start(src, store, journal, **kw):
    stop = threading.Event()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("state", run_recorder(
        src, store, stop, journal=journal, batch_ms=10, spill_after_s=0.2, **kw)))
    t.start()
    return stop, t, out


def wait(pred, timeout=20):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def expected(per_ring, rings, prefix="r"):
    return {f"{prefix}{s}-{i}" for s in range(rings) for i in range(per_ring)}


def test_store_away_rings_keep_draining_into_the_journal_then_everything_lands_once_in_order(tmp_path):
    src, store = FakeSource(2), FlakyStore(str(tmp_path / "runs.db"))
    j = Journal(str(tmp_path / "j"))
    stop, t, out = start(src, store, j, batch_max=500)
    try:
        fill(src, 300, "a")
        wait(lambda: len(store.request_ids()) == 600)
        store.down = True
        for k in range(5):  # runs keep coming while the store is away: the rings still empty
            fill(src, 300, f"b{k}-")
            wait(lambda: all(r.tail == r.head for r in src.rings))
        assert j.pending_runs == 3000 and len(store.request_ids()) == 600
        store.down = False
        fill(src, 300, "c")
        wait(lambda: len(store.request_ids()) == 600 * 7 and j.pending_bytes == 0)
    finally:
        stop.set()
        t.join(20)
    ids = store.request_ids()
    want = expected(300, 2, "a") | expected(300, 2, "c")
    for k in range(5):
        want |= expected(300, 2, f"b{k}-")
    assert len(ids) == len(set(ids)) == len(want) and set(ids) == want
    # in order: the journal's runs before the newer ones, each ring's runs in the order they were made
    pos = {rid: i for i, rid in enumerate(ids)}
    for s in range(2):
        seq = [f"a{s}-{i}" for i in range(300)] + [f"b{k}-{s}-{i}" for k in range(5) for i in range(300)] + \
              [f"c{s}-{i}" for i in range(300)]
        assert [pos[x] for x in seq] == sorted(pos[x] for x in seq)
    assert out["state"].spilled >= 3000 and out["state"].store_up


def test_a_recorder_restarted_while_the_store_is_away_duplicates_nothing(tmp_path):
    src, store = FakeSource(2), FlakyStore(str(tmp_path / "runs.db"))
    jdir = str(tmp_path / "j")
    j = Journal(jdir)
    stop, t, _ = start(src, store, j, batch_max=200)
    fill(src, 500, "a")
    wait(lambda: len(store.request_ids()) == 1000)
    store.down = True
    fill(src, 500, "b")
    wait(lambda: all(r.tail == r.head for r in src.rings))
    stop.set()
    t.join(20)
    j.close()
    # a new recorder, store still away, more runs; then a third with the store back
    j = Journal(jdir)
    assert j.pending_runs == 1000
    stop, t, _ = start(src, store, j, batch_max=200)
    fill(src, 500, "c")
    wait(lambda: all(r.tail == r.head for r in src.rings))
    stop.set()
    t.join(20)
    j.close()
    store.down = False
    j = Journal(jdir)
    stop, t, _ = start(src, store, j, batch_max=200)
    wait(lambda: len(store.request_ids()) >= 3000 and j.pending_bytes == 0)
    stop.set()
    t.join(20)
    ids = store.request_ids()
    assert len(ids) == len(set(ids)) == 3000
    assert set(ids) == expected(500, 2, "a") | expected(500, 2, "b") | expected(500, 2, "c")


def test_a_full_journal_leaves_the_rest_in_the_rings_and_loses_nothing_itself(tmp_path):
    src, store = FakeSource(1), FlakyStore(str(tmp_path / "runs.db"))
    j = Journal(str(tmp_path / "j"), max_bytes=20_000)
    store.down = True
    stop, t, out = start(src, store, j, batch_max=50)
    try:
        fill(src, 2000, "a")
        wait(lambda: out.get("state") is None and j.pending_bytes > 15_000)
        time.sleep(0.3)
        assert src.rings[0].tail < src.rings[0].head  # the rest waits in the ring
        store.down = False
        wait(lambda: len(store.request_ids()) == 2000)
    finally:
        stop.set()
        t.join(20)
    ids = store.request_ids()
    assert ids == [f"a0-{i}" for i in range(2000)]


@pytest.mark.parametrize("url", ["postgresql://postgres@127.0.0.1:{port}/postgres", "http://127.0.0.1:{port}"])
def test_history_and_usage_answer_503_store_unavailable_when_the_run_store_cannot_be_reached(app_client, url):
    from tests.conftest import free_port

    app_client.app_obj.run_store_url = url.format(port=free_port())  # nothing listens there
    for path in ("/api/v1/history", "/api/v1/usage"):
        r = app_client.simulate_get(path, headers={"X-API-Key": "adm"})
        assert r.status_code == 503, (path, r.status_code, r.text)
        assert r.json["code"] == "store_unavailable" and r.json["request_id"]
        assert "run store" in r.json["error"] and r.headers.get("Retry-After")


def test_history_with_a_bad_filter_is_still_400(app_client, tmp_path):
    app_client.app_obj.run_store_url = str(tmp_path / "runs.db")
    r = app_client.simulate_get("/api/v1/history", params={"since": "yesterday"}, headers={"X-API-Key": "adm"})
    assert r.status_code == 400 and r.json["code"] == "invalid_filter"


def test_recorder_sigkilled_during_the_outage_and_during_the_drain_loses_and_duplicates_nothing(tmp_path):
    """`python -m qag.recorder` on a real segment, producers in other processes; the SQLite store is
    locked by this test (the recorder's commits wait), the recorder is SIGKILLed at random moments while
    it spills, the lock goes, and it is SIGKILLed again while the journal drains: every run once."""
    import random
    import signal
    import sqlite3
    import subprocess
    import sys
    import uuid

    from shm import Segment
    from tests.integration.test_recorder_shm import PRODUCER, ROOT, _cmdline, env

    per = 12_000
    name = f"/qag-jkill-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    seg = Segment.create(name, 1 << 20, slots=3)  # rings of ~1,300 runs: a restarted recorder spills soon
    url = str(tmp_path / "runs.db")
    jdir = str(tmp_path / "journal")
    store = FlakyStore(url)
    rnd = random.Random(13)
    e = dict(env(), QAG_JOURNAL_SPILL_AFTER_MS="200", QAG_HOME=str(tmp_path))
    logf = open(tmp_path / "recorder.log", "ab")  # noqa: SIM115 - shared by the recorders of this test

    def recorder():
        p = subprocess.Popen([sys.executable, "-m", "qag.recorder", "--segment", name, "--store", url, "--slot", "2",
                              "--batch-max", "500", "--batch-ms", "20", "--journal", jdir],
                             cwd=ROOT, env=e, stdout=logf, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while _cmdline(p.pid) != "qag: recorder" and time.monotonic() < deadline:
            time.sleep(0.01)
        return p

    rec = recorder()
    lock = sqlite3.connect(url, isolation_level=None, timeout=30)
    producers = []
    try:
        wait(lambda: seg.stat()["process_slots"][2]["role"] == "recorder", timeout=30)
        time.sleep(1.0)  # its store open
        lock.execute("BEGIN EXCLUSIVE")  # from now on every commit of the recorder waits
        producers = [subprocess.Popen([sys.executable, "-c", PRODUCER, name, str(s), str(per)], cwd=ROOT, env=e,
                                      stdout=subprocess.PIPE) for s in (0, 1)]
        for _ in range(3):
            time.sleep(rnd.uniform(0.3, 1.0))
            rec.send_signal(signal.SIGKILL)
            rec.wait(10)
            rec = recorder()
        for p in producers:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0 and out.strip() == b"0", out  # the rings never stayed full
        rings = [seg.ring(0), seg.ring(1)]
        wait(lambda: all(r.tail == r.head for r in rings), timeout=60)
        assert len(store.request_ids()) < 2 * per  # the outage held runs back
        lock.execute("ROLLBACK")
        for _ in range(2):  # killed again while the journal drains
            time.sleep(rnd.uniform(0.05, 0.3))
            rec.send_signal(signal.SIGKILL)
            rec.wait(10)
            rec = recorder()
        try:
            wait(lambda: len(store.request_ids()) >= 2 * per, timeout=120)
        except AssertionError:
            raise AssertionError(f"{len(store.request_ids())} of {2 * per} runs stored; recorder log:\n"
                                 + (tmp_path / "recorder.log").read_text()[-3000:]) from None
        time.sleep(1)
        rec.send_signal(signal.SIGTERM)
        rec.wait(30)
    finally:
        for p in producers + [rec]:
            if p.poll() is None:
                p.kill()
                p.wait()
        lock.close()
        seg.close()
        unlink_segment(name)
    ids = store.request_ids()
    assert len(ids) == len(set(ids)) == 2 * per
    assert set(ids) == {f"p{s}-{i}" for s in (0, 1) for i in range(per)}
    c = store.counts()
    assert c == {"qag_events": 2 * per, "qag_history": 2 * per, "usage_calls": 2 * per}
    assert not os.path.exists(jdir)  # a clean stop with an empty journal removes it
