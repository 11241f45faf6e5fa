//! The database call of a served request: a session leased from the thread's pool, the statement prepared
//! and checked against what the plane can render, executed under the client-side deadline, and retried
//! once on a fresh session when a pooled one turns out stale. Failures become an answer (`Exec::Fail`:
//! 504 `query_timeout`) or a forward (`Exec::Forward`: a statement the database rejects, connection trouble).

use crate::entries::{ConnEntry, PlanEntry};
use crate::error::{timeout_error, ApiError, ExecError};
use crate::mysql;
use crate::options::Format;
use crate::params::PVal;
use crate::pg;
use crate::pool::Lease;
use crate::render::Page;
use std::rc::Rc;

/// How executing went when it did not give rows: forward to Python, or answer this error.
pub(super) enum Exec {
    Forward(&'static str),
    Fail(ApiError),
}

/// The page a read gave: its column names and cells.
pub(super) type Rows = Page;

fn exec_error(e: ExecError, plan: &PlanEntry) -> Exec {
    match e {
        ExecError::Timeout => Exec::Fail(timeout_error(plan.query_timeout)),
        // A statement the database rejects is Python's to answer: the same 500 query_failed to the caller, and
        // a run that keeps the database's words for administrators (LAYOUT.md [Run record] RR5), which the
        // plane does not carry. A rejected read changed nothing, so running it again there is safe.
        ExecError::Rejected => Exec::Forward("the database rejected the statement"),
        ExecError::Stale => Exec::Forward("connection lost"),
        ExecError::Forward(why) => Exec::Forward(why),
    }
}

/// Run one execution under the call's client-side deadline (the statement limit plus a margin,
/// `limits::deadline`): when the database stops answering (frozen, a dead host), the call is answered
/// 504 `query_timeout` as Python answers a statement over its limit, and the session it held is
/// discarded (a lease dropped mid-exchange never goes back to its pool).
async fn with_deadline(plan: &PlanEntry, fut: impl std::future::Future<Output = Result<Rows, Exec>>) -> Result<Rows, Exec> {
    match tokio::time::timeout(crate::limits::deadline(plan.query_timeout), fut).await {
        Ok(r) => r,
        Err(_) => Err(Exec::Fail(timeout_error(plan.query_timeout))),
    }
}

/// PostgreSQL: everything that could make the answer differ from Python's is decided from the prepared
/// statement before executing. A pooled session found stale (the server restarted, the session was
/// terminated) is dropped with every idle one, and the read is tried once more on a fresh session.
pub(super) async fn execute_pg(plan: &PlanEntry, conn: Rc<ConnEntry>, password: Option<String>, sql: &str, bound: &[PVal],
                    format: Format, expect: usize) -> Result<Rows, Exec> {
    let spec = pg::SessionSpec { conn, password, timeout_ms: crate::limits::millis(plan.query_timeout), write: false };
    let pool = pg::pool_for(&spec);
    with_deadline(plan, async {
        for attempt in 0..2 {
            let Ok(mut lease) = Lease::get(pool.clone()).await else { return Err(Exec::Forward("cannot connect")) };
            match execute_pg_once(plan, &mut lease, sql, bound, format, expect).await {
                Err(ExecError::Stale) if attempt == 0 && lease.reused => {
                    drop(lease);
                    pool.borrow_mut().purge_idle();
                }
                Ok(x) => return Ok(x),
                Err(e) => return Err(exec_error(e, plan)),
            }
        }
        Err(Exec::Forward("connection lost twice"))
    })
    .await
}

async fn execute_pg_once(plan: &PlanEntry, lease: &mut Lease<pg::Session>, sql: &str, bound: &[PVal], format: Format,
                         expect: usize) -> Result<Rows, ExecError> {
    let typed: Vec<tokio_postgres::types::Type> = plan.arg_names.iter()
        .map(|n| plan.specs.iter().find(|s| s.name == *n).map_or(tokio_postgres::types::Type::TEXT, |s| pg::literal_type(s.ty)))
        .collect();
    let st = lease.prepare(sql, &typed).await?;
    let tz_utc = lease.tz_utc();
    if st.columns().iter().any(|c| !pg::column_supported(c.type_(), tz_utc))
        || (format == Format::Csv && st.columns().iter().any(|c| pg::is_json(c.type_())))
        || plan.transforms.as_ref().is_some_and(|t| t.len() != st.columns().len())
        || st.params().len() != bound.len()
    {
        return Err(ExecError::Forward("result shape or types"));
    }
    let mut args = Vec::with_capacity(bound.len());
    for (ty, v) in st.params().iter().zip(bound) {
        args.push(pg::arg_for(ty, v).ok_or(ExecError::Forward("parameter type"))?);
    }
    let columns: Vec<String> = st.columns().iter().map(|c| c.name().to_string()).collect();
    if !plan.names_match(&columns) {
        return Err(ExecError::Forward("masked names differ"));
    }
    lease.query(&st, &args, plan.state_free, expect).await
}

/// MySQL/MariaDB: the prepared statement's metadata rules out what the plane cannot render before
/// executing; the result's own columns decide again (a read executed twice costs time, never a wrong answer).
/// `one_off`: the statement holds literals (a float): closed after use, so that it never crowds the
/// session's cache of the saved queries' statements. A stale pooled session: as for PostgreSQL.
pub(super) async fn execute_mysql(plan: &PlanEntry, conn: Rc<ConnEntry>, password: Option<String>, sql: &str,
                       bound: &[PVal], one_off: bool) -> Result<Rows, Exec> {
    let mut args = Vec::with_capacity(bound.len());
    for v in bound {
        args.push(mysql::arg_for(v).ok_or(Exec::Forward("parameter type"))?);
    }
    let spec = mysql::SessionSpec { conn, password, timeout: plan.query_timeout, write: false };
    let pool = mysql::pool_for(&spec);
    with_deadline(plan, async {
        for attempt in 0..2 {
            let Ok(mut lease) = Lease::get(pool.clone()).await else { return Err(Exec::Forward("cannot connect")) };
            match execute_mysql_once(plan, &mut lease, sql, args.clone(), one_off).await {
                Err(ExecError::Stale) if attempt == 0 && lease.reused => {
                    drop(lease);
                    pool.borrow_mut().purge_idle();
                }
                Ok(x) => return Ok(x),
                Err(e) => return Err(exec_error(e, plan)),
            }
        }
        Err(Exec::Forward("connection lost twice"))
    })
    .await
}

async fn execute_mysql_once(plan: &PlanEntry, lease: &mut Lease<mysql::Session>, sql: &str, args: Vec<mysql_async::Value>,
                            one_off: bool) -> Result<Rows, ExecError> {
    let st = lease.prepare(sql).await?;
    if st.num_params() as usize != args.len()
        || !st.columns().iter().all(mysql::column_supported)
        || plan.transforms.as_ref().is_some_and(|t| t.len() != st.columns().len())
    {
        return Err(ExecError::Forward("result shape or types"));
    }
    let result = lease.query(&st, args).await;
    if one_off {
        lease.close(st).await;
    }
    if !plan.state_free {
        // connectors.py S5: a session that ran a statement not proven state-free (a user variable, GET_LOCK,
        // a function off the short list) serves nobody else; Python resets it, the plane closes it
        lease.retire();
    }
    result
}
