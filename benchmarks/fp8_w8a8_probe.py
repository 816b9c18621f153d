"""Where W8A8's perplexity cost comes from (CPU, fp32 compute, the SmolLM2 GGUF).

    PYTHONPATH=. python benchmarks/fp8_w8a8_probe.py [--num-tokens 2048] [--window 512]
        [--text opticks|python-docs] [--modes w8a8,w8,a8,...]

Each mode is one engine with ``quantization="fp8"`` (since 2026-12-03 per-tensor e4m3
weights, per-token e4m3 activations: the ``w8pt_a8`` mode) whose CPU linear
(``Fp8LinearMethod.apply``) is swapped, for this probe only, to isolate one source of
error; perplexity over the first ``--num-tokens`` tokens
of ``pagedllm bench perplexity``'s text, against the unquantised engine:

* ``w8a8``: per-channel e4m3 weights, per-token e4m3 activations (shipped until
  2026-12-03, and what FP8_DYNAMIC checkpoints hold); ``w8``: per-channel e4m3 weights,
  float activations;
* ``a8``: float weights, per-token e4m3 activations;
* ``w8a8_g128``: activations with one scale per 128 columns of a token (vLLM's
  per-token-group activation quantisation of block-FP8 checkpoints), e4m3 weights;
* ``w8_mant3``: weights rounded to 3 mantissa bits with an unbounded exponent (no
  subnormals, no saturation: e4m3's floor under any choice of scales), float activations;
* ``w8a8_pt``: vLLM's online ``quantization="fp8"`` (per-tensor weights, dynamic
  per-tensor activations); the mixes ``w8pt_a8`` (per-tensor weights, per-token
  activations) and ``w8_a8pt`` (per-channel, per-tensor), and each part alone:
  ``w8_pt`` (per-tensor e4m3 weights, float activations), ``a8_pt`` (float weights,
  per-tensor e4m3 activations);
* ``skip_<proj>``: ``w8a8`` with one kind of projection left in float (``qkv_proj``,
  ``o_proj``, ``gate_up_proj``, ``down_proj``), vLLM's ``ignored_layers``.

``--stats`` also prints, per projection kind, the relative output error ||y8 - y|| / ||y||
of the ``w8a8`` linear and of its weight-only and activation-only parts, and the
activations' mean per-token amax / rms (outliers).
"""

from __future__ import annotations

import argparse
import collections
import math

import torch

from pagedllm.layers.quantization import fp8 as fp8mod
from pagedllm.layers.quantization.fp8 import FP8_DTYPE, FP8_MAX, quantize_fp8_rows

MODE = "w8a8"
STATS: dict[str, list[float]] = collections.defaultdict(lambda: [0.0] * 5)
_orig_process = fp8mod.Fp8LinearMethod.process_weights_after_loading


def _q(x: torch.Tensor) -> torch.Tensor:
    """Per-row e4m3 round trip."""
    q, s = quantize_fp8_rows(x)
    return q.float() * s


