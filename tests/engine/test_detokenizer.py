"""IncrementalDetokenizer on the real default tokenizer (SmolLM2, byte-level BPE).

Unicode round trips, stop strings split across tokens, earliest-stop-wins, min_tokens,
streaming holdback, special tokens, and bounded per-step work.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pagedllm.engine.detokenizer import (
    MAX_PENDING_TOKENS,
    IncrementalDetokenizer,
    decode_token,
    decode_tokens,
)
from pagedllm.model_files.resolve import resolve_model
from pagedllm.sampling_params import SamplingParams

HC = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


@pytest.fixture(scope="module")
def tok() -> Any:
    return resolve_model(None).load_tokenizer()


@pytest.fixture(scope="module")
def prompt(tok: Any) -> list[int]:
    return tok.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n",
                      add_special_tokens=False)


def enc(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(tok: Any, prompt: list[int], ids: list[int], params: SamplingParams,
           chunks: list[int] | None = None) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed ``ids`` (one per update, or in ``chunks`` sizes) like the engine does.

    Returns the detokenizer, the streamed deltas, and the matched stop string.
    Also checks after every step that what was streamed is a prefix of the final text
    (so nothing was ever emitted that a later stop string cut away).
    """
    d = IncrementalDetokenizer(tok, prompt, params)
    deltas: list[str] = []
    sizes = chunks or [1] * len(ids)
    pos, stop = 0, None
    for n in sizes:
        if pos >= len(ids):
            break
        stop = d.update(ids[pos:pos + n])
        pos += n
        finished = stop is not None or pos >= len(ids)
        deltas.append(d.get_next_output_text(finished=finished, delta=True))
        if stop is not None:
            break
    # Nothing streamed was ever taken back by a later stop-string cut.
    for k in range(len(deltas)):
        assert d.output_text.startswith("".join(deltas[:k + 1]))
    assert "".join(deltas) == d.output_text
    assert d.get_next_output_text(finished=True, delta=False) == d.output_text
    return d, deltas, stop


# --- Unicode --------------------------------------------------------------------------

ZWJ, VS16 = "\u200d", "\ufe0f"
emoji = st.sampled_from(["👨", "👩", "👧", "❤", "🏳", "🌈", "🤷", "🏽", "👍", "😀", "🧑", "💻"])
emoji_seq = st.builds(lambda xs, vs: ZWJ.join(x + (VS16 if v else "") for x, v in zip(xs, vs)),
                      st.lists(emoji, min_size=1, max_size=4),
                      st.lists(st.booleans(), min_size=4, max_size=4))
pieces = st.one_of(
    st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),  # CJK
    st.characters(min_codepoint=0x3040, max_codepoint=0x30FF),  # kana
    st.characters(min_codepoint=0xC0, max_codepoint=0x17F),  # precomposed accents
    st.builds(lambda c, m: c + m, st.sampled_from("aeiouAEn"),  # combining accents
              st.characters(min_codepoint=0x300, max_codepoint=0x36F)),
    emoji_seq,
    st.sampled_from([" ", "  ", "\n", "\t", ".", ",", "!", "?", "'", '"', "-", "…", "€"]),
    st.text("abcdefghijklmnopqrstuvwxyz ", min_size=1, max_size=6),
    st.characters(codec="utf-8"),  # anything encodable
)
unicode_text = st.lists(pieces, min_size=1, max_size=25).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=HC)
@given(text=unicode_text, chunk_seed=st.lists(st.integers(1, 4), max_size=60))
def test_unicode_round_trip(tok: Any, prompt: list[int], text: str,
                            chunk_seed: list[int]) -> None:
    ids = enc(tok, text)
    assume(ids)
    want = tok.decode(ids, skip_special_tokens=True)
    for chunks in (None, chunk_seed + [len(ids)]):
        d, deltas, stop = stream(tok, prompt, ids, SamplingParams(), chunks)
        assert stop is None
        assert "".join(deltas) == d.output_text == want
        for delta in deltas:
            delta.encode("utf-8")  # no lone surrogates: valid UTF-8
            # (The tokenizer itself is lossy on a few rare bytes -- it drops some control
            # characters and its decode can hold U+FFFD -- and we must match its decode.)
            if "\ufffd" not in want:
                assert "\ufffd" not in delta


