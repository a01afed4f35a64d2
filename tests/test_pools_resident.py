"""Where the engine's big buffers live. Pools cost memory as they fill: the KV and state pools read
as zeros and are resident only where written (a budget as large as llama-server's must not be RSS
at start). Weights a step reads whole share one huge-page arena."""

from __future__ import annotations

import torch

from baton.kv.spec import KVSpec, LayerKind
from baton.kv.state import StateStorage
from baton.kv.storage import pool_zeros
from baton.models.gguf_blocks import BlockTensor
from baton.models.layers import quantize_weight, regroup_on_huge_pages
from baton.ops import packed_linear

MIB = 1 << 20


def resident_bytes(t: torch.Tensor) -> int:
    """The resident bytes of the mapping that holds t's first byte (/proc/self/smaps)."""
    addr = t.data_ptr()
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= addr < end
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the tensor")


def test_a_pool_is_zero_and_resident_only_where_written():
    for huge_pages in (True, False):
        pool = pool_zeros((64, MIB // 4), torch.float32, "cpu", huge_pages=huge_pages)  # 64 MiB
        assert resident_bytes(pool) < 4 * MIB
        assert not pool[::7].any()  # reading maps the zero page, nothing becomes resident
        assert resident_bytes(pool) < 4 * MIB
        pool[3].fill_(1.0)  # one MiB written
        assert MIB <= resident_bytes(pool) < 6 * MIB
        assert pool[3].eq(1.0).all() and not pool[4].any()


def test_state_checkpoints_are_resident_only_once_taken():
    kinds = [LayerKind.recurrent((16, 128, 128), (96, 3)) for _ in range(4)]  # ~1 MiB a layer's state
    spec = KVSpec.build(kinds, num_kv_heads=1, head_dim=8, block_size=16)
    states = StateStorage(spec, num_slots=2, num_checkpoints=48)  # 4 layers x 48 checkpoints: 193 MiB
    checkpoints = states.checkpoints[0][0]
    assert checkpoints.shape == (4, 48, 16, 128, 128)
    assert resident_bytes(checkpoints) < 8 * MIB
    checkpoints[:, 5].fill_(2.0)  # one checkpoint taken: 4 MiB
    assert 4 * MIB <= resident_bytes(checkpoints) < 12 * MIB
    assert not checkpoints[:, 6].any() and not states.running[0][0].any()


def test_regrouped_blocks_share_one_arena_and_keep_their_bits():
    torch.manual_seed(0)
    tied = quantize_weight(torch.randn(20, 512), "q4_k")  # 20 rows: the last group padded
    other = quantize_weight(torch.randn(16, 256), "q8_0")
    alone = [BlockTensor(w.qtype, w.blocks.clone()) for w in (tied, other)]
    for w in alone:
        w.regroup()
    regroup_on_huge_pages([tied, other, tied])  # a tied embedding and lm_head: one weight, regrouped once
    assert tied.blocks.untyped_storage().data_ptr() == other.blocks.untyped_storage().data_ptr()
    for w, ref in zip((tied, other), alone):
        assert w.shape == ref.shape and torch.equal(w.blocks, ref.blocks)
        x = torch.randn(3, w.shape[1])
        n = w.shape[0]
        assert torch.equal(packed_linear(x, w.kernel_weight(), None, n), packed_linear(x, ref.kernel_weight(), None, n))
