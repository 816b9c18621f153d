"""LoRA on the default model as it runs by default -- the GGUF's Q4_1 weights kept
quantised (issue 46 item 1: the slots once took a packed weight's uint8 dtype and the
first adapter request killed the engine) -- and bad adapters (issue 46 item 2): NaN
weights, data offsets that do not match the shapes, an unknown dtype are a 400 from
``/v1/load_lora_adapter`` naming the problem, the server alive and a good adapter still
working; an adapter whose files go bad after the load fails its request only."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from tests.lora.fixtures import make_adapters
from tests.server.harness import running_server

PROMPT = [504, 3575, 282, 4649, 314, 7042, 30, 378]
N = 6
SPECS = [("good", 8, 16, False, ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                  "down_proj"])]


@pytest.fixture(scope="module")
def good_adapter(tmp_path_factory, hf_default_model) -> tuple[str, str]:
    """(root, a PEFT adapter of the default model)."""
    root = str(tmp_path_factory.mktemp("lora-q"))
    (good,) = make_adapters(hf_default_model, root, SPECS, seed=3, scale=0.05,
                            merge=False)
    return root, good.path


@pytest.fixture(scope="module")
def quantised_lora(good_adapter) -> Iterator[tuple]:
    root, good = good_adapter
    with running_server("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                        "--lora-modules", f"good={good}",
                        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}) as s:
        yield s, root, good


def _complete(s, model: str) -> httpx.Response:
    return httpx.post(f"{s.url}/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0.0,
        "logprobs": 1})


def _alive(s) -> None:
    assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200
    r = _complete(s, "good")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]


def test_adapter_on_quantised_weights(quantised_lora) -> None:
    s, _, _ = quantised_lora
    base = httpx.get(f"{s.url}/v1/models", timeout=10).json()["data"][0]["id"]
    r = _complete(s, "good")
    assert r.status_code == 200, r.text
    tuned = r.json()["choices"][0]
    plain = _complete(s, base).json()["choices"][0]
    # The delta rides on the quantised output: the first token's log probability moves
    # (a small adapter need not flip a greedy token, so the text may be the same).
    lp_tuned = tuned["logprobs"]["top_logprobs"][0]
    lp_plain = plain["logprobs"]["top_logprobs"][0]
    assert lp_tuned != lp_plain, (lp_tuned, lp_plain)
    _alive(s)


def _write_safetensors(path: str, tensors: dict[str, np.ndarray],
                       tweak: dict[str, dict] | None = None) -> None:
    """A safetensors file by its spec (u64 header length, JSON header, data), float32;
    ``tweak``: header fields to override per tensor."""
    header, data, off = {}, b"", 0
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape),
                        "data_offsets": [off, off + len(raw)],
                        **(tweak or {}).get(name, {})}
        data += raw
        off += len(raw)
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + data)


def _bad_adapters(root, good: str) -> dict[str, tuple[str, str]]:
    """name -> (directory, a word the 400 must carry)."""
    from safetensors.numpy import load_file

    tensors = load_file(os.path.join(good, "adapter_model.safetensors"))
    first = sorted(tensors)[0]
    out = {}
    for name, word in (("nan", "non-finite"), ("offsets", "data_offsets"),
                       ("dtype", "dtype")):
        d = os.path.join(root, f"bad-{name}")
        shutil.copytree(good, d)
        f = os.path.join(d, "adapter_model.safetensors")
        if name == "nan":
            t = dict(tensors)
            t[first] = t[first].copy()
            t[first].flat[3] = np.nan
            _write_safetensors(f, t)
        elif name == "offsets":  # the first tensor claims 16 bytes, inside the file
            _write_safetensors(f, tensors, {first: {"data_offsets": [0, 16]}})
        else:
            _write_safetensors(f, tensors, {first: {"dtype": "F24"}})
        out[name] = (d, word)
    return out


def _load(s, name: str, path: str) -> httpx.Response:
    return httpx.post(f"{s.url}/v1/load_lora_adapter", timeout=120,
                      json={"lora_name": name, "lora_path": path})


def test_bad_adapters_refused_at_load(quantised_lora) -> None:
    s, root, good = quantised_lora
    for name, (path, word) in _bad_adapters(root, good).items():
        r = _load(s, f"bad-{name}", path)
        assert r.status_code == 400, (name, r.text)
        msg = r.json()["error"]["message"]
        assert word in msg and "bad-" + name in msg, msg
        _alive(s)
        models = {m["id"] for m in httpx.get(f"{s.url}/v1/models", timeout=10).json()["data"]}
        assert f"bad-{name}" not in models
    # A good adapter still loads and runs.
    assert _load(s, "good2", shutil.copytree(good, os.path.join(root, "good2"))) \
        .status_code == 200
    r = _complete(s, "good2")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == \
        _complete(s, "good").json()["choices"][0]["text"]


def test_adapter_gone_bad_after_load_fails_its_request_only(quantised_lora) -> None:
    """Checked at load, then its tensors turn to NaN before the first request: the
    worker's load fails that request (an abort), never the step or the engine."""
    s, root, good = quantised_lora
    late = shutil.copytree(good, os.path.join(root, "late"))
    assert _load(s, "late", late).status_code == 200
    from safetensors.numpy import load_file

    f = os.path.join(late, "adapter_model.safetensors")
    t = load_file(f)
    first = sorted(t)[0]
    t[first] = t[first].copy()
    t[first].flat[0] = np.inf
    _write_safetensors(f, t)
    r = _complete(s, "late")
    assert r.status_code != 200 or r.json()["choices"][0]["finish_reason"] == "abort", \
        r.text
    _alive(s)


def test_bad_lora_module_at_startup_one_line(good_adapter) -> None:
    root, good = good_adapter
    path = _bad_adapters(os.path.join(root, "startup"), good)["nan"][0]
    p = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port",
                        "0", "--enable-lora", "--max-lora-rank", "8", "--lora-modules",
                        f"nanny={path}"], capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    errors = [ln for ln in p.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and "nanny" in errors[0] and "non-finite" in errors[0], \
        p.stderr


def test_bad_adapters_refused_offline(good_adapter) -> None:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.lora.request import LoRARequest

    root, good = good_adapter
    bad = _bad_adapters(os.path.join(root, "offline"), good)
    llm = LLM(enable_lora=True, max_lora_rank=8, max_model_len=256)
    try:
        for i, (name, (path, word)) in enumerate(bad.items()):
            with pytest.raises(ValueError, match=word) as e:
                llm.generate([[1, 2, 3]], lora_request=LoRARequest(name, i + 1, path),
                             use_tqdm=False)
            assert repr(name) in str(e.value)
        out = llm.generate([[1, 2, 3]], lora_request=LoRARequest("good", 9, good),
                           use_tqdm=False)
        assert out[0].outputs[0].token_ids
    finally:
        llm.shutdown()
