"""baton's own compute paths (the compiled decode attention and panel linear, the tiled prefill
attention) against the same math written out by hand in float64."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import baton.engine.runner as runner
import baton.ops as baton_ops
from baton.models.mla import tiled_attention
from baton.ops import (
    LIB,
    cache_key,
    empty_huge_pages,
    gated_act,
    ops,
    pack_weight_panels,
    packed_linear,
    paged_attention,
    rms_norm,
    rms_norm_heads_,
    rotary_,
)

REPO = Path(__file__).resolve().parents[1]


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
    out = paged_attention(*case, block_size, scale)
    ref = reference(*case, block_size, scale)
    assert out.shape == case[0].shape and out.dtype == case[0].dtype
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_decode_attention_of_a_sequence_does_not_depend_on_its_batch():
    q, k_cache, v_cache, table, offsets, lens = random_case(8, 9, 3, 64, 16, 700, torch.float32, "NHD", seed=1)
    assert lens.max() > 512  # some sequences span several partitions
    together = paged_attention(q, k_cache, v_cache, table, offsets, lens, 16, 0.125)
    for s in range(8):
        alone = paged_attention(
            q[s : s + 1], k_cache, v_cache, table[s : s + 1], offsets[s : s + 1], lens[s : s + 1], 16, 0.125
        )
        assert torch.equal(alone, together[s : s + 1])


def test_decode_attention_rejects_mismatched_inputs():
    q, k_cache, v_cache, table, offsets, lens = random_case(2, 4, 2, 16, 4, 20, torch.float32, "NHD", seed=2)
    with pytest.raises(RuntimeError, match="block_table"):
        paged_attention(q, k_cache, v_cache, table.int(), offsets, lens, 4, 0.25)
    with pytest.raises(RuntimeError, match="head shapes"):
        paged_attention(q[:, :3], k_cache, v_cache, table, offsets, lens, 4, 0.25)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(
    "corrupt,message",
    [
        ("block_past_the_cache", r"block_table\[1, 0\] = {num_blocks} is outside the KV cache's {num_blocks} blocks"),
        ("negative_block", r"block_table\[1, 0\] = -1 is outside the KV cache's {num_blocks} blocks"),
        ("negative_offset", r"kv_offset\[0\] = -1 is negative"),
        ("zero_length", r"kv_len\[1\] = 0: a query attends to at least one position"),
        ("past_the_table_row", r"kv_offset\[0\] \+ kv_len\[0\] = 3 \+ 18 runs past block_table row 0 \(5 blocks"),
        ("zero_block_size", r"block_size must be at least 1, got 0"),
    ],
)
def test_decode_attention_rejects_a_context_it_would_read_out_of_bounds(layout, corrupt, message):
    block_size, num_blocks, width = 4, 13, 5
    g = torch.Generator().manual_seed(4)
    shape = (num_blocks * block_size, 2, 16)
    k_cache, v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    if layout == "HND":  # [heads, slots, dim] storage read through a [slots, heads, dim] view
        k_cache, v_cache = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (k_cache, v_cache))
    q = torch.randn(2, 4, 16, generator=g)
    table = torch.arange(2 * width).view(2, width).contiguous()
    offsets, lens = torch.tensor([3, 0]), torch.tensor([10, 7])
    bs = block_size
    if corrupt == "block_past_the_cache":
        table[1, 0] = num_blocks
    elif corrupt == "negative_block":
        table[1, 0] = -1
    elif corrupt == "negative_offset":
        offsets[0] = -1
    elif corrupt == "zero_length":
        lens[1] = 0
    elif corrupt == "past_the_table_row":
        lens[0] = width * block_size - 3 + 1
    else:
        bs = 0
    with pytest.raises(RuntimeError, match=message.format(num_blocks=num_blocks)):
        paged_attention(q, k_cache, v_cache, table, offsets, lens, bs, 0.25)


def test_decode_attention_ignores_table_entries_past_the_context():
    """Rows are padded to the widest context: entries no position of a row reads may hold anything."""
    q, k_cache, v_cache, table, offsets, lens = random_case(3, 4, 2, 16, 4, 20, torch.float32, "NHD", seed=5)
    padded = torch.cat([table, torch.full((3, 2), -7)], 1)
    lens[0] = 1
    padded[0, offsets[0] // 4 + 1 :] = 10**9  # past its one position
    out = paged_attention(q, k_cache, v_cache, padded, offsets, lens, 4, 0.25)
    ref = reference(q, k_cache, v_cache, table, offsets, lens, 4, 0.25)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def tiny_decoder(num_blocks=6, block_size=4):
    """A one-layer FusedDecoder over random weights and a zeroed KV cache: heads 2, kv heads 1, dim 16."""
    g = torch.Generator().manual_seed(6)
    hidden, heads, kv_heads, dim, inner = 32, 2, 1, 16, 64

    def panels(n, k):
        return pack_weight_panels(torch.randn(n, k, generator=g) / math.sqrt(k))

    decoder = ops().FusedDecoder(hidden, ops().NormWeights(torch.ones(hidden), 1e-6))
    k_cache = torch.zeros(num_blocks * block_size, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    add_llama_layer(decoder, panels, hidden, heads, kv_heads, dim, inner, 0.25, k_cache, v_cache)
    return decoder, k_cache, v_cache


def add_llama_layer(decoder, panels, hidden, heads, kv_heads, dim, inner, scale, k_cache, v_cache, times=1):
    """A Llama layer's two blocks (attention, gated MLP) over random panels and unit norms, `times`
    layers deep (the same weights and cache each time)."""
    attn = ops().AttentionStep(
        num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, hidden=hidden, scale=scale, rope=0, rotary_dim=dim,
        qkv=[panels((heads + 2 * kv_heads) * dim, hidden)], qkv_rows=[(heads + 2 * kv_heads) * dim], qkv_bias=None,
        q_norm=ops().NormWeights(), k_norm=ops().NormWeights(), o=panels(hidden, heads * dim), o_bias=None,
        k_cache=k_cache, v_cache=v_cache, k_scale=None, v_scale=None, group=0,
    )  # fmt: skip
    mlp = ops().GatedMlpStep(
        gate_up=[panels(2 * inner, hidden)], gate_up_rows=[2 * inner], down=panels(hidden, inner),
        intermediate=inner, hidden=hidden, gelu_tanh=False,
    )  # fmt: skip
    norm = ops().NormWeights(torch.ones(hidden), 1e-6)
    for _ in range(times):
        decoder.add_block(norm, attn, ops().NormWeights())
        decoder.add_block(norm, mlp, ops().NormWeights())


def decode_step(decoder, block_size=4, **metadata):
    """Two decode rows: row 0 at position 4 over blocks [2, 3], row 1 at position 2 of block 5."""
    step = {
        "slot_mapping": torch.tensor([3 * block_size, 5 * block_size + 2]),
        "block_ids": torch.tensor([[2, 3], [5, 0]]),
        "kv_offsets": torch.tensor([0, 0]),
        "kv_lens": torch.tensor([5, 3]),
        "block_size": block_size,
    }
    step.update(metadata)
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(7))
    angle = torch.rand(2, 8, generator=torch.Generator().manual_seed(8))
    cos, sin = torch.cat([angle.cos()] * 2, 1), torch.cat([-angle.sin(), angle.sin()], 1)
    group = [step["slot_mapping"]], [step["block_ids"]], [step["kv_offsets"]], [step["kv_lens"]]
    return decoder.forward(x, [cos], [sin], *group, step["block_size"])


@pytest.mark.parametrize(
    "metadata,message",
    [
        ({"block_ids": torch.tensor([[2, 6], [5, 0]])}, r"block_table\[0, 1\] = 6 is outside the KV cache's 6 blocks"),
        ({"kv_offsets": torch.tensor([0, -2])}, r"kv_offset\[1\] = -2 is negative"),
        ({"kv_lens": torch.tensor([0, 3])}, r"kv_len\[0\] = 0"),
        ({"kv_lens": torch.tensor([5, 9])}, r"kv_offset\[1\] \+ kv_len\[1\] = 0 \+ 9 runs past block_table row 1"),
        ({"slot_mapping": torch.tensor([12, 24])}, r"slot_mapping\[0\]\[1\] = 24 is outside the KV cache's 24 slots"),
        ({"block_size": 0}, r"block_size must be at least 1, got 0"),
    ],
)
def test_fused_decode_step_rejects_bad_metadata_before_writing_the_cache(metadata, message):
    decoder, k_cache, v_cache = tiny_decoder()
    assert decode_step(decoder).isfinite().all()  # the good step runs
    k_before, v_before = k_cache.clone(), v_cache.clone()
    with pytest.raises(RuntimeError, match=message):
        decode_step(decoder, **metadata)
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


def test_a_layer_step_refuses_unknown_missing_and_misshapen_arguments():
    g = torch.Generator().manual_seed(3)
    args = dict(
        gate_up=[pack_weight_panels(torch.randn(16, 8, generator=g))], gate_up_rows=[16],
        down=pack_weight_panels(torch.randn(8, 8, generator=g)), intermediate=8, hidden=8, gelu_tanh=False,
    )  # fmt: skip
    ops().GatedMlpStep(**args)  # the good arguments build it
    with pytest.raises(RuntimeError, match="GatedMlpStep takes no argument.*down_bais"):
        ops().GatedMlpStep(**args, down_bais=torch.zeros(8))
    with pytest.raises(RuntimeError, match="missing argument down"):
        ops().GatedMlpStep(**{k: v for k, v in args.items() if k != "down"})
    with pytest.raises(RuntimeError, match=r"down must be packed panels of a \[8, 8\] weight"):
        ops().GatedMlpStep(**{**args, "down": pack_weight_panels(torch.randn(8, 4, generator=g))})
    with pytest.raises(RuntimeError, match=r"down_bias must be contiguous \[8\]"):
        ops().GatedMlpStep(**args, down_bias=torch.zeros(7))


def ticks_while(call) -> tuple[list[float], float, float]:
    """The times a Python thread woke (it sleeps 1 ms a turn) while call() ran in this one, and
    when call() started and ended."""
    ticks, stop = [], threading.Event()

    def count():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    counter = threading.Thread(target=count)
    counter.start()
    try:
        time.sleep(0.02)
        start = time.perf_counter()
        call()
        end = time.perf_counter()
    finally:
        stop.set()
        counter.join()
    return [t for t in ticks if start <= t <= end], start, end


def long_panel_linear():
    g = torch.Generator().manual_seed(9)
    x, packed = torch.randn(1024, 2048, generator=g), pack_weight_panels(torch.randn(4096, 2048, generator=g))
    return lambda: packed_linear(x, packed, None, 4096)


def long_decode_attention():
    g = torch.Generator().manual_seed(10)
    k_cache, v_cache = torch.randn(4096 * 16, 2, 64, generator=g), torch.randn(4096 * 16, 2, 64, generator=g)
    table = torch.randperm(4096, generator=g)[:512].repeat(64, 1)
    q, offsets, lens = torch.randn(64, 16, 64, generator=g), torch.zeros(64, dtype=torch.long), torch.full((64,), 8192)
    return lambda: paged_attention(q, k_cache, v_cache, table, offsets, lens, 16, 0.125)


def long_fused_decode_step():
    """8 layers (sharing one set of weights) of a 1024-wide model at 64 rows."""
    g = torch.Generator().manual_seed(11)
    hidden, heads, kv_heads, dim, inner, rows = 1024, 16, 4, 64, 4096, 64

    def panels(n, k):
        return pack_weight_panels(torch.randn(n, k, generator=g) / math.sqrt(k))

    decoder = ops().FusedDecoder(hidden, ops().NormWeights(torch.ones(hidden), 1e-6))
    k_cache, v_cache = torch.zeros(rows * 16, kv_heads, dim), torch.zeros(rows * 16, kv_heads, dim)
    add_llama_layer(decoder, panels, hidden, heads, kv_heads, dim, inner, 0.125, k_cache, v_cache, times=8)
    x, cos, sin = torch.randn(rows, hidden, generator=g), torch.ones(rows, dim), torch.zeros(rows, dim)
    # row i writes the first slot of block i and reads that one position
    slots, blocks = torch.arange(rows) * 16, torch.arange(rows)[:, None].contiguous()
    offsets, lens = torch.zeros(rows, dtype=torch.long), torch.ones(rows, dtype=torch.long)
    return lambda: decoder.forward(x, [cos], [sin], [slots], [blocks], [offsets], [lens], 16)


@pytest.mark.parametrize("make_call", [long_panel_linear, long_decode_attention, long_fused_decode_step])
def test_long_ops_let_other_python_threads_run(make_call):
    """The server's event loop is a Python thread: it must keep running while an op computes."""
    call = make_call()
    call()  # warm up (page faults, thread pool)
    ticks, start, end = ticks_while(call)
    assert end - start > 0.02, "the op was too short to tell"
    # holding the GIL, the op would keep the counter asleep from its start to its end
    longest_gap = max(b - a for a, b in zip([start, *ticks], [*ticks, end]))
    assert len(ticks) >= 5 and longest_gap < (end - start) / 2, (len(ticks), longest_gap, end - start)


