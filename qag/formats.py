"""The formats beyond JSON, NDJSON, CSV and TSV (qag/render.py): XML, YAML, XLSX and Parquet, and the column types
they need.

XML is the standard library's; YAML (PyYAML), XLSX (openpyxl) and Parquet (pyarrow) are the optional
extra `formats` (`pip install 'qag[formats]'`): a format whose library is missing is 501 `format_unavailable`
naming the extra, never a 500. Values keep qag's normative text (qag/values.py) wherever a format carries text;
XLSX and Parquet keep the value's own type: Parquet's schema comes from the cursor's column types
(`Columns.types`), not from the values, except where the driver reports none (SQLite) or a value no longer has
its column's type (a masked column is text). A decimal column is `decimal128(p, s)` from the cursor's precision
and scale when p <= 38, else (unconstrained `numeric`, p > 38) its exact text; a row group whose values do not
fit the schema ends the answer in an error, never in nulls.
"""
from __future__ import annotations

import datetime as _dt
import decimal
import io
import json
import re
from collections.abc import Iterator

from qag.errors import ApiError
from qag.values import csv_value, decimal_text, json_value

EXTRA = "formats"

# The neutral type names a connector reports per result column (None: the driver does not say).
BOOL, INT, FLOAT, DECIMAL, TEXT, DATE, TIME, TIMESTAMP, TIMESTAMPTZ, BYTES, JSON, UUID = (
    "bool", "int", "float", "decimal", "text", "date", "time", "timestamp", "timestamptz", "bytes", "json", "uuid")


class DecimalType(str):
    """The DECIMAL column type with the cursor's precision and scale: equal to (and hashed as) DECIMAL, so every
    reader that only asks "is it a decimal?" sees the plain name. precision None: not declared (PostgreSQL's
    unconstrained numeric)."""

    def __new__(cls, precision, scale):
        t = super().__new__(cls, DECIMAL)
        t.precision, t.scale = precision, scale
        return t

    def __repr__(self):
        return f"DecimalType({self.precision}, {self.scale})"


class Columns(list):
    """A result's column names (a plain list to every reader) that also carries each column's neutral type."""

    __slots__ = ("types",)

    def __init__(self, names, types):
        super().__init__(names)
        self.types = list(types)


# PostgreSQL type OIDs (pg_type.oid of the built-in types, stable across versions).
_PG = {16: BOOL, 20: INT, 21: INT, 23: INT, 26: INT, 700: FLOAT, 701: FLOAT, 1700: DECIMAL, 25: TEXT, 1043: TEXT,
       1042: TEXT, 18: TEXT, 19: TEXT, 1082: DATE, 1083: TIME, 1266: TIME, 1114: TIMESTAMP, 1184: TIMESTAMPTZ,
       17: BYTES, 114: JSON, 3802: JSON, 2950: UUID}

# MySQL/MariaDB protocol field types (mysql.connector.constants.FieldType).
_MY = {1: INT, 2: INT, 3: INT, 8: INT, 9: INT, 13: INT, 16: INT, 4: FLOAT, 5: FLOAT, 0: DECIMAL, 246: DECIMAL,
       10: DATE, 14: DATE, 11: TIME, 7: TIMESTAMP, 12: TIMESTAMP, 245: JSON, 15: TEXT, 253: TEXT, 254: TEXT,
       247: TEXT, 248: TEXT}


def _decimal(precision, scale):
    """A DECIMAL column's type from the description's precision and scale (None or out of range: undeclared;
    psycopg2 says 65535 for PostgreSQL's unconstrained numeric)."""
    if isinstance(precision, int) and isinstance(scale, int) and 0 < precision <= 1000 and 0 <= scale <= precision:
        return DecimalType(precision, scale)
    return DecimalType(None, None)


_PG_SEEN: dict = {}  # a description's fields -> (names, types): a saved query's result has the same every call
_PG_SEEN_MAX = 1024


def pg_columns(description) -> Columns:
    key = tuple(map(tuple, description))  # every field of every column, so the same key is the same answer
    seen = _PG_SEEN.get(key)
    if seen is None:
        seen = ([d[0] for d in description],
                [_decimal(d[4], d[5]) if d[1] == 1700 else _PG.get(d[1]) for d in description])
        if len(_PG_SEEN) >= _PG_SEEN_MAX:
            _PG_SEEN.clear()
        _PG_SEEN[key] = seen
    return Columns(*seen)  # fresh lists each call: a reader may keep or change its own


def mysql_columns(description) -> Columns:
    # BLOB and STRING types carry text or bytes by their charset: left to the value (None). DECIMAL's precision
    # and scale are in the description where qag's column parser put them (qag/connectors.py, mysql_parse_column).
    return Columns([d[0] for d in description],
                   [_decimal(d[4], d[5]) if _MY.get(d[1]) == DECIMAL else _MY.get(d[1]) for d in description])


