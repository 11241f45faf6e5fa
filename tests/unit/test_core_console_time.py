"""The Console overview's latency per minute: nearest-rank percentiles of the run history's durations."""
from qag.http.console import _per_minute, _percentile


def test_nearest_rank_percentiles():
    vals = sorted(float(i) for i in range(1, 101))
    assert _percentile(vals, 0.5) == 50.0 and _percentile(vals, 0.99) == 99.0 and _percentile(vals, 1.0) == 100.0
    assert _percentile([7.0], 0.5) == 7.0 and _percentile([7.0], 0.99) == 7.0
    assert _percentile([1.0, 2.0], 0.5) == 1.0 and _percentile([1.0, 2.0], 0.99) == 2.0


def test_runs_grouped_by_minute_oldest_first_and_odd_rows_skipped():
    runs = [{"at": "2026-12-02T01:02:59.999Z", "duration_ms": 3.0},
            {"at": "2026-12-02T01:01:00.000Z", "duration_ms": 1.0},
            {"at": "2026-12-02T01:02:00.000Z", "duration_ms": 9.0}, {"at": None, "duration_ms": 5.0},
            {"at": "2026-12-02T01:02:01.000Z", "duration_ms": None}]
    assert _per_minute(runs) == [("2026-12-02T01:01", {"p50": 1.0, "p99": 1.0, "calls": 1}),
                                 ("2026-12-02T01:02", {"p50": 3.0, "p99": 9.0, "calls": 2})]


def test_timestamps_keep_four_digit_years():
    """RFC 3339 wants four digits: strftime's %Y wrote year 231 as "231" (schemathesis found it on expires_at)."""
    from qag import timeutil
    assert timeutil.fmt(timeutil.parse("0231-10-13T03:44:12.533902Z")) == "0231-10-13T03:44:12.533Z"
    assert timeutil.fmt(timeutil.parse("2026-12-02T01:02:03.456789+01:00")) == "2026-12-02T00:02:03.456Z"


def test_a_processes_cpus_as_proc_says():
    import os

    from qag.http.console import cpus_of
    mine = cpus_of(os.getpid())
    allowed = sorted(os.sched_getaffinity(0))
    assert mine != "–" and str(allowed[0]) in mine
    assert cpus_of(None) == "–" and cpus_of(2 ** 30) == "–"
