"""Parameters: `:name` markers found in SQL text, typed specs and their rules, and the values of one call.

Markers inside string literals, quoted identifiers, comments and PostgreSQL `::` casts are not
parameters. The driver binds every value; nothing a caller sends is ever spliced into SQL text.
"""
from __future__ import annotations

import functools
import math
import re
from typing import Any

from qag.errors import ApiError
from qag.governance.lexers import LexError, mysql_read, mysql_tokens, quoted_end, sqlite_tokens

try:
    from pglast.parser import scan as pg_scan
except ImportError:  # pragma: no cover - pglast is a base dependency
    pg_scan = None

INT_MIN, INT_MAX = -(2 ** 63), 2 ** 63 - 1
TYPES = {"int": "int", "integer": "int", "float": "float", "number": "float", "str": "str", "string": "str",
         "bool": "bool", "boolean": "bool"}
RULES = ("type", "required", "default", "enum", "min", "max", "min_length", "max_length", "pattern", "description",
         "from_claim")
RESERVED = frozenset(("format", "page", "page_size", "version", "timeout", "stream", "connection_name"))
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_IDENT_START = re.compile(r"[A-Za-z_]")
# A number's text, as a query string gives it: ASCII digits only (no Unicode digits, no '_' separators, no
# surrounding spaces, no hex), so one value has one reading whatever reads it.
_INT_RE = re.compile(r"[+-]?[0-9]+")
FLOAT_RE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
INT_RE = _INT_RE
_NOT_FINITE = frozenset(("nan", "+nan", "-nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"))
TRUE_TEXT = frozenset(("true", "1", "yes"))
FALSE_TEXT = frozenset(("false", "0", "no"))


def scan_markers(sql: str, dialect: str = "postgres") -> list[tuple[int, int, str]]:
    """Every `:name` marker as (start, end, name), found with the database's own lexical rules: PostgreSQL's
    scanner itself (libpg_query through pglast), and MySQL/MariaDB's and SQLite's rules written out below.
    Text a server could read in more than one way (a MySQL string under either setting of
    NO_BACKSLASH_ESCAPES, a PostgreSQL literal under standard_conforming_strings off, an executable
    comment) or whose markers the server would read otherwise is refused: 400 invalid_sql."""
    return list(_markers_cached(sql, dialect))


class Unreadable(ApiError):
    """400 invalid_sql: the text cannot be read exactly as the database reads it."""

    def __init__(self, dialect: str, why: str):
        super().__init__(400, "invalid_sql", f"qag cannot read this {_DIALECT_NAMES.get(dialect, dialect)} statement "
                         f"exactly as the database would: {why}")


_DIALECT_NAMES = {"postgres": "PostgreSQL", "mysql": "MySQL/MariaDB", "sqlite": "SQLite", "clickhouse": "ClickHouse"}


@functools.lru_cache(maxsize=4096)
def _markers_cached(sql: str, dialect: str) -> tuple[tuple[int, int, str], ...]:
    if not isinstance(sql, str):
        raise Unreadable(dialect, "the statement is not text")
    if "\x00" in sql:
        raise Unreadable(dialect, "it contains a NUL character")
    if dialect == "postgres":
        return _pg_markers(sql)
    if dialect == "mysql":
        return _mysql_markers(sql)
    if dialect == "sqlite":
        return _sqlite_markers(sql)
    if dialect == "clickhouse":
        return _clickhouse_markers(sql)
    return tuple(_generic_markers(sql, dialect))


def _marker_at(sql: str, colon: int, word_end: int, dialect: str):
    """The marker for a ':' at `colon` followed by a name token ending at word_end (exclusive), None when
    the text there is not a marker. A name the server reads longer than a marker name is refused."""
    prev = sql[colon - 1] if colon > 0 else " "
    if prev.isalnum() or prev == "_":
        return None
    word = sql[colon + 1:word_end]
    m = NAME_RE.match(word)
    if m is None:
        return None
    if m.end() != len(word):
        raise Unreadable(dialect, f"the server reads {sql[colon:word_end]!r} as one name, which is not a "
                                  "parameter marker :name (letters, digits, _)")
    return (colon, word_end, word)


