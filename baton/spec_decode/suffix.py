"""Suffix decoding (vLLM's `suffix` method), model-free: the drafts continue the request's latest
tokens the way they were most often continued before, in its own prompt and output and in the
outputs of recent requests with the same cache salt.

The suffix tree is walked without being built: the places where the request's last n tokens
occurred (n as long as any occurrence allows, up to max_depth) are the tree's node, their next
tokens its children with their counts. The most frequent child is drafted while its share of the
node is at least min_token_prob, and the node moves to the occurrences that continued with it.
A step's drafts are at most max_spec_factor times the match length (a short match is weak
evidence). Every draft is verified, so outputs are those of plain decoding."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from baton.config import SpeculativeConfig
from baton.engine.request import Request

SEPARATOR = -1  # between requests in a recent-outputs buffer: no match runs across two
MAX_SALTS = 256  # recent outputs kept for this many cache salts, the least recently used dropped


class RecentOutputs:
    """The outputs of the most recent finished requests of one cache salt, at most `max_tokens`
    in all (the oldest dropped first), as one array with SEPARATOR between them."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.outputs: OrderedDict[str, np.ndarray] = OrderedDict()
        self.num_tokens = 0
        self._buffer: np.ndarray | None = None

    def add(self, request_id: str, tokens: list[int]) -> None:
        if not tokens or len(tokens) > self.max_tokens:
            return
        self.outputs[request_id] = np.asarray(tokens, dtype=np.int64)
        self.num_tokens += len(tokens)
        while self.num_tokens > self.max_tokens:
            _, dropped = self.outputs.popitem(last=False)
            self.num_tokens -= dropped.size
        self._buffer = None

    @property
    def buffer(self) -> np.ndarray:
        if self._buffer is None:
            parts = []
            for tokens in self.outputs.values():
                parts += [tokens, np.array([SEPARATOR], dtype=np.int64)]
            self._buffer = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return self._buffer


def longest_match(source: np.ndarray, suffix: np.ndarray, max_depth: int) -> tuple[int, np.ndarray]:
    """(n, ends): the longest n <= max_depth such that suffix's last n tokens occur in source,
    ending at positions `ends` that some token follows; (0, []) when not even the last one does."""
    if not source.size or not suffix.size:
        return 0, np.empty(0, dtype=np.int64)
    ends = np.flatnonzero(source[:-1] == suffix[-1])
    n = 1 if ends.size else 0
    while ends.size and n < min(max_depth, suffix.size):
        longer = ends[ends >= n]
        longer = longer[source[longer - n] == suffix[-n - 1]]
        if not longer.size:
            break
        ends, n = longer, n + 1
    return n, ends


def walk(sources: list[tuple[np.ndarray, np.ndarray]], k: int, min_token_prob: float) -> list[int]:
    """Up to k tokens down the tree from the nodes `sources` ((array, match ends) pairs, counted
    together): the most frequent next token while its share is at least min_token_prob."""
    drafts: list[int] = []
    while len(drafts) < k:
        nexts = [(array, ends[ends + 1 < array.size]) for array, ends in sources]
        followers = np.concatenate([array[ends + 1] for array, ends in nexts])
        followers = followers[followers != SEPARATOR]
        if not followers.size:
            break
        values, counts = np.unique(followers, return_counts=True)
        best = int(np.argmax(counts))  # ties: the smallest token id
        if counts[best] < min_token_prob * followers.size:
            break
        token = int(values[best])
        drafts.append(token)
        sources = [(array, ends[array[ends + 1] == token] + 1) for array, ends in nexts]
    return drafts


class SuffixProposer:
    """The drafter of the `suffix` method: SpecDecoder calls propose and release as it does a
    draft model's."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.requests: dict[str, Request] = {}  # requests it drafted for and has not yet released
        # by cache salt: one tenant never drafts from (nor times its drafts against) another's outputs
        self.recent: OrderedDict[bytes, RecentOutputs] = OrderedDict()

    def observe(self, running: list[Request]) -> None:
        """Every running request, drafted for or not: its output joins the recent ones when it ends."""
        for req in running:
            self.requests[req.request_id] = req

    def propose(self, wanted: list[tuple[Request, int]]) -> list[list[int]]:
        return [self._propose(req, k) for req, k in wanted]

    def _propose(self, req: Request, k: int) -> list[int]:
        c = self.config
        own = np.asarray(req.token_ids, dtype=np.int64)
        suffix = own[-c.suffix_max_depth :]
        matches = [(own, *longest_match(own, suffix, c.suffix_max_depth))]
        recent = self.recent.get(req.cache_salt)
        if recent is not None and recent.outputs:
            matches.append((recent.buffer, *longest_match(recent.buffer, suffix, c.suffix_max_depth)))
        n = max(m for _, m, _ in matches)
        if n == 0:
            return []
        limit = min(k, max(1, int(c.suffix_max_spec_factor * n)))
        return walk([(array, ends) for array, m, ends in matches if m == n], limit, c.suffix_min_token_prob)

    def release(self, live: set[str]) -> None:
        """Requests gone from the engine: their outputs join the recent ones of their salt."""
        for rid in [rid for rid in self.requests if rid not in live]:
            req = self.requests.pop(rid)
            recent = self.recent.pop(req.cache_salt, None) or RecentOutputs(self.config.suffix_cache_tokens)
            recent.add(rid, req.output_token_ids)
            self.recent[req.cache_salt] = recent  # the most recently used last
            while len(self.recent) > MAX_SALTS:
                self.recent.popitem(last=False)
