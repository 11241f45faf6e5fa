"""Syscalls and context switches of the plane per write, for each plane binary: one `qag serve --plane` per binary
(started as bench/oltp.py's qag_plane target), a warm-up, then `strace -c -f -p <plane>` during N writes
(oltp.py's `deposit_writer`, oha -n N, one caller at a time); and, in a second run of N writes without strace,
the plane threads' voluntary context switches (/proc/<plane>/task/*/status), each divided by N.

    PATH=/work/main/.venv/bin:~/.cargo/bin:$PATH python bench/results/2026-12-06-plane-writes/syscalls.py \\
        before=/tmp/before/qag-plane after=rustplane/target/release/qag-plane -n 2000"""
import argparse
import os
import re
import signal
import subprocess
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..'))
import harness as H  # noqa: E402
import oltp  # noqa: E402
import targets as T  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument('bins', nargs='+')
ap.add_argument('-n', type=int, default=2000)
ap.add_argument('--callers', type=int, default=1)
a = ap.parse_args()


class Q(T.Qag):
    def __init__(self, opts, w, binary):
        self.bin = binary
        super().__init__(opts, w, plane=True)

    def env(self):
        e = super().env()
        e['QAG_PLANE_BIN'] = self.bin
        return e


def switches(pid):
    tot = 0
    for tid in os.listdir(f'/proc/{pid}/task'):
        with open(f'/proc/{pid}/task/{tid}/status') as f:
            tot += int(re.search(r'^voluntary_ctxt_switches:\s+(\d+)', f.read(), re.M).group(1))
    return tot


oltp.ensure_data(10)
w, calls, *_ = oltp.workload(10)
call = next(c for c in calls if c.name == 'deposit_writer')
oha = H.find_oha()
for i, spec in enumerate(a.bins):
    name, b = spec.split('=', 1)
    t = Q(types.SimpleNamespace(gateway_cpus=H.parse_cpus('0'), load_cpus=H.parse_cpus('1'), qag_src=None,
                                store_suffix=f'_wsc{i}'), w, os.path.abspath(b))
    t.start(workers=1)
    try:
        st = H.all_stats()
        plane = next(p for p in t.ticks(st) if st[p][1].startswith('qag-plane'))
        url = H.regex_escape_base(t.base) + t.path(call)
        H.run_oha(oha, url, duration=2, conns=8, headers=t.headers(call), load_cpus=[1])
        s0 = switches(plane)
        out = H.run_oha(oha, url, duration=60, conns=a.callers, headers=t.headers(call), load_cpus=[1], requests=a.n)
        sw = (switches(plane) - s0) / out['n_2xx']
        path = f'/tmp/strace-{name}.txt'
        tr = subprocess.Popen(['strace', '-c', '-f', '-p', str(plane), '-o', path], stderr=subprocess.DEVNULL)
        time.sleep(1)
        out2 = H.run_oha(oha, url, duration=120, conns=a.callers, headers=t.headers(call), load_cpus=[1],
                         requests=a.n)
        tr.send_signal(signal.SIGINT)
        tr.wait()
        per = {}
        for line in open(path):
            m = re.match(r'\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)$', line)
            if m and m.group(2) != 'total':
                per[m.group(2)] = int(m.group(1)) / out2['n_2xx']
        print(f'{name}: {out["n_2xx"]} writes at {a.callers} caller(s): {sw:.2f} voluntary switches per write '
              f'(plane threads); under strace {out2["n_2xx"]} writes, per write: '
              + ', '.join(f'{k} {v:.2f}' for k, v in sorted(per.items(), key=lambda kv: -kv[1])), flush=True)
    finally:
        t.stop()
