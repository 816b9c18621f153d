"""Embedding throughput: embeddings/s of an encoder at fixed-length inputs (issue 23's
target: the E5-large shape, 512-token inputs, batch 256, dummy weights).

Every step pools ``--batch-size`` whole prompts (``max_num_seqs`` = batch size,
``max_num_batched_tokens`` = batch size x input length, so one step holds the batch).
One warm-up pass, then ``--num-iters`` timed passes over ``--num-prompts`` prompts;
the median pass is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

from pagedllm.entrypoints.engine_cli_args import add_engine_args, engine_args_from_cli

_BERT = {"architectures": ["BertModel"], "model_type": "bert", "hidden_act": "gelu",
         "layer_norm_eps": 1e-12, "type_vocab_size": 2, "vocab_size": 30522,
         "max_position_embeddings": 512, "pad_token_id": 0, "torch_dtype": "float16"}
EMBED_SHAPES: dict[str, dict[str, Any]] = {
    # intfloat/e5-large-v2 (and BGE-large-en-v1.5): 335M parameters.
    "e5-large": {**_BERT, "hidden_size": 1024, "num_hidden_layers": 24,
                 "num_attention_heads": 16, "intermediate_size": 4096},
    # intfloat/e5-small-v2 / BGE-small: 33M parameters (the CPU figure).
    "e5-small": {**_BERT, "hidden_size": 384, "num_hidden_layers": 12,
                 "num_attention_heads": 12, "intermediate_size": 1536},
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dummy", default="e5-large", choices=sorted(EMBED_SHAPES),
                   help="Encoder shape with random weights (ignored with --model).")
    p.add_argument("--input-len", type=int, default=512, help="Tokens per input.")
    p.add_argument("--batch-size", type=int, default=256,
                   help="Inputs pooled per engine step.")
    p.add_argument("--num-prompts", type=int, default=1024, help="Inputs per timed pass.")
    p.add_argument("--num-iters", type=int, default=3, help="Timed passes (median).")
    p.add_argument("--output-json", default=None, help="Write the results here as JSON.")
    add_engine_args(p)


def main(args: argparse.Namespace) -> int:
    import numpy as np

    from pagedllm import LLM
    from pagedllm.pooling_params import PoolingParams

    for name in ("input_len", "batch_size", "num_prompts", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1")
    if args.model is None:
        d = tempfile.mkdtemp(prefix=f"pagedllm-{args.dummy}-")
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(EMBED_SHAPES[args.dummy], f)
        args.model, args.load_format, args.skip_tokenizer_init = d, "dummy", True
    args.max_num_seqs = args.batch_size
    args.max_num_batched_tokens = args.batch_size * args.input_len
    eargs = engine_args_from_cli(args)
    llm = LLM(eargs.model, **{k: v for k, v in vars(eargs).items()
                              if k not in ("model", "extra")})
    mc = llm.llm_engine.config.model_config
    rng = np.random.default_rng(0)
    hi = min(mc.vocab_size, 30000)  # ordinary word pieces, clear of special tokens
    lo = min(1000, hi // 2)
    prompts = [{"prompt_token_ids": rng.integers(lo, hi, args.input_len).tolist()}
               for _ in range(args.num_prompts)]
    params = PoolingParams(task="embed")
    llm.embed(prompts[:args.batch_size], params)  # warm-up (allocator, kernels)
    times = []
    for _ in range(args.num_iters):
        t0 = time.perf_counter()
        outs = llm.embed(prompts, params)
        times.append(time.perf_counter() - t0)
    assert len(outs) == len(prompts)
    t = statistics.median(times)
    result = {"model": args.dummy if eargs.load_format == "dummy" else eargs.model,
              "device": llm.llm_engine.config.device_config.device, "dtype": mc.dtype,
              "input_len": args.input_len, "batch_size": args.batch_size,
              "num_prompts": args.num_prompts, "seconds": t,
              "embeddings_per_s": args.num_prompts / t,
              "tokens_per_s": args.num_prompts * args.input_len / t,
              "dimension": len(outs[0].outputs.embedding)}
    print(f"embed {result['model']} ({result['device']}, {mc.dtype}): "
          f"{args.num_prompts} x {args.input_len} tokens, batch {args.batch_size}: "
          f"{result['embeddings_per_s']:.1f} embeddings/s "
          f"({result['tokens_per_s']:.0f} tokens/s), median of {args.num_iters}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
