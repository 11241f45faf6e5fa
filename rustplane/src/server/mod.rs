//! The plane's HTTP side, one room per job:
//!
//! - [`accept`]: each plane thread's runtime, listener (SO_REUSEPORT) and connections, the dispatch of a
//!   request (served here or forwarded), and draining on SIGTERM;
//! - [`serve`]: the request path of `GET /q/<name>`, one stage after the other, mirroring qag/http/data.py's
//!   `DataResource.serve` (auth, plan, bind, execute, govern, render);
//! - [`cached`]: a call of a query with `cache_ttl` answered from the host's response cache (a fresh hit), else
//!   forwarded (Python fills the cache);
//! - [`execute`]: the database call of a served request: a pooled session, the client-side deadline, one
//!   retry on a fresh session;
//! - [`forward`]: everything else, to gunicorn over kept-alive HTTP/1.1 connections;
//! - [`write`]: a saved query that writes, when its plan entry lets the plane serve it: executed in its own
//!   transaction on a write session, committed, answered and recorded as Python's write;
//! - [`record`]: each served call's run record in the plane's ring and its counters in the plane's slot.
//!
//! Here: what every thread shares ([`Shared`]), request ids and the error answer, which served and
//! forwarded calls both use.

mod accept;
mod cached;
mod execute;
mod forward;
mod record;
mod serve;
mod write;

pub use accept::{run_thread, DRAINING, INFLIGHT};
pub use forward::Upstream;

use crate::error::ApiError;
use crate::segment::Segment;
use bytes::Bytes;
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::header::HeaderValue;
use hyper::{Request, Response, StatusCode};
use std::cell::Cell as StdCell;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// An answer's body: written whole (served calls, errors, small forwarded answers) or streamed from gunicorn.
type Body = Either<Full<Bytes>, Incoming>;

/// What every plane thread shares: the segment and the plane's slot in it, where to forward, the mask key.
pub struct Shared {
    pub seg: Segment,
    pub slot: usize,
    upstream: Upstream,
    home: String,
    mask_key: Option<Vec<u8>>,
    admin_key: Option<String>,
    record_wait_ms: u64,
    /// QAG_PLANE_DEBUG=1: say on stderr why a data call was forwarded.
    debug: bool,
    /// QAG_HEADER_TIMEOUT (seconds, default 10, as Python's workers): a client that has not sent a request's
    /// whole header this long after connecting or after its last answer is disconnected.
    header_timeout: std::time::Duration,
    producer: Mutex<record::Producer>,
}

impl Shared {
    pub fn new(seg: Segment, slot: usize, upstream: Upstream, home: String, mask_key: Option<Vec<u8>>,
               admin_key: Option<String>, record_wait_ms: u64) -> Shared {
        Shared { seg, slot, upstream, home, mask_key, admin_key, record_wait_ms,
                 debug: std::env::var("QAG_PLANE_DEBUG").is_ok_and(|v| !v.is_empty() && v != "0"),
                 header_timeout: header_timeout(std::env::var("QAG_HEADER_TIMEOUT").ok().as_deref()),
                 producer: Mutex::new(record::Producer::default()) }
    }
}

/// QAG_HEADER_TIMEOUT's value (qag/config.py: a positive number of seconds, default 10; the arbiter refuses a
/// malformed one before the plane starts, so anything unreadable here is the default).
fn header_timeout(v: Option<&str>) -> std::time::Duration {
    let s = v.and_then(|t| t.trim().parse::<f64>().ok()).filter(|s| s.is_finite() && *s > 0.0).unwrap_or(10.0);
    std::time::Duration::from_secs_f64(s.min(86_400.0))
}

/// Microseconds since the epoch (a run record's `at_us`, a key entry's expiry).
fn now_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as i64).unwrap_or(0)
}

thread_local! {
    static RNG: StdCell<u64> = StdCell::new(seed());
}

fn seed() -> u64 {
    let mut b = [0u8; 8];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut b);
    }
    u64::from_le_bytes(b) ^ now_us() as u64
}

/// secrets.token_hex(8)-shaped request id (splitmix64 from a urandom seed).
fn mint_request_id() -> String {
    RNG.with(|r| {
        let mut z = r.get().wrapping_add(0x9E37_79B9_7F4A_7C15);
        r.set(z);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        format!("{:016x}", z ^ (z >> 31))
    })
}

/// The caller's `X-Request-ID` when it is one Python would keep too, else a new one.
fn request_id(req: &Request<Incoming>) -> String {
    if let Some(v) = single_header(req, "x-request-id") {
        if !v.is_empty() && v.len() <= 64 && v.bytes().all(|b| b.is_ascii_alphanumeric() || b".:_-".contains(&b)) {
            return v.to_string();
        }
    }
    mint_request_id()
}

/// A header given exactly once, as text.
fn single_header<'a>(req: &'a Request<Incoming>, name: &str) -> Option<&'a str> {
    let mut it = req.headers().get_all(name).iter();
    let v = it.next()?;
    if it.next().is_some() {
        return None;
    }
    v.to_str().ok()
}

/// An error answer as Python's: its JSON body, `X-Request-ID`, never cached or sniffed.
fn error_response(err: &ApiError, rid: &str) -> Response<Body> {
    let body = err.body(rid);
    let mut r = Response::new(Either::Left(Full::new(Bytes::from(body))));
    *r.status_mut() = StatusCode::from_u16(err.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let h = r.headers_mut();
    h.insert("content-type", HeaderValue::from_static("application/json"));
    h.insert("x-request-id", HeaderValue::from_str(rid).unwrap_or(HeaderValue::from_static("-")));
    h.insert("cache-control", HeaderValue::from_static("no-store"));
    h.insert("x-content-type-options", HeaderValue::from_static("nosniff"));
    r
}

#[cfg(test)]
mod tests {
    use super::header_timeout;
    use std::time::Duration;

    #[test]
    fn the_header_timeout_is_qag_header_timeout_or_ten_seconds() {
        assert_eq!(header_timeout(None), Duration::from_secs(10));
        assert_eq!(header_timeout(Some("1.5")), Duration::from_millis(1500));
        assert_eq!(header_timeout(Some("0")), Duration::from_secs(10));
        assert_eq!(header_timeout(Some("nan")), Duration::from_secs(10));
    }
}
