"""Every metric qag exports, declared in one place, and the one observation call that feeds them.

Handlers never touch counters directly: they call `Observer.request(...)` once per call. The backend
is the shared segment's per-slot counters when a segment is attached (so one scrape of any worker
sees the whole instance), else an in-process registry.
"""
from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from shm.layout import HIST_BOUNDS

_bisect = bisect_left
_BOUNDS = HIST_BOUNDS
_NB = len(HIST_BOUNDS)  # a histogram's sum cell follows its buckets (shm/segment.py histogram_observe)

# name -> (type, help, label names)
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "qag_requests_total": ("counter", "HTTP requests served, by route and status.", ("route", "status")),
    "qag_errors_total": ("counter", "Error responses, by contract code.", ("code",)),
    "qag_rows_total": ("counter", "Rows returned by saved queries.", ()),
    "qag_request_duration_seconds": ("histogram", "Whole request duration, by route.", ("route",)),
    "qag_query_duration_seconds": ("histogram", "Database execution time of saved queries.", ()),
    "qag_plan_cache_total": ("counter", "Plan cache lookups, by result (hit or miss).", ("result",)),
    "qag_pool_connections": ("gauge", "Data-database connections of the scraped worker, by connection and state.",
                             ("connection", "state", "slot")),
    "qag_runs_recorded_total": ("counter", "Runs handed to the run ring.", ()),
    "qag_runs_lost_total": ("counter", ("Runs dropped because the run ring was full (recorder stopped, or its journal "
                                         "full); each episode is logged with its reason."), ()),
    "qag_ring_occupancy_bytes": ("gauge", "Bytes waiting in each run ring.", ("slot",)),
    "qag_recorder_lag_seconds": ("gauge", "Age of the recorder's last heartbeat.", ()),
    "qag_recorder_batches_total": ("counter", "Batches the recorder committed to the run store.", ()),
    "qag_run_store_up": ("gauge", "1 while the recorder's last write reached the run store, 0 while it is away.", ()),
    "qag_journal_bytes": ("gauge", "Bytes of runs in the recorder's journal not yet in the run store.", ()),
    "qag_journal_runs": ("gauge", "Runs in the recorder's journal not yet in the run store.", ()),
    "qag_journal_full": ("gauge", ("1 while the journal is at QAG_JOURNAL_MAX_BYTES (the rings fill, then runs are "
                                  "lost)."), ()),
    "qag_journal_spilled_runs_total": ("counter", ("Runs the recorder put in its journal because the run store was "
                                                    "away."), ()),
    "qag_store_statements_total": ("counter", "Statements sent to the metadata store (zero on a warm call).", ()),
    "qag_generation": ("gauge", "The global generation of the shared segment.", ()),
    "qag_change_watcher_current": ("gauge", ("1 while this host's change watcher is caught up with the metadata "
                                             "store (cached entries are trusted), else 0 (every call re-reads "
                                             "the store)."), ()),
    "qag_limits_fallback_total": ("counter", "Limit and quota decisions made on this host because Redis did not "
                                  "answer, by reason.", ("reason",)),
    "qag_http_dropped_total": ("counter", "Client connections a worker closed on the client's account, by reason "
                               "(header_timeout, send_timeout, evicted at QAG_MAX_CONNECTIONS).", ("reason",)),
    "qag_response_cache_total": ("counter", ("Lookups of saved queries' cached answers (cache_ttl), by result: hit, "
                                             "miss, stale (the previous answer while another call fills it), "
                                             "waited (a hit after waiting on that call), bypass (not cacheable: "
                                             "no response cache, an argument without encoding, the change watcher "
                                             "behind), rejected (an answer larger than the largest record), "
                                             "redis (a hit in the Redis tier shared by the hosts), "
                                             "redis_unavailable (that tier skipped: Redis did not answer)."),
                                 ("result",)),
    "qag_response_cache_bytes": ("gauge", "Bytes of the host's cached answers (records the index points at).", ()),
    "qag_response_cache_capacity_bytes": ("gauge", "Bytes of the response cache's arena (QAG_RESPONSE_CACHE_MB "
                                                   "less its index).", ()),
    "qag_response_cache_entries": ("gauge", "Cached answers held on the host.", ()),
    "qag_segment_cache_entries": ("gauge", ("Key, plan and connection entries held in the segment's cache, which the "
                                            "data plane serves from (README: sizing the segment)."), ()),
    "qag_segment_cache_slots": ("gauge", "Slots of the segment's cache (QAG_SHM_SIZE less the other regions).", ()),
    "qag_segment_cache_dropped_total": ("counter", ("Entries the segment's cache let go, by cause: evicted (pushed "
                                                    "out by another entry: a working set larger than the cache; "
                                                    "the plane forwards what is not there), rejected (larger than "
                                                    "a slot)."), ("cause",)),
    "qag_response_cache_evictions_total": ("counter", ("Cached answers dropped on the host, by cause: room (the "
                                                       "arena lapped or an index bucket was full), removed (an "
                                                       "administrator's DELETE /api/v1/cache)."), ("cause",)),
}

