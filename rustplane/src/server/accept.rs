//! Each plane thread: its own current-thread runtime and SO_REUSEPORT listener, the accept loop, one task
//! per connection (HTTP/1.1 kept alive), the dispatch of each request (`route`: served or forwarded), and
//! stopping on SIGTERM (`DRAINING`) without refusing or resetting a connection the kernel already accepted.

use super::forward::forward;
use super::serve::{serve_query, Decision};
use super::{Body, Shared};
use hyper::body::Incoming;
use hyper::header::HeaderValue;
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::cell::Cell as StdCell;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Calls being handled now, and whether the plane is stopping (SIGTERM): listeners close, calls in
/// flight finish, then the process exits.
pub static INFLIGHT: AtomicUsize = AtomicUsize::new(0);
pub static DRAINING: AtomicBool = AtomicBool::new(false);

struct InFlight;

impl InFlight {
    fn enter() -> InFlight {
        INFLIGHT.fetch_add(1, Ordering::SeqCst);
        InFlight
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        INFLIGHT.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn handle(sh: Arc<Shared>, req: Request<Incoming>, peer: Option<IpAddr>) -> Result<Response<Body>, Infallible> {
    let _guard = InFlight::enter();
    let mut r = route(sh, req, peer).await?;
    if DRAINING.load(Ordering::Relaxed) {
        r.headers_mut().insert("connection", HeaderValue::from_static("close"));
    }
    Ok(r)
}

async fn route(sh: Arc<Shared>, req: Request<Incoming>, peer: Option<IpAddr>) -> Result<Response<Body>, Infallible> {
    // A GET with a body is Python's to refuse (400 invalid_body: what the body says would be ignored).
    let has_body = req.headers().contains_key(hyper::header::TRANSFER_ENCODING)
        || req.headers().get(hyper::header::CONTENT_LENGTH).is_some_and(|v| v.as_bytes() != b"0");
    if req.method() == hyper::Method::GET && !has_body && req.uri().path().starts_with("/q/") {
        match serve_query(&sh, &req, peer).await {
            Decision::Answer(r) => return Ok(r),
            Decision::Forward(why) => {
                if sh.debug {
                    crate::plog!("info", "forwarding {}: {why}", req.uri());
                }
            }
        }
    }
    Ok(forward(&sh.upstream, req, peer).await)
}

/// Run one plane thread: its own listener (SO_REUSEPORT) and runtime, until the plane stops.
///
/// Stopping (DRAINING, set on SIGTERM): the thread stops accepting first — it takes every connection the
/// kernel already completed from its accept queue (closing a listener resets those), then closes the
/// listener, so a new connection is refused rather than accepted and reset. Then every connection is
/// shut down gracefully: an idle kept-alive one is closed, one with a call in flight (served or forwarded:
/// the workers are still up, the arbiter stops the plane before them) finishes its answer, and its run is
/// recorded, then closes. The thread returns when its last connection has closed (main gives up after 10 s).
pub fn run_thread(sh: Arc<Shared>, listen: SocketAddr) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        let sock = if listen.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
        sock.set_reuseaddr(true)?;
        sock.set_reuseport(true)?;
        sock.bind(listen)?;
        let listener = sock.listen(1024)?;
        let (drain_tx, drain_rx) = tokio::sync::watch::channel(false);
        let open = Rc::new(StdCell::new(0usize));
        loop {
            if DRAINING.load(Ordering::Relaxed) {
                // no new connections: the ones already in the accept queue are taken and served first
                let std_listener = listener.into_std()?;
                std_listener.set_nonblocking(true)?;
                while let Ok((stream, addr)) = std_listener.accept() {
                    if let Ok(stream) = tokio::net::TcpStream::from_std(stream) {
                        spawn_connection(&sh, stream, addr, &open, drain_rx.clone());
                    }
                }
                drop(std_listener);
                let _ = drain_tx.send(true);
                while open.get() > 0 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                return Ok(());
            }
            let accepted = match tokio::time::timeout(Duration::from_millis(100), listener.accept()).await {
                Ok(a) => a,
                Err(_) => continue, // look at DRAINING again
            };
            match accepted {
                Ok((stream, addr)) => spawn_connection(&sh, stream, addr, &open, drain_rx.clone()),
                Err(e) => {
                    crate::plog!("error", "accept: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    })
}

/// Serve one accepted connection on this thread; `open` counts the thread's connections, `drain` turns
/// true when the plane stops (then the connection finishes what it is answering and closes).
fn spawn_connection(sh: &Arc<Shared>, stream: tokio::net::TcpStream, addr: SocketAddr, open: &Rc<StdCell<usize>>,
                    mut drain: tokio::sync::watch::Receiver<bool>) {
    let _ = stream.set_nodelay(true);
    let sh = sh.clone();
    let peer = Some(addr.ip()).map(|ip| match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    });
    struct Open(Rc<StdCell<usize>>);
    impl Drop for Open {
        fn drop(&mut self) {
            self.0.set(self.0.get() - 1);
        }
    }
    open.set(open.get() + 1);
    let guard = Open(open.clone());
    let header_timeout = sh.header_timeout;
    tokio::task::spawn_local(async move {
        let _guard = guard;
        let svc = hyper::service::service_fn(move |req| handle(sh.clone(), req, peer));
        // A client that sends its header slowly (or, kept alive, no next request) holds a task and a socket:
        // it is disconnected after QAG_HEADER_TIMEOUT, as Python's workers do (hyper starts the timer when the
        // connection opens and again when it waits for the next request).
        let mut conn = std::pin::pin!(hyper::server::conn::http1::Builder::new()
            .keep_alive(true)
            .timer(TokioTimer::new())
            .header_read_timeout(header_timeout)
            .serve_connection(TokioIo::new(stream), svc));
        let stopping = std::pin::pin!(async move {
            while !*drain.borrow_and_update() {
                if drain.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        });
        if let futures_util::future::Either::Right(_) = futures_util::future::select(conn.as_mut(), stopping).await {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    });
}
