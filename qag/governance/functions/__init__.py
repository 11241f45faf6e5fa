"""The per-dialect allow-lists of functions a key with an allow-list or masking rules may call (issue 12, class 3).

The data files beside this module (postgres.txt, mysql.txt, sqlite.txt, clickhouse.txt) are reviewed like code:
one function per line, `#` comments per group, and an optional `[syntax]` section of grammar that is not a
catalogue function (`name  example`), whose examples the catalogue tests run. Names are kept as written; callers
compare them with `normalize()`.
"""

from __future__ import annotations

import functools
import pathlib
import re

_DIR = pathlib.Path(__file__).resolve().parent
DIALECTS = ("postgres", "mysql", "sqlite", "clickhouse")

# ClickHouse aggregate combinators: sumIf, uniqArray, avgOrNull, countDistinctIf, ... are their base function.
_CH_COMBINATORS = ("if", "array", "map", "distinct", "ornull", "ordefault", "state", "merge", "mergestate",
                   "simplestate", "foreach", "resample", "argmin", "argmax", "respectnulls", "ignorenulls")

_TRUSTED = re.compile(r"[^\s.\"`'()]+(?:\.[^\s.\"`'()]+)?")


class AllowList:
    """One dialect's list: `functions` (catalogue names, as written), `syntax` ({name: example})."""

    __slots__ = ("dialect", "functions", "names", "syntax")

    def __init__(self, dialect: str, functions: tuple[str, ...], syntax: dict[str, str]):
        self.dialect = dialect
        self.functions = functions
        self.syntax = syntax
        self.names = frozenset(normalize(n, dialect) for n in (*functions, *syntax))

    def allows(self, name: str) -> bool:
        n = normalize(name, self.dialect)
        if n in self.names:
            return True
        if self.dialect == "clickhouse":
            # take combinators off from the end, one at a time (countDistinctIf -> countDistinct -> count)
            changed = True
            while changed:
                changed = False
                for suffix in _CH_COMBINATORS:
                    if n.endswith(suffix) and len(n) > len(suffix):
                        n = n[: -len(suffix)]
                        changed = True
                        if n in self.names:
                            return True
                        break
        return False


def normalize(name: str, dialect: str) -> str:
    """PostgreSQL compares names exactly (the parser already folded unquoted ones); MySQL/MariaDB, SQLite and
    ClickHouse's call sites here compare case-insensitively."""
    return name if dialect == "postgres" else name.lower()


@functools.cache
def allow_list(dialect: str) -> AllowList:
    path = _DIR / f"{dialect}.txt"
    functions: list[str] = []
    syntax: dict[str, str] = {}
    section = "functions"
    for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line == "[syntax]":
            section = "syntax"
            continue
        if section == "functions":
            if " " in line:
                raise ValueError(f"{path.name}:{lineno}: one function name per line, got {raw!r}")
            functions.append(line)
        else:
            name, _, example = line.partition(" ")
            if not example.strip():
                raise ValueError(f"{path.name}:{lineno}: a [syntax] line is 'name  example', got {raw!r}")
            syntax[name] = example.strip()
    return AllowList(dialect, tuple(functions), syntax)


def parse_trusted(value) -> tuple[str, ...]:
    """Validate a connection's `options.trusted_functions`: a list of "name" or "schema.name" texts. Returns them
    lowercased (compared case-insensitively); raises ValueError with a sentence for the operator."""
    if value is None:
        return ()
    if not isinstance(value, list):
        # one exception type for every invalid setting: the API maps it to 400 invalid_field
        raise ValueError('options.trusted_functions must be a list of "schema.name" or "name" texts')  # noqa: TRY004
    out = []
    for item in value:
        if not isinstance(item, str) or not _TRUSTED.fullmatch(item):
            raise ValueError(f'options.trusted_functions entry {item!r} is not "schema.name" or "name" (no spaces, '
                             "quotes or parentheses)")
        out.append(item.lower())
    return tuple(dict.fromkeys(out))


class Trust:
    """The functions an administrator marked trusted on a connection. "name" trusts every call of that name;
    "schema.name" trusts calls qualified with that schema, and an unqualified call of the name when every
    user-defined function of that name the database reports lives in a trusted schema."""

    __slots__ = ("bare", "qualified")

    def __init__(self, entries):
        entries = parse_trusted(list(entries) if entries else None)
        self.bare = frozenset(e for e in entries if "." not in e)
        self.qualified = frozenset(e for e in entries if "." in e)

    def __bool__(self) -> bool:
        return bool(self.bare or self.qualified)

    def trusts(self, qualifier: str | None, name: str, defined_in=()) -> bool:
        n = name.lower()
        if n in self.bare:
            return True
        if qualifier is not None:
            return f"{qualifier.lower()}.{n}" in self.qualified
        schemas = [s for s in defined_in if s]
        return bool(schemas) and all(f"{s.lower()}.{n}" in self.qualified for s in schemas)
