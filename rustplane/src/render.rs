//! Result values as Python sees them (psycopg2's types) and their rendering, byte-identical to
//! qag/render.py: JSON (compact, ensure_ascii=False, floats by repr, duplicate column names collapse to
//! the first position with the last value), NDJSON, CSV (csv.writer, "\r\n", minimal quoting).

use crate::pyfmt::{float_repr, json_str};

/// A parsed JSON value as Python's json.loads gives it (key order kept, duplicate keys: first position,
/// last value). Numbers keep the text Python would print for the int or float they become.
#[derive(Debug, Clone, PartialEq)]
pub enum JValue {
    Null,
    Bool(bool),
    Num(String),
    Str(String),
    Arr(Vec<JValue>),
    Obj(Vec<(String, JValue)>),
}

/// One result value, typed as psycopg2 would return it.
#[derive(Debug, Clone, PartialEq)]
pub enum Cell {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    /// numeric: `text` is str(Decimal) (hash/mask text); `num` is what JSON and CSV print: the exact digits in
    /// plain notation (values.decimal_text), or the total seconds of a MySQL TIME.
    Decimal { text: String, num: String },
    /// text, and everything Python renders as a string: dates and times (isoformat), bytea (hex), uuid.
    Str(String),
    Json(JValue),
}

/// A page of results: the column names and every row's cells, row after row in one vector (one allocation
/// per page, not one per row, and the cells of a row side by side for the renderers).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Page {
    pub columns: Vec<String>,
    /// `rows * columns.len()` cells, row-major.
    pub cells: Vec<Cell>,
    /// Counted apart: a statement of no columns (`SELECT FROM t`) still has rows (`{}` each in JSON).
    pub rows: usize,
}

impl Page {
    /// An empty page of these columns, with room for `rows` rows.
    pub fn with_capacity(columns: Vec<String>, rows: usize) -> Page {
        let cells = Vec::with_capacity(rows.saturating_mul(columns.len()).min(1 << 20));
        Page { columns, cells, rows: 0 }
    }

    /// A page of rows given one vector each (tests, and drivers that hand rows over one by one).
    pub fn from_rows(columns: Vec<String>, rows: Vec<Vec<Cell>>) -> Page {
        let mut page = Page::with_capacity(columns, rows.len());
        for r in rows {
            page.push_row(r);
        }
        page
    }

    /// Append a row: its cells, one per column (a row of another width is a bug in the caller).
    pub fn push_row(&mut self, row: impl IntoIterator<Item = Cell>) {
        let before = self.cells.len();
        self.cells.extend(row);
        assert_eq!(self.cells.len() - before, self.columns.len(), "a row has one cell per column");
        self.rows += 1;
    }

    pub fn width(&self) -> usize {
        self.columns.len()
    }

    /// The rows, each a slice of `width()` cells.
    pub fn iter_rows(&self) -> impl ExactSizeIterator<Item = &[Cell]> + '_ {
        let w = self.width();
        (0..self.rows).map(move |i| &self.cells[i * w..(i + 1) * w])
    }

    /// Keep the first `n` rows.
    pub fn truncate(&mut self, n: usize) {
        if n < self.rows {
            self.rows = n;
            self.cells.truncate(n * self.width());
        }
    }
}

pub fn write_jvalue(out: &mut String, v: &JValue, sort: bool) {
    match v {
        JValue::Null => out.push_str("null"),
        JValue::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        JValue::Num(n) => out.push_str(n),
        JValue::Str(s) => json_str(out, s, false),
        JValue::Arr(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_jvalue(out, x, sort);
            }
            out.push(']');
        }
        JValue::Obj(o) => {
            out.push('{');
            let mut items: Vec<&(String, JValue)> = o.iter().collect();
            if sort {
                items.sort_by(|a, b| a.0.cmp(&b.0));
            }
            for (i, (k, x)) in items.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                json_str(out, k, false);
                out.push(':');
                write_jvalue(out, x, sort);
            }
            out.push('}');
        }
    }
}

