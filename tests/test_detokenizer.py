"""Incremental detokenization: after every token, the finalized text plus the held-back text equals
transformers' decode of all the ids so far, for the real tokenizers the suite uses (SmolLM2's
byte-level BPE, Gemma3's SentencePiece BPE with byte fallback), at bounded work per token; and the
engine's output text is what it was when it decoded the whole output on every token."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton import SamplingParams
from baton.config import EnvSettings
from baton.engine import detokenizer
from baton.engine.detokenizer import INCOMPLETE, IncrementalDetokenizer
from baton.models.loader import resolve_model_path
from baton.tokenizer import load_tokenizer

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It wasn't the dog's fault, was it? No -- never!",
    "code": (
        'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n'
        "        return n\n\treturn fibonacci(n - 1) + fibonacci(n - 2)  # tab, then spaces\n\n\n"
    ),
    "emoji_cjk": (
        "Party 🎉 family 👩‍👩‍👧 flag 🇫🇷 · 中文字符 日本語のテキスト 한국어 · rare 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𠀀𠀁𪛖 · café naïve"
    ),
}


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def tok(request):
    return load_tokenizer(resolve_model_path(request.param), EnvSettings.read().cache_dir, None)


@pytest.fixture(scope="module")
def awkward_ids(tok) -> list[int]:
    """Ids a stream finds hard: special tokens, and tokens whose text alone is an incomplete character."""
    texts = tok.backend_tokenizer.decode_batch([[i] for i in range(len(tok))], skip_special_tokens=False)
    partial = [i for i, t in enumerate(texts) if INCOMPLETE in t]
    assert len(partial) >= 64  # byte-level pieces (SmolLM2) or <0xXX> byte tokens (Gemma3)
    return sorted(set(tok.all_special_ids) | set(partial))


def stream(tok, ids: list[int], skip: bool, prefix: Sequence[int] = ()) -> tuple[IncrementalDetokenizer, list[str]]:
    """Append `ids` one at a time after `prefix` (appended but not checked), checking the invariant
    against a full decode after every token."""
    detok = IncrementalDetokenizer(tok, skip)
    for t in prefix:
        detok.append(t)
    start, pieces = len(detok.text), []
    for k, t in enumerate(ids):
        pieces.append(detok.append(t))
        assert detok.text + detok.pending == tok.decode([*prefix, *ids[: k + 1]], skip_special_tokens=skip)
    assert detok.text[start:] == "".join(pieces)
    return detok, pieces


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("name", list(TEXTS))
def test_real_text_streams_to_its_decode(tok, name, skip):
    ids = tok.encode(TEXTS[name])  # Gemma3 starts with <bos>: skipped or shown, as decode does
    detok, pieces = stream(tok, ids, skip)
    assert detok.pending == ""
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    if name == "emoji_cjk":  # some character's bytes were split across tokens and held back
        assert any(p == "" for p, t in zip(pieces, ids) if t not in tok.all_special_ids)


@pytest.mark.parametrize("skip", [True, False])
def test_text_after_a_prefix(tok, skip):
    """Mid-stream (the context is earlier output, not the start) the pieces still add up."""
    prefix = tok.encode(TEXTS["code"])
    ids = tok.encode(TEXTS["emoji_cjk"] + " " + TEXTS["english"], add_special_tokens=False)
    detok, _ = stream(tok, ids, skip, prefix)
    assert detok.text == tok.decode(prefix + ids, skip_special_tokens=skip)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_random_ids_stream_to_their_decode(tok, awkward_ids, data, skip):
    any_id = st.integers(0, len(tok) + 3)  # a few past the vocabulary: decode drops them
    ids = data.draw(st.lists(st.one_of(any_id, st.sampled_from(awkward_ids)), min_size=1, max_size=40))
    prefix = data.draw(st.lists(st.one_of(any_id, st.sampled_from(awkward_ids)), max_size=8))
    stream(tok, ids, skip, prefix)


def test_byte_fallback_run_is_held_whole(tok):
    """Gemma3 decodes a run of <0xXX> tokens as a whole: a character that the run completed turns
    into U+FFFD once an invalid byte follows, so it must not have been emitted."""
    byte = {b: tok.backend_tokenizer.token_to_id(f"<0x{b:02X}>") for b in "𝔘".encode() + b"\xf0"}
    if None in byte.values():
        pytest.skip("a byte-level tokenizer: no byte-fallback tokens")
    word = tok.encode(" word", add_special_tokens=False)
    ids = [byte[b] for b in "𝔘".encode()] + [byte[0xF0]] + word
    _, pieces = stream(tok, ids, True)
    assert "𝔘" not in "".join(pieces)


class CountingTokenizer:
    """A tokenizer the detokenizer cannot see into, as a slow one: every decode goes through here."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.calls = self.ids = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.calls += 1
        self.ids += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.tok.get_vocab()


