"""End to end: the contract's conventions held letter by letter on a real `qag serve` (a SQLite connection):
request bodies read as strict JSON, numbers read in one grammar, each option and parameter given once, lists
paged by cursors the server checks, and the run filters read as RFC 3339. Each case is one that qag answered
otherwise before (a 200 that ignored what the caller sent, or a 500)."""
from __future__ import annotations

import json
import socket

import pytest
import requests

from tests.conftest import orders_db, start_server

J = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = start_server()
    db = orders_db(str(tmp_path_factory.mktemp("contract") / "orders.db"))
    s.post = lambda path, body, **kw: requests.post(s.base + path, headers={**s.admin, **J, **kw.pop("headers", {})},
                                                    data=body if isinstance(body, bytes) else json.dumps(body), **kw)
    for path, body in (
            ("/api/v1/connections", {"name": "lite", "db": "sqlite", "database": db}),
            ("/api/v1/queries", {"name": "orders", "connection_name": "lite", "publish": True,
                                 "sql": "SELECT id, cid FROM orders WHERE id >= :aid ORDER BY id",
                                 "parameters": {"aid": {"type": "int", "default": 1}}}),
            ("/api/v1/queries", {"name": "typed", "connection_name": "lite", "publish": True,
                                 "sql": "SELECT :i AS i, :f AS f, :b AS b",
                                 "parameters": {"i": "int", "f": "float", "b": "bool"}})):
        r = s.post(path, body)
        assert r.status_code == 201, r.text
    r = s.post("/api/v1/api-keys", {"name": "k", "queries": ["orders", "typed"], "connections": ["lite"]})
    s.key = {"X-API-Key": r.json()["secret"]}
    yield s
    s.stop()


def error(r, status, code):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["code"] == code, body
    assert body["request_id"] == r.headers["X-Request-Id"]
    return body


