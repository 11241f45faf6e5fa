"""Runs every stanza of tests/governance_cases/<dialect>.txt through plan_governance (format: see README.txt)."""

from __future__ import annotations

import pathlib

import pytest

from qag.governance import GovernanceError, plan_governance

CASES_DIR = pathlib.Path(__file__).resolve().parent.parent / "governance_cases"
DIALECTS = ("postgres", "mysql", "sqlite", "clickhouse")


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def load_file(path: pathlib.Path):
    dialect = path.stem
    catalogue: dict = {}
    defaults: dict = {}
    cases = []
    current = None
    mode = None
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.rstrip("\n")
        if current is None and not line.startswith("=="):
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            if s.startswith("table "):
                name, _, cols = s[len("table "):].partition(":")
                schema, _, table = name.strip().rpartition(".")
                catalogue[(schema, table)] = _split(cols)
                continue
            if s.startswith("generated "):
                # generated schema.table.column: source, ...   (a column the database computes; "*": any column)
                name, _, deps = s[len("generated "):].partition(":")
                schema, table, column = name.strip().rsplit(".", 2)
                srcs = None if deps.strip() == "*" else tuple(_split(deps))
                catalogue.setdefault("\x00generated", {}).setdefault((schema, table), {})[column] = srcs
                continue
            if s.startswith("inherits "):
                # inherits schema.child: schema.parent   (a partition or INHERITS child; repeatable per child)
                child, _, parent = s[len("inherits "):].partition(":")
                cs, _, ct = child.strip().rpartition(".")
                ps, _, pt = parent.strip().rpartition(".")
                catalogue.setdefault("\x00inherits", {}).setdefault((cs, ct), []).append((ps, pt))
                continue
            if s.startswith("default "):
                key, _, value = s[len("default "):].partition(":")
                defaults[key.strip()] = value.strip()
                continue
            raise ValueError(f"{path}:{lineno}: unexpected header line {line!r}")
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
        key = key.strip()
        if key == "sql" and mode == "head":
            mode = "sql"
            if value.strip():
                current["sql"].append(value.strip())
            continue
        current[key] = value.strip()
    for c in cases:
        c["sql"] = "\n".join(c["sql"]).strip()
        c.setdefault("dialect", dialect)
        if "expect" not in c:
            raise ValueError(f"{path}:{c['line']}: case {c['name']!r} has no expect:")
    return catalogue, cases


def all_cases():
    out = []
    for d in DIALECTS:
        path = CASES_DIR / f"{d}.txt"
        catalogue, cases = load_file(path)
        for c in cases:
            out.append(pytest.param(catalogue, c, id=f"{d}:{c['line']}:{c['name']}"))
    return out


def _mask_rules(value: str | None):
    rules = []
    for item in _split(value or ""):
        column, _, action = item.rpartition("=")
        rules.append({"column": column.strip(), "action": action.strip()})
    return rules


def run_case(catalogue, c):
    allowed = c.get("allowed")
    if allowed is None or allowed == "any":
        allowed_tables = None
    elif allowed == "none":
        allowed_tables = []
    else:
        allowed_tables = _split(allowed)
    writes = set(_split(c.get("writes", "")))
    ops = c.get("write_ops")
    calls = []

    def columns_of(schema, table):
        calls.append((schema, table))
        return catalogue.get((schema, table))

    columns_of.exact = lambda schema, table: catalogue.get((schema, table))
    generated = catalogue.get("\x00generated")
    if generated:
        columns_of.generated = lambda schema, table: generated.get((schema, table))
    views_of = None
    inherits = catalogue.get("\x00inherits")
    if inherits:
        def views_of():
            return {}
        views_of.ancestors = lambda: {k: tuple(v) for k, v in inherits.items()}
    return plan_governance(
        sql=c["sql"], dialect=c["dialect"], default_schema=c.get("schema", ""),
        allowed_tables=allowed_tables, mask_rules=_mask_rules(c.get("mask")),
        server_allows_writes="server" in writes, key_allows_writes="key" in writes,
        allowed_write_ops=None if ops is None else _split(ops),
        allow_unsafe=c.get("unsafe", "no") == "yes", columns_of=columns_of, views_of=views_of,
        search_path=_split(c["search_path"]) if "search_path" in c else None)


@pytest.mark.parametrize("catalogue,case", all_cases())
def test_case(catalogue, case):
    expect = case["expect"]
    if expect == "ok":
        plan = run_case(catalogue, case)
        if "tables" in case:
            assert sorted(plan.tables) == sorted(_split(case["tables"])), plan
        if "transforms" in case:
            if case["transforms"] == "none":
                # no position masked: no rule covers a table read (None), or one does and the shape is pinned
                assert plan.transforms is None or not any(plan.transforms), plan
            else:
                want = tuple(None if t == "-" else t for t in _split(case["transforms"]))
                assert plan.transforms == want, plan
        if "is_write" in case:
            assert plan.is_write is (case["is_write"] == "yes"), plan
        if "ops" in case:
            assert sorted(plan.write_ops) == sorted(_split(case["ops"])), plan
        # Every plan survives the trip through the cache format.
        assert type(plan).from_dict(plan.to_dict()) == plan
        return
    with pytest.raises(GovernanceError) as info:
        run_case(catalogue, case)
    err = info.value
    assert err.code == expect, f"{err.code}: {err.message}"
    if "forbidden" in case:
        assert sorted(err.extra.get("tables", [])) == sorted(_split(case["forbidden"])), err.extra
    if "message_has" in case:
        assert case["message_has"] in err.message, err.message
    status = {"multiple_statements": 400, "invalid_sql": 400}.get(expect, 403)
    assert err.status == status


def test_enough_cases_per_dialect():
    counts = {d: len(load_file(CASES_DIR / f"{d}.txt")[1]) for d in DIALECTS}
    assert sum(counts.values()) >= 200, counts
    assert all(n >= 30 for n in counts.values()), counts