def types_after_masking(cols, transforms) -> list | None:
    """The column types of a masked result: a hashed or masked column is text, a dropped one is gone."""
    types = getattr(cols, "types", None)
    if types is None:
        return None
    if transforms is None:
        return list(types)
    out = []
    for i, t in enumerate(transforms):
        if t == "drop":
            continue
        ty = types[i] if i < len(types) else None
        out.append(TEXT if t in ("hash", "mask") else ty)
    return out


def _need(module: str, fmt: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise ApiError(501, "format_unavailable", f"format={fmt} needs the optional extra '{EXTRA}' on the server "
                       f"(pip install 'qag[{EXTRA}]'); ask an administrator, or use json, ndjson or csv.") from None


OPTIONAL = {"yaml": "yaml", "xlsx": "openpyxl", "parquet": "pyarrow.parquet"}  # format -> its optional library


def available(fmt: str) -> None:
    """Raise 501 format_unavailable before anything runs when fmt's library is missing."""
    mod = OPTIONAL.get(fmt)
    if mod is not None:
        _need(mod, fmt)


# -- text forms ----------------------------------------------------------------------------------------------
def _plain(v):
    """A value as the JSON renderer writes it, as a Python value (str, int, float, bool, None, list, dict; a Decimal
    stays one, for YAML's representer below)."""
    if v is None or isinstance(v, (bool, int, float, str, decimal.Decimal)):
        return v
    if isinstance(v, (list, dict)):
        return v
    return json_value(v)


def _text(v) -> str:
    t = csv_value(v)
    return t if isinstance(t, str) else repr(t) if isinstance(t, float) else str(t)


# -- XML -----------------------------------------------------------------------------------------------------
_XML_BAD = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_NAME_BAD = re.compile(r"[^\w.\-]")
_XML_CR = {"\r": "&#13;"}


def _xml_tag(name: str) -> str:
    tag = _NAME_BAD.sub("_", str(name)) or "_"
    if not re.match(r"[^\W\d]", tag) or tag.lower().startswith("xml"):  # a letter (any script) or '_' first
        tag = "_" + tag
    return tag


def _xml_text(v) -> str:
    from xml.sax.saxutils import escape
    # a CR is written as &#13;: a parser turns a literal CR (and CR LF) into LF, so the text would not read back
    return escape(_XML_BAD.sub("\ufffd", _text(v)), _XML_CR)


def render_xml(columns, rows) -> bytes:
    """`<data><item><col>text</col>…</item>…</data>` (QueryAPIGate's shape); a NULL is an element with `null="true"`."""
    tags = [_xml_tag(c) for c in columns]
    out = ['<?xml version="1.0" encoding="UTF-8"?>\n<data>']
    for r in rows:
        out.append("<item>")
        for tag, v in zip(tags, r):
            if v is None:
                out.append(f'<{tag} null="true"/>')
            else:
                out.append(f"<{tag}>{_xml_text(v)}</{tag}>")
        out.append("</item>")
    out.append("</data>\n")
    return "".join(out).encode("utf-8")


# -- YAML ----------------------------------------------------------------------------------------------------
_yaml_dumper = None


def _dumper(yaml):
    """PyYAML's SafeDumper that writes a Decimal as a plain number of its exact digits (decimal_text: 12.50, an int
    when it has no point), NaN and infinities as null, as JSON does; a float stays PyYAML's."""
    global _yaml_dumper
    if _yaml_dumper is None:
        class Dumper(yaml.SafeDumper):
            pass

        def decimal_node(dumper, v):
            if not v.is_finite():
                return dumper.represent_none(None)
            text = decimal_text(v)
            return dumper.represent_scalar("tag:yaml.org,2002:float" if "." in text else "tag:yaml.org,2002:int", text)
        Dumper.add_representer(decimal.Decimal, decimal_node)
        _yaml_dumper = Dumper
    return _yaml_dumper


def render_yaml(columns, rows) -> bytes:
    yaml = _need("yaml", "yaml")
    docs = [dict(zip(columns, (_plain(v) for v in r))) for r in rows]
    return yaml.dump(docs, Dumper=_dumper(yaml), default_flow_style=False, sort_keys=False,
                     allow_unicode=True).encode("utf-8")


# -- XLSX ----------------------------------------------------------------------------------------------------
def _xlsx_value(v):
    from openpyxl.cell.cell import ILLEGAL_CHARACTERS_RE
    if v is None or isinstance(v, (bool, int, float)):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 2 ** 53:
            return str(v)  # Excel keeps 15 significant digits: a bigger integer is kept exactly as text
        return v
    if isinstance(v, decimal.Decimal):
        # a spreadsheet number is a double shown to 15 significant digits: a number when that keeps the value's
        # digits (12.50 -> 12.5), else its exact text, as a number too wide for a double (NaN: empty)
        if not v.is_finite():
            return None
        f = float(v)
        return f if abs(f) < 1e15 and len(v.normalize().as_tuple().digits) <= 15 else decimal_text(v)
    if isinstance(v, _dt.datetime):
        if v.tzinfo is not None:
            v = v.astimezone(_dt.UTC).replace(tzinfo=None)  # Excel has no time zones: UTC, said in docs
        return v
    if isinstance(v, (_dt.date, _dt.time)):
        return v.replace(tzinfo=None) if isinstance(v, _dt.time) else v
    t = _text(v)
    return ILLEGAL_CHARACTERS_RE.sub("", t)


def _xlsx_text(ws, v):
    """A text cell that stays text: openpyxl makes any string starting with '=' a formula (`<f>`), so a value
    such as =HYPERLINK(...) or =cmd|' /C calc'!A1 from the database would run in the reader's spreadsheet."""
    if isinstance(v, str) and v.startswith("="):
        from openpyxl.cell import WriteOnlyCell
        cell = WriteOnlyCell(ws, value=v)
        cell.data_type = "s"
        return cell
    return v


def render_xlsx(columns, rows) -> bytes:
    openpyxl = _need("openpyxl", "xlsx")
    wb = openpyxl.Workbook(write_only=True)
    ws = wb.create_sheet("result")
    ws.append([_xlsx_text(ws, _xlsx_value(str(c))) for c in columns])
    for r in rows:
        ws.append([_xlsx_text(ws, _xlsx_value(v)) for v in r])
    buf = io.BytesIO()
    wb.save(buf)
    return buf.getvalue()


# -- Parquet -------------------------------------------------------------------------------------------------
ROW_GROUP_ROWS = 8192


def _arrow_type(pa, ty):
    if ty == DECIMAL:
        p = getattr(ty, "precision", None)
        # decimal128 holds 38 digits; a wider or undeclared decimal is its exact text (decimal256 is read by
        # too few readers, and an undeclared scale cannot be fixed before the rows are seen)
        return pa.decimal128(p, ty.scale) if p is not None and p <= 38 else pa.string()
    return {BOOL: pa.bool_(), INT: pa.int64(), FLOAT: pa.float64(), TEXT: pa.string(), DATE: pa.date32(),
            TIME: pa.time64("us"), TIMESTAMP: pa.timestamp("us"), TIMESTAMPTZ: pa.timestamp("us", tz="UTC"),
            BYTES: pa.binary(), JSON: pa.string(), UUID: pa.string()}.get(ty)


def _arrow_values(ty, values):
    if ty == DECIMAL:
        # NaN and ±Infinity (PostgreSQL numeric) have no decimal128 value: null, as JSON writes them
        return [v if v is None or not isinstance(v, decimal.Decimal) or v.is_finite() else None for v in values]
    if ty in (JSON,):
        return [None if v is None else v if isinstance(v, str) else json.dumps(_plain(v), ensure_ascii=False,
                                                                              separators=(",", ":"))
                for v in values]
    if ty in (UUID, TEXT):
        return [None if v is None else v if isinstance(v, str) else _text(v) for v in values]
    if ty == TIME:
        return [v.replace(tzinfo=None) if isinstance(v, _dt.time) else v for v in values]
    if ty == BYTES:
        return [bytes(v) if isinstance(v, (bytearray, memoryview)) else v for v in values]
    return values


_ARROW_ERRORS = (ValueError, TypeError, OverflowError, ArithmeticError)  # pa.ArrowInvalid is a ValueError


def _unfit(name, at, exc) -> ApiError:
    # the contract has no code of its own for it: an internal error, whose text says what to do
    return ApiError(500, "internal_error", f"column {name!r} holds a value Parquet's {at} cannot keep "
                    f"({str(exc).splitlines()[0][:200]}); ask for format=json or csv, which keep every value.")


def _column(pa, ty, values, name, stream=False):
    """One Arrow column: the declared type (a decimal that does not fit it is an error, never a null or a guess;
    another value, e.g. MySQL's BIGINT UNSIGNED past int64, takes its own type or text); where the driver declares
    none, the values' own type, else text (in a stream, an all-NULL first group of such a column is text: a later
    group must fit the type the first one fixed)."""
    at = _arrow_type(pa, ty)
    if at is not None:
        vals = _arrow_values(ty, values)
        if pa.types.is_string(at) and ty == DECIMAL:
            vals = [None if v is None else decimal_text(v) if isinstance(v, decimal.Decimal) else _text(v)
                    for v in vals]
        try:
            return pa.array(vals, type=at)
        except _ARROW_ERRORS as exc:
            if ty == DECIMAL:
                raise _unfit(name, at, exc) from None
    try:
        arr = pa.array(values)
        if not pa.types.is_null(arr.type) or (ty is None and not stream):
            return arr
    except _ARROW_ERRORS:
        pass
    return pa.array([None if v is None else _text(v) for v in values], type=pa.string())


def _names(columns) -> list[str]:
    # Unique field names: Parquet readers key columns by name (SELECT a.id, b.id).
    seen: dict[str, int] = {}
    out = []
    for n in (str(c) for c in columns):
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}_{seen[n]}")
    return out


