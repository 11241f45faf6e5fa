"""The writes block side by side with qag from several source trees (bench/oltp.py's `deposit_writer` call, its
targets started as oltp.py starts them: one worker, gateway on CPU 0, oha on CPU 1): QueryAPIGate 0.43 + cache,
the Falcon + psycopg2 floor (one autocommit UPDATE per write, no reset) and one `qag serve` per tree (PYTHONPATH),
at each caller count, interleaved rounds (the order rotated each round). Per run: calls/s, gateway tree CPU µs
per call, p50; one JSON line per run to --out. The summary gives medians (min-max) and, per round, the
reference's CPU µs per call over each target's (its calls per gateway CPU-second ÷ the reference's).

    PATH=/work/main/.venv/bin:~/.cargo/bin:$PATH python bench/results/2026-12-06-s24/ab_trees.py \\
        before=/tmp/before after=. --rounds 3 --duration 5

Each tree is a checkout of qag (its `qag` package is imported from there)."""
import argparse
import json
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..'))
import harness as H  # noqa: E402
import oltp  # noqa: E402
import targets as T  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument('trees', nargs='+', help='name=path of a qag source tree')
ap.add_argument('--callers', default='1,8,32')
ap.add_argument('--rounds', type=int, default=3)
ap.add_argument('--duration', type=float, default=5)
ap.add_argument('--warmup', type=float, default=1)
ap.add_argument('--no-peer', action='store_true')
ap.add_argument('--out', default=os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results.jsonl'))
a = ap.parse_args()


oltp.ensure_data(10)
w, calls, _rows_call, _cache_calls, _keys_spec = oltp.workload(10)
call = next(c for c in calls if c.name == 'deposit_writer')
oha = H.find_oha()


def opts(i, src=None):
    return types.SimpleNamespace(gateway_cpus=H.parse_cpus('0'), load_cpus=H.parse_cpus('1'), qag_src=src,
                                 store_suffix=f'_wab{i}')


tg = [] if a.no_peer else [('reference', T.Peer(opts(0), w, cache=True))]
tg.append(('floor', T.FloorPg(opts(1), w)))
for i, spec in enumerate(a.trees):
    name, tree = spec.split('=', 1)
    tg.append((name, T.Qag(opts(2 + i, os.path.abspath(tree)), w)))
for _, t in tg:
    t.start(workers=1)
session = time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())
res = {}
callers = [int(x) for x in a.callers.split(',')]
try:
    with open(a.out, 'a') as out_f:
        for r in range(a.rounds):
            for n in callers:
                order = tg[r % len(tg):] + tg[:r % len(tg)]
                for name, t in order:
                    url = H.regex_escape_base(t.base) + t.path(call)
                    H.run_oha(oha, url, duration=a.warmup, conns=8, headers=t.headers(call), load_cpus=[1])
                    st = H.all_stats()
                    before = t.ticks(st)
                    plane = [p for p in before if st[p][1].startswith('qag-plane')]
                    out = H.run_oha(oha, url, duration=a.duration, conns=n, headers=t.headers(call), load_cpus=[1])
                    after = t.ticks()
                    done = out['n_2xx']
                    tot = H.delta_seconds(before, after) * 1e6 / done
                    pl = sum(after.get(p, 0) - before[p] for p in plane) / H.CLK_TCK * 1e6 / done
                    rec = {'session': session, 'target': name, 'callers': n, 'round': r, 'calls': done,
                           'calls_s': out['ok_rps'], 'gw_cpu_us': round(tot, 1), 'plane_cpu_us': round(pl, 1),
                           'p50_ms': out['p50_ms'], 'p99_ms': out['p99_ms'], 'non_2xx': out['non_2xx'],
                           'errors': out['errors'], 'loadavg': os.getloadavg()[0]}
                    out_f.write(json.dumps(rec) + '\n')
                    out_f.flush()
                    res.setdefault((n, name), []).append(rec)
                    print(f'round {r} {n:2d} callers {name:10s}: {done} calls {out["ok_rps"]:.0f}/s '
                          f'gw {tot:.1f} µs plane {pl:.1f} µs p50 {out["p50_ms"]} ms non2xx {out["non_2xx"]} '
                          f'err {out["errors"]}', flush=True)
finally:
    for _, t in tg:
        t.stop()


def mm(v, f='{:.1f}'):
    return f'{f.format(statistics.median(v))} ({f.format(min(v))}-{f.format(max(v))})'


print()
print('| callers | target | calls/s | gw CPU µs per call | plane µs | p50 ms | reference ÷ target per gw CPU-s |')
print('|---|---|---|---|---|---|---|')
for n in callers:
    ref = res.get((n, 'reference'))
    for name, _ in tg:
        v = res[(n, name)]
        ratio = ''
        if ref and name != 'reference':
            rs = [b['gw_cpu_us'] / x['gw_cpu_us'] for b, x in zip(ref, v)]
            ratio = mm(rs, '{:.2f}') + 'x'
        print(f'| {n} | {name} | {mm([x["calls_s"] for x in v], "{:.0f}")} | {mm([x["gw_cpu_us"] for x in v])} | '
              f'{mm([x["plane_cpu_us"] for x in v])} | {mm([x["p50_ms"] for x in v], "{:.2f}")} | {ratio} |')
