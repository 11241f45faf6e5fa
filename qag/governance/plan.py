"""The plan-time decision for (key, query version, connection): may it run, and how is each output column masked."""

from __future__ import annotations

import functools
import inspect
import re

from sqlglot import exp

from .analysis import analyze, called_functions, canonical_dialect, func_name, normalize_identifier
from .errors import GovernanceError
from .functions import Trust, allow_list
from .lineage import Lineage, Unknown
from .tables import default_schema_for, forbidden_tables, normalize_text, parse_allowed, resolve, split_name, table_text
from .transforms import ACTIONS, STRICTNESS

_PLAN_VERSION = 1


class GovernedPlan:
    """Immutable outcome of plan_governance; to_dict()/from_dict() round-trip through msgpack."""

    __slots__ = ("is_write", "output_names", "tables", "transforms", "unknown", "unsafe", "write_ops")

    def __init__(self, *, is_write, write_ops, tables, transforms, output_names=None, unsafe=(), unknown=()):
        set_ = object.__setattr__
        set_(self, "is_write", bool(is_write))
        set_(self, "write_ops", frozenset(write_ops))
        set_(self, "tables", frozenset(tables))
        set_(self, "transforms", tuple(transforms) if transforms is not None else None)
        # Best-effort names of the output columns (before drop), for catalogues and name checks.
        set_(self, "output_names", tuple(output_names) if output_names is not None else None)
        set_(self, "unsafe", tuple(unsafe))
        # Relations a governed key's statement names that the connection's catalogue did not know when the plan
        # was built (a table or view created since, or none at all): such a plan must not be kept, or a view
        # created later would be read as an ungoverned table by the kept plan.
        set_(self, "unknown", tuple(unknown))

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
            "unknown": list(self.unknown),
        }

    @classmethod
    def from_dict(cls, d) -> GovernedPlan:
        if d.get("v", _PLAN_VERSION) != _PLAN_VERSION:
            raise ValueError(f"governed plan version {d.get('v')!r} is not {_PLAN_VERSION}")
        return cls(is_write=d["is_write"], write_ops=d["write_ops"], tables=d["tables"],
                   transforms=d.get("transforms"), output_names=d.get("output_names"),
                   unsafe=d.get("unsafe") or (), unknown=d.get("unknown") or ())

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


def _mysql_case_forbidden(a, schema, allowed_tables, columns_of) -> list[tuple[str, str]]:
    """MariaDB/MySQL with lower_case_table_names=0 (Linux's default) tell `CUSTOMERS` from `customers`: two
    tables. A name is the table of exactly that spelling when the catalogue holds one (else the server folds
    it, and so does the allow-list); the same for an allow-list entry. The tables written with another
    spelling than the allow-list entry they matched, and that name another table, are forbidden."""
    exact = getattr(columns_of, "exact", None)
    if exact is None or not isinstance(a.tree, exp.Expression):
        return []
    refs = set(a.table_refs)
    trees = [a.tree] + ([a.tree.meta["qag_alt"]] if "qag_alt" in a.tree.meta else [])
    written = set()
    for tree in trees:
        for t in tree.find_all(exp.Table):
            if not isinstance(t.this, exp.Identifier):
                continue
            db = t.args.get("db")
            dbt = db.this if isinstance(db, exp.Identifier) else None
            if (dbt.lower() if dbt else None, t.this.this.lower()) in refs:
                written.add((dbt if dbt is not None else schema, t.this.this))
    if not written:
        return []

    def ident(db, name):
        return (db, name) if exact(db, name) is not None else (db.lower(), name.lower())

    entries = set()
    for e in allowed_tables:
        parts = split_name(str(e), "postgres")     # keeps quoted parts' case; unquoted: ASCII-folded, undone below
        raw = [p for p in str(e).replace("`", "").split(".")]
        if not parts or len(raw) != len(parts):
            continue
        db, name = (schema, raw[-1]) if len(raw) == 1 else (raw[-2], raw[-1])
        entries.add((db, name))
    allowed_ids = {ident(db, n) for db, n in entries if "*" not in (db, n)}
    wild = [(db, n) for db, n in entries if "*" in (db, n)]
    out = []
    for db, name in written:
        me = ident(db, name)
        if me in allowed_ids:
            continue
        if any((w[0] == "*" or ident(w[0], "x")[0] == me[0]) and (w[1] == "*" or ident(me[0], w[1])[1] == me[1])
               for w in wild):
            continue
        out.append((db, name))
    return sorted(out)


