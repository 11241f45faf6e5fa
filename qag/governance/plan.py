"""The plan-time decision for (key, query version, connection): may it run, and how is each output column masked."""

from __future__ import annotations

import re

from .analysis import analyze, called_functions, canonical_dialect
from .errors import GovernanceError
from .lineage import Lineage, Unknown
from .tables import default_schema_for, forbidden_tables, parse_allowed, resolve, split_name, table_text
from .transforms import ACTIONS, STRICTNESS

_PLAN_VERSION = 1


class GovernedPlan:
    """Immutable outcome of plan_governance; to_dict()/from_dict() round-trip through msgpack."""

    __slots__ = ("is_write", "output_names", "tables", "transforms", "unsafe", "write_ops")

    def __init__(self, *, is_write, write_ops, tables, transforms, output_names=None, unsafe=()):
        set_ = object.__setattr__
        set_(self, "is_write", bool(is_write))
        set_(self, "write_ops", frozenset(write_ops))
        set_(self, "tables", frozenset(tables))
        set_(self, "transforms", tuple(transforms) if transforms is not None else None)
        # Best-effort names of the output columns (before drop), for catalogues and name checks.
        set_(self, "output_names", tuple(output_names) if output_names is not None else None)
        set_(self, "unsafe", tuple(unsafe))

    def __setattr__(self, name, value):
        raise AttributeError("GovernedPlan is immutable")

    def __delattr__(self, name):
        raise AttributeError("GovernedPlan is immutable")

    def to_dict(self) -> dict:
        return {
            "v": _PLAN_VERSION,
            "is_write": self.is_write,
            "write_ops": sorted(self.write_ops),
            "tables": sorted(self.tables),
            "transforms": list(self.transforms) if self.transforms is not None else None,
            "output_names": list(self.output_names) if self.output_names is not None else None,
            "unsafe": list(self.unsafe),
        }

    @classmethod
    def from_dict(cls, d) -> GovernedPlan:
        if d.get("v", _PLAN_VERSION) != _PLAN_VERSION:
            raise ValueError(f"governed plan version {d.get('v')!r} is not {_PLAN_VERSION}")
        return cls(is_write=d["is_write"], write_ops=d["write_ops"], tables=d["tables"],
                   transforms=d.get("transforms"), output_names=d.get("output_names"),
                   unsafe=d.get("unsafe") or ())

    def masked_columns(self) -> list[dict]:
        """What a catalogue shows: each masked output position, its column name and action."""
        if self.transforms is None:
            return []
        names = self.output_names or (None,) * len(self.transforms)
        return [{"position": i, "column": names[i] if i < len(names) else None, "action": t}
                for i, t in enumerate(self.transforms) if t is not None]

    def __reduce__(self):
        return (_plan_from_dict, (self.to_dict(),))

    def __eq__(self, other):
        return isinstance(other, GovernedPlan) and self.to_dict() == other.to_dict()

    def __hash__(self):
        return hash((self.is_write, self.write_ops, self.tables, self.transforms))

    def __repr__(self) -> str:
        return (f"GovernedPlan(is_write={self.is_write}, write_ops={sorted(self.write_ops)}, "
                f"tables={sorted(self.tables)}, transforms={self.transforms})")


def _plan_from_dict(d):
    return GovernedPlan.from_dict(d)


class MaskRule:
    """One rule: "[schema.]table.column" with "*" wildcards, matched case-insensitively.
    A two-part rule (table.column) matches that table in ANY schema/database: masking errs on hiding."""

    __slots__ = ("action", "column", "schema", "table", "text")

    def __init__(self, text: str, action: str):
        self.text = text
        self.action = action
        parts = split_name(text, "mysql")   # lowercases every part, honours quotes
        if not parts or any(p == "" for p in parts):
            raise GovernanceError(403, "mask_unresolvable", f"mask rule column {text!r} is not [schema.]table.column")
        parts = ["*"] * (3 - len(parts)) + parts if len(parts) < 3 else parts[-3:]
        self.schema, self.table, self.column = (_matcher(p) for p in parts)

    def matches_table(self, schema: str, table: str) -> bool:
        return self.schema(schema.lower()) and self.table(table.lower())

    def matches_column(self, column: str) -> bool:
        return self.column(column.lower())


def _matcher(pattern: str):
    if pattern == "*":
        return lambda s: True
    if "*" in pattern:
        rx = re.compile("".join(".*" if ch == "*" else re.escape(ch) for ch in pattern), re.DOTALL)
        return lambda s: rx.fullmatch(s) is not None
    return lambda s: s == pattern


