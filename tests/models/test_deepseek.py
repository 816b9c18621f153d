"""DeepSeek-V2/V3 (multi-head latent attention) logit parity with transformers (fp32,
CPU) through the paged latent KV cache (``tests/models/paged.py``): whole prompts, chunks
then decodes and a mixed batch, in each attention form (``attention/mla_torch.py``:
"auto" = decodes absorbed and longer queries expanded; or one form forced); the absorbed
and expanded forms agree to rounding; the MLA cache's shape and bytes per token.  Engine
greedy runs are in ``tests/e2e/test_deepseek_greedy.py``."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.models.loader import kv_cache_shape, load_model
from tests.models.deepseek_tiny import CONFIGS, LAYERS, VOCAB, build
from tests.models.paged import PagedSession, hf_logits_of, session_for

ATOL = 1e-4
MODES = ("auto", "absorbed", "expanded")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = build(request.param, path)
    cfg = EngineArgs(model=path, device="cpu", dtype="float32").create_engine_config()
    ours = load_model(cfg.model_config, torch.device("cpu"), TorchReferenceBackend())
    yield ours, hf, cfg
    ours.set_mla_mode("auto")


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_whole_prompt(pair) -> None:
    pair[0].set_mla_mode("auto")
    ids = _prompt(70, seed=1)
    got = session_for(pair).step({0: ids})[0]
    torch.testing.assert_close(got, hf_logits_of(pair[1], ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("mode", MODES)
def test_chunks_then_decodes(pair, mode: str) -> None:
    pair[0].set_mla_mode(mode)
    ids = _prompt(45, seed=2)
    s = session_for(pair, block_size=4, seed=4)
    parts = [s.step({7: ids[:13]})[7], s.step({7: ids[13:30]})[7]]
    parts += [s.step({7: [t]})[7] for t in ids[30:]]
    torch.testing.assert_close(torch.cat(parts), hf_logits_of(pair[1], ids), atol=ATOL,
                               rtol=0)


def _mixed(pair) -> dict[int, torch.Tensor]:
    """Prefills, chunks with context and decodes in the same steps."""
    prompts = {r: _prompt(n, seed=10 + r) for r, n in enumerate([33, 20, 9])}
    s = session_for(pair, seed=3)
    got: dict[int, list[torch.Tensor]] = {r: [] for r in prompts}
    schedule = [{0: (0, 33), 1: (0, 7), 2: (0, 1)}, {1: (7, 19), 2: (1, 2)},
                {0: (33, 33), 1: (19, 20), 2: (2, 9)}]
    for step in schedule:
        new = {r: prompts[r][a:b] for r, (a, b) in step.items() if b > a}
        for r, logits in s.step(new).items():
            got[r].append(logits)
    return {r: torch.cat(v) for r, v in got.items()}


@pytest.mark.parametrize("mode", MODES)
def test_mixed_batch(pair, mode: str) -> None:
    pair[0].set_mla_mode(mode)
    for r, logits in _mixed(pair).items():
        ids = {0: _prompt(33, 10), 1: _prompt(20, 11), 2: _prompt(9, 12)}[r]
        torch.testing.assert_close(logits, hf_logits_of(pair[1], ids), atol=ATOL, rtol=0)


def test_absorbed_equals_expanded(pair) -> None:
    """The two forms over the same cache contents agree to float32 rounding."""
    outs = {}
    for mode in ("absorbed", "expanded"):
        pair[0].set_mla_mode(mode)
        outs[mode] = _mixed(pair)
    pair[0].set_mla_mode("auto")
    for r in outs["absorbed"]:
        torch.testing.assert_close(outs["absorbed"][r], outs["expanded"][r], atol=2e-5,
                                   rtol=0)


def test_kv_cache_shape_and_bytes(pair) -> None:
    """One ``[c_kv | k_pe]`` entry per token and layer: (32 + 8) x 4 bytes x 3 layers,
    against 2 x heads x head_dim for a GQA model of the same attention width."""
    hf_cfg = pair[1].config
    mc = pair[2].model_config
    entry = hf_cfg.kv_lora_rank + hf_cfg.qk_rope_head_dim
    assert mc.use_mla and mc.kv_entries_per_token == 1
    assert kv_cache_shape(mc, 10, 16) == (1, 10, 16, 1, entry)
    assert mc.kv_bytes_per_token() == LAYERS * entry * 4
    gqa = 2 * LAYERS * hf_cfg.num_attention_heads * \
        (hf_cfg.qk_nope_head_dim + hf_cfg.qk_rope_head_dim) * 4
    assert mc.kv_bytes_per_token() * 4 < gqa  # 480 vs 1920 bytes
    with pytest.raises(ValueError, match="MLA KV cache"):
        pair[0].bind_kv_caches([torch.zeros(2, 4, 16, 1, entry)] * LAYERS)


def test_mla_mode_is_checked(pair) -> None:
    with pytest.raises(ValueError, match="mla mode"):
        pair[0].set_mla_mode("fast")


def test_other_one_byte_caches_are_refused_at_bind(pair) -> None:
    entry = pair[2].model_config.head_dim
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        pair[0].bind_kv_caches([torch.zeros(1, 4, 16, 1, entry,
                                            dtype=torch.float8_e5m2)] * LAYERS)


def _fake_quantised_hf_logits(hf, ids: list[int], k_scale: float) -> torch.Tensor:
    """Transformers' V2 logits with what an fp8 latent cache holds in place of ``c_kv``
    (``kv_a_layernorm``'s output) and the rotated ``k_pe``: ``e4m3(x / k_scale) *
    k_scale``.  The queries and the rest stay fp32."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2

    from pagedllm.attention.kv_cache_dtype import quantize_kv

    def fq(x: torch.Tensor) -> torch.Tensor:
        return (quantize_kv(x, k_scale).float() * k_scale).to(x.dtype)

    rotate = hf_v2.apply_rotary_emb

    def rotate_fq(q, k, freqs):  # type: ignore[no-untyped-def]
        q, k = rotate(q, k, freqs)
        return q, fq(k)

    hooks = [layer.self_attn.kv_a_layernorm.register_forward_hook(lambda m, i, o: fq(o))
             for layer in hf.model.layers]
    hf_v2.apply_rotary_emb = rotate_fq
    try:
        return hf_logits_of(hf, ids)
    finally:
        hf_v2.apply_rotary_emb = rotate
        for h in hooks:
            h.remove()


def test_fp8_latent_cache_equals_fake_quantised_transformers(tmp_path) -> None:
    """``kv_cache_dtype="fp8"``: the model over an e4m3 latent cache computes exactly
    transformers with its latents rounded the same way -- chunks then decodes, every
    attention form, and (interpreted) the Triton decode kernel.  The scale comes from the
    checkpoint (``self_attn.k_scale``, 0.02: entries / 0.02 in e4m3's normal range; the
    ``v_scale`` beside it is dropped: the latent is keys and values at once).  Measured:
    1.7e-6 off in most runs; 5.5e-4 where one element's e4m3 rounding flips between two
    fp32 computations of it (a latent on a rounding midpoint to within 1e-6), so 1e-3.
    Against plain fp32 transformers the same logits are ~0.25 off (max |logit| ~2.6):
    fp8's own error, which the engine test bounds in greedy tokens."""
    from safetensors.torch import save_file

    hf = build("v2_lite", str(tmp_path))
    save_file({f"model.layers.{i}.self_attn.{k}_scale": torch.tensor(v)
               for i in range(LAYERS) for k, v in (("k", 0.02), ("v", 0.5))},
              str(tmp_path / "kv_scales.safetensors"), metadata={"format": "pt"})
    cfg = EngineArgs(model=str(tmp_path), device="cpu", dtype="float32",
                     kv_cache_dtype="fp8").create_engine_config()
    ours = load_model(cfg.model_config, torch.device("cpu"), TorchReferenceBackend())
    assert [m.k_scale for m in ours.mla_layers()] == [pytest.approx(0.02)] * LAYERS
    assert not any(hasattr(m, "v_scale") for m in ours.mla_layers())
    ids = _prompt(45, seed=2)
    ref = _fake_quantised_hf_logits(hf, ids, ours.mla_layers()[0].k_scale)
    runs = [("auto", False), ("absorbed", False), ("expanded", False)]
    if os.environ.get("TRITON_INTERPRET") == "1":
        runs.append(("auto", True))
    mc = cfg.model_config
    for mode, kernel in runs:
        ours.set_mla_mode(mode)
        ours.mla_backend.kernel_on_cpu = kernel
        s = PagedSession(ours, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks=48,
                         block_size=4, seed=4, kv_entries=1, dtype=torch.float8_e4m3fn)
        parts = [s.step({7: ids[:13]})[7], s.step({7: ids[13:30]})[7]]
        parts += [s.step({7: [t]})[7] for t in ids[30:]]
        torch.testing.assert_close(torch.cat(parts), ref, atol=1e-3, rtol=0,
                                   msg=lambda m, mode=mode: f"{mode}: {m}")
    ours.mla_backend.kernel_on_cpu = False


# One config: ``test_triton_kernels_in_every_layer`` runs this kernel on all four.
@pytest.mark.parametrize("pair", ["v2_lite"], indirect=True)
def test_triton_decode_kernel_in_the_model(pair) -> None:
    """Decode steps through ``kernels/mla_decode.py`` (interpreted on CPU tensors) over
    the cache this layer writes: the agreed layout, end to end."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernel on CPU tensors: needs TRITON_INTERPRET=1")
    pytest.importorskip("pagedllm.kernels.mla_decode")
    ours, hf = pair[0], pair[1]
    ours.set_mla_mode("auto")
    ours.mla_backend.kernel_on_cpu = True
    try:
        ids = _prompt(24, seed=6)
        s = session_for(pair, block_size=4, seed=6)
        parts = [s.step({0: ids[:19]})[0]] + [s.step({0: [t]})[0] for t in ids[19:]]
    finally:
        ours.mla_backend.kernel_on_cpu = False
    torch.testing.assert_close(torch.cat(parts), hf_logits_of(hf, ids), atol=ATOL, rtol=0)


# One config: the row selection under test does not depend on it (the kernel itself runs
# on every config in ``test_triton_kernels_in_every_layer``).
@pytest.mark.parametrize("pair", ["v3"], indirect=True)
def test_triton_kernel_serves_the_decodes_of_a_mixed_step(pair) -> None:
    """A step mixing prompt chunks and decodes sends the decodes (rows not first, not
    contiguous) through the kernel with their rows of the metadata: logits equal the
    torch path's."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernel on CPU tensors: needs TRITON_INTERPRET=1")
    pytest.importorskip("pagedllm.kernels.mla_decode")
    ours = pair[0]
    ours.set_mla_mode("auto")
    a, b, c = _prompt(14, seed=7), _prompt(9, seed=8), _prompt(11, seed=9)
    runs = []
    for on in (False, True):
        ours.mla_backend.kernel_on_cpu = on
        try:
            s = session_for(pair, block_size=4, seed=7)
            s.step({0: a[:12], 2: c[:10]})
            # request 1 prefills between two decodes: decodes at rows 0 and 2
            out = s.step({0: [a[12]], 1: b, 2: [c[10]]})
            runs.append(torch.cat([out[0], out[2]]))
        finally:
            ours.mla_backend.kernel_on_cpu = False
    torch.testing.assert_close(runs[1], runs[0], atol=ATOL, rtol=0)


def test_rope_table_ignores_a_foreign_head_dim(pair) -> None:
    """Released (remote-code) configs carry no ``head_dim``; the rotary table is sized
    from ``qk_rope_head_dim`` whatever the config's ``head_dim`` says."""
    import copy

    ours, hf, _ = pair
    cfg = copy.deepcopy(ours.config)
    cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads  # 16, not the rope dim 8
    other = type(ours)(cfg, TorchReferenceBackend()).eval()
    other.load_state_dict(ours.state_dict())
    assert other.model.rotary_emb.rotary_dim == cfg.qk_rope_head_dim
    ids = _prompt(30, seed=8)
    got = session_for((other, hf, pair[2])).step({0: ids})[0]
    torch.testing.assert_close(got, hf_logits_of(hf, ids), atol=ATOL, rtol=0)


def test_quantised_kv_b_proj_is_read_dequantised(tmp_path) -> None:
    """Under ``--quantization fp8`` ``kv_b_proj`` is stored e4m3; attention reads it
    through the method's own dequantisation (the layer applied to the identity): within
    fp8 rounding of the checkpoint's weight, and the two forms still agree."""
    hf = build("v3", str(tmp_path))
    cfg = EngineArgs(model=str(tmp_path), device="cpu", dtype="float32",
                     quantization="fp8").create_engine_config()
    ours = load_model(cfg.model_config, torch.device("cpu"), TorchReferenceBackend())
    layer = ours.model.layers[0].self_attn
    assert layer.kv_b_proj.unquantized_weight is None
    dense = layer.kv_b_weight(torch.float32)
    ref = hf.model.layers[0].self_attn.kv_b_proj.weight
    assert float((dense - ref).abs().max() / ref.abs().max()) < 0.07  # e4m3: 3 mantissa bits
    assert layer.kv_b_weight(torch.float32) is dense  # cached while the weight is unchanged
    ids = _prompt(26, seed=9)
    outs = []
    for mode in ("absorbed", "expanded"):
        ours.set_mla_mode(mode)
        s = session_for((ours, hf, cfg), block_size=4, seed=9)
        outs.append(torch.cat([s.step({0: ids[:20]})[0]]
                              + [s.step({0: [t]})[0] for t in ids[20:]]))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=0)


