"""BERT and XLM-RoBERTa encoders (``BertModel``, ``XLMRobertaModel``: E5, BGE) over a
flattened batch, with the poolers of ``layers/pooler.py``.

```
 ids -> word + position + token_type(0) embeddings -> LayerNorm
     -> [ LN(x + o(attn(qkv(x))))  ->  LN(x + down(gelu(up(x)))) ] x L -> hidden [T, H]
```

Attention is bidirectional within each sequence (no KV cache): one batched SDPA per
layer over the sequences of ``query_start_loc`` (padded and masked when their lengths
differ: ``_Layout``).  XLM-RoBERTa differs only in its position ids,
which start after the padding index (``padding_idx + 1``).  Linear layers take
``quant_config`` and their HF module names as ``prefix``, like the decoders.

The pooling runner (``worker/pooling_runner.py``) serves it through the scheduler without
a KV cache (``LLM.embed``, ``/v1/embeddings``); ``is_encoder`` tells it to call
``forward(input_ids, query_start_loc, token_type_ids)`` rather than a decoder's paged
forward.  Segment ids (``token_type_ids``) matter for sentence pairs (cross-encoders,
``models/bert_classifier.py``); None means segment 0 throughout.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    load_weight,
)
from pagedllm.layers.pooler import PoolingType, pool
from pagedllm.layers.quantization.base import QuantizationConfig


class BertLayer(nn.Module):
    def __init__(self, config: Any, quant_config: QuantizationConfig | None,
                 prefix: str) -> None:
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        self.num_heads, self.head_dim = heads, h // heads
        self.qkv = QKVParallelLinear(h, self.head_dim, heads, heads, bias=True,
                                     quant_config=quant_config,
                                     prefix=f"{prefix}.attention.self.qkv")
        self.attn_out = RowParallelLinear(h, h, bias=True, quant_config=quant_config,
                                          prefix=f"{prefix}.attention.output.dense")
        self.attn_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.up = ColumnParallelLinear(h, config.intermediate_size, bias=True,
                                       quant_config=quant_config,
                                       prefix=f"{prefix}.intermediate.dense")
        self.down = RowParallelLinear(config.intermediate_size, h, bias=True,
                                      quant_config=quant_config,
                                      prefix=f"{prefix}.output.dense")
        self.out_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        if config.hidden_act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported")
        self.approximate = "none" if config.hidden_act == "gelu" else "tanh"

    def forward(self, x: torch.Tensor, layout: _Layout) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        attn = layout.attention(q, k, v).reshape(t, -1)
        x = self.attn_norm(x + self.attn_out(attn))
        return self.out_norm(x + self.down(F.gelu(self.up(x), approximate=self.approximate)))


class _Layout:
    """How a flattened batch of sequences becomes one batched bidirectional SDPA:
    sequences of equal length are a view ``[R, L]``; otherwise they are scattered into
    a zero-padded ``[R, L_max]`` batch whose padded keys are masked out (padded query
    rows attend to real keys and are dropped).  Built once per forward, shared by the
    layers; one SDPA call per layer, not one per sequence."""

    def __init__(self, query_start_loc: torch.Tensor, num_tokens: int) -> None:
        qsl = query_start_loc.tolist()  # host bounds (the runner built them on the host)
        lens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
        self.num_seqs, self.max_len = len(lens), max(lens)
        self.uniform = all(n == self.max_len for n in lens)
        self.rows: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        if not self.uniform:
            dev = query_start_loc.device
            lens_t = torch.tensor(lens, device=dev)
            seq = torch.repeat_interleave(torch.arange(len(lens), device=dev), lens_t)
            pos = torch.arange(num_tokens, device=dev) - query_start_loc[:-1].long()[seq]
            self.rows = seq * self.max_len + pos  # token -> row of the padded batch
            keep = torch.arange(self.max_len, device=dev)[None, :] < lens_t[:, None]
            self.mask = keep[:, None, None, :]  # [R, 1, 1, L]: attend to real keys only

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q, k, v [T, heads, d]`` -> ``[T, heads, d]``."""
        r, n = self.num_seqs, self.max_len
        if self.uniform:
            def batch(x: torch.Tensor) -> torch.Tensor:
                return x.view(r, n, *x.shape[1:]).transpose(1, 2)
            o = F.scaled_dot_product_attention(batch(q), batch(k), batch(v))
            return o.transpose(1, 2).reshape(q.shape)
        rows = self.rows
        assert rows is not None

        def pad(x: torch.Tensor) -> torch.Tensor:
            out = x.new_zeros(r * n, *x.shape[1:])
            out.index_copy_(0, rows, x)
            return out.view(r, n, *x.shape[1:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=self.mask)
        return o.transpose(1, 2).reshape(r * n, *q.shape[1:]).index_select(0, rows)


class BertModel(nn.Module):
    """``embed(input_ids [T], query_start_loc [R + 1], pooling, normalize) -> [R, H]``;
    ``forward`` returns the last hidden states ``[T, H]``."""

    position_offset = 0  # XLM-RoBERTa: padding_idx + 1
    is_encoder = True

    def __init__(self, hf_config: Any, backend: Any = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        """``backend`` (the paged attention backend the loader passes) is unused: the
        encoder's attention is bidirectional SDPA over each sequence."""
        super().__init__()
        c = hf_config
        self.config = c
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.emb_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        pre = f"{prefix}." if prefix else ""
        self.layers = nn.ModuleList(BertLayer(c, quant_config, f"{pre}encoder.layer.{i}")
                                    for i in range(c.num_hidden_layers))

    def positions(self, query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
        starts = query_start_loc[:-1].long()
        lens = query_start_loc[1:].long() - starts
        first = torch.repeat_interleave(starts, lens)
        return torch.arange(num_tokens, device=first.device) - first + self.position_offset

    def forward(self, input_ids: torch.Tensor, query_start_loc: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        pos = self.positions(query_start_loc, input_ids.shape[0])
        # One segment type (XLM-R): its tokenizer's pair ids, if any, are all type 0.
        one_type = self.token_type_embeddings.num_embeddings == 1
        types = self.token_type_embeddings.weight[0] if token_type_ids is None or one_type \
            else self.token_type_embeddings(token_type_ids)
        x = self.word_embeddings(input_ids) + types
        x = self.emb_norm(x + self.position_embeddings(pos))
        layout = _Layout(query_start_loc, input_ids.shape[0])
        for layer in self.layers:
            x = layer(x, layout)
        return x

    def embed(self, input_ids: torch.Tensor, query_start_loc: torch.Tensor,
              pooling: PoolingType = "mean", normalize: bool = True) -> torch.Tensor:
        return pool(self(input_ids, query_start_loc), query_start_loc, pooling, normalize)

    _RENAMES = (
        ("embeddings.word_embeddings.", "word_embeddings."),
        ("embeddings.position_embeddings.", "position_embeddings."),
        ("embeddings.token_type_embeddings.", "token_type_embeddings."),
        ("embeddings.LayerNorm.", "emb_norm."),
        ("encoder.layer.", "layers."),
        (".attention.output.dense.", ".attn_out."),
        (".attention.output.LayerNorm.", ".attn_norm."),
        (".intermediate.dense.", ".up."),
        (".output.dense.", ".down."),
        (".output.LayerNorm.", ".out_norm."),
    )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names (optionally under ``bert.``/``roberta.``); the pooler head and
        position-id buffers are skipped.  ``ValueError`` naming a tensor on an unknown
        name or shape, or listing parameters the checkpoint did not provide."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("bert.").removeprefix("roberta.")
            if name.startswith(("pooler.", "cls.", "lm_head.", "classifier.")) \
                    or name.endswith("position_ids"):
                continue
            shard: tuple[str, ...] = ()
            for part, sid in (("query", "q"), ("key", "k"), ("value", "v")):
                if f".attention.self.{part}." in name:
                    name, shard = name.replace(f".attention.self.{part}.", ".qkv."), (sid,)
            for old, new in self._RENAMES:
                name = name.replace(old, new)
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                                 f"{type(self).__name__}")
            load_weight(param, tensor, *shard)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} parameter(s): "
                             f"{', '.join(missing[:5])}")


class XLMRobertaModel(BertModel):
    def __init__(self, hf_config: Any, backend: Any = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(hf_config, backend, quant_config, prefix)
        self.position_offset = int(hf_config.pad_token_id) + 1
