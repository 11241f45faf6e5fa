"""Parameters: markers, compilation for each driver, specs and their rules."""
import pytest

from qag import params as P
from qag.errors import ApiError


@pytest.mark.parametrize("sql,names", [
    ("SELECT * FROM t WHERE id = :id", ["id"]),
    ("SELECT ':not' , \":q\" FROM t WHERE a = :a -- :c\n AND b = :b /* :d */", ["a", "b"]),
    ("SELECT x::int, :y::text FROM t", ["y"]),
    ("SELECT $$ :no $$, $tag$ :no $tag$ FROM t WHERE a = :a", ["a"]),
    ("SELECT 'it''s :no' FROM t WHERE a BETWEEN :start AND :start + 99", ["start", "start"]),
    ("SELECT a FROM t WHERE a=:a1 AND b=:_b", ["a1", "_b"]),
])
def test_scan_markers_postgres(sql, names):
    assert [m[2] for m in P.scan_markers(sql, "postgres")] == names


def test_scan_markers_mysql_backslash_and_hash_comment():
    sql = "SELECT 'a\\\\' , 'b'':no', `:no` FROM t # :no\n WHERE a = :a"
    assert [m[2] for m in P.scan_markers(sql, "mysql")] == ["a"]
    # 'a\' :no' ends after :no with backslash escapes, before it under NO_BACKSLASH_ESCAPES: refused
    with pytest.raises(ApiError) as ei:
        P.scan_markers("SELECT 'a\\' :no', `:no` FROM t # :no\n WHERE a = :a", "mysql")
    assert ei.value.code == "invalid_sql" and "NO_BACKSLASH_ESCAPES" in ei.value.message


def test_compile_positional_and_percent_escaped():
    sql, names = P.compile_sql("SELECT * FROM t WHERE name LIKE 'a%' AND id = :id AND x = :id", "postgres")
    assert sql == "SELECT * FROM t WHERE name LIKE 'a%%' AND id = %s AND x = %s"
    assert names == ("id", "id")
    sql, names = P.compile_sql("SELECT * FROM t WHERE id = :id", "sqlite")
    assert sql == "SELECT * FROM t WHERE id = ?" and names == ("id",)
    # no markers: psycopg2 still formats the text (the connector passes an empty tuple), so % is doubled;
    # mysql-connector given no values leaves the text alone, and never undoubles %%
    assert P.compile_sql("SELECT '%' FROM t", "postgres") == ("SELECT '%%' FROM t", ())
    assert P.compile_sql("SELECT '%', 7 % 2 FROM t", "mysql") == ("SELECT '%', 7 % 2 FROM t", ())
    assert P.compile_sql("SELECT '%', 7 % 2 FROM t WHERE a = :a", "mysql") == \
        ("SELECT '%', 7 % 2 FROM t WHERE a = %s", ("a",))


def test_neutralize():
    assert P.neutralize("SELECT a FROM t WHERE a = :a AND b = ':b'", "postgres") == \
        "SELECT a FROM t WHERE a = NULL AND b = ':b'"


def specs(d, sql="SELECT 1"):
    return P.build_specs(P.normalize_specs(d, sql, "postgres"))


def test_types_and_rules():
    s = specs({"i": {"type": "int", "min": 1, "max": 10}, "f": "float", "s": {"type": "str", "pattern": "[a-z]+",
                                                                                 "max_length": 5},
               "b": "bool", "e": {"type": "string", "enum": ["x", "y"], "default": "x"}})
    v = P.bind(s, {"i": "3", "f": "2.5", "s": "abc", "b": "yes"}, 65536)
    assert v == {"i": 3, "f": 2.5, "s": "abc", "b": True, "e": "x"}
    v = P.bind(s, {"i": 10, "f": 1, "s": "z", "b": False, "e": "y"}, 65536)
    assert v == {"i": 10, "f": 1.0, "s": "z", "b": False, "e": "y"}


def test_every_problem_at_once():
    s = specs({"i": {"type": "int", "min": 1}, "s": {"type": "str", "pattern": "[a-z]+"}, "b": "bool",
               "r": "int"})
    with pytest.raises(ApiError) as ei:
        P.bind(s, {"i": "0", "s": "ABC", "b": "maybe", "zz": "1"}, 65536)
    e = ei.value
    assert e.status == 400 and e.code == "param_invalid"
    assert e.extra["errors"] == {"i": "must be at least 1", "s": "must match the pattern [a-z]+",
                                 "b": "must be a boolean (true/1/yes or false/0/no)", "r": "is required",
                                 "zz": "is not a parameter of this query"}


