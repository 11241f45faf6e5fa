"""PostgreSQL statements read by PostgreSQL's own parser (libpg_query through pglast): the authority for
what a statement contains — its relations, function calls and column references, with every name as the
server decodes and folds it (U&"..." escapes, UESCAPE, quoting, truncation to 63 bytes).

sqlglot still computes lineage; it is given the statement re-spelled from PostgreSQL's tokens (every
U&"..." name, E'...', U&'...' and dollar-quoted literal written in the plain form, comments dropped), so
it reads the names the server reads. `cross_check` then compares what both parsers found and refuses a
statement on which they disagree: a construct one of them misreads is refused by construction, whatever
it is, instead of being one more entry on a list.
"""

from __future__ import annotations

import functools

from sqlglot import exp

from .errors import GovernanceError

try:
    from pglast import ast as pg_ast
    from pglast.parser import ParseError, parse_sql, scan
except ImportError:  # pragma: no cover - pglast is a base dependency
    pg_ast = None

NAMEDATALEN = 64


class Reading:
    """What PostgreSQL's parser read in one statement. Shared through the cache: treat as read-only."""

    __slots__ = ("columns", "functions", "indirections", "relations", "scopes", "stmt", "syntax", "text")

    def __init__(self, stmt, text, relations, functions, columns, indirections, scopes, syntax=frozenset()):
        self.stmt = stmt                  # the pglast statement node
        self.text = text                  # the statement re-spelled for sqlglot
        self.relations = relations        # tuple[(schema | None, name)] of every RangeVar (CTE names included)
        self.functions = functions        # tuple[(schema | None, name)] of every FuncCall, as PostgreSQL names it
        self.columns = columns            # tuple[tuple[str, ...]] of every ColumnRef's fields ("*" for a star)
        self.indirections = indirections  # tuple[(ref fields, name)]: (x).name field selections
        self.scopes = scopes              # tuple[(ref fields, tuple[FROM items])]: qualified refs and what is visible
        self.syntax = syntax              # names of call-like syntax PostgreSQL does not read as a FuncCall (ROW, ...)
        # (FuncCalls PostgreSQL's grammar makes of SQL-standard syntax, x AT TIME ZONE z -> timezone(z, x), are
        # in functions and in syntax: sqlglot reads them as nodes of their own.)


def _refuse(why: str) -> GovernanceError:
    return GovernanceError(400, "invalid_sql", f"qag cannot read this PostgreSQL statement exactly as the server "
                                               f"would: {why}")


@functools.lru_cache(maxsize=2048)
def read(sql: str) -> Reading:
    """Parse exactly one statement with PostgreSQL's parser; 400 multiple_statements / invalid_sql."""
    if pg_ast is None:  # pragma: no cover
        raise _refuse("pglast (PostgreSQL's parser) is not installed")
    if "\x00" in sql:
        raise _refuse("it contains a NUL character")
    try:
        stmts = parse_sql(sql)
        tokens = scan(sql)
    except ParseError as exc:
        raise GovernanceError(400, "invalid_sql",
                              f"PostgreSQL cannot parse the SQL ({str(exc).splitlines()[0][:200]}); "
                              "fix the statement") from None
    except Exception as exc:  # noqa: BLE001 - anything else the parser raises is still a refusal, never a 500
        raise _refuse(f"{type(exc).__name__}") from None
    stmts = [s for s in stmts if s.stmt is not None]
    if not stmts:
        raise GovernanceError(400, "invalid_sql", "the SQL is empty: write exactly one statement")
    if len(stmts) > 1:
        raise GovernanceError(400, "multiple_statements",
                              f"the SQL holds {len(stmts)} statements; a query must be exactly one statement")
    text = respell(sql, tokens)
    c = _Collector()
    try:
        c.ctes = _cte_queries(stmts[0].stmt)
        c.walk(stmts[0].stmt, ())
    except RecursionError:
        raise GovernanceError(400, "invalid_sql", "the statement is nested too deeply to analyse") from None
    return Reading(stmts[0].stmt, text, tuple(c.relations), tuple(dict.fromkeys(c.functions)), tuple(c.columns),
                   tuple(c.indirections), tuple(c.scopes), frozenset(c.syntax))


