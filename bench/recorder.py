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
dict's recording fields set, the record packed and pushed under the ring's lock (qag.server.worker.RingRecorder),
in microseconds of CPU per call, and as a share of a worker's CPU per call (--worker-cpu-us, default
600: the low end of what the lead's bench measures per PK lookup on this machine; a smaller
per-call cost makes the share larger, so the low end is the conservative one).

End-to-end A/B (--ab): `qag serve` with one worker pinned to CPU 0 serving the PK lookup of bench/oltp.py
(pgbench data, plain key) to oha on CPU 1, as shipped (A) and with the worker's ring recorder replaced by a
no-op in a bench-only launcher (B: qag.server.worker.RingRecorder.__call__ patched before the arbiter forks; no
product setting turns recording off). Rounds alternate A and B; the worker's own CPU per call (from /proc,
by its title) is compared, and the recorder process's CPU per call is reported beside it: the recorder runs
on the workers' cores, so its share is recording's cost to a worker too.

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

from recorder_throughput import _fill, _pg_db, _proc_cpu

from qag.entries import pack_run
from qag.recorder import run_recorder
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
    (what QagApp.finish and qag.server.worker.RingRecorder do), on a real segment ring drained between chunks."""
    import shm
    from qag.metrics import Observer
    from qag.server.worker import RingRecorder

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
        record = pack_run(0, "svc-orders", "customer_by_id", 3, "main", 200, None, 1, 730, 181,
                          "01JDX7Q" + "0" * 19, "worker:0", "http", "/q/{name}")
        return {"calls_per_round": calls, "rounds": rounds, "record_bytes": len(record),
                "median_us": round(statistics.median(per_call), 3), "min_us": round(min(per_call), 3),
                "max_us": round(max(per_call), 3)}
    finally:
        seg.close()
        seg.unlink()


class _NoRecordQag:
    """Mixin for bench/targets.Qag: the same `qag serve`, its workers' ring recorder a no-op (bench only)."""

    PATCH = ("import sys, qag.server.worker as w; w.RingRecorder.__call__ = lambda self, run: True; "
             "from qag.cli import main; sys.argv[0] = 'qag'; sys.exit(main())")

    def command(self, workers, threads):
        cmd = super().command(workers, threads)
        return [sys.executable, "-c", self.PATCH] + cmd[cmd.index("serve"):]


def _ticks_by_title(target, prefix: str) -> int:
    """CPU ticks of the target's processes whose title starts with `prefix` (`qag: worker`, `qag: recorder`)."""
    total = 0
    for pid, ticks in target.ticks().items():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().decode(errors="replace")
        except OSError:
            continue
        if title.startswith(prefix):
            total += ticks
    return total


def _oltp_scale(oltp) -> int | None:
    """pgbench scale of the OLTP data already there, or None."""
    try:
        conn = oltp.pg_connect(oltp.DATA_DB)
    except Exception:  # noqa: BLE001 - no database yet
        return None
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM pgbench_branches")
            return int(cur.fetchone()[0])
    except Exception:  # noqa: BLE001 - no schema yet
        return None
    finally:
        conn.close()