# ---- PostgreSQL: its own scanner ----------------------------------------------------------------------
def _pg_markers(sql: str) -> tuple[tuple[int, int, str], ...]:
    try:
        tokens = pg_scan(sql)
    except Exception as exc:  # noqa: BLE001 - pglast's ParseError or anything the scanner raises: a refusal
        raise Unreadable("postgres", str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__) from None
    out = []
    for k, t in enumerate(tokens):
        name = t.name
        if name == "PARAM":
            raise Unreadable("postgres", f"{sql[t.start:t.end + 1]} is a positional parameter; name parameters "
                                         "as :name")
        # With standard_conforming_strings off the server reads a backslash in '...' as an escape.
        if name == "SCONST" and sql[t.start] == "'" and "\\" in sql[t.start:t.end + 1] and \
                quoted_end(sql, t.start, "'", True) != t.end + 1:
            raise Unreadable("postgres", f"the literal at character {t.start + 1} ends elsewhere when "
                                         "standard_conforming_strings is off; write it as an E'...' string")
        if name == "ASCII_58" and k + 1 < len(tokens) and tokens[k + 1].start == t.end + 1:
            m = _marker_at(sql, t.start, tokens[k + 1].end + 1, "postgres")
            if m is not None:
                out.append(m)
    return tuple(out)


def _mysql_markers(sql: str) -> tuple[tuple[int, int, str], ...]:
    try:
        tokens = mysql_read(sql)
    except LexError as exc:
        raise Unreadable("mysql", exc.why) from None
    return _markers_from(sql, tokens, "mysql")


def _markers_from(sql, tokens, dialect):
    out = []
    for k, (kind, a, b) in enumerate(tokens):
        if kind == "colon" and k + 1 < len(tokens) and tokens[k + 1][0] == "word" and tokens[k + 1][1] == b:
            m = _marker_at(sql, a, tokens[k + 1][2], dialect)
            if m is not None:
                out.append(m)
    return tuple(out)


# ---- SQLite ---------------------------------------------------------------------------------------------
def _sqlite_markers(sql: str) -> tuple[tuple[int, int, str], ...]:
    try:
        tokens = sqlite_tokens(sql)
    except LexError as exc:
        raise Unreadable("sqlite", exc.why) from None
    for kind, a, b in tokens:
        if kind == "var":
            raise Unreadable("sqlite", f"SQLite reads {sql[a:b]!r} as a parameter; name parameters as :name")
    markers = _markers_from(sql, tokens, "sqlite")
    if len(markers) != sum(1 for t in tokens if t[0] == "colon"):
        raise Unreadable("sqlite", "SQLite reads a :name right after a name or number as a parameter; put a "
                                   "space before the ':'")
    return markers


# ---- ClickHouse: its Lexer.cpp's rules -------------------------------------------------------------------
_CH_HEREDOC = re.compile(r"\$([A-Za-z0-9_]*)\$")


def _clickhouse_markers(sql: str) -> tuple[tuple[int, int, str], ...]:
    """ClickHouse's lexical rules: '...', "..." and `...` all take backslash escapes and doubled quotes;
    $tag$...$tag$ heredoc strings; -- and '# ' / '#!' comments to the end of the line; /* */ comments nest.
    A :name inside any of them is text (a value bound there would land inside a name or a string where its
    quotes could end it: SELECT 1 AS "x\\":q read secrets with q = '" , (SELECT ...) AS "t')."""
    out: list[tuple[int, int, str]] = []
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c in "'\"`":
            j = quoted_end(sql, i, c, True)
            if j < 0:
                raise Unreadable("clickhouse", f"the quoted text at character {i + 1} does not end")
            i = j
        elif c == "$" and (m := _CH_HEREDOC.match(sql, i)) is not None:
            j = sql.find(m.group(0), m.end())
            if j < 0:
                raise Unreadable("clickhouse", f"the heredoc string at character {i + 1} does not end")
            i = j + len(m.group(0))
        elif sql.startswith("--", i) or c == "#":
            j = sql.find("\n", i)
            i = n if j < 0 else j + 1
        elif sql.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if sql.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif sql.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
            if depth:
                raise Unreadable("clickhouse", "a /* comment does not end")
        elif c == ":":
            if sql.startswith("::", i):
                i += 2
                continue
            m = NAME_RE.match(sql, i + 1)
            prev = sql[i - 1] if i > 0 else " "
            if m and not (prev.isalnum() or prev == "_"):
                if m.end() < n and (sql[m.end()].isalnum() or sql[m.end()] in "_$"):
                    raise Unreadable("clickhouse", f"the server reads {sql[i:m.end() + 1]!r}... as one name, which is "
                                                   "not a parameter marker :name (letters, digits, _)")
                out.append((i, m.end(), m.group(0)))
                i = m.end()
            else:
                i += 1
        else:
            i += 1
    return tuple(out)


