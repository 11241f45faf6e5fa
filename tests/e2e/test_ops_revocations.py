"""End to end, two hosts on one PostgreSQL metadata store (two `qag serve` with their own QAG_HOME and segment):
a revocation made on host A reaches host B whatever B's change watcher is going through when it commits —
SIGKILLed, its LISTEN session cut, the notification never sent, hung — and B fails closed meanwhile: it
does not answer from entries it cannot prove current (issue 13, item 1; qag/server/changes.py, shm/LAYOUT.md W1-W4).
With `--plane` the same holds for calls the data plane serves from the segment."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import requests

from tests.conftest import need_plane, pg_exec, pg_fresh_db, start_server

J = {"Content-Type": "application/json"}
DATA = "qag_ops_data"  # a data database of this file's own (other sessions drop and re-create the shared ones)
RESTART_S = 6.0  # the watcher's restart: the arbiter's 0.2-0.4 s backoff, a Python start, one catch-up


def _child(srv, title_text: str) -> int:
    out = subprocess.run(["pgrep", "-P", str(srv.proc.pid)], capture_output=True, text=True, check=False).stdout
    for pid in map(int, out.split()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().replace(b"\x00", b" ").decode().strip() == title_text:
                    return pid
        except OSError:
            continue
    raise AssertionError(f"no child titled {title_text!r}")


def _post(srv, path, body):
    r = requests.post(srv.base + path, headers={**srv.admin, **J}, data=json.dumps(body), timeout=30)
    assert r.status_code in (200, 201), r.text
    return r.json()


def _key(a, name: str) -> str:
    return _post(a, "/api/v1/api-keys", {"name": name, "queries": ["account"], "connections": []})["secret"]


def _revoke(a, name: str) -> None:
    r = requests.patch(a.base + f"/api/v1/api-keys/{name}", headers={**a.admin, **J},
                       data=json.dumps({"active": False}), timeout=30)
    assert r.status_code == 200, r.text


def _call(srv, secret: str) -> requests.Response:
    return requests.get(srv.base + "/q/account?aid=3", headers={"X-API-Key": secret}, timeout=30)


def _warm(srv, secret: str) -> None:
    for _ in range(20):
        assert _call(srv, secret).status_code == 200


def _refused_within(srv, secret: str, limit: float) -> float:
    """Seconds until srv refuses the secret (401); fails past limit."""
    t0 = time.monotonic()
    while True:
        r = _call(srv, secret)
        if r.status_code == 401:
            return time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert time.monotonic() - t0 < limit, f"host B still serves the revoked key after {limit} s"
        time.sleep(0.02)


def _watcher_current(srv) -> bool:
    st = requests.get(srv.base + "/-/shm", headers=srv.admin, timeout=10).json()
    slot = st["slots"] - 3
    info = st["process_slots"][slot]
    return info["role"] == "other" and info["heartbeat_value"] != 0 and info["alive"]


def _wait_current(srv, timeout=20.0) -> None:
    deadline = time.time() + timeout
    while not _watcher_current(srv):
        st = requests.get(srv.base + "/-/shm", headers=srv.admin, timeout=10).json()
        if st["process_slots"][st["slots"] - 3]["role"] == "":  # a build whose watcher publishes no position
            time.sleep(2.0)
            return
        assert time.time() < deadline, "the change watcher never caught up"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def data_db():
    dsn = pg_fresh_db(DATA)
    pg_exec(dsn, "CREATE TABLE pgbench_accounts (aid int PRIMARY KEY, bid int, abalance int); "
                 "INSERT INTO pgbench_accounts SELECT g, 1, 0 FROM generate_series(1, 100) g")
    return dsn


@pytest.fixture(params=["python", "plane"])
def hosts(request, data_db):
    args = ("--workers", "1")
    if request.param == "plane":
        need_plane()
        args = ("--workers", "1", "--plane", "--plane-threads", "1")
    store_dsn = pg_fresh_db(f"qag_ops_revoke_{request.param}")
    env = {"QAG_DATABASE_URL": store_dsn, "QAG_ADMIN_KEY": "shared-admin"}
    a = start_server(env, args=("--workers", "1"))
    b = start_server(env, args=args)
    _post(a, "/api/v1/connections", {"name": "oltp", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                     "user": "postgres", "database": DATA})
    _post(a, "/api/v1/queries", {"name": "account", "connection_name": "oltp",
                                 "sql": "SELECT aid, bid, abalance FROM pgbench_accounts WHERE aid = :aid",
                                 "parameters": {"aid": {"type": "int", "required": True}}, "publish": True})
    _wait_current(b)
    yield a, b, store_dsn, request.param
    a.stop()
    b.stop()


def _served_by_plane(srv, secret: str) -> bool:
    """The plane answered at least one of a few warm calls (its runs say served_by=plane)."""
    for _ in range(30):
        _call(srv, secret)
    deadline = time.time() + 10
    while time.time() < deadline:
        h = requests.get(srv.base + "/api/v1/history?limit=30", headers=srv.admin, timeout=10).json()["items"]
        if any(r["served_by"] == "plane" for r in h):
            return True
        time.sleep(0.3)
    return False


def test_revocation_reaches_b_whatever_its_watcher_is_doing(hosts):
    a, b, store_dsn, mode = hosts
    figures = {}

    # 0. control: the watcher is up and listening
    k0 = _key(a, "k0")
    _warm(b, k0)
    if mode == "plane":
        assert _served_by_plane(b, k0), "the plane did not serve the warm key: the test would not test it"
    _revoke(a, "k0")
    figures["control"] = _refused_within(b, k0, 2.0)

    # 1. SIGKILLed: the revocation commits while B has no watcher; the restarted one must not treat it as applied
    k1, keep = _key(a, "k1"), _key(a, "keep")
    _wait_current(b)
    _warm(b, k1)
    _warm(b, keep)
    os.kill(_child(b, "qag: changes"), signal.SIGKILL)
    _revoke(a, "k1")
    figures["sigkill"] = _refused_within(b, k1, RESTART_S)
    _wait_current(b)
    for _ in range(20):
        assert _call(b, k1).status_code == 401
    assert _call(b, keep).status_code == 200  # a key still valid is served again

    # 2. its LISTEN session cut (the change is notified to nobody on B)
    k2 = _key(a, "k2")
    _wait_current(b)
    _warm(b, k2)
    seg = requests.get(b.base + "/-/shm", headers=b.admin, timeout=10).json()["name"]
    cut = pg_exec(store_dsn, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
                  (f"qag-changes {seg}",))
    assert cut, "B's LISTEN session was not found"
    _revoke(a, "k2")
    figures["listen_cut"] = _refused_within(b, k2, RESTART_S)

    # 3. no notification at all: an edit that went through no host (a script following the store's change
    #    protocol: the row, the change's sequence number, its audit row; no NOTIFY)
    k3 = _key(a, "k3")
    _wait_current(b)
    _warm(b, k3)
    pg_exec(store_dsn, """
        WITH s AS (UPDATE qag_change_seq SET n = n + 1 WHERE id = 1 RETURNING n),
             k AS (UPDATE qag_api_keys SET active = 0 WHERE name = 'k3' RETURNING name)
        INSERT INTO qag_audit (at, actor, action, entity, name, seq)
        SELECT '2026-12-01T00:00:00.000Z', 'script', 'update', 'api_key', k.name, s.n FROM s, k""")
    figures["no_notify"] = _refused_within(b, k3, RESTART_S)

    # 4. hung (SIGSTOP): it cannot apply anything, so B must stop trusting its caches once its heartbeat is stale
    k4 = _key(a, "k4")
    _wait_current(b)
    _warm(b, k4)
    watcher = _child(b, "qag: changes")
    os.kill(watcher, signal.SIGSTOP)
    try:
        _revoke(a, "k4")
        figures["sigstop"] = _refused_within(b, k4, RESTART_S)
        assert _call(b, keep).status_code == 200  # served from the store meanwhile
    finally:
        os.kill(watcher, signal.SIGCONT)
    _wait_current(b)
    assert _call(b, k4).status_code == 401
    print("revoked key refused on B after (s):", {k: round(v, 2) for k, v in figures.items()})


def test_b_answers_503_not_from_cache_when_store_and_watcher_are_away(data_db):
    """A private PostgreSQL is the metadata store (never the shared one): stopped, B cannot prove any cached
    key current and answers 503 store_unavailable; started again, a revocation made meanwhile on A holds."""
    import shutil
    pg_bin = "/usr/lib/postgresql/15/bin"
    if not os.path.exists(f"{pg_bin}/initdb"):
        pytest.skip("no PostgreSQL server binaries for a private instance")
    import tempfile

    from tests.conftest import free_port
    tmp = tempfile.mkdtemp(prefix="qag-ops-pg-")  # pytest's tmp_path is not reachable by the postgres user
    data, port = os.path.join(tmp, "data"), free_port()
    run = {"check": True, "capture_output": True}
    user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if user:
        shutil.chown(tmp, "postgres")
    subprocess.run([*user, f"{pg_bin}/initdb", "-D", data, "-A", "trust", "-U", "postgres"], **run)

    def pg_ctl(*args):
        subprocess.run([*user, f"{pg_bin}/pg_ctl", "-D", data, "-w", "-l", os.path.join(tmp, "pg.log"), *args], **run)
    pg_ctl("-o", f"-p {port} -k {tmp} -c listen_addresses=127.0.0.1", "start")
    try:
        store_dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        env = {"QAG_DATABASE_URL": store_dsn, "QAG_ADMIN_KEY": "shared-admin"}
        a = start_server(env, args=("--workers", "1"))
        b = start_server(env, args=("--workers", "1"))
        try:
            _post(a, "/api/v1/connections", {"name": "oltp", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                             "user": "postgres", "database": DATA})
            _post(a, "/api/v1/queries", {"name": "account", "connection_name": "oltp",
                                         "sql": "SELECT aid, bid, abalance FROM pgbench_accounts WHERE aid = :aid",
                                         "parameters": {"aid": {"type": "int", "required": True}}, "publish": True})
            k, keep = _key(a, "k"), _key(a, "keep")
            _wait_current(b)
            _warm(b, k)
            pg_ctl("-m", "fast", "stop")
            t0 = time.monotonic()
            while True:
                r = _call(b, k)
                if r.status_code == 503:
                    break
                assert r.status_code == 200, r.text
                assert time.monotonic() - t0 < RESTART_S, "B kept answering from entries it cannot prove current"
                time.sleep(0.05)
            assert r.json()["code"] == "store_unavailable"
            pg_ctl("-o", f"-p {port} -k {tmp} -c listen_addresses=127.0.0.1", "start")
            deadline = time.time() + 20
            while True:  # A's own store connection reconnects on its next call
                r = requests.patch(a.base + "/api/v1/api-keys/k", headers={**a.admin, **J},
                                   data=json.dumps({"active": False}), timeout=30)
                if r.status_code == 200:
                    break
                assert time.time() < deadline, r.text
                time.sleep(0.2)
            t0 = time.monotonic()
            while (r := _call(b, k)).status_code != 401:
                assert r.status_code in (200, 503), r.text
                assert r.status_code != 200, "B served a key revoked while it was cut off"
                assert time.monotonic() - t0 < 20
                time.sleep(0.05)
            _wait_current(b)
            assert _call(b, k).status_code == 401
            assert _call(b, keep).status_code == 200
        finally:
            a.stop()
            b.stop()
    finally:
        subprocess.run([*user, f"{pg_bin}/pg_ctl", "-D", data, "-m", "immediate", "stop"], capture_output=True,
                       check=False)
        shutil.rmtree(tmp, ignore_errors=True)
