//! The errors the plane answers with, and how a database call fails: `ApiError` and its body exactly as
//! Python's `json.dumps(err.body(rid))` writes it, Python's fixed sentences (`unauthorized`,
//! `query_failed`, `query_timeout`), `Outcome` (answer this error, or forward to Python) and `ExecError`.

use crate::pyfmt::{float_g, float_repr, json_str};

/// A JSON-able extra of an error body.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Extra {
    Errors(Vec<(String, String)>),
    Timeout(f64),
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ApiError {
    pub(crate) status: u16,
    pub(crate) code: &'static str,
    pub(crate) message: String,
    pub(crate) extra: Option<Extra>,
}

impl ApiError {
    pub(crate) fn new(status: u16, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, code, message: message.into(), extra: None }
    }

    /// `json.dumps({"error", "code", "request_id", **extra})`: separators ", " and ": ", ensure_ascii.
    pub(crate) fn body(&self, rid: &str) -> Vec<u8> {
        let mut s = String::with_capacity(128);
        s.push_str("{\"error\": ");
        json_str(&mut s, &self.message, true);
        s.push_str(", \"code\": ");
        json_str(&mut s, self.code, true);
        s.push_str(", \"request_id\": ");
        json_str(&mut s, rid, true);
        match &self.extra {
            None => {}
            Some(Extra::Errors(errs)) => {
                s.push_str(", \"errors\": {");
                for (i, (k, v)) in errs.iter().enumerate() {
                    if i > 0 {
                        s.push_str(", ");
                    }
                    json_str(&mut s, k, true);
                    s.push_str(": ");
                    json_str(&mut s, v, true);
                }
                s.push('}');
            }
            Some(Extra::Timeout(t)) => {
                s.push_str(", \"timeout\": ");
                s.push_str(&float_repr(*t));
            }
        }
        s.push('}');
        s.into_bytes()
    }
}

/// What a stage decides: an answer (error), or "let Python do it".
#[derive(Debug, PartialEq)]
pub(crate) enum Outcome {
    Error(ApiError),
    Forward(&'static str),
}

impl From<ApiError> for Outcome {
    fn from(e: ApiError) -> Outcome {
        Outcome::Error(e)
    }
}

/// Python's 401 sentence (a key entry that is inactive, expired, or not for the caller's address).
pub(crate) const UNAUTHORIZED: &str = "Give a valid, active API key in the X-API-Key header.";


/// The 504 body of a statement over its limit (connectors.query_timeout).
pub(crate) fn timeout_error(seconds: f64) -> ApiError {
    ApiError {
        status: 504,
        code: "query_timeout",
        message: format!("The statement ran longer than its time limit of {} s and was cancelled.", float_g(seconds)),
        extra: Some(Extra::Timeout(seconds)),
    }
}

/// How a statement failed (PostgreSQL or MySQL), in the terms the request path answers with.
#[derive(Debug)]
pub(crate) enum ExecError {
    /// The database rejected the statement (forwarded: Python answers 500 query_failed and keeps its words).
    Rejected,
    /// statement_timeout (504 query_timeout).
    Timeout,
    /// The session is gone (the server restarted, the connection was terminated or closed): a read on a
    /// pooled session is retried once on a fresh one, else forwarded.
    Stale,
    /// Connection trouble, an unexpected value, anything Python should answer: forward.
    Forward(&'static str),
}

/// How a write went that did not commit (server/write.rs answers from it). Each says what the database holds
/// after it, which decides whether Python may run the statement again.
#[derive(Debug)]
pub(crate) enum WriteError {
    /// Nothing was executed (the statement did not prepare, a value the plane does not bind alike): Python may
    /// run it, there is nothing to undo.
    NotRun(&'static str),
    /// The session was found gone before the write was sent (at prepare): nothing ran; tried again on a fresh
    /// session once.
    Stale,
    /// The database rejected the statement or its commit (its first line): the transaction was rolled back.
    Rejected(String),
    /// Over the statement limit: cancelled and rolled back (504 `query_timeout`).
    Timeout,
    /// The session was lost while the write was on its way (the driver's first line): it may have committed or
    /// not, and nobody can tell. Never run again (502 `connection_failed`, as Python answers: connectors.py S6).
    Lost(String),
    /// The statement ran and sent rows where its prepared metadata said it would send none (`write::servable`
    /// keeps every statement known to do so away): it is never run again, and the call is a 500.
    RowsAfterAll,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_body_like_python() {
        let t = String::from_utf8(timeout_error(30.0).body("r")).unwrap();
        assert_eq!(t, r#"{"error": "The statement ran longer than its time limit of 30 s and was cancelled.", "code": "query_timeout", "request_id": "r", "timeout": 30.0}"#);
    }
}