# ---- the fallback: quotes, comments, :: --------------------------------------------------------------
def _generic_markers(sql: str, dialect: str) -> list[tuple[int, int, str]]:
    out: list[tuple[int, int, str]] = []
    i, n = 0, len(sql)
    backslash = dialect in ("mysql", "clickhouse")
    while i < n:
        c = sql[i]
        if c == "'" or (c == '"' and dialect == "mysql"):
            i = _skip_quoted(sql, i, c, backslash)
        elif c == '"' or c == "`":
            i = _skip_quoted(sql, i, c, False)
        elif (c == "-" and sql.startswith("--", i)) or (c == "#" and dialect == "mysql"):
            j = sql.find("\n", i)
            i = n if j < 0 else j + 1
        elif c == "/" and sql.startswith("/*", i):
            j = sql.find("*/", i + 2)
            i = n if j < 0 else j + 2
        elif c == ":":
            if sql.startswith("::", i):
                i += 2
                continue
            m = NAME_RE.match(sql, i + 1)
            prev = sql[i - 1] if i > 0 else " "
            if m and not (prev.isalnum() or prev == "_"):
                out.append((i, m.end(), m.group(0)))
                i = m.end()
            else:
                i += 1
        else:
            i += 1
    return out


def _skip_quoted(sql: str, i: int, q: str, backslash: bool) -> int:
    n = len(sql)
    j = i + 1
    while j < n:
        c = sql[j]
        if backslash and c == "\\":
            j += 2
            continue
        if c == q:
            if j + 1 < n and sql[j + 1] == q:  # doubled quote escapes itself
                j += 2
                continue
            return j + 1
        j += 1
    return n


def compile_sql(sql: str, dialect: str) -> tuple[str, tuple[str, ...]]:
    """Driver-ready SQL with positional markers, and the parameter name bound at each position.

    What each driver does with the text decides its form (the connectors execute it with the tuple of
    values, empty when there are none): psycopg2 formats the text whenever it is given a tuple, so every
    literal % is doubled, markers or not; mysql-connector replaces each %s in order and nothing else
    (%% stays %%), so % is left alone and a %s outside a marker is split (% s, '..%' 's..') so that it is
    not taken for one; sqlite3 binds ? itself."""
    markers = scan_markers(sql, dialect)
    if dialect == "mysql":
        return _mysql_driver_sql(sql, markers), tuple(m[2] for m in markers)
    percent = dialect == "postgres" or (dialect == "clickhouse" and bool(markers))
    mark = "?" if dialect == "sqlite" else "%s"
    parts: list[str] = []
    names: list[str] = []
    pos = 0
    for start, end, name in markers:
        chunk = sql[pos:start]
        parts.append(chunk.replace("%", "%%") if percent else chunk)
        parts.append(mark)
        names.append(name)
        pos = end
    tail = sql[pos:]
    parts.append(tail.replace("%", "%%") if percent else tail)
    return "".join(parts), tuple(names)


def _mysql_driver_sql(sql: str, markers) -> str:
    if not markers:
        return sql          # no values: mysql-connector leaves the text alone
    at = {m[0]: m for m in markers}
    out = []
    pos = 0
    try:
        tokens = mysql_tokens(sql, True)
    except LexError as exc:
        raise Unreadable("mysql", exc.why) from None
    k = 0
    while k < len(tokens):
        kind, a, b = tokens[k]
        out.append(sql[pos:a])   # whitespace between tokens
        if a in at:
            out.append("%s")
            end = at[a][1]
            while k < len(tokens) and tokens[k][1] < end:
                k += 1
            pos = end
            continue
        text = sql[a:b]
        if "%s" in text:
            if kind in ("str", "dq"):
                q = text[0]
                text = text.replace("%s", "%" + q + " " + q + "s")   # adjacent literals concatenate
            elif kind == "ident":
                raise Unreadable("mysql", f"the name {text} holds %s, which the driver would take for a "
                                          "parameter")
            else:
                text = text.replace("%s", "% s")
        elif text == "%" and sql.startswith("s", b):
            text = "% "                                           # 7 %s1 (s1 a column): not a %s
        out.append(text)
        pos = b
        k += 1
    out.append(sql[pos:])
    return "".join(out)


