"""Rendering a result: JSON (an array of row objects in select-list order), NDJSON, CSV and TSV here; XML, YAML,
XLSX and Parquet in qag/formats.py. The text of each value is qag/values.py's (normative: byte-identical with
the Rust plane's).
"""
from __future__ import annotations

import csv
import datetime as _dt
import decimal
import io
import uuid
from collections.abc import Iterable, Iterator
from itertools import repeat
from operator import itemgetter

from qag import formats as _f
from qag.values import csv_value as _csv_value
from qag.values import encode as _encode

try:  # the fast path below; without it every result takes the standard library's path, to the same bytes
    import orjson as _orjson
except ImportError:  # pragma: no cover - orjson is in the `server` extra
    _orjson = None

FORMATS = {"json": "application/json", "ndjson": "application/x-ndjson", "csv": "text/csv; charset=utf-8",
           "tsv": "text/tab-separated-values; charset=utf-8"}


def _safe(v):
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return None
    return v


# -- the fast path: orjson, only where its bytes are the standard library's --------------------------------
# orjson writes str, int (64-bit), bool and None exactly as json does with ensure_ascii=False (the escapes too),
# floats as repr does except below 1e-4 ("0.00001", "1e-5" for "1e-05"; 0.0 and everything from 1e-4 up agree),
# naive datetimes and dates as isoformat() does (every microsecond checked), but an aware datetime with an offset
# of seconds (pre-1900 local mean time: "+00:19:32") cut to minutes, and a time of 10,000-99,999 us with a digit
# short ("00:00:00.10000" for .010000). tests/unit/test_core_render.py compares both paths over
# a corpus and a hypothesis property. So a result takes it only when no value is a container or a type orjson
# serialises natively its own way (Enum), no float is below 1e-4 in magnitude, and datetimes and times are handed to
# _orjson_default (isoformat) unless no column can hold an aware datetime or a time. Every other value goes to
# _orjson_default, which returns exactly the standard library's text. Any error falls back to the standard path,
# which then behaves as it always did (NaN -> null retry, the same exceptions).
_FAST_VALUES = frozenset((str, int, bool, float, type(None), decimal.Decimal, _dt.datetime, _dt.date, _dt.time,
                          _dt.timedelta, bytes, bytearray, memoryview, uuid.UUID))
# Neutral column types (qag/formats.py) whose driver values are always among _FAST_VALUES and never a float:
# not scanned. TIMESTAMP values are naive (psycopg2's timestamp, mysql-connector's DATETIME and TIMESTAMP).
_FAST_TYPES = frozenset((_f.BOOL, _f.INT, _f.DECIMAL, _f.DATE, _f.TIME, _f.TIMESTAMP, _f.TIMESTAMPTZ, _f.BYTES))
_DATES = (_dt.datetime, _dt.date, _dt.time)


def _orjson_default(v):
    t = type(v)
    if t is decimal.Decimal:
        # its exact digits as a JSON number (qag/values.py's decimal_text): str() is format(v, "f") unless it has
        # an exponent (1E+3, 1E-7; only a finite one has), and 3x cheaper; NaN and Infinity end in a letter: null
        s = str(v)
        if "E" in s:
            return _orjson.Fragment(format(v, "f"))
        return _orjson.Fragment(s) if s[-1] <= "9" else None
    elif t in _DATES:
        return v.isoformat()
    return _orjson.Fragment(_encode(v))  # the standard library's own text of the value, byte for byte


if _orjson is not None:
    _dumps = _orjson.dumps
    _OPT_NAIVE = _orjson.OPT_PASSTHROUGH_SUBCLASS | _orjson.OPT_PASSTHROUGH_DATACLASS
    _OPT = _OPT_NAIVE | _orjson.OPT_PASSTHROUGH_DATETIME
    _NL = _orjson.OPT_APPEND_NEWLINE
    _FAST_ERRORS = (TypeError, ValueError, OverflowError)


