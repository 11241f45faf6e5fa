//! A call of a saved query with `cache_ttl`, answered from the host's response cache (shm/LAYOUT.md
//! [Response cache]) as qag/http/data.py's `from_cache` + `answer` answer a hit: after authenticating,
//! planning and binding exactly as for any read, the key is the plan entry's `response_prefix` (R5, which
//! carries the caller's masking fingerprint: a masked key never finds an unmasked answer) + the call's
//! suffix; a fresh record (R9, R10) is the answer (R15), recorded as any call (rows, body bytes; 0 for a 304).
//! A miss, an expired record, or an argument without an encoding is forwarded: Python claims the key, runs
//! the statement and fills the cache (R13); the plane never writes a record.

use super::record::Run;
use super::serve::{csv_disposition, Decision};
use super::{single_header, Shared};
use crate::entries::PlanEntry;
use crate::options::{CallOptions, Format};
use crate::params::PVal;
use crate::responses::{self, Record};
use bytes::Bytes;
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::header::HeaderValue;
use hyper::{Request, Response, StatusCode};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// qag/http/data.py NOT_CURRENT: generations this high are the change watcher's "behind" values; Python never
/// caches under them.
const NOT_CURRENT: u64 = 1 << 62;

fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// data.py `conditional`: If-None-Match is `*` or lists the ETag (`W/` prefixes ignored). None: a header the
/// plane does not judge (several of them, not text): forwarded.
fn not_modified(req: &Request<Incoming>, etag: &str) -> Option<bool> {
    let all = req.headers().get_all("if-none-match");
    if all.iter().count() == 0 {
        return Some(false);
    }
    let inm = single_header(req, "if-none-match")?;
    Some(inm.trim() == "*" || inm.split(',').any(|t| {
        let t = t.trim();
        t.strip_prefix("W/").unwrap_or(t) == etag
    }))
}

/// The fresh record of this call, or why the call goes to Python.
pub(super) fn lookup(sh: &Shared, plan: &PlanEntry, opts: &CallOptions, bound: &[PVal]) -> Result<Record, &'static str> {
    let Some(prefix) = plan.response_prefix.as_deref() else { return Err("cache_ttl without a response prefix") };
    if plan.gens[1] >= NOT_CURRENT || plan.gens[2] >= NOT_CURRENT {
        return Err("response cache: generations not current");
    }
    let Some(rc) = sh.seg.responses() else { return Err("no response cache") };
    let Some(suffix) = responses::suffix(opts.format.name(), opts.page, opts.page_size, bound) else {
        return Err("response cache: an argument without an encoding");
    };
    let key = [prefix, &suffix].concat();
    let Some(rec) = rc.get(&key, responses::key_hash(&key)) else { return Err("response cache miss") };
    if !rec.fresh(now_ns()) {
        return Err("response cache: expired"); // Python serves or refills it (R10, R13)
    }
    rc.hit(&rec); // R16, as data.py's answer() does
    Ok(rec)
}

/// data.py `answer` (R15): the record's body, its paging headers, ETag, Cache-Control, X-Cache: hit, the CSV
/// download's name; 304 without a body when If-None-Match names the ETag. Then the middleware's headers.
pub(super) async fn answer(sh: &Shared, req: &Request<Incoming>, rec: Record, opts: &CallOptions, name: &str, mut run: Run,
                           t0: Instant) -> Decision {
    let etag = rec.etag_header();
    let Some(unchanged) = not_modified(req, &etag) else { return Decision::Forward("If-None-Match the plane does not judge") };
    let status = if unchanged { 304 } else { 200 };
    run.status = status;
    run.rows = i64::from(rec.rows);
    run.bytes = if unchanged { 0 } else { rec.body.len() as i64 };
    let rid = run.request_id.clone();
    sh.count_response_cache("hit");
    sh.finish(run, t0, None, Some(true)).await;
    let body = if unchanged { Bytes::new() } else { Bytes::from(rec.body) };
    let mut r = Response::new(Either::Left(Full::new(body)));
    if unchanged {
        *r.status_mut() = StatusCode::NOT_MODIFIED;
    }
    let h = r.headers_mut();
    let num = |v: i64| HeaderValue::from_str(&v.to_string()).expect("digits");
    h.insert("x-page", num(opts.page));
    h.insert("x-page-size", num(opts.page_size));
    h.insert("x-row-count", num(i64::from(rec.rows)));
    h.insert("x-has-more", HeaderValue::from_static(if rec.has_more { "true" } else { "false" }));
    h.insert("etag", HeaderValue::from_str(&etag).expect("hex digits"));
    h.insert("cache-control", HeaderValue::from_str(&format!("private, max-age={}", rec.ttl_s)).expect("digits"));
    h.insert("x-cache", HeaderValue::from_static("hit"));
    if opts.format == Format::Csv {
        if let Ok(v) = HeaderValue::from_str(&csv_disposition(name)) {
            h.insert("content-disposition", v);
        }
    }
    h.insert("content-type", HeaderValue::from_static(opts.format.content_type()));
    h.insert("x-content-type-options", HeaderValue::from_static("nosniff"));
    h.insert("x-request-id", HeaderValue::from_str(&rid).unwrap_or(HeaderValue::from_static("-")));
    Decision::Answer(r)
}