def test_cache_key_changes_with_the_cpu_the_compiler_and_the_arch():
    avx2 = "fpu sse sse2 avx avx2 fma"
    key = cache_key(avx2, "c++ (Debian 12.2.0-14) 12.2.0", "x86_64")
    assert key == cache_key(avx2, "c++ (Debian 12.2.0-14) 12.2.0", "x86_64")
    assert key.startswith(f"torch-{torch.__version__}-")
    others = {
        cache_key(avx2 + " avx512f avx512bw", "c++ (Debian 12.2.0-14) 12.2.0", "x86_64"),
        cache_key("fpu sse sse2 avx", "c++ (Debian 12.2.0-14) 12.2.0", "x86_64"),
        cache_key(avx2, "c++ (Debian 13.1.0-2) 13.1.0", "x86_64"),
        cache_key(avx2, "c++ (Debian 12.2.0-14) 12.2.0", "aarch64"),
    }
    assert key not in others and len(others) == 4


def test_a_built_cache_loads_without_building():
    ops()  # builds here if this machine's cache is cold
    script = (
        "import torch.utils.cpp_extension as ext\n"
        "def build(*a, **k): raise AssertionError('the cache was built again')\n"
        "ext.load = build\n"
        "from baton.ops import LIB, build_dir, ops\n"
        "assert ops().__file__ == str(build_dir() / LIB), ops().__file__\n"
        "print(ops().PANEL_LANES)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["16"]


def fake_builds(monkeypatch, barrier=None):
    """Stand in for torch's 40 s build: a library file written into the build directory given."""
    from torch.utils import cpp_extension

    def load(name, sources, extra_cflags, extra_ldflags, build_directory, verbose):
        assert name == "baton_ops" and "-march=native" in extra_cflags
        Path(build_directory, LIB).write_text(build_directory)
        if barrier is not None:
            barrier.wait(timeout=30)  # every build finished before any is published
        return SimpleNamespace(built_in=build_directory)

    monkeypatch.setattr(cpp_extension, "load", load)


def test_processes_building_a_cold_cache_at_once_all_succeed_and_leave_one_build(tmp_path, monkeypatch):
    fake_builds(monkeypatch, threading.Barrier(3))
    final = tmp_path / "torch-x-0123"
    modules = [None] * 3

    def build(i):
        modules[i] = baton_ops._build(final)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(m is not None for m in modules)
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]  # the losers' builds are gone
    assert sorted(p.name for p in final.iterdir()) == [LIB]
    assert (final / LIB).read_text() in {m.built_in for m in modules}  # one whole build, renamed in