def _small_float(values) -> bool:
    """Whether a column holds a float orjson writes otherwise than repr: nonzero and below 1e-4 in magnitude
    (None and zeros are skipped by filter; NaN compares false and is refused too)."""
    floats = [v for v in values if type(v) is float]
    m = min(map(abs, filter(None, floats)), default=1.0)
    return not m >= 1e-4


def _fast_option(columns, rows):
    """orjson's options for this result when its bytes are the standard library's, else None."""
    if _orjson is None or not rows:
        return None
    width = len(columns)
    if len(rows[0]) != width:
        return None
    # Rows of other widths after the first: with typed columns only, the callers build the row objects with
    # row_dicts() (whose compiled maker refuses a row of another length and falls back to dict(zip())) or the
    # template below (whose argument count refuses it); so the rows are not measured here (45 us at 1,000 rows).
    types = getattr(columns, "types", None)
    if types is None or len(types) != width:
        types = (None,) * width
    elif _FAST_TYPES.issuperset(types):  # no column to scan: the loop below would find nothing
        return _OPT if _f.TIMESTAMPTZ in types or _f.TIME in types else _OPT_NAIVE
    if len(set(map(len, rows))) > 1:
        return None
    seen: set = set()
    for i, ty in enumerate(types):
        if ty not in _FAST_TYPES:
            col = set(map(type, map(itemgetter(i), rows)))
            if float in col and _small_float(map(itemgetter(i), rows)):
                return None
            seen |= col
    if not seen <= _FAST_VALUES:
        return None
    if _dt.datetime in seen or _dt.time in seen or _f.TIMESTAMPTZ in types or _f.TIME in types:
        return _OPT  # a datetime that may be aware, or a time: isoformat() through _orjson_default
    return _OPT_NAIVE  # naive datetimes and dates: orjson's own text is isoformat()'s


def row_objects(columns: list[str], rows: Iterable[tuple]):
    for r in rows:
        yield dict(zip(columns, r))


_MAKERS: dict[tuple[str, ...], object] = {}
_MAKERS_MAX = 512
_MAKER_COLUMNS_MAX = 64


def _objects_maker(columns: tuple[str, ...]):
    """A function rows -> the list of row objects `[dict(zip(columns, r)) for r in rows]` would build, compiled
    for these columns as one comprehension that unpacks each row into a dict display: 0.21 against 0.69 us a row
    for four columns (bench/results/2026-12-06-session/notes.md). The generated text holds only positional names
    (k0.., v0..): the column names are the function's default values, never source text. The same dict as
    dict(zip()): a repeated name keeps its first place and its last value. A row of another length raises
    ValueError (the caller falls back to dict(zip()), which would have cut it)."""
    n = len(columns)
    names = {f"k{i}": c for i, c in enumerate(columns)}
    src = ("lambda rows, " + "".join(f"k{i}=k{i}, " for i in range(n)) + ": [{"
           + ", ".join(f"k{i}: v{i}" for i in range(n)) + "} for (" + "".join(f"v{i}, " for i in range(n))
           + ") in rows]")
    return eval(src, {"__builtins__": {}}, names)  # noqa: S307 - positional names only, see above


def row_dicts(columns: list[str], rows: list) -> list[dict]:
    """[dict(zip(columns, r)) for r in rows], built by a comprehension compiled once per column list."""
    key = tuple(columns)
    make = _MAKERS.get(key)
    if make is None:
        if not 0 < len(key) <= _MAKER_COLUMNS_MAX:
            return list(map(dict, map(zip, repeat(columns), rows)))
        if len(_MAKERS) >= _MAKERS_MAX:
            _MAKERS.clear()
        make = _MAKERS[key] = _objects_maker(key)
    try:
        return make(rows)
    except (ValueError, TypeError):  # a row of another length than the columns: dict(zip()) as before
        return list(map(dict, map(zip, repeat(columns), rows)))


