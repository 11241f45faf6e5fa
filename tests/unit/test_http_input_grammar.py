"""How qag reads what a caller sends, without I/O: a request body as strict JSON (qag/http/common.parse_json), a
parameter's text (qag/params), a timestamp a caller gives (qag/timeutil.parse_input) and a list's cursor
(qag/http/manage). Each refusal here was a silent reading, or a 500, before."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qag import params as P
from qag import timeutil
from qag.errors import ApiError
from qag.http.common import parse_json
from qag.http.manage import make_cursor, read_cursor


@pytest.mark.parametrize("raw", [
    b'{"a": 1, "a": 2}', b'{"x": {"a": 1, "a": 1}}', b'{"a": NaN}', b'{"a": Infinity}', b'{"a": -Infinity}',
    b'{"a": "\\ud800"}', b'{"a": "\\uDFFF"}', b'{"\\ud800": 1}', '{"a": 1}'.encode("utf-16"),
    '{"a": 1}'.encode("utf-32"), b'\xef\xbb\xbf{"a": 1}', b'{"a": "\xff"}', b"[1]", b"null", b'"x"', b"{",
    b"[" * 100_000,
])
def test_a_body_outside_strict_json_is_invalid_body(raw):
    with pytest.raises(ApiError) as e:
        parse_json(raw)
    assert e.value.status == 400 and e.value.code == "invalid_body"


@pytest.mark.parametrize("raw, value", [
    (b'{"a": "\\ud83d\\ude00"}', {"a": "\U0001F600"}),   # a surrogate pair is one character
    (b'{"a": "\\\\ud800"}', {"a": "\\ud800"}),             # an escaped backslash, not an escape
    (b'{"a": 1e400}', {"a": float("inf")}),                # a number JSON allows; its readers refuse it
    (b'{"a": {"b": 1}, "b": {"b": 2}}', {"a": {"b": 1}, "b": {"b": 2}}),
])
def test_strict_json_still_reads_what_json_allows(raw, value):
    assert parse_json(raw) == value


@pytest.mark.parametrize("text", [" 1", "1 ", "\t1", "1_0", "\u0661", "0x10", "1e3", "1.0", "", "+", "--1"])
def test_int_text_is_ascii_digits_with_a_sign(text):
    spec = P.build_specs({"i": {"type": "int", "required": True}})
    with pytest.raises(ApiError) as e:
        P.bind(spec, {"i": text}, 65536)
    assert e.value.code in ("param_invalid", "param_required")


@pytest.mark.parametrize("text", [" 2.5", "2.5 ", "1_0", "\u0661", "0x1p3", "nan", "inf", "-Infinity", "1e", "e1"])
def test_float_text_is_ascii_decimal(text):
    spec = P.build_specs({"f": {"type": "float", "required": True}})
    with pytest.raises(ApiError) as e:
        P.bind(spec, {"f": text}, 65536)
    assert e.value.code == "param_invalid"


def test_int_text_too_long_for_python_is_out_of_range_not_a_crash():
    spec = P.build_specs({"i": {"type": "int", "required": True}})
    for text in ("9" * 5000, "-" + "9" * 5000):
        with pytest.raises(ApiError) as e:
            P.bind(spec, {"i": text}, 1 << 20)
        assert e.value.extra["errors"] == {"i": "must be a signed 64-bit integer"}


def test_a_float_from_a_json_integer_beyond_a_double_is_not_finite():
    spec = P.build_specs({"f": {"type": "float", "required": True}})
    with pytest.raises(ApiError) as e:
        P.bind(spec, {"f": 10 ** 400}, 65536)
    assert e.value.extra["errors"] == {"f": "must be a finite number"}


@pytest.mark.parametrize("text", ["2030-01-01T00:00:00", "2030-01-01 00:00", "20300101T000000Z", "tomorrow",
                                  "2030-13-01T00:00:00Z", "2030-01-01T00:00:00+0200", "\u0662030-01-01", 12345])
def test_a_callers_timestamp_is_rfc3339_with_its_offset(text):
    with pytest.raises(ValueError):
        timeutil.parse_input(text)


@pytest.mark.parametrize("text, utc", [("2030-01-01T02:00:00+02:00", "2030-01-01T00:00:00.000Z"),
                                       ("2030-01-01t00:00:00.123456z", "2030-01-01T00:00:00.123Z"),
                                       ("2030-01-01 00:00:00Z", "2030-01-01T00:00:00.000Z"),
                                       ("2030-01-01", "2030-01-01T00:00:00.000Z")])
def test_rfc3339_timestamps_read_in_utc(text, utc):
    assert timeutil.fmt(timeutil.parse_input(text)) == utc


@given(st.text(min_size=1, max_size=100))
def test_a_cursor_reads_back_and_a_changed_one_is_refused(name):
    c = make_cursor(name)
    assert read_cursor(c) == name
    for bad in {c[:-1], c + "A", c[1:], name} - {c}:
        with pytest.raises(ApiError) as e:
            read_cursor(bad)
        assert e.value.code == "invalid_cursor"


def test_xml_keeps_a_carriage_return_and_a_non_ascii_column_name():
    import xml.etree.ElementTree as ET

    from qag import formats
    doc = ET.fromstring(formats.render_xml(["ü", "1x"], [["a\r\nb\rc", "x"]]))
    assert [(e.tag, e.text) for e in doc[0]] == [("ü", "a\r\nb\rc"), ("_1x", "x")]  # was "a\nb\nc" and "_ü"
