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


def test_a_checkpoint_superseded_on_its_path_is_evicted_first_unless_several_requests_used_it():
    """A chat with a shared system prompt: the prompt's end is resumed by two conversations and
    stays; each conversation's grid checkpoint, superseded by its own turn's end, goes first."""
    kv = KVManager(hybrid(), [256], num_state_slots=2, num_checkpoints=5, checkpoint_interval=8)
    system = list(range(100, 116))  # 16 tokens: its checkpoint at 16 (the grid's and the last boundary)
    assert [p for p, _ in _run(kv, "warm", system + [0])] == [8, 16]
    conversations = {}
    for name, start in (("a", 200), ("b", 300)):
        prompt = system + list(range(start, start + 13))  # 29 tokens: 24 on the grid, 28 the last boundary
        hit = kv.find_cached_prefix(name, prompt)
        assert hit.num_tokens == 16  # both resume from the system prompt's end
        assert kv.allocate_slots(name, prompt, 0, len(prompt) - 16, num_cached_tokens=16)
        kv.pop_restore(name)
        assert [p for p, _ in kv.pending_snapshots[name]] == [24, 28]
        kv.cache_blocks(name, prompt, len(prompt))
        kv.free(name)
        conversations[name] = prompt
    # five checkpoints: 8, 16 (used twice), a's 24 (superseded by its 28) and 28, b's 24 and 28 are
    # six; the pool holds five, so one went: the least recently used of the superseded, 8 or a's 24
    pool = kv.checkpoints
    held = sorted(pool.entries[c].num_tokens for c in pool.hash_to_id.values())
    assert held.count(16) == 1 and held.count(28) == 2
    # a third conversation evicts another superseded one, never a turn's end or the shared prompt
    third = system + list(range(400, 413))
    assert kv.find_cached_prefix("c", third).num_tokens == 16
    assert kv.allocate_slots("c", third, 0, len(third) - 16, num_cached_tokens=16)
    kv.pop_restore("c")
    kv.cache_blocks("c", third, len(third))
    kv.free("c")
    for name, prompt in conversations.items():  # each next turn still resumes at its previous end
        assert kv.find_cached_prefix(name + "2", prompt + [5, 5, 5]).num_tokens == 28
    assert kv.find_cached_prefix("d", system + [9] * 5).num_tokens == 16
    assert kv.all_free()


def test_a_decodes_rolling_checkpoint_does_not_push_out_its_prompts_end():
    """The next turn of a chat may carry another reply than the one generated (a client holding the
    history): it resumes at the prompt's last boundary, which the decode's rolling checkpoint past
    it must not put first in line for eviction."""
    kv = KVManager(hybrid(), [256], num_state_slots=2, num_checkpoints=3, checkpoint_interval=0)
    prompt = list(range(100, 113))  # its last boundary: 12
    assert kv.allocate_slots("a", prompt, 0, 13)
    kv.cache_blocks("a", prompt, 13)
    tokens = list(prompt)
    for t in range(4):  # decode to 17: a rolling checkpoint at 16
        tokens.append(7)
        assert kv.allocate_slots("a", tokens, 13 + t, 1)
        kv.cache_blocks("a", tokens, 14 + t)
    kv.free("a")
    _run(kv, "b", list(range(200, 213)))  # a third checkpoint: the pool is full
    _run(kv, "c", list(range(300, 313)))  # evicts the least recently used: a's rolling one at 16
    assert kv.find_cached_prefix("a2", prompt + [9] * 5).num_tokens == 12
    assert kv.find_cached_prefix("a3", tokens + [9]).num_tokens == 12
    assert kv.all_free()
