"""Gemma 3 with images, logits against transformers (fp32, CPU) through the paged KV cache
(``tests/models/paged.py``) with per-token key limits (``AttentionMetadata.query_limits``)
built by hand: a prompt with two images in two chunks (the cut between the runs), then
decodes -- on the torch reference backend, and on the Triton backend with its kernels
interpreted on CPU (``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.models.loader import load_model
from tests.models.paged import PagedSession, build_metadata, positions_for
from tests.models.tiny_gemma3 import build_gemma3, image

TWO = "<start_of_turn> user <start_of_image> and <start_of_image> what is the color ? " \
      "<end_of_turn> <start_of_turn> assistant"
ATOL = 1e-4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gemma3_logits"))
    hf = build_gemma3(path)
    processor = transformers.AutoProcessor.from_pretrained(path)
    cfg = EngineArgs(model=path, device="cpu", dtype="float32").create_engine_config()
    inputs = processor(text=TWO, images=[image(1), image(2)], return_tensors="pt")
    with torch.no_grad():
        want = hf(**inputs).logits[0].float()
    return cfg, inputs, want


def _runs(ids: list[int], image_token: int) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t == image_token:
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
    return runs


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunks_with_images_then_decodes(setup, backend: str) -> None:
    cfg, inputs, want = setup
    if backend == "triton":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("runs the Triton kernels on CPU tensors: needs TRITON_INTERPRET=1")
        from pagedllm.attention.triton_backend import TritonAttentionBackend

        be = TritonAttentionBackend()
    else:
        be = TorchReferenceBackend()
    model = load_model(cfg.model_config, torch.device("cpu"), be)
    mc = cfg.model_config
    s = PagedSession(model, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks=32,
                     block_size=4, seed=2)
    ids = inputs["input_ids"][0].tolist()
    runs = _runs(ids, model.image_token_id)  # type: ignore[arg-type]
    assert len(runs) == 2
    with torch.inference_mode():
        feats = model.embed_multimodal({"pixel_values": inputs["pixel_values"]})
        embeds = model.get_input_embeddings(torch.tensor(ids))
        for (a, b), f in zip(runs, feats):
            embeds[a:b] = f
    limits = list(range(len(ids)))
    for a, b in runs:
        limits[a:b] = [b - 1] * (b - a)
    cut = runs[0][1] + 2  # after the first run, before the second
    steps = [(0, cut), (cut, len(ids) - 3)] + [(i, i + 1) for i in range(len(ids) - 3,
                                                                          len(ids))]
    got = []
    table = s.tables.setdefault(0, [])
    for a, b in steps:
        while len(table) * s.block_size < b:
            table.append(s.free.pop())
        meta = build_metadata([a], [b - a], [table], s.block_size)
        meta.with_query_limits(torch.tensor(limits[a:b], dtype=torch.int32))
        with torch.inference_mode():
            hidden = model(torch.tensor(ids[a:b]), positions_for([a], [b - a]), meta,
                           inputs_embeds=embeds[a:b])
            got.append(model.compute_logits(hidden))
    torch.testing.assert_close(torch.cat(got), want, atol=ATOL, rtol=0)
