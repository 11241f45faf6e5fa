"""The text of a value: what every format writes for each Python type a driver returns. Normative: the Rust
plane's render.rs writes the same bytes (tests/e2e/test_plane_differential.py), so a change here is a change
there.

JSON: ints as JSON numbers, floats as their shortest round-trip text (repr), a Decimal (numeric, DECIMAL) as a JSON
number of its exact digits in plain notation (decimal_text: 12.50 stays 12.50, never a binary float's
124.94999999999999), NaN and infinities as null; datetime/date/time as ISO 8601, timedelta as seconds, bytes as
lowercase hex, UUID as its canonical text, a set as its sorted list. CSV (and every text format): the same, NULL
as an empty field, booleans as true/false, a JSON value as its JSON text, a non-finite Decimal as its text (NaN).
"""
from __future__ import annotations

import datetime as _dt
import decimal
import json
import re
import secrets
import uuid


def decimal_text(v: decimal.Decimal) -> str:
    """A finite Decimal's exact digits in plain notation, its exponent kept (trailing zeros too: numeric(12,2)'s
    12.50 stays 12.50), never an exponent form: the text PostgreSQL prints for a numeric (1E+3 -> 1000,
    1E-7 -> 0.0000001)."""
    return format(v, "f")


# The standard library's encoder has no way to write a number's own text (a float subclass is written with
# float.__repr__): a finite Decimal is handed to it as a string that opens with NUL and this process's nonce, which
# the encoder writes as "\u0000<nonce><digits>", and encode() puts the bare digits in its place. A value of the
# result cannot forge it: it would have to know the nonce, which nothing prints.
_NONCE = secrets.token_hex(8)
_MARK = "\x00" + _NONCE
_MARKED_OUT = '"\\u0000' + _NONCE
_MARKED = re.compile(re.escape(_MARKED_OUT) + '([-0-9.]+)"')


def json_value(v):
    """A value JSON has no type for, as the JSON value it is written as (the encoder's default; a finite Decimal
    is its decimal_text marked for encode(), a non-finite one None)."""
    if isinstance(v, decimal.Decimal):
        return _MARK + decimal_text(v) if v.is_finite() else None
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

    def _encode(o) -> str:
        return "".join(_c_iter(o, 0))
else:  # pragma: no cover - not CPython
    _encode = _enc.encode


def encode(o) -> str:
    """o as compact JSON text (separators "," and ":", non-ASCII kept, a float NaN refused: ValueError)."""
    s = _encode(o)
    return _MARKED.sub(r"\1", s) if _MARKED_OUT in s else s


def csv_value(v):
    """A value as the csv module should get it: str, int or float (written via str/repr), or "" for NULL."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (str, int, float)):
        return v
    if isinstance(v, decimal.Decimal):
        return decimal_text(v) if v.is_finite() else str(v)  # NaN, Infinity: the database's text
    if isinstance(v, (dict, list, tuple)):
        # a JSON or record value: its JSON text, exactly as the json format writes it (not Python's repr)
        return encode(v)
    d = json_value(v)
    return d if isinstance(d, (str, int, float)) else encode(d)
