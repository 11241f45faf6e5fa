//! MySQL/MariaDB for the plane: per-thread pools of read-only sessions set up exactly as
//! qag/connectors.py's MySQLConnector does (`SET SESSION max_statement_time = <s>` on MariaDB,
//! `max_execution_time = <ms>` on MySQL, then `SET SESSION TRANSACTION READ ONLY`), prepared statements
//! (binary protocol, cached per session), and result values decoded into what mysql-connector-python's
//! text-protocol conversions would return.

use crate::entries::ConnEntry;
use crate::limits;
use crate::params::PVal;
use crate::error::{ExecError, WriteError};
use crate::pg::decimal_texts;
use crate::pool::{self, Lease, Pool, Pooled, Pools};
use crate::pyfmt::{float_repr, hex};
use crate::render::{Cell, Page};
use mysql_async::consts::{ColumnFlags, ColumnType};
use mysql_async::prelude::Queryable;
use mysql_async::{Column, Conn, OptsBuilder, Params, Row, Statement, Value};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

/// MariaDB and MySQL print a FLOAT/DOUBLE with a fixed number of decimals only below this (NOT_FIXED_DEC).
const NOT_FIXED_DEC: u8 = 31;
/// The `binary` character set: mysql-connector returns such values as bytes (rendered as hex).
const BINARY_CHARSET: u16 = 63;

/// Pool key: everything that defines a session; a changed connection entry makes a new pool.
#[derive(Clone, PartialEq, Debug)]
pub(crate) struct SessionSpec {
    pub(crate) conn: Rc<ConnEntry>,
    pub(crate) password: Option<String>,
    /// cfg.query_timeout in seconds (the plan entry's `query_timeout`).
    pub(crate) timeout: f64,
    /// A write session (connectors.py S1: not read-only), in a pool of its own.
    pub(crate) write: bool,
}

pub(crate) struct Session {
    conn: Conn,
    /// The session's time-limit SET (S1), sent again after a reset (a write session's, S5).
    limit_sql: String,
    healthy: bool,
    /// A command is under way: a lease dropped meanwhile (the call's deadline fired) closes the session.
    busy: bool,
}

impl Pooled for Session {
    type Spec = SessionSpec;

    async fn connect(spec: &SessionSpec) -> Result<Session, ExecError> {
        connect(spec).await
    }

    fn reusable(&self) -> bool {
        self.healthy && !self.busy
    }

    /// Close without waiting on the server: COM_QUIT is written (or not, within 100 ms) and the socket
    /// closed. (Dropping a `Conn` would spawn a clean-up that first reads what the server still owes,
    /// forever when it is frozen.)
    fn close(self) {
        let conn = self.conn;
        tokio::task::spawn_local(async move {
            let _ = tokio::time::timeout(Duration::from_millis(100), conn.disconnect()).await;
        });
    }
}

thread_local! {
    static POOLS: Pools<Session> = RefCell::new(HashMap::new());
    static WRITE_POOLS: Pools<Session> = RefCell::new(HashMap::new());
}

/// The thread's pool of sessions for this connection entry, password and limit (reads and writes apart).
pub(crate) fn pool_for(spec: &SessionSpec) -> Rc<RefCell<Pool<Session>>> {
    pool::pool_for(if spec.write { &WRITE_POOLS } else { &POOLS }, &spec.conn.name, spec)
}

/// The SET that MySQLConnector._open runs first: MariaDB's limit in seconds (3 decimals), MySQL's in ms,
/// each rounded up and at least 10 ms (`limits`: never 0, which is "no limit").
fn time_limit_sql(mariadb: bool, timeout: f64) -> String {
    if mariadb {
        format!("SET SESSION max_statement_time = {}", limits::mariadb_seconds(timeout))
    } else {
        format!("SET SESSION max_execution_time = {}", limits::millis(timeout))
    }
}

