"""render_json of the rows block's page, in-process, from two source trees side by side: the same rows fetched once
(pgbench's accounts joined to their branch), each tree's qag.render and qag.formats imported in turn, 9 rounds
alternating the order, CPU µs per call (median, min-max).

    python bench/results/2026-12-06-s24/render_ab.py BEFORE_TREE AFTER_TREE [1,10,100,1000]"""
import statistics
import sys
import time

import psycopg2

SQL = ('SELECT a.aid, a.abalance, b.bid, b.bbalance FROM pgbench_accounts a '
       'JOIN pgbench_branches b ON b.bid = a.bid WHERE a.aid >= %s ORDER BY a.aid LIMIT %s')


def load(path):
    sys.path.insert(0, path)
    for m in [k for k in sys.modules if k == 'qag' or k.startswith('qag.')]:
        del sys.modules[m]
    import qag.formats as f
    import qag.render as r
    sys.path.pop(0)
    return r, f


def main():
    old, fo = load(sys.argv[1])
    new, fn = load(sys.argv[2])
    sizes = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else '1,10,100,1000').split(',')]
    conn = psycopg2.connect('postgresql://postgres@127.0.0.1:5432/qag_bench_oltp')
    conn.autocommit = True
    for n in sizes:
        cur = conn.cursor()
        cur.execute(SQL, (100000, n))
        rows = cur.fetchall()
        co, cn = fo.pg_columns(cur.description), fn.pg_columns(cur.description)
        assert old.render_json(co, rows) == new.render_json(cn, rows)
        res = {'before': [], 'after': []}
        k = max(50, 20000 // n)
        for rnd in range(9):
            for name, mod, cols in (('before', old, co), ('after', new, cn))[::(1 if rnd % 2 else -1)]:
                c0 = time.process_time()
                for _ in range(k):
                    mod.render_json(cols, rows)
                res[name].append((time.process_time() - c0) / k * 1e6)
        b, a = statistics.median(res['before']), statistics.median(res['after'])
        print(f"{n:5d} rows: before {b:7.1f} us ({min(res['before']):.1f}-{max(res['before']):.1f})  "
              f"after {a:7.1f} us ({min(res['after']):.1f}-{max(res['after']):.1f})  saved {b - a:6.1f} us")


if __name__ == '__main__':
    main()