# ---- re-spelling for sqlglot ------------------------------------------------------------------------------
def respell(sql: str, tokens) -> str:
    out = []
    pos = 0
    k = 0
    n = len(tokens)
    while k < n:
        t = tokens[k]
        a, b = t.start, t.end + 1
        out.append(sql[pos:a])
        text = sql[a:b]
        name = t.name
        if name in ("UIDENT", "USCONST"):
            esc = "\\"
            # UESCAPE 'c' may follow after comments; they go with it
            j = k + 1
            while j < n and tokens[j].name in ("C_COMMENT", "SQL_COMMENT"):
                j += 1
            if j + 1 < n and tokens[j].name == "UESCAPE" and tokens[j + 1].name == "SCONST":
                lit = sql[tokens[j + 1].start:tokens[j + 1].end + 1]
                if len(lit) != 3 or lit[0] != "'" or lit[2] != "'":
                    raise _refuse(f"UESCAPE {lit} is not one character in quotes")
                esc = lit[1]
                b = tokens[j + 1].end + 1
                k = j + 1
            body = _unquote(text[2:], text[2])
            value = decode_unicode_escapes(body, esc)
            if name == "UIDENT":
                value = truncate_identifier(value)
                out.append('"' + value.replace('"', '""') + '"')
            else:
                out.append(_plain_literal(value))
        elif name == "SCONST" and text[:1] in ("e", "E"):
            out.append(_plain_literal(decode_e_string(_unquote(text[1:], "'"))))
        elif name == "SCONST" and text[:1] == "$":
            tag_end = text.index("$", 1) + 1
            out.append(_plain_literal(text[tag_end:len(text) - tag_end]))
        elif name in ("C_COMMENT", "SQL_COMMENT"):
            out.append(" ")
        else:
            out.append(text)
        pos = b
        k += 1
    out.append(sql[pos:])
    return "".join(out)


def _unquote(quoted: str, q: str) -> str:
    if len(quoted) < 2 or quoted[0] != q or quoted[-1] != q:
        raise _refuse(f"unexpected quoting {quoted[:20]!r}")
    return quoted[1:-1].replace(q + q, q)


def _plain_literal(value: str) -> str:
    if "\x00" in value:
        raise _refuse("a literal holds a NUL character")
    return "'" + value.replace("'", "''") + "'"


def truncate_identifier(name: str) -> str:
    """PostgreSQL keeps the first NAMEDATALEN-1 bytes of a name (whole characters)."""
    raw = name.encode("utf-8")
    if len(raw) < NAMEDATALEN:
        return name
    return raw[:NAMEDATALEN - 1].decode("utf-8", "ignore")


def decode_unicode_escapes(body: str, esc: str = "\\") -> str:
    """U&'...' / U&"..." escapes as PostgreSQL reads them (str_udeescape): esc esc, esc XXXX, esc + XXXXXX,
    surrogate pairs joined."""
    out = []
    i, n = 0, len(body)
    pending_high = None
    while i < n:
        c = body[i]
        if c != esc:
            if pending_high is not None:
                raise _refuse("a Unicode escape starts a surrogate pair it does not finish")
            out.append(c)
            i += 1
            continue
        if body[i + 1:i + 2] == esc:
            out.append(esc)
            i += 2
            continue
        if body[i + 1:i + 2] == "+":
            digits, i = body[i + 2:i + 8], i + 8
        else:
            digits, i = body[i + 1:i + 5], i + 5
        if not digits or any(ch not in "0123456789abcdefABCDEF" for ch in digits) or len(digits) not in (4, 6):
            raise _refuse("an invalid Unicode escape")
        cp = int(digits, 16)
        if 0xD800 <= cp <= 0xDBFF:
            if pending_high is not None:
                raise _refuse("an invalid Unicode surrogate pair")
            pending_high = cp
            continue
        if 0xDC00 <= cp <= 0xDFFF:
            if pending_high is None:
                raise _refuse("an invalid Unicode surrogate pair")
            cp = 0x10000 + ((pending_high - 0xD800) << 10) + (cp - 0xDC00)
            pending_high = None
        elif pending_high is not None:
            raise _refuse("an invalid Unicode surrogate pair")
        if cp == 0 or cp > 0x10FFFF:
            raise _refuse("a Unicode escape outside the valid range")
        out.append(chr(cp))
    if pending_high is not None:
        raise _refuse("an unfinished Unicode surrogate pair")
    return "".join(out)


