//! Decode shm/vectors/*.bin (written by `python -m shm.vectors`) field by field; each check names the
//! LAYOUT.md rule it exercises.

use qag_plane::msgpack::Value;
use qag_plane::segment::*;
use qag_plane::sys::Mapping;
use std::sync::atomic::Ordering::{Acquire, Relaxed};

fn load(name: &str) -> Vec<u8> {
    let path = format!("{}/../shm/vectors/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn segment(name: &str) -> Segment {
    Segment::from_mapping(name, Mapping::from_bytes(&load(name))).expect("vector attaches")
}

/// R4, consumer side, for the test: records from `pos` to head as (position after, payload).
fn ring_read(seg: &Segment, slot: usize, mut pos: u64) -> Vec<(u64, Vec<u8>)> {
    let base = seg.ring_base(slot);
    let cap = seg.g.ring_capacity as u64;
    let head = seg.m.load_u64(base, Acquire);
    let mut out = Vec::new();
    while pos < head {
        let off = pos & (cap - 1);
        let word = seg.m.load_u64(base + RING_HEADER_SIZE + off as usize, Acquire);
        let n = word & 0xFFFF_FFFF;
        if n == PAD_LENGTH {
            pos += cap - off;
            continue;
        }
        let payload = seg.m.read_bytes(base + RING_HEADER_SIZE + off as usize + 8, n as usize);
        assert_eq!(crc32fast::hash(&payload) as u64, word >> 32, "R4: crc32 of the payload");
        pos += 8 + ((n + 7) & !7);
        out.push((pos, payload));
    }
    out
}

#[test]
fn header_h1_and_geometry() {
    let bytes = load("header.bin");
    assert_eq!(bytes.len(), 4096, "header is one page");
    let seg = segment("segment.bin");
    let m = &seg.m;
    let word = m.load_u64(0, Acquire);
    assert_eq!(word & 0xFFFF_FFFF, 0x5347_4151, "H1: magic QAGS");
    assert_eq!(word >> 32 & 0xFFFF, 1, "H1: major 1");
    assert_eq!(word >> 48, 1, "H1: minor 1 (layout 1.1: the responses region)");
    assert_eq!(&bytes[..], &load("segment.bin")[..4096], "header.bin is the segment's first page");
    assert_eq!(m.load_u64(H_TOTAL_SIZE, Relaxed), 1 << 20, "[Header] total_size");
    assert_eq!(m.load_u64(H_CREATED_AT_NS, Relaxed), 1_700_000_000_000_000_000, "[Header] created_at_ns");
    assert_eq!(m.load_u32(H_CREATOR_PID, Relaxed), 4242, "[Header] creator_pid");
    assert_eq!(m.load_u32(H_HEADER_SIZE, Relaxed), 4096, "[Header] header_size");
    assert_eq!(m.load_u32(H_REGION_COUNT, Relaxed), 8, "[Header] region_count (1.1: responses)");
    let g = &seg.g;
    assert_eq!((g.slots, g.gen_slots, g.series_max, g.cells_per_slot), (2, 256, 128, 1024), "[Geometry] small profile");
    assert_eq!((g.cache_ways, g.cache_slot_size, g.cache_slot_count), (8, 4096, 168), "[Geometry] cache");
    assert_eq!((g.ring_capacity, g.ring_header_size, g.ring_stride), (131072, 128, 135168), "[Geometry] rings");
    assert_eq!((g.series_entry_size, g.slot_meta_size, g.hist_buckets), (256, 64, 17), "[Header] sizes");
    let want = [(4096, 4096), (8192, 8192), (16384, 32768), (49152, 16384), (65536, 4096), (69632, 688128), (757760, 270336)];
    assert_eq!(g.regions, want, "[Geometry] regions in order, each after the previous, the first at 4096");
    let mut end = 4096;
    for (i, &(off, size)) in g.regions.iter().enumerate() {
        assert_eq!(off, end, "[Geometry] region {} starts where the previous ends", REGION_NAMES[i]);
        assert_eq!(off % 4096, 0, "[Geometry] page-aligned");
        end = off + size;
    }
    let bounds = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];
    assert_eq!(&g.hist_bounds[..16], &bounds, "[Histogram buckets] bounds at 256");
    assert!(g.hist_bounds[16].is_infinite(), "[Histogram buckets] the last is +Inf");
    assert_eq!(m.load_f64(H_HIST_BOUNDS + 8 * 17), 0.0, "[Header] unused bounds are zero");
}

#[test]
fn l3_refuses_other_major_and_uninitialised() {
    let mut bytes = load("segment.bin");
    bytes[4..6].copy_from_slice(&2u16.to_le_bytes());
    let err = Segment::from_mapping("v2", Mapping::from_bytes(&bytes)).err().expect("major 2 refused");
    assert!(err.0.contains("layout version 2.1") && err.0.contains("1.0"), "L3 names both versions: {}", err.0);
    let mut bytes = load("segment.bin");
    bytes[6..8].copy_from_slice(&7u16.to_le_bytes());
    assert!(Segment::from_mapping("minor", Mapping::from_bytes(&bytes)).is_ok(), "L3: a higher minor is accepted");
    let mut bytes = load("segment.bin");
    bytes[0..8].copy_from_slice(&[0; 8]);
    assert!(Segment::from_mapping("zero", Mapping::from_bytes(&bytes)).is_err(), "L3: magic zero = not initialised");
    let mut bytes = load("segment.bin");
    bytes.truncate(1 << 19);
    assert!(Segment::from_mapping("short", Mapping::from_bytes(&bytes)).is_err(), "L3: total_size must equal the object");
}

