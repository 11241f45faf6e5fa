//! Every `unsafe` of the crate: the shared mapping's atomic word access, the named semaphores of the
//! writers' lock, and CPU pinning. Callers get safe, bounds-checked methods.

use std::ffi::CString;
use std::fs::OpenOptions;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicU8, Ordering};

/// A shared mapping of the whole segment object (or of a private buffer, for tests).
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
    _keep: Keep,
}

#[allow(dead_code)] // held only to keep the memory alive
enum Keep {
    Map(memmap2::MmapRaw),
    Buf(Box<[u64]>),
}

// SAFETY: the mapping is shared memory accessed only through atomics (or plain byte copies guarded by a
// seqlock); the raw pointer stays valid for the life of `_keep`, which this struct owns.
unsafe impl Send for Mapping {}
// SAFETY: as above; every access goes through atomic operations, so concurrent use from threads is sound.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Map the POSIX shared-memory object `name` ("/qag-…"), read-write, shared.
    pub fn open_shm(name: &str) -> std::io::Result<Mapping> {
        let path = format!("/dev/shm/{}", name.trim_start_matches('/'));
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let map = memmap2::MmapRaw::map_raw(&file)?;
        Ok(Mapping { ptr: map.as_mut_ptr(), len: map.len(), _keep: Keep::Map(map) })
    }

    /// A private copy of `bytes` (golden vectors in tests), 8-aligned.
    pub fn from_bytes(bytes: &[u8]) -> Mapping {
        let mut words = vec![0u64; bytes.len().div_ceil(8)].into_boxed_slice();
        let ptr = words.as_mut_ptr() as *mut u8;
        // SAFETY: `words` holds at least bytes.len() bytes, freshly allocated, not aliased.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, bytes.len()) };
        Mapping { ptr, len: bytes.len(), _keep: Keep::Buf(words) }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, off: usize, size: usize, align: usize) {
        assert!(off.is_multiple_of(align) && off.checked_add(size).is_some_and(|e| e <= self.len),
                "segment access out of bounds or misaligned: {off}+{size}");
    }

    fn a64(&self, off: usize) -> &AtomicU64 {
        self.check(off, 8, 8);
        // SAFETY: in bounds and 8-aligned (checked; the mapping is page-aligned); AtomicU64 has the layout of
        // u64 and the memory lives as long as &self.
        unsafe { &*(self.ptr.add(off) as *const AtomicU64) }
    }

    fn a32(&self, off: usize) -> &AtomicU32 {
        self.check(off, 4, 4);
        // SAFETY: in bounds and 4-aligned (checked); lifetime tied to &self.
        unsafe { &*(self.ptr.add(off) as *const AtomicU32) }
    }

    pub fn load_u64(&self, off: usize, o: Ordering) -> u64 {
        self.a64(off).load(o)
    }

    pub fn store_u64(&self, off: usize, v: u64, o: Ordering) {
        self.a64(off).store(v, o)
    }

    pub fn load_u32(&self, off: usize, o: Ordering) -> u32 {
        self.a32(off).load(o)
    }

    pub fn store_u32(&self, off: usize, v: u32, o: Ordering) {
        self.a32(off).store(v, o)
    }

    pub fn load_f64(&self, off: usize) -> f64 {
        f64::from_bits(self.load_u64(off, Ordering::Relaxed))
    }

    pub fn store_f64(&self, off: usize, v: f64) {
        self.store_u64(off, v.to_bits(), Ordering::Relaxed)
    }

    /// Copy bytes out with relaxed atomic byte loads (the seqlock decides whether the copy is valid, C3).
    pub fn read_bytes(&self, off: usize, len: usize) -> Vec<u8> {
        self.check(off, len, 1);
        let mut out = Vec::with_capacity(len);
        for i in 0..len {
            // SAFETY: in bounds (checked above); AtomicU8 has the layout of u8.
            let b = unsafe { &*(self.ptr.add(off + i) as *const AtomicU8) };
            out.push(b.load(Ordering::Relaxed));
        }
        out
    }

    /// Copy `len` bytes out with relaxed 8-byte atomic loads from an 8-aligned offset (C3: the seqlock
    /// decides whether the copy is valid). Reads up to 7 bytes past `len`, within the checked bounds.
    pub fn read_words(&self, off: usize, len: usize) -> Vec<u8> {
        let words = len.div_ceil(8);
        self.check(off, words * 8, 8);
        let mut out = Vec::with_capacity(words * 8);
        for i in 0..words {
            out.extend_from_slice(&self.load_u64(off + 8 * i, Ordering::Relaxed).to_le_bytes());
        }
        out.truncate(len);
        out
    }

    /// Store bytes with relaxed atomic byte stores (published by a later Release store, R2/S2).
    pub fn write_bytes(&self, off: usize, data: &[u8]) {
        self.check(off, data.len(), 1);
        for (i, &v) in data.iter().enumerate() {
            // SAFETY: in bounds (checked above); AtomicU8 has the layout of u8.
            let b = unsafe { &*(self.ptr.add(off + i) as *const AtomicU8) };
            b.store(v, Ordering::Relaxed);
        }
    }
}

/// Acquire or release fence (LAYOUT.md [Memory ordering]).
pub fn fence_acquire() {
    fence(Ordering::Acquire)
}

pub fn fence_release() {
    fence(Ordering::Release)
}

/// A named POSIX semaphore (the writers' lock `name-w`, the takeover lock `name-r`).
pub struct Sem(*mut libc::sem_t);