def parse_rules(mask_rules) -> list[MaskRule]:
    rules = []
    for r in mask_rules or ():
        if not isinstance(r, dict) or not isinstance(r.get("column"), str):
            raise GovernanceError(403, "mask_unresolvable", f"mask rule {r!r} needs a 'column' text")
        action = str(r.get("action", "")).lower()
        if action not in ACTIONS:
            raise GovernanceError(403, "mask_unresolvable",
                                  f"mask rule for {r['column']!r} has action {r.get('action')!r}; "
                                  "use hash, mask, null or drop")
        rules.append(MaskRule(r["column"], action))
    return rules


def plan_governance(*, sql: str, dialect: str, default_schema: str, allowed_tables, mask_rules,
                    server_allows_writes: bool, key_allows_writes: bool, allowed_write_ops,
                    allow_unsafe: bool, columns_of, functions_of=None) -> GovernedPlan:
    """Decide once whether the statement may run for this key and how each output column is masked.
    Checks in this order: unsafe functions, writes (server, key, op), tables, masking.
    functions_of() (optional): the database's user-defined functions as (schema, name) pairs; a key limited
    by allowed_tables or masking rules may not call one (its body may read any table)."""
    d = canonical_dialect(dialect)
    a = analyze(sql, d)
    schema = default_schema_for(d, default_schema)
    rules = parse_rules(mask_rules)
    udfs = ()
    if functions_of is not None and (allowed_tables is not None or rules) and d in ("postgres", "mysql"):
        udfs = user_defined_calls(called_functions(sql, d), d, functions_of)

    if a.unsafe and not allow_unsafe:
        raise GovernanceError(403, "unsafe_function",
                              f"the statement uses {', '.join(a.unsafe)}, which reach files or other servers; "
                              "only a query saved by an administrator with unsafe functions allowed may",
                              {"functions": list(a.unsafe)})

    if a.is_write:
        ops = ", ".join(sorted(a.write_ops))
        if not server_allows_writes:
            raise GovernanceError(403, "read_only",
                                  f"the server forbids writes (QAG_ALLOW_WRITES is off) and this statement "
                                  f"writes ({ops})")
        if not key_allows_writes:
            raise GovernanceError(403, "read_only",
                                  f"this API key may not write (its allow_writes is off) and this statement "
                                  f"writes ({ops})")
        if allowed_write_ops is not None:
            allowed = {str(o).lower() for o in allowed_write_ops}
            bad = sorted(a.write_ops - allowed)
            if bad:
                raise GovernanceError(403, "write_op_not_allowed",
                                      f"this API key may not {', '.join(bad)}; its allowed_write_ops are "
                                      f"{', '.join(sorted(allowed)) or 'empty'}", {"operations": bad})

    tables = resolve(a.table_refs, d, schema)
    if allowed_tables is not None:
        if a.opaque:
            raise GovernanceError(403, "table_not_allowed",
                                  f"qag cannot tell which tables {a.opaque} read, so a key limited by "
                                  "allowed_tables may not run it", {"tables": []})
        if a.from_funcs:
            raise GovernanceError(403, "table_not_allowed",
                                  f"{', '.join(a.from_funcs)} in FROM may read tables qag cannot see, so a key "
                                  "limited by allowed_tables may not run it",
                                  {"tables": [], "functions": list(a.from_funcs)})
        if udfs:
            raise GovernanceError(403, "table_not_allowed",
                                  f"{_udf_phrase(udfs)}, which may read tables qag cannot see, so a key limited by "
                                  "allowed_tables may not call it", {"tables": [], "functions": list(udfs)})
        bad = forbidden_tables(tables, parse_allowed(allowed_tables, d, schema))
        if bad:
            names = [table_text(t) for t in bad]
            raise GovernanceError(403, "table_not_allowed",
                                  f"this API key may not read or write {', '.join(names)}", {"tables": names})

    if udfs and rules:
        raise GovernanceError(403, "mask_unresolvable",
                              f"this key has masking rules and {_udf_phrase(udfs)}, whose result cannot be traced to "
                              "its source columns", {"functions": list(udfs)})
    transforms, names = _masking(a, d, schema, tables, rules, columns_of)
    return GovernedPlan(is_write=a.is_write, write_ops=a.write_ops,
                        tables=[table_text(t) for t in tables], transforms=transforms,
                        output_names=names, unsafe=a.unsafe)


def _udf_phrase(udfs) -> str:
    return f"{', '.join(udfs)} {'is a user-defined function' if len(udfs) == 1 else 'are user-defined functions'}"