def test_multibyte_chars_split_over_byte_tokens_wait(tok: Any, prompt: list[int]) -> None:
    text = "世界👨‍👩‍👧❤️"
    ids = enc(tok, text)
    assert len(ids) > len(text)  # several tokens per character
    _, deltas, _ = stream(tok, prompt, ids, SamplingParams())
    assert "".join(deltas) == text
    assert "" in deltas  # some steps had to wait for the rest of a character
    assert all("\ufffd" not in d for d in deltas)


def test_invalid_bytes_flush_and_window_stays_small(tok: Any, prompt: list[int]) -> None:
    lead = enc(tok, "世")[0]  # a token holding an incomplete UTF-8 sequence
    ids = [lead] * 40 + enc(tok, " fine")
    d = IncrementalDetokenizer(tok, prompt, SamplingParams())
    for i in ids:
        d.update([i])
        # Bounded per-step decode window: context + pending, each at most MAX + 1 tokens.
        assert len(d._tokens) <= 2 * (MAX_PENDING_TOKENS + 1)
    d.get_next_output_text(finished=True, delta=True)
    assert d.output_text.endswith(" fine") and "\ufffd" in d.output_text


def test_trailing_incomplete_char_flushed_when_finished(tok: Any, prompt: list[int]) -> None:
    ids = enc(tok, "ab世")[:-1]  # stop mid-character
    d, deltas, _ = stream(tok, prompt, ids, SamplingParams())
    assert "".join(deltas) == tok.decode(ids) == d.output_text
    assert d.output_text.endswith("\ufffd")


def test_window_does_not_grow_with_length(tok: Any, prompt: list[int]) -> None:
    ids = enc(tok, "The quick brown fox jumps over the lazy dog. 世界 " * 200)
    d = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=["NEVER"]))
    longest = 0
    for i in ids:
        d.update([i])
        d.get_next_output_text(finished=False, delta=True)
        longest = max(longest, len(d._tokens))
    assert longest <= 8
    assert d.output_text == tok.decode(ids)


# --- SentencePiece-style decoding (leading spaces depend on context) -------------------

@pytest.fixture(scope="module")
def sp_tok() -> Any:
    """A small Llama-style tokenizer (Metaspace, byte fallback, strip-first-space decoder)
    trained in memory with the real ``tokenizers`` library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.train_from_iterator(
        ["hello world this is a test of the tokenizer",
         "the world is big and the test is small"] * 10,
        trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"]))
    model = json.loads(trained.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    for b in range(256):  # byte-fallback pieces are ordinary (non-special) vocabulary
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    t = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    t.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@settings(max_examples=80, deadline=None, suppress_health_check=HC)
@given(words=st.lists(st.sampled_from(["hello", "world", "the", "test", "is", "small", "世界",
                                       "😀", "é", "xyz", "\n"]), min_size=1, max_size=12),
       prompt_words=st.lists(st.sampled_from(["the", "test", "big", "世"]), max_size=4))
def test_output_continues_prompt_text(sp_tok: Any, words: list[str],
                                      prompt_words: list[str]) -> None:
    # The prompt's last tokens are decoding context: "the test" + " hello" keeps its space
    # (decoding " hello" alone would strip it), so prompt text + output text == the text of
    # prompt + output, which is what completions clients concatenate.
    prompt_ids = sp_tok.encode(" ".join(prompt_words), add_special_tokens=False)
    all_ids = sp_tok.encode(" ".join(prompt_words + words), add_special_tokens=False)
    assume(all_ids[:len(prompt_ids)] == prompt_ids and len(all_ids) > len(prompt_ids))
    out_ids = all_ids[len(prompt_ids):]
    d, deltas, _ = stream(sp_tok, prompt_ids, out_ids, SamplingParams())
    whole, head = sp_tok.decode(all_ids), sp_tok.decode(prompt_ids)
    assert head + "".join(deltas) == whole
    assert all("\ufffd" not in x for x in deltas)


# --- special tokens ---------------------------------------------------------------------

@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok: Any, prompt: list[int], skip: bool) -> None:
    ids = enc(tok, "Hello<|im_end|> there<|im_start|>x<repo_name>y")
    assert tok.convert_tokens_to_ids("<repo_name>") in ids  # special, not in all_special_ids
    params = SamplingParams(skip_special_tokens=skip)
    d, deltas, _ = stream(tok, prompt, ids, params)
    assert d.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in d.output_text) is (not skip)


class _SlowView:
    """The real tokenizer presented as a "slow" one, to exercise the added-token path."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.is_fast = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def __len__(self) -> int:
        return len(self._tok)


