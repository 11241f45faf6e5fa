"""Shared fixtures: real PostgreSQL and MariaDB databases, an in-process app, and real `qag serve` processes."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

PG_ADMIN_DSN = os.environ.get("QAG_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
MYSQL = dict(host="127.0.0.1", port=3306, user="root", password="")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def need_plane() -> str:
    """The data plane binary `qag serve --plane` will run (QAG_PLANE_BIN, `qag-plane` on PATH, else
    rustplane/target/release/qag-plane). Tests never build it: a cold `cargo build --release` takes longer than
    pytest's 300 s timeout on a 2-core machine, so `make plane` builds it once before pytest (`make test` does)."""
    from qag.server.arbiter import plane_binary
    binary = plane_binary()
    if binary is None or not os.path.exists(binary):
        pytest.fail("qag-plane is not built: run `make plane` (cd rustplane && cargo build --release) before "
                    "pytest, or set QAG_PLANE_BIN", pytrace=False)
    return binary


@pytest.fixture(scope="session")
def plane() -> str:
    """need_plane() as a fixture, for a module whose every test goes through the plane."""
    return need_plane()


def orders_db(path: str) -> str:
    """A small SQLite file of orders (id, cid, total, email), two rows; returns its path."""
    import sqlite3
    c = sqlite3.connect(path)
    c.executescript("CREATE TABLE orders (id INTEGER PRIMARY KEY, cid INTEGER, total REAL, email TEXT);"
                    "INSERT INTO orders VALUES (1, 7, 12.5, 'ann@example.com'), (2, 8, 3.0, 'bob@example.com');")
    c.commit()
    c.close()
    return path


def shm_name(prefix: str):
    """A fresh segment name for a test (yield from it in a fixture); its memory and semaphores go after."""
    import uuid
    n = f"/{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield n
    unlink_segment(n)


def unlink_segment(name: str) -> None:
    """A test segment's memory and its two semaphores gone, whichever of them exist."""
    import posix_ipc
    for unlink in (lambda: posix_ipc.unlink_shared_memory(name), lambda: posix_ipc.unlink_semaphore(name + "-w"),
                   lambda: posix_ipc.unlink_semaphore(name + "-r")):
        try:
            unlink()
        except posix_ipc.ExistentialError:
            pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg_fresh_db(name: str) -> str:
    """Drop and create a PostgreSQL database; returns its DSN."""
    import psycopg2
    conn = psycopg2.connect(PG_ADMIN_DSN)
    conn.autocommit = True
    cur = conn.cursor()
    cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,))
    cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
    cur.execute(f'CREATE DATABASE "{name}"')
    conn.close()
    return PG_ADMIN_DSN.rsplit("/", 1)[0] + "/" + name


def pg_exec(dsn: str, sql: str, args=()):
    import psycopg2
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        cur = conn.cursor()
        cur.execute(sql, args)
        return cur.fetchall() if cur.description else None
    finally:
        conn.close()


def mysql_exec(sql: str, args=(), database=None, multi=False):
    import mysql.connector
    conn = mysql.connector.connect(**MYSQL, database=database, autocommit=True)
    try:
        cur = conn.cursor()
        if multi:
            for stmt in [s for s in sql.split(";") if s.strip()]:
                cur.execute(stmt)
            return None
        cur.execute(sql, args)
        return cur.fetchall() if cur.description else None
    finally:
        conn.close()


@pytest.fixture(scope="session")
def pgbench_dsn():
    """A small pgbench database (scale 1) plus the seeds' schema, shared by the session."""
    dsn = pg_fresh_db("qag_core_pgbench")
    subprocess.run(["pgbench", "-i", "-s", "1", "-q", "-h", "127.0.0.1", "-U", "postgres", "qag_core_pgbench"],
                   check=True, capture_output=True)
    return dsn


@pytest.fixture()
def home(tmp_path):
    return str(tmp_path / "home")


@pytest.fixture()
def app_client(home):
    """The app in-process on a fresh SQLite store (single process: LocalGenerations)."""
    import falcon.testing

    from qag import config
    from qag.http.app import create_app
    cfg = config.load({"QAG_HOME": home, "QAG_ADMIN_KEY": "adm", "QAG_ALLOW_WRITES": "1"})
    app = create_app(cfg)
    client = falcon.testing.TestClient(app)
    client.app_obj = app
    yield client
    app.runtime.close()
    app.runtime.store.close()


class Server:
    def __init__(self, proc, base, env, log_path):
        self.proc = proc
        self.base = base
        self.env = env
        self.admin = {"X-API-Key": env["QAG_ADMIN_KEY"]}
        self.log_path = log_path

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, sig=signal.SIGTERM, timeout=20):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


_STARTED: list = []


@pytest.fixture(scope="session", autouse=True)
def _stop_every_server():
    """A test that fails before its own stop() must not leave a qag instance running."""
    yield
    for srv in _STARTED:
        try:
            srv.stop(timeout=10)
        except Exception:
            pass


def start_server(env_extra: dict | None = None, args=("--workers", "2"), wait=True) -> Server:
    import requests
    port = free_port()
    home = tempfile.mkdtemp(prefix="qag-e2e-")
    env = dict(os.environ)
    env.update({"QAG_HOME": home, "QAG_ADMIN_KEY": "adm-" + str(port), "QAG_BIND": f"127.0.0.1:{port}",
                "QAG_LOG_LEVEL": "warning"})
    env.update(env_extra or {})
    log_path = os.path.join(home, "server.log")
    logf = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "qag.cli", "serve", *args], env=env, stdout=logf,
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    srv = Server(proc, f"http://127.0.0.1:{port}", env, log_path)
    _STARTED.append(srv)
    if not wait:
        return srv
    deadline = time.time() + 30
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("qag serve exited:\n" + srv.log())
        try:
            if requests.get(srv.base + "/health", timeout=1).status_code == 200:
                return srv
        except requests.RequestException:
            pass
        time.sleep(0.1)
    srv.stop()
    raise RuntimeError("qag serve did not become healthy:\n" + srv.log())


@pytest.fixture()
def server_factory():
    servers = []

    def make(env_extra=None, args=("--workers", "2"), wait=True):
        s = start_server(env_extra, args, wait)
        servers.append(s)
        return s
    yield make
    for s in servers:
        s.stop()
