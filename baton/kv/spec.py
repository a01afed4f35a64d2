"""What KV memory a model needs: layer kinds, the groups they form, and how a budget is split."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerKind:
    """`full` layers attend to every earlier position; `sliding` ones to the last `window` (self included)."""

    name: str
    window: int | None = None

    @staticmethod
    def full() -> LayerKind:
        return LayerKind("full")

    @staticmethod
    def sliding(window: int) -> LayerKind:
        if window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        return LayerKind("sliding", window)

    @property
    def is_sliding(self) -> bool:
        return self.name == "sliding"


@dataclass(frozen=True)
class KVGroup:
    """Layers of one kind and KV geometry; they share block tables and one storage tensor."""

    group_id: int
    kind: LayerKind
    layer_ids: tuple[int, ...]
    num_kv_heads: int
    head_dim: int

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * len(self.layer_ids) * block_size * self.num_kv_heads * self.head_dim * elem

    def blocks_per_request(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Most blocks one request of `num_tokens` tokens can hold, prefilled `chunk` tokens at a time."""
        if not self.kind.is_sliding:
            return math.ceil(num_tokens / block_size)
        span = min(num_tokens, self.kind.window - 1 + min(chunk, num_tokens))
        return min(math.ceil(num_tokens / block_size), math.ceil(span / block_size) + 1)


@dataclass(frozen=True)
class KVSpec:
    groups: tuple[KVGroup, ...]
    layer_to_group: tuple[tuple[int, int], ...]  # layer id -> (group id, index inside the group)
    block_size: int

    @staticmethod
    def build(layer_kinds: list[LayerKind], num_kv_heads: int, head_dim: int, block_size: int) -> KVSpec:
        by_kind: dict[LayerKind, list[int]] = {}
        for layer_id, kind in enumerate(layer_kinds):
            by_kind.setdefault(kind, []).append(layer_id)
        groups = tuple(
            KVGroup(gid, kind, tuple(ids), num_kv_heads, head_dim) for gid, (kind, ids) in enumerate(by_kind.items())
        )
        mapping = [(0, 0)] * len(layer_kinds)
        for g in groups:
            for idx, layer_id in enumerate(g.layer_ids):
                mapping[layer_id] = (g.group_id, idx)
        return KVSpec(groups, tuple(mapping), block_size)


def size_kv_pools(
    spec: KVSpec,
    dtype: torch.dtype,
    budget_bytes: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> list[int]:
    """Blocks per group for a byte budget. Pure: no model, no tensors allocated.

    Sliding groups scale with in-flight requests (each holds about a window), full groups with
    history: sliding groups get what `max_num_seqs` concurrent requests need, but never more than
    their share of bytes per token, and full groups get the rest.
    """
    bs = spec.block_size
    sliding = [g for g in spec.groups if g.kind.is_sliding]
    full = [g for g in spec.groups if not g.kind.is_sliding]
    per_token = {g.group_id: g.bytes_per_block(bs, dtype) / bs for g in spec.groups}
    total_per_token = sum(per_token.values())
    blocks = [0] * len(spec.groups)
    left = budget_bytes
    for g in sliding:
        need = max_num_seqs * (math.ceil((g.kind.window - 1) / bs) + 2) + math.ceil(max_num_batched_tokens / bs)
        share = budget_bytes if not full else budget_bytes * per_token[g.group_id] / total_per_token
        bpb = g.bytes_per_block(bs, dtype)
        blocks[g.group_id] = max(1, min(need, int(share // bpb)))
        left -= blocks[g.group_id] * bpb
    if full:
        full_per_token = sum(per_token[g.group_id] for g in full)
        num_tokens = max(0, left) / full_per_token
        for g in full:
            blocks[g.group_id] = max(1, int(num_tokens // bs))
    return blocks
