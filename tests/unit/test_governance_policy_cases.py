"""Runs the stanzas of tests/governance_cases/{functions,views}_<dialect>.txt (issue 12, classes 3 and 5)
through plan_governance. Same format as the dialect files (tests/governance_cases/README.txt), plus:

Header:
  udf schema.name                  a user-defined function functions_of() reports
  view schema.name: SELECT ...     a view views_of() reports, with its definition (one line)
Case:
  trusted: public.f, g             the connection's options.trusted_functions
  functions: a, b.c                (function_not_allowed / unsafe_function) the functions named, exactly
  tables: ...                      (ok) as in the dialect files; (error) the tables named, exactly
"""

from __future__ import annotations

import pathlib

import pytest

from qag.governance import GovernanceError, plan_governance

CASES_DIR = pathlib.Path(__file__).resolve().parent.parent / "governance_cases"
FILES = sorted(p for prefix in ("functions_", "views_") for p in CASES_DIR.glob(prefix + "*.txt"))


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def load(path: pathlib.Path):
    dialect = path.stem.split("_", 1)[1]
    env: dict = {"tables": {}, "udfs": set(), "views": {}}
    defaults: dict = {}
    cases: list[dict] = []
    current = None
    mode = None
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if current is None and not line.startswith("=="):
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            kind, _, rest = s.partition(" ")
            if kind == "table":
                name, _, cols = rest.partition(":")
                schema, _, table = name.strip().rpartition(".")
                env["tables"][(schema, table)] = _split(cols)
            elif kind == "view":
                name, _, sql = rest.partition(":")
                schema, _, view = name.strip().rpartition(".")
                env["views"][(schema, view)] = sql.strip()
            elif kind == "udf":
                schema, _, fn = rest.strip().rpartition(".")
                env["udfs"].add((schema, fn))
            elif kind == "default":
                key, _, value = rest.partition(":")
                defaults[key.strip()] = value.strip()
            else:
                raise ValueError(f"{path}:{lineno}: unexpected header line {line!r}")
            continue
        if line.startswith("=="):
            current = {"name": line[2:].strip(), "line": lineno, "sql": [], **defaults}
            cases.append(current)
            mode = "head"
            continue
        if mode == "sql":
            if line.startswith("expect:"):
                current["expect"] = line.partition(":")[2].strip()
                mode = "tail"
            else:
                current["sql"].append(line)
            continue
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        key, sep, value = s.partition(":")
        if not sep:
            raise ValueError(f"{path}:{lineno}: expected 'key: value', got {line!r}")
        if key.strip() == "sql" and mode == "head":
            mode = "sql"
            continue
        current[key.strip()] = value.strip()
    for c in cases:
        c["sql"] = "\n".join(c["sql"]).strip()
        if "expect" not in c:
            raise ValueError(f"{path}:{c['line']}: case {c['name']!r} has no expect:")
    return dialect, env, cases


def all_cases():
    out = []
    for path in FILES:
        dialect, env, cases = load(path)
        for c in cases:
            out.append(pytest.param(dialect, env, c, id=f"{path.stem}:{c['line']}:{c['name']}"))
    return out


def run(dialect, env, c):
    allowed = c.get("allowed")
    allowed_tables = None if allowed in (None, "any") else [] if allowed == "none" else _split(allowed)
    rules = []
    for item in _split(c.get("mask", "")):
        column, _, action = item.rpartition("=")
        rules.append({"column": column.strip(), "action": action.strip()})
    writes = set(_split(c.get("writes", "")))
    return plan_governance(
        sql=c["sql"], dialect=dialect, default_schema=c.get("schema", ""), allowed_tables=allowed_tables,
        mask_rules=rules, server_allows_writes="server" in writes, key_allows_writes="key" in writes,
        allowed_write_ops=None, allow_unsafe=c.get("unsafe", "no") == "yes",
        columns_of=lambda s, t: env["tables"].get((s, t)),
        functions_of=lambda: env["udfs"], views_of=lambda: env["views"],
        trusted_functions=_split(c.get("trusted", "")))


@pytest.mark.parametrize("dialect,env,case", all_cases())
def test_case(dialect, env, case):
    expect = case["expect"]
    if expect == "ok":
        plan = run(dialect, env, case)
        if "tables" in case:
            assert sorted(plan.tables) == sorted(_split(case["tables"])), plan
        if "transforms" in case:
            want = None if case["transforms"] == "none" else \
                tuple(None if t == "-" else t for t in _split(case["transforms"]))
            assert plan.transforms == want, plan
        return
    with pytest.raises(GovernanceError) as info:
        run(dialect, env, case)
    err = info.value
    assert err.code == expect, f"{err.code}: {err.message}"
    assert err.status == 403
    if "functions" in case:
        assert sorted(err.extra.get("functions", [])) == sorted(_split(case["functions"])), err.extra
    if "tables" in case:
        assert sorted(err.extra.get("tables", [])) == sorted(_split(case["tables"])), err.extra
    if "message_has" in case:
        assert case["message_has"] in err.message, err.message


def test_every_dialect_has_function_cases():
    assert {p.stem for p in FILES} >= {f"functions_{d}" for d in ("postgres", "mysql", "sqlite", "clickhouse")} | \
        {f"views_{d}" for d in ("postgres", "mysql", "sqlite")}


@pytest.mark.parametrize("dialect", ["postgres", "mysql", "sqlite", "clickhouse"])
def test_allow_lists_hold_nothing_known_dangerous(dialect):
    """No entry is on analysis.py's unsafe list or a function that writes, and none repeats."""
    from qag.governance import analysis
    from qag.governance.functions import allow_list, normalize
    al = allow_list(dialect)
    # ClickHouse's names are case-sensitive (dateDiff and DATE_DIFF are both listed); the others' are not
    names = [n if dialect == "clickhouse" else normalize(n, dialect) for n in (*al.functions, *al.syntax)]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    unsafe = analysis._UNSAFE_FUNCS[dialect] | set(analysis._WRITE_FUNCS[dialect])
    prefixes = analysis._UNSAFE_PREFIXES[dialect]
    bad = [n for n in names if n.lower() in unsafe or (prefixes and n.lower().startswith(prefixes))]
    assert not bad, bad
    for refused in {"postgres": ("ts_rewrite", "pg_stat_get_activity", "current_setting", "set_config", "pg_sleep",
                                 "txid_current", "pg_terminate_backend", "lo_get", "dblink", "query_to_xml"),
                    "mysql": ("sleep", "benchmark", "get_lock", "load_file", "version", "last_insert_id"),
                    "sqlite": ("load_extension", "changes", "sqlite_version"),
                    "clickhouse": ("getsetting", "sleep", "currentuser", "file", "url")}[dialect]:
        assert not al.allows(refused), refused


def test_trusted_functions_validation():
    from qag.governance.functions import parse_trusted
    assert parse_trusted(["public.Card_Of", "lower", "lower"]) == ("public.card_of", "lower")
    assert parse_trusted(None) == ()
    for bad in ("public.f", [""], ["a.b.c"], ["f()"], ["a b"], [1], ['"x".y']):
        with pytest.raises(ValueError):
            parse_trusted(bad)