def test_triton_kernels_in_every_layer(pair) -> None:
    """The CUDA path's kernels (interpreted on CPU) in every layer: the MLA prologue and
    decode kernels and the fused-MoE kernels -- for V2-Lite's plain softmax router the
    expert layer routes itself (``FusedMoE.forward``), V3's grouped router goes through
    ``grouped_topk`` -- prefill, then decodes: logits equal transformers'."""
    from pagedllm.layers.fused_moe import FusedMoE

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels on CPU tensors: needs TRITON_INTERPRET=1")
    ours, hf = pair[0], pair[1]
    moes = [m for m in ours.modules() if isinstance(m, FusedMoE)]
    ours.set_mla_mode("auto")
    ours.mla_backend.kernel_on_cpu = True
    for m in moes:
        m.use_triton = True
    try:
        ids = _prompt(22, seed=10)
        s = session_for(pair, block_size=4, seed=10)
        parts = [s.step({0: ids[:18]})[0]] + [s.step({0: [t]})[0] for t in ids[18:]]
    finally:
        ours.mla_backend.kernel_on_cpu = False
        for m in moes:
            m.use_triton = False
    torch.testing.assert_close(torch.cat(parts), hf_logits_of(hf, ids), atol=ATOL, rtol=0)


def _graph_meta(meta, tokens: int, reqs: int):  # type: ignore[no-untyped-def]
    """``meta`` as a CUDA graph of ``tokens`` rows and ``reqs`` request slots sees it
    (worker/cuda_graphs.py): padded rows write nowhere (slot -1), the unused request
    slots own no token, and the host twins are the capture's placeholders."""
    from pagedllm.attention.metadata import AttentionMetadata

    t, n = meta.num_actual_tokens, meta.num_reqs
    i32 = torch.int32
    decode = tokens == reqs and meta.max_query_len == 1  # a decode graph: row i = request i
    qsl = torch.arange(reqs + 1, dtype=i32) if decode else torch.full((reqs + 1,), t,
                                                                         dtype=i32)
    qsl[:n + 1] = meta.query_start_loc
    seq = torch.ones(reqs, dtype=i32)
    seq[:n] = meta.seq_lens
    tables = torch.zeros(reqs, meta.block_tables.shape[1], dtype=i32)
    tables[:n] = meta.block_tables
    slots = torch.full((tokens,), -1, dtype=torch.int64)
    slots[:t] = meta.slot_mapping
    placeholder = torch.full((reqs + 1,), tokens, dtype=i32)
    placeholder[0] = 0
    if decode:
        placeholder = torch.arange(reqs + 1, dtype=i32)
    return AttentionMetadata(
        num_actual_tokens=tokens, num_reqs=reqs, max_query_len=1 if decode else tokens,
        max_seq_len=meta.max_seq_len, query_start_loc=qsl, seq_lens=seq,
        block_tables=tables, slot_mapping=slots, query_start_loc_cpu=placeholder,
        seq_lens_cpu=torch.ones(reqs, dtype=i32), block_size=meta.block_size,
        host_lens=False)