# Series exported from the first scrape, before anything happened: `increase()` needs a sample before the
# first event to see it (a series born at 1 has increased by nothing). Counters and histograms without labels
# are all in; these are the labelled ones whose label values are known in advance.
INITIAL_LABELS: dict[str, tuple[tuple[str, ...], ...]] = {
    "qag_plan_cache_total": (("hit",), ("miss",)),
    "qag_limits_fallback_total": (("redis_unavailable",),),
    "qag_http_dropped_total": (("header_timeout",), ("send_timeout",), ("evicted",)),
    "qag_response_cache_total": (("hit",), ("miss",)),
}

def reference_markdown() -> str:
    """The metrics reference for the README (a test keeps the two in step)."""
    lines = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for name, (kind, doc, labels) in METRICS.items():
        lines.append(f"| `{name}` | {kind} | {', '.join(labels) or '-'} | {doc} |")
    return "\n".join(lines)


# Every histogram's buckets, declared once: the segment's (shm/layout.py HIST_BOUNDS, LAYOUT.md [Histogram
# buckets]), which the creator writes into the segment's header and the plane reads from there. The
# in-process registry (no segment) uses the same bounds, so both backends export the same series.
BUCKETS = HIST_BOUNDS[:-1]  # the finite bounds; +Inf is the last bucket of both backends


class LocalBackend:
    """Counters for one process (no segment)."""

    def __init__(self):
        self.values: dict[tuple[str, tuple], float] = {}
        self.hist: dict[tuple[str, tuple], list] = {}
        self.lock = threading.Lock()

    def counter_add(self, slot, name, labels, value=1):
        k = (name, labels)
        with self.lock:
            self.values[k] = self.values.get(k, 0) + value

    def histogram_observe(self, slot, name, labels, value):
        k = (name, labels)
        with self.lock:
            h = self.hist.get(k)
            if h is None:
                h = self.hist[k] = [[0] * (len(BUCKETS) + 1), 0.0, 0]
            for i, b in enumerate(BUCKETS):
                if value <= b:
                    h[0][i] += 1
                    break
            else:
                h[0][-1] += 1
            h[1] += value
            h[2] += 1

    def snapshot(self):
        with self.lock:
            return dict(self.values), {k: ([*v[0]], v[1], v[2]) for k, v in self.hist.items()}


_HIT = (("result", "hit"),)
_MISS = (("result", "miss"),)
_RESULT = {r: (("result", r),) for r in ("hit", "miss", "stale", "waited", "bypass", "rejected", "redis",
                                         "redis_unavailable")}


