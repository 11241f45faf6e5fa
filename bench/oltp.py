#!/usr/bin/env python3
"""OLTP on PostgreSQL: pgbench's schema (scale 10, or --scale 100) behind every target, the seeds' three saved
queries and three keys, measured block by block. `python bench/oltp.py --smoke` is the CI check.

Usage: python bench/oltp.py [blocks...] [--targets peer,qag,floor] [--rounds 5] [--smoke] (see --help)."""
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import blocks as B  # noqa: E402
import harness as H  # noqa: E402
import targets as T  # noqa: E402

DATA_DB = 'qag_bench_oltp'
# the rows block's range query: bench/floors/falcon_pg.py runs the same with LIMIT page_size
RANGE_SQL = ('SELECT a.aid, a.abalance, b.bid, b.bbalance FROM pgbench_accounts a '
             'JOIN pgbench_branches b ON b.bid = a.bid WHERE a.aid >= :start ORDER BY a.aid')
PG = ['-h', '127.0.0.1', '-p', '5432', '-U', 'postgres']


def pg_connect(db):
    import psycopg2
    conn = psycopg2.connect(f'postgresql://postgres@127.0.0.1:5432/{db}')
    conn.autocommit = True
    return conn


def ensure_data(scale):
    """pgbench -i -s N into qag_bench_oltp, unless it already holds that scale."""
    conn = pg_connect('postgres')
    with conn.cursor() as cur:
        cur.execute('SELECT 1 FROM pg_database WHERE datname = %s', (DATA_DB,))
        exists = cur.fetchone() is not None
        if not exists:
            cur.execute(f'CREATE DATABASE {DATA_DB}')
    conn.close()
    have = None
    conn = pg_connect(DATA_DB)
    with conn.cursor() as cur:
        try:
            cur.execute('SELECT count(*) FROM pgbench_branches')
            have = cur.fetchone()[0]
        except Exception:  # noqa: BLE001 - no schema yet
            have = None
    conn.close()
    if have == scale:
        return
    H.progress(f'pgbench -i -s {scale} {DATA_DB} (was {have})')
    subprocess.run(['pgbench', '-i', '-q', '-s', str(scale)] + PG + [DATA_DB], check=True,
                   stdout=subprocess.DEVNULL)


def id_regex(n):
    """A regex drawing ids uniformly from the largest d-digit block under n (1,000,000 rows -> 100000-999999),
    so every id exists and no leading zeros are sent."""
    d = len(str(n)) - 1
    return '[1-9]' + (f'[0-9]{{{d - 1}}}' if d > 1 else '')


