"""Column lineage: trace each output column, by position, to the source schema.table.column values it derives from.

Over-approximates on purpose (a column may list sources it does not really use) so masking errs on hiding;
where the shape or sources cannot be known (SELECT * over a table of unknown columns), it says so and the
caller refuses with mask_unresolvable when a rule might apply.
"""

from __future__ import annotations

import logging

from sqlglot import exp

from .analysis import func_name, normalize_identifier

# A lineage is a frozenset of items:
#   ("c", schema, table, column)  the value of that column, as it is or through an exact pass-through
#                                 (names lowercased for matching)
#   ("e", schema, table, column)  a value computed from that column by an expression that rearranges it
#                                 (a per-column rule holds for it only if it hides the whole value)
#   ("t", schema, table)          some column(s) of that table whose names are not known
#   ("w", schema, table[, column]) a whole-row or composite value holding that column (or columns of that table
#                                 whose names are not known) (SELECT c,
#                                 row_to_json(c), c.f attribute notation, ROW(..), JSON and array builders):
#                                 no per-column rule can apply inside it
#   ("?", why)                    anything at all
#
# Names are compared as the database compares them: PostgreSQL keeps quoted names exactly (unquoted ones
# arrive folded by normalize_identifier), so "C" is not c and "EMAIL" is not email; MySQL/MariaDB and
# SQLite compare column names without case, and a MySQL table alias that could be either of two FROM
# items (aliases are case-sensitive, or not, with lower_case_table_names) counts as both.
EMPTY: frozenset = frozenset()
_log = logging.getLogger("qag.governance")
_QUERY = (exp.Select, exp.SetOperation, exp.Subquery, exp.Values)
_DML = (exp.Insert, exp.Update, exp.Delete, exp.Merge)
_MAX_ROUNDS = 8


class Unknown:
    """An output whose number of columns cannot be known; lineage is everything that might flow into it."""

    __slots__ = ("lineage", "why")

    def __init__(self, lineage, why):
        self.lineage = frozenset(lineage)
        self.why = why


def _derive(lin):
    """The lineage of a value computed from `lin` (not a pass-through): column items become "e"."""
    return frozenset(("e",) + i[1:] if i[0] == "c" else i for i in lin)


def _whole(lin):
    """The lineage of a whole-row or composite value built from `lin`: no per-column rule applies inside it."""
    return frozenset(("w",) + i[1:] if i[0] in ("c", "e", "t") else i for i in lin)


# Values that hold several values at once (a row, JSON, an array): a rule on one column cannot be applied
# inside them, so a masked column flowing into one is refused (lineage "w").
_COMPOSITE_NODES = tuple(c for c in (getattr(exp, n, None) for n in (
    "Tuple", "Array", "ArrayAgg", "Struct", "JSONObject", "JSONObjectAgg", "JSONArray", "JSONArrayAgg",
    "ArrayConcat", "ArrayAppend", "ArrayPrepend", "Map", "VarMap", "ToMap", "JSONBObjectAgg", "ArrayUniqueAgg",
    "GroupConcat")) if c is not None)
_COMPOSITE_FUNCS = frozenset(str.split("""
    row to_json to_jsonb row_to_json array_to_json json_agg jsonb_agg json_object_agg jsonb_object_agg
    json_build_object jsonb_build_object json_build_array jsonb_build_array json_object jsonb_object array_agg
    hstore xmlforest xmlelement xmlagg xmlconcat json_array json_arrayagg json_objectagg json_strip_nulls
    jsonb_strip_nulls jsonb_insert jsonb_set json_populate_record jsonb_populate_record record_out
    """))


def _ident(name):
    return name


def _lower(name):
    return name.lower() if name is not None else None


class _Source:
    __slots__ = ("alias", "any_lineage", "cols", "fold", "pending", "table")

    def __init__(self, alias, cols, table=None, any_lineage=EMPTY, pending=False, fold=_lower):
        self.alias = alias            # name the query uses for it (folded as the dialect compares names)
        self.cols = cols              # list[(name | None, lineage)] or None if unknown; None: an unnamed expression
        self.table = table            # (schema, table) for a real table
        self.any_lineage = any_lineage
        self.pending = pending        # a recursive CTE whose columns are still being computed
        self.fold = fold

    def col(self, name):
        """(lineage or None, definitely found). An unnamed output column (the server names it: lower,
        ?column?, ...) may be the one asked for: its lineage is included, never as definite."""
        if self.cols is not None:
            fold = self.fold
            found = [lin for n, lin in self.cols if n is not None and fold(n) == name]
            maybe = [lin for n, lin in self.cols if n is None]
            if found:
                return _union(found), True      # had an unnamed one the same name, the server says ambiguous
            return (_union(maybe) if maybe else None), False
        if self.table is not None:
            return frozenset({("c", self.table[0].lower(), self.table[1].lower(), name.lower())}), False
        return self.any_lineage, False

    def all(self):
        if self.cols is not None:
            return frozenset().union(*(lin for _, lin in self.cols)) if self.cols else EMPTY
        if self.table is not None:
            return frozenset({("t", self.table[0].lower(), self.table[1].lower())})
        if self.pending:
            return EMPTY
        return self.any_lineage | {("?", "a source of unknown columns")}


