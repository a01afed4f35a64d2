"""Incremental detokenization: a sequence's text grows with a bounded amount of decode work per token.

Decoding the whole output again for every new token costs O(n) per token. A sequence here keeps a
short window instead: the tokens of the last piece of text it emitted (the context that decides,
for instance, whether the next token's leading space survives) and the tokens held back since.
A new token is decoded with that window only; the text past the context's own decode is emitted,
unless it ends in U+FFFD (a character whose bytes are still incomplete), in which case the tokens
are held back until a later one completes it. This is vLLM's prefix_offset/read_offset algorithm.

For a tokenizer backed by the tokenizers library, whose `decode` transformers returns unchanged,
the emitted pieces come from that library's own `DecodeStream` (the same algorithm, in Rust). Slow
tokenizers, and a stream that fails (a decoder that is not prefix-stable), use the same algorithm
here over `tokenizer.decode`. The held-back text (`pending`) is computed here in either case, since
`DecodeStream` does not expose it; the engine's text includes it, as a full decode would.

Invariant: `text + pending == tokenizer.decode(ids, skip_special_tokens=...)` for the ids appended.
Two things make it hold where a plain stream would not:
- The stream starts empty, not seeded with the prompt: the engine's output text is the decode of
  the output ids alone, so a SentencePiece leading space is stripped at the start of the output as
  that decode strips it, and a prompt that ends mid-character does not lend its bytes to the output.
- A run of byte-fallback tokens ("<0xF0>" ...) is held until a token of another kind ends it:
  ByteFallback decodes a run as a whole, and one invalid byte turns every byte of the run into
  U+FFFD, so a character the run completed early is not final (a plain stream emits it anyway).

Work per token is a decode of the window. Tokens that decode drops (special tokens when skipped,
ids outside the vocabulary) never enter it. It grows only over a run of byte-fallback tokens or of
tokens whose text is all U+FFFD, neither of which a decode can finish earlier either.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

INCOMPLETE = "\ufffd"  # what decode shows for bytes that do not (yet) form a character


@dataclass(frozen=True)
class _Decoding:
    """How a tokenizer decodes: `backend` is its Rust tokenizer when `tokenizer.decode` is exactly
    that tokenizer's decode (no text edits on top), else None."""

    backend: Tokenizer | None
    special_ids: frozenset[int]  # what decode drops with skip_special_tokens (fast tokenizers only)
    byte_ids: frozenset[int]  # byte-fallback tokens "<0xXX>"


@functools.lru_cache(maxsize=8)
def _decoding(tokenizer: PreTrainedTokenizerBase) -> _Decoding:
    # computed once per tokenizer: Gemma3 has 6k added tokens (~3 ms to list)
    names = {f"<0x{b:02X}>" for b in range(256)} | {f"<0x{b:02x}>" for b in range(256)}
    backend = getattr(tokenizer, "_tokenizer", None)
    exact = (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and isinstance(backend, Tokenizer)
        and type(tokenizer)._decode is PreTrainedTokenizerFast._decode
        and not _cleans_up(tokenizer, backend)
    )
    if not exact:
        vocab = tokenizer.get_vocab()
        return _Decoding(None, frozenset(), frozenset(vocab[n] for n in names if n in vocab))
    special = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    byte_ids = frozenset(i for i in map(backend.token_to_id, names) if i is not None)
    return _Decoding(backend, special, byte_ids)


def _cleans_up(tokenizer: PreTrainedTokenizerFast, backend: Tokenizer) -> bool:
    """Whether transformers edits the Rust decode's text: clean_up_tokenization_spaces, which
    transformers 5 ignores for BPE models unless forced."""
    if not tokenizer.clean_up_tokenization_spaces:
        return False
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    return type(backend.model).__name__ != "BPE" or forced


class IncrementalDetokenizer:
    """One sequence's output text, decoded a few tokens at a time.

    `text` is the finalized text (the concatenation of what `append` returned) and only grows;
    `pending` is the text of the held-back tokens, U+FFFD where a character is still incomplete,
    which a later token may change. Always `text + pending == tokenizer.decode(ids,
    skip_special_tokens)`. With no tokenizer both stay "".
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._context: list[int] = []  # the tokens of the last emitted piece
        self._held: list[int] = []  # tokens appended since, not yet emitted
        self._fed = 0  # how many of _held the stream has seen
        self._context_text: str | None = ""  # decode(context), None until needed
        self._window_text: str | None = ""  # decode(context + held), None until needed
        self._backend: Tokenizer | None = None
        self._dropped: frozenset[int] = frozenset()
        self._byte_ids: frozenset[int] = frozenset()
        self._stream: DecodeStream | None = None
        if tokenizer is not None:
            decoding = _decoding(tokenizer)
            self._backend, self._byte_ids = decoding.backend, decoding.byte_ids
            if skip_special_tokens:
                self._dropped = decoding.special_ids
            if decoding.backend is not None:
                self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def append(self, token_id: int) -> str:
        """Add the next token; return the text it finalizes ("" while a character is incomplete)."""
        if self.tokenizer is None or token_id in self._dropped:
            return ""
        if self._backend is not None and self._backend.id_to_token(token_id) is None:
            return ""  # outside the vocabulary: decode drops it
        self._held.append(token_id)
        self._window_text = None
        if token_id in self._byte_ids:
            return ""  # a run of byte tokens is final only once it ends (module docstring)
        piece = None
        if self._stream is not None:
            try:
                piece = self._stream.step(self._backend, self._held[self._fed :])
                self._fed = len(self._held)
            except Exception as e:  # the stream found its text not prefix-stable: go on without it
                logger.warning("DecodeStream failed (%s); detokenizing this sequence in Python", e)
                self._stream = None
        if self._stream is None:
            piece = self._step()
        if piece is None:
            return ""
        self._context, self._held, self._fed = self._held, [], 0
        self._context_text = self._window_text = None
        self.text += piece
        return piece

    @property
    def pending(self) -> str:
        """The text of the held-back tokens, as a decode of all ids shows it after `text`."""
        if not self._held:
            return ""
        return self._window()[len(self._prefix()) :]

    def _step(self) -> str | None:
        """vLLM's rule: emit the window's text past its context's, unless it ends mid-character."""
        window, prefix = self._window(), self._prefix()
        if len(window) > len(prefix) and not window.endswith(INCOMPLETE):
            return window[len(prefix) :]
        return None

    def _window(self) -> str:
        if self._window_text is None:
            self._window_text = self._decode(self._context + self._held)
        return self._window_text

    def _prefix(self) -> str:
        if self._context_text is None:
            self._context_text = self._decode(self._context)
        return self._context_text

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
