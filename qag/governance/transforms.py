"""Masking at call time: apply a plan's per-position actions to result rows (hash, mask, null, drop).

The exact text of a value, which hash and mask work on, is normative (a Rust data plane must reproduce it
byte for byte), then UTF-8 encoded:

    None                 stays None for every action (hash, mask and null give None; drop removes the column)
    str                  as is
    bool                 "true" / "false"
    int                  decimal, leading "-" when negative, no "+" and no leading zeros ("-42")
    float                Python repr(): the shortest digits that round-trip; scientific "d.ddde+XX" /
                         "d.ddde-XX" (at least two exponent digits) when the decimal exponent is < -4 or
                         >= 16, else positional with at least one digit after "." ("1.0", "0.0001",
                         "1e-05", "1e+16", "1.5e+300"); "nan", "inf", "-inf"; "-0.0"
    decimal.Decimal      str(): the driver's text of the number ("12.50", "1E+3" as the database sent it)
    datetime/date/time   isoformat(): "2026-11-30T06:59:53.123000+00:00", "2026-11-30", "06:59:53"
    bytes/bytearray/
    memoryview           lowercase hex of the bytes, no prefix ("00ff")
    uuid.UUID            lowercase 8-4-4-4-12 form
    dict/list/tuple      JSON with sorted keys, separators "," and ":", non-ASCII kept (not \\u-escaped),
                         nested values by these same rules when not JSON-native
    anything else        str(value)

    hash(v) = hex(HMAC-SHA256(mask_key, utf8(text(v))))[:16]       (lowercase hex)
    mask(v) = if text has "@" with something on both sides of its LAST "@":
                  first character of the part before it + "***@" + the part after it   (j***@example.com)
              elif text is empty: "***"
              else: first character + "***"                         (characters are Unicode code points)
"""

from __future__ import annotations

import datetime as _dt
import decimal
import hashlib
import hmac
import json
import uuid

from .errors import GovernanceError

ACTIONS = ("hash", "mask", "null", "drop")
STRICTNESS = {"hash": 1, "mask": 2, "null": 3, "drop": 4}   # the strictest action on a column wins


def text_of(v) -> str:
    t = type(v)
    if t is str:
        return v
    if t is int:
        return str(v)
    if t is bool:
        return "true" if v else "false"
    if t is float:
        return repr(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(int(v))
    if isinstance(v, float):
        return repr(float(v))
    if isinstance(v, str):
        return str.__str__(v)
    if isinstance(v, decimal.Decimal):
        return str(v)
    if isinstance(v, (_dt.datetime, _dt.date, _dt.time)):
        return v.isoformat()
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).hex()
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=text_of)
    return str(v)


def hash_value(v, mask_key: bytes):
    if v is None:
        return None
    return hmac.digest(mask_key, text_of(v).encode("utf-8", "surrogatepass"), "sha256")[:8].hex()


def mask_value(v):
    if v is None:
        return None
    t = text_of(v)
    local, at, domain = t.rpartition("@")
    if at and local and domain:
        return local[0] + "***@" + domain
    if not t:
        return "***"
    return t[0] + "***"


def _hasher(mask_key: bytes):
    # HMAC (RFC 2104) with the key pads hashed once: copying two prepared SHA-256 states is ~1.5x faster
    # than hmac.digest(), whose OpenSSL 3 path sets the key up again on every call (measured 2.9 vs 4.3 us
    # on the loaded CI box).
    key = bytes(mask_key)
    if len(key) > 64:
        key = hashlib.sha256(key).digest()
    key = key.ljust(64, b"\0")
    inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
    outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))
    icopy, ocopy = inner.copy, outer.copy

    def h(v):
        if v is None:
            return None
        i = icopy()
        i.update((v if type(v) is str else text_of(v)).encode("utf-8", "surrogatepass"))
        o = ocopy()
        o.update(i.digest())
        return o.digest()[:8].hex()
    return h