class _Scope:
    __slots__ = ("aliases", "ctes", "merged", "parent", "sources")

    def __init__(self, parent, ctes=None):
        self.sources: list[_Source] = []
        self.merged = []              # list[(name, lineage)] for SELECT *, or an Unknown
        self.aliases: dict = {}
        self.parent = parent
        # CTEs visible here: a subquery inside an expression sees them too.
        self.ctes = ctes if ctes is not None else (parent.ctes if parent is not None else {})


def _union(items):
    out = set()
    for i in items:
        out |= i
    return frozenset(out)


class Lineage:
    """Computes the output columns of one statement. columns_of(schema, table) -> list[str] | None."""

    def __init__(self, dialect, default_schema, columns_of, resolve_ref):
        self.d = dialect
        self.fold = _ident if dialect in ("postgres", "clickhouse") else _lower
        self.default_schema = default_schema
        self._columns_of = columns_of
        self._cols_cache: dict = {}
        self._written: set | None = None     # collecting the lineage of stored values (written())
        self.resolve_ref = resolve_ref       # (db | None, name) -> (schema, table)
        self.unplaced = False                # a column name no FROM item was known to hold (see unqualified)

    # ---- entry point -------------------------------------------------------------------------------------
    def outputs(self, tree):
        """list[(name, lineage)] per output position, or Unknown. A MySQL statement with "..." text carries
        the reading of a server with ANSI_QUOTES ("x" a name) in tree.meta["qag_alt"]: both count."""
        try:
            return self._outputs(tree)
        except RecursionError:
            raise
        except Exception as exc:  # an untraceable statement is refused (403), never a 500
            if hasattr(exc, "status"):
                raise     # a domain error (the catalogue's connection failed, ...): the caller maps it
            _log.exception("lineage failed")
            return Unknown({("?", type(exc).__name__)}, f"qag could not trace them: {type(exc).__name__}")

    def _outputs(self, tree):
        out = self.query(tree, {}, None)
        alt = tree.meta.get("qag_alt") if isinstance(tree, exp.Expression) else None
        if alt is not None:
            other = self.query(alt, {}, None)
            if isinstance(out, Unknown) or isinstance(other, Unknown) or len(out) != len(other):
                return Unknown(self.flat(out) | self.flat(other), 'MySQL reads "..." as text, or with ANSI_QUOTES '
                                                                  "as a name, and the two readings differ in shape")
            out = [(n, lin | olin) for (n, lin), (_, olin) in zip(out, other)]
        return out

    def generated_of(self, table):
        """{column: its sources | None} of a table's generated / ALIAS / MATERIALIZED columns (lowercased), from
        columns_of.generated when the catalogue gives it."""
        read = getattr(self._columns_of, "generated", None)
        if read is None:
            return None
        key = ("\x00gen",) + tuple(table)
        if key not in self._cols_cache:
            self._cols_cache[key] = read(table[0], table[1])
        return self._cols_cache[key]

    @staticmethod
    def _base(table, c, gen):
        """A base table column's lineage: itself, and when the database computes it from other columns
        (GENERATED ALWAYS AS (lower(email)), ClickHouse ALIAS email), a value derived from them."""
        s, t, low = table[0].lower(), table[1].lower(), c.lower()
        lin = {("c", s, t, low)}
        if gen and low in gen:
            deps = gen[low]
            if deps is None:
                lin.add(("t", s, t))
            else:
                lin |= {("e", s, t, dep) for dep in deps if dep != low}
        return frozenset(lin)

    def columns_of(self, table):
        if table not in self._cols_cache:
            cols = self._columns_of(table[0], table[1]) if self._columns_of else None
            self._cols_cache[table] = list(cols) if cols is not None else None
        return self._cols_cache[table]

    def norm(self, ident):
        return normalize_identifier(ident, self.d)

    # ---- queries -----------------------------------------------------------------------------------------
    def query(self, q, ctes, outer):
        if isinstance(q, exp.Subquery):
            ctes = self.bind_ctes(q, ctes, outer)
            return self.query(q.this, ctes, outer)
        if isinstance(q, exp.Select):
            return self.select(q, ctes, outer)[0]
        if isinstance(q, exp.SetOperation):
            ctes = self.bind_ctes(q, ctes, outer)
            left = self.query(q.left, ctes, outer)
            right = self.query(q.right, ctes, outer)
            if isinstance(left, Unknown) or isinstance(right, Unknown) or len(left) != len(right):
                return Unknown(self.flat(left) | self.flat(right), "set operation of unknown shape")
            return [(ln, ll | rl) for (ln, ll), (_, rl) in zip(left, right)]
        if isinstance(q, exp.Values):
            return self.values(q, outer)
        if isinstance(q, _DML):
            return self.dml(q, ctes, outer)
        return Unknown({("?", type(q).__name__)}, f"{type(q).__name__} output")

    @staticmethod
    def flat(cols):
        if isinstance(cols, Unknown):
            return cols.lineage
        return _union(lin for _, lin in cols)

    def values(self, q, outer):
        scope = outer if outer is not None else _Scope(None, {})
        rows = [t.expressions if isinstance(t, exp.Tuple) else [t] for t in q.expressions]
        if not rows:
            return []
        width = len(rows[0])
        if any(len(r) != width for r in rows):
            return Unknown(_union(self.expr(e, scope) for r in rows for e in r), "VALUES rows of unequal width")
        out = []
        for i in range(width):
            out.append((f"column{i + 1}", _union(self.expr(r[i], scope) for r in rows)))
        return out

    def bind_ctes(self, q, ctes, outer):
        with_ = q.args.get("with_") if "with_" in q.args else q.args.get("with")
        if not isinstance(with_, exp.With):
            return ctes
        ctes = dict(ctes)
        recursive = bool(with_.args.get("recursive"))
        for cte in with_.expressions:
            alias = cte.args.get("alias")
            if not isinstance(alias, exp.TableAlias) or alias.this is None:
                continue
            name = self.norm(alias.this)
            if cte.args.get("scalar"):
                continue   # ClickHouse WITH <expr> AS name: an alias, handled with the select's aliases
            colnames = [self.norm(c) for c in alias.columns] if alias.columns else None
            if recursive:
                ctes[name] = ("pending", None)
                prev = None
                for _ in range(_MAX_ROUNDS):
                    cols = self._rename(self.query(cte.this, ctes, outer), colnames)
                    if prev is not None and not isinstance(prev, Unknown) and not isinstance(cols, Unknown) \
                            and len(prev) == len(cols):
                        cols = [(n, lin | plin) for (n, lin), (_, plin) in zip(cols, prev)]
                    ctes[name] = ("cols", cols)
                    if _same(prev, cols):
                        break
                    prev = cols
                else:
                    ctes[name] = ("cols", Unknown({("?", "recursive CTE")}, "recursive CTE did not settle"))
            else:
                # A non-recursive CTE cannot see itself: bind after computing its body.
                ctes[name] = ("cols", self._rename(self.query(cte.this, ctes, outer), colnames))
        # PostgreSQL SEARCH ... SET seq / CYCLE ... SET is_cycle USING path add columns holding the rows' values
        # (seq and path are arrays of records of them): whole values of every column of the CTE (sqlglot keeps
        # the clause on the WITH, so every CTE of it gets them)
        extra = []
        for key in ("search", "cycle"):
            clause = with_.args.get(key)
            if isinstance(clause, exp.Expression):
                for part in ("expression", "using"):
                    v = clause.args.get(part)
                    if isinstance(v, exp.Identifier):
                        extra.append(self.norm(v))
        if extra:
            for cte in with_.expressions:
                alias = cte.args.get("alias")
                if not isinstance(alias, exp.TableAlias) or alias.this is None:
                    continue
                name = self.norm(alias.this)
                kind, cols = ctes.get(name, (None, None))
                if kind == "cols" and not isinstance(cols, Unknown):
                    whole = _whole(self.flat(cols))
                    ctes[name] = ("cols", list(cols) + [(n, whole) for n in extra])
        return ctes

    @staticmethod
    def _rename(cols, names):
        if not names or isinstance(cols, Unknown):
            return cols
        out = list(cols)
        for i, n in enumerate(names[:len(out)]):
            out[i] = (n, out[i][1])
        return out

    # ---- SELECT ------------------------------------------------------------------------------------------
    def select(self, q, ctes, outer):
        ctes = self.bind_ctes(q, ctes, outer)
        scope = _Scope(outer, ctes)
        from_ = q.args.get("from_") if "from_" in q.args else q.args.get("from")
        if from_ is not None:
            self.add_source(from_.this, scope, ctes, None)
        for join in q.args.get("joins") or []:
            self.add_source(join.this, scope, ctes, join)
        for lat in q.args.get("laterals") or []:
            self.add_source(lat, scope, ctes, None)
        self.collect_aliases(q, scope)
        outs = []
        unknown = None
        for e in q.expressions:
            got = self.projection(e, scope)
            if isinstance(got, Unknown):
                unknown = got if unknown is None else Unknown(unknown.lineage | got.lineage, unknown.why)
                continue
            outs.extend(got)
        if unknown is not None:
            return Unknown(unknown.lineage | self.flat(outs), unknown.why), scope
        return outs, scope

    def collect_aliases(self, q, scope):
        """Aliases named anywhere in this SELECT (ClickHouse lets any clause use them, even before they are
        defined) plus ClickHouse scalar CTEs. Resolved to a fixed point so alias chains are followed."""
        exprs: dict = {}
        for node in _walk_local(q):
            if isinstance(node, exp.Alias) and node.args.get("alias") is not None:
                exprs.setdefault(self.fold(self.norm(node.args["alias"])), []).append(node.this)
        with_ = q.args.get("with_") if "with_" in q.args else q.args.get("with")
        if isinstance(with_, exp.With):
            for cte in with_.expressions:
                if cte.args.get("scalar") and isinstance(cte.args.get("alias"), exp.TableAlias):
                    exprs.setdefault(self.fold(cte.alias), []).append(cte.this)
        for join in q.args.get("joins") or []:
            if str(join.args.get("kind") or "").upper() == "ARRAY":
                for e in ([join.this] + list(join.args.get("expressions") or [])):
                    if isinstance(e, exp.Alias):
                        exprs.setdefault(self.fold(e.alias), []).append(e.this)
        if not exprs:
            return
        lin = {name: EMPTY for name in exprs}
        for _ in range(_MAX_ROUNDS):
            scope.aliases = lin
            new = {name: _union(self.value(e, scope) for e in es) for name, es in exprs.items()}
            if new == lin:
                break
            lin = new
        else:
            lin = {name: frozenset({("?", "alias cycle")}) for name in exprs}
        scope.aliases = lin

    def projection(self, e, scope):
        if isinstance(e, exp.Apply):
            # ClickHouse "* APPLY(f)": one output per column, each derived from that column alone.
            return self.projection(e.this, scope)
        if isinstance(e, exp.Star):
            return self.star(e, scope, scope.merged)
        if isinstance(e, exp.Column) and isinstance(e.this, exp.Star):
            src = self.find_source(e, scope)
            if src is None:
                return Unknown({("?", "t.* of an unknown source")}, "t.* of an unknown source")
            if src.cols is None:
                return Unknown(src.all(), f"{src.alias}.* over a table whose columns are unknown")
            return self.star(e.this, scope, list(src.cols))
        if isinstance(e, exp.Columns):
            return Unknown(self.scope_all(scope), "COLUMNS(...) matcher")
        # The name the server will report, where it is predictable (a column or an alias), as the dialect
        # folds it; None otherwise (the server names it: "lower", "?column?", the expression's text).
        name = None
        if isinstance(e, exp.Alias):
            alias = e.args.get("alias")
            name = self.norm(alias) if isinstance(alias, exp.Identifier) else (e.alias or None)
        elif isinstance(e, exp.Column):
            name = self.norm(e.this) if isinstance(e.this, exp.Identifier) else (e.name or None)
        return [(name, self.value(e, scope))]

    def value(self, e, scope):
        """The lineage of the value of expression e: its sources' items as they are when e passes one
        value through unchanged (exact_passthrough), else derived ("e")."""
        lin = self.expr(e, scope)
        return lin if _exact(e) else _derive(lin)

    def star(self, star, scope, cols):
        if isinstance(cols, Unknown):
            return cols
        cols = list(cols)
        excl = star.args.get("except_") if "except_" in star.args else star.args.get("except")
        if excl:
            drop = {self.fold(self.norm(c.this) if isinstance(c.this, exp.Identifier) else c.name) for c in excl}
            cols = [(n, lin) for n, lin in cols if n is None or self.fold(n) not in drop]
        repl = star.args.get("replace")
        if repl:
            by = {self.fold(r.alias): self.value(r.this, scope) for r in repl if isinstance(r, exp.Alias)}
            # ClickHouse REPLACE keeps the column's position and takes the new expression's lineage.
            cols = [(n, by[self.fold(n)]) if n is not None and self.fold(n) in by else (n, lin) for n, lin in cols]
        return cols

    def scope_all(self, scope):
        return _union(s.all() for s in scope.sources) or frozenset({("?", "no sources")})

    # ---- FROM items --------------------------------------------------------------------------------------
    def add_source(self, node, scope, ctes, join):
        src = self.make_source(node, scope, ctes)
        if src is None:
            return
        if join is not None and str(join.args.get("kind") or "").upper() == "ARRAY":
            return   # ClickHouse ARRAY JOIN: its aliases were collected; * keeps the table's columns
        scope.sources.append(src)
        using = [self.fold(self.norm(u)) if isinstance(u, exp.Identifier) else self.fold(str(u.name))
                 for u in (join.args.get("using") or [])] if join is not None else []
        natural = join is not None and str(join.args.get("method") or "").upper() == "NATURAL"
        right = list(src.cols) if src.cols is not None else Unknown(src.all(), f"columns of {src.alias} unknown")
        left = scope.merged
        if len(scope.sources) == 1:
            scope.merged = right
            return
        if isinstance(left, Unknown) or isinstance(right, Unknown):
            scope.merged = Unknown(self.flat(left) | self.flat(right), "a joined source of unknown columns")
            return
        if natural:
            rnames = {self.fold(n) for n, _ in right if n is not None}
            using = [self.fold(n) for n, _ in left if n is not None and self.fold(n) in rnames]
        if not using:
            scope.merged = left + right
            return
        scope.merged = _merge_using(left, right, using, self.d, natural, self.fold)

    def make_source(self, node, scope, ctes):
        d = self.d
        if isinstance(node, exp.Final):
            node = node.this
        alias_node = node.args.get("alias") if isinstance(node, exp.Expression) else None
        alias = self.norm(alias_node.this) if isinstance(alias_node, exp.TableAlias) and alias_node.this else None
        colnames = [self.norm(c) for c in alias_node.columns] if isinstance(alias_node, exp.TableAlias) \
            and alias_node.columns else None
        if isinstance(node, exp.Table):
            this = node.this
            if isinstance(this, exp.Identifier):
                name = self.norm(this)
                db = node.args.get("db")
                if db is None and name in ctes:
                    kind, cols = ctes[name]
                    if kind == "pending":
                        return self._src(alias or name, None, pending=True)
                    if isinstance(cols, Unknown):
                        return self._src(alias or name, None, any_lineage=cols.lineage)
                    return self._src(alias or name, self._rename(cols, colnames))
                if db is None and d == "mysql" and name == "dual":
                    return None
                table = self.resolve_ref((self.norm(db) if isinstance(db, exp.Identifier) else None, name))
                known = self.columns_of(table)
                cols = None
                if known is not None:
                    gen = self.generated_of(table)
                    cols = [(c, self._base(table, c, gen)) for c in known]
                    cols = self._rename(cols, colnames)
                src = self._src(alias or name, cols, table)
                for j in node.args.get("joins") or []:       # MySQL UPDATE t JOIN s ...
                    self.add_source(j.this, scope, ctes, j)
                return src
            if node.args.get("rows_from"):
                args_lin = _union(self.expr(t, scope) for t in node.args["rows_from"])
                return self._func_source(alias, colnames, args_lin, None)
            if isinstance(this, exp.Func):
                return self._func_source(alias or func_name(this), colnames, self.expr(this, scope), this)
            return _Source((alias or "?"), None, any_lineage=frozenset({("?", "unknown FROM item")}))
        if isinstance(node, exp.Subquery):
            cols = self.query(node, ctes, scope)
            return self._derived(alias, colnames, cols)
        if isinstance(node, exp.Lateral):
            inner = node.this
            if isinstance(inner, exp.Subquery):
                cols = self.query(inner, ctes, scope)
                return self._derived(alias, colnames, cols)
            return self._func_source(alias, colnames, self.expr(inner, scope), inner)
        if isinstance(node, exp.Unnest):
            lin = _derive(_union(self.expr(e, scope) for e in node.expressions))
            width = len(node.expressions) + (1 if node.args.get("offset") else 0)
            names = colnames or ([alias] if alias and width == 1 else None)
            if names and len(names) == width:
                return self._src(alias or "unnest", [(n, lin) for n in names])
            return self._src(alias or "unnest", [(f"unnest{i}", lin) for i in range(width)])
        if isinstance(node, exp.Values):
            if d == "clickhouse":
                # ClickHouse values('a UInt8, b String', ...) declares its columns in a string.
                return self._src(alias or "values", None, any_lineage=EMPTY)
            cols = self.values(node, scope)
            return self._derived(alias, colnames, cols)
        if isinstance(node, _QUERY):
            return self._derived(alias, colnames, self.query(node, ctes, scope))
        return _Source((alias or "?"), None, any_lineage=frozenset({("?", f"FROM {type(node).__name__}")}))

    def _derived(self, alias, colnames, cols):
        if isinstance(cols, Unknown):
            return self._src(alias or "?", None, any_lineage=cols.lineage | {("?", cols.why)})
        return self._src(alias or "?", self._rename(cols, colnames))

    def _src(self, alias, cols, table=None, any_lineage=EMPTY, pending=False):
        return _Source(self.fold(alias), cols, table, any_lineage, pending, self.fold)

    def _func_source(self, alias, colnames, args_lin, func):
        alias = self.fold(alias or "?")
        args_lin = _derive(args_lin)
        if colnames:
            return _Source(alias, [(n, args_lin) for n in colnames], any_lineage=args_lin, fold=self.fold)
        fname = func_name(func) if isinstance(func, exp.Func) else ""
        single = {"generate_series": None, "exploding_generate_series": None, "generateseries": None,
                  "unnest": None, "generate_subscripts": None, "numbers": "number", "numbers_mt": "number",
                  "zeros": "zero", "zeros_mt": "zero", "string_to_table": None, "regexp_split_to_table": None,
                  "json_array_elements": None, "jsonb_array_elements": None, "json_array_elements_text": None,
                  "jsonb_array_elements_text": None}
        if fname in single:
            return _Source(alias, [(single[fname] or alias, args_lin)], any_lineage=args_lin, fold=self.fold)
        # A set-returning function of unknown shape: its columns derive from its arguments.
        return _Source(alias, None, any_lineage=args_lin, fold=self.fold)

    # ---- DML with RETURNING --------------------------------------------------------------------------------
    def written(self, tree):
        """Everything the values a statement stores may derive from: INSERT's rows, UPDATE's, ON CONFLICT's and
        MERGE's assignments (in a data-modifying CTE too), SELECT ... INTO's and CREATE ... AS's columns. A key
        with masking rules must not copy a masked value into a column it then reads in clear."""
        self._written = set()
        try:
            if isinstance(tree, exp.Create):
                body = tree.args.get("expression")
                if isinstance(body, exp.Expression):
                    self._written |= self.flat(self.query(body, {}, None))
            elif isinstance(tree, _QUERY + _DML):
                out = self.query(tree, {}, None)
                if isinstance(tree, exp.Select) and tree.args.get("into") is not None:
                    self._written |= self.flat(out)
            return frozenset(self._written)
        except RecursionError:
            raise
        except Exception as exc:  # untraceable: everything may flow into the stored values
            if hasattr(exc, "status"):
                raise
            _log.exception("lineage of written values failed")
            return frozenset({("?", type(exc).__name__)})
        finally:
            self._written = None

    def dml(self, q, ctes, outer):
        ctes = self.bind_ctes(q, ctes, outer)
        returning = q.args.get("returning")
        if returning is None and self._written is None:
            return []
        scope = _Scope(outer, ctes)
        target = q.this
        if isinstance(target, exp.Schema):
            target = target.this
        self.add_source(target, scope, ctes, None)
        extra = set()
        from_ = q.args.get("from_") if "from_" in q.args else q.args.get("from")
        if from_ is not None:
            self.add_source(from_.this, scope, ctes, None)
        using = q.args.get("using")
        for u in (using if isinstance(using, list) else [using] if isinstance(using, exp.Expression) else []):
            self.add_source(u, scope, ctes, None)
        # Values written by the statement flow into the returned row: count them as sources of every column.
        src_q = q.args.get("expression") if isinstance(q, exp.Insert) else None
        if src_q is not None:
            extra |= self.flat(self.query(src_q, ctes, scope))
        assignments = list(q.expressions) if isinstance(q, exp.Update) else []
        conflict = q.args.get("conflict")
        if conflict is not None:
            assignments += list(conflict.args.get("expressions") or [])
        for a in assignments:
            if isinstance(a, exp.EQ):
                extra |= self.expr(a.expression, scope)
        if isinstance(q, exp.Merge):
            for src in scope.sources[1:]:
                extra |= src.all()
            for when in q.find_all(exp.When):
                then = when.args.get("then")
                if isinstance(then, exp.Expression):
                    extra |= self.expr(then, scope)
        if self._written is not None:
            self._written |= extra
        if returning is None:
            return []
        outs = []
        for e in returning.expressions:
            got = self.projection(e, _with_merged_target(scope))
            if isinstance(got, Unknown):
                return Unknown(got.lineage | extra, got.why)
            outs.extend(got)
        return [(n, lin | frozenset(extra)) for n, lin in outs]

    # ---- expressions ---------------------------------------------------------------------------------------
    def find_source(self, col, scope):
        """The FROM item a qualified column names; for MySQL/MariaDB a _Source merging every item the
        qualifier could name (table aliases are case-sensitive or not with lower_case_table_names, and
        normalize_identifier has already lowercased them): the lineage then covers both readings."""
        found = self.find_sources(col, scope)
        if not found:
            return None
        if len(found) == 1:
            return found[0]
        cols = None
        if all(f.cols is not None for f in found):
            cols = [(n, lin) for f in found for n, lin in f.cols]
        return _Source(found[0].alias, cols, None, _union(f.all() for f in found), fold=self.fold)

    def find_sources(self, col, scope):
        qual = col.args.get("table")
        if qual is None:
            return []
        fold = self.fold
        qname = fold(self.norm(qual))
        db = col.args.get("db")
        dbname = fold(self.norm(db)) if isinstance(db, exp.Identifier) else None
        out = []
        s = scope
        while s is not None:
            for src in s.sources:
                if dbname is not None:
                    if src.table is not None and fold(src.table[0]) == dbname and fold(src.table[1]) == qname:
                        out.append(src)
                elif src.alias == qname:
                    out.append(src)
            if out and self.d != "mysql":
                return out[:1]
            s = s.parent
        return out

    def expr(self, e, scope):
        """Everything an expression's value may derive from, including subqueries inside it."""
        out = set()
        stack = [e]
        while stack:
            node = stack.pop()
            if not isinstance(node, exp.Expression):
                continue
            if isinstance(node, exp.Column):
                out |= self.column(node, scope)
                continue
            if isinstance(node, exp.Lambda):
                # x -> f(x): its parameters are the values of the arrays it is applied to (the call's other
                # arguments, traced there), not columns
                inner = _Scope(scope, scope.ctes)
                inner.aliases = {self.fold(self.norm(p) if isinstance(p, exp.Identifier) else p.name): EMPTY
                                 for p in node.expressions}
                out |= self.expr(node.this, inner)
                continue
            if isinstance(node, exp.Dot) and isinstance(node.this, exp.Paren) and \
                    isinstance(node.this.this, exp.Column) and not node.this.this.args.get("table") and \
                    isinstance(node.expression, exp.Identifier):
                # PostgreSQL (x).f: the column f of the row x, or the call f(x) (then a whole-row value).
                ref = exp.Column(this=node.expression.copy(), table=node.this.this.this.copy())
                if self.find_source(ref, scope) is not None:
                    out |= self.column(ref, scope)
                    continue
            if isinstance(node, _COMPOSITE_NODES) or (isinstance(node, exp.Func)
                                                      and func_name(node) in _COMPOSITE_FUNCS):
                inner = set()
                for v in node.args.values():
                    for x in (v if isinstance(v, list) else [v]):
                        if isinstance(x, exp.Expression):
                            inner |= self.expr(x, scope)
                out |= _whole(inner)
                continue
            if isinstance(node, exp.Star):
                if not isinstance(node.parent, exp.Count):
                    out |= _whole(self.flat(scope.merged)) if scope.sources else EMPTY
                continue
            if isinstance(node, exp.Exists):
                inner = node.this
                out |= _derive(self.refs(inner.this if isinstance(inner, exp.Subquery) else inner, scope))
                continue
            if isinstance(node, (_QUERY, _DML)):
                out |= self.flat(self.query(node, scope.ctes, scope)) | _derive(self.refs(node, scope))
                continue
            for v in node.args.values():
                if isinstance(v, list):
                    stack.extend(v)
                elif isinstance(v, exp.Expression):
                    stack.append(v)
        return frozenset(out)

    def refs(self, q, scope):
        """Column references in a query's clauses other than its output (used for EXISTS and as a
        conservative extra for subqueries inside an output expression)."""
        if isinstance(q, exp.Subquery):
            return self.refs(q.this, scope)
        if isinstance(q, exp.SetOperation):
            return self.refs(q.left, scope) | self.refs(q.right, scope)
        if not isinstance(q, exp.Select):
            return EMPTY
        _, inner = self.select(q, scope.ctes, scope)
        out = set()
        for key in ("where", "having", "qualify", "prewhere"):
            v = q.args.get(key)
            if v is not None:
                out |= self.expr(v, inner)
        for join in q.args.get("joins") or []:
            if join.args.get("on") is not None:
                out |= self.expr(join.args["on"], inner)
        return frozenset(out)

    def column(self, col, scope):
        if isinstance(col.this, exp.Star):
            # t.* inside an expression (row_to_json(c.*)): a whole-row value of that source.
            src = self.find_source(col, scope)
            return _whole(src.all()) if src is not None else frozenset({("?", "t.* of an unknown source")})
        name = self.fold(self.norm(col.this) if isinstance(col.this, exp.Identifier) else col.name)
        qual = col.args.get("table")
        if qual is not None:
            src = self.find_source(col, scope)
            if src is not None:
                lin, found = src.col(name)
                if found:
                    return lin
                if src.cols is None and (src.table is None or self.d != "postgres"):
                    return lin if lin is not None else EMPTY
                # Not one of its columns (or its columns are unknown): PostgreSQL reads x.f as the call f(x)
                # (attribute notation: c.row_to_json, c.to_jsonb, c.text, a user's f), a whole-row value.
                unplaced = _unplaced(src)
                self.unplaced = self.unplaced or bool(unplaced)
                return _whole(src.all()) | (lin or EMPTY) | unplaced
            # Not a FROM item: a struct/nested field or a name we cannot place; take every candidate.
            qname = self.fold(self.norm(qual))
            out = set(self.unqualified(qname, scope)) | set(self.unqualified(f"{qname}.{name}", scope))
            db = col.args.get("db")
            schema = self.norm(db).lower() if isinstance(db, exp.Identifier) else self.default_schema.lower()
            out.add(("c", schema, qname.lower(), name.lower()))
            return frozenset(out)
        if isinstance(col.this, exp.Identifier) and not col.this.args.get("quoted") and \
                col.this.this.lower() in _VALUE_KEYWORDS.get(self.d, ()):
            return EMPTY     # PostgreSQL user, current_role, system_user; MySQL UTC_DATE ...: the server's values
        return self.unqualified(name, scope)

    def unqualified(self, name, scope):
        out = set()
        s = scope
        placed = False
        walked = []
        while s is not None:
            definite = False
            for src in s.sources:
                lin, found = src.col(name)
                if lin is None:
                    walked.append(src)    # (an unnamed column of it may be the one: its lineage is taken)
                if lin:
                    out |= lin
                definite = definite or found
                if src.alias == name and not found:
                    out |= _whole(src.all())  # PostgreSQL whole-row reference: SELECT c FROM customer c
                    placed = True
            if name in s.aliases:
                out |= s.aliases[name]
                placed = True
            if definite:
                placed = True
                break
            s = s.parent
        if not placed:
            # A name no FROM item in reach is known to hold: the catalogue may be older than the table (a
            # column added since, a generated one among them) or the name something qag cannot place. It may
            # be any column of any table in reach: "t" (columns that cannot be named), refused where a masking
            # rule covers one of those tables.
            for src in walked:
                got = _unplaced(src)
                if got:
                    self.unplaced = True
                    out |= got
        return frozenset(out)


