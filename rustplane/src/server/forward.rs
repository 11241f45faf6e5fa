//! Forwarding to gunicorn: every request the plane does not serve goes there unchanged (hop-by-hop headers
//! aside, the caller's address in `X-Qag-Client-Addr`), over kept-alive HTTP/1.1 connections kept per
//! thread, the most recently used first and never one idle for `UPSTREAM_IDLE` or more. A gunicorn that
//! cannot be reached is a 502 `upstream_unavailable`.

use super::{error_response, mint_request_id, Body};
use crate::error::ApiError;
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use std::cell::RefCell;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// Where gunicorn listens: `unix:/path` or `HOST:PORT`.
#[derive(Clone, Debug)]
pub enum Upstream {
    Unix(String),
    Tcp(String),
}

impl Upstream {
    pub fn parse(s: &str) -> Upstream {
        match s.strip_prefix("unix:") {
            Some(p) => Upstream::Unix(p.to_string()),
            None => Upstream::Tcp(s.to_string()),
        }
    }
}

thread_local! {
    /// Kept-alive connections to gunicorn with the time each went idle.
    static UPSTREAM: RefCell<Vec<(SendRequest<Incoming>, Instant)>> = const { RefCell::new(Vec::new()) };
}

async fn upstream_sender(up: &Upstream, fresh: bool) -> std::io::Result<SendRequest<Incoming>> {
    let reused = if fresh { None } else { UPSTREAM.with(|p| {
        let mut pool = p.borrow_mut();
        // gunicorn closes a kept-alive connection after `keepalive` seconds (qag: 5, gunicorn's default: 2);
        // one idle nearly that long may close while our request is on its way (a 502): not reused
        let now = Instant::now();
        pool.retain(|(s, idle)| !s.is_closed() && now.duration_since(*idle) < UPSTREAM_IDLE);
        // the most recently used first: its socket and gunicorn's thread for it are warm
        let i = pool.iter().rposition(|(s, _)| s.is_ready())?;
        Some(pool.swap_remove(i).0)
    }) };
    if let Some(s) = reused {
        return Ok(s);
    }
    macro_rules! handshake {
        ($io:expr) => {{
            let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new($io))
                .await
                .map_err(std::io::Error::other)?;
            tokio::task::spawn_local(async move {
                let _ = conn.await;
            });
            sender
        }};
    }
    Ok(match up {
        Upstream::Unix(p) => handshake!(tokio::net::UnixStream::connect(p).await?),
        Upstream::Tcp(a) => {
            let s = tokio::net::TcpStream::connect(a.as_str()).await?;
            s.set_nodelay(true)?;
            handshake!(s)
        }
    })
}

/// Longest idle time of a kept-alive gunicorn connection the plane reuses (below gunicorn's keepalive).
const UPSTREAM_IDLE: Duration = Duration::from_millis(1500);

/// Forwarded answers up to this length are read whole before they are written to the caller.
const FORWARD_BUFFER_MAX: u64 = 256 * 1024;

const HOP: [&str; 3] = ["connection", "keep-alive", "proxy-connection"];

/// Forward a request unchanged (hop-by-hop headers aside; the caller's address in X-Qag-Client-Addr).
pub(super) async fn forward(up: &Upstream, mut req: Request<Incoming>, peer: Option<IpAddr>) -> Response<Body> {
    let h = req.headers_mut();
    for n in HOP {
        h.remove(n);
    }
    h.remove("x-qag-client-addr");
    if let Some(ip) = peer {
        if let Ok(v) = HeaderValue::from_str(&ip.to_string()) {
            h.insert(HeaderName::from_static("x-qag-client-addr"), v);
        }
    }
    let mut req = req;
    for attempt in 0..2 {
        // a kept-alive connection gunicorn has just closed (its keepalive timeout) fails before the request
        // is written: hyper gives the request back and it goes again on a new connection
        let mut sender = match upstream_sender(up, attempt > 0).await {
            Ok(s) => s,
            Err(e) => return bad_gateway(&format!("cannot connect to gunicorn: {e}")),
        };
        if sender.ready().await.is_err() {
            continue;
        }
        let resp = sender.try_send_request(req).await;
        UPSTREAM.with(|p| {
            let mut pool = p.borrow_mut();
            if pool.len() < 256 && !sender.is_closed() {
                pool.push((sender, Instant::now()));
            }
        });
        match resp {
            Ok(mut r) => {
                for n in HOP {
                    r.headers_mut().remove(n);
                }
                // gunicorn writes the head and the body separately: a small answer is read whole and written
                // to the caller in one write (one wake-up and one packet fewer on each side); anything
                // without a length (streams, /events) or large goes through as it comes
                let small = r.headers().get(hyper::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<u64>().ok()).is_some_and(|n| n <= FORWARD_BUFFER_MAX);
                if small {
                    let (parts, body) = r.into_parts();
                    return match http_body_util::BodyExt::collect(body).await {
                        Ok(c) => Response::from_parts(parts, Either::Left(Full::new(c.to_bytes()))),
                        Err(e) => bad_gateway(&format!("gunicorn's answer broke off: {e}")),
                    };
                }
                return r.map(Either::Right);
            }
            Err(mut e) => match e.take_message() {
                Some(r) => req = r,
                None => return bad_gateway(&format!("gunicorn did not answer: {}", e.error())),
            },
        }
    }
    bad_gateway("the connection to gunicorn failed twice")
}

fn bad_gateway(detail: &str) -> Response<Body> {
    let err = ApiError::new(502, "upstream_unavailable",
                            format!("The data plane could not reach the qag workers ({detail}); retry shortly."));
    error_response(&err, &mint_request_id())
}