fn write_cell_json(out: &mut String, c: &Cell) {
    match c {
        Cell::Null => out.push_str("null"),
        Cell::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Cell::Int(i) => out.push_str(itoa::Buffer::new().format(*i)),
        Cell::Float(f) => {
            if f.is_finite() {
                out.push_str(&float_repr(*f))
            } else {
                out.push_str("null") // render.py retries the page with _safe(): non-finite floats become null
            }
        }
        Cell::Decimal { num, .. } => out.push_str(num),
        Cell::Str(s) => json_str(out, s, false),
        Cell::Json(v) => write_jvalue(out, v, false),
    }
}

/// For each distinct column name in first-occurrence order: (name, index of its last occurrence).
fn dict_layout(columns: &[String]) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for (i, c) in columns.iter().enumerate() {
        if let Some(e) = out.iter_mut().find(|e| columns[e.0] == *c) {
            e.1 = i;
        } else {
            out.push((i, i));
        }
    }
    out
}

/// A row object's fixed text, written once per page instead of once per row: for each distinct column,
/// `"name":` (`,"name":` after the first), and the index of the value it takes.
struct ObjLayout {
    keys: Vec<(String, usize)>,
}

impl ObjLayout {
    fn new(columns: &[String]) -> ObjLayout {
        let keys = dict_layout(columns)
            .into_iter()
            .enumerate()
            .map(|(n, (name_i, val_i))| {
                let mut k = String::with_capacity(columns[name_i].len() + 4);
                if n > 0 {
                    k.push(',');
                }
                json_str(&mut k, &columns[name_i], false);
                k.push(':');
                (k, val_i)
            })
            .collect();
        ObjLayout { keys }
    }

    fn write_row(&self, out: &mut String, row: &[Cell]) {
        out.push('{');
        for (k, val_i) in &self.keys {
            out.push_str(k);
            write_cell_json(out, &row[*val_i]);
        }
        out.push('}');
    }
}

/// Once the first row is written (`out` holds it), room for all `n` at about its size, so that the body
/// grows once instead of doubling (and copying) ten times on a 1,000-row page.
fn reserve_like_first(out: &mut String, n: usize) {
    let per = out.len().max(8);
    out.reserve(per.saturating_mul(n) / 8 * 9);
}

pub fn render_json(page: &Page) -> Vec<u8> {
    let obj = ObjLayout::new(&page.columns);
    let mut out = String::with_capacity(256);
    out.push('[');
    for (i, r) in page.iter_rows().enumerate() {
        if i > 0 {
            if i == 1 {
                reserve_like_first(&mut out, page.rows);
            }
            out.push(',');
        }
        obj.write_row(&mut out, r);
    }
    out.push(']');
    out.into_bytes()
}

pub fn render_ndjson(page: &Page) -> Vec<u8> {
    let obj = ObjLayout::new(&page.columns);
    let mut out = String::with_capacity(256);
    for (i, r) in page.iter_rows().enumerate() {
        if i == 1 {
            reserve_like_first(&mut out, page.rows);
        }
        obj.write_row(&mut out, r);
        out.push('\n');
    }
    out.into_bytes()
}

fn csv_field(out: &mut String, s: &str, alone: bool) {
    if (alone && s.is_empty()) || s.contains([',', '"', '\r', '\n']) {
        out.push('"');
        out.push_str(&s.replace('"', "\"\""));
        out.push('"');
    } else {
        out.push_str(s);
    }
}

/// `_csv_value(v)` written as csv.writer writes it; None for values render.py would print with repr() of a
/// container (forwarded). Only text can need quoting: ints, floats, decimals and booleans never hold a comma,
/// a quote or a line break.
fn csv_cell(out: &mut String, c: &Cell, alone: bool) -> Option<()> {
    match c {
        Cell::Null => csv_field(out, "", alone),
        Cell::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Cell::Int(i) => out.push_str(itoa::Buffer::new().format(*i)),
        Cell::Float(f) => out.push_str(&float_repr(*f)),
        Cell::Decimal { num, .. } => csv_field(out, num, alone),
        Cell::Str(s) => csv_field(out, s, alone),
        Cell::Json(_) => return None,
    }
    Some(())
}