@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens_on_slow_path(tok: Any, spaces: bool) -> None:
    ids = enc(tok, "<|im_start|>hi<|im_end|>")
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
    d = IncrementalDetokenizer(_SlowView(tok), [], params)
    for i in ids:
        d.update([i])
    sep = " " if spaces else ""
    assert d.output_text == sep.join(["<|im_start|>", "hi", "<|im_end|>"])


# --- stop strings -----------------------------------------------------------------------

TEXT = "Hello world, this is a test. The answer is forty-two. Goodbye now."


def test_stop_string_split_across_tokens(tok: Any, prompt: list[int]) -> None:
    ids = enc(tok, TEXT)
    stop = "is forty"  # spans " is", " forty"
    d, deltas, got = stream(tok, prompt, ids, SamplingParams(stop=[stop]))
    assert got == stop
    assert d.output_text == TEXT[:TEXT.index(stop)]
    assert "".join(deltas) == d.output_text
    assert d.update(enc(tok, " more")) is None and d.output_text == TEXT[:TEXT.index(stop)]


def test_stop_string_inside_one_token_and_partial_token(tok: Any, prompt: list[int]) -> None:
    ids = enc(tok, TEXT)
    d, _, got = stream(tok, prompt, ids, SamplingParams(stop=["orl"]))  # inside " world"
    assert got == "orl" and d.output_text == "Hello w"


def test_include_stop_str_in_output(tok: Any, prompt: list[int]) -> None:
    ids = enc(tok, TEXT)
    stop = "answer is"
    params = SamplingParams(stop=[stop], include_stop_str_in_output=True)
    d, deltas, got = stream(tok, prompt, ids, params, chunks=[len(ids)])
    assert got == stop
    cut = TEXT.index(stop) + len(stop)
    assert d.output_text == TEXT[:cut] == "".join(deltas)  # text after it in the chunk cut
    d, deltas, _ = stream(tok, prompt, ids, params)
    assert d.output_text == TEXT[:cut] == "".join(deltas)


def test_multibyte_stop_string(tok: Any, prompt: list[int]) -> None:
    text = "价格是三百元，谢谢"
    d, deltas, got = stream(tok, prompt, enc(tok, text), SamplingParams(stop=["三百"]))
    assert got == "三百" and d.output_text == "价格是" == "".join(deltas)


def test_earliest_stop_wins(tok: Any, prompt: list[int]) -> None:
    ids = enc(tok, TEXT)
    # All in one update: "test" starts before "answer" although listed second.
    d, _, got = stream(tok, prompt, ids, SamplingParams(stop=["answer", "test"]),
                       chunks=[len(ids)])
    assert got == "test" and d.output_text == TEXT[:TEXT.index("test")]
    # Same start: the one listed first wins.
    for stops in (["a test", "a te"], ["a te", "a test"]):
        params = SamplingParams(stop=stops, include_stop_str_in_output=True)
        d, _, got = stream(tok, prompt, ids, params, chunks=[len(ids)])
        assert got == stops[0]
        assert d.output_text == TEXT[:TEXT.index("a test") + len(stops[0])]