def user_defined_calls(calls, d: str, functions_of) -> list[str]:
    """The calls (from called_functions) that may reach a user-defined function. PostgreSQL: a call qualified
    with another schema than pg_catalog/information_schema, or an unqualified name some schema defines (which
    one runs depends on search_path and argument types, so any); MySQL/MariaDB: a qualified call, or an
    unqualified name a database defines (a built-in of the same name wins unqualified, but sqlglot models
    the built-ins that matter)."""
    if not calls:
        return []
    defined = {(str(s).lower(), str(n).lower()) for s, n in functions_of()}
    names = {n for _, n in defined}
    out = []
    for q, n in calls:
        if q is not None:
            if d == "postgres" and q in ("pg_catalog", "information_schema"):
                continue
            if (q, n) not in defined and n not in names:
                continue  # no such function: the database refuses the call itself
            out.append(f"{q}.{n}")
        elif n in names:
            out.append(n)
    return out


# Catalog relations whose rows can hold other tables' values (statistics samples, query texts with literals,
# raw pages): a key with masking rules could read masked values through them, so they are refused for it.
_REVEALING = {
    "postgres": lambda s, t: t in ("pg_stat_statements", "pg_stat_statements_info") or (s == "pg_catalog" and t in (
        "pg_stats", "pg_statistic", "pg_stats_ext", "pg_stats_ext_exprs", "pg_statistic_ext_data",
        "pg_stat_activity", "pg_largeobject")),
    "mysql": lambda s, t: s in ("mysql", "performance_schema", "sys") or (s == "information_schema" and t in (
        "column_statistics", "processlist", "innodb_buffer_page", "innodb_ft_index_table", "innodb_ft_index_cache")),
    "sqlite": lambda s, t: t in ("sqlite_stat1", "sqlite_stat3", "sqlite_stat4", "sqlite_dbpage", "dbstat"),
    "clickhouse": lambda s, t: s.lower() == "system" and (t.lower().endswith("_log") or t.lower() in (
        "processes", "query_cache", "filesystem_cache")),
}


def _masking(a, d, schema, tables, rules, columns_of):
    if not rules or a.explain or not a.has_output:
        return None, None
    revealing = sorted(f"{s}.{t}" for s, t in tables if _REVEALING[d](s.lower(), t.lower()))
    if revealing:
        raise GovernanceError(403, "mask_unresolvable",
                              f"this key has masking rules and {', '.join(revealing)} can reveal values of masked "
                              "columns (statistics, query texts or raw pages)", {"tables": revealing})
    if a.opaque:
        raise GovernanceError(403, "mask_unresolvable",
                              f"this key has masking rules and qag cannot trace the columns of {a.opaque}")
    if a.from_funcs:
        raise GovernanceError(403, "mask_unresolvable",
                              f"this key has masking rules and the rows of {', '.join(a.from_funcs)} cannot be "
                              "traced to their source columns", {"functions": list(a.from_funcs)})
    lineage = Lineage(d, schema, columns_of, lambda ref: next(iter(resolve([ref], d, schema))))

    def may_apply(rule):
        for t in tables:
            if rule.matches_table(*t):
                cols = lineage.columns_of(t)
                if cols is None or any(rule.matches_column(c) for c in cols):
                    return True
        return False

    applicable = [r for r in rules if may_apply(r)]
    if not applicable:
        return None, None      # fast path: no rule can touch any column this statement reads

    try:
        outs = lineage.outputs(a.tree)
    except RecursionError:
        raise GovernanceError(403, "mask_unresolvable", "the statement is nested too deeply to trace its columns") \
            from None
    if isinstance(outs, Unknown):
        raise GovernanceError(403, "mask_unresolvable",
                              f"masking rules apply to this statement but its output columns cannot be "
                              f"traced ({outs.why}); list the columns explicitly")
    transforms = []
    for pos, (name, lin) in enumerate(outs):
        best = None
        actions = set()
        for item in lin:
            kind = item[0]
            if kind == "c":
                for r in applicable:
                    if r.matches_table(item[1], item[2]) and r.matches_column(item[3]):
                        actions.add(r.action)
                        if best is None or STRICTNESS[r.action] > STRICTNESS[best]:
                            best = r.action
            elif kind == "t":
                if any(r.matches_table(item[1], item[2]) for r in applicable):
                    raise GovernanceError(403, "mask_unresolvable",
                                          f"output column {pos + 1} ({name}) derives from columns of "
                                          f"{item[1]}.{item[2]} that cannot be named, and a masking rule "
                                          "covers that table; list the columns explicitly",
                                          {"column": name, "position": pos})
            else:
                raise GovernanceError(403, "mask_unresolvable",
                                      f"output column {pos + 1} ({name}) cannot be traced to its source "
                                      f"({item[1]}) while masking rules apply", {"column": name, "position": pos})
        if best == "mask" and "hash" in actions:
            # mask keeps the text after the last "@": in a value built from a masked and a hashed source
            # (concat(email, phone)) that tail could carry the hashed one in clear, so hide the whole value.
            best = "null"
        transforms.append(best)
    names = [n for n, _ in outs]
    if all(t is None for t in transforms):
        return None, names
    return transforms, names
