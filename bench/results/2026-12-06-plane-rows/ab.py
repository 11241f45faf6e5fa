"""Plane binaries side by side: one `qag serve --plane` per binary (started as bench/oltp.py's qag_plane target
starts it: one worker, gateway on CPU 0, oha on CPU 1), the rows block's call at each page size, interleaved
rounds (the order rotated each round): gateway tree CPU µs per call, the plane process's alone, and per round
the first binary's µs over each one's. The figures in the 2026-12-06 plane commits came from this.

    PATH=.venv/bin:~/.cargo/bin:$PATH python bench/results/2026-12-06-plane-rows/ab.py \
        before=/tmp/old/qag-plane after=rustplane/target/release/qag-plane --rows 1,100,1000 --rounds 5 --duration 3

Name each binary `qag-plane` (in its own directory): the tests and tools that find the plane by its name do."""
import argparse
import os
import statistics
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..'))
import harness as H  # noqa: E402
import oltp  # noqa: E402
import targets as T  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument('bins', nargs='+')
ap.add_argument('--rows', default='100,1000')
ap.add_argument('--rounds', type=int, default=5)
ap.add_argument('--duration', type=float, default=5)
ap.add_argument('--warmup', type=float, default=1)
ap.add_argument('--callers', type=int, default=32)
ap.add_argument('--fmt', default='json')
a = ap.parse_args()


class Q(T.Qag):
    def __init__(self, opts, w, binary):
        self.bin = binary
        super().__init__(opts, w, plane=True)

    def env(self):
        e = super().env()
        e['QAG_PLANE_BIN'] = self.bin
        return e


oltp.ensure_data(10)
w, calls, rows_call, cache_calls, keys_spec = oltp.workload(10)
oha = H.find_oha()
tg = []
for i, spec in enumerate(a.bins):
    name, b = spec.split('=', 1)
    opts = types.SimpleNamespace(gateway_cpus=H.parse_cpus('0'), load_cpus=H.parse_cpus('1'), qag_src=None,
                                 store_suffix=f'_ab{i}')
    t = Q(opts, w, os.path.abspath(b))
    t.start(workers=1)
    tg.append((name, t))
res = {}
try:
    for r in range(a.rounds):
        for n in [int(x) for x in a.rows.split(',')]:
            call = rows_call(n, a.fmt)
            order = tg[r % len(tg):] + tg[:r % len(tg)]
            for name, t in order:
                url = H.regex_escape_base(t.base) + t.path(call)
                H.run_oha(oha, url, duration=a.warmup, conns=8, headers=t.headers(call), load_cpus=[1])
                st = H.all_stats()
                before = t.ticks(st)
                plane = [p for p in before if st[p][1].startswith('qag-plane')]
                out = H.run_oha(oha, url, duration=a.duration, conns=a.callers, headers=t.headers(call), load_cpus=[1])
                after = t.ticks()
                done = out['n_2xx']
                tot = H.delta_seconds(before, after) * 1e6 / done
                pl = sum(after.get(p, 0) - before[p] for p in plane) / H.CLK_TCK * 1e6 / done
                res.setdefault((n, name), []).append((tot, pl))
                print(f'round {r} rows {n} {name}: {done} calls {out.get("rps", 0):.0f}/s '
                      f'total {tot:.1f} µs plane {pl:.1f} µs non2xx {out["non_2xx"]} err {out["errors"]}', flush=True)
finally:
    for _, t in tg:
        t.stop()
print()
names = [n for n, _ in tg]
for n in [int(x) for x in a.rows.split(',')]:
    base = res[(n, names[0])]
    for name in names:
        v = res[(n, name)]
        tot = [x[0] for x in v]
        pl = [x[1] for x in v]
        ratio = [b[0] / x[0] for b, x in zip(base, v)]
        print(f'rows {n:5d} {name:10s} total µs {statistics.median(tot):7.1f} ({min(tot):.1f}-{max(tot):.1f})  '
              f'plane µs {statistics.median(pl):7.1f} ({min(pl):.1f}-{max(pl):.1f})  '
              f'{names[0]}/this per round {statistics.median(ratio):.3f} ({min(ratio):.3f}-{max(ratio):.3f})')
