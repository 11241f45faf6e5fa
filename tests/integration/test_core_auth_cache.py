"""A worker's key cache stays bounded whatever secrets clients send (issue 13 item 6): every distinct wrong
X-API-Key was cached for ever (about 250 bytes each, +15 MB per worker after 60,000)."""
from __future__ import annotations

import secrets
import tracemalloc

import pytest

from qag import config
from qag.auth import Auth
from qag.errors import ApiError
from qag.runtime import LocalGenerations, Runtime
from qag.store import Store


@pytest.fixture()
def auth(tmp_path):
    cfg = config.load({"QAG_HOME": str(tmp_path)})
    store = Store(home=cfg.home)
    store.migrate()
    yield Auth(Runtime(cfg, store, LocalGenerations()))
    store.close()


def test_wrong_secrets_do_not_grow_memory(auth):
    def wrong(n):
        for _ in range(n):
            with pytest.raises(ApiError) as ei:
                auth.authenticate("sk_" + secrets.token_hex(16), "127.0.0.1")
            assert ei.value.status == 401
    wrong(3000)  # fill whatever bounded cache there is
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    wrong(12_000)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 512 * 1024, f"{grown} bytes kept for 12,000 wrong secrets"


def test_a_wrong_secret_is_refused_from_the_cache(auth):
    secret = "sk_" + secrets.token_hex(16)
    for _ in range(3):
        with pytest.raises(ApiError):
            auth.authenticate(secret, "127.0.0.1")
    statements = []
    auth.runtime.store.observer = type("O", (), {"store_statement": lambda self: statements.append(1)})()
    with pytest.raises(ApiError):
        auth.authenticate(secret, "127.0.0.1")
    assert statements == []  # answered from the cache, no store lookup


def test_an_allow_list_is_checked_on_every_call_and_follows_a_change(auth):
    """The allow-list is parsed once per cached key row; every call still checks the caller's address against it,
    and a changed list (a new row, after the key's generation is bumped) is the one checked from the next call."""
    store, rt = auth.runtime.store, auth.runtime
    _, secret = store.create_key("t", "ips", {"queries": ["*"], "allowed_ips": ["10.1.0.0/16", "bogus", "::1"]},
                                 True, None, "")
    for _ in range(3):  # the first call reads the row, the others use the cached one
        assert auth.authenticate(secret, "10.1.2.3").name == "ips"
        assert auth.authenticate(secret, "::1").name == "ips"
        for ip in ("10.2.0.1", "127.0.0.1", "not an address", None):
            with pytest.raises(ApiError) as ei:
                auth.authenticate(secret, ip)
            assert ei.value.status == 401 and ei.value.code == "unauthorized"
    store.update_key("t", "ips", {"allowed_ips": ["127.0.0.0/8"]}, {})
    rt.changed("key", "ips")
    assert auth.authenticate(secret, "127.0.0.1").name == "ips"
    with pytest.raises(ApiError):
        auth.authenticate(secret, "10.1.2.3")
