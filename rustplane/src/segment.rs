//! The shared segment as `shm/LAYOUT.md` (version 1.x) defines it: attach and version check (L3, H1),
//! generations (G1, G3), seqlock cache reads (C3-C5), the plane's own ring (R1-R3), counter cells and the
//! series table (S1-S3, N1-N2), slot claim and heartbeat (M1, M2), and the writers' lock (K2, K3).
//! Rule labels in comments are LAYOUT.md's.

use crate::msgpack::{self, Enc};
use crate::sys::{self, Mapping, Sem};
use std::collections::HashMap;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const MAGIC: u64 = 0x5347_4151;
const MAJOR: u64 = 1;

// [Header]
pub const H_TOTAL_SIZE: usize = 8;
pub const H_CREATED_AT_NS: usize = 16;
pub const H_CREATOR_PID: usize = 24;
const H_SLOTS: usize = 28;
pub const H_HEADER_SIZE: usize = 32;
pub const H_REGION_COUNT: usize = 36;
const H_GEN_SLOTS: usize = 64;
const H_CACHE_SLOT_COUNT: usize = 68;
const H_CACHE_SLOT_SIZE: usize = 72;
const H_CACHE_WAYS: usize = 76;
const H_RING_CAPACITY: usize = 80;
const H_RING_HEADER_SIZE: usize = 84;
const H_SERIES_MAX: usize = 88;
const H_SERIES_ENTRY_SIZE: usize = 92;
const H_CELLS_PER_SLOT: usize = 96;
const H_SLOT_META_SIZE: usize = 100;
const H_HIST_BUCKETS: usize = 104;
const H_RING_STRIDE: usize = 108;
const H_REGIONS: usize = 128;
pub const H_HIST_BOUNDS: usize = 256;
const H_GLOBAL_GEN: usize = 512;
pub const L_OWNER_PID: usize = 576;
pub const L_OWNER_START: usize = 584;
const L_ACQUIRED_AT_NS: usize = 592;
pub const L_SEQ: usize = 600;
pub const L_DIRTY_CACHE_SLOT: usize = 608;
const L_TAKEOVERS: usize = 616;
pub const H_SERIES_COUNT: usize = 640;
pub const H_CELLS_USED: usize = 648;
pub const H_CACHE_PUTS: usize = 704;
pub const H_CACHE_USED: usize = 736;

pub const REGION_NAMES: [&str; 7] = ["slot_meta", "generations", "series", "counters", "cache_tags", "cache", "rings"];
pub const R_SLOT_META: usize = 0;
const R_GENERATIONS: usize = 1;
pub const R_SERIES: usize = 2;
const R_COUNTERS: usize = 3;
pub const R_CACHE_TAGS: usize = 4;
pub const R_CACHE: usize = 5;
const R_RINGS: usize = 6;

const CACHE_READ_RETRIES: usize = 64; // C4
const CACHE_SLOT_HEADER: usize = 64;
const SERIES_ENTRY_SIZE: usize = 256;
pub const RING_HEADER_SIZE: usize = 128;
pub const PAD_LENGTH: u64 = 0xFFFF_FFFF;

pub const KIND_COUNTER: u8 = 1;
pub const KIND_GAUGE: u8 = 2;
pub const KIND_HISTOGRAM: u8 = 3;
const ROLE_PLANE: u64 = 3;

/// Generation kinds in table order (G1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GenKind {
    Key = 0,
    Query = 1,
    Connection = 2,
}

#[derive(Debug)]
pub struct LayoutError(pub String);

impl std::fmt::Display for LayoutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Geometry as recorded in the header (readers never recompute it, L3).
#[derive(Debug, Clone)]
pub struct Geometry {
    pub size: u64,
    pub slots: u32,
    pub gen_slots: u32,
    pub cache_slot_count: u32,
    pub cache_slot_size: u32,
    pub cache_ways: u32,
    pub ring_capacity: u32,
    pub ring_header_size: u32,
    pub series_max: u32,
    pub series_entry_size: u32,
    pub cells_per_slot: u32,
    pub slot_meta_size: u32,
    pub hist_buckets: u32,
    pub ring_stride: u32,
    pub regions: [(u64, u64); 7],
    /// Region 7, `responses` (layout 1.1; (0, 0) in a 1.0 segment, or when the response cache is off).
    pub responses: (u64, u64),
    pub hist_bounds: Vec<f64>,
}

type Labels = Vec<(String, String)>;

struct SeriesCache {
    decoded: usize,
    by_norm: HashMap<(String, Labels), (u8, u32)>,
}

