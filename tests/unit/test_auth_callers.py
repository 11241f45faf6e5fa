"""A signed-in caller's name (qag/auth.py caller_of): what its runs are recorded, its limits counted and its /events
filtered under. Two subjects are never one caller, and no subject can print a second log line."""
from __future__ import annotations

from qag.auth import caller_of


def test_one_name_per_subject():
    long_a, long_b = "u" * 250 + "a", "u" * 250 + "b"
    subjects = ["ada", "", "?", "a\nb", "a\\nb", 'a"b', "a\x00", "a\x01", "ädä", long_a, long_b, "jwt", "x" * 200]
    names = [caller_of(s) for s in subjects] + [caller_of(None)]
    assert len(set(names)) == len(names), names
    assert caller_of("ada") == "jwt:ada"
    assert all("\n" not in n and "\x00" not in n and len(n) <= 204 for n in names)
    assert caller_of(None) == "jwt?", "no subject: a name no key (letters, digits, _ . -) and no subject can have"


def test_this_workers_own_limit_windows_are_bounded(monkeypatch):
    """Without a segment (or with no room in it) a worker counts each caller's window itself; signed-in subjects
    have no bound, so windows of a past period are dropped once there are MAX_LOCAL_WINDOWS."""
    import types

    from qag import auth
    from qag.limits import parse
    monkeypatch.setattr(auth, "MAX_LOCAL_WINDOWS", 50)
    cfg = types.SimpleNamespace(admin_key="", redis_url="")
    a = auth.Auth(types.SimpleNamespace(cfg=cfg, generations=None, slot=0))
    spec = parse("rate_limit", "2/minute")
    for i in range(200):
        assert a._host_window("rate_limit", caller_of(f"u{i}"), spec, 1000.0 + i * 60)[0] is False
    assert len(a._windows) <= 51
    over = [a._host_window("rate_limit", "jwt:x", spec, 50_000.0)[0] for _ in range(3)]
    assert over == [False, False, True], "a current window still counts"
