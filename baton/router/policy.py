"""Which worker takes a request: in turn, or where its prefix is cached, weighed against load."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from baton.router.workers import Worker


class Policy(Protocol):
    def choose(self, workers: Sequence[Worker], prefix_tokens: Sequence[float]) -> int:
        """The index in `workers` (non-empty) of the one to take the request; `prefix_tokens[i]` is
        the prefix of the request that workers[i] is expected to hold, in estimated tokens."""


class RoundRobin:
    def __init__(self) -> None:
        self._turn = 0

    def choose(self, workers: Sequence[Worker], prefix_tokens: Sequence[float]) -> int:
        i = self._turn % len(workers)
        self._turn += 1
        return i


class CacheAware:
    """score = expected prefix hit (tokens) / prefix_tokens_per_request - requests in flight.

    The highest score wins: a worker holding 1,000 more tokens of the prompt than another keeps the
    request until it has 1,000 / N more requests in flight. On a tie (typically nobody holds the
    prefix and loads are equal) the worker that remembers the fewest chunks wins, so new prefixes
    spread over the workers instead of piling onto the first."""

    def __init__(self, prefix_tokens_per_request: float) -> None:
        self.prefix_tokens_per_request = prefix_tokens_per_request

    def choose(self, workers: Sequence[Worker], prefix_tokens: Sequence[float]) -> int:
        def rank(i: int) -> tuple[float, int]:
            w = workers[i]
            return prefix_tokens[i] / self.prefix_tokens_per_request - w.in_flight, -len(w.index)

        return max(range(len(workers)), key=rank)


def make_policy(name: str, prefix_tokens_per_request: float) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "cache_aware":
        return CacheAware(prefix_tokens_per_request)
    raise ValueError(f"unknown routing policy {name!r}")
