"""The grammar of rate_limit and quota (qag/limits.py parse): what is accepted, and the sentence for the rest."""
from __future__ import annotations

import pytest

from qag import limits


@pytest.mark.parametrize("field,value,calls,rows,per", [
    ("rate_limit", "60/minute", 60, None, "minute"),
    ("rate_limit", "5/seconds", 5, None, "second"),
    ("quota", "100/Month", 100, None, "month"),
    ("quota", {"calls": 5}, 5, None, "day"),
    ("quota", {"rows": 7, "per": "hour"}, None, 7, "hour"),
    ("quota", {"calls": 1, "rows": 2, "per": "minute"}, 1, 2, "minute"),
])
def test_accepted(field, value, calls, rows, per):
    spec = limits.parse(field, value)
    assert (spec.calls, spec.rows, spec.per) == (calls, rows, per)


@pytest.mark.parametrize("field,value", [
    ("rate_limit", "0/minute"), ("rate_limit", "-1/minute"), ("rate_limit", "1e3/minute"),
    ("rate_limit", "10/fortnight"), ("rate_limit", "10/month"), ("rate_limit", ""), ("rate_limit", "10"),
    ("rate_limit", 10), ("rate_limit", "1000000000001/day"),
    # digits of other scripts are digits to Python's int(), not to a caller reading the grant
    ("rate_limit", "\u0661\u0660/minute"), ("quota", "\uff15/day"),
    ("quota", {}), ("quota", {"calls": 1.5}), ("quota", {"calls": "5"}), ("quota", {"calls": True}),
    ("quota", {"calls": 5, "per": "week"}), ("quota", {"calls": 5, "per": "second"}),
    ("quota", {"calls": 5, "extra": 1}), ("quota", {"calls": None, "rows": None}), ("quota", ["5/day"]),
])
def test_refused_with_the_grammar(field, value):
    with pytest.raises(ValueError) as e:
        limits.parse(field, value)
    assert field in str(e.value)
