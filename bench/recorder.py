#!/usr/bin/env python3
"""Recorder benchmark: runs/s from real segment rings into each run store, and what recording costs a worker.

    python bench/recorder.py [--stores sqlite,postgresql,clickhouse] [--rounds 5] [--runs 160000] [--out FILE]
    python bench/recorder.py --smoke            # < 60 s: one small round per store, checks every run landed

Throughput: each target (one store, its own segment with two rings, i.e. two producers) takes its turn
in every round, in an order rotated each round. A turn fills the rings with typical run records (not
timed), then times `run_recorder` draining them into the store: ring read, decode, batch, id minting, one
transaction or insert per batch, commit, release. Reported per store: median (min-max) wall-clock
runs/s, and "CPU-bound" runs/s = runs / CPU seconds of the busier of the recorder process and the
database server backend (what an otherwise idle 2-core machine would do, each on its own core); the
1-minute load average before each turn is recorded with it. At the end every store must hold exactly
rounds x runs runs in its event stream, history and usage (none lost, none duplicated).

Producer cost: what recording adds to one call in a worker, in-process on a real segment ring: the run
dict's recording fields set, the record packed and pushed under the ring's lock (qag.worker.RingRecorder),
in microseconds of CPU per call, and as a share of a worker's CPU per call (--worker-cpu-us, default
600: the low end of what the lead's bench measures per PK lookup on this machine; a smaller
per-call cost makes the share larger, so the low end is the conservative one).

Results: one JSON line per turn and one summary line per store and for the producer, appended to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qag import runrecord as rr
from qag.recorder import run_recorder
from qag.recorder._throughput import _fill, _pg_db, _proc_cpu
from qag.runstore import StoreSettings, open_store

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "out", "recorder", "results.jsonl")
STORES = ("sqlite", "postgresql", "clickhouse")


class Target:
    """One store with its own segment (two rings), measured turn after turn."""

    def __init__(self, kind: str):
        import shm

        self.kind = kind
        self.tmp = tempfile.mkdtemp(prefix=f"qag-bench-rec-{kind}-")
        url = {"sqlite": os.path.join(self.tmp, "runs.db"), "clickhouse": f"chdb://{self.tmp}/ch"}.get(kind)
        if kind == "postgresql":
            url = _pg_db("qag_rec_bench")
        self.seg = shm.Segment.create(f"/qag-bench-rec-{os.getpid()}-{uuid.uuid4().hex[:6]}", slots=2)
        self.store = open_store(url, StoreSettings())
        self.store.ensure_schema()
        self.batch_max = self.store.batch_max_hint
        self.backend = self.store.conn.get_backend_pid() if kind == "postgresql" else None
        self.written = 0
        self.turns = 0

    def turn(self, runs: int) -> dict:
        _fill(self.seg, runs // 2, self.turns)
        self.turns += 1
        load = os.getloadavg()[0]
        stop = threading.Event()
        c0, b0 = time.process_time(), _proc_cpu(self.backend)
        t0 = time.perf_counter()
        th = threading.Thread(target=run_recorder, args=(self.seg, self.store, stop),
                              kwargs={"batch_max": self.batch_max, "batch_ms": 50})
        th.start()
        rings = [self.seg.ring(i) for i in range(self.seg.ring_count())]
        while any(r.tail != r.head for r in rings):
            time.sleep(0.001)
        wall = time.perf_counter() - t0
        cpu, db_cpu = time.process_time() - c0, _proc_cpu(self.backend) - b0
        stop.set()
        th.join()
        n = (runs // 2) * 2
        self.written += n
        return {"store": self.kind, "runs": n, "batch_max": self.batch_max, "wall_s": round(wall, 4),
                "runs_per_s": round(n / wall), "recorder_cpu_s": round(cpu, 4),
                "db_server_cpu_s": round(db_cpu, 4) if self.backend else None,
                "cpu_bound_runs_per_s": round(n / max(cpu, db_cpu, 1e-9)), "loadavg_1m": round(load, 2)}

    def check(self) -> dict:
        c = self.store.counts()
        ok = c == {"qag_events": self.written, "qag_history": self.written, "usage_calls": self.written}
        return {"expected": self.written, "counts": c, "accounted": ok}

    def close(self):
        self.store.close()
        self.seg.close()
        self.seg.unlink()
        shutil.rmtree(self.tmp, ignore_errors=True)


def producer_cost(calls: int, rounds: int) -> dict:
    """Per-call CPU of recording in a worker: fill the run's recording fields, pack, push under the lock
    (what QagApp.finish and qag.worker.RingRecorder do), on a real segment ring drained between chunks."""
    import shm
    from qag.metrics import Observer
    from qag.worker import RingRecorder

    seg = shm.Segment.create(f"/qag-bench-prod-{os.getpid()}-{uuid.uuid4().hex[:6]}", slots=1)
    try:
        rec = RingRecorder(seg, 0, 10, Observer(backend=seg, slot=0))
        ring = seg.ring(0)
        chunk = 10_000
        per_call = []
        for _ in range(rounds):
            spent = 0.0
            done = 0
            while done < calls:
                run = {"at_us": time.time_ns() // 1000, "key_name": "svc-orders", "query": "customer_by_id",
                       "version": 3, "connection": "main", "rows": 1, "bytes": 181, "transport": "http"}
                t0 = time.process_time()
                for i in range(chunk):
                    # what finish() sets on every call before handing the run to the recorder
                    run["status"], run["code"], run["duration_us"] = 200, None, 730 + (i & 255)
                    run["request_id"], run["route"] = f"01JDX7Q{i:019d}", "/q/{name}"
                    if not rec(run):
                        raise RuntimeError("ring full during the producer measurement")
                spent += time.process_time() - t0
                ring.release(ring.head)  # the consumer's part, outside the timed loop
                done += chunk
            per_call.append(spent / done * 1e6)
        return {"calls_per_round": calls, "rounds": rounds, "record_bytes": len(rr.pack(0, "svc-orders", "customer_by_id", 3, "main", 200, None, 1, 730, 181,
                                                "01JDX7Q" + "0" * 19, "worker:0", "http", "/q/{name}")),
                "median_us": round(statistics.median(per_call), 3), "min_us": round(min(per_call), 3),
                "max_us": round(max(per_call), 3)}
    finally:
        seg.close()
        seg.unlink()


def summarise(rows: list[dict]) -> dict:
    w = [r["runs_per_s"] for r in rows]
    c = [r["cpu_bound_runs_per_s"] for r in rows]
    per100k = [r["recorder_cpu_s"] * 1e5 / r["runs"] for r in rows]
    db = [r["db_server_cpu_s"] * 1e5 / r["runs"] for r in rows if r["db_server_cpu_s"] is not None]
    return {"store": rows[0]["store"], "turns": len(rows), "runs_per_turn": rows[0]["runs"],
            "batch_max": rows[0]["batch_max"],
            "wall_median": round(statistics.median(w)), "wall_min": min(w), "wall_max": max(w),
            "cpu_bound_median": round(statistics.median(c)), "cpu_bound_min": min(c), "cpu_bound_max": max(c),
            "recorder_cpu_s_per_100k": round(statistics.median(per100k), 3),
            "db_server_cpu_s_per_100k": round(statistics.median(db), 3) if db else None,
            "loadavg_min": min(r["loadavg_1m"] for r in rows), "loadavg_max": max(r["loadavg_1m"] for r in rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/recorder.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stores", default=",".join(STORES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=160_000, help="runs per turn (two 8 MiB rings hold ~180,000)")
    ap.add_argument("--producer-calls", type=int, default=200_000, help="calls per producer round")
    ap.add_argument("--worker-cpu-us", type=float, default=600.0,
                    help="a worker's CPU per call, to express the producer cost as a share (µs)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="JSON lines appended here")
    ap.add_argument("--smoke", action="store_true", help="one small round per store (< 60 s)")
    ap.add_argument("--session", default=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    args = ap.parse_args(argv)
    if args.smoke:
        args.rounds, args.runs, args.producer_calls = 1, 20_000, 20_000
    kinds = [k.strip() for k in args.stores.split(",") if k.strip()]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    out = open(args.out, "a")  # noqa: SIM115 - appended to across the whole run, closed at its end

    def emit(row):
        row = {"bench": "recorder", "session": args.session, "smoke": args.smoke, **row}
        out.write(json.dumps(row) + "\n")
        out.flush()

    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs; "
          f"{args.rounds} rounds x {args.runs:,} runs per store", flush=True)
    targets = [Target(k) for k in kinds]
    failed = False
    try:
        turns: dict[str, list] = {k: [] for k in kinds}
        for rnd in range(args.rounds):
            order = targets[rnd % len(targets):] + targets[:rnd % len(targets)]
            for t in order:
                r = t.turn(args.runs)
                turns[t.kind].append(r)
                emit({"kind": "turn", "round": rnd, **r})
                print(f"  round {rnd} {t.kind:>10}: {r['runs_per_s']:>8,} runs/s wall, "
                      f"{r['cpu_bound_runs_per_s']:>8,} CPU-bound (load {r['loadavg_1m']})", flush=True)
        print(f"{'store':>10} | {'wall runs/s: median (min-max)':>32} | {'CPU-bound runs/s':>30} | "
              f"CPU s/100k rec, db | accounted")
        for t in targets:
            s = summarise(turns[t.kind])
            s.update(t.check())
            failed |= not s["accounted"]
            emit({"kind": "summary", **s})
            print(f"{t.kind:>10} | {s['wall_median']:>9,} ({s['wall_min']:,}-{s['wall_max']:,}) | "
                  f"{s['cpu_bound_median']:>9,} ({s['cpu_bound_min']:,}-{s['cpu_bound_max']:,}) | "
                  f"{s['recorder_cpu_s_per_100k']}, {s['db_server_cpu_s_per_100k'] or '-'} | "
                  f"{'yes' if s['accounted'] else 'NO: ' + json.dumps(s['counts'])}", flush=True)
    finally:
        for t in targets:
            t.close()
    p = producer_cost(args.producer_calls, max(3, args.rounds))
    p["worker_cpu_us_per_call"] = args.worker_cpu_us
    p["share_of_worker_cpu_pct"] = round(100 * p["median_us"] / args.worker_cpu_us, 3)
    emit({"kind": "producer", **p})
    print(f"producer: {p['median_us']} µs CPU per recorded call (min {p['min_us']}, max {p['max_us']}; "
          f"{p['record_bytes']} B record) = {p['share_of_worker_cpu_pct']}% of a worker's "
          f"{args.worker_cpu_us:g} µs per call", flush=True)
    print(f"results appended to {args.out}")
    out.close()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
