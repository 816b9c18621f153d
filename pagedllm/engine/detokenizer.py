"""Incremental detokenisation and stop strings, one :class:`IncrementalDetokenizer` per sequence.

Decoding token by token is not ``decode(ids[-1])``: a byte-level BPE token may hold half of
a UTF-8 character, and SentencePiece decoders drop or add a leading space depending on what
comes before.  We use vLLM's two-offset scheme over a short window of token *strings*::

    window:  ... | prefix_offset ........ read_offset ........ end |
                   \\__ already emitted __/ \\__ not yet emitted __/

    prefix_text = to_string(window[prefix_offset:read_offset])   # context only
    new_text    = to_string(window[prefix_offset:])
    delta       = new_text[len(prefix_text):]

The few context tokens make the decoder treat spaces as it would mid-sequence.  If
``new_text`` ends in U+FFFD the last character is still incomplete: emit nothing and wait
for more tokens.  After an emission the window is trimmed to start at the new
``prefix_offset``, so each step decodes a handful of tokens whatever the sequence length.

Stop strings are searched only in the newly decoded text plus ``len(stop) - 1`` characters
before it; the earliest match wins (ties: the one listed first) and the output is cut at
its start (or its end with ``include_stop_str_in_output``).  While streaming,
:meth:`get_next_output_text` holds back ``max(len(stop)) - 1`` characters, so a stop string
that is still forming is never sent to the client.
"""

from __future__ import annotations

from typing import Any

from pagedllm.sampling_params import SamplingParams

# Prompt tokens decoded as context before the first output token (vLLM's value).
INITIAL_DETOKENIZATION_OFFSET = 5
# A UTF-8 character needs at most 4 byte tokens, so a tail that is still "incomplete" after
# this many tokens is invalid bytes from the model, not a character being formed: emit it
# (as U+FFFD) rather than let the window, and the per-step cost, grow without bound.
MAX_PENDING_TOKENS = 8
_REPLACEMENT = "\ufffd"


class _TextBuffer:
    """Append-mostly text: appends and reads of a short suffix cost O(suffix), not O(text).

    Pieces are joined lazily (and the join is kept) only when the whole text is asked for.
    """

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, s: str) -> None:
        if s:
            self._pieces.append(s)
            self._len += len(s)

    def suffix(self, start: int) -> str:
        """``text[start:]`` (``0 <= start <= len``), walking pieces back from the end."""
        need = self._len - start
        if need <= 0:
            return ""
        parts: list[str] = []
        got = 0
        for piece in reversed(self._pieces):
            parts.append(piece)
            got += len(piece)
            if got >= need:
                break
        return "".join(reversed(parts))[got - need:]

    def truncate(self, length: int) -> None:
        """Drop everything after the first ``length`` characters."""
        while self._pieces and self._len - len(self._pieces[-1]) >= length:
            self._len -= len(self._pieces.pop())
        if self._len > length:
            keep = len(self._pieces[-1]) - (self._len - length)
            self._pieces[-1] = self._pieces[-1][:keep]
            self._len = length

    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""


def _special_ids(tokenizer: Any) -> frozenset[int]:
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(i for i, t in decoder.items() if getattr(t, "special", False))
    return frozenset(ids)