async fn connect(spec: &SessionSpec) -> Result<Session, ExecError> {
    // mysql-connector's connection_timeout=max(1, int(round(connect_timeout))), here for the whole set-up
    // (handshake and SETs: a frozen server accepts from its backlog and then never answers)
    let limit = Duration::from_secs_f64(spec.conn.connect_timeout.round().max(1.0));
    match tokio::time::timeout(limit, open(spec)).await {
        Ok(r) => r,
        Err(_) => Err(ExecError::Forward("cannot connect")),
    }
}

async fn open(spec: &SessionSpec) -> Result<Session, ExecError> {
    let c = &spec.conn;
    let opts = OptsBuilder::default()
        .ip_or_hostname(c.host.clone())
        .tcp_port(c.port)
        .user(Some(c.user.clone().unwrap_or_else(|| "root".into())))
        .pass(Some(spec.password.clone().unwrap_or_default()))
        .db_name(c.database.clone())
        // TCP like mysql-connector (a unix socket would be another account: root@localhost)
        .prefer_socket(false)
        .tcp_nodelay(true)
        .tcp_keepalive(Some(limits::KEEPALIVE_IDLE))
        .stmt_cache_size(256);
    let Ok(mut conn) = Conn::new(opts).await else { return Err(ExecError::Forward("cannot connect")) };
    let version: Option<String> = conn.query_first("SELECT VERSION()").await.map_err(|_| ExecError::Forward("cannot connect"))?;
    let mariadb = version.unwrap_or_default().to_ascii_lowercase().contains("mariadb");
    let limit_sql = time_limit_sql(mariadb, spec.timeout);
    conn.query_drop(&limit_sql).await.map_err(|_| ExecError::Forward("session setup"))?;
    if !spec.write {
        conn.query_drop("SET SESSION TRANSACTION READ ONLY").await.map_err(|_| ExecError::Forward("session setup"))?;
    }
    Ok(Session { conn, limit_sql, healthy: true, busy: false })
}

/// A MySQL/MariaDB session's statements, on its lease (`pool::Lease`).
impl Lease<Session> {
    fn conn(&mut self) -> &mut Conn {
        &mut self.session_mut().conn
    }

    /// The session is closed when the lease ends instead of going back to the pool.
    pub(crate) fn retire(&mut self) {
        self.session_mut().healthy = false;
    }

    /// Prepare (or find in the session's statement cache).
    pub(crate) async fn prepare(&mut self, sql: &str) -> Result<Statement, ExecError> {
        self.session_mut().busy = true;
        let res = self.conn().prep(sql).await;
        self.session_mut().busy = false;
        match res {
            Ok(st) => Ok(st),
            Err(e) if is_stale(&e) => {
                self.session_mut().healthy = false;
                Err(ExecError::Stale)
            }
            Err(_) => Err(ExecError::Forward("prepare failed")),
        }
    }

    /// Close a statement and drop it from the session's cache (a one-off statement holding literals). A
    /// failure marks the session broken: it is closed rather than reused.
    pub(crate) async fn close(&mut self, st: Statement) {
        self.session_mut().busy = true;
        let res = self.conn().close(st).await;
        self.session_mut().busy = false;
        if res.is_err() {
            self.session_mut().healthy = false;
        }
    }

    /// Execute; (column names, rows of cells). Errors as MySQLConnector._run maps them.
    pub(crate) async fn query(&mut self, st: &Statement, args: Vec<Value>) -> Result<Page, ExecError> {
        self.session_mut().busy = true;
        let fetched = fetch(self.conn(), st, args).await;
        self.session_mut().busy = false;
        let (columns, rows) = match fetched {
            Ok(x) => x,
            Err(e) => {
                let (err, broken) = classify(e);
                if broken {
                    self.session_mut().healthy = false;
                }
                return Err(err);
            }
        };
        let Some(columns) = columns else { return Err(ExecError::Forward("no result set")) };
        if !columns.iter().all(column_supported) {
            return Err(ExecError::Forward("column type"));
        }
        let names = columns.iter().map(|c| c.name_str().into_owned()).collect();
        let mut page = Page::with_capacity(names, rows.len());
        for mut r in rows {
            for (i, c) in columns.iter().enumerate() {
                let v = r.take(i).unwrap_or(Value::NULL);
                page.cells.push(decode(c, v).ok_or(ExecError::Forward("value the plane cannot render"))?);
            }
            page.rows += 1;
        }
        Ok(page)
    }
}

