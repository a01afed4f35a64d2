"""Linears over GGUF blocks (baton/ops/quant_linear.cpp) against the gguf package's dequantization
followed by a float64 matmul.

The kernel dequantizes with the gguf package's formulas and float32 rounding, so its weights are
the package's bit for bit (asserted); what remains is float32 summation over K, bounded by
K * 2^-24 * (|x| @ |w|^T) for every format alike."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from baton import LLM, SamplingParams
from baton.models.gguf_blocks import BLOCK_FORMATS, BlockTensor, concat_rows
from baton.models.gguf_file import GGUFFile
from baton.models.loader import resolve_model_path
from baton.models.quantize import QUANT_TYPES, quantize_matrix
from baton.ops import dequantize_rows, packed_linear

FORMATS = list(BLOCK_FORMATS)


def reference(x: torch.Tensor, rows: np.ndarray, qtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf's dequantized weight [N, K] and x @ w^T in float64."""
    n = rows.shape[0]
    w = torch.from_numpy(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[qtype]).reshape(n, -1))
    return w, x.double() @ w.double().T


def check_against_gguf(x: torch.Tensor, rows: np.ndarray, qtype: str) -> None:
    t = BlockTensor.from_rows(qtype, rows)
    w, expected = reference(x, rows, qtype)
    assert torch.equal(t.dequantize(), w.float())  # the same weights, bit for bit
    y = packed_linear(x, t.blocks, None, t.shape[0])
    bound = x.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    assert ((y.double() - expected).abs() <= bound + 1e-30).all()


def random_blocks(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random bytes in `qtype`'s blocks with finite fp16 scales spanning 2^-24 .. 2^15."""
    values, nbytes = BLOCK_FORMATS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // values, nbytes), dtype=np.uint8)
    scales = (rng.choice([2.0**-24, 2.0**-14, 1e-3, 1.0, 3e2, 2.0**15], size=(n, k // values, 2))).astype(np.float16)
    offsets = {"Q6_K": [208], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q4_1": [0, 2], "Q5_1": [0, 2]}.get(qtype, [0])
    for i, off in enumerate(offsets):
        raw[..., off : off + 2] = scales[..., i : i + 1].view(np.uint8)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", FORMATS)
def test_kernel_matches_gguf_dequantization(qtype):
    g = torch.Generator().manual_seed(0)
    k = 512
    w = torch.randn(37, k, generator=g)
    w[3] *= 1e3  # a row of large weights beside small ones
    for rows in (quantize_matrix(w, QUANT_TYPES[qtype.lower()]), random_blocks(qtype, 37, k, seed=1)):
        check_against_gguf(torch.randn(11, k, generator=g), rows, qtype)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
def test_a_row_has_the_same_bits_in_any_batch(qtype):
    g = torch.Generator().manual_seed(0)
    k = 1024  # 252 rows of x per pass: 300 rows cross passes
    t = BlockTensor.from_rows(qtype, quantize_matrix(torch.randn(50, k, generator=g), QUANT_TYPES[qtype.lower()]))
    x = torch.randn(300, k, generator=g)
    together = packed_linear(x, t.blocks, None, 50)
    for rows in (1, 2, 3, 4, 5, 7, 9, 65):
        assert torch.equal(packed_linear(x[:rows], t.blocks, None, 50), together[:rows])
    assert torch.equal(packed_linear(x[200:201], t.blocks, None, 50), together[200:201])
    strided = torch.randn(300, 2 * k, generator=g)[:, :k]  # rows with a stride, as a view of a wider tensor
    assert torch.equal(
        packed_linear(strided, t.blocks, None, 50), packed_linear(strided.contiguous(), t.blocks, None, 50)
    )


def test_widened_parts_keep_their_values():
    """Q4_0 / Q5_0 parts of a fused projection beside a Q8_0 part become Q8_0 blocks, exactly."""
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(0))
    parts = [
        BlockTensor.from_rows(q, quantize_matrix(w[i * 8 : i * 8 + 8], QUANT_TYPES[q.lower()]))
        for i, q in enumerate(["Q5_0", "Q4_0", "Q8_0"])
    ]
    joined = concat_rows(parts)
    assert joined is not None and joined.qtype == "Q8_0"
    assert torch.equal(joined.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert concat_rows([parts[0], BlockTensor.from_rows("Q4_1", quantize_matrix(w[:8], QUANT_TYPES["q4_1"]))]) is None


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
        check_against_gguf(torch.randn(3, int(t.shape[0]), generator=g), rows, t.tensor_type.name)


@pytest.mark.slow  # 10 s; every format's kernel is checked against the gguf package above
def test_every_matrix_of_the_smollm2_file(smollm2):
    check_packaged("smollm2-135m")


@pytest.mark.slow
def test_every_matrix_of_the_gemma3_file():
    check_packaged("gemma3-270m")


def test_packaged_file_runs_in_its_shipped_formats(smollm2):
    from baton.models.layers import describe_linears

    assert describe_linears(smollm2.engine.model).startswith("linears 120 Q4_1, 1 Q8_0;")


@pytest.mark.parametrize("quantization,hidden", [("q8_0", 64), ("q4_k", 256)])
def test_quantization_at_load_matches_the_dequantized_reference(tmp_path, quantization, hidden):
    """A float checkpoint quantized at load computes what transformers computes on the same
    quantized-then-dequantized weights (gguf's dequantization)."""
    from tests.test_random_models import make_model

    ref, path = make_model(tmp_path, "LlamaForCausalLM", hidden_size=hidden, intermediate_size=2 * hidden)
    llm = LLM(str(path), progress=False, quantization=quantization, kv_cache_memory_bytes=16 << 20)
    qtype = QUANT_TYPES[quantization]
    with torch.no_grad():
        for module in ref.modules():
            if isinstance(module, torch.nn.Linear) and module.in_features % qtype_values(qtype) == 0:
                rows = quantize_matrix(module.weight, qtype)
                module.weight.copy_(torch.from_numpy(gguf.quants.dequantize(rows, qtype)).view_as(module.weight))
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


def qtype_values(qtype) -> int:
    return gguf.GGML_QUANT_SIZES[qtype][0]
