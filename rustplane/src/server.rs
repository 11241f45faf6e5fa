//! HTTP: one current-thread runtime per plane thread (SO_REUSEPORT listeners, pinned), the request path
//! of `GET /q/<name>` mirroring qag/http/app.py's DataResource.serve, and forwarding of everything else to
//! gunicorn over kept-alive HTTP/1.1 connections.

use crate::entries::{ConnEntry, KeyEntry, PlanEntry, PlanLookup};
use crate::mask::{self, Action};
use crate::msgpack::Enc;
use crate::params::{self, ApiError, Format, Outcome};
use crate::mysql;
use crate::pg::{self, ExecError, Lease, SessionSpec};
use crate::render;
use crate::segment::{Segment, KIND_COUNTER, KIND_HISTOGRAM};
use bytes::Bytes;
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};
use std::cell::{Cell as StdCell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub type Body = Either<Full<Bytes>, Incoming>;

pub const ROUTE: &str = "/q/{name}";
pub const UNAUTHORIZED: &str = "Give a valid, active API key in the X-API-Key header.";
pub const QUERY_FAILED: &str = "The database rejected the statement; an administrator can see why in the run history.";

#[derive(Clone, Debug)]
pub enum Upstream {
    Unix(String),
    Tcp(String),
}

impl Upstream {
    pub fn parse(s: &str) -> Upstream {
        match s.strip_prefix("unix:") {
            Some(p) => Upstream::Unix(p.to_string()),
            None => Upstream::Tcp(s.to_string()),
        }
    }
}

/// Counter cells of the plane's slot, by series, and the ring: one writer at a time (N1, R*).
#[derive(Default)]
struct Producer {
    /// (metric, label value) -> first cell; None when the series could not be registered.
    cells: HashMap<&'static str, HashMap<String, Option<u32>>>,
}

pub struct Shared {
    pub seg: Segment,
    pub slot: usize,
    pub upstream: Upstream,
    pub home: String,
    pub mask_key: Option<Vec<u8>>,
    pub admin_key: Option<String>,
    pub record_wait_ms: u64,
    /// QAG_PLANE_DEBUG=1: say on stderr why a data call was forwarded.
    pub debug: bool,
    producer: Mutex<Producer>,
}

impl Shared {
    pub fn new(seg: Segment, slot: usize, upstream: Upstream, home: String, mask_key: Option<Vec<u8>>,
               admin_key: Option<String>, record_wait_ms: u64) -> Shared {
        Shared { seg, slot, upstream, home, mask_key, admin_key, record_wait_ms,
                 debug: std::env::var("QAG_PLANE_DEBUG").is_ok_and(|v| !v.is_empty() && v != "0"), producer: Mutex::new(Producer::default()) }
    }
}

/// One call's run record (qag/runrecord.py field order), written by `record`.
struct Run {
    at_us: i64,
    key_name: Option<String>,
    query: String,
    version: Option<i64>,
    connection: Option<String>,
    status: u16,
    code: Option<&'static str>,
    rows: i64,
    bytes: i64,
    request_id: String,
}

fn now_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as i64).unwrap_or(0)
}

thread_local! {
    static RNG: StdCell<u64> = StdCell::new(seed());
    /// Kept-alive connections to gunicorn with the time each went idle.
    static UPSTREAM: RefCell<Vec<(hyper::client::conn::http1::SendRequest<Incoming>, Instant)>> = const { RefCell::new(Vec::new()) };
    static PASSWORDS: RefCell<HashMap<String, (u64, Option<String>)>> = RefCell::new(HashMap::new());
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

fn request_id(req: &Request<Incoming>) -> String {
    if let Some(v) = single_header(req, "x-request-id") {
        if !v.is_empty() && v.len() <= 64 && v.bytes().all(|b| b.is_ascii_alphanumeric() || b".:_-".contains(&b)) {
            return v.to_string();
        }
    }
    mint_request_id()
}

fn single_header<'a>(req: &'a Request<Incoming>, name: &str) -> Option<&'a str> {
    let mut it = req.headers().get_all(name).iter();
    let v = it.next()?;
    if it.next().is_some() {
        return None;
    }
    v.to_str().ok()
}

