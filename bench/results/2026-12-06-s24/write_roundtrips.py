"""What a write's round trips cost the client process here: psycopg2 in autocommit on the bench's OLTP database,
one thread, CPU µs of this process per operation (median, min-max of 7 rounds of 300): the UPDATE alone, qag's
one-message write (`SET LOCAL statement_timeout; UPDATE`), the same followed by S5's `DISCARD ALL` as psycopg2
sends it (waiting for its answer), `DISCARD ALL` alone and `SELECT 1`.

    python bench/results/2026-12-06-s24/write_roundtrips.py"""
import random
import statistics
import time

import psycopg2

U = 'UPDATE pgbench_accounts SET abalance = abalance + %s WHERE aid = %s'


def main():
    conn = psycopg2.connect('postgresql://postgres@127.0.0.1:5432/qag_bench_oltp', application_name='qag')
    conn.autocommit = True

    def run(sql, args=None):
        with conn.cursor() as c:
            c.execute(sql, args)

    def update():
        run(U, (1, random.randint(100000, 999999)))

    def qag_write():
        run('SET LOCAL statement_timeout = 5000; ' + U, (1, random.randint(100000, 999999)))

    def qag_write_reset():
        qag_write()
        run('DISCARD ALL')

    ops = [('UPDATE alone', update), ('SET LOCAL; UPDATE', qag_write),
           ('SET LOCAL; UPDATE then DISCARD ALL', qag_write_reset), ('DISCARD ALL alone', lambda: run('DISCARD ALL')),
           ('SELECT 1', lambda: run('SELECT 1'))]
    res = {name: [] for name, _ in ops}
    for _ in range(7):
        for name, f in ops:
            c0 = time.process_time()
            for _ in range(300):
                f()
            res[name].append((time.process_time() - c0) / 300 * 1e6)
    for name, v in res.items():
        print(f'{name:40s} {statistics.median(v):6.1f} us CPU ({min(v):.1f}-{max(v):.1f})')


if __name__ == '__main__':
    main()
