#!/usr/bin/env python3
"""What a row costs: qag's WSGI app and a bare floor in-process (no HTTP server, no load generator), CPU µs of
this process per call at 1, 10, 100 and 1,000 rows per call, in json, ndjson and csv, so the slope (µs per row)
is read without a shared machine's scheduler noise.

    python bench/rowcost.py [--rounds 5] [--rows 1,10,100,1000] [--formats json,ndjson,csv]
                            [--cases pg_accounts,pg_accounts_masked,pg_items,my_items] [--trees A,B] [--out FILE]

Cases (each the same SQL in qag, as a saved query paged with &page_size=N, and in the floor, with LIMIT N):
  pg_accounts         pgbench's accounts joined to their branch, four integer columns (the harness's page call)
  pg_accounts_masked  the same through a key that hashes abalance (masking's per-row cost)
  pg_items / my_items id, name, price (DECIMAL), created (TIMESTAMP), qty on PostgreSQL / MariaDB
                      (database qag_cost_rows, made here: 2,000 rows)
The floor: Falcon + the driver, one connection, the rows as the driver returns them rendered by
bench/floors/floor_render.py (orjson when installed) - what the same work costs with no gateway.

Each round runs every cell for qag and the floor in turn (the order flipped every round) for --calls calls
(fewer for big pages: about --rows-per-cell rows). `--trees A,B` measures qag from two source trees instead
(e.g. main and a branch: rounds alternate between child processes with PYTHONPATH=A and =B) for before/after
figures; the floor runs in each child too. Prints per call µs, median (min-max), and the slope per row
between the smallest and the biggest page."""
from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, 'bench')

PG = {'host': '127.0.0.1', 'port': 5432, 'user': 'postgres'}
MY = {'host': '127.0.0.1', 'port': 3306, 'user': 'root', 'password': ''}
ROWS_DB = 'qag_cost_rows'
ITEMS = 2000

ACCOUNTS_SQL = ('SELECT a.aid, a.abalance, b.bid, b.bbalance FROM pgbench_accounts a '
                'JOIN pgbench_branches b ON b.bid = a.bid WHERE a.aid >= {p} ORDER BY a.aid')
ITEMS_SQL = 'SELECT id, name, price, created, qty FROM item WHERE id >= {p} ORDER BY id'

CASES = {
    'pg_accounts': {'db': 'postgres', 'database': 'qag_bench_oltp', 'sql': ACCOUNTS_SQL, 'max_start': 900000},
    'pg_accounts_masked': {'db': 'postgres', 'database': 'qag_bench_oltp', 'sql': ACCOUNTS_SQL, 'max_start': 900000,
                           'mask': [{'column': '*.abalance', 'action': 'hash'}]},
    'pg_items': {'db': 'postgres', 'database': ROWS_DB, 'sql': ITEMS_SQL, 'max_start': ITEMS - 1000},
    'my_items': {'db': 'mysql', 'database': ROWS_DB, 'sql': ITEMS_SQL, 'max_start': ITEMS - 1000},
}


