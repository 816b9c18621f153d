"""/metrics under vLLM's names, types and labels, and the shipped Grafana dashboard.

Against the shared real server; the exposition is parsed with prometheus_client's own
parser.  Values are checked as deltas around this test's own requests (the server is
shared, but the session's tests run one at a time).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.harness import ServerProcess

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "pagedllm.json"

# vLLM's metric families (prometheus_client strips a counter's ``_total``) and types.
VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:cache_config_info": "gauge",
    "pagedllm:engine_alive": "gauge",
    "pagedllm:requests_rejected": "counter",
    "pagedllm:kv_cache_free_blocks": "gauge",
    "pagedllm:kv_cache_total_blocks": "gauge",
}


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _scrape(server: ServerProcess) -> dict[str, tuple[str, list]]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def _value(fams: dict[str, tuple[str, list]], family: str, sample: str,
           **labels: str) -> float:
    return sum(s.value for s in fams[family][1] if s.name == sample
               and all(s.labels.get(k) == v for k, v in labels.items()))


def test_vllm_names_types_labels_and_values(server: ServerProcess, client: openai.OpenAI,
                                            model: str) -> None:
    before = _scrape(server)
    client.completions.create(model=model, prompt="The capital of France is", n=2,
                              max_tokens=3, temperature=0.7, seed=1)
    list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, stream=True))
    after = _scrape(server)

    for name, kind in VLLM_FAMILIES.items():
        assert name in after, name
        assert after[name][0] == kind, (name, after[name][0])
        for s in after[name][1]:
            assert s.labels.get("engine") == "0", (name, s.labels)
            if name != "vllm:cache_config_info":
                assert s.labels.get("model_name") == "SmolLM2-135M-Instruct", (name, s)
    for name in ("process_resident_memory_bytes", "process_cpu_seconds", "python_info",
                 "python_gc_collections"):
        assert name in after, name

    def delta(family: str, sample: str, **labels: str) -> float:
        return _value(after, family, sample, **labels) - _value(before, family, sample,
                                                                **labels)

    # Three sequences finished (n=2 completion + one chat): each histogram of a finished
    # sequence got three observations, and the per-request n histogram two (n=2, n=1).
    for fam in ("vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens",
                "vllm:request_generation_tokens", "vllm:request_params_max_tokens",
                "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                "vllm:request_inference_time_seconds", "vllm:request_queue_time_seconds"):
        assert delta(fam, fam + "_count") == 3, fam
    assert delta("vllm:request_params_n", "vllm:request_params_n_count") == 2
    assert delta("vllm:request_params_n", "vllm:request_params_n_sum") == 3
    assert delta("vllm:request_max_num_generation_tokens",
                 "vllm:request_max_num_generation_tokens_count") == 2
    assert delta("vllm:request_params_max_tokens", "vllm:request_params_max_tokens_sum") == 10
    generated = delta("vllm:generation_tokens", "vllm:generation_tokens_total")
    assert 3 <= generated <= 10
    assert delta("vllm:request_generation_tokens",
                 "vllm:request_generation_tokens_sum") == generated
    assert delta("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == delta(
        "vllm:prompt_tokens", "vllm:prompt_tokens_total")
    # Every step computed at least one token, and the steps computed every prompt token
    # and all but each sequence's last sampled token.
    assert delta("vllm:iteration_tokens_total", "vllm:iteration_tokens_total_count") >= 3
    assert delta("vllm:iteration_tokens_total", "vllm:iteration_tokens_total_sum") >= \
        generated - 3
    e2e = delta("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_sum")
    inference = delta("vllm:request_inference_time_seconds",
                      "vllm:request_inference_time_seconds_sum")
    assert 0 < inference <= e2e
    info = after["vllm:cache_config_info"][1]
    assert len(info) == 1 and info[0].value == 1
    assert info[0].labels["block_size"] == "16" and int(info[0].labels["num_gpu_blocks"]) > 0


def _queried_metrics(dashboard: dict) -> set[str]:
    exprs: list[str] = []
    for panel in dashboard["panels"]:
        exprs += [t["expr"] for t in panel["targets"]]
    for var in dashboard["templating"]["list"]:
        if isinstance(var.get("query"), dict):
            exprs.append(var["query"]["query"])
    names = set()
    for expr in exprs:
        names.update(re.findall(r"\b((?:vllm|pagedllm):[A-Za-z0-9_]+|process_[a-z_]+)", expr))
    return names


def test_grafana_dashboard_queries_exist(server: ServerProcess) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queried = _queried_metrics(dashboard)
    assert len(queried) >= 25
    samples = {s.name for _, ss in _scrape(server).values() for s in ss}
    missing = sorted(queried - samples)
    assert not missing, f"dashboard queries series the server does not export: {missing}"