/// None when a value has no CSV form the plane can reproduce (a JSON document: Python prints its repr).
pub fn render_csv(page: &Page) -> Option<Vec<u8>> {
    let alone = page.width() == 1;
    let mut out = String::with_capacity(256);
    for (i, c) in page.columns.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        csv_field(&mut out, c, alone);
    }
    out.push_str("\r\n");
    let header = out.len();
    for (n, r) in page.iter_rows().enumerate() {
        if n == 1 {
            let first = out.len() - header;
            out.reserve(first.max(8).saturating_mul(page.rows) / 8 * 9);
        }
        for (i, c) in r.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            csv_cell(&mut out, c, alone)?;
        }
        out.push_str("\r\n");
    }
    Some(out.into_bytes())
}

/// Python's json.loads on a json/jsonb column's text. None on anything it would not give back as
/// plain str/int/float/list/dict we can print (the caller then forwards).
pub fn parse_json(text: &str) -> Option<JValue> {
    let b = text.as_bytes();
    let mut p = 0;
    let v = parse_value(b, &mut p, 0)?;
    skip_ws(b, &mut p);
    if p != b.len() {
        return None;
    }
    Some(v)
}

fn skip_ws(b: &[u8], p: &mut usize) {
    while *p < b.len() && matches!(b[*p], b' ' | b'\t' | b'\n' | b'\r') {
        *p += 1;
    }
}

fn parse_value(b: &[u8], p: &mut usize, depth: u32) -> Option<JValue> {
    if depth > 200 {
        return None;
    }
    skip_ws(b, p);
    match *b.get(*p)? {
        b'n' if b[*p..].starts_with(b"null") => {
            *p += 4;
            Some(JValue::Null)
        }
        b't' if b[*p..].starts_with(b"true") => {
            *p += 4;
            Some(JValue::Bool(true))
        }
        b'f' if b[*p..].starts_with(b"false") => {
            *p += 5;
            Some(JValue::Bool(false))
        }
        b'"' => Some(JValue::Str(parse_string(b, p)?)),
        b'[' => {
            *p += 1;
            let mut items = Vec::new();
            skip_ws(b, p);
            if b.get(*p) == Some(&b']') {
                *p += 1;
                return Some(JValue::Arr(items));
            }
            loop {
                items.push(parse_value(b, p, depth + 1)?);
                skip_ws(b, p);
                match b.get(*p)? {
                    b',' => *p += 1,
                    b']' => {
                        *p += 1;
                        return Some(JValue::Arr(items));
                    }
                    _ => return None,
                }
            }
        }
        b'{' => {
            *p += 1;
            let mut items: Vec<(String, JValue)> = Vec::new();
            skip_ws(b, p);
            if b.get(*p) == Some(&b'}') {
                *p += 1;
                return Some(JValue::Obj(items));
            }
            loop {
                skip_ws(b, p);
                if b.get(*p) != Some(&b'"') {
                    return None;
                }
                let k = parse_string(b, p)?;
                skip_ws(b, p);
                if b.get(*p) != Some(&b':') {
                    return None;
                }
                *p += 1;
                let v = parse_value(b, p, depth + 1)?;
                if let Some(e) = items.iter_mut().find(|e| e.0 == k) {
                    e.1 = v; // a Python dict keeps the first position and the last value
                } else {
                    items.push((k, v));
                }
                skip_ws(b, p);
                match b.get(*p)? {
                    b',' => *p += 1,
                    b'}' => {
                        *p += 1;
                        return Some(JValue::Obj(items));
                    }
                    _ => return None,
                }
            }
        }
        b'-' | b'0'..=b'9' => parse_number(b, p),
        _ => None, // NaN / Infinity (json.loads accepts them, but they cannot be rendered): forward
    }
}

fn parse_number(b: &[u8], p: &mut usize) -> Option<JValue> {
    let start = *p;
    if b[*p] == b'-' {
        *p += 1;
    }
    let int_start = *p;
    if b.get(*p) == Some(&b'0') {
        *p += 1;
    } else {
        while b.get(*p).is_some_and(u8::is_ascii_digit) {
            *p += 1;
        }
    }
    if *p == int_start {
        return None;
    }
    let mut is_float = false;
    if b.get(*p) == Some(&b'.') && b.get(*p + 1).is_some_and(u8::is_ascii_digit) {
        is_float = true;
        *p += 1;
        while b.get(*p).is_some_and(u8::is_ascii_digit) {
            *p += 1;
        }
    }
    if matches!(b.get(*p), Some(b'e') | Some(b'E')) {
        let save = *p;
        *p += 1;
        if matches!(b.get(*p), Some(b'+') | Some(b'-')) {
            *p += 1;
        }
        if b.get(*p).is_some_and(u8::is_ascii_digit) {
            is_float = true;
            while b.get(*p).is_some_and(u8::is_ascii_digit) {
                *p += 1;
            }
        } else {
            *p = save;
        }
    }
    let text = std::str::from_utf8(&b[start..*p]).ok()?;
    if is_float {
        let f: f64 = text.parse().ok()?;
        if !f.is_finite() {
            return None;
        }
        Some(JValue::Num(float_repr(f)))
    } else {
        let digits = text.trim_start_matches('-');
        let neg = text.starts_with('-') && digits != "0";
        Some(JValue::Num(format!("{}{}", if neg { "-" } else { "" }, digits)))
    }
}