_E_SIMPLE = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def decode_e_string(body: str) -> str:
    """The value of E'...' (body already without the doubled quotes undone: \\' stays as written)."""
    out = []
    i, n = 0, len(body)
    while i < n:
        c = body[i]
        if c != "\\" or i + 1 >= n:
            out.append(c)
            i += 1
            continue
        d = body[i + 1]
        if d in _E_SIMPLE:
            out.append(_E_SIMPLE[d])
            i += 2
        elif d in "01234567":
            j = i + 1
            while j < n and j < i + 4 and body[j] in "01234567":
                j += 1
            out.append(chr(int(body[i + 1:j], 8) & 0xFF))
            i = j
        elif d == "x" and i + 2 < n and body[i + 2] in "0123456789abcdefABCDEF":
            j = i + 2
            while j < n and j < i + 4 and body[j] in "0123456789abcdefABCDEF":
                j += 1
            out.append(chr(int(body[i + 2:j], 16)))
            i = j
        elif d in "uU":
            width = 4 if d == "u" else 8
            digits = body[i + 2:i + 2 + width]
            if len(digits) != width or any(ch not in "0123456789abcdefABCDEF" for ch in digits):
                raise _refuse("an invalid Unicode escape in an E'...' string")
            out.append(chr(int(digits, 16)) if int(digits, 16) <= 0x10FFFF else "?")
            i += 2 + width
        else:
            out.append(d)
            i += 2
    return "".join(out)


# ---- what the parser found ---------------------------------------------------------------------------------
def _strs(items) -> tuple[str, ...]:
    out = []
    for f in items or ():
        if isinstance(f, pg_ast.String):
            out.append(f.sval)
        elif isinstance(f, pg_ast.A_Star):
            out.append("*")
        else:
            out.append("?")
    return tuple(out)


class _Collector:
    """One walk over the parse tree: relations, function calls, column references, and for each
    qualified reference the FROM items visible where it stands (for attribute notation)."""

    def __init__(self):
        self.relations: list = []
        self.functions: list = []
        self.columns: list = []
        self.indirections: list = []
        self.scopes: list = []
        self.syntax: set = set()
        self.ctes: dict = {}

    def walk(self, node, visible) -> None:
        if isinstance(node, tuple):
            for v in node:
                self.walk(v, visible)
            return
        if not isinstance(node, pg_ast.Node):
            return
        if isinstance(node, pg_ast.SelectStmt):
            items = tuple(_from_items(node.fromClause, self.ctes)) + visible
            for name in node.__slots__:
                if name == "fromClause":
                    continue
                self.walk(getattr(node, name), items)
            # FROM items see the outer scope (LATERAL and function arguments see earlier siblings too).
            self.walk(node.fromClause, items)
            return
        if isinstance(node, (pg_ast.UpdateStmt, pg_ast.DeleteStmt, pg_ast.MergeStmt)):
            extra = [node.relation] + list(getattr(node, "fromClause", None) or getattr(node, "usingClause", None)
                                           or ())
            if isinstance(node, pg_ast.MergeStmt):
                extra = [node.relation, node.sourceRelation]
            visible = tuple(_from_items(tuple(x for x in extra if x is not None), self.ctes)) + visible
        elif isinstance(node, pg_ast.InsertStmt):
            visible = tuple(_from_items((node.relation,), self.ctes)) + visible
        syntax = _SYNTAX_NAMES.get(type(node).__name__)
        if syntax:
            self.syntax.update(syntax)
        if isinstance(node, pg_ast.RangeVar):
            self.relations.append((node.schemaname, node.relname))
        elif isinstance(node, pg_ast.FuncCall):
            parts = _strs(node.funcname)
            self.functions.append((parts[-2] if len(parts) > 1 else None, parts[-1]))
            if int(node.funcformat or 0) == _COERCE_SQL_SYNTAX:
                self.syntax.add(parts[-1])
        elif isinstance(node, pg_ast.ColumnRef):
            fields = _strs(node.fields)
            self.columns.append(fields)
            if len(fields) >= 2:
                self.scopes.append((fields, visible))
        elif isinstance(node, pg_ast.A_Indirection) and isinstance(node.arg, pg_ast.ColumnRef):
            for ind in node.indirection or ():
                if isinstance(ind, pg_ast.String):
                    self.indirections.append((_strs(node.arg.fields), ind.sval, visible))
                    break
                break
        for name in node.__slots__:
            self.walk(getattr(node, name), visible)


