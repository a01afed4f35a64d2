"""baton's own compute paths (the compiled decode attention and panel linear, the tiled prefill
attention) against the same math written out by hand in float64."""

from __future__ import annotations

import math

import pytest
import torch

import baton.engine.runner as runner
from baton.models.layers import PrefillSeq, _prefill_attention
from baton.ops import (
    empty_huge_pages,
    gated_act,
    pack_weight_panels,
    paged_decode_attention,
    panel_linear,
    rms_norm,
    rms_norm_heads_,
    rotary_,
)


def reference(q, k_cache, v_cache, block_table, offsets, lens, block_size, scale):
    """softmax(q . K^T * scale) V over each sequence's listed positions, float64, one head at a time."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[1]
    for s in range(q.shape[0]):
        slots = (block_table[s][:, None] * block_size + torch.arange(block_size)).flatten()
        slots = slots[offsets[s] : offsets[s] + lens[s]]
        for h in range(q.shape[1]):
            k = k_cache[slots, h // group].double()
            v = v_cache[slots, h // group].double()
            w = torch.softmax(k @ q[s, h].double() * scale, dim=0)
            out[s, h] = w @ v
    return out


def random_case(num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_len, dtype, layout, seed):
    g = torch.Generator().manual_seed(seed)
    num_blocks = num_seqs * (max_len // block_size + 2) + 3
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    if layout == "HND":  # [heads, slots, dim] storage read through a [slots, heads, dim] view
        k_cache = torch.randn(shape[1], shape[0], shape[2], generator=g).to(dtype).transpose(0, 1)
        v_cache = torch.randn(shape[1], shape[0], shape[2], generator=g).to(dtype).transpose(0, 1)
    else:
        k_cache = torch.randn(shape, generator=g).to(dtype)
        v_cache = torch.randn(shape, generator=g).to(dtype)
    lens = torch.randint(1, max_len + 1, (num_seqs,), generator=g)
    offsets = torch.randint(0, block_size, (num_seqs,), generator=g)  # a window starting mid-block
    width = int(((offsets + lens + block_size - 1) // block_size).max())
    perm = torch.randperm(num_blocks, generator=g)
    block_table = perm[: num_seqs * width].view(num_seqs, width).contiguous()
    q = torch.randn(num_seqs, num_heads, head_dim, generator=g)
    return q, k_cache, v_cache, block_table, offsets, lens


@pytest.mark.parametrize(
    "num_seqs,num_heads,num_kv_heads,head_dim,block_size,max_len,dtype,layout",
    [
        (1, 9, 3, 64, 16, 300, torch.float32, "NHD"),  # SmolLM2's heads, one sequence: heads split over threads
        (1, 4, 1, 256, 16, 2000, torch.float32, "NHD"),  # a long context cut into partitions, merged
        (8, 9, 3, 64, 16, 300, torch.float32, "NHD"),
        (5, 4, 1, 256, 16, 600, torch.float32, "NHD"),  # Gemma3-270M's heads
        (3, 4, 4, 40, 7, 50, torch.float32, "HND"),  # head_dim not a multiple of the vector width
        (4, 6, 2, 64, 16, 200, torch.bfloat16, "NHD"),
        (2, 2, 2, 32, 4, 1, torch.float32, "NHD"),  # a single position
    ],
)
def test_decode_attention_matches_a_hand_written_softmax(
    num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_len, dtype, layout
):
    case = random_case(num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_len, dtype, layout, seed=0)
    scale = 1 / math.sqrt(head_dim)
    out = paged_decode_attention(*case, block_size, scale)
    ref = reference(*case, block_size, scale)
    assert out.shape == case[0].shape and out.dtype == case[0].dtype
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_decode_attention_of_a_sequence_does_not_depend_on_its_batch():
    q, k_cache, v_cache, table, offsets, lens = random_case(8, 9, 3, 64, 16, 700, torch.float32, "NHD", seed=1)
    assert lens.max() > 512  # some sequences span several partitions
    together = paged_decode_attention(q, k_cache, v_cache, table, offsets, lens, 16, 0.125)
    for s in range(8):
        alone = paged_decode_attention(
            q[s : s + 1], k_cache, v_cache, table[s : s + 1], offsets[s : s + 1], lens[s : s + 1], 16, 0.125
        )
        assert torch.equal(alone, together[s : s + 1])


def test_decode_attention_rejects_mismatched_inputs():
    q, k_cache, v_cache, table, offsets, lens = random_case(2, 4, 2, 16, 4, 20, torch.float32, "NHD", seed=2)
    with pytest.raises(RuntimeError, match="block_table"):
        paged_decode_attention(q, k_cache, v_cache, table.int(), offsets, lens, 4, 0.25)
    with pytest.raises(RuntimeError, match="head shapes"):
        paged_decode_attention(q[:, :3], k_cache, v_cache, table, offsets, lens, 4, 0.25)


def causal_reference(q, k, v, q_pos, kv_pos, window, scale):
    """[q, heads, dim] float64: each query over the positions it may see (causal, inside the window)."""
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(group, 1)) * scale
    visible = kv_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= kv_pos[None, :] > q_pos[:, None] - window
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v.double().repeat_interleave(group, 1))


@pytest.mark.parametrize(
    "q_start,num_queries,window,blind",
    [
        (50, 13, None, False),  # a chunk after 50 cached positions: 8-position tiles, the newest one causal
        (0, 30, 9, False),  # a whole prompt longer than its window: one tile, masked on both edges
        (37, 20, 12, True),  # a later chunk of a sliding layer: the newest queries see nothing of the older tile
        (5, 1, None, False),  # one query
    ],
)
def test_prefill_attention_over_tiles_matches_one_softmax(monkeypatch, q_start, num_queries, window, blind):
    monkeypatch.setattr(runner, "KV_TILE", 8)  # many tiles for short contexts
    g = torch.Generator().manual_seed(q_start + num_queries)
    heads, kv_heads, dim = 6, 2, 16
    end = q_start + num_queries
    kv_start = 0 if window is None else max(0, q_start - window + 1)
    q = torch.randn(num_queries, heads, dim, generator=g)
    k = torch.randn(end, kv_heads, dim, generator=g)
    v = torch.randn(end, kv_heads, dim, generator=g)
    # the cache holds positions in scattered slots; kv_slots lists them from kv_start on
    slots = torch.randperm(200, generator=g)[:end]
    k_cache = torch.zeros(200, kv_heads, dim).index_copy_(0, slots, k)
    v_cache = torch.zeros(200, kv_heads, dim).index_copy_(0, slots, v)
    tiles = runner._kv_tiles(q_start, end, kv_start, window)
    assert len(tiles) == -(-(end - kv_start) // max(8, num_queries))
    assert any(t.blind_rows is not None for t in tiles) == blind
    kv_slots = None if q_start == 0 else slots[kv_start:]
    p = PrefillSeq(0, num_queries, kv_slots, tiles)
    out = _prefill_attention(q, k[q_start:], v[q_start:], k_cache, v_cache, p, 0.25)
    ref = causal_reference(
        q, k[kv_start:], v[kv_start:], torch.arange(q_start, end), torch.arange(kv_start, end), window, 0.25
    )
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "rows,out_features,in_features,bias",
    [(1, 960, 576, False), (5, 37, 40, True), (16, 576, 1536, False), (70, 100, 64, True)],
)
def test_panel_linear_matches_a_float64_matmul(rows, out_features, in_features, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(rows, in_features, generator=g)
    y = panel_linear(x, pack_weight_panels(w), b, out_features)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)


def test_panel_linear_gives_a_row_the_same_bits_in_any_batch():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(100, 64, generator=g)
    packed = pack_weight_panels(w)
    x = torch.randn(16, 64, generator=g)
    together = panel_linear(x, packed, None, 100)
    for rows in (1, 3, 8, 9):
        assert torch.equal(panel_linear(x[:rows], packed, None, 100), together[:rows])
    assert torch.equal(panel_linear(x[5:6], packed, None, 100), together[5:6])


F32 = {"rtol": 1e-5, "atol": 1e-5}  # float32 results against float64 references


def rms_reference(x, w, eps, offset):
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + w.double())


@pytest.mark.parametrize("rows,dim,offset", [(1, 576, 0.0), (7, 640, 1.0), (300, 40, 0.0), (2, 3, 1.0)])
def test_rms_norm_matches_float64(rows, dim, offset):
    g = torch.Generator().manual_seed(dim)
    x, w = torch.randn(rows, dim, generator=g) * 3, torch.randn(dim, generator=g)
    torch.testing.assert_close(rms_norm(x, w, 1e-6, offset).double(), rms_reference(x, w, 1e-6, offset), **F32)


def test_rms_norm_adds_the_residual_in_place_first():
    g = torch.Generator().manual_seed(0)
    x, residual, w = torch.randn(5, 96, generator=g), torch.randn(5, 96, generator=g), torch.randn(96, generator=g)
    total = x.double() + residual.double()
    out = rms_norm(x, w, 1e-5, residual=residual)
    torch.testing.assert_close(residual.double(), total, **F32)
    torch.testing.assert_close(out.double(), rms_reference(total, w, 1e-5, 0.0), **F32)


def test_rms_norm_of_heads_normalizes_each_head_of_a_strided_view_in_place():
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(3, 7 * 32, generator=g)
    w = torch.randn(32, generator=g)
    before = qkv.clone()
    k = qkv[:, 4 * 32 : 6 * 32].view(3, 2, 32)  # the k heads of a fused qkv row
    rms_norm_heads_(k, w, 1e-6, 1.0)
    ref = rms_reference(before[:, 4 * 32 : 6 * 32].view(3, 2, 32), w, 1e-6, 1.0)
    torch.testing.assert_close(k.double(), ref, **F32)
    untouched = torch.cat([qkv[:, : 4 * 32], qkv[:, 6 * 32 :]], 1)
    assert torch.equal(untouched, torch.cat([before[:, : 4 * 32], before[:, 6 * 32 :]], 1))


@pytest.mark.parametrize("dim", [64, 256, 40])
def test_rotary_matches_the_rotation_written_out(dim):
    g = torch.Generator().manual_seed(dim)
    tokens, heads, half = 5, 3, dim // 2
    x = torch.randn(tokens, heads, dim, generator=g)
    angle = torch.rand(tokens, half, generator=g, dtype=torch.float64) * 100
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    c, s = angle.cos()[:, None], angle.sin()[:, None]
    ref = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)  # rotate each (x1_i, x2_i) pair by its angle
    cos = torch.cat([angle.cos(), angle.cos()], -1).float()
    signed_sin = torch.cat([-angle.sin(), angle.sin()], -1).float()
    rotary_(x, cos, signed_sin)
    torch.testing.assert_close(x.double(), ref, **F32)


@pytest.mark.parametrize("gelu", [False, True])
def test_gated_act_matches_float64(gelu):
    g = torch.Generator().manual_seed(int(gelu))
    x = torch.randn(4, 2 * 100, generator=g) * 4
    gate, up = x.double().chunk(2, -1)
    if gelu:
        act = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)))
    else:
        act = gate / (1 + torch.exp(-gate))
    torch.testing.assert_close(gated_act(x, gelu).double(), act * up, **F32)


def test_row_ops_give_a_row_the_same_bits_in_any_batch():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(9, 64, generator=g), torch.randn(64, generator=g)
    assert torch.equal(rms_norm(x[3:4], w, 1e-6), rms_norm(x, w, 1e-6)[3:4])
    assert torch.equal(gated_act(x[3:4], True), gated_act(x, True)[3:4])


def test_huge_page_tensor_is_writable_and_sized():
    t = empty_huge_pages(3 * 4 + 1)
    assert t.dtype == torch.uint8 and t.numel() == 13
    t.fill_(7)
    assert int(t.sum()) == 91