def _around_markers(sql: str, dialect: str) -> tuple[list[str], tuple[str, ...]]:
    """The text around the markers (one more piece than markers) and the name at each marker."""
    pieces, names, pos = [], [], 0
    for start, end, name in scan_markers(sql, dialect):
        pieces.append(sql[pos:start])
        names.append(name)
        pos = end
    pieces.append(sql[pos:])
    return pieces, tuple(names)


def compile_native(sql: str, dialect: str) -> tuple[str, tuple[str, ...]]:
    """The statement with the database's own markers ($1..$n for PostgreSQL, ? elsewhere), one per
    occurrence, for the Rust plane's drivers (no % doubling: these drivers never format text)."""
    pieces, names = _around_markers(sql, dialect)
    out = [pieces[0]]
    for i, piece in enumerate(pieces[1:], 1):
        out += [f"${i}" if dialect == "postgres" else "?", piece]
    return "".join(out), names


def split_at_markers(sql: str, dialect: str) -> list[str]:
    """The text around the markers (one more piece than markers). With it the plane can put a value's literal
    where the Python driver would, as mysql-connector does with a float (its repr, a DECIMAL or DOUBLE literal
    to the server) while the other values stay bound."""
    return _around_markers(sql, dialect)[0]


def neutralize(sql: str, dialect: str) -> str:
    """The SQL with every marker replaced by NULL, for statement analysis."""
    return "NULL".join(split_at_markers(sql, dialect))


class ParamSpec:
    __slots__ = ("name", "type", "required", "default", "has_default", "enum", "min", "max", "min_length",
                 "max_length", "pattern", "_re", "_rules")

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"type": self.type, "required": self.required}
        if self.has_default:
            out["default"] = self.default
        for f in ("enum", "min", "max", "min_length", "max_length", "pattern"):
            v = getattr(self, f)
            if v is not None:
                out[f] = v
        return out