def ab_worker_cost(rounds: int, duration: float, conns: int = 32) -> dict:
    """Worker CPU per PK lookup with recording (A) and with the ring recorder a no-op (B)."""
    import types

    sys.path.insert(0, HERE)
    import harness as H
    import oltp
    import targets as T

    oha = H.find_oha()
    scale = _oltp_scale(oltp) or 10
    oltp.ensure_data(scale)  # the lead's data as it is (never re-initialised to another scale here)
    wl, calls, _rows_call, _cache_calls, _keys_spec = oltp.workload(scale)
    call = next(c for c in calls if c.name == "lookup_plain")
    opts_a = types.SimpleNamespace(gateway_cpus=[0], qag_src=None, store_suffix="_recorder_ab")
    opts_b = types.SimpleNamespace(gateway_cpus=[0], qag_src=None, store_suffix="_recorder_ab_off")
    no_rec = type("QagNoRecord", (_NoRecordQag, T.Qag), {})
    a, b = T.Qag(opts_a, wl), no_rec(opts_b, wl)
    a.name, b.name = "recording", "no_recording"
    res: dict[str, list] = {k: [] for v in ("recording", "no_recording") for k in (v, v + "_rps", v + "_recorder")}
    rows = []
    try:
        for rnd in range(rounds):
            for t in ([a, b] if rnd % 2 == 0 else [b, a]):
                t.start(workers=1)
                url = H.regex_escape_base(t.base) + t.path(call)
                hdr = t.headers(call)
                H.run_oha(oha, url, duration=1.0, conns=8, headers=hdr, load_cpus=[1])  # warm-up
                w0, r0 = _ticks_by_title(t, "qag: worker"), _ticks_by_title(t, "qag: recorder")
                r = H.run_oha(oha, url, duration=duration, conns=conns, headers=hdr, load_cpus=[1])
                cpu = (_ticks_by_title(t, "qag: worker") - w0) / H.CLK_TCK
                rec_cpu = (_ticks_by_title(t, "qag: recorder") - r0) / H.CLK_TCK
                us = cpu * 1e6 / max(r["n_2xx"], 1)
                rec_us = rec_cpu * 1e6 / max(r["n_2xx"], 1)
                res[t.name].append(us)
                res[t.name + "_rps"].append(r["rps"])
                res[t.name + "_recorder"].append(rec_us)
                rows.append({"round": rnd, "variant": t.name, "calls": r["n"], "ok": r["n_2xx"], "rps": r["rps"],
                             "worker_cpu_s": round(cpu, 3), "worker_cpu_us_per_call": round(us, 1),
                             "recorder_cpu_us_per_call": round(rec_us, 1),
                             "loadavg_1m": round(os.getloadavg()[0], 2)})
                print(f"  A/B round {rnd} {t.name:>12}: {r['rps']:>7,.0f} calls/s, worker {us:6.1f} µs CPU per call, "
                      f"recorder process {rec_us:5.1f} (load {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        a.stop()
        b.stop()
    ma, mb = statistics.median(res["recording"]), statistics.median(res["no_recording"])
    return {"rounds": rounds, "duration_s": duration, "conns": conns, "turns": rows,
            "recording_us_per_call": round(ma, 1), "no_recording_us_per_call": round(mb, 1),
            "recording_min_max": [round(min(res["recording"]), 1), round(max(res["recording"]), 1)],
            "no_recording_min_max": [round(min(res["no_recording"]), 1), round(max(res["no_recording"]), 1)],
            "recording_share_pct": round(100 * (ma - mb) / ma, 2),
            "recording_rps": round(statistics.median(res["recording_rps"])),
            "no_recording_rps": round(statistics.median(res["no_recording_rps"])),
            # the recorder process runs on the workers' cores: its CPU per call is recording's cost too
            "recorder_process_us_per_call": round(statistics.median(res["recording_recorder"]), 1),
            "recorder_process_share_pct": round(100 * statistics.median(res["recording_recorder"]) / ma, 2)}


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
    ap.add_argument("--ab", action="store_true", help="also the end-to-end A/B: worker CPU per call, recording on/off")
    ap.add_argument("--ab-rounds", type=int, default=4)
    ap.add_argument("--ab-duration", type=float, default=8.0)
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
            k = rnd % max(len(targets), 1)
            order = targets[k:] + targets[:k]
            for t in order:
                r = t.turn(args.runs)
                turns[t.kind].append(r)
                emit({"kind": "turn", "round": rnd, **r})
                print(f"  round {rnd} {t.kind:>10}: {r['runs_per_s']:>8,} runs/s wall, "
                      f"{r['cpu_bound_runs_per_s']:>8,} CPU-bound (load {r['loadavg_1m']})", flush=True)
        if targets:
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
    if args.ab:
        ab = ab_worker_cost(args.ab_rounds, args.ab_duration)
        emit({"kind": "ab", **ab})
        p["share_of_measured_worker_cpu_pct"] = round(100 * p["median_us"] / ab["recording_us_per_call"], 3)
        emit({"kind": "producer_vs_ab", "producer_us": p["median_us"],
              "worker_us_per_call": ab["recording_us_per_call"],
              "share_pct": p["share_of_measured_worker_cpu_pct"]})
        print(f"A/B: worker {ab['recording_us_per_call']} µs CPU per call recording "
              f"({ab['recording_min_max'][0]}-{ab['recording_min_max'][1]}), {ab['no_recording_us_per_call']} without "
              f"({ab['no_recording_min_max'][0]}-{ab['no_recording_min_max'][1]}): recording = "
              f"{ab['recording_share_pct']}% of the worker's CPU per call; calls/s {ab['recording_rps']} vs "
              f"{ab['no_recording_rps']}; the recorder process {ab['recorder_process_us_per_call']} µs per call "
              f"({ab['recorder_process_share_pct']}% of a worker's); the producer's "
              f"{p['median_us']} µs = {p['share_of_measured_worker_cpu_pct']}% of it", flush=True)
    print(f"results appended to {args.out}")
    out.close()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
