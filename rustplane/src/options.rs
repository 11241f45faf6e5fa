//! A `/q` call's query string and its options, twin of qag/http/options.py: the query string read the way
//! Falcon reads it, and `format`, `page`, `page_size` checked with the same rules and answers. A call that
//! names `version`, `timeout`, `stream` or `connection_name`, or a value the plane does not parse exactly as
//! Python would, yields `Forward`.

use crate::error::{ApiError, Outcome};

/// One call's query string, parsed the way Falcon does (keep_blank, no csv), in first-seen order.
/// None when a name repeats (Python builds a list) or decoding is not plain UTF-8: forward.
pub(crate) fn parse_query(qs: &str) -> Option<Vec<(String, String)>> {
    let mut out: Vec<(String, String)> = Vec::new();
    if qs.is_empty() {
        return Some(out);
    }
    let encoded = qs.contains('+') || qs.contains('%');
    for field in qs.split('&') {
        let (k, v) = field.split_once('=').unwrap_or((field, ""));
        if v.is_empty() && k.is_empty() {
            continue;
        }
        let (k, v) = if encoded { (pct_decode(k)?, pct_decode(v)?) } else { (k.to_string(), v.to_string()) };
        if out.iter().any(|(n, _)| *n == k) {
            return None;
        }
        out.push((k, v));
    }
    Some(out)
}

fn pct_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let h = b.get(i + 1..i + 3)?; // a malformed escape: Falcon keeps it; rare, forward
                let v = u8::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok()?;
                if !h.iter().all(u8::is_ascii_hexdigit) {
                    return None;
                }
                out.push(v);
                i += 2;
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8(out).ok() // invalid UTF-8: Falcon substitutes U+FFFD; forward instead
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Format {
    Json,
    Ndjson,
    Csv,
}

impl Format {
    /// The format's name as a call's options hold it (lowercase): the response cache's key has it (R5).
    pub(crate) fn name(self) -> &'static str {
        match self {
            Format::Json => "json",
            Format::Ndjson => "ndjson",
            Format::Csv => "csv",
        }
    }

    pub(crate) fn content_type(self) -> &'static str {
        match self {
            Format::Json => "application/json",
            Format::Ndjson => "application/x-ndjson",
            Format::Csv => "text/csv; charset=utf-8",
        }
    }
}

#[derive(Debug)]
pub(crate) struct CallOptions {
    pub(crate) format: Format,
    pub(crate) page: i64,
    pub(crate) page_size: i64,
}

fn int_opt(given: &[(String, String)], name: &str, default: i64, lo: i64, hi: Option<i64>) -> Result<i64, Outcome> {
    let Some((_, raw)) = given.iter().find(|(k, _)| k == name) else { return Ok(default) };
    if raw.is_empty() {
        return Ok(default);
    }
    if !raw.is_ascii() {
        return Err(Outcome::Forward("non-ASCII paging value"));
    }
    // Python's grammar (qag/params.py INT_RE): an optional sign and ASCII digits, nothing around them
    let digits = raw.strip_prefix(['+', '-']).unwrap_or(raw);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ApiError::new(400, "invalid_paging", format!("{name} must be an integer.")).into());
    }
    let v: i64 = raw.parse().map_err(|_| Outcome::Forward("paging value beyond 64 bits"))?;
    if v < lo || hi.is_some_and(|h| v > h) {
        let bound = match hi {
            Some(h) => format!("between {lo} and {h}"),
            None => format!("at least {lo}"),
        };
        return Err(ApiError::new(400, "invalid_paging", format!("{name} must be {bound}.")).into());
    }
    Ok(v)
}

/// call_options() for the plane: version, timeout and stream are Python's to handle (forward).
pub(crate) fn call_options(given: &[(String, String)], default_page_size: i64, max_page_size: i64) -> Result<CallOptions, Outcome> {
    for k in ["version", "timeout", "stream", "connection_name"] {
        if given.iter().any(|(n, _)| n == k) {
            return Err(Outcome::Forward("version, timeout, stream or connection_name given"));
        }
    }
    let format = match given.iter().find(|(k, _)| k == "format") {
        None => Format::Json,
        Some((_, f)) => match f.to_ascii_lowercase().as_str() {
            _ if !f.is_ascii() => return Err(Outcome::Forward("non-ASCII format")),
            "json" => Format::Json,
            "ndjson" => Format::Ndjson,
            "csv" => Format::Csv,
            // Every other format (tsv, xml, yaml, xlsx, parquet) and every bad one are Python's to render or refuse.
            _ => return Err(Outcome::Forward("format rendered by Python")),
        },
    };
    let page = int_opt(given, "page", 1, 1, None)?;
    let page_size = int_opt(given, "page_size", default_page_size, 1, Some(max_page_size))?;
    if page > i64::MAX / 2 / page_size.max(1) {
        return Err(Outcome::Forward("page beyond 64-bit offsets"));
    }
    Ok(CallOptions { format, page, page_size })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(s: &str) -> Vec<(String, String)> {
        parse_query(s).unwrap()
    }

    #[test]
    fn options_like_python() {
        let o = call_options(&q("format=CSV&page=2&page_size=5"), 10, 1000).unwrap();
        assert_eq!((o.format, o.page, o.page_size), (Format::Csv, 2, 5));
        let e = |qs: &str| match call_options(&q(qs), 10, 1000) {
            Err(Outcome::Error(e)) => String::from_utf8(e.body("r")).unwrap(),
            other => panic!("{other:?}"),
        };
        assert!(matches!(call_options(&q("format=xml"), 10, 1000), Err(Outcome::Forward(_))), "Python renders xml");
        assert!(matches!(call_options(&q("format=bogus"), 10, 1000), Err(Outcome::Forward(_))), "Python refuses it");
        assert_eq!(e("page=0"), r#"{"error": "page must be at least 1.", "code": "invalid_paging", "request_id": "r"}"#);
        assert_eq!(e("page_size=1001"), r#"{"error": "page_size must be between 1 and 1000.", "code": "invalid_paging", "request_id": "r"}"#);
        assert_eq!(e("page=1.5"), r#"{"error": "page must be an integer.", "code": "invalid_paging", "request_id": "r"}"#);
        assert!(matches!(call_options(&q("stream=true"), 10, 1000), Err(Outcome::Forward(_))));
        assert_eq!(e("page=1_0"), r#"{"error": "page must be an integer.", "code": "invalid_paging", "request_id": "r"}"#);
        assert_eq!(e("page=%201"), r#"{"error": "page must be an integer.", "code": "invalid_paging", "request_id": "r"}"#);
        assert_eq!(call_options(&q("page=%2B2"), 10, 1000).unwrap().page, 2);
        assert!(parse_query("a=1&a=2").is_none(), "a repeated name is a list in Python: forward");
        assert_eq!(q("a&=x&b=&&c=%2B+1"), vec![("a".into(), "".into()), ("".into(), "x".into()), ("b".into(), "".into()), ("c".into(), "+ 1".into())]);
    }
}
