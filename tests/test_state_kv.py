"""Recurrent state in the KV manager, without a model: sizing, checkpoints and the resumable prefix."""

from __future__ import annotations

import pytest
import torch

from baton.kv.manager import KVManager
from baton.kv.prefix import resumable_prefix
from baton.kv.spec import KVSpec, LayerKind, size_kv_pools

FULL = LayerKind.full()
RECURRENT = LayerKind.recurrent((6, 3), (2, 4, 4))  # (conv window, delta state): 18 + 32 floats


def hybrid(block_size: int = 4) -> KVSpec:
    return KVSpec.build([RECURRENT, RECURRENT, FULL], num_kv_heads=1, head_dim=4, block_size=block_size)


def test_spec_keeps_recurrent_layers_out_of_the_paged_groups():
    spec = hybrid()
    assert [g.layer_ids for g in spec.groups] == [(2,)] and [g.layer_ids for g in spec.state_groups] == [(0, 1)]
    assert spec.layer_to_group == (None, None, (0, 0)) and spec.layer_to_state == ((0, 0), (0, 1), None)
    assert spec.state_bytes_per_slot() == 2 * (18 + 32) * 4


def test_sizing_gives_every_running_request_a_slot_then_checkpoints_then_blocks():
    spec = hybrid()
    slot = spec.state_bytes_per_slot()  # 400 bytes
    block = spec.groups[0].bytes_per_block(4, torch.float32)  # 2 * 4 tokens * 4 dims * 4 bytes = 128
    sizes = size_kv_pools(spec, torch.float32, 4 * slot + 4000, max_num_seqs=4, max_num_batched_tokens=8)
    assert sizes.num_state_slots == 4
    assert sizes.num_checkpoints == 1000 // slot  # a quarter of what is left after the slots: 2
    assert sizes.blocks == [(4000 - 2 * slot) // block]
    with pytest.raises(ValueError, match="recurrent state of 4 requests"):
        size_kv_pools(spec, torch.float32, 4 * slot, 4, 8)


def _run(kv: KVManager, rid: str, tokens: list[int]) -> list[tuple[int, int]]:
    """Prefill `tokens` in one step; the checkpoints it recorded, as (position, id)."""
    assert kv.allocate_slots(rid, tokens, 0, len(tokens))
    assert kv.pop_restore(rid) == (kv.state_slots[rid], None)  # a cold start: zeros
    planned = list(kv.pending_snapshots.get(rid, []))
    kv.cache_blocks(rid, tokens, len(tokens))
    kv.free(rid)
    return planned


def test_checkpoints_on_the_grid_and_at_the_prompts_last_boundary_decide_the_hit():
    kv = KVManager(hybrid(), [64], num_state_slots=2, num_checkpoints=8, checkpoint_interval=8)
    tokens = list(range(100, 122))  # 22 tokens: grid at 8, 16; the prompt's last boundary at 20
    assert [p for p, _ in _run(kv, "a", tokens)] == [8, 16, 20]
    hit = kv.find_cached_prefix("b", tokens + [7, 7])
    assert (hit.num_tokens, hit.kv_tokens) == (20, 20)
    # diverging at 14: the KV matches 12 tokens, the deepest checkpoint below is at 8
    hit = kv.find_cached_prefix("c", tokens[:14] + [9] * 10)
    assert (hit.num_tokens, hit.kv_tokens) == (8, 12)
    assert kv.allocate_slots("c", tokens[:14] + [9] * 10, 0, 16, num_cached_tokens=8)
    assert kv.pop_restore("c") == (kv.state_slots["c"], hit.checkpoint_id)
    # 12: the divergence point; 20 the last boundary below the prompt's end; 24 its end (rolling)
    assert [p for p, _ in kv.pending_snapshots["c"]] == [12, 16, 20, 24]
    kv.cache_blocks("c", tokens[:14] + [9] * 10, 24)
    kv.free("c")
    assert kv.find_cached_prefix("d", tokens[:12] + [5] * 9).num_tokens == 12
    assert kv.all_free()


def test_evicting_a_checkpoint_releases_the_blocks_only_it_made_resumable():
    kv = KVManager(hybrid(), [64], num_state_slots=2, num_checkpoints=1, checkpoint_interval=0)
    a = list(range(100, 113))
    _run(kv, "a", a)
    assert kv.find_cached_prefix("x", a + [1]).num_tokens == 12
    pool = kv.pools[0]
    assert len(pool.hash_to_block) == 3
    _run(kv, "b", list(range(200, 213)))  # its checkpoint takes the only one: a's is evicted
    hit = kv.find_cached_prefix("y", a + [1])
    assert (hit.num_tokens, hit.kv_tokens) == (0, 0)  # a's blocks went with its checkpoint
    assert len(pool.hash_to_block) == 3 and pool.num_free == 64  # b's three blocks, all free
    assert kv.find_cached_prefix("z", list(range(200, 213)) + [1]).num_tokens == 12


def test_the_resumable_prefix_needs_every_group_at_once():
    spec = hybrid()
    has_state = {8}.__contains__
    everything = lambda g, lo, hi: True  # noqa: E731
    assert resumable_prefix(spec, [4, 8, 12], everything, has_state) == 8
    assert resumable_prefix(spec, [4, 8, 12], lambda g, lo, hi: hi <= 4, has_state) == 0
    assert resumable_prefix(spec, [4, 8, 12], everything, lambda n: False) == 0


def test_a_running_requests_rolling_checkpoint_evicted_under_it_is_not_freed_twice():
    kv = KVManager(hybrid(), [64], num_state_slots=3, num_checkpoints=2, checkpoint_interval=0)
    r = list(range(100, 113))
    assert kv.allocate_slots("r", r, 0, 13)
    kv.cache_blocks("r", r, 13)  # checkpoint at 12, the prompt's last boundary
    for t in range(3):  # decode to 16: a rolling checkpoint there
        r.append(7)
        assert kv.allocate_slots("r", r, 13 + t, 1)
        kv.cache_blocks("r", r, 14 + t)
    _run(kv, "s", list(range(200, 213)))  # evicts r's checkpoint at 12
    t_tokens = list(range(300, 313))
    _run(kv, "t", t_tokens)  # evicts r's rolling checkpoint at 16
    r.append(7)
    assert kv.allocate_slots("r", r, 16, 1) and kv.allocate_slots("r", r + [7] * 3, 17, 3)
    kv.cache_blocks("r", r + [7] * 3, 20)  # a rolling checkpoint at 20 replaces r's latest: not t's
    assert kv.find_cached_prefix("u", t_tokens + [1]).num_tokens == 12
    kv.free("r")
    assert kv.all_free()
