"""Formats: JSON in select-list order, NDJSON, CSV; empty results are not special."""
import datetime as dt
import decimal
import enum
import json
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qag import formats, render


def test_json_order_and_types():
    cols = ["z", "a", "d", "t", "b", "n"]
    rows = [(1, "x", decimal.Decimal("1.50"), dt.datetime(2026, 11, 30, 6, 59, 53), b"\x01\xff", None)]
    out = render.render_json(cols, rows)
    assert out == b'[{"z":1,"a":"x","d":1.50,"t":"2026-11-30T06:59:53","b":"01ff","n":null}]'
    assert list(json.loads(out)[0]) == cols


# Numbers as the database has them (docs/api.md, "Numbers"): a Decimal is a JSON number of its exact digits in plain
# notation (trailing zeros kept, no exponent), NaN and infinities null; CSV/TSV/XML/YAML the same digits.
DECIMALS = [("124.95", "124.95"), ("12.50", "12.50"), ("12.00", "12.00"), ("1E+3", "1000"), ("1E-7", "0.0000001"),
            ("-0.0000100", "-0.0000100"), ("12345678901234567890.123456789", "12345678901234567890.123456789"),
            ("99999999999999999999999999999999999999999.5", "99999999999999999999999999999999999999999.5"),
            ("0E-10", "0.0000000000"), ("-5", "-5"), (str(2 ** 64), str(2 ** 64))]


@pytest.mark.parametrize("fn", [render.render_json, render.render_ndjson])
def test_a_decimal_is_a_json_number_of_its_exact_digits(fn, monkeypatch):
    for cols in (["a"], formats.Columns(["a"], [formats.DECIMAL])):
        for src, text in DECIMALS + [("NaN", "null"), ("Infinity", "null"), ("-Infinity", "null")]:
            fast, slow = _both(fn, cols, [(decimal.Decimal(src),)], monkeypatch)
            assert fast == slow
            assert fast.strip(b"[]\n") == b'{"a":' + text.encode() + b"}", (src, fast)
            if text != "null":
                assert json.loads(fast.strip(b"[]\n"), parse_float=decimal.Decimal)["a"] == decimal.Decimal(src)
    # inside a container (a numeric[] array) and beside a value that takes the standard library's path
    fast, slow = _both(fn, ["a", "b"], [([decimal.Decimal("2.50"), decimal.Decimal("NaN")], 1e-7)], monkeypatch)
    assert fast == slow and fast.strip(b"[]\n") == b'{"a":[2.50,null],"b":1e-07}'


def test_a_string_cannot_forge_a_decimals_number():
    from qag import values
    for s in ("\x001.5", values._MARK[:-1] + "1.5", "\x00" + "0" * 16 + "1.5"):
        assert json.loads(render.render_json(["a"], [(s,)]))[0]["a"] == s


def test_csv_xml_yaml_keep_a_decimals_digits():
    pytest.importorskip("yaml")
    import yaml
    rows = [(decimal.Decimal(g),) for g, _ in DECIMALS] + [(decimal.Decimal("NaN"),)]
    texts = [t for _, t in DECIMALS]
    for cols in (["a"], formats.Columns(["a"], [formats.DECIMAL])):
        assert render.render_csv(cols, rows).decode().split("\r\n")[1:-1] == texts + ["NaN"]
        assert render.render_tsv(cols, rows).decode().split("\r\n")[1:-1] == texts + ["NaN"]
    xml = formats.render_xml(["a"], rows).decode()
    assert all(f"<a>{t}</a>" in xml for t in texts)
    y = formats.render_yaml(["a"], rows).decode()
    assert y.splitlines() == [f"- a: {t}" for t in texts] + ["- a: null"]
    assert yaml.safe_load(y)[1]["a"] == 12.5 and yaml.safe_load(y)[3]["a"] == 1000


def test_xlsx_keeps_a_decimal_as_a_number_when_a_double_holds_its_digits_else_as_its_text():
    assert formats._xlsx_value(decimal.Decimal("124.95")) == 124.95
    assert formats._xlsx_value(decimal.Decimal("12.50")) == 12.5
    assert formats._xlsx_value(decimal.Decimal("12345678901234567890.123456789")) == "12345678901234567890.123456789"
    assert formats._xlsx_value(decimal.Decimal("0.1234567890123456789")) == "0.1234567890123456789"
    assert formats._xlsx_value(decimal.Decimal("NaN")) is None


