//! PostgreSQL for the plane: per-thread pools of read-only sessions (startup options
//! `-c default_transaction_read_only=on -c statement_timeout=<ms>`, as qag/connectors.py), prepared
//! statements cached per session, parameters sent in text form (PostgreSQL parses them like psycopg2's
//! quoted literals), and result values decoded from the binary format into what psycopg2 would return.

use crate::entries::ConnEntry;
use crate::limits;
use crate::error::{ExecError, WriteError};
use crate::pool::{self, Lease, Pool, Pooled, Pools};
use crate::params::PVal;
use crate::pyfmt::{decimal_str, float_repr, hex};
use crate::render::{parse_json, Cell, Page};
use bytes::{Bytes, BytesMut};
use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;
use std::cell::RefCell;
use std::collections::HashMap;
use std::error::Error as StdError;
use std::rc::Rc;
use std::time::Duration;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{Format, IsNull, Kind, ToSql, Type};
use tokio_postgres::{Client, NoTls, Statement};

/// A bound value, sent in text format.
#[derive(Debug)]
pub(crate) struct Arg(Option<String>);

impl ToSql for Arg {
    fn to_sql(&self, _ty: &Type, out: &mut BytesMut) -> Result<IsNull, Box<dyn StdError + Sync + Send>> {
        match &self.0 {
            None => Ok(IsNull::Yes),
            Some(s) => {
                out.extend_from_slice(s.as_bytes());
                Ok(IsNull::No)
            }
        }
    }

    fn accepts(_ty: &Type) -> bool {
        true
    }

    fn encode_format(&self, _ty: &Type) -> Format {
        Format::Text
    }

    tokio_postgres::types::to_sql_checked!();
}

/// The text a parameter of PostgreSQL type `ty` gets for value `v`, or None when psycopg2's literal
/// would behave differently (then the call is forwarded to Python).
pub(crate) fn arg_for(ty: &Type, v: &PVal) -> Option<Arg> {
    let int_types = [Type::INT2, Type::INT4, Type::INT8];
    Some(Arg(match v {
        PVal::Null => None,
        PVal::Str(s) => Some(s.clone()),
        PVal::Bool(b) if *ty == Type::BOOL => Some((if *b { "true" } else { "false" }).to_string()),
        PVal::Int(i) if *ty == Type::INT2 && i16::try_from(*i).is_ok() => Some(i.to_string()),
        PVal::Int(i) if *ty == Type::INT4 && i32::try_from(*i).is_ok() => Some(i.to_string()),
        PVal::Int(i) if *ty == Type::INT8 || *ty == Type::NUMERIC => Some(i.to_string()),
        PVal::Int(i) if (*ty == Type::FLOAT8 || *ty == Type::FLOAT4) && i.unsigned_abs() < (1 << 24) => Some(i.to_string()),
        PVal::Float(f) if *ty == Type::FLOAT8 || *ty == Type::NUMERIC => Some(float_repr(*f)),
        _ if int_types.contains(ty) => return None,
        _ => return None,
    }))
}

/// The type of a psycopg2 literal for a parameter of this spec type.
pub(crate) fn literal_type(t: crate::params::PType) -> Type {
    use crate::params::PType;
    match t {
        PType::Int => Type::INT8,
        PType::Float => Type::NUMERIC,
        PType::Str => Type::TEXT,
        PType::Bool => Type::BOOL,
    }
}

/// Whether the plane can render a column of this type exactly as psycopg2 + render.py would.
pub(crate) fn column_supported(ty: &Type, tz_utc: bool) -> bool {
    if matches!(ty.kind(), Kind::Enum(_)) {
        return true;
    }
    [
        Type::BOOL, Type::BYTEA, Type::CHAR, Type::NAME, Type::INT8, Type::INT2, Type::INT4, Type::TEXT, Type::OID,
        Type::JSON, Type::FLOAT4, Type::FLOAT8, Type::BPCHAR, Type::VARCHAR, Type::DATE, Type::TIME, Type::TIMESTAMP,
        Type::NUMERIC, Type::UUID, Type::JSONB,
    ]
    .contains(ty)
        || (*ty == Type::TIMESTAMPTZ && tz_utc)
}

pub(crate) fn is_json(ty: &Type) -> bool {
    *ty == Type::JSON || *ty == Type::JSONB
}

fn be_i64(b: &[u8]) -> Option<i64> {
    Some(i64::from_be_bytes(b.try_into().ok()?))
}

/// Days since 1970-01-01 to (year, month, day) (proleptic Gregorian).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

const PG_EPOCH_DAYS: i64 = 10_957; // 2000-01-01 in days since 1970-01-01

fn date_text(pg_days: i64) -> Option<String> {
    let (y, m, d) = civil(pg_days + PG_EPOCH_DAYS);
    if !(1..=9999).contains(&y) {
        return None; // psycopg2 raises for dates outside Python's range
    }
    Some(format!("{y:04}-{m:02}-{d:02}"))
}

/// datetime.time.isoformat(): HH:MM:SS, then .ffffff when microseconds are non-zero.
fn time_text(us: i64) -> String {
    let (s, frac) = (us.div_euclid(1_000_000), us.rem_euclid(1_000_000));
    let t = format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
    if frac == 0 {
        t
    } else {
        format!("{t}.{frac:06}")
    }
}

