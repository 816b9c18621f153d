"""A model's transformers config, cached on disk so that a process can have it without
importing transformers.

Why: transformers imports lazily, and building a model's config class pulls in most of
the library (``configuration_llama`` -> activations -> kernels hub -> model loading ->
``torch.distributed.tensor``...).  That is 2-3 s on a small CPU and was 8.8-14.8 s of an
8B start-up on the H200 machine (docs/findings.md, "Start-up"), in the engine-core
process and again in every tensor-parallel rank that unpickles the config -- processes
that use nothing else of transformers.  The API server's own process imports it anyway
(tokenizer, chat template) and builds the same config in parallel.

How: whenever a config is built through transformers, a snapshot of it is written to
``$PAGEDLLM_CACHE_DIR/hf_configs/<key>.json``: every instance attribute, the value of
every public property and ``attribute_map`` alias, sub-configs (``text_config``,
``vision_config``) as nested snapshots.  The key hashes what the config was built from
(config.json's bytes and directory, or a GGUF's path, size and mtime), the transformers version and
this module's format version.  A process without transformers loaded reads the snapshot
back as a :class:`ConfigView`: the same attribute values, class attributes such as
``model_type`` included (tested attribute by attribute
against transformers for every architecture the tests build), ``to_dict()`` and
``get_text_config()``; nothing else of ``PretrainedConfig``, which the engine never calls.
A property whose value cannot be stored (transformers' ``per_layer_config`` view) raises
``NotImplementedError`` on the view, loudly, rather than an ``AttributeError`` that a
``getattr(config, name, default)`` would turn into a silent default.

What is never cached: configs that need ``trust_remote_code`` (their class is the
checkpoint's code), and configs with a public attribute or property value this module
cannot store faithfully (it then writes nothing, and every start builds the config
through transformers as before).  A cache that cannot be written (read-only home) costs
nothing but the saving.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import sys
import tempfile
import warnings
from typing import Any

import pagedllm.envs as envs

logger = logging.getLogger("pagedllm")

# Bump when the snapshot's format or what is stored in it changes.
FORMAT_VERSION = 1


class Unstorable(ValueError):
    """A value the snapshot cannot round-trip exactly."""


def cache_root() -> str:
    """``$PAGEDLLM_CACHE_DIR/hf_configs`` (default ``~/.cache/pagedllm/hf_configs``)."""
    return os.path.join(envs.cache_dir(), "hf_configs")


def transformers_loaded() -> bool:
    """Whether this process has imported transformers (then building the real config is
    cheap and the view is not needed)."""
    return "transformers" in sys.modules


def key_for_bytes(kind: str, data: bytes) -> str | None:
    """The cache key of a config built from ``data`` (``kind``: how it was built), or
    None when the installed transformers' version cannot be read."""
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None
    h = hashlib.sha256(f"{FORMAT_VERSION}|{version}|{kind}|".encode())
    h.update(data)
    return h.hexdigest()[:40]


def key_for_file(kind: str, path: str) -> str | None:
    """The key of a config built from the (large) file ``path``: its absolute path, size
    and mtime stand for its bytes, as for the converted-tokenizer cache."""
    st = os.stat(path)
    return key_for_bytes(kind, f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}"
                         .encode())


# --------------------------------------------------------------------------- encoding