def test_floats_are_their_shortest_round_trip_text():
    rows = [(0.1,), (124.95,), (1 / 3,), (1e16,), (5e-324,), (1e-7,)]
    want = ["0.1", "124.95", "0.3333333333333333", "1e+16", "5e-324", "1e-07"]
    assert [json.loads(line)["a"] for line in render.render_ndjson(["a"], rows).splitlines()] == [r[0] for r in rows]
    assert render.render_ndjson(["a"], rows).decode().split() == [f'{{"a":{w}}}' for w in want]
    assert render.render_csv(["a"], rows).decode().split("\r\n")[1:-1] == want


def test_empty_results():
    assert render.render_json(["a"], []) == b"[]"
    assert render.render_ndjson(["a"], []) == b""
    assert render.render_csv(["a", "b"], []) == b"a,b\r\n"


def test_ndjson_and_csv():
    cols, rows = ["id", "name"], [(1, "a,b"), (2, 'say "hi"'), (3, None)]
    assert render.render_ndjson(cols, rows) == b'{"id":1,"name":"a,b"}\n{"id":2,"name":"say \\"hi\\""}\n' \
        b'{"id":3,"name":null}\n'
    assert render.render_csv(cols, rows) == b'id,name\r\n1,"a,b"\r\n2,"say ""hi"""\r\n3,\r\n'


def test_streamers_match_renderers():
    cols, rows = ["id", "v"], [(i, f"v{i}") for i in range(1200)]
    batches = [rows[i:i + 500] for i in range(0, 1200, 500)]
    assert b"".join(render.stream_csv(cols, iter(batches))) == render.render_csv(cols, rows)
    assert b"".join(render.stream_ndjson(cols, iter(batches))) == render.render_ndjson(cols, rows)


def test_unicode_not_escaped():
    assert render.render_json(["n"], [("Zoë",)]) == '[{"n":"Zoë"}]'.encode()


def test_a_json_value_in_csv_and_tsv_is_its_json_text_not_pythons_repr():
    row = [({"v": 1, "é": [1, None]}, [1, "a"])]
    assert render.render_csv(["d", "a"], row) == 'd,a\r\n"{""v"":1,""é"":[1,null]}","[1,""a""]"\r\n'.encode()
    assert render.render_tsv(["d"], [({"v": True},)]) == b'd\r\n"{""v"":true}"\r\n'


# -- the fast path (orjson) writes the standard library's bytes -------------------------------------------------

class _Color(enum.Enum):
    RED = 1


class _Str(str):
    pass


_TZ = dt.timezone(dt.timedelta(hours=-3, minutes=-30))
CORPUS = [
    0, 1, -1, 2 ** 63 - 1, -2 ** 63, 2 ** 64 - 1, 2 ** 64, -2 ** 63 - 1, 10 ** 30, True, False, None,
    "", "x", "Zoë 😀", "\x00\x01\x1f\x7f\u2028\u2029", '"\\/\b\f\n\r\t', "a,b\r\n\"c\"", "\ud800",
    decimal.Decimal("1.50"), decimal.Decimal("12"), decimal.Decimal("-0"), decimal.Decimal("1E+3"),
    decimal.Decimal("1E-7"), decimal.Decimal("0.00001"), decimal.Decimal("123456789012345678901234.5"),
    decimal.Decimal(2 ** 63), decimal.Decimal("NaN"), decimal.Decimal("Infinity"), decimal.Decimal("-1E+400"),
    dt.datetime(2026, 11, 30, 6, 59, 53), dt.datetime(2026, 11, 30, 6, 59, 53, 123000, tzinfo=dt.UTC),
    dt.datetime(1, 1, 1, tzinfo=_TZ), dt.date(2026, 2, 28), dt.time(6, 59), dt.time(6, 59, 1, 5, tzinfo=_TZ),
    dt.timedelta(days=1, microseconds=3), dt.time(0, 0, 0, 10000), b"", b"\x00\xff", bytearray(b"\x01"),
    memoryview(b"\x02\x03"),
    uuid.UUID("12345678-1234-5678-1234-567812345678"), {"b", "a"},
    1.0, 0.1, 1e-05, 1e-4, 9.999999999999999e-05, 1e16, 1.5e300, -0.0, 5e-324, float("nan"), float("inf"),
    dt.datetime(1890, 1, 1, tzinfo=dt.timezone(dt.timedelta(seconds=1172))), dt.datetime(1, 1, 1, 0, 0, 0, 1),
    {"v": 1.5e-7, "é": [1, None]}, [1, "a", 1e-05], (1, 2), {1: "int key"}, _Color.RED, _Str("sub"),
]


