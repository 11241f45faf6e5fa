"""The MariaDB floor: a bare Falcon app on gunicorn running the tpcc_mysql saved queries straight through
mysql-connector, one autocommit connection per thread, json, ndjson or csv out (floor_render.py). What a
gateway is compared with on MySQL.

FLOOR_MYSQL (JSON: host, port, user, password, database) and FLOOR_QUERIES (JSON: name -> [sql with %s, [param
names in order; a parameter named page_size is the row count, default 10]]) come from the harness. Routes:
GET /q/<name>?<params>[&format=json|ndjson|csv], /health."""
import json
import os
import threading

import falcon
import mysql.connector
from floor_render import formats, render

_CFG = json.loads(os.environ.get('FLOOR_MYSQL', '{}'))
_QUERIES = json.loads(os.environ.get('FLOOR_QUERIES', '{}'))
_local = threading.local()


def _conn():
    conn = getattr(_local, 'conn', None)
    if conn is None:
        conn = mysql.connector.connect(autocommit=True, **_CFG)
        _local.conn = conn
    return conn


class _Query:
    def on_get(self, req, resp, name):
        entry = _QUERIES.get(name)
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
        cur = _conn().cursor()
        try:
            cur.execute(sql, args)
            cols = [d[0] for d in cur.description]
            rows = cur.fetchall()
        finally:
            cur.close()
        resp.data, resp.content_type = render(cols, rows, fmt)


class _Health:
    def on_get(self, req, resp):
        resp.data = b'{"status": "ok"}'
        resp.content_type = falcon.MEDIA_JSON


app = falcon.App()
app.add_route('/q/{name}', _Query())
app.add_route('/health', _Health())