def _encode(value: Any) -> Any:
    """A JSON value that ``_decode`` turns back into ``value`` (``Unstorable`` if none)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return {"__float__": repr(value)}
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value) or set(value) & _MARKERS:
            # e.g. id2label's int keys: the items, keys and all
            return {"__items__": [[_encode(k), _encode(v)] for k, v in value.items()]}
        return {k: _encode(v) for k, v in value.items()}
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    raise Unstorable(f"a {type(value).__name__}")


_MARKERS = {"__tuple__", "__float__", "__dtype__", "__items__"}


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if "__items__" in value:
            return {_decode(k): _decode(v) for k, v in value["__items__"]}
        if "__tuple__" in value:
            return tuple(_decode(v) for v in value["__tuple__"])
        if "__float__" in value:
            return float(value["__float__"])
        if "__dtype__" in value:
            import torch

            return getattr(torch, value["__dtype__"])
        return {k: _decode(v) for k, v in value.items()}
    return value


def snapshot(config: Any) -> dict[str, Any]:
    """What :class:`ConfigView` needs to stand for the transformers ``config``.
    ``Unstorable`` when a public value cannot be stored exactly."""
    from transformers import PretrainedConfig

    attrs: dict[str, Any] = {}
    subs: dict[str, Any] = {}
    for name, value in vars(config).items():
        if isinstance(value, PretrainedConfig):
            subs[name] = snapshot(value)
            continue
        try:
            attrs[name] = _encode(value)
        except Unstorable:
            if not name.startswith("_"):
                raise
    props: dict[str, Any] = {}
    missing: list[str] = []
    cls = type(config)
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # reading deprecated aliases (torch_dtype) warns
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in dir(cls):
                if name.startswith("_") or name in attrs or name in subs:
                    continue
                static = inspect.getattr_static(cls, name, None)
                # Properties, and plain class attributes (model_type, base_model_tp_plan);
                # not methods.
                if not isinstance(static, property) and (
                        callable(static) or isinstance(static, (classmethod, staticmethod))):
                    continue
                try:
                    value = getattr(config, name)
                except Exception:  # a property that raises: so does the view's (missing)
                    continue
                if isinstance(value, PretrainedConfig):
                    subs[name] = snapshot(value)
                    continue
                try:
                    props[name] = _encode(value)
                except Unstorable:  # e.g. a view object of transformers' own
                    missing.append(name)
    finally:
        quiet.setLevel(level)
    aliases = {str(k): str(v) for k, v in getattr(config, "attribute_map", {}).items()}
    return {"class": cls.__name__, "attrs": attrs, "props": props, "subs": subs,
            "aliases": aliases, "missing": missing}


class ConfigView:
    """A cached transformers config: attribute reads and writes as on the original
    (``attribute_map`` aliases included), ``to_dict()`` and ``get_text_config()``.
    ``config_class`` names the transformers class it stands for."""

    def __init__(self, snap: dict[str, Any]) -> None:
        object.__setattr__(self, "config_class", snap["class"])
        object.__setattr__(self, "_aliases", dict(snap.get("aliases", {})))
        object.__setattr__(self, "_props", {k: _decode(v)
                                            for k, v in snap.get("props", {}).items()})
        object.__setattr__(self, "_missing", frozenset(snap.get("missing", ())))
        for name, value in snap["attrs"].items():
            object.__setattr__(self, name, _decode(value))
        for name, sub in snap.get("subs", {}).items():
            object.__setattr__(self, name, ConfigView(sub))

    def __getattr__(self, name: str) -> Any:  # only for names not set on the instance
        aliases = object.__getattribute__(self, "_aliases")
        if name in aliases:
            return getattr(self, aliases[name])
        props = object.__getattribute__(self, "_props")
        if name in props:
            return props[name]
        if name in object.__getattribute__(self, "_missing"):
            # Loud, not an AttributeError that getattr(config, name, default) would hide.
            raise NotImplementedError(
                f"{object.__getattribute__(self, 'config_class')}.{name} is not kept in "
                f"the cached model config (model_files/config_cache.py)")
        raise AttributeError(f"'{object.__getattribute__(self, 'config_class')}' "
                             f"(cached) has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, self._aliases.get(name, name), value)

    def __getstate__(self) -> dict[str, Any]:
        return dict(vars(self))

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in vars(self).items():
            if name in _VIEW_FIELDS:
                continue
            out[name] = value.to_dict() if isinstance(value, ConfigView) else value
        return out

    def get_text_config(self, decoder: bool | None = None,
                        encoder: bool | None = None) -> Any:
        """The decoder's config: ``text_config`` when there is one, else this one."""
        text = vars(self).get("text_config")
        return text if isinstance(text, ConfigView) else self

    def __repr__(self) -> str:
        return f"ConfigView({self.config_class}, {len(vars(self)) - len(_VIEW_FIELDS)} " \
            "attributes)"


# The view's own bookkeeping, not the config's attributes.
_VIEW_FIELDS = ("config_class", "_aliases", "_props", "_missing")


def has(key: str) -> bool:
    """Whether an entry for ``key`` exists (readable or not)."""
    return os.path.isfile(os.path.join(cache_root(), key + ".json"))


def load(key: str | None) -> ConfigView | None:
    """The cached view for ``key``, or None (no entry, or one that cannot be read)."""
    if key is None:
        return None
    path = os.path.join(cache_root(), key + ".json")
    try:
        with open(path, encoding="utf-8") as f:
            return ConfigView(json.load(f))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        logger.warning("ignoring the unreadable cached model config %s: %s", path, e)
        return None


def save(key: str | None, config: Any) -> None:
    """Store ``config``'s snapshot under ``key`` (written to a temporary sibling and
    renamed into place, so a concurrent reader never sees half of it).  Never raises:
    an unstorable config or an unwritable cache only costs the saving."""
    if key is None:
        return
    try:
        data = json.dumps(snapshot(config))
    except (Unstorable, TypeError, ValueError) as e:
        logger.debug("model config not cached (%s)", e)
        return
    root = cache_root()
    try:
        os.makedirs(root, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(data)
        os.replace(tmp, os.path.join(root, key + ".json"))
    except OSError as e:
        logger.debug("model config cache not writable (%s)", e)
