//! Time limits, as qag/connectors.py sets them (issue 13 items 4 and 7): a statement limit is never rounded
//! to "no limit", and no call outlives its limit by more than a small margin, even when the database stops
//! answering (SIGSTOP, a dead host): the server's own limit first, the plane's client-side deadline second.
//!
//! The rule (qag/connectors.py S3, the same in Python): a limit below `MIN_TIMEOUT` (0.01 s) is raised to it and
//! rounded **up** to whole milliseconds (`ceil(s * 1000 - 1e-9)`: the 1e-9 keeps 0.29 s at 290 ms, not 291),
//! then written in the server's unit (PostgreSQL `statement_timeout` and MySQL `max_execution_time` in ms,
//! MariaDB `max_statement_time` in seconds with 3 decimals), so `0.0004` is 10 ms, never 0 ("off").

use std::time::Duration;

/// The smallest statement limit, in seconds: anything below (including 0.0004, which would round to 0,
/// "no limit") is raised to it.
const MIN_TIMEOUT: f64 = 0.01;

/// How long past its statement limit a call may wait for the database before the plane gives up on the
/// session (504 `query_timeout`, the session discarded): covers the server's own cancellation reaching us.
const DEADLINE_MARGIN: Duration = Duration::from_secs(1);

/// TCP keepalive on every database session (connectors.py S1): idle time before the first probe, interval,
/// probes. A host that vanishes is noticed within about idle + interval × probes (25 s) even when nothing is
/// sent; a frozen server (its kernel still answers) is the deadline's to notice.
pub(crate) const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
pub(crate) const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
pub(crate) const KEEPALIVE_RETRIES: u32 = 3;
/// TCP_USER_TIMEOUT: data written but not acknowledged for this long closes the socket (a dead host).
pub(crate) const TCP_USER_TIMEOUT: Duration = Duration::from_secs(10);

/// The limit in seconds after the minimum (NaN and non-positive values are the minimum too: a plan never
/// carries them, and "no limit" is never the answer).
fn clamp(seconds: f64) -> f64 {
    if seconds.is_nan() || seconds < MIN_TIMEOUT {
        MIN_TIMEOUT
    } else {
        seconds
    }
}

/// PostgreSQL `statement_timeout` / MySQL `max_execution_time`: milliseconds, rounded up, at least 10
/// (connectors.limit_ms).
pub(crate) fn millis(seconds: f64) -> u64 {
    ((clamp(seconds) * 1000.0 - 1e-9).ceil() as u64).max(10)
}

/// MariaDB `max_statement_time`: the same milliseconds, written in seconds with 3 decimals.
pub(crate) fn mariadb_seconds(seconds: f64) -> String {
    let ms = millis(seconds);
    format!("{}.{:03}", ms / 1000, ms % 1000)
}

/// The client-side deadline of one call whose statement limit is `seconds`: the limit plus the margin.
pub(crate) fn deadline(seconds: f64) -> Duration {
    Duration::from_secs_f64(clamp(seconds)) + DEADLINE_MARGIN
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tiny_limit_is_never_off() {
        assert_eq!(millis(0.0004), 10, "below the minimum: raised to 10 ms, not rounded to 0");
        assert_eq!(millis(0.0), 10);
        assert_eq!(millis(-1.0), 10);
        assert_eq!(millis(f64::NAN), 10);
        assert_eq!(mariadb_seconds(0.0004), "0.010");
        assert_eq!(mariadb_seconds(0.0), "0.010");
    }

    #[test]
    fn converted_by_rounding_up_like_limit_ms() {
        // connectors.limit_ms(None, s) for these s
        assert_eq!(millis(30.0), 30_000);
        assert_eq!(millis(0.0105), 11, "10.5 ms is 11 ms, not 10");
        assert_eq!(millis(0.29), 290, "0.29 * 1000 is 290.00000000000006: still 290");
        assert_eq!(millis(2.5), 2500);
        assert_eq!(millis(0.0100001), 11);
        assert_eq!(mariadb_seconds(30.0), "30.000");
        assert_eq!(mariadb_seconds(0.0105), "0.011");
        assert_eq!(mariadb_seconds(1.5), "1.500");
    }

    #[test]
    fn deadline_is_limit_plus_margin() {
        assert_eq!(deadline(2.0), Duration::from_secs(3));
        assert_eq!(deadline(0.0), Duration::from_millis(10) + DEADLINE_MARGIN);
    }
}
