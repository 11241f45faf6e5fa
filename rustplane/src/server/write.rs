//! Writes served by the plane (issue 19 part 3): a saved query that writes, called by a key whose plan entry
//! carries governance's yes (LAYOUT.md [Plan entry] P3: the server's `QAG_ALLOW_WRITES`, the key's
//! `allow_writes`, every write operation within its `allowed_write_ops`), executed in its own transaction on a
//! write session (`pg::Lease::write`, `mysql::Lease::write`), committed, and answered as qag/http/data.py's
//! `render` answers a write: `{"affected_rows": N}` in JSON (an empty body in the other formats) and
//! `X-Affected-Rows`. A refusal never reaches here: governance refused the plan, so no entry was published (E3)
//! and Python answers the call.
//!
//! Everything that could make the answer differ from Python's is decided before the statement runs (a write
//! that returns rows, a parameter the plane does not bind alike: forwarded while nothing has run), because once
//! it ran the plane must answer it: a write is never run twice. In particular a statement the database
//! rejects is answered here (500 `query_failed`, the contract's sentence) with the database's words in the run
//! (RR5) as Python records them, not forwarded as a rejected read is: the transaction was rolled back, but what
//! a failed statement did outside it stays — a sequence's `nextval` (PostgreSQL never rolls it back), rows of a
//! non-transactional MySQL table (MyISAM, Aria, MEMORY keep what a statement changed before it failed), the side
//! effects of a function an administrator allowed (`allow_unsafe`) — and Python running it again would do
//! them twice. A session lost while the write was on its way is 502 `connection_failed`, as Python answers it
//! (connectors.py S6: writes are not retried); the client-side deadline is 504 `query_timeout` (S4).

use super::record::Run;
use super::serve::{stage, Decision};
use super::{error_response, Body, Shared};
use crate::entries::{ConnEntry, PlanEntry};
use crate::error::{timeout_error, ApiError, WriteError};
use crate::options::Format;
use crate::params::PVal;
use crate::pool::Lease;
use crate::pyfmt::float_repr;
use crate::{mysql, pg};
use bytes::Bytes;
use http_body_util::{Either, Full};
use hyper::header::HeaderValue;
use hyper::Response;
use std::rc::Rc;
use std::time::Instant;

/// The write operations the plane serves: plain DML, whose statements answer an affected-row count and nothing
/// else. Anything else a key may be granted (create, set, transaction, a procedure's call...) stays Python's.
const SERVED_OPS: [&str; 4] = ["insert", "update", "delete", "replace"];

/// Whether the plane may run this write at all, decided from the plan before anything is prepared: plain DML
/// only, and on MySQL/MariaDB no `RETURNING` anywhere in the text (MariaDB's DELETE/INSERT ... RETURNING
/// prepares as if it returned no columns, then sends rows: the prepared metadata cannot be trusted for it;
/// the word in a literal or a comment only costs a forward).
pub(super) fn servable(plan: &PlanEntry, mysql: bool) -> bool {
    !plan.write_ops.is_empty()
        && plan.write_ops.iter().all(|o| SERVED_OPS.contains(&o.as_str()))
        && !(mysql && plan.sql_native.to_ascii_lowercase().contains("returning"))
}

/// qag/errors.py QueryFailed's sentence (a scoped key never reads the database's words).
const QUERY_FAILED: &str = "The database rejected the statement; an administrator can see why in the run history.";

/// qag/errors.py Unreachable.SENTENCE.
fn unreachable(conn: &str) -> ApiError {
    ApiError::new(502, "connection_failed",
                  format!("Could not reach the database of connection '{conn}'; check that it is running and reachable, then retry."))
}

