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
Uses the harnesses' data when present (bench/oltp.py, bench/tpcc_mysql.py); otherwise it makes a small copy of
the same shape itself (`pgbench -i -s 1` into qag_govcost_oltp, 3,000 tpcc-like customers into qagb_govcost).

Plan time (once per key, query and version): for a set of representative statements per database (a lookup,
a join, a CTE, a window, an aggregate, a union, a subquery, JSON), the time to build the plan cold (every
analysis and marker cache emptied, the runtime's plan cache emptied; the connection's catalogue and function
list, read once per connection generation, warm), for the plain and for the governed key, median of --plan-rounds;
and beside it the catalogue reads themselves (introspection once per connection generation)."""
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
                       "database": "qag_bench_oltp", "options": {"allow_superuser": True}},
        "query": {"name": "q", "connection_name": "db", "publish": True,
                  "sql": "SELECT aid, bid, abalance FROM pgbench_accounts WHERE aid = :aid",
                  "parameters": {"aid": {"type": "int", "required": True}}},
        "governed": {"allowed_tables": ["pgbench_accounts", "pgbench_branches"],
                     "mask": [{"column": "*.abalance", "action": "hash"}]},
        "qs": lambda rnd: f"aid={rnd.randint(100000, 999999)}",
    },
    "mariadb": {
        "connection": {"name": "db", "db": "mysql", "host": "127.0.0.1", "port": 3306, "user": "root",
                       "database": "qagb_crm", "options": {"allow_superuser": True}},
        "query": {"name": "q", "connection_name": "db", "publish": True,
                  "sql": "SELECT c_id, c_first, c_middle, c_last, c_phone, c_credit, c_balance FROM "
                         "qagb_crm.customer WHERE c_w_id = :w AND c_d_id = :d AND c_id = :c",
                  "parameters": {"w": {"type": "int"}, "d": {"type": "int"}, "c": {"type": "int"}}},
        "governed": {"allowed_tables": ["qagb_crm.customer"], "mask": [{"column": "*.c_balance", "action": "hash"}]},
        "qs": lambda rnd: f"w=1&d={rnd.randint(1, 10)}&c={rnd.randint(1, 300)}",
    },
}


# Representative statements for the plan-time figures (each saved as its own query).
PLAN_SQL = {
    "postgres": {
        "lookup": "SELECT aid, bid, abalance FROM pgbench_accounts WHERE aid = :aid",
        "join": "SELECT a.aid, a.abalance, b.bbalance FROM pgbench_accounts a JOIN pgbench_branches b ON b.bid = a.bid "
                "WHERE a.aid BETWEEN :aid AND :aid + 99 ORDER BY a.aid",
        "cte": "WITH t AS (SELECT bid, sum(abalance) AS s FROM pgbench_accounts WHERE aid < :aid GROUP BY bid) "
               "SELECT b.bid, t.s FROM pgbench_branches b JOIN t ON t.bid = b.bid",
        "window": "SELECT aid, abalance, rank() OVER (PARTITION BY bid ORDER BY abalance DESC) AS r "
                  "FROM pgbench_accounts WHERE aid BETWEEN :aid AND :aid + 50",
        "aggregate": "SELECT bid, count(*) AS n, max(abalance) AS top FROM pgbench_accounts GROUP BY bid "
                     "HAVING count(*) > :aid",
        "union": "SELECT aid AS id, abalance AS v FROM pgbench_accounts WHERE aid = :aid UNION ALL "
                 "SELECT bid, bbalance FROM pgbench_branches",
        "subquery": "SELECT aid, abalance FROM pgbench_accounts WHERE bid IN (SELECT bid FROM pgbench_branches "
                    "WHERE bbalance >= 0) AND aid < :aid",
        "json": "SELECT json_build_object('aid', aid, 'bid', bid) AS doc FROM pgbench_accounts WHERE aid = :aid",
    },
    "mariadb": {
        "lookup": "SELECT c_id, c_first, c_last, c_balance FROM customer WHERE c_w_id = 1 AND c_d_id = 1 AND c_id = :c",
        "join": "SELECT c.c_id, c.c_balance, d.c_id AS other FROM customer c JOIN customer d ON d.c_id = c.c_id + 1 "
                "WHERE c.c_id = :c",
        "cte": "WITH t AS (SELECT c_d_id, sum(c_balance) AS s FROM customer WHERE c_id < :c GROUP BY c_d_id) "
               "SELECT c_d_id, s FROM t",
        "window": "SELECT c_id, c_balance, rank() OVER (PARTITION BY c_d_id ORDER BY c_balance DESC) AS r "
                  "FROM customer WHERE c_id < :c",
        "aggregate": "SELECT c_d_id, count(*) AS n, max(c_balance) AS top FROM customer GROUP BY c_d_id "
                     "HAVING count(*) > :c",
        "union": "SELECT c_id AS id, c_balance AS v FROM customer WHERE c_id = :c UNION ALL "
                 "SELECT c_d_id, c_credit_lim FROM customer WHERE c_id = 1",
        "subquery": "SELECT c_id, c_balance FROM customer "
                    "WHERE c_d_id IN (SELECT c_d_id FROM customer WHERE c_id = :c)",
        "json": "SELECT JSON_OBJECT('id', c_id, 'last', c_last) AS doc FROM customer WHERE c_id = :c",
    },
}


def ensure_data(name, w):
    """Point the workload at the harness's data, or make a small copy of the same shape."""
    if name == "postgres":
        import psycopg2
        try:
            psycopg2.connect(host="127.0.0.1", user="postgres", dbname=w["connection"]["database"]).close()
            return
        except psycopg2.OperationalError:
            pass
        db = "qag_govcost_oltp"
        w["connection"]["database"] = db
        conn = psycopg2.connect(host="127.0.0.1", user="postgres", dbname="postgres")
        conn.autocommit = True
        cur = conn.cursor()
        cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (db,))
        if not cur.fetchone():
            cur.execute(f"CREATE DATABASE {db}")
            import subprocess
            subprocess.run(["pgbench", "-i", "-s", "1", "-q", "-h", "127.0.0.1", "-U", "postgres", db], check=True,
                           capture_output=True)
        conn.close()
        w["qs"] = lambda rnd: f"aid={rnd.randint(1, 100000)}"
        return
    import mysql.connector
    conn = mysql.connector.connect(host="127.0.0.1", user="root", password="", autocommit=True)
    cur = conn.cursor()
    cur.execute("SHOW DATABASES LIKE 'qagb_crm'")
    if cur.fetchall():
        conn.close()
        return
    db = "qagb_govcost"
    w["connection"]["database"] = db
    w["query"]["sql"] = w["query"]["sql"].replace("qagb_crm.", db + ".")
    w["governed"]["allowed_tables"] = [db + ".customer"]
    cur.execute(f"CREATE DATABASE IF NOT EXISTS {db}")
    cur.execute(f"CREATE TABLE IF NOT EXISTS {db}.customer (c_w_id INT, c_d_id INT, c_id INT, c_first VARCHAR(16), "
                "c_middle CHAR(2), c_last VARCHAR(16), c_phone CHAR(16), c_credit CHAR(2), c_credit_lim DECIMAL(12,2), "
                "c_balance DECIMAL(12,2), PRIMARY KEY (c_w_id, c_d_id, c_id))")
    cur.execute(f"SELECT count(*) FROM {db}.customer")
    if cur.fetchone()[0] == 0:
        rows = [(1, d, c, f"first{c}", "OE", f"last{c}", f"{c:016d}", "GC", 50000, c * 1.5)
                for d in range(1, 11) for c in range(1, 301)]
        cur.executemany(f"INSERT INTO {db}.customer VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)", rows)
    conn.close()