impl Shared {
    fn cell(&self, p: &mut Producer, kind: u8, name: &'static str, labels: &[(&str, &str)]) -> Option<u32> {
        // every metric here has at most one label that varies (route is constant)
        let var = labels.iter().rfind(|(k, _)| *k != "route").map_or("", |(_, v)| *v);
        if let Some(c) = p.cells.get(name).and_then(|m| m.get(var)) {
            return *c;
        }
        let c = match self.seg.series_cell(kind, name, labels) {
            Ok(c) => Some(c),
            Err(e) => {
                eprintln!("qag-plane: metric {name} not counted: {e}");
                None
            }
        };
        p.cells.entry(name).or_default().insert(var.to_string(), c);
        c
    }

    /// Observer.request + RingRecorder: count the call in our slot, push the run into our ring.
    async fn finish(&self, run: Run, t0: Instant, query_seconds: Option<f64>, plan_hit: Option<bool>) {
        let duration = t0.elapsed().as_secs_f64();
        let mut e = Enc::default();
        e.array(15);
        e.uint(1);
        e.int(run.at_us);
        e.opt_str(run.key_name.as_deref());
        e.str(&run.query);
        e.opt_int(run.version);
        e.opt_str(run.connection.as_deref());
        e.uint(run.status as u64);
        e.opt_str(run.code);
        e.int(run.rows);
        e.int((duration * 1e6) as i64);
        e.int(run.bytes);
        e.str(&run.request_id);
        e.str("plane");
        e.str("http");
        e.str(ROUTE);
        let payload = e.0;
        let slot = self.slot;
        {
            let mut p = self.producer.lock().unwrap_or_else(|e| e.into_inner());
            let status = run.status.to_string();
            let seg = &self.seg;
            if let Some(c) = self.cell(&mut p, KIND_COUNTER, "qag_requests_total", &[("route", ROUTE), ("status", &status)]) {
                seg.cell_add(slot, c, 1.0);
            }
            if let Some(code) = run.code {
                if let Some(c) = self.cell(&mut p, KIND_COUNTER, "qag_errors_total", &[("code", code)]) {
                    seg.cell_add(slot, c, 1.0);
                }
            }
            if run.rows != 0 {
                if let Some(c) = self.cell(&mut p, KIND_COUNTER, "qag_rows_total", &[]) {
                    seg.cell_add(slot, c, run.rows as f64);
                }
            }
            if let Some(c) = self.cell(&mut p, KIND_HISTOGRAM, "qag_request_duration_seconds", &[("route", ROUTE)]) {
                seg.histogram_observe(slot, c, duration);
            }
            if let Some(q) = query_seconds {
                if let Some(c) = self.cell(&mut p, KIND_HISTOGRAM, "qag_query_duration_seconds", &[]) {
                    seg.histogram_observe(slot, c, q);
                }
            }
            if let Some(hit) = plan_hit {
                if let Some(c) = self.cell(&mut p, KIND_COUNTER, "qag_plan_cache_total", &[("result", if hit { "hit" } else { "miss" })]) {
                    seg.cell_add(slot, c, 1.0);
                }
            }
        }
        let deadline = Instant::now() + Duration::from_millis(self.record_wait_ms);
        let mut pause = Duration::from_micros(100);
        let ok = loop {
            let pushed = {
                let _p = self.producer.lock().unwrap_or_else(|e| e.into_inner());
                self.seg.ring_push(slot, &payload)
            };
            if pushed {
                break true;
            }
            if Instant::now() >= deadline {
                break false;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(2));
        };
        let mut p = self.producer.lock().unwrap_or_else(|e| e.into_inner());
        let name = if ok { "qag_runs_recorded_total" } else { "qag_runs_lost_total" };
        if let Some(c) = self.cell(&mut p, KIND_COUNTER, name, &[]) {
            self.seg.cell_add(slot, c, 1.0);
        }
    }
}

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

