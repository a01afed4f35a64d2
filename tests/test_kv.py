"""KV manager, pool and sizing on their own: no model, expected values worked out by hand."""

from __future__ import annotations

import math

import torch

from baton.kv.manager import NULL_BLOCK, KVManager
from baton.kv.pool import BlockPool
from baton.kv.spec import KVSpec, LayerKind, size_kv_pools

FULL, SLIDE8 = LayerKind.full(), LayerKind.sliding(8)


def hybrid_manager(num_blocks=(32, 32), block_size=4) -> KVManager:
    spec = KVSpec.build([SLIDE8, SLIDE8, FULL], num_kv_heads=1, head_dim=4, block_size=block_size)
    return KVManager(spec, list(num_blocks))


def test_spec_groups_layers_by_kind():
    spec = KVSpec.build([SLIDE8, FULL, SLIDE8, FULL], 2, 8, 16)
    assert [(g.kind, g.layer_ids) for g in spec.groups] == [(SLIDE8, (0, 2)), (FULL, (1, 3))]
    assert spec.layer_to_group == ((0, 0), (1, 0), (0, 1), (1, 1))


def test_sizing_is_a_pure_split_by_what_each_group_scales_with():
    spec = KVSpec.build([SLIDE8, FULL], num_kv_heads=1, head_dim=4, block_size=4)
    # bytes per block per group: 2 (K,V) * 1 layer * 4 tokens * 1 head * 4 dims * 4 bytes = 128
    blocks = size_kv_pools(spec, torch.float32, budget_bytes=128 * 100, max_num_seqs=2, max_num_batched_tokens=8).blocks
    # sliding need: 2 seqs * (ceil(7/4) + 2) + ceil(8/4) = 10 blocks (< its half share of 50)
    assert blocks == [10, 90]
    # a budget too small for the need: sliding gets its bytes-per-token share (half) only
    assert size_kv_pools(spec, torch.float32, 128 * 12, 2, 8).blocks == [6, 6]
    full_only = KVSpec.build([FULL, FULL], 1, 4, 4)
    assert size_kv_pools(full_only, torch.float32, 256 * 10, 2, 8).blocks == [10]


def test_pool_hands_out_vacant_blocks_before_cached_ones_lru():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.publish(a[0], b"h0", None, (1,))
    pool.publish(a[1], b"h1", b"h0", (2,))
    pool.free([a[1], a[0]])  # tail first: h1 is evicted before h0
    assert pool.num_free == 4
    assert pool.lookup(b"h1", b"h0", (2,)) == a[1]
    assert pool.lookup(b"h1", b"h0", (3,)) is None  # verified against the tokens
    fresh = pool.allocate(3)
    assert set(fresh[:2]) == {2, 3}  # vacant ones first
    assert fresh[2] == a[1]  # then the least recently freed cached block
    assert pool.lookup(b"h1", b"h0", (2,)) is None and pool.lookup(b"h0", None, (1,)) == a[0]


def test_allocation_is_all_or_nothing():
    kv = hybrid_manager(num_blocks=(8, 3))
    tokens = list(range(20))
    assert not kv.allocate_slots("r", tokens, 0, 13)  # the full group needs 4 blocks, has 3
    assert kv.all_free() and "r" not in kv.block_tables
    assert kv.allocate_slots("r", tokens, 0, 12)
    assert [kv.num_free_blocks(g) for g in (0, 1)] == [5, 0]


def test_sliding_blocks_released_outside_the_window():
    kv = hybrid_manager()
    tokens = list(range(40))
    assert kv.allocate_slots("r", tokens, 0, 20)
    kv.remove_skipped_blocks("r", 20)
    # the next query is at position 20 and reads 13..20: blocks 0..2 (positions 0..11) are gone
    assert kv.block_tables["r"][0][:3] == [NULL_BLOCK] * 3
    assert NULL_BLOCK not in kv.block_tables["r"][0][3:]
    assert NULL_BLOCK not in kv.block_tables["r"][1]  # the full group keeps everything
    kv.free("r")
    assert kv.all_free()


def _run_and_cache(kv: KVManager, rid: str, tokens: list[int]) -> None:
    assert kv.allocate_slots(rid, tokens, 0, len(tokens))
    kv.cache_blocks(rid, tokens, len(tokens))
    kv.remove_skipped_blocks(rid, len(tokens))
    kv.free(rid)


def test_prefix_hit_requires_every_group_to_serve_the_window():
    kv = hybrid_manager(num_blocks=(64, 64))
    tokens = list(range(100, 124))  # 6 full blocks
    _run_and_cache(kv, "a", tokens)
    query = tokens + [7, 7, 7]
    assert kv.find_cached_prefix("b", query).num_tokens == 24  # everything is still cached
    # Evict the sliding group's block 3 (positions 12..15): a hit at 24 needs positions 17..23
    # (blocks 4, 5) only, so 24 still works; a hit at 20 would need block 3 and is not needed.
    sliding_pool = kv.pools[0]
    block3 = kv._lookup(0, 3, kv._block_hashes("b", query, b""), query)
    sliding_pool._forget(sliding_pool.blocks[block3])
    assert kv.find_cached_prefix("b", query).num_tokens == 24
    # Evict block 5 too: L=24 needs block 5; L=20 needs blocks 3,4 (13..19) -> block 3 gone;
    # L=16 needs blocks 2,3 -> gone; L=12 needs blocks 1,2 (positions 5..11) -> present.
    block5 = kv._lookup(0, 5, kv._block_hashes("b", query, b""), query)
    sliding_pool._forget(sliding_pool.blocks[block5])
    assert kv.find_cached_prefix("b", query).num_tokens == 12
    # The hit's table holds exactly what the window at 12 needs, and the rest comes fresh.
    assert kv.allocate_slots("b", query, 0, len(query) - 12, num_cached_tokens=12)
    table = kv.block_tables["b"][0]
    first = (12 - 8 + 1) // 4
    assert table[:first] == [NULL_BLOCK] * first and len(table) == math.ceil(len(query) / 4)


def test_prefix_hit_never_covers_the_last_token():
    kv = hybrid_manager()
    tokens = list(range(16))
    _run_and_cache(kv, "a", tokens)
    assert kv.find_cached_prefix("b", tokens).num_tokens == 12  # at least one token is computed for logits
