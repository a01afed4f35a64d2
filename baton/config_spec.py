"""The speculative decoding section of the config tree (vLLM's --speculative-config)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

SPEC_METHODS = ("ngram", "suffix", "draft_model", "mtp")


@dataclass
class SpeculativeConfig:
    """vLLM's --speculative-config: a proposer drafts tokens, one forward verifies them all."""

    method: str = "ngram"
    """ngram: prompt lookup over the prompt and the output; suffix: the most frequent continuations
    of the latest tokens in the prompt, the output and recent requests' outputs (spec/suffix.py);
    draft_model: a smaller (or quantized) model with the same tokenizer; mtp: the model's own
    multi-token-prediction layers."""
    num_speculative_tokens: int = 4
    """The most tokens drafted per request and step (k); each request's own k follows its
    measured acceptance between 1 and this."""
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    """ngram: the longest suffix of this many tokens (down to the min) found earlier is followed."""
    suffix_max_depth: int = 24
    """suffix: the longest run of latest tokens matched."""
    suffix_min_token_prob: float = 0.1
    """suffix: a draft token's share of the continuations seen at its place, at least."""
    suffix_max_spec_factor: float = 1.0
    """suffix: a step drafts at most this many tokens per token of the match."""
    suffix_cache_tokens: int = 65536
    """suffix: recent requests' output tokens kept per cache salt."""
    model: str | None = None
    """draft_model: a known name, HF directory or .gguf; its vocabulary must be the target's."""
    quantization: str | None = None
    """draft_model: quantize the draft's linears at load (q4_0, q8_0, ...)."""
    disable_by_batch_size: int | None = 8
    """Speculate only while fewer requests than this are running (None: always). On a CPU, a
    batch of decodes already reads each weight once for many tokens: verifying drafts then costs
    compute that plain decoding does not. Measured on SmolLM2 with 2 cores (bench/README.md):
    n-gram drafts pay 1.3x at c1, about nothing at c4, and lose a few percent at c8."""
    adaptive: bool = True
    """Each request's k follows its acceptance: it drafts only as far as drafts tend to survive."""

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 32:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max <= 32, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if not 1 <= self.suffix_max_depth <= 64:
            raise ValueError(f"suffix_max_depth must be in [1, 64], got {self.suffix_max_depth}")
        if not 0.0 <= self.suffix_min_token_prob <= 1.0:
            raise ValueError(f"suffix_min_token_prob must be in [0, 1], got {self.suffix_min_token_prob}")
        if not 0.0 < self.suffix_max_spec_factor <= 16.0:
            raise ValueError(f"suffix_max_spec_factor must be in (0, 16], got {self.suffix_max_spec_factor}")
        if not 0 <= self.suffix_cache_tokens <= 1 << 24:
            raise ValueError(f"suffix_cache_tokens must be in [0, 2^24], got {self.suffix_cache_tokens}")
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative method "draft_model" needs "model"')
        if self.method != "draft_model" and (self.model or self.quantization):
            raise ValueError(f'"model" and "quantization" belong to method "draft_model", not {self.method!r}')
        from baton.config import QUANTIZATIONS  # the model section's: config.py imports this module

        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a dict or its JSON text (the CLI flag), with unknown keys named in the error."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("the speculative config is a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; known: {', '.join(sorted(known))}")
        return cls(**value)