def _table(pa, columns, rows, types, schema=None, stream=False):
    """One row group as an Arrow table: in the given schema (a stream's later groups), else in the one the
    cursor's types (and, where it gives none, this group's values) make."""
    cols = list(zip(*rows)) if rows else [() for _ in columns]
    if schema is not None:
        arrays = []
        for i, f in enumerate(schema):
            ty = types[i] if types and i < len(types) else None
            vals = list(cols[i])
            if pa.types.is_string(f.type):  # a declared text column, or one the first group made text
                arrays.append(_column(pa, ty if ty is not None and _arrow_type(pa, ty) == f.type else TEXT,
                                      vals, f.name))
                continue
            try:
                arrays.append(pa.array(_arrow_values(ty, vals), type=f.type))
            except _ARROW_ERRORS as exc:
                raise _unfit(f.name, f.type, exc) from None
        return pa.Table.from_arrays(arrays, schema=schema)
    names = _names(columns)
    arrays = [_column(pa, types[i] if types and i < len(types) else None, list(cols[i]), names[i], stream)
              for i in range(len(names))]
    return pa.Table.from_arrays(arrays, schema=pa.schema([pa.field(n, a.type) for n, a in zip(names, arrays)]))


def render_parquet(columns, rows, types=None) -> bytes:
    pq = _need("pyarrow.parquet", "parquet")
    types = types if types is not None else getattr(columns, "types", None)
    import pyarrow as pa
    buf = io.BytesIO()
    pq.write_table(_table(pa, columns, rows, types), buf)
    return buf.getvalue()


