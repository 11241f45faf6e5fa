//! Masking transforms, identical to qag/governance/transforms.py: per-position hash (HMAC-SHA256 of the
//! value's text, first 16 hex characters), mask (first character + "***", an email keeps its domain), null, drop.

use crate::render::{write_jvalue, Cell, Page};
use crate::pyfmt::float_repr;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Keep,
    Hash,
    Mask,
    Null,
    Drop,
}

impl Action {
    pub fn parse(s: Option<&str>) -> Option<Action> {
        Some(match s {
            None => Action::Keep,
            Some("hash") => Action::Hash,
            Some("mask") => Action::Mask,
            Some("null") => Action::Null,
            Some("drop") => Action::Drop,
            Some(_) => return None,
        })
    }
}

/// `text_of(v)`: the normative text a value is hashed or masked on (None for SQL NULL).
pub fn text_of(c: &Cell) -> Option<String> {
    Some(match c {
        Cell::Null => return None,
        Cell::Bool(b) => (if *b { "true" } else { "false" }).to_string(),
        Cell::Int(i) => i.to_string(),
        Cell::Float(f) => float_repr(*f),
        Cell::Decimal { text, .. } => text.clone(),
        Cell::Str(s) => s.clone(),
        Cell::Json(v) => {
            let mut s = String::new();
            write_jvalue(&mut s, v, true);
            s
        }
    })
}

pub fn hash_text(key: &[u8], text: &str) -> String {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(text.as_bytes());
    let d = mac.finalize().into_bytes();
    crate::pyfmt::hex(&d[..8])
}

pub fn mask_text(t: &str) -> String {
    if let Some(at) = t.rfind('@') {
        let (local, domain) = (&t[..at], &t[at + 1..]);
        if !local.is_empty() && !domain.is_empty() {
            let first = local.chars().next().expect("non-empty");
            return format!("{first}***@{domain}");
        }
    }
    match t.chars().next() {
        None => "***".to_string(),
        Some(c) => format!("{c}***"),
    }
}

/// apply_transforms: the page with each column's action applied (dropped columns gone). None when the width
/// differs (Python answers 403 mask_unresolvable: the caller decides before executing, so this is a safety
/// net). A kept cell is moved, not copied; only hashed and masked ones are new.
pub fn apply(actions: &[Action], key: &[u8], page: Page) -> Option<Page> {
    if actions.len() != page.width() {
        return None;
    }
    let Page { columns, cells, rows } = page;
    let columns: Vec<String> = columns.into_iter().zip(actions).filter(|(_, a)| **a != Action::Drop).map(|(c, _)| c).collect();
    let mut out = Page::with_capacity(columns, rows);
    let mut row = Vec::with_capacity(actions.len());
    let mut cells = cells.into_iter();
    for _ in 0..rows {
        row.clear();
        for (c, a) in cells.by_ref().take(actions.len()).zip(actions) {
            match a {
                Action::Keep => row.push(c),
                Action::Null => row.push(Cell::Null),
                Action::Hash => row.push(text_of(&c).map_or(Cell::Null, |t| Cell::Str(hash_text(key, &t)))),
                Action::Mask => row.push(text_of(&c).map_or(Cell::Null, |t| Cell::Str(mask_text(&t)))),
                Action::Drop => {}
            }
        }
        out.push_row(row.drain(..));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::parse_json;

    #[test]
    fn hmac_matches_python() {
        // python: from qag.governance import hash_value; hash_value(v, b"test-mask-key")
        let key = b"test-mask-key";
        let cases: &[(Cell, &str)] = &[
            (Cell::Str("alice@example.com".into()), "b1c21049711d3154"),
            (Cell::Int(-42), "3db27330f6f755b1"),
            (Cell::Float(1e16), "9452fe0bda24661a"),
            (Cell::Bool(true), "76415004dffbfddf"),
            (Cell::Str("é😀".into()), "490860e4a19fad9d"),
            (Cell::Decimal { text: "12.50".into(), num: "12.5".into() }, "bf3d0e9fba530aed"),
            (Cell::Json(parse_json(r#"{"b": 1, "a": [1.0, "é"]}"#).unwrap()), "fb97018776875a96"),
        ];
        for (c, want) in cases {
            assert_eq!(hash_text(key, &text_of(c).unwrap()), *want, "hash of {c:?}");
        }
    }

    #[test]
    fn mask_like_python() {
        for (t, want) in [("john@example.com", "j***@example.com"), ("", "***"), ("x", "x***"), ("@host", "@***"),
            ("a@b@c", "a***@c"), ("user@", "u***"), ("élan", "é***"), ("😀@d", "😀***@d")] {
            assert_eq!(mask_text(t), want, "mask({t:?})");
        }
    }

    #[test]
    fn apply_drops_and_nulls() {
        let acts = [Action::Keep, Action::Drop, Action::Null, Action::Mask, Action::Hash];
        let rows = vec![vec![Cell::Int(1), Cell::Str("x".into()), Cell::Str("y".into()), Cell::Null, Cell::Null]];
        let cols = ["a", "b", "c", "d", "e"].iter().map(|s| s.to_string()).collect();
        let p = apply(&acts, b"k", Page::from_rows(cols, rows)).unwrap();
        assert_eq!(p.columns, vec!["a", "c", "d", "e"]);
        assert_eq!((p.rows, p.cells), (1, vec![Cell::Int(1), Cell::Null, Cell::Null, Cell::Null]));
        assert!(apply(&acts, b"k", Page::from_rows(vec!["a".into()], vec![])).is_none());
        // rows of no columns stay rows
        let p = apply(&[], b"k", Page::from_rows(vec![], vec![vec![], vec![]])).unwrap();
        assert_eq!(p.rows, 2);
    }
}
