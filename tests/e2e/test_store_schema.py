"""End to end: a metadata store migrated by a newer qag is refused at start, in one line, before anything is
created (qag/store_migrations.py; rolling upgrades run the new version's hosts first), on SQLite and PostgreSQL."""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import pytest

from qag.store import Store
from qag.store_migrations import LATEST
from tests.conftest import ROOT, free_port, pg_exec, pg_fresh_db


def _serve(env_extra: dict, home: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, QAG_HOME=home, QAG_BIND=f"127.0.0.1:{free_port()}", QAG_ADMIN_KEY="adm",
               QAG_LOG_LEVEL="warning", **env_extra)
    return subprocess.run([sys.executable, "-m", "qag.cli", "serve", "--workers", "1"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)


def _expect_refused(r: subprocess.CompletedProcess, found: int) -> None:
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 3 and lines == [
        f"qag: cannot start: the metadata store's schema is version {found}, newer than this qag knows "
        f"(version {LATEST}); upgrade qag on this host, or point it at another store"], (r.returncode, lines)


def test_sqlite_store_newer_than_the_code_is_refused_at_start(tmp_path):
    home = str(tmp_path / "home")
    Store(home=home).migrate()
    db = sqlite3.connect(os.path.join(home, "qag.db"))
    db.execute("INSERT INTO qag_schema_version VALUES (?, 'from a newer qag', '2027-01-01T00:00:00.000Z')",
               (LATEST + 1,))
    db.commit()
    db.close()
    _expect_refused(_serve({}, home), LATEST + 1)
    # nothing was written: the newer schema's version is still the last one, and `qag migrate` refuses it too
    db = sqlite3.connect(os.path.join(home, "qag.db"))
    assert db.execute("SELECT MAX(version) FROM qag_schema_version").fetchone()[0] == LATEST + 1
    db.close()
    env = dict(os.environ, QAG_HOME=home)
    r = subprocess.run([sys.executable, "-m", "qag.cli", "migrate"], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 1 and r.stderr.startswith("qag: cannot migrate: the metadata store's schema is version "
                                                     f"{LATEST + 1}, newer"), r.stderr


def test_sqlite_store_at_the_codes_version_starts(tmp_path):
    """The refusal is for newer only: the same store at LATEST migrates to LATEST and is accepted."""
    home = str(tmp_path / "home")
    assert Store(home=home).migrate() == LATEST
    assert Store(home=home).migrate() == LATEST


@pytest.mark.timeout(120)
def test_postgres_store_newer_than_the_code_is_refused_at_start(tmp_path):
    dsn = pg_fresh_db("qag_domain_schema")
    s = Store(home=str(tmp_path / "h0"), database_url=dsn)
    assert s.migrate() == LATEST
    s.close()
    pg_exec(dsn, "INSERT INTO qag_schema_version VALUES (%s, 'from a newer qag', '2027-01-01T00:00:00.000Z')",
            (LATEST + 2,))
    _expect_refused(_serve({"QAG_DATABASE_URL": dsn}, str(tmp_path / "home")), LATEST + 2)