// SAFETY: a sem_t handle from sem_open may be used from any thread (POSIX semaphores are thread-safe).
unsafe impl Send for Sem {}
// SAFETY: as above.
unsafe impl Sync for Sem {}

impl Sem {
    pub fn open(name: &str) -> std::io::Result<Sem> {
        let c = CString::new(name).map_err(|_| std::io::Error::other("NUL in semaphore name"))?;
        // SAFETY: c is a valid NUL-terminated string; oflag 0 opens an existing semaphore only.
        let s = unsafe { libc::sem_open(c.as_ptr(), 0) };
        if s == libc::SEM_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Sem(s))
    }

    /// sem_timedwait for `ms` milliseconds; true when acquired.
    pub fn wait_ms(&self, ms: u64) -> bool {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: ts is a valid out-pointer.
        unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
        let nsec = ts.tv_nsec as u64 + (ms % 1000) * 1_000_000;
        ts.tv_sec += (ms / 1000 + nsec / 1_000_000_000) as libc::time_t;
        ts.tv_nsec = (nsec % 1_000_000_000) as libc::c_long;
        loop {
            // SAFETY: self.0 is an open semaphore; ts is valid.
            let r = unsafe { libc::sem_timedwait(self.0, &ts) };
            if r == 0 {
                return true;
            }
            if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                return false;
            }
        }
    }

    pub fn post(&self) {
        // SAFETY: self.0 is an open semaphore.
        unsafe { libc::sem_post(self.0) };
    }

    pub fn value(&self) -> i32 {
        let mut v: libc::c_int = 0;
        // SAFETY: self.0 is open; v is a valid out-pointer.
        unsafe { libc::sem_getvalue(self.0, &mut v) };
        v
    }
}

impl Drop for Sem {
    fn drop(&mut self) {
        // SAFETY: self.0 came from sem_open and is closed once.
        unsafe { libc::sem_close(self.0) };
    }
}

/// Pin the calling thread to one logical CPU; false if the kernel refused.
pub fn pin_thread(cpu: usize) -> bool {
    // SAFETY: cpu_set_t is plain data; zeroed is a valid empty set; CPU_SET bounds-checks by its type size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if cpu >= 8 * std::mem::size_of::<libc::cpu_set_t>() {
            return false;
        }
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// Set the calling thread's nice value (Linux: setpriority on a thread id applies to that thread only);
/// false if the kernel refused (lowering it needs CAP_SYS_NICE or RLIMIT_NICE).
pub fn set_thread_nice(nice: i32) -> bool {
    // SAFETY: gettid has no preconditions; setpriority only reads its integer arguments.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, nice) == 0
    }
}

/// True when process `pid` exists (kill(pid, 0) does not fail with ESRCH).
pub fn pid_exists(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Keep freed memory for the next call instead of giving it back to the kernel after each one (glibc
/// malloc). A 1,000-row page's cells (about 200 KiB) and body are above malloc's first mmap threshold, and a
/// freed top of heap above 128 KiB is trimmed: without this every such call maps, faults in, zeroes and
/// unmaps its pages again. Blocks up to `mmap` bytes come from the heap; up to `trim` bytes stay free in it.
/// False where mallopt refused (or another malloc is linked).
pub fn keep_freed_memory(mmap: usize, trim: usize) -> bool {
    let (Ok(mmap), Ok(trim)) = (libc::c_int::try_from(mmap), libc::c_int::try_from(trim)) else { return false };
    // SAFETY: mallopt only sets malloc's tunables; called before the threads start, as glibc recommends.
    unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, mmap) == 1 && libc::mallopt(libc::M_TRIM_THRESHOLD, trim) == 1 }
}

/// Set this process's name (comm, shown by `ps -o comm` and `top`).
pub fn set_process_name(name: &str) {
    if let Ok(c) = CString::new(name) {
        // SAFETY: PR_SET_NAME reads a NUL-terminated string of up to 16 bytes; c is valid.
        unsafe { libc::prctl(libc::PR_SET_NAME, c.as_ptr() as libc::c_ulong, 0, 0, 0) };
    }
}

/// Block SIGTERM and SIGINT in the calling thread (threads started later inherit the mask), so that
/// `wait_stop_signal` alone receives them.
pub fn block_stop_signals() {
    // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialise it; pthread_sigmask only reads it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// Wait up to `ms` for SIGTERM or SIGINT (blocked by `block_stop_signals`); true when one arrived.
pub fn wait_stop_signal(ms: u64) -> bool {
    // SAFETY: as above; sigtimedwait writes only into the null-allowed info pointer and reads ts.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        let ts = libc::timespec { tv_sec: (ms / 1000) as libc::time_t, tv_nsec: ((ms % 1000) * 1_000_000) as libc::c_long };
        libc::sigtimedwait(&set, std::ptr::null_mut(), &ts) > 0
    }
}

/// The name of the effective user, as libpq takes it when a connection names no user.
pub fn os_user() -> Option<String> {
    // SAFETY: getpwuid returns a pointer into static storage or null; we copy the name out at once and
    // only the plane's connect path calls this (rarely).
    unsafe {
        let pw = libc::getpwuid(libc::geteuid());
        if pw.is_null() || (*pw).pw_name.is_null() {
            return None;
        }
        std::ffi::CStr::from_ptr((*pw).pw_name).to_str().ok().map(str::to_string)
    }
}