def _path_resolver(d, schema, search_path, columns_of, views_of):
    """refs -> {(schema, table)}: tables.resolve, except that on PostgreSQL with a search_path of several schemas
    a bare name is the relation of the first schema holding it (exact names, from the catalogue: the columns and
    the views), as the server finds it; held by none, the first schema (the server refuses it)."""
    path = [p for p in (search_path or ()) if p]
    if d != "postgres" or not path:
        return lambda refs: resolve(refs, d, schema)
    if len(path) == 1:
        return lambda refs: resolve(refs, d, path[0])     # (a path of one schema, e.g. set on the role)
    exact = getattr(columns_of, "exact", columns_of) if columns_of is not None else None
    found: dict = {}

    def holder(name):
        if name not in found:
            views = views_of() if views_of is not None else {}
            found[name] = next((s for s in path if (s, name) in views or
                                (exact is not None and exact(s, name) is not None)), None)
        return found[name]

    def res(refs):
        out = set()
        for db, name in refs:
            if db is None and not name.startswith("pg_"):
                out.add((holder(name) or schema, name))
            else:
                out |= resolve([(db, name)], d, schema)
        return frozenset(out)
    return res


class _Inherited:
    """A mask rule that also covers the partitions and INHERITS children of the tables it names: their rows are
    the parent's rows, so reading a partition directly must not show what the parent's rule hides."""

    __slots__ = ("action", "ancestors", "rule")

    def __init__(self, rule: MaskRule, ancestors: dict):
        self.rule = rule
        self.action = rule.action
        self.ancestors = ancestors     # {(schema, table) lowercased: ((schema, table), ...)}

    def matches_table(self, schema: str, table: str) -> bool:
        if self.rule.matches_table(schema, table):
            return True
        return any(self.rule.matches_table(s, t) for s, t in self.ancestors.get((schema.lower(), table.lower()), ()))

    def matches_column(self, column: str) -> bool:
        return self.rule.matches_column(column)


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
                    allow_unsafe: bool, columns_of, functions_of=None, trusted_functions=(),
                    views_of=None, search_path=None) -> GovernedPlan:
    """Decide once whether the statement may run for this key and how each output column is masked.
    Checks in this order: unsafe functions, writes (server, key, op), tables, masking, functions.

    For a key limited by allowed_tables or masking rules ("governed"):
    - every function called must be on the dialect's allow-list (qag/governance/functions/<dialect>.txt) or in
      trusted_functions (the connection's options.trusted_functions), else 403 function_not_allowed;
      functions_of() (optional) gives the database's user-defined functions as (schema, name) pairs: a name one
      of them defines is refused even where a built-in has it too (which one runs depends on argument types);
    - views_of() (optional) gives {(schema, name): definition} of the database's views: a view the statement
      reads is governed as its definition (tables, functions, column lineage), or refused when it cannot be.
    search_path (PostgreSQL, optional): the schemas a bare name is looked up in; with more than one, a bare name
    is the relation of the first schema holding it (by the catalogue), as the server finds it."""
    d = canonical_dialect(dialect)
    a = analyze(sql, d)
    schema = default_schema_for(d, default_schema)
    rules = parse_rules(mask_rules)
    governed = allowed_tables is not None or bool(rules)
    ancestors_of = getattr(views_of, "ancestors", None)
    if rules and ancestors_of is not None and a.table_refs:
        ancestors = ancestors_of()
        if ancestors:
            rules = [_Inherited(r, ancestors) for r in rules]
    try:
        trust = Trust(trusted_functions if governed else ())
    except ValueError as exc:
        raise GovernanceError(403, "function_not_allowed",
                              f"{exc}; an administrator must correct the connection before governed keys can run "
                              "queries on it") from None

    views: list[_View] = []
    res = _path_resolver(d, schema, search_path if governed else None, columns_of, views_of)
    direct = res(a.table_refs)
    tables = direct
    unknown: list = []
    if governed and views_of is not None and a.table_refs:
        unknown = _unknown_relations(direct, d, views_of, columns_of)
        if unknown and getattr(views_of, "refresh", None) is not None and views_of.refresh():
            unknown = _unknown_relations(direct, d, views_of, columns_of)   # the catalogue was read again
        tables, views = _expand_views(direct, d, views_of)
    unsafe = tuple(dict.fromkeys((*a.unsafe, *(u for v in views for u in v.analysis.unsafe))))

    if unsafe and not allow_unsafe:
        raise GovernanceError(403, "unsafe_function",
                              f"the statement uses {', '.join(unsafe)}, which reach files or other servers; "
                              "only a query saved by an administrator with unsafe functions allowed may",
                              {"functions": list(unsafe)})

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

    from_funcs = [*a.from_funcs, *(f for v in views for f in v.analysis.from_funcs)]
    if from_funcs and trust:
        by_name = _by_name(_defined(functions_of, d))
        from_funcs = [f for f in from_funcs if not trust.trusts(None, f, by_name.get(f.lower(), ()))]

    opaque = a.opaque or next((f"the view {table_text(v.name)}" for v in views if v.analysis.opaque), None)
    if allowed_tables is not None:
        if opaque:
            raise GovernanceError(403, "table_not_allowed",
                                  f"qag cannot tell which tables {opaque} read, so a key limited by "
                                  "allowed_tables may not run it", {"tables": []})
        if from_funcs:
            raise GovernanceError(403, "table_not_allowed",
                                  f"{', '.join(dict.fromkeys(from_funcs))} in FROM may read tables qag cannot see, "
                                  "so a key limited by allowed_tables may not run it",
                                  {"tables": [], "functions": list(dict.fromkeys(from_funcs))})
        bad = forbidden_tables(tables, parse_allowed(allowed_tables, d, schema))
        if not bad and d == "mysql":
            bad = _mysql_case_forbidden(a, schema, allowed_tables, columns_of)
        if bad:
            names = [table_text(t) for t in bad]
            via = [table_text(v.name) for v in views if any(t in v.reads for t in bad)]
            raise GovernanceError(403, "table_not_allowed",
                                  f"this API key may not read or write {', '.join(names)}"
                                  + (f" (read through the view {', '.join(via)})" if via else ""),
                                  {"tables": names})

    read = direct | tables
    if rules and a.is_write:
        _check_written(a, d, schema, read, rules, columns_of, views, res)
    refresh = getattr(views_of, "refresh", None) if views_of is not None else None
    transforms, names = _masking(a, d, schema, read, rules, columns_of, opaque, from_funcs, res=res, refresh=refresh)
    if views and rules and a.has_output and not a.explain:
        # Rules may also name a view's own columns (contacts.contact): the lineage through the views' names
        # and the lineage through their definitions both apply, the stricter action wins per position.
        expanded = _expanded_tree(a.tree, d, schema, views, res)
        t2, n2 = _masking(a, d, schema, read, rules, columns_of, opaque, from_funcs, tree=expanded, res=res)
        transforms = _stricter(transforms, t2)
        names = names or n2
    if governed:
        # after tables and masking: their refusals name the more specific cause (a forbidden table, a value that
        # cannot be traced) when a statement has both
        _check_functions(d, [(sql, default_schema)] + [(v.text, v.name[0]) for v in views], trust, functions_of,
                         skip=frozenset(from_funcs), columns_of=columns_of)
    return GovernedPlan(is_write=a.is_write, write_ops=a.write_ops,
                        tables=[table_text(t) for t in read], transforms=transforms,
                        output_names=names, unsafe=unsafe, unknown=[table_text(t) for t in unknown])


