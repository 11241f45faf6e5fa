"""Rendering a result: JSON (an array of row objects in select-list order), NDJSON and CSV here; TSV, XML, YAML,
XLSX and Parquet in qag/formats.py.

The text form of each value is fixed here and must stay byte-identical with the Rust plane's:
ints and floats as JSON numbers (floats via repr), Decimal as a number (int when integral),
datetime/date/time as ISO 8601, bytes as lowercase hex, UUID as its canonical text.
"""
from __future__ import annotations

import csv
import datetime as _dt
import decimal
import io
import json
import uuid
from typing import Iterable, Iterator

FORMATS = {"json": "application/json", "ndjson": "application/x-ndjson", "csv": "text/csv; charset=utf-8"}


def _default(v):
    if isinstance(v, decimal.Decimal):
        if v == v.to_integral_value() and abs(v) < 2 ** 63:
            return int(v)
        return float(v)
    if isinstance(v, _dt.datetime):
        return v.isoformat()
    if isinstance(v, (_dt.date, _dt.time)):
        return v.isoformat()
    if isinstance(v, _dt.timedelta):
        return v.total_seconds()
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).hex()
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, set):
        return sorted(v)
    return str(v)


_enc = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=_default, allow_nan=False)
_encode = _enc.encode


def _safe(v):
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return None
    return v


def row_objects(columns: list[str], rows: Iterable[tuple]):
    for r in rows:
        yield dict(zip(columns, r))


def render_json(columns: list[str], rows: list[tuple]) -> bytes:
    try:
        return _encode([dict(zip(columns, r)) for r in rows]).encode("utf-8")
    except ValueError:
        return _encode([dict(zip(columns, map(_safe, r))) for r in rows]).encode("utf-8")


def _line(columns, r) -> bytes:
    try:
        return (_encode(dict(zip(columns, r))) + "\n").encode("utf-8")
    except ValueError:
        return (_encode(dict(zip(columns, map(_safe, r)))) + "\n").encode("utf-8")


def render_ndjson(columns: list[str], rows: list[tuple]) -> bytes:
    return b"".join(_line(columns, r) for r in rows)


def _csv_value(v):
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (str, int, float)):
        return v
    if isinstance(v, (dict, list, tuple)):
        # a JSON or record value: its JSON text, exactly as the json format writes it (not Python's repr)
        return _encode(v)
    d = _default(v)
    return d if isinstance(d, (str, int, float)) else _encode(d)


def render_csv(columns: list[str], rows: list[tuple], delimiter: str = ",") -> bytes:
    buf = io.StringIO()
    w = csv.writer(buf, delimiter=delimiter, lineterminator="\r\n")
    w.writerow(columns)
    for r in rows:
        w.writerow([_csv_value(v) for v in r])
    return buf.getvalue().encode("utf-8")


RENDERERS = {"json": render_json, "ndjson": render_ndjson, "csv": render_csv}


def stream_ndjson(columns: list[str], batches: Iterator[list[tuple]]) -> Iterator[bytes]:
    for batch in batches:
        if batch:
            yield b"".join(_line(columns, r) for r in batch)


def stream_csv(columns: list[str], batches: Iterator[list[tuple]], delimiter: str = ",") -> Iterator[bytes]:
    buf = io.StringIO()
    w = csv.writer(buf, delimiter=delimiter, lineterminator="\r\n")
    w.writerow(columns)
    yield buf.getvalue().encode("utf-8")
    for batch in batches:
        buf.seek(0)
        buf.truncate()
        for r in batch:
            w.writerow([_csv_value(v) for v in r])
        if batch:
            yield buf.getvalue().encode("utf-8")


STREAMERS = {"ndjson": stream_ndjson, "csv": stream_csv}


def _more_formats() -> None:
    from qag import formats
    FORMATS.update(formats.CONTENT_TYPES)
    RENDERERS.update(formats.RENDERERS)
    STREAMERS.update(formats.STREAMERS)


_more_formats()