/// How a write that did not commit is answered: forwarded (nothing ran), or this error with the run's `error`.
enum Fail {
    Forward(&'static str),
    Answer(ApiError, Option<String>),
}

/// Which database the write runs on (the plan's dialect, checked against the connection by `serve_query`).
pub(super) enum Db {
    Postgres,
    Mysql,
}

/// What `serve_query` hands over once the call is authenticated, planned and bound.
pub(super) struct WriteCall<'a> {
    pub(super) plan: &'a PlanEntry,
    pub(super) conn: Rc<ConnEntry>,
    pub(super) password: Option<String>,
    pub(super) db: Db,
    /// The statement to run: the native SQL, or (MySQL) with its floats put in as literals.
    pub(super) sql: &'a str,
    /// The values bound to its markers.
    pub(super) args: &'a [PVal],
    /// Every parameter value of the call in argument order (Plan.bind_args), for the run's `error` (RR5).
    pub(super) all_args: &'a [PVal],
    pub(super) format: Format,
    pub(super) name: &'a str,
}

/// Execute, commit, answer and record one write (the tail of `serve_query` for a write).
pub(super) async fn serve_write(sh: &Shared, w: WriteCall<'_>, mut run: Run, t0: Instant,
                                mut stages: Vec<(&'static str, f64)>, t: Instant) -> Decision {
    let password = w.password.clone();
    let executed = match tokio::time::timeout(crate::limits::deadline(w.plan.query_timeout), execute(&w)).await {
        Ok(r) => r,
        // the database stopped answering (frozen, a dead host): Python's watchdog answers the same 504, and the
        // session held is discarded (a lease dropped mid-exchange never goes back to its pool)
        Err(_) => Err(Fail::Answer(timeout_error(w.plan.query_timeout), None)),
    };
    let t1 = stage(&mut stages, "execute", t);
    let count = match executed {
        Ok(n) => n,
        Err(Fail::Forward(why)) => return Decision::Forward(why),
        Err(Fail::Answer(err, text)) => {
            run.status = err.status;
            run.code = Some(err.code);
            run.error = text.and_then(|t| run_error(&hide(&t, password.as_deref()), w.all_args));
            let rid = run.request_id.clone();
            sh.finish(run, t0, None, Some(true)).await;
            return Decision::Answer(error_response(&err, &rid));
        }
    };
    let query_seconds = (t1 - t).as_secs_f64();
    let t = stage(&mut stages, "govern", t1);
    // data.py render(): json.dumps({"affected_rows": n}) in JSON, nothing in the other formats
    let body = match w.format {
        Format::Json => format!("{{\"affected_rows\": {count}}}").into_bytes(),
        _ => Vec::new(),
    };
    stage(&mut stages, "render", t);
    run.bytes = body.len() as i64;
    let rid = run.request_id.clone();
    sh.finish(run, t0, Some(query_seconds), Some(true)).await;
    Decision::Answer(answer(body, count, w.format, w.name, &stages, &rid))
}

/// A write's answer with Python's headers (data.py render() and the middleware's).
fn answer(body: Vec<u8>, count: u64, format: Format, name: &str, stages: &[(&'static str, f64)], rid: &str) -> Response<Body> {
    let mut r = Response::new(Either::Left(Full::new(Bytes::from(body))));
    let h = r.headers_mut();
    h.insert("content-type", HeaderValue::from_static(format.content_type()));
    h.insert("x-affected-rows", HeaderValue::from_str(&count.to_string()).expect("digits"));
    h.insert("cache-control", HeaderValue::from_static("no-store"));
    h.insert("x-content-type-options", HeaderValue::from_static("nosniff"));
    if format == Format::Csv {
        if let Ok(v) = HeaderValue::from_str(&super::serve::csv_disposition(name)) {
            h.insert("content-disposition", v);
        }
    }
    let timing = stages.iter().map(|(n, d)| format!("{n};dur={:.3}", d * 1000.0)).collect::<Vec<_>>().join(", ");
    if let Ok(v) = HeaderValue::from_str(&timing) {
        h.insert("server-timing", v);
    }
    h.insert("x-request-id", HeaderValue::from_str(rid).unwrap_or(HeaderValue::from_static("-")));
    r
}

/// WriteError as the call is answered (see the module's text for why nothing that ran is forwarded).
fn fail_of(e: WriteError, plan: &PlanEntry, conn: &str) -> Fail {
    match e {
        WriteError::NotRun(why) => Fail::Forward(why),
        WriteError::Stale => Fail::Forward("connection lost before the write"),
        WriteError::Rejected(text) => Fail::Answer(ApiError::new(500, "query_failed", QUERY_FAILED), Some(text)),
        WriteError::Timeout => Fail::Answer(timeout_error(plan.query_timeout), None),
        WriteError::Lost(text) => Fail::Answer(unreachable(conn), Some(text)),
        WriteError::RowsAfterAll => {
            crate::plog!("error", "a write on connection {conn} sent rows the plane did not expect (its statement ran)");
            Fail::Answer(ApiError::new(500, "internal_error",
                                       "The write ran, but the data plane could not read its answer; check the data before retrying."), None)
        }
    }
}

async fn execute(w: &WriteCall<'_>) -> Result<u64, Fail> {
    match w.db {
        Db::Postgres => write_pg(w).await,
        Db::Mysql => write_mysql(w).await,
    }
}

/// PostgreSQL: prepared (nothing runs), checked (no result set, the parameters bound as psycopg2's literals
/// would be), then `pg::Lease::write`. A pooled session found stale at prepare is dropped with the idle ones and
/// the write prepared once more on a fresh session: nothing had run.
async fn write_pg(w: &WriteCall<'_>) -> Result<u64, Fail> {
    let plan = w.plan;
    let spec = pg::SessionSpec { conn: w.conn.clone(), password: w.password.clone(),
                                 timeout_ms: crate::limits::millis(plan.query_timeout), write: true };
    let pool = pg::pool_for(&spec);
    let typed: Vec<tokio_postgres::types::Type> = plan.arg_names.iter()
        .map(|n| plan.specs.iter().find(|s| s.name == *n).map_or(tokio_postgres::types::Type::TEXT, |s| pg::literal_type(s.ty)))
        .collect();
    for attempt in 0..2 {
        let Ok(mut lease) = Lease::get(pool.clone()).await else { return Err(Fail::Forward("cannot connect")) };
        let st = match lease.prepare_write(w.sql, &typed).await {
            Ok(st) => st,
            Err(WriteError::Stale) if attempt == 0 && lease.reused => {
                drop(lease);
                pool.borrow_mut().purge_idle();
                continue;
            }
            Err(e) => return Err(fail_of(e, plan, &w.conn.name)),
        };
        if !st.columns().is_empty() || st.params().len() != w.args.len() {
            return Err(Fail::Forward("a write that returns rows"));
        }
        let mut args = Vec::with_capacity(w.args.len());
        for (ty, v) in st.params().iter().zip(w.args) {
            args.push(pg::arg_for(ty, v).ok_or(Fail::Forward("parameter type"))?);
        }
        let out = lease.write(&st, &args).await;
        return out.map_err(|e| lost_or(e, plan, w, &pool));
    }
    Err(Fail::Forward("connection lost twice before the write"))
}

/// A session lost mid-write: the idle sessions of its pool were opened before the same event (a restart ends
/// them all, connectors.py S6) and are closed now; then the answer.
fn lost_or<S: crate::pool::Pooled>(e: WriteError, plan: &PlanEntry, w: &WriteCall<'_>,
                                   pool: &Rc<std::cell::RefCell<crate::pool::Pool<S>>>) -> Fail {
    if matches!(e, WriteError::Lost(_)) {
        pool.borrow_mut().purge_idle();
    }
    fail_of(e, plan, &w.conn.name)
}

/// MySQL/MariaDB: as PostgreSQL's (`mysql::Lease::write`).
async fn write_mysql(w: &WriteCall<'_>) -> Result<u64, Fail> {
    let plan = w.plan;
    let mut args = Vec::with_capacity(w.args.len());
    for v in w.args {
        args.push(mysql::arg_for(v).ok_or(Fail::Forward("parameter type"))?);
    }
    let spec = mysql::SessionSpec { conn: w.conn.clone(), password: w.password.clone(), timeout: plan.query_timeout, write: true };
    let pool = mysql::pool_for(&spec);
    for attempt in 0..2 {
        let Ok(mut lease) = Lease::get(pool.clone()).await else { return Err(Fail::Forward("cannot connect")) };
        let st = match lease.prepare_write(w.sql).await {
            Ok(st) => st,
            Err(WriteError::Stale) if attempt == 0 && lease.reused => {
                drop(lease);
                pool.borrow_mut().purge_idle();
                continue;
            }
            Err(e) => return Err(fail_of(e, plan, &w.conn.name)),
        };
        if !st.columns().is_empty() || st.num_params() as usize != args.len() {
            return Err(Fail::Forward("a write that returns rows"));
        }
        let out = lease.write(&st, args).await;
        return out.map_err(|e| lost_or(e, plan, w, &pool));
    }
    Err(Fail::Forward("connection lost twice before the write"))
}

/// connectors.py `_first_line`'s password replacement.
fn hide(text: &str, password: Option<&str>) -> String {
    match password {
        Some(p) if !p.is_empty() => text.replace(p, "********"),
        _ => text.to_string(),
    }
}

/// qag/entries.py `run_error` (LAYOUT.md [Run record] RR5): each parameter value (its Python `str`) replaced by
/// `[value]`, one of 3 characters or fewer only where quoted, the longest first; no NUL; at most 500 characters.
pub(super) fn run_error(text: &str, args: &[PVal]) -> Option<String> {
    if text.is_empty() {
        return None;
    }
    let mut text = text.replace('\0', "");
    let mut values: Vec<String> = args.iter().filter_map(|a| match a {
        PVal::Int(i) => Some(i.to_string()),
        PVal::Float(f) => Some(float_repr(*f)),
        PVal::Str(s) => Some(s.clone()),
        PVal::Bool(_) | PVal::Null => None,
    }).collect();
    values.sort();
    values.dedup();
    values.sort_by_key(|v| std::cmp::Reverse(v.chars().count()));
    for a in values.iter().filter(|a| !a.is_empty()) {
        if a.chars().count() > 3 {
            text = text.replace(a.as_str(), "[value]");
        } else {
            for q in ['"', '\''] {
                text = text.replace(&format!("{q}{a}{q}"), &format!("{q}[value]{q}"));
            }
        }
    }
    Some(text.chars().take(500).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_error_like_entries_run_error() {
        // each case gives what qag.entries.run_error gives for the same text and values
        let args = [PVal::Str("alice@example.com".into()), PVal::Int(7), PVal::Bool(true), PVal::Float(0.5)];
        assert_eq!(run_error("duplicate key: Key (email)=(alice@example.com) already exists", &args).as_deref(),
                   Some("duplicate key: Key (email)=([value]) already exists"));
        assert_eq!(run_error("invalid input \"7\" at line 1", &args).as_deref(), Some("invalid input \"[value]\" at line 1"),
                   "a short value only where quoted: line 1 stays");
        assert_eq!(run_error("x 0.5 y", &args).as_deref(), Some("x 0.5 y"), "0.5 is 3 characters: only quoted");
        assert_eq!(run_error("", &args), None);
        assert_eq!(run_error(&"é".repeat(600), &[]).map(|s| s.chars().count()), Some(500));
        assert_eq!(run_error("a\0b", &[]).as_deref(), Some("ab"));
        assert_eq!(hide("password authentication failed: s3cret", Some("s3cret")), "password authentication failed: ********");
    }
}
