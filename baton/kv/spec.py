"""What KV memory a model needs: layer kinds, the groups they form, and how a budget is split."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

STATE_DTYPE = torch.float32  # recurrent state accumulates over the whole sequence: kept in float32


@dataclass(frozen=True)
class LayerKind:
    """`full` layers attend to every earlier position; `sliding` ones to the last `window` (self
    included); `mla` ones to every earlier position through one compressed latent of `latent_dim`
    per token, followed in the same cache row by the key of the layer's sparse-attention indexer
    where it has one (`index_dim`: DeepSeek-V3.2, GLM-5); `pooled` ones one key of `latent_dim`
    per `pool` tokens (GLM-5.3-Flash's pooled indexer keys: a block of block_size tokens holds
    block_size / pool rows); `recurrent` ones keep no per-token cache, only fixed-size state tensors
    of `state_shapes` (e.g. a conv window and a delta-rule or SSM state)."""

    name: str
    window: int | None = None
    latent_dim: int | None = None
    index_dim: int = 0
    pool: int = 1
    state_shapes: tuple[tuple[int, ...], ...] = ()

    @staticmethod
    def full() -> LayerKind:
        return LayerKind("full")

    @staticmethod
    def sliding(window: int) -> LayerKind:
        if window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        return LayerKind("sliding", window)

    @staticmethod
    def mla(latent_dim: int, index_dim: int = 0) -> LayerKind:
        if latent_dim < 1 or index_dim < 0:
            raise ValueError(f"an MLA layer needs latent_dim >= 1 and index_dim >= 0, got {latent_dim}, {index_dim}")
        return LayerKind("mla", latent_dim=latent_dim, index_dim=index_dim)

    @staticmethod
    def pooled(dim: int, pool: int) -> LayerKind:
        if dim < 1 or pool < 1:
            raise ValueError(f"a pooled layer needs dim >= 1 and pool >= 1, got {dim}, {pool}")
        return LayerKind("pooled", latent_dim=dim, pool=pool)

    @property
    def row_dim(self) -> int | None:
        """A one-head layer's cache row: an MLA latent, then its indexer key; a pooled key."""
        return None if self.latent_dim is None else self.latent_dim + self.index_dim

    @staticmethod
    def none() -> LayerKind:
        """A layer with no KV cache and no state (an MLP- or MoE-only block): in no group."""
        return LayerKind("none")

    @staticmethod
    def recurrent(*state_shapes: tuple[int, ...]) -> LayerKind:
        if not state_shapes or any(d < 1 for s in state_shapes for d in s):
            raise ValueError(f"a recurrent layer needs non-empty state shapes, got {state_shapes}")
        return LayerKind("recurrent", state_shapes=tuple(tuple(s) for s in state_shapes))

    @property
    def is_sliding(self) -> bool:
        return self.name == "sliding"

    @property
    def is_recurrent(self) -> bool:
        return self.name == "recurrent"

    @property
    def is_mla(self) -> bool:
        return self.name == "mla"

    @property
    def is_pooled(self) -> bool:
        return self.name == "pooled"

    @property
    def has_latent(self) -> bool:
        """K alone, one head: MLA latents and pooled keys."""
        return self.name in ("mla", "pooled")

    @property
    def is_none(self) -> bool:
        return self.name == "none"


