"""The text of a value: what every format writes for each Python type a driver returns. Normative: the Rust
plane's render.rs writes the same bytes (tests/e2e/test_plane_differential.py), so a change here is a change
there.

JSON: ints and floats as JSON numbers (floats via repr), Decimal as a number (int when integral),
datetime/date/time as ISO 8601, timedelta as seconds, bytes as lowercase hex, UUID as its canonical text, a set
as its sorted list. CSV (and every text format): the same, NULL as an empty field, booleans as true/false, a
JSON value as its JSON text.
"""
from __future__ import annotations

import datetime as _dt
import decimal
import json
import uuid


def decimal_text(v: decimal.Decimal) -> str:
    """A finite Decimal's exact digits in plain notation, its exponent kept (trailing zeros too: numeric(12,2)'s
    12.50 stays 12.50), never an exponent form: the text PostgreSQL prints for a numeric (1E+3 -> 1000,
    1E-7 -> 0.0000001)."""
    return format(v, "f")


def json_value(v):
    """A value JSON has no type for, as the JSON value it is written as (the encoder's default)."""
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


_enc = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=json_value, allow_nan=False)
_c_make = getattr(json.encoder, "c_make_encoder", None)
if _c_make is not None:
    # JSONEncoder.encode builds a new C encoder on every call (~2 us): built once here, one per line of NDJSON
    # cost 2.1 us a row before. No circular-reference markers: a database value cannot refer to itself.
    _c_iter = _c_make(None, json_value, json.encoder.c_encode_basestring, None, ":", ",", False, False, False)

    def encode(o) -> str:
        """o as compact JSON text (separators "," and ":", non-ASCII kept, NaN refused: ValueError)."""
        return "".join(_c_iter(o, 0))
else:  # pragma: no cover - not CPython
    encode = _enc.encode


def csv_value(v):
    """A value as the csv module should get it: str, int or float (written via str/repr), or "" for NULL."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (str, int, float)):
        return v
    if isinstance(v, (dict, list, tuple)):
        # a JSON or record value: its JSON text, exactly as the json format writes it (not Python's repr)
        return encode(v)
    d = json_value(v)
    return d if isinstance(d, (str, int, float)) else encode(d)
