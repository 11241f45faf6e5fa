//! Python's text forms, byte for byte: `repr(float)`, `json.dumps` string escaping (with and without
//! `ensure_ascii`), `repr(str)` for printable ASCII, `format(x, "g")`, and `str(Decimal)`.

/// Lowercase hex of bytes (bytes.hex()).
pub fn hex(b: &[u8]) -> String {
    const H: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for &x in b {
        s.push(H[(x >> 4) as usize] as char);
        s.push(H[(x & 15) as usize] as char);
    }
    s
}

/// `repr(x)` of a Python float: shortest round-trip digits; scientific when the decimal exponent is
/// < -4 or >= 16 ("1e-05", "1e+16", "1.5e+300"), else positional with at least one fractional digit.
pub fn float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // Rust's `{:e}` gives the shortest round-trip digits as d[.ddd]e<exp>.
    let s = format!("{:e}", x);
    let (mant, exp) = s.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("exponent");
    let (neg, mant) = match mant.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mant),
    };
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    let mut out = String::with_capacity(24);
    if neg {
        out.push('-');
    }
    if !(-4..16).contains(&exp) {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push(if exp < 0 { '-' } else { '+' });
        out.push_str(&format!("{:02}", exp.abs()));
    } else if exp < 0 {
        out.push_str("0.");
        for _ in 0..(-exp - 1) {
            out.push('0');
        }
        out.push_str(&digits);
    } else {
        let point = exp as usize + 1;
        if digits.len() <= point {
            out.push_str(&digits);
            for _ in digits.len()..point {
                out.push('0');
            }
            out.push_str(".0");
        } else {
            out.push_str(&digits[..point]);
            out.push('.');
            out.push_str(&digits[point..]);
        }
    }
    out
}

/// `format(x, "g")`: 6 significant digits, trailing zeros removed, scientific when exp < -4 or >= 6.
pub fn float_g(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0".into() } else { "0".into() };
    }
    let s = format!("{:.5e}", x);
    let (mant, exp) = s.split_once('e').unwrap();
    let exp: i32 = exp.parse().unwrap();
    if (-4..6).contains(&exp) {
        let decimals = (5 - exp).max(0) as usize;
        let t = format!("{:.*}", decimals, x);
        if t.contains('.') {
            t.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            t
        }
    } else {
        let m = if mant.contains('.') { mant.trim_end_matches('0').trim_end_matches('.') } else { mant };
        format!("{}e{}{:02}", m, if exp < 0 { '-' } else { '+' }, exp.abs())
    }
}

/// Append `s` as a JSON string the way Python's json module writes it.
/// `ascii`: ensure_ascii=True (\uXXXX for non-ASCII, surrogate pairs above the BMP).
pub fn json_str(out: &mut String, s: &str, ascii: bool) {
    out.push('"');
    if ascii {
        for c in s.chars() {
            match c {
                c if (c as u32) < 0x80 && !needs_escape(c as u8) && c != '\u{7f}' => out.push(c),
                c if (c as u32) < 0x80 => push_escape(out, c as u8),
                c => {
                    let mut buf = [0u16; 2];
                    for u in c.encode_utf16(&mut buf) {
                        push_u(out, *u);
                    }
                }
            }
        }
    } else {
        // ensure_ascii=False: only '"', '\\' and the controls below 0x20 change, all ASCII, so the text between
        // them (any UTF-8) is copied in runs
        let b = s.as_bytes();
        let mut run = 0;
        for (i, &c) in b.iter().enumerate() {
            if needs_escape(c) {
                out.push_str(&s[run..i]);
                push_escape(out, c);
                run = i + 1;
            }
        }
        out.push_str(&s[run..]);
    }
    out.push('"');
}

fn needs_escape(c: u8) -> bool {
    c == b'"' || c == b'\\' || c < 0x20
}

fn push_escape(out: &mut String, c: u8) {
    match c {
        b'"' => out.push_str("\\\""),
        b'\\' => out.push_str("\\\\"),
        b'\n' => out.push_str("\\n"),
        b'\r' => out.push_str("\\r"),
        b'\t' => out.push_str("\\t"),
        0x08 => out.push_str("\\b"),
        0x0c => out.push_str("\\f"),
        c => push_u(out, c as u16),
    }
}

fn push_u(out: &mut String, u: u16) {
    const H: &[u8; 16] = b"0123456789abcdef";
    out.push_str("\\u");
    for shift in [12, 8, 4, 0] {
        out.push(H[((u >> shift) & 15) as usize] as char);
    }
}

