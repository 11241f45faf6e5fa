//! The payloads the plane exchanges with Python through the segment (shm/LAYOUT.md [Entries], [Run record]),
//! the twin of qag/entries.py: the key, plan and connection entries Python publishes in the cache, validated
//! against the current generations (anything malformed or stale is a miss), and the run record the plane
//! writes into its ring. Each payload's fields are declared once below (`KEY_FIELDS`…`RUN_FIELDS`); the
//! tests (tests/entries_vectors.rs) decode the golden vectors `python -m shm.vectors` wrote field by field
//! and fail when a field is declared on one side only.

use crate::mask::Action;
use crate::msgpack::{self, Enc, Value};
use crate::params::Spec;
use crate::segment::{GenKind, Segment};
use std::any::Any;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;
use std::net::IpAddr;

/// LAYOUT.md [Key entry]: the fields of a key entry, in the order Python writes them (E4). `row` is read by
/// other Python workers only.
pub const KEY_FIELDS: &[&str] = &["name", "active", "expires_at_us", "allowed_ips", "prev", "prev_until_us", "gen", "rate_limit", "row"];

/// LAYOUT.md [Plan entry] (E4). `sql_driver`, `write_ops` and `tables` are Python's; the plane ignores them.
pub const PLAN_FIELDS: &[&str] = &[
    "query", "version", "published_version", "connection", "dialect", "sql_native", "sql_driver", "sql_pieces",
    "arg_names", "specs", "transforms", "names", "page_mode", "is_write", "write_ops", "tables", "gens", "cache_ttl",
    "default_page_size", "max_page_size", "query_timeout", "state_free", "response_prefix", "server_allows_writes",
    "key_allows_writes", "allowed_write_ops",
];

/// LAYOUT.md [Plan entry] `specs`: each declared parameter, as `Spec::from_value` reads it (E4).
pub const SPEC_FIELDS: &[&str] =
    &["name", "type", "required", "has_default", "default", "enum", "min", "max", "min_length", "max_length", "pattern"];

/// LAYOUT.md [Connection entry] (E4).
pub const CONNECTION_FIELDS: &[&str] = &["db", "host", "port", "user", "database", "options", "active", "gen", "connect_timeout"];

/// LAYOUT.md [Run record] RR1: the run record's fields, in their order in the array.
pub const RUN_FIELDS: [&str; 16] = [
    "v", "at_us", "key_name", "query", "version", "connection", "status", "code", "rows", "duration_us", "bytes",
    "request_id", "served_by", "transport", "route", "error",
];

/// RR3: the run record's major version, its first field.
pub const RUN_VERSION: u64 = 1;

/// One served call as the plane records it (LAYOUT.md [Run record]): `encode` writes RUN_FIELDS in order.
#[derive(Debug, Clone, PartialEq)]
pub struct RunRecord<'a> {
    pub at_us: i64,
    pub key_name: Option<&'a str>,
    pub query: Option<&'a str>,
    pub version: Option<i64>,
    pub connection: Option<&'a str>,
    pub status: u16,
    pub code: Option<&'a str>,
    pub rows: i64,
    pub duration_us: i64,
    pub bytes: i64,
    pub request_id: &'a str,
    pub served_by: &'a str,
    pub transport: &'a str,
    pub route: &'a str,
    /// RR5 (format 1.1): what the database said of a failed call, for administrators; None when it said nothing.
    pub error: Option<&'a str>,
}

impl RunRecord<'_> {
    /// RR1: the msgpack array, byte-identical to qag/entries.py's `pack_run` for the same values.
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.array(RUN_FIELDS.len());
        e.uint(RUN_VERSION);
        e.int(self.at_us);
        e.opt_str(self.key_name);
        e.opt_str(self.query);
        e.opt_int(self.version);
        e.opt_str(self.connection);
        e.uint(self.status as u64);
        e.opt_str(self.code);
        e.int(self.rows);
        e.int(self.duration_us);
        e.int(self.bytes);
        e.str(self.request_id);
        e.str(self.served_by);
        e.str(self.transport);
        e.str(self.route);
        e.opt_str(self.error);
        e.0
    }
}

