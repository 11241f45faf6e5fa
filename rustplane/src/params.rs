//! A saved query's parameters with qag/params.py's rules and error sentences: the specs a plan entry
//! carries (`Spec`), the reserved names, conversion of the query string's text, the rules (enum, min/max,
//! lengths, pattern) and `bind`, every problem at once in Python's order.
//!
//! Anything whose Python outcome the plane cannot reproduce exactly (non-ASCII numerals, `_` in numbers,
//! very long values, a pattern the `regex` crate reads differently) yields `Forward`.

use crate::error::{ApiError, Extra, Outcome};
use crate::msgpack::Value;
use crate::pyfmt::float_repr;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PType {
    Int,
    Float,
    Str,
    Bool,
}

/// A typed value after conversion (Python's int/float/str/bool/None).
#[derive(Debug, Clone, PartialEq)]
pub enum PVal {
    Null,
    Int(i64),
    Float(f64),
    Str(String),
    Bool(bool),
}

impl PVal {
    /// str(v) as _check_rules' messages print it.
    fn py_str(&self) -> String {
        match self {
            PVal::Null => "None".into(),
            PVal::Int(i) => i.to_string(),
            PVal::Float(f) => float_repr(*f),
            PVal::Str(s) => s.clone(),
            PVal::Bool(b) => (if *b { "True" } else { "False" }).into(),
        }
    }