fn parse_string(b: &[u8], p: &mut usize) -> Option<String> {
    *p += 1;
    let mut out = String::new();
    loop {
        let start = *p;
        while *p < b.len() && b[*p] != b'"' && b[*p] != b'\\' && b[*p] >= 0x20 {
            *p += 1;
        }
        out.push_str(std::str::from_utf8(&b[start..*p]).ok()?);
        match *b.get(*p)? {
            b'"' => {
                *p += 1;
                return Some(out);
            }
            b'\\' => {
                let e = *b.get(*p + 1)?;
                *p += 2;
                match e {
                    b'"' => out.push('"'),
                    b'\\' => out.push('\\'),
                    b'/' => out.push('/'),
                    b'b' => out.push('\u{8}'),
                    b'f' => out.push('\u{c}'),
                    b'n' => out.push('\n'),
                    b'r' => out.push('\r'),
                    b't' => out.push('\t'),
                    b'u' => {
                        let hi = hex4(b, p)?;
                        let c = if (0xD800..0xDC00).contains(&hi) && b.get(*p) == Some(&b'\\') && b.get(*p + 1) == Some(&b'u') {
                            *p += 2;
                            let lo = hex4(b, p)?;
                            if !(0xDC00..0xE000).contains(&lo) {
                                return None;
                            }
                            char::from_u32(0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00))?
                        } else {
                            char::from_u32(hi)? // a lone surrogate: Python keeps it, we cannot: forward
                        };
                        out.push(c);
                    }
                    _ => return None,
                }
            }
            _ => return None, // a raw control character: json.loads refuses it (strict)
        }
    }
}