def _clear_analysis_caches():
    """Empty every memoised function of the analysis (sqlglot/pglast parses, marker scans): a cold plan."""
    import importlib
    import pkgutil

    import qag.governance
    mods = ["qag.params", "qag.plan"] + [f"qag.governance.{m.name}"
                                         for m in pkgutil.iter_modules(qag.governance.__path__)]
    n = 0
    for mod in mods:
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        for v in vars(m).values():
            if callable(getattr(v, "cache_clear", None)):
                v.cache_clear()
                n += 1
    return n


def plan_time(name, w, rounds):
    """Cold plan building per representative statement (plain and governed key), and the catalogue reads."""
    home = tempfile.mkdtemp(prefix="qag-govcost-plan-")
    app = make_app(home)
    call = caller(app)
    admin = "bench-admin-key"
    st, out = call("POST", "/api/v1/connections", body=w["connection"], key=admin)
    assert st == 201, out[:300]
    stmts = PLAN_SQL[name]
    for qn, sql in stmts.items():
        params = {"aid": "int"} if ":aid" in sql else {"c": "int"}
        st, out = call("POST", "/api/v1/queries", key=admin, body={"name": qn, "connection_name": "db", "sql": sql,
                                                                  "parameters": params, "publish": True})
        assert st == 201, (qn, out[:300])
    gov = dict(w["governed"])
    if name == "postgres":
        gov["allowed_tables"] = ["pgbench_accounts", "pgbench_branches"]
    keys = {}
    for label, extra in (("plain", {}), ("governed", gov)):
        st, out = call("POST", "/api/v1/api-keys", key=admin,
                       body={"name": label, "queries": list(stmts), "connections": [], **extra})
        keys[label] = json.loads(out)["secret"]
    rt = app.runtime
    principals = {k: app.auth.authenticate(v, "127.0.0.1") for k, v in keys.items()}
    # the catalogue and function list: once per connection generation
    _crow, connector, _cgen = rt.connection("db")
    t = time.perf_counter()
    connector.introspect()
    introspect_ms = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    connector.user_functions()
    functions_ms = (time.perf_counter() - t) * 1e3
    views_ms = None
    if hasattr(connector, "views"):  # the views' definitions, for keys that read views as their definitions
        t = time.perf_counter()
        connector.views()
        views_ms = (time.perf_counter() - t) * 1e3
    from qag.errors import ApiError
    refused = {}
    for label, p in principals.items():  # warm the connection's catalogue caches and pools
        for qn in stmts:
            try:
                rt.plan(p, qn, None)
            except ApiError as exc:  # a refusal is decided at plan time too: its cost is timed the same
                refused[(label, qn)] = exc.code
    res = {}
    for qn in stmts:
        per = {"plain": [], "governed": []}
        for i in range(rounds):
            for label in (("plain", "governed") if i % 2 == 0 else ("governed", "plain")):
                rt.plans.clear()
                _clear_analysis_caches()
                t = time.process_time()  # CPU: the build is pure computation once the catalogue is warm
                try:
                    rt.plan(principals[label], qn, None)
                except ApiError:
                    pass
                per[label].append((time.process_time() - t) * 1e3)
        res[qn] = {k: statistics.median(v) for k, v in per.items()}
        res[qn]["refused"] = {k: c for (k, q), c in refused.items() if q == qn}
    rt.close()
    rt.store.close()
    return {"database": name, "kind": "plan_time", "rounds": rounds, "per_statement_ms": res,
            "introspect_ms": round(introspect_ms, 2), "user_functions_ms": round(functions_ms, 2),
            "views_ms": None if views_ms is None else round(views_ms, 2),
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load1": os.getloadavg()[0]}


def make_app(home):
    os.environ.update({"QAG_HOME": home, "QAG_ADMIN_KEY": "bench-admin-key", "QAG_DATABASE_URL": ""})
    from qag import config
    from qag.http.app import create_app
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
    p = app.auth.authenticate(keys["governed"], "127.0.0.1")
    plan, _crow, connector = rt.plan(p, "q", None)
    from qag.params import bind
    args = plan.bind_args(bind(plan.specs, dict(x.split("=") for x in w["qs"](rnd).split("&")), 65536))
    cols, rows, _ = connector.run(plan.paged_sql(1, 10), args, write=False, timeout=None, max_rows=None)
    from qag.http.data import apply_transforms
    n = 20000
    t = time.process_time()
    for _ in range(n):
        apply_transforms(plan.transforms, cols, rows, rt.mask_key, plan.names)
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
    ap.add_argument("--plan-rounds", type=int, default=20, help="cold plan builds per statement and key")
    ap.add_argument("--skip-calls", action="store_true", help="only the plan-time figures")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "govcost", "results.jsonl"))
    opts = ap.parse_args()
    rnd = random.Random(7)
    os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
    names = opts.databases.split(",")
    for name in names:
        ensure_data(name, WORKLOADS[name])
    print("Plan time (once per key, query and version), cold, CPU ms, median of", opts.plan_rounds, "builds:")
    print()
    print("| database | statement | plain key | governed key | governed − plain |")
    print("|---|---|---|---|---|")
    for name in names:
        r = plan_time(name, WORKLOADS[name], opts.plan_rounds)
        with open(opts.out, "a") as f:
            f.write(json.dumps(r) + "\n")
        for qn, v in r["per_statement_ms"].items():
            note = "".join(f" ({k} key refused: {c})" for k, c in v["refused"].items())
            print(f"| {name} | {qn}{note} | {v['plain']:.2f} | {v['governed']:.2f} | "
                  f"{v['governed'] - v['plain']:+.2f} |", flush=True)
        views = "" if r["views_ms"] is None else f", views {r['views_ms']:.1f}"
        print(f"| {name} | catalogue read, wall ms (once per connection generation) | {r['introspect_ms']:.1f} | "
              f"+ functions {r['user_functions_ms']:.1f}{views} | |", flush=True)
    if opts.skip_calls:
        return
    print()
    print("Hot path per call (CPU of this process, µs):")
    print()
    print("| database | plain CPU µs/call | governed CPU µs/call | cost per pair | masking stage µs | its share |")
    print("|---|---|---|---|---|---|")
    for name in names:
        r = measure(name, WORKLOADS[name], opts.rounds, opts.calls, rnd)
        with open(opts.out, "a") as f:
            f.write(json.dumps(r) + "\n")
        share = 100.0 * r["mask_stage_us"] / statistics.median(r["governed_cpu_us"])
        print(f"| {name} | {fmt(r['plain_cpu_us'], 0)} | {fmt(r['governed_cpu_us'], 0)} | {fmt(r['cost_pct'])} % "
              f"| {r['mask_stage_us']:.1f} | {share:.1f} % |", flush=True)


if __name__ == "__main__":
    main()