fn timestamp_text(us: i64) -> Option<String> {
    if us == i64::MAX || us == i64::MIN {
        return None; // infinity
    }
    let days = us.div_euclid(86_400_000_000);
    let rest = us.rem_euclid(86_400_000_000);
    Some(format!("{}T{}", date_text(days)?, time_text(rest)))
}

/// PostgreSQL's binary numeric to (str(Decimal), JSON/CSV text); None for NaN and infinities (forwarded:
/// Python writes null in JSON, the database's text in CSV).
fn numeric_texts(b: &[u8]) -> Option<(String, String)> {
    if b.len() < 8 {
        return None;
    }
    let ndigits = u16::from_be_bytes([b[0], b[1]]) as usize;
    let weight = i16::from_be_bytes([b[2], b[3]]) as i64;
    let sign = u16::from_be_bytes([b[4], b[5]]);
    let dscale = u16::from_be_bytes([b[6], b[7]]) as usize;
    if sign != 0 && sign != 0x4000 || b.len() != 8 + 2 * ndigits {
        return None;
    }
    let digit = |i: i64| -> u16 {
        if i >= 0 && (i as usize) < ndigits {
            u16::from_be_bytes([b[8 + 2 * i as usize], b[9 + 2 * i as usize]])
        } else {
            0
        }
    };
    let mut int_part = String::new();
    if weight >= 0 {
        for i in 0..=weight {
            let d = digit(i);
            if int_part.is_empty() {
                if d != 0 {
                    int_part = d.to_string();
                }
            } else {
                int_part.push_str(&format!("{d:04}"));
            }
        }
    }
    if int_part.is_empty() {
        int_part.push('0');
    }
    let mut frac = String::new();
    let mut i = weight + 1;
    while frac.len() < dscale {
        frac.push_str(&format!("{:04}", digit(i)));
        i += 1;
    }
    frac.truncate(dscale);
    decimal_texts(sign == 0x4000, &int_part, &frac)
}

/// A decimal of sign, integer digits (no leading zeros, "0" for none) and fractional digits, as
/// (str(Decimal), what render.py prints: values.decimal_text, the exact digits in plain notation, the scale's
/// trailing zeros kept: 12.50, 1000, 0.0000001, never a float's 124.94999999999999 nor an exponent).
/// Always Some (the Option stays for the callers' `?`: a decimal the plane cannot print is forwarded).
pub(crate) fn decimal_texts(neg: bool, int_part: &str, frac: &str) -> Option<(String, String)> {
    let text = decimal_str(neg, int_part, frac);
    let mut num = String::with_capacity(int_part.len() + frac.len() + 2);
    if neg {
        num.push('-');
    }
    num.push_str(int_part);
    if !frac.is_empty() {
        num.push('.');
        num.push_str(frac);
    }
    Some((text, num))
}

/// One binary value as psycopg2 would return it; None when the plane cannot reproduce it exactly.
pub(crate) fn decode(ty: &Type, raw: Option<&[u8]>) -> Option<Cell> {
    let Some(b) = raw else { return Some(Cell::Null) };
    let text = || std::str::from_utf8(b).ok().map(str::to_string);
    Some(match *ty {
        Type::BOOL => Cell::Bool(*b.first()? != 0),
        Type::INT2 => Cell::Int(i16::from_be_bytes(b.try_into().ok()?) as i64),
        Type::INT4 => Cell::Int(i32::from_be_bytes(b.try_into().ok()?) as i64),
        Type::OID => Cell::Int(u32::from_be_bytes(b.try_into().ok()?) as i64),
        Type::INT8 => Cell::Int(be_i64(b)?),
        Type::FLOAT4 => {
            let f = f32::from_be_bytes(b.try_into().ok()?);
            // psycopg2 parses PostgreSQL's shortest text of the float4: the same digits, read as a double
            Cell::Float(if f.is_finite() { format!("{f}").parse().ok()? } else { f as f64 })
        }
        Type::FLOAT8 => Cell::Float(f64::from_be_bytes(b.try_into().ok()?)),
        Type::NUMERIC => {
            let (text, num) = numeric_texts(b)?;
            Cell::Decimal { text, num }
        }
        Type::BYTEA => Cell::Str(hex(b)),
        Type::UUID => {
            let h = hex(b);
            if h.len() != 32 {
                return None;
            }
            Cell::Str(format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..]))
        }
        Type::DATE => {
            let d = i32::from_be_bytes(b.try_into().ok()?);
            if d == i32::MAX || d == i32::MIN {
                return None;
            }
            Cell::Str(date_text(d as i64)?)
        }
        Type::TIME => Cell::Str(time_text(be_i64(b)?)),
        Type::TIMESTAMP => Cell::Str(timestamp_text(be_i64(b)?)?),
        Type::TIMESTAMPTZ => Cell::Str(format!("{}+00:00", timestamp_text(be_i64(b)?)?)),
        Type::JSON => Cell::Json(parse_json(&text()?)?),
        Type::JSONB => {
            if b.first() != Some(&1) {
                return None;
            }
            Cell::Json(parse_json(std::str::from_utf8(&b[1..]).ok()?)?)
        }
        _ => Cell::Str(text()?), // text, varchar, bpchar, name, "char", enums: their text
    })
}

