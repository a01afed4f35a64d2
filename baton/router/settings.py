"""The router's settings: one dataclass, validated on construction; `baton router` derives its flags from it."""

from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("cache_aware", "round_robin")


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class RouterSettings:
    policy: str = field(
        default="cache_aware",
        metadata=_help("cache_aware: the worker whose cached prefix outweighs its load; round_robin: in turn"),
    )
    prefix_tokens_per_request: float = field(
        default=256.0,
        metadata=_help(
            "cache_aware: N prefix tokens are worth one queued request. A worker's score is its expected "
            "prefix hit in tokens / N minus its in-flight requests; the highest score wins"
        ),
    )
    min_prefix_share: float = field(
        default=0.5,
        metadata=_help(
            "cache_aware: a worker's cached prefix counts only if it covers at least this share of the "
            "request; below it, a request goes to the least loaded worker, then the one caching the least"
        ),
    )
    chars_per_token: float = field(
        default=4.0, metadata=_help("converts a matched prefix in characters to its estimated tokens")
    )
    chunk_chars: int = field(
        default=64, metadata=_help("the prefix index's unit: request text is matched in chunks of this many chars")
    )
    cache_tokens_per_worker: int = field(
        default=32768,
        metadata=_help(
            "the most prompt tokens the router remembers per worker (least recently used forgotten first); "
            "set it near a worker's KV cache size, so the router forgets about what the worker evicts"
        ),
    )
    health_interval_s: float = field(default=2.0, metadata=_help("seconds between /health checks of each worker"))
    health_timeout_s: float = field(default=5.0, metadata=_help("a /health check slower than this failed"))
    health_failures: int = field(default=2, metadata=_help("consecutive failed checks before a worker is marked down"))
    max_workers: int = field(default=64, metadata=_help("the most workers the router holds"))
    connect_timeout_s: float = field(default=5.0, metadata=_help("connecting to a worker slower than this failed"))
    first_byte_timeout_s: float = field(
        default=600.0,
        metadata=_help(
            "a worker's answer (a whole one, or a stream's first token) later than this failed: the request "
            "moves to another worker"
        ),
    )
    idle_timeout_s: float = field(
        default=120.0, metadata=_help("a stream silent for longer than this after its first token failed")
    )
    max_response_bytes: int = field(
        default=64 << 20, metadata=_help("a worker's answer (or one stream event) larger than this failed")
    )

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.prefix_tokens_per_request > 0:
            raise ValueError(f"prefix_tokens_per_request must be positive, got {self.prefix_tokens_per_request}")
        if not 0.0 <= self.min_prefix_share <= 1.0:
            raise ValueError(f"min_prefix_share must be in [0, 1], got {self.min_prefix_share}")
        if not self.chars_per_token > 0:
            raise ValueError(f"chars_per_token must be positive, got {self.chars_per_token}")
        if self.chunk_chars < 1 or self.cache_tokens_per_worker < 1:
            raise ValueError("chunk_chars and cache_tokens_per_worker must be >= 1")
        if not (self.health_interval_s > 0 and self.health_timeout_s > 0) or self.health_failures < 1:
            raise ValueError("health_interval_s and health_timeout_s must be positive, health_failures >= 1")
        if not 1 <= self.max_workers <= 4096:
            raise ValueError(f"max_workers must be in [1, 4096], got {self.max_workers}")
        if not (self.connect_timeout_s > 0 and self.first_byte_timeout_s > 0 and self.idle_timeout_s > 0):
            raise ValueError("connect_timeout_s, first_byte_timeout_s and idle_timeout_s must be positive")
        if self.max_response_bytes < 1024:
            raise ValueError(f"max_response_bytes must be at least 1024, got {self.max_response_bytes}")

    @property
    def index_capacity_chunks(self) -> int:
        """The per-worker bound of the prefix index, in chunks."""
        return max(1, round(self.cache_tokens_per_worker * self.chars_per_token / self.chunk_chars))

    def chunks_to_tokens(self, num_chunks: int) -> float:
        return num_chunks * self.chunk_chars / self.chars_per_token