/// A MySQL/MariaDB write session's statements (server/write.rs).
impl Lease<Session> {
    /// Prepare a write; preparing executes nothing. The statement must give no result set (checked by the
    /// caller before executing).
    pub(crate) async fn prepare_write(&mut self, sql: &str) -> Result<Statement, WriteError> {
        match self.prepare(sql).await {
            Ok(st) => Ok(st),
            Err(ExecError::Stale) => Err(WriteError::Stale),
            Err(_) => Err(WriteError::NotRun("prepare failed")),
        }
    }

    /// Execute a write and commit it; the rows it changed (mysql-connector's rowcount: affected rows, not found
    /// rows, neither driver sets CLIENT_FOUND_ROWS). The session is in autocommit: the statement is its own
    /// transaction, committed by the server when it succeeds and rolled back when it fails (InnoDB), which is
    /// what connectors.py's one statement then COMMIT amounts to, one round trip fewer. Then the session is
    /// reset (S5: writes are always reset): COM_RESET_CONNECTION, then its time limit again.
    ///
    /// A statement the server rejects is `Rejected` with mysql-connector's text of it (`errno (sqlstate):
    /// message`). Unlike PostgreSQL's, a failed statement on a non-transactional table (MyISAM, Aria, MEMORY)
    /// keeps the rows it changed before failing: the plane never runs a write again (server/write.rs).
    pub(crate) async fn write(&mut self, st: &Statement, args: Vec<Value>) -> Result<u64, WriteError> {
        self.session_mut().busy = true;
        let res = async {
            let result = self.conn().exec_iter(st, Params::Positional(args)).await?;
            let rows = result.columns().is_some_and(|c| !c.is_empty());
            let n = result.affected_rows();
            result.drop_result().await?;
            Ok::<(u64, bool), mysql_async::Error>((n, rows))
        }
        .await;
        let out = match res {
            Ok((_, true)) => Err(WriteError::RowsAfterAll),
            Ok((n, false)) => Ok(n),
            Err(mysql_async::Error::Server(e)) if matches!(e.code, 1969 | 3024 | 1317) => Err(WriteError::Timeout),
            Err(e) if is_stale(&e) => {
                self.session_mut().healthy = false;
                Err(WriteError::Lost(e.to_string().lines().next().unwrap_or("Error").to_string()))
            }
            Err(mysql_async::Error::Server(e)) => Err(WriteError::Rejected(format!("{} ({}): {}", e.code, e.state, e.message))),
            Err(e) => {
                self.session_mut().healthy = false;
                Err(WriteError::Lost(e.to_string()))
            }
        };
        let limit_sql = self.session().limit_sql.clone();
        let reset = async {
            self.conn().reset().await?;
            self.conn().query_drop(limit_sql).await
        }
        .await;
        self.session_mut().busy = false;
        if reset.is_err() {
            self.session_mut().healthy = false; // a session whose reset failed is closed, not reused (S5)
        }
        out
    }
}

/// One round trip: COM_STMT_EXECUTE and its (first) result set. The connection drops any further
/// result set before its next command.
async fn fetch(conn: &mut Conn, st: &Statement, args: Vec<Value>) -> mysql_async::Result<(Option<Arc<[Column]>>, Vec<Row>)> {
    let mut result = conn.exec_iter(st, Params::Positional(args)).await?;
    let columns = result.columns();
    let rows = result.collect::<Row>().await?;
    Ok((columns, rows))
}