class Observer:
    """The one observation type: every count and timing of a call goes through here."""

    def __init__(self, backend=None, slot: int = 0):
        self.backend = backend or LocalBackend()
        self.slot = slot
        self.gauges = []  # callables yielding (name, labels, value)
        # A slot's counter cells have one writer: this process's threads take turns (shm/LAYOUT.md, Counters).
        self.lock = threading.Lock()
        self._labels: dict = {}
        # The shared segment's cells, written in place by request() (shm/segment.py cells(), N1 and N2).
        self._d = self.backend.cells() if hasattr(self.backend, "histogram_cell") else None
        self._cells: dict = {}   # (route, status) -> (qag_requests_total cell, qag_request_duration_seconds cell)
        self._fixed: dict = {}   # the unlabelled series' cells, and the plan cache's hit and miss

    def request(self, route: str, status: int, code: str | None, rows: int, duration: float,
                query_seconds: float | None = None, plan_hit: bool | None = None,
                recorded: bool | None = None) -> None:
        b, slot = self.backend, self.slot
        if self._d is not None:  # the segment: each series' cell located once, then a load and a store each
            cells = self._cells.get((route, status))
            if cells is None:
                labels = self._route_labels(route, status)
                cells = self._cells[(route, status)] = (b.counter_cell(slot, "qag_requests_total", labels[0]),
                                                        b.histogram_cell(slot, "qag_request_duration_seconds",
                                                                         labels[1]))
            d, fixed = self._d, self._fixed
            with self.lock:
                d[cells[0]] += 1
                if code:
                    b.counter_add(slot, "qag_errors_total", (("code", code),), 1)
                if rows:
                    i = fixed.get("qag_rows_total")
                    d[self._fixed_cell("qag_rows_total") if i is None else i] += rows
                h = cells[1]
                d[h + _bisect(_BOUNDS, duration)] += 1
                d[h + _NB] += duration
                if query_seconds is not None:
                    h = fixed.get("qag_query_duration_seconds")
                    if h is None:
                        h = self._fixed_cell("qag_query_duration_seconds", histogram=True)
                    d[h + _bisect(_BOUNDS, query_seconds)] += 1
                    d[h + _NB] += query_seconds
                if plan_hit is not None:
                    name = "hit" if plan_hit else "miss"
                    i = fixed.get(name)
                    d[self._fixed_cell(name) if i is None else i] += 1
                if recorded is not None:
                    name = "qag_runs_recorded_total" if recorded else "qag_runs_lost_total"
                    i = fixed.get(name)
                    d[self._fixed_cell(name) if i is None else i] += 1
            return
        labels = self._route_labels(route, status)
        with self.lock:
            b.counter_add(slot, "qag_requests_total", labels[0], 1)
            if code:
                b.counter_add(slot, "qag_errors_total", (("code", code),), 1)
            if rows:
                b.counter_add(slot, "qag_rows_total", (), rows)
            b.histogram_observe(slot, "qag_request_duration_seconds", labels[1], duration)
            if query_seconds is not None:
                b.histogram_observe(slot, "qag_query_duration_seconds", (), query_seconds)
            if plan_hit is not None:
                b.counter_add(slot, "qag_plan_cache_total", _HIT if plan_hit else _MISS, 1)
            if recorded is not None:
                b.counter_add(slot, "qag_runs_recorded_total" if recorded else "qag_runs_lost_total", (), 1)

    def _route_labels(self, route: str, status: int) -> tuple:
        labels = self._labels.get((route, status))
        if labels is None:  # label tuples built once per (route, status), not per call
            labels = self._labels[(route, status)] = ((("route", route), ("status", str(status))),
                                                      (("route", route),))
        return labels

    def _fixed_cell(self, name: str, histogram: bool = False) -> int:
        """A series of request()'s without per-call labels, located in the segment on its first use (so the
        segment registers the same series, in the same order of first use, as counter_add would)."""
        b = self.backend
        if name in ("hit", "miss"):
            i = b.counter_cell(self.slot, "qag_plan_cache_total", _HIT if name == "hit" else _MISS)
        elif histogram:
            i = b.histogram_cell(self.slot, name, ())
        else:
            i = b.counter_cell(self.slot, name, ())
        self._fixed[name] = i
        return i

    def limit_fallback(self, reason: str) -> None:
        with self.lock:
            self.backend.counter_add(self.slot, "qag_limits_fallback_total", (("reason", reason),), 1)

    def response_cache(self, result: str) -> None:
        """One lookup of a cached answer (qag/http/data.py), by result (METRICS: qag_response_cache_total)."""
        with self.lock:
            self.backend.counter_add(self.slot, "qag_response_cache_total", _RESULT[result], 1)

    def store_statement(self) -> None:
        with self.lock:
            self.backend.counter_add(self.slot, "qag_store_statements_total", (), 1)

    def http_dropped(self, reason: str) -> None:
        """The HTTP worker closed a client's connection on the client's account (qag/server/gworker.py)."""
        with self.lock:
            self.backend.counter_add(self.slot, "qag_http_dropped_total", (("reason", reason),), 1)

    def run_recorded(self, ok: bool) -> None:
        with self.lock:
            self.backend.counter_add(self.slot, "qag_runs_recorded_total" if ok else "qag_runs_lost_total", (), 1)

    def render(self) -> bytes:
        reg = CollectorRegistry(auto_describe=False)
        reg.register(_Collector(self))
        return generate_latest(reg)


