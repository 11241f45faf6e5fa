"""qag's ways in and side surfaces, attacked through a real `qag serve`: a Console session is worth what the
administrator credential that opened it is worth now; the Console refuses sign-ins and forms from another site and
redirects only inside itself; /events parses its resume id strictly and serves signed-in callers their own runs;
a token naming a key of its own (jku, x5u, jwk, x5c) is refused and nothing is fetched; /metrics takes its token
with the scheme in any case; RateLimit-Remaining is an integer; /openapi.json lists only what /catalog lists."""
from __future__ import annotations

import http.server
import json
import re
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
import requests

from tests.conftest import ROOT, free_port, start_server
from tests.e2e.test_core_signed_in import AUD, ISS, SECRET, IdP


@pytest.fixture(scope="module")
def idp():
    p = IdP()
    yield p
    p.httpd.shutdown()


@pytest.fixture(scope="module")
def srv(idp, tmp_path_factory):
    data = str(tmp_path_factory.mktemp("auth") / "crm.db")
    db = sqlite3.connect(data)
    db.executescript("CREATE TABLE notes (id INTEGER, owner TEXT, email TEXT);"
                     "INSERT INTO notes VALUES (1, 'ada', 'ada@corp.example'), (2, 'bob', 'bob@corp.example');")
    db.commit()
    db.close()
    s = start_server({"QAG_JWT_JWKS_URL": f"http://127.0.0.1:{idp.port}/jwks.json", "QAG_JWT_SECRET": SECRET,
                      "QAG_JWT_ISSUER": ISS, "QAG_JWT_AUDIENCE": AUD, "QAG_METRICS_TOKEN": "metrics-token-1",
                      "QAG_ALLOW_WRITES": "1"}, args=("--workers", "1"))
    post = lambda p, b: requests.post(s.base + p, json=b, headers=s.admin, timeout=10)
    assert post("/api/v1/connections", {"name": "crm", "db": "sqlite", "database": data}).status_code == 201
    for q in ({"name": "notes", "sql": "SELECT id, owner, email FROM notes ORDER BY id"},
              {"name": "note", "sql": "SELECT id, owner FROM notes WHERE id = :id", "parameters": {"id": "int"}},
              {"name": "add_note", "sql": "INSERT INTO notes (id, owner) VALUES (:id, 'x')",
               "parameters": {"id": "int"}}):
        r = post("/api/v1/queries", {**q, "connection_name": "crm", "publish": True})
        assert r.status_code == 201, r.text
    assert post("/api/v1/roles", {"name": "analyst", "queries": ["notes"]}).status_code == 201
    s.post = post
    yield s
    s.stop()


def admin_token(srv, name: str, action: str = "create") -> str:
    out = subprocess.run([sys.executable, "-m", "qag.cli", "admins", action, name], env=srv.env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[0] if action == "create" else ""


def console_session(srv, token: str) -> requests.Session:
    s = requests.Session()
    r = s.post(srv.base + "/console/login", data={"token": token}, allow_redirects=False, timeout=10)
    assert r.status_code == 303 and "qag_console" in s.cookies, r.text
    return s


def csrf_of(session, srv) -> str:
    page = session.get(srv.base + "/console/keys", timeout=10)
    assert page.status_code == 200
    return re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)


# -- the Console ---------------------------------------------------------------------------------------------------
def test_a_console_session_ends_when_its_administrator_token_is_revoked(srv):
    token = admin_token(srv, "night-ops")
    s = console_session(srv, token)
    assert s.get(srv.base + "/console/keys", allow_redirects=False, timeout=10).status_code == 200
    admin_token(srv, "night-ops", "revoke")
    assert requests.get(srv.base + "/api/v1/queries", headers={"X-API-Key": token}, timeout=10).status_code == 401
    for path in ("/console/keys", "/console", "/console/audit"):
        r = s.get(srv.base + path, allow_redirects=False, timeout=10)
        assert r.status_code == 303 and "/console/login" in r.headers["location"], (path, r.status_code)
    assert s.get(srv.base + "/console/runs/tail", timeout=10).status_code == 401
    # and a form the page still holds changes nothing
    r = s.post(srv.base + "/console/keys", data={"csrf": "x", "action": "create", "name": "after-revoke"},
               allow_redirects=False, timeout=10)
    assert r.status_code == 303
    names = [k["name"] for k in requests.get(srv.base + "/api/v1/api-keys", headers=srv.admin,
                                             timeout=10).json()["items"]]
    assert "after-revoke" not in names