# -- bodies --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/q/orders", "/api/v1/api-keys"])
@pytest.mark.parametrize("raw, why", [
    (b'{"params": {"aid": 1, "aid": 2}}', "appears twice"),      # which aid? the last one was used
    (b'{"name": "a", "name": "b"}', "appears twice"),
    (b'{"params": {"aid": NaN}}', "NaN"),                         # not JSON (RFC 8259)
    (b'{"params": {"aid": Infinity}}', "Infinity"),
    (b'{"params": {"aid": -Infinity}}', "Infinity"),
    (b'{"name": "s", "description": "a\\ud800b"}', "surrogate"),      # half a pair: a 500 from the store
    (b'{"params": {"aid": 1}, "format": "\\udc00"}', "surrogate"),
    ('{"name": "utf16"}'.encode("utf-16"), "utf-8"),                   # JSON is UTF-8 (RFC 8259 8.1)
])
def test_a_body_that_is_not_strict_json_is_invalid_body(srv, path, raw, why):
    b = error(srv.post(path, raw), 400, "invalid_body")
    assert why in b["error"]


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "application/xml"])
def test_a_body_sent_as_another_media_type_is_invalid_body(srv, ctype):
    for path in ("/q/orders", "/api/v1/connections"):
        error(srv.post(path, {"params": {}}, headers={"Content-Type": ctype}), 400, "invalid_body")
    r = srv.post("/q/orders", {"params": {"aid": 2}}, headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200 and [x["id"] for x in r.json()] == [2]


def test_a_get_or_delete_with_a_body_is_refused_not_run_without_it(srv):
    r = requests.get(srv.base + "/q/orders", headers={**srv.key, **J}, data=json.dumps({"params": {"aid": 2}}))
    error(r, 400, "invalid_body")
    r = requests.get(srv.base + "/api/v1/connections", headers={**srv.admin, **J}, data=b'{"x": 1}')
    error(r, 400, "invalid_body")
    assert requests.get(srv.base + "/q/orders", headers=srv.key).status_code == 200
    # a DELETE's body would be ignored too: DELETE /api/v1/cache {"query": "orders"} evicted every query's answers
    r = requests.delete(srv.base + "/api/v1/cache", headers={**srv.admin, **J}, data=b'{"query": "orders"}')
    error(r, 400, "invalid_body")
    r = requests.delete(srv.base + "/api/v1/api-keys/k", headers={**srv.admin, **J}, data=b'{}')
    error(r, 400, "invalid_body")
    assert requests.get(srv.base + "/api/v1/api-keys/k", headers=srv.admin).status_code == 200


# -- numbers, options and parameters given once -------------------------------------------------------------
@pytest.mark.parametrize("qs, code", [
    ("page=%201", "invalid_paging"), ("page=1%20", "invalid_paging"), ("page_size=%D9%A1", "invalid_paging"),
    ("page=1_0", "invalid_paging"), ("page=1&page=2", "invalid_paging"), ("page_size=1&page_size=2", "invalid_paging"),
    ("timeout=1_0", "invalid_timeout"), ("timeout=%205", "invalid_timeout"), ("timeout=%D9%A1", "invalid_timeout"),
    ("timeout=1&timeout=2", "invalid_timeout"), ("format=json&format=csv", "invalid_format"),
    ("version=%201", "param_invalid"), ("version=1_0", "param_invalid"),
])
def test_options_are_read_in_one_grammar_and_once(srv, qs, code):
    b = error(requests.get(f"{srv.base}/q/orders?{qs}", headers=srv.key), 400, code)
    if qs.count("=") == 2 and qs.split("=")[0] == qs.split("&")[1].split("=")[0]:
        assert "once" in b["error"]


@pytest.mark.parametrize("name, value", [
    ("i", "%201"), ("i", "1%20"), ("i", "%D9%A1"), ("i", "1_0"), ("i", "1" * 5000), ("i", "-" + "9" * 5000),
    ("f", "1_0"), ("f", "%D9%A1"), ("f", "%202.5"), ("f", "0x10"), ("b", "%20true"),
])
def test_parameter_text_is_read_strictly_never_a_500(srv, name, value):
    given = {"i": "1", "f": "1.5", "b": "true", name: value}
    qs = "&".join(f"{k}={v}" for k, v in given.items())
    b = error(requests.get(f"{srv.base}/q/typed?{qs}", headers=srv.key), 400, "param_invalid")
    assert list(b["errors"]) == [name]


def test_a_float_parameter_from_a_json_integer_too_large_for_a_double_is_param_invalid(srv):
    raw = b'{"params": {"i": 1, "f": 1' + b"0" * 400 + b', "b": true}}'
    b = error(srv.post("/q/typed", raw, headers=srv.key), 400, "param_invalid")
    assert b["errors"] == {"f": "must be a finite number"}


def test_post_takes_query_string_parameters_too_each_name_once(srv):
    h = {**srv.key}
    r = srv.post("/q/orders?aid=2", {"params": {}}, headers=h)
    assert r.status_code == 200 and [x["id"] for x in r.json()] == [2]  # it ran with aid=1 before
    b = error(srv.post("/q/orders?aid=3", {"params": {"aid": 2}}, headers=h), 400, "param_invalid")
    assert b["errors"] == {"aid": "must be given once"}
    error(srv.post("/q/orders?format=csv", {"format": "json"}, headers=h), 400, "invalid_format")
    error(srv.post("/q/orders?page=1", {"page": 2}, headers=h), 400, "invalid_paging")


# -- lists and filters --------------------------------------------------------------------------------------
def test_list_cursors_are_checked_and_unknown_names_refused(srv):
    for n in ("a1", "a2", "a3"):
        srv.post("/api/v1/api-keys", {"name": n})
    seen, cursor = [], None
    while True:
        r = requests.get(srv.base + "/api/v1/api-keys", headers=srv.admin,
                         params={"limit": 1, **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200, r.text
        seen += [i["name"] for i in r.json()["items"]]
        cursor = r.json()["next_cursor"]
        if cursor is None:
            break
        assert cursor not in seen  # opaque: not the name itself
    assert seen == sorted(seen) and {"a1", "a2", "a3", "k"} <= set(seen)
    good = requests.get(srv.base + "/api/v1/api-keys?limit=1", headers=srv.admin).json()["next_cursor"]
    for bad in ("a1", good[:-1], good + "x", good[:-2] + ("A" if good[-2] != "A" else "B") + good[-1], "%%%"):
        error(requests.get(srv.base + "/api/v1/api-keys", headers=srv.admin, params={"cursor": bad}), 400,
              "invalid_cursor")
    for path in ("/api/v1/connections", "/api/v1/queries", "/api/v1/api-keys", "/api/v1/roles", "/api/v1/audit"):
        error(requests.get(srv.base + path + "?colour=red", headers=srv.admin), 400, "unknown_field")
        for limit in ("0", "-1", "1001", "1.5", "%201"):
            error(requests.get(f"{srv.base}{path}?limit={limit}", headers=srv.admin), 400, "invalid_paging")


def test_audit_pages_with_a_cursor(srv):
    srv.post("/api/v1/api-keys", {"name": "audited"})
    r = requests.get(srv.base + "/api/v1/audit?limit=2", headers=srv.admin).json()
    assert len(r["items"]) == 2 and r["next_cursor"]
    ids = [i["id"] for i in r["items"]]
    nxt = requests.get(srv.base + "/api/v1/audit", headers=srv.admin,
                       params={"limit": 2, "cursor": r["next_cursor"]}).json()
    assert [i["id"] for i in nxt["items"]] and max(i["id"] for i in nxt["items"]) < min(ids)


@pytest.mark.parametrize("qs", [
    "status=999", "status=600", "status=abc", "since=2026-01-01T00:00:00", "since=20260101T000000Z",
    "until=2026-01-01%2000:00", "since=2027-01-01T00:00:00Z&until=2026-01-01T00:00:00Z",
    "cursor=99999999999999999999999", "cursor=-5", "cursor=abc", "query=a&query=b",
])
def test_history_filters_outside_their_grammar_are_400(srv, qs):
    error(requests.get(f"{srv.base}/api/v1/history?{qs}", headers=srv.admin), 400, "invalid_filter")


def test_history_filters_in_their_grammar(srv):
    requests.get(srv.base + "/q/orders", headers={**srv.key, "X-Request-Id": "filter-probe"})
    for qs in ("status=200", "status=2xx", "status=ok", "since=2026-01-01", "since=2026-01-01T00:00:00Z",
               "since=2026-01-01T01:00:00%2B01:00", "since=2026-01-01%2000:00:00Z"):
        r = requests.get(f"{srv.base}/api/v1/history?{qs}", headers=srv.admin)
        assert r.status_code == 200, (qs, r.text)


@pytest.mark.parametrize("qs", ["per=", "per=week", "per=MINUTE", "since=yesterday",
                                "since=2027-01-01T00:00:00Z&until=2026-01-01T00:00:00Z"])
def test_usage_filters_outside_their_grammar_are_400(srv, qs):
    error(requests.get(f"{srv.base}/api/v1/usage?{qs}", headers=srv.admin), 400, "invalid_filter")


@pytest.mark.parametrize("value", ["2030-01-01 00:00:00", "2030-01-01T00:00:00", "20300101T000000Z", "tomorrow",
                                   12345, "2030-13-01T00:00:00Z"])
def test_expires_at_is_rfc3339_with_its_offset(srv, value):
    error(srv.post("/api/v1/api-keys", {"name": "exp", "expires_at": value}), 400, "invalid_field")


def test_expires_at_with_an_offset_is_stored_in_utc(srv):
    r = srv.post("/api/v1/api-keys", {"name": "exp2", "expires_at": "2099-01-01T02:00:00+02:00"})
    assert r.status_code == 201 and r.json()["expires_at"] == "2099-01-01T00:00:00.000Z"


def test_a_role_that_is_not_a_name_is_400(srv):
    error(srv.post("/api/v1/api-keys", {"name": "rk", "role": 5}), 400, "invalid_field")


def test_two_request_ids_or_a_malformed_one_are_replaced(srv):
    host, port = srv.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: aaa\r\nX-Request-Id: bbb\r\n"
                  b"Connection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    rid = [line.split(b":", 1)[1].strip() for line in data.split(b"\r\n") if line.lower().startswith(b"x-request-id")]
    assert len(rid) == 1 and rid[0] not in (b"aaa", b"bbb", b"aaa,bbb")
    for bad in ("a" * 65, "has space", "ünï", ""):
        r = requests.get(srv.base + "/q/nosuch", headers={**srv.key, "X-Request-Id": bad.encode()})
        assert r.headers["X-Request-Id"] != bad and r.json()["request_id"] == r.headers["X-Request-Id"]
    r = requests.get(srv.base + "/q/nosuch", headers={**srv.key, "X-Request-Id": "a" * 64})
    assert r.headers["X-Request-Id"] == "a" * 64


def test_a_query_string_that_is_not_utf8_is_refused_not_read_as_replacement_characters(srv):
    r = requests.get(srv.base + "/q/orders?aid=%FF", headers=srv.key)
    error(r, 400, "param_invalid")
    error(requests.get(srv.base + "/api/v1/history?query=%C3", headers=srv.admin), 400, "invalid_request")
    assert requests.get(srv.base + "/q/orders?aid=%32", headers=srv.key).json() == [{"id": 2, "cid": 8}]


@pytest.mark.parametrize("method, path", [
    ("GET", "/catalog"), ("GET", "/connections/lite/schema"), ("GET", "/api/v1/connections/lite"),
    ("GET", "/api/v1/queries/orders"), ("GET", "/api/v1/api-keys/k"), ("POST", "/api/v1/api-keys"),
    ("POST", "/api/v1/queries/validate"), ("PATCH", "/api/v1/api-keys/k"), ("DELETE", "/api/v1/api-keys/k"),
])
def test_a_query_string_name_a_route_does_not_take_is_unknown_field(srv, method, path):
    h = {**(srv.key if path.startswith(("/catalog", "/connections")) else srv.admin), **J}
    r = requests.request(method, srv.base + path + "?dry_run=true", headers=h,
                         data=None if method in ("GET", "DELETE") else b"{}")
    error(r, 400, "unknown_field")
    assert requests.get(srv.base + "/api/v1/api-keys/k", headers=srv.admin).status_code == 200  # not deleted


def test_a_querys_versions_are_a_list_paged_like_the_others(srv):
    assert srv.post("/api/v1/queries", {"name": "vq", "connection_name": "lite", "sql": "SELECT 1 AS v"}).ok
    for n in (2, 3):
        assert srv.post("/api/v1/queries/vq/versions", {"sql": f"SELECT {n} AS v"}).status_code == 201
    seen, cursor = [], None
    while True:
        r = requests.get(srv.base + "/api/v1/queries/vq/versions", headers=srv.admin,
                         params={"limit": 2, **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200, r.text
        seen += [v["version"] for v in r.json()["items"]]
        cursor = r.json()["next_cursor"]
        if cursor is None:
            break
    assert seen == [1, 2, 3]
    error(requests.get(srv.base + "/api/v1/queries/vq/versions?cursor=2", headers=srv.admin), 400, "invalid_cursor")
    error(requests.get(srv.base + "/api/v1/queries/vq/versions?sort=desc", headers=srv.admin), 400, "unknown_field")
    error(srv.post("/api/v1/queries/vq/publish", {"version": 2 ** 70}), 400, "invalid_field")  # a 500 before


@pytest.fixture(scope="module")
def pgsrv():
    """A server whose store is PostgreSQL, whose text cannot hold a NUL (psycopg2 refuses to send one)."""
    from tests.conftest import PG_ADMIN_DSN, pg_exec, pg_fresh_db
    dsn = pg_fresh_db("qag_http_contract_store")
    s = start_server({"QAG_DATABASE_URL": dsn})
    yield s
    s.stop()
    pg_exec(PG_ADMIN_DSN, "DROP DATABASE IF EXISTS qag_http_contract_store WITH (FORCE)")


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_a_nul_in_a_name_or_a_body_is_a_4xx_on_either_store(request, store):
    s = request.getfixturevalue("srv" if store == "sqlite" else "pgsrv")
    for path, code in (("/api/v1/connections/a%00b", "connection_not_found"), ("/api/v1/queries/a%00b",
                       "query_not_found"), ("/api/v1/api-keys/a%00b", "key_not_found"),
                       ("/api/v1/roles/a%00b", "role_not_found"), ("/q/a%00b", "query_not_found")):
        error(requests.get(s.base + path, headers=s.admin), 404, code)
    error(requests.delete(s.base + "/api/v1/api-keys/a%00b", headers=s.admin), 404, "key_not_found")
    error(requests.get(s.base + "/q/x?connection_name=a%00b", headers=s.admin), 400, "param_invalid")
    error(requests.get(s.base + "/api/v1/history?query=a%00b", headers=s.admin), 400, "invalid_filter")
    for path, body in (("/api/v1/api-keys", {"name": "nul", "description": "a\x00b"}),
                       ("/api/v1/connections/test", {"name": "a\x00b"}),
                       ("/api/v1/roles", {"name": "nul", "queries": ["a\x00"]})):
        r = requests.post(s.base + path, headers={**s.admin, **J}, data=json.dumps(body))
        error(r, 400, "invalid_body")
    assert requests.get(s.base + "/api/v1/api-keys/nul", headers=s.admin).status_code == 404


def test_the_catalog_is_a_list_paged_like_the_others(srv):
    r = requests.get(srv.base + "/catalog?limit=1", headers=srv.key)
    assert r.status_code == 200, r.text
    first = r.json()
    assert [i["name"] for i in first["items"]] == ["orders"] and first["next_cursor"]
    nxt = requests.get(srv.base + "/catalog", headers=srv.key, params={"limit": 1, "cursor": first["next_cursor"]})
    assert [i["name"] for i in nxt.json()["items"]] == ["typed"] and nxt.json()["next_cursor"] is None
    error(requests.get(srv.base + "/catalog?limit=0", headers=srv.key), 400, "invalid_paging")
    error(requests.get(srv.base + "/catalog?limit=1", headers={"X-API-Key": "sk_nope"}), 401, "unauthorized")


def test_xlsx_writes_text_starting_with_equals_as_text_never_a_formula(srv):
    import io
    import zipfile
    r = srv.post("/api/v1/queries", {"name": "inj", "connection_name": "lite", "publish": True,
                                     "sql": "SELECT '=cmd|'' /C calc''!A1' AS \"=h\", '=1+1' AS v"})
    assert r.status_code == 201, r.text
    x = requests.get(srv.base + "/q/inj?format=xlsx", headers=srv.admin)
    assert x.status_code == 200, x.text
    sheet = zipfile.ZipFile(io.BytesIO(x.content)).read("xl/worksheets/sheet1.xml").decode()
    assert "<f>" not in sheet and "=cmd|' /C calc'!A1" in sheet and "=1+1" in sheet and "=h" in sheet


def test_names_that_are_routes_of_their_collection_are_refused(srv, tmp_path):
    # saved, they could never be read, changed or deleted at their address (GET /api/v1/connections/test is 405)
    b = error(srv.post("/api/v1/connections", {"name": "test", "db": "sqlite", "database": str(tmp_path / "t.db"),
                                               "active": False}), 400, "invalid_name")
    assert "test" in b["error"]
    error(srv.post("/api/v1/queries", {"name": "validate", "connection_name": "lite", "sql": "SELECT 1 AS x"}), 400,
          "invalid_name")
    r = srv.post("/api/v1/connections/test", {"db": "sqlite", "database": str(tmp_path / "t.db")})
    assert r.status_code == 502 and r.json()["code"] == "connection_failed"  # /test itself still takes a body


def test_head_health_answers_as_get_without_a_body(srv):
    r = requests.head(srv.base + "/health", headers={"X-Request-Id": "lb-probe"})
    assert r.status_code == 200 and r.content == b"" and r.headers["X-Request-Id"] == "lb-probe"
    assert requests.get(srv.base + "/health").json()["status"] == "ok"


def test_a_caller_limit_of_hundreds_of_digits_is_invalid_body_not_a_500(srv):
    big = "1" + "0" * 400
    for path, name in (("/api/v1/api-keys", "qt"), ("/api/v1/roles", "qtr")):
        r = srv.post(path, f'{{"name": "{name}", "query_timeout": {big}}}'.encode())
        assert error(r, 400, "invalid_body")["field"] == "query_timeout"


def test_the_cache_routes_read_their_names_once_and_numbers_strictly(srv):
    for method, qs in (("DELETE", "query=orders&query=typed"), ("GET", "query=orders&query=typed"),
                       ("GET", "limit=%201"), ("GET", "limit=1_0")):
        error(requests.request(method, f"{srv.base}/api/v1/cache?{qs}", headers=srv.admin), 400, "invalid_body")
