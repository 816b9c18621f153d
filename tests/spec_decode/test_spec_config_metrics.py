"""speculative_config validation (errors name the field), the CLI flag, and the
vLLM-named spec-decode metrics."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.entrypoints.engine_cli_args import add_engine_args, engine_args_from_cli
from pagedllm.messages import SchedulerStats
from pagedllm.metrics import EngineMetrics
from pagedllm.spec_decode.config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig


def test_valid_config_and_defaults():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                     "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (4, 2, 5)
    assert c.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    assert SpeculativeConfig.from_dict(None) is None


@pytest.mark.parametrize("raw, field", [
    ({"method": "eagle9", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
      "prompt_lookup_max": 3}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1},
     "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel": 1},
     "draft_tensor_parallel"),
    ("ngram", "speculative_config"),
])
def test_bad_config_names_the_field(raw, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(raw)


def test_cli_flag_parses_json_and_refuses_non_objects(capsys):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--speculative-config",
                         '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert engine_args_from_cli(args).speculative_config == {
        "method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--speculative-config", "[1]"])
    assert e.value.code == 2
    assert "--speculative-config" in capsys.readouterr().err


def test_metrics_under_vllm_names():
    m = EngineMetrics("m", process_collectors=False)
    m.record_stats(SchedulerStats(spec_num_drafts=2, spec_num_draft_tokens=7,
                                  spec_num_accepted_tokens=4, spec_accepted_per_pos=[2, 1, 1]))
    from prometheus_client import generate_latest

    fams = {f.name: f for f in text_string_to_metric_families(
        generate_latest(m.registry).decode())}

    def total(name, **labels):
        return sum(s.value for s in fams[name].samples if s.name == name + "_total"
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    assert total("vllm:spec_decode_num_drafts") == 2
    assert total("vllm:spec_decode_num_draft_tokens") == 7
    assert total("vllm:spec_decode_num_accepted_tokens") == 4
    assert total("vllm:spec_decode_num_accepted_tokens_per_pos", position="0") == 2
    assert total("vllm:spec_decode_num_accepted_tokens_per_pos", position="2") == 1


@pytest.mark.parametrize("kw, field", [({"pipeline_parallel_size": 2},
                                        "pipeline_parallel_size")])
def test_engine_args_refuse_unsupported_combinations(kw, field):
    """(async_scheduling: n-gram keeps it, a draft model refuses it --
    test_spec_policy_engine.py.)"""
    from pagedllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match=field):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                   **kw).create_engine_config()