/// Server errors that mean the session is gone: shutdown in progress (1053), connection killed (1927,
/// MariaDB), disconnected by the server (4031), aborted or broken network exchanges (1152, 1158-1161).
const STALE_CODES: [u16; 8] = [1053, 1927, 4031, 1152, 1158, 1159, 1160, 1161];

/// Whether the session is unusable: one of the errors above, or not a server error at all (the socket
/// failed, the connection closed, the driver lost the protocol).
fn is_stale(e: &mysql_async::Error) -> bool {
    match e {
        mysql_async::Error::Server(s) => STALE_CODES.contains(&s.code) || s.code >= 2000,
        _ => true,
    }
}

/// (how the call is answered, whether the session is broken).
fn classify(e: mysql_async::Error) -> (ExecError, bool) {
    match e {
        // MariaDB max_statement_time, MySQL max_execution_time, interrupted (MySQLConnector._run)
        mysql_async::Error::Server(s) if matches!(s.code, 1969 | 3024 | 1317) => (ExecError::Timeout, false),
        ref e if is_stale(e) => (ExecError::Stale, true),
        _ => (ExecError::Rejected, false),
    }
}

/// The statement with each float put in as the literal mysql-connector writes (`str(float)`, Python's
/// repr: `0.1` is a DECIMAL literal to the server, `1e+16` a DOUBLE), the other markers kept; and the
/// values still to bind. None when the publisher gave no pieces or they do not match the values.
pub(crate) fn with_float_literals(pieces: Option<&[String]>, bound: &[PVal]) -> Option<(String, Vec<PVal>)> {
    let pieces = pieces?;
    if pieces.len() != bound.len() + 1 {
        return None;
    }
    let mut sql = String::with_capacity(pieces.iter().map(String::len).sum::<usize>() + 8 * bound.len());
    let mut rest = Vec::with_capacity(bound.len());
    for (piece, v) in pieces.iter().zip(bound) {
        sql.push_str(piece);
        match v {
            PVal::Float(x) if x.is_finite() => sql.push_str(&float_repr(*x)),
            PVal::Float(_) => return None, // the parameter rules refuse these before binding
            other => {
                sql.push('?');
                rest.push(other.clone());
            }
        }
    }
    sql.push_str(&pieces[bound.len()]);
    Some((sql, rest))
}

/// The value mysql-connector would send for a bound Python value (`%s` interpolation): ints and bools
/// (1/0) as integers, strings as strings, None as NULL. A float is put in the statement's text instead
/// (`with_float_literals`).
pub(crate) fn arg_for(v: &PVal) -> Option<Value> {
    Some(match v {
        PVal::Null => Value::NULL,
        PVal::Int(i) => Value::Int(*i),
        PVal::Bool(b) => Value::Int(*b as i64),
        PVal::Str(s) => Value::Bytes(s.clone().into_bytes()),
        PVal::Float(_) => return None,
    })
}

fn is_int_type(t: ColumnType) -> bool {
    use ColumnType::*;
    matches!(t, MYSQL_TYPE_TINY | MYSQL_TYPE_SHORT | MYSQL_TYPE_LONG | MYSQL_TYPE_LONGLONG | MYSQL_TYPE_INT24 | MYSQL_TYPE_YEAR)
}