class CompiledTransforms:
    """Per-position callables built once per (transforms, mask key); __call__ is the per-call work."""

    __slots__ = ("identity", "keep", "row_fn", "transforms", "width", "_checked")

    def __init__(self, transforms, mask_key: bytes):
        transforms = tuple(transforms)
        for t in transforms:
            if t is not None and t not in ACTIONS:
                raise GovernanceError(403, "mask_unresolvable", f"unknown masking action {t!r}")
        self.transforms = transforms
        self.width = len(transforms)
        self.identity = all(t is None for t in transforms)   # shape pinned, nothing masked: rows pass as they are
        self.keep = tuple(i for i, t in enumerate(transforms) if t != "drop")
        parts = []
        for i, t in enumerate(transforms):
            if t is None:
                parts.append(f"r[{i}]")
            elif t == "hash":
                parts.append(f"h(r[{i}])")
            elif t == "mask":
                parts.append(f"m(r[{i}])")
            elif t == "null":
                parts.append("None")
        # Generated from fixed tokens and integer positions only: one tuple display per row is the fastest
        # Python can build a row (about 3x a per-column loop).
        src = "def row_fn(rows):\n    return [(" + "".join(p + ", " for p in parts) + ") for r in rows]\n"
        ns = {"h": _hasher(mask_key), "m": mask_value}
        exec(compile(src, "<qag.governance.transforms>", "exec"), ns)  # noqa: S102 - see comment above
        self.row_fn = ns["row_fn"]
        self._checked: dict = {}  # (result columns, plan names) already found to match: checked once

    def __call__(self, columns, rows):
        if len(columns) != self.width:
            # The result does not have the shape the plan was built for (e.g. the table changed under
            # SELECT *): never guess which column is which.
            raise GovernanceError(403, "mask_unresolvable",
                                  f"the result has {len(columns)} columns but the masking plan expects "
                                  f"{self.width}; the schema may have changed, rebuild the plan")
        if self.identity:
            return columns, rows
        if len(self.keep) == self.width:
            return columns, self.row_fn(rows)
        return [columns[i] for i in self.keep], self.row_fn(rows)

    def check_names(self, columns, names) -> None:
        """Refuse a result whose positions carry other columns than the plan traced (same width, but the table
        changed under SELECT *: an unmasked position may now hold a column a rule covers). Every position is
        checked, masked or not. Compared case-insensitively, after any "t." prefix (ClickHouse), on the first
        63 characters (PostgreSQL truncates longer names); positions without a known name pass."""
        key = (tuple(columns), names if type(names) is tuple else tuple(names))
        if key in self._checked:
            return
        for i in range(len(self.transforms)):
            if i >= len(names) or names[i] is None or i >= len(columns):
                continue
            got = str(columns[i]).rsplit(".", 1)[-1].lower()[:63]
            want = str(names[i]).rsplit(".", 1)[-1].lower()[:63]
            if got != want:
                raise GovernanceError(403, "mask_unresolvable",
                                      f"result column {i + 1} is {columns[i]!r} but the masking plan traced "
                                      f"{names[i]!r}; the schema may have changed, rebuild the plan")
        if len(self._checked) > 256:
            self._checked.clear()
        self._checked[key] = True


_compiled: dict = {}


def compile_transforms(transforms, mask_key: bytes) -> CompiledTransforms:
    key = (tuple(transforms), bytes(mask_key))
    c = _compiled.get(key)
    if c is None:
        if len(_compiled) > 4096:
            _compiled.clear()
        c = _compiled[key] = CompiledTransforms(key[0], key[1])
    return c


def apply_transforms(transforms, columns, rows, mask_key: bytes, names=None):
    """Apply per-position actions; returns (columns, rows). transforms None → the input, untouched.
    names (optional, the plan's output_names): also check that each masked position holds the column the
    plan traced, which catches a table changed under SELECT * without a change of width."""
    if transforms is None:
        return columns, rows
    c = _compiled.get((transforms, mask_key)) if type(transforms) is tuple and type(mask_key) is bytes else None
    if c is None:
        c = compile_transforms(transforms, mask_key)
    if names is not None:
        c.check_names(columns, names)
    return c(columns, rows)