fn hex4(b: &[u8], p: &mut usize) -> Option<u32> {
    let s = std::str::from_utf8(b.get(*p..*p + 4)?).ok()?;
    *p += 4;
    u32::from_str_radix(s, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(c: &[&str], rows: Vec<Vec<Cell>>) -> Page {
        Page::from_rows(c.iter().map(|s| s.to_string()).collect(), rows)
    }

    #[test]
    fn page_rows_and_truncate() {
        let mut p = page(&["a", "b"], vec![vec![Cell::Int(1), Cell::Null], vec![Cell::Int(2), Cell::Null], vec![Cell::Int(3), Cell::Null]]);
        assert_eq!(p.iter_rows().map(|r| r[0].clone()).collect::<Vec<_>>(), vec![Cell::Int(1), Cell::Int(2), Cell::Int(3)]);
        p.truncate(2);
        assert_eq!((p.rows, p.cells.len()), (2, 4));
        p.truncate(5);
        assert_eq!(p.rows, 2);
        let mut empty = page(&[], vec![vec![], vec![], vec![]]);
        assert_eq!(empty.iter_rows().count(), 3);
        empty.truncate(1);
        assert_eq!(empty.rows, 1);
    }

    #[test]
    fn json_like_render_py() {
        // python: render.render_json(["id","name","x","id"], [(1,"a\"é",1e16,2),(None,True,0.1,float("nan"))])
        let rows = vec![
            vec![Cell::Int(1), Cell::Str("a\"é".into()), Cell::Float(1e16), Cell::Int(2)],
            vec![Cell::Null, Cell::Bool(true), Cell::Float(0.1), Cell::Float(f64::NAN)],
        ];
        let out = render_json(&page(&["id", "name", "x", "id"], rows));
        assert_eq!(String::from_utf8(out).unwrap(), r#"[{"id":2,"name":"a\"é","x":1e+16},{"id":null,"name":true,"x":0.1}]"#);
        assert_eq!(render_json(&page(&["a"], vec![])), b"[]".to_vec());
        let nd = render_ndjson(&page(&["a", "b"], vec![vec![Cell::Int(-5), Cell::Decimal { text: "12.50".into(), num: "12.50".into() }]]));
        assert_eq!(String::from_utf8(nd).unwrap(), "{\"a\":-5,\"b\":12.50}\n");
        assert_eq!(render_ndjson(&page(&["a"], vec![])), b"".to_vec());
        // rows of no columns (SELECT FROM t): json.dumps([{}, {}])
        assert_eq!(render_json(&page(&[], vec![vec![], vec![]])), b"[{},{}]".to_vec());
        // i64's extremes, text needing every escape, and a page long enough to outgrow the first row's estimate
        let rows = vec![
            vec![Cell::Int(i64::MIN), Cell::Str("\u{1}\u{1f}\u{8}\u{c}\t\r\n\"\\/\u{7f}é😀".into())],
            vec![Cell::Int(i64::MAX), Cell::Str("x".repeat(300))],
        ];
        let out = String::from_utf8(render_json(&page(&["n", "t"], rows))).unwrap();
        let want = concat!(r#"[{"n":-9223372036854775808,"t":"\u0001\u001f\b\f\t\r\n\"\\/"#, "\u{7f}é😀", r#""},{"n":9223372036854775807,"t":""#);
        assert_eq!(out, format!("{want}{}\"}}]", "x".repeat(300)));
    }

    #[test]
    fn csv_like_python_csv_writer() {
        // python: render.render_csv(["a","b,c","d"], [("x,y", 'q"t', "l1\nl2"), (None, True, 1.5), ("", " s ", "\r")])
        let rows = vec![
            vec![Cell::Str("x,y".into()), Cell::Str("q\"t".into()), Cell::Str("l1\nl2".into())],
            vec![Cell::Null, Cell::Bool(true), Cell::Float(1.5)],
            vec![Cell::Str("".into()), Cell::Str(" s ".into()), Cell::Str("\r".into())],
        ];
        let out = render_csv(&page(&["a", "b,c", "d"], rows)).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "a,\"b,c\",d\r\n\"x,y\",\"q\"\"t\",\"l1\nl2\"\r\n,true,1.5\r\n, s ,\"\r\"\r\n"
        );
        // one column, empty value: csv quotes a lone empty field
        let out = render_csv(&page(&["a"], vec![vec![Cell::Null], vec![Cell::Int(1)], vec![Cell::Str("".into())]])).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "a\r\n\"\"\r\n1\r\n\"\"\r\n");
        // two columns: an empty value is not quoted; a decimal, a float, an int and a bool as render.py prints them
        let rows = vec![
            vec![Cell::Null, Cell::Str("".into())],
            vec![Cell::Decimal { text: "1E-7".into(), num: "0.0000001".into() }, Cell::Float(1e16)],
            vec![Cell::Int(-3), Cell::Bool(false)],
        ];
        let out = render_csv(&page(&["a", "b"], rows)).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "a,b\r\n,\r\n0.0000001,1e+16\r\n-3,false\r\n");
        assert!(render_csv(&page(&["j"], vec![vec![Cell::Json(JValue::Null)]])).is_none());
    }

    #[test]
    fn json_documents_like_json_loads() {
        let v = parse_json(r#" {"b": [1, 2.50, -0, 1E2, "\u00e9\ud83d\ude00"], "a": {"x": null}, "b": true} "#).unwrap();
        let mut s = String::new();
        write_jvalue(&mut s, &v, false);
        assert_eq!(s, r#"{"b":true,"a":{"x":null}}"#);
        let v = parse_json(r#"[1, 2.50, -0, 1E2, "\u00e9\ud83d\ude00", {"z":1,"y":2}]"#).unwrap();
        let mut s = String::new();
        write_jvalue(&mut s, &v, true);
        assert_eq!(s, "[1,2.5,0,100.0,\"é😀\",{\"y\":2,\"z\":1}]");
        assert!(parse_json("NaN").is_none());
        assert!(parse_json("[1,]").is_none());
    }
}