pub struct Segment {
    pub name: String,
    pub m: Mapping,
    pub g: Geometry,
    sems: Option<(Sem, Sem)>,
    series: Mutex<SeriesCache>,
}

fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

/// Field 22 of /proc/<pid>/stat (start time in clock ticks), 0 if unreadable.
fn proc_start(pid: u32) -> u64 {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0 };
    let Some(close) = text.rfind(')') else { return 0 };
    text[close + 1..].split_whitespace().nth(19).and_then(|s| s.parse().ok()).unwrap_or(0)
}

impl Segment {
    /// L3: map the named object, check the magic word first (H1), refuse another major version.
    pub fn attach(name: &str) -> Result<Segment, LayoutError> {
        let m = Mapping::open_shm(name).map_err(|e| LayoutError(format!("no shared-memory segment named {name}: {e}")))?;
        let sems = (
            Sem::open(&format!("{name}-w")).map_err(|e| LayoutError(format!("segment {name} has no writer lock: {e}")))?,
            Sem::open(&format!("{name}-r")).map_err(|e| LayoutError(format!("segment {name} has no takeover lock: {e}")))?,
        );
        let mut seg = Segment::from_mapping(name, m)?;
        seg.sems = Some(sems);
        Ok(seg)
    }

    /// Read a segment held in a mapping (the golden vectors in tests, or an attached object).
    pub fn from_mapping(name: &str, m: Mapping) -> Result<Segment, LayoutError> {
        if m.len() < 4096 {
            return Err(LayoutError(format!("segment {name} is {} bytes, smaller than its header", m.len())));
        }
        let word = m.load_u64(0, Acquire); // H1: the magic word first, Acquire
        let (magic, major, minor) = (word & 0xFFFF_FFFF, word >> 32 & 0xFFFF, word >> 48);
        if magic == 0 {
            return Err(LayoutError(format!("segment {name} is not initialised (its creator is still writing it, or died)")));
        }
        if magic != MAGIC {
            return Err(LayoutError(format!("segment {name} has magic {magic:#010x}, expected {MAGIC:#010x}: not a qag segment")));
        }
        if major != MAJOR {
            return Err(LayoutError(format!(
                "segment {name} has layout version {major}.{minor}, but this plane reads version {MAJOR}.0: major versions differ; restart the instance"
            )));
        }
        let u32at = |off| m.load_u32(off, Relaxed);
        let size = m.load_u64(H_TOTAL_SIZE, Relaxed);
        if size != m.len() as u64 {
            return Err(LayoutError(format!("segment header says {size} bytes but the object has {}", m.len())));
        }
        let mut regions = [(0u64, 0u64); 7];
        if (u32at(H_REGION_COUNT) as usize) < 7 {
            return Err(LayoutError("segment region table has fewer than 7 regions".into()));
        }
        for (i, r) in regions.iter_mut().enumerate() {
            *r = (m.load_u64(H_REGIONS + 16 * i, Relaxed), m.load_u64(H_REGIONS + 16 * i + 8, Relaxed));
            if r.0 + r.1 > size {
                return Err(LayoutError("segment region table is inconsistent with its size".into()));
            }
        }
        let responses = if u32at(H_REGION_COUNT) >= 8 {
            let r = (m.load_u64(H_REGIONS + 16 * 7, Relaxed), m.load_u64(H_REGIONS + 16 * 7 + 8, Relaxed));
            if r.0.checked_add(r.1).is_none_or(|end| end > size) {
                return Err(LayoutError("segment region table is inconsistent with its size".into()));
            }
            r
        } else {
            (0, 0)
        };
        let hist_buckets = u32at(H_HIST_BUCKETS);
        let hist_bounds = (0..hist_buckets.min(32) as usize).map(|i| m.load_f64(H_HIST_BOUNDS + 8 * i)).collect();
        let g = Geometry {
            size,
            slots: u32at(H_SLOTS),
            gen_slots: u32at(H_GEN_SLOTS),
            cache_slot_count: u32at(H_CACHE_SLOT_COUNT),
            cache_slot_size: u32at(H_CACHE_SLOT_SIZE),
            cache_ways: u32at(H_CACHE_WAYS),
            ring_capacity: u32at(H_RING_CAPACITY),
            ring_header_size: u32at(H_RING_HEADER_SIZE),
            series_max: u32at(H_SERIES_MAX),
            series_entry_size: u32at(H_SERIES_ENTRY_SIZE),
            cells_per_slot: u32at(H_CELLS_PER_SLOT),
            slot_meta_size: u32at(H_SLOT_META_SIZE),
            hist_buckets,
            ring_stride: u32at(H_RING_STRIDE),
            regions,
            responses,
            hist_bounds,
        };
        if g.gen_slots == 0 || !g.gen_slots.is_power_of_two() || g.cache_ways == 0 || g.cache_slot_count < g.cache_ways
            || !g.ring_capacity.is_power_of_two() || g.slots == 0
        {
            return Err(LayoutError("segment geometry is inconsistent".into()));
        }
        Ok(Segment {
            name: name.to_string(),
            m,
            g,
            sems: None,
            series: Mutex::new(SeriesCache { decoded: 0, by_norm: HashMap::new() }),
        })
    }

