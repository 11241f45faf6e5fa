#!/usr/bin/env python3
"""Fault experiments of the change watcher (issue 13, item 1): two hosts (two `qag serve` with their own QAG_HOME
and segment) on one PostgreSQL metadata store; a key is revoked through host A while host B's change watcher
is in trouble, and we measure how long B still serves it.

    PYTHONPATH=$PWD bench/faults_ops.py --trials 3 [--cap 30] [--out results.jsonl]

Run it with PYTHONPATH pointing at another checkout (say main before the fix) to get the "before" figures
(the servers start in a scratch directory, so PYTHONPATH alone decides which qag they run).
Scenarios: `control` (nothing wrong), `sigkill` (watcher SIGKILLed just before the revocation: it commits
while B has no watcher), `listen_cut` (the watchers' LISTEN sessions terminated by pg_terminate_backend),
`sigstop` (watcher hung for `--cap` seconds). Each trial prints one JSON line: scenario, trial, served_after_s
(None = still served at the cap). Databases: qag_ops_faults_store, qag_ops_faults_data on 127.0.0.1:5432.
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
import time

import psycopg2
import requests

PG = "postgresql://postgres@127.0.0.1:5432/"
J = {"Content-Type": "application/json"}
ADMIN = {"X-API-Key": "faults-admin"}


def fresh_db(name: str) -> str:
    conn = psycopg2.connect(PG + "postgres")
    conn.autocommit = True
    cur = conn.cursor()
    cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
    cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
    cur.execute(f'CREATE DATABASE "{name}"')
    conn.close()
    return PG + name


def sql(dsn: str, text: str, args=()):
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        cur = conn.cursor()
        cur.execute(text, args or None)
        return cur.fetchall() if cur.description else None
    finally:
        conn.close()


class Host:
    def __init__(self, store_dsn: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.home = tempfile.mkdtemp(prefix="qag-faults-ops-")
        self.base = f"http://127.0.0.1:{port}"
        env = dict(os.environ, QAG_HOME=self.home, QAG_BIND=f"127.0.0.1:{port}", QAG_DATABASE_URL=store_dsn,
                   QAG_ADMIN_KEY=ADMIN["X-API-Key"], QAG_LOG_LEVEL="warning")
        self.log = open(os.path.join(self.home, "server.log"), "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "qag.cli", "serve", "--workers", "1"], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=self.home)  # `-m` puts the cwd first on sys.path: PYTHONPATH must decide
        deadline = time.time() + 30
        while True:
            try:
                if requests.get(self.base + "/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline or self.proc.poll() is not None:
                raise SystemExit(f"qag serve did not start; see {self.home}/server.log")
            time.sleep(0.1)

    def child(self, title: str) -> int:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True, check=False).stdout
        for pid in map(int, out.split()):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if f.read().replace(b"\x00", b" ").decode().strip() == title:
                        return pid
            except OSError:
                pass
        raise RuntimeError(f"no {title!r} under the arbiter")

    def call(self, secret: str) -> int:
        return requests.get(self.base + "/q/account?aid=3", headers={"X-API-Key": secret}, timeout=30).status_code

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def post(h: Host, path: str, body: dict) -> dict:
    r = requests.post(h.base + path, headers={**ADMIN, **J}, data=json.dumps(body), timeout=30)
    r.raise_for_status()
    return r.json()


def trial(a: Host, b: Host, store_dsn: str, scenario: str, n: int, cap: float) -> dict:
    name = f"{scenario}-{n}"
    secret = post(a, "/api/v1/api-keys", {"name": name, "queries": ["account"], "connections": []})["secret"]
    time.sleep(2.0)  # B's watcher settles (and, after an earlier trial, has been restarted)
    for _ in range(20):
        assert b.call(secret) == 200
    stopped = None
    if scenario == "sigkill":
        os.kill(b.child("qag: changes"), signal.SIGKILL)
    elif scenario == "listen_cut":
        sql(store_dsn, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND application_name LIKE 'qag-changes%'")
    elif scenario == "sigstop":
        stopped = b.child("qag: changes")
        os.kill(stopped, signal.SIGSTOP)
    r = requests.patch(a.base + f"/api/v1/api-keys/{name}", headers={**ADMIN, **J},
                       data=json.dumps({"active": False}), timeout=30)
    r.raise_for_status()
    t0 = time.monotonic()
    served_after = None
    statuses: dict[int, int] = {}
    try:
        while time.monotonic() - t0 < cap:
            st = b.call(secret)
            statuses[st] = statuses.get(st, 0) + 1
            if st != 200:
                served_after = round(time.monotonic() - t0, 3)
                break
            time.sleep(0.02)
    finally:
        if stopped:
            os.kill(stopped, signal.SIGCONT)
    return {"scenario": scenario, "trial": n, "served_after_s": served_after, "cap_s": cap, "statuses": statuses}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--cap", type=float, default=30.0, help="seconds to keep calling B before giving up")
    ap.add_argument("--scenarios", default="control,sigkill,listen_cut,sigstop")
    ap.add_argument("--out", help="append the JSON lines here too")
    args = ap.parse_args()
    store_dsn = fresh_db("qag_ops_faults_store")
    data = fresh_db("qag_ops_faults_data")
    sql(data, "CREATE TABLE accounts (aid int PRIMARY KEY, abalance int); "
              "INSERT INTO accounts SELECT g, 0 FROM generate_series(1, 100) g")
    a = Host(store_dsn)
    b = Host(store_dsn)
    out = open(args.out, "a") if args.out else None
    try:
        post(a, "/api/v1/connections", {"name": "data", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                        "user": "postgres", "database": "qag_ops_faults_data"})
        post(a, "/api/v1/queries", {"name": "account", "connection_name": "data",
                                    "sql": "SELECT aid, abalance FROM accounts WHERE aid = :aid",
                                    "parameters": {"aid": {"type": "int", "required": True}}, "publish": True})
        for scenario in args.scenarios.split(","):
            for n in range(args.trials):
                rec = trial(a, b, store_dsn, scenario, n, args.cap)
                rec["code"] = os.environ.get("PYTHONPATH", "")
                line = json.dumps(rec)
                print(line, flush=True)
                if out:
                    out.write(line + "\n")
    finally:
        a.stop()
        b.stop()
        if out:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