def test_a_damaged_cache_directory_is_built_again(tmp_path, monkeypatch):
    fake_builds(monkeypatch)
    final = tmp_path / "torch-x-0123"
    final.mkdir()
    (final / LIB).write_bytes(b"not a library")
    monkeypatch.setattr(baton_ops, "build_dir", lambda: final)
    module = baton_ops.ops.__wrapped__()
    assert (final / LIB).read_text() == module.built_in
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]


def test_a_cache_directory_without_its_library_is_replaced(tmp_path, monkeypatch):
    fake_builds(monkeypatch)
    final = tmp_path / "torch-x-0123"
    final.mkdir()
    (final / "bindings.o").write_bytes(b"half a build")
    module = baton_ops._build(final)
    assert sorted(p.name for p in final.iterdir()) == [LIB]
    assert (final / LIB).read_text() == module.built_in
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]


@pytest.mark.slow
def test_two_processes_compiling_into_a_cold_cache_both_load_the_ops(tmp_path):
    """The real build twice at once (minutes): both processes get working ops, one build stays."""
    env = {**os.environ, "HOME": str(tmp_path)}
    script = "from baton.ops import ops; print(ops().PANEL_LANES)"
    procs = [
        subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert [o.split() for o in outs] == [["16"], ["16"]]
    root = tmp_path / ".cache" / "baton" / "ops"
    (entry,) = root.iterdir()
    assert (entry / LIB).is_file() and ".tmp-" not in entry.name


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
def test_attention_over_kv_tiles_matches_one_softmax(monkeypatch, q_start, num_queries, window, blind):
    """MLA's prefill: flash calls over tiles, merged by log-sum-exp."""
    monkeypatch.setattr(runner, "KV_TILE", 8)  # many tiles for short contexts
    g = torch.Generator().manual_seed(q_start + num_queries)
    heads, dim = 6, 16
    end = q_start + num_queries
    kv_start = 0 if window is None else max(0, q_start - window + 1)
    q = torch.randn(num_queries, heads, dim, generator=g)
    k = torch.randn(end, heads, dim, generator=g)
    v = torch.randn(end, heads, dim, generator=g)
    tiles = runner._kv_tiles(q_start, end, kv_start, window)
    assert len(tiles) == -(-(end - kv_start) // max(8, num_queries))
    assert any(t.blind_rows is not None for t in tiles) == blind

    def load(t):
        return k[kv_start + t.lo : kv_start + t.hi].transpose(0, 1)[None], v[
            kv_start + t.lo : kv_start + t.hi
        ].transpose(0, 1)[None]

    out = tiled_attention(q.transpose(0, 1)[None], tiles, load, 0.25)[0].transpose(0, 1)
    ref = causal_reference(
        q, k[kv_start:], v[kv_start:], torch.arange(q_start, end), torch.arange(kv_start, end), window, 0.25
    )
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def chunk_case(context, num_queries, heads, kv_heads, dim, block_size, dtype, seed):
    """A sequence of context + num_queries positions in scattered blocks of a cache."""
    g = torch.Generator().manual_seed(seed)
    end = context + num_queries
    num_blocks = end // block_size + 9
    k_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[: -(-end // block_size)]
    q = torch.randn(num_queries, heads, dim, generator=g).to(dtype)
    return q, k_cache, v_cache, table


def chunk_rows(context, num_queries, window, block_size):
    """Each query's (first position, length) of a chunk at [context, context + num_queries)."""
    pos = torch.arange(context, context + num_queries)
    lo = torch.zeros_like(pos) if window is None else (pos - window + 1).clamp(min=0)
    return lo, pos + 1 - lo


@pytest.mark.parametrize(
    "context,num_queries,heads,kv_heads,dim,block_size,window,dtype",
    [
        (0, 40, 9, 3, 64, 16, None, torch.float32),  # a whole prompt: SmolLM2's heads
        (300, 37, 9, 3, 64, 16, None, torch.float32),  # a chunk after a prefix hit, rows in 3 tiles
        (600, 20, 4, 1, 256, 16, None, torch.float32),  # Gemma3's heads, three partitions
        (45, 30, 4, 4, 40, 7, 19, torch.float32),  # a sliding window, head_dim off the vector width
        (0, 50, 6, 2, 64, 16, None, torch.bfloat16),
    ],
)
def test_prefill_rows_match_a_causal_softmax(context, num_queries, heads, kv_heads, dim, block_size, window, dtype):
    q, k_cache, v_cache, table = chunk_case(context, num_queries, heads, kv_heads, dim, block_size, dtype, seed=11)
    lo, lens = chunk_rows(context, num_queries, window, block_size)
    seqs = torch.zeros(num_queries, dtype=torch.long)
    out = paged_attention(q, k_cache, v_cache, table[None].contiguous(), lo, lens, block_size, 0.125, row_seq=seqs)
    slots = (table[:, None] * block_size + torch.arange(block_size)).flatten()[: context + num_queries]
    ref = causal_reference(
        q,
        k_cache[slots],
        v_cache[slots],
        torch.arange(context, context + num_queries),
        torch.arange(context + num_queries),
        window,
        0.125,
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("window", [None, 100])
def test_prefill_rows_have_the_bits_of_decodes(window):
    """A prompt's rows, a later chunk's rows and decodes at the same positions: one arithmetic,
    whatever the batch around them, the chunk boundaries and the block size."""
    context, n = 530, 70
    q, k_cache, v_cache, table = chunk_case(context, n, 9, 3, 64, 16, torch.float32, seed=12)
    lo, lens = chunk_rows(context, n, window, 16)
    one_seq = torch.zeros(n, dtype=torch.long)
    chunk = paged_attention(q, k_cache, v_cache, table[None].contiguous(), lo, lens, 16, 0.125, row_seq=one_seq)
    # the same rows as decodes, behind two other sequences' rows, and a chunk of another sequence after
    other_q, _, _, other_table = chunk_case(0, 20, 9, 3, 64, 16, torch.float32, seed=13)
    tables = torch.zeros(2 + n + 1, table.numel(), dtype=torch.long)
    tables[0, :3], tables[1, :2], tables[2 + n, : other_table.numel()] = table[:3], other_table[:2], other_table
    tables[2 : 2 + n] = table
    olo, olens = chunk_rows(0, 20, window, 16)
    mixed = paged_attention(
        torch.cat([torch.randn(2, 9, 64), q, other_q]),
        k_cache,
        v_cache,
        tables,
        torch.cat([torch.tensor([5, 0]), lo, olo]),
        torch.cat([torch.tensor([40, 20]), lens, olens]),
        16,
        0.125,
        row_seq=torch.cat([torch.arange(2 + n), torch.full((20,), 2 + n)]),
    )
    assert torch.equal(mixed[2 : 2 + n], chunk)
    # a prompt split into chunks at a block edge that is no partition edge, and at no block edge
    for cut in (48, 37):
        head = paged_attention(
            q[:cut], k_cache, v_cache, table[None].contiguous(), lo[:cut], lens[:cut], 16, 0.125, row_seq=one_seq[:cut]
        )
        assert torch.equal(head, chunk[:cut])
    # the same cache in blocks of 8 and of 64 (a prefill worker and a decode worker of other block sizes)
    slots = (table[:, None] * 16 + torch.arange(16)).flatten()
    for bs in (8, 64):
        blocks = -(-slots.numel() // bs)
        k2, v2 = (torch.zeros(blocks * bs, 3, 64) for _ in range(2))
        k2[: slots.numel()], v2[: slots.numel()] = k_cache[slots], v_cache[slots]
        same = paged_attention(q, k2, v2, torch.arange(blocks)[None], lo, lens, bs, 0.125, row_seq=one_seq)
        assert torch.equal(same, chunk)


def test_attention_rejects_a_row_seq_outside_the_table():
    q, k_cache, v_cache, table = chunk_case(0, 4, 2, 1, 16, 4, torch.float32, seed=14)
    lo, lens = chunk_rows(0, 4, None, 4)
    with pytest.raises(RuntimeError, match=r"row_seq\[2\] = 1 is not a row of the 1-row block_table"):
        paged_attention(q, k_cache, v_cache, table[None], lo, lens, 4, 0.25, row_seq=torch.tensor([0, 0, 1, 0]))
    with pytest.raises(RuntimeError, match="row_seq must be contiguous int64"):
        paged_attention(q, k_cache, v_cache, table[None], lo, lens, 4, 0.25, row_seq=torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize(
    "rows,out_features,in_features,bias",
    [(1, 960, 576, False), (5, 37, 40, True), (16, 576, 1536, False), (70, 100, 64, True)],
)
def test_panel_linear_matches_a_float64_matmul(rows, out_features, in_features, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(rows, in_features, generator=g)
    y = packed_linear(x, pack_weight_panels(w), b, out_features)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)


def test_panel_linear_gives_a_row_the_same_bits_in_any_batch():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(100, 64, generator=g)
    packed = pack_weight_panels(w)
    x = torch.randn(16, 64, generator=g)
    together = packed_linear(x, packed, None, 100)
    for rows in (1, 3, 8, 9):
        assert torch.equal(packed_linear(x[:rows], packed, None, 100), together[:rows])
    assert torch.equal(packed_linear(x[5:6], packed, None, 100), together[5:6])


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


def test_linear_and_row_ops_reject_mismatched_shapes():
    packed, x = pack_weight_panels(torch.randn(40, 64)), torch.randn(2, 64)  # 3 panels: 48 outputs at most
    with pytest.raises(RuntimeError, match="x has K = 63 input features, the packed weight 64"):
        packed_linear(torch.randn(2, 63), packed, None, 40)
    with pytest.raises(RuntimeError, match="out_features = 49 is outside the packed weight's 48"):
        packed_linear(x, packed, None, 49)
    with pytest.raises(RuntimeError, match=r"bias must be contiguous float32 \[out_features=40\]"):
        packed_linear(x, packed, torch.randn(39), 40)
    with pytest.raises(RuntimeError, match=r"weight must be contiguous float32 \[dim=64\]"):
        rms_norm(x, torch.randn(63), 1e-6)
    with pytest.raises(RuntimeError, match=r"residual \[3, 64\] does not match x \[2, 64\]"):
        rms_norm(x, torch.randn(64), 1e-6, residual=torch.randn(3, 64))
    with pytest.raises(RuntimeError, match=r"cos \[2, 16\] and sin \[3, 16\] must be \[tokens, dim\]"):
        rotary_(torch.randn(2, 3, 16), torch.randn(2, 16), torch.randn(3, 16))
    with pytest.raises(RuntimeError, match="x must be float32 \\[rows, dim\\]"):
        gated_act(x.double(), False)
    with pytest.raises(RuntimeError, match="x must hold gate and up halves"):
        gated_act(torch.randn(2, 7), False)


def test_huge_page_tensor_is_writable_and_sized():
    t = empty_huge_pages(3 * 4 + 1)
    assert t.dtype == torch.uint8 and t.numel() == 13
    t.fill_(7)
    assert int(t.sum()) == 91


def test_hc_weights_match_the_torch_formula():
    """A hyper-connection's weights (GLM-5.3-Flash) as transformers computes them in torch:
    sigmoids, a softmax and 20 Sinkhorn passes, to float32 rounding; comb doubly stochastic."""
    from baton.ops import hc_weights

    gen = torch.Generator().manual_seed(0)
    n, iters, eps = 4, 20, 1e-6
    mixed, base, scale = (torch.randn(s, generator=gen) for s in ((37, (2 + n) * n), ((2 + n) * n,), (3,)))
    pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    want_pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    want_post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    pre, post, got = hc_weights(mixed, base, scale, n, iters, eps)
    torch.testing.assert_close(pre, want_pre, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(post, want_post, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, comb, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.sum(dim=-2), torch.ones(37, n), rtol=0, atol=1e-4)
    with pytest.raises(RuntimeError, match="mixed must be"):
        hc_weights(mixed[:, :-1].contiguous(), base, scale, n, iters, eps)
