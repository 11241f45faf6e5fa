"""End to end: `qag serve` as a process tree: pinning, titles, replacement of a dead worker, graceful stop,
startup failures, immediate revocation across workers, zero store reads on warm calls, instance-wide
metrics, and every run recorded even when the recorder is killed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import requests

from tests.conftest import ROOT, free_port, need_plane, pg_fresh_db, start_server

J = {"Content-Type": "application/json"}
PGB = "qag_core_pgbench"


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(x) for x in out]


def title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\x00", b" ").decode().strip()
    except OSError:
        return ""  # it exited between the listing and this read (a killed worker being replaced)


def cpus_allowed(pid: int) -> str:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("Cpus_allowed_list"):
            return line.split(":", 1)[1].strip()
    return ""


def arbiter_pid(srv) -> int:
    return srv.proc.pid


def workers(srv) -> dict[int, str]:
    return {p: title(p) for p in children(arbiter_pid(srv)) if "qag: worker" in title(p)}


def setup(srv, extra_key=None):
    def post(path, body):
        r = requests.post(srv.base + path, headers={**srv.admin, **J}, data=json.dumps(body))
        assert r.status_code in (200, 201), r.text
        return r.json()
    post("/api/v1/connections", {"name": "oltp", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                 "user": "postgres", "database": PGB})
    post("/api/v1/queries", {"name": "account", "connection_name": "oltp",
                             "sql": "SELECT aid, bid, abalance FROM pgbench_accounts WHERE aid = :aid",
                             "parameters": {"aid": {"type": "int", "required": True}}, "publish": True})
    return post("/api/v1/api-keys", {"name": "bench", "queries": ["account"], "connections": [],
                                     **(extra_key or {})})["secret"]


def test_auto_workers_pinned_one_per_physical_core(pgbench_dsn):
    cmd_env = {"QAG_WORKERS": "auto"}
    srv = start_server(cmd_env, args=())
    try:
        ws = workers(srv)
        from qag.server.serve import physical_cores
        cores = physical_cores(sorted(os.sched_getaffinity(0)))
        assert len(ws) == len(cores)
        pinned = sorted(cpus_allowed(p) for p in ws)
        assert pinned == sorted(str(c[0]) for c in cores)
        for p, t in ws.items():
            assert t.startswith("qag: worker ") and f"[cpu {cpus_allowed(p)}]" in t
        assert title(arbiter_pid(srv)) == "qag: arbiter"
        assert any(title(p) == "qag: recorder" for p in children(arbiter_pid(srv)))
    finally:
        srv.stop()


def test_taskset_limits_workers():
    """Under `taskset -c 0` only one worker starts, pinned to CPU 0."""
    import tempfile

    from tests.conftest import free_port
    port = free_port()
    env = dict(os.environ, QAG_HOME=tempfile.mkdtemp(), QAG_ADMIN_KEY="a", QAG_BIND=f"127.0.0.1:{port}")
    proc = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-m", "qag.cli", "serve"], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).ok:
                    break
            except requests.RequestException:
                time.sleep(0.1)
        ws = [p for p in children(proc.pid) if "qag: worker" in title(p)]
        assert len(ws) == 1 and cpus_allowed(ws[0]) == "0" and title(ws[0]) == "qag: worker 0 [cpu 0]"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)


def test_dead_worker_replaced_in_its_slot_and_graceful_stop(pgbench_dsn):
    srv = start_server()
    key = setup(srv)
    ws = workers(srv)
    assert len(ws) == 2
    victim = next(p for p, t in ws.items() if "worker 1" in t)
    os.kill(victim, signal.SIGKILL)
    deadline = time.time() + 20
    while time.time() < deadline:
        now = workers(srv)
        if len(now) == 2 and victim not in now:
            break
        time.sleep(0.2)
    now = workers(srv)
    assert sorted(now.values()) == sorted(ws.values())  # the same slot and CPU
    for _ in range(20):
        assert requests.get(srv.base + "/q/account?aid=3", headers={"X-API-Key": key}).status_code == 200
    name = requests.get(srv.base + "/-/shm", headers=srv.admin).json()["name"].lstrip("/")
    assert name in os.listdir("/dev/shm")
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) == 0
    assert name not in os.listdir("/dev/shm"), "the segment was not unlinked"


def test_malformed_setting_and_unreachable_store_stop_startup():
    r = subprocess.run([sys.executable, "-m", "qag.cli", "serve"], env=dict(os.environ, QAG_MAX_PAGE_SIZE="lots"),
                       capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert r.returncode != 0 and "QAG_MAX_PAGE_SIZE" in r.stderr
    r = subprocess.run([sys.executable, "-m", "qag.cli", "serve"],
                       env=dict(os.environ, QAG_DATABASE_URL="postgresql://postgres@127.0.0.1:1/x"),
                       capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert r.returncode != 0 and "metadata store" in r.stderr


def test_unreachable_redis_starts_in_fallback_with_a_warning():
    """A Redis that does not answer at start is no reason to refuse calls: qag starts, says so once, and
    serves; a malformed QAG_REDIS_URL stops it, named."""
    r = subprocess.run([sys.executable, "-m", "qag.cli", "serve"], env=dict(os.environ, QAG_REDIS_URL="redis://:99999"),
                       capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert r.returncode != 0 and "QAG_REDIS_URL" in r.stderr, r.stderr
    srv = start_server({"QAG_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}, args=("--workers", "1"))
    try:
        assert requests.get(srv.base + "/health", timeout=10).status_code == 200
        assert "Redis at QAG_REDIS_URL does not answer" in srv.log(), srv.log()
    finally:
        srv.stop()


def test_revocation_immediate_across_workers_under_load(pgbench_dsn):
    srv = start_server()
    key = setup(srv)
    stop = threading.Event()
    revoked_at = [None]
    late_ok = []
    counts = {"ok": 0, "401": 0}
    lock = threading.Lock()

    def hammer():
        s = requests.Session()
        while not stop.is_set():
            t0 = time.monotonic()
            r = s.get(srv.base + "/q/account?aid=5", headers={"X-API-Key": key})
            with lock:
                if r.status_code == 200:
                    counts["ok"] += 1
                    if revoked_at[0] is not None and t0 > revoked_at[0]:
                        late_ok.append(t0 - revoked_at[0])
                else:
                    counts["401"] += 1
    threads = [threading.Thread(target=hammer) for _ in range(16)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    r = requests.patch(srv.base + "/api/v1/api-keys/bench", headers={**srv.admin, **J},
                       data=json.dumps({"active": False}))
    assert r.status_code == 200
    revoked_at[0] = time.monotonic()
    while counts["401"] < 1000:
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join()
    assert counts["ok"] > 50
    assert late_ok == [], f"{len(late_ok)} calls sent after the revocation returned still succeeded"
    srv.stop()


def test_new_version_and_inactive_connection_take_effect_at_once(pgbench_dsn):
    srv = start_server()
    key = setup(srv)
    s = requests.Session()
    for _ in range(10):
        assert s.get(srv.base + "/q/account?aid=5", headers={"X-API-Key": key}).json()[0]["aid"] == 5
    r = requests.post(srv.base + "/api/v1/queries/account/versions", headers={**srv.admin, **J},
                      data=json.dumps({"sql": "SELECT aid, 'v2' AS version FROM pgbench_accounts WHERE aid = :aid",
                                       "parameters": {"aid": "int"}, "publish": True}))
    assert r.status_code == 201
    for _ in range(200):
        assert s.get(srv.base + "/q/account?aid=5", headers={"X-API-Key": key}).json() == [{"aid": 5, "version": "v2"}]
    r = requests.patch(srv.base + "/api/v1/connections/oltp", headers={**srv.admin, **J},
                       data=json.dumps({"active": False}))
    assert r.status_code == 200
    for _ in range(200):
        r = s.get(srv.base + "/q/account?aid=5", headers={"X-API-Key": key})
        assert r.status_code == 403 and r.json()["code"] == "connection_inactive", r.text
    srv.stop()


def metric(srv, name) -> float:
    total = 0.0
    for line in requests.get(srv.base + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_warm_calls_read_nothing_from_store_and_metrics_count_every_call(pgbench_dsn):
    srv = start_server()
    key = setup(srv)
    s = requests.Session()
    # The change watcher re-reads this host's own changes within a second (it cannot tell them from another
    # host's) and bumps their generations once more: let that happen before measuring.
    time.sleep(2.5)

    def warm_slots():
        slots = requests.get(srv.base + "/-/shm", headers=srv.admin).json()["process_slots"]
        return [p for p in slots if p["role"] == "worker"
                and any("qag_plan_cache_total" in k and "hit" in k for k in p["counters"])]
    deadline = time.time() + 20
    while len(warm_slots()) < 2:  # warm both workers: each has answered from its plan cache
        assert time.time() < deadline
        ts = [threading.Thread(target=lambda: [requests.get(srv.base + "/q/account?aid=1", headers={"X-API-Key": key})
                                               for _ in range(5)]) for _ in range(8)]
        [t.start() for t in ts]
        [t.join() for t in ts]
    before = metric(srv, "qag_store_statements_total")
    calls_before = metric(srv, 'qag_requests_total{route="/q/{name}",status="200"}')
    n = 1000
    for i in range(n):
        assert s.get(srv.base + f"/q/account?aid={i + 1}", headers={"X-API-Key": key}).status_code == 200
    assert metric(srv, "qag_store_statements_total") == before
    assert metric(srv, 'qag_requests_total{route="/q/{name}",status="200"}') - calls_before == n
    stat = requests.get(srv.base + "/-/shm", headers=srv.admin).json()
    assert stat
    srv.stop()


def history_count(srv, query="account") -> int:
    u = requests.get(srv.base + f"/api/v1/usage?per=day&query={query}", headers=srv.admin).json()["items"]
    return sum(x["calls"] for x in u)


def test_every_run_recorded_even_when_recorder_killed(pgbench_dsn):
    srv = start_server()
    key = setup(srv)
    rec = [p for p in children(arbiter_pid(srv)) if title(p) == "qag: recorder"]
    assert len(rec) == 1
    n_threads, per = 4, 300
    killed = threading.Event()

    def burst():
        s = requests.Session()
        for i in range(per):
            r = s.get(srv.base + f"/q/account?aid={i + 1}", headers={"X-API-Key": key})
            assert r.status_code == 200
    threads = [threading.Thread(target=burst) for _ in range(n_threads)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    os.kill(rec[0], signal.SIGKILL)
    killed.set()
    for t in threads:
        t.join()
    deadline = time.time() + 30
    while time.time() < deadline and history_count(srv) < n_threads * per:
        time.sleep(0.3)
    assert history_count(srv) == n_threads * per
    new = [p for p in children(arbiter_pid(srv)) if title(p) == "qag: recorder"]
    assert new and new[0] != rec[0]
    # history holds each run exactly once (request ids unique)
    seen, cursor = [], None
    while True:
        url = srv.base + "/api/v1/history?query=account&limit=1000" + (f"&cursor={cursor}" if cursor else "")
        page = requests.get(url, headers=srv.admin).json()
        seen += [x["request_id"] for x in page["items"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert len(seen) == len(set(seen)) == n_threads * per
    srv.stop()


def test_store_on_postgresql_and_admin_cli(pgbench_dsn):
    store_dsn = pg_fresh_db("qag_core_store")
    srv = start_server({"QAG_DATABASE_URL": store_dsn})
    key = setup(srv)
    assert requests.get(srv.base + "/q/account?aid=9", headers={"X-API-Key": key}).json() == \
        [{"aid": 9, "bid": 1, "abalance": 0}]
    r = subprocess.run([sys.executable, "-m", "qag.cli", "admins", "create", "alice"], env=srv.env,
                       capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert r.returncode == 0, r.stderr
    token = r.stdout.strip()
    assert requests.get(srv.base + "/api/v1/api-keys", headers={"X-API-Key": token}).status_code == 200
    assert requests.get(srv.base + "/api/v1/api-keys", headers={"X-API-Key": key}).status_code == 403
    from tests.conftest import pg_exec
    rows = pg_exec(store_dsn, "SELECT key_hash FROM qag_api_keys WHERE name = 'bench'")
    import hashlib
    assert rows == [(hashlib.sha256(key.encode()).hexdigest(),)]
    audit = pg_exec(store_dsn, "SELECT actor, action, entity, name FROM qag_audit ORDER BY id")
    assert ("adm-" in audit[0][0]) or audit[0][0] == "admin"
    assert [a[1:] for a in audit[:3]] == [("create", "connection", "oltp"), ("create", "query", "account"),
                                          ("create", "api_key", "bench")]
    srv.stop()


def test_two_hosts_on_one_postgresql_store_agree(pgbench_dsn):
    """A revocation made through host A stops the key on host B within the store's notification delay;
    a change made by the CLI (not through any host) reaches both by the audit-log fallback."""
    store_dsn = pg_fresh_db("qag_core_store2")
    a = start_server({"QAG_DATABASE_URL": store_dsn, "QAG_ADMIN_KEY": "shared-admin"})
    b = start_server({"QAG_DATABASE_URL": store_dsn, "QAG_ADMIN_KEY": "shared-admin"})
    try:
        key = setup(a)
        sb = requests.Session()
        for _ in range(20):  # warm B's caches: from here on B reads nothing from the store
            assert sb.get(b.base + "/q/account?aid=2", headers={"X-API-Key": key}).status_code == 200
        r = requests.patch(a.base + "/api/v1/api-keys/bench", headers={**a.admin, **J},
                           data=json.dumps({"active": False}))
        assert r.status_code == 200
        t0 = time.monotonic()
        while sb.get(b.base + "/q/account?aid=2", headers={"X-API-Key": key}).status_code == 200:
            assert time.monotonic() - t0 < 2.0, "host B still serves the revoked key"
        elapsed = time.monotonic() - t0
        for _ in range(100):
            assert sb.get(b.base + "/q/account?aid=2", headers={"X-API-Key": key}).status_code == 401
        assert elapsed < 2.0
    finally:
        a.stop()
        b.stop()


def test_concurrent_burst_counted_and_recorded_exactly(pgbench_dsn):
    """16 callers over 2 workers of 8 threads: /metrics from any worker and the run history both count
    every call (threads of one worker share its ring and counter cells without losing an update)."""
    srv = start_server({"QAG_THREADS": "8"})
    key = setup(srv)
    base_calls = metric(srv, 'qag_requests_total{route="/q/{name}",status="200"}')
    per, n_threads = 150, 16
    errors = []
    done = [0]
    lock = threading.Lock()

    def burst(t, n, fresh):
        s = requests.Session()
        for i in range(n):
            h = {"X-API-Key": key, **({"Connection": "close"} if fresh else {})}
            r = s.get(srv.base + f"/q/account?aid={(t * per + i) % 99999 + 1}", headers=h)
            with lock:
                done[0] += 1
            if r.status_code != 200:
                errors.append(r.status_code)

    def wave(n, fresh):
        threads = [threading.Thread(target=burst, args=(t, n, fresh)) for t in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def served_by():
        items = requests.get(srv.base + "/api/v1/history?limit=1000", headers=srv.admin).json()["items"]
        return {x["served_by"] for x in items}
    wave(per, fresh=False)
    # Which worker accepts a kept-alive connection is the kernel's choice; should one worker have taken all
    # 16, waves of fresh connections reach the other (every one of these calls is counted too).
    for _ in range(10):
        time.sleep(0.3)
        if served_by() == {"worker:0", "worker:1"}:
            break
        wave(5, fresh=True)
    assert not errors
    total = done[0]
    for _ in range(10):  # several scrapes land on both workers; each sees the whole instance
        assert metric(srv, 'qag_requests_total{route="/q/{name}",status="200"}') - base_calls == total
    deadline = time.time() + 20
    while time.time() < deadline and history_count(srv) < total:
        time.sleep(0.2)
    assert history_count(srv) == total
    assert served_by() == {"worker:0", "worker:1"}
    srv.stop()


def test_allowed_ips_hold_for_calls_the_plane_forwards(pgbench_dsn):
    need_plane()
    srv = start_server(args=("--workers", "1", "--plane"))
    try:
        local = setup(srv, {"allowed_ips": ["127.0.0.0/8"]})
        r = requests.post(srv.base + "/api/v1/api-keys", headers={**srv.admin, **J},
                          data=json.dumps({"name": "far", "queries": ["account"], "allowed_ips": ["10.0.0.0/8"]}))
        far = r.json()["secret"]
        for key, want in ((local, 200), (far, 401)):
            # POST is always forwarded to gunicorn; GET may be served by the plane itself
            r = requests.post(srv.base + "/q/account", headers={"X-API-Key": key, **J},
                              data=json.dumps({"params": {"aid": 3}}))
            assert r.status_code == want, r.text
            assert requests.get(srv.base + "/q/account?aid=3", headers={"X-API-Key": key}).status_code == want
        # a client cannot claim another address: the plane replaces the header
        r = requests.post(srv.base + "/q/account", headers={"X-API-Key": far, "X-Qag-Client-Addr": "10.1.1.1", **J},
                          data=json.dumps({"params": {"aid": 3}}))
        assert r.status_code == 401
    finally:
        srv.stop()


def test_children_do_not_outlive_a_killed_arbiter():
    srv = start_server()
    kids = [p for p in children(arbiter_pid(srv)) if title(p) in ("qag: recorder", "qag: changes")]
    assert len(kids) == 2
    os.kill(arbiter_pid(srv), signal.SIGKILL)
    srv.proc.wait(10)
    deadline = time.time() + 20
    while time.time() < deadline and any(os.path.exists(f"/proc/{p}") and "qag" in title(p) for p in kids):
        time.sleep(0.2)
    assert not [p for p in kids if os.path.exists(f"/proc/{p}") and "qag" in title(p)]


def test_group_sigterm_stops_children_once_and_records_every_run(pgbench_dsn):
    """Ctrl-C in a terminal signals the whole process group. The recorder and the other children are not
    restarted during the stop (they are in their own session and the arbiter stops them in order), and
    every run made before the signal is in the run store afterwards."""
    import sqlite3
    srv = start_server()
    key = setup(srv)
    home = srv.env["QAG_HOME"]
    kids = [p for p in children(arbiter_pid(srv)) if "qag: worker" not in title(p)]
    assert kids and all(os.getsid(p) != os.getsid(arbiter_pid(srv)) for p in kids)
    with requests.Session() as s:
        for i in range(1, 101):
            assert s.get(srv.base + f"/q/account?aid={i}", headers={"X-API-Key": key}).status_code == 200
    os.killpg(srv.proc.pid, signal.SIGTERM)
    assert srv.proc.wait(30) == 0
    log = srv.log()
    assert "restarting" not in log, log
    db = sqlite3.connect(os.path.join(home, "runs.db"))
    try:
        n = db.execute("SELECT count(*) FROM qag_history WHERE query = 'account'").fetchone()[0]
    finally:
        db.close()
    assert n == 100