class _TokenDecoder:
    """Token id -> token string -> text, honouring the special-token options.

    Fast (Rust) tokenizers decode added tokens themselves and ignore
    ``spaces_between_special_tokens``, as ``tokenizer.decode`` does; for slow tokenizers
    with added tokens we reproduce ``decode``'s "added tokens are decoded on their own and
    optionally joined with spaces" rule (vLLM's approach).
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool,
                 spaces_between_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        # Looked up once (transformers recomputes these on every call).  The union matters:
        # ``decode(skip_special_tokens=True)`` skips every added token flagged special,
        # which can be more than ``all_special_ids`` (SmolLM2: 17 vs 3).
        self.special_ids = _special_ids(tokenizer) if skip_special_tokens else frozenset()
        self.spaces_between = spaces_between_special_tokens
        added = {} if getattr(tokenizer, "is_fast", True) else tokenizer.get_added_vocab()
        self.added_tokens = frozenset(added)

    def token(self, token_id: int) -> str | None:
        """The token string; None for a skipped special token or an out-of-vocab id."""
        if token_id in self.special_ids or not 0 <= token_id < self.vocab_size:
            return None
        return self.tokenizer.convert_ids_to_tokens(token_id)

    def to_string(self, tokens: list[str]) -> str:
        if not self.added_tokens:
            return self.tokenizer.convert_tokens_to_string(tokens) if tokens else ""
        sub_texts: list[str] = []
        run: list[str] = []
        for t in tokens:
            if t in self.added_tokens:
                if run:
                    sub_texts.append(self.tokenizer.convert_tokens_to_string(run))
                    run = []
                sub_texts.append(t)
            else:
                run.append(t)
        if run:
            sub_texts.append(self.tokenizer.convert_tokens_to_string(run))
        return (" " if self.spaces_between else "").join(sub_texts)


class IncrementalDetokenizer:
    """Text and stop-string state for one output sequence.

    Contract for the engine's output processor, per step::

        stop = detok.update(new_token_ids, stop_terminated=<last id is EOS/stop id>)
        if stop is not None: finish the request with stop_reason=stop
        chunk = detok.get_next_output_text(finished, delta=<streaming>)

    After a stop string matched, further ``update`` calls are ignored (tokens already in
    flight when the request was stopped).  With ``params.detokenize`` False (or no
    tokenizer) no text is produced and stop strings are not checked.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self.params = params
        self.stop: list[str] = list(params.stop or [])  # type: ignore[arg-type]
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        # Only text that might be cut away again needs holding back from a stream.
        self.stop_buffer_length = (self._max_stop_len - 1
                                   if self.stop and not self.include_stop else 0)
        self.matched_stop: str | None = None
        self.num_output_tokens = 0
        self._text = _TextBuffer()
        self._sent = 0  # characters already returned by delta get_next_output_text
        self._decoder = (_TokenDecoder(tokenizer, params.skip_special_tokens,
                                       params.spaces_between_special_tokens)
                         if tokenizer is not None and params.detokenize else None)
        self._tokens: list[str] = []
        self._prefix_offset = self._read_offset = 0
        if self._decoder is not None:
            self._init_window(prompt_token_ids)

    # --- decoding ---------------------------------------------------------------------

    def _init_window(self, prompt_token_ids: list[int]) -> None:
        """Seed the window with the prompt's last few tokens (context, never emitted)."""
        assert self._decoder is not None
        # Two extra in case some of them are skipped special tokens.
        tail = prompt_token_ids[-INITIAL_DETOKENIZATION_OFFSET - 2:]
        self._tokens = [t for t in map(self._decoder.token, tail) if t is not None]
        self._read_offset = len(self._tokens)
        self._prefix_offset = max(self._read_offset - INITIAL_DETOKENIZATION_OFFSET, 0)

    def _decode_next(self, token_id: int, force: bool = False) -> str:
        """Text that ``token_id`` completes (often "", e.g. mid-character)."""
        assert self._decoder is not None
        tok = self._decoder.token(token_id) if token_id >= 0 else None
        if tok is not None:
            self._tokens.append(tok)
        return self._emit(force)

    def _emit(self, force: bool) -> str:
        assert self._decoder is not None
        tokens, p, r = self._tokens, self._prefix_offset, self._read_offset
        if r == len(tokens):
            return ""  # nothing new (e.g. a skipped special token)
        prefix_text = self._decoder.to_string(tokens[p:r])
        new_text = self._decoder.to_string(tokens[p:])
        waiting = len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT)
        if waiting and not force and len(tokens) - r <= MAX_PENDING_TOKENS:
            return ""
        # Keep only the tokens after the old read offset: they are the next step's context.
        del tokens[:r]
        self._prefix_offset, self._read_offset = 0, len(tokens)
        return new_text[len(prefix_text):]

    # --- per step ---------------------------------------------------------------------

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Decode ``new_token_ids``; return the stop string that matched, else None.

        ``stop_terminated``: the last id is EOS or a ``stop_token_ids`` entry; its text is
        left out unless ``include_stop_str_in_output`` (vLLM semantics).  Stop strings are
        not looked for in text of the first ``min_tokens`` tokens.
        """
        if self.matched_stop is not None or not new_token_ids:
            return None
        if self._decoder is None:
            self.num_output_tokens += len(new_token_ids)
            return None
        ids = new_token_ids
        if stop_terminated and not self.include_stop:
            ids = new_token_ids[:-1]
        check_from = len(self._text)
        for tid in ids:
            self.num_output_tokens += 1
            self._text.append(self._decode_next(tid))
            if self.min_tokens and self.num_output_tokens <= self.min_tokens:
                check_from = len(self._text)
        self.num_output_tokens += len(new_token_ids) - len(ids)

        if self.stop and self.num_output_tokens > self.min_tokens:
            self.matched_stop = self._check_stop(len(self._text) - check_from)
        return self.matched_stop

    def _check_stop(self, new_chars: int) -> str | None:
        """Find the earliest stop string overlapping the last ``new_chars`` characters."""
        if new_chars <= 0:
            return None
        start = max(0, len(self._text) - new_chars - (self._max_stop_len - 1))
        window = self._text.suffix(start)
        new_from = len(window) - new_chars
        best: tuple[int, str] | None = None
        for s in self.stop:
            # Matches that end before the new text were already ruled out last step.
            i = window.find(s, max(0, new_from - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self._text.truncate(start + i + (len(s) if self.include_stop else 0))
        return s

    def _flush_pending(self) -> None:
        """At the end, emit a trailing incomplete character (as U+FFFD, like ``decode``)."""
        if self._decoder is not None and self.matched_stop is None:
            self._text.append(self._emit(force=True))

    # --- reading ----------------------------------------------------------------------

    @property
    def output_text(self) -> str:
        """All text so far; cut at a matched stop string (kept if include_stop_str...)."""
        return self._text.text()

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text for the next ``RequestOutput``.

        ``delta``: only what was not returned by an earlier delta call; else the full text.
        While not ``finished`` the last ``stop_buffer_length`` characters are held back (a
        stop string may be forming there).  ``finished=True`` also flushes a trailing
        incomplete character, so the concatenated deltas equal ``output_text``.
        """
        if finished:
            self._flush_pending()
        length = len(self._text) - (0 if finished else self.stop_buffer_length)
        if not delta:
            return self._text.text()[:max(length, 0)]
        if length <= self._sent:
            return ""
        out = self._text.suffix(self._sent)[:length - self._sent]
        self._sent = length
        return out


def decode_token(tokenizer: Any, token_id: int) -> str:
    """The text of one token on its own, for logprob entries (vLLM style).

    ``convert_ids_to_tokens`` then ``convert_tokens_to_string``: a lone byte token comes
    out as U+FFFD, special tokens as their literal text, out-of-vocab ids as "".
    """
    if not 0 <= token_id < len(tokenizer):
        return ""
    tok = tokenizer.convert_ids_to_tokens(token_id)
    return tokenizer.convert_tokens_to_string([tok]) if tok is not None else ""


def decode_tokens(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """:func:`decode_token` for each id (one row of logprob alternatives)."""
    return [decode_token(tokenizer, t) for t in token_ids]
