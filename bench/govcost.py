#!/usr/bin/env python3
"""What governance costs a call, measured where the cost is: qag's own WSGI app in-process (no HTTP server,
no load generator), so the gateway's CPU per call is read without the noise of a shared machine's scheduler.

    python bench/govcost.py [--rounds 10] [--calls 1000] [--out FILE]

For each database (PostgreSQL: pgbench's `account` lookup on the oltp harness's data; MariaDB: the tpcc
harness's `customer` call) one app serves the same saved query to a plain key and to a governed key
(allowed_tables + a hash mask, as the harnesses' governed keys), in alternating rounds (the order flipped
every round). Each round: --calls calls, CPU seconds of this process (the app and the driver's client
side) per call. The cost of a pair = governed / plain - 1; reported as the median (min-max) over pairs, with
the masking stage alone (the plan's transforms applied to that call's result, timed on its own) beside it.
Needs the harnesses' data: run bench/oltp.py and bench/tpcc_mysql.py (any block) once first."""
from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WORKLOADS = {
    "postgres": {
        "connection": {"name": "db", "db": "postgres", "host": "127.0.0.1", "port": 5432, "user": "postgres",
                       "database": "qag_bench_oltp"},
        "query": {"name": "q", "connection_name": "db", "publish": True,
                  "sql": "SELECT aid, bid, abalance FROM pgbench_accounts WHERE aid = :aid",
                  "parameters": {"aid": {"type": "int", "required": True}}},
        "governed": {"allowed_tables": ["pgbench_accounts", "pgbench_branches"],
                     "mask": [{"column": "*.abalance", "action": "hash"}]},
        "qs": lambda rnd: f"aid={rnd.randint(100000, 999999)}",
    },
    "mariadb": {
        "connection": {"name": "db", "db": "mysql", "host": "127.0.0.1", "port": 3306, "user": "root",
                       "database": "qagb_crm"},
        "query": {"name": "q", "connection_name": "db", "publish": True,
                  "sql": "SELECT c_id, c_first, c_middle, c_last, c_phone, c_credit, c_balance FROM "
                         "qagb_crm.customer WHERE c_w_id = :w AND c_d_id = :d AND c_id = :c",
                  "parameters": {"w": {"type": "int"}, "d": {"type": "int"}, "c": {"type": "int"}}},
        "governed": {"allowed_tables": ["qagb_crm.customer"], "mask": [{"column": "*.c_balance", "action": "hash"}]},
        "qs": lambda rnd: f"w=1&d={rnd.randint(1, 10)}&c={rnd.randint(1, 300)}",
    },
}


def make_app(home):
    os.environ.update({"QAG_HOME": home, "QAG_ADMIN_KEY": "bench-admin-key", "QAG_DATABASE_URL": ""})
    from qag import config
    from qag.app import create_app
    return create_app(config.load())


def caller(app):
    def call(method, path, qs="", body=None, key=None):
        data = json.dumps(body).encode() if body is not None else b""
        env = {"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": qs, "SERVER_NAME": "bench",
               "SERVER_PORT": "80", "wsgi.url_scheme": "http", "SERVER_PROTOCOL": "HTTP/1.1",
               "REMOTE_ADDR": "127.0.0.1", "wsgi.errors": sys.stderr, "wsgi.input": io.BytesIO(data),
               "CONTENT_LENGTH": str(len(data))}
        if body is not None:
            env["CONTENT_TYPE"] = "application/json"
        if key:
            env["HTTP_X_API_KEY"] = key
        status = []
        out = b"".join(app(env, lambda s, h, e=None: status.append(s)))
        return int(status[0].split()[0]), out
    return call


def measure(name, w, rounds, calls, rnd):
    home = tempfile.mkdtemp(prefix="qag-govcost-")
    app = make_app(home)
    call = caller(app)
    admin = "bench-admin-key"
    for path, body in (("/api/v1/connections", w["connection"]), ("/api/v1/queries", w["query"])):
        st, out = call("POST", path, body=body, key=admin)
        if st != 201:
            sys.exit(f"{name}: {path} -> {st} {out[:300]!r} (run the harness once to create its data)")
    keys = {}
    for label, extra in (("plain", {}), ("governed", w["governed"])):
        st, out = call("POST", "/api/v1/api-keys", key=admin,
                       body={"name": label, "queries": ["q"], "connections": [], **extra})
        keys[label] = json.loads(out)["secret"]
    for k in keys.values():  # warm: plans, pools, the mask key
        for _ in range(200):
            st, out = call("GET", "/q/q", w["qs"](rnd), key=k)
            assert st == 200, out[:300]
    rt = app.runtime
    per = {"plain": [], "governed": []}
    for i in range(rounds):
        for label in (("plain", "governed") if i % 2 == 0 else ("governed", "plain")):
            qs = [w["qs"](rnd) for _ in range(calls)]
            t = time.process_time()
            for q in qs:
                call("GET", "/q/q", q, key=keys[label])
            per[label].append((time.process_time() - t) / calls * 1e6)
    # the masking stage on its own: the governed plan's transforms over one call's result
    p = rt.authenticate(keys["governed"], "127.0.0.1")
    plan, _crow, connector = rt.plan(p, "q", None)
    from qag.params import bind
    args = plan.bind_args(bind(plan.specs, dict(x.split("=") for x in w["qs"](rnd).split("&")), 65536))
    cols, rows, _ = connector.run(plan.paged_sql(1, 10), args, write=False, timeout=None, max_rows=None)
    n = 20000
    t = time.process_time()
    for _ in range(n):
        app.apply_transforms(plan.transforms, cols, rows, rt.mask_key, plan.names)
    stage = (time.process_time() - t) / n * 1e6
    rt.close()
    rt.store.close()
    pairs = [100.0 * (g / pl - 1) for pl, g in zip(per["plain"], per["governed"])]
    return {"database": name, "rounds": rounds, "calls": calls,
            "plain_cpu_us": per["plain"], "governed_cpu_us": per["governed"], "cost_pct": pairs,
            "mask_stage_us": round(stage, 2), "rows_per_call": len(rows),
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load1": os.getloadavg()[0]}


def fmt(vals, digits=1):
    m = statistics.median(vals)
    return f"{m:.{digits}f} ({min(vals):.{digits}f} to {max(vals):.{digits}f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--databases", default="postgres,mariadb")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "govcost", "results.jsonl"))
    opts = ap.parse_args()
    rnd = random.Random(7)
    os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
    print("| database | plain CPU µs/call | governed CPU µs/call | cost per pair | masking stage µs | its share |")
    print("|---|---|---|---|---|---|")
    for name in opts.databases.split(","):
        r = measure(name, WORKLOADS[name], opts.rounds, opts.calls, rnd)
        with open(opts.out, "a") as f:
            f.write(json.dumps(r) + "\n")
        share = 100.0 * r["mask_stage_us"] / statistics.median(r["governed_cpu_us"])
        print(f"| {name} | {fmt(r['plain_cpu_us'], 0)} | {fmt(r['governed_cpu_us'], 0)} | {fmt(r['cost_pct'])} % "
              f"| {r['mask_stage_us']:.1f} | {share:.1f} % |", flush=True)


if __name__ == "__main__":
    main()