def test_the_console_refuses_other_sites_and_redirects_only_inside_itself(srv):
    admin = srv.env["QAG_ADMIN_KEY"]
    for headers in ({"Origin": "http://attacker.example"}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"},
                    {"Sec-Fetch-Site": "same-site"}):
        r = requests.post(srv.base + "/console/login", data={"token": admin}, headers=headers,
                          allow_redirects=False, timeout=10)
        assert r.status_code == 403 and r.json()["code"] == "csrf_failed", headers
        assert "set-cookie" not in r.headers, "no session from another site's sign-in form"
    s = console_session(srv, admin)
    token = csrf_of(s, srv)
    for headers in ({"Sec-Fetch-Site": "cross-site"}, {"Origin": "null"}):
        r = s.post(srv.base + "/console/keys", data={"csrf": token, "action": "create", "name": "cross"},
                   headers=headers, allow_redirects=False, timeout=10)
        assert r.status_code == 403 and r.json()["code"] == "csrf_failed", headers
    r = s.post(srv.base + "/console/keys", data={"csrf": token, "action": "create", "name": "same"},
               headers={"Origin": srv.base, "Sec-Fetch-Site": "same-origin"}, allow_redirects=False, timeout=10)
    assert r.status_code == 200 and "sk_" in r.text, "the Console's own form still works"
    names = [k["name"] for k in requests.get(srv.base + "/api/v1/api-keys", headers=srv.admin,
                                             timeout=10).json()["items"]]
    assert "cross" not in names and "same" in names
    for nxt in ("//evil.example", "https://evil.example/console", "/console/../api/v1/api-keys",
                "/console\t//evil.example", "/console%2F%2Fevil.example", "/consolex", "/console\\evil",
                "/console/%5c%5cevil.example", "/console\r\nSet-Cookie: x=1"):
        r = requests.post(srv.base + "/console/login", data={"token": admin, "next": nxt}, allow_redirects=False,
                          timeout=10)
        assert r.status_code == 303 and r.headers["location"] == "/console", (nxt, r.headers.get("location"))
    r = requests.post(srv.base + "/console/login", data={"token": admin, "next": "/console/runs?query=notes"},
                      allow_redirects=False, timeout=10)
    assert r.headers["location"] == "/console/runs?query=notes"


# -- /events -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["abc", "-1", "+5", "5_0", "1e3", " 5", "99999999999999999999", "9223372036854775808",
                                 "\u0663"])
def test_a_bad_resume_id_is_400_not_a_guess(srv, bad):
    for how in ("header", "query"):
        if how == "header":
            if not bad.isascii() or bad != bad.strip():
                continue  # not sendable as a header value
            r = requests.get(srv.base + "/events", headers={**srv.admin, "Last-Event-ID": bad}, timeout=10)
        else:
            r = requests.get(srv.base + "/events", params={"last_event_id": bad}, headers=srv.admin, timeout=10)
        assert r.status_code == 400 and r.json()["code"] == "invalid_event_id", (how, bad, r.status_code)


def test_events_refuses_unknown_and_repeated_parameters(srv):
    r = requests.get(srv.base + "/events", params={"bogus": "1"}, headers=srv.admin, timeout=10)
    assert r.status_code == 400 and r.json()["code"] == "unknown_field"
    r = requests.get(srv.base + "/events?last_event_id=1&last_event_id=2", headers=srv.admin, timeout=10)
    assert r.status_code == 400 and r.json()["code"] == "invalid_event_id"


def first_event(srv, headers, timeout=5.0):
    r = requests.get(srv.base + "/events", params={"limit": 1}, headers=headers, stream=True, timeout=timeout)
    try:
        assert r.status_code == 200, r.text
        buf = b""
        for chunk in r.iter_content(None):
            buf += chunk
            if b"\ndata: " in buf and buf.endswith(b"\n\n"):
                break
        return buf.decode()
    except requests.exceptions.ConnectionError:
        return None
    finally:
        r.close()