def workload(scale):
    accounts = scale * 100000
    connection = {'name': 'oltp', 'db': 'postgres', 'host': '127.0.0.1', 'port': 5432, 'user': 'postgres',
                  'password': '', 'database': DATA_DB,
                  'options': {'allow_superuser': True}}  # the governed key on a superuser connection (S8)
    queries = [
        {'name': 'account', 'connection_name': 'oltp', 'publish': True, 'description': 'One account by id',
         'sql': 'SELECT aid, bid, abalance FROM pgbench_accounts WHERE aid = :aid',
         'parameters': {'aid': {'type': 'int', 'required': True}}},
        {'name': 'account_page', 'connection_name': 'oltp', 'publish': True,
         'description': 'A 100-row page of accounts with their branch',
         'sql': 'SELECT a.aid, a.abalance, b.bid, b.bbalance FROM pgbench_accounts a '
                'JOIN pgbench_branches b ON b.bid = a.bid WHERE a.aid BETWEEN :start AND :start + 99 ORDER BY a.aid',
         'parameters': {'start': {'type': 'int', 'required': True}}},
        {'name': 'account_range', 'connection_name': 'oltp', 'publish': True,
         'description': 'Accounts with their branch from start on, a page of page_size rows (the rows block)',
         'sql': RANGE_SQL, 'parameters': {'start': {'type': 'int', 'required': True}}},
        {'name': 'account_cached', 'connection_name': 'oltp', 'publish': True, 'cache_ttl': 600,
         'description': 'One account by id, answered from the response cache for 10 minutes (the cache block)',
         'sql': 'SELECT aid, bid, abalance FROM pgbench_accounts WHERE aid = :aid',
         'parameters': {'aid': {'type': 'int', 'required': True}}},
        {'name': 'deposit', 'connection_name': 'oltp', 'publish': True, 'description': 'Add delta to an account',
         'sql': 'UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid',
         'parameters': {'aid': {'type': 'int', 'required': True}, 'delta': {'type': 'int', 'required': True}}},
    ]
    plain = {'queries': ['account', 'account_page', 'account_range', 'account_cached'], 'connections': []}
    keys = {
        'plain': plain,
        'governed': {**plain, 'allowed_tables': ['pgbench_accounts', 'pgbench_branches'],
                     'mask': [{'column': '*.abalance', 'action': 'hash'}]},
        'writer': {'queries': ['deposit'], 'connections': [], 'allow_writes': True, 'allowed_write_ops': ['update']},
    }
    aid = id_regex(accounts)
    start = id_regex(accounts // 10)
    lookup = rf'/q/account\?aid={aid}'
    page = rf'/q/account_page\?start={start}&page_size=100'
    calls = [
        T.HELLO,
        T.Call('lookup_plain', 'account', 'plain', lookup, floor=lookup),
        T.Call('lookup_governed', 'account', 'governed', lookup),
        T.Call('page_plain', 'account_page', 'plain', page, floor=page),
        T.Call('deposit_writer', 'deposit', 'writer', rf'/q/deposit\?aid={aid}&delta=[1-9]',
               floor=rf'/q/deposit\?aid={aid}&delta=[1-9]'),
    ]
    w = T.Workload(connection, queries, keys, data_db=DATA_DB,
                   floor_env={'FLOOR_PG_DSN': f'postgresql://postgres@127.0.0.1:5432/{DATA_DB}'})

    def rows_call(n, fmt):
        # start from the 5-digit ids: every page of up to 1,000 rows exists in full
        path = rf'/q/account_range\?start={start}&page_size={n}&format={fmt}'
        return T.Call(f'rows_{fmt}_{n}', 'account_range', 'plain', path, floor=path)
    # the cache block: 100 ids (100000-100099), cached and not; after the warm-up every cached call is a hit
    hot = r'1000[0-9][0-9]'
    cache_calls = (T.Call('cache_uncached', 'account', 'plain', rf'/q/account\?aid={hot}'),
                   T.Call('cache_hit', 'account_cached', 'plain', rf'/q/account_cached\?aid={hot}'))
    cache_calls[0].samples = [f'/q/account?aid={100000 + i}' for i in range(0, 100, 5)]
    cache_calls[1].samples = [f'/q/account_cached?aid={100000 + i}' for i in range(0, 100, 5)]
    # the keys block: the lookup with the plain key's grants, spread over K keys or the same SQL under Q names
    keys_spec = {'call': calls[1], 'path': '/q/account?aid={id}', 'id_range': (10 ** (len(str(accounts)) - 2),
                                                                              10 ** (len(str(accounts)) - 1) - 1),
                 'query': queries[0]}
    return w, calls, rows_call, cache_calls, keys_spec


def pg_xacts(db):
    conn = pg_connect('postgres')
    with conn.cursor() as cur:
        cur.execute('SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s', (db,))
        row = cur.fetchone()
    conn.close()
    return row[0] if row else 0


def roundtrip_counter(target):
    """Transactions so far on the data database and on the target's own store (pg_stat_database)."""
    out = {'data_xacts': pg_xacts(DATA_DB)}
    if target.store_db():
        out['store_xacts'] = pg_xacts(target.store_db())
    return out


def dbonly(bench):
    """PostgreSQL on its own: pgbench -S (primary-key read) with 1 and --callers clients, from the load CPUs."""
    opts = bench.opts
    for rnd in range(opts.rounds):
        for clients in (1, opts.callers):
            cmd = H.taskset_prefix(opts.load_cpus) + ['pgbench', '-S', '-n', '-c', str(clients), '-j', '1', '-T',
                                                       str(max(1, int(opts.duration)))] + PG + [DATA_DB]
            out = subprocess.run(cmd, capture_output=True, text=True)
            m = re.search(r'tps = ([0-9.]+) \((?:without|excluding)', out.stdout)
            lat = re.search(r'latency average = ([0-9.]+) ms', out.stdout)
            if out.returncode != 0 or not m:
                bench.fail('dbonly', f'pgbench -S -c {clients}', RuntimeError(out.stderr[-300:]))
                continue
            row = bench.results.add(block='dbonly', target='postgres', call='pgbench_S', round=rnd, conns=clients,
                                    rps=float(m.group(1)), mean_ms=float(lat.group(1)) if lat else None,
                                    n=1, non_2xx=0, errors=0)
            H.progress(f"[dbonly] r{rnd} pgbench -S -c {clients}: {row['rps']:.0f} tps")


def main():
    def extra(p):
        p.add_argument('--scale', type=int, default=10, help='pgbench scale (10 default; seeds use 100)')
    opts = B.parse_args(__doc__.splitlines()[0], os.path.join(H.BENCH_DIR, 'out', 'oltp', 'results.jsonl'), extra)
    ensure_data(opts.scale)
    w, calls, rows_call, cache_calls, keys_spec = workload(opts.scale)
    bench = B.Bench(opts, 'oltp', w, calls, db_comms={'postgres'}, roundtrip_counter=roundtrip_counter,
                    dbonly=dbonly, rows_call=rows_call, cache_calls=cache_calls, keys_spec=keys_spec)
    bench.results.common['scale'] = opts.scale
    sys.exit(bench.run())


if __name__ == '__main__':
    main()