/// What the plane decided for a request it looked at.
enum Decision {
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

fn stage(stages: &mut Vec<(&'static str, f64)>, name: &'static str, since: Instant) -> Instant {
    let now = Instant::now();
    stages.push((name, (now - since).as_secs_f64()));
    now
}

/// DataResource.serve for the calls the plane can answer exactly as Python would.
async fn serve_query(sh: &Shared, req: &Request<Incoming>, peer: Option<IpAddr>) -> Decision {
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
    let Some(given) = params::parse_query(req.uri().query().unwrap_or("")) else { return Decision::Forward("query string") };
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
    if plan.is_write || plan.paged_sql(1, 1).is_none() || plan.cache_ttl
        || (plan.transforms.is_some() && !plan.names_published)
    {
        return Decision::Forward("plan not servable (dialect, write, paging)");
    }
    if plan.transforms.as_ref().is_some_and(|t| t.contains(&Action::Hash)) && sh.mask_key.is_none() {
        return Decision::Forward("hash without a mask key");
    }
    let Some(conn) = ConnEntry::load(&sh.seg, &plan.connection) else { return Decision::Forward("no current connection entry") };
    match dialect {
        Dialect::Postgres if conn.db != "postgres" || conn.options.contains_key("sslmode") => {
            return Decision::Forward("connection not plain postgres");
        }
        Dialect::Mysql if conn.db != "mysql" => return Decision::Forward("connection not mysql"),
        // mysql-connector uses TLS when the server offers it; the plane's sessions are plain TCP, so it
        // reads only databases on this host (a remote one stays Python's, encrypted)
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
    let opts = match params::call_options(&given, plan.default_page_size, plan.max_page_size) {
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
    let Some(sql) = plan.paged(base, opts.page, opts.page_size) else { return Decision::Forward("paging mode") };
    let executed = match dialect {
        Dialect::Postgres => execute_pg(&plan, conn, password, &sql, &bound, opts.format).await,
        Dialect::Mysql => match with_literals {
            Some((_, rest)) => execute_mysql(&plan, conn, password, &sql, &rest, true).await,
            None => execute_mysql(&plan, conn, password, &sql, &bound, false).await,
        },
    };
    let t1 = stage(&mut stages, "execute", t);
    let query_seconds = (t1 - t).as_secs_f64();
    let (columns, rows) = match executed {
        Ok(x) => x,
        Err(Exec::Forward(why)) => return Decision::Forward(why),
        Err(Exec::Fail(e)) => return fail(run, e, Some(true), None).await,
    };
    if !plan.names_match(&columns) || plan.transforms.as_ref().is_some_and(|t| t.len() != columns.len()) {
        return Decision::Forward("masked names differ");
    }
    if opts.format == Format::Csv && rows.iter().any(|r| r.iter().any(|c| matches!(c, crate::render::Cell::Json(_)))) {
        return Decision::Forward("CSV of a JSON value");
    }
    let (columns, mut rows) = match &plan.transforms {
        None => (columns, rows),
        Some(acts) => match mask::apply(acts, sh.mask_key.as_deref().unwrap_or(b""), columns, rows) {
            Some(x) => x,
            None => return Decision::Forward("masking width"),
        },
    };
    let t = stage(&mut stages, "govern", t1);
    let has_more = rows.len() as i64 > opts.page_size;
    if has_more {
        rows.truncate(opts.page_size as usize);
    }
    let body = match opts.format {
        Format::Json => render::render_json(&columns, &rows),
        Format::Ndjson => render::render_ndjson(&columns, &rows),
        Format::Csv => match render::render_csv(&columns, &rows) {
            Some(b) => b,
            None => return Decision::Forward("CSV of a JSON value"),
        },
    };
    stage(&mut stages, "render", t);
    run.rows = rows.len() as i64;
    run.bytes = body.len() as i64;
    let timing = stages.iter().map(|(n, d)| format!("{n};dur={:.3}", d * 1000.0)).collect::<Vec<_>>().join(", ");
    let nrows = rows.len();
    sh.finish(run, t0, Some(query_seconds), Some(true)).await;
    let mut r = Response::new(Either::Left(Full::new(Bytes::from(body))));
    let h = r.headers_mut();
    h.insert("content-type", HeaderValue::from_static(opts.format.content_type()));
    let num = |v: i64| HeaderValue::from_str(&v.to_string()).expect("digits");
    h.insert("x-page", num(opts.page));
    h.insert("x-page-size", num(opts.page_size));
    h.insert("x-row-count", num(nrows as i64));
    h.insert("x-has-more", HeaderValue::from_static(if has_more { "true" } else { "false" }));
    // as Python's answers (qag/http/app.py RequestIdMiddleware): never sniffed; the plane serves no cache_ttl query
    h.insert("cache-control", HeaderValue::from_static("no-store"));
    h.insert("x-content-type-options", HeaderValue::from_static("nosniff"));
    if opts.format == Format::Csv {
        // Python's formats.disposition(): a CSV answer is a download, named for its query.
        let mut safe: String = name.chars().map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c } else { '_' }).collect();
        if safe.is_empty() {
            safe.push_str("result");
        }
        if let Ok(v) = HeaderValue::from_str(&format!("attachment; filename=\"{safe}.csv\"")) {
            h.insert("content-disposition", v);
        }
    }
    if let Ok(v) = HeaderValue::from_str(&timing) {
        h.insert("server-timing", v);
    }
    h.insert("x-request-id", HeaderValue::from_str(&rid).unwrap_or(HeaderValue::from_static("-")));
    Decision::Answer(r)
}

#[derive(Clone, Copy, PartialEq)]
enum Dialect {
    Postgres,
    Mysql,
}

/// How executing went when it did not give rows: forward to Python, or answer this error.
enum Exec {
    Forward(&'static str),
    Fail(ApiError),
}

type Rows = (Vec<String>, Vec<Vec<crate::render::Cell>>);

fn exec_error(e: ExecError, plan: &PlanEntry) -> Exec {
    match e {
        ExecError::Timeout => Exec::Fail(params::timeout_error(plan.query_timeout)),
        ExecError::Rejected => Exec::Fail(ApiError::new(500, "query_failed", QUERY_FAILED)),
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
        Err(_) => Err(Exec::Fail(params::timeout_error(plan.query_timeout))),
    }
}

/// PostgreSQL: everything that could make the answer differ from Python's is decided from the prepared
/// statement before executing. A pooled session found stale (the server restarted, the session was
/// terminated) is dropped with every idle one, and the read is tried once more on a fresh session.
async fn execute_pg(plan: &PlanEntry, conn: Rc<ConnEntry>, password: Option<String>, sql: &str, bound: &[params::PVal],
                    format: Format) -> Result<Rows, Exec> {
    let spec = SessionSpec { conn, password, timeout_ms: crate::limits::millis(plan.query_timeout) };
    let pool = pg::pool_for(&spec);
    with_deadline(plan, async {
        for attempt in 0..2 {
            let Ok(mut lease) = Lease::get(pool.clone()).await else { return Err(Exec::Forward("cannot connect")) };
            match execute_pg_once(plan, &mut lease, sql, bound, format).await {
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

async fn execute_pg_once(plan: &PlanEntry, lease: &mut Lease, sql: &str, bound: &[params::PVal], format: Format)
                         -> Result<Rows, ExecError> {
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
    let rows = lease.query(&st, &args, plan.state_free).await?;
    Ok((columns, rows))
}

/// MySQL/MariaDB: the prepared statement's metadata rules out what the plane cannot render before
/// executing; the result's own columns decide again (a read executed twice costs time, never a wrong answer).
/// `one_off`: the statement holds literals (a float): closed after use, so that it never crowds the
/// session's cache of the saved queries' statements. A stale pooled session: as for PostgreSQL.
async fn execute_mysql(plan: &PlanEntry, conn: Rc<ConnEntry>, password: Option<String>, sql: &str,
                       bound: &[params::PVal], one_off: bool) -> Result<Rows, Exec> {
    let mut args = Vec::with_capacity(bound.len());
    for v in bound {
        args.push(mysql::arg_for(v).ok_or(Exec::Forward("parameter type"))?);
    }
    let spec = mysql::SessionSpec { conn, password, timeout: plan.query_timeout };
    let pool = mysql::pool_for(&spec);
    with_deadline(plan, async {
        for attempt in 0..2 {
            let Ok(mut lease) = mysql::Lease::get(pool.clone()).await else { return Err(Exec::Forward("cannot connect")) };
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

async fn execute_mysql_once(plan: &PlanEntry, lease: &mut mysql::Lease, sql: &str, args: Vec<mysql_async::Value>,
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

async fn upstream_sender(up: &Upstream, fresh: bool) -> std::io::Result<hyper::client::conn::http1::SendRequest<Incoming>> {
    let reused = if fresh { None } else { UPSTREAM.with(|p| {
        let mut pool = p.borrow_mut();
        // gunicorn closes a kept-alive connection after `keepalive` seconds (qag: 5, gunicorn's default: 2);
        // one idle nearly that long may close while our request is on its way (a 502): not reused
        let now = Instant::now();
        pool.retain(|(s, idle)| !s.is_closed() && now.duration_since(*idle) < UPSTREAM_IDLE);
        // the most recently used first: its socket and gunicorn's thread for it are warm
        let i = pool.iter().rposition(|(s, _)| s.is_ready())?;
        Some(pool.swap_remove(i).0)
    }) };
    if let Some(s) = reused {
        return Ok(s);
    }
    macro_rules! handshake {
        ($io:expr) => {{
            let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new($io))
                .await
                .map_err(std::io::Error::other)?;
            tokio::task::spawn_local(async move {
                let _ = conn.await;
            });
            sender
        }};
    }
    Ok(match up {
        Upstream::Unix(p) => handshake!(tokio::net::UnixStream::connect(p).await?),
        Upstream::Tcp(a) => {
            let s = tokio::net::TcpStream::connect(a.as_str()).await?;
            s.set_nodelay(true)?;
            handshake!(s)
        }
    })
}

/// Longest idle time of a kept-alive gunicorn connection the plane reuses (below gunicorn's keepalive).
const UPSTREAM_IDLE: Duration = Duration::from_millis(1500);

/// Forwarded answers up to this length are read whole before they are written to the caller.
const FORWARD_BUFFER_MAX: u64 = 256 * 1024;

const HOP: [&str; 3] = ["connection", "keep-alive", "proxy-connection"];

/// Forward a request unchanged (hop-by-hop headers aside; the caller's address in X-Qag-Client-Addr).
pub async fn forward(up: &Upstream, mut req: Request<Incoming>, peer: Option<IpAddr>) -> Response<Body> {
    let h = req.headers_mut();
    for n in HOP {
        h.remove(n);
    }
    h.remove("x-qag-client-addr");
    if let Some(ip) = peer {
        if let Ok(v) = HeaderValue::from_str(&ip.to_string()) {
            h.insert(HeaderName::from_static("x-qag-client-addr"), v);
        }
    }
    let mut req = req;
    for attempt in 0..2 {
        // a kept-alive connection gunicorn has just closed (its keepalive timeout) fails before the request
        // is written: hyper gives the request back and it goes again on a new connection
        let mut sender = match upstream_sender(up, attempt > 0).await {
            Ok(s) => s,
            Err(e) => return bad_gateway(&format!("cannot connect to gunicorn: {e}")),
        };
        if sender.ready().await.is_err() {
            continue;
        }
        let resp = sender.try_send_request(req).await;
        UPSTREAM.with(|p| {
            let mut pool = p.borrow_mut();
            if pool.len() < 256 && !sender.is_closed() {
                pool.push((sender, Instant::now()));
            }
        });
        match resp {
            Ok(mut r) => {
                for n in HOP {
                    r.headers_mut().remove(n);
                }
                // gunicorn writes the head and the body separately: a small answer is read whole and written
                // to the caller in one write (one wake-up and one packet fewer on each side); anything
                // without a length (streams, /events) or large goes through as it comes
                let small = r.headers().get(hyper::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<u64>().ok()).is_some_and(|n| n <= FORWARD_BUFFER_MAX);
                if small {
                    let (parts, body) = r.into_parts();
                    return match http_body_util::BodyExt::collect(body).await {
                        Ok(c) => Response::from_parts(parts, Either::Left(Full::new(c.to_bytes()))),
                        Err(e) => bad_gateway(&format!("gunicorn's answer broke off: {e}")),
                    };
                }
                return r.map(Either::Right);
            }
            Err(mut e) => match e.take_message() {
                Some(r) => req = r,
                None => return bad_gateway(&format!("gunicorn did not answer: {}", e.error())),
            },
        }
    }
    bad_gateway("the connection to gunicorn failed twice")
}

fn bad_gateway(detail: &str) -> Response<Body> {
    let err = ApiError::new(502, "upstream_unavailable",
                            format!("The data plane could not reach the qag workers ({detail}); retry shortly."));
    error_response(&err, &mint_request_id())
}

/// Calls being handled now, and whether the plane is stopping (SIGTERM): listeners close, calls in
/// flight finish, then the process exits.
pub static INFLIGHT: AtomicUsize = AtomicUsize::new(0);
pub static DRAINING: AtomicBool = AtomicBool::new(false);

struct InFlight;

impl InFlight {
    fn enter() -> InFlight {
        INFLIGHT.fetch_add(1, Ordering::SeqCst);
        InFlight
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        INFLIGHT.fetch_sub(1, Ordering::SeqCst);
    }
}

pub async fn handle(sh: Arc<Shared>, req: Request<Incoming>, peer: Option<IpAddr>) -> Result<Response<Body>, Infallible> {
    let _guard = InFlight::enter();
    let mut r = route(sh, req, peer).await?;
    if DRAINING.load(Ordering::Relaxed) {
        r.headers_mut().insert("connection", HeaderValue::from_static("close"));
    }
    Ok(r)
}

async fn route(sh: Arc<Shared>, req: Request<Incoming>, peer: Option<IpAddr>) -> Result<Response<Body>, Infallible> {
    if req.method() == hyper::Method::GET && req.uri().path().starts_with("/q/") {
        match serve_query(&sh, &req, peer).await {
            Decision::Answer(r) => return Ok(r),
            Decision::Forward(why) => {
                if sh.debug {
                    eprintln!("qag-plane: forwarding {}: {why}", req.uri());
                }
            }
        }
    }
    Ok(forward(&sh.upstream, req, peer).await)
}

/// Run one plane thread: its own listener (SO_REUSEPORT) and runtime, until the plane stops.
///
/// Stopping (DRAINING, set on SIGTERM): the thread stops accepting first — it takes every connection the
/// kernel already completed from its accept queue (closing a listener resets those), then closes the
/// listener, so a new connection is refused rather than accepted and reset. Then every connection is
/// shut down gracefully: an idle kept-alive one is closed, one with a call in flight (served or forwarded:
/// the workers are still up, the arbiter stops the plane before them) finishes its answer, and its run is
/// recorded, then closes. The thread returns when its last connection has closed (main gives up after 10 s).
pub fn run_thread(sh: Arc<Shared>, listen: SocketAddr) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        let sock = if listen.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
        sock.set_reuseaddr(true)?;
        sock.set_reuseport(true)?;
        sock.bind(listen)?;
        let listener = sock.listen(1024)?;
        let (drain_tx, drain_rx) = tokio::sync::watch::channel(false);
        let open = Rc::new(StdCell::new(0usize));
        loop {
            if DRAINING.load(Ordering::Relaxed) {
                // no new connections: the ones already in the accept queue are taken and served first
                let std_listener = listener.into_std()?;
                std_listener.set_nonblocking(true)?;
                while let Ok((stream, addr)) = std_listener.accept() {
                    if let Ok(stream) = tokio::net::TcpStream::from_std(stream) {
                        spawn_connection(&sh, stream, addr, &open, drain_rx.clone());
                    }
                }
                drop(std_listener);
                let _ = drain_tx.send(true);
                while open.get() > 0 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                return Ok(());
            }
            let accepted = match tokio::time::timeout(Duration::from_millis(100), listener.accept()).await {
                Ok(a) => a,
                Err(_) => continue, // look at DRAINING again
            };
            match accepted {
                Ok((stream, addr)) => spawn_connection(&sh, stream, addr, &open, drain_rx.clone()),
                Err(e) => {
                    eprintln!("qag-plane: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    })
}

/// Serve one accepted connection on this thread; `open` counts the thread's connections, `drain` turns
/// true when the plane stops (then the connection finishes what it is answering and closes).
fn spawn_connection(sh: &Arc<Shared>, stream: tokio::net::TcpStream, addr: SocketAddr, open: &Rc<StdCell<usize>>,
                    mut drain: tokio::sync::watch::Receiver<bool>) {
    let _ = stream.set_nodelay(true);
    let sh = sh.clone();
    let peer = Some(addr.ip()).map(|ip| match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    });
    struct Open(Rc<StdCell<usize>>);
    impl Drop for Open {
        fn drop(&mut self) {
            self.0.set(self.0.get() - 1);
        }
    }
    open.set(open.get() + 1);
    let guard = Open(open.clone());
    tokio::task::spawn_local(async move {
        let _guard = guard;
        let svc = hyper::service::service_fn(move |req| handle(sh.clone(), req, peer));
        let mut conn = std::pin::pin!(hyper::server::conn::http1::Builder::new()
            .keep_alive(true)
            .serve_connection(TokioIo::new(stream), svc));
        let stopping = std::pin::pin!(async move {
            while !*drain.borrow_and_update() {
                if drain.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        });
        if let futures_util::future::Either::Right(_) = futures_util::future::select(conn.as_mut(), stopping).await {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    });
}