/// Cache key of a key entry: b"k:" + lowercase hex sha256(secret).
pub fn key_cache_key(secret_sha256_hex: &str) -> Vec<u8> {
    format!("k:{secret_sha256_hex}").into_bytes()
}

pub fn plan_cache_key(key_name: &str, query: &str) -> Vec<u8> {
    let mut k = b"p:".to_vec();
    k.extend_from_slice(key_name.as_bytes());
    k.push(0);
    k.extend_from_slice(query.as_bytes());
    k
}

pub fn conn_cache_key(name: &str) -> Vec<u8> {
    format!("c:{name}").into_bytes()
}

type MemoMap = HashMap<Vec<u8>, (Vec<u8>, Rc<dyn Any>)>;

thread_local! {
    /// Parsed entries by cache key, with the raw bytes they were parsed from: an unchanged entry is not
    /// decoded again (the generations are still checked on every call, by the callers).
    static MEMO: RefCell<MemoMap> = RefCell::new(HashMap::new());
}

/// The entry under `key`, parsed once per distinct value. E4: an entry is one msgpack map; any other value
/// is a miss. Its generations (E1) are checked by each `load`, on every call.
fn fetch<T: 'static>(seg: &Segment, key: &[u8], parse: fn(&[u8], &Value) -> Option<T>) -> Option<Rc<T>> {
    let raw = seg.cache_get(key)?;
    let hit = MEMO.with(|m| {
        let m = m.borrow();
        let (old, v) = m.get(key)?;
        if *old == raw { v.clone().downcast::<Option<Rc<T>>>().ok() } else { None }
    });
    let entry = match hit {
        Some(e) => e,
        None => {
            let parsed: Rc<Option<Rc<T>>> = Rc::new(match msgpack::decode(&raw) {
                Some(v @ Value::Map(_)) => parse(key, &v).map(Rc::new),
                _ => None,
            });
            MEMO.with(|m| {
                let mut m = m.borrow_mut();
                if m.len() > 20_000 {
                    m.clear();
                }
                m.insert(key.to_vec(), (raw, parsed.clone() as Rc<dyn Any>));
            });
            parsed
        }
    };
    (*entry).clone()
}

fn opt_i64(v: &Value, k: &str) -> Option<Option<i64>> {
    match v.get(k) {
        None | Some(Value::Nil) => Some(None),
        Some(x) => Some(Some(x.as_i64()?)),
    }
}

#[derive(Debug, Clone)]
pub struct KeyEntry {
    pub name: String,
    pub active: bool,
    pub expires_at_us: Option<i64>,
    pub allowed_ips: Option<Vec<String>>,
    pub prev: bool,
    pub prev_until_us: Option<i64>,
    pub rate_limited: bool,
    pub gen: u64,
}

impl KeyEntry {
    /// The current key entry for this secret hash, or None (missing, stale, malformed: forward).
    pub fn load(seg: &Segment, secret_hash: &str) -> Option<Rc<KeyEntry>> {
        let k = fetch(seg, &key_cache_key(secret_hash), |_, v| KeyEntry::parse(v))?;
        if seg.gen(GenKind::Key, &k.name) != k.gen {
            return None;
        }
        Some(k)
    }

    fn parse(v: &Value) -> Option<KeyEntry> {
        let name = v.get("name")?.as_str()?.to_string();
        let gen = v.get("gen")?.as_u64()?;
        let allowed_ips = match v.get("allowed_ips") {
            None | Some(Value::Nil) => None,
            Some(a) => Some(a.as_array()?.iter().map(|x| x.as_str().map(str::to_string)).collect::<Option<Vec<_>>>()?),
        };
        Some(KeyEntry {
            name,
            active: v.get("active")?.as_bool()?,
            expires_at_us: opt_i64(v, "expires_at_us")?,
            allowed_ips,
            prev: v.get("prev").and_then(Value::as_bool).unwrap_or(false),
            prev_until_us: opt_i64(v, "prev_until_us")?,
            rate_limited: !matches!(v.get("rate_limit"), None | Some(Value::Nil)),
            gen,
        })
    }