/// Whether a PostgreSQL error means the session is unusable: SQLSTATE classes 08 (connection exception)
/// and 57P (admin or crash shutdown, cannot connect now), or no server error at all (the socket failed or
/// the connection closed).
fn is_stale(e: &tokio_postgres::Error) -> bool {
    match e.as_db_error() {
        Some(db) => {
            let c = db.code().code();
            c.starts_with("08") || c.starts_with("57P")
        }
        None => true,
    }
}

pub(crate) struct Session {
    client: Client,
    /// The task driving the connection's socket: aborted when the session is discarded, so a session
    /// given up on (a frozen server) closes its socket at once instead of waiting for an answer forever.
    task: tokio::task::JoinHandle<()>,
    stmts: HashMap<String, Statement>,
    pub(crate) tz_utc: bool,
    healthy: bool,
    /// An exchange with the server is under way. A lease dropped meanwhile (the call's deadline fired) must
    /// not give the session back: its connection still owes answers to a request nobody waits for.
    busy: bool,
}

impl Pooled for Session {
    type Spec = SessionSpec;

    async fn connect(spec: &SessionSpec) -> Result<Session, ExecError> {
        connect(spec).await
    }

    fn reusable(&self) -> bool {
        self.healthy && !self.busy && !self.client.is_closed()
    }