    /// The response cache (region 7), when the segment has one ([Response cache] R1).
    pub fn responses(&self) -> Option<crate::responses::Responses<'_>> {
        let (off, size) = self.g.responses;
        if size == 0 {
            return None;
        }
        crate::responses::Responses::new(&self.m, off as usize, size as usize)
    }

    pub fn region(&self, r: usize) -> usize {
        self.g.regions[r].0 as usize
    }

    // ---- generations (G1, G3) --------------------------------------------------------------------------

    /// Byte offset of ident's generation slot (G1: crc32(ident) & (gen_slots - 1)).
    pub fn gen_offset(&self, kind: GenKind, ident: &str) -> usize {
        let slot = crc32fast::hash(ident.as_bytes()) & (self.g.gen_slots - 1);
        self.region(R_GENERATIONS) + 8 * (kind as usize * self.g.gen_slots as usize + slot as usize)
    }

    /// G3: one aligned 8-byte Acquire load.
    pub fn gen(&self, kind: GenKind, ident: &str) -> u64 {
        self.m.load_u64(self.gen_offset(kind, ident), Acquire)
    }

    pub fn global_gen(&self) -> u64 {
        self.m.load_u64(H_GLOBAL_GEN, Acquire)
    }

    // ---- cache (C3, C4, C5) ----------------------------------------------------------------------------

    /// The value stored under `key`, or None (absent, torn 64 times, or left odd by a dead writer).
    pub fn cache_get(&self, key: &[u8]) -> Option<Vec<u8>> {
        let crc = crc32fast::hash(key);
        let ways = self.g.cache_ways as usize;
        let sets = self.g.cache_slot_count as usize / ways;
        let set = crc as usize % sets;
        let tags = self.region(R_CACHE_TAGS) + set * 4 * ways;
        let size = self.g.cache_slot_size as usize;
        let room = size - CACHE_SLOT_HEADER;
        let base0 = self.region(R_CACHE);
        for way in 0..ways {
            if self.m.load_u32(tags + 4 * way, Relaxed) != crc {
                continue; // C5: tags are hints; only matching ways are examined
            }
            let base = base0 + (set * ways + way) * size;
            for _ in 0..CACHE_READ_RETRIES {
                let s1 = self.m.load_u64(base, Acquire);
                if s1 & 1 == 1 {
                    continue;
                }
                let klen = self.m.load_u32(base + 8, Relaxed) as usize;
                let vlen = self.m.load_u32(base + 12, Relaxed) as usize;
                let fits = klen + vlen <= room && room.is_multiple_of(8);
                let data = if fits { self.m.read_words(base + CACHE_SLOT_HEADER, klen + vlen) } else { Vec::new() };
                sys::fence_acquire();
                if self.m.load_u64(base, Relaxed) != s1 || !fits {
                    continue; // torn: retry (C3)
                }
                if klen != key.len() || &data[..klen] != key {
                    break; // a consistent slot holding another key
                }
                return Some(data[klen..].to_vec());
            }
        }
        None
    }

    // ---- slot metadata (M1, M2) ------------------------------------------------------------------------

    fn slot_meta(&self, slot: usize) -> usize {
        self.region(R_SLOT_META) + slot * self.g.slot_meta_size as usize
    }

    /// M1: claim `slot` as the plane; then zero this slot's gauge cells.
    pub fn set_slot(&self, slot: usize, pid: u32) {
        let b = self.slot_meta(slot);
        let now = now_ns();
        let mut seq = self.m.load_u64(b, Relaxed);
        seq += seq & 1;
        self.m.store_u64(b, seq + 1, Relaxed);
        sys::fence_release();
        self.m.store_u64(b + 8, pid as u64, Relaxed);
        self.m.store_u64(b + 48, proc_start(pid), Relaxed);
        self.m.store_u64(b + 16, ROLE_PLANE, Relaxed);
        self.m.store_u64(b + 24, now, Relaxed);
        self.m.store_u64(b + 40, 0, Release);
        self.m.store_u64(b + 32, now, Release);
        self.m.store_u64(b, seq + 2, Release);
        let mut cache = self.series.lock().unwrap_or_else(|e| e.into_inner());
        self.sync_series(&mut cache);
        let base = self.region(R_COUNTERS) + slot * self.g.cells_per_slot as usize * 8;
        for (kind, cell) in cache.by_norm.values() {
            if *kind == KIND_GAUGE {
                self.m.store_f64(base + 8 * *cell as usize, 0.0);
            }
        }
    }

    /// M2: heartbeat value, then the time.
    pub fn set_heartbeat(&self, slot: usize, value: Option<u64>) {
        let b = self.slot_meta(slot);
        if let Some(v) = value {
            self.m.store_u64(b + 40, v, Release);
        }
        self.m.store_u64(b + 32, now_ns(), Release);
    }

    // ---- rings (R1-R3), producer side -----------------------------------------------------------------

    pub fn ring_base(&self, slot: usize) -> usize {
        self.region(R_RINGS) + slot * self.g.ring_stride as usize
    }

    /// R1-R3: push one record into ring `slot`; false when there is no room now (the caller may retry).
    /// The caller guarantees one producer at a time for the slot.
    pub fn ring_push(&self, slot: usize, record: &[u8]) -> bool {
        let cap = self.g.ring_capacity as u64;
        let n = record.len() as u64;
        assert!(n > 0 && n <= cap / 2 - 8, "ring record of {n} bytes");
        let base = self.ring_base(slot);
        let data = base + RING_HEADER_SIZE;
        let rl = 8 + ((n + 7) & !7);
        let mut head = self.m.load_u64(base, Relaxed); // our own field
        let tail = self.m.load_u64(base + 64, Acquire);
        let mut off = head & (cap - 1);
        let contiguous = cap - off;
        let need = if rl <= contiguous { rl } else { contiguous + rl };
        if need > cap - (head - tail) {
            return false;
        }
        if rl > contiguous {
            self.m.store_u64(data + off as usize, PAD_LENGTH, Release);
            head += contiguous;
            off = 0;
        }
        let start = data + off as usize;
        let mut padded = record.to_vec();
        padded.resize(((n + 7) & !7) as usize, 0);
        self.m.write_bytes(start + 8, &padded);
        let word = n | (crc32fast::hash(record) as u64) << 32;
        self.m.store_u64(start, word, Release); // R2: the record word after the payload
        self.m.store_u64(base, head + rl, Release); // R3: publish
        true
    }

    // ---- series and counters (S1-S3, N1-N2) -----------------------------------------------------------

    fn sync_series(&self, cache: &mut SeriesCache) {
        let count = self.m.load_u64(H_SERIES_COUNT, Acquire) as usize; // S2
        let base = self.region(R_SERIES);
        while cache.decoded < count.min(self.g.series_max as usize) {
            let off = base + cache.decoded * SERIES_ENTRY_SIZE;
            cache.decoded += 1;
            let cell = self.m.load_u32(off, Relaxed);
            let head = self.m.read_bytes(off + 4, 6);
            let kind = head[2];
            let dlen = u16::from_le_bytes([head[4], head[5]]) as usize;
            if dlen > SERIES_ENTRY_SIZE - 16 {
                continue;
            }
            if let Some((name, labels)) = decode_desc(&self.m.read_bytes(off + 16, dlen)) {
                cache.by_norm.insert((name, labels), (kind, cell));
            }
        }
    }

    /// The series entries published so far: (name, labels, kind, cell_index, cell_count).
    pub fn series_entries(&self) -> Vec<(String, Labels, u8, u32, u16)> {
        let count = self.m.load_u64(H_SERIES_COUNT, Acquire) as usize;
        let base = self.region(R_SERIES);
        let mut out = Vec::new();
        for i in 0..count.min(self.g.series_max as usize) {
            let off = base + i * SERIES_ENTRY_SIZE;
            let head = self.m.read_bytes(off, 10);
            let cell = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
            let ncells = u16::from_le_bytes([head[4], head[5]]);
            let dlen = u16::from_le_bytes([head[8], head[9]]) as usize;
            if let Some((name, labels)) = decode_desc(&self.m.read_bytes(off + 16, dlen.min(240))) {
                out.push((name, labels, head[6], cell, ncells));
            }
        }
        out
    }

    /// S3: the first cell of series (name, labels) of `kind`, registering it under the writers' lock.
    pub fn series_cell(&self, kind: u8, name: &str, labels: &[(&str, &str)]) -> Result<u32, String> {
        let mut norm: Labels = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        norm.sort();
        let key = (name.to_string(), norm);
        let mut cache = self.series.lock().unwrap_or_else(|e| e.into_inner());
        if !cache.by_norm.contains_key(&key) {
            self.sync_series(&mut cache);
        }
        if !cache.by_norm.contains_key(&key) {
            let lock = self.lock()?;
            self.sync_series(&mut cache);
            if !cache.by_norm.contains_key(&key) {
                let r = self.append_series(kind, &key.0, &key.1);
                if let Err(e) = r {
                    drop(lock);
                    return Err(e);
                }
                self.sync_series(&mut cache);
            }
            drop(lock);
        }
        match cache.by_norm.get(&key) {
            Some(&(k, cell)) if k == kind => Ok(cell),
            Some(_) => Err(format!("series {name} exists with another kind")),
            None => Err(format!("series {name} could not be registered")),
        }
    }

    /// S2, with the writers' lock held.
    fn append_series(&self, kind: u8, name: &str, labels: &Labels) -> Result<(), String> {
        let count = self.m.load_u64(H_SERIES_COUNT, Relaxed);
        let used = self.m.load_u64(H_CELLS_USED, Relaxed);
        let ncells = if kind == KIND_HISTOGRAM { self.g.hist_buckets as u64 + 1 } else { 1 };
        if count >= self.g.series_max as u64 || used + ncells > self.g.cells_per_slot as u64 {
            return Err(format!("no room for series {name}: {count}/{} series, {used}/{} cells", self.g.series_max, self.g.cells_per_slot));
        }
        let desc = encode_desc(name, labels);
        if desc.len() > SERIES_ENTRY_SIZE - 16 {
            return Err(format!("series {name} is {} bytes encoded", desc.len()));
        }
        let off = self.region(R_SERIES) + count as usize * SERIES_ENTRY_SIZE;
        let mut entry = vec![0u8; SERIES_ENTRY_SIZE];
        entry[0..4].copy_from_slice(&(used as u32).to_le_bytes());
        entry[4..6].copy_from_slice(&(ncells as u16).to_le_bytes());
        entry[6] = kind;
        entry[8..10].copy_from_slice(&(desc.len() as u16).to_le_bytes());
        entry[16..16 + desc.len()].copy_from_slice(&desc);
        self.m.write_bytes(off, &entry);
        self.m.store_u64(H_CELLS_USED, used + ncells, Relaxed);
        sys::fence_release();
        self.m.store_u64(H_SERIES_COUNT, count + 1, Release);
        Ok(())
    }

    fn cell_offset(&self, slot: usize, cell: u32) -> usize {
        self.region(R_COUNTERS) + 8 * (slot * self.g.cells_per_slot as usize + cell as usize)
    }

    /// N1: add to a counter cell of our own slot (load + store; one writer per block).
    pub fn cell_add(&self, slot: usize, cell: u32, v: f64) {
        let off = self.cell_offset(slot, cell);
        self.m.store_f64(off, self.m.load_f64(off) + v);
    }

    pub fn cell_get(&self, slot: usize, cell: u32) -> f64 {
        self.m.load_f64(self.cell_offset(slot, cell))
    }

    /// N2: bucket = first bound >= value (Python's bisect_left), then the sum cell.
    pub fn histogram_observe(&self, slot: usize, cell: u32, v: f64) {
        let b = self.g.hist_bounds.iter().position(|&x| x >= v).unwrap_or(self.g.hist_bounds.len().saturating_sub(1));
        self.cell_add(slot, cell + b as u32, 1.0);
        self.cell_add(slot, cell + self.g.hist_buckets, v);
    }

    // ---- writers' lock (K2, K3) -----------------------------------------------------------------------

    /// Take the writers' lock (K2), taking over a dead owner's (K3); gives up after 5 s.
    pub fn lock(&self) -> Result<LockGuard<'_>, String> {
        let Some((w, r)) = &self.sems else { return Err("segment has no writer lock (a private buffer)".into()) };
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut seen: Option<(u64, Instant)> = None;
        loop {
            if w.wait_ms(50) {
                self.hold();
                return Ok(LockGuard { seg: self });
            }
            if Instant::now() > deadline {
                return Err("the segment's writer lock stayed held for 5 s".into());
            }
            let owner = self.m.load_u64(L_OWNER_PID, Relaxed);
            let ostart = self.m.load_u64(L_OWNER_START, Relaxed);
            let seq = self.m.load_u64(L_SEQ, Relaxed);
            let dead = if owner != 0 {
                !sys::pid_exists(owner as i32) || (ostart != 0 && proc_start(owner as u32) != ostart)
            } else {
                match seen {
                    Some((s, t)) if s == seq => t.elapsed() > Duration::from_secs(1),
                    _ => {
                        seen = Some((seq, Instant::now()));
                        false
                    }
                }
            };
            if dead && r.wait_ms(1000) {
                let same = self.m.load_u64(L_OWNER_PID, Relaxed) == owner
                    && self.m.load_u64(L_OWNER_START, Relaxed) == ostart
                    && self.m.load_u64(L_SEQ, Relaxed) == seq
                    && w.value() == 0;
                if same {
                    self.hold();
                    self.m.store_u64(L_TAKEOVERS, self.m.load_u64(L_TAKEOVERS, Relaxed) + 1, Relaxed);
                    self.repair();
                    r.post();
                    return Ok(LockGuard { seg: self });
                }
                r.post();
            }
        }
    }

    fn hold(&self) {
        let pid = std::process::id();
        self.m.store_u64(L_OWNER_PID, pid as u64, Relaxed);
        self.m.store_u64(L_OWNER_START, proc_start(pid), Relaxed);
        self.m.store_u64(L_ACQUIRED_AT_NS, now_ns(), Relaxed);
        self.m.store_u64(L_SEQ, self.m.load_u64(L_SEQ, Relaxed) + 1, Relaxed);
    }

    /// K4: discard the cache slot a dead owner left odd.
    fn repair(&self) {
        let dirty = self.m.load_u64(L_DIRTY_CACHE_SLOT, Relaxed);
        if dirty == 0 || dirty > self.g.cache_slot_count as u64 {
            return;
        }
        let idx = dirty as usize - 1;
        let base = self.region(R_CACHE) + idx * self.g.cache_slot_size as usize;
        let seq = self.m.load_u64(base, Relaxed);
        if seq & 1 == 1 {
            self.m.store_u32(base + 8, 0, Relaxed);
            self.m.store_u32(base + 12, 0, Relaxed);
            self.m.store_u32(base + 28, 0, Relaxed);
            sys::fence_release();
            self.m.store_u64(base, seq + 1, Release);
            self.m.store_u32(self.region(R_CACHE_TAGS) + 4 * idx, 0, Release);
            let mut used = 0u64;
            for j in 0..self.g.cache_slot_count as usize {
                if self.m.load_u32(self.region(R_CACHE) + j * self.g.cache_slot_size as usize + 8, Relaxed) != 0 {
                    used += 1;
                }
            }
            self.m.store_u64(H_CACHE_USED, used, Relaxed);
            self.m.store_u64(720, self.m.load_u64(720, Relaxed) + 1, Relaxed);
        }
        self.m.store_u64(L_DIRTY_CACHE_SLOT, 0, Relaxed);
    }
}

pub struct LockGuard<'a> {
    seg: &'a Segment,
}

impl Drop for LockGuard<'_> {
    fn drop(&mut self) {
        self.seg.m.store_u64(L_OWNER_PID, 0, Relaxed);
        self.seg.m.store_u64(L_OWNER_START, 0, Relaxed);
        if let Some((w, _)) = &self.seg.sems {
            w.post();
        }
    }
}

/// A series desc: msgpack `[name, [[label, value], …]]`, labels sorted (S3).
pub fn encode_desc(name: &str, labels: &Labels) -> Vec<u8> {
    let mut e = Enc::default();
    e.array(2);
    e.str(name);
    e.array(labels.len());
    for (k, v) in labels {
        e.array(2);
        e.str(k);
        e.str(v);
    }
    e.0
}

fn decode_desc(b: &[u8]) -> Option<(String, Labels)> {
    let v = msgpack::decode(b)?;
    let a = v.as_array()?;
    let name = a.first()?.as_str()?.to_string();
    let mut labels = Vec::new();
    for p in a.get(1)?.as_array()? {
        let p = p.as_array()?;
        labels.push((p.first()?.as_str()?.to_string(), p.get(1)?.as_str()?.to_string()));
    }
    Some((name, labels))
}
