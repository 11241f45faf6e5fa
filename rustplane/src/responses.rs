//! The response cache's reader (shm/LAYOUT.md [Response cache], region `responses`), the twin of
//! shm/responses.py's `get`: R5's key suffix (the prefix comes in the plan entry), R6's hash, R9's lock-free
//! read with its position checks, R10's freshness and R16's advisory hit count. The plane never writes a
//! record, never claims a fill (R13) and never refreshes one (R11): a miss is forwarded and Python fills it.

use crate::params::PVal;
use crate::sys::{fence_acquire, Mapping};
use sha2::{Digest, Sha256};
use std::sync::atomic::Ordering::{Acquire, Relaxed};

/// R4: an entry's magic word ("QAGR" in memory).
pub const MAGIC: u32 = 0x5247_4151;
/// R4: the record header's bytes, before the key.
pub const HEADER: usize = 80;
/// R3: ways per bucket, bytes per way.
const WAYS: usize = 8;
const WAY_SIZE: usize = 32;
// R2: the region header's fields the reader uses (offsets from the region's start)
const F_CAPACITY: usize = 0;
const F_ARENA: usize = 8;
const F_INDEX: usize = 16;
const F_BUCKETS: usize = 24;
const F_MAX_RECORD: usize = 40;
const F_WPOS: usize = 64;
const F_WLIMIT: usize = 128;

/// R5's suffix: the format's name, the page, the page size used and the bound arguments (the plan's
/// `arg_names` order). None when a value has no encoding (the call is then not answered from the cache).
pub fn suffix(format: &str, page: i64, page_size: i64, args: &[PVal]) -> Option<Vec<u8>> {
    let f = format.as_bytes();
    let n = u16::try_from(args.len()).ok()?;
    let mut out = Vec::with_capacity(1 + f.len() + 18 + 9 * args.len());
    out.push(u8::try_from(f.len()).ok()?);
    out.extend_from_slice(f);
    out.extend_from_slice(&u64::try_from(page).ok()?.to_le_bytes());
    out.extend_from_slice(&u64::try_from(page_size).ok()?.to_le_bytes());
    out.extend_from_slice(&n.to_le_bytes());
    for a in args {
        match a {
            PVal::Null => out.push(0),
            PVal::Bool(false) => out.push(1),
            PVal::Bool(true) => out.push(2),
            PVal::Int(i) => {
                out.push(3);
                out.extend_from_slice(&i.to_le_bytes());
            }
            PVal::Float(x) => {
                out.push(4);
                out.extend_from_slice(&x.to_le_bytes());
            }
            PVal::Str(s) => {
                out.push(5);
                out.extend_from_slice(&u32::try_from(s.len()).ok()?.to_le_bytes());
                out.extend_from_slice(s.as_bytes());
            }
        }
    }
    Some(out)
}

/// R6: the first 8 bytes of sha256(key), little-endian; 0 is 1.
pub fn key_hash(key: &[u8]) -> u64 {
    let d = Sha256::digest(key);
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    match u64::from_le_bytes(b) {
        0 => 1,
        h => h,
    }
}

/// A record R9 found: an answer as it was stored (R4), and where its way is (R16).
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub body: Vec<u8>,
    pub rows: u32,
    pub has_more: bool,
    pub etag: [u8; 16],
    pub ttl_s: u32,
    pub created_at_ns: u64,
    pub expires_at_ns: u64,
    /// the record's position
    pub pos: u64,
    /// the region offset of its index way
    pub way: usize,
}

impl Record {
    /// R10: fresh while `now < expires_at_ns` (CLOCK_REALTIME).
    pub fn fresh(&self, now_ns: u64) -> bool {
        now_ns < self.expires_at_ns
    }

    /// R15: the `ETag` header's value, `"` + 32 lowercase hex digits + `"`.
    pub fn etag_header(&self) -> String {
        format!("\"{}\"", crate::pyfmt::hex(&self.etag))
    }
}

/// R1/R2: what the creator wrote into the region header, as the reader uses it (offsets from the region's start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub capacity: u64,
    pub arena_offset: u64,
    pub index_offset: u64,
    pub index_buckets: u64,
    pub max_record: u64,
}

/// The region of a mapping (the segment's region 7, or a region on its own in the golden vectors), with the
/// geometry its creator wrote (R1, R2): readers take it from there and never recompute it.
pub struct Responses<'a> {
    m: &'a Mapping,
    base: usize,
    capacity: u64,
    arena: usize,
    index: usize,
    buckets: u64,
    max_record: u64,
}

fn le_u32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().expect("4 bytes"))
}

fn le_u64(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().expect("8 bytes"))
}

