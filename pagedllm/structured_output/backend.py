"""The grammar backend (xgrammar): validate a constraint, compile it, match tokens.

Two halves, used by different processes:

* :func:`validate` (frontend): parses the constraint into an ``xgrammar.Grammar``
  (cheap, tokenizer-free) so a bad schema, regex or grammar is a ``ValueError`` naming
  the field before the request reaches the core;
* :class:`GrammarCompiler` (engine core): compiles against the tokenizer's vocabulary
  on a worker thread (never on the engine loop) and keeps each compiled grammar in a
  bounded LRU keyed by :meth:`StructuredOutputsParams.key`, so a repeated schema is
  compiled once.

xgrammar's messages start with a C++ source location (``[time] /project/cpp/x.cc:94:``);
:func:`clean_error` strips it so no path reaches a client.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import xgrammar as xgr

from pagedllm.structured_output.limits import check_limits
from pagedllm.structured_outputs_params import StructuredOutputsParams

_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
# Most spaces or tabs a JSON grammar allows at one position, after at most one line
# break (room for indentation; vLLM leaves whitespace unbounded).  The bound costs
# xgrammar 25-45 us a row per mask where whitespace may come next, against ~2 us
# unbounded (docs/benchmarks.md).
MAX_WHITESPACE = 16


def clean_error(e: BaseException) -> str:
    """xgrammar's message, first meaningful line, without its C++ source location."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    msg = _LOCATION.sub("", lines[0]) if lines else type(e).__name__
    return msg.replace("Check failed: (error.empty()) is false: ", "")


def _choice_ebnf(choices: list[str]) -> str:
    # JSON string escapes (\" \\ \n \uXXXX) are valid in xgrammar's EBNF literals.
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _schema_text(schema: str | dict[str, Any]) -> str:
    if isinstance(schema, dict):
        return json.dumps(schema)
    try:
        json.loads(schema)
    except json.JSONDecodeError as e:
        raise ValueError(f"structured_outputs.json is not valid JSON: {e.msg}") from None
    return schema


# xgrammar's optional-whitespace runs in a JSON grammar (``whitespace_7{0, 16}``), and
# what each becomes: spaces, or one line break and an indentation -- never a second
# blank line.  A small model given free whitespace spends its tokens on it (SmolLM2:
# 72 newlines in 100 tokens, issue 46 item 17; docs/server.md has the measurement).
_WS_RUN = re.compile(r"\bwhitespace(?:_\d+)?\{0, ?\d+\}")
_WS_RULE = (f'\nws_pos ::= ([ \\t]{{0,{MAX_WHITESPACE}}}) | '
            f'([ \\t]{{0,2}} "\\r"? "\\n" [ \\t]{{0,{MAX_WHITESPACE}}})\n')


def _json_grammar(schema: str, p: StructuredOutputsParams, strict: bool) -> xgr.Grammar:
    """``schema`` as a grammar; with optional whitespace at most one line break (plus
    indentation) per position, without any when ``disable_any_whitespace``."""
    if p.disable_any_whitespace:
        return xgr.Grammar.from_json_schema(schema, any_whitespace=False,
                                            strict_mode=strict)
    g = xgr.Grammar.from_json_schema(schema, any_whitespace=True, strict_mode=strict,
                                     max_whitespace_cnt=MAX_WHITESPACE)
    return xgr.Grammar.from_ebnf(_WS_RUN.sub("ws_pos", str(g)) + _WS_RULE)


def _grammar(p: StructuredOutputsParams) -> xgr.Grammar:
    kind = p.kind
    if kind == "json":
        assert p.json is not None
        return _json_grammar(_schema_text(p.json), p, strict=True)
    if kind == "json_object":  # any object (not strict: any properties, any values)
        return _json_grammar('{"type": "object"}', p, strict=False)
    if kind == "regex":
        assert p.regex is not None
        return xgr.Grammar.from_regex(p.regex)
    if kind == "choice":
        assert p.choice is not None
        return xgr.Grammar.from_ebnf(_choice_ebnf(p.choice))
    assert p.grammar is not None
    return xgr.Grammar.from_ebnf(p.grammar)


def validate(p: StructuredOutputsParams, field: str = "structured_outputs") -> None:
    """``ValueError`` whose message starts with ``field`` when ``p`` does not parse, does
    not compile, is over a size bound (``limits.check_limits``: checked first, before
    any parsing) or provably matches no string (:func:`matches_nothing`)."""
    check_limits(p, field)
    try:
        grammar = _grammar(p)
        empty = p.kind in _SEARCHED_KINDS and matches_nothing(grammar)
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from None
    except Exception as e:  # xgrammar raises RuntimeError for every parse failure
        raise ValueError(f"{field}: invalid {p.kind}: {clean_error(e)}") from None
    if empty:
        raise ValueError(f"{field}: the {p.kind} matches no string (its language is "
                         "empty), so no output could satisfy it")


# --------------------------------------------------------------- empty-language check
#
# A regex such as ``[^\s\S]`` or ``a(?:[^\s\S])`` parses and compiles, but no output
# can ever satisfy it; in the core the row would only be allowed its stop tokens and end
# at once with an empty text.  The check compiles the grammar against a 257-token
# *byte* vocabulary (every byte, plus a stop token: tokenizer-independent and about a
# millisecond to compile) and searches the byte automaton depth first for an accepting
# path.  The search is bounded: it proves emptiness only when it exhausts every path
# within the budget (all branches dead); a budget or depth run-out means "not proven"
# and the request goes ahead.  JSON schemas and choices are not searched (xgrammar
# rejects the contradictory schemas it can detect while parsing; a choice is never
# empty).  Emptiness *under a particular tokenizer* (a language whose strings no token
# sequence spells) is not decided up front; the core's matcher then allows only the stop
# tokens, so such a request ends with an empty text rather than garbage.