# The padding and placeholders under test do not depend on the config; these two cover
# both RoPE layouts, both query paths and both routers (the interpreter's time is ~20 s
# a config).
@pytest.mark.parametrize("pair", ["v2_lite", "v3_neox_yarn"], indirect=True)
def test_graph_steps_without_host_lengths(pair) -> None:
    """Steps as a CUDA graph replays them (``AttentionMetadata.host_lens`` False: padded
    rows and request slots, placeholder host twins): prompt chunks, a chunk after
    context beside a whole prompt, decodes in a chunk graph and in a decode graph all
    run the absorbed kernel path (``MLATorchBackend._graph_step``) -- the real rows'
    logits equal transformers'."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels on CPU tensors: needs TRITON_INTERPRET=1")
    import tests.models.paged as paged

    ours, hf = pair[0], pair[1]
    a, b = _prompt(19, seed=11), _prompt(9, seed=12)
    real = paged.build_metadata
    shape = {"tokens": 0, "reqs": 0}

    def graph_metadata(*args, **kwargs):  # type: ignore[no-untyped-def]
        return _graph_meta(real(*args, **kwargs), shape["tokens"], shape["reqs"])

    class GraphSession(PagedSession):
        """Pads ids and positions to the graph's rows; logits of the real rows."""

        def step(self, new_tokens, last_only=False):  # type: ignore[no-untyped-def]
            t = sum(len(v) for v in new_tokens.values())
            pad = shape["tokens"] - t
            orig_model = self.model

            def forward(ids, positions, meta, last_only=False):  # type: ignore[no-untyped-def]
                ids = torch.cat((ids, ids.new_zeros(pad)))
                positions = torch.cat((positions, positions.new_zeros(pad)))
                return orig_model(ids, positions, meta, last_only=last_only)[:t]

            class Shim:  # the model as the session calls it
                __call__ = staticmethod(forward)
                compute_logits = staticmethod(orig_model.compute_logits)

            self.model = Shim()  # type: ignore[assignment]
            try:
                return PagedSession.step(self, new_tokens, last_only)
            finally:
                self.model = orig_model

    ours.set_mla_mode("auto")
    ours.mla_backend.kernel_on_cpu = True
    paged.build_metadata = graph_metadata
    try:
        mc = pair[2].model_config
        s = GraphSession(ours, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks=48,
                         block_size=4, seed=13, kv_entries=mc.kv_entries_per_token)
        got_a, got_b = [], []
        shape.update(tokens=16, reqs=4)
        got_a.append(s.step({0: a[:12]})[0])
        shape.update(tokens=32, reqs=8)  # a chunk after context beside a whole prompt
        out = s.step({0: a[12:17], 1: b})
        got_a.append(out[0])
        got_b.append(out[1])
        shape.update(tokens=8, reqs=8)  # decodes in a chunk graph, with padding rows
        out = s.step({0: [a[17]], 1: [2]})
        got_a.append(out[0])
        got_b.append(out[1])
        shape.update(tokens=4, reqs=4)  # a decode graph: padded requests read block 0
        for ta, tb in zip(a[18:], [3]):
            out = s.step({0: [ta], 1: [tb]})
            got_a.append(out[0])
            got_b.append(out[1])
    finally:
        paged.build_metadata = real
        ours.mla_backend.kernel_on_cpu = False
    torch.testing.assert_close(torch.cat(got_a), hf_logits_of(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got_b), hf_logits_of(hf, b + [2, 3]), atol=ATOL,
                               rtol=0)
