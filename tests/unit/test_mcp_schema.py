"""`qag mcp`'s tool input schemas follow the contract's parameter rules: a parameter is required unless it has a
default (API.md), whichever way it is declared; a claim-bound one is not the caller's to give."""
from __future__ import annotations

from qag.mcpserver import input_schema


def test_required_unless_a_default():
    s = input_schema({"a": "int", "b": {"type": "str"}, "c": {"type": "int", "default": 3},
                      "d": {"type": "bool", "required": False}, "e": {"type": "str", "from_claim": "sub"}})
    assert s["required"] == ["a", "b"]
    assert set(s["properties"]) == {"a", "b", "c", "d"}
    assert s["properties"]["c"] == {"type": "integer", "default": 3}
