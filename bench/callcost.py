#!/usr/bin/env python3
"""A call's fixed cost, in-process: qag's worker application wired as `qag serve` wires it (the shared segment's
counters, the run ring and its recorder hand-off, the change watcher's generations) and the bare Falcon +
psycopg2 floor (bench/floors/falcon_pg.py), both called through WSGI with the environ gunicorn builds, no HTTP
server and no load generator, so what the application adds to each call is read without a shared machine's
scheduler noise.

    python bench/callcost.py [--rounds 5] [--calls 1000] [--only lookup_plain,...] [--trees A,B]
    python bench/callcost.py --opcodes [--only ...]     # Python opcodes per call, by file and by function

Calls (pgbench's data in qag_bench_oltp, scale 10, made by `pgbench -i` when missing; the seeds' four calls and
the 1- and 10-row range pages of the rows block):
  lookup_plain     /q/account?aid=N                       (plain key; the floor's lookup)
  lookup_governed  the same through the governed key      (allowed_tables + a hash mask on abalance)
  page_plain       /q/account_page?start=N&page_size=100   (the 100-row page with a join; the floor's page)
  rows_1, rows_10  /q/account_range?start=N&page_size=K    (the floor: the same with LIMIT K)
  deposit_writer   /q/deposit?aid=N&delta=D               (the writer key; the floor: one autocommit UPDATE)

`--opcodes` is deterministic (sys.settrace's opcode events over --opcode-calls warm calls): the figure to put
beside a hot-path change, with the CPU µs of interleaved rounds (`--trees A,B`: qag from two source trees,
rounds alternating between child processes, each with its own floor) where the change is in C or the driver.
The run ring is drained between rounds, as the recorder would; the recorder's own work is not counted here
(bench/recorder.py measures it)."""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, 'bench')
DATA_DB = 'qag_bench_oltp'
PG = {'host': '127.0.0.1', 'port': 5432, 'user': 'postgres'}
ADMIN = 'bench-admin-key'

QUERIES = [
    {'name': 'account', 'sql': 'SELECT aid, bid, abalance FROM pgbench_accounts WHERE aid = :aid',
     'parameters': {'aid': {'type': 'int', 'required': True}}},
    {'name': 'account_page', 'sql': 'SELECT a.aid, a.abalance, b.bid, b.bbalance FROM pgbench_accounts a '
     'JOIN pgbench_branches b ON b.bid = a.bid WHERE a.aid BETWEEN :start AND :start + 99 ORDER BY a.aid',
     'parameters': {'start': {'type': 'int', 'required': True}}},
    {'name': 'account_range', 'sql': 'SELECT a.aid, a.abalance, b.bid, b.bbalance FROM pgbench_accounts a '
     'JOIN pgbench_branches b ON b.bid = a.bid WHERE a.aid >= :start ORDER BY a.aid',
     'parameters': {'start': {'type': 'int', 'required': True}}},
    {'name': 'deposit', 'sql': 'UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid',
     'parameters': {'aid': {'type': 'int', 'required': True}, 'delta': {'type': 'int', 'required': True}}},
]
PLAIN = {'queries': ['account', 'account_page', 'account_range'], 'connections': []}
KEYS = {
    'plain': PLAIN,
    'governed': {**PLAIN, 'allowed_tables': ['pgbench_accounts', 'pgbench_branches'],
                 'mask': [{'column': '*.abalance', 'action': 'hash'}]},
    'writer': {'queries': ['deposit'], 'connections': [], 'allow_writes': True, 'allowed_write_ops': ['update']},
}
# name -> (key, path, query string of a random draw, whether the floor serves it)
CALLS = {
    'lookup_plain': ('plain', '/q/account', lambda r: f'aid={r.randint(100000, 999999)}', True),
    'lookup_governed': ('governed', '/q/account', lambda r: f'aid={r.randint(100000, 999999)}', False),
    'page_plain': ('plain', '/q/account_page', lambda r: f'start={r.randint(10000, 99999)}&page_size=100', True),
    'rows_1': ('plain', '/q/account_range', lambda r: f'start={r.randint(10000, 99999)}&page_size=1', True),
    'rows_10': ('plain', '/q/account_range', lambda r: f'start={r.randint(10000, 99999)}&page_size=10', True),
    'deposit_writer': ('writer', '/q/deposit', lambda r: f'aid={r.randint(100000, 999999)}&delta=1', True),
}


