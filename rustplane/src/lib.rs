//! # qag-plane
//!
//! The Rust data plane of qag. It sits in front of gunicorn and serves `GET /q/<name>` reads of saved
//! queries itself, from what Python published in the instance's shared segment (`shm/LAYOUT.md`):
//! key entries, plans and connection entries, each validated against the segment's generations on
//! every call. Every security decision is Python's: the plane only applies decisions already made
//! (key active / expiry / allowed IPs, plan, masking transforms) and forwards to gunicorn, unchanged,
//! everything it cannot answer byte-for-byte as Python would (other routes, POST, administrators,
//! writes, streaming, `version`/`timeout`, unknown or stale entries, rate-limited keys, SQLite and
//! ClickHouse connections, column types it does not render, connection failures).
//!
//! It reads PostgreSQL (tokio-postgres) and MySQL/MariaDB (mysql_async) itself: per-thread pools of
//! read-only sessions set up as qag/connectors.py sets up Python's, prepared statements, and values decoded
//! into what psycopg2 / mysql-connector-python would return, so render.py's bytes come out.
//!
//! Each served call is recorded in the plane's own ring (a run record identical to
//! `qag/entries.py`'s, `served_by = "plane"`) and counted in its own counter slot, so the recorder
//! and `/metrics` see it like any worker's.
//!
//! Modules, from the wire down:
//!
//! - [`server`]: the HTTP side (`server/accept.rs` the threads and the accept loop, `serve.rs` the request
//!   path, `execute.rs` the database call, `forward.rs` forwarding to gunicorn, `record.rs` run records and
//!   counters);
//! - `options` (a call's query string and `format`/`page`/`page_size`, twin of qag/http/options.py),
//!   [`params`] (parameter specs and binding, twin of qag/params.py), `error` (error answers and bodies);
//! - [`entries`] (the published key, plan and connection entries and the run record, shm/LAYOUT.md [Entries], [Run record]), [`mask`] (masking),
//!   [`render`] (JSON, NDJSON, CSV), [`pyfmt`] (Python's text forms);
//! - `pg` and `mysql` (sessions and value decoding per database), `pool` (per-thread session pools and the
//!   lease of a session), `limits` (statement limits, client-side deadlines, keepalives);
//! - [`responses`] (the response cache's reader: saved queries' cached answers, shm/LAYOUT.md [Response cache]);
//! - [`segment`] (the shared segment's layout), [`msgpack`], [`sys`] (every `unsafe`), [`log`] (log lines,
//!   text or JSON as QAG_LOG_FORMAT says).
//!
//! Public (`pub mod`) are the modules `main.rs` and the tests in `tests/` use, and those whose types the
//! public ones carry; the rest is the crate's own.

pub mod entries;
mod error;
mod limits;
pub mod log;
pub mod mask;
pub mod msgpack;
mod mysql;
mod options;
pub mod params;
mod pg;
mod pool;
pub mod pyfmt;
pub mod render;
pub mod responses;
pub mod segment;
pub mod server;
#[allow(unsafe_code)] // the one module allowed `unsafe` ([lints] in Cargo.toml): each block has a SAFETY line
pub mod sys;
