"""What the floors write: the rows as the driver returns them, in json (an array of objects), ndjson or csv, the
cheapest plain way (orjson when installed, else the standard library), with no gateway's rules for values
(a Decimal is a float, a date its ISO text). Shared by falcon_pg.py and falcon_mysql.py."""
import csv
import datetime
import decimal
import io
import json

try:
    import orjson
except ImportError:  # the floor still runs, on the standard library
    orjson = None

TYPES = {'json': 'application/json', 'ndjson': 'application/x-ndjson', 'csv': 'text/csv; charset=utf-8'}


def _default(v):
    if isinstance(v, decimal.Decimal):
        return float(v)
    if isinstance(v, (datetime.date, datetime.datetime, datetime.time)):
        return v.isoformat()
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).hex()
    return str(v)


def render(cols, rows, fmt):
    """(body, content type) for rows (tuples) under column names cols."""
    if fmt == 'csv':
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator='\r\n')
        w.writerow(cols)
        w.writerows(rows)
        return buf.getvalue().encode(), TYPES['csv']
    if fmt == 'ndjson':
        if orjson is not None:
            buf = io.BytesIO()
            opt = orjson.OPT_APPEND_NEWLINE
            for r in rows:
                buf.write(orjson.dumps(dict(zip(cols, r)), default=_default, option=opt))
            return buf.getvalue(), TYPES['ndjson']
        return ''.join(json.dumps(dict(zip(cols, r)), default=_default) + '\n' for r in rows).encode(), TYPES['ndjson']
    objs = [dict(zip(cols, r)) for r in rows]
    if orjson is not None:
        return orjson.dumps(objs, default=_default), TYPES['json']
    return json.dumps(objs, default=_default).encode(), TYPES['json']


def formats(req):
    fmt = (req.get_param('format') or 'json').lower()
    return fmt if fmt in TYPES else None
