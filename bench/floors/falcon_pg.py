"""The PostgreSQL floor: a bare Falcon app on gunicorn doing the bench's primary-key lookup with psycopg2,
one autocommit connection per thread (one round trip per call), JSON out. What a gateway is compared with.

Routes mirror the gateways': GET /q/account?aid=N and /q/account_page?start=N, plus /health.
DSN from FLOOR_PG_DSN (default the bench's OLTP database)."""
import json
import os
import threading

import falcon
import psycopg2

_DSN = os.environ.get('FLOOR_PG_DSN', 'postgresql://postgres@127.0.0.1:5432/qag_bench_oltp')
_local = threading.local()

_SQL = {
    'account': ('SELECT aid, bid, abalance FROM pgbench_accounts WHERE aid = %s', 'aid'),
    'account_page': ('SELECT a.aid, a.abalance, b.bid, b.bbalance FROM pgbench_accounts a '
                     'JOIN pgbench_branches b ON b.bid = a.bid WHERE a.aid BETWEEN %s AND %s + 99 ORDER BY a.aid',
                     'start'),
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
        sql, param = entry
        try:
            value = int(req.get_param(param, required=True))
        except ValueError:
            raise falcon.HTTPBadRequest(description=f'{param} must be an integer')
        with _conn().cursor() as cur:
            cur.execute(sql, (value,) * sql.count('%s'))
            cols = [d[0] for d in cur.description]
            rows = [dict(zip(cols, r)) for r in cur.fetchall()]
        resp.data = json.dumps(rows).encode()
        resp.content_type = falcon.MEDIA_JSON


class _Health:
    def on_get(self, req, resp):
        resp.data = b'{"status": "ok"}'
        resp.content_type = falcon.MEDIA_JSON


app = falcon.App()
app.add_route('/q/{name}', _Query())
app.add_route('/health', _Health())
