"""Fault experiments for the HTTP layer (issue 13, items 2, 3, 5, 6): a few clients against one `qag serve`.

Each scenario starts a private `qag serve` from a source tree (`--tree`, default this repository; point it at
a checkout of another commit for a before/after), holds it the way one bad or unlucky client would, and
measures what an innocent caller sees meanwhile: /health, a fast call of another key and the Management
API (latency, capped at --cap seconds), plus what the bad client holds (database sessions idle in
transaction, worker memory). Bounded in time and count; traffic only to 127.0.0.1.

    python bench/faults_http.py [scenarios...] [--tree PATH] [--cap 30] [--out FILE]

Scenarios: idle slowloris streams events slow stop badkeys hotpath (default: all). Figures of a run go
to --out (JSON lines) and a table to stdout; bench/results/2026-12-01-faults/http.md keeps the recorded ones.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import psycopg2
import requests

PG = "postgresql://postgres@127.0.0.1:5432/"
DB = "qag_http_faults"
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg(sql, args=(), db="postgres"):
    conn = psycopg2.connect(PG + db)
    conn.autocommit = True
    try:
        cur = conn.cursor()
        cur.execute(sql, args)
        return cur.fetchall() if cur.description else None
    finally:
        conn.close()


class Server:
    def __init__(self, tree, env=None, args=("--workers", "1")):
        self.port = free_port()
        self.home = tempfile.mkdtemp(prefix="qag-faults-http-")
        self.env = dict(os.environ, PYTHONPATH=tree, QAG_HOME=self.home, QAG_ADMIN_KEY="adm",
                        QAG_BIND=f"127.0.0.1:{self.port}", QAG_LOG_LEVEL="warning", **(env or {}))
        self.log = open(os.path.join(self.home, "server.log"), "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "qag.cli", "serve", *args], env=self.env, cwd=tree,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.base = f"http://127.0.0.1:{self.port}"
        self.admin = {"X-API-Key": "adm"}
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if requests.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                time.sleep(0.1)
        raise RuntimeError("qag serve did not start")

    def post(self, path, body):
        r = requests.post(self.base + path, headers=self.admin, json=body, timeout=30)
        assert r.status_code in (200, 201), r.text
        return r.json()

    def setup(self) -> dict:
        self.post("/api/v1/connections", {"name": "pg", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                          "user": "postgres", "database": DB})
        for name, sql in (("fast", "SELECT 1 AS n"), ("slow", "SELECT 1 AS n FROM pg_sleep(5)"),
                          ("big", "SELECT g, repeat('x', 300) AS pad FROM generate_series(1, 400000) g")):
            self.post("/api/v1/queries", {"name": name, "connection_name": "pg", "sql": sql, "publish": True})
        keys = {}
        for name, grants in (("a", {"queries": ["*"]}), ("b", {"queries": ["*"]}), ("nothing", {})):
            keys[name] = {"X-API-Key": self.post("/api/v1/api-keys", {"name": name, **grants})["secret"]}
        return keys

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)

    def workers(self) -> list[int]:
        out = subprocess.run(["pgrep", "-s", str(self.proc.pid), "-f", "qag: worker"], capture_output=True,
                             text=True).stdout.split()
        return [int(p) for p in out]


def addr(srv):
    return ("127.0.0.1", srv.port)


def latency(srv, path, headers, cap) -> float | str:
    t = time.monotonic()
    try:
        r = requests.get(srv.base + path, headers=headers or {}, timeout=cap)
        took = time.monotonic() - t
        return round(took * 1000, 1) if r.status_code == 200 else f"{r.status_code} in {took * 1000:.0f} ms"
    except requests.RequestException:
        return f">{cap:g} s"


def innocent(srv, keys, cap) -> dict:
    return {"health_ms": latency(srv, "/health", None, cap), "metrics_ms": latency(srv, "/metrics", None, cap),
            "manage_ms": latency(srv, "/api/v1/api-keys", srv.admin, cap),
            "fast_call_ms": latency(srv, "/q/fast", keys["b"], cap)}


def idle_in_transaction() -> int:
    return pg("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND application_name = 'qag' "
              "AND state = 'idle in transaction'", (DB,))[0][0]


# -- scenarios --------------------------------------------------------------------------------------------
def s_idle(tree, cap):
    """2,100 idle connections on 2 workers (default limit 1,000 each): 1,100 kept alive after a call, 1,000
    that never send a byte."""
    srv = Server(tree, args=("--workers", "2"))
    socks = []
    try:
        keys = srv.setup()
        kept = [socket.create_connection(addr(srv), timeout=10) for _ in range(1100)]
        for s in kept:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        for s in kept:
            try:
                s.recv(4096)
            except OSError:
                pass
        socks = kept + [socket.create_connection(addr(srv), timeout=10) for _ in range(1000)]
        return innocent(srv, keys, cap)
    finally:
        for s in socks:
            s.close()
        srv.stop()


def s_slowloris(tree, cap):
    """12 connections on 1 worker with 4 threads: 8 send half a request line or half the headers, 4 half a body."""
    srv = Server(tree, args=("--workers", "1", "--threads", "4"))
    socks = []
    try:
        keys = srv.setup()
        for i in range(12):
            s = socket.create_connection(addr(srv), timeout=10)
            s.sendall(b"POST /q/fast HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{" if i >= 8 else
                      b"GET /q/fa" if i % 2 else b"GET /q/fast HTTP/1.1\r\nHost: x\r\nX-API-")
            socks.append(s)
        time.sleep(0.5)
        out = innocent(srv, keys, cap)
        t = time.monotonic()
        closed = 0
        for s in socks:
            s.settimeout(max(0.1, cap - (time.monotonic() - t)))
            try:
                closed += s.recv(100) == b""
            except OSError:
                pass
        out["slow_clients_closed"] = f"{closed}/12"
        return out
    finally:
        for s in socks:
            s.close()
        srv.stop()


def s_streams(tree, cap):
    """8 readers of a 400,000-row ?stream=true answer (about 120 MB of CSV) that stop reading; 1 worker, 4 threads."""
    srv = Server(tree, args=("--workers", "1", "--threads", "4"))
    socks = []
    try:
        keys = srv.setup()
        secret = keys["a"]["X-API-Key"]
        refused = 0
        for _ in range(8):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.settimeout(3)
            s.connect(addr(srv))
            s.sendall(f"GET /q/big?format=csv&stream=true HTTP/1.1\r\nHost: x\r\nX-API-Key: {secret}\r\n\r\n".encode())
            socks.append(s)
            time.sleep(0.2)
        for s in socks:
            try:
                refused += s.recv(64).startswith(b"HTTP/1.1 503")
            except OSError:
                pass
        out = {"refused_503": refused, "idle_in_transaction_at_2s": idle_in_transaction()}
        out.update(innocent(srv, keys, cap))
        t = time.monotonic()
        while idle_in_transaction() and time.monotonic() - t < 40:
            time.sleep(0.5)
        left = idle_in_transaction()
        out["sessions_released_after_s"] = round(time.monotonic() - t, 1) if not left else f"{left} still held at 40 s"
        return out
    finally:
        for s in socks:
            s.close()
        srv.stop()


def s_events(tree, cap):
    """12 idle /events subscribers of a key granted nothing; 1 worker, 4 threads."""
    srv = Server(tree, args=("--workers", "1", "--threads", "4"))
    subs = []
    try:
        keys = srv.setup()
        codes = []

        def subscribe():
            try:
                r = requests.get(srv.base + "/events", headers=keys["nothing"], stream=True, timeout=(5, cap))
                codes.append(r.status_code)
                subs.append(r)
            except requests.RequestException:
                codes.append("timeout")
        ts = [threading.Thread(target=subscribe) for _ in range(12)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(cap)
        out = {"subscribed": codes.count(200), "refused_503": codes.count(503)}
        out.update(innocent(srv, keys, cap))
        return out
    finally:
        for r in subs:
            r.close()
        srv.stop()


def s_slow(tree, cap):
    """16 concurrent 5-second calls of one key on 1 worker with QAG_THREADS=4."""
    srv = Server(tree, {"QAG_THREADS": "4"}, args=("--workers", "1"))
    try:
        keys = srv.setup()
        codes = []

        def call():
            try:
                codes.append(requests.get(srv.base + "/q/slow", headers=keys["a"], timeout=60).status_code)
            except requests.RequestException:
                codes.append("timeout")
        ts = [threading.Thread(target=call) for _ in range(16)]
        for t in ts:
            t.start()
        time.sleep(0.5)
        out = innocent(srv, keys, cap)
        for t in ts:
            t.join(90)
        out["slow_calls"] = {str(c): codes.count(c) for c in sorted(set(codes), key=str)}
        return out
    finally:
        srv.stop()


def s_stop(tree, cap):
    """SIGTERM with a 5-second call in flight, then 16 connection attempts 50 ms apart."""
    srv = Server(tree, args=("--workers", "1"))
    keys = srv.setup()
    res = {}

    def call():
        try:
            res["status"] = requests.get(srv.base + "/q/slow", headers=keys["a"], timeout=30).status_code
        except requests.RequestException as e:
            res["status"] = type(e).__name__
    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.5)
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    outcomes = []
    for _ in range(16):
        try:
            s = socket.create_connection(addr(srv), timeout=5)
        except ConnectionRefusedError:
            outcomes.append("refused")
            continue
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            outcomes.append("answered" if s.recv(100).startswith(b"HTTP/1.1 200") else "reset")
        except OSError:
            outcomes.append("reset")
        finally:
            s.close()
        time.sleep(0.05)
    t.join(30)
    srv.proc.wait(30)
    return {"in_flight_call": res.get("status"), **{k: outcomes.count(k) for k in ("refused", "answered", "reset")}}


def rss_kb(pid) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def s_badkeys(tree, cap, n=20_000):
    """20,000 calls, each with a new wrong X-API-Key, on 1 worker: its resident memory before and after."""
    srv = Server(tree, args=("--workers", "1"))
    try:
        srv.setup()
        (pid,) = srv.workers()
        s = requests.Session()
        for i in range(2000):
            s.get(srv.base + "/q/fast", headers={"X-API-Key": f"sk_warm{i}"}, timeout=10)
        before = rss_kb(pid)
        for i in range(n):
            s.get(srv.base + "/q/fast", headers={"X-API-Key": f"sk_wrong{i:08d}{'x' * 24}"}, timeout=10)
        return {"wrong_keys": n, "worker_rss_growth_kb": rss_kb(pid) - before}
    finally:
        srv.stop()


def s_hotpath(tree, cap, seconds=8):
    """The request path's cost: wrk, 1 thread, 32 connections, a one-row lookup, 1 worker pinned to CPU 0, wrk
    on CPU 1; requests/s and the worker's CPU seconds per call."""
    srv = Server(tree, {"QAG_WORKERS": "1"}, args=())
    try:
        keys = srv.setup()
        (pid,) = srv.workers()
        for _ in range(200):
            requests.get(srv.base + "/q/fast", headers=keys["a"], timeout=10)

        def cpu():
            f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        c0 = cpu()
        out = subprocess.run(["taskset", "-c", "1", "wrk", "-t1", "-c32", f"-d{seconds}s", "-H",
                              f"X-API-Key: {keys['a']['X-API-Key']}", srv.base + "/q/fast"],
                             capture_output=True, text=True).stdout
        c1 = cpu()
        rps = float(next(x for x in out.splitlines() if x.startswith("Requests/sec")).split()[1])
        non2xx = next((int(x.split()[-1]) for x in out.splitlines() if "Non-2xx" in x), 0)
        return {"rps": round(rps), "worker_cpu_us_per_call": round((c1 - c0) / (rps * seconds) * 1e6),
                "non_2xx": non2xx}
    finally:
        srv.stop()


SCENARIOS = {"idle": s_idle, "slowloris": s_slowloris, "streams": s_streams, "events": s_events, "slow": s_slow,
             "stop": s_stop, "badkeys": s_badkeys, "hotpath": s_hotpath}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenarios", nargs="*", default=list(SCENARIOS))
    p.add_argument("--tree", default=HERE, help="source tree whose qag is started (default: this one)")
    p.add_argument("--cap", type=float, default=30.0, help="longest wait for an innocent call, in seconds")
    p.add_argument("--out", default=os.path.join(HERE, "bench", "out", "faults_http.jsonl"))
    p.add_argument("--label", default="")
    opts = p.parse_args()
    pg(f'DROP DATABASE IF EXISTS "{DB}"')
    pg(f'CREATE DATABASE "{DB}"')
    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    commit = subprocess.run(["git", "-C", opts.tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    with open(opts.out, "a") as f:
        for name in opts.scenarios:
            t = time.monotonic()
            row = {"scenario": name, "tree": opts.label or opts.tree, "commit": commit,
                   **SCENARIOS[name](opts.tree, opts.cap), "took_s": round(time.monotonic() - t, 1)}
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