_COERCE_SQL_SYNTAX = 3   # CoercionForm.COERCE_SQL_SYNTAX: a FuncCall the grammar made of SQL-standard syntax

# Call-like syntax PostgreSQL's grammar turns into nodes of their own rather than FuncCall (sqlglot may
# keep them as a call by name).
_SYNTAX_NAMES = {
    "RowExpr": ("row",), "CoalesceExpr": ("coalesce",), "MinMaxExpr": ("greatest", "least"),
    "A_Expr": ("nullif",), "XmlExpr": ("xmlelement", "xmlforest", "xmlconcat", "xmlparse", "xmlpi", "xmlroot",
                                       "xmlserialize", "xmlexists", "xmlattributes"), "XmlSerialize": ("xmlserialize",),
    "SQLValueFunction": ("current_date", "current_time", "current_timestamp", "localtime", "localtimestamp",
                         "current_role", "current_user", "user", "session_user", "current_catalog",
                         "current_schema"),
    "GroupingFunc": ("grouping",), "A_ArrayExpr": ("array",), "BooleanTest": (), "TypeCast": ("cast",),
    "CollateClause": ("collate",),
}


def _cte_queries(stmt) -> dict:
    """Every CTE of the statement by name (the first one of a name): a FROM item naming one reads it."""
    out: dict = {}

    def walk(node):
        if isinstance(node, tuple):
            for v in node:
                walk(v)
            return
        if not isinstance(node, pg_ast.Node):
            return
        if isinstance(node, pg_ast.CommonTableExpr):
            out.setdefault(node.ctename, node.ctequery)
        for name in node.__slots__:
            walk(getattr(node, name))

    walk(stmt)
    return out


def _from_items(from_clause, ctes=None):
    """(alias, kind, payload) for every FROM item, joins flattened: kind 'rel' (payload (schema, name)),
    'sub' (the subquery, or the CTE it names), 'func' or 'other'."""
    ctes = ctes or {}
    for item in from_clause or ():
        if isinstance(item, pg_ast.JoinExpr):
            yield from _from_items((item.larg, item.rarg), ctes)
            if item.alias is not None:
                yield (item.alias.aliasname, "other", None)
            continue
        alias = item.alias.aliasname if getattr(item, "alias", None) is not None else None
        renamed = _strs(item.alias.colnames) if getattr(item, "alias", None) is not None and item.alias.colnames \
            else ()
        if renamed:
            # t(a, b): the first columns take these names; which names the rest have is not looked up here
            yield (alias, "renamed", renamed)
        elif isinstance(item, pg_ast.RangeVar) and item.schemaname is None and item.relname in ctes:
            yield (alias or item.relname, "sub", ctes[item.relname])
        elif isinstance(item, pg_ast.RangeVar):
            yield (alias or item.relname, "rel", (item.schemaname, item.relname))
            if alias is None and item.schemaname:
                yield (f"{item.schemaname}.{item.relname}", "rel", (item.schemaname, item.relname))
        elif isinstance(item, pg_ast.RangeSubselect):
            yield (alias, "sub", item.subquery)
        elif isinstance(item, pg_ast.RangeFunction):
            yield (alias, "func", item)
        else:
            yield (alias, "other", None)


