"""Per-request sampling settings, validated on construction (vLLM's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        checks = [
            (self.n >= 1, "n", "must be >= 1"),
            (self.temperature >= 0.0, "temperature", "must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "must be -1, 0 (off) or a positive integer"),
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
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be token ids"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {rule}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def uses_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0
