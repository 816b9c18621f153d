"""Which runner serves a model, and how it pools (vLLM's ``--runner`` / ``--convert`` /
``--pooler-config``).

```
 runner auto  ─► the architecture's tasks: pooling only (BertModel, *ForSequence-
                 Classification) -> "pooling"; a decoder -> "generate"
 runner pooling on a decoder ─► convert "embed": last-token pooling, normalised
                 (Qwen3-Embedding, e5-mistral); convert "classify" is not supported
 runner generate on a pooling-only model ─► ValueError naming runner
```

Pooling type, in order: ``pooler_config={"pooling_type": ...}``; the checkpoint's
sentence-transformers ``modules.json`` + ``1_Pooling/config.json`` (CLS / mean /
last-token; a ``Normalize`` module); the architecture's default (CLS for BERT-style
encoders, as vLLM; last token for decoders).
"""

from __future__ import annotations

import json
import os
from typing import Any

from pagedllm.model_files.safe_open import open_regular
from pagedllm.models.registry import ARCHITECTURES, get_architecture
from pagedllm.pooling_params import PoolerConfig

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
POOLING_TYPES = ("cls", "mean", "last")


def resolve_runner(hf_config: Any, directory: str | None, runner: str = "auto",
                   convert: str = "auto", pooler_config: dict[str, Any] | None = None,
                   ) -> tuple[str, str, PoolerConfig | None]:
    """``(runner, convert, pooler config or None)``; ``ValueError`` naming the argument."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)}, got {convert!r}")
    arch = get_architecture(hf_config)
    info = ARCHITECTURES[arch]
    if runner == "auto":
        runner = "pooling" if info.is_pooling_only or convert in ("embed", "classify") \
            else "generate"
    if runner == "generate":
        if info.is_pooling_only:
            raise ValueError(f"runner: {arch} is a pooling model (tasks: "
                             f"{', '.join(info.tasks)}); it cannot generate -- use runner "
                             "'pooling' (the default for it)")
        if convert not in ("auto", "none"):
            raise ValueError(f"convert {convert!r} needs runner 'pooling'")
        if pooler_config:
            raise ValueError("pooler_config applies to runner 'pooling' only")
        return "generate", "none", None
    if info.is_pooling_only:
        if convert not in ("auto", "none"):
            raise ValueError(f"convert: {arch} is a pooling model already; leave convert "
                             "unset")
        tasks, convert, default = info.tasks, "none", "cls"
    else:
        if convert == "classify":
            raise ValueError(f"convert: 'classify' is not supported for {arch}; decoders "
                             "pool with convert 'embed'")
        tasks, convert, default = ("embed", "encode"), "embed", "last"
    if "embed" in tasks and "encode" not in tasks:
        tasks = (*tasks, "encode")
    overrides = dict(pooler_config or {})
    unknown = sorted(set(overrides) - {"pooling_type", "normalize"})
    if unknown:
        raise ValueError(f"pooler_config: unknown key(s) {', '.join(unknown)}; known: "
                         "pooling_type, normalize")
    st_type, st_norm = _sentence_transformers_pooling(
        directory, read_mode="pooling_type" not in overrides)
    ptype = str(overrides.get("pooling_type") or st_type or default).lower()
    if ptype not in POOLING_TYPES:
        raise ValueError(f"pooler_config: pooling_type must be one of CLS, MEAN, LAST, got "
                         f"{overrides.get('pooling_type')!r}")
    normalize = overrides.get("normalize", True if st_norm is None else st_norm)
    if not isinstance(normalize, bool):
        raise ValueError(f"pooler_config: normalize must be a boolean, got {normalize!r}")
    return "pooling", convert, PoolerConfig(ptype, normalize, tuple(tasks))


def _sentence_transformers_pooling(directory: str | None, read_mode: bool = True,
                                   ) -> tuple[str | None, bool | None]:
    """The pooling mode (unless ``read_mode`` is off: overridden) and normalisation a
    sentence-transformers checkpoint declares; ``(None, None)`` without ``modules.json``."""
    if not directory:
        return None, None
    try:
        with open(os.path.join(directory, "modules.json")) as f:
            modules = json.load(f)
    except (OSError, ValueError):
        return None, None
    ptype, normalize = None, False
    for m in modules if isinstance(modules, list) else []:
        kind = str(m.get("type", ""))
        if kind.endswith("Normalize"):
            normalize = True
        elif kind.endswith("Pooling") and read_mode:
            try:
                with open_regular(os.path.join(directory, m.get("path", ""), "config.json"),
                                  max_bytes=1 << 20, encoding="utf-8") as f:
                    cfg = json.load(f)
            except (OSError, ValueError):
                continue
            ptype = _st_mode(cfg)
    return ptype, normalize


_ST_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
_ST_LEGACY = (("pooling_mode_cls_token", "cls"), ("pooling_mode_mean_tokens", "mean"),
              ("pooling_mode_lasttoken", "lasttoken"), ("pooling_mode_max_tokens", "max"),
              ("pooling_mode_weightedmean_tokens", "weightedmean"),
              ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len_tokens"))


def _st_mode(cfg: dict[str, Any]) -> str | None:
    """Our pooling type for a ``1_Pooling/config.json``: sentence-transformers 6's
    ``pooling_mode`` or the older ``pooling_mode_*_tokens`` flags; ``ValueError`` naming
    ``pooler_config`` for a mode we do not pool by (max, weighted mean, ...)."""
    mode = cfg.get("pooling_mode")
    if mode is None:
        modes = [name for key, name in _ST_LEGACY if cfg.get(key)]
        mode = modes[0] if len(modes) == 1 else tuple(modes) or None
    if mode is None:
        return None
    if isinstance(mode, list):
        mode = mode[0] if len(mode) == 1 else tuple(mode)
    if not isinstance(mode, str) or mode not in _ST_MODES:
        raise ValueError(f"pooler_config: the checkpoint's sentence-transformers pooling "
                         f"mode {mode!r} is not supported (cls, mean, lasttoken are); pass "
                         "pooler_config to pool differently")
    return _ST_MODES[mode]