    fn as_num(&self) -> Option<Num> {
        match *self {
            PVal::Int(i) => Some(Num::I(i)),
            PVal::Float(f) => Some(Num::F(f)),
            PVal::Bool(b) => Some(Num::I(b as i64)),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Num {
    I(i64),
    F(f64),
}

impl Num {
    fn text(&self) -> String {
        match *self {
            Num::I(i) => i.to_string(),
            Num::F(f) => float_repr(f),
        }
    }
}

/// Python's exact comparison a < b across int and float.
fn num_lt(a: Num, b: Num) -> bool {
    match (a, b) {
        (Num::I(x), Num::I(y)) => x < y,
        (Num::F(x), Num::F(y)) => x < y,
        (Num::I(x), Num::F(y)) => int_cmp_float(x, y) == Some(std::cmp::Ordering::Less),
        (Num::F(x), Num::I(y)) => int_cmp_float(y, x) == Some(std::cmp::Ordering::Greater),
    }
}

fn int_cmp_float(i: i64, f: f64) -> Option<std::cmp::Ordering> {
    if f.is_nan() {
        return None;
    }
    if f >= 9.3e18 {
        return Some(std::cmp::Ordering::Less);
    }
    if f <= -9.3e18 {
        return Some(std::cmp::Ordering::Greater);
    }
    let fl = f.floor();
    match (i as i128).cmp(&(fl as i128)) {
        std::cmp::Ordering::Equal => Some(if f > fl { std::cmp::Ordering::Less } else { std::cmp::Ordering::Equal }),
        o => Some(o),
    }
}

#[derive(Debug, Clone)]
pub struct Spec {
    pub name: String,
    pub ty: PType,
    pub required: bool,
    pub has_default: bool,
    pub default: PVal,
    pub enum_: Option<Vec<PVal>>,
    pub min: Option<Num>,
    pub max: Option<Num>,
    pub min_length: Option<usize>,
    pub max_length: Option<usize>,
    pub pattern: Option<(String, regex::Regex)>,
}

fn pval_of(v: &Value) -> Option<PVal> {
    Some(match v {
        Value::Nil => PVal::Null,
        Value::Bool(b) => PVal::Bool(*b),
        Value::Int(_) | Value::UInt(_) => PVal::Int(v.as_i64()?),
        Value::Float(f) => PVal::Float(*f),
        Value::Str(s) => PVal::Str(s.clone()),
        _ => return None,
    })
}

fn num_of(v: &Value) -> Option<Option<Num>> {
    Some(match v {
        Value::Nil => None,
        Value::Int(_) | Value::UInt(_) => Some(Num::I(v.as_i64()?)),
        Value::Float(f) => Some(Num::F(*f)),
        _ => return None,
    })
}

/// A Python `re` pattern the `regex` crate reads the same way, full-match anchored; None = forward.
fn compile_pattern(p: &str) -> Option<regex::Regex> {
    // Constructs that differ between the two engines (or only exist in one): let Python decide.
    for bad in ["&&", "--", "~~", "[:", "\\Z", "\\z", "\\A", "{,", "(?<", "(?#", "(?P=", "\\p", "\\P", "\\x{", "\\U", "\\N", "\\u", "\\0", "\\h", "\\K"] {
        if p.contains(bad) {
            return None;
        }
    }
    if p.contains(" ") && p.contains("(?x") {
        return None;
    }
    regex::Regex::new(&format!("\\A(?:{p})\\z")).ok()
}

impl Spec {
    /// A spec as published in a plan entry; None when a field is malformed or the pattern is not portable.
    pub fn from_value(v: &Value) -> Option<Spec> {
        let ty = match v.get("type")?.as_str()? {
            "int" => PType::Int,
            "float" => PType::Float,
            "str" => PType::Str,
            "bool" => PType::Bool,
            _ => return None,
        };
        let opt_usize = |k: &str| -> Option<Option<usize>> {
            match v.get(k) {
                None | Some(Value::Nil) => Some(None),
                Some(x) => Some(Some(x.as_u64()? as usize)),
            }
        };
        let pattern = match v.get("pattern") {
            None | Some(Value::Nil) => None,
            Some(p) => {
                let p = p.as_str()?;
                Some((p.to_string(), compile_pattern(p)?))
            }
        };
        let enum_ = match v.get("enum") {
            None | Some(Value::Nil) => None,
            Some(e) => Some(e.as_array()?.iter().map(pval_of).collect::<Option<Vec<_>>>()?),
        };
        Some(Spec {
            name: v.get("name")?.as_str()?.to_string(),
            ty,
            required: v.get("required").and_then(Value::as_bool).unwrap_or(true),
            has_default: v.get("has_default").and_then(Value::as_bool).unwrap_or(false),
            default: v.get("default").map_or(Some(PVal::Null), pval_of)?,
            enum_,
            min: v.get("min").map_or(Some(None), num_of)?,
            max: v.get("max").map_or(Some(None), num_of)?,
            min_length: opt_usize("min_length")?,
            max_length: opt_usize("max_length")?,
            pattern,
        })
    }
}

/// `_convert` for query-string text. Err(Ok(sentence)) = a param error; Err(Err(())) = forward.
fn convert(spec: &Spec, raw: &str) -> Result<PVal, Result<String, ()>> {
    if spec.ty != PType::Str && !raw.is_ascii() {
        return Err(Err(())); // Python refuses these; its sentence is its own to give
    }
    match spec.ty {
        PType::Int => {
            let t = raw; // no spaces around the digits (qag/params.py INT_RE)
            let digits = t.strip_prefix(['+', '-']).unwrap_or(t);
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return Err(Ok("must be an integer".into()));
            }
            match t.parse::<i64>() {
                Ok(v) => Ok(PVal::Int(v)),
                Err(_) => Err(Ok("must be a signed 64-bit integer".into())),
            }
        }
        PType::Float => {
            let t = raw; // no spaces around the number (qag/params.py FLOAT_RE)
            if t.contains('_') {
                return Err(Err(()));
            }
            let low = t.to_ascii_lowercase();
            let body = low.strip_prefix(['+', '-']).unwrap_or(&low);
            let special = matches!(body, "inf" | "infinity" | "nan");
            let plain = !body.is_empty()
                && body.bytes().all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'+' | b'-'));
            if !special && !plain {
                return Err(Ok("must be a number".into()));
            }
            match t.parse::<f64>() {
                Ok(v) if v.is_finite() => Ok(PVal::Float(v)),
                Ok(_) => Err(Ok("must be a finite number".into())),
                Err(_) => Err(Ok("must be a number".into())),
            }
        }
        PType::Bool => {
            let low = raw.to_ascii_lowercase();
            match low.as_str() {
                "true" | "1" | "yes" => Ok(PVal::Bool(true)),
                "false" | "0" | "no" => Ok(PVal::Bool(false)),
                _ => Err(Ok("must be a boolean (true/1/yes or false/0/no)".into())),
            }
        }
        PType::Str => {
            if raw.contains('\0') {
                return Err(Ok("must not contain NUL characters".into()));
            }
            Ok(PVal::Str(raw.to_string()))
        }
    }
}