/// Whether the plane renders a column of this type exactly as mysql-connector + render.py would.
/// Not: SET (a Python set), GEOMETRY and VECTOR (driver-specific objects), anything unknown.
pub(crate) fn column_supported(c: &Column) -> bool {
    use ColumnType::*;
    if c.flags().contains(ColumnFlags::SET_FLAG) {
        return false;
    }
    is_int_type(c.column_type())
        || matches!(
            c.column_type(),
            MYSQL_TYPE_DECIMAL | MYSQL_TYPE_NEWDECIMAL | MYSQL_TYPE_FLOAT | MYSQL_TYPE_DOUBLE | MYSQL_TYPE_NULL
                | MYSQL_TYPE_TIMESTAMP | MYSQL_TYPE_TIMESTAMP2 | MYSQL_TYPE_DATE | MYSQL_TYPE_NEWDATE | MYSQL_TYPE_TIME
                | MYSQL_TYPE_TIME2 | MYSQL_TYPE_DATETIME | MYSQL_TYPE_DATETIME2 | MYSQL_TYPE_VARCHAR | MYSQL_TYPE_BIT
                | MYSQL_TYPE_JSON | MYSQL_TYPE_ENUM | MYSQL_TYPE_TINY_BLOB | MYSQL_TYPE_MEDIUM_BLOB | MYSQL_TYPE_LONG_BLOB
                | MYSQL_TYPE_BLOB | MYSQL_TYPE_VAR_STRING | MYSQL_TYPE_STRING
        )
}

fn days_in_month(y: u16, m: u8) -> u8 {
    match m {
        4 | 6 | 9 | 11 => 30,
        2 if (y.is_multiple_of(4) && !y.is_multiple_of(100)) || y.is_multiple_of(400) => 29,
        2 => 28,
        _ => 31,
    }
}

/// datetime.date(y, m, d).isoformat(); None where Python's constructor raises (the connector gives None:
/// zero dates, zero months or days).
fn date_iso(y: u16, m: u8, d: u8) -> Option<String> {
    if !(1..=9999).contains(&y) || !(1..=12).contains(&m) || d == 0 || d > days_in_month(y, m) {
        return None;
    }
    Some(format!("{y:04}-{m:02}-{d:02}"))
}

/// datetime.datetime(...).isoformat(): "T", and ".ffffff" only when microseconds are not zero.
fn datetime_iso(y: u16, mo: u8, d: u8, h: u8, mi: u8, s: u8, us: u32) -> Option<String> {
    let date = date_iso(y, mo, d)?;
    if h > 23 || mi > 59 || s > 59 || us > 999_999 {
        return None;
    }
    let mut t = format!("{date}T{h:02}:{mi:02}:{s:02}");
    if us != 0 {
        t.push_str(&format!(".{us:06}"));
    }
    Some(t)
}

/// A TIME as the connector's datetime.timedelta: (str(td), repr(td.total_seconds())).
fn timedelta_texts(neg: bool, days: u32, h: u8, m: u8, s: u8, us: u32) -> (String, String) {
    let mag = ((days as i64 * 24 + h as i64) * 3600 + m as i64 * 60 + s as i64) * 1_000_000 + us as i64;
    let total = if neg { -mag } else { mag };
    // timedelta normalises to days (may be negative), 0 <= seconds < 86400, 0 <= microseconds < 10**6
    let d = total.div_euclid(86_400_000_000);
    let rest = total.rem_euclid(86_400_000_000);
    let (secs, micro) = (rest / 1_000_000, rest % 1_000_000);
    let mut text = String::new();
    if d != 0 {
        text.push_str(&format!("{d} day{}, ", if d.abs() != 1 { "s" } else { "" }));
    }
    text.push_str(&format!("{}:{:02}:{:02}", secs / 3600, secs / 60 % 60, secs % 60));
    if micro != 0 {
        text.push_str(&format!(".{micro:06}"));
    }
    // total_seconds() = microseconds / 10**6, one correctly rounded division (exact operands below 2**53)
    (text, float_repr(total as f64 / 1e6))
}

/// A FLOAT/DOUBLE as Python's float() of the server's text for it.
fn float_cell(v: f64, single: bool, decimals: u8) -> Option<Cell> {
    if !v.is_finite() {
        return None;
    }
    let text = if decimals < NOT_FIXED_DEC {
        format!("{:.*}", decimals as usize, v) // FLOAT(M,D)/DOUBLE(M,D), ROUND(x, D): fixed decimals
    } else if single {
        format!("{v:.5e}") // a FLOAT's text has 6 significant digits (FLT_DIG)
    } else {
        return Some(Cell::Float(v)); // a DOUBLE's text is the shortest that round-trips
    };
    Some(Cell::Float(text.parse().ok()?))
}