def test_required_only():
    s = specs({"aid": {"type": "int", "required": True}})
    with pytest.raises(ApiError) as ei:
        P.bind(s, {}, 65536)
    assert ei.value.code == "param_required" and ei.value.extra["errors"] == {"aid": "is required"}


@pytest.mark.parametrize("raw", ["abc", "1.5", "9223372036854775808", "-9223372036854775809", "", " "])
def test_int_rejects(raw):
    s = specs({"aid": "int"})
    with pytest.raises(ApiError) as ei:
        P.bind(s, {"aid": raw}, 65536)
    assert ei.value.code in ("param_invalid", "param_required")


def test_int64_bounds_accepted():
    s = specs({"a": "int"})
    assert P.bind(s, {"a": "9223372036854775807"}, 65536)["a"] == 2 ** 63 - 1
    assert P.bind(s, {"a": "-9223372036854775808"}, 65536)["a"] == -(2 ** 63)


@pytest.mark.parametrize("raw,val", [("true", True), ("1", True), ("YES", True), ("false", False), ("0", False),
                                     ("no", False)])
def test_bool_text(raw, val):
    assert P.bind(specs({"b": "bool"}), {"b": raw}, 65536)["b"] is val


def test_float_rejects_nan_inf():
    for raw in ("nan", "inf", "-inf", "x"):
        with pytest.raises(ApiError):
            P.bind(specs({"f": "float"}), {"f": raw}, 65536)


def test_oversized_param():
    with pytest.raises(ApiError) as ei:
        P.bind(specs({"s": "str"}), {"s": "x" * (1 << 20)}, 65536)
    assert ei.value.code == "param_invalid" and "longer than 65536" in ei.value.extra["errors"]["s"]


def test_invalid_declarations():
    for bad in ({"a": "date"}, {"a": {"type": "int", "pattern": "x"}}, {"a": {"type": "str", "pattern": "("}},
                {"page": "int"}, {"1a": "int"}, {"a": {"type": "int", "default": "x"}}, {"a": {"type": "int",
                                                                                              "bogus": 1}}):
        with pytest.raises(ApiError) as ei:
            P.normalize_specs(bad, "SELECT 1", "postgres")
        assert ei.value.code == "invalid_parameters"


def test_undeclared_marker_is_required_string():
    assert P.normalize_specs({}, "SELECT :x", "postgres") == {"x": {"type": "str", "required": True}}


def test_default_makes_optional():
    assert P.normalize_specs({"a": {"type": "int", "default": "5"}}, "SELECT :a", "postgres") == \
        {"a": {"type": "int", "default": 5, "required": False}}


def test_compile_native_for_the_plane():
    sql = "SELECT a FROM t WHERE a BETWEEN :start AND :start + 99 AND b LIKE 'x%' AND c = :c"
    assert P.compile_native(sql, "postgres") == (
        "SELECT a FROM t WHERE a BETWEEN $1 AND $2 + 99 AND b LIKE 'x%' AND c = $3", ("start", "start", "c"))
    assert P.compile_native(sql, "mysql")[0] == "SELECT a FROM t WHERE a BETWEEN ? AND ? + 99 AND b LIKE 'x%' AND c = ?"


@pytest.mark.parametrize("sql,names", [
    ('SELECT 1 AS "x\\":q", :p', ["p"]),              # "..." names take backslash escapes: :q is inside
    ("SELECT 1 AS `x\\`:q`, :p", ["p"]),
    ("SELECT 'it\\'s :q', :p", ["p"]),
    ("SELECT $$a:q$$ AS h, :p", ["p"]),                  # heredoc strings
    ("SELECT $t$a$$:q$t$ AS h, :p", ["p"]),
    ("SELECT 1 /* a /* b */ :q */ AS z, :p", ["p"]),     # comments nest
    ("SELECT 1 AS a, :p # :q\n", ["p"]),
    ("SELECT 1 AS a, :p #! :q\n", ["p"]),
    ("SELECT 1 AS a, :p --:q\n", ["p"]),
    ("SELECT :p::String", ["p"]),
])
def test_scan_markers_clickhouse(sql, names):
    """ClickHouse's Lexer.cpp rules: a value bound at a :name the server reads inside a name or a string could
    end it with its own quote (SELECT 1 AS "x\\":q with q = '" , (SELECT token FROM secrets) AS "t' read a
    table the key may not)."""
    assert [m[2] for m in P.scan_markers(sql, "clickhouse")] == names


@pytest.mark.parametrize("sql", ['SELECT 1 AS "x', "SELECT $$a", "SELECT 1 /* /* */", "SELECT :pé", "SELECT :p١"])
def test_scan_markers_clickhouse_refused(sql):
    with pytest.raises(P.Unreadable):
        P.scan_markers(sql, "clickhouse")