    /// Dropping the session aborts its connection task: the socket closes now.
    fn close(self) {
        drop(self);
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Pool key: everything that defines a session; a changed connection entry makes a new pool.
#[derive(Clone, PartialEq, Debug)]
pub(crate) struct SessionSpec {
    pub(crate) conn: Rc<ConnEntry>,
    pub(crate) password: Option<String>,
    pub(crate) timeout_ms: u64,
    /// A write session (connectors.py S1: no `default_transaction_read_only`), in a pool of its own, as each
    /// Python worker keeps its read and write sessions apart.
    pub(crate) write: bool,
}

thread_local! {
    static POOLS: Pools<Session> = RefCell::new(HashMap::new());
    static WRITE_POOLS: Pools<Session> = RefCell::new(HashMap::new());
}

/// The thread's pool of sessions for this connection entry, password and limit (reads and writes apart).
pub(crate) fn pool_for(spec: &SessionSpec) -> Rc<RefCell<Pool<Session>>> {
    pool::pool_for(if spec.write { &WRITE_POOLS } else { &POOLS }, &spec.conn.name, spec)
}

async fn connect(spec: &SessionSpec) -> Result<Session, ExecError> {
    // psycopg2's connect_timeout=max(1, int(round(connect_timeout))), for the whole start-up (a frozen
    // server completes the TCP handshake from its backlog and then never answers the startup message)
    let limit = Duration::from_secs_f64(spec.conn.connect_timeout.round().max(1.0));
    tokio::time::timeout(limit, open(spec)).await.map_err(|_| ExecError::Forward("cannot connect"))?
}

async fn open(spec: &SessionSpec) -> Result<Session, ExecError> {
    let c = &spec.conn;
    let mut cfg = tokio_postgres::Config::new();
    cfg.host(&c.host).port(c.port).application_name("qag")
        .connect_timeout(Duration::from_secs_f64(c.connect_timeout.round().max(1.0)))
        .keepalives(true)
        .keepalives_idle(limits::KEEPALIVE_IDLE)
        .keepalives_interval(limits::KEEPALIVE_INTERVAL)
        .keepalives_retries(limits::KEEPALIVE_RETRIES)
        .tcp_user_timeout(limits::TCP_USER_TIMEOUT);
    if let Some(u) = &c.user {
        cfg.user(u);
    } else {
        cfg.user(crate::sys::os_user().unwrap_or_else(|| "postgres".into())); // libpq's default
    }
    if let Some(d) = &c.database {
        cfg.dbname(d);
    }
    if let Some(p) = &spec.password {
        cfg.password(p);
    }
    let mut opts = vec![format!("-c statement_timeout={}", spec.timeout_ms)];
    if !spec.write {
        opts.push("-c default_transaction_read_only=on".to_string());
    }
    if let Some(sp) = c.options.get("schema").or_else(|| c.options.get("search_path")) {
        opts.push(format!("-c search_path={}", sp.replace([' ', '\\'], "")));
    }
    cfg.options(opts.join(" "));
    let (client, conn) = cfg.connect(NoTls).await.map_err(|_| ExecError::Forward("cannot connect"))?;
    let tz = conn.parameter("TimeZone").unwrap_or("").to_ascii_lowercase();
    let tz_utc = matches!(tz.as_str(), "utc" | "etc/utc" | "gmt" | "etc/gmt" | "universal" | "zulu" | "etc/universal" | "etc/zulu" | "uct" | "etc/uct" | "gmt0" | "etc/gmt0" | "greenwich");
    let task = tokio::task::spawn_local(async move {
        let _ = conn.await;
    });
    Ok(Session { client, task, stmts: HashMap::new(), tz_utc, healthy: true, busy: false })
}

/// What follows a statement not proven state-free (connectors.py S5): what `DISCARD ALL` does except
/// `DEALLOCATE ALL` (the plane's own prepared statements, and tokio-postgres's type-lookup ones, stay):
/// every setting back to the startup packet's (`default_transaction_read_only=on`, `statement_timeout`,
/// `search_path`), the session's role, advisory locks, cursors, LISTEN, cached plans, temporary tables,
/// sequence state. One simple-query message, its own transaction.
const RESET_SESSION: &str = "CLOSE ALL; SET SESSION AUTHORIZATION DEFAULT; RESET ALL; UNLISTEN *; \
SELECT pg_advisory_unlock_all(); DISCARD PLANS; DISCARD TEMP; DISCARD SEQUENCES";

/// A PostgreSQL session's statements, on its lease (`pool::Lease`).
impl Lease<Session> {
    pub(crate) fn tz_utc(&self) -> bool {
        self.session().tz_utc
    }

    /// `typed`: the types psycopg2's literals would have (str → text, int → int8, float → numeric, bool),
    /// used only when PostgreSQL cannot infer a parameter's type by itself (`:x IS NULL`).
    pub(crate) async fn prepare(&mut self, sql: &str, typed: &[Type]) -> Result<Statement, ExecError> {
        let session = self.session_mut();
        if let Some(s) = session.stmts.get(sql) {
            return Ok(s.clone());
        }
        session.busy = true;
        let mut res = session.client.prepare(sql).await;
        if matches!(&res, Err(e) if e.code() == Some(&SqlState::INDETERMINATE_DATATYPE)) {
            res = session.client.prepare_typed(sql, typed).await;
        }
        session.busy = false;
        let st = match res {
            Ok(st) => st,
            Err(e) if is_stale(&e) => {
                session.healthy = false;
                return Err(ExecError::Stale);
            }
            Err(_) => return Err(ExecError::Forward("prepare failed")),
        };
        if session.stmts.len() > 256 {
            session.stmts.clear();
        }
        session.stmts.insert(sql.to_string(), st.clone());
        Ok(st)
    }

    /// Execute (connectors.py S2, S5). The session's transactions are read-only from its start
    /// (`default_transaction_read_only=on`), and a statement cannot make its own transaction read-write
    /// (`set_config('transaction_read_only', 'off', true)` fails once it took its snapshot); what it could
    /// change for *later* transactions and callers — that default, `search_path`, `statement_timeout`,
    /// advisory locks — only a statement off the plan's state-free verdict can reach (`state_free`: one
    /// SELECT of built-ins that read nothing but their arguments), and such a statement is followed by
    /// `RESET_SESSION`, sent with it (tokio-postgres pipelines requests polled together: one write, one
    /// round trip), before the session serves anyone else. A state-free read is the statement alone.
    /// The page of cells in select-list order; `expect`: how many rows the statement returns at most (its
    /// LIMIT), room made for them at once.
    pub(crate) async fn query(&mut self, st: &Statement, args: &[Arg], state_free: bool, expect: usize) -> Result<Page, ExecError> {
        let session = self.session_mut();
        session.busy = true;
        let client = &session.client;
        let (result, end) = if state_free {
            (read_rows(client, st, args, expect).await, Ok(()))
        } else {
            futures_util::future::join(read_rows(client, st, args, expect), client.batch_execute(RESET_SESSION)).await
        };
        session.busy = false;
        if let Err(e) = &end {
            session.healthy = false; // a session whose reset failed is not reused
            if is_stale(e) {
                return Err(ExecError::Stale);
            }
        }
        match result {
            Ok(Ok(rows)) if session.healthy => Ok(rows),
            Ok(Ok(_)) => Err(ExecError::Forward("session reset failed")),
            Ok(Err(why)) => Err(ExecError::Forward(why)),
            Err(e) => Err(match e.as_db_error() {
                Some(db) if *db.code() == SqlState::QUERY_CANCELED => ExecError::Timeout,
                _ if is_stale(&e) => {
                    session.healthy = false;
                    ExecError::Stale
                }
                Some(_) => ExecError::Rejected,
                None => ExecError::Stale,
            }),
        }
    }
}

/// The statement's rows, each decoded as it arrives, straight from the DataRow message's bytes (tokio-postgres's
/// `RowStream::poll_raw_rows`: no `Row` built per row, no page of them held). A value the plane cannot render
/// (Ok(Err(why))) still reads the rest, so the session ends the exchange with nothing owed and goes back to its
/// pool.
async fn read_rows(client: &Client, st: &Statement, args: &[Arg], expect: usize)
                   -> Result<Result<Page, &'static str>, tokio_postgres::Error> {
    let stream = client.query_raw(st, args.iter()).await?;
    futures_util::pin_mut!(stream);
    let types: Vec<&Type> = st.columns().iter().map(|c| c.type_()).collect();
    let mut page = Page::with_capacity(st.columns().iter().map(|c| c.name().to_string()).collect(), expect);
    let mut failed = None;
    let mut on_row = |body: &[u8]| {
        if failed.is_none() {
            if let Err(why) = decode_row(&types, body, &mut page.cells) {
                failed = Some(why);
            }
        }
        page.rows += 1;
    };
    std::future::poll_fn(|cx| stream.as_mut().poll_raw_rows(cx, &mut on_row)).await?;
    Ok(match failed {
        Some(why) => Err(why),
        None => Ok(page),
    })
}

/// One DataRow's body (a big-endian u16 column count, then per column an i32 length, -1 for NULL, and its
/// bytes) decoded into `cells`, one cell per column of `types`; on failure `cells` is left as it was before.
fn decode_row(types: &[&Type], body: &[u8], cells: &mut Vec<Cell>) -> Result<(), &'static str> {
    let before = cells.len();
    let res = (|| {
        let n = u16::from_be_bytes(body.get(..2).ok_or("value decode")?.try_into().map_err(|_| "value decode")?);
        if usize::from(n) != types.len() {
            return Err("value decode");
        }
        let mut p = 2;
        for ty in types {
            let len = i32::from_be_bytes(body.get(p..p + 4).ok_or("value decode")?.try_into().map_err(|_| "value decode")?);
            p += 4;
            let raw = if len < 0 {
                None
            } else {
                let end = p + len as usize;
                let v = body.get(p..end).ok_or("value decode")?;
                p = end;
                Some(v)
            };
            cells.push(decode(ty, raw).ok_or("value the plane cannot render")?);
        }
        if p != body.len() {
            return Err("value decode");
        }
        Ok(())
    })();
    if res.is_err() {
        cells.truncate(before);
    }
    res
}

