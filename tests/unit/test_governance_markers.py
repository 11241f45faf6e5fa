"""The `:name` marker scanner read against each database's own lexer (issue 12, class 1): PostgreSQL's
scanner and parser (pglast), SQLite's tokenizer (the sqlite3 module binds by name and counts for us),
and MySQL/MariaDB's rules (backslash escapes under both settings of NO_BACKSLASH_ESCAPES)."""

from __future__ import annotations

import sqlite3

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qag import params as P
from qag.errors import ApiError

pglast = pytest.importorskip("pglast")


def names(sql, dialect):
    return [m[2] for m in P.scan_markers(sql, dialect)]


def refused(sql, dialect):
    with pytest.raises(ApiError) as ei:
        P.scan_markers(sql, dialect)
    assert ei.value.status == 400 and ei.value.code == "invalid_sql"
    return ei.value.message


# ---- PostgreSQL ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sql,want", [
    ("SELECT E'it\\'s :p'", []),                                 # E-string: \' does not end the literal
    ("SELECT e'\\\\' , :q", ["q"]),                              # E'\\' is one backslash, then a marker
    ("SELECT 1 /* a /* b */ :p */", []),                         # comments nest in PostgreSQL
    ("SELECT 1 /* a /* b */ */ , :p", ["p"]),
    ("SELECT $q$ :p $q$, $$ :r $$, :s", ["s"]),
    ('SELECT U&"a:p", U&\'\\0041 :p\', :t', ["t"]),
    ("SELECT x::int, :y::text, a:=1", ["y"]),
    ("SELECT :select, :from_", ["select", "from_"]),            # a keyword is a name after ':'
    ("SELECT 1 -- :p\n, :q", ["q"]),
    ("SELECT arr[1:n]", []),                                     # a slice, not a marker
])
def test_postgres_markers(sql, want):
    assert names(sql, "postgres") == want


@pytest.mark.parametrize("sql,why", [
    ("SELECT $1", "positional parameter"),
    ('SELECT :U&"x"', "one name"),
    ("SELECT :näme", "one name"),
    ("SELECT :e'x'", "one name"),
    ("SELECT 'a\\' :b", "standard_conforming_strings"),         # ends before :b only when scs is on
    ("SELECT 'open", "unterminated"),
    ("SELECT 1 /* open", "unterminated"),
    ("SELECT 1\x00; DROP TABLE t", "NUL"),
])
def test_postgres_refusals(sql, why):
    assert why in refused(sql, "postgres")


_PG_PIECES = st.sampled_from([
    " :a ", " :b ", " 'x:a' ", " E'x\\':a' ", " E'\\\\' ", " /* :a /* :b */ :c */ 1", " $$ :a $$ ",
    " $t$ :b $t$ ", ' 1 AS "col:a" ', ' 2 AS U&"d\\0061t:a" ', " -- :a\n 3", " 1::int ", " 'it''s :a' ",
    " 7 % 2 ", " 'A%' ", " :c::text ", " :a + :b ",
])


@settings(max_examples=300, deadline=None)
@given(st.lists(_PG_PIECES, min_size=1, max_size=12))
def test_postgres_markers_agree_with_the_parser(pieces):
    """Each marker becomes a ParamRef in PostgreSQL's own parse of the native text, and every literal of
    the statement has the same value with markers as $n and with markers as NULL (so no marker was found
    inside a literal, comment or identifier, and none was missed)."""
    sql = "SELECT 0, " + ", ".join(pieces)
    markers = P.scan_markers(sql, "postgres")
    native, got = P.compile_native(sql, "postgres")
    assert list(got) == [m[2] for m in markers]
    tree = pglast.parse_sql(native)
    params = sorted(n.number for n in _nodes(tree) if type(n).__name__ == "ParamRef")
    assert params == list(range(1, len(markers) + 1))
    consts = [repr(n) for n in _nodes(tree) if type(n).__name__ == "A_Const" and not n.isnull]
    neutral = [repr(n) for n in _nodes(pglast.parse_sql(P.neutralize(sql, "postgres")))
               if type(n).__name__ == "A_Const" and not n.isnull]
    assert consts == neutral
    # psycopg2 formats the driver text with the values: every literal % must come back as one %.
    driver, _ = P.compile_sql(sql, "postgres")
    assert driver.replace("%%", "%").replace("%s", "NULL") == P.neutralize(sql, "postgres").replace("%%", "%")


def _nodes(tree):
    from pglast.visitors import Visitor

    found = []

    class V(Visitor):
        def visit(self, ancestors, node):
            found.append(node)

    V()(tree)
    return found


# ---- SQLite: its own tokenizer decides ------------------------------------------------------------------
_SQLITE_PIECES = st.sampled_from([
    " :a ", " :b ", " 'x:a' ", ' "y:a" ', " [z:a] ", " `w:a` ", " 'it''s :c' ",
    " '%' ", " :c ", " 1 ", " /* :a */ 2 ", " -- :b\n 3 ",
])