#[test]
fn generations_g1_g3() {
    let seg = segment("segment.bin");
    assert_eq!(crc32fast::hash(b"alice") & 255, 71, "G1: crc32 & (gen_slots-1)");
    assert_eq!(seg.gen(GenKind::Key, "alice"), 2, "G3: key slot 71");
    assert_eq!(seg.gen(GenKind::Query, "orders_by_id"), 1, "G3: query slot 165");
    assert_eq!(seg.gen(GenKind::Connection, "main"), 1, "G3: connection slot 100");
    assert_eq!(seg.gen(GenKind::Key, "bob"), 0, "G3: untouched slots are 0");
    assert_eq!(seg.gen_offset(GenKind::Query, "orders_by_id"), 8192 + 8 * (256 + 165), "G1: kinds in order key, query, connection");
    assert_eq!(seg.global_gen(), 4, "G2: global generation");
}

#[test]
fn cache_c2_c3_c5_and_entries() {
    let seg = segment("segment.bin");
    let key = b"p:alice\x00orders_by_id";
    let crc = crc32fast::hash(key);
    let sets = 168 / 8;
    assert_eq!(crc as usize % sets, 12, "C2: set of the plan key");
    let base = seg.region(R_CACHE) + 96 * 4096;
    assert_eq!(seg.m.load_u64(base, Relaxed) % 2, 0, "C1: published slot has an even seq");
    assert_eq!(seg.m.load_u32(base + 8, Relaxed) as usize, key.len(), "C1: key_len");
    assert_eq!(seg.m.load_u64(base + 16, Relaxed), 1, "C2: stamp of the first put");
    assert_eq!(seg.m.load_u32(base + 24, Relaxed), 4242, "C1: writer_pid");
    assert_eq!(seg.m.load_u32(base + 28, Relaxed), crc, "C1: key_crc");
    assert_eq!(seg.m.load_u32(seg.region(R_CACHE_TAGS) + 32 * 12, Relaxed), crc, "C5: tag of way 0 of set 12");
    let value = seg.cache_get(key).expect("C3: plan entry found");
    assert_eq!(value, load("plan_entry.bin"), "[Cache entries] the value is the plan entry vector (tests/entries_vectors.rs)");
    assert!(matches!(qag_plane::msgpack::decode(&value), Some(Value::Map(_))), "[Cache entries] E4: one msgpack map");
    assert_eq!(seg.cache_get(b"row:key:alice"), Some(vec![1, 2, 3]), "C3: an opaque value (set 7, slot 56)");
    let base56 = seg.region(R_CACHE) + 56 * 4096;
    assert_eq!(seg.m.load_u64(base56 + 16, Relaxed), 2, "C2: stamp 2");
    assert_eq!(seg.cache_get(b"p:alice\x00orders"), None, "absent key is a miss");
    assert_eq!(seg.m.load_u64(H_CACHE_PUTS, Relaxed), 4, "[Header] cache_puts");
    assert_eq!(seg.m.load_u64(H_CACHE_USED, Relaxed), 4, "[Header] cache_used");
}

#[test]
fn crashed_writer_c4_k4() {
    let seg = segment("segment_crashed.bin");
    let base = seg.region(R_CACHE) + 96 * 4096;
    assert_eq!(seg.m.load_u64(base, Relaxed), 3, "crashed slot left odd");
    assert_eq!(seg.cache_get(b"p:alice\x00orders_by_id"), None, "C4: an odd slot is a miss after bounded retries");
    assert_eq!(seg.cache_get(b"row:key:alice"), Some(vec![1, 2, 3]), "other slots unaffected");
    assert_eq!(seg.m.load_u64(L_OWNER_PID, Relaxed), 0x7FFF_FFFF, "K3: dead owner recorded");
    assert_eq!(seg.m.load_u64(L_OWNER_START, Relaxed), 1, "K2: owner start");
    assert_eq!(seg.m.load_u64(L_DIRTY_CACHE_SLOT, Relaxed), 97, "K4: dirty slot index + 1");
    let healthy = segment("segment.bin");
    assert_eq!(seg.m.load_u64(L_SEQ, Relaxed), healthy.m.load_u64(L_SEQ, Relaxed) + 1, "K2: lock_seq + 1");
}