def _both(fn, cols, rows, monkeypatch):
    """fn's output (or exception type) on the fast path and on the standard library's."""
    def one():
        try:
            return fn(cols, rows)
        except Exception as exc:  # noqa: BLE001 - the same failure is part of the contract
            return type(exc)
    fast = one()
    with monkeypatch.context() as m:
        m.setattr(render, "_orjson", None)
        slow = one()
    return fast, slow


@pytest.mark.skipif(render._orjson is None, reason="orjson not installed: there is one path only")
@pytest.mark.parametrize("fn", [render.render_json, render.render_ndjson, render.render_csv])
def test_fast_path_bytes_are_the_standard_librarys(fn, monkeypatch):
    for v in CORPUS:
        fast, slow = _both(fn, ["a", "b"], [(v, 1), (2, v)], monkeypatch)
        assert fast == slow, (v, fast, slow)
    # the whole corpus in one result, with and without the connector's declared column types
    rows = [tuple(CORPUS[i:i + 3]) for i in range(0, len(CORPUS) - 2)]
    for cols in (["x", "y", "z"], formats.Columns(["x", "y", "z"], [None, formats.TEXT, formats.JSON])):
        fast, slow = _both(fn, cols, rows, monkeypatch)
        assert fast == slow


@pytest.mark.skipif(render._orjson is None, reason="orjson not installed: there is one path only")
def test_declared_types_skip_the_scan_but_keep_the_bytes(monkeypatch):
    cols = formats.Columns(["i", "d", "t", "b", "s"],
                           [formats.INT, formats.DECIMAL, formats.TIMESTAMPTZ, formats.BYTES, formats.TEXT])
    rows = [(i, decimal.Decimal(i) / 8, dt.datetime(2026, 1, 1, tzinfo=dt.UTC), b"\x01", f"r{i}")
            for i in range(300)] + [(None, None, None, None, None)]
    for fn in (render.render_json, render.render_ndjson, render.render_csv):
        fast, slow = _both(fn, cols, rows, monkeypatch)
        assert fast == slow and isinstance(fast, bytes)
    assert render._fast_option(cols, rows) is render._OPT   # an aware datetime: isoformat() writes it
    naive = formats.Columns(["t"], [formats.TIMESTAMP])
    assert render._fast_option(naive, [(dt.datetime(2026, 1, 1),)]) is render._OPT_NAIVE
    assert render._fast_option(["t"], [(dt.time(0, 0, 0, 10000),)]) is render._OPT   # orjson writes .10000
    assert render._fast_option(["f"], [(1.5,), (0.0,), (None,)]) is not None
    assert render._fast_option(["f"], [(1.5,), (1e-05,)]) is None   # orjson writes 0.00001: the standard path
    assert render._fast_option(["f"], [(float("nan"),)]) is None
    assert render._fast_option(["a", "b"], [(1, 2), (3,)]) is None   # so do ragged rows


_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.text(), st.floats(allow_nan=True),
                     st.floats(min_value=-1e-3, max_value=1e-3), st.decimals(allow_nan=True),
                     st.datetimes(timezones=st.none() | st.timezones()), st.times(), st.dates(),
                     st.binary(max_size=8), st.uuids())


@pytest.mark.skipif(render._orjson is None, reason="orjson not installed: there is one path only")
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_scalars, _scalars), max_size=6))
def test_fast_path_property(rows):
    mp = pytest.MonkeyPatch()
    try:
        for fn in (render.render_json, render.render_ndjson, render.render_csv):
            fast, slow = _both(fn, ["a", "b"], rows, mp)
            assert fast == slow
    finally:
        mp.undo()