def attribute_calls(reading: Reading, columns_of=None, resolve=None) -> tuple[str, ...]:
    """Names used as `x.name` or `(x).name` where x is a FROM item and name is not one of its columns: in
    PostgreSQL that is the function call name(x) (attribute notation), a whole-row value. A FROM item whose
    columns are unknown (no catalogue, a function) gives none."""
    out = []
    for fields, visible in reading.scopes:
        qual, name = fields[:-1], fields[-1]
        if name == "*":
            continue
        item = _lookup(qual, visible)
        if item is not None and not _has_column(item, name, columns_of, resolve):
            out.append(name)
    for fields, name, visible in reading.indirections:
        item = _lookup(fields, visible)
        if item is not None and not _has_column(item, name, columns_of, resolve):
            out.append(name)
    return tuple(dict.fromkeys(out))


def _lookup(qual, visible):
    key = ".".join(qual)
    for alias, kind, payload in visible:
        if alias == key or (kind == "rel" and len(qual) == 2 and payload == (qual[0], qual[1])):
            return (kind, payload)
        if alias == qual[-1] and len(qual) == 1:
            return (kind, payload)
    return None


def _has_column(item, name, columns_of, resolve) -> bool:
    """False only when the item's columns are known and name is not one of them. (Where they are not known,
    lineage treats x.name of a masked table as a whole-row value; the server refuses a name that is neither.)"""
    kind, payload = item
    if kind == "renamed":
        return True       # some columns renamed, others not: cannot be told apart here (lineage still can)
    if kind == "rel" and columns_of is not None and resolve is not None:
        cols = columns_of(*resolve(payload))
        return cols is None or name in cols
    if kind == "sub":
        names = _output_names(payload, columns_of, resolve)
        return names is None or name in names
    return True


def _output_names(q, columns_of=None, resolve=None, depth=0):
    """The column names a subquery gives its FROM item (None when they cannot be known)."""
    if not isinstance(q, pg_ast.SelectStmt) or depth > 16:
        return None
    if q.larg is not None:
        return _output_names(q.larg, columns_of, resolve, depth + 1)
    names = []
    for t in q.targetList or ():
        if t.name:
            names.append(t.name)
        elif isinstance(t.val, pg_ast.ColumnRef):
            f = _strs(t.val.fields)
            if f[-1] == "*":
                items = list(_from_items(q.fromClause))
                if len(f) > 1:
                    items = [it for it in items if it[0] == f[-2]]
                for _alias, kind, payload in items:
                    if kind == "rel" and columns_of is not None and resolve is not None:
                        cols = columns_of(*resolve(payload))
                    elif kind == "sub":
                        cols = _output_names(payload, columns_of, resolve, depth + 1)
                    else:
                        cols = None
                    if cols is None:
                        return None
                    names.extend(cols)
                continue
            names.append(f[-1])
        else:
            names.append(_figure(t.val) or "?column?")
    return names


def _figure(node):
    """The name PostgreSQL gives an unnamed output column (FigureColnameInternal), None for ?column?."""
    if isinstance(node, pg_ast.ColumnRef):
        f = _strs(node.fields)
        return f[-1] if f[-1] != "*" else None
    if isinstance(node, pg_ast.A_Indirection):
        last = node.indirection[-1] if node.indirection else None
        return last.sval if isinstance(last, pg_ast.String) else _figure(node.arg)
    if isinstance(node, pg_ast.FuncCall):
        return _strs(node.funcname)[-1]
    if isinstance(node, pg_ast.TypeCast):
        inner = _figure(node.arg)
        if inner:
            return inner
        names = _strs(node.typeName.names) if node.typeName is not None else ()
        return names[-1] if names else None
    if isinstance(node, pg_ast.CaseExpr):
        return _figure(node.defresult) or "case" if node.defresult is not None else "case"
    fixed = {"A_ArrayExpr": "array", "RowExpr": "row", "CoalesceExpr": "coalesce", "XmlSerialize": "xmlserialize"}
    if type(node).__name__ in fixed:
        return fixed[type(node).__name__]
    if isinstance(node, pg_ast.MinMaxExpr):
        return "greatest" if int(node.op) == 0 else "least"
    if isinstance(node, pg_ast.SubLink):
        kind = int(node.subLinkType)
        if kind == 0:
            return "exists"
        if kind == 6:        # ARRAY_SUBLINK
            return "array"
        if kind == 4 and isinstance(node.subselect, pg_ast.SelectStmt) and node.subselect.targetList:
            t = node.subselect.targetList[0]
            return t.name or _figure(t.val)
    return None