def ensure_data(cases):
    """qag_bench_oltp (pgbench scale 1 when missing) and qag_cost_rows' item table on both databases."""
    import psycopg2
    conn = psycopg2.connect(dbname='postgres', **PG)
    conn.autocommit = True
    cur = conn.cursor()
    for db in {'qag_bench_oltp', ROWS_DB}:
        cur.execute('SELECT 1 FROM pg_database WHERE datname = %s', (db,))
        if not cur.fetchone():
            cur.execute(f'CREATE DATABASE {db}')
            if db == 'qag_bench_oltp':
                subprocess.run(['pgbench', '-i', '-q', '-s', '10', '-h', PG['host'], '-U', PG['user'], db],
                               check=True, capture_output=True)
    conn.close()
    rows = [(i, f'item {i:05d} é', f'{i * 1.25:.2f}', f'2026-11-{1 + i % 28:02d} 06:{i % 60:02d}:53', i % 97)
            for i in range(1, ITEMS + 1)]
    conn = psycopg2.connect(dbname=ROWS_DB, **PG)
    conn.autocommit = True
    cur = conn.cursor()
    cur.execute('CREATE TABLE IF NOT EXISTS item (id int PRIMARY KEY, name varchar(24), price numeric(10,2), '
                'created timestamp, qty int)')
    cur.execute('SELECT count(*) FROM item')
    if cur.fetchone()[0] != ITEMS:
        cur.execute('TRUNCATE item')
        cur.executemany('INSERT INTO item VALUES (%s, %s, %s, %s, %s)', rows)
    conn.close()
    if any(CASES[c]['db'] == 'mysql' for c in cases):
        import mysql.connector
        conn = mysql.connector.connect(autocommit=True, **MY)
        cur = conn.cursor()
        cur.execute(f'CREATE DATABASE IF NOT EXISTS {ROWS_DB}')
        cur.execute(f'CREATE TABLE IF NOT EXISTS {ROWS_DB}.item (id INT PRIMARY KEY, name VARCHAR(24), '
                    'price DECIMAL(10,2), created DATETIME, qty INT) CHARACTER SET utf8mb4')
        cur.execute(f'SELECT count(*) FROM {ROWS_DB}.item')
        if cur.fetchone()[0] != ITEMS:
            cur.execute(f'TRUNCATE {ROWS_DB}.item')
            cur.executemany(f'INSERT INTO {ROWS_DB}.item VALUES (%s, %s, %s, %s, %s)', rows)
        conn.close()


# ---------------------------------------------------------------- the two apps, in-process

def wsgi_caller(app):
    def call(method, path, qs='', body=None, key=None):
        data = json.dumps(body).encode() if body is not None else b''
        env = {'REQUEST_METHOD': method, 'PATH_INFO': path, 'QUERY_STRING': qs, 'SERVER_NAME': 'bench',
               'SERVER_PORT': '80', 'wsgi.url_scheme': 'http', 'SERVER_PROTOCOL': 'HTTP/1.1',
               'REMOTE_ADDR': '127.0.0.1', 'wsgi.errors': sys.stderr, 'wsgi.input': io.BytesIO(data),
               'CONTENT_LENGTH': str(len(data))}
        if body is not None:
            env['CONTENT_TYPE'] = 'application/json'
        if key:
            env['HTTP_X_API_KEY'] = key
        status = []
        out = b''.join(app(env, lambda s, h, e=None: status.append(s)))
        return int(status[0].split()[0]), out
    return call


def qag_app(cases):
    """qag's app with one connection per database, one saved query and one key per case."""
    os.environ.update({'QAG_HOME': tempfile.mkdtemp(prefix='qag-rowcost-'), 'QAG_ADMIN_KEY': 'bench-admin-key',
                       'QAG_DATABASE_URL': ''})
    from qag import config
    from qag.http.app import create_app
    app = create_app(config.load())
    call = wsgi_caller(app)
    admin = 'bench-admin-key'
    made, keys = set(), {}
    for name in cases:
        c = CASES[name]
        conn_name = f"{c['db']}_{c['database']}"
        if conn_name not in made:
            body = {'name': conn_name, 'db': c['db'], 'database': c['database'],
                    'options': {'allow_superuser': True}, **(PG if c['db'] == 'postgres' else MY)}
            st, out = call('POST', '/api/v1/connections', body=body, key=admin)
            assert st == 201, out[:300]
            made.add(conn_name)
        st, out = call('POST', '/api/v1/queries', key=admin, body={
            'name': name, 'connection_name': conn_name, 'publish': True, 'sql': c['sql'].format(p=':start'),
            'parameters': {'start': {'type': 'int', 'required': True}}})
        assert st == 201, out[:300]
        grants = {'queries': [name], 'connections': []}
        if c.get('mask'):
            grants['mask'] = c['mask']
        st, out = call('POST', '/api/v1/api-keys', key=admin, body={'name': name, **grants})
        keys[name] = json.loads(out)['secret']

    def serve(case, start, n, fmt):
        st, out = call('GET', f'/q/{case}', f'start={start}&page_size={n}&format={fmt}', key=keys[case])
        assert st == 200, out[:300]
        return out
    return serve


