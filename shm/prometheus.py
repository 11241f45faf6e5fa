"""A prometheus-client collector over Segment.collect(): one scrape of any process shows every slot's counts.

Usage: `REGISTRY.register(ShmCollector(seg, help={"qag_requests_total": "Calls by route and status."}))`.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import Metric
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from .segment import Segment


class ShmCollector:
    """Renders counters (`<name>` with `_total`), gauges and histograms (`_bucket{le}`, `_sum`, `_count`)."""

    def __init__(self, seg: Segment, help: Mapping[str, str] | None = None) -> None:
        self.seg = seg
        self.help = dict(help or {})

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for item in self.seg.collect():
            name, kind, labels = item["name"], item["kind"], dict(item["labels"])
            base = name[:-6] if kind == "counter" and name.endswith("_total") else name
            fam = families.get(base)
            if fam is None:
                fam = families[base] = Metric(base, self.help.get(name, name), kind)
            if kind == "counter":
                fam.add_sample(base + "_total", labels, item["value"])
            elif kind == "gauge":
                fam.add_sample(base, labels, item["value"])
            else:
                for bound, count in item["buckets"]:
                    le = "+Inf" if math.isinf(bound) else floatToGoString(bound)
                    fam.add_sample(base + "_bucket", {**labels, "le": le}, count)
                fam.add_sample(base + "_count", labels, item["count"])
                fam.add_sample(base + "_sum", labels, item["sum"])
        yield from families.values()
