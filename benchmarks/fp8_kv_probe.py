"""Where the fp8 KV cache's perplexity cost comes from (CPU, fp32 compute, the SmolLM2 GGUF).

    PYTHONPATH=. python benchmarks/fp8_kv_probe.py [--num-tokens 8192] [--window 1024]
        [--text opticks|python-docs] [--modes kv8,k8,v8,...]

One unquantised engine (``quantization="none"``, an fp32 cache); for this probe only, the
torch attention backend's ``write_kv`` is wrapped so that the keys and/or values it stores
are first rounded the way a mode says (and read back as floats).  Perplexity over the
first ``--num-tokens`` tokens of ``pagedllm bench perplexity``'s text, against the same
engine with the wrapper off.  Keys are rounded after the rotary embedding, as the cache
stores them.

* ``kv8``: keys and values as e4m3 with scale 1.0 (what ``kv_cache_dtype="fp8"`` stores);
  ``k8`` / ``v8``: only the keys / only the values;
* ``kv8_amax``: per-layer scales from the tensor's amax on every write (keys / 200,
  values / 100: ``calculate_kv_scales``' constants, here recomputed per write, so an
  upper bound on what any per-tensor scale can do);
* ``kv8_head``: one scale per token and head (amax / 448): no value is subnormal or
  saturated, the finest scale a cache of e4m3 codes can carry;
* ``kv_mant3``: 3 mantissa bits, any exponent (e4m3's rounding with no subnormals and no
  saturation: the floor of every scale choice); ``kv_mant4`` / ``kv_mant5``: 4 and 5 bits,
  for how the cost falls with precision.
"""

from __future__ import annotations

import argparse

import torch
from fp8_w8a8_probe import perplexity  # this folder: run as benchmarks/fp8_kv_probe.py

from pagedllm.attention import torch_ref
from pagedllm.attention.kv_cache_dtype import quantize_kv
from pagedllm.layers.kv_scales import scales_from_amax
from pagedllm.layers.quantization.fp8 import quantize_fp8_rows

MODE = "off"
_orig_write = torch_ref.TorchReferenceBackend.write_kv


def _e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What the fp8 cache stores at ``scale``, read back (the engine's own rounding)."""
    return (quantize_kv(x, scale).float() * scale).to(x.dtype)


def _mant(x: torch.Tensor, bits: int) -> torch.Tensor:
    m, e = torch.frexp(x.float())  # x = m * 2^e, 0.5 <= |m| < 1
    return torch.ldexp(torch.round(m * 2.0 ** (bits + 1)) / 2.0 ** (bits + 1), e)


def _round(x: torch.Tensor, which: str) -> torch.Tensor:
    mode = MODE
    if mode in ("k8", "v8"):
        mode = "kv8" if mode[0] == which else "off"
    if mode == "off":
        return x
    if mode == "kv8":
        return _e4m3(x, 1.0)
    if mode == "kv8_amax":  # calculate_kv_scales' rule, on every write
        k_scale, v_scale = scales_from_amax(x, x)
        return _e4m3(x, k_scale if which == "k" else v_scale)
    if mode == "kv8_head":  # [tokens, heads, head_dim]: one scale per token and head
        q, s = quantize_fp8_rows(x)
        return (q.float() * s).to(x.dtype)
    if mode.startswith("kv_mant"):
        return _mant(x, int(mode[len("kv_mant"):])).to(x.dtype)
    raise ValueError(f"unknown mode {MODE!r}")


def write_kv(self, key, value, kv_cache, meta, k_scale=1.0, v_scale=1.0):  # type: ignore
    return _orig_write(self, _round(key, "k"), _round(value, "v"), kv_cache, meta,
                       k_scale, v_scale)


def main() -> None:
    global MODE
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--text", default="opticks", choices=["opticks", "python-docs"])
    ap.add_argument("--modes", default="kv8,k8,v8,kv8_amax,kv8_head,kv_mant3,kv_mant4")
    args = ap.parse_args()
    from pagedllm import LLM
    from pagedllm.benchmarks.perplexity import corpus_text

    torch_ref.TorchReferenceBackend.write_kv = write_kv  # type: ignore[method-assign]
    # No prefix caching: every mode recomputes the same windows.
    llm = LLM(None, quantization="none", device="cpu", max_model_len=args.window + 1,
              kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)
    ids = llm.get_tokenizer()(corpus_text(args.text)[0],
                              add_special_tokens=False)["input_ids"][:args.num_tokens]
    windows = [ids[i:i + args.window] for i in range(0, len(ids), args.window)]
    p0 = perplexity(llm, windows)
    print(f"unquantised {p0:.4f} ({len(ids)} tokens of {args.text})", flush=True)
    for mode in args.modes.split(","):
        MODE = mode
        p = perplexity(llm, windows)
        print(f"{mode:<12} {p:.4f} {100 * (p / p0 - 1):+.2f}%", flush=True)


if __name__ == "__main__":
    main()