# -- the template path: whole JSON pages of typed columns whose values' text holds no "," "[" "]" or space -------
# orjson writes the rows as arrays (`[[1,2],[3,4]]`, 34 us for 1,000 rows of four integers, where building the
# row objects alone costs 180 us); the values' texts are cut out at the commas and set into a template made of
# the column names: `[{"a":%b,"b":%b},{"a":%b,"b":%b}]`. The bytes are the row objects' (the same orjson text of
# each value, in the same order). It is taken only when every column's type is one whose JSON text cannot hold
# a comma, bracket or space (integers, booleans, decimals, dates, timestamps: null, true, false, digits, signs,
# points, "E", and ISO text) and the names are distinct (a dict keeps one of a repeated name). Whatever the
# values are, a text with a separator in it makes more pieces than the template has places (TypeError: the
# row objects' path then runs). The row boundaries are counted too, but that alone does not catch rows of unequal
# widths whose values add up to the same count (a 3-wide row and a 5-wide one under 4 names): what keeps them out
# is that column types come only from a driver's description (qag/formats.py pg_columns, mysql_columns; masking
# keeps its results' rows as wide as their names, qag/http/data.py govern), and a driver's rows all have the
# description's width. Rows of any other origin carry no types and never take this path.
_TEMPLATE_TYPES = frozenset((_f.INT, _f.BOOL, _f.DECIMAL, _f.DATE, _f.TIMESTAMP, _f.TIMESTAMPTZ))
_TEMPLATE_MIN_ROWS = 16  # below this the row objects' path costs as little (measured: even at 16 rows)
_ROW_TEMPLATES: dict[tuple[str, ...], bytes | None] = {}
_PAGE_TEMPLATES: dict[tuple[bytes, int, bool], bytes] = {}


def _row_template(columns) -> bytes | None:
    key = tuple(columns)
    t = _ROW_TEMPLATES.get(key, False)
    if t is False:
        types = getattr(columns, "types", None)
        ok = (types is not None and len(types) == len(key) and 0 < len(key) <= _MAKER_COLUMNS_MAX
              and _TEMPLATE_TYPES.issuperset(types) and len(set(key)) == len(key))
        # a name's own "%" is doubled: the template's only placeholders are the values'
        t = (b"{" + b",".join(_orjson.dumps(c).replace(b"%", b"%%") + b":%b" for c in key) + b"}") if ok else None
        if len(_ROW_TEMPLATES) >= _MAKERS_MAX:
            _ROW_TEMPLATES.clear()
        _ROW_TEMPLATES[key] = t
    return t


def _templated(columns, rows, opt, lines: bool = False) -> bytes | None:
    """The JSON page (or, `lines`, the NDJSON lines) by the template, or None (then the row objects' path)."""
    row_t = _row_template(columns)
    if row_t is None:
        return None
    n = len(rows)
    body = _dumps(rows, _orjson_default, opt)
    if body[:2] != b"[[" or body[-2:] != b"]]" or b" " in body or body.count(b"],[") != n - 1:
        return None
    page = _PAGE_TEMPLATES.get((row_t, n, lines))
    if page is None:
        page = b"".join(repeat(row_t + b"\n", n)) if lines else b"[" + b",".join(repeat(row_t, n)) + b"]"
        if len(_PAGE_TEMPLATES) >= 64:
            _PAGE_TEMPLATES.clear()
        _PAGE_TEMPLATES[(row_t, n, lines)] = page
    try:
        return page % tuple(body[2:-2].replace(b"],[", b",").split(b","))
    except TypeError:  # more or fewer pieces than places: a value's text held a separator, or a row's width
        return None


def render_json(columns: list[str], rows: list[tuple]) -> bytes:
    opt = _fast_option(columns, rows)
    if opt is not None:
        try:
            if len(rows) >= _TEMPLATE_MIN_ROWS:
                out = _templated(columns, rows, opt)
                if out is not None:
                    return out
            return _dumps(row_dicts(columns, rows), _orjson_default, opt)
        except _FAST_ERRORS:
            pass
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
    opt = _fast_option(columns, rows)
    if opt is not None:
        if len(rows) >= _TEMPLATE_MIN_ROWS:
            try:
                out = _templated(columns, rows, opt, lines=True)
            except _FAST_ERRORS:
                out = None
            if out is not None:
                return out
        opt |= _NL
        try:
            # one line at a time into one buffer: a list of 1,000 orjson results held at once cost 8 us a row
            # (each result's allocation is fresh memory), written and dropped one by one 0.2 us
            buf = io.BytesIO()
            write = buf.write
            for d in row_dicts(columns, rows):
                write(_dumps(d, _orjson_default, opt))
            return buf.getvalue()
        except _FAST_ERRORS:
            pass
    return b"".join([_line(columns, r) for r in rows])


