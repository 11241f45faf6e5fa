"""Recorder throughput: runs/s from real segment rings through `run_recorder` into each run store.

    python bench/recorder_throughput.py [--stores sqlite,postgresql,clickhouse] [--runs 180000] [--rounds 3]

Each round fills two rings (two producers' worth) with typical run records, then times the
recorder draining them into the store: decode, batch, id minting, one write per batch, commit,
release. Reports the median of the rounds, wall clock, and "CPU-bound": runs per CPU second of the
busier of the recorder process and the PostgreSQL backend (what an idle 2-core machine would do,
each on its own core). The load average is printed too: on a shared machine wall-clock figures
move with what else runs.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qag.entries import pack_run  # noqa: E402
from qag.recorder import run_recorder  # noqa: E402
from qag.runstore import StoreSettings, open_store  # noqa: E402

PG_ADMIN = os.environ.get("QAG_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def _pg_db(name: str) -> str:
    import psycopg2

    conn = psycopg2.connect(PG_ADMIN)
    conn.autocommit = True
    cur = conn.cursor()
    cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
    cur.execute(f'CREATE DATABASE "{name}"')
    conn.close()
    return PG_ADMIN.rsplit("/", 1)[0] + "/" + name


def _fill(seg, per_ring: int, round_no: int) -> None:
    now = time.time_ns() // 1000
    for slot in range(seg.ring_count()):
        ring = seg.ring(slot)
        for i in range(per_ring):
            ok = ring.push(pack_run(now, f"svc-{i % 20}", f"lookup_{i % 7}", 1 + i % 3, "main", 200 if i % 50 else 500,
                                   None if i % 50 else "query_failed", 1, 700 + i % 900, 180,
                                   f"{round_no}-{slot}-{i:08d}", f"worker:{slot}", "http", "/q/{name}"), 0)
            if not ok:
                raise RuntimeError(f"ring {slot} full after {i} runs: lower --runs")


def measure(kind: str, runs: int, rounds: int, batch_max: int | None = None) -> dict:
    import shm

    tmp = tempfile.mkdtemp(prefix="qag-throughput-")
    url = {"sqlite": os.path.join(tmp, "runs.db"), "postgresql": None, "clickhouse": f"chdb://{tmp}/ch"}[kind]
    if kind == "postgresql":
        url = _pg_db("qag_rec_throughput")
    name = f"/qag-throughput-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    seg = shm.Segment.create(name, slots=2)
    store = open_store(url, StoreSettings())
    store.ensure_schema()
    bm = batch_max or getattr(store, "batch_max_hint", 5000)
    rates, cpu_rates, cpus = [], [], []
    backend = store.conn.get_backend_pid() if kind == "postgresql" else None
    try:
        for r in range(rounds):
            _fill(seg, runs // 2, r)
            stop = threading.Event()
            c0, b0 = time.process_time(), _proc_cpu(backend)
            t0 = time.perf_counter()
            th = threading.Thread(target=run_recorder, args=(seg, store, stop),
                                  kwargs={"batch_max": bm, "batch_ms": 50})
            th.start()
            rings = [seg.ring(i) for i in range(seg.ring_count())]
            while any(x.tail != x.head for x in rings):
                time.sleep(0.001)
            dt = time.perf_counter() - t0
            cpu, db_cpu = time.process_time() - c0, _proc_cpu(backend) - b0
            stop.set()
            th.join()
            rates.append(runs / dt)
            # What the recorder could do on an idle machine: the recorder process and the database
            # server each on a core of their own (two cores), so the busier of the two sets the pace.
            cpu_rates.append(runs / max(cpu, db_cpu, 1e-9))
            cpus.append((cpu * 1e5 / runs, db_cpu * 1e5 / runs))
        counts = store.counts()
    finally:
        store.close()
        seg.close()
        seg.unlink()
        shutil.rmtree(tmp, ignore_errors=True)
    expected = runs * rounds
    if counts.get("qag_events") != expected or counts.get("usage_calls") != expected:
        raise AssertionError(f"{kind}: store holds {counts}, expected {expected} runs")
    return {"store": kind, "batch_max": bm, "runs_per_round": runs, "rounds": rounds,
            "median_runs_per_s": round(statistics.median(rates)), "min": round(min(rates)), "max": round(max(rates)),
            "cpu_bound_runs_per_s": round(statistics.median(cpu_rates)),
            "recorder_cpu_s_per_100k": round(statistics.median(c for c, _ in cpus), 2),
            "db_server_cpu_s_per_100k": round(statistics.median(d for _, d in cpus), 2) if backend else None}


def _proc_cpu(pid: int | None) -> float:
    """CPU seconds of another local process (the PostgreSQL backend serving the store)."""
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def resume_check(kind: str, total: int, reconnects: int, seed: int = 7) -> dict:
    """Write `total` runs, then read them as SSE clients that hang up at random points and resume
    from the last id they got: every run must arrive exactly once, in order."""
    import random

    tmp = tempfile.mkdtemp(prefix="qag-resume-")
    url = {"sqlite": os.path.join(tmp, "runs.db"), "postgresql": None, "clickhouse": f"chdb://{tmp}/ch"}[kind]
    if kind == "postgresql":
        url = _pg_db("qag_rec_resume")
    store = open_store(url, StoreSettings())
    store.ensure_schema()
    try:
        now = time.time_ns() // 1000
        batch = 50_000 if kind == "clickhouse" else 10_000
        for j in range(0, total, batch):
            store.write_batch("resume", [(0, i + 1, pack_run(now, f"svc-{i % 20}", "q", 1, "main", 200, None, 1, 1, 1,
                                                            f"r{i}", "worker:0", "http", "/q/{name}"))
                                         for i in range(j, min(total, j + batch))])
        rnd = random.Random(seed)
        cut = sorted(rnd.sample(range(1, total), reconnects))  # the client hangs up after these many runs
        got, last, k = 0, 0, 0
        expect = 0
        while True:
            stop_at = cut[k] if k < len(cut) else total
            items = store.events_after(last, limit=min(1000, stop_at - got) or 1)
            if not items:
                break
            for it in items:
                if it["request_id"] != f"r{expect}":
                    raise AssertionError(f"{kind}: got {it['request_id']} where r{expect} was due")
                expect += 1
            got += len(items)
            last = items[-1]["event_id"]
            if k < len(cut) and got >= cut[k]:
                k += 1  # reconnect: a new request resuming from `last` (Last-Event-ID)
        if expect != total:
            raise AssertionError(f"{kind}: {expect} of {total} runs delivered")
        return {"store": kind, "events": total, "reconnects": k, "missing": total - expect, "repeated": 0}
    finally:
        store.close()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/recorder_throughput.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stores", default="sqlite,postgresql,clickhouse")
    ap.add_argument("--runs", type=int, default=160_000, help="runs per round (two rings of 8 MiB hold ~180,000)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-max", type=int, default=None)
    ap.add_argument("--resume-check", type=int, default=0, metavar="N",
                    help="instead: write N runs and replay them as SSE clients reconnecting at random points")
    ap.add_argument("--reconnects", type=int, default=7500)
    args = ap.parse_args(argv)
    if args.resume_check:
        for kind in args.stores.split(","):
            print(resume_check(kind.strip(), args.resume_check, args.reconnects), flush=True)
        return 0
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for kind in args.stores.split(","):
        res = measure(kind.strip(), args.runs, args.rounds, args.batch_max)
        print(f"{res['store']:>11}: {res['median_runs_per_s']:>8,} runs/s (min {res['min']:,}, max {res['max']:,}; "
              f"batch_max {res['batch_max']}, {res['rounds']} x {res['runs_per_round']:,} runs); "
              f"CPU-bound {res['cpu_bound_runs_per_s']:,} runs/s (CPU s per 100,000 runs: recorder "
              f"{res['recorder_cpu_s_per_100k']}, database server {res['db_server_cpu_s_per_100k'] or '-'})",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