def test_streams_match_renderers_on_typed_and_mixed_columns():
    cols = formats.Columns(["i", "d", "f"], [formats.INT, formats.DECIMAL, formats.FLOAT])
    rows = [(i, decimal.Decimal(i) / 4, i / 3) for i in range(1100)]
    batches = [rows[i:i + 500] for i in range(0, 1100, 500)]
    assert b"".join(render.stream_csv(cols, iter(batches))) == render.render_csv(cols, rows)
    assert b"".join(render.stream_ndjson(cols, iter(batches))) == render.render_ndjson(cols, rows)


def _parquet(chunks):
    import io

    import pyarrow.parquet as pq
    return pq.read_table(io.BytesIO(b"".join(chunks)))


def test_parquet_decimal_schema_is_the_cursors_and_a_later_group_that_does_not_fit_is_an_error():
    pytest.importorskip("pyarrow")
    from qag.errors import ApiError
    n = formats.ROW_GROUP_ROWS
    small = [(decimal.Decimal("1.50"), decimal.Decimal("2.5"), 1)] * n
    big = [(decimal.Decimal("9999999999.99"), decimal.Decimal("1E+40"), 2)]
    cols = formats.Columns(["fixed", "free", "n"], [formats.DecimalType(12, 2), formats.DecimalType(None, None),
                                                   formats.INT])
    t = _parquet(formats.stream_parquet(cols, iter([small, big])))
    assert str(t.schema.field("fixed").type) == "decimal128(12, 2)" and str(t.schema.field("free").type) == "string"
    assert t.column("fixed").to_pylist()[-1] == decimal.Decimal("9999999999.99")
    assert t.column("free").to_pylist()[-1] == "1" + "0" * 40 and t.column("free").null_count == 0
    # the page: the same schema and values
    t = _parquet([formats.render_parquet(cols, small[:2] + big)])
    assert str(t.schema.field("fixed").type) == "decimal128(12, 2)" and t.column("fixed").null_count == 0
    # untyped columns (SQLite): the first group fixes the type; a later group that does not fit ends the stream
    # in an error, never in nulls; an untyped all-NULL first group is text, which every later value fits
    untyped = formats.Columns(["a", "b"], [None, None])
    chunks = formats.stream_parquet(untyped, iter([[(1, None)] * n, [("x", 2.5)]]))
    with pytest.raises(ApiError) as e:
        list(chunks)
    assert e.value.status == 500 and "'a'" in str(e.value)
    t = _parquet(formats.stream_parquet(untyped, iter([[(1, None)] * n, [(2, 2.5)]])))
    assert t.column("b").to_pylist()[-1] == "2.5" and t.column("a").to_pylist()[-1] == 2


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "k0", "v1", "rows", "__builtins__", "x y", "é", "", "lambda", "None",
                                 "a\"b", "1"]), min_size=1, max_size=70),
       st.integers(0, 4), st.booleans())
def test_compiled_row_objects_are_dict_zips(cols, nrows, odd):
    """render.row_dicts (a comprehension compiled per column list) builds exactly dict(zip(columns, row)): the same
    keys in the same order with the same values, a repeated name keeping its first place and its last value, and
    a row of another length cut as zip cuts it."""
    rows = [tuple((i * 7 + j) % 5 or None for j in range(len(cols))) for i in range(nrows)]
    if odd:
        rows.append(tuple(range(len(cols) + 1)))
        rows.append(tuple(range(len(cols) - 1)))
    want = [dict(zip(cols, r)) for r in rows]
    got = render.row_dicts(cols, rows)
    assert got == want and [list(d.items()) for d in got] == [list(d.items()) for d in want]


def test_compiled_row_objects_render_the_same_bytes():
    cols = ["id", "name", "id", "amount", "at"]
    rows = [(1, "ada", 2, decimal.Decimal("1.50"), dt.datetime(2026, 11, 30, 6, 59, 53)), (3, None, 4, None, None)]
    want = (b'[{"id":2,"name":"ada","amount":1.50,"at":"2026-11-30T06:59:53"},'
            b'{"id":4,"name":null,"amount":null,"at":null}]')
    assert render.render_json(cols, rows) == want
    assert render.render_ndjson(cols, rows) == (b'{"id":2,"name":"ada","amount":1.50,"at":"2026-11-30T06:59:53"}\n'
                                                b'{"id":4,"name":null,"amount":null,"at":null}\n')


