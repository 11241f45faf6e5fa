"""Property tests: a parameter value never changes the SQL text, and any value reaches the database
unchanged (bound by the driver, never spliced)."""
import sqlite3

from hypothesis import given, settings
from hypothesis import strategies as st

from qag import params as P

SQL = "SELECT :v AS v, 'literal :not' AS l -- :nor\n WHERE 1 = 1"


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_text_round_trips_through_sqlite(value):
    if "\x00" in value:
        return  # refused by the parameter rules (tested elsewhere)
    sql, names = P.compile_sql(SQL, "sqlite")
    assert names == ("v",) and sql == "SELECT ? AS v, 'literal :not' AS l -- :nor\n WHERE 1 = 1"
    db = sqlite3.connect(":memory:")
    assert db.execute(sql, (value,)).fetchone() == (value, "literal :not")


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "c"]), st.one_of(st.text(), st.integers(), st.booleans())))
def test_sql_text_independent_of_values(values):
    sql = "SELECT * FROM t WHERE a = :a AND b = :b AND c = :c"
    for d in ("postgres", "mysql", "sqlite"):
        compiled, names = P.compile_sql(sql, d)
        assert names == ("a", "b", "c")
        specs = P.build_specs(P.normalize_specs({"a": "str", "b": "str", "c": "str"}, sql, d))
        try:
            bound = P.bind(specs, {k: v for k, v in values.items() if isinstance(v, str)}, 65536)
        except Exception:
            continue
        assert P.compile_sql(sql, d) == (compiled, names)  # nothing about the values reaches the text
        assert set(bound) == {"a", "b", "c"}
