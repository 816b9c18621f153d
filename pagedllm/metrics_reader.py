"""Prometheus metrics as plain Python objects: what ``LLM.get_metrics()`` returns.

The shapes are vLLM's (``vllm.v1.metrics.reader``), so code written against vLLM's
offline metrics API reads ours unchanged::

    for m in llm.get_metrics():
        if isinstance(m, Counter):     m.name, m.labels, m.value        (int)
        elif isinstance(m, Gauge):     m.name, m.labels, m.value        (float)
        elif isinstance(m, Histogram): m.count, m.sum, m.buckets        ({"le": count})
        elif isinstance(m, Vector):    m.values  (spec_decode_num_accepted_tokens_per_pos)

The snapshot is read from a ``CollectorRegistry`` (the engine's ``EngineMetrics``, the
same series ``/metrics`` serves), not from a second tally.  Only ``vllm:`` and
``pagedllm:`` metrics are returned (no process or GC collectors); counter names carry no
``_total`` suffix (prometheus_client's family name, as vLLM's reader gives it).  Histogram
buckets are cumulative, keyed by the ``le`` label (``"+Inf"`` always present, equal to
``count``).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.samples import Sample

PREFIXES = ("vllm:", "pagedllm:")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class Metric:
    """One series: ``name`` and its ``labels`` (several may share a name)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer count."""

    value: int


@dataclass
class Vector(Metric):
    """Integer counters by position: ``values[i]`` is the count at position ``i`` (only
    ``vllm:spec_decode_num_accepted_tokens_per_pos``)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that can go up or down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in cumulative buckets keyed by upper bound (``"+Inf"`` included);
    ``count`` observations summing to ``sum``."""

    count: int
    sum: float
    buckets: dict[str, int]


def _key(labels: dict[str, str], drop: str) -> frozenset[tuple[str, str]]:
    return frozenset((k, v) for k, v in labels.items() if k != drop)


def _samples(samples: list[Sample], name: str) -> list[Sample]:
    return [s for s in samples if s.name == name]


def snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every ``vllm:``/``pagedllm:`` gauge, counter and histogram series of
    ``registry`` now (other metric types are skipped)."""
    out: list[Metric] = []
    for fam in registry.collect():
        if not fam.name.startswith(PREFIXES):
            continue
        if fam.type == "gauge":
            out.extend(Gauge(fam.name, dict(s.labels), float(s.value))
                       for s in _samples(fam.samples, fam.name))
        elif fam.type == "counter":
            samples = _samples(fam.samples, fam.name + "_total")
            if fam.name == PER_POSITION:
                out.extend(_vectors(fam.name, samples))
            else:
                out.extend(Counter(fam.name, dict(s.labels), int(s.value)) for s in samples)
        elif fam.type == "histogram":
            out.extend(_histograms(fam.name, fam.samples))
    return out


def _vectors(name: str, samples: list[Sample]) -> list[Metric]:
    by_labels: dict[frozenset[tuple[str, str]], dict[int, int]] = {}
    for s in samples:
        by_labels.setdefault(_key(s.labels, "position"), {})[
            int(s.labels["position"])] = int(s.value)
    out: list[Metric] = []
    for key, by_pos in by_labels.items():
        values = [0] * (max(by_pos) + 1)
        for pos, v in by_pos.items():
            values[pos] = v
        out.append(Vector(name, dict(key), values))
    return out


def _histograms(name: str, samples: list[Sample]) -> list[Metric]:
    buckets: dict[frozenset[tuple[str, str]], dict[str, int]] = {}
    counts: dict[frozenset[tuple[str, str]], int] = {}
    sums: dict[frozenset[tuple[str, str]], float] = {}
    for s in samples:
        if s.name == name + "_bucket":
            buckets.setdefault(_key(s.labels, "le"), {})[s.labels["le"]] = int(s.value)
        elif s.name == name + "_count":
            counts[_key(s.labels, "")] = int(s.value)
        elif s.name == name + "_sum":
            sums[_key(s.labels, "")] = float(s.value)
    return [Histogram(name, dict(key), counts.get(key, 0), sums.get(key, 0.0), b)
            for key, b in buckets.items()]
