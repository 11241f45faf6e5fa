"""Signed-in callers through a real `qag serve`: tokens from a test identity provider (a JWKS server on loopback that
this test starts, RS256 and ES256 keys, plus HS256 with a shared secret), verified by PyJWT in qag; roles as grant
templates; parameters bound to a verified claim. Every bad token is the same 401 as a bad key."""
from __future__ import annotations

import http.server
import json
import sqlite3
import threading
import time

import jwt
import pytest
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from tests.conftest import free_port

ISS, AUD, SECRET = "https://idp.test", "qag-tests", "hs-shared-secret-for-tests-0123456789"


class IdP:
    """A JWKS endpoint whose key set the test can change (key rotation)."""

    def __init__(self):
        self.rsa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.ec = ec.generate_private_key(ec.SECP256R1())
        self.rotated = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.keys = [self._jwk(self.rsa.public_key(), "rsa1", "RS256"), self._jwk(self.ec.public_key(), "ec1", "ES256")]
        self.fetches = 0
        idp = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                idp.fetches += 1
                body = json.dumps({"keys": idp.keys}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass
        self.port = free_port()
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), H)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @staticmethod
    def _jwk(pub, kid, alg):
        algo = jwt.algorithms.RSAAlgorithm if alg == "RS256" else jwt.algorithms.ECAlgorithm
        d = json.loads(algo.to_jwk(pub))
        d.update(kid=kid, alg=alg, use="sig")
        return d

    def token(self, claims=None, *, alg="RS256", kid=None, key=None, headers=None, **over):
        now = int(time.time())
        body = {"iss": ISS, "aud": AUD, "sub": "ada", "role": "analyst", "iat": now, "exp": now + 300, **(claims or {})}
        for k, v in over.items():
            if v is None:
                body.pop(k, None)
            else:
                body[k] = v
        if alg == "RS256":
            key, kid = key or self.rsa, kid or "rsa1"
        elif alg == "ES256":
            key, kid = key or self.ec, kid or "ec1"
        elif alg == "HS256":
            key = key or SECRET
        return jwt.encode(body, key, algorithm=alg, headers={**({"kid": kid} if kid else {}), **(headers or {})})


@pytest.fixture(scope="module")
def idp():
    p = IdP()
    yield p
    p.httpd.shutdown()


@pytest.fixture(scope="module")
def srv(idp, tmp_path_factory):
    from tests.conftest import start_server
    data = str(tmp_path_factory.mktemp("signed") / "crm.db")
    db = sqlite3.connect(data)
    db.executescript("CREATE TABLE notes (id INTEGER, owner TEXT, body TEXT, email TEXT);"
                     "INSERT INTO notes VALUES (1, 'ada', 'ada note', 'ada@corp.example'),"
                     "(2, 'bob', 'bob note', 'bob@corp.example'), (3, 'ada', 'ada two', 'ada2@corp.example');")
    db.commit()
    db.close()
    s = start_server({"QAG_JWT_JWKS_URL": f"http://127.0.0.1:{idp.port}/jwks.json", "QAG_JWT_SECRET": SECRET,
                      "QAG_JWT_ISSUER": ISS, "QAG_JWT_AUDIENCE": AUD, "QAG_JWT_LEEWAY_SECONDS": "5"},
                     args=("--workers", "1"))
    adm = s.admin
    post = lambda p, b: requests.post(s.base + p, json=b, headers=adm, timeout=10)
    assert post("/api/v1/connections", {"name": "crm", "db": "sqlite", "database": data}).status_code == 201
    for q in ({"name": "mine", "sql": "SELECT id, body, email FROM notes WHERE owner = :owner ORDER BY id",
               "parameters": {"owner": {"type": "str", "from_claim": "sub"}}},
              {"name": "all_notes", "sql": "SELECT id, owner, email FROM notes ORDER BY id"}):
        r = post("/api/v1/queries", {**q, "connection_name": "crm", "publish": True})
        assert r.status_code == 201, r.text
    r = post("/api/v1/roles", {"name": "analyst", "queries": ["mine", "all_notes"], "connections": ["crm"],
                               "mask": [{"column": "notes.email", "action": "mask"}]})
    assert r.status_code == 201, r.text
    r = post("/api/v1/roles", {"name": "strict", "queries": ["*"], "require_claims": True})
    assert r.status_code == 201, r.text
    s.post = post
    yield s
    s.stop()


