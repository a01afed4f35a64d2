"""Linears over GGUF blocks (baton/ops/quant_linear.cpp, quant_int.cpp), both kernels.

The float kernel dequantizes with the gguf package's formulas and float32 rounding, so its weights
are the package's bit for bit; what remains is float32 summation over K, bounded by
K * 2^-24 * (|x| @ |w|^T). The int8 kernels are checked against the formats' spec evaluated in
float64 (each block's values as (scale part) - (offset part), checked against the gguf package)
and x quantized per block as their contract says (tests/quant_ref.py): their integer sums are
exact, what remains is one scale product and one fused add per block, bounded by
(blocks + 8) * 2^-23 * (|x| @ (|scale part| + |offset part|)^T)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from baton import LLM, SamplingParams
from baton.models.gguf_blocks import BLOCK_FORMATS, BlockTensor, slice_k_parts, stack_rows
from baton.models.gguf_file import GGUFFile
from baton.models.loader import resolve_model_path
from baton.models.quantize import QUANT_TYPES, quantize_matrix
from baton.ops import dequantize_rows, packed_linear, quant_kernel, regroup_blocks, set_quant_kernel
from baton.parallel.comm import tree_sum
from tests.quant_ref import quantize_inputs, quantized_x

FORMATS = list(BLOCK_FORMATS)
INT8_KERNELS = ["int8-avx512_vnni", "int8-avx_vnni", "int8-avx2"]


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float64)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 for the 8 sub-blocks: 6-bit scales and mins [..., 8]."""
    s = s.astype(np.int64)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc, m


def spec_parts(rows: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """A [N, K] and B [N, K] in float64 with the weight = A - B, from ggml's block layouts."""
    values, nbytes = BLOCK_FORMATS[qtype]
    blk = rows.reshape(rows.shape[0], -1, nbytes)
    n, nb = blk.shape[:2]
    zero = np.zeros((n, nb, values))
    if qtype == "Q8_0":
        return (_f16(blk[..., :2]) * blk[..., 2:].view(np.int8)).reshape(n, -1), zero.reshape(n, -1)
    if qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        has_min, five = qtype.endswith("_1"), qtype.startswith("Q5")
        qs_at = 2 + 2 * has_min + 4 * five
        qs = blk[..., qs_at : qs_at + 16].astype(np.int64)
        q = np.concatenate([qs & 15, qs >> 4], -1)
        if five:
            qh = blk[..., qs_at - 4 : qs_at].copy().view(np.uint32).astype(np.int64)
            q |= ((qh >> np.arange(32)) & 1) << 4
        d = _f16(blk[..., :2])
        if has_min:
            return (d * q).reshape(n, -1), (-_f16(blk[..., 2:4]) + zero).reshape(n, -1)
        return (d * (q - (16 if five else 8))).reshape(n, -1), zero.reshape(n, -1)
    if qtype in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blk[..., 0:2]), _f16(blk[..., 2:4])
        sc, m = _k_scales(blk[..., 4:16])
        qs = blk[..., (48 if qtype == "Q5_K" else 16) :].astype(np.int64).reshape(n, nb, 4, 32)
        q = np.stack([qs & 15, qs >> 4], 3).reshape(n, nb, 8, 32)  # sub-blocks 2p, 2p + 1
        if qtype == "Q5_K":
            qh = blk[..., 16:48].astype(np.int64)
            q |= ((qh[:, :, None, :] >> np.arange(8)[:, None]) & 1) << 4
        a = d[..., None] * sc[..., None] * q
        b = np.broadcast_to(dmin[..., None] * m[..., None], q.shape)
        return a.reshape(n, -1), b.reshape(n, -1)
    assert qtype == "Q6_K"
    ql, qh = blk[..., :128].astype(np.int64), blk[..., 128:192].astype(np.int64)
    sc = blk[..., 192:208].view(np.int8).astype(np.int64)
    q = np.zeros((n, nb, 256), dtype=np.int64)
    for half in range(2):
        lo, h = ql[..., 64 * half : 64 * half + 64], qh[..., 32 * half : 32 * half + 32]
        for g in range(4):
            low = lo[..., 32 * (g & 1) : 32 * (g & 1) + 32]
            low = low & 15 if g < 2 else low >> 4
            q[..., 128 * half + 32 * g : 128 * half + 32 * g + 32] = low | (((h >> (2 * g)) & 3) << 4)
    a = _f16(blk[..., 208:210]) * np.repeat(sc, 16, -1) * (q - 32)
    return a.reshape(n, -1), zero.reshape(n, -1)