# ---- agreement between the two parsers --------------------------------------------------------------------
def _sqlglot_function_names(tree) -> tuple[set, set]:
    from sqlglot.dialects.postgres import Postgres

    known = set()
    anonymous = set()
    for node in tree.find_all(exp.Func):
        if isinstance(node, exp.Anonymous):
            this = node.this
            anonymous.add(this.this if isinstance(this, exp.Identifier) and this.quoted else
                          (this.this if isinstance(this, exp.Identifier) else str(this)).lower())
            continue
        known.add(node.sql_name().lower())
        known.update(n.lower() for n in getattr(type(node), "_sql_names", ()) or ())
        known.add(type(node).key.lower())
    parser_names = _parser_function_names(Postgres)
    return known | anonymous, anonymous | {"__parser__:" + n for n in parser_names}


@functools.lru_cache(maxsize=1)
def _parser_function_names(dialect_cls) -> frozenset:
    p = dialect_cls.Parser
    names = set()
    for attr in ("FUNCTIONS", "FUNCTION_PARSERS", "NO_PAREN_FUNCTIONS", "NO_PAREN_FUNCTION_PARSERS"):
        for k in getattr(p, attr, {}) or {}:
            names.add(str(k).lower() if not isinstance(k, str) else k.lower())
    return frozenset(names)


_DATA_STATEMENTS = tuple(getattr(pg_ast, n) for n in ("SelectStmt", "InsertStmt", "UpdateStmt", "DeleteStmt",
                                                      "MergeStmt", "ExplainStmt") if pg_ast is not None)


def cross_check(reading: Reading, tree, normalize) -> None:
    """Refuse (400 invalid_sql) when sqlglot's tree does not name the relations, functions and column
    references PostgreSQL's parser found."""
    from sqlglot.dialects.postgres import Postgres

    # Relations: the same set of (schema, name), both ways.
    pg_rels = {(s, n) for s, n in reading.relations}
    sg_rels = set()
    for t in tree.find_all(exp.Table):
        if isinstance(t.this, exp.Identifier):
            db = t.args.get("db")
            sg_rels.add((normalize(db) if isinstance(db, exp.Identifier) else None, normalize(t.this)))
    # DDL names its objects as plain names (DROP TABLE t has no RangeVar) where sqlglot has a Table: there
    # only a relation PostgreSQL reads and sqlglot misses is a disagreement.
    exact = isinstance(reading.stmt, _DATA_STATEMENTS)
    if (pg_rels != sg_rels) if exact else not pg_rels <= sg_rels:
        diff = sorted(_fmt(x) for x in ((pg_rels ^ sg_rels) if exact else (pg_rels - sg_rels)))
        raise _refuse(f"PostgreSQL's parser and the lineage parser read different tables ({', '.join(diff)})")

    # Functions: each call PostgreSQL sees must be a call in sqlglot's tree (by name, or a built-in sqlglot
    # models under another node); each call sqlglot keeps by name must be one PostgreSQL sees.
    sg_all, _ = _sqlglot_function_names(tree)
    parser_names = _parser_function_names(Postgres)
    pg_names = {n for _, n in reading.functions}
    missing = sorted(n for n in pg_names if n not in sg_all and n.lower() not in sg_all
                     and n.upper().lower() not in parser_names and n not in reading.syntax)
    if missing:
        raise _refuse(f"the lineage parser does not see the call{'s' if len(missing) > 1 else ''} to "
                      f"{', '.join(missing)}")
    for node in tree.find_all(exp.Anonymous):
        this = node.this
        name = normalize(this) if isinstance(this, exp.Identifier) else str(this).lower()
        if name not in pg_names and name not in reading.syntax:
            raise _refuse(f"the lineage parser reads a call to {name} that PostgreSQL does not")

    # Column references: each one PostgreSQL sees (qualifier, name) must be a column in sqlglot's tree.
    sg_cols = set()
    for c in tree.find_all(exp.Column):
        q = c.args.get("table")
        qual = normalize(q) if isinstance(q, exp.Identifier) else None
        name = "*" if isinstance(c.this, exp.Star) else (normalize(c.this) if isinstance(c.this, exp.Identifier)
                                                         else str(c.name))
        sg_cols.add((qual, name))
        sg_cols.add((None, name))
    if any(True for _ in tree.find_all(exp.Star)):
        sg_cols.add((None, "*"))
    for fields in reading.columns:
        key = (fields[-2] if len(fields) > 1 else None, fields[-1])
        if key not in sg_cols:
            raise _refuse(f"the lineage parser does not see the column reference {'.'.join(fields)}")