def normalize_specs(raw: Any, sql: str, dialect: str) -> dict[str, dict]:
    """Validate a query's declared parameters (saved form); raise 400 invalid_parameters with every problem."""
    errors: dict[str, str] = {}
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ApiError(400, "invalid_parameters", "parameters must be an object mapping names to a type or a spec")
    out: dict[str, dict] = {}
    for name, spec in raw.items():
        if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name in RESERVED:
            errors[str(name)] = ("is reserved" if name in RESERVED else
                                 "is not a valid parameter name (letters, digits, _; not starting with a digit)")
            continue
        if isinstance(spec, str):
            spec = {"type": spec}
        if not isinstance(spec, dict):
            errors[name] = "must be a type name or an object with a type"
            continue
        unknown = [k for k in spec if k not in RULES]
        if unknown:
            errors[name] = f"has unknown rules {', '.join(sorted(unknown))}; allowed: {', '.join(RULES)}"
            continue
        t = TYPES.get(str(spec.get("type", "str")).lower()) if isinstance(spec.get("type", "str"), str) else None
        if t is None:
            errors[name] = "type must be one of int, float, str, bool"
            continue
        norm: dict[str, Any] = {"type": t}
        problems = []
        if "required" in spec and not isinstance(spec["required"], bool):
            problems.append("required must be true or false")
        for f in ("min", "max"):
            if f in spec:
                if t not in ("int", "float") or isinstance(spec[f], bool) or not isinstance(spec[f], (int, float)):
                    problems.append(f"{f} applies to numbers and must be a number")
                else:
                    norm[f] = spec[f]
        for f in ("min_length", "max_length"):
            if f in spec:
                if t != "str" or isinstance(spec[f], bool) or not isinstance(spec[f], int) or spec[f] < 0:
                    problems.append(f"{f} applies to strings and must be a non-negative integer")
                else:
                    norm[f] = spec[f]
        if "pattern" in spec:
            if t != "str" or not isinstance(spec["pattern"], str):
                problems.append("pattern applies to strings and must be a regular expression")
            else:
                try:
                    re.compile(spec["pattern"])
                    norm["pattern"] = spec["pattern"]
                except re.error as exc:
                    problems.append(f"pattern is not a valid regular expression: {exc}")
        probe = _spec_from({"type": t, **{k: v for k, v in norm.items() if k != "type"}}, name)
        if "enum" in spec:
            if not isinstance(spec["enum"], list) or not spec["enum"]:
                problems.append("enum must be a non-empty list")
            else:
                vals = []
                for v in spec["enum"]:
                    try:
                        vals.append(_convert(probe, v))
                    except ValueError as exc:
                        problems.append(f"enum value {v!r} {exc}")
                norm["enum"] = vals
        if "default" in spec:
            if spec["default"] is None:
                norm["default"] = None
            else:
                try:
                    norm["default"] = _convert(probe, spec["default"])
                except ValueError as exc:
                    problems.append(f"default {exc}")
        norm["required"] = bool(spec.get("required", "default" not in spec))
        if "description" in spec:
            norm["description"] = str(spec["description"])
        if "from_claim" in spec:
            # bound from the signed-in caller's verified token (qag/identity.py), never from the call
            c = spec["from_claim"]
            if not isinstance(c, str) or not re.fullmatch(r"[A-Za-z0-9_:./-]{1,100}", c):
                problems.append("from_claim must name a claim of the token, e.g. sub")
            else:
                norm["from_claim"] = c
        if problems:
            errors[name] = "; ".join(problems)
        else:
            out[name] = norm
    if errors:
        raise ApiError(400, "invalid_parameters", "Some parameter declarations are invalid: " +
                       "; ".join(f"{k} {v}" for k, v in errors.items()), {"errors": errors})
    for _, _, name in scan_markers(sql, dialect):
        if name not in out:  # an undeclared marker is a required string
            out[name] = {"type": "str", "required": True}
    return out


def _spec_from(d: dict, name: str) -> ParamSpec:
    s = ParamSpec()
    s.name = name
    s.type = d["type"]
    s.required = d.get("required", True)
    s.has_default = "default" in d
    s.default = d.get("default")
    s.enum = d.get("enum")
    s.min = d.get("min")
    s.max = d.get("max")
    s.min_length = d.get("min_length")
    s.max_length = d.get("max_length")
    s.pattern = d.get("pattern")
    s._re = re.compile(s.pattern) if s.pattern is not None else None
    # whether _check_rules can refuse anything of this spec's (bind skips the call when it cannot)
    s._rules = (s.enum is not None or s.min is not None or s.max is not None or
                s.type == "str" and (s.min_length is not None or s.max_length is not None or s._re is not None))
    return s


def build_specs(saved: dict[str, dict]) -> tuple[ParamSpec, ...]:
    return tuple(_spec_from(d, n) for n, d in saved.items())


def _convert(spec: ParamSpec, raw: Any) -> Any:
    """Text (query string) or JSON value → the typed value; ValueError with the sentence for `errors`."""
    t = spec.type
    if t == "int":
        if isinstance(raw, bool):
            raise ValueError("must be an integer")
        if isinstance(raw, int):
            v = raw
        elif isinstance(raw, str) and _INT_RE.fullmatch(raw):
            v = text_int(raw)
        elif isinstance(raw, float) and raw.is_integer():
            v = int(raw)
        else:
            raise ValueError("must be an integer")
        if not INT_MIN <= v <= INT_MAX:
            raise ValueError("must be a signed 64-bit integer")
        return v
    if t == "float":
        if isinstance(raw, bool):
            raise ValueError("must be a number")
        if isinstance(raw, (int, float)):
            try:
                v = float(raw)
            except OverflowError:  # a JSON integer of hundreds of digits
                raise ValueError("must be a finite number") from None
        elif isinstance(raw, str):
            if raw.lower() in _NOT_FINITE:
                raise ValueError("must be a finite number")
            if not FLOAT_RE.fullmatch(raw):
                raise ValueError("must be a number")
            v = float(raw)
        else:
            raise ValueError("must be a number")
        if math.isnan(v) or math.isinf(v):
            raise ValueError("must be a finite number")
        return v
    if t == "bool":
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str):
            low = raw.lower()
            if low in TRUE_TEXT:
                return True
            if low in FALSE_TEXT:
                return False
        if isinstance(raw, int) and raw in (0, 1):
            return bool(raw)
        raise ValueError("must be a boolean (true/1/yes or false/0/no)")
    if not isinstance(raw, str):
        raise ValueError("must be a string")
    if "\x00" in raw:
        raise ValueError("must not contain NUL characters")
    return raw