/// The first line of what PostgreSQL said, as connectors.py `_first_line` keeps it (psycopg2's text of a server
/// error is its message; DETAIL and HINT follow on lines of their own).
fn first_line(e: &tokio_postgres::Error) -> String {
    let text = match e.as_db_error() {
        Some(db) => db.message().to_string(),
        None => e.to_string(),
    };
    text.trim().lines().next().unwrap_or("Error").trim_end().to_string()
}

/// A PostgreSQL write session's statements (server/write.rs).
impl Lease<Session> {
    /// Prepare a write: its statement (cached per session, as reads do). Preparing executes nothing.
    pub(crate) async fn prepare_write(&mut self, sql: &str, typed: &[Type]) -> Result<Statement, WriteError> {
        match self.prepare(sql, typed).await {
            Ok(st) => Ok(st),
            Err(ExecError::Stale) => Err(WriteError::Stale),
            Err(_) => Err(WriteError::NotRun("prepare failed")),
        }
    }

    /// Execute a write in its own transaction and commit it, as connectors.py's write does (psycopg2 without
    /// autocommit: BEGIN, the statement, COMMIT), then reset the session (S5: writes are always reset), all in one
    /// message under one Sync (`write_messages`): PostgreSQL answers it in one flush, at its ReadyForQuery, so the
    /// plane's thread sleeps once per write for the database instead of once per statement (four before:
    /// bench/results/2026-12-06-plane-writes). The rows it changed (the statement's CommandComplete count,
    /// psycopg2's rowcount) when it committed.
    ///
    /// Under one Sync an error makes the server skip every message up to the Sync, so the answers tell which
    /// statement failed (`WriteEnd`), and what the database holds after each outcome is: the statement failed (a
    /// server error) — nothing committed, the explicit transaction left failed (ReadyForQuery 'E'); the statement
    /// ran and COMMIT failed (a deferred constraint, a serialization failure) — rolled back (ReadyForQuery 'I');
    /// both answered — committed. In the first two the reset was skipped: `ROLLBACK` (when the transaction is
    /// still open) and the reset follow as one simple query, a second round trip on this rare path, before the
    /// session serves anyone else, or it is not reused. A session lost on the way (no server error, or SQLSTATE
    /// 08/57P) before COMMIT answered leaves the outcome unknown: `Lost`; lost after, the write committed and only
    /// the session is given up.
    pub(crate) async fn write(&mut self, st: &Statement, args: &[Arg]) -> Result<u64, WriteError> {
        if args.len() != st.params().len() {
            return Err(WriteError::NotRun("parameter count")); // write_pg checked it: nothing is sent
        }
        let messages = write_messages(st, args).map_err(|_| WriteError::NotRun("parameter encoding"))?;
        let session = self.session_mut();
        session.busy = true;
        let answers = session.client.pipeline_raw(messages).await;
        let end = write_end(&answers);
        let out = match end {
            WriteEnd::Committed(n) => Ok(n),
            WriteEnd::CommittedResetFailed(n) => {
                session.healthy = false; // a session whose reset failed is not reused (S5)
                Ok(n)
            }
            WriteEnd::Lost(text) => {
                session.healthy = false;
                Err(WriteError::Lost(text))
            }
            WriteEnd::Failed { error, at, open } => {
                // the skipped reset, and the failed transaction's ROLLBACK when it is still open
                let reset = if open { ROLLBACK_RESET_SESSION } else { RESET_SESSION };
                if session.client.batch_execute(reset).await.is_err() {
                    session.healthy = false;
                }
                Err(match error.code() {
                    Some(c) if *c == SqlState::QUERY_CANCELED && at == WriteStep::Statement => WriteError::Timeout,
                    _ => WriteError::Rejected(first_line(error)),
                })
            }
        };
        session.busy = false;
        out
    }
}