@dataclass(frozen=True)
class KVGroup:
    """Paged layers of one kind and KV geometry; they share block tables and one storage tensor.
    An MLA group stores one row per token in K (head_dim = latent_dim + index_dim, one head) and no
    V; a pooled group one row per pool of tokens."""

    group_id: int
    kind: LayerKind
    layer_ids: tuple[int, ...]
    num_kv_heads: int
    head_dim: int

    @property
    def v_head_dim(self) -> int:
        return 0 if self.kind.has_latent else self.head_dim

    def rows_per_block(self, block_size: int) -> int:
        """Cache rows of one block: a row per token, or per pool of tokens."""
        return block_size // self.kind.pool

    def cache_rows(self, blocks, positions, block_size: int):
        """The cache row of each position in its block (numpy or torch alike): a pooled group's row
        is its pool's."""
        return blocks * self.rows_per_block(block_size) + positions % block_size // self.kind.pool

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        per_layer = self.rows_per_block(block_size) * self.num_kv_heads * (self.head_dim + self.v_head_dim) * elem
        if dtype == torch.float8_e4m3fn:  # a float32 K and V scale per KV head
            per_layer += 2 * self.num_kv_heads * 4
        return len(self.layer_ids) * per_layer

    def blocks_per_request(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Most blocks one request of `num_tokens` tokens can hold, prefilled `chunk` tokens at a time."""
        if not self.kind.is_sliding:
            return math.ceil(num_tokens / block_size)
        span = min(num_tokens, self.kind.window - 1 + min(chunk, num_tokens))
        return min(math.ceil(num_tokens / block_size), math.ceil(span / block_size) + 1)


@dataclass(frozen=True)
class StateGroup:
    """Recurrent layers with the same state shapes: one running slot per request holds all of them,
    one checkpoint holds all of them at one position."""

    group_id: int
    kind: LayerKind
    layer_ids: tuple[int, ...]

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return self.kind.state_shapes

    def bytes_per_slot(self) -> int:
        return len(self.layer_ids) * sum(math.prod(s) for s in self.state_shapes) * STATE_DTYPE.itemsize


@dataclass(frozen=True)
class KVSpec:
    groups: tuple[KVGroup, ...]  # paged groups: full, sliding, mla
    layer_to_group: tuple[tuple[int, int] | None, ...]  # layer id -> (group, index in group); None: recurrent, none
    block_size: int
    state_groups: tuple[StateGroup, ...] = ()
    layer_to_state: tuple[tuple[int, int] | None, ...] = ()  # layer id -> (state group, index in group)

    @property
    def has_state(self) -> bool:
        return bool(self.state_groups)

    def state_bytes_per_slot(self) -> int:
        return sum(g.bytes_per_slot() for g in self.state_groups)

    @staticmethod
    def build(layer_kinds: list[LayerKind], num_kv_heads: int, head_dim: int, block_size: int) -> KVSpec:
        by_kind: dict[LayerKind, list[int]] = {}
        for layer_id, kind in enumerate(layer_kinds):
            by_kind.setdefault(kind, []).append(layer_id)
        paged = [(k, ids) for k, ids in by_kind.items() if not k.is_recurrent and not k.is_none]
        for kind, _ in paged:
            if block_size % kind.pool:
                raise ValueError(
                    f"block_size {block_size} must be a multiple of the pool size {kind.pool} (index_kpool)"
                )
        groups = tuple(
            KVGroup(gid, kind, tuple(ids), 1 if kind.has_latent else num_kv_heads, kind.row_dim or head_dim)
            for gid, (kind, ids) in enumerate(paged)
        )
        state_groups = tuple(
            StateGroup(gid, kind, tuple(ids))
            for gid, (kind, ids) in enumerate((k, ids) for k, ids in by_kind.items() if k.is_recurrent)
        )
        mapping: list[tuple[int, int] | None] = [None] * len(layer_kinds)
        for g in groups:
            for idx, layer_id in enumerate(g.layer_ids):
                mapping[layer_id] = (g.group_id, idx)
        state_mapping: list[tuple[int, int] | None] = [None] * len(layer_kinds)
        for sg in state_groups:
            for idx, layer_id in enumerate(sg.layer_ids):
                state_mapping[layer_id] = (sg.group_id, idx)
        return KVSpec(groups, tuple(mapping), block_size, state_groups, tuple(state_mapping))


@dataclass(frozen=True)
class PoolSizes:
    blocks: list[int]  # per paged group
    num_state_slots: int  # running requests' recurrent state (0 without recurrent layers)
    num_checkpoints: int  # state checkpoints kept for prefix caching


MAX_CHECKPOINT_INTERVAL = 256  # tokens: the sparsest default grid of state checkpoints


def checkpoint_interval(spec: KVSpec, dtype: torch.dtype, configured: int | None) -> int:
    """Tokens between the grid checkpoints of a model's recurrent state: `configured`, else the
    largest power-of-two number of blocks whose KV takes no more bytes than one checkpoint (laid
    that often, checkpoints take one to two times the bytes of the KV they save recomputing: a
    small state is kept at every few blocks, so a prefix two prompts share resumes at its last
    block from the second prompt on), but at least a block and at most 256 tokens (rounded up to
    a block) apart."""
    bs = spec.block_size
    if configured:
        return configured
    longest = -(-MAX_CHECKPOINT_INTERVAL // bs) * bs
    kv_per_token = sum(g.bytes_per_block(bs, dtype) for g in spec.groups) / bs
    blocks = 1
    while (2 * blocks * bs) * kv_per_token <= spec.state_bytes_per_slot() and 2 * blocks * bs <= longest:
        blocks *= 2
    return min(blocks * bs, longest)


def size_kv_pools(
    spec: KVSpec,
    dtype: torch.dtype,
    budget_bytes: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    checkpoint_fraction: float = 0.25,
) -> PoolSizes:
    """Blocks per group, state slots and checkpoints for a byte budget. Pure: no model, no tensors.

    Recurrent state is constant per request: every one of `max_num_seqs` running requests gets a
    slot first, then checkpoints get `checkpoint_fraction` of what is left. Sliding groups scale
    with in-flight requests (each holds about a window), full and MLA groups with history: sliding
    groups get what `max_num_seqs` concurrent requests need, but never more than their share of
    bytes per token, and full groups get the rest.
    """
    bs = spec.block_size
    num_slots = num_ckpts = 0
    if spec.has_state:
        slot_bytes = spec.state_bytes_per_slot()
        num_slots = max_num_seqs
        budget_bytes -= num_slots * slot_bytes
        if budget_bytes <= 0:
            raise ValueError(
                f"the KV budget does not hold the recurrent state of {max_num_seqs} requests "
                f"({slot_bytes} bytes each): raise kv_cache_memory_bytes or lower max_num_seqs"
            )
        num_ckpts = max(1, int(budget_bytes * checkpoint_fraction // slot_bytes))
        budget_bytes -= num_ckpts * slot_bytes
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
    return PoolSizes(blocks, num_slots, num_ckpts)
