"""The PostgreSQL floor: a bare Falcon app on gunicorn doing the bench's primary-key lookup (and its write) with
psycopg2, one autocommit connection per thread (one round trip per call), json, ndjson or csv out (floor_render.py).
What a gateway is compared with.

Routes mirror the gateways': GET /q/account?aid=N, /q/account_page?start=N, /q/account_range?start=N&page_size=K
(K rows from N on: the rows-per-call block), each with &format=json|ndjson|csv, /q/deposit?aid=N&delta=D
(the writes block), plus /health.
DSN from FLOOR_PG_DSN (default the bench's OLTP database)."""
import os
import threading

import falcon
import psycopg2
from floor_render import formats, render

_DSN = os.environ.get('FLOOR_PG_DSN', 'postgresql://postgres@127.0.0.1:5432/qag_bench_oltp')
_local = threading.local()

# the rows-per-call block's query (bench/oltp.py saves the same SQL in every gateway, which pages it)
RANGE_SQL = ('SELECT a.aid, a.abalance, b.bid, b.bbalance FROM pgbench_accounts a '
             'JOIN pgbench_branches b ON b.bid = a.bid WHERE a.aid >= %s ORDER BY a.aid')

_SQL = {
    'account': ('SELECT aid, bid, abalance FROM pgbench_accounts WHERE aid = %s', ('aid',)),
    'account_page': ('SELECT a.aid, a.abalance, b.bid, b.bbalance FROM pgbench_accounts a '
                     'JOIN pgbench_branches b ON b.bid = a.bid WHERE a.aid BETWEEN %s AND %s + 99 ORDER BY a.aid',
                     ('start', 'start')),
    'account_range': (RANGE_SQL + ' LIMIT %s', ('start', 'page_size')),
    # the write: one autocommit UPDATE, one round trip (a gateway also resets the session after it, S5)
    'deposit': ('UPDATE pgbench_accounts SET abalance = abalance + %s WHERE aid = %s', ('delta', 'aid')),
}


def _conn():
    conn = getattr(_local, 'conn', None)
    if conn is None or conn.closed:
        conn = psycopg2.connect(_DSN)
        # autocommit: a SELECT is one message and one answer, no BEGIN/ROLLBACK around it.
        conn.autocommit = True
        _local.conn = conn
    return conn


class _Query:
    def on_get(self, req, resp, name):
        entry = _SQL.get(name)
        if entry is None:
            raise falcon.HTTPNotFound()
        sql, names = entry
        fmt = formats(req)
        try:
            args = [int(req.get_param(n) or 10) if n == 'page_size' else int(req.get_param(n, required=True))
                    for n in names]
        except ValueError:
            raise falcon.HTTPBadRequest(description='parameters must be integers') from None
        if fmt is None:
            raise falcon.HTTPBadRequest(description='format must be json, ndjson or csv')
        with _conn().cursor() as cur:
            cur.execute(sql, args)
            if cur.description is None:  # a write: its count, as the gateways answer it
                resp.data, resp.content_type = b'{"rowcount":%d}' % cur.rowcount, falcon.MEDIA_JSON
                return
            cols = [d[0] for d in cur.description]
            rows = cur.fetchall()
        resp.data, resp.content_type = render(cols, rows, fmt)


class _Health:
    def on_get(self, req, resp):
        resp.data = b'{"status": "ok"}'
        resp.content_type = falcon.MEDIA_JSON


app = falcon.App()
app.add_route('/q/{name}', _Query())
app.add_route('/health', _Health())