class _Sink(io.RawIOBase):
    """A write-only file for ParquetWriter whose bytes are taken out after each row group."""

    def __init__(self):
        self.parts: list[bytes] = []
        self.pos = 0

    def writable(self):
        return True

    def write(self, b):
        self.parts.append(bytes(b))
        self.pos += len(b)
        return len(b)

    def tell(self):
        return self.pos

    def take(self) -> bytes:
        out = b"".join(self.parts)
        self.parts.clear()
        return out


def stream_parquet(columns, batches, types=None) -> Iterator[bytes]:
    """Row groups of up to ROW_GROUP_ROWS rows as the cursor delivers them: memory stays one group's worth.
    The schema is the cursor's types (where the driver declares none, fixed by the first group); a later group
    that does not fit it ends the stream (the body is cut short, the run recorded stream_aborted), never nulls."""
    pq = _need("pyarrow.parquet", "parquet")
    types = types if types is not None else getattr(columns, "types", None)
    import pyarrow as pa
    sink = _Sink()
    writer = None
    pending: list = []

    def flush():
        nonlocal writer
        t = _table(pa, columns, pending, types, writer.schema if writer is not None else None, stream=True)
        if writer is None:
            writer = pq.ParquetWriter(sink, t.schema)
        writer.write_table(t)
        pending.clear()

    for batch in batches:
        pending.extend(batch)
        if len(pending) >= ROW_GROUP_ROWS:
            flush()
            chunk = sink.take()
            if chunk:
                yield chunk
    if pending or writer is None:
        flush()
    writer.close()
    chunk = sink.take()
    if chunk:
        yield chunk


CONTENT_TYPES = {"xml": "application/xml; charset=utf-8",
                 "yaml": "application/yaml; charset=utf-8",
                 "xlsx": "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
                 "parquet": "application/vnd.apache.parquet"}
RENDERERS = {"xml": render_xml, "yaml": render_yaml, "xlsx": render_xlsx,
             "parquet": render_parquet}
STREAMERS = {"parquet": stream_parquet}
TYPED = frozenset(("parquet",))  # renderers that take the column types
# Answers a browser should save rather than show: files by nature, and every stream.
DOWNLOADS = frozenset(("csv", "tsv", "xlsx", "parquet"))


def disposition(query: str, fmt: str) -> str:
    safe = re.sub(r'[^A-Za-z0-9._-]', "_", query) or "result"
    return f'attachment; filename="{safe}.{fmt}"'