fn py_eq(a: &PVal, b: &PVal) -> bool {
    match (a.as_num(), b.as_num()) {
        (Some(x), Some(y)) => !num_lt(x, y) && !num_lt(y, x) && !matches!((x, y), (Num::F(f), _) | (_, Num::F(f)) if f.is_nan()),
        _ => a == b,
    }
}

fn check_rules(spec: &Spec, v: &PVal) -> Option<String> {
    if let Some(e) = &spec.enum_ {
        if !e.iter().any(|x| py_eq(v, x)) {
            return Some(format!("must be one of {}", e.iter().map(PVal::py_str).collect::<Vec<_>>().join(", ")));
        }
    }
    if let (Some(m), Some(x)) = (spec.min, v.as_num()) {
        if num_lt(x, m) {
            return Some(format!("must be at least {}", m.text()));
        }
    }
    if let (Some(m), Some(x)) = (spec.max, v.as_num()) {
        if num_lt(m, x) {
            return Some(format!("must be at most {}", m.text()));
        }
    }
    if let (PType::Str, PVal::Str(s)) = (spec.ty, v) {
        let n = s.chars().count();
        if let Some(m) = spec.min_length {
            if n < m {
                return Some(format!("must be at least {m} characters long"));
            }
        }
        if let Some(m) = spec.max_length {
            if n > m {
                return Some(format!("must be at most {m} characters long"));
            }
        }
        if let Some((p, re)) = &spec.pattern {
            if !re.is_match(s) {
                return Some(format!("must match the pattern {p}"));
            }
        }
    }
    None
}

const RESERVED: [&str; 7] = ["format", "page", "page_size", "version", "timeout", "stream", "connection_name"];

