//! The response cache's golden vectors (shm/vectors/response_key*.bin, responses.bin, plan_entry_cached.bin,
//! written by `python -m shm.vectors` with shm/responses.py and qag/entries.py) read by the plane's reader
//! (src/responses.rs); each check names the LAYOUT.md rule it exercises ([Response cache] R1-R10, R16).

use qag_plane::entries::PlanEntry;
use qag_plane::params::PVal;
use qag_plane::responses::{key_hash, suffix, Geometry, Responses};
use qag_plane::sys::Mapping;
use std::sync::atomic::Ordering::Relaxed;

fn load(name: &str) -> Vec<u8> {
    let path = format!("{}/../shm/vectors/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The vectors' clock (shm/vectors.py): every record was made then.
const CLOCK_NS: u64 = 1_700_000_000_000_000_000;

fn prefix() -> Vec<u8> {
    let plan = PlanEntry::from_payload(&load("plan_entry_cached.bin")).expect("[Plan entry] the cached plan decodes");
    assert!(plan.cache_ttl, "[Plan entry] cache_ttl 60");
    plan.response_prefix.expect("[Plan entry] 23 response_prefix (entries 1.2)")
}

#[test]
fn r5_keys_are_pythons_bytes() {
    let prefix = prefix();
    // the prefix: "r1", the query, version 1, the connection, generations 1 and 1, a 16-byte fingerprint
    assert_eq!(&prefix[..2], b"r1", "R5: encoding version 1");
    assert_eq!(&prefix[2..4], &12u16.to_le_bytes(), "R5: u16 length of the query's name");
    assert_eq!(&prefix[4..16], b"orders_by_id");
    assert_eq!(prefix.len(), 2 + 2 + 12 + 8 + 2 + 4 + 8 + 8 + 16, "R5: the prefix's parts");
    let key = [prefix.clone(), suffix("json", 1, 100, &[PVal::Int(42)]).unwrap()].concat();
    assert_eq!(key, load("response_key.bin"), "R5: prefix + json, page 1, page size 100, int 42");
    let args = [PVal::Null, PVal::Bool(false), PVal::Bool(true), PVal::Int(-7), PVal::Float(1.5), PVal::Str("é x".into())];
    let key = [prefix, suffix("csv", 2, 5, &args).unwrap()].concat();
    assert_eq!(key, load("response_key_types.bin"), "R5: one argument of each tag");
    assert_eq!(key_hash(&key), 0x9999_06bb_d563_34b9, "R6: sha256's first 8 bytes, little-endian");
}

#[test]
fn r1_r2_geometry_from_the_region_header() {
    let m = Mapping::from_bytes(&load("responses.bin"));
    let rc = Responses::new(&m, 0, m.len()).expect("R1: a region of 65536 bytes");
    assert_eq!(rc.geometry(), Geometry { capacity: 57344, arena_offset: 8192, index_offset: 4096, index_buckets: 16, max_record: 7168 });
}

#[test]
fn r9_r10_r16_lookups_in_the_vector() {
    let m = Mapping::from_bytes(&load("responses.bin"));
    let rc = Responses::new(&m, 0, m.len()).unwrap();
    let first = load("response_key.bin");
    assert!(rc.get(&first, key_hash(&first)).is_none(), "R8/R9: the first answer was lapped: a miss");
    let key = load("response_key_types.bin");
    let rec = rc.get(&key, key_hash(&key)).expect("R9: the types answer is found");
    assert_eq!(rec.pos, 31304, "R11: where its refresh put it");
    assert_eq!(rc.way_of(&rec), (9, 0), "R3: bucket key_hash % 16, way 0");
    assert_eq!(rec.body, b"id,total\r\n1,****\r\n2,****\r\n".to_vec(), "R4: the body, exactly as sent");
    assert_eq!((rec.rows, rec.has_more, rec.ttl_s), (2, true, 30), "R4: rows, flags bit 0, ttl_s");
    assert_eq!((rec.created_at_ns, rec.expires_at_ns), (CLOCK_NS, CLOCK_NS + 30_000_000_000), "R4: created, expires");
    // blake2b-128 of the body, as Python computed it (hashlib.blake2b(body, digest_size=16))
    assert_eq!(rec.etag_header(), "\"a3ef626c0fc721978dc666bc2562134d\"", "R15: the ETag header");
    assert!(rec.fresh(CLOCK_NS + 29_999_999_999) && !rec.fresh(CLOCK_NS + 30_000_000_000), "R10: fresh before expires_at_ns");
    assert_eq!(rc.hits(&rec), 1, "R16: served once before the vector was written");
    rc.hit(&rec);
    assert_eq!(rc.hits(&rec), 2, "R16: the plane's hit counted on its way");
    // the fillers: the prefix + json, page 1, 100, int 1000 + i; the first three lapped, the eleventh at the second
    // lap's start (offset 0)
    let filler = |i: i64| [prefix(), suffix("json", 1, 100, &[PVal::Int(1000 + i)]).unwrap()].concat();
    for i in 0..3 {
        assert!(rc.get(&filler(i), key_hash(&filler(i))).is_none(), "R8: filler {i} was lapped");
    }
    let k = filler(9);
    let rec = rc.get(&k, key_hash(&k)).expect("R9: the eleventh record (filler 9), past the pad");
    assert_eq!((rec.pos, rec.rows, rec.has_more, rec.body.len()), (57344, 100, true, 6000), "R7: the next lap's start");
    assert!(rec.body.iter().all(|b| *b == b'F'));
    assert!(rc.get(&k[..k.len() - 1], key_hash(&k[..k.len() - 1])).is_none(), "another key: a miss");
}

/// The region's wpos and wlimit (R2), and the types answer's way, changed in a copy of the vector.
fn with(change: impl FnOnce(&Mapping)) -> Option<u64> {
    let m = Mapping::from_bytes(&load("responses.bin"));
    change(&m);
    let rc = Responses::new(&m, 0, m.len()).unwrap();
    let key = load("response_key_types.bin");
    rc.get(&key, key_hash(&key)).map(|r| r.pos)
}

#[test]
fn r9_position_checks_make_a_changing_record_a_miss() {
    const WPOS: usize = 64;
    const WLIMIT: usize = 128;
    // bucket 9, way 0: hash at index_offset + (8 * 9) * 32, pos 8 bytes after it
    const WAY: usize = 4096 + 8 * 9 * 32;
    let cap = 57344u64;
    assert_eq!(with(|_| {}), Some(31304));
    // R9 step 4: a writer reserved bytes that overwrite the record (wlimit past P + capacity)
    assert_eq!(with(|m| m.store_u64(WLIMIT, 31304 + cap + 8, Relaxed)), None, "R9 4: overwritten while read");
    assert_eq!(with(|m| m.store_u64(WLIMIT, 31304 + cap, Relaxed)), Some(31304), "R9 4: wlimit = P + capacity is fine");
    // R9 step 2: a position the write position has lapped, or not yet written
    assert_eq!(with(|m| m.store_u64(WPOS, 31304 + cap + 8, Relaxed)), None, "R9 2: P + capacity < W");
    assert_eq!(with(|m| m.store_u64(WPOS, 31304 + 72, Relaxed)), None, "R9 2: P + 80 > W");
    assert_eq!(with(|m| m.store_u64(WAY + 8, 31305, Relaxed)), None, "R9 2: P not a multiple of 8");
    // R9 step 3: the header is not an entry's, or the key differs
    assert_eq!(with(|m| m.store_u32(8192 + 31304, 0x5047_4151, Relaxed)), None, "R9 3: a pad's magic");
    assert_eq!(with(|m| m.store_u64(8192 + 31304 + 80, 0, Relaxed)), None, "R9 4: the key's bytes differ");
    // R3: a way whose hash does not match is not read
    assert_eq!(with(|m| m.store_u64(WAY, 7, Relaxed)), None, "R3: no way holds the hash");
}

#[test]
fn r1_a_segment_without_a_response_cache() {
    let seg = qag_plane::segment::Segment::from_mapping("v", Mapping::from_bytes(&load("segment.bin"))).unwrap();
    assert_eq!(seg.g.responses, (1_028_096, 0), "[Header] region 7: responses, size 0 in the vector");
    assert!(seg.responses().is_none(), "R1: size 0: no response cache, every lookup forwarded");
}