def weights(t: BlockTensor) -> torch.Tensor:
    """t's blocks as loading lays them out for the kernel in use: regrouped by 8 rows for int8, with
    t's K parts."""
    if not quant_kernel().startswith("int8"):
        return t.blocks
    return BlockTensor(t.qtype, regroup_blocks(t.blocks), t.shape[0], t.k_parts).kernel_weight()


def check_against_gguf(x: torch.Tensor, rows: np.ndarray, qtype: str) -> None:
    """The float kernel against gguf's dequantized weight and x @ w^T in float64."""
    t = BlockTensor.from_rows(qtype, rows)
    w = torch.from_numpy(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[qtype]).reshape(rows.shape[0], -1))
    assert torch.equal(t.dequantize(), w.float())  # the same weights, bit for bit
    y = packed_linear(x, t.blocks, None, t.shape[0])
    expected = x.double() @ w.double().T
    bound = x.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    assert ((y.double() - expected).abs() <= bound + 1e-30).all()


def check_against_spec(x: torch.Tensor, rows: np.ndarray, qtype: str) -> None:
    """An int8 kernel (the one selected) against the spec in float64."""
    t = BlockTensor.from_rows(qtype, rows)
    a, b = spec_parts(rows, qtype)
    w = torch.from_numpy(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[qtype]).reshape(rows.shape[0], -1))
    assert torch.equal(t.dequantize(), w.float())  # the embedding path: the package's weights, bit for bit
    assert (np.abs(a - b - w.double().numpy()) <= 2.0**-22 * (np.abs(a) + np.abs(b)) + 1e-45).all()
    values = BLOCK_FORMATS[qtype][0]
    xq = quantized_x(x, values)
    expected = xq @ (a - b).T
    y = packed_linear(x, weights(t), None, t.shape[0]).double().numpy()
    bound = (x.shape[1] / 32 + 8) * 2.0**-23 * (np.abs(xq) @ (np.abs(a) + np.abs(b)).T)
    assert (np.abs(y - expected) <= bound + 1e-30).all(), np.abs(y - expected).max()