# Unquoted words the server reads as a value (a call without parentheses), never as a column, that sqlglot
# leaves as column references: not names to place.
_VALUE_KEYWORDS = {
    "postgres": frozenset({"user", "current_role", "system_user"}),
    "mysql": frozenset({"utc_date", "utc_time", "utc_timestamp"}),
}


def _unplaced(src):
    """The lineage of a name that may be a column of src the lineage does not know: some column of each table
    src reads ("t"); a source of unknown columns already gave its lineage in col()."""
    if src.cols is None:
        return EMPTY
    if src.table is not None:
        return frozenset({("t", src.table[0].lower(), src.table[1].lower())})
    out = set()
    for _, lin in src.cols:
        for i in lin:
            if i[0] in ("c", "e", "t", "w") and len(i) >= 3:
                out.add(("t", i[1], i[2]))
            elif i[0] == "?":
                out.add(i)
    return frozenset(out)


def _merge_using(left, right, using, dialect, natural, fold=_lower):
    """SELECT * over JOIN ... USING / NATURAL JOIN, per engine (checked against each engine):
    SQLite keeps the left columns in place and drops the right's copies; MySQL/MariaDB put the common
    columns first in the left table's order; PostgreSQL and ClickHouse put them first in USING order
    (PostgreSQL's NATURAL: left order)."""
    uset = set(using)
    k = fold
    rlin = {}
    for n, lin in right:
        if k(n) in uset:
            rlin[k(n)] = rlin.get(k(n), EMPTY) | lin
    if dialect == "sqlite":
        out = [(n, lin | rlin.get(k(n), EMPTY)) for n, lin in left]
        return out + [(n, lin) for n, lin in right if k(n) not in uset]
    llin = {}
    for n, lin in left:
        if k(n) in uset and k(n) not in llin:
            llin[k(n)] = (n, lin)
    order = [k(n) for n, _ in left if k(n) in uset] if (dialect == "mysql" or natural) else list(using)
    seen = set()
    first = []
    for u in order:
        if u in seen:
            continue
        seen.add(u)
        name, lin = llin.get(u, (u, EMPTY))
        first.append((name, lin | rlin.get(u, EMPTY)))
    rest_left = [(n, lin) for n, lin in left if k(n) not in uset]
    rest_right = [(n, lin) for n, lin in right if k(n) not in uset]
    return first + rest_left + rest_right