def test_a_signed_in_caller_follows_its_own_runs_only(srv, idp):
    ada, bob = idp.token(alg="HS256", sub="ada-events"), idp.token(alg="HS256", sub="bob-events")
    h = {"Authorization": f"Bearer {ada}"}
    assert requests.get(srv.base + "/q/notes", headers=h, timeout=10).status_code == 200
    text = first_event(srv, h, timeout=15)
    assert text and '"key_name": "jwt:ada-events"' in text
    # bob has no runs: his feed stays quiet (no event of ada's reaches him)
    assert first_event(srv, {"Authorization": f"Bearer {bob}"}, timeout=2) is None
    r = requests.get(srv.base + "/events", headers={"Authorization": "Bearer not.a.token"}, timeout=10)
    assert r.status_code == 401 and r.json()["code"] == "unauthorized"


# -- tokens ------------------------------------------------------------------------------------------------------
@pytest.fixture()
def trap():
    """An HTTP server that counts every request: a token's key URL must never be fetched."""
    hits = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *a):
            pass
    port = free_port()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), H)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{port}", hits
    httpd.shutdown()


def test_a_token_naming_its_own_key_is_refused_and_nothing_is_fetched(srv, idp, trap):
    url, hits = trap
    refused = {
        "jku": idp.token(headers={"jku": url + "/jwks.json"}),
        "x5u": idp.token(headers={"x5u": url + "/cert.pem"}),
        "jwk": idp.token(headers={"jwk": {"kty": "oct", "k": "c2VjcmV0"}}),
        "x5c": idp.token(headers={"x5c": ["MIIB"]}),
        "jku, HS256": idp.token(alg="HS256", headers={"jku": url + "/jwks.json"}),
    }
    for why, token in refused.items():
        r = requests.get(srv.base + "/q/notes", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert r.status_code == 401 and r.json()["code"] == "unauthorized", (why, r.text)
    assert requests.get(srv.base + "/q/notes", headers={"Authorization": f"Bearer {idp.token()}"},
                        timeout=10).status_code == 200, "the same token without the header passes"
    time.sleep(0.3)
    assert hits == [], f"a token's key URL was fetched: {hits}"


# -- /metrics, limits, OpenAPI ---------------------------------------------------------------------------------------
def test_metrics_token_scheme_is_case_insensitive_and_the_token_is_not(srv):
    for auth in ("Bearer metrics-token-1", "bearer metrics-token-1", "BEARER metrics-token-1"):
        assert requests.get(srv.base + "/metrics", headers={"Authorization": auth}, timeout=10).status_code == 200
    key = srv.post("/api/v1/api-keys", {"name": "metrics-reader", "queries": ["notes"]}).json()["secret"]
    for headers in ({}, {"Authorization": "Bearer METRICS-TOKEN-1"}, {"Authorization": "Bearer metrics-token"},
                    {"Authorization": "Basic bWV0cmljcy10b2tlbi0x"}, {"Authorization": "metrics-token-1"},
                    {"X-API-Key": key}, {"X-API-Key": "sk_wrong"},
                    {"Authorization": "Bearer " + srv.admin["X-API-Key"]}):
        r = requests.get(srv.base + "/metrics", headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["code"] == "unauthorized", headers
    # the administrator's key works everywhere, /metrics included
    assert requests.get(srv.base + "/metrics", headers=srv.admin, timeout=10).status_code == 200


def test_ratelimit_headers_are_integers(srv):
    key = srv.post("/api/v1/api-keys", {"name": "limited", "queries": ["notes"], "rate_limit": "4/minute",
                                        "quota": "50/day"}).json()["secret"]
    seen = []
    for _ in range(6):
        r = requests.get(srv.base + "/q/notes", headers={"X-API-Key": key}, timeout=10)
        seen.append(r.status_code)
        for h in ("RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset"):
            assert re.fullmatch(r"[0-9]+", r.headers[h]), (h, r.headers[h])
        if r.status_code == 429:
            assert r.json()["code"] == "rate_limited" and re.fullmatch(r"[0-9]+", r.headers["Retry-After"])
    assert seen[:4] == [200] * 4 and seen[4:] == [429, 429], seen


def test_openapi_lists_what_the_catalog_lists(srv):
    key = srv.post("/api/v1/api-keys", {"name": "reader", "queries": ["notes", "note", "add_note"]}).json()["secret"]
    h = {"X-API-Key": key}
    catalog = {i["name"] for i in requests.get(srv.base + "/catalog", headers=h, timeout=10).json()["items"]}
    doc = requests.get(srv.base + "/openapi.json", headers=h, timeout=10).json()
    listed = {p[3:] for p in doc["paths"] if p.startswith("/q/") and p != "/q/{name}"}
    assert catalog == {"notes", "note"}, "a write is not runnable by a read-only key"
    assert listed == catalog
    assert requests.get(srv.base + "/q/add_note", params={"id": 9}, headers=h, timeout=10).status_code == 403
    params = {p["name"]: p for p in doc["paths"]["/q/note"]["get"]["parameters"]}
    assert params["id"]["required"] is True, "a parameter without a default is required (API.md)"


# -- per-caller counts in the shared segment ------------------------------------------------------------------------
def test_many_callers_cannot_fill_the_segment_for_everyone(idp, tmp_path):
    """Each limited caller (a key, or a signed-in subject: a set with no bound) had series of its own in the
    segment's series table (its rate window, its streams): once the table was full, every new limited caller,
    every new stream and every new metric series was a 500 until the segment was made anew. Past the room kept
    for the instance's own series, callers are counted per worker, and nothing fails."""
    data = str(tmp_path / "d.db")
    db = sqlite3.connect(data)
    db.executescript("CREATE TABLE t (id INTEGER); INSERT INTO t VALUES (1), (2);")
    db.commit()
    db.close()
    # a small segment: 128 series in all
    s = start_server({"QAG_JWT_SECRET": SECRET, "QAG_JWT_ISSUER": ISS, "QAG_JWT_AUDIENCE": AUD,
                      "QAG_SHM_SIZE": str(4 << 20), "QAG_RESPONSE_CACHE_MB": "0"}, args=("--workers", "1"))
    try:
        post = lambda p, b: requests.post(s.base + p, json=b, headers=s.admin, timeout=10)
        assert post("/api/v1/connections", {"name": "d", "db": "sqlite", "database": data}).status_code == 201
        assert post("/api/v1/queries", {"name": "t", "connection_name": "d", "sql": "SELECT id FROM t",
                                        "publish": True}).status_code == 201
        assert post("/api/v1/roles", {"name": "limited", "queries": ["t"], "rate_limit": "100/minute"}).status_code \
            == 201
        http = requests.Session()
        statuses = []
        for i in range(150):
            token = idp.token(alg="HS256", sub=f"user-{i}", role="limited")
            statuses.append(http.get(s.base + "/q/t", headers={"Authorization": f"Bearer {token}"},
                                     timeout=10).status_code)
        assert set(statuses) == {200}, [(i, st) for i, st in enumerate(statuses) if st != 200][:3]
        # a caller seen after that is still limited (per worker: exact with one worker) and may stream
        key = post("/api/v1/api-keys", {"name": "late", "queries": ["t"], "rate_limit": "2/minute"}).json()["secret"]
        got = [requests.get(s.base + "/q/t", headers={"X-API-Key": key}, timeout=10).status_code for _ in range(3)]
        assert got == [200, 200, 429], got
        key2 = post("/api/v1/api-keys", {"name": "streamer", "queries": ["t"]}).json()["secret"]
        r = requests.get(s.base + "/q/t", params={"stream": "true", "format": "csv"}, headers={"X-API-Key": key2},
                         timeout=10)
        assert r.status_code == 200 and r.text.splitlines()[0] == "id"
        # and the instance's own series still have room: new routes and statuses are counted
        assert requests.get(s.base + "/nowhere", timeout=10).status_code == 404
        assert requests.get(s.base + "/metrics", timeout=10).status_code == 200
        assert "internal_error" not in requests.get(s.base + "/metrics", timeout=10).text
        assert "Traceback" not in s.log()
    finally:
        s.stop()


def test_a_signed_in_caller_is_403_on_management_routes_and_a_bad_token_401(srv, idp):
    good, bad = {"Authorization": f"Bearer {idp.token()}"}, {"Authorization": "Bearer not.a.token"}
    assert requests.get(srv.base + "/q/notes", headers=good, timeout=10).status_code == 200
    for path in ("/api/v1/api-keys", "/api/v1/history", "/api/v1/roles", "/-/shm"):
        r = requests.get(srv.base + path, headers=good, timeout=10)
        assert r.status_code == 403 and r.json()["code"] == "forbidden", (path, r.status_code)
        r = requests.get(srv.base + path, headers=bad, timeout=10)
        assert r.status_code == 401 and r.json()["code"] == "unauthorized", path
    r = requests.post(srv.base + "/api/v1/api-keys", json={"name": "by-jwt", "queries": ["*"]}, headers=good,
                      timeout=10)
    assert r.status_code == 403


# -- every 401 alike, through the data plane too ----------------------------------------------------------------------
def _refusal(base, headers) -> tuple:
    import http.client
    c = http.client.HTTPConnection(base.split("//")[1], timeout=10)
    c.putrequest("GET", "/q/t", skip_accept_encoding=True)
    for k, v in headers:
        c.putheader(k, v)
    c.endheaders()
    r = c.getresponse()
    body = json.loads(r.read())
    c.close()
    body.pop("request_id")
    return r.status, body, sorted(k.lower() for k, _ in r.getheaders() if k.lower() not in ("date",))


def test_every_401_is_alike_through_the_plane(plane, tmp_path):
    """The plane answers a key it knows (warm) itself and forwards an unknown one to gunicorn, which signed its
    answers `Server: gunicorn`: a real key outside its allowed_ips was told apart from a made-up one."""
    data = str(tmp_path / "d.db")
    db = sqlite3.connect(data)
    db.executescript("CREATE TABLE t (id INTEGER); INSERT INTO t VALUES (1);")
    db.commit()
    db.close()
    s = start_server({"QAG_WORKERS": "1", "QAG_PLANE_BIN": plane},
                     args=("--workers", "1", "--plane", "--plane-threads", "1"))
    try:
        post = lambda p, b: requests.post(s.base + p, json=b, headers=s.admin, timeout=10)
        assert post("/api/v1/connections", {"name": "d", "db": "sqlite", "database": data}).status_code == 201
        assert post("/api/v1/queries", {"name": "t", "connection_name": "d", "sql": "SELECT id FROM t",
                                        "publish": True}).status_code == 201
        fenced = post("/api/v1/api-keys", {"name": "fenced", "queries": ["t"],
                                           "allowed_ips": ["10.0.0.0/8"]}).json()["secret"]
        revoked = post("/api/v1/api-keys", {"name": "gone", "queries": ["t"]}).json()["secret"]
        assert requests.get(s.base + "/q/t", headers={"X-API-Key": revoked}, timeout=10).status_code == 200
        assert requests.patch(s.base + "/api/v1/api-keys/gone", json={"active": False}, headers=s.admin,
                              timeout=10).status_code == 200
        for _ in range(3):  # warm: the plane holds both keys' entries now
            requests.get(s.base + "/q/t", headers={"X-API-Key": fenced}, timeout=10)
        seen = {}
        for why, headers in {"none": [], "unknown": [("X-API-Key", "sk_made_up")], "empty": [("X-API-Key", "")],
                             "outside allowed_ips": [("X-API-Key", fenced)],
                             "spoofed address": [("X-API-Key", fenced), ("X-Qag-Client-Addr", "10.1.2.3"),
                                                 ("X-Forwarded-For", "10.1.2.3")],
                             "revoked": [("X-API-Key", revoked)], "bad token": [("Authorization", "Bearer a.b.c")]
                             }.items():
            seen[why] = _refusal(s.base, headers)
            assert seen[why][0] == 401, (why, seen[why])
        assert len({repr(v) for v in seen.values()}) == 1, seen
    finally:
        s.stop()


def test_without_a_configured_audience_a_token_naming_one_is_refused(idp, tmp_path):
    """RFC 7519 4.1.3: a token whose aud does not name its processor MUST be rejected. With no QAG_JWT_AUDIENCE qag
    names none, so a token minted for another service (same issuer, same key) is not taken."""
    data = str(tmp_path / "d.db")
    db = sqlite3.connect(data)
    db.executescript("CREATE TABLE t (id INTEGER); INSERT INTO t VALUES (1);")
    db.commit()
    db.close()
    s = start_server({"QAG_JWT_SECRET": SECRET}, args=("--workers", "1"))
    try:
        post = lambda p, b: requests.post(s.base + p, json=b, headers=s.admin, timeout=10)
        assert post("/api/v1/connections", {"name": "d", "db": "sqlite", "database": data}).status_code == 201
        assert post("/api/v1/queries", {"name": "t", "connection_name": "d", "sql": "SELECT id FROM t",
                                        "publish": True}).status_code == 201
        assert post("/api/v1/roles", {"name": "analyst", "queries": ["t"]}).status_code == 201
        call = lambda token: requests.get(s.base + "/q/t", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert call(idp.token(alg="HS256", aud=None)).status_code == 200
        for aud in ("billing-service", ["billing-service", "qag"]):
            r = call(idp.token(alg="HS256", aud=aud))
            assert r.status_code == 401 and r.json()["code"] == "unauthorized", aud
    finally:
        s.stop()


def test_discovery_leaves_out_what_identity_rules_refuse(srv, idp):
    """/catalog, /openapi.json and /mcp's tools/list list what /q would run for this caller: not a claim-bound
    query for an API key (403 sign_in_required), nor for a token without the claim (403 claim_missing), nor an
    unbound query for a role that requires claim binding (403 claim_binding_required)."""
    assert srv.post("/api/v1/queries", {"name": "my_notes", "connection_name": "crm", "publish": True,
                                        "sql": "SELECT id FROM notes WHERE owner = :owner",
                                        "parameters": {"owner": {"type": "str", "from_claim": "sub"}}}
                    ).status_code == 201
    assert srv.post("/api/v1/roles", {"name": "bound", "queries": ["notes", "my_notes"],
                                      "require_claims": True}).status_code == 201
    assert requests.patch(srv.base + "/api/v1/roles/analyst", json={"queries": ["notes", "my_notes"]},
                          headers=srv.admin, timeout=10).status_code == 200
    key = srv.post("/api/v1/api-keys", {"name": "lister", "queries": ["notes", "my_notes"]}).json()["secret"]

    def listed(headers) -> dict:
        cat = {i["name"] for i in requests.get(srv.base + "/catalog", headers=headers, timeout=10).json()["items"]}
        doc = requests.get(srv.base + "/openapi.json", headers=headers, timeout=10).json()
        api = {p[3:] for p in doc["paths"] if p.startswith("/q/") and p != "/q/{name}"}
        r = requests.post(srv.base + "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                          headers=headers, timeout=10)
        tools = {t["name"] for t in r.json()["result"]["tools"]}
        assert cat == api == tools, (cat, api, tools)
        return cat

    def runs(headers, name) -> int:
        return requests.get(srv.base + f"/q/{name}", headers=headers, timeout=10).status_code

    cases = {"key": {"X-API-Key": key},
             "token": {"Authorization": f"Bearer {idp.token(sub='ada')}"},
             "token without sub": {"Authorization": f"Bearer {idp.token(sub=None)}"},
             "role requiring claims": {"Authorization": f"Bearer {idp.token(sub='ada', role='bound')}"}}
    expected = {"key": {"notes"}, "token": {"notes", "my_notes"}, "token without sub": {"notes"},
                "role requiring claims": {"my_notes"}}
    for who, headers in cases.items():
        assert listed(headers) == expected[who], who
        for name in ("notes", "my_notes"):
            assert (runs(headers, name) == 200) == (name in expected[who]), (who, name)


def test_a_key_made_again_under_a_deleted_keys_name_does_not_follow_its_runs(srv):
    """/events filters a key's runs by its name; a key deleted and made again under the same name (another holder)
    saw every run of the one before."""
    old = srv.post("/api/v1/api-keys", {"name": "reborn", "queries": ["notes"]}).json()["secret"]
    assert requests.get(srv.base + "/q/notes", headers={"X-API-Key": old, "X-Request-Id": "old-holder-call"},
                        timeout=10).status_code == 200
    assert requests.delete(srv.base + "/api/v1/api-keys/reborn", headers=srv.admin, timeout=10).status_code == 204
    time.sleep(0.05)  # the new key is made a clock tick after the old key's run
    new = srv.post("/api/v1/api-keys", {"name": "reborn", "queries": ["notes"]}).json()["secret"]
    assert requests.get(srv.base + "/q/notes", headers={"X-API-Key": new, "X-Request-Id": "new-holder-call"},
                        timeout=10).status_code == 200
    text = first_event(srv, {"X-API-Key": new}, timeout=15)
    assert text and "new-holder-call" in text and "old-holder-call" not in text, text


def test_an_administrators_event_stream_ends_when_its_token_is_revoked(srv):
    token = admin_token(srv, "events-watcher")
    r = requests.get(srv.base + "/events", headers={"X-API-Key": token}, stream=True, timeout=(5, 20))
    assert r.status_code == 200
    admin_token(srv, "events-watcher", "revoke")
    t0 = time.time()
    try:
        for _ in r.iter_content(None):  # the stream must end by itself, not wait out the read timeout
            assert time.time() - t0 < 15, "still streaming after the token was revoked"
    except requests.exceptions.RequestException as exc:
        raise AssertionError(f"the stream did not end: {exc}") from None
    finally:
        r.close()
    assert time.time() - t0 < 15


def test_allowed_ips_on_a_dual_stack_bind(tmp_path):
    """Bound on [::], an IPv4 caller arrives as ::ffff:a.b.c.d: it must match an IPv4 allow-list (it was refused),
    and IPv6 loopback is still not IPv4 loopback."""
    data = str(tmp_path / "d.db")
    db = sqlite3.connect(data)
    db.executescript("CREATE TABLE t (id INTEGER); INSERT INTO t VALUES (1);")
    db.commit()
    db.close()
    port = free_port()
    s = start_server({"QAG_BIND": f"[::]:{port}"}, args=("--workers", "1"), wait=False)
    v4, v6 = f"http://127.0.0.1:{port}", f"http://[::1]:{port}"
    try:
        deadline = time.time() + 30
        while True:
            try:
                if requests.get(v4 + "/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.time() < deadline and s.proc.poll() is None, s.log()
            time.sleep(0.2)
        post = lambda p, b: requests.post(v4 + p, json=b, headers=s.admin, timeout=10)
        assert post("/api/v1/connections", {"name": "d", "db": "sqlite", "database": data}).status_code == 201
        assert post("/api/v1/queries", {"name": "t", "connection_name": "d", "sql": "SELECT id FROM t",
                                        "publish": True}).status_code == 201
        k4 = post("/api/v1/api-keys", {"name": "v4", "queries": ["t"], "allowed_ips": ["127.0.0.1/32"]}).json()
        k6 = post("/api/v1/api-keys", {"name": "v6", "queries": ["t"], "allowed_ips": ["::1/128"]}).json()
        get = lambda base, k: requests.get(base + "/q/t", headers={"X-API-Key": k["secret"]}, timeout=10).status_code
        assert get(v4, k4) == 200
        assert get(v6, k6) == 200
        assert get(v6, k4) == 401 and get(v4, k6) == 401
        r = requests.get(v6 + "/q/t", headers={"X-API-Key": k4["secret"], "X-Forwarded-For": "127.0.0.1"},
                         timeout=10)
        assert r.status_code == 401, "a forwarded address is not the caller's"
    finally:
        s.stop()


@pytest.mark.parametrize("role", ["analyst\u0000", "analyst\n", "../analyst", "", "a" * 101, "ana lyst", "analyst;"])
def test_a_role_claim_that_cannot_be_a_role_name_is_401(srv, idp, role):
    r = requests.get(srv.base + "/q/notes", headers={"Authorization": f"Bearer {idp.token(role=role)}"}, timeout=10)
    assert r.status_code == 401 and r.json()["code"] == "unauthorized", (role, r.status_code, r.text[:200])
