#!/usr/bin/env python3
"""Fault experiments for the data sessions (qag/connectors.py), on PRIVATE PostgreSQL and MariaDB instances
(ports and temp dirs of their own, never the machine's shared servers), each run with the current module and,
for comparison, with the module at git revision --base:

  frozen    the server SIGSTOPped for --freeze seconds while 8 pooled calls (limit 2 s, and ?timeout=0.5) run:
            how long each call took and what it answered
  restart   8 idle pooled sessions, the server restarted, then 200 calls from 4 threads: how many failed
  trips     50 reads on a warm session: messages the server logged (PostgreSQL log_statement) or counted
            (MariaDB Questions, Com_admin_commands = pings) per read
  timeout   ?timeout=0.0004: the limit the server was given for the statement

    PYTHONPATH=. python bench/faults_dbsessions.py [--base 0abf9db] [--freeze 8] [--only pg|my]

Figures of 2026-12-01: bench/results/2026-12-01-faults/dbsessions.md.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from qag import config, connectors  # noqa: E402
from tests.integration.dbsess_instances import PrivateMariaDB, PrivatePostgres  # noqa: E402

CFG = config.load({"QAG_QUERY_TIMEOUT": "2", "QAG_CONNECT_TIMEOUT": "2", "QAG_POOL_SIZE": "8"})
LOOKUP = "SELECT aid, abalance FROM acc WHERE aid = %s"
DB = "qag_dbsess_faults"


def load_base(rev: str):
    src = subprocess.run(["git", "show", f"{rev}:qag/connectors.py"], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout
    path = os.path.join(tempfile.mkdtemp(), "base_connectors.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("base_connectors", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(c, sql, args=(), timeout=None):
    kw = {"state_free": True} if "state_free" in c.run.__code__.co_varnames else {}
    return c.run(sql, args, write=False, timeout=timeout, max_rows=None, **kw)


def outcome(exc: BaseException | None) -> str:
    if exc is None:
        return "200"
    status = getattr(exc, "status", None)
    return f"{status} {exc.code}" if status else type(exc).__name__


def fill(c, n):
    held = [c.acquire(False)[0] for _ in range(n)]
    for s in held:
        c.release(s, False)


def frozen(inst, mod, freeze: float) -> str:
    c = mod.make(inst.row(DB), "", CFG)
    fill(c, 8)
    res: list[tuple[float, str]] = []

    def one(t):
        t0 = time.monotonic()
        try:
            run(c, LOOKUP, (1,), timeout=t)
            exc = None
        except BaseException as e:  # noqa: BLE001 - any answer is the figure
            exc = e
        res.append((time.monotonic() - t0, outcome(exc)))
    inst.freeze()
    threads = [threading.Thread(target=one, args=(0.5 if i % 2 else None,)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(freeze)
    inst.thaw()
    for t in threads:
        t.join()
    c.close()
    worst = max(d for d, _ in res)
    codes = sorted({o for _, o in res})
    return f"slowest call {worst:.2f} s (limit 2 s / 0.5 s, frozen {freeze:g} s); answers {codes}"


def restart(inst, mod) -> str:
    c = mod.make(inst.row(DB), "", CFG)
    fill(c, 8)
    t0 = time.monotonic()
    inst.restart()
    took = time.monotonic() - t0
    errors: list[str] = []
    t1 = time.monotonic()

    def caller(k):
        for i in range(50):
            try:
                run(c, LOOKUP, (1 + (k * 50 + i) % 1000,))
            except BaseException as e:  # noqa: BLE001
                errors.append(outcome(e))
    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    calls = time.monotonic() - t1
    c.close()
    return f"{len(errors)} of 200 calls failed {sorted(set(errors))} (restart {took:.1f} s, calls {calls:.2f} s)"


def trips(inst, mod, which) -> str:
    c = mod.make(inst.row(DB), "", CFG)
    run(c, LOOKUP, (1,))
    if which == "pg":
        time.sleep(0.3)
        before = len(inst.statements())
        for i in range(50):
            run(c, LOOKUP, (i + 1,))
        time.sleep(0.5)
        n = len(inst.statements()) - before
        c.close()
        return f"{n / 50:g} messages per read"
    names = ("Questions", "Com_admin_commands")
    a, b = inst.status(*names), inst.status(*names)
    before = inst.status(*names)
    for i in range(50):
        run(c, LOOKUP, (i + 1,))
    after = inst.status(*names)
    c.close()
    q = (after["Questions"] - before["Questions"] - (b["Questions"] - a["Questions"])) / 50
    p = (after["Com_admin_commands"] - before["Com_admin_commands"]
         - (b["Com_admin_commands"] - a["Com_admin_commands"])) / 50
    return f"{q:g} queries + {p:g} pings per read"


def tiny_timeout(inst, mod, which) -> str:
    c = mod.make(inst.row(DB), "", CFG)
    probe = "SELECT current_setting('statement_timeout')" if which == "pg" else "SELECT @@max_statement_time"
    try:
        got = run(c, probe, timeout=0.0004)[1][0][0]
    finally:
        c.close()
    return f"?timeout=0.0004 gave the statement a limit of {got!r}" + (" (no limit)" if str(got) in ("0", "0.0")
                                                                        else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="0abf9db")
    ap.add_argument("--freeze", type=float, default=8.0)
    ap.add_argument("--only", choices=("pg", "my"))
    a = ap.parse_args()
    mods = {"base " + a.base: load_base(a.base), "now": connectors}
    for which in ("pg", "my"):
        if a.only and a.only != which:
            continue
        inst = PrivatePostgres() if which == "pg" else PrivateMariaDB()
        try:
            if which == "pg":
                inst.execute(f"CREATE DATABASE {DB}")
                inst.execute("CREATE TABLE acc AS SELECT g AS aid, 0 AS abalance FROM generate_series(1, 1000) g; "
                             "ALTER TABLE acc ADD PRIMARY KEY (aid)", DB)
            else:
                inst.execute(f"CREATE DATABASE {DB}")
                inst.execute("CREATE TABLE acc (aid INT PRIMARY KEY, abalance INT)", DB)
                inst.execute("INSERT INTO acc SELECT seq, 0 FROM seq_1_to_1000", DB)
            name = "PostgreSQL 15" if which == "pg" else "MariaDB 10.11"
            # the freezes last: a thawed instance takes longer to stop (its restart would be slower)
            for exp, fn in (("trips", lambda m: trips(inst, m, which)),
                            ("timeout", lambda m: tiny_timeout(inst, m, which)),
                            ("restart", lambda m: restart(inst, m)), ("frozen", lambda m: frozen(inst, m, a.freeze))):
                for label, mod in mods.items():
                    t0 = time.monotonic()
                    try:
                        out = fn(mod)
                    except BaseException as e:  # noqa: BLE001
                        out = f"experiment failed: {e!r}"
                    print(f"| {name} | {label} | {exp} | {out} | {time.monotonic() - t0:.1f} s |", flush=True)
        finally:
            inst.stop()


if __name__ == "__main__":
    main()