def floor_app(cases):
    """The floor: Falcon + the driver + bench/floors/floor_render.py, as bench/floors/falcon_pg.py serves it."""
    sys.path.insert(0, os.path.join(BENCH, 'floors'))
    import falcon
    from floor_render import formats, render
    conns = {}
    local = threading.local()

    def connect(c):
        if c['db'] == 'postgres':
            import psycopg2
            conn = psycopg2.connect(dbname=c['database'], **PG)
            conn.autocommit = True
            return conn
        import mysql.connector
        return mysql.connector.connect(autocommit=True, database=c['database'], **MY)

    class Query:
        def on_get(self, req, resp, name):
            c = CASES[name]
            key = (c['db'], c['database'])
            conn = getattr(local, 'c', {}).get(key)
            if conn is None:
                conn = conns[key] = connect(c)
                local.c = conns
            fmt = formats(req)
            cur = conn.cursor()
            try:
                cur.execute(c['sql'].format(p='%s') + ' LIMIT %s',
                            (int(req.get_param('start')), int(req.get_param('page_size'))))
                cols = [d[0] for d in cur.description]
                rows = cur.fetchall()
            finally:
                cur.close()
            resp.data, resp.content_type = render(cols, rows, fmt)

    app = falcon.App()
    app.add_route('/q/{name}', Query())
    call = wsgi_caller(app)

    def serve(case, start, n, fmt):
        st, out = call('GET', f'/q/{case}', f'start={start}&page_size={n}&format={fmt}')
        assert st == 200, out[:300]
        return out
    return serve


def cells(opts):
    return [(c, n, f) for c in opts.cases for n in opts.rows for f in opts.formats]