impl<'a> Responses<'a> {
    /// The region at `base` of `size` bytes; None when there is none (size 0) or its header does not fit
    /// the region (then every lookup would be a miss anyway).
    pub fn new(m: &'a Mapping, base: usize, size: usize) -> Option<Responses<'a>> {
        if size < 4096 || base.checked_add(size)? > m.len() || !base.is_multiple_of(8) {
            return None;
        }
        let u = |off: usize| m.load_u64(base + off, Relaxed);
        let (capacity, arena, index, buckets, max_record) = (u(F_CAPACITY), u(F_ARENA), u(F_INDEX), u(F_BUCKETS), u(F_MAX_RECORD));
        let index_end = index.checked_add(buckets.checked_mul((WAYS * WAY_SIZE) as u64)?)?;
        if capacity == 0 || !capacity.is_multiple_of(4096) || buckets == 0 || !buckets.is_power_of_two() || !index.is_multiple_of(8)
            || index_end > arena || arena.checked_add(capacity)? > size as u64 || !arena.is_multiple_of(8)
        {
            return None;
        }
        Some(Responses { m, base, capacity, arena: base + arena as usize, index: base + index as usize, buckets, max_record })
    }

    pub fn geometry(&self) -> Geometry {
        Geometry {
            capacity: self.capacity,
            arena_offset: (self.arena - self.base) as u64,
            index_offset: (self.index - self.base) as u64,
            index_buckets: self.buckets,
            max_record: self.max_record,
        }
    }

    /// R9: the newest valid record of `key` (fresh or expired: R10 is the caller's), or None. Never blocks,
    /// never waits, no retry: a record overwritten while being read is a miss, and so is a slot being changed.
    pub fn get(&self, key: &[u8], h: u64) -> Option<Record> {
        let bucket = self.index + (h % self.buckets) as usize * WAYS * WAY_SIZE;
        (0..WAYS).find_map(|w| {
            let way = bucket + w * WAY_SIZE;
            if self.m.load_u64(way, Relaxed) != h {
                return None;
            }
            self.read_at(key, way)
        })
    }

    /// R9 steps 2-4 for one way whose hash matched.
    fn read_at(&self, key: &[u8], way: usize) -> Option<Record> {
        let cap = self.capacity;
        // 2. the position, then the write position, both Acquire
        let p = self.m.load_u64(way + 8, Acquire);
        let w = self.m.load_u64(self.base + F_WPOS, Acquire);
        if !p.is_multiple_of(8) || p.checked_add(HEADER as u64)? > w || p.checked_add(cap)? < w {
            return None;
        }
        // 3. the header, checked, then the key and the body (copied now, decided on below)
        let at = self.arena + (p % cap) as usize;
        let head = self.m.read_words(at, HEADER);
        let (magic, length) = (le_u32(&head, 0), le_u32(&head, 4) as u64);
        let (key_len, body_len) = (le_u32(&head, 16) as u64, le_u32(&head, 20) as u64);
        if magic != MAGIC || !length.is_multiple_of(8) || HEADER as u64 + key_len + body_len > length || length > self.max_record
            || p % cap + length > cap || p + length > w || key_len != key.len() as u64
        {
            return None;
        }
        let data = self.m.read_words(at + HEADER, (key_len + body_len) as usize);
        // 4. no writer reserved a byte over [p, p + length) before the copy ended; the key is this one
        fence_acquire();
        let limit = self.m.load_u64(self.base + F_WLIMIT, Relaxed);
        if limit > p + cap || data[..key.len()] != *key {
            return None;
        }
        let mut etag = [0u8; 16];
        etag.copy_from_slice(&head[56..72]);
        Some(Record {
            body: data[key.len()..].to_vec(),
            rows: le_u32(&head, 44),
            has_more: le_u32(&head, 48) & 1 == 1,
            etag,
            ttl_s: le_u32(&head, 40),
            created_at_ns: le_u64(&head, 24),
            expires_at_ns: le_u64(&head, 32),
            pos: p,
            way,
        })
    }

    /// R16: an advisory count on the way of a record served (a Relaxed load and store: a lost update, or one
    /// landing on a way just reused, is allowed).
    pub fn hit(&self, rec: &Record) {
        let off = rec.way + 16;
        self.m.store_u64(off, self.m.load_u64(off, Relaxed).wrapping_add(1), Relaxed);
    }

    /// The way's advisory count (tests, diagnostics).
    pub fn hits(&self, rec: &Record) -> u64 {
        self.m.load_u64(rec.way + 16, Relaxed)
    }

    /// The bucket and way index of a record's way (tests: R3's placement).
    pub fn way_of(&self, rec: &Record) -> (u64, usize) {
        let i = (rec.way - self.index) / WAY_SIZE;
        ((i / WAYS) as u64, i % WAYS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffix_refuses_what_has_no_encoding() {
        assert!(suffix("json", -1, 100, &[]).is_none(), "a page below 0 is not a u64");
        assert!(suffix(&"x".repeat(256), 1, 100, &[]).is_none(), "a format name over 255 bytes");
        assert!(suffix("json", 1, 100, &vec![PVal::Null; 65536]).is_none(), "more than 65,535 arguments");
        // -0.0 and 0.0 are two keys (R5: the f64's own bytes)
        assert_ne!(suffix("json", 1, 1, &[PVal::Float(-0.0)]), suffix("json", 1, 1, &[PVal::Float(0.0)]));
        assert_eq!(suffix("csv", 1, 5, &[]).unwrap(), [&[3u8][..], b"csv", &1u64.to_le_bytes(), &5u64.to_le_bytes(), &[0, 0]].concat());
    }

    #[test]
    fn a_region_whose_header_does_not_fit_is_none() {
        let m = Mapping::from_bytes(&[0u8; 65536]);
        assert!(Responses::new(&m, 0, 0).is_none(), "no region");
        assert!(Responses::new(&m, 0, 65536).is_none(), "an uninitialised header (capacity 0)");
        assert!(Responses::new(&m, 4096, 65536).is_none(), "past the mapping's end");
    }
}