    /// Runtime._check_key: Some(true) when the key may call now from `ip`; None when an allowed_ips entry
    /// is in a form only Python's ipaddress reads (a netmask, a scope id…): the call is forwarded.
    pub fn allows(&self, now_us: i64, ip: Option<IpAddr>) -> Option<bool> {
        if let Some(nets) = &self.allowed_ips {
            if nets.iter().any(|n| parse_net(n).is_none()) {
                return None;
            }
        }
        Some(self.allows_parsed(now_us, ip))
    }

    fn allows_parsed(&self, now_us: i64, ip: Option<IpAddr>) -> bool {
        let now_us = now_us - now_us.rem_euclid(1000); // Python compares millisecond RFC 3339 texts
        if !self.active {
            return false;
        }
        if self.expires_at_us.is_some_and(|e| e <= now_us) {
            return false;
        }
        if self.prev && self.prev_until_us.is_none_or(|u| u <= now_us) {
            return false;
        }
        if let Some(nets) = &self.allowed_ips {
            if !nets.is_empty() {
                let Some(ip) = ip else { return false };
                return nets.iter().any(|n| ip_in(ip, n));
            }
        }
        true
    }
}

/// A network in the plain forms both parsers read alike: "addr" or "addr/bits" (decimal bits).
fn parse_net(net: &str) -> Option<(IpAddr, u32)> {
    let (addr, bits) = match net.split_once('/') {
        Some((a, b)) => (a, Some(b)),
        None => (net, None),
    };
    if !addr.bytes().all(|b| b.is_ascii_hexdigit() || b == b'.' || b == b':') {
        return None;
    }
    let na = addr.parse::<IpAddr>().ok()?;
    let width = if na.is_ipv4() { 32 } else { 128 };
    let bits = match bits {
        None => width,
        Some(b) if !b.is_empty() && b.len() <= 3 && b.bytes().all(|c| c.is_ascii_digit()) => b.parse().ok().filter(|n| *n <= width)?,
        Some(_) => return None,
    };
    Some((na, bits))
}

/// ipaddress.ip_network(n, strict=False) membership, for networks parse_net reads.
pub fn ip_in(ip: IpAddr, net: &str) -> bool {
    let Some((na, bits)) = parse_net(net) else { return false };
    let ip = match (ip, na) {
        (IpAddr::V6(v6), IpAddr::V4(_)) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => return false,
        },
        _ => ip,
    };
    let width = if na.is_ipv4() { 32 } else { 128 };
    let to_u128 = |a: IpAddr| match a {
        IpAddr::V4(x) => u32::from(x) as u128,
        IpAddr::V6(x) => u128::from(x),
    };
    if ip.is_ipv4() != na.is_ipv4() {
        return false;
    }
    if bits == 0 {
        return true;
    }
    let shift = width - bits;
    (to_u128(ip) >> shift) == (to_u128(na) >> shift)
}