def ensure_data():
    import psycopg2
    conn = psycopg2.connect(dbname='postgres', **PG)
    conn.autocommit = True
    cur = conn.cursor()
    cur.execute('SELECT 1 FROM pg_database WHERE datname = %s', (DATA_DB,))
    if not cur.fetchone():
        cur.execute(f'CREATE DATABASE {DATA_DB}')
        subprocess.run(['pgbench', '-i', '-q', '-s', '10', '-h', PG['host'], '-U', PG['user'], DATA_DB],
                       check=True, capture_output=True)
    conn.close()


def environ(method, path, qs, key=None, body=b''):
    """What gunicorn's wsgi.create gives an application for a kept-alive HTTP/1.1 request from oha."""
    import io
    env = {'REQUEST_METHOD': method, 'PATH_INFO': path, 'QUERY_STRING': qs, 'SCRIPT_NAME': '',
           'SERVER_NAME': '127.0.0.1', 'SERVER_PORT': '8080', 'SERVER_PROTOCOL': 'HTTP/1.1', 'RAW_URI': path + '?' + qs,
           'REMOTE_ADDR': '127.0.0.1', 'REMOTE_PORT': '40000', 'HTTP_HOST': '127.0.0.1:8080',
           'HTTP_USER_AGENT': 'oha/1.16.0', 'HTTP_ACCEPT': '*/*', 'wsgi.url_scheme': 'http', 'wsgi.version': (1, 0),
           'wsgi.multithread': True, 'wsgi.multiprocess': False, 'wsgi.run_once': False,
           'wsgi.errors': sys.stderr, 'wsgi.input': io.BytesIO(body), 'wsgi.input_terminated': True}
    if key:
        env['HTTP_X_API_KEY'] = key
    return env


def call_with(app):
    def call(method, path, qs='', key=None, body=None):
        data = json.dumps(body).encode() if body is not None else b''
        env = environ(method, path, qs, key, data)
        if body is not None:
            env['CONTENT_TYPE'], env['CONTENT_LENGTH'] = 'application/json', str(len(data))
        status = []
        out = b''.join(app(env, lambda s, h, e=None: status.append(s)))
        return int(status[0].split()[0]), out
    return call


class HttpCaller:
    """`--http`: the call as bytes through qag's worker class (qag/server/gworker.py QagWorker.handle: gunicorn's
    parser, wsgi.create, the answer written to the socket) on a socketpair, for either application: the HTTP
    layer's own cost beside the application's. The main thread's epoll hand-off is not in it. The floor's calls keep
    gunicorn's parser and wsgi.create (`fast=False`), as under stock gunicorn: qag's fast path
    (qag/server/fasthttp.py) is qag's, not the floor's."""

    def __init__(self, app, fast=True):
        import socket

        from gunicorn.config import Config
        from gunicorn.glogging import Logger
        from gunicorn.workers.gthread import TConn

        from qag.server import gworker
        cfg = Config()
        gworker._freeze(cfg)
        gworker._cache_per_worker()
        w = gworker.QagWorker.__new__(gworker.QagWorker)
        w.cfg, w.log, w.wsgi, w.nr, w.max_requests, w.alive = cfg, Logger(cfg), app, 0, sys.maxsize, True
        w.send_timeout = 30.0
        if hasattr(gworker, '_hooks'):
            w.pre_hook, w.post_hook, w.timed = gworker._hooks(cfg, w.log)
        if hasattr(gworker, '_fast_head'):
            w.fast = gworker._fast_head(cfg, w.log) if fast else None
        self.worker = w
        self.ours, self.theirs = socket.socketpair()
        conn = TConn(cfg, self.ours, ('127.0.0.1', 40000), ('127.0.0.1', 8080))
        self.ours.setblocking(True)
        conn.buf = bytearray()
        conn.too_many = conn.close_after = conn.continued = conn.closing = False
        self.conn = conn

    def __call__(self, method, path, qs='', key=None, body=None):
        data = json.dumps(body).encode() if body is not None else b''
        head = [f'{method} {path}{"?" + qs if qs else ""} HTTP/1.1', 'Host: 127.0.0.1:8080', 'User-Agent: oha/1.16.0',
                'Accept: */*']
        if key:
            head.append(f'X-API-Key: {key}')
        if body is not None:
            head += ['Content-Type: application/json', f'Content-Length: {len(data)}']
        self.conn.buf += ('\r\n'.join(head) + '\r\n\r\n').encode() + data
        keep = self.worker.handle(self.conn)
        assert keep is True, keep
        out = b''
        while True:
            out += self.theirs.recv(1 << 20)
            end = out.find(b'\r\n\r\n')
            if end < 0:
                continue
            length = int(out[:end].lower().split(b'content-length:')[1].split(b'\r\n')[0])
            if len(out) >= end + 4 + length:
                break
        return int(out.split(b' ', 2)[1]), out[out.find(b'\r\n\r\n') + 4:]


