//! The plane's log lines, on standard error: as they always read (`qag-plane: …`), or, when
//! `QAG_LOG_FORMAT=json`, one JSON object per line with the fields every qag process writes
//! (qag/logs.py): `ts` (RFC 3339 UTC, milliseconds), `level`, `process` ("plane"), `pid`, `logger`
//! ("qag.plane") and `msg`.

use crate::pyfmt::json_str;
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

static JSON: OnceLock<bool> = OnceLock::new();

/// QAG_LOG_FORMAT=json (read once).
pub fn json() -> bool {
    *JSON.get_or_init(|| std::env::var("QAG_LOG_FORMAT").map(|v| v.trim().eq_ignore_ascii_case("json")).unwrap_or(false))
}

/// Writes one line: `level` is "info", "warning" or "error".
pub fn line(level: &str, msg: &str) {
    if json() {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        eprintln!("{}", json_line(now.as_millis() as i64, level, std::process::id(), msg));
    } else {
        eprintln!("qag-plane: {msg}");
    }
}

/// `plog!("warning", "format {}", args)`: one log line (see [`line`]).
#[macro_export]
macro_rules! plog {
    ($level:expr, $($arg:tt)*) => { $crate::log::line($level, &format!($($arg)*)) };
}

/// The JSON object of one line (pure: the tests call it).
pub fn json_line(unix_ms: i64, level: &str, pid: u32, msg: &str) -> String {
    let mut out = String::with_capacity(msg.len() + 120);
    out.push_str("{\"ts\": \"");
    out.push_str(&rfc3339_ms(unix_ms));
    out.push_str("\", \"level\": ");
    json_str(&mut out, level, false);
    out.push_str(", \"process\": \"plane\", \"pid\": ");
    out.push_str(&pid.to_string());
    out.push_str(", \"logger\": \"qag.plane\", \"msg\": ");
    json_str(&mut out, msg, false);
    out.push('}');
    out
}

/// Unix milliseconds as `YYYY-MM-DDTHH:MM:SS.mmmZ` (the proleptic Gregorian calendar, as Python's).
pub fn rfc3339_ms(unix_ms: i64) -> String {
    let ms = unix_ms.rem_euclid(1000);
    let secs = unix_ms.div_euclid(1000);
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    // days since 1970-01-01 to a civil date (Howard Hinnant's algorithm)
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{ms:03}Z", sod / 3600, sod % 3600 / 60, sod % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc_with_milliseconds() {
        assert_eq!(rfc3339_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_ms(1_764_637_252_085), "2025-12-02T01:00:52.085Z");
        assert_eq!(rfc3339_ms(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339_ms(-1), "1969-12-31T23:59:59.999Z");
    }

    #[test]
    fn a_line_is_one_json_object_with_its_text_escaped() {
        let l = json_line(0, "warning", 42, "forwarding /q/x?a=\"b\"\\\n\u{1}é");
        assert_eq!(
            l,
            "{\"ts\": \"1970-01-01T00:00:00.000Z\", \"level\": \"warning\", \"process\": \"plane\", \"pid\": 42, \
             \"logger\": \"qag.plane\", \"msg\": \"forwarding /q/x?a=\\\"b\\\"\\\\\\n\\u0001é\"}"
        );
    }
}
