"""Management API list paging on a PostgreSQL store whose collation is not C (issue 13, item 13): the store
sorts in its collation, the cursor compares as Python does; every item must come exactly once, in order."""
from __future__ import annotations

import json

import falcon.testing
import pytest

from tests.conftest import PG_ADMIN_DSN, pg_exec

DB = "qag_ops_paging_icu"
# Names an ICU or glibc locale sorts quite unlike code points: case folded, punctuation nearly ignored.
NAMES = ["a", "A0", "a-c", "a.b", "a_b", "aB", "Ab", "b", "B", "Z", "z-a", "z_a", "zA", "0x", "9.z"]


@pytest.fixture(scope="module")
def client():
    import psycopg2
    admin = psycopg2.connect(PG_ADMIN_DSN)
    admin.autocommit = True
    cur = admin.cursor()
    cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (DB,))
    cur.execute(f"DROP DATABASE IF EXISTS {DB}")
    cur.execute(f"CREATE DATABASE {DB} TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'und' LOCALE 'C.utf8'")
    admin.close()
    dsn = PG_ADMIN_DSN.rsplit("/", 1)[0] + "/" + DB
    # the premise: this database does not sort names as Python does
    assert [r[0] for r in pg_exec(dsn, "SELECT x FROM unnest(%s::text[]) x ORDER BY x", (NAMES,))] != sorted(NAMES)
    import tempfile

    from qag import config
    from qag.http.app import create_app
    cfg = config.load({"QAG_HOME": tempfile.mkdtemp(prefix="qag-ops-paging-"), "QAG_ADMIN_KEY": "adm",
                       "QAG_DATABASE_URL": dsn})
    app = create_app(cfg)
    c = falcon.testing.TestClient(app)
    yield c
    app.runtime.close()
    app.runtime.store.close()


H = {"X-API-Key": "adm", "Content-Type": "application/json"}


def _all_pages(client, path: str, limit: int) -> list[str]:
    seen, cursor = [], None
    for _ in range(100):
        r = client.simulate_get(path, headers=H, params={"limit": limit, **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200, r.text
        seen += [i["name"] for i in r.json["items"]]
        cursor = r.json["next_cursor"]
        if cursor is None:
            return seen
    raise AssertionError("paging never ended")


@pytest.mark.parametrize("limit", [1, 2, 4, 1000])
def test_api_keys_page_through_every_item_once_in_order(client, limit):
    if not client.simulate_get("/api/v1/api-keys", headers=H).json["items"]:
        for n in NAMES:
            r = client.simulate_post("/api/v1/api-keys", headers=H,
                                     body=json.dumps({"name": n, "queries": [], "connections": []}))
            assert r.status_code == 201, r.text
    assert _all_pages(client, "/api/v1/api-keys", limit) == sorted(NAMES)


@pytest.mark.parametrize("limit", [1, 3])
def test_connections_page_through_every_item_once_in_order(client, limit, tmp_path):
    if not client.simulate_get("/api/v1/connections", headers=H).json["items"]:
        for n in NAMES:
            r = client.simulate_post("/api/v1/connections", headers=H,
                                     body=json.dumps({"name": n, "db": "sqlite", "database": str(tmp_path / "x.db"),
                                                      "active": False}))
            assert r.status_code == 201, r.text
    assert _all_pages(client, "/api/v1/connections", limit) == sorted(NAMES)