class QagWorkerApp:
    """qag's application as one `qag serve` worker builds it (qag/server/worker.py build_worker_app) on a
    segment of its own, the change watcher's heartbeat kept fresh by hand and the run ring drained by hand."""

    def __init__(self, http=False):
        home = tempfile.mkdtemp(prefix='qag-callcost-')
        os.environ.update({'QAG_HOME': home, 'QAG_ADMIN_KEY': ADMIN, 'QAG_DATABASE_URL': '',
                           'QAG_ALLOW_WRITES': '1'})
        import shm
        from qag import config
        from qag.server.arbiter import watcher_slot
        from qag.server.worker import build_worker_app
        from qag.store import Store
        cfg = config.load()
        Store(home=cfg.home, database_url=cfg.database_url, secret_key=cfg.secret_key).migrate()
        self.seg_name = f'/qag-callcost-{os.getpid()}'
        self.seg = shm.Segment.create(self.seg_name, cfg.shm_size, slots=4)
        self.watcher = watcher_slot(self.seg.slots)
        self.seg.set_slot(self.watcher, 'other', os.getpid())
        self.beat()
        self.app = build_worker_app(cfg, slot=0, segment_name=self.seg_name)
        self.ring = self.seg.ring(0)
        self.call = call_with(self.app)
        self.keys = {}
        st, out = self.call('POST', '/api/v1/connections', key=ADMIN, body={
            'name': 'oltp', 'db': 'postgres', 'database': DATA_DB, 'password': '',
            'options': {'allow_superuser': True}, **PG})
        assert st == 201, out[:300]
        for q in QUERIES:
            st, out = self.call('POST', '/api/v1/queries', key=ADMIN,
                                body={**q, 'connection_name': 'oltp', 'publish': True})
            assert st == 201, out[:300]
        for name, grants in KEYS.items():
            st, out = self.call('POST', '/api/v1/api-keys', key=ADMIN, body={'name': name, **grants})
            assert st == 201, out[:300]
            self.keys[name] = json.loads(out)['secret']
        if http:
            self.call = HttpCaller(self.app)

    def beat(self):
        self.seg.set_heartbeat(self.watcher, 1)

    def drain(self):
        while True:
            got = self.ring.read(4096)
            if not got:
                return
            self.ring.release(got[-1][0])

    def serve(self, name, qs):
        key, path, _, _ = CALLS[name]
        st, out = self.call('GET', path, qs, self.keys[key])
        assert st == 200, out[:300]
        return out

    def close(self):
        self.seg.unlink()  # the names first: the app's views of the segment may keep close() from unmapping
        try:
            self.seg.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


class FloorApp:
    def __init__(self, http=False):
        os.environ['FLOOR_PG_DSN'] = f"postgresql://postgres@127.0.0.1:5432/{DATA_DB}"
        sys.path.insert(0, os.path.join(BENCH, 'floors'))
        import falcon_pg
        self.call = HttpCaller(falcon_pg.app, fast=False) if http else call_with(falcon_pg.app)

    def beat(self):
        pass

    def drain(self):
        pass

    def serve(self, name, qs):
        _, path, _, _ = CALLS[name]
        st, out = self.call('GET', path, qs)
        assert st == 200, out[:300]
        return out

    def close(self):
        pass


