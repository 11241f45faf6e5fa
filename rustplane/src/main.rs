//! `qag-plane`: qag's Rust data plane (see the crate docs in lib.rs).
//!
//! `qag-plane --listen 127.0.0.1:8080 --upstream unix:/path/gunicorn.sock|127.0.0.1:PORT --segment /qag-xxxx
//!  --slot N --threads T [--pin-cpus 0,1] --home QAG_HOME`
//! Environment: QAG_MASK_KEY_FILE (the file's bytes are the HMAC mask key) or QAG_MASK_KEY; QAG_ADMIN_KEY
//! (requests bearing it are always forwarded); QAG_RECORD_WAIT_MS (default 50); QAG_PLANE_NICE (the
//! threads' nice value, default unchanged).

use qag_plane::plog;
use qag_plane::segment::Segment;
use qag_plane::server::{run_thread, Shared, Upstream, DRAINING, INFLIGHT};
use qag_plane::sys;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// mimalloc rather than glibc's malloc: a call allocates a page's cells, its body, headers and the database
/// driver's buffers, and glibc's free lists (consolidation on every large request included) were ~13% of the
/// plane's samples on a 100-row page; mimalloc took the plane's CPU per such page down ~13% (2026-12-06).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

const USAGE: &str = "usage: qag-plane --listen HOST:PORT --upstream unix:/path|HOST:PORT --segment /qag-xxxx --slot N \
--threads T [--pin-cpus 0,1] --home QAG_HOME";

struct Args {
    listen: SocketAddr,
    upstream: String,
    segment: String,
    slot: usize,
    threads: usize,
    pin: Vec<usize>,
    home: String,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let (mut listen, mut upstream, mut segment, mut slot, mut threads, mut pin, mut home) =
        (None, None, None, None, 1usize, Vec::new(), None);
    while let Some(a) = it.next() {
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (a.clone(), None),
        };
        if flag == "--help" || flag == "-h" {
            return Err(USAGE.to_string());
        }
        let mut val = || inline.clone().or_else(|| it.next()).ok_or(format!("{flag} needs a value\n{USAGE}"));
        match flag.as_str() {
            "--listen" => listen = Some(val()?.parse::<SocketAddr>().map_err(|e| format!("--listen: {e}"))?),
            "--upstream" => upstream = Some(val()?),
            "--segment" => segment = Some(val()?),
            "--slot" => slot = Some(val()?.parse::<usize>().map_err(|e| format!("--slot: {e}"))?),
            "--threads" => threads = val()?.parse::<usize>().map_err(|e| format!("--threads: {e}"))?.max(1),
            "--pin-cpus" => {
                let v = val()?;
                pin = v.split(',').filter(|s| !s.trim().is_empty())
                    .map(|s| s.trim().parse::<usize>().map_err(|e| format!("--pin-cpus {v}: {e}")))
                    .collect::<Result<_, _>>()?;
            }
            "--home" => home = Some(val()?),
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    Ok(Args {
        listen: listen.ok_or(format!("--listen is required\n{USAGE}"))?,
        upstream: upstream.ok_or(format!("--upstream is required\n{USAGE}"))?,
        segment: segment.ok_or(format!("--segment is required\n{USAGE}"))?,
        slot: slot.ok_or(format!("--slot is required\n{USAGE}"))?,
        threads,
        pin,
        home: home.ok_or(format!("--home is required\n{USAGE}"))?,
    })
}

fn mask_key() -> Result<Option<Vec<u8>>, String> {
    if let Ok(path) = std::env::var("QAG_MASK_KEY_FILE") {
        if !path.is_empty() {
            return std::fs::read(&path).map(Some).map_err(|e| format!("QAG_MASK_KEY_FILE {path}: {e}"));
        }
    }
    Ok(std::env::var("QAG_MASK_KEY").ok().filter(|k| !k.is_empty()).map(String::into_bytes))
}

fn main() -> ExitCode {
    sys::set_process_name("qag-plane");
    // pages of up to 8 MiB reuse the heap; at most 32 MiB of it stays free between calls
    sys::keep_freed_memory(8 << 20, 32 << 20);
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let seg = match Segment::attach(&args.segment) {
        Ok(s) => s,
        Err(e) => {
            plog!("error", "{e}");
            return ExitCode::from(3);
        }
    };
    if args.slot >= seg.g.slots as usize {
        plog!("error", "slot {} out of range 0..{}", args.slot, seg.g.slots - 1);
        return ExitCode::from(2);
    }
    let mask = match mask_key() {
        Ok(k) => k,
        Err(e) => {
            plog!("error", "{e}");
            return ExitCode::from(2);
        }
    };
    seg.set_slot(args.slot, std::process::id());
    let wait_ms = std::env::var("QAG_RECORD_WAIT_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(50);
    let admin = std::env::var("QAG_ADMIN_KEY").ok().filter(|k| !k.is_empty());
    let shared = Arc::new(Shared::new(seg, args.slot, Upstream::parse(&args.upstream), args.home.clone(), mask, admin, wait_ms));
    plog!(
        "info",
        "listening on {} ({} threads{}), forwarding to {}, segment {} slot {}",
        args.listen,
        args.threads,
        if args.pin.is_empty() { String::new() } else { format!(", pinned to CPUs {:?}", args.pin) },
        args.upstream,
        args.segment,
        args.slot
    );
    sys::block_stop_signals(); // before the threads start: they inherit the mask
    // QAG_PLANE_NICE: the plane threads' nice value. They share their cores with the recorder and the
    // workers; a negative value lets a call waking the plane preempt their batches at once (tail latency).
    let nice = std::env::var("QAG_PLANE_NICE").ok().and_then(|v| v.trim().parse::<i32>().ok());
    let mut handles = Vec::new();
    for i in 0..args.threads {
        let sh = shared.clone();
        let cpu = if args.pin.is_empty() { None } else { Some(args.pin[i % args.pin.len()]) };
        let listen = args.listen;
        let h = std::thread::Builder::new().name(format!("qag-plane-{i}")).spawn(move || {
            if let Some(c) = cpu {
                if !sys::pin_thread(c) {
                    plog!("warning", "could not pin thread {i} to CPU {c}");
                }
            }
            if let Some(n) = nice {
                if !sys::set_thread_nice(n) {
                    plog!("warning", "could not set thread {i}'s nice value to {n}");
                }
            }
            if let Err(e) = run_thread(sh, listen) {
                plog!("error", "thread {i}: {e}");
                std::process::exit(4);
            }
        });
        match h {
            Ok(h) => handles.push(h),
            Err(e) => {
                plog!("error", "cannot start thread {i}: {e}");
                return ExitCode::from(4);
            }
        }
    }
    // M2: a heartbeat every second tells `qag shm stat` and the arbiter that the plane is alive.
    loop {
        shared.seg.set_heartbeat(shared.slot, None);
        if sys::wait_stop_signal(1000) {
            break;
        }
    }
    // SIGTERM: stop accepting, let the calls in flight finish (and be recorded), then exit.
    DRAINING.store(true, Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(10);
    for h in handles {
        while !h.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    plog!("info", "stopped ({} calls still in flight)", INFLIGHT.load(Ordering::SeqCst));
    ExitCode::SUCCESS
}