#[derive(Debug, Clone)]
pub struct PlanEntry {
    pub query: String,
    pub version: i64,
    /// The query's published version when the entry was written (LAYOUT.md [Plan entry], 1.1). The plane
    /// serves an entry only when it equals `version`: it serves calls without `version`, which run the
    /// published one; an entry without the field (an older publisher) is forwarded.
    pub published_version: Option<i64>,
    pub connection: String,
    pub dialect: String,
    pub sql_native: String,
    /// MySQL: the saved SQL's text around its markers (one more piece than markers), so that a float is put
    /// in as the literal mysql-connector sends (Python's repr) while the other values stay bound.
    pub sql_pieces: Option<Vec<String>>,
    pub arg_names: Vec<String>,
    pub specs: Vec<Spec>,
    pub transforms: Option<Vec<Action>>,
    /// governance's traced name per output position (None: unknown), checked against the result's names.
    pub output_names: Option<Vec<Option<String>>>,
    /// The entry says whether names were traced ("names" present, even nil). A masking plan from a
    /// publisher that does not say is forwarded: Python checks the names at call time, the plane could not.
    pub names_published: bool,
    /// connectors.py S5 (LAYOUT.md [Plan entry], 1.1): the statement is proven to leave no session state behind. False
    /// (or absent): the session is reset after the call (PostgreSQL) or closed (MySQL).
    pub state_free: bool,
    /// A saved query with `cache_ttl`: its calls are answered from the host's response cache (a fresh record
    /// under `response_prefix` + the call's suffix), or forwarded (a miss: Python fills the cache).
    pub cache_ttl: bool,
    /// LAYOUT.md [Plan entry] 23 (entries 1.2), [Response cache] R5: the prefix of this plan's cached answers'
    /// keys (query, version, connection, generations, the masking fingerprint). None: not cacheable, or an
    /// older publisher: a call of a query with `cache_ttl` is then forwarded.
    pub response_prefix: Option<Vec<u8>>,
    pub page_mode: String,
    pub is_write: bool,
    /// LAYOUT.md [Plan entry] P3 (1.3): the write may be served by the plane: `is_write`, the server's and the
    /// key's write settings both true, and `write_ops` (not empty) all within `allowed_write_ops` (nil: any).
    /// False for every read, and for a write whose entry lacks any of the three (a publisher before 1.3): forwarded.
    pub write_allowed: bool,
    /// The statement's write operations (informative for Python; the plane serves only plain DML, write.rs).
    pub write_ops: Vec<String>,
    pub default_page_size: i64,
    pub max_page_size: i64,
    pub query_timeout: f64,
    pub gens: [u64; 3],
}

pub enum PlanLookup {
    Miss,
    /// Present and current but the plane cannot serve it (bad pattern, unknown field): forward.
    Unservable,
    Hit(Rc<PlanEntry>),
}

impl PlanEntry {
    pub fn load(seg: &Segment, key_name: &str, query: &str) -> PlanLookup {
        let Some(p) = fetch(seg, &plan_cache_key(key_name, query), |_, v| Self::parse_any(v)) else { return PlanLookup::Miss };
        let current = [seg.gen(GenKind::Key, key_name), seg.gen(GenKind::Query, query), seg.gen(GenKind::Connection, &p.1)];
        if p.0 != current {
            return PlanLookup::Miss;
        }
        match &p.2 {
            Some(plan) if plan.query == query => PlanLookup::Hit(plan.clone()),
            _ => PlanLookup::Unservable,
        }
    }

    /// A plan entry's payload decoded on its own, without E1's check of its generations (tests, tools); None
    /// when it is malformed or not one the plane can serve.
    pub fn from_payload(payload: &[u8]) -> Option<PlanEntry> {
        let (_, _, plan) = Self::parse_any(&msgpack::decode(payload)?)?;
        plan.map(|p| (*p).clone())
    }

    /// (gens, connection, the plan if the plane can serve it): the generations are read even from an
    /// entry the plane cannot serve, so a stale one is a miss and a current one is forwarded.
    #[allow(clippy::type_complexity)]
    fn parse_any(v: &Value) -> Option<([u64; 3], String, Option<Rc<PlanEntry>>)> {
        let g = v.get("gens")?.as_array()?;
        let gens = [g.first()?.as_u64()?, g.get(1)?.as_u64()?, g.get(2)?.as_u64()?];
        let conn = v.get("connection")?.as_str()?.to_string();
        Some((gens, conn, Self::parse(v, gens).map(Rc::new)))
    }