def test_min_tokens_suppresses_stop(tok: Any, prompt: list[int]) -> None:
    text = "STOP one STOP two"
    ids = enc(tok, text)
    first = next(k for k in range(1, len(ids) + 1) if "STOP" in tok.decode(ids[:k]))
    d, _, got = stream(tok, prompt, ids, SamplingParams(stop=["STOP"], min_tokens=first))
    assert got == "STOP" and d.output_text == "STOP one "
    d, _, got = stream(tok, prompt, ids, SamplingParams(stop=["STOP"], min_tokens=first - 1))
    assert got == "STOP" and d.output_text == ""
    # Several tokens in one update: text of the first min_tokens tokens is still exempt.
    params = SamplingParams(stop=["STOP"], min_tokens=first)
    d, _, got = stream(tok, prompt, ids, params, chunks=[len(ids)])
    assert got == "STOP" and d.output_text == "STOP one "
    d, _, got = stream(tok, prompt, ids[:first + 2], params, chunks=[first + 2])
    assert got is None and d.output_text == tok.decode(ids[:first + 2])


def test_stop_terminated_token_text(tok: Any, prompt: list[int]) -> None:
    ids = enc(tok, "Hi.")
    for include in (False, True):
        d = IncrementalDetokenizer(tok, prompt, SamplingParams(include_stop_str_in_output=include,
                                                               stop_token_ids=[ids[-1]]))
        d.update(ids[:-1])
        assert d.update(ids[-1:], stop_terminated=True) is None
        assert d.output_text == ("Hi." if include else "Hi")
        assert d.num_output_tokens == len(ids)


def test_detokenize_false(tok: Any, prompt: list[int]) -> None:
    d = IncrementalDetokenizer(tok, prompt, SamplingParams(detokenize=False, stop=["a"]))
    assert d.update(enc(tok, "a b a")) is None
    assert d.output_text == "" and d.get_next_output_text(True, True) == ""
    assert d.num_output_tokens == 3


ascii_text = st.text("abc xyz.", min_size=1, max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=HC)
@given(text=ascii_text, stops=st.lists(st.text("abc xyz.", min_size=1, max_size=4),
                                       min_size=1, max_size=3),
       include=st.booleans(), chunk=st.integers(1, 3))
def test_stop_strings_match_stepwise_reference(tok: Any, prompt: list[int], text: str,
                                               stops: list[str], include: bool,
                                               chunk: int) -> None:
    ids = enc(tok, text)
    assume(ids)
    # Reference: after each update the text is decode(ids[:k]); the first update whose
    # text contains any stop stops, at the earliest start among them (ties: listed first).
    want_text, want_stop = text, None
    for k in range(chunk, len(ids) + chunk, chunk):
        so_far = tok.decode(ids[:k])
        hits = [(so_far.find(s), n, s) for n, s in enumerate(stops) if s in so_far]
        if hits:
            start, _, want_stop = min(hits)
            want_text = so_far[:start + (len(want_stop) if include else 0)]
            break
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    d, deltas, got = stream(tok, prompt, ids, params, chunks=[chunk] * len(ids))
    assert got == want_stop
    assert d.output_text == want_text == "".join(deltas)


@settings(max_examples=80, deadline=None, suppress_health_check=HC)
@given(text=ascii_text, stop=st.text("abc xyz.", min_size=2, max_size=6))
def test_holdback_never_streams_partial_stop(tok: Any, prompt: list[int], text: str,
                                             stop: str) -> None:
    ids = enc(tok, text + stop + " tail")
    d = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=[stop]))
    streamed, got = "", None
    for i in ids:
        got = d.update([i])
        streamed += d.get_next_output_text(finished=got is not None, delta=True)
        if got is not None:
            break
        # Everything that could still become the start of the stop string is held back.
        assert len(d.output_text) - len(streamed) == min(len(stop) - 1, len(d.output_text))
    assert got == stop
    assert streamed == d.output_text == (text + stop)[:(text + stop).index(stop)]


# --- logprob token text -----------------------------------------------------------------

def test_decode_token(tok: Any) -> None:
    hello = enc(tok, " hello")
    assert len(hello) == 1 and decode_token(tok, hello[0]) == " hello"
    assert decode_token(tok, enc(tok, "世")[0]) == "\ufffd"  # a lone byte piece
    assert decode_token(tok, tok.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"
    assert decode_token(tok, len(tok) + 5) == "" and decode_token(tok, -1) == ""
    assert decode_tokens(tok, hello * 2) == [" hello", " hello"]
