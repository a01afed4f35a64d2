"""Which worker takes a request: in turn, or where its prefix is cached, weighed against load."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from baton.router.workers import Worker


class Policy(Protocol):
    def choose(self, workers: Sequence[Worker], prefix_tokens: Sequence[float], request_tokens: float) -> int:
        """The index in `workers` (non-empty) of the one to take the request; `prefix_tokens[i]` is
        the part of the request workers[i] is expected to hold, of `request_tokens` (estimates)."""


class RoundRobin:
    def __init__(self) -> None:
        self._turn = 0

    def choose(self, workers: Sequence[Worker], prefix_tokens: Sequence[float], request_tokens: float) -> int:
        i = self._turn % len(workers)
        self._turn += 1
        return i


class CacheAware:
    """score = expected prefix hit (tokens) / prefix_tokens_per_request - requests in flight.

    The highest score wins: a worker holding 1,000 more tokens of the prompt than another keeps the
    request until it has 1,000 / N more requests in flight. A prefix counts only if it covers at
    least `min_prefix_share` of the request (SGLang's cache threshold): a few tokens every prompt
    starts with are no reason to pile new prompts onto one worker. On a tie (typically: nobody
    holds enough, loads are equal) the worker that remembers the fewest chunks wins, so new
    prefixes spread over the workers' caches."""

    def __init__(self, prefix_tokens_per_request: float, min_prefix_share: float) -> None:
        self.prefix_tokens_per_request = prefix_tokens_per_request
        self.min_prefix_share = min_prefix_share

    def choose(self, workers: Sequence[Worker], prefix_tokens: Sequence[float], request_tokens: float) -> int:
        least = self.min_prefix_share * request_tokens

        def rank(i: int) -> tuple[float, int]:
            w = workers[i]
            prefix = prefix_tokens[i] if prefix_tokens[i] >= least else 0.0
            return prefix / self.prefix_tokens_per_request - w.in_flight, -len(w.index)

        return max(range(len(workers)), key=rank)


def make_policy(name: str, prefix_tokens_per_request: float, min_prefix_share: float) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "cache_aware":
        return CacheAware(prefix_tokens_per_request, min_prefix_share)
    raise ValueError(f"unknown routing policy {name!r}")