    fn parse(v: &Value, gens: [u64; 3]) -> Option<PlanEntry> {
        let transforms = match v.get("transforms") {
            None | Some(Value::Nil) => None,
            Some(t) => Some(t.as_array()?.iter().map(|a| Action::parse(a.as_str().or(if a.is_nil() { None } else { Some("?") })))
                .collect::<Option<Vec<_>>>()?),
        };
        Some(PlanEntry {
            query: v.get("query")?.as_str()?.to_string(),
            version: v.get("version")?.as_i64()?,
            published_version: opt_i64(v, "published_version")?,
            connection: v.get("connection")?.as_str()?.to_string(),
            dialect: v.get("dialect")?.as_str()?.to_string(),
            sql_native: v.get("sql_native")?.as_str()?.to_string(),
            sql_pieces: match v.get("sql_pieces") {
                None | Some(Value::Nil) => None,
                Some(a) => Some(a.as_array()?.iter().map(|x| x.as_str().map(str::to_string)).collect::<Option<_>>()?),
            },
            arg_names: v.get("arg_names")?.as_array()?.iter().map(|x| x.as_str().map(str::to_string)).collect::<Option<_>>()?,
            specs: v.get("specs")?.as_array()?.iter().map(Spec::from_value).collect::<Option<_>>()?,
            transforms,
            names_published: v.get("names").is_some(),
            state_free: v.get("state_free").and_then(Value::as_bool).unwrap_or(false),
            cache_ttl: !matches!(v.get("cache_ttl"), None | Some(Value::Nil) | Some(Value::UInt(0)) | Some(Value::Int(0))),
            response_prefix: match v.get("response_prefix") {
                Some(Value::Bin(b)) => Some(b.clone()),
                _ => None,
            },
            output_names: match v.get("names") {
                None | Some(Value::Nil) => None,
                Some(a) => Some(a.as_array()?.iter().map(|x| if x.is_nil() { Some(None) } else { x.as_str().map(|s| Some(s.to_string())) })
                    .collect::<Option<Vec<_>>>()?),
            },
            page_mode: v.get("page_mode")?.as_str()?.to_string(),
            is_write: v.get("is_write")?.as_bool()?,
            write_allowed: write_allowed(v),
            write_ops: match v.get("write_ops").and_then(Value::as_array) {
                Some(a) => a.iter().filter_map(|o| o.as_str().map(str::to_ascii_lowercase)).collect(),
                None => Vec::new(),
            },
            default_page_size: v.get("default_page_size")?.as_i64()?,
            max_page_size: v.get("max_page_size")?.as_i64()?,
            query_timeout: v.get("query_timeout")?.as_f64()?,
            gens,
        })
    }

    /// CompiledTransforms.check_names: every position, masked or not, must carry the column the plan traced
    /// (compared lowercased, after a "t." prefix, on 63 characters): a table changed under SELECT * could put a
    /// column a rule covers where the plan traced an unmasked one. False = Python refuses (403): forward.
    pub fn names_match(&self, columns: &[String]) -> bool {
        let (Some(acts), Some(names)) = (&self.transforms, &self.output_names) else { return true };
        let norm = |s: &str| -> Option<String> {
            let last = s.rsplit('.').next().unwrap_or(s);
            if !last.is_ascii() {
                return None; // Unicode lower() and truncation: leave it to Python
            }
            Some(last.to_ascii_lowercase().chars().take(63).collect())
        };
        for i in 0..acts.len() {
            if i >= columns.len() {
                continue;
            }
            let Some(Some(want)) = names.get(i) else { continue };
            match (norm(&columns[i]), norm(want)) {
                (Some(g), Some(w)) if g == w => {}
                _ => return false,
            }
        }
        true
    }

    /// Plan.paged_sql for one page (+1 row to know whether there is more).
    pub fn paged_sql(&self, page: i64, page_size: i64) -> Option<String> {
        self.paged(&self.sql_native, page, page_size)
    }

    /// `base` (the native SQL, or it with literals put in) paged as Plan.paged_sql does.
    pub fn paged(&self, base: &str, page: i64, page_size: i64) -> Option<String> {
        match self.page_mode.as_str() {
            "append" => Some(format!("{}\nLIMIT {} OFFSET {}", base, page_size + 1, (page - 1) * page_size)),
            "wrap" => Some(format!(
                "SELECT * FROM (\n{}\n) AS qag_page LIMIT {} OFFSET {}",
                base,
                page_size + 1,
                (page - 1) * page_size
            )),
            _ => None,
        }
    }
}