def one_round(servers, opts, rnd_no, rnd):
    """Every cell once for every server (the order of the servers flipped every round): CPU µs per call."""
    out = []
    order = list(servers) if rnd_no % 2 == 0 else list(reversed(servers))
    for case, n, fmt in cells(opts):
        calls = max(opts.min_calls, min(opts.calls, opts.rows_per_cell // n))
        for label in order:
            serve = servers[label]
            starts = [rnd.randint(1, CASES[case]['max_start']) for _ in range(calls)]
            t = time.process_time()
            for s in starts:
                serve(case, s, n, fmt)
            us = (time.process_time() - t) / calls * 1e6
            out.append({'target': label, 'case': case, 'rows': n, 'format': fmt, 'round': rnd_no, 'calls': calls,
                        'cpu_us_per_call': round(us, 1)})
    return out


def warm(servers, opts):
    for serve in servers.values():
        for case, n, fmt in cells(opts):
            for i in range(20):
                serve(case, 1 + i, n, fmt)


def child(opts):
    """One process, one tree: --child-rounds rounds, JSON lines on stdout."""
    servers = {opts.label: qag_app(opts.cases), 'floor': floor_app(opts.cases)}
    warm(servers, opts)
    rnd = random.Random(opts.seed)
    for r in range(opts.child_rounds):
        for row in one_round(servers, opts, opts.round_base + r, rnd):
            print(json.dumps(row), flush=True)


def summarize(rows, opts, labels):
    def med(v):
        return statistics.median(v)
    by = {}
    for r in rows:
        by.setdefault((r['target'], r['case'], r['format'], r['rows']), []).append(r['cpu_us_per_call'])
    print()
    print('CPU µs per call, median (min-max) of', opts.rounds, 'rounds; ratio = target / floor per round (median)')
    print()
    print('| case | format | rows | ' + ' | '.join(labels) + ' | ' +
          ' | '.join(f'{lab} ÷ floor' for lab in labels if lab != 'floor') + ' |')
    print('|---|---|---|' + '---|' * (len(labels) + len(labels) - 1))
    for case in opts.cases:
        for fmt in opts.formats:
            for n in opts.rows:
                vals = [by.get((lab, case, fmt, n), []) for lab in labels]
                cellv = [f'{med(v):.0f} ({min(v):.0f}-{max(v):.0f})' if v else '-' for v in vals]
                floor = by.get(('floor', case, fmt, n), [])
                ratios = []
                for lab in labels:
                    if lab == 'floor':
                        continue
                    v = by.get((lab, case, fmt, n), [])
                    ratios.append(f'{med([a / b for a, b in zip(v, floor)]):.2f}' if v and floor else '-')
                print(f'| {case} | {fmt} | {n} | ' + ' | '.join(cellv) + ' | ' + ' | '.join(ratios) + ' |')
    lo, hi = min(opts.rows), max(opts.rows)
    if lo == hi:
        return
    print()
    print(f'µs per row (slope between {lo} and {hi} rows, per round, median (min-max)):')
    print()
    print('| case | format | ' + ' | '.join(labels) + ' |')
    print('|---|---|' + '---|' * len(labels))
    for case in opts.cases:
        for fmt in opts.formats:
            cellv = []
            for lab in labels:
                a, b = by.get((lab, case, fmt, lo), []), by.get((lab, case, fmt, hi), [])
                s = [(y - x) / (hi - lo) for x, y in zip(a, b)]
                cellv.append(f'{med(s):.3f} ({min(s):.3f}-{max(s):.3f})' if s else '-')
            print(f'| {case} | {fmt} | ' + ' | '.join(cellv) + ' |')


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--rows', default='1,10,100,1000')
    ap.add_argument('--formats', default='json,ndjson,csv')
    ap.add_argument('--cases', default='pg_accounts,pg_accounts_masked,pg_items,my_items')
    ap.add_argument('--calls', type=int, default=400, help='calls per cell and round, at most')
    ap.add_argument('--min-calls', type=int, default=30)
    ap.add_argument('--rows-per-cell', type=int, default=60000, help='rows per cell and round, about')
    ap.add_argument('--trees', default='', help='A,B: qag from these source trees, rounds alternating (children)')
    ap.add_argument('--out', default='', help='append the JSON lines here too')
    ap.add_argument('--seed', type=int, default=7)
    ap.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
    ap.add_argument('--label', default='qag', help=argparse.SUPPRESS)
    ap.add_argument('--child-rounds', type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument('--round-base', type=int, default=0, help=argparse.SUPPRESS)
    opts = ap.parse_args()
    opts.rows = [int(x) for x in opts.rows.split(',')]
    opts.formats = opts.formats.split(',')
    opts.cases = opts.cases.split(',')
    if opts.child:
        return child(opts)
    ensure_data(opts.cases)
    trees = [t for t in opts.trees.split(',') if t] or [None]
    labels = [('qag' if t is None else os.path.basename(t.rstrip('/')) or t) for t in trees]
    rows = []
    for r in range(opts.rounds):
        order = list(zip(trees, labels)) if r % 2 == 0 else list(reversed(list(zip(trees, labels))))
        for tree, label in order:
            env = dict(os.environ)
            if tree is not None:
                env['PYTHONPATH'] = tree
            cmd = [sys.executable, os.path.abspath(__file__), '--child', '--label', label, '--round-base', str(r),
                   '--rows', ','.join(map(str, opts.rows)), '--formats', ','.join(opts.formats),
                   '--cases', ','.join(opts.cases), '--calls', str(opts.calls), '--min-calls', str(opts.min_calls),
                   '--rows-per-cell', str(opts.rows_per_cell), '--seed', str(opts.seed + r)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f'{label} round {r} failed:\n{out.stderr[-2000:]}')
            got = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{')]
            if len(trees) > 1:  # each child's own floor: keep one floor per round (the first child's)
                got = [g for g in got if g['target'] != 'floor' or label == labels[0]]
            rows += got
            print(f'round {r} {label}: {len(got)} cells', file=sys.stderr, flush=True)
    if opts.out:
        os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
        with open(opts.out, 'a') as f:
            for row in rows:
                f.write(json.dumps({**row, 'at': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}) + '\n')
    summarize(rows, opts, labels + ['floor'])


if __name__ == '__main__':
    main()