def warm(targets, names):
    rnd = random.Random(1)
    for t in targets.values():
        for name in names:
            if isinstance(t, FloorApp) and not CALLS[name][3]:
                continue
            for _ in range(30):
                t.serve(name, CALLS[name][2](rnd))
            t.drain()


def one_round(targets, names, calls, rnd_no, rnd):
    out = []
    order = list(targets) if rnd_no % 2 == 0 else list(reversed(targets))
    for name in names:
        qss = [CALLS[name][2](rnd) for _ in range(calls)]
        for label in order:
            t = targets[label]
            if isinstance(t, FloorApp) and not CALLS[name][3]:
                continue
            beat, serve = t.beat, t.serve
            c0 = time.process_time()
            for i, qs in enumerate(qss):
                if not i % 50:  # the change watcher's beat, as it keeps it (a write waits on a commit: 1,000 take
                    beat()      # seconds, and a stale beat turns every cache off, which no served call sees)
                serve(name, qs)
            us = (time.process_time() - c0) / calls * 1e6
            t.drain()
            out.append({'target': label, 'call': name, 'round': rnd_no, 'calls': calls,
                        'cpu_us_per_call': round(us, 1)})
    return out


def opcodes(targets, names, calls, top):
    """Opcodes executed per call (sys.settrace opcode events), by file and by function."""
    rnd = random.Random(3)
    for name in names:
        for label, t in targets.items():
            if isinstance(t, FloorApp) and not CALLS[name][3]:
                continue
            qss = [CALLS[name][2](rnd) for _ in range(calls)]
            by_file, by_func = collections.Counter(), collections.Counter()

            def tracer(frame, event, arg):
                frame.f_trace_opcodes = True
                if event == 'opcode':
                    co = frame.f_code
                    by_file[co.co_filename] += 1
                    by_func[(co.co_filename, co.co_firstlineno, co.co_name)] += 1
                return tracer
            t.beat()
            sys.settrace(tracer)
            try:
                for qs in qss:
                    t.serve(name, qs)
            finally:
                sys.settrace(None)
            t.drain()
            total = sum(by_file.values()) / calls
            print(f'{name} {label}: {total:.0f} opcodes per call')
            if top:
                def short(f):
                    for p in (ROOT + '/', os.path.dirname(os.__file__) + '/'):
                        f = f.replace(p, '')
                    return f.split('site-packages/')[-1]
                for f, v in by_file.most_common(top):
                    print(f'  {v / calls:7.0f}  {short(f)}')
                print('  by function:')
                for (f, ln, fn), v in by_func.most_common(top * 2):
                    print(f'  {v / calls:7.0f}  {short(f)}:{ln} {fn}')
            print(json.dumps({'target': label, 'call': name, 'opcodes_per_call': round(total)}), flush=True)


def child(opts):
    targets = {opts.label: QagWorkerApp(opts.http), 'floor': FloorApp(opts.http)}
    try:
        warm(targets, opts.only)
        if opts.opcodes:
            return opcodes(targets, opts.only, opts.opcode_calls, opts.top)
        rnd = random.Random(opts.seed)
        for r in range(opts.child_rounds):
            for row in one_round(targets, opts.only, opts.calls, opts.round_base + r, rnd):
                print(json.dumps(row), flush=True)
    finally:
        for t in targets.values():
            t.close()


