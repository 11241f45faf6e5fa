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
