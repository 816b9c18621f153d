"""Cross-encoders: ``BertForSequenceClassification`` and
``XLMRobertaForSequenceClassification`` (rerankers such as ms-marco MiniLM, BGE-reranker).

```
 ids (+ segment ids) -> encoder (models/bert.py) -> hidden [T, H]
   BERT:        hidden[CLS] -> tanh(pooler.dense) -> classifier           -> logits [R, L]
   XLM-RoBERTa: hidden[CLS] -> tanh(classifier.dense) -> classifier.out_proj -> logits [R, L]
```

``classify(hidden, query_start_loc)`` is the pooling runner's hook for the ``classify``
and ``score`` tasks (``worker/pooling_runner.py``); the activation (sigmoid for one
label, softmax for more) is the runner's, per request.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.layers.linear import default_weight_loader
from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.models.bert import BertModel, XLMRobertaModel


class _CrossEncoder(nn.Module):
    """An encoder plus a two-layer head on the first (CLS) token."""

    is_encoder = True
    encoder_cls: type[BertModel] = BertModel
    # HF names of the head's two linear layers (after the encoder prefix is removed).
    head_names: tuple[str, str] = ("", "")

    def __init__(self, hf_config: Any, backend: Any = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        h = hf_config.hidden_size
        self.config = hf_config
        self.encoder = self.encoder_cls(hf_config, backend, quant_config)
        self.dense = nn.Linear(h, h)
        self.out_proj = nn.Linear(h, int(hf_config.num_labels))

    @property
    def num_labels(self) -> int:
        return self.out_proj.out_features

    def forward(self, input_ids: torch.Tensor, query_start_loc: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.encoder(input_ids, query_start_loc, token_type_ids)

    def classify(self, hidden: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        """Raw logits ``[R, num_labels]`` (float32) from each sequence's first token."""
        cls = hidden.index_select(0, query_start_loc[:-1].long())
        return self.out_proj(torch.tanh(self.dense(cls))).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The head's tensors here, the rest to the encoder (which names what is
        unknown or missing); ``ValueError`` when the head is incomplete."""
        dense, out = self.head_names
        own = {f"{dense}.weight": self.dense.weight, f"{dense}.bias": self.dense.bias,
               f"{out}.weight": self.out_proj.weight, f"{out}.bias": self.out_proj.bias}
        seen: set[str] = set()

        def rest() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name in own:
                    with torch.no_grad():
                        default_weight_loader(own[name], tensor)
                    seen.add(name)
                else:
                    yield name, tensor

        self.encoder.load_weights(rest())
        missing = sorted(set(own) - seen)
        if missing:
            raise ValueError(f"checkpoint is missing the classification head: "
                             f"{', '.join(missing)}")


class BertForSequenceClassification(_CrossEncoder):
    head_names = ("bert.pooler.dense", "classifier")


class XLMRobertaForSequenceClassification(_CrossEncoder):
    encoder_cls = XLMRobertaModel
    head_names = ("classifier.dense", "classifier.out_proj")
