"""A model's cache memory, built from the config: the KV spec, the pools' sizes, the KV manager,
the KV and recurrent-state tensors, the longest request that fits, and the startup log of it."""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass

import torch

from baton.config import CacheConfig, SchedulerConfig
from baton.kv.manager import KVManager
from baton.kv.spec import KVSpec, checkpoint_interval, size_kv_pools
from baton.kv.state import StateStorage
from baton.kv.storage import KVStorage
from baton.models.model_config import TextModelConfig

logger = logging.getLogger(__name__)


@dataclass
class CacheMemory:
    spec: KVSpec
    kv: KVManager
    storage: KVStorage
    states: StateStorage
    max_model_len: int


def build_cache_memory(
    mc: TextModelConfig,
    cache: CacheConfig,
    sched: SchedulerConfig,
    kv_dtype: torch.dtype,
    drafts_per_slot: int = 0,
    layers: Collection[int] | None = None,
) -> CacheMemory:
    """`drafts_per_slot`: speculative decoding's k (recurrent layers keep a state per verified draft).
    `layers`: a pipeline stage's cache layers; it holds their share of the pools, its budget's worth."""
    spec = KVSpec.build(mc.layer_kinds, mc.num_kv_heads, mc.head_dim, cache.block_size)
    share = 1.0 if layers is None else len([i for i in layers if i < mc.num_layers]) / mc.num_layers
    sizes = size_kv_pools(
        spec,
        kv_dtype,
        int(cache.kv_cache_memory_bytes / share),
        sched.max_num_seqs,
        sched.max_num_batched_tokens,
        cache.state_checkpoint_fraction,
    )
    num_blocks = sizes.blocks if cache.num_kv_blocks is None else [cache.num_kv_blocks] * len(spec.groups)
    num_checkpoints = sizes.num_checkpoints if cache.enable_prefix_caching else 0
    kv = KVManager(
        spec,
        num_blocks,
        cache.enable_prefix_caching,
        sizes.num_state_slots,
        num_checkpoints,
        checkpoint_interval(spec, kv_dtype, cache.state_checkpoint_interval),
    )
    max_len = fit_max_model_len(kv, sched, mc.max_position_embeddings)
    memory = CacheMemory(
        spec,
        kv,
        KVStorage(spec, num_blocks, kv_dtype, cache.kv_layout, layers=layers),
        StateStorage(spec, sizes.num_state_slots, num_checkpoints, drafts_per_slot=drafts_per_slot, layers=layers),
        max_len,
    )
    _log(memory, cache)
    return memory


def fit_max_model_len(kv: KVManager, sched: SchedulerConfig, model_max: int) -> int:
    """The configured max_model_len if one request of it fits (ValueError if not), else the longest
    power-of-two fraction of the model's that does."""
    chunk = sched.max_num_batched_tokens
    wanted = sched.max_model_len
    if wanted is not None:
        if not kv.can_ever_fit(wanted, chunk):
            raise ValueError(
                f"max_model_len={wanted} needs {kv.max_request_blocks(wanted, chunk)} blocks per KV group, "
                f"but the KV budget gives {[p.num_blocks for p in kv.pools]}: "
                "raise kv_cache_memory_bytes / num_kv_blocks or lower max_model_len"
            )
        return wanted
    length = model_max
    while length > 2 and not kv.can_ever_fit(length, chunk):
        length //= 2
    return length


def _bytes_per_token(spec: KVSpec, dtype: torch.dtype) -> dict[str, float]:
    """A token's KV bytes by part: attention K/V, MLA latents, sparse-attention indexer keys (an
    MLA row's share of its group's bytes, or a pooled group's; fp8 scales included)."""
    parts: dict[str, float] = {}
    for g in spec.groups:
        per_token = g.bytes_per_block(spec.block_size, dtype) / spec.block_size
        if g.kind.is_pooled:
            parts["indexer"] = parts.get("indexer", 0) + per_token
            continue
        if not g.kind.is_mla:
            parts["attention"] = parts.get("attention", 0) + per_token
            continue
        index_share = g.kind.index_dim / g.head_dim
        parts["mla"] = parts.get("mla", 0) + per_token * (1 - index_share)
        if g.kind.index_dim:
            parts["indexer"] = parts.get("indexer", 0) + per_token * index_share
    return parts


def _log(memory: CacheMemory, cache: CacheConfig) -> None:
    spec, kv = memory.spec, memory.kv
    logger.info(
        "KV cache: %s blocks of %d tokens per group (%s), %.1f MiB; max_model_len %d; bytes per token: %s",
        [p.num_blocks for p in kv.pools],
        cache.block_size,
        ", ".join(f"{g.kind.name}x{len(g.layer_ids)}" for g in spec.groups),
        memory.storage.nbytes() / 2**20,
        memory.max_model_len,
        ", ".join(f"{part} {n:g}" for part, n in _bytes_per_token(spec, memory.storage.dtype).items()),
    )
    if spec.has_state:
        logger.info(
            "recurrent state: %d layers, %.2f MiB per request; %d running slots, %d checkpoints (%.1f MiB) "
            "every %d tokens; the smallest prefix that can be shared is %d tokens (one block)",
            sum(len(g.layer_ids) for g in spec.state_groups),
            spec.state_bytes_per_slot() / 2**20,
            kv.num_state_slots,
            kv.checkpoints.num_checkpoints,
            memory.states.nbytes() / 2**20,
            kv.checkpoint_interval,
            cache.block_size,
        )