/// bind(): every problem at once, in Python's order (specs, then unknown names in query order).
pub(crate) fn bind(specs: &[Spec], given: &[(String, String)]) -> Result<Vec<(String, PVal)>, Outcome> {
    let mut errors: Vec<(String, String)> = Vec::new();
    let mut missing = false;
    let mut values = Vec::with_capacity(specs.len());
    let params: Vec<&(String, String)> = given.iter().filter(|(k, _)| !RESERVED.contains(&k.as_str())).collect();
    for spec in specs {
        let raw = params.iter().find(|(k, _)| *k == spec.name).map(|(_, v)| v.as_str());
        match raw {
            None => {}
            Some("") if spec.ty != PType::Str => {}
            Some(raw) => {
                if raw.len() > 16384 {
                    return Err(Outcome::Forward("long parameter value (Python's byte limit)"));
                }
                match convert(spec, raw) {
                    Err(Err(())) => return Err(Outcome::Forward("parameter text needs Python's parser")),
                    Err(Ok(msg)) => errors.push((spec.name.clone(), msg)),
                    Ok(v) => match check_rules(spec, &v) {
                        Some(msg) => errors.push((spec.name.clone(), msg)),
                        None => values.push((spec.name.clone(), v)),
                    },
                }
                continue;
            }
        }
        if spec.has_default {
            values.push((spec.name.clone(), spec.default.clone()));
        } else if spec.required {
            errors.push((spec.name.clone(), "is required".into()));
            missing = true;
        } else {
            values.push((spec.name.clone(), PVal::Null));
        }
    }
    for (k, _) in &params {
        if !specs.iter().any(|s| s.name == *k) {
            errors.push((k.clone(), "is not a parameter of this query".into()));
        }
    }
    if errors.is_empty() {
        return Ok(values);
    }
    let only_missing = missing && errors.iter().all(|(_, v)| v == "is required");
    let code = if only_missing { "param_required" } else { "param_invalid" };
    let what = errors.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join("; ");
    Err(Outcome::Error(ApiError {
        status: 400,
        code,
        message: format!("Fix the parameters and try again: {what}."),
        extra: Some(Extra::Errors(errors)),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, ty: PType) -> Spec {
        Spec { name: name.into(), ty, required: true, has_default: false, default: PVal::Null, enum_: None, min: None,
               max: None, min_length: None, max_length: None, pattern: None }
    }

    fn q(s: &str) -> Vec<(String, String)> {
        crate::options::parse_query(s).unwrap()
    }

    fn err_body(r: Result<Vec<(String, PVal)>, Outcome>) -> String {
        match r {
            Err(Outcome::Error(e)) => String::from_utf8(e.body("rid1")).unwrap(),
            other => panic!("expected an error, got {other:?}"),
        }
    }

    #[test]
    fn required_and_unknown_like_python() {
        // python: params.bind(specs, {...}, 65536) -> ApiError; json.dumps(err.body("rid1"))
        let specs = vec![spec("aid", PType::Int), spec("name", PType::Str)];
        assert_eq!(err_body(bind(&specs, &q(""))),
            r#"{"error": "Fix the parameters and try again: aid is required; name is required.", "code": "param_required", "request_id": "rid1", "errors": {"aid": "is required", "name": "is required"}}"#);
        assert_eq!(err_body(bind(&specs, &q("aid=x1&name=a&zz=1&%C3%A9=2"))),
            "{\"error\": \"Fix the parameters and try again: aid must be an integer; zz is not a parameter of this query; \\u00e9 is not a parameter of this query.\", \"code\": \"param_invalid\", \"request_id\": \"rid1\", \"errors\": {\"aid\": \"must be an integer\", \"zz\": \"is not a parameter of this query\", \"\\u00e9\": \"is not a parameter of this query\"}}");
        assert_eq!(err_body(bind(&specs, &q("aid=&format=csv"))),
            r#"{"error": "Fix the parameters and try again: aid is required; name is required.", "code": "param_required", "request_id": "rid1", "errors": {"aid": "is required", "name": "is required"}}"#);
        let ok = bind(&specs, &q("aid=%2B42&name=&page=2")).unwrap();
        assert_eq!(ok, vec![("aid".into(), PVal::Int(42)), ("name".into(), PVal::Str("".into()))]);
        assert_eq!(err_body(bind(&specs, &q("aid=99999999999999999999&name=x"))),
            r#"{"error": "Fix the parameters and try again: aid must be a signed 64-bit integer.", "code": "param_invalid", "request_id": "rid1", "errors": {"aid": "must be a signed 64-bit integer"}}"#);
    }

    #[test]
    fn rules_like_python() {
        let mut f = spec("f", PType::Float);
        f.min = Some(Num::I(0));
        f.max = Some(Num::F(2.5));
        let mut e = spec("e", PType::Str);
        e.enum_ = Some(vec![PVal::Str("a".into()), PVal::Str("b".into())]);
        let mut s = spec("s", PType::Str);
        s.min_length = Some(2);
        s.max_length = Some(3);
        let mut p = spec("p", PType::Str);
        p.pattern = Some(("[a-z]+\\d".into(), compile_pattern("[a-z]+\\d").unwrap()));
        let mut b = spec("b", PType::Bool);
        b.enum_ = Some(vec![PVal::Bool(true)]);
        let specs = vec![f, e, s, p, b];
        assert_eq!(err_body(bind(&specs, &q("f=3&e=c&s=abcd&p=ab1x&b=no"))),
            r#"{"error": "Fix the parameters and try again: f must be at most 2.5; e must be one of a, b; s must be at most 3 characters long; p must match the pattern [a-z]+\\d; b must be one of True.", "code": "param_invalid", "request_id": "rid1", "errors": {"f": "must be at most 2.5", "e": "must be one of a, b", "s": "must be at most 3 characters long", "p": "must match the pattern [a-z]+\\d", "b": "must be one of True"}}"#);
        assert_eq!(err_body(bind(&specs, &q("f=-1e-3&e=a&s=x&p=ab1&b=maybe"))),
            r#"{"error": "Fix the parameters and try again: f must be at least 0; s must be at least 2 characters long; b must be a boolean (true/1/yes or false/0/no).", "code": "param_invalid", "request_id": "rid1", "errors": {"f": "must be at least 0", "s": "must be at least 2 characters long", "b": "must be a boolean (true/1/yes or false/0/no)"}}"#);
        assert_eq!(err_body(bind(&specs, &q("f=nan&e=a&s=xy&p=ab1&b=1"))),
            r#"{"error": "Fix the parameters and try again: f must be a finite number.", "code": "param_invalid", "request_id": "rid1", "errors": {"f": "must be a finite number"}}"#);
        let ok = bind(&specs, &q("f=%2B2.5&e=b&s=%C3%A9t%C3%A9&p=z9&b=YES")).unwrap();
        assert_eq!(ok[0].1, PVal::Float(2.5));
        assert_eq!(ok[2].1, PVal::Str("été".into()));
        assert_eq!(ok[4].1, PVal::Bool(true));
        assert_eq!(bind(&specs, &q("f=%D9%A3")), Err(Outcome::Forward("parameter text needs Python's parser")));
    }

    #[test]
    fn conversions_like_python() {
        // python: params._convert(spec, text) for float, int and bool specs
        let f = spec("f", PType::Float);
        let i = spec("i", PType::Int);
        let b = spec("b", PType::Bool);
        let num = "must be a number";
        let fin = "must be a finite number";
        type Case<'a> = (&'a str, Result<f64, &'a str>, Result<i64, &'a str>);
        let cases: &[Case<'_>] = &[
            ("1e5", Ok(100000.0), Err("must be an integer")), (".5", Ok(0.5), Err("")), ("5.", Ok(5.0), Err("")),
            ("1e", Err(num), Err("")), ("e1", Err(num), Err("")), ("+.5", Ok(0.5), Err("")), ("-.e1", Err(num), Err("")),
            ("1.5E+3", Ok(1500.0), Err("")), ("0x10", Err(num), Err("")), ("1e500", Err(fin), Err("")),
            ("nAn", Err(fin), Err("")), ("-iNF", Err(fin), Err("")), ("Infinity", Err(fin), Err("")),
            ("infinit", Err(num), Err("")), (" 2 ", Err(num), Err("")), ("\t3\n", Err(num), Err("")), ("1.2.3", Err(num), Err("")),
            ("--1", Err(num), Err("")), ("+-1", Err(num), Err("")), ("1e+", Err(num), Err("")), ("00.5", Ok(0.5), Err("")),
            ("5e-400", Ok(0.0), Err("")), ("\x0b7\x1c", Err(num), Err("")), ("+7", Ok(7.0), Ok(7)),
        ];
        for (text, fv, iv) in cases {
            let got = convert(&f, text);
            match fv {
                Ok(v) => assert_eq!(got, Ok(PVal::Float(*v)), "float {text:?}"),
                Err(m) => assert_eq!(got, Err(Ok(m.to_string())), "float {text:?}"),
            }
            let got = convert(&i, text);
            match iv {
                Ok(v) => assert_eq!(got, Ok(PVal::Int(*v)), "int {text:?}"),
                Err(_) => assert_eq!(got, Err(Ok("must be an integer".to_string())), "int {text:?}"),
            }
            assert_eq!(convert(&b, text), Err(Ok("must be a boolean (true/1/yes or false/0/no)".to_string())), "bool {text:?}");
        }
        assert_eq!(convert(&f, "\u{661}"), Err(Err(())), "Unicode digits: Python's to decide");
        assert_eq!(convert(&f, "1__0"), Err(Err(())), "underscores: Python's to decide");
    }
}