_TEMPLATE_VALUES = {
    formats.INT: st.none() | st.integers(-2 ** 63, 2 ** 63 - 1),
    formats.BOOL: st.none() | st.booleans(),
    formats.DECIMAL: st.none() | st.decimals(allow_nan=True, allow_infinity=True)
    | st.sampled_from([decimal.Decimal("1E+3"), decimal.Decimal("-1E-7"), decimal.Decimal("0.000")]),
    formats.DATE: st.none() | st.dates(),
    formats.TIMESTAMP: st.none() | st.datetimes(),
    formats.TIMESTAMPTZ: st.none() | st.datetimes(timezones=st.timezones())
    | st.just(dt.datetime(1890, 1, 1, tzinfo=dt.timezone(dt.timedelta(seconds=1172)))),
}
_TEMPLATE_NAMES = ["aid", "a%b", "%s", "%%", "a\"b", "a,b", "[", "]", "é", "x y", "\n", "", "},{"]


@st.composite
def _typed_pages(draw):
    types = draw(st.lists(st.sampled_from(sorted(_TEMPLATE_VALUES)), min_size=1, max_size=5))
    names = draw(st.lists(st.sampled_from(_TEMPLATE_NAMES), min_size=len(types), max_size=len(types), unique=True))
    n = draw(st.integers(render._TEMPLATE_MIN_ROWS, render._TEMPLATE_MIN_ROWS + 20))
    rows = draw(st.lists(st.tuples(*[_TEMPLATE_VALUES[t] for t in types]), min_size=n, max_size=n))
    return formats.Columns(names, types), rows


@pytest.mark.skipif(render._orjson is None, reason="orjson not installed: there is one path only")
@settings(max_examples=300, deadline=None)
@given(_typed_pages())
def test_a_templated_page_is_the_row_objects_bytes(page):
    """A page of typed columns whose values' JSON text holds no separator is set into a template of the column
    names (render._templated): the same bytes as the row objects' path and the standard library's, in JSON and
    NDJSON, whatever the names hold ("%", quotes, commas, brackets)."""
    cols, rows = page
    assert render._templated(cols, rows, render._fast_option(cols, rows)) is not None   # the path is taken
    mp = pytest.MonkeyPatch()
    try:
        for fn in (render.render_json, render.render_ndjson):
            fast, slow = _both(fn, cols, rows, mp)
            assert fast == slow
            assert fast == (b"".join(render._dumps(d, render._orjson_default, render._OPT | render._NL)
                                     for d in render.row_dicts(cols, rows)) if fn is render.render_ndjson
                            else render._dumps(render.row_dicts(cols, rows), render._orjson_default, render._OPT))
    finally:
        mp.undo()


@pytest.mark.skipif(render._orjson is None, reason="orjson not installed: there is one path only")
def test_a_page_the_template_cannot_hold_takes_the_row_objects_path(monkeypatch):
    n = render._TEMPLATE_MIN_ROWS
    ints = formats.Columns(["a", "b"], [formats.INT, formats.INT])
    # a repeated name: a row object keeps one (its first place, its last value), so no template
    dup = formats.Columns(["a", "a"], [formats.INT, formats.INT])
    assert render._row_template(dup) is None
    assert render.render_json(dup, [(1, 2)] * n) == b"[" + b",".join([b'{"a":2}'] * n) + b"]"
    # a text column, or no declared types: no template
    assert render._row_template(formats.Columns(["a", "s"], [formats.INT, formats.TEXT])) is None
    assert render._row_template(["a", "b"]) is None
    # values that are not what the column's type declares (a separator, a space, brackets in their text), and a
    # row of another width: more or fewer pieces than places, so the row objects' path writes the page
    for rows in ([(1, "x,y")] * n, [(1, "x y")] * n, [(1, "],[")] * n, [(1, [2, 3])] * n,
                 [(1, 2)] * (n - 1) + [(3,)], [(1, 2)] * (n - 1) + [(3, 4, 5)]):
        assert render._templated(ints, rows, render._OPT) is None, rows
        for fn in (render.render_json, render.render_ndjson):
            fast, slow = _both(fn, ints, rows, monkeypatch)
            assert fast == slow, rows
    assert render.render_json(ints, [(1, "x,y")] * n).startswith(b'[{"a":1,"b":"x,y"},')
