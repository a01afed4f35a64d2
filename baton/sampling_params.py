"""Per-request sampling settings, validated on construction (vLLM's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_SEED = 2**64  # seeds are in [0, 2^64), as torch.Generator takes them
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value
MAX_GRAMMAR_CHARS = 256 * 1024  # a schema, regex or grammar as text
MAX_CHOICES = 1024


@dataclass
class StructuredOutputsParams:
    """Constrain the output (vLLM's StructuredOutputsParams): exactly one of a JSON schema, any JSON
    object, a regex, a choice of strings, or a grammar (llguidance's Lark, or llama.cpp's GBNF)."""

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # a reasoning model's thinking before the constrained answer: "optional" (the output may open
    # with <think>...</think>), "open" (it is thinking until </think>); None: the answer at once
    thinking: str | None = None
    whitespace_pattern: str | None = None  # JSON: a regex for the whitespace allowed between tokens

    def __post_init__(self) -> None:
        if self.whitespace_pattern is not None and not (
            isinstance(self.whitespace_pattern, str) and len(self.whitespace_pattern) <= 256
        ):
            raise ValueError("invalid structured output whitespace_pattern: a regex of at most 256 characters")
        if self.thinking not in (None, "optional", "open"):
            raise ValueError(f"invalid structured output thinking: {self.thinking!r} (optional, open or none)")
        given = [name for name in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice or grammar, "
                f"got {', '.join(given) or 'none'}"
            )
        checks = [
            (self.json is None or isinstance(self.json, (dict, str)), "json", "must be a JSON schema (object or text)"),
            (self.regex is None or isinstance(self.regex, str), "regex", "must be a string"),
            (self.grammar is None or isinstance(self.grammar, str), "grammar", "must be a string"),
            (
                self.choice is None
                or (
                    isinstance(self.choice, list)
                    and 0 < len(self.choice) <= MAX_CHOICES
                    and all(isinstance(c, str) and c for c in self.choice)
                ),
                "choice",
                f"must be 1 to {MAX_CHOICES} non-empty strings",
            ),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"invalid structured output {name}: {rule}")
        size = len(self.json if isinstance(self.json, str) else repr(self.json or ""))
        size += sum(len(x or "") for x in (self.regex, self.grammar)) + sum(map(len, self.choice or []))
        if size > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the structured output spec has {size} characters; the limit is {MAX_GRAMMAR_CHARS}")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    """Added to the logits of these token ids before sampling, each in [-100, 100]."""
    allowed_token_ids: list[int] | None = None
    """Only these tokens may be sampled."""
    bad_words: list[str] | None = None
    """Word sequences never generated: their last token is banned wherever the rest has just been produced."""
    structured_outputs: StructuredOutputsParams | None = None
    """Only tokens that keep the output inside this schema, regex, choice or grammar are sampled."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        bias = self.logit_bias or {}
        checks = [
            (self.n >= 1, "n", "must be >= 1"),
            (self.temperature >= 0.0, "temperature", "must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (-1 <= self.top_k < 2**31, "top_k", "must be -1, 0 (off) or a positive integer below 2^31"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be in [0, max_tokens]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (all(_is_id(t) for t in self.stop_token_ids), "stop_token_ids", "must be token ids"),
            (self.seed is None or (_is_int(self.seed) and 0 <= self.seed < MAX_SEED), "seed", "must be in [0, 2^64)"),
            (
                all(_is_id(t) and _is_number(b) and abs(b) <= MAX_LOGIT_BIAS for t, b in bias.items()),
                "logit_bias",
                f"must map token ids to values in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            ),
            (
                self.allowed_token_ids is None or (self.allowed_token_ids and all(map(_is_id, self.allowed_token_ids))),
                "allowed_token_ids",
                "must be a non-empty list of token ids",
            ),
            (
                self.bad_words is None or all(isinstance(w, str) and w.strip() for w in self.bad_words),
                "bad_words",
                "must be non-empty strings",
            ),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {rule}")

    def check_token_ids(self, vocab_size: int) -> None:
        """Every token id the request names must index the vocabulary (an id past it would fail the
        whole engine step, and with it every other request in the batch)."""
        named = {
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": list((self.logit_bias or {}).keys()),
            "allowed_token_ids": self.allowed_token_ids or [],
        }
        for name, ids in named.items():
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"invalid sampling parameter {name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def uses_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_id(x) -> bool:
    return _is_int(x) and x >= 0


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