/// The text of a DECIMAL (as the server sends it: "-12.50") as Cell::Decimal.
fn decimal_cell(b: &[u8]) -> Option<Cell> {
    let s = std::str::from_utf8(b).ok()?;
    let (neg, digits) = match s.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, s),
    };
    let (int_part, frac) = digits.split_once('.').unwrap_or((digits, ""));
    if int_part.is_empty() || !int_part.bytes().all(|c| c.is_ascii_digit()) || !frac.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let trimmed = int_part.trim_start_matches('0');
    let int_part = if trimmed.is_empty() { "0" } else { trimmed };
    let (text, num) = decimal_texts(neg, int_part, frac)?;
    Some(Cell::Decimal { text, num })
}

fn big_int_cell(v: u64) -> Cell {
    match i64::try_from(v) {
        Ok(i) => Cell::Int(i),
        Err(_) => Cell::Decimal { text: v.to_string(), num: v.to_string() }, // a Python int above 2**63
    }
}

/// One binary-protocol value as mysql-connector's text conversion would return it; None when the
/// plane cannot reproduce it (the call is forwarded).
pub(crate) fn decode(c: &Column, v: Value) -> Option<Cell> {
    use ColumnType::*;
    let t = c.column_type();
    Some(match v {
        Value::NULL => Cell::Null,
        Value::Int(i) if is_int_type(t) => Cell::Int(i),
        Value::UInt(u) if is_int_type(t) => big_int_cell(u),
        Value::Float(f) if t == MYSQL_TYPE_FLOAT => float_cell(f as f64, true, c.decimals())?,
        Value::Double(f) if t == MYSQL_TYPE_DOUBLE => float_cell(f, false, c.decimals())?,
        Value::Date(y, mo, d, h, mi, s, us) => match t {
            MYSQL_TYPE_DATE | MYSQL_TYPE_NEWDATE => match date_iso(y, mo, d) {
                Some(x) => Cell::Str(x),
                None => Cell::Null,
            },
            MYSQL_TYPE_DATETIME | MYSQL_TYPE_DATETIME2 | MYSQL_TYPE_TIMESTAMP | MYSQL_TYPE_TIMESTAMP2 => {
                match datetime_iso(y, mo, d, h, mi, s, us) {
                    Some(x) => Cell::Str(x),
                    None => Cell::Null,
                }
            }
            _ => return None,
        },
        Value::Time(neg, days, h, m, s, us) if matches!(t, MYSQL_TYPE_TIME | MYSQL_TYPE_TIME2) => {
            let (text, num) = timedelta_texts(neg, days, h, m, s, us);
            Cell::Decimal { text, num }
        }
        Value::Bytes(b) => match t {
            MYSQL_TYPE_DECIMAL | MYSQL_TYPE_NEWDECIMAL => decimal_cell(&b)?,
            MYSQL_TYPE_BIT => {
                if b.len() > 8 {
                    return None;
                }
                big_int_cell(b.iter().fold(0u64, |acc, x| (acc << 8) | *x as u64))
            }
            // MySQL's JSON type is text whatever its character set says
            MYSQL_TYPE_JSON => Cell::Str(String::from_utf8(b).ok()?),
            _ if is_int_type(t) => return None,
            _ if c.character_set() == BINARY_CHARSET => Cell::Str(hex(&b)),
            // the connector decodes other text as UTF-8 and gives bytes back when it cannot
            _ => match String::from_utf8(b) {
                Ok(s) => Cell::Str(s),
                Err(e) => Cell::Str(hex(e.as_bytes())),
            },
        },
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timedeltas_like_python() {
        // str(timedelta(hours=12, seconds=1.5)), .total_seconds()
        assert_eq!(timedelta_texts(false, 0, 12, 0, 1, 500_000), ("12:00:01.500000".into(), "43201.5".into()));
        // -00:00:01.5 -> timedelta(seconds=-1.5) = "-1 day, 23:59:58.500000"
        assert_eq!(timedelta_texts(true, 0, 0, 0, 1, 500_000), ("-1 day, 23:59:58.500000".into(), "-1.5".into()));
        // 838:59:59 = 34 days 22:59:59
        assert_eq!(timedelta_texts(false, 34, 22, 59, 59, 0), ("34 days, 22:59:59".into(), "3020399.0".into()));
        assert_eq!(timedelta_texts(false, 1, 0, 0, 0, 0), ("1 day, 0:00:00".into(), "86400.0".into()));
        assert_eq!(timedelta_texts(false, 0, 0, 0, 0, 0), ("0:00:00".into(), "0.0".into()));
    }

    #[test]
    fn dates_like_the_connector() {
        assert_eq!(date_iso(2026, 11, 30).unwrap(), "2026-11-30");
        assert!(date_iso(0, 0, 0).is_none() && date_iso(2023, 2, 29).is_none() && date_iso(2024, 2, 29).is_some());
        assert_eq!(datetime_iso(2020, 1, 1, 10, 0, 0, 123_000).unwrap(), "2020-01-01T10:00:00.123000");
        assert_eq!(datetime_iso(2020, 1, 1, 10, 0, 0, 0).unwrap(), "2020-01-01T10:00:00");
    }

    #[test]
    fn floats_like_float_of_the_server_text() {
        // FLOAT 0.44949105381965637 is sent as "0.449491" (6 digits): Python reads 0.449491
        assert_eq!(float_cell(0.449_491_053_819_656_37, true, 31), Some(Cell::Float(0.449491)));
        assert_eq!(float_cell(1234567.0, true, 31), Some(Cell::Float(1234570.0)));
        assert_eq!(float_cell(1.005, false, 2), Some(Cell::Float(1.0)), "DOUBLE(10,2) text 1.00 (1.005 is below)");
        assert_eq!(float_cell(0.1, false, 31), Some(Cell::Float(0.1)));
        assert_eq!(decimal_cell(b"-0.50"), Some(Cell::Decimal { text: "-0.50".into(), num: "-0.50".into() }));
        assert_eq!(decimal_cell(b"12.00"), Some(Cell::Decimal { text: "12.00".into(), num: "12.00".into() }));
        assert_eq!(decimal_cell(b"0.0000001"), Some(Cell::Decimal { text: "1E-7".into(), num: "0.0000001".into() }));
        assert_eq!(decimal_cell(b"007.5"), Some(Cell::Decimal { text: "7.5".into(), num: "7.5".into() }));
    }

    #[test]
    fn floats_become_the_literals_mysql_connector_writes() {
        let pieces: Vec<String> = ["SELECT ", " AS f, ", " AS s FROM t WHERE x > ", " AND y = ", ""].iter().map(|s| s.to_string()).collect();
        let bound = vec![PVal::Float(0.1), PVal::Str("a".into()), PVal::Float(1e16), PVal::Int(3)];
        let (sql, rest) = with_float_literals(Some(&pieces), &bound).expect("pieces match");
        assert_eq!(sql, "SELECT 0.1 AS f, ? AS s FROM t WHERE x > 1e+16 AND y = ?");
        assert_eq!(rest, vec![PVal::Str("a".into()), PVal::Int(3)]);
        let (sql, _) = with_float_literals(Some(&pieces[..2]), &[PVal::Float(-2.5)]).expect("one marker");
        assert_eq!(sql, "SELECT -2.5 AS f, ");
        assert!(with_float_literals(Some(&pieces), &bound[..3]).is_none(), "pieces and values must match");
        assert!(with_float_literals(None, &bound).is_none(), "an older publisher: forwarded");
    }
}
