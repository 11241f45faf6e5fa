#!/usr/bin/env python3
"""What deciding who a call is costs: qag/auth.py's per-call path in-process, on a real segment (the generations a
worker reads, through WatchedGenerations), CPU ns of this thread per call, so a shared machine's scheduler noise
stays out of the figure.

    python bench/authcost.py [--rounds 3] [--calls 10000] [--repeat 21] [--trees A,B]

Blocks: authenticate() of a warm key, of a warm key with a two-network allow-list, authenticate_caller() with
X-API-Key, check_rate() of a key without limits and of one with a rate limit (counted in the segment's per-host
windows: no Redis), and the warm plan lookup that follows. Each figure is the best of --repeat runs of --calls
calls. `--trees A,B` measures two source trees (e.g. main and a branch), rounds alternating between child
processes with PYTHONPATH=A and =B, the order flipped every round, for before/after figures."""
from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
import timeit
import uuid

BLOCKS = ("authenticate", "authenticate_ips", "authenticate_caller", "check_rate", "check_rate_limited", "plan")


def measure(calls: int, repeat: int) -> dict[str, float]:
    import falcon.testing

    import shm
    from qag import config
    from qag.http.app import create_app
    from qag.server.changes import WatchedGenerations

    tmp = tempfile.mkdtemp(prefix="qag-authcost-")
    seg = shm.Segment.create(f"/qag-authcost-{os.getpid()}-{uuid.uuid4().hex[:6]}", 4 * 1024 * 1024, slots=4)
    try:
        seg.set_slot(3, "other")
        seg.set_heartbeat(3, 1)
        gens = WatchedGenerations(seg, 3, stale_s=1e9)  # a watcher that stays caught up for the whole run
        cfg = config.load({"QAG_HOME": tmp, "QAG_ADMIN_KEY": "adm"})
        try:
            app = create_app(cfg, generations=gens)
        except TypeError:  # a tree before qag/auth.py
            app = create_app(cfg, gens=gens)
        client = falcon.testing.TestClient(app)
        adm = {"X-API-Key": "adm"}
        db = os.path.join(tmp, "x.db")
        with sqlite3.connect(db) as con:
            con.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
            con.execute("INSERT INTO t VALUES (1, 'a')")

        def post(path, body):
            r = client.simulate_post(path, headers=adm, body=json.dumps(body))
            assert r.status_code == 201, r.text
            return r.json

        post("/api/v1/connections", {"name": "db", "db": "sqlite", "database": db})
        post("/api/v1/queries", {"name": "q", "connection_name": "db", "sql": "SELECT id, v FROM t", "publish": True})
        secret = {name: post("/api/v1/api-keys", {"name": name, "queries": ["q"], **grants})["secret"]
                  for name, grants in (("plain", {}), ("ips", {"allowed_ips": ["10.0.0.0/8", "127.0.0.0/8"]}),
                                       ("rate", {"rate_limit": "100000000/second"}))}
        rt = app.runtime
        auth = getattr(app, "auth", rt)
        plain = auth.authenticate(secret["plain"], "127.0.0.1")
        limited = auth.authenticate(secret["rate"], "127.0.0.1")
        fns = {"authenticate": lambda: auth.authenticate(secret["plain"], "127.0.0.1"),
               "authenticate_ips": lambda: auth.authenticate(secret["ips"], "127.0.0.1"),
               "authenticate_caller": lambda: auth.authenticate_caller(secret["plain"], None, "127.0.0.1"),
               "check_rate": lambda: auth.check_rate(plain),
               "check_rate_limited": lambda: auth.check_rate(limited),
               "plan": lambda: rt.plan(plain, "q", None)}
        out = {}
        for name in BLOCKS:
            fns[name]()
            out[name] = min(timeit.repeat(fns[name], number=calls, repeat=repeat, timer=time.thread_time)) / calls * 1e9
        rt.close()
        rt.store.close()
        return out
    finally:
        seg.close()
        seg.unlink()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=21)
    ap.add_argument("--trees", default="", help="A,B: qag from these source trees, rounds alternating (children)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.child:
        print(json.dumps(measure(opts.calls, opts.repeat)))
        return 0
    trees = [t for t in opts.trees.split(",") if t] or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    results: dict[str, list[dict]] = {t: [] for t in trees}
    for r in range(opts.rounds):
        for tree in trees if r % 2 == 0 else list(reversed(trees)):
            env = dict(os.environ, PYTHONPATH=tree)
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--calls", str(opts.calls),
                                  "--repeat", str(opts.repeat)], env=env, capture_output=True, text=True, check=True)
            results[tree].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'ns per call (CPU, best of ' + str(opts.repeat) + ')':40s}" + "".join(f"{t[-28:]:>30s}" for t in trees))
    for name in BLOCKS:
        cells = ["/".join(f"{run[name]:.0f}" for run in results[t]) for t in trees]
        print(f"{name:40s}" + "".join(f"{c:>30s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
