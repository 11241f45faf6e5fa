#!/usr/bin/env python3
"""This machine's scheduling noise, the floor under any tail latency measured here: a thread pinned to
each CPU in turn sleeps 1 ms again and again and records how late it wakes. On a quiet dedicated core
the lateness is tens of microseconds; on a shared virtual machine it reaches milliseconds even idle.

Usage: python bench/noise.py [--seconds 5] [--cpus 0,1] [--out results.jsonl]"""
import argparse
import json
import os
import time


def probe(cpu, seconds):
    os.sched_setaffinity(0, {cpu})
    late = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        time.sleep(0.001)
        late.append((time.perf_counter() - t - 0.001) * 1e3)
    late.sort()
    n = len(late)
    return {'block': 'noise', 'cpu': cpu, 'wakeups': n, 'late_p50_ms': round(late[n // 2], 3),
            'late_p99_ms': round(late[int(n * 0.99)], 3), 'late_p999_ms': round(late[int(n * 0.999)], 3),
            'late_max_ms': round(late[-1], 3), 'over_2ms': sum(1 for x in late if x > 2),
            'over_5ms': sum(1 for x in late if x > 5), 'at': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()),
            'loadavg': os.getloadavg()[0]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--seconds', type=float, default=5.0)
    p.add_argument('--cpus', default=','.join(str(c) for c in sorted(os.sched_getaffinity(0))))
    p.add_argument('--out', default=None, help='append the rows to this results.jsonl')
    opts = p.parse_args()
    rows = [probe(int(c), opts.seconds) for c in opts.cpus.split(',') if c]
    for r in rows:
        print(f"cpu {r['cpu']}: {r['wakeups']} wake-ups, late p50 {r['late_p50_ms']} / p99 {r['late_p99_ms']} / "
              f"p99.9 {r['late_p999_ms']} / max {r['late_max_ms']} ms; {r['over_5ms']} over 5 ms "
              f"(load {r['loadavg']:.2f})")
    if opts.out:
        with open(opts.out, 'a') as f:
            for r in rows:
                f.write(json.dumps(r) + '\n')


if __name__ == '__main__':
    main()
