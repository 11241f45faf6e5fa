"""The run store away for longer than the rings can hold (tiny rings: QAG_SHM_SIZE=1 MiB, about 300
runs a ring), under steady calls over 2 workers, then back: every answered call's run is in history
exactly once and in order (the journal's runs before the newer ones), no call waited on a full ring,
and while the store was away history and usage answered 503 store_unavailable and /metrics said so.

On a PRIVATE PostgreSQL (initdb + pg_ctl on a port of its own, stopped and started by the test; the
shared one at 5432 serves the data), with the recorder SIGKILLed while its journal holds runs and the
whole instance restarted over a journal with a torn tail; on SQLite (the run store's file locked by an
exclusive transaction the test holds); on ClickHouse over HTTP (the loopback chDB server stopped)."""
from __future__ import annotations

import datetime as dt
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import pytest
import requests

from tests.conftest import free_port, start_server
from tests.e2e.test_core_serve import arbiter_pid, children, title

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PG_BIN = "/usr/lib/postgresql/15/bin"
SMALL = {"QAG_SHM_SIZE": str(1 << 20), "QAG_THREADS": "8", "QAG_JOURNAL_SPILL_AFTER_MS": "300"}
THREADS = 6


class PrivatePg:
    """A PostgreSQL of the test's own: its data directory, socket and port in a temp dir."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="qag-journal-pg-")  # pytest's tmp_path: not reachable by postgres
        self.data = os.path.join(self.dir, "data")
        self.port = free_port()
        # initdb refuses to run as root: as the postgres user then
        self.user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.user:
            shutil.chown(self.dir, "postgres")
        subprocess.run([*self.user, f"{PG_BIN}/initdb", "-D", self.data, "-U", "postgres", "-A", "trust",
                        "--no-sync"], check=True, capture_output=True)
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self):
        subprocess.run([*self.user, f"{PG_BIN}/pg_ctl", "-D", self.data, "-l", os.path.join(self.dir, "log"), "-w",
                        "-o", f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off", "start"],
                       check=True, capture_output=True)

    def stop(self, mode="fast"):
        subprocess.run([*self.user, f"{PG_BIN}/pg_ctl", "-D", self.data, "-m", mode, "-w", "stop"],
                       capture_output=True)

    def remove(self):
        self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture()
def private_pg():
    if not os.path.exists(f"{PG_BIN}/initdb"):
        pytest.skip("no PostgreSQL server binaries for a private instance")
    pg = PrivatePg()
    pg.start()
    yield pg
    pg.remove()


J = {"Content-Type": "application/json"}


def setup(srv) -> str:
    """A saved lookup on a SQLite data database of the test's own (the data side is not what is tested:
    the shared PostgreSQL's other users must not make these calls fail), and a key for it."""
    import json
    import sqlite3

    path = os.path.join(srv.env["QAG_HOME"], "data.db")
    c = sqlite3.connect(path)
    c.execute("CREATE TABLE accounts (aid INTEGER PRIMARY KEY, bid INTEGER, abalance INTEGER)")
    c.executemany("INSERT INTO accounts VALUES (?, ?, ?)", [(i, i % 10, i * 3) for i in range(1, 1001)])
    c.commit()
    c.close()

    def post(path_, body):
        r = requests.post(srv.base + path_, headers={**srv.admin, **J}, data=json.dumps(body), timeout=30)
        assert r.status_code in (200, 201), r.text
        return r.json()
    post("/api/v1/connections", {"name": "lite", "db": "sqlite", "database": path})
    post("/api/v1/queries", {"name": "account", "connection_name": "lite",
                             "sql": "SELECT aid, bid, abalance FROM accounts WHERE aid = :aid",
                             "parameters": {"aid": {"type": "int", "required": True}}, "publish": True})
    return post("/api/v1/api-keys", {"name": "journal", "queries": ["account"], "connections": ["lite"]})["secret"]


class Caller:
    """THREADS callers, each making calls one after another until stopped; every answer kept."""

    def __init__(self, srv, key):
        self.srv, self.key = srv, key
        self.stop = threading.Event()
        self.go = threading.Event()
        self.go.set()
        self.lock = threading.Lock()
        self.answers = []   # (request id, status, seconds)
        self.errors = []
        self.threads = [threading.Thread(target=self.run, args=(t,)) for t in range(THREADS)]

    def run(self, t):
        s = requests.Session()
        i = t
        while not self.stop.is_set():
            self.go.wait()
            t0 = time.monotonic()
            r = s.get(self.srv.base + f"/q/account?aid={i % 1000 + 1}", headers={"X-API-Key": self.key}, timeout=30)
            with self.lock:
                self.answers.append((r.headers.get("X-Request-Id"), r.status_code, time.monotonic() - t0))
                if r.status_code != 200:
                    self.errors.append(r.text[:300])
            i += THREADS
            time.sleep(0.002)

    def __enter__(self):
        [t.start() for t in self.threads]
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.go.set()
        [t.join(60) for t in self.threads]

    def count(self):
        with self.lock:
            return len(self.answers)


