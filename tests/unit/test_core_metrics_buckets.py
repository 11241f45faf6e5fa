"""Every histogram's buckets are declared once (shm/layout.py HIST_BOUNDS, LAYOUT.md [Histogram buckets]):
the segment's header carries them to the plane, and the in-process registry exports the same ones."""
import struct
from pathlib import Path

from qag import metrics
from shm import layout

VECTORS = Path(__file__).resolve().parents[2] / "shm" / "vectors"


def test_the_segment_header_holds_the_declared_bounds_which_the_plane_reads():
    """[Histogram buckets] the golden segment (decoded by rustplane/tests/vectors.rs too) holds HIST_BOUNDS at
    256, so the plane, which reads the bounds from the header, buckets as Python does."""
    seg = (VECTORS / "segment.bin").read_bytes()
    n = struct.unpack_from("<I", seg, layout.H_HIST_BUCKETS)[0]
    got = tuple(struct.unpack_from("<d", seg, layout.H_HIST_BOUNDS + 8 * i)[0] for i in range(n))
    assert got == layout.HIST_BOUNDS


def test_the_in_process_registry_exports_the_segments_buckets():
    obs = metrics.Observer()
    obs.request("/q/{name}", 200, None, 1, 0.003, query_seconds=0.0002)
    text = obs.render().decode()
    for name in ("qag_request_duration_seconds", "qag_query_duration_seconds"):
        les = [line.split('le="', 1)[1].split('"', 1)[0] for line in text.splitlines()
               if line.startswith(name + "_bucket")]
        assert les == [repr(float(b)) if b != float("inf") else "+Inf" for b in layout.HIST_BOUNDS], name
    assert 'qag_query_duration_seconds_bucket{le="0.00025"} 1.0' in text
    assert 'qag_request_duration_seconds_bucket{le="0.0025",route="/q/{name}"} 0.0' in text
    assert 'qag_request_duration_seconds_bucket{le="0.005",route="/q/{name}"} 1.0' in text