def summarize(rows, names, labels):
    by = collections.defaultdict(list)
    for r in rows:
        by[(r['target'], r['call'])].append(r['cpu_us_per_call'])
    print()
    print('CPU µs per call, median (min-max) over rounds; ÷ floor per round (median)')
    print()
    others = [lab for lab in labels if lab != 'floor']
    print('| call | ' + ' | '.join(labels) + ' | ' + ' | '.join(f'{lab} ÷ floor' for lab in others) + ' |')
    print('|---|' + '---|' * (len(labels) + len(others)))
    for name in names:
        cells = []
        for lab in labels:
            v = by.get((lab, name))
            cells.append(f'{statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})' if v else '-')
        floor = by.get(('floor', name))
        ratios = []
        for lab in others:
            v = by.get((lab, name))
            ratios.append(f'{statistics.median([a / b for a, b in zip(v, floor)]):.2f}' if v and floor else '-')
        print(f'| {name} | ' + ' | '.join(cells) + ' | ' + ' | '.join(ratios) + ' |')
    if len(others) == 2:
        a, b = others
        print()
        print(f'{b} ÷ {a} per round (median (min-max)):')
        for name in names:
            va, vb = by.get((a, name)), by.get((b, name))
            if va and vb:
                q = [y / x for x, y in zip(va, vb)]
                print(f'  {name}: {statistics.median(q):.3f} ({min(q):.3f}-{max(q):.3f})')


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--calls', type=int, default=1000, help='calls per cell and round')
    ap.add_argument('--only', default=','.join(CALLS), help='calls, comma-separated')
    ap.add_argument('--trees', default='', help='A,B: qag from these source trees, rounds alternating (children)')
    ap.add_argument('--opcodes', action='store_true', help='count Python opcodes per call instead of CPU time')
    ap.add_argument('--opcode-calls', type=int, default=50)
    ap.add_argument('--http', action='store_true', help="through qag's worker class's handle() on a socketpair")
    ap.add_argument('--top', type=int, default=0, help='with --opcodes: the N busiest files (2N functions)')
    ap.add_argument('--seed', type=int, default=7)
    ap.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
    ap.add_argument('--label', default='qag', help=argparse.SUPPRESS)
    ap.add_argument('--child-rounds', type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument('--round-base', type=int, default=0, help=argparse.SUPPRESS)
    opts = ap.parse_args()
    opts.only = [n for n in opts.only.split(',') if n]
    unknown = [n for n in opts.only if n not in CALLS]
    if unknown:
        sys.exit(f'unknown call(s) {unknown}; known: {", ".join(CALLS)}')
    if opts.child:
        return child(opts)
    ensure_data()
    trees = [t for t in opts.trees.split(',') if t] or [None]
    labels = [('qag' if t is None else os.path.basename(t.rstrip('/')) or t) for t in trees]
    rows = []
    rounds = 1 if opts.opcodes else opts.rounds
    for r in range(rounds):
        pairs = list(zip(trees, labels))
        for tree, label in (pairs if r % 2 == 0 else pairs[::-1]):
            env = dict(os.environ)
            if tree is not None:
                env['PYTHONPATH'] = tree
            cmd = [sys.executable, os.path.abspath(__file__), '--child', '--label', label, '--round-base', str(r),
                   '--only', ','.join(opts.only), '--calls', str(opts.calls), '--seed', str(opts.seed + r),
                   '--opcode-calls', str(opts.opcode_calls), '--top', str(opts.top)]
            if opts.opcodes:
                cmd.append('--opcodes')
            if opts.http:
                cmd.append('--http')
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f'{label} round {r} failed:\n{out.stderr[-3000:]}')
            if opts.opcodes:
                print('\n'.join(line for line in out.stdout.splitlines() if not line.startswith('{')))
            got = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{')]
            if len(trees) > 1:  # one floor per round: the first child's
                got = [g for g in got if g['target'] != 'floor' or label == labels[0]]
            rows += got
            print(f'round {r} {label}: {len(got)} cells', file=sys.stderr, flush=True)
    if opts.opcodes:
        print()
        print('| call | ' + ' | '.join(labels + ['floor']) + ' |')
        print('|---|' + '---|' * (len(labels) + 1))
        for name in opts.only:
            v = {(g['target'], g['call']): g['opcodes_per_call'] for g in rows}
            print(f'| {name} | ' + ' | '.join(str(v.get((lab, name), '-')) for lab in labels + ['floor']) + ' |')
        return
    summarize(rows, opts.only, labels + ['floor'])


if __name__ == '__main__':
    main()