def _q_group(x: torch.Tensor, g: int = 128) -> torch.Tensor:
    t, c = x.shape
    pad = (-c) % g
    xp = torch.nn.functional.pad(x.float(), (0, pad)).view(t, -1, g)
    s = (xp.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=fp8mod._MIN_SCALE)
    return ((xp / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * s).view(t, -1)[:, :c]


def _mant3(x: torch.Tensor) -> torch.Tensor:
    """Round to 3 mantissa bits (half to even), any exponent."""
    m, e = torch.frexp(x.float())  # x = m * 2^e, 0.5 <= |m| < 1
    return torch.ldexp(torch.round(m * 16.0) / 16.0, e)


def _q_tensor(x: torch.Tensor) -> torch.Tensor:
    q, s = fp8mod.quantize_fp8_tensor(x)
    return q.float() * s


def process(self, layer) -> None:  # type: ignore[no-untyped-def]
    layer._probe_w = layer.weight.data.float().clone()
    layer._probe_m3 = _mant3(layer._probe_w)
    layer._probe_w8 = _q(layer._probe_w)  # per-channel, whatever the engine stores
    _orig_process(self, layer)


def apply(self, layer, x, bias):  # type: ignore[no-untyped-def]
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float()
    w = layer._probe_w
    w8 = layer._probe_w8
    kind = getattr(layer, "_probe_kind", "?")
    mode = MODE
    if mode.startswith("skip_"):
        mode = "float" if kind == mode[5:] else "w8a8"
    xa, wa = {"w8a8": (_q(x2), w8), "w8": (x2, w8), "a8": (_q(x2), w),
              "w8a8_g128": (_q_group(x2), w8), "float": (x2, w),
              "w8_mant3": (x2, layer._probe_m3),
              "w8a8_pt": (_q_tensor(x2), _q_tensor(w)),
              "a8_pt": (_q_tensor(x2), w), "w8_pt": (x2, _q_tensor(w)),
              "w8_a8pt": (_q_tensor(x2), w8), "w8pt_a8": (_q(x2), _q_tensor(w))}[mode]
    y = xa @ wa.t()
    if STATS_ON:
        ref = x2 @ w.t()
        n = ref.norm().item() + 1e-30
        st = STATS[kind]
        st[0] += (y - ref).norm().item() / n
        st[1] += (x2 @ w8.t() - ref).norm().item() / n
        st[2] += (_q(x2) @ w.t() - ref).norm().item() / n
        rms = x2.pow(2).mean(-1).sqrt().clamp(min=1e-30)
        st[3] += (x2.abs().amax(-1) / rms).mean().item()
        st[4] += 1
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], y.shape[-1])


STATS_ON = False


def perplexity(llm, windows: list[list[int]]) -> float:  # type: ignore[no-untyped-def]
    from pagedllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], sp, use_tqdm=False)
    lps = [o.prompt_logprobs[i][o.prompt_token_ids[i]].logprob
           for o in outs for i in range(1, len(o.prompt_token_ids))]
    return math.exp(-sum(lps) / len(lps))


def main() -> None:
    global MODE, STATS_ON
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--modes", default="w8a8,w8,a8,w8a8_g128,w8a8_pt,skip_qkv_proj,"
                                       "skip_o_proj,skip_gate_up_proj,skip_down_proj")
    ap.add_argument("--text", default="opticks", choices=["opticks", "python-docs"])
    ap.add_argument("--stats", action="store_true")
    args = ap.parse_args()
    from pagedllm import LLM
    from pagedllm.benchmarks.perplexity import corpus_text

    fp8mod.Fp8LinearMethod.process_weights_after_loading = process  # type: ignore
    fp8mod.Fp8LinearMethod.apply = apply  # type: ignore
    # No prefix caching: every mode recomputes the same windows.
    kw = dict(device="cpu", max_model_len=args.window + 1, kv_cache_memory_bytes=64 << 20,
              enable_prefix_caching=False)
    base = LLM(None, quantization="none", **kw)
    ids = base.get_tokenizer()(corpus_text(args.text)[0],
                               add_special_tokens=False)["input_ids"][:args.num_tokens]
    windows = [ids[i:i + args.window] for i in range(0, len(ids), args.window)]
    p0 = perplexity(base, windows)
    print(f"unquantised {p0:.4f}", flush=True)
    del base
    llm = LLM(None, quantization="fp8", **kw)
    model = llm.llm_engine.client.core.executor.worker.model
    for name, m in model.named_modules():
        if hasattr(m, "_probe_w"):
            m._probe_kind = name.rsplit(".", 1)[-1]
    for mode in args.modes.split(","):
        MODE = mode
        STATS_ON = args.stats and mode == "w8a8"
        p = perplexity(llm, windows)
        print(f"{mode:<20} {p:.4f} {100 * (p / p0 - 1):+.2f}%", flush=True)
    if STATS or args.stats:
        print("kind            rel err w8a8   w8 only   a8 only   amax/rms")
        for kind, st in sorted(STATS.items()):
            n = st[4]
            print(f"{kind:<16}{st[0] / n:>12.4f}{st[1] / n:>10.4f}{st[2] / n:>10.4f}"
                  f"{st[3] / n:>11.1f}")


if __name__ == "__main__":
    main()
