//! Recording a served call as any worker's is recorded (qag/metrics.py `Observer.request`, qag/server/worker.py
//! `RingRecorder`): its counters and histograms in the plane's counter slot (series registered once per
//! thread, N1), and its run record (shm/LAYOUT.md [Run record], encoded by `entries::RunRecord`,
//! `served_by = "plane"`) pushed into the plane's ring (R1-R3), waiting up to QAG_RECORD_WAIT_MS on a full
//! ring before the run is counted lost.

use super::Shared;
use crate::entries::RunRecord;
use crate::segment::{KIND_COUNTER, KIND_HISTOGRAM};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The route label of every call the plane serves.
const ROUTE: &str = "/q/{name}";

/// Counter cells of the plane's slot, by series, and the ring: one writer at a time (N1, R*).
#[derive(Default)]
pub(super) struct Producer {
    /// (metric, label value) -> first cell; None when the series could not be registered.
    cells: HashMap<&'static str, HashMap<String, Option<u32>>>,
}

/// What `Shared::finish` records of one call (LAYOUT.md [Run record], encoded by `entries::RunRecord`).
pub(super) struct Run {
    pub(super) at_us: i64,
    pub(super) key_name: Option<String>,
    pub(super) query: String,
    pub(super) version: Option<i64>,
    pub(super) connection: Option<String>,
    pub(super) status: u16,
    pub(super) code: Option<&'static str>,
    pub(super) rows: i64,
    pub(super) bytes: i64,
    pub(super) request_id: String,
    /// RR5: the database's words of a failed write the plane answered itself (server/write.rs); None otherwise.
    pub(super) error: Option<String>,
}

impl Shared {
    fn cell(&self, p: &mut Producer, kind: u8, name: &'static str, labels: &[(&str, &str)]) -> Option<u32> {
        // every metric here has at most one label that varies (route is constant)
        let var = labels.iter().rfind(|(k, _)| *k != "route").map_or("", |(_, v)| *v);
        if let Some(c) = p.cells.get(name).and_then(|m| m.get(var)) {
            return *c;
        }
        let c = match self.seg.series_cell(kind, name, labels) {
            Ok(c) => Some(c),
            Err(e) => {
                crate::plog!("warning", "metric {name} not counted: {e}");
                None
            }
        };
        p.cells.entry(name).or_default().insert(var.to_string(), c);
        c
    }

    /// Observer.request + RingRecorder: count the call in our slot, push the run into our ring.
    pub(super) async fn finish(&self, run: Run, t0: Instant, query_seconds: Option<f64>, plan_hit: Option<bool>) {
        let duration = t0.elapsed().as_secs_f64();
        let payload = RunRecord {
            at_us: run.at_us,
            key_name: run.key_name.as_deref(),
            query: Some(&run.query),
            version: run.version,
            connection: run.connection.as_deref(),
            status: run.status,
            code: run.code,
            rows: run.rows,
            duration_us: (duration * 1e6) as i64,
            bytes: run.bytes,
            request_id: &run.request_id,
            served_by: "plane",
            transport: "http",
            route: ROUTE,
            // RR5: a read the database rejects, and every read failure whose words matter, is forwarded to Python,
            // which records them (execute.rs); a write is never run twice, so its failure's words are the plane's
            // to record (write.rs)
            error: run.error.as_deref(),
        }
        .encode();
        let slot = self.slot;
        {
            let mut p = self.producer.lock().unwrap_or_else(|e| e.into_inner());
            let status = run.status.to_string();
            let seg = &self.seg;
            if let Some(c) = self.cell(&mut p, KIND_COUNTER, "qag_requests_total", &[("route", ROUTE), ("status", &status)]) {
                seg.cell_add(slot, c, 1.0);
            }
            if let Some(code) = run.code {
                if let Some(c) = self.cell(&mut p, KIND_COUNTER, "qag_errors_total", &[("code", code)]) {
                    seg.cell_add(slot, c, 1.0);
                }
            }
            if run.rows != 0 {
                if let Some(c) = self.cell(&mut p, KIND_COUNTER, "qag_rows_total", &[]) {
                    seg.cell_add(slot, c, run.rows as f64);
                }
            }
            if let Some(c) = self.cell(&mut p, KIND_HISTOGRAM, "qag_request_duration_seconds", &[("route", ROUTE)]) {
                seg.histogram_observe(slot, c, duration);
            }
            if let Some(q) = query_seconds {
                if let Some(c) = self.cell(&mut p, KIND_HISTOGRAM, "qag_query_duration_seconds", &[]) {
                    seg.histogram_observe(slot, c, q);
                }
            }
            if let Some(hit) = plan_hit {
                if let Some(c) = self.cell(&mut p, KIND_COUNTER, "qag_plan_cache_total", &[("result", if hit { "hit" } else { "miss" })]) {
                    seg.cell_add(slot, c, 1.0);
                }
            }
        }
        let deadline = Instant::now() + Duration::from_millis(self.record_wait_ms);
        let mut pause = Duration::from_micros(100);
        let ok = loop {
            let pushed = {
                let _p = self.producer.lock().unwrap_or_else(|e| e.into_inner());
                self.seg.ring_push(slot, &payload)
            };
            if pushed {
                break true;
            }
            if Instant::now() >= deadline {
                break false;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(2));
        };
        let mut p = self.producer.lock().unwrap_or_else(|e| e.into_inner());
        let name = if ok { "qag_runs_recorded_total" } else { "qag_runs_lost_total" };
        if let Some(c) = self.cell(&mut p, KIND_COUNTER, name, &[]) {
            self.seg.cell_add(slot, c, 1.0);
        }
    }
}

impl Shared {
    /// Observer.response_cache: one lookup of a cached answer by result (qag_response_cache_total{result}).
    pub(super) fn count_response_cache(&self, result: &'static str) {
        let mut p = self.producer.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = self.cell(&mut p, KIND_COUNTER, "qag_response_cache_total", &[("result", result)]) {
            self.seg.cell_add(self.slot, c, 1.0);
        }
    }
}