def call(srv, path, token=None, key=None, **params):
    h = {}
    if token:
        h["Authorization"] = f"Bearer {token}"
    if key:
        h["X-API-Key"] = key
    return requests.get(srv.base + path, params=params, headers=h, timeout=10)


def test_signed_in_callers_read_their_own_rows_governed(srv, idp):
    for alg in ("RS256", "ES256", "HS256"):
        r = call(srv, "/q/mine", idp.token(alg=alg))
        assert r.status_code == 200, (alg, r.text)
        assert [x["body"] for x in r.json()] == ["ada note", "ada two"]
        assert r.json()[0]["email"] == "a***@corp.example", "the role's masking applies"
    r = call(srv, "/q/mine", idp.token(sub="bob"))
    assert [x["id"] for x in r.json()] == [2]
    r = call(srv, "/q/all_notes", idp.token())
    assert r.status_code == 200 and all("***" in x["email"] for x in r.json())
    hist = requests.get(srv.base + "/api/v1/history", params={"query": "mine"}, headers=srv.admin, timeout=10).json()
    deadline = time.time() + 10
    while not any(i["key_name"] == "jwt:bob" for i in hist["items"]) and time.time() < deadline:
        time.sleep(0.2)
        hist = requests.get(srv.base + "/api/v1/history", params={"query": "mine"}, headers=srv.admin,
                            timeout=10).json()
    assert any(i["key_name"] == "jwt:bob" for i in hist["items"]), "a signed-in call is recorded under its caller"


def test_claim_bound_parameters(srv, idp):
    r = call(srv, "/q/mine", idp.token(), owner="bob")
    assert r.status_code == 400 and r.json()["code"] == "param_from_claim"
    r = call(srv, "/q/mine", idp.token(sub=None))
    assert r.status_code == 403 and r.json()["code"] == "claim_missing"
    key = srv.post("/api/v1/api-keys", {"name": "script", "queries": ["mine"], "connections": ["crm"]}).json()["secret"]
    r = call(srv, "/q/mine", key=key, owner="bob")
    assert r.status_code == 403 and r.json()["code"] == "sign_in_required"
    r = call(srv, "/q/mine", key=srv.admin["X-API-Key"], owner="bob")
    assert r.status_code == 200 and [x["id"] for x in r.json()] == [2], "an administrator gives it"
    r = call(srv, "/q/all_notes", idp.token(role="strict"))
    assert r.status_code == 403 and r.json()["code"] == "claim_binding_required"
    assert call(srv, "/q/mine", idp.token(role="strict")).status_code == 200
    cat = requests.get(srv.base + "/catalog", headers={"Authorization": f"Bearer {idp.token()}"}, timeout=10).json()
    mine = next(i for i in cat["items"] if i["name"] == "mine")
    assert "owner" not in mine["parameters"]
    doc = requests.get(srv.base + "/openapi.json", headers={"Authorization": f"Bearer {idp.token()}"}, timeout=10)
    doc = doc.json()
    assert "bearer" in doc["components"]["securitySchemes"]
    assert "owner" not in [p["name"] for p in doc["paths"]["/q/mine"]["get"]["parameters"]]


