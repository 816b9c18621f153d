"""Prometheus metrics under vLLM's names, types, buckets and labels.

Dashboards and alerts written for vLLM read a pagedllm server unchanged: every metric
that vLLM defines and we have an equivalent of is exported as ``vllm:<name>`` with vLLM's
label set (``model_name``, ``engine``); metrics vLLM lacks are ``pagedllm:<name>`` with the
same labels (``engine_alive``, ``requests_rejected_total``, ``kv_cache_free_blocks``,
``kv_cache_total_blocks``).  There are no ``pagedllm:`` aliases of the ``vllm:`` series: one
name per measurement keeps scrapes small and queries unambiguous (docs/server.md).

One ``EngineMetrics`` per server, on its own ``CollectorRegistry`` (no module-global
registry, so tests can build several), which also carries prometheus_client's process,
platform and GC collectors (``process_*``, ``python_*``) as vLLM's default registry does.

Who feeds what:

* ``record_stats(SchedulerStats)`` after every engine step: the running/waiting gauges,
  KV usage, free/total blocks, preemptions, prefix-cache counters and the step's token
  count (``iteration_tokens_total``).
* ``add_request(EngineCoreRequest)`` when a request (with its ``n - 1`` forks) is sent to
  the core: ``request_params_n`` is observed there, once per request.
* ``on_outputs`` for every ``EngineCoreOutputs``: prompt tokens are counted when the first
  token arrives (prefill done, as in vLLM), generation tokens as they arrive; TTFT and
  inter-token latency as tokens arrive; at a sequence's finish its e2e, queue, prefill,
  decode and inference times, its time per output token and its prompt/generation token
  counts and ``max_tokens``.
* ``on_finished`` for sequences the frontend aborted (disconnects, cancel, stop strings found
  by the detokeniser): finished with that reason unless already finished.

Times: arrival is the frontend's ``time.time()``; the core reports
``first_scheduled_time`` with the same clock (same host), so queue time is a difference of
wall clocks.  Phases as vLLM defines them: queue = arrival → first scheduled, prefill =
first scheduled → first token, decode = first token → last token, inference = first
scheduled → last token, time per output token = decode / (generated tokens - 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from pagedllm.messages import EngineCoreOutputs, EngineCoreRequest, FinishReason, SchedulerStats

# Buckets as in vLLM (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                            40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)

FINISH_REASONS = ("stop", "length", "abort")
TRANSPORT_REJECT_REASONS = ("handshake", "malformed")  # engine/transport_auth.py
REJECT_REASONS = ("queue_full", "draining")
LABELS = ("model_name", "engine")
ENGINE = "0"  # one engine core per server (vLLM's ``engine`` label is its index)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


def cache_config_labels(cache_config: Any, num_gpu_blocks: int) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` from a ``CacheConfig`` (vLLM's label
    names; values as strings, swap space in GiB as vLLM's ``swap_space``)."""
    return {
        "block_size": str(cache_config.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": str(cache_config.enable_prefix_caching),
        "gpu_memory_utilization": str(cache_config.gpu_memory_utilization),
        "kv_cache_memory_bytes": str(cache_config.kv_cache_memory_bytes),
        "num_gpu_blocks": str(num_gpu_blocks),
        "swap_space": str(cache_config.swap_space_bytes / (1 << 30)),
    }


@dataclass
class _Group:
    """The n sequences of one core request (for ``request_max_num_generation_tokens``)."""

    remaining: int
    max_generation_tokens: int = 0


@dataclass
class _SeqState:
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int | None
    group: _Group
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0


class EngineMetrics:
    """The server's Prometheus metrics (see module doc for the feeding contract).

    ``max_model_len`` sets the token-count histograms' buckets; ``cache_info`` (from
    ``cache_config_labels``) publishes ``vllm:cache_config_info``.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, *,
                 max_model_len: int = 2048, cache_info: dict[str, str] | None = None,
                 process_collectors: bool = True, speculative: bool = True) -> None:
        # No ``<counter>_created`` series (timestamps nobody graphs; vLLM disables
        # them too).  A prometheus_client switch for the whole process.
        disable_created_metrics()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        if process_collectors:
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            GCCollector(registry=r)
        lbl = list(LABELS)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, lbl, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*lbl, *extra], registry=r)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, lbl, buckets=buckets, registry=r)

        tokens = build_1_2_5_buckets(max_model_len)
        # -- scheduler state (gauges)
        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        # -- counters (prometheus_client appends _total)
        self.prompt_tokens = counter("vllm:prompt_tokens",
                                     "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter(
            "vllm:request_success", "Count of successfully processed requests.",
            ("finished_reason",))
        self.num_preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        # The prefix cache's host tier (core/offload_tier.py; zero when off): vLLM's
        # names for the tokens looked up past the device hit and found off the device.
        self.external_prefix_cache_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache "
            "sharing, in terms of number of queried tokens.")
        self.external_prefix_cache_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.")
        # Speculative decoding (spec_decode/): registered only when it is on.
        self.speculative = speculative
        if speculative:
            self.spec_decode_num_drafts = counter(
                "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
            self.spec_decode_num_draft_tokens = counter(
                "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
            self.spec_decode_num_accepted_tokens = counter(
                "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
            self.spec_decode_num_accepted_tokens_per_pos = counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.", ("position",))
        # -- histograms of counts
        self.request_prompt_tokens = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation_tokens = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            _ITERATION_TOKEN_BUCKETS)
        self.request_max_num_generation_tokens = hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", tokens)
        self.request_params_n = hist(
            "vllm:request_params_n", "Histogram of the n request parameter.", _N_BUCKETS)
        self.request_params_max_tokens = hist(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.", tokens)
        # -- histograms of times
        self.ttft = hist("vllm:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        # vLLM keeps this older name with the same observations as inter_token_latency.
        self.tpot = hist("vllm:time_per_output_token_seconds",
                         "Histogram of time per output token in seconds. DEPRECATED: Use "
                         "vllm:inter_token_latency_seconds instead.", _ITL_BUCKETS)
        self.request_tpot = hist("vllm:request_time_per_output_token_seconds",
                                 "Histogram of time_per_output_token_seconds per request.",
                                 _ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds",
                        "Histogram of e2e request latency in seconds.",
                        _REQUEST_LATENCY_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.",
                               _REQUEST_LATENCY_BUCKETS)
        self.inference_time = hist("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.",
                                   _REQUEST_LATENCY_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.",
                                 _REQUEST_LATENCY_BUCKETS)
        self.decode_time = hist("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.",
                                _REQUEST_LATENCY_BUCKETS)
        # -- pagedllm's own
        self.kv_cache_free_blocks = gauge(
            "pagedllm:kv_cache_free_blocks", "KV-cache blocks free in the pool.")
        self.kv_cache_total_blocks = gauge(
            "pagedllm:kv_cache_total_blocks", "KV-cache blocks in the pool.")
        self.engine_alive = gauge(
            "pagedllm:engine_alive", "1 while the engine-core loop is making progress.")
        self.kv_offload_bytes = counter(
            "pagedllm:kv_offload_bytes", "KV bytes copied by the prefix cache's host tier: "
            "evicted blocks to the host, prefix hits back to the device.", ("direction",))
        self.kv_offload_usage_perc = gauge(
            "pagedllm:kv_offload_usage_perc",
            "Fill of the prefix cache's host tier. 1 means 100 percent.")
        self.kv_offload_total_blocks = gauge(
            "pagedllm:kv_offload_total_blocks",
            "KV blocks in the prefix cache's host tier (0: off).")
        # Its disk tier (core/disk_tier.py; zero when off), named like the host tier's.
        self.kv_offload_disk_queries = counter(
            "pagedllm:kv_offload_disk_queries", "Tokens looked up in the prefix cache's "
            "disk tier (past the device and host tiers' hits).")
        self.kv_offload_disk_hits = counter(
            "pagedllm:kv_offload_disk_hits",
            "Tokens found in the prefix cache's disk tier (also counted in "
            "vllm:external_prefix_cache_hits).")
        self.kv_offload_disk_bytes = counter(
            "pagedllm:kv_offload_disk_bytes", "KV bytes copied by the prefix cache's disk "
            "tier: blocks the host tier evicts to disk, prefix hits back to the host.",
            ("direction",))
        self.kv_offload_disk_usage_perc = gauge(
            "pagedllm:kv_offload_disk_usage_perc",
            "Fill of the prefix cache's disk tier. 1 means 100 percent.")
        self.kv_offload_disk_total_blocks = gauge(
            "pagedllm:kv_offload_disk_total_blocks",
            "KV blocks in the prefix cache's disk tier (0: off).")
        self.requests_rejected = counter(
            "pagedllm:requests_rejected", "Requests refused by admission control or draining.",
            ("reason",))
        self.engine_transport_rejected = counter(
            "pagedllm:engine_transport_rejected",
            "Peers or messages the engine transport refused: failed handshakes "
            "(unauthenticated peers) and malformed messages.", ("reason",))
        if cache_info is not None:
            info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                         [*cache_info, "engine"], registry=r)
            info.labels(**cache_info, engine=ENGINE).set(1)

        # Touch every labelled child so each series exists (at 0) from the start.
        m = self._lbl = (model_name, ENGINE)
        for reason in FINISH_REASONS:
            self.request_success.labels(*m, reason)
        for reason in REJECT_REASONS:
            self.requests_rejected.labels(*m, reason)
        for metric in (self.num_requests_running, self.num_requests_waiting,
                       self.kv_cache_usage_perc, self.prompt_tokens, self.generation_tokens,
                       self.num_preemptions, self.prefix_cache_queries,
                       self.prefix_cache_hits, self.request_prompt_tokens,
                       self.request_generation_tokens, self.iteration_tokens,
                       self.request_max_num_generation_tokens, self.request_params_n,
                       self.request_params_max_tokens, self.ttft, self.itl, self.tpot,
                       self.request_tpot, self.e2e, self.queue_time, self.inference_time,
                       self.prefill_time, self.decode_time, self.kv_cache_free_blocks,
                       self.kv_cache_total_blocks, self.engine_alive,
                       self.external_prefix_cache_queries, self.external_prefix_cache_hits,
                       self.kv_offload_usage_perc, self.kv_offload_total_blocks,
                       self.kv_offload_disk_queries, self.kv_offload_disk_hits,
                       self.kv_offload_disk_usage_perc, self.kv_offload_disk_total_blocks):
            metric.labels(*m)
        if speculative:
            for metric in (self.spec_decode_num_drafts, self.spec_decode_num_draft_tokens,
                           self.spec_decode_num_accepted_tokens):
                metric.labels(*m)
        for direction in ("to_host", "to_device"):
            self.kv_offload_bytes.labels(*m, direction)
        for direction in ("to_disk", "to_host"):
            self.kv_offload_disk_bytes.labels(*m, direction)
        for reason in TRANSPORT_REJECT_REASONS:
            self.engine_transport_rejected.labels(*m, reason)
        self._seqs: dict[str, _SeqState] = {}

    # ------------------------------------------------------------------ engine stats

    def record_stats(self, stats: SchedulerStats) -> None:
        m = self._lbl
        self.num_requests_running.labels(*m).set(stats.num_running_reqs)
        self.num_requests_waiting.labels(*m).set(stats.num_waiting_reqs)
        self.kv_cache_usage_perc.labels(*m).set(stats.kv_cache_usage)
        self.kv_cache_free_blocks.labels(*m).set(stats.num_free_blocks)
        self.kv_cache_total_blocks.labels(*m).set(stats.num_total_blocks)
        if stats.num_preemptions:
            self.num_preemptions.labels(*m).inc(stats.num_preemptions)
        if stats.prefix_cache_queries:
            self.prefix_cache_queries.labels(*m).inc(stats.prefix_cache_queries)
        if stats.prefix_cache_hits:
            self.prefix_cache_hits.labels(*m).inc(stats.prefix_cache_hits)
        if stats.num_scheduled_tokens:
            self.iteration_tokens.labels(*m).observe(stats.num_scheduled_tokens)
        if stats.spec_num_drafts and self.speculative:
            self._record_spec(stats)
        if stats.kv_offload_total_blocks:
            self._record_offload(stats)

    def _record_offload(self, stats: SchedulerStats) -> None:
        m = self._lbl
        self.kv_offload_usage_perc.labels(*m).set(stats.kv_offload_usage)
        self.kv_offload_total_blocks.labels(*m).set(stats.kv_offload_total_blocks)
        if stats.kv_offload_queries:
            self.external_prefix_cache_queries.labels(*m).inc(stats.kv_offload_queries)
        if stats.kv_offload_hits:
            self.external_prefix_cache_hits.labels(*m).inc(stats.kv_offload_hits)
        if stats.kv_offload_bytes_to_host:
            self.kv_offload_bytes.labels(*m, "to_host").inc(stats.kv_offload_bytes_to_host)
        if stats.kv_offload_bytes_to_device:
            self.kv_offload_bytes.labels(*m, "to_device").inc(
                stats.kv_offload_bytes_to_device)
        if stats.kv_offload_disk_total_blocks:
            self._record_offload_disk(stats)

    def _record_offload_disk(self, stats: SchedulerStats) -> None:
        m = self._lbl
        self.kv_offload_disk_usage_perc.labels(*m).set(stats.kv_offload_disk_usage)
        self.kv_offload_disk_total_blocks.labels(*m).set(stats.kv_offload_disk_total_blocks)
        for metric, n in ((self.kv_offload_disk_queries, stats.kv_offload_disk_queries),
                          (self.kv_offload_disk_hits, stats.kv_offload_disk_hits)):
            if n:
                metric.labels(*m).inc(n)
        for direction, n in (("to_disk", stats.kv_offload_bytes_to_disk),
                             ("to_host", stats.kv_offload_bytes_from_disk)):
            if n:
                self.kv_offload_disk_bytes.labels(*m, direction).inc(n)

    def _record_spec(self, stats: SchedulerStats) -> None:
        m = self._lbl
        self.spec_decode_num_drafts.labels(*m).inc(stats.spec_num_drafts)
        self.spec_decode_num_draft_tokens.labels(*m).inc(stats.spec_num_draft_tokens)
        self.spec_decode_num_accepted_tokens.labels(*m).inc(stats.spec_num_accepted_tokens)
        for pos, n in enumerate(stats.spec_accepted_per_pos):
            self.spec_decode_num_accepted_tokens_per_pos.labels(*m, str(pos)).inc(n)

    def track_engines(self, stats: list[SchedulerStats], assigned: list[int],
                      prefix_routed: list[int]) -> None:
        """Data parallelism (``engine/dp_client.py``): per-engine gauges labelled
        ``engine``, read at scrape time from ``stats``, ``assigned`` (sequences sent
        to each engine so far) and ``prefix_routed`` (those of them placed there for
        their cached prefix, ``engine/dp_routing.py``), lists the DP client keeps
        current; the ``vllm:`` gauges (whose ``engine`` label stays "0") are the
        totals."""
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
        g = Gauge("pagedllm:engine_requests_prefix_routed",
                  "Sequences sent to each engine because it held at least half of their "
                  "prompt's blocks (--data-parallel-routing prefix).",
                  lbl, registry=self.registry)
        for i in range(len(prefix_routed)):
            g.labels(self.model_name, str(i)).set_function(
                lambda i=i: float(prefix_routed[i]))

    def set_engine_alive(self, alive: bool) -> None:
        self.engine_alive.labels(*self._lbl).set(1 if alive else 0)

    def record_rejected(self, reason: str) -> None:
        self.requests_rejected.labels(*self._lbl, reason).inc()

    def record_transport_rejected(self, reason: str, count: int = 1) -> None:
        self.engine_transport_rejected.labels(*self._lbl, reason).inc(count)

    # ------------------------------------------------------------------ per sequence

    def add_request(self, request: EngineCoreRequest) -> None:
        """Track ``request`` and its forks (their ids are ``request.fork_ids``)."""
        ids = (request.request_id, *request.fork_ids)
        group = _Group(remaining=len(ids))
        for sid in ids:
            self._seqs[sid] = _SeqState(request.arrival_time, len(request.prompt_token_ids),
                                        request.sampling_params.max_tokens, group)
        self.request_params_n.labels(*self._lbl).observe(len(ids))

    def on_outputs(self, outputs: EngineCoreOutputs, now: float | None = None) -> None:
        """Account one engine step's outputs (unknown request ids are ignored)."""
        if outputs.scheduler_stats is not None:
            self.record_stats(outputs.scheduler_stats)
        if not outputs.outputs:
            return
        now = time.time() if now is None else now
        m = self._lbl
        gen_tokens = 0
        for out in outputs.outputs:
            seq = self._seqs.get(out.request_id)
            if seq is None:
                continue
            if out.first_scheduled_time is not None and seq.first_scheduled_time is None:
                seq.first_scheduled_time = out.first_scheduled_time
                self.queue_time.labels(*m).observe(
                    max(0.0, out.first_scheduled_time - seq.arrival_time))
            if out.new_token_ids:
                gen_tokens += len(out.new_token_ids)
                seq.num_generation_tokens += len(out.new_token_ids)
                if seq.first_token_time is None:
                    seq.first_token_time = now
                    self.prompt_tokens.labels(*m).inc(seq.num_prompt_tokens)
                    self.ttft.labels(*m).observe(now - seq.arrival_time)
                elif seq.last_token_time is not None:
                    self.itl.labels(*m).observe(now - seq.last_token_time)
                    self.tpot.labels(*m).observe(now - seq.last_token_time)
                seq.last_token_time = now
            if out.finish_reason is not None:
                self._finish(out.request_id, str(out.finish_reason), now)
        if gen_tokens:
            self.generation_tokens.labels(*m).inc(gen_tokens)

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
        m = self._lbl
        self.request_success.labels(*m, reason).inc()
        self.e2e.labels(*m).observe(now - seq.arrival_time)
        self.request_prompt_tokens.labels(*m).observe(seq.num_prompt_tokens)
        self.request_generation_tokens.labels(*m).observe(seq.num_generation_tokens)
        if seq.max_tokens:
            self.request_params_max_tokens.labels(*m).observe(seq.max_tokens)
        scheduled, first, last = (seq.first_scheduled_time, seq.first_token_time,
                                  seq.last_token_time)
        if scheduled is not None and first is not None and last is not None:
            self.prefill_time.labels(*m).observe(max(0.0, first - scheduled))
            self.inference_time.labels(*m).observe(max(0.0, last - scheduled))
        if first is not None and last is not None:
            decode = last - first
            self.decode_time.labels(*m).observe(decode)
            if seq.num_generation_tokens > 1:
                self.request_tpot.labels(*m).observe(
                    decode / (seq.num_generation_tokens - 1))
        group = seq.group
        group.max_generation_tokens = max(group.max_generation_tokens,
                                          seq.num_generation_tokens)
        group.remaining -= 1
        if group.remaining == 0:
            self.request_max_num_generation_tokens.labels(*m).observe(
                group.max_generation_tokens)

    @property
    def num_tracked(self) -> int:
        """Sequences added and not yet finished (for leak checks in tests)."""
        return len(self._seqs)