class _Collector:
    def __init__(self, obs: Observer):
        self.obs = obs

    def collect(self) -> Iterable:
        backend = self.obs.backend
        if hasattr(backend, "collect"):  # the shared segment: every slot summed, dead workers included
            values, hists = {}, {}
            for item in backend.collect():
                key = (item["name"], tuple(tuple(x) for x in item["labels"]))
                if item["kind"] == "histogram":
                    hists[key] = ("cumulative", item["buckets"], item["sum"], item["count"])
                else:
                    values[key] = item["value"]
        else:
            values, hists = backend.snapshot()
        fams: dict[str, object] = {}
        for name, (kind, doc, labels) in METRICS.items():
            if kind == "counter":
                fams[name] = CounterMetricFamily(name.removesuffix("_total"), doc, labels=list(labels))
            elif kind == "gauge":
                fams[name] = GaugeMetricFamily(name, doc, labels=list(labels))
            else:
                fams[name] = HistogramMetricFamily(name, doc, labels=list(labels))
        for (name, labels), v in sorted(values.items()):
            fam = fams.get(name)
            if fam is None:
                continue
            fam.add_metric([lv for _, lv in labels], v)
        for (name, labels), h in sorted(hists.items(), key=lambda kv: kv[0]):
            fam = fams.get(name)
            if fam is None:
                continue
            if h[0] == "cumulative":
                cum = [("+Inf" if b == float("inf") else repr(float(b)), n) for b, n in h[1]]
                if cum[-1][0] != "+Inf":
                    cum.append(("+Inf", h[3]))
                total = h[2]
            else:
                buckets, total, _ = h
                cum, acc = [], 0
                for bound, n in zip(HIST_BOUNDS, buckets):
                    acc += n
                    cum.append(("+Inf" if bound == float("inf") else repr(bound), acc))
            fam.add_metric([lv for _, lv in labels], cum, total)
        zero_buckets = [("+Inf" if b == float("inf") else repr(float(b)), 0) for b in HIST_BOUNDS]
        present = {(name, tuple(lv for _, lv in labels)) for name, labels in list(values) + list(hists)}
        for name, (kind, _doc, labels) in METRICS.items():
            if kind == "gauge":
                continue
            for lvs in (INITIAL_LABELS.get(name, ()) if labels else ((),)):
                if (name, lvs) in present:
                    continue
                if kind == "counter":
                    fams[name].add_metric(list(lvs), 0.0)
                else:
                    fams[name].add_metric(list(lvs), zero_buckets, 0.0)
        for gauge in self.obs.gauges:
            for name, labels, v in gauge():
                fam = fams.get(name)
                if fam is not None:
                    fam.add_metric(list(labels), v)
        return list(fams.values())
