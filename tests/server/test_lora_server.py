"""LoRA on the server, with PEFT adapters made on the default model (SmolLM2-135M):
adapters are models (``/v1/models`` with ``parent``), a request picks one by ``model``
and gets transformers + PEFT's greedy tokens; unknown names are 404 ``model_not_found``;
run-time load/unload need the API key, and a bad adapter is a 400 with the server alive."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.lora.fixtures import hf_greedy, make_adapters
from tests.server.harness import running_server

KEY = "sk-lora-test"
PROMPT = [504, 3575, 282, 4649, 314, 7042, 30, 378]
N = 5
SPECS = [("a1", 8, 16, False, ["q_proj", "v_proj", "down_proj"]),
         ("a2", 4, 8, True, ["k_proj", "o_proj", "gate_proj", "up_proj"])]


@pytest.fixture(scope="module")
def lora_env(tmp_path_factory, hf_default_model) -> Iterator[tuple]:
    from pagedllm.engine.arg_utils import EngineArgs

    mc = EngineArgs(device="cpu", quantization="none").create_engine_config().model_config
    r = mc.resolved
    tok = r.load_tokenizer(False)
    base = hf_default_model  # the default GGUF in fp32; make_adapters deep-copies it
    root = str(tmp_path_factory.mktemp("server-lora"))
    adapters = make_adapters(base, root, SPECS, seed=7, scale=0.05, merge=False)
    # Greedy text of transformers + PEFT (the server returns text).
    want = {a.name: tok.decode(hf_greedy(a.peft_model, PROMPT, N)) for a in adapters}
    want["base"] = tok.decode(hf_greedy(base, PROMPT, N))
    # Loaded at run time: a1's weights under another name (and id); a rank above
    # --max-lora-rank; a corrupt file.
    paths = {a.name: a.path for a in adapters}
    paths["a3"] = shutil.copytree(adapters[0].path, os.path.join(root, "a3"))
    want["a3"] = want["a1"]
    big = os.path.join(root, "big")
    shutil.copytree(adapters[0].path, big)
    cfg_path = os.path.join(big, "adapter_config.json")
    json.dump({**json.load(open(cfg_path)), "r": 16}, open(cfg_path, "w"))
    bad = os.path.join(root, "bad")
    shutil.copytree(adapters[0].path, bad)
    with open(os.path.join(bad, "adapter_model.safetensors"), "r+b") as f:
        f.write(b"\xff" * 16)
    a1, a2 = adapters[0].path, adapters[1].path
    with running_server(
            "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--quantization", "none", "--api-key", KEY, "--lora-modules", f"a1={a1}",
            json.dumps({"name": "a2", "path": a2}),
            env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}) as s:
        yield s, want, paths, big, bad


def _client(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.url}/v1", api_key=KEY, max_retries=0)


def _completion_text(s, model: str) -> str:
    out = _client(s).completions.create(model=model, prompt=PROMPT, max_tokens=N,
                                        temperature=0.0)
    assert out.model == model
    return out.choices[0].text


def test_adapters_are_models_and_match_peft(lora_env) -> None:
    s, want, _, _, _ = lora_env
    client = _client(s)
    models = {m.id: m for m in client.models.list().data}
    base = next(m for m in models.values() if getattr(m, "parent", None) is None)
    assert {"a1", "a2"} <= set(models)
    assert models["a1"].parent == base.id == models["a2"].parent
    for name in ("a1", "a2"):
        assert _completion_text(s, name) == want[name], name
    assert _completion_text(s, base.id) == want["base"]
    assert want["a1"] != want["base"]
    # Chat picks the adapter the same way (the request goes through).
    chat = client.chat.completions.create(model="a2", max_tokens=2, messages=[
        {"role": "user", "content": "hi"}])
    assert chat.model == "a2"


def test_unknown_adapter_is_404(lora_env) -> None:
    s = lora_env[0]
    with pytest.raises(openai.NotFoundError) as e:
        _client(s).completions.create(model="nope", prompt="hi", max_tokens=1)
    assert e.value.code == "model_not_found"


def test_load_and_unload_at_run_time(lora_env) -> None:
    s, want, paths, big, bad = lora_env
    auth = {"Authorization": f"Bearer {KEY}"}
    load = f"{s.url}/v1/load_lora_adapter"
    unload = f"{s.url}/v1/unload_lora_adapter"
    body = {"lora_name": "a3", "lora_path": paths["a3"]}
    assert httpx.post(load, json=body).status_code == 401  # behind the API key
    assert httpx.post(load, json=body, headers=auth).status_code == 200
    assert _completion_text(s, "a3") == want["a3"]
    dup = httpx.post(load, json=body, headers=auth)
    assert dup.status_code == 400 and "already in use" in dup.text
    for name, path, why in (("big", big, "rank 16 exceeds max_lora_rank 8"),
                            ("bad", bad, "corrupt"),
                            ("none", "/nonexistent", "adapter_config.json")):
        r = httpx.post(load, json={"lora_name": name, "lora_path": path}, headers=auth)
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    assert httpx.post(load, json={"lora_name": "x"}, headers=auth).status_code == 400
    assert httpx.post(unload, json={"lora_name": "a3"}, headers=auth).status_code == 200
    gone = httpx.post(unload, json={"lora_name": "a3"}, headers=auth)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        _client(s).completions.create(model="a3", prompt="hi", max_tokens=1)
    # Alive and exact after all that.
    assert _completion_text(s, "a1") == want["a1"]
    assert "a3" not in {m.id for m in _client(s).models.list().data}


def test_names_with_lone_surrogates_change_nothing(lora_env) -> None:
    """Issue 46 item 12: a valid adapter under the name "\\ud800" was registered, then
    the answer (and every later GET /v1/models) was a 500.  Now the body is refused
    (400 naming the field) before any state changes; the server answers as before."""
    s, want, paths, _, _ = lora_env
    auth = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    before = {m.id for m in _client(s).models.list().data}
    for body, param in (({"lora_name": "\ud800", "lora_path": paths["a1"]}, "lora_name"),
                        ({"lora_name": "ok\udfffname", "lora_path": paths["a1"]},
                         "lora_name"),
                        ({"lora_name": "s1", "lora_path": paths["a1"] + "\ud800"},
                         "lora_path")):
        # json.dumps escapes the surrogate as "\ud800", as a hostile client sends it.
        r = httpx.post(f"{s.url}/v1/load_lora_adapter", content=json.dumps(body),
                       headers=auth)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
        models = httpx.get(f"{s.url}/v1/models", headers=auth)
        assert models.status_code == 200, models.text
        assert {m["id"] for m in models.json()["data"]} == before
    r = httpx.post(f"{s.url}/v1/unload_lora_adapter", content=json.dumps(
        {"lora_name": "\ud800"}), headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    assert _completion_text(s, "a1") == want["a1"]