def long_ids(tok, n: int) -> list[int]:
    text = " ".join(TEXTS.values())
    ids = tok.encode(text * (1 + n // len(tok.encode(text))))[:n]
    assert len(ids) == n
    return ids


def test_work_per_token_is_bounded(tok):
    """2,000 tokens cost ten times what 200 do: per token a few decodes of a few tokens, counted on
    the slow path; on the fast path the window (what DecodeStream and `pending` decode) is no longer
    for 2,000 tokens than for 200 (its longest: a run of byte tokens, the rare characters' 4 bytes)."""
    per_token, longest = {}, {}
    for n in (200, 2000):
        ids = long_ids(tok, n)
        counting = CountingTokenizer(tok)
        slow, fast = IncrementalDetokenizer(counting), IncrementalDetokenizer(tok)
        assert slow._stream is None and fast._stream is not None
        longest[n] = 0
        for t in ids:
            slow.append(t)
            _ = slow.pending  # the engine reads it every token
            fast.append(t)
            longest[n] = max(longest[n], len(fast._context) + len(fast._held))
        assert slow.text + slow.pending == fast.text + fast.pending == tok.decode(ids, skip_special_tokens=True)
        per_token[n] = (counting.calls / n, counting.ids / n)
    assert per_token[2000][0] <= 3 and per_token[2000][1] <= 16
    assert per_token[2000][1] <= 1.25 * per_token[200][1]
    assert longest[2000] == longest[200] <= 24


def test_a_failing_stream_hands_over_to_python(tok, monkeypatch, caplog):
    class Failing:
        def __init__(self, skip_special_tokens: bool) -> None:
            self.steps = 0

        def step(self, backend, ids):
            self.steps += 1
            if self.steps == 5:
                raise Exception("Invalid prefix encountered")
            return self.real.step(backend, ids)

    real_stream = detokenizer.DecodeStream

    def failing(skip_special_tokens: bool):
        f = Failing(skip_special_tokens)
        f.real = real_stream(skip_special_tokens=skip_special_tokens)
        return f

    monkeypatch.setattr(detokenizer, "DecodeStream", failing)
    ids = tok.encode(TEXTS["emoji_cjk"] + TEXTS["code"])
    with caplog.at_level(logging.WARNING, logger=detokenizer.__name__):
        detok, pieces = stream(tok, ids, True)
    assert "DecodeStream failed" in caplog.text and detok._stream is None
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)


def test_no_tokenizer_no_text():
    detok = IncrementalDetokenizer(None)
    assert [detok.append(t) for t in (1, 2, 3)] == ["", "", ""] and detok.text + detok.pending == ""


# ---- the engine: its text is what decoding the whole output on every token gave -----------------


def whole_decode_engine(tok, output_ids: list[int], params: SamplingParams, eos: set[int]) -> tuple:
    """Decode the whole output after every token and look for stop strings in what is new since the
    previous decode (past their common prefix, as vLLM checks only new text; a character completed by
    this token counts as new): (text, tokens kept, stop_reason)."""
    text, eos = "", set() if params.ignore_eos else eos
    for k, token in enumerate(output_ids):
        if token in eos or token in params.stop_token_ids:
            reason = None if token in eos else token
            return tok.decode(output_ids[:k], skip_special_tokens=params.skip_special_tokens), k + 1, reason
        previous, text = text, tok.decode(output_ids[: k + 1], skip_special_tokens=params.skip_special_tokens)
        if params.stop and k + 1 >= params.min_tokens:
            common = len(os.path.commonprefix([previous, text]))
            start = max(0, common - max(len(s) for s in params.stop) + 1)
            hits = [(i, s) for i, s in ((text.find(s, start), s) for s in params.stop) if i >= 0]
            if hits:
                idx, stop = min(hits)
                return text[: idx + len(stop) if params.include_stop_str_in_output else idx], k + 1, stop
    return text, len(output_ids), None


def test_engine_text_is_the_whole_decode(smollm2):
    tok = smollm2.get_tokenizer()
    emoji = "Write the word for 'hello' in Chinese, Japanese and Korean, then three emoji:"  # split characters
    plain = "The capital of France is"
    partial = {"prompt_token_ids": tok.encode("你好")[:1] + tok.encode("🎉")[:1]}  # ends mid-character
    greedy = dict(max_tokens=32, temperature=0.0)
    free = smollm2.generate([plain], SamplingParams(**greedy))[0].outputs[0]
    word = free.text.split()[4]
    cases = {
        "emoji": (emoji, SamplingParams(**greedy)),
        "emoji, special tokens shown": (emoji, SamplingParams(**greedy, skip_special_tokens=False)),
        "prompt ends mid-character": (partial, SamplingParams(**greedy)),
        "stop string": (plain, SamplingParams(**greedy, stop=[word, "zzz"])),
        "stop string kept": (plain, SamplingParams(**greedy, stop=word, include_stop_str_in_output=True)),
        "stop string before min_tokens": (plain, SamplingParams(**greedy, stop=free.text.split()[0], min_tokens=6)),
        "stop token": (plain, SamplingParams(**greedy, stop_token_ids=[free.token_ids[5]])),
        "stop strings of split characters": (emoji, SamplingParams(**greedy, stop=["。", "👌👌👌", "！"])),
        "sampled": (emoji, SamplingParams(max_tokens=32, temperature=1.0, seed=3, stop=["!"], min_tokens=4)),
    }
    outs = smollm2.generate([p for p, _ in cases.values()], [params for _, params in cases.values()])
    reasons = set()
    for name, (_, params), out in zip(cases, cases.values(), outs):
        c = out.outputs[0]
        text, kept, reason = whole_decode_engine(tok, c.token_ids, params, smollm2.engine.eos_token_ids)
        assert (c.text, len(c.token_ids), c.stop_reason) == (text, kept, reason), name
        reasons.add(type(c.stop_reason))
    assert reasons >= {str, int}  # a stop string and a stop token did end some