def _with_merged_target(scope):
    # RETURNING * lists the target table's columns (the first source).
    if scope.sources:
        first = scope.sources[0]
        view = _Scope(scope.parent)
        view.sources = scope.sources
        view.aliases = scope.aliases
        view.ctes = scope.ctes
        view.merged = list(first.cols) if first.cols is not None else Unknown(first.all(), "target columns unknown")
        return view
    return scope


# Expressions whose value is one of their sources' values, unchanged but for case or type: a per-column rule
# applied to the result is exact for them (mask keeps the first character and what follows the last "@", so
# anything that can move characters, e.g. reverse(), substr(), ||, replace(), is not). When in doubt: not.
_WRAPPERS = tuple(c for c in (getattr(exp, n, None) for n in (
    "Alias", "Paren", "Cast", "TryCast", "Lower", "Upper", "Max", "Min", "AnyValue", "FirstValue", "LastValue",
    "NthValue", "Lag", "Lead", "Distinct")) if c is not None)
_INERT = (exp.Literal, exp.Null, exp.Boolean, exp.DataType, exp.Identifier, exp.Var)


# Values that carry none of their sources' characters: a count, a length, a one-way digest, a truth value.
# Any rule on them hides no less than on the column itself.
_NO_TEXT = tuple(c for c in (getattr(exp, n, None) for n in (
    "Count", "ApproxDistinct", "Length", "BitLength", "MD5", "MD5Digest", "SHA", "SHA2", "SHA1Digest",
    "Predicate", "Connector", "Not", "Exists")) if c is not None)


