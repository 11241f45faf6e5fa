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
