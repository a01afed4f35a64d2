"""What the router believes a worker's prefix cache holds: a shadow index over request text.

A request's text (`request_text`) is cut into fixed-size character chunks, each hashed chained
with the one before (`chunk_hashes`), as the engine keys KV blocks: a chunk's hash names the whole
prefix that ends with it, so the set of hashes a worker holds is a trie of prefixes, each node
named by its path. A worker's longest usable prefix is the count of a request's leading hashes it
holds. Each index is bounded: past its capacity the least recently used chunks are forgotten,
tails before heads (a request touches its chunks last to first), as a worker's own LRU evicts."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence

import xxhash


def request_text(endpoint: str, body: dict) -> str:
    """A canonical text of what a request's prompt is made from, prefix-stable: a chat that appends
    messages gets a text that extends the earlier one. Malformed shapes give "" (the worker will
    refuse them; the router only needs not to fail)."""
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        tools = body.get("tools")
        # tools are rendered ahead of the conversation by chat templates
        head = json.dumps(tools, sort_keys=True, separators=(",", ":")) + "\n" if tools else ""
        return head + "".join(json.dumps(m, sort_keys=True, separators=(",", ":")) + "\n" for m in messages)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    # a token list "[1,2,3" is a prefix of "[1,2,3,4]" up to the last bracket
    return json.dumps(prompt, separators=(",", ":")) if prompt is not None else ""


def chunk_hashes(text: str, chunk_chars: int, limit: int | None = None) -> list[int]:
    """Chained hashes of the text's full chunks (a partial tail is never matched, like a partial
    block), at most `limit` of them: no index holds more than its capacity."""
    hashes, h = [], 0
    end = len(text) - chunk_chars + 1 if limit is None else min(len(text) - chunk_chars + 1, limit * chunk_chars)
    for start in range(0, end, chunk_chars):
        h = xxhash.xxh3_64_intdigest(text[start : start + chunk_chars].encode("utf-8", "surrogatepass"), seed=h)
        hashes.append(h)
    return hashes


class PrefixIndex:
    """One worker's shadow prefix cache: chained chunk hashes in LRU order, at most `capacity` of them."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading chunks of the request this worker holds."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        """The worker is about to compute (or reuse) this prefix: it becomes the most recently used,
        its head most of all, and the least recently used chunks beyond capacity are forgotten."""
        lru = self._lru
        for h in reversed(hashes[: self.capacity]):  # a prompt longer than the capacity keeps its head
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def clear(self) -> None:
        self._lru.clear()