def _pg_refs(node) -> set:
    """(qualifier, name) of every ColumnRef under a node (subqueries included)."""
    out = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, tuple):
            stack.extend(n)
            continue
        if not isinstance(n, pg_ast.Node):
            continue
        if isinstance(n, pg_ast.ColumnRef):
            f = _strs(n.fields)
            out.add((f[-2] if len(f) > 1 else None, f[-1]))
            continue
        stack.extend(getattr(n, name) for name in n.__slots__)
    return out


def _sg_refs(node, normalize) -> set:
    out = set()
    for c in node.find_all(exp.Column):
        q = c.args.get("table")
        name = "*" if isinstance(c.this, exp.Star) else (normalize(c.this) if isinstance(c.this, exp.Identifier)
                                                         else str(c.name))
        out.add((normalize(q) if isinstance(q, exp.Identifier) else None, name))
        out.add((None, name))
    if isinstance(node, exp.Star) or any(True for _ in node.find_all(exp.Star)):
        out.add((None, "*"))
    return out


def check_outputs(stmt, tree, normalize) -> None:
    """The output columns, position by position: the same number in both parses, and every column reference
    PostgreSQL reads in an output expression is in sqlglot's expression at that position (masking is decided
    per position, so a column sqlglot placed elsewhere would be masked in the wrong place)."""
    if isinstance(stmt, pg_ast.ExplainStmt):
        return
    if not isinstance(stmt, pg_ast.SelectStmt):
        return
    if int(stmt.op or 0) != 0:
        if not isinstance(tree, exp.SetOperation):
            raise _refuse("PostgreSQL reads a set operation where the lineage parser does not")
        check_outputs(stmt.larg, tree.left, normalize)
        check_outputs(stmt.rarg, tree.right, normalize)
        return
    while isinstance(tree, exp.Subquery):
        tree = tree.this
    if stmt.valuesLists is not None or not isinstance(tree, exp.Select):
        return
    targets = stmt.targetList or ()
    if len(targets) != len(tree.expressions):
        raise _refuse(f"PostgreSQL reads {len(targets)} output columns where the lineage parser reads "
                      f"{len(tree.expressions)}")
    for i, (t, e) in enumerate(zip(targets, tree.expressions), 1):
        missing = _pg_refs(t.val) - _sg_refs(e, normalize)
        if missing:
            raise _refuse(f"output column {i} reads {', '.join(sorted('.'.join(x for x in m if x) for m in missing))} "
                          "in PostgreSQL's parse but not in the lineage parser's")


def _fmt(rel) -> str:
    s, n = rel
    return f"{s}.{n}" if s else str(n)