/// `repr(s)` when every character is printable ASCII (None otherwise: the caller forwards to Python).
pub fn str_repr(s: &str) -> Option<String> {
    if !s.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return None;
    }
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        if c == '\\' {
            out.push_str("\\\\");
        } else if c == quote {
            out.push('\\');
            out.push(c);
        } else {
            out.push(c);
        }
    }
    out.push(quote);
    Some(out)
}

/// `str(Decimal(text))` for a plain decimal text (sign, digits, optional point and digits):
/// Python's to-scientific-string rules.
pub fn decimal_str(neg: bool, int_digits: &str, frac_digits: &str) -> String {
    let all = format!("{int_digits}{frac_digits}");
    let coeff = all.trim_start_matches('0');
    let coeff = if coeff.is_empty() { "0" } else { coeff };
    let exp = -(frac_digits.len() as i64);
    let leftdigits = exp + coeff.len() as i64;
    let dotplace = if exp <= 0 && leftdigits > -6 { leftdigits } else { 1 };
    let (intpart, fracpart) = if dotplace <= 0 {
        ("0".to_string(), format!(".{}{}", "0".repeat((-dotplace) as usize), coeff))
    } else if dotplace as usize >= coeff.len() {
        (format!("{}{}", coeff, "0".repeat(dotplace as usize - coeff.len())), String::new())
    } else {
        (coeff[..dotplace as usize].to_string(), format!(".{}", &coeff[dotplace as usize..]))
    };
    let e = if leftdigits == dotplace { String::new() } else { format!("E{:+}", leftdigits - dotplace) };
    format!("{}{}{}{}", if neg { "-" } else { "" }, intpart, fracpart, e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_like_python() {
        // python -c 'print([repr(x) for x in (...)])'
        let cases: &[(f64, &str)] = &[
            (1e16, "1e+16"), (1e15, "1000000000000000.0"), (0.1, "0.1"), (0.0001, "0.0001"), (0.00001, "1e-05"),
            (1.5e300, "1.5e+300"), (-0.0, "-0.0"), (0.0, "0.0"), (1.0, "1.0"), (-2.5, "-2.5"), (123456789.125, "123456789.125"),
            (1.7976931348623157e308, "1.7976931348623157e+308"), (5e-324, "5e-324"), (1234567890123456.7, "1234567890123456.8"),
            (9999999999999998.0, "9999999999999998.0"), (0.30000000000000004, "0.30000000000000004"), (1e-4, "0.0001"),
            (12345.678e-10, "1.2345678e-06"), (2.0f64.powi(60), "1.152921504606847e+18"), (100.0, "100.0"),
        ];
        for (x, want) in cases {
            assert_eq!(float_repr(*x), *want, "repr({x:e})");
        }
    }

    #[test]
    fn float_g_like_python() {
        let cases: &[(f64, &str)] = &[(30.0, "30"), (0.5, "0.5"), (2.25, "2.25"), (1e6, "1e+06"), (123456.0, "123456"),
            (1234567.0, "1.23457e+06"), (0.0001, "0.0001"), (0.00001, "1e-05"), (1.0 / 3.0, "0.333333")];
        for (x, want) in cases {
            assert_eq!(float_g(*x), *want, "format({x}, 'g')");
        }
    }

    #[test]
    fn json_strings() {
        let mut s = String::new();
        json_str(&mut s, "a\"b\\c\nd\u{1}é😀\u{7f}", false);
        assert_eq!(s, "\"a\\\"b\\\\c\\nd\\u0001é😀\u{7f}\"");
        let mut s = String::new();
        json_str(&mut s, "é😀\u{7f}", true);
        assert_eq!(s, "\"\\u00e9\\ud83d\\ude00\\u007f\"");
    }

    #[test]
    fn reprs_and_decimals() {
        assert_eq!(str_repr("xml").unwrap(), "'xml'");
        assert_eq!(str_repr("it's").unwrap(), "\"it's\"");
        assert_eq!(str_repr("a'b\"c\\").unwrap(), "'a\\'b\"c\\\\'");
        assert!(str_repr("é").is_none());
        // str(Decimal(x)) for PostgreSQL numeric texts
        assert_eq!(decimal_str(false, "12", "50"), "12.50");
        assert_eq!(decimal_str(false, "0", "0000001"), "1E-7");
        assert_eq!(decimal_str(false, "0", "000001"), "0.000001");
        assert_eq!(decimal_str(true, "0", "00"), "-0.00");
        assert_eq!(decimal_str(false, "1000", ""), "1000");
        assert_eq!(decimal_str(false, "0", ""), "0");
        assert_eq!(decimal_str(false, "0", "00000000"), "0E-8");
    }
}