/// The statements of `RESET_SESSION`, each sent as Parse/Bind/Execute after the write's COMMIT, where they run in
/// the extended protocol's implicit transaction, committed at the Sync. Checked on this machine's PostgreSQL 15.20
/// (a raw-protocol client, 2026-12-06): each answers CommandComplete there, and what a write left (a setting, an
/// advisory lock, a temporary table, LISTEN) is gone for the session's next statement
/// (tests/e2e/test_plane_writes.py `test_a_write_leaves_nothing_on_its_session`). `DISCARD ALL` is not among them
/// for the reason `RESET_SESSION` gives (it would deallocate the plane's prepared statements), not because of the
/// implicit transaction (15.20 ran it there too).
const RESET_STATEMENTS: [&str; 8] = ["CLOSE ALL", "SET SESSION AUTHORIZATION DEFAULT", "RESET ALL", "UNLISTEN *",
    "SELECT pg_advisory_unlock_all()", "DISCARD PLANS", "DISCARD TEMP", "DISCARD SEQUENCES"];

/// After a write failed inside its explicit transaction (ReadyForQuery 'E'): end it, then the reset.
const ROLLBACK_RESET_SESSION: &str = "ROLLBACK; CLOSE ALL; SET SESSION AUTHORIZATION DEFAULT; RESET ALL; \
UNLISTEN *; SELECT pg_advisory_unlock_all(); DISCARD PLANS; DISCARD TEMP; DISCARD SEQUENCES";

/// What comes before and after the statement in a write's message, the same for every write: Parse/Bind/Execute of
/// `BEGIN` (unnamed statement and portal); then Parse/Bind/Execute of `COMMIT`, of each of `RESET_STATEMENTS`,
/// and the one Sync.
struct WriteFrame {
    before: Bytes,
    after: Bytes,
}

fn simple_step(sql: &str, buf: &mut BytesMut) -> std::io::Result<()> {
    frontend::parse("", sql, std::iter::empty(), buf)?;
    frontend::bind("", "", std::iter::empty(), std::iter::empty::<()>(), |_, _| Ok(postgres_protocol::IsNull::No),
                   std::iter::empty(), buf)
        .map_err(|_| std::io::Error::other("bind"))?;
    frontend::execute("", 0, buf)
}

fn write_frame() -> WriteFrame {
    let mut buf = BytesMut::with_capacity(512);
    simple_step("BEGIN", &mut buf).expect("a constant statement encodes");
    let before = buf.split().freeze();
    simple_step("COMMIT", &mut buf).expect("a constant statement encodes");
    for sql in RESET_STATEMENTS {
        simple_step(sql, &mut buf).expect("a constant statement encodes");
    }
    frontend::sync(&mut buf);
    WriteFrame { before, after: buf.freeze() }
}

thread_local! {
    static WRITE_FRAME: WriteFrame = write_frame();
}

/// A write's whole message: `WriteFrame::before`, Bind/Execute of the prepared statement with its values in text
/// format (no format codes: all text, as `Arg` sends them; no result format codes, the statement has no columns),
/// `WriteFrame::after`.
fn write_messages(st: &Statement, args: &[Arg]) -> std::io::Result<Bytes> {
    WRITE_FRAME.with(|f| {
        let len: usize = args.iter().map(|a| a.0.as_ref().map_or(4, |s| 4 + s.len())).sum();
        let mut buf = BytesMut::with_capacity(f.before.len() + f.after.len() + st.server_name().len() + len + 32);
        buf.extend_from_slice(&f.before);
        frontend::bind("", st.server_name(), std::iter::empty(), args.iter(), |a, out| match &a.0 {
            None => Ok(postgres_protocol::IsNull::Yes),
            Some(s) => {
                out.extend_from_slice(s.as_bytes());
                Ok(postgres_protocol::IsNull::No)
            }
        }, std::iter::empty(), &mut buf)
            .map_err(|_| std::io::Error::other("bind"))?;
        frontend::execute("", 0, &mut buf)?;
        buf.extend_from_slice(&f.after);
        Ok(buf.freeze())
    })
}

/// Which of a write's statements an answer belongs to: counted by the CommandCompletes before it.
#[derive(Debug, PartialEq, Clone, Copy)]
enum WriteStep {
    Begin,
    Statement,
    Commit,
    Reset,
}

fn step_at(completed: usize) -> WriteStep {
    match completed {
        0 => WriteStep::Begin,
        1 => WriteStep::Statement,
        2 => WriteStep::Commit,
        _ => WriteStep::Reset,
    }
}

/// How a write's exchange ended, read from the server's answers in order.
#[derive(Debug)]
enum WriteEnd<'a> {
    /// COMMIT and the reset answered: the statement's count.
    Committed(u64),
    /// COMMIT answered, the reset did not (a server error in it, or the session lost after COMMIT).
    CommittedResetFailed(u64),
    /// The session was lost before COMMIT answered (no server error, or SQLSTATE 08/57P): unknown outcome.
    Lost(String),
    /// A server error in BEGIN, the statement or COMMIT: nothing committed; `open` when the explicit transaction
    /// is still open (ReadyForQuery 'E' or 'T'), to be rolled back.
    Failed { error: &'a tokio_postgres::Error, at: WriteStep, open: bool },
}