@settings(max_examples=300, deadline=None)
@given(st.lists(_SQLITE_PIECES, min_size=1, max_size=10))
def test_sqlite_markers_are_sqlite_parameters(pieces):
    sql = "SELECT 0, " + ", ".join(pieces)
    found = sorted(set(names(sql, "sqlite")))
    db = sqlite3.connect(":memory:")
    # SQLite binds named parameters itself: exactly our names must be asked for.
    db.execute(sql.replace("[z:a]", "1").replace('"y:a"', "1").replace("`w:a`", "1"), {n: 1 for n in found})
    for missing in found:
        with pytest.raises(sqlite3.ProgrammingError):
            db.execute(sql.replace("[z:a]", "1").replace('"y:a"', "1").replace("`w:a`", "1"),
                       {n: 1 for n in found if n != missing})
    compiled, order = P.compile_sql(sql, "sqlite")
    assert compiled.count("?") == len(order)


@pytest.mark.parametrize("sql", ["SELECT ?", "SELECT ?1", "SELECT @a", "SELECT $a", "SELECT a:b", "SELECT :a$b",
                                 "SELECT [open"])
def test_sqlite_refusals(sql):
    refused(sql, "sqlite")


def test_sqlite_unterminated_comment_runs_to_the_end():
    assert names("SELECT :a /* :b", "sqlite") == ["a"]


# ---- MySQL / MariaDB --------------------------------------------------------------------------------------
@pytest.mark.parametrize("sql,want", [
    ("SELECT 'a''b :x', \"c:y\", `d:z` , :p", ["p"]),
    ("SELECT 1 # :x\n, :p", ["p"]),
    ("SELECT 1 -- :x\n, :p", ["p"]),
    ("SELECT 5--:p", ["p"]),                     # -- without a space after it is minus minus
    ("SELECT 'a\\\\', :p", ["p"]),               # \\ reads the same with and without backslash escapes
    ("SELECT @v := 1, :p", ["p"]),
    ("SELECT 1 /* :x */, :p", ["p"]),
])
def test_mysql_markers(sql, want):
    assert names(sql, "mysql") == want


@pytest.mark.parametrize("sql,why", [
    ("SELECT 'it\\'s :p'", "NO_BACKSLASH_ESCAPES"),
    ("SELECT \"a\\\" :p\"", "NO_BACKSLASH_ESCAPES"),
    ("SELECT 1 /*! , :p */", "executable"),
    ("SELECT 1 /*M!100000 , :p */", "executable"),
    ("SELECT 1 /* a /* b */", "comment inside a comment"),
    ("SELECT ?", "placeholder"),
    ("SELECT :näme", "one name"),
    ("SELECT 'open", "does not end"),
])
def test_mysql_refusals(sql, why):
    assert why in refused(sql, "mysql")


def _mysql_connector_substitute(driver_sql: str, values: tuple) -> str:
    """What mysql-connector's cursor does with a tuple of values (cursor.py RE_PY_PARAM): every %s in order."""
    import re

    it = iter(values)
    return re.sub("%s", lambda m: next(it), driver_sql)


@pytest.mark.parametrize("sql,values,want", [
    ("SELECT 7 % 2, 'A%s' , :a", ("'v'",), "SELECT 7 % 2, 'A%' 's' , 'v'"),
    ("SELECT \"x%s\", /* %s */ a %s1, :a", ("'v'",), "SELECT \"x%\" \"s\", /* % s */ a % s1, 'v'"),
    ("SELECT 'LIKE 100%', :a", ("'v'",), "SELECT 'LIKE 100%', 'v'"),
])
def test_mysql_driver_text_binds_only_markers(sql, values, want):
    driver, order = P.compile_sql(sql, "mysql")
    assert len(order) == len(values)
    assert _mysql_connector_substitute(driver, values) == want


def test_mysql_percent_s_in_a_backtick_name_is_refused():
    with pytest.raises(ApiError):
        P.compile_sql("SELECT `a%s`, :a", "mysql")


def test_ordinary_statements_compile_as_before():
    """The bytes the Rust plane receives (compile_native, split_at_markers) are unchanged for ordinary text."""
    sql = "SELECT a FROM t WHERE a BETWEEN :start AND :start + 99 AND b LIKE 'x%' AND c = :c -- :no\n"
    assert P.compile_native(sql, "postgres")[0] == \
        "SELECT a FROM t WHERE a BETWEEN $1 AND $2 + 99 AND b LIKE 'x%' AND c = $3 -- :no\n"
    assert P.split_at_markers(sql, "mysql") == ["SELECT a FROM t WHERE a BETWEEN ", " AND ",
                                                " + 99 AND b LIKE 'x%' AND c = ", " -- :no\n"]
    assert P.neutralize(sql, "sqlite") == \
        "SELECT a FROM t WHERE a BETWEEN NULL AND NULL + 99 AND b LIKE 'x%' AND c = NULL -- :no\n"