# Values the csv module writes as _csv_value would have them written (str as is, int via str, float via repr,
# None as an empty field): passed through untouched. Columns of INT or FLOAT type are not scanned.
_CSV_AS_IS = frozenset((str, int, float, type(None)))
_CSV_TYPES = frozenset((_f.INT, _f.FLOAT))


_DECIMAL = frozenset((decimal.Decimal,))
_ISO = frozenset((_dt.datetime, _dt.date, _dt.time))


def _csv_decimal(v):
    """_csv_value of a Decimal or None, without its chain of type tests."""
    if v is None:
        return ""
    s = str(v)  # format(v, "f") unless it has an exponent (1E+3; only a finite one has); NaN kept as it is
    return s if "E" not in s else format(v, "f")


def _csv_iso(v):
    """_csv_value of a datetime, date, time or None."""
    return "" if v is None else v.isoformat()


def _csv_rows(columns, rows):
    """The rows as the csv writer should get them: untouched where every value is written as is, else only the
    columns that need _csv_value converted (the rest of the row is not touched: 1.0 against 0.34 us a row for
    four integer columns)."""
    if not rows:
        return rows
    width = len(columns)
    if len(set(map(len, rows))) > 1 or len(rows[0]) != width:
        return [[_csv_value(v) for v in r] for r in rows]
    types = getattr(columns, "types", None)
    if types is None or len(types) != width:
        types = (None,) * width
    convert = {}
    for i, ty in enumerate(types):
        if ty in _CSV_TYPES:
            continue
        kinds = set(map(type, map(itemgetter(i), rows)))
        if not kinds <= _CSV_AS_IS:
            kinds.discard(type(None))
            convert[i] = _csv_decimal if kinds <= _DECIMAL else _csv_iso if kinds <= _ISO else _csv_value
    if not convert:
        return rows
    cols = list(zip(*rows))
    for i, fn in convert.items():
        cols[i] = map(fn, cols[i])
    return zip(*cols)


def render_csv(columns: list[str], rows: list[tuple], delimiter: str = ",") -> bytes:
    buf = io.StringIO()
    w = csv.writer(buf, delimiter=delimiter, lineterminator="\r\n")
    w.writerow(columns)
    w.writerows(_csv_rows(columns, rows))
    return buf.getvalue().encode("utf-8")


def render_tsv(columns, rows) -> bytes:
    return render_csv(columns, rows, delimiter="\t")


RENDERERS = {"json": render_json, "ndjson": render_ndjson, "csv": render_csv, "tsv": render_tsv}


def stream_ndjson(columns: list[str], batches: Iterator[list[tuple]]) -> Iterator[bytes]:
    for batch in batches:
        if batch:
            yield render_ndjson(columns, batch)


def stream_csv(columns: list[str], batches: Iterator[list[tuple]], delimiter: str = ",") -> Iterator[bytes]:
    buf = io.StringIO()
    w = csv.writer(buf, delimiter=delimiter, lineterminator="\r\n")
    w.writerow(columns)
    yield buf.getvalue().encode("utf-8")
    for batch in batches:
        buf.seek(0)
        buf.truncate()
        w.writerows(_csv_rows(columns, batch))
        if batch:
            yield buf.getvalue().encode("utf-8")


def stream_tsv(columns, batches) -> Iterator[bytes]:
    return stream_csv(columns, batches, delimiter="\t")


STREAMERS = {"ndjson": stream_ndjson, "csv": stream_csv, "tsv": stream_tsv}


def _more_formats() -> None:
    from qag import formats
    FORMATS.update(formats.CONTENT_TYPES)
    RENDERERS.update(formats.RENDERERS)
    STREAMERS.update(formats.STREAMERS)


_more_formats()
