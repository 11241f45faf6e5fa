"""The MariaDB floor: a bare Falcon app on gunicorn running the tpcc_mysql saved queries straight through
mysql-connector, one autocommit connection per thread, JSON out. What a gateway is compared with on MySQL.

FLOOR_MYSQL (JSON: host, port, user, password, database) and FLOOR_QUERIES (JSON: name -> [sql with %s, [param
names in order]]) come from bench/tpcc_mysql.py. Routes: GET /q/<name>?<params>, /health."""
import datetime
import decimal
import json
import os
import threading

import falcon
import mysql.connector

_CFG = json.loads(os.environ.get('FLOOR_MYSQL', '{}'))
_QUERIES = json.loads(os.environ.get('FLOOR_QUERIES', '{}'))
_local = threading.local()


def _default(v):
    if isinstance(v, decimal.Decimal):
        return float(v)
    if isinstance(v, (datetime.date, datetime.datetime)):
        return v.isoformat(sep=' ')
    return str(v)


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
        try:
            args = [int(req.get_param(n, required=True)) for n in names]
        except ValueError:
            raise falcon.HTTPBadRequest(description='parameters must be integers')
        cur = _conn().cursor()
        try:
            cur.execute(sql, args)
            cols = [d[0] for d in cur.description]
            rows = [dict(zip(cols, r)) for r in cur.fetchall()]
        finally:
            cur.close()
        resp.data = json.dumps(rows, default=_default).encode()
        resp.content_type = falcon.MEDIA_JSON


class _Health:
    def on_get(self, req, resp):
        resp.data = b'{"status": "ok"}'
        resp.content_type = falcon.MEDIA_JSON


app = falcon.App()
app.add_route('/q/{name}', _Query())
app.add_route('/health', _Health())