def test_every_bad_token_is_the_same_401(srv, idp):
    pub_pem = idp.rsa.public_key().public_bytes(serialization.Encoding.PEM,
                                                 serialization.PublicFormat.SubjectPublicKeyInfo)
    now = int(time.time())
    bad = {
        "expired": idp.token(exp=now - 60),
        "not yet valid": idp.token(nbf=now + 600),
        "no exp": idp.token(exp=None),
        "wrong audience": idp.token(aud="someone-else"),
        "wrong issuer": idp.token(iss="https://evil.test"),
        "unknown role": idp.token(role="root"),
        "no role": idp.token(role=None),
        "unsigned": jwt.encode({"iss": ISS, "aud": AUD, "sub": "ada", "role": "analyst", "exp": now + 300}, None,
                               algorithm="none"),
        "wrong HS secret": idp.token(alg="HS256", key="not-the-secret-not-the-secret-0000"),
        "foreign RSA key": idp.token(key=rsa.generate_private_key(public_exponent=65537, key_size=2048)),
        "oversized": idp.token(pad="x" * 9000),
        "malformed": "not.a.token",
        "garbage": "Zm9v",
    }
    # algorithm confusion: an HS256 token whose "secret" is the provider's public key
    header = jwt.utils.base64url_encode(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "rsa1"}).encode())
    payload = jwt.utils.base64url_encode(json.dumps({"iss": ISS, "aud": AUD, "sub": "ada", "role": "analyst",
                                                     "exp": now + 300}).encode())
    import hashlib
    import hmac
    sig = jwt.utils.base64url_encode(hmac.new(pub_pem, header + b"." + payload, hashlib.sha256).digest())
    bad["HS256 signed with the public key"] = (header + b"." + payload + b"." + sig).decode()
    texts = set()
    for why, token in bad.items():
        r = call(srv, "/q/all_notes", token)
        assert r.status_code == 401 and r.json()["code"] == "unauthorized", (why, r.text)
        texts.add(r.json()["error"])
    r = requests.get(srv.base + "/q/all_notes", headers={"Authorization": "Basic YTpi"}, timeout=10)
    assert r.status_code == 401
    texts.add(r.json()["error"])
    texts.add(call(srv, "/q/all_notes", key="sk_not_a_key").json()["error"])
    assert len(texts) == 1, f"refusals must not tell why (nor which way in failed): {texts}"


def test_an_unknown_kid_refreshes_the_key_set(srv, idp):
    time.sleep(1.1)   # qag refetches a key set at most once a second
    before = idp.fetches
    idp.keys.append(IdP._jwk(idp.rotated.public_key(), "rsa2", "RS256"))
    r = call(srv, "/q/mine", idp.token(kid="rsa2", key=idp.rotated))
    assert r.status_code == 200, r.text
    assert idp.fetches > before


def test_role_changes_reach_signed_in_callers_and_keys_from_roles(srv, idp):
    token = idp.token(sub="carol")
    assert call(srv, "/q/all_notes", token).json()[0]["email"] == "a***@corp.example"
    r = requests.patch(srv.base + "/api/v1/roles/analyst", json={"mask": [{"column": "notes.email", "action": "null"}]},
                       headers=srv.admin, timeout=10)
    assert r.status_code == 200, r.text
    assert call(srv, "/q/all_notes", token).json()[0]["email"] is None, "the next call has the new grants"
    k = srv.post("/api/v1/api-keys", {"name": "from_role", "role": "analyst"})
    assert k.status_code == 201 and k.json()["queries"] == ["mine", "all_notes"]
    assert call(srv, "/q/all_notes", key=k.json()["secret"]).json()[0]["email"] is None
    assert srv.post("/api/v1/api-keys", {"name": "x", "role": "nope"}).status_code == 404
    assert requests.delete(srv.base + "/api/v1/roles/analyst", headers=srv.admin, timeout=10).status_code == 204
    assert call(srv, "/q/all_notes", token).status_code == 401, "a deleted role signs nobody in"
    assert call(srv, "/q/all_notes", key=k.json()["secret"]).status_code == 200, "a key's grants were copied"
    audit = requests.get(srv.base + "/api/v1/audit", headers=srv.admin, timeout=10).json()
    assert any(a["entity"] == "role" and a["action"] == "delete" for a in audit["items"])