fn write_end(answers: &[Result<Message, tokio_postgres::Error>]) -> WriteEnd<'_> {
    let mut completed = 0;
    let mut count = 0;
    let mut failed: Option<(&tokio_postgres::Error, WriteStep)> = None;
    for a in answers {
        match a {
            Ok(Message::CommandComplete(body)) => {
                if completed == 1 {
                    // tokio-postgres's extract_row_affected: the tag's last word ("UPDATE 3", "INSERT 0 1")
                    count = body.tag().ok().and_then(|t| t.rsplit(' ').next()?.parse().ok()).unwrap_or(0);
                }
                completed += 1;
            }
            Ok(Message::ReadyForQuery(body)) => {
                return match failed {
                    None if completed == 3 + RESET_STATEMENTS.len() => WriteEnd::Committed(count),
                    None if completed >= 3 => WriteEnd::CommittedResetFailed(count),
                    Some((_, WriteStep::Reset)) => WriteEnd::CommittedResetFailed(count),
                    Some((error, at)) => WriteEnd::Failed { error, at, open: body.status() != b'I' },
                    // BEGIN, the statement and COMMIT each answer before ReadyForQuery unless one failed: an
                    // answer short of them is not one this exchange can have, and says nothing of the outcome
                    None => WriteEnd::Lost("unexpected answer to the write".into()),
                };
            }
            Ok(_) => {}
            Err(e) if e.as_db_error().is_none() || is_stale(e) => {
                return if completed >= 3 { WriteEnd::CommittedResetFailed(count) } else { WriteEnd::Lost(first_line(e)) };
            }
            Err(e) => {
                if failed.is_none() {
                    failed = Some((e, step_at(completed)));
                }
            }
        }
    }
    // pipeline_raw ends with ReadyForQuery or with an error that is not the server's: not reached
    WriteEnd::Lost("connection closed".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numeric(ndigits: &[u16], weight: i16, neg: bool, dscale: u16) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&(ndigits.len() as u16).to_be_bytes());
        b.extend_from_slice(&weight.to_be_bytes());
        b.extend_from_slice(&(if neg { 0x4000u16 } else { 0 }).to_be_bytes());
        b.extend_from_slice(&dscale.to_be_bytes());
        for d in ndigits {
            b.extend_from_slice(&d.to_be_bytes());
        }
        b
    }

    #[test]
    fn numerics_like_psycopg2_decimal() {
        // (str(Decimal), values.decimal_text): JSON and CSV print the exact digits in plain notation
        // 12.50 -> Decimal('12.50'): 12.50, trailing zero kept (numeric(p,2)'s text)
        assert_eq!(numeric_texts(&numeric(&[12, 5000], 0, false, 2)), Some(("12.50".into(), "12.50".into())));
        // 124.95: not the float's 124.94999999999999
        assert_eq!(numeric_texts(&numeric(&[124, 9500], 0, false, 2)), Some(("124.95".into(), "124.95".into())));
        // 1000 (weight 0 digits [1000])
        assert_eq!(numeric_texts(&numeric(&[1000], 0, false, 0)), Some(("1000".into(), "1000".into())));
        // 123456789.00
        assert_eq!(numeric_texts(&numeric(&[1, 2345, 6789], 2, false, 2)), Some(("123456789.00".into(), "123456789.00".into())));
        // -0.0000100 (digits base 10000: 1000 x 10000^-2)
        assert_eq!(numeric_texts(&numeric(&[0, 1000], -1, true, 7)), Some(("-0.0000100".into(), "-0.0000100".into())));
        // -0.0000001 (10 x 10000^-2) -> Decimal('-1E-7'), printed without the exponent
        assert_eq!(numeric_texts(&numeric(&[10], -2, true, 7)), Some(("-1E-7".into(), "-0.0000001".into())));
        // 0 with scale 2
        assert_eq!(numeric_texts(&numeric(&[], 0, false, 2)), Some(("0.00".into(), "0.00".into())));
        // 10000000000000000000 (over 2^63): its digits, not 1e+19
        assert_eq!(numeric_texts(&numeric(&[1000], 4, false, 0)), Some(("10000000000000000000".into(), "10000000000000000000".into())));
        // 12345678901234567890.123456789 (digits 1234 5678 9012 3456 7890 . 1234 5678 9000, scale 9)
        let many = numeric(&[1234, 5678, 9012, 3456, 7890, 1234, 5678, 9000], 4, false, 9);
        assert_eq!(numeric_texts(&many), Some(("12345678901234567890.123456789".into(), "12345678901234567890.123456789".into())));
        // 1e400 (weight 100): over any double, printed in full
        let (_, huge) = numeric_texts(&numeric(&[1], 100, false, 0)).unwrap();
        assert_eq!(huge, format!("1{}", "0".repeat(400)));
        // NaN (sign 0xC000): forwarded to Python
        let mut nan = numeric(&[], 0, false, 0);
        nan[4] = 0xC0;
        assert_eq!(numeric_texts(&nan), None);
    }

    #[test]
    fn dates_and_times_like_isoformat() {
        assert_eq!(date_text(0).unwrap(), "2000-01-01");
        assert_eq!(date_text(-1).unwrap(), "1999-12-31");
        assert_eq!(date_text(9_830).unwrap(), "2026-11-30");
        assert_eq!(timestamp_text(0).unwrap(), "2000-01-01T00:00:00");
        assert_eq!(timestamp_text(849_337_193_123_000).unwrap(), "2026-11-30T06:59:53.123000");
        assert_eq!(timestamp_text(-1).unwrap(), "1999-12-31T23:59:59.999999");
        assert_eq!(time_text(25_193_000_001), "06:59:53.000001");
        assert!(date_text(-800_000).is_none());
    }

    /// A DataRow body: the column count, then each column's length (-1: NULL) and bytes.
    fn data_row(cols: &[Option<&[u8]>]) -> Vec<u8> {
        let mut b = (cols.len() as u16).to_be_bytes().to_vec();
        for c in cols {
            match c {
                None => b.extend_from_slice(&(-1i32).to_be_bytes()),
                Some(v) => {
                    b.extend_from_slice(&(v.len() as i32).to_be_bytes());
                    b.extend_from_slice(v);
                }
            }
        }
        b
    }

    #[test]
    fn data_rows_decoded_in_place() {
        let types = [&Type::INT4, &Type::TEXT, &Type::INT8, &Type::BOOL];
        let mut cells = vec![Cell::Int(7)];
        let row = data_row(&[Some(&42i32.to_be_bytes()), Some("é,x".as_bytes()), None, Some(&[1])]);
        assert_eq!(decode_row(&types, &row, &mut cells), Ok(()));
        assert_eq!(cells, vec![Cell::Int(7), Cell::Int(42), Cell::Str("é,x".into()), Cell::Null, Cell::Bool(true)]);
        // an empty text is a value, not NULL
        let mut cells = Vec::new();
        assert_eq!(decode_row(&[&Type::TEXT], &data_row(&[Some(b"")]), &mut cells), Ok(()));
        assert_eq!(cells, vec![Cell::Str(String::new())]);
        // no columns (SELECT FROM t): a row of no cells
        assert_eq!(decode_row(&[], &data_row(&[]), &mut cells), Ok(()));
        assert_eq!(cells.len(), 1);
        // malformed bodies and values the plane cannot render fail and leave the cells as they were
        let mut cells = vec![Cell::Int(1)];
        assert_eq!(decode_row(&types[..1], &row, &mut cells), Err("value decode")); // 4 columns, 1 expected
        let mut long = data_row(&[Some(&1i32.to_be_bytes())]);
        long.push(0);
        assert_eq!(decode_row(&types[..1], &long, &mut cells), Err("value decode")); // trailing bytes
        let short = data_row(&[Some(&1i32.to_be_bytes())]);
        assert_eq!(decode_row(&types[..1], &short[..short.len() - 1], &mut cells), Err("value decode")); // cut short
        assert_eq!(decode_row(&types[..1], &[0], &mut cells), Err("value decode")); // no count
        let two = data_row(&[Some(&5i32.to_be_bytes()), Some(&[0xff])]);
        assert_eq!(decode_row(&[&Type::INT4, &Type::TEXT], &two, &mut cells), Err("value the plane cannot render"));
        assert_eq!(cells, vec![Cell::Int(1)]);
    }

    /// The message tags of a run of frontend messages (each a tag, a big-endian length counting itself, a body).
    fn tags(mut b: &[u8]) -> String {
        let mut out = String::new();
        while !b.is_empty() {
            out.push(b[0] as char);
            let len = u32::from_be_bytes([b[1], b[2], b[3], b[4]]) as usize;
            b = &b[1 + len..];
        }
        out
    }

    #[test]
    fn a_write_is_one_sync() {
        // BEGIN, then (the statement's Bind/Execute between), COMMIT and each reset statement, and one Sync at the end
        let f = write_frame();
        assert_eq!(tags(&f.before), "PBE");
        assert_eq!(tags(&f.after), format!("{}S", "PBE".repeat(1 + RESET_STATEMENTS.len())));
        assert!(f.after.windows(7).any(|w| w == b"COMMIT\0"));
        // the simple-query resets say the same statements
        assert_eq!(RESET_SESSION, RESET_STATEMENTS.join("; "));
        assert_eq!(ROLLBACK_RESET_SESSION, format!("ROLLBACK; {RESET_SESSION}"));
        assert!(!RESET_STATEMENTS.contains(&"DISCARD ALL")); // it would deallocate the prepared statements
    }

    #[test]
    fn float4_like_psycopg2() {
        let c = decode(&Type::FLOAT4, Some(&0.1f32.to_be_bytes())).unwrap();
        assert_eq!(c, Cell::Float(0.1));
        let c = decode(&Type::UUID, Some(&[0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0, 1, 2, 3, 4, 5, 6, 7])).unwrap();
        assert_eq!(c, Cell::Str("12345678-9abc-def0-0001-020304050607".into()));
    }
}