#[test]
fn slot_meta_m1_m2() {
    let seg = segment("segment.bin");
    let b0 = seg.region(R_SLOT_META);
    assert_eq!(seg.m.load_u64(b0, Relaxed) % 2, 0, "M1: seq even after claim");
    assert_eq!(seg.m.load_u64(b0 + 8, Relaxed), 4242, "M1: slot 0 pid");
    assert_eq!(seg.m.load_u64(b0 + 16, Relaxed), 1, "M1: slot 0 role worker");
    assert_eq!(seg.m.load_u64(b0 + 24, Relaxed), 1_700_000_000_000_000_000, "M1: started_at_ns");
    let b1 = b0 + 64;
    assert_eq!(seg.m.load_u64(b1 + 8, Relaxed), 4243, "M1: slot 1 pid");
    assert_eq!(seg.m.load_u64(b1 + 16, Relaxed), 2, "M1: slot 1 role recorder");
    assert_eq!(seg.m.load_u64(b1 + 40, Acquire), 16, "M2: heartbeat_value");
    assert_eq!(seg.m.load_u64(b1 + 32, Acquire), 1_700_000_000_000_000_000, "M2: heartbeat_ns");
}

#[test]
fn series_and_counters_s2_n1_n2() {
    let seg = segment("segment.bin");
    assert_eq!(seg.m.load_u64(H_SERIES_COUNT, Acquire), 3, "S2: series_count");
    assert_eq!(seg.m.load_u64(H_CELLS_USED, Relaxed), 20, "S2: cells_used = 1 + 18 + 1");
    let s = seg.series_entries();
    let route = vec![("route".to_string(), "/q/{name}".to_string()), ("status".to_string(), "200".to_string())];
    assert_eq!(s[0], ("qag_requests_total".to_string(), route.clone(), KIND_COUNTER, 0, 1), "S3: counter, cell 0");
    assert_eq!(s[1].0, "qag_query_duration_seconds");
    assert_eq!((s[1].2, s[1].3, s[1].4), (KIND_HISTOGRAM, 1, 18), "S3: histogram, cells 1..18");
    assert_eq!((s[2].0.as_str(), s[2].2, s[2].3), ("qag_pool_in_use", KIND_GAUGE, 19), "S3: gauge, cell 19");
    assert_eq!(encode_desc("qag_requests_total", &route), seg.m.read_bytes(seg.region(R_SERIES) + 16, seg.m.read_bytes(seg.region(R_SERIES) + 8, 1)[0] as usize), "S3: desc bytes");
    assert_eq!(seg.cell_get(0, 0), 3.0, "N1: slot 0 counter");
    assert_eq!(seg.cell_get(1, 0), 2.0, "N1: slot 1 counter");
    assert_eq!(seg.cell_get(0, 1 + 5), 1.0, "N2: 0.003 in bucket 5");
    assert_eq!(seg.cell_get(1, 1 + 10), 1.0, "N2: 0.2 in bucket 10");
    assert_eq!(seg.cell_get(0, 1 + 17), 0.003, "N2: sum cell after the buckets");
    assert_eq!(seg.cell_get(0, 19), 2.0, "gauge");
}

#[test]
fn rings_r1_r4() {
    let seg = segment("segment.bin");
    let b0 = seg.ring_base(0);
    assert_eq!(seg.m.load_u64(b0 + 64, Acquire), 16, "R5: ring 0 tail after the first record");
    assert_eq!(seg.m.load_u64(b0, Acquire), 56, "R3: ring 0 head");
    let recs: Vec<Vec<u8>> = ring_read(&seg, 0, 0).into_iter().map(|r| r.1).collect();
    assert_eq!(recs, vec![b"run-0".to_vec(), b"run-1 twelve".to_vec(), b"run-2".to_vec()], "R4: records in order");
    let b1 = seg.ring_base(1);
    assert_eq!(seg.m.load_u64(b1 + 64, Acquire), 131056, "R5: ring 1 tail = capacity - 16");
    assert_eq!(seg.m.load_u64(b1, Acquire), 131104, "R1: ring 1 head after pad + record");
    assert_eq!(seg.m.load_u64(b1 + 128 + 131056, Relaxed), PAD_LENGTH, "R1: pad word at data offset 131056");
    let r = ring_read(&seg, 1, 131056);
    assert_eq!(r, vec![(131104, b"wrapped-record-payload!!".to_vec())], "R1: record at offset 0 of the next lap");
}

#[test]
fn ring_push_matches_python_bytes() {
    // Push the same records Python pushed into ring 0 of a zeroed copy; the data bytes must agree (R1-R3).
    let orig = load("segment.bin");
    let mut blank = orig.clone();
    let seg0 = segment("segment.bin");
    let b0 = seg0.ring_base(0);
    for b in &mut blank[b0..b0 + 128 + 64] {
        *b = 0;
    }
    let seg = Segment::from_mapping("copy", Mapping::from_bytes(&blank)).unwrap();
    for r in [&b"run-0"[..], b"run-1 twelve", b"run-2"] {
        assert!(seg.ring_push(0, r));
    }
    assert_eq!(seg.m.load_u64(b0, Relaxed), 56, "R3: head");
    assert_eq!(seg.m.read_bytes(b0 + 128, 56), orig[b0 + 128..b0 + 128 + 56].to_vec(), "R2: record words and payloads");
}