def metric(srv, name, default=None) -> float:
    text = requests.get(srv.base + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    if default is not None:
        return default
    raise AssertionError(f"{name} missing from /metrics")


def history(srv, timeout=120, expect=None):
    """Every run of the query, oldest first, once history holds `expect` of them."""
    deadline = time.monotonic() + timeout
    while True:
        items, cursor = [], None
        while True:
            url = srv.base + "/api/v1/history?query=account&limit=1000" + (f"&cursor={cursor}" if cursor else "")
            r = requests.get(url, headers=srv.admin, timeout=30)
            if r.status_code != 200:
                break
            page = r.json()
            items += page["items"]
            cursor = page["next_cursor"]
            if not cursor:
                break
        if r.status_code == 200 and (expect is None or len(items) >= expect):
            return sorted(items, key=lambda x: x["event_id"])
        assert time.monotonic() < deadline, f"history holds {len(items)} of {expect} runs ({r.status_code})"
        time.sleep(0.5)


def check_every_answer_recorded_once_in_order(srv, answers):
    ok = [a for a in answers if a[1] == 200]
    assert len(ok) == len(answers), {a[1] for a in answers}
    runs = history(srv, expect=len(ok))
    rids = [x["request_id"] for x in runs]
    if len(rids) != len(set(rids)):
        from collections import Counter
        twice = {r for r, n in Counter(rids).items() if n > 1}
        raise AssertionError(f"{len(twice)} runs recorded twice: " + repr(
            [(x["request_id"], x["event_id"], x["served_by"]) for x in runs if x["request_id"] in twice][:12]))
    assert set(rids) == {a[0] for a in ok}, "an answered call's run is missing"
    # In event id order, per worker: no run ends before one already seen started (a worker's runs are
    # recorded in the order its calls finish), so the journal's runs came before the newer ones.
    for served_by in {x["served_by"] for x in runs}:
        max_start = None
        for x in (r for r in runs if r["served_by"] == served_by):
            start = dt.datetime.fromisoformat(x["at"].replace("Z", "+00:00")).timestamp()
            end = start + x["duration_ms"] / 1000
            if max_start is not None:
                assert end >= max_start - 0.003, f"{x['request_id']} (id {x['event_id']}) is out of order"
            max_start = start if max_start is None else max(max_start, start)
    return runs


def assert_unavailable(srv):
    for path in ("/api/v1/history?query=account", "/api/v1/usage?per=day"):
        r = requests.get(srv.base + path, headers=srv.admin, timeout=30)
        assert r.status_code == 503, (path, r.status_code, r.text)
        body = r.json()
        assert body["code"] == "store_unavailable" and body["request_id"] and "run store" in body["error"]


def recorder_pid(srv):
    rec = [p for p in children(arbiter_pid(srv)) if title(p).startswith("qag: recorder")]
    assert rec, "no recorder"
    return rec[0]


def recorder_slot(srv) -> dict:
    st = requests.get(srv.base + "/-/shm", headers=srv.admin, timeout=10).json()
    return next((ps for ps in st["process_slots"] if ps["role"] == "recorder"), {})


def wait_for(pred, timeout=60, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def ring_holds(srv) -> int:
    """About how many runs the producers' rings hold together (a run record is ~100 bytes with its word)."""
    st = requests.get(srv.base + "/-/shm", headers=srv.admin, timeout=10).json()
    producers = [ps for ps in st["process_slots"] if ps["role"] in ("worker", "plane")]
    return sum(ps["ring"]["capacity"] for ps in producers) // 100


def outage(srv, key, down, up, seconds=5.0, during=None):
    """Calls before, during (at least `seconds`, and until 3 times what the rings hold were answered)
    and after the store's outage."""
    with Caller(srv, key) as calls:
        wait_for(lambda: calls.count() > 200, what="calls")
        down()
        t0 = time.monotonic()
        n0 = calls.count()
        wait_for(lambda: metric(srv, "qag_run_store_up") == 0, timeout=30, what="the store seen down")
        wait_for(lambda: metric(srv, "qag_journal_runs") > 0, timeout=30, what="the journal used")
        if during:
            during(calls)
        holds = ring_holds(srv)
        while time.monotonic() - t0 < seconds or calls.count() - n0 < 3 * holds:
            assert time.monotonic() - t0 < 120, "too few calls"
            time.sleep(0.2)
        in_outage = calls.count() - n0
        up()
        wait_for(lambda: metric(srv, "qag_journal_runs") == 0 and metric(srv, "qag_run_store_up") == 1,
                 timeout=120, what="the journal drained")
        time.sleep(0.5)
    lost = metric(srv, "qag_runs_lost_total", 0)
    assert lost == 0, (lost, [ln for ln in srv.log().splitlines() if "lost" in ln or "recorder" in ln][-20:])
    slow = [a for a in calls.answers if a[2] > 1.0]
    assert not slow, f"{len(slow)} calls took over 1 s, the slowest {max(a[2] for a in slow):.1f} s"
    assert in_outage >= 3 * holds, (in_outage, holds)  # the outage outlasted the rings three times over
    bad = [a for a in calls.answers if a[1] != 200]
    assert not bad, f"{len(bad)} calls failed: {calls.errors[:3]}"
    return calls.answers


def test_postgres_store_away_longer_than_the_rings_hold(private_pg):
    env = {**SMALL, "QAG_RUN_STORE_URL": private_pg.url}
    srv = start_server(env)
    home = srv.env["QAG_HOME"]
    try:
        key = setup(srv)

        def during(calls):
            assert_unavailable(srv)
            # SIGKILL the recorder while its journal holds runs: the next one resumes from the journal.
            # Calls pause meanwhile: with no recorder at all, tiny rings fill in a second (and their
            # runs are then lost, counted and logged: a recorder's death is the one case the journal
            # does not cover).
            # Calls resume once the new recorder is reading the rings, not when its process exists: its
            # slot is its own (until then /metrics shows the dead one's gauges) and its loop has beaten (a
            # CI run resumed on the dead recorder's journal gauge, and a recorder still importing on a busy
            # machine let the rings fill).
            calls.go.clear()
            time.sleep(0.3)
            old = recorder_pid(srv)
            os.kill(old, signal.SIGKILL)
            wait_for(lambda: [p for p in children(arbiter_pid(srv)) if title(p).startswith("qag: recorder")
                              and p != old], what="a new recorder")
            new = recorder_pid(srv)
            # its slot claimed, then a heartbeat of its loop (the one at the claim comes within microseconds)
            wait_for(lambda: (lambda ps: ps.get("pid") == new and ps["heartbeat_ns"] - ps["started_at_ns"] > 50e6)(
                recorder_slot(srv)), what="the new recorder reading the rings")
            wait_for(lambda: metric(srv, "qag_journal_runs") > 0, what="the new recorder journalling")
            calls.go.set()

        answers = outage(srv, key, private_pg.stop, private_pg.start, during=during)
        check_every_answer_recorded_once_in_order(srv, answers)

        # The whole instance stopped while the store is away (the journal persists), its journal's tail
        # torn as by a crash in the middle of a write, then started with the store back: every run is
        # kept, the torn bytes are dropped, never misread.
        private_pg.stop()
        with Caller(srv, key) as calls:
            wait_for(lambda: metric(srv, "qag_journal_runs") > 300, what="runs journalled")
        srv.stop()
        frames = sorted(glob.glob(os.path.join(home, "journal", "*", "*.qj")))
        assert frames, "the journal is kept while it holds runs"
        with open(frames[-1], "ab") as f:
            f.write(b"JQRF\x00\x10\x00\x00torn")
        private_pg.start()
        # the same instance (QAG_HOME and bind: the journal is QAG_HOME/journal/<instance>)
        srv2 = start_server({**env, "QAG_HOME": home, "QAG_ADMIN_KEY": srv.env["QAG_ADMIN_KEY"],
                             "QAG_BIND": srv.env["QAG_BIND"]}, wait=False)
        srv2.base = srv.base

        def healthy():
            try:
                return requests.get(srv2.base + "/health", timeout=1).status_code == 200
            except requests.RequestException:
                return False
        try:
            wait_for(healthy, timeout=60, what="the restarted instance")
            runs = check_every_answer_recorded_once_in_order(srv2, answers + calls.answers)
            assert len(runs) == len(answers) + len(calls.answers)
            wait_for(lambda: "torn tail" in srv2.log(), what="the torn tail logged")
        finally:
            srv2.stop()
    finally:
        srv.stop()


def test_sqlite_store_locked_longer_than_the_rings_hold():
    import sqlite3

    srv = start_server(SMALL)
    lock = {}
    try:
        key = setup(srv)
        path = os.path.join(srv.env["QAG_HOME"], "runs.db")

        def down():
            c = sqlite3.connect(path, isolation_level=None, timeout=30)
            c.execute("BEGIN EXCLUSIVE")  # holds the write lock: every commit of the recorder waits
            lock["c"] = c

        def up():
            lock.pop("c").execute("ROLLBACK")

        answers = outage(srv, key, down, up)
        check_every_answer_recorded_once_in_order(srv, answers)
    finally:
        if "c" in lock:
            lock["c"].close()
        srv.stop()


class LoopbackClickHouse:
    """tests/integration/test_runstore_http.py's chDB server, stoppable and restartable on one port."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="qag-journal-ch-")
        self.port = free_port()
        self.proc = None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self):
        self.proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "integration",
                                                                   "test_runstore_http.py"),
                                      os.path.join(self.dir, "ch"), str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
        deadline = time.monotonic() + 90
        while True:
            try:
                if urllib.request.urlopen(self.url + "/ping", timeout=1).read() == b"Ok.\n":
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(self.proc.stderr.read().decode()[-3000:]) from None
                time.sleep(0.2)

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


def test_clickhouse_store_away_longer_than_the_rings_hold():
    pytest.importorskip("chdb")
    ch = LoopbackClickHouse()
    ch.start()
    srv = None
    try:
        # the loopback server answers an insert in ~0.1-1 s on a busy machine: the default spill delay
        # and rings that hold a few seconds of these calls (4 MiB segment: 128 KiB rings), not one
        srv = start_server({**SMALL, "QAG_RUN_STORE_URL": ch.url,
                            "QAG_LOG_LEVEL": os.environ.get("QAG_TEST_LOG", "info"),
                            "QAG_JOURNAL_SPILL_AFTER_MS": "1000", "QAG_SHM_SIZE": str(4 << 20)})
        key = setup(srv)
        try:
            answers = outage(srv, key, ch.stop, ch.start, during=lambda calls: assert_unavailable(srv))
            check_every_answer_recorded_once_in_order(srv, answers)
        except AssertionError:
            print("\n".join(x for x in srv.log().splitlines() if "qag: recorder" in x or "lost" in x)[-8000:])
            raise
    finally:
        if srv is not None:
            srv.stop()
        ch.stop()
        shutil.rmtree(ch.dir, ignore_errors=True)


def test_past_the_journals_bound_runs_are_lost_counted_and_logged_never_waited_for():
    """A journal bound of 64 KiB (a few hundred runs) and the store locked: once journal and rings are
    full, runs are lost, each counted in qag_runs_lost_total, the episode logged once with its reason;
    calls still answer at once; afterwards recorded + lost = answered."""
    import sqlite3

    srv = start_server({**SMALL, "QAG_JOURNAL_MAX_BYTES": str(64 << 10)})
    lock = {}
    try:
        key = setup(srv)
        path = os.path.join(srv.env["QAG_HOME"], "runs.db")
        with Caller(srv, key) as calls:
            wait_for(lambda: calls.count() > 100, what="calls")
            c = sqlite3.connect(path, isolation_level=None, timeout=30)
            c.execute("BEGIN EXCLUSIVE")
            lock["c"] = c
            wait_for(lambda: metric(srv, "qag_journal_full") == 1, what="the journal full")
            wait_for(lambda: metric(srv, "qag_runs_lost_total", 0) > 100, what="runs lost")
            lock.pop("c").execute("ROLLBACK")
            wait_for(lambda: metric(srv, "qag_journal_runs") == 0 and metric(srv, "qag_journal_full") == 0,
                     what="the journal drained")
            time.sleep(0.5)
        answers = calls.answers
        assert all(a[1] == 200 for a in answers)
        slow = [a for a in answers if a[2] > 1.0]
        assert not slow, f"{len(slow)} calls took over 1 s"
        lost = metric(srv, "qag_runs_lost_total")
        runs = history(srv, expect=len(answers) - int(lost))
        rids = [x["request_id"] for x in runs]
        assert len(rids) == len(set(rids)) and set(rids) <= {a[0] for a in answers}
        assert len(rids) + lost == len(answers)
        log = srv.log()
        assert "runs are being lost (qag_runs_lost_total): the recorder's run journal is full" in log
        # once per episode of losses on a ring (2 workers, the plane), not once per lost run: a ring that takes a
        # run again ends its episode ("takes runs again after N were lost") and may start another while the store
        # is still locked (a CI run saw a worker's ring do so: 4 such lines)
        episodes, ended = log.count("runs are being lost"), log.count("takes runs again after")
        assert 1 <= episodes <= ended + 3 and episodes * 10 <= lost, (episodes, ended, lost)
    finally:
        if "c" in lock:
            lock["c"].close()
        srv.stop()
