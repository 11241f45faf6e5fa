//! The request path of `GET /q/<name>`, top to bottom, for the calls the plane can answer exactly as
//! qag/http/data.py's `DataResource.serve` would: authenticate (key entry) → plan (plan entry, connection
//! entry) → bind (options, parameters) → execute → govern (masking) → render → record, each stage timed
//! into `Server-Timing`. Each early return says why the call goes to Python instead (`Decision::Forward`).

use super::cached;
use super::execute::{execute_mysql, execute_pg, Exec};
use super::record::Run;
use super::write::{serve_write, Db, WriteCall};
use super::{error_response, now_us, request_id, single_header, Body, Shared};
use crate::entries::{ConnEntry, KeyEntry, PlanEntry, PlanLookup};
use crate::error::{ApiError, Outcome, UNAUTHORIZED};
use crate::mask::{self, Action};
use crate::mysql;
use crate::options::{self, Format};
use crate::params;
use crate::render;
use bytes::Bytes;
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::header::HeaderValue;
use hyper::{Request, Response};
use sha2::{Digest, Sha256};
use std::cell::RefCell;
use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Instant;

thread_local! {
    /// Each connection's password (file `<home>/plane/conn-<name>.secret`) for the generation it was read at.
    static PASSWORDS: RefCell<HashMap<String, (u64, Option<String>)>> = RefCell::new(HashMap::new());
}

