#!/usr/bin/env python3
"""Fault experiment (issue 13 item 9): the run store unwritable for 60 s under steady load.

    python bench/faults_journal.py [--root DIR] [--label NAME] [--outage 90] [--conns 16] [--out FILE]

`qag serve --workers 2` from --root (a checkout: the one to measure; default this one) with its default
segment (2 MiB rings a worker) and the default run store (SQLite runs.db in QAG_HOME), serving a PK
lookup on a pgbench database of its own (qag_journal_faults, scale 1, on 127.0.0.1:5432) to wrk (16
connections, closed loop). The run store is made unwritable by an exclusive transaction this script
holds on runs.db (every commit of the recorder waits, as on a store that does not answer) for --outage
seconds (90 by default: at ~750 calls/s the two rings, ~42,000 runs, fill after about 55 s), then
released. wrk runs 10 s before, through the outage in 30-s pieces (calls/s of each), and 10 s after. Then the script
waits for the recorder to catch up and reports: calls/s before, during and after; the slowest calls
(wrk's p99 and max) during the outage; calls answered, runs recorded (usage), runs lost
(qag_runs_lost_total and answered - recorded).

Run it for the code before and after a change (e.g. `git worktree add /tmp/before <commit>` and
`--root /tmp/before --label before`): results are JSON lines appended to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PG = "postgresql://postgres@127.0.0.1:5432/postgres"
DB = "qag_journal_faults"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_pgbench() -> None:
    import psycopg2

    c = psycopg2.connect(PG)
    c.autocommit = True
    cur = c.cursor()
    cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB,))
    if cur.fetchone() is None:
        cur.execute(f'CREATE DATABASE "{DB}"')
        subprocess.run(["pgbench", "-i", "-s", "1", "-q", "-h", "127.0.0.1", "-U", "postgres", DB], check=True,
                       capture_output=True)
    c.close()


def http(method, url, headers=None, body=None, timeout=30):
    req = urllib.request.Request(url, method=method, headers=headers or {},
                                 data=json.dumps(body).encode() if body is not None else None)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wrk(url, key, seconds, conns) -> dict:
    out = subprocess.run(["wrk", "-t", "1", "-c", str(conns), "-d", f"{seconds}s", "--latency", "--timeout", "30s",
                          "-H", f"X-API-Key: {key}", url], capture_output=True, text=True, check=True).stdout
    res = {"seconds": seconds}
    m = re.search(r"(\d+) requests in ([\d.]+)(\w+)", out)
    if m is None:
        raise RuntimeError("unexpected wrk output:\n" + out)
    res["requests"] = int(m.group(1))
    res["rps"] = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    res["non_2xx"] = int(m.group(1)) if m else 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    res["socket_errors"] = sum(int(x) for x in m.groups()) if m else 0

    def ms(text):
        v, unit = float(text[:-2] if text.endswith(("ms", "us")) else text[:-1]), text[-2:]
        return v if unit == "ms" else v / 1000 if unit == "us" else v * 1000
    m = re.search(r"99%\s+([\d.]+\w+)", out)
    res["p99_ms"] = ms(m.group(1)) if m else None
    m = re.search(r"Latency\s+[\d.]+\w+\s+[\d.]+\w+\s+([\d.]+\w+)", out)
    res["max_ms"] = ms(m.group(1)) if m else None
    return res


def metric(base, name) -> float:
    _s, body = http("GET", base + "/metrics")
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def usage_calls(base, admin) -> int | None:
    status, body = http("GET", base + "/api/v1/usage?per=day&query=account", headers=admin)
    if status != 200:
        return None
    return sum(x["calls"] for x in json.loads(body)["items"])


def run(root: str, label: str, outage: float, conns: int) -> dict:
    ensure_pgbench()
    port = free_port()
    home = tempfile.mkdtemp(prefix="qag-faults-journal-")
    admin_key = f"adm-{port}"
    env = dict(os.environ, QAG_HOME=home, QAG_ADMIN_KEY=admin_key, QAG_BIND=f"127.0.0.1:{port}",
               QAG_LOG_LEVEL="warning", PYTHONPATH=root)
    log = open(os.path.join(home, "server.log"), "w")  # noqa: SIM115 - the server's, closed with it
    proc = subprocess.Popen([sys.executable, "-m", "qag.cli", "serve", "--workers", "2"], env=env, cwd=root,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    admin = {"X-API-Key": admin_key}
    lock = None
    try:
        deadline = time.time() + 60
        while True:
            try:
                if http("GET", base + "/health", timeout=1)[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError("qag serve did not start: " + open(os.path.join(home, "server.log")).read()[-2000:])
            time.sleep(0.2)
        for path, body in (("/api/v1/connections", {"name": "oltp", "db": "postgres", "host": "127.0.0.1",
                                                    "port": 5432, "user": "postgres", "database": DB}),
                           ("/api/v1/queries", {"name": "account", "connection_name": "oltp",
                                                "sql": "SELECT aid, bid, abalance FROM pgbench_accounts "
                                                       "WHERE aid = :aid",
                                                "parameters": {"aid": {"type": "int", "required": True}},
                                                "publish": True})):
            st, b = http("POST", base + path, admin, body)
            assert st in (200, 201), b
        st, b = http("POST", base + "/api/v1/api-keys", admin, {"name": "faults", "queries": ["account"],
                                                                 "connections": ["oltp"]})
        assert st in (200, 201), b
        key = json.loads(b)["secret"]
        url = base + "/q/account?aid=42"
        warm = wrk(url, key, 3, conns)
        before = wrk(url, key, 10, conns)
        lock = sqlite3.connect(os.path.join(home, "runs.db"), isolation_level=None, timeout=30)
        lock.execute("BEGIN EXCLUSIVE")  # the run store cannot be written while this is held
        t0 = time.time()
        # the outage in segments of at most 30 s: calls/s as the rings fill, and after they are full
        parts = []
        left = int(outage)
        while left > 0:
            parts.append(wrk(url, key, min(30, left), conns))
            left -= parts[-1]["seconds"]
        during = {"requests": sum(p["requests"] for p in parts), "non_2xx": sum(p["non_2xx"] for p in parts),
                  "rps": round(sum(p["requests"] for p in parts) / outage, 1),
                  "p99_ms": max(p["p99_ms"] or 0 for p in parts), "max_ms": max(p["max_ms"] or 0 for p in parts)}
        lock.execute("ROLLBACK")
        lock.close()
        lock = None
        after = wrk(url, key, 10, conns)
        answered = warm["requests"] + before["requests"] + during["requests"] + after["requests"]
        deadline = time.time() + 600
        last, still = -1, 0
        while time.time() < deadline:
            calls = usage_calls(base, admin)
            if calls is not None and calls == last:
                still += 1
                if still >= 6:
                    break
            else:
                still = 0
            last = calls if calls is not None else last
            time.sleep(1)
        lost = metric(base, "qag_runs_lost_total")
        recorded = last
        res = {"label": label, "root": root, "outage_s": outage, "conns": conns,
               "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
               "load_avg": os.getloadavg()[0], "rps_before": before["rps"], "rps_during": during["rps"],
               "rps_after": after["rps"], "rps_during_parts": [p["rps"] for p in parts],
               "p99_ms_during": during["p99_ms"], "max_ms_during": during["max_ms"],
               "answered": answered, "answered_during": during["requests"],
               "non_2xx": warm["non_2xx"] + before["non_2xx"] + during["non_2xx"] + after["non_2xx"],
               "recorded": recorded, "missing": answered - (recorded or 0), "runs_lost_metric": lost,
               "journal_spilled": metric(base, "qag_journal_spilled_runs_total")}
        return res
    finally:
        if lock is not None:
            lock.close()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
        shutil.rmtree(home, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=HERE, help="checkout whose qag is measured")
    ap.add_argument("--label", default="after")
    ap.add_argument("--outage", type=float, default=90.0)
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--out", default=os.path.join(HERE, "bench", "out", "faults", "journal.jsonl"))
    args = ap.parse_args(argv)
    res = run(os.path.abspath(args.root), args.label, args.outage, args.conns)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(res) + "\n")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
