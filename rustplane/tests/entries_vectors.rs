//! The entry and run record vectors (shm/vectors/{key,plan,connection}_entry.bin and run_record.bin, written by
//! `python -m shm.vectors` with qag/entries.py's writers) decoded field by field; each check names the LAYOUT.md
//! rule it exercises ([Entries] E1-E6, [Run record] RR1-RR4). A field declared on one side only fails here: each
//! vector's field names must equal this crate's declaration (src/entries.rs) and qag/entries.py's.

use qag_plane::entries::*;
use qag_plane::mask::Action;
use qag_plane::msgpack::{self, Value};
use qag_plane::params::{Num, PType, PVal};
use qag_plane::segment::{GenKind, Segment};
use qag_plane::sys::Mapping;
use std::collections::BTreeMap;

/// sha256 hex of the vectors' secret ("qag-vector-secret"): alice's key entry is at k:<this>.
const KEY_HASH: &str = "577d63245a20fb42908e5dacb12ee30532da351028e571d2121705bf92e04cc9";

fn load(name: &str) -> Vec<u8> {
    let path = format!("{}/../shm/vectors/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn segment(bytes: &[u8]) -> Segment {
    Segment::from_mapping("entries", Mapping::from_bytes(bytes)).expect("vector attaches")
}

fn python_source() -> String {
    let path = format!("{}/../qag/entries.py", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The field names qag/entries.py declares in `decl`, a tuple of ("name", "type") pairs.
fn python_entry_fields(decl: &str) -> Vec<String> {
    let src = python_source();
    let start = src.find(&format!("\n{decl} = (")).unwrap_or_else(|| panic!("qag/entries.py declares {decl}"));
    let body = &src[start + decl.len() + 5..];
    let body = &body[..body.find("\n)\n").expect("the declaration ends with a line ')'")];
    let re = regex::Regex::new(r#"\(\s*"(\w+)",\s*""#).unwrap();
    re.captures_iter(body).map(|c| c[1].to_string()).collect()
}

/// The fields of qag/entries.py's `class RunRecord(NamedTuple)`, in order.
fn python_run_fields() -> Vec<String> {
    let src = python_source();
    let start = src.find("class RunRecord(NamedTuple):").expect("qag/entries.py declares RunRecord");
    let re = regex::Regex::new(r"^    (\w+): ").unwrap();
    src[start..].lines().skip(1).take_while(|l| l.is_empty() || l.starts_with("    "))
        .filter_map(|l| re.captures(l).map(|c| c[1].to_string())).collect()
}

/// E4: the map's keys, in the order they are written.
fn keys(v: &Value) -> Vec<String> {
    let Value::Map(m) = v else { panic!("E4: an entry is one msgpack map, got {v:?}") };
    m.iter().map(|(k, _)| k.as_str().expect("E4: string keys").to_string()).collect()
}

fn decode(name: &str) -> Value {
    msgpack::decode(&load(name)).unwrap_or_else(|| panic!("{name} is msgpack"))
}

fn check_fields(vector: &Value, ours: &[&str], python: Vec<String>, what: &str) {
    let got = keys(vector);
    assert_eq!(got, ours, "E4: the {what}'s fields in the vector (qag/entries.py wrote it) against src/entries.rs");
    assert_eq!(python, ours, "E4: the {what}'s fields declared by qag/entries.py against src/entries.rs");
}

#[test]
fn key_entry_e4_fields_and_values() {
    let v = decode("key_entry.bin");
    check_fields(&v, KEY_FIELDS, python_entry_fields("KEY_ENTRY"), "key entry");
    let seg = segment(&load("segment.bin"));
    assert_eq!(seg.cache_get(&key_cache_key(KEY_HASH)), Some(load("key_entry.bin")), "E5: k:<sha256 hex>");
    let k = KeyEntry::load(&seg, KEY_HASH).expect("E1: a current key entry loads");
    assert_eq!(k.name, "alice", "[Key entry] name");
    assert!(k.active, "[Key entry] active");
    assert_eq!(k.expires_at_us, Some(1_798_761_600_000_000), "[Key entry] expires_at_us: 2027-01-01T00:00:00Z");
    assert_eq!(k.allowed_ips, Some(vec!["10.0.0.0/8".to_string()]), "[Key entry] allowed_ips");
    assert!(!k.prev, "[Key entry] prev");
    assert_eq!(k.prev_until_us, None, "[Key entry] prev_until_us");
    assert_eq!(k.gen, 2, "[Key entry] gen = the segment's generation of key alice");
    assert!(!k.rate_limited, "[Key entry] rate_limit nil");
    assert!(matches!(v.get("row"), Some(Value::Map(_))), "[Key entry] row: a map the plane ignores");
    assert_eq!(k.allows(1_798_761_599_999_000, Some("10.1.2.3".parse().unwrap())), Some(true));
}

#[test]
fn plan_entry_e4_fields_and_values() {
    let v = decode("plan_entry.bin");
    check_fields(&v, PLAN_FIELDS, python_entry_fields("PLAN_ENTRY"), "plan entry");
    let specs = v.get("specs").and_then(Value::as_array).expect("[Plan entry] specs");
    check_fields(&specs[0], SPEC_FIELDS, python_entry_fields("SPEC_ENTRY"), "plan entry's spec");
    let seg = segment(&load("segment.bin"));
    assert_eq!(seg.cache_get(&plan_cache_key("alice", "orders_by_id")), Some(load("plan_entry.bin")), "E5: p:<key>\\0<query>");
    let PlanLookup::Hit(p) = PlanEntry::load(&seg, "alice", "orders_by_id") else { panic!("E1: a current plan entry is a hit") };
    assert_eq!((p.query.as_str(), p.version, p.published_version), ("orders_by_id", 1, Some(1)), "[Plan entry] query, version, P2");
    assert_eq!((p.connection.as_str(), p.dialect.as_str()), ("main", "postgres"), "[Plan entry] connection, dialect");
    assert_eq!(p.sql_native, "SELECT id, total FROM orders WHERE id = $1", "[Plan entry] sql_native");
    assert_eq!(v.get("sql_driver").and_then(Value::as_str), Some("SELECT id, total FROM orders WHERE id = %(id)s"), "[Plan entry] sql_driver");
    assert_eq!(p.sql_pieces, None, "[Plan entry] sql_pieces: nil for PostgreSQL");
    assert_eq!(p.arg_names, vec!["id".to_string()], "[Plan entry] arg_names");
    let s = &p.specs[0];
    assert_eq!((s.name.as_str(), s.ty, s.required, s.has_default), ("id", PType::Int, true, false), "[Plan entry] spec");
    assert_eq!((&s.default, &s.enum_, s.min, s.max), (&PVal::Null, &None, Some(Num::I(1)), None), "[Plan entry] spec rules");
    assert_eq!((s.min_length, s.max_length, s.pattern.is_none()), (None, None, true), "[Plan entry] spec lengths, pattern");
    assert_eq!(p.transforms, Some(vec![Action::Keep, Action::Mask]), "[Plan entry] transforms (nil = keep)");
    assert_eq!(p.output_names, Some(vec![Some("id".to_string()), Some("total".to_string())]), "[Plan entry] names");
    assert!(p.names_published, "[Plan entry] names present");
    assert_eq!(p.page_mode, "append", "[Plan entry] page_mode");
    assert!(!p.is_write, "[Plan entry] is_write");
    assert_eq!(v.get("write_ops").and_then(Value::as_array).map(<[Value]>::len), Some(0), "[Plan entry] write_ops");
    assert_eq!(v.get("tables").and_then(Value::as_array).and_then(|t| t[0].as_str()), Some("orders"), "[Plan entry] tables");
    assert_eq!(p.gens, [2, 1, 1], "E1: [Plan entry] gens = key, query, connection generations");
    assert!(!p.cache_ttl, "[Plan entry] cache_ttl nil");
    assert_eq!((p.default_page_size, p.max_page_size, p.query_timeout), (100, 1000, 30.0), "[Plan entry] paging, query_timeout");
    assert!(p.state_free, "[Plan entry] state_free");
    assert_eq!(v.get("server_allows_writes").and_then(Value::as_bool), Some(false), "[Plan entry] server_allows_writes (P3)");
    assert_eq!(v.get("key_allows_writes").and_then(Value::as_bool), Some(false), "[Plan entry] key_allows_writes (P3)");
    assert!(v.get("allowed_write_ops").is_some_and(Value::is_nil), "[Plan entry] allowed_write_ops nil (P3)");
    assert!(!p.write_allowed, "P3: a read plan's entry lets the plane serve no write");
}

#[test]
fn connection_entry_e4_fields_and_values() {
    let v = decode("connection_entry.bin");
    check_fields(&v, CONNECTION_FIELDS, python_entry_fields("CONNECTION_ENTRY"), "connection entry");
    let seg = segment(&load("segment.bin"));
    assert_eq!(seg.cache_get(&conn_cache_key("main")), Some(load("connection_entry.bin")), "E5: c:<connection>");
    let c = ConnEntry::load(&seg, "main").expect("E1: a current connection entry loads");
    let want = ConnEntry {
        name: "main".into(),
        db: "postgres".into(),
        host: "127.0.0.1".into(),
        port: 5432,
        user: Some("qag".into()),
        database: Some("shop".into()),
        options: BTreeMap::from([("search_path".to_string(), "app".to_string())]),
        connect_timeout: 3.0,
        gen: 1,
    };
    assert_eq!(*c, want, "[Connection entry] every field (options: text and integers only)");
    assert_eq!(v.get("active").and_then(Value::as_bool), Some(true), "[Connection entry] active");
}

#[test]
fn stale_entries_are_misses_e1() {
    let mut bytes = load("segment.bin");
    let seg = segment(&bytes);
    let off = seg.gen_offset(GenKind::Key, "alice");
    bytes[off..off + 8].copy_from_slice(&3u64.to_le_bytes()); // key alice bumped past the entries' 2
    let seg = segment(&bytes);
    assert!(KeyEntry::load(&seg, KEY_HASH).is_none(), "E1: a key entry of an older generation is a miss");
    assert!(matches!(PlanEntry::load(&seg, "alice", "orders_by_id"), PlanLookup::Miss), "E1: so is the key's plan");
    assert!(ConnEntry::load(&seg, "main").is_some(), "E1: the connection's generation did not move");
}

#[test]
fn run_record_rr1_fields_order_and_bytes() {
    let bytes = load("run_record.bin");
    let v = msgpack::decode(&bytes).expect("RR1: msgpack");
    let a = v.as_array().expect("RR1: an array");
    assert_eq!(python_run_fields(), RUN_FIELDS, "RR1: qag/entries.py's RunRecord fields against src/entries.rs");
    assert_eq!(a.len(), RUN_FIELDS.len(), "RR1: one element per declared field");
    let field = |name: &str| &a[RUN_FIELDS.iter().position(|f| *f == name).unwrap()];
    assert_eq!(field("v").as_u64(), Some(RUN_VERSION), "RR3: v = 1");
    assert_eq!(field("at_us").as_i64(), Some(1_700_000_000_000_000), "RR1: at_us");
    assert_eq!(field("key_name").as_str(), Some("alice"), "RR1: key_name");
    assert_eq!(field("query").as_str(), Some("orders_by_id"), "RR1: query");
    assert_eq!(field("version").as_i64(), Some(1), "RR1: version");
    assert_eq!(field("connection").as_str(), Some("main"), "RR1: connection");
    assert_eq!(field("status").as_u64(), Some(200), "RR1: status");
    assert!(field("code").is_nil(), "RR1: code nil on success");
    assert_eq!((field("rows").as_i64(), field("duration_us").as_i64(), field("bytes").as_i64()), (Some(1), Some(812), Some(120)));
    assert_eq!(field("request_id").as_str(), Some("0123456789abcdef"), "RR1: request_id");
    assert_eq!((field("served_by").as_str(), field("transport").as_str(), field("route").as_str()), (Some("plane"), Some("http"), Some("/q/{name}")));
    let ours = RunRecord {
        at_us: 1_700_000_000_000_000,
        key_name: Some("alice"),
        query: Some("orders_by_id"),
        version: Some(1),
        connection: Some("main"),
        status: 200,
        code: None,
        rows: 1,
        duration_us: 812,
        bytes: 120,
        request_id: "0123456789abcdef",
        served_by: "plane",
        transport: "http",
        route: "/q/{name}",
        error: None,
    };
    assert!(field("error").is_nil(), "RR5: error nil on success");
    assert_eq!(ours.encode(), bytes, "RR1: the plane's encoder writes Python's bytes, field for field");
}

#[test]
fn one_convention_e4() {
    // The plan entry of segment.bin wrapped as layout 1.0's first text described ([1, gens, payload]), in place.
    let mut bytes = load("segment.bin");
    let seg = segment(&bytes);
    let base = seg.region(qag_plane::segment::R_CACHE) + 96 * 4096;
    let key_len = u32::from_le_bytes(bytes[base + 8..base + 12].try_into().unwrap()) as usize;
    let mut wrapped = b"\x93\x01\x90".to_vec();
    wrapped.extend_from_slice(&load("plan_entry.bin"));
    bytes[base + 12..base + 16].copy_from_slice(&(wrapped.len() as u32).to_le_bytes());
    bytes[base + 64 + key_len..base + 64 + key_len + wrapped.len()].copy_from_slice(&wrapped);
    let seg = segment(&bytes);
    assert_eq!(seg.cache_get(&plan_cache_key("alice", "orders_by_id")), Some(wrapped), "C3: the slot holds the wrapped value");
    assert!(matches!(PlanEntry::load(&seg, "alice", "orders_by_id"), PlanLookup::Miss), "E4: a value that is not one map is a miss");
}

#[test]
fn run_record_rr5_error_text_of_a_failed_call() {
    let bytes = load("run_record_failed.bin");
    let v = msgpack::decode(&bytes).expect("RR1: msgpack");
    let a = v.as_array().expect("RR1: an array");
    assert_eq!(a.len(), RUN_FIELDS.len(), "RR1: one element per declared field");
    assert_eq!(&bytes[..4], &[0xdc, 0x00, 0x10, 0x01], "RR4: array16 of 16, v = 1");
    let field = |name: &str| &a[RUN_FIELDS.iter().position(|f| *f == name).unwrap()];
    assert_eq!((field("status").as_u64(), field("code").as_str()), (Some(500), Some("query_failed")), "RR1: a failure");
    assert_eq!(field("error").as_str(), Some("relation \"public.ordres\" does not exist (é)"), "RR5: the database's words");
    let ours = RunRecord {
        at_us: 1_700_000_000_000_000,
        key_name: Some("alice"),
        query: Some("orders_by_id"),
        version: Some(1),
        connection: Some("main"),
        status: 500,
        code: Some("query_failed"),
        rows: 0,
        duration_us: 812,
        bytes: 150,
        request_id: "0123456789abcdef",
        served_by: "worker:1",
        transport: "http",
        route: "/q/{name}",
        error: Some("relation \"public.ordres\" does not exist (é)"),
    };
    assert_eq!(ours.encode(), bytes, "RR5: the plane's encoder writes Python's bytes for a text too");
}