/// What the plane decided for a request it looked at.
pub(super) enum Decision {
    Answer(Response<Body>),
    Forward(&'static str),
}

fn is_query_name(n: &str) -> bool {
    !n.is_empty() && n.len() <= 200 && n.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
}

fn password_for(home: &str, conn: &ConnEntry) -> Option<Option<String>> {
    PASSWORDS.with(|p| {
        if let Some((gen, v)) = p.borrow().get(&conn.name) {
            if *gen == conn.gen {
                return Some(v.clone());
            }
        }
        let path = format!("{home}/plane/conn-{}.secret", conn.name);
        let v = match std::fs::read(&path) {
            Ok(b) => Some(String::from_utf8(b).ok()?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(_) => return None,
        };
        p.borrow_mut().insert(conn.name.clone(), (conn.gen, v.clone()));
        Some(v)
    })
}

fn is_loopback_host(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost") || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

pub(super) fn stage(stages: &mut Vec<(&'static str, f64)>, name: &'static str, since: Instant) -> Instant {
    let now = Instant::now();
    stages.push((name, (now - since).as_secs_f64()));
    now
}

/// qag/http/data.py DataResource.serve for the calls the plane can answer exactly as Python would.
pub(super) async fn serve_query(sh: &Shared, req: &Request<Incoming>, peer: Option<IpAddr>) -> Decision {
    let path = req.uri().path();
    let name = &path[3..];
    if !is_query_name(name) {
        return Decision::Forward("query name");
    }
    if req.headers().contains_key("origin") {
        // CORS (QAG_CORS_ORIGINS) is Python's: it decides which origins get Access-Control-Allow-Origin.
        return Decision::Forward("browser call (Origin)");
    }
    let Some(secret) = single_header(req, "x-api-key") else { return Decision::Forward("no single X-API-Key") };
    if secret.is_empty() || sh.admin_key.as_deref() == Some(secret) {
        return Decision::Forward("administrator");
    }
    let Some(given) = options::parse_query(req.uri().query().unwrap_or("")) else { return Decision::Forward("query string") };
    let t0 = Instant::now();
    let mut stages = Vec::with_capacity(6);
    let hash = crate::pyfmt::hex(&Sha256::digest(secret.as_bytes()));
    let Some(key) = KeyEntry::load(&sh.seg, &hash) else { return Decision::Forward("no current key entry") };
    if key.rate_limited {
        return Decision::Forward("rate-limited key");
    }
    let rid = request_id(req);
    let mut run = Run {
        at_us: now_us(),
        key_name: None,
        query: name.to_string(),
        version: None,
        connection: None,
        status: 200,
        code: None,
        rows: 0,
        bytes: 0,
        request_id: rid.clone(),
        error: None,
    };
    let Some(allowed) = key.allows(now_us(), peer) else { return Decision::Forward("allowed_ips needs Python") };
    if !allowed {
        let err = ApiError::new(401, "unauthorized", UNAUTHORIZED);
        run.status = 401;
        run.code = Some("unauthorized");
        sh.finish(run, t0, None, None).await;
        return Decision::Answer(error_response(&err, &rid));
    }
    let plan = match PlanEntry::load(&sh.seg, &key.name, name) {
        PlanLookup::Hit(p) => p,
        _ => return Decision::Forward("no current plan entry"),
    };
    if plan.published_version != Some(plan.version) {
        return Decision::Forward("plan entry not of the published version");
    }
    let dialect = match plan.dialect.as_str() {
        "postgres" => Dialect::Postgres,
        "mysql" => Dialect::Mysql,
        _ => return Decision::Forward("dialect"),
    };
    // a write: served when its entry carries governance's yes (LAYOUT.md [Plan entry] P3) and it has no masking
    // (a write without a result set has nothing to mask; one with RETURNING is forwarded by write.rs)
    if plan.is_write && (!plan.write_allowed || plan.transforms.is_some() || !super::write::servable(&plan, dialect == Dialect::Mysql)) {
        return Decision::Forward("write the plan entry does not let the plane serve");
    }
    // a read of a query with cache_ttl: answered from the response cache (cached.rs) when its entry carries the
    // key's prefix (entries 1.2); a write is never cached (data.py from_cache), and one with cache_ttl is Python's
    if (!plan.is_write && plan.paged_sql(1, 1).is_none()) || (plan.cache_ttl && (plan.is_write || plan.response_prefix.is_none()))
        || (plan.transforms.is_some() && !plan.names_published)
    {
        return Decision::Forward("plan not servable (dialect, paging, cache_ttl without a prefix)");
    }
    if plan.transforms.as_ref().is_some_and(|t| t.contains(&Action::Hash)) && sh.mask_key.is_none() {
        return Decision::Forward("hash without a mask key");
    }
    let Some(conn) = ConnEntry::load(&sh.seg, &plan.connection) else { return Decision::Forward("no current connection entry") };
    match dialect {
        Dialect::Postgres if conn.db != "postgres" || conn.options.contains_key("sslmode") => {
            return Decision::Forward("connection not plain postgres");
        }
        // libpq's default sslmode is `prefer` (TLS when the server offers it) and mysql-connector likewise uses TLS
        // when offered; the plane's sessions are plain TCP, so it reads only databases on this host (a remote one
        // stays Python's, encrypted as Python's driver negotiates it)
        Dialect::Postgres if !is_loopback_host(&conn.host) => return Decision::Forward("postgres beyond this host"),
        Dialect::Mysql if conn.db != "mysql" => return Decision::Forward("connection not mysql"),
        Dialect::Mysql if !is_loopback_host(&conn.host) => return Decision::Forward("mysql beyond this host"),
        _ => {}
    }
    let Some(password) = password_for(&sh.home, &conn) else { return Decision::Forward("connection password unreadable") };
    let password = password.filter(|p| !p.is_empty());
    run.key_name = Some(key.name.clone());
    let fail = |mut run: Run, err: ApiError, plan_hit: Option<bool>, q: Option<f64>| async move {
        run.status = err.status;
        run.code = Some(err.code);
        let rid = run.request_id.clone();
        sh.finish(run, t0, q, plan_hit).await;
        Decision::Answer(error_response(&err, &rid))
    };
    let opts = match options::call_options(&given, plan.default_page_size, plan.max_page_size) {
        Ok(o) => o,
        Err(Outcome::Forward(_)) => return Decision::Forward("options need Python"),
        Err(Outcome::Error(e)) => return fail(run, e, None, None).await,
    };
    let t = stage(&mut stages, "auth", t0);
    run.version = Some(plan.version);
    run.connection = Some(plan.connection.clone());
    let t = stage(&mut stages, "plan", t);
    let values = match params::bind(&plan.specs, &given) {
        Ok(v) => v,
        Err(Outcome::Forward(_)) => return Decision::Forward("parameters need Python"),
        Err(Outcome::Error(e)) => return fail(run, e, Some(true), None).await,
    };
    let mut bound = Vec::with_capacity(plan.arg_names.len());
    for n in &plan.arg_names {
        match values.iter().find(|(k, _)| k == n) {
            Some((_, v)) => bound.push(v.clone()),
            None => return Decision::Forward("argument unbound"),
        }
    }
    let t = stage(&mut stages, "bind", t);
    if plan.cache_ttl && !plan.is_write {
        // data.py from_cache: a fresh cached answer, without the database; else Python's (it fills the cache)
        return match cached::lookup(sh, &plan, &opts, &bound) {
            Ok(rec) => cached::answer(sh, req, rec, &opts, name, run, t0).await,
            Err(why) => Decision::Forward(why),
        };
    }
    // MySQL: mysql-connector sends a float as its repr, a literal in the statement text (DECIMAL, or DOUBLE
    // with an exponent); no bound type is read the same way, so the plane puts the same literal there
    let with_literals = match dialect {
        Dialect::Mysql if bound.iter().any(|v| matches!(v, params::PVal::Float(_))) => {
            let Some(x) = mysql::with_float_literals(plan.sql_pieces.as_deref(), &bound) else {
                return Decision::Forward("float parameter without the statement's pieces");
            };
            Some(x)
        }
        _ => None,
    };
    let base = with_literals.as_ref().map_or(plan.sql_native.as_str(), |(sql, _)| sql.as_str());
    if plan.is_write {
        let w = WriteCall {
            plan: &plan,
            conn,
            password,
            db: if dialect == Dialect::Postgres { Db::Postgres } else { Db::Mysql },
            sql: base,
            args: with_literals.as_ref().map_or(bound.as_slice(), |(_, rest)| rest.as_slice()),
            all_args: &bound,
            format: opts.format,
            name,
        };
        return serve_write(sh, w, run, t0, stages, t).await;
    }
    let Some(sql) = plan.paged(base, opts.page, opts.page_size) else { return Decision::Forward("paging mode") };
    let executed = match dialect {
        Dialect::Postgres => {
            let expect = usize::try_from(opts.page_size).unwrap_or(0).saturating_add(1); // a page and one row past it
            execute_pg(&plan, conn, password, &sql, &bound, opts.format, expect).await
        }
        Dialect::Mysql => match with_literals {
            Some((_, rest)) => execute_mysql(&plan, conn, password, &sql, &rest, true).await,
            None => execute_mysql(&plan, conn, password, &sql, &bound, false).await,
        },
    };
    let t1 = stage(&mut stages, "execute", t);
    let query_seconds = (t1 - t).as_secs_f64();
    let page = match executed {
        Ok(x) => x,
        Err(Exec::Forward(why)) => return Decision::Forward(why),
        Err(Exec::Fail(e)) => return fail(run, e, Some(true), None).await,
    };
    if !plan.names_match(&page.columns) || plan.transforms.as_ref().is_some_and(|t| t.len() != page.width()) {
        return Decision::Forward("masked names differ");
    }
    if opts.format == Format::Csv && page.cells.iter().any(|c| matches!(c, render::Cell::Json(_))) {
        return Decision::Forward("CSV of a JSON value");
    }
    let mut page = match &plan.transforms {
        None => page,
        // a shape pinned with nothing masked (a rule covers a table read, no output column): checked above, as is
        Some(acts) if acts.iter().all(|a| *a == Action::Keep) => page,
        Some(acts) => match mask::apply(acts, sh.mask_key.as_deref().unwrap_or(b""), page) {
            Some(x) => x,
            None => return Decision::Forward("masking width"),
        },
    };
    let t = stage(&mut stages, "govern", t1);
    let has_more = page.rows as i64 > opts.page_size;
    if has_more {
        page.truncate(opts.page_size as usize);
    }
    let body = match opts.format {
        Format::Json => render::render_json(&page),
        Format::Ndjson => render::render_ndjson(&page),
        Format::Csv => match render::render_csv(&page) {
            Some(b) => b,
            None => return Decision::Forward("CSV of a JSON value"),
        },
    };
    stage(&mut stages, "render", t);
    run.rows = page.rows as i64;
    run.bytes = body.len() as i64;
    let timing = stages.iter().map(|(n, d)| format!("{n};dur={:.3}", d * 1000.0)).collect::<Vec<_>>().join(", ");
    let nrows = page.rows;
    sh.finish(run, t0, Some(query_seconds), Some(true)).await;
    let mut r = Response::new(Either::Left(Full::new(Bytes::from(body))));
    let h = r.headers_mut();
    h.insert("content-type", HeaderValue::from_static(opts.format.content_type()));
    let num = |v: i64| HeaderValue::from_str(&v.to_string()).expect("digits");
    h.insert("x-page", num(opts.page));
    h.insert("x-page-size", num(opts.page_size));
    h.insert("x-row-count", num(nrows as i64));
    h.insert("x-has-more", HeaderValue::from_static(if has_more { "true" } else { "false" }));
    // as Python's answers (qag/http/app.py RequestIdMiddleware): never sniffed, never stored (a cache_ttl query's
    // answers are cached.rs's)
    h.insert("cache-control", HeaderValue::from_static("no-store"));
    h.insert("x-content-type-options", HeaderValue::from_static("nosniff"));
    if opts.format == Format::Csv {
        if let Ok(v) = HeaderValue::from_str(&csv_disposition(name)) {
            h.insert("content-disposition", v);
        }
    }
    if let Ok(v) = HeaderValue::from_str(&timing) {
        h.insert("server-timing", v);
    }
    h.insert("x-request-id", HeaderValue::from_str(&rid).unwrap_or(HeaderValue::from_static("-")));
    Decision::Answer(r)
}

/// Python's formats.disposition(): a CSV answer is a download, named for its query.
pub(super) fn csv_disposition(name: &str) -> String {
    let mut safe: String = name.chars().map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c } else { '_' }).collect();
    if safe.is_empty() {
        safe.push_str("result");
    }
    format!("attachment; filename=\"{safe}.csv\"")
}

#[derive(Clone, Copy, PartialEq)]
enum Dialect {
    Postgres,
    Mysql,
}
