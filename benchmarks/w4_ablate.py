"""What each small kernel of a batch-1 decode step costs, measured by leaving it out.

With programmatic dependent launch (``kernels/pdl.py``) the profiler's kernel durations
include the time a kernel sits waiting for its predecessor, so a per-kernel table does not
say what removing (fusing away) a kernel would save.  This script measures that directly:
it replaces one kind of kernel with a no-op before the engine is built (so the decode CUDA
graphs are captured without it) and reports W4's TPOT.  The outputs are garbage in every
variant but ``none``; only the times mean anything.

    python benchmarks/w4_ablate.py --skip none rotary_kv reduce norm attn small

Each variant runs in its own process (fresh engine, fresh graphs), one after another.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

VARIANTS = {
    "none": "nothing left out (the baseline)",
    "rotary_kv": "rotary + KV-cache write (one launch per layer)",
    "reduce": "the split-KV merge after decode attention",
    "norm": "both RMSNorm (+ residual) launches per layer",
    "attn": "attention: rotary/KV write, attention and the merge",
    "small": "every launch but the GEMVs (norms, rotary, attention)",
}


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: None


def _apply(skip: str) -> None:
    import pagedllm.attention.triton_backend as tb
    import pagedllm.kernels.paged_attention as pa
    from pagedllm.layers.norm import RMSNorm

    if skip in ("rotary_kv", "attn", "small"):
        tb.rotary_and_write_kv = lambda *a, **k: None  # type: ignore[assignment]
    if skip == "reduce":
        pa._reduce_splits_kernel = _NoLaunch()  # type: ignore[assignment]
    if skip in ("attn", "small"):
        tb.TritonAttentionBackend.attend = (  # type: ignore[method-assign]
            lambda self, query, kv_cache, meta, scale: query)
    if skip in ("norm", "small"):
        def no_norm(self: Any, x: Any, residual: Any = None) -> Any:
            return x if residual is None else (x, residual)
        RMSNorm.forward = no_norm  # type: ignore[method-assign]


def _child(skip: str, out: str) -> int:
    _apply(skip)
    from pagedllm.benchmarks import latency

    p = argparse.ArgumentParser()
    latency.add_args(p)
    args = p.parse_args(["--dummy", "llama3-8b", "--num-prompts", "3",
                         "--output-json", out])
    return latency.main(args)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                   help="Variants to run, each in its own process.")
    p.add_argument("--out", default=".", help="Folder for the per-variant JSON and the "
                   "summary (w4_ablate.json).")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return _child(args.child, os.path.join(args.out, f"w4_ablate_{args.child}.json"))
    rows = []
    for skip in args.skip:
        rc = subprocess.call([sys.executable, __file__, "--child", skip, "--out", args.out])
        path = os.path.join(args.out, f"w4_ablate_{skip}.json")
        if rc != 0 or not os.path.exists(path):
            rows.append({"skip": skip, "error": f"exit {rc}"})
            continue
        with open(path) as f:
            res = json.load(f)
        rows.append({"skip": skip, "tpot_ms": res["tpot_ms"], "tpot_all_ms": res["tpot_all_ms"]})
    base = next((r["tpot_ms"] for r in rows if r["skip"] == "none" and "tpot_ms" in r), None)
    print(f"{'left out':<12}{'TPOT ms':>9}{'saves ms':>10}{'per layer us':>14}  what")
    for r in rows:
        if "tpot_ms" not in r:
            print(f"{r['skip']:<12}{r['error']:>9}")
            continue
        saves = (base - r["tpot_ms"]) if base is not None else float("nan")
        print(f"{r['skip']:<12}{r['tpot_ms']:>9.3f}{saves:>10.3f}{saves * 1000 / 32:>14.2f}  "
              f"{VARIANTS[r['skip']]}")
    with open(os.path.join(args.out, "w4_ablate.json"), "w") as f:
        json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