def text_int(text: str) -> int:
    """An integer's text (already matched by INT_RE) as an int; one too long for Python to read (thousands of
    digits) is returned as a value outside every 64-bit bound, so that it is refused as out of range."""
    try:
        return int(text)
    except ValueError:
        return INT_MAX + 1 if not text.startswith("-") else INT_MIN - 1


def bind(specs: tuple[ParamSpec, ...], given: dict[str, Any], max_bytes: int) -> dict[str, Any]:
    """Validate one call's values against the specs; raise 400 param_required/param_invalid with every problem."""
    errors: dict[str, str] = {}
    missing = False
    values: dict[str, Any] = {}
    for spec in specs:
        raw = given.get(spec.name, _MISSING)
        if raw is _MISSING or (isinstance(raw, str) and raw == "" and spec.type != "str"):
            if spec.has_default:
                values[spec.name] = spec.default
            elif spec.required:
                errors[spec.name] = "is required"
                missing = True
            else:
                values[spec.name] = None
            continue
        if raw is None:
            if spec.required and not spec.has_default:
                errors[spec.name] = "is required"
                missing = True
            else:
                values[spec.name] = spec.default if spec.has_default else None
            continue
        if isinstance(raw, list):
            errors[spec.name] = "must be given once"
            continue
        if isinstance(raw, str) and len(raw) > max_bytes // 4 and len(raw.encode("utf-8")) > max_bytes:
            errors[spec.name] = f"is longer than {max_bytes} bytes"
            continue
        if raw.__class__ is str and spec.type == "int":  # a query string's integer, read as _convert reads it
            if not _INT_RE.fullmatch(raw):
                errors[spec.name] = "must be an integer"
                continue
            v = text_int(raw)
            if not INT_MIN <= v <= INT_MAX:
                errors[spec.name] = "must be a signed 64-bit integer"
                continue
        else:
            try:
                v = _convert(spec, raw)
            except ValueError as exc:
                errors[spec.name] = str(exc)
                continue
        if spec._rules:
            problem = _check_rules(spec, v)
            if problem:
                errors[spec.name] = problem
                continue
        values[spec.name] = v
    for name in given:
        # every spec's name is in values or errors by now: any other name is not a parameter
        if name not in values and name not in errors:
            errors[name] = "is not a parameter of this query"
    if errors:
        only_missing = missing and all(v == "is required" for v in errors.values())
        code = "param_required" if only_missing else "param_invalid"
        what = "; ".join(f"{k} {v}" for k, v in errors.items())
        raise ApiError(400, code, f"Fix the parameters and try again: {what}.", {"errors": errors})
    return values


def _check_rules(spec: ParamSpec, v: Any) -> str | None:
    if spec.enum is not None and v not in spec.enum:
        return "must be one of " + ", ".join(str(e) for e in spec.enum)
    if spec.min is not None and v < spec.min:
        return f"must be at least {spec.min}"
    if spec.max is not None and v > spec.max:
        return f"must be at most {spec.max}"
    if spec.type == "str":
        if spec.min_length is not None and len(v) < spec.min_length:
            return f"must be at least {spec.min_length} characters long"
        if spec.max_length is not None and len(v) > spec.max_length:
            return f"must be at most {spec.max_length} characters long"
        if spec._re is not None and not spec._re.fullmatch(v):
            return f"must match the pattern {spec.pattern}"
    return None


class _Missing:
    __slots__ = ()


_MISSING = _Missing()