# ---------------------------------------------------------------------------------------------- functions
_CALL_HEAD = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_$]*)\s*\(")
_DIALECT_NAMES = {"postgres": "PostgreSQL", "mysql": "MySQL/MariaDB", "sqlite": "SQLite", "clickhouse": "ClickHouse"}


def statement_calls(sql: str, d: str, columns_of=None, default_schema=None
                    ) -> tuple[list[tuple[str | None, str]], frozenset[str]]:
    """Every function the statement calls, as (qualifier or None, name): called_functions() (the analysis's
    list, the database's own names; given the catalogue when it takes one, so that PostgreSQL's attribute
    notation x.f is told apart from a column) and, for the built-ins sqlglot models as nodes of their own, the
    name the dialect's generator writes for that node. Also returns sqlglot's internal names of those nodes
    (e.g. time_to_str for DATE_FORMAT, coalesce for IFNULL), which a call list built from sqlglot's names
    reports: they were judged by the name the dialect writes."""
    if _CALLED_TAKES_CATALOGUE:
        base = called_functions(sql, d, columns_of=columns_of, default_schema=default_schema)
    else:
        base = called_functions(sql, d)
    heads, internal, skip = _tree_calls(sql, d)
    calls = [(q, n) for q, n in base if q is not None or n.lower() not in skip]
    have = set(calls)
    calls += [c for c in heads if c not in have]
    return calls, internal


@functools.lru_cache(maxsize=2048)
def _tree_calls(sql: str, d: str):
    """(generated names of sqlglot-modelled built-ins, their internal names, names not judged as calls)."""
    tree = analyze(sql, d).tree
    heads: list = []
    internal: set = set()
    if tree is None:
        return (), frozenset(), frozenset()
    # Not calls the allow-list judges: functions in FROM (table functions, set-returning functions and
    # SQLite's pragma tables are governed by analysis.py as relations) and MySQL optimizer hints
    # (/*+ NO_INDEX_MERGE(t) */, which sqlglot reads as calls).
    elsewhere, aside = set(), set()
    for node in tree.find_all(exp.Func):
        parent = node.parent
        if isinstance(parent, (exp.Table, exp.Lateral)) and parent.this is node or node.find_ancestor(exp.Hint):
            aside.add(func_name(node))
        else:
            elsewhere.add(func_name(node))
    skip = frozenset(aside - elsewhere)
    for node in tree.find_all(exp.Func):
        if isinstance(node, exp.Anonymous) or func_name(node) in skip:
            continue
        internal.add(node.sql_name().lower())
        head = _generated_name(node, d)
        if head is not None and (None, head) not in heads:
            heads.append((None, head))
    return tuple(heads), frozenset(internal), skip


_CALLED_TAKES_CATALOGUE = "columns_of" in inspect.signature(called_functions).parameters


_HEADS: dict = {}


def _generated_name(node, d: str) -> str | None:
    """The function name the dialect writes for a sqlglot-modelled built-in; None when it writes syntax
    (an operator, CASE, x COLLATE c, CURRENT_DATE), which invokes only built-in operators. Remembered per
    (node class, dialect, arguments present): generating a node writes its whole subtree (measured: ~4 ms a
    plan for a dozen built-ins without this)."""
    if isinstance(node, (exp.Binary, exp.Connector)):
        return None   # an operator (a ~ b, a -> b, a AND b) or its function spelling (POWER(a, b)): built-in
    key = (type(node), d, tuple(k for k, v in node.args.items() if v is not None and v != []))
    if key in _HEADS:
        return _HEADS[key]
    try:
        text = node.sql(dialect=d)
        m = _CALL_HEAD.match(text)
        head = m.group(1).lower() if m else None
        first = node.args.get("this")
        if head is not None and isinstance(first, exp.Expression) and text.startswith(first.sql(dialect=d)):
            head = None   # written after its first operand (x IS JSON, x COLLATE c): the name seen is the operand's
    except Exception:   # noqa: BLE001 - a node the dialect cannot write: name it by its class, which no list holds
        head = type(node).__name__.lower()
    if len(_HEADS) < 4096:
        _HEADS[key] = head
    return head


def _check_functions(d: str, statements, trust: Trust, functions_of, skip: frozenset, columns_of=None) -> None:
    """403 function_not_allowed unless every call of every statement (the query and the views it reads) is on
    the dialect's allow-list or trusted; a name a user-defined function has is refused unless trusted."""
    al = allow_list(d)
    refused: list[str] = []
    udfs: list[str] = []
    defined = None
    by_name: dict[str, list[str]] = {}
    for text, schema in statements:
        calls, internal = statement_calls(text, d, columns_of, schema)
        for q, n in calls:
            if q is None and n in skip:
                continue   # functions in FROM: refused below with the codes the allow-list and masking use
            if defined is None:
                defined = _defined(functions_of, d)
                by_name = _by_name(defined)
            ln = n.lower()
            schemas = by_name.get(ln, [])
            if trust.trusts(q, n, schemas):
                continue
            label = f"{q}.{n}" if q is not None else n
            if q is not None:
                if d == "postgres" and q == "pg_catalog" and al.allows(n):
                    continue
                if (q.lower(), ln) in defined or schemas:
                    udfs.append(label)
                refused.append(label)
            elif schemas:
                udfs.append(label)
                refused.append(label)
            elif not al.allows(n) and ln not in internal:
                # (a name that is sqlglot's own for a node it models, e.g. time_to_str for DATE_FORMAT, was
                # checked above by the name the dialect writes for that node)
                refused.append(label)
    if refused:
        refused = list(dict.fromkeys(refused))
        udfs = list(dict.fromkeys(udfs))
        many = len(refused) > 1
        why = ""
        if udfs:
            what = "are user-defined functions" if len(udfs) > 1 else "is a user-defined function"
            why = f" ({', '.join(udfs)} {what}, whose body may read any table)"
        raise GovernanceError(403, "function_not_allowed",
                              f"this API key may call only functions known to be safe on {_DIALECT_NAMES[d]} and "
                              f"those an administrator marked trusted on the connection; {', '.join(refused)} "
                              f"{'are' if many else 'is'} not among them{why}",
                              {"functions": refused})


def _defined(functions_of, d: str) -> frozenset[tuple[str, str]]:
    if functions_of is None or d not in ("postgres", "mysql"):
        return frozenset()
    return frozenset((str(s).lower(), str(n).lower()) for s, n in functions_of())


def _by_name(defined) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for s, n in defined:
        out.setdefault(n, []).append(s)
    return out


def user_defined_calls(calls, d: str, functions_of) -> list[str]:
    """The calls (from called_functions) that may reach a user-defined function (kept for callers of the
    earlier interface; plan_governance refuses every call outside the allow-list)."""
    if not calls:
        return []
    defined = _defined(functions_of, d)
    names = {n for _, n in defined}
    out = []
    for q, n in calls:
        if q is not None:
            if d == "postgres" and q in ("pg_catalog", "information_schema"):
                continue
            if (q, n) not in defined and n not in names:
                continue
            out.append(f"{q}.{n}")
        elif n in names:
            out.append(n)
    return out


# ---------------------------------------------------------------------------------------------- views
_VIEW_DEPTH = 8


class _View:
    __slots__ = ("analysis", "columns", "name", "reads", "text", "tree")

    def __init__(self, name, text, analysis, tree, columns, reads):
        self.name = name            # (schema, view)
        self.text = text            # the definition's query text
        self.analysis = analysis
        self.tree = tree            # the definition's query tree (not yet expanded)
        self.columns = columns      # the view's own column names when its definition lists them, else None
        self.reads = reads          # resolved relations the definition names


def _unknown_relations(direct, d: str, views_of, columns_of) -> list:
    """The relations neither the views nor the columns catalogue know (sorted)."""
    index = _views_index(views_of, d)
    return sorted(t for t in direct if _view_key(t, d) not in index and columns_of(t[0], t[1]) is None)


def _view_key(t, d: str) -> tuple[str, str]:
    return (normalize_text(t[0], True, d), normalize_text(t[1], True, d))


def _views_index(views_of, d: str) -> dict:
    return {_view_key(k, d): v for k, v in (views_of() or {}).items()}


def _expand_views(direct, d: str, views_of):
    """Replace each view among the relations by what its definition reads, recursively (depth-bounded).
    Returns (base relations, [_View])."""
    index = _views_index(views_of, d)
    if not index:
        return direct, []
    seen: dict = {}
    out: set = set()

    def walk(rels, depth):
        for t in rels:
            key = _view_key(t, d)
            if key not in index:
                out.add(t)
                continue
            if key in seen:
                continue
            if depth >= _VIEW_DEPTH:
                raise GovernanceError(403, "view_not_expandable",
                                      f"the view {table_text(t)} nests views more than {_VIEW_DEPTH} deep; a key with "
                                      "an allow-list or masking rules may not read it", {"tables": [table_text(t)]})
            v = _parse_view(t, index[key], d)
            seen[key] = v
            walk(v.reads, depth + 1)
    walk(direct, 0)
    return frozenset(out), list(seen.values())


def _parse_view(t, definition, d: str) -> _View:
    def refuse(why):
        return GovernanceError(403, "view_not_expandable",
                               f"the view {table_text(t)} {why}, so qag cannot govern what it reads; a key with an "
                               "allow-list or masking rules may not read it", {"tables": [table_text(t)]})
    if not isinstance(definition, str) or not definition.strip():
        raise refuse("has a definition this connection may not read")
    text = definition.strip().rstrip(";").strip()
    columns = None
    try:
        a = analyze(text, d)
    except GovernanceError:
        raise refuse("has a definition qag cannot read") from None
    tree = a.tree
    if isinstance(tree, exp.Create):
        # SQLite keeps the whole CREATE VIEW statement: govern its query, named by the view's column list
        q = tree.args.get("expression")
        target = tree.this
        if isinstance(target, exp.Schema):
            columns = [c.name for c in target.expressions]
        if not isinstance(q, (exp.Select, exp.SetOperation, exp.Subquery, exp.Values)):
            raise refuse("has a definition qag cannot read")
        text = q.sql(dialect=d)
        try:
            a = analyze(text, d)
        except GovernanceError:
            raise refuse("has a definition qag cannot read") from None
        tree = a.tree
    if a.is_write or not a.has_output:
        raise refuse("is not defined by a query")
    # Names in a definition resolve in the view's own schema (PostgreSQL's definitions are read with every
    # name qualified; MySQL's are; SQLite's live in main).
    reads = resolve(a.table_refs, d, default_schema_for(d, t[0]))
    return _View(t, text, a, tree, columns, reads)


def _expanded_tree(tree, d: str, schema: str, views: list[_View], res=None):
    """A copy of the statement's tree where every reference to a view is its definition as a derived table
    (aliased as the reference was), recursively: what lineage then traces goes to the base columns."""
    by_key = {_view_key(v.name, d): v for v in views}

    def expand(node, look, depth):
        if depth > _VIEW_DEPTH:
            raise GovernanceError(403, "view_not_expandable", f"views nest more than {_VIEW_DEPTH} deep")
        ctes = {normalize_identifier(c.args["alias"].this, d) for c in node.find_all(exp.CTE)
                if isinstance(c.args.get("alias"), exp.TableAlias) and c.args["alias"].this is not None}
        for t in list(node.find_all(exp.Table)):
            if not isinstance(t.this, exp.Identifier):
                continue
            db = t.args.get("db")
            name = normalize_identifier(t.this, d)
            if db is None and name in ctes:
                ref = next(iter(look([(None, name)])))
                if _view_key(ref, d) in by_key:
                    raise GovernanceError(403, "view_not_expandable",
                                          f"{name} names both a CTE and a view; rename the CTE",
                                          {"tables": [table_text(ref)]})
                continue
            dbn = normalize_identifier(db, d) if isinstance(db, exp.Identifier) else (str(db).lower() if db else None)
            ref = next(iter(look([(dbn, name)])))
            v = by_key.get(_view_key(ref, d))
            if v is None:
                continue
            vs = default_schema_for(d, v.name[0])
            inner = expand(v.tree.copy(), lambda refs, vs=vs: resolve(refs, d, vs), depth + 1)
            alias = t.args.get("alias")
            if isinstance(alias, exp.TableAlias) and alias.this is not None:
                new_alias = alias.copy()
            else:
                new_alias = exp.TableAlias(this=exp.to_identifier(t.this.this, quoted=t.this.quoted))
            if v.columns and not new_alias.columns:
                new_alias.set("columns", [exp.to_identifier(c, quoted=True) for c in v.columns])
            t.replace(exp.Subquery(this=inner, alias=new_alias))
        return node
    return expand(tree.copy(), res or (lambda refs: resolve(refs, d, schema)), 0)


def _stricter(a, b):
    if a is None:
        return b
    if b is None:
        return a
    out = []
    for x, y in zip(a, b):
        if x is None or y is None:
            out.append(x or y)
        elif {x, y} == {"mask", "hash"}:
            out.append("null")   # see _masking: a value mixing a masked and a hashed source is nulled
        else:
            out.append(x if STRICTNESS[x] >= STRICTNESS[y] else y)
    return tuple(out) if len(a) == len(b) else a


# Catalog relations whose rows can hold other tables' values (statistics samples, query texts with literals,
# raw pages): a key with masking rules could read masked values through them, so they are refused for it.
_REVEALING = {
    "postgres": lambda s, t: t in ("pg_stat_statements", "pg_stat_statements_info") or (s == "pg_catalog" and t in (
        "pg_stats", "pg_statistic", "pg_stats_ext", "pg_stats_ext_exprs", "pg_statistic_ext_data",
        "pg_stat_activity", "pg_largeobject")),
    # InnoDB's tables show other sessions' statements (innodb_trx.trx_query) and locked rows' keys (lock_data)
    "mysql": lambda s, t: s in ("mysql", "performance_schema", "sys") or (s == "information_schema" and (t in (
        "column_statistics", "processlist", "query_cache_info", "optimizer_trace") or t.startswith("innodb_"))),
    "sqlite": lambda s, t: t in ("sqlite_stat1", "sqlite_stat3", "sqlite_stat4", "sqlite_dbpage", "dbstat"),
    # ClickHouse's system tables hold values in many places (system.errors' last_error_message quotes the value
    # a failed cast read, system.mutations' commands, system.parts' partition values): only the ones listed
    # below, which describe the schema and the server's constants, are read by a key with masking rules
    "clickhouse": lambda s, t: s.lower() == "system" and t.lower() not in _CH_HARMLESS_SYSTEM,
}
_CH_HARMLESS_SYSTEM = frozenset("""
    one numbers numbers_mt zeros zeros_mt databases tables columns functions table_functions formats
    data_type_families table_engines time_zones collations build_options contributors licenses keywords
    aggregate_function_combinators database_engines
""".split())


def _check_written(a, d, schema, tables, rules, columns_of, views, res) -> None:
    """A write by a key with masking rules may not store a value derived from a masked column (INSERT ... SELECT
    email, UPDATE ... SET note = email, MERGE, SELECT ... INTO, CREATE ... AS): the key, or anyone, would then
    read it in clear from the column it was copied to. Refused (403 mask_unresolvable) before it runs, whatever
    the rule's action, and when the stored values cannot be traced while a rule covers a table read."""
    lineage = Lineage(d, schema, columns_of, lambda ref: next(iter(res([ref]))))
    applicable = [r for r in rules if any(r.matches_table(*t) for t in tables)]
    if not applicable or not isinstance(a.tree, exp.Expression):
        return
    trees = [a.tree] + ([_expanded_tree(a.tree, d, schema, views, res)] if views else [])
    for tree in trees:
        for item in lineage.written(tree):
            kind = item[0]
            if kind in ("c", "e", "w") and len(item) >= 4:
                hit = any(r.matches_table(item[1], item[2]) and r.matches_column(item[3]) for r in applicable)
            elif kind in ("w", "t"):
                hit = any(r.matches_table(item[1], item[2]) for r in applicable)
            else:
                hit = kind == "?"
            if hit:
                what = ".".join(item[1:]) if kind != "?" else "values qag cannot trace"
                raise GovernanceError(403, "mask_unresolvable",
                                      f"this statement stores values computed from {what}, which a masking rule of "
                                      "this key covers: the copy would be read in clear; write literal values or "
                                      "parameters, or columns no rule masks", {"column": what})


def _masking(a, d, schema, tables, rules, columns_of, opaque=None, from_funcs=None, tree=None, res=None,
             refresh=None):
    res = res or (lambda refs: resolve(refs, d, schema))
    if rules and a.explain and d in ("mysql", "clickhouse") and not isinstance(a.tree, exp.Describe):
        # MariaDB/MySQL print a const table's values in the plan's conditions (EXPLAIN FORMAT=JSON ... WHERE
        # c.id = 1 showed the masked email), ClickHouse evaluates scalar subqueries into it: a plan is not masked
        covered = sorted(table_text(t) for t in tables if any(r.matches_table(*t) for r in rules))
        if covered:
            raise GovernanceError(403, "mask_unresolvable",
                                  f"this key has masking rules covering {', '.join(covered)}, and the plan "
                                  f"{_DIALECT_NAMES[d]} prints can hold values it read (constant rows, subqueries' "
                                  "results), which masking cannot reach; EXPLAIN is refused for it",
                                  {"tables": covered})
    if not rules or a.explain or not a.has_output:
        return None, None
    opaque = a.opaque if opaque is None else opaque
    from_funcs = list(dict.fromkeys(a.from_funcs if from_funcs is None else from_funcs))
    revealing = sorted(f"{s}.{t}" for s, t in tables if _REVEALING[d](s.lower(), t.lower()))
    if revealing:
        raise GovernanceError(403, "mask_unresolvable",
                              f"this key has masking rules and {', '.join(revealing)} can reveal values of masked "
                              "columns (statistics, query texts, error messages or raw pages)", {"tables": revealing})
    if opaque:
        raise GovernanceError(403, "mask_unresolvable",
                              f"this key has masking rules and qag cannot trace the columns of {opaque}")
    if from_funcs:
        raise GovernanceError(403, "mask_unresolvable",
                              f"this key has masking rules and the rows of {', '.join(from_funcs)} cannot be "
                              "traced to their source columns", {"functions": from_funcs})
    lineage = Lineage(d, schema, columns_of, lambda ref: next(iter(res([ref]))))

    def may_apply(rule):
        # A rule on a table the statement reads applies even when the catalogue lists no column it names: the
        # column may have been added since the catalogue was read (a name the lineage cannot place is then
        # refused, lineage.py "t"), and the rule's table decides, not qag's copy of its columns.
        return any(rule.matches_table(*t) for t in tables)

    applicable = [r for r in rules if may_apply(r)]
    if not applicable:
        return None, None      # fast path: no rule can touch any column this statement reads

    try:
        outs = lineage.outputs(a.tree if tree is None else tree)
        if lineage.unplaced and refresh is not None and refresh():
            # a name no table was known to hold: perhaps a column added since the catalogue was read; read it
            # again (at most every 2 s per connection) and trace once more
            lineage = Lineage(d, schema, columns_of, lambda ref: next(iter(res([ref]))))
            outs = lineage.outputs(a.tree if tree is None else tree)
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
        moved = None     # a mask-ruled column inside an expression that can move its characters
        for item in lin:
            kind = item[0]
            if kind in ("c", "e"):   # lineage.py: "e" is a value computed from the column, not the column
                for r in applicable:
                    if r.matches_table(item[1], item[2]) and r.matches_column(item[3]):
                        if kind == "e" and r.action == "mask":
                            moved = moved or ".".join(item[1:])
                        actions.add(r.action)
                        if best is None or STRICTNESS[r.action] > STRICTNESS[best]:
                            best = r.action
            elif kind == "w":        # a whole-row or composite value (row, JSON, array): no per-column rule fits
                if any(r.matches_table(item[1], item[2]) and (len(item) < 4 or r.matches_column(item[3]))
                       for r in applicable):
                    raise GovernanceError(403, "mask_unresolvable",
                                          f"output column {pos + 1} ({name}) is a whole row or a composite value "
                                          f"(row, JSON, array) holding columns of {item[1]}.{item[2]}, and a masking "
                                          "rule covers that table; select the columns one by one",
                                          {"column": name, "position": pos})
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
        if best == "mask" and moved:
            raise GovernanceError(403, "mask_unresolvable", f"output column {pos + 1} ({name}) is computed from "
                                  f"{moved}, which is masked with mask: mask keeps parts of a value's text, which an "
                                  "expression can move; select the column itself, or use hash, null or drop",
                                  {"column": name, "position": pos})
        transforms.append(best)
    names = [n for n, _ in outs]
    # A rule covers a table the statement reads: the plan pins the result's shape even when no position is
    # masked (a tuple of None, not None), so a result whose columns are not the ones traced here (a column added
    # after the catalogue was read, under SELECT *) is refused at call time (apply_transforms) instead of served.
    return tuple(transforms), names