def scale_offsets(qtype: str) -> list[int]:
    """Where a block of `qtype` holds its fp16 scales (d, and m or dmin)."""
    return {"Q6_K": [208], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q4_1": [0, 2], "Q5_1": [0, 2]}.get(qtype, [0])


def random_blocks(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random bytes in `qtype`'s blocks with finite fp16 scales spanning 2^-24 .. 2^15."""
    values, nbytes = BLOCK_FORMATS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // values, nbytes), dtype=np.uint8)
    scales = (rng.choice([2.0**-24, 2.0**-14, 1e-3, 1.0, 3e2, 2.0**15], size=(n, k // values, 2))).astype(np.float16)
    for i, off in enumerate(scale_offsets(qtype)):
        raw[..., off : off + 2] = scales[..., i : i + 1].view(np.uint8)
    return raw.reshape(n, -1)


@pytest.fixture(params=INT8_KERNELS)
def int8_kernel(request):
    """Each int8 kernel this CPU has (the rest skipped), the kernel before restored after."""
    before = quant_kernel()
    try:
        set_quant_kernel(request.param)
    except RuntimeError as e:
        pytest.skip(str(e))
    yield request.param
    set_quant_kernel(before)


@pytest.mark.parametrize("qtype", FORMATS)
def test_float_kernel_matches_gguf_dequantization(qtype):
    g = torch.Generator().manual_seed(0)
    k = 512
    w = torch.randn(37, k, generator=g)
    w[3] *= 1e3  # a row of large weights beside small ones
    for rows in (quantize_matrix(w, QUANT_TYPES[qtype.lower()]), random_blocks(qtype, 37, k, seed=1)):
        check_against_gguf(torch.randn(11, k, generator=g), rows, qtype)


@pytest.mark.parametrize("qtype", FORMATS)
def test_int8_kernel_matches_the_formats_spec(qtype, int8_kernel):
    g = torch.Generator().manual_seed(0)
    k = 512
    w = torch.randn(37, k, generator=g)
    w[3] *= 1e3  # a row of large weights beside small ones
    for rows in (quantize_matrix(w, QUANT_TYPES[qtype.lower()]), random_blocks(qtype, 37, k, seed=1)):
        x = torch.randn(11, k, generator=g)
        x[2] *= 1e-3
        x[4, :40] = 0  # a block of zeros
        check_against_spec(x, rows, qtype)


@pytest.mark.parametrize("qtype", FORMATS)
def test_int8_kernel_sums_the_largest_codes_exactly(qtype, int8_kernel):
    """Every code at its format's largest value against x rows of one sign (x's codes at +-127 or
    -128): AVX2 adds up to 8 of maddubs' int16 pairs before widening, so a bound too loose for
    the format's codes would overflow here and miss the spec."""
    values, nbytes = BLOCK_FORMATS[qtype]
    k = 1024
    raw = np.full((16, k // values, nbytes), 0xFF, dtype=np.uint8)
    one = np.array([1.0], dtype=np.float16).view(np.uint8)
    for off in scale_offsets(qtype):
        raw[..., off : off + 2] = one
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, ::2] = 0.5  # codes of both sizes, one sign
    check_against_spec(x, raw.reshape(16, -1), qtype)


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("n", [20, 40])
def test_every_instruction_set_gives_the_same_bits(qtype, n):
    """AVX-512 takes two groups of 8 outputs a call (16 lanes) and an odd group out alone: 20 outputs
    are a pair and a group of 4, 40 two pairs and a whole group; with a bias on every lane."""
    g = torch.Generator().manual_seed(0)
    t = BlockTensor.from_rows(qtype, random_blocks(qtype, n, 1024, seed=2))
    x, bias = torch.randn(7, 1024, generator=g), torch.randn(n, generator=g)
    results = {}
    before = quant_kernel()
    try:
        for name in INT8_KERNELS:
            try:
                set_quant_kernel(name)
            except RuntimeError:
                continue
            results[name] = packed_linear(x, weights(t), bias, n)
    finally:
        set_quant_kernel(before)
    assert "int8-avx2" in results
    for name, y in results.items():
        assert torch.equal(y, results["int8-avx2"]), name


def test_kernels_are_chosen_by_name():
    before = quant_kernel()
    with pytest.raises(RuntimeError, match="no quantized-linear kernel int8-sse9"):
        set_quant_kernel("int8-sse9")
    assert quant_kernel() == before  # a refused name changes nothing
    try:
        assert set_quant_kernel("int8").startswith("int8-") and quant_kernel().startswith("int8-")
    finally:
        set_quant_kernel(before)


def test_int8_rows_of_non_finite_inputs_are_non_finite(int8_kernel):
    t = BlockTensor.from_rows("Q4_K", quantize_matrix(torch.randn(8, 256), QUANT_TYPES["q4_k"]))
    x = torch.randn(3, 256)
    x[1, 7] = float("nan")
    x[2, 9] = float("inf")
    y = packed_linear(x, weights(t), None, 8)
    assert y[0].isfinite().all() and y[1].isnan().all() and y[2].isnan().all()


@pytest.mark.parametrize("kernel", ["float", "int8"])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
def test_a_row_has_the_same_bits_in_any_batch(qtype, kernel):
    before = quant_kernel()
    set_quant_kernel(kernel)
    try:
        check_row_bits(qtype)
    finally:
        set_quant_kernel(before)


def check_row_bits(qtype: str) -> None:
    g = torch.Generator().manual_seed(0)
    k = 1024  # rows of x per pass: 252 (float), 256 (int8); 300 rows cross passes
    t = BlockTensor.from_rows(qtype, quantize_matrix(torch.randn(50, k, generator=g), QUANT_TYPES[qtype.lower()]))
    x = torch.randn(300, k, generator=g)
    w = weights(t)
    together = packed_linear(x, w, None, 50)
    for rows in (1, 2, 3, 4, 5, 7, 9, 65):
        assert torch.equal(packed_linear(x[:rows], w, None, 50), together[:rows])
    assert torch.equal(packed_linear(x[200:201], w, None, 50), together[200:201])
    strided = torch.randn(300, 2 * k, generator=g)[:, :k]  # rows with a stride, as a view of a wider tensor
    assert torch.equal(packed_linear(strided, w, None, 50), packed_linear(strided.contiguous(), w, None, 50))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q4_1", "Q8_0"])
def test_row_parallel_shards_of_whole_k_parts_give_the_whole_weights_bits(qtype, int8_kernel):
    """Tensor parallel: a row-parallel linear cut by K into d shards of whole parts, each shard's
    output computed alone and the d outputs added as TPGroup.all_reduce adds them (a balanced tree in
    rank order), has the whole weight's bits, for d = 2, 4, 8."""
    k = 2048
    t = BlockTensor.from_rows(qtype, random_blocks(qtype, 20, k, seed=4))
    assert t.k_parts == 8
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(5))
    whole = packed_linear(x, weights(t), None, 20)
    blocks = t.blocks.shape[1]
    for d in (2, 4, 8):
        shards = [t.take_blocks(r * blocks // d, (r + 1) * blocks // d) for r in range(d)]
        assert [s.k_parts for s in shards] == [8 // d] * d
        outs = [packed_linear(x[:, r * k // d : (r + 1) * k // d], weights(s), None, 20) for r, s in enumerate(shards)]
        assert torch.equal(tree_sum(outs), whole), d
    # 64 blocks in parts of 8: a range of whole parts keeps them, a cut through one is a single chain
    assert slice_k_parts(64, 8, 40) == 4 and slice_k_parts(64, 0, 12) == 1 and slice_k_parts(18, 9, 18) == 1


def test_quantization_at_load_keeps_a_shards_parts():
    from baton.models.layers import quantize_weight

    w = torch.randn(16, 1024)
    assert quantize_weight(w, "q8_0").k_parts == 8  # 32 blocks
    assert quantize_weight(w[:, 512:], "q8_0", (512, 1024, 1024)).k_parts == 4  # half of the whole's 8
    assert quantize_weight(w[:, :256], "q4_k", (0, 256, 1024)).k_parts == 1  # a quarter of 4 blocks: one part


@pytest.mark.parametrize("qtype", FORMATS)
def test_regrouped_blocks_hold_every_row(qtype):
    """A regrouped weight (the last group padded with copies of the last row) reads back as shipped."""
    t = BlockTensor.from_rows(qtype, random_blocks(qtype, 21, 512, seed=3))
    expected = t.dequantize()
    t.regroup()
    assert t.blocks.shape == (3, 512 // BLOCK_FORMATS[qtype][0], 8, BLOCK_FORMATS[qtype][1])
    assert t.shape == (21, 512) and torch.equal(t.dequantize(), expected)
    ids = torch.tensor([20, 0, 7, 8, 20])
    assert torch.equal(dequantize_rows(t.blocks, ids), expected[ids])


@pytest.mark.parametrize("kernel", ["float", "int8"])
def test_parts_in_several_formats_stay_in_their_formats(kernel):
    """A fused projection's parts: of one format, joined into one tensor; of several (Q4_K_M's Q4_K
    q and k beside a Q6_K v), runs computed in their own formats and put side by side, checked
    against x @ W^T in float64 on the dequantized parts (and by the fused step's stacked_linear)."""
    from baton.models.layers import StackedLinear
    from baton.ops import ops

    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 512, generator=g)
    parts = [
        BlockTensor.from_rows("Q4_K", quantize_matrix(w[i * 16 : i * 16 + 16], QUANT_TYPES["q4_k"])) for i in (0, 1)
    ]
    parts.append(BlockTensor.from_rows("Q6_K", quantize_matrix(w[32:], QUANT_TYPES["q6_k"])))
    joined = stack_rows(parts[:2])
    assert isinstance(joined, BlockTensor) and joined.shape == (32, 512)
    stacked = stack_rows(parts)
    assert [(p.qtype, p.shape[0]) for p in stacked] == [("Q4_K", 32), ("Q6_K", 8)]
    dense = torch.cat([p.dequantize() for p in stacked]).double()
    before = quant_kernel()
    set_quant_kernel(kernel)
    try:
        if kernel == "int8":
            for p in stacked:
                p.regroup()
        bias = torch.randn(40, generator=g)
        linear = StackedLinear.from_blocks(stacked, bias)
        x = torch.randn(5, 512, generator=g)
        y = linear(x)
        xq = torch.from_numpy(quantized_x(x, 256)) if kernel == "int8" else x.double()
        expected = xq @ dense.T + bias.double()
        assert y.shape == (5, 40) and ((y.double() - expected).abs() <= 1e-4 * expected.abs().max()).all()
        rows = [p.out_features for p in linear.parts()]
        assert torch.equal(ops().stacked_linear(x, [p.packed for p in linear.parts()], rows, bias, 40), y)
    finally:
        set_quant_kernel(before)


def test_malformed_blocks_are_refused():
    good = torch.zeros(4, 2, 34, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="no GGUF block format of 33 bytes"):
        packed_linear(torch.zeros(1, 64), torch.zeros(4, 2, 33, dtype=torch.uint8), None, 4)
    with pytest.raises(RuntimeError, match="input features"):
        packed_linear(torch.zeros(1, 63), good, None, 4)
    with pytest.raises(RuntimeError, match="out_features"):
        packed_linear(torch.zeros(1, 64), good, None, 5)
    with pytest.raises(RuntimeError, match="outside the weight's 4 rows"):
        dequantize_rows(good, torch.tensor([4]))
    with pytest.raises(ValueError, match="Q8_0 rows"):
        BlockTensor.from_rows("Q8_0", np.zeros((4, 35), dtype=np.uint8))


def packaged_tensors(model: str):
    f = GGUFFile(resolve_model_path(model))
    return [t for t in f.reader.tensors if len(t.shape) == 2 and t.tensor_type.name in BLOCK_FORMATS]


def check_packaged(model: str) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = packaged_tensors(model)
    assert tensors
    for t in tensors:
        rows = np.asarray(t.data).reshape(int(t.shape[1]), -1)
        if rows.shape[0] > 4096:  # the embedding: every row dequantized, a sample multiplied
            blocks = BlockTensor.from_rows(t.tensor_type.name, rows)
            expected = gguf.quants.dequantize(rows, t.tensor_type).reshape(rows.shape[0], -1)
            assert torch.equal(blocks.dequantize(), torch.from_numpy(expected))
            rows = rows[:: rows.shape[0] // 512]
        x = torch.randn(3, int(t.shape[0]), generator=g)
        check_against_gguf(x, rows, t.tensor_type.name)
        before = quant_kernel()
        set_quant_kernel("int8")
        try:
            check_against_spec(x, rows, t.tensor_type.name)
        finally:
            set_quant_kernel(before)


@pytest.mark.slow  # 10 s; every format's kernel is checked against the gguf package above
def test_every_matrix_of_the_smollm2_file(smollm2):
    check_packaged("smollm2-135m")


@pytest.mark.slow
def test_every_matrix_of_the_gemma3_file():
    check_packaged("gemma3-270m")


def test_packaged_file_runs_in_its_shipped_formats(smollm2):
    from baton.models.layers import describe_linears

    assert describe_linears(smollm2.engine.model).startswith("linears 120 Q4_1, 1 Q8_0;")


# int8 at q8_0 and q6_k: seeds at which no activation code sits on a rounding boundary. Elsewhere a
# last-bit difference upstream (the fused kernels sum in another order than torch) can move one
# code by one step, a change of d * w in one product (about 1e-3 of the logits): the int8 contract
# itself is checked linear by linear above, for every format.
@pytest.mark.parametrize(
    "kernel,quantization,hidden",
    [("float", "q8_0", 64), ("float", "q4_k", 256), ("int8", "q8_0", 64), ("int8", "q6_k", 256)],
)
def test_quantization_at_load_matches_the_dequantized_reference(tmp_path, monkeypatch, kernel, quantization, hidden):
    """A float checkpoint quantized at load computes what transformers computes on the same
    quantized-then-dequantized weights (gguf's dequantization); under int8, each linear's input
    quantized per block as the kernels' contract says."""
    from tests.test_random_models import make_model

    monkeypatch.setenv("BATON_QUANT_KERNEL", kernel)
    ref, path = make_model(tmp_path, "LlamaForCausalLM", hidden_size=hidden, intermediate_size=2 * hidden)
    before = quant_kernel()
    try:
        llm = LLM(str(path), progress=False, quantization=quantization, kv_cache_memory_bytes=16 << 20)
        assert quant_kernel().startswith(kernel)
        qtype = QUANT_TYPES[quantization]
        with torch.no_grad():
            for module in ref.modules():
                if isinstance(module, torch.nn.Linear) and module.in_features % qtype_values(qtype) == 0:
                    rows = quantize_matrix(module.weight, qtype)
                    module.weight.copy_(torch.from_numpy(gguf.quants.dequantize(rows, qtype)).view_as(module.weight))
                    if kernel == "int8":
                        quantize_inputs(module, qtype_values(qtype))
        ids = torch.randint(0, 256, (13,), generator=torch.Generator().manual_seed(1)).tolist()
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0]
        got = llm.prompt_logits({"prompt_token_ids": ids})
        assert (got - expected).abs().max() / expected.abs().max() < 1e-4
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        new = llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
        with torch.no_grad():
            ref_logits = ref(torch.tensor([ids + new])).logits[0]
        assert new == ref_logits[len(ids) - 1 : -1].argmax(-1).tolist()
        assert llm.engine.model.fused_decoder is not None
    finally:
        set_quant_kernel(before)


def qtype_values(qtype) -> int:
    return gguf.GGML_QUANT_SIZES[qtype][0]


def test_a_fused_projection_with_parts_in_formats_baton_does_not_read_is_whole():
    """Q3_K_M-like: q and k arrive dequantized (a format the kernels do not read), v in Q8_0 blocks;
    after loading, the fused qkv's rows hold all three, v dequantized into its rows."""
    from baton.models.llama import LlamaForCausalLM
    from baton.models.model_config import parse_hf_config

    hf = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(parse_hf_config(hf, "LlamaForCausalLM"))
    model = model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(64, 64, generator=g), torch.randn(32, 64, generator=g)
    v = BlockTensor.from_rows("Q8_0", quantize_matrix(torch.randn(32, 64, generator=g), QUANT_TYPES["q8_0"]))
    model.load_weight("model.layers.0.self_attn.q_proj.weight", q)
    model.load_weight("model.layers.0.self_attn.v_proj.weight", v)
    model.load_weight("model.layers.0.self_attn.k_proj.weight", k)
    model.finish_loading()
    qkv = model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(qkv, torch.cat([q, k, v.dequantize()])) and not model.block_weights
