#!/usr/bin/env python3
"""What a limit costs a call, and what a second instance on the same cores costs (issue 17, "Measure").

Through real `qag serve` (the default): one instance (1 worker, pinned to --gateway-cpus) on a PostgreSQL store
and a private `redis-server` (its INFO commandstats count qag's Redis scripts, and nothing else's); a primary-key
lookup on PostgreSQL called by oha (--callers, on --load-cpus) with four keys in rotated rounds:

- `plain`: no limit;
- `rate`: `rate_limit: "1000000/minute"` (a token bucket in Redis, leased by each worker);
- `quota`: `quota: "1000000000/month"` (leased: far from the limit a call costs no Redis round trip);
- `quota_rows`: `{"calls": 1e9, "rows": 1e10, "per": "month"}` (calls and rows leased).

Every run offers the same load (--rate calls/s, open loop: below capacity, so each key's calls share the same
per-second work of the gateway; --rate 0 for a closed loop). Each run: calls/s, gateway CPU seconds (the
instance's whole process tree: arbiter, worker, recorder, from /proc), calls per gateway CPU-second, CPU µs
per call and Redis scripts per call. Per round, each limited key's CPU per call against the plain key's in the
same round: "more CPU" is median (min-max) over rounds.

Then two instances against one on the same cores: a second instance B (1 worker, the same CPUs, the same store
and Redis) and the quota key, in rotated rounds: `one` (A alone, --callers) against `two` (A and B together, each
with half the callers, two oha at once); calls per gateway CPU-second of the instances serving, and calls/s.

    bench/limits.py [--rounds 5] [--duration 5] [--callers 16] [--gateway-cpus 0] [--load-cpus 1]
                    [--rate 300] [--blocks limits,instances] [--out bench/out/limits]
    bench/limits.py --inproc [--rounds 5] [--calls 20000]      # the limiter alone, in-process (client CPU)

Writes results.jsonl and results.md in --out. Needs PostgreSQL on 127.0.0.1:5432 (postgres, trust),
`redis-server`, oha and taskset; databases `qag_limits_bench_data` and `qag_limits_bench_store` are recreated.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

DATA_DB = "qag_limits_bench_data"
STORE_DB = "qag_limits_bench_store"
ADMIN = "adm-limits-bench"
KEYS = {"plain": {}, "rate": {"rate_limit": "1000000/minute"}, "quota": {"quota": "1000000000/month"},
        "quota_rows": {"quota": {"calls": 10 ** 9, "rows": 10 ** 10, "per": "month"}}}


# ---------------------------------------------------------------- in-process: the limiter alone

class _Cfg:
    def __init__(self, url):
        self.redis_url = url


def inproc(url: str, rounds: int, calls: int) -> dict:
    """CPU µs per `Limiter.check` (process time: the client's side of a round trip counts, Redis's own work not)."""
    from qag.errors import ApiError
    from qag.limits import Limiter
    lim = Limiter(_Cfg(url), lambda *a: (False, 1, 1.0))
    tag = uuid.uuid4().hex[:8]
    cases = {"none": {}, "rate_limit": {"rate_limit": f"{calls * rounds * 4}/second"},
             "quota": {"quota": f"{10 ** 9}/month"},
             "quota_rows": {"quota": {"calls": 10 ** 9, "rows": 10 ** 10, "per": "month"}},
             # within 2 x 256 of its limit a quota is counted call by call, and refused calls too: 500, then 429s
             "quota_at_limit": {"quota": "500/month"}}
    out: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(rounds):
        for name in harness.rotated(list(cases), r):
            grants = cases[name]
            key = f"bench-{tag}-{name}-{r}"
            t0 = time.process_time()
            for _ in range(calls):
                try:
                    d = lim.check(key, grants)
                except ApiError:
                    continue
                if d is not None and d.rows_keys:
                    lim.count_rows(d, 1)
            out[name].append((time.process_time() - t0) / calls * 1e6)
    lim.return_leases()
    return out


# ---------------------------------------------------------------- through qag serve

def _psql(db: str, sql: str) -> None:
    import psycopg2
    conn = psycopg2.connect(f"postgresql://postgres@127.0.0.1:5432/{db}")
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(sql)
    conn.close()


def _recreate(name: str) -> None:
    _psql("postgres", f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    _psql("postgres", f'CREATE DATABASE "{name}"')


def _redis_server(tmp: str):
    port = harness.free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    import redis
    r = redis.Redis(port=port, socket_timeout=0.5)
    deadline = time.time() + 10
    while True:
        try:
            r.ping()
            return proc, port, r
        except redis.RedisError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)


def _scripts(r) -> int:
    stats = r.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


class Instance:
    def __init__(self, name, cpus, redis_port):
        self.name, self.port = name, harness.free_port()
        self.home = tempfile.mkdtemp(prefix=f"qag-limits-bench-{name}-")
        env = {k: v for k, v in os.environ.items() if not k.startswith("QAG_")}
        env.update({"QAG_HOME": self.home, "QAG_ADMIN_KEY": ADMIN, "QAG_LOG_LEVEL": "warning",
                    "QAG_DATABASE_URL": f"postgresql://postgres@127.0.0.1:5432/{STORE_DB}",
                    "QAG_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0"})
        cmd = harness.taskset_prefix(cpus) + [sys.executable, "-m", "qag.cli", "serve", "--bind",
                                               f"127.0.0.1:{self.port}", "--workers", "1"]
        self.log = open(os.path.join(self.home, "serve.log"), "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.base = f"http://127.0.0.1:{self.port}"
        harness.wait_http(self.base + "/health", 60, self.proc)

    def ticks(self, stats=None):
        return harness.tree_ticks(self.proc.pid, stats)

    def stop(self):
        harness.stop_process(self.proc)
        self.log.close()
        shutil.rmtree(self.home, ignore_errors=True)


def _setup(a: Instance) -> dict[str, str]:
    import requests
    h = {"X-API-Key": ADMIN}

    def post(path, body):
        r = requests.post(a.base + path, json=body, headers=h, timeout=30)
        assert r.status_code == 201, r.text
        return r.json()
    post("/api/v1/connections", {"name": "d", "db": "postgres", "host": "127.0.0.1", "port": 5432,
                                 "user": "postgres", "database": DATA_DB})
    post("/api/v1/queries", {"name": "lookup", "connection_name": "d", "publish": True,
                             "sql": "SELECT id, v FROM t WHERE id = :id",
                             "parameters": {"id": {"type": "int", "required": True}}})
    tag = uuid.uuid4().hex[:6]
    return {name: post("/api/v1/api-keys", {"name": f"bench-{name}-{tag}", "queries": ["lookup"], **grants})["secret"]
            for name, grants in KEYS.items()}


def _run(oha, bases_secrets, args):
    """oha against each (base, secret) at once (callers split between them); the instances' CPU and Redis's."""
    stats0 = harness.all_stats()
    insts = [b for b, _ in bases_secrets]
    t0 = {i.name: i.ticks(stats0) for i in insts}
    s0 = _scripts(args.redis)
    out = [None] * len(bases_secrets)
    conns = max(1, args.callers // len(bases_secrets))

    def one(j):
        inst, secret = bases_secrets[j]
        out[j] = harness.run_oha(oha, harness.regex_escape_base(inst.base + "/q/lookup?id=") + "[1-9][0-9]{3}",
                                 duration=args.duration, conns=conns, headers={"X-API-Key": secret},
                                 load_cpus=args.load_cpus,
                                 rate=(args.rate / len(bases_secrets)) if args.rate else None)
    threads = [threading.Thread(target=one, args=(j,)) for j in range(len(bases_secrets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats1 = harness.all_stats()
    cpu = sum(harness.delta_seconds(t0[i.name], i.ticks(stats1)) for i in insts)
    scripts = _scripts(args.redis) - s0
    ok = sum(o["n_2xx"] for o in out)
    bad = sum(o["non_2xx"] + o["errors"] for o in out)
    secs = max(o["duration_s"] for o in out)
    return {"calls": ok, "non_2xx": bad, "rps": round(ok / secs, 1), "gateway_cpu_s": round(cpu, 3),
            "calls_per_cpu_s": round(ok / cpu, 1) if cpu else None,
            "cpu_us_per_call": round(cpu / ok * 1e6, 1) if ok else None,
            "redis_scripts_per_call": round(scripts / ok, 5) if ok else None,
            "p50_ms": out[0]["p50_ms"], "p99_ms": out[0]["p99_ms"]}


def serve(args) -> int:
    oha = harness.find_oha(args.oha)
    if oha is None:
        harness.die(harness.OHA_HELP)
    os.makedirs(args.out, exist_ok=True)
    jsonl = os.path.join(args.out, "results.jsonl")
    session = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    _recreate(DATA_DB)
    _psql(DATA_DB, "CREATE TABLE t (id int PRIMARY KEY, v int); "
                   "INSERT INTO t SELECT g, g * 7 FROM generate_series(1, 10000) g; ANALYZE t")
    _recreate(STORE_DB)
    tmp = tempfile.mkdtemp(prefix="qag-limits-bench-redis-")
    rproc, rport, args.redis = _redis_server(tmp)
    a = b = None
    rows = []
    try:
        a = Instance("a", args.gateway_cpus, rport)
        secrets = _setup(a)
        for secret in secrets.values():   # warm: plans, pools, leases
            harness.run_oha(oha, harness.regex_escape_base(a.base + "/q/lookup?id=") + "[1-9][0-9]{3}",
                            duration=args.warmup, conns=8, headers={"X-API-Key": secret}, load_cpus=args.load_cpus)
        for rnd in range(args.rounds if "limits" in args.blocks else 0):
            for name in harness.rotated(list(KEYS), rnd):
                res = _run(oha, [(a, secrets[name])], args)
                row = {"session": session, "block": "limits", "round": rnd, "case": name, **res}
                rows.append(row)
                with open(jsonl, "a") as f:
                    f.write(json.dumps(row) + "\n")
                harness.progress(f"limits r{rnd} {name:<10} {res['calls_per_cpu_s']:>8} calls/CPU-s "
                                 f"{res['cpu_us_per_call']:>7} us/call {res['rps']:>8} calls/s "
                                 f"{res['redis_scripts_per_call']} scripts/call non-2xx {res['non_2xx']}")
        if "instances" in args.blocks:
            b = Instance("b", args.gateway_cpus, rport)
            harness.run_oha(oha, harness.regex_escape_base(b.base + "/q/lookup?id=") + "[1-9][0-9]{3}",
                            duration=args.warmup, conns=8, headers={"X-API-Key": secrets["quota"]},
                            load_cpus=args.load_cpus)
            for rnd in range(args.rounds):
                for case in harness.rotated(["one", "two"], rnd):
                    pairs = [(a, secrets["quota"])] + ([(b, secrets["quota"])] if case == "two" else [])
                    res = _run(oha, pairs, args)
                    row = {"session": session, "block": "instances", "round": rnd, "case": case, **res}
                    rows.append(row)
                    with open(jsonl, "a") as f:
                        f.write(json.dumps(row) + "\n")
                    harness.progress(f"instances r{rnd} {case:<4} {res['calls_per_cpu_s']:>8} calls/CPU-s "
                                     f"{res['rps']:>8} calls/s non-2xx {res['non_2xx']}")
    finally:
        for inst in (a, b):
            if inst is not None:
                inst.stop()
        harness.stop_process(rproc)
        shutil.rmtree(tmp, ignore_errors=True)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(report(rows, args))
    print(report(rows, args))
    return 1 if any(r["non_2xx"] for r in rows) else 0


def _mm(xs, fmt="{:.1f}"):
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def report(rows, args) -> str:
    lim = [r for r in rows if r["block"] == "limits"]
    out = [f"# What a limit costs a call through `qag serve` (bench/limits.py, {time.strftime('%Y-%m-%d')})", "",
           f"One instance, 1 worker on CPU {harness.cpu_list(args.gateway_cpus)}, oha with {args.callers} callers "
           f"on CPU {harness.cpu_list(args.load_cpus)}, "
           + (f"an open loop of {args.rate:g} calls/s in all (the same offered load for every key, below "
              "capacity, so the gateway's per-second work is shared by as many calls in every run), "
              if args.rate else "a closed loop, ")
           + f"{args.rounds} rotated rounds of {args.duration:g} s; a primary-key lookup on PostgreSQL; a "
           "private redis-server. Median (min-max) over rounds.", "",
           "| key | calls per gateway CPU-second | gateway CPU µs per call | calls/s | p50 ms |"
           " Redis scripts per call | more CPU per call than `plain` (per round) |", "|---|---|---|---|---|---|---|"]
    plain = {r["round"]: r for r in lim if r["case"] == "plain"}
    for name in KEYS:
        rs = [r for r in lim if r["case"] == name]
        if not rs:
            continue
        more = [r["cpu_us_per_call"] / plain[r["round"]]["cpu_us_per_call"] - 1 for r in rs]
        out.append(f"| `{name}` | {_mm([r['calls_per_cpu_s'] for r in rs], '{:,.0f}')} | "
                   f"{_mm([r['cpu_us_per_call'] for r in rs])} | {_mm([r['rps'] for r in rs], '{:,.0f}')} | "
                   f"{_mm([r['p50_ms'] for r in rs], '{:.2f}')} | "
                   f"{_mm([r['redis_scripts_per_call'] for r in rs], '{:.4f}')} | "
                   + ("-" if name == "plain" else _mm([m * 100 for m in more], "{:+.1f}%")) + " |")
    if not lim:
        out = out[:2]
    two = [r for r in rows if r["block"] == "instances"]
    if two:
        one = {r["round"]: r for r in two if r["case"] == "one"}
        tw = [r for r in two if r["case"] == "two"]
        out += ["", f"Two instances against one on the same CPU ({harness.cpu_list(args.gateway_cpus)}), the "
                "`quota` key (one Redis quota shared by both), 1 worker each, the same total callers"
                + (f" and the same {args.rate:g} calls/s in all (half to each)" if args.rate else "") + ".", "",
                "| case | calls per gateway CPU-second | calls/s |", "|---|---|---|"]
        for case in ("one", "two"):
            rs = [r for r in two if r["case"] == case]
            out.append(f"| {case} | {_mm([r['calls_per_cpu_s'] for r in rs], '{:,.0f}')} | "
                       f"{_mm([r['rps'] for r in rs], '{:,.0f}')} |")
        ratio = [r["calls_per_cpu_s"] / one[r["round"]]["calls_per_cpu_s"] for r in tw]
        rps = [r["rps"] / one[r["round"]]["rps"] for r in tw]
        out += ["", f"two ÷ one, per round: calls per gateway CPU-second {_mm(ratio, '{:.3f}')}, "
                f"calls/s {_mm(rps, '{:.3f}')}."]
    bad = sum(r["non_2xx"] for r in rows)
    out += ["", f"Non-2xx answers or errors: {bad}."]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inproc", action="store_true", help="the limiter alone, in-process")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/15", help="--inproc: the Redis to use")
    ap.add_argument("--calls", type=int, default=20000, help="--inproc: calls per round and case")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=float, default=5)
    ap.add_argument("--warmup", type=float, default=2)
    ap.add_argument("--callers", type=int, default=16)
    ap.add_argument("--rate", type=float, default=300,
                    help="calls/s offered in all (open loop; 0: closed loop, as fast as the gateway answers)")
    ap.add_argument("--gateway-cpus", default="0")
    ap.add_argument("--load-cpus", default="1")
    ap.add_argument("--oha")
    ap.add_argument("--blocks", default="limits,instances",
                    help="limits (the four keys), instances (two instances against one); comma-separated")
    ap.add_argument("--out", default=os.path.join(harness.BENCH_DIR, "out", "limits"))
    a = ap.parse_args()
    if a.inproc:
        res = inproc(a.redis, a.rounds, a.calls)
        print(f"CPU per call, {a.rounds} rotated rounds of {a.calls} calls: median (min-max) microseconds")
        for name, xs in res.items():
            print(f"  {name:<11} {statistics.median(xs):7.2f} ({min(xs):.2f}-{max(xs):.2f})")
        return 0
    a.gateway_cpus, a.load_cpus = harness.parse_cpus(a.gateway_cpus), harness.parse_cpus(a.load_cpus)
    a.blocks = {b.strip() for b in a.blocks.split(",") if b.strip()}
    return serve(a)


if __name__ == "__main__":
    raise SystemExit(main())
