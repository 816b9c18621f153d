"""Prometheus metrics with vLLM's meanings under the ``pagedllm:`` prefix.

One ``EngineMetrics`` per server, on its own ``CollectorRegistry`` (no module-global
registry, so tests can build several).  Every metric carries a ``model_name`` label.

Who feeds what:

* ``record_stats(SchedulerStats)`` after every engine step: the running/waiting gauges,
  KV usage, free/total blocks, preemptions and prefix-cache counters.
* ``add_request`` when a (child) sequence is sent to the engine core, then
  ``on_outputs`` for every ``EngineCoreOutputs``: prompt tokens are counted when the first
  token arrives (prefill done, as in vLLM), generation tokens as they arrive; TTFT,
  inter-token latency, end-to-end latency and queue time are observed per sequence.
* ``on_finished`` for sequences the frontend aborted (disconnects, cancel, stop strings found
  by the detokeniser): finished with reason ``abort`` unless already finished.

Times: arrival is the frontend's ``time.time()``; the core reports
``first_scheduled_time`` with the same clock (same host), so queue time is a difference of
wall clocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedllm.engine.messages import EngineCoreOutputs, FinishReason, SchedulerStats

# Buckets as in vLLM (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class _SeqState:
    arrival_time: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    last_token_time: float | None = None
    queue_time_observed: bool = False


class EngineMetrics:
    """The server's Prometheus metrics (see module doc for the feeding contract)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        lbl = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pagedllm:{name}", doc, lbl, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"pagedllm:{name}", doc, [*lbl, *extra], registry=r)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"pagedllm:{name}", doc, lbl, buckets=buckets, registry=r)

        self.num_requests_running = gauge(
            "num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.kv_cache_free_blocks = gauge(
            "kv_cache_free_blocks", "KV-cache blocks free in the pool.")
        self.kv_cache_total_blocks = gauge(
            "kv_cache_total_blocks", "KV-cache blocks in the pool.")
        self.engine_alive = gauge(
            "engine_alive", "1 while the engine-core loop is making progress.")
        # prometheus_client appends _total to counters itself.
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter(
            "request_success", "Count of successfully processed requests.",
            ("finished_reason",))
        self.num_preemptions = counter(
            "num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prefix-cache queries, in tokens.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix-cache hits, in tokens.")
        self.requests_rejected = counter(
            "requests_rejected", "Requests refused by admission control or draining.",
            ("reason",))
        self.ttft = hist("time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds",
                        "Histogram of end to end request latency in seconds.", _E2E_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.",
                               _E2E_BUCKETS)
        # Touch labelled children so every series exists (at 0) from the start.
        m = model_name
        for reason in FINISH_REASONS:
            self.request_success.labels(m, reason)
        for reason in ("queue_full", "draining"):
            self.requests_rejected.labels(m, reason)
        for c in (self.prompt_tokens, self.generation_tokens, self.num_preemptions,
                  self.prefix_cache_queries, self.prefix_cache_hits):
            c.labels(m)
        for g in (self.num_requests_running, self.num_requests_waiting,
                  self.kv_cache_usage_perc, self.kv_cache_free_blocks,
                  self.kv_cache_total_blocks, self.engine_alive):
            g.labels(m)
        self._seqs: dict[str, _SeqState] = {}

    # ------------------------------------------------------------------ engine stats

    def record_stats(self, stats: SchedulerStats) -> None:
        m = self.model_name
        self.num_requests_running.labels(m).set(stats.num_running_reqs)
        self.num_requests_waiting.labels(m).set(stats.num_waiting_reqs)
        self.kv_cache_usage_perc.labels(m).set(stats.kv_cache_usage)
        self.kv_cache_free_blocks.labels(m).set(stats.num_free_blocks)
        self.kv_cache_total_blocks.labels(m).set(stats.num_total_blocks)
        if stats.num_preemptions:
            self.num_preemptions.labels(m).inc(stats.num_preemptions)
        if stats.prefix_cache_queries:
            self.prefix_cache_queries.labels(m).inc(stats.prefix_cache_queries)
        if stats.prefix_cache_hits:
            self.prefix_cache_hits.labels(m).inc(stats.prefix_cache_hits)

    def track_engines(self, stats: list[SchedulerStats], assigned: list[int]) -> None:
        """Data parallelism (``engine/dp_client.py``): per-engine gauges labelled
        ``engine``, read at scrape time from ``stats`` and ``assigned`` (sequences sent
        to each engine so far), lists the DP client keeps current; the gauges above
        without the label are the totals."""
        lbl = ["model_name", "engine"]
        specs = (("engine_num_requests_running", "Requests running, per engine.",
                  "num_running_reqs"),
                 ("engine_num_requests_waiting", "Requests waiting, per engine.",
                  "num_waiting_reqs"),
                 ("engine_kv_cache_usage_perc", "KV-cache usage, per engine.",
                  "kv_cache_usage"))
        for name, doc, attr in specs:
            g = Gauge(f"pagedllm:{name}", doc, lbl, registry=self.registry)
            for i in range(len(stats)):
                g.labels(self.model_name, str(i)).set_function(
                    lambda i=i, a=attr: float(getattr(stats[i], a)))
        g = Gauge("pagedllm:engine_requests_assigned", "Sequences sent to each engine.",
                  lbl, registry=self.registry)
        for i in range(len(assigned)):
            g.labels(self.model_name, str(i)).set_function(lambda i=i: float(assigned[i]))

    def set_engine_alive(self, alive: bool) -> None:
        self.engine_alive.labels(self.model_name).set(1 if alive else 0)

    def record_rejected(self, reason: str) -> None:
        self.requests_rejected.labels(self.model_name, reason).inc()

    # ------------------------------------------------------------------ per sequence

    def add_request(self, request_id: str, arrival_time: float,
                    num_prompt_tokens: int) -> None:
        self._seqs[request_id] = _SeqState(arrival_time, num_prompt_tokens)

    def on_outputs(self, outputs: EngineCoreOutputs, now: float | None = None) -> None:
        """Account one engine step's outputs (unknown request ids are ignored)."""
        if outputs.scheduler_stats is not None:
            self.record_stats(outputs.scheduler_stats)
        if not outputs.outputs:
            return
        now = time.time() if now is None else now
        m = self.model_name
        gen_tokens = 0
        for out in outputs.outputs:
            seq = self._seqs.get(out.request_id)
            if seq is None:
                continue
            if out.first_scheduled_time is not None and not seq.queue_time_observed:
                seq.queue_time_observed = True
                self.queue_time.labels(m).observe(
                    max(0.0, out.first_scheduled_time - seq.arrival_time))
            if out.new_token_ids:
                gen_tokens += len(out.new_token_ids)
                if seq.first_token_time is None:
                    seq.first_token_time = now
                    self.prompt_tokens.labels(m).inc(seq.num_prompt_tokens)
                    self.ttft.labels(m).observe(now - seq.arrival_time)
                elif seq.last_token_time is not None:
                    self.itl.labels(m).observe(now - seq.last_token_time)
                seq.last_token_time = now
            if out.finish_reason is not None:
                self._finish(out.request_id, str(out.finish_reason), now)
        if gen_tokens:
            self.generation_tokens.labels(m).inc(gen_tokens)

    def on_finished(self, request_ids: list[str], reason: str = str(FinishReason.ABORT),
                    now: float | None = None) -> None:
        """Sequences finished by the frontend (aborts, or stop strings it detected);
        ids already finished are ignored."""
        now = time.time() if now is None else now
        for rid in request_ids:
            if rid in self._seqs:
                self._finish(rid, reason, now)

    def _finish(self, request_id: str, reason: str, now: float) -> None:
        seq = self._seqs.pop(request_id)
        m = self.model_name
        self.request_success.labels(m, reason).inc()
        self.e2e.labels(m).observe(now - seq.arrival_time)

    @property
    def num_tracked(self) -> int:
        """Sequences added and not yet finished (for leak checks in tests)."""
        return len(self._seqs)
