"""Golden vectors for masking (tests/governance_cases/transform_vectors.jsonl): the normative text, hash and
mask of each value type, for any other implementation (the Rust data plane) to reproduce byte for byte.

Regenerate (only when the contract changes): python tests/unit/test_governance_vectors.py --write
"""

from __future__ import annotations

import datetime as dt
import decimal
import hashlib
import hmac
import json
import pathlib
import sys
import uuid

from qag.governance import apply_transforms, text_of

PATH = pathlib.Path(__file__).resolve().parent.parent / "governance_cases" / "transform_vectors.jsonl"
KEYS = [b"test-mask-key", bytes(range(32)), b"k" * 100]   # short, 32 bytes, longer than the SHA-256 block


def decode(kind: str, value):
    """Vector value → the Python value a driver would return."""
    return {
        "null": lambda v: None, "str": str, "int": int, "bool": bool, "float": float,
        "decimal": decimal.Decimal, "datetime": dt.datetime.fromisoformat, "date": dt.date.fromisoformat,
        "time": dt.time.fromisoformat, "bytes": bytes.fromhex, "uuid": uuid.UUID, "json": lambda v: v,
    }[kind](value)


SAMPLES = [
    ("null", None), ("str", "john@example.com"), ("str", "Alice"), ("str", ""), ("str", "é@ü.example"),
    ("str", "x@y@z.example"), ("str", "@nolocal"), ("str", "nodomain@"), ("str", "日本語"), ("str", "a\u0000b"),
    ("int", "0"), ("int", "-42"), ("int", "9223372036854775807"), ("int", "-9223372036854775808"),
    ("bool", True), ("bool", False),
    ("float", "1.5"), ("float", "0.1"), ("float", "-0.0"), ("float", "1e+16"), ("float", "1e-05"),
    ("float", "123456789012345.6"), ("float", "1.7976931348623157e+308"), ("float", "5e-324"),
    ("float", "inf"), ("float", "-inf"), ("float", "nan"),
    ("decimal", "12.50"), ("decimal", "-0.001"), ("decimal", "1E+3"), ("decimal", "0E-10"),
    ("datetime", "2026-11-30T06:59:53.123000+00:00"), ("datetime", "2026-11-30T06:59:53"),
    ("date", "2026-11-30"), ("time", "06:59:53.000001"),
    ("bytes", "00ff10"), ("bytes", ""),
    ("uuid", "12345678-1234-5678-1234-567812345678"),
    ("json", {"b": 1, "a": ["x", None, True, 1.5], "é": "ü"}), ("json", [1, "two"]),
]


def build():
    out = []
    for key in KEYS:
        for kind, raw in SAMPLES:
            v = decode(kind, raw)
            text = None if v is None else text_of(v)
            digest = None if v is None else hmac.new(key, text.encode("utf-8"), hashlib.sha256).hexdigest()[:16]
            _, rows = apply_transforms(("hash", "mask", "null"), ["h", "m", "n"], [(v, v, v)], key)
            out.append({"key_hex": key.hex(), "type": kind, "value": raw, "text": text,
                        "hash": digest, "mask": rows[0][1], "null": None})
            assert rows[0][0] == digest and rows[0][2] is None
    return out


def test_vectors_match():
    want = [json.loads(line) for line in PATH.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert want == json.loads(json.dumps(build())), "masking output changed: the contract (and Rust) must follow"


def test_vectors_hash_is_the_contract():
    for v in (json.loads(line) for line in PATH.read_text(encoding="utf-8").splitlines() if line.strip()):
        if v["text"] is not None:
            key = bytes.fromhex(v["key_hex"])
            assert v["hash"] == hmac.new(key, v["text"].encode(), hashlib.sha256).hexdigest()[:16]


if __name__ == "__main__" and "--write" in sys.argv:
    PATH.write_text("".join(json.dumps(v, ensure_ascii=False) + "\n" for v in build()), encoding="utf-8")
    print(f"wrote {PATH}")