_SEARCHED_KINDS = ("regex", "grammar")
_BYTE_STOP = 256
SEARCH_BUDGET = 512  # matcher steps (accept + mask) before giving up
SEARCH_DEPTH = 64
_byte_compiler: xgr.GrammarCompiler | None = None
_byte_lock = threading.Lock()


def _byte_grammar_compiler() -> xgr.GrammarCompiler:
    global _byte_compiler
    with _byte_lock:
        if _byte_compiler is None:
            info = xgr.TokenizerInfo([bytes([i]) for i in range(256)] + [b"</s>"],
                                     vocab_type=xgr.VocabType.RAW,
                                     stop_token_ids=[_BYTE_STOP])
            _byte_compiler = xgr.GrammarCompiler(info, max_threads=1,
                                                 cache_enabled=False)
        return _byte_compiler


def matches_nothing(grammar: xgr.Grammar, budget: int = SEARCH_BUDGET,
                    depth: int = SEARCH_DEPTH) -> bool:
    """True only when ``grammar`` provably accepts no byte string (see above)."""
    compiled = _byte_grammar_compiler().compile_grammar(grammar)
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, 257)
    steps = 0
    exhausted = True  # every explored branch ended dead (no truncation)

    def allowed() -> np.ndarray:
        nonlocal steps
        steps += 1
        matcher.fill_next_token_bitmask(mask)
        words = mask[0].numpy().view(np.uint32)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:257]
        return np.flatnonzero(bits)

    def accepts(level: int) -> bool:
        nonlocal exhausted
        tokens = allowed()
        if _BYTE_STOP in tokens:
            return True
        for t in tokens:
            if steps >= budget or level >= depth:
                exhausted = False
                return False
            if not matcher.accept_token(int(t)):
                continue
            found = accepts(level + 1)
            matcher.rollback(1)
            if found:
                return True
        return False

    return not accepts(0) and exhausted


def tokenizer_size(tok: Any) -> int:
    """One past the tokenizer's largest token id.

    The grammars are compiled for this vocabulary, not the model's when the model pads
    its embedding beyond it: xgrammar would register every padding id as a special
    token, and its ``accept_token`` scans that list on every call (~14 us per token for
    the 79,104 padding ids of a 49k tokenizer on a 128k model, against ~1 us).  The
    runner's bitmask keeps the padding ids' bits at zero."""
    return max(tok.get_vocab().values()) + 1


def tokenizer_info(tok: Any, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's view of ``tok``'s vocabulary (at most ``vocab_size`` ids: the model's;
    see :func:`tokenizer_size`)."""
    return xgr.TokenizerInfo.from_huggingface(
        tok, vocab_size=min(vocab_size, tokenizer_size(tok)))


# The compiled-grammar cache's default bound.  Grammars are sized by xgrammar
# (``memory_size_bytes``): a small JSON schema takes ~0.1 MB on a 49k vocabulary, a
# 20,000-value enum 62 MB.
MAX_CACHE_BYTES = 512 * 2**20


class GrammarCompiler:
    """Compiles constraints for one tokenizer, off the caller's thread, with an LRU
    bounded by bytes (``max_cache_bytes`` of compiled grammars, by xgrammar's own
    ``memory_size_bytes``; a grammar larger than the whole bound is used, not kept).

    ``submit`` returns a future of the ``xgrammar.CompiledGrammar``; the first call
    builds the ``TokenizerInfo`` (``load_tokenizer`` is called then, on the worker
    thread).  A future cancelled before its compile starts never runs (``GrammarGate``
    cancels those of aborted requests).  Thread-safe.
    """

    def __init__(self, load_tokenizer: Any, vocab_size: int,
                 max_cache_bytes: int = MAX_CACHE_BYTES, max_workers: int = 1) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}
        self.max_cache_bytes = max_cache_bytes
        self.cache_bytes = 0
        self._pool = ThreadPoolExecutor(max_workers=max_workers,
                                        thread_name_prefix="grammar-compile")

    def _xgr_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = tokenizer_info(self._load_tokenizer(), self.vocab_size)
                # xgrammar's own cache off: ours is bounded and keyed the same way.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1,
                                                     cache_enabled=False)
            return self._compiler

    def compile(self, p: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Compile now (the calling thread), or return the cached result."""
        key = p.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._xgr_compiler().compile_grammar(_grammar(p))
        self._put(key, compiled)
        return compiled

    def _put(self, key: tuple[str, str], compiled: xgr.CompiledGrammar) -> None:
        size = int(compiled.memory_size_bytes)
        with self._lock:
            if size > self.max_cache_bytes or key in self._cache:
                return
            self._cache[key] = compiled
            self._sizes[key] = size
            self.cache_bytes += size
            while self.cache_bytes > self.max_cache_bytes:
                old, _ = self._cache.popitem(last=False)
                self.cache_bytes -= self._sizes.pop(old)

    def __len__(self) -> int:
        return len(self._cache)

    def submit(self, p: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        return self._pool.submit(self.compile, p)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
