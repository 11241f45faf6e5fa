"""A `/q` call's options: the reserved names (format, page, page_size, version, timeout, stream,
connection_name) split from the query's parameters and checked, each refusal a 400 of the contract.

Its twin is `rustplane/src/options.rs`: the data plane checks format, page and page_size with the same rules
and answers, and forwards here every call that names version, timeout, stream or connection_name, or a value
it does not parse itself.
"""
from __future__ import annotations

import math

from qag import connectors, formats, render
from qag import params as P
from qag.errors import ApiError

TRUE = frozenset(("1", "true", "yes", "on"))
FALSE = frozenset(("0", "false", "no", "off", ""))
TRUE_OR_FALSE = TRUE | FALSE
FORMAT_NAMES = ", ".join(render.FORMATS)
MAX_OFFSET = (2 ** 63 - 1) // 2


class CallOptions:
    __slots__ = ("format", "page", "page_size", "version", "timeout", "stream", "params", "connection")


ONCE_CODES = {"format": "invalid_format", "page": "invalid_paging", "page_size": "invalid_paging",
              "timeout": "invalid_timeout", "stream": "invalid_stream", "version": "param_invalid",
              "connection_name": "param_invalid"}


def given_once(name: str) -> ApiError:
    """A reserved name given twice (`?page=1&page=2`, or both in the query string and a POST body): which one
    was meant cannot be known, so the call is refused with that option's own code."""
    extra = {"errors": {name: "must be given once"}} if ONCE_CODES[name] == "param_invalid" else None
    return ApiError(400, ONCE_CODES[name], f"{name} must be given once.", extra)


def call_options(given: dict, cfg) -> CallOptions:
    """Split reserved names (format, page, page_size, version, timeout, stream) from parameters."""
    o = CallOptions()
    get = given.get
    for name in ONCE_CODES:
        if isinstance(get(name), list):
            raise given_once(name)
    fmt = get("format", "json")
    low = fmt.lower() if isinstance(fmt, str) else None
    if low not in render.FORMATS:
        raise ApiError(400, "invalid_format", f"format must be one of {FORMAT_NAMES}, not {fmt!r}.")
    o.format = low
    if low in formats.OPTIONAL:
        formats.available(low)
    raw = get("page")
    o.page = 1 if raw is None or raw == "" else _int_opt(given, "page", 1, 1, None)
    o.page_size = _int_opt(given, "page_size", cfg.default_page_size, 1, cfg.max_page_size)
    if o.page > MAX_OFFSET // o.page_size:
        # The offset (page - 1) * page_size must stay a signed 64-bit integer on every database; the data
        # plane forwards exactly these calls here (rustplane/src/options.rs, "page beyond 64-bit offsets").
        raise ApiError(400, "invalid_paging", f"page must be between 1 and {MAX_OFFSET // o.page_size} for a "
                       f"page_size of {o.page_size}.")
    v = given.get("version")
    if v is None or v == "":
        o.version = None
    else:
        try:
            if isinstance(v, bool) or (isinstance(v, str) and not P.INT_RE.fullmatch(v)) or \
                    (isinstance(v, float) and not v.is_integer()):
                raise ValueError
            o.version = int(v)
            if o.version < 1 or o.version >= 2 ** 63:
                raise ValueError
        except (TypeError, ValueError, OverflowError):
            raise ApiError(400, "param_invalid", "version must be a positive integer.",
                           {"errors": {"version": "must be a positive integer"}}) from None
    t = given.get("timeout")
    if t is None or t == "":
        o.timeout = None
    else:
        # connectors S3: a positive number of seconds, clamped to [0.01, QAG_QUERY_TIMEOUT] and rounded up to
        # whole milliseconds, so no value asks the server for "no limit"
        try:
            if isinstance(t, bool) or not isinstance(t, (str, int, float)):
                raise ValueError
            if isinstance(t, str) and not P.FLOAT_RE.fullmatch(t):
                raise ValueError  # ASCII decimal text only: no spaces, '_', Unicode digits, nan or inf
            asked = float(t)
            if not (asked > 0 and math.isfinite(asked)):
                raise ValueError
        except (TypeError, ValueError, OverflowError):
            raise ApiError(400, "invalid_timeout", f"timeout must be a positive number of seconds (at least "
                           f"{connectors.MIN_TIMEOUT:g} is used, at most {cfg.query_timeout:g}).") from None
        o.timeout = connectors.limit_ms(asked, cfg.query_timeout) / 1000
    s = given.get("stream")
    if s is None:
        o.stream = False
    elif isinstance(s, bool):
        o.stream = s
    elif isinstance(s, str) and s.lower() in TRUE_OR_FALSE:
        o.stream = s.lower() in TRUE
    else:
        raise ApiError(400, "invalid_stream", "stream must be true or false.")
    if o.stream:
        if o.format not in render.STREAMERS:
            raise ApiError(400, "invalid_stream", f"stream=true needs format={', '.join(render.STREAMERS)}; "
                           f"{o.format} is not streamed.")
        if "page" in given or "page_size" in given:
            raise ApiError(400, "invalid_stream", "stream=true returns the whole result; leave out page and "
                           "page_size.")
    c = given.get("connection_name")
    if c is None or c == "":
        o.connection = None
    elif not isinstance(c, str) or "\x00" in c:
        raise ApiError(400, "param_invalid", "connection_name must be the name of a connection.",
                       {"errors": {"connection_name": "must be a connection's name"}})
    else:
        o.connection = c
    o.params = {k: v for k, v in given.items() if k not in P.RESERVED}
    return o


def _int_opt(given: dict, name: str, default: int, lo: int, hi: int | None) -> int:
    raw = given.get(name)
    if raw is None or raw == "":
        return default
    try:
        if raw.__class__ is str:  # a query string's value: ASCII digits, an optional sign, nothing else
            if not P.INT_RE.fullmatch(raw):
                raise ValueError
            v = P.text_int(raw)
        else:
            if isinstance(raw, bool) or isinstance(raw, list):
                raise ValueError
            v = int(raw)
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError
    except (TypeError, ValueError, OverflowError):  # OverflowError: a JSON body's Infinity
        raise ApiError(400, "invalid_paging", f"{name} must be an integer.") from None
    if v < lo or (hi is not None and v > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise ApiError(400, "invalid_paging", f"{name} must be {bound}.")
    return v
