"""pgparse against PostgreSQL's own parser (pglast): the re-spelled text sqlglot reads names and values
exactly what PostgreSQL decoded (issue 12, class 1)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qag.governance import GovernanceError, pgparse

pglast = pytest.importorskip("pglast")

_CHARS = st.characters(min_codepoint=0x20, max_codepoint=0x2FFFF, exclude_categories=("Cs",))


def _escape(text: str, esc: str) -> str:
    out = []
    for ch in text:
        cp = ord(ch)
        if ch == esc:
            out.append(esc + esc)
        elif cp > 0xFFFF:
            out.append(f"{esc}+{cp:06x}")
        elif ch in "\"'" or cp > 0x7E or ch.isalpha() and cp % 2:
            out.append(f"{esc}{cp:04x}")
        else:
            out.append(ch)
    return "".join(out)


@settings(max_examples=300, deadline=None)
@given(name=st.text(_CHARS, min_size=1, max_size=40), esc=st.sampled_from(["\\", "!", "~"]), comment=st.booleans())
def test_unicode_escaped_names_and_literals_decode_as_postgresql_does(name, esc, comment):
    body = _escape(name, esc)
    uesc = (" /* c */" if comment else "") + f" UESCAPE '{esc}'" if esc != "\\" else ""
    quoted, ident = body.replace(chr(39), chr(39) * 2), body.replace(chr(34), chr(34) * 2)
    sql = f"SELECT U&'{quoted}'{uesc} AS v, x.U&\"{ident}\"{uesc} FROM x"
    try:
        tree = pglast.parse_sql(sql)
    except pglast.parser.ParseError:
        return      # PostgreSQL refuses it: so does qag (read() raises)
    target = tree[0].stmt.targetList
    pg_value = target[0].val.val.sval
    pg_name = target[1].val.fields[1].sval
    reading = pgparse.read(sql)
    respelled = pglast.parse_sql(reading.text)[0].stmt.targetList
    assert respelled[0].val.val.sval == pg_value
    assert respelled[1].val.fields[1].sval == pg_name
    assert "U&" not in reading.text


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(list("ab'\\nrtx0178uU{}") + ["\\x41", "\\u00e9", "\\101", "\\'"]), max_size=30))
def test_e_strings_decode_as_postgresql_does(parts):
    text = "".join(parts)
    sql = "SELECT E'" + text.replace("'", "''") + "'"
    try:
        tree = pglast.parse_sql(sql)
    except pglast.parser.ParseError:
        return
    want = tree[0].stmt.targetList[0].val.val.sval if tree[0].stmt.targetList[0].val.val is not None else None
    try:
        reading = pgparse.read(sql)
    except GovernanceError:     # refused (never anything else: no 500)
        return
    got = pglast.parse_sql(reading.text)[0].stmt.targetList[0].val.val.sval
    assert got == want


def test_identifiers_are_cut_at_63_bytes_as_postgresql_does():
    long = "e" * 70
    reading = pgparse.read(f'SELECT U&"{long}" FROM t')
    assert reading.columns == (("e" * 63,),)
    assert '"' + "e" * 63 + '"' in reading.text
