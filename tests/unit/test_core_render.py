"""Formats: JSON in select-list order, NDJSON, CSV; empty results are not special."""
import datetime as dt
import decimal
import json

from qag import render


def test_json_order_and_types():
    cols = ["z", "a", "d", "t", "b", "n"]
    rows = [(1, "x", decimal.Decimal("1.50"), dt.datetime(2026, 11, 30, 6, 59, 53), b"\x01\xff", None)]
    out = render.render_json(cols, rows)
    assert out == b'[{"z":1,"a":"x","d":1.5,"t":"2026-11-30T06:59:53","b":"01ff","n":null}]'
    assert list(json.loads(out)[0]) == cols


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
    from qag import formats, render
    row = [({"v": 1, "é": [1, None]}, [1, "a"])]
    assert render.render_csv(["d", "a"], row) == 'd,a\r\n"{""v"":1,""é"":[1,null]}","[1,""a""]"\r\n'.encode()
    assert formats.render_tsv(["d"], [({"v": True},)]) == b'd\r\n"{""v"":true}"\r\n'
