#!/usr/bin/env python3
"""What a limit costs a call, in-process: the CPU time of `Limiter.check` for a key with a rate limit (leased token
buckets in Redis), a key with a quota (one atomic Redis script per call) and a key with neither, in alternating
rounds; each figure is CPU microseconds per call (process time, so the Redis server's own work is not counted but
the client's round trip is). Compare with a whole call's gateway CPU (bench/results: ~300 us for the lookup).

    bench/limits.py [--redis redis://127.0.0.1:6379/15] [--rounds 5] [--calls 20000]
"""
from __future__ import annotations

import argparse
import statistics
import time
import uuid


class _Cfg:
    def __init__(self, url):
        self.redis_url = url


def measure(url: str, rounds: int, calls: int) -> dict:
    from qag.limits import Limiter
    lim = Limiter(_Cfg(url), lambda *a: (False, 1, 1.0))
    tag = uuid.uuid4().hex[:8]
    cases = {"none": {}, "rate_limit": {"rate_limit": f"{calls * rounds * 4}/second"},
             "quota": {"quota": f"{calls * rounds * 4}/day"}}
    out: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(rounds):
        order = list(cases) if r % 2 == 0 else list(reversed(cases))
        for name in order:
            grants = cases[name]
            key = f"bench-{tag}-{name}"
            t0 = time.process_time()
            for _ in range(calls):
                lim.check(key, grants)
            out[name].append((time.process_time() - t0) / calls * 1e6)
    lim.return_leases()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/15")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20000)
    a = ap.parse_args()
    res = measure(a.redis, a.rounds, a.calls)
    print(f"CPU per call, {a.rounds} alternating rounds of {a.calls} calls: median (min-max) microseconds")
    for name, xs in res.items():
        print(f"  {name:<11} {statistics.median(xs):7.2f} ({min(xs):.2f}-{max(xs):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