/// P3: whether an entry's write decisions let the plane serve its write. Fails closed: a field absent or of
/// another type, an empty `write_ops`, any operation outside `allowed_write_ops` (compared lowercased, as
/// governance compares them) is a no.
fn write_allowed(v: &Value) -> bool {
    let yes = |k: &str| v.get(k).and_then(Value::as_bool) == Some(true);
    if !(v.get("is_write").and_then(Value::as_bool) == Some(true) && yes("server_allows_writes") && yes("key_allows_writes")) {
        return false;
    }
    let strs = |x: &Value| x.as_array()?.iter().map(|o| o.as_str().map(str::to_ascii_lowercase)).collect::<Option<Vec<_>>>();
    let Some(ops) = v.get("write_ops").and_then(strs) else { return false };
    if ops.is_empty() {
        return false;
    }
    match v.get("allowed_write_ops") {
        Some(Value::Nil) => true,
        Some(a) => strs(a).is_some_and(|allowed| ops.iter().all(|o| allowed.contains(o))),
        None => false,
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ConnEntry {
    pub name: String,
    pub db: String,
    pub host: String,
    pub port: u16,
    pub user: Option<String>,
    pub database: Option<String>,
    pub options: BTreeMap<String, String>,
    /// cfg.connect_timeout in seconds (qag/entries.py; absent from older publishers: 3 s).
    pub connect_timeout: f64,
    pub gen: u64,
}

impl ConnEntry {
    pub fn load(seg: &Segment, name: &str) -> Option<Rc<ConnEntry>> {
        let c = fetch(seg, &conn_cache_key(name), ConnEntry::parse)?;
        if seg.gen(GenKind::Connection, name) != c.gen {
            return None;
        }
        Some(c)
    }

    fn parse(key: &[u8], v: &Value) -> Option<ConnEntry> {
        let gen = v.get("gen")?.as_u64()?;
        if v.get("active").and_then(Value::as_bool) == Some(false) {
            return None; // Python answers 502 for an inactive connection
        }
        let s = |k: &str| v.get(k).and_then(Value::as_str).filter(|s| !s.is_empty()).map(str::to_string);
        let mut options = BTreeMap::new();
        if let Some(Value::Map(m)) = v.get("options") {
            for (k, x) in m {
                let text = match x {
                    Value::Str(s) => s.clone(),
                    Value::Nil => continue,
                    other => match other.as_i64() {
                        Some(i) => i.to_string(),
                        None => return None,
                    },
                };
                options.insert(k.as_str()?.to_string(), text);
            }
        }
        let db = v.get("db")?.as_str()?.to_string();
        let port = match v.get("port") {
            None | Some(Value::Nil) => if db == "mysql" || db == "mariadb" { 3306 } else { 5432 },
            Some(p) => u16::try_from(p.as_i64().or_else(|| p.as_str().and_then(|s| s.parse().ok()))?).ok()?,
        };
        Some(ConnEntry {
            name: String::from_utf8(key.strip_prefix(b"c:")?.to_vec()).ok()?,
            db,
            host: s("host").unwrap_or_else(|| "127.0.0.1".into()),
            port,
            user: s("user"),
            database: s("database"),
            options,
            connect_timeout: v.get("connect_timeout").and_then(Value::as_f64).filter(|t| *t > 0.0).unwrap_or(3.0),
            gen,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidr_like_ipaddress() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(ip_in(ip("10.1.2.3"), "10.0.0.0/8"));
        assert!(ip_in(ip("10.1.2.3"), "10.1.2.3"));
        assert!(!ip_in(ip("10.1.2.4"), "10.1.2.3/32"));
        assert!(ip_in(ip("10.1.2.3"), "10.1.2.99/24"), "strict=False: host bits ignored");
        assert!(ip_in(ip("::1"), "::1/128"));
        assert!(!ip_in(ip("127.0.0.1"), "::1"));
        assert!(!ip_in(ip("127.0.0.1"), "bogus"));
        assert!(parse_net(" 10.0.0.0/8").is_none() && parse_net("10.0.0.0/ 8").is_none() && parse_net("fe80::1%eth0").is_none());
        assert!(ip_in(ip("1.2.3.4"), "0.0.0.0/0"));
    }

    fn write_entry(fields: &[(&str, Value)]) -> Value {
        let strs = |v: &[&str]| Value::Array(v.iter().map(|s| Value::Str(s.to_string())).collect());
        let mut m: Vec<(Value, Value)> = vec![
            (Value::Str("is_write".into()), Value::Bool(true)),
            (Value::Str("write_ops".into()), strs(&["update"])),
            (Value::Str("server_allows_writes".into()), Value::Bool(true)),
            (Value::Str("key_allows_writes".into()), Value::Bool(true)),
            (Value::Str("allowed_write_ops".into()), strs(&["insert", "update"])),
        ];
        for (k, v) in fields {
            m.retain(|(n, _)| n.as_str() != Some(k));
            if !matches!(v, Value::Bin(_)) {
                m.push((Value::Str(k.to_string()), v.clone())); // Bin: the field left out
            }
        }
        Value::Map(m)
    }

    #[test]
    fn a_write_is_the_planes_only_when_its_entry_says_yes_to_all_p3() {
        let strs = |v: &[&str]| Value::Array(v.iter().map(|s| Value::Str(s.to_string())).collect());
        let absent = Value::Bin(vec![]);
        assert!(write_allowed(&write_entry(&[])), "server, key and allowed_write_ops say yes");
        assert!(write_allowed(&write_entry(&[("allowed_write_ops", Value::Nil)])), "nil: any operation");
        assert!(write_allowed(&write_entry(&[("write_ops", strs(&["UPDATE"]))])), "compared lowercased");
        for (field, v) in [
            ("server_allows_writes", Value::Bool(false)),
            ("key_allows_writes", Value::Bool(false)),
            ("server_allows_writes", absent.clone()),
            ("key_allows_writes", absent.clone()),
            ("allowed_write_ops", absent.clone()),
            ("key_allows_writes", Value::Int(1)),
            ("allowed_write_ops", strs(&["insert"])),
            ("allowed_write_ops", strs(&[])),
            ("allowed_write_ops", Value::Str("update".into())),
            ("write_ops", strs(&[])),
            ("write_ops", absent.clone()),
            ("is_write", Value::Bool(false)),
        ] {
            assert!(!write_allowed(&write_entry(&[(field, v.clone())])), "{field} = {v:?}: forwarded");
        }
        assert!(!write_allowed(&write_entry(&[("write_ops", strs(&["update", "delete"]))])), "one op outside: forwarded");
    }

    #[test]
    fn key_checks_like_check_key() {
        let mut k = KeyEntry { name: "k".into(), active: true, expires_at_us: Some(100_000), allowed_ips: None, prev: false,
                               prev_until_us: None, rate_limited: false, gen: 0 };
        assert_eq!(k.allows(99_999, None), Some(true));
        assert_eq!(k.allows(100_000, None), Some(false), "expires_at <= now: expired");
        assert_eq!(k.allows(100_999 - 1000, None), Some(true), "now is compared at millisecond precision");
        k.expires_at_us = None;
        k.prev = true;
        assert_eq!(k.allows(5, None), Some(false), "previous secret without a grace end");
        k.prev_until_us = Some(10_000);
        assert!(k.allows(9_999, None) == Some(true) && k.allows(10_000, None) == Some(false));
        k.prev = false;
        k.allowed_ips = Some(vec!["127.0.0.0/8".into()]);
        assert_eq!(k.allows(0, Some("127.0.0.2".parse().unwrap())), Some(true));
        assert_eq!(k.allows(0, None), Some(false));
        k.allowed_ips = Some(vec!["10.0.0.0/255.0.0.0".into()]);
        assert_eq!(k.allows(0, None), None, "a netmask form: Python's ipaddress decides");
        k.allowed_ips = Some(vec!["127.0.0.0/8".into()]);
        k.active = false;
        assert_eq!(k.allows(0, Some("127.0.0.2".parse().unwrap())), Some(false));
    }
}
