"""connectors' rules without I/O: S3 (a time limit is never rounded to "no limit"), S5 (which statements are
proven to leave no session state), and call_options' timeout (400 invalid_timeout)."""
from __future__ import annotations

import pytest

from qag import config
from qag.connectors import limit_ms, state_free
from qag.errors import ApiError
from qag.http.options import call_options

CFG = config.load({"QAG_QUERY_TIMEOUT": "30"})


@pytest.mark.parametrize("asked, ms", [
    (None, 30000), (0.0004, 10), (0.01, 10), (0.0101, 11), (0.5, 500), (1.0001, 1001), (29.9999, 30000),
    (30, 30000), (31, 30000), (1e9, 30000), (1e-300, 10), (7e307, 30000), (1.7976931348623157e308, 30000),
])
def test_s3_limit_is_clamped_and_rounded_up_never_zero(asked, ms):
    assert limit_ms(asked, 30.0) == ms


def test_s3_server_limit_itself_is_never_zero():
    assert limit_ms(None, 0.0001) == 10 and limit_ms(5, 0.0001) == 10


@pytest.mark.parametrize("raw", ["0", "-1", "abc", "", "nan", "inf", "-inf", "0.0", True, [1], {"a": 1}])
def test_timeout_not_a_positive_number_is_invalid_timeout(raw):
    if raw == "":
        assert call_options({"timeout": raw}, CFG).timeout is None  # empty means "not given"
        return
    with pytest.raises(ApiError) as ei:
        call_options({"timeout": raw}, CFG)
    assert ei.value.status == 400 and ei.value.code == "invalid_timeout"


@pytest.mark.parametrize("raw, seconds", [("0.0004", 0.01), ("0.5", 0.5), (2, 2.0), ("1e3", 30.0), (0.0101, 0.011)])
def test_timeout_is_clamped_to_the_documented_range(raw, seconds):
    assert call_options({"timeout": raw}, CFG).timeout == seconds


@pytest.mark.parametrize("sql, free", [
    ("SELECT abalance FROM pgbench_accounts WHERE aid = NULL", True),
    ("SELECT a.aid, lower(b.name), count(*) FROM a JOIN b ON b.id = a.id GROUP BY 1, 2 ORDER BY 1", True),
    ("SELECT pg_catalog.lower(x), coalesce(y, 0), now() FROM t", True),
    ("WITH c AS (SELECT id FROM t) SELECT id FROM c UNION SELECT 1", True),
    ("SELECT set_config('search_path', 'evil', false)", False),
    ("SELECT pg_advisory_lock(1)", False),
    ("SELECT nextval('s')", False),
    ("SELECT myschema.lower(x) FROM t", False),
    ("SELECT f(x) FROM t", False),
    ("SELECT * FROM t FOR UPDATE", False),
    ("SELECT * INTO TEMP x FROM t", False),
    ("SET search_path = evil", False),
    ("PREPARE p AS SELECT 1", False),
    ("LISTEN ch", False),
    ("DECLARE c CURSOR WITH HOLD FOR SELECT 1", False),
    ("EXPLAIN ANALYZE SELECT 1", False),
    ("SELECT 1; SELECT 2", False),
    ("not sql at all", False),
])
def test_s5_postgres_verdicts(sql, free):
    assert state_free(sql, "postgres") is free


@pytest.mark.parametrize("sql, free", [
    ("SELECT id, name FROM t WHERE name = NULL", True),
    ("SELECT lower(name), count(*) FROM t GROUP BY 1", True),
    ("SELECT @a := 1", False),
    ("SELECT GET_LOCK('x', 0)", False),
    ("SELECT LAST_INSERT_ID(5)", False),
    ("SELECT 1 INTO @x", False),
    ("SELECT * FROM t FOR UPDATE", False),
    ("SELECT my_udf(x) FROM t", False),
    ("SET @b = 2", False),
    ("SET SESSION TRANSACTION READ WRITE", False),
    ("CREATE TEMPORARY TABLE x (a INT)", False),
])
def test_s5_mysql_verdicts(sql, free):
    assert state_free(sql, "mysql") is free


def test_s5_sqlite_and_clickhouse_keep_no_session_state_of_their_own():
    assert state_free("SELECT 1", "sqlite") and state_free("SELECT 1", "clickhouse")
