"""A request's prompt and parameters, checked against the model before it may reach a step:
tokenizing, token ids inside the vocabulary, room to generate, constraints that compile, bad
words as token ids. The server runs the same checks on its own thread before it answers."""

from __future__ import annotations

from baton.engine.grammar import StructuredOutputs
from baton.sampling_params import SamplingParams

Prompt = str | list[int] | dict


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, structured: StructuredOutputs) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.structured = structured

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]} instead of text")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list):
            return None, list(prompt)
        raise ValueError(f"a prompt is a string, a list of token ids or a dict, not {type(prompt).__name__}")

    def check(self, token_ids: list[int], params: SamplingParams) -> list[list[int]]:
        """Every check of a request against this model, before it may reach a step (ValueError);
        returns its bad words as token ids. The server calls it too, before it answers."""
        vocab = self.vocab_size
        if not token_ids:
            raise ValueError("the prompt is empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, which leaves no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        params.check_token_ids(vocab)
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)  # GrammarError (a ValueError) if it does not compile
        return self._bad_words_token_ids(params.bad_words)

    def _bad_words_token_ids(self, words: list[str] | None) -> list[list[int]]:
        """Each bad word as token ids, with and without a leading space (as vLLM bans them)."""
        if not words:
            return []
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer; this model has none")
        out: list[list[int]] = []
        for word in words:
            for text in (word.strip(), " " + word.strip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out