def _exact(e) -> bool:
    """Whether a per-column rule applied to e's value is exact: e is, row by row, one of its sources' values
    as they are (or a literal), or a value that carries none of their characters."""
    if isinstance(e, (exp.Column, exp.Literal, exp.Null, exp.Boolean, exp.Subquery) + _NO_TEXT):
        return True          # a scalar subquery passes its one value; that value's lineage says how it was made
    if isinstance(e, exp.Dot) and isinstance(e.this, exp.Paren) and isinstance(e.this.this, exp.Column):
        return True          # (x).f: a field of a row (a call f(x) is a whole-row value, "w", whatever this says)
    if isinstance(e, (exp.Window, exp.Filter, exp.Collate)):
        return _exact(e.this)    # PARTITION BY / ORDER BY / FILTER choose rows, COLLATE an order: not the value
    if isinstance(e, exp.Case):
        return all(_exact(i.args.get("true")) for i in e.args.get("ifs") or []) and \
            (e.args.get("default") is None or _exact(e.args["default"])) and e.this is None
    if isinstance(e, exp.If):
        return _exact(e.args.get("true")) and (e.args.get("false") is None or _exact(e.args["false"]))
    if isinstance(e, (exp.Coalesce, getattr(exp, "Nullif", exp.Coalesce))):
        return _exact(e.this) and all(_exact(x) for x in e.expressions or [])
    if isinstance(e, _WRAPPERS) and isinstance(e.this, exp.Expression):
        for key, v in e.args.items():
            if key == "this" or v is None or isinstance(v, (bool, str)):
                continue
            for x in (v if isinstance(v, list) else [v]):
                if isinstance(x, exp.Expression) and not isinstance(x, _INERT) and not \
                        (isinstance(e, (exp.Lag, exp.Lead)) and _exact(x)):
                    return False
        return _exact(e.this)
    return False


def _walk_local(q):
    """Nodes of a statement without descending into nested queries."""
    stack = list(q.args.values())
    while stack:
        v = stack.pop()
        if isinstance(v, list):
            stack.extend(v)
            continue
        if not isinstance(v, exp.Expression):
            continue
        if isinstance(v, (_QUERY, exp.With)):
            continue
        yield v
        stack.extend(v.args.values())


def _same(a, b):
    if a is None or b is None:
        return False
    if isinstance(a, Unknown) or isinstance(b, Unknown):
        return isinstance(a, Unknown) and isinstance(b, Unknown) and a.lineage == b.lineage
    return a == b
