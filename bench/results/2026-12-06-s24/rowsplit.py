"""Where a page's CPU goes in-process, by stage: the rows block's range query (pgbench's accounts joined to their
branch, four integer columns) at 1, 100 and 1,000 rows, CPU µs per call (best, median of 5 rounds): psycopg2's
execute and fetch (libpq reading the answer, then Python objects), qag's column types, the row objects, orjson
over them, and qag.render.render_json whole (the tree on PYTHONPATH, else the installed one).

    python bench/results/2026-12-06-s24/rowsplit.py"""
import statistics
import time

import orjson
import psycopg2

from qag import formats, render

SQL = ('SELECT a.aid, a.abalance, b.bid, b.bbalance FROM pgbench_accounts a '
       'JOIN pgbench_branches b ON b.bid = a.bid WHERE a.aid >= %s ORDER BY a.aid LIMIT %s')


def t(f, n):
    got = []
    for _ in range(5):
        c0 = time.process_time()
        for _ in range(n):
            f()
        got.append((time.process_time() - c0) / n * 1e6)
    return f'{min(got):.1f}/{statistics.median(got):.1f}'


def main():
    conn = psycopg2.connect('postgresql://postgres@127.0.0.1:5432/qag_bench_oltp')
    conn.autocommit = True
    for rows in (1, 100, 1000):
        n = max(20, 20000 // rows)
        cur = conn.cursor()

        def fetch():
            cur.execute(SQL, (100000, rows))
            return cur.fetchall()

        r = fetch()
        cols = formats.pg_columns(cur.description)
        d = render.row_dicts(cols, r)
        print(rows, 'rows:', {
            'execute+fetchall': t(fetch, n),
            'execute only': t(lambda: cur.execute(SQL, (100000, rows)), n),
            'pg_columns': t(lambda: formats.pg_columns(cur.description), n),
            'row_dicts': t(lambda: render.row_dicts(cols, r), n),
            'orjson of the row objects': t(lambda: orjson.dumps(d), n),
            'render_json': t(lambda: render.render_json(cols, r), n),
        })


if __name__ == '__main__':
    main()
