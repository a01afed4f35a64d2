"""The hybrid GGUF files llama.cpp writes (qwen35, qwen35moe, qwen3next, nemotron_h_moe, a dense
Nemotron-H, granitehybrid with experts and dense, lfm2, lfm2moe), made from random transformers checkpoints by
llama.cpp's own converter: served by baton
with transformers' greedy tokens on the source checkpoint (and so is the checkpoint's directory);
quantized files' blocks placed as their float values are; bad files refused at load, naming the file
and the problem."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from baton import LLM, SamplingParams
from baton.models.gguf_arch import experts, take_column_groups, take_rows
from baton.models.gguf_blocks import BlockTensor
from baton.models.loader import WeightMismatchError, load_model
from baton.models.weight_map import BlockRows
from bench.gguf_rewrite import rewrite
from bench.hybrid_files import converted, converter_source
from tests.gguf_files import VOCAB, convert, quantized
from tests.test_falcon_h1 import TINY as FALCON
from tests.test_granite_hybrid import BAMBA
from tests.test_granite_hybrid import TINY as GRANITE
from tests.test_kimi_linear import TINY as KIMI
from tests.test_lfm2 import MOE as LFM2_MOE
from tests.test_lfm2 import TINY as LFM2
from tests.test_random_models import make_model

QWEN = dict(  # 2 key heads, 4 value heads: qwen35 files hold them tiled
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=32,  # n_k != n_v head dims too
    max_position_embeddings=4096,
)
NEMOTRON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    mamba_num_heads=8,
    mamba_head_dim=8,
    n_groups=2,
    ssm_state_size=16,
    conv_kernel=4,
    max_position_embeddings=4096,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
NEMOTRON_MOE = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
)
CASES = {  # name: (architecture, config, the GGUF architecture the converter writes)
    "qwen35-odd-pattern": (
        "Qwen3_5ForCausalLM",
        {
            **QWEN,
            "num_hidden_layers": 5,
            "layer_types": ["linear_attention", "full_attention"] + ["linear_attention"] * 2 + ["full_attention"],
        },
        "qwen35",
    ),
    "qwen3next-moe": ("Qwen3NextForCausalLM", {**QWEN, **MOE, "num_hidden_layers": 4}, "qwen3next"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", {**QWEN, **MOE, "num_hidden_layers": 4}, "qwen35moe"),
    "nemotron_h-moe": (
        "NemotronHForCausalLM",
        {**NEMOTRON, **NEMOTRON_MOE, "hybrid_override_pattern": "M*MEM*E", "tie_word_embeddings": False},
        "nemotron_h_moe",
    ),
    "nemotron_h-dense-tied": (
        "NemotronHForCausalLM",
        {**NEMOTRON, "hybrid_override_pattern": "M*M-M-"},
        "nemotron_h",
    ),
    "granitehybrid-moe": ("GraniteMoeHybridForCausalLM", {**GRANITE, "vocab_size": VOCAB}, "granitehybrid"),
    "granitehybrid-dense-tied": (
        "GraniteMoeHybridForCausalLM",
        {
            **GRANITE,
            "vocab_size": VOCAB,
            "num_local_experts": 0,
            "tie_word_embeddings": True,
            "layer_types": ["attention", "mamba", "mamba", "attention", "mamba"],
            "num_key_value_heads": 4,
            "mamba_n_groups": 1,
        },
        "granitehybrid",
    ),
    "bamba": ("BambaForCausalLM", {**BAMBA, "vocab_size": VOCAB}, "granitehybrid"),
    "lfm2": ("Lfm2ForCausalLM", {**LFM2, "vocab_size": VOCAB}, "lfm2"),
    # tied and unscaled, as LiquidAI's: the converter cannot map an untied lfm2moe lm_head and
    # writes no routed_scaling_factor
    "lfm2moe": (
        "Lfm2MoeForCausalLM",
        {**LFM2_MOE, "vocab_size": VOCAB, "tie_word_embeddings": True, "routed_scaling_factor": 1.0},
        "lfm2moe",
    ),
    # untied: a tied file's lm_head is the embedding the converter scaled, as llama.cpp reads it
    "falcon-h1": ("FalconH1ForCausalLM", {**FALCON, "vocab_size": VOCAB}, "falcon-h1"),
    "falcon-h1-no-norm-mha": (
        "FalconH1ForCausalLM",
        {**FALCON, "vocab_size": VOCAB, "mamba_rms_norm": False, "num_key_value_heads": 4, "mamba_n_groups": 1},
        "falcon-h1",
    ),
    # KDA heads = MLA heads, as llama.cpp sizes both by attention.head_count
    "kimi-linear": (
        "KimiLinearForCausalLM",
        {**KIMI, "vocab_size": VOCAB, "linear_attn_config": {**KIMI["linear_attn_config"], "num_heads": 4}},
        "kimi-linear",
    ),
    "lfm2-tied-kernel-4": (  # (the converter fails on a conv bias: it squeezes the bias like the kernel)
        "Lfm2ForCausalLM",
        {**LFM2, "vocab_size": VOCAB, "tie_word_embeddings": True, "conv_L_cache": 4},
        "lfm2",
    ),
}
PROMPTS = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 40, 77)]


class _Files(dict):
    """case -> (transformers reference, F32 GGUF path, HF directory), each converted when first asked
    for (a case only the slow tests use costs the default suite nothing)."""

    def __init__(self, root) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, case: str):
        arch, config, _ = CASES[case]
        ref, hf_dir = make_model(self.root.mktemp(case), arch, **config)
        no_mtp = ("--no-mtp",) if arch.startswith("Qwen3") else ()  # others refuse the flag
        path = convert(converter_source(hf_dir, arch), hf_dir.parent / f"{case}.gguf", *no_mtp)
        path = converted(path, arch, config)
        self[case] = ref, path, hf_dir
        return self[case]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return _Files(tmp_path_factory)


# (lfm2moe: lfm2's file layout with nemotron_h-moe's kind of experts, which the default suite keeps)
# (the default suite keeps one file per kind of mixer: Gated DeltaNet, Mamba2 with MoE, Mamba2 with
# Granite's multipliers, LFM2's short convolution; `make test-slow` converts every case)
SLOW_CASES = (
    *("granitehybrid-dense-tied", "bamba", "lfm2-tied-kernel-4", "falcon-h1-no-norm-mha", "lfm2moe"),
    *("qwen3next-moe", "qwen35moe", "nemotron_h-dense-tied", "falcon-h1", "kimi-linear"),
)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES])
def test_llama_cpp_files_give_transformers_tokens(files, case):
    ref, path, hf_dir = files[case]
    assert gguf.GGUFReader(str(path)).fields["general.architecture"].contents() == CASES[case][2]
    llm = LLM(str(path), progress=False, block_size=16, max_num_batched_tokens=37, kv_cache_memory_bytes=64 << 20)
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPTS[2]])).logits[0]
    got = llm.prompt_logits({"prompt_token_ids": PROMPTS[2]})
    assert (got - expected).abs().max() / expected.abs().max() < 1e-3
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )
    for prompt, out in zip(PROMPTS, outs):
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == want
    assert llm.engine.model.fused_decoder is not None  # the decode steps ran as one C++ call
    assert llm.engine.kv.all_free()
    # the source directory itself: the same tokens
    from_dir = LLM(str(hf_dir), progress=False, block_size=16, kv_cache_memory_bytes=64 << 20)
    again = from_dir.generate(
        [{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )
    assert again[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


@pytest.mark.parametrize(
    "case",
    [
        "qwen35-odd-pattern",
        pytest.param("nemotron_h-moe", marks=pytest.mark.slow),
        pytest.param("granitehybrid-moe", marks=pytest.mark.slow),
        pytest.param("lfm2", marks=pytest.mark.slow),
        pytest.param("falcon-h1", marks=pytest.mark.slow),
        # KDA's fused in_proj gathered in blocks (PartsWeightMap), kv_b dequantized
        pytest.param("kimi-linear", marks=pytest.mark.slow),
    ],
)
def test_q8_0_blocks_sit_where_their_float_values_do(files, tmp_path, case):
    """The converter's transforms undone on blocks (rows regathered, tiled value heads, stacked
    experts) give what the same file gives dequantized at load: the float kernel reads blocks with
    the gguf package's formulas (summing K in parts, so equal to float rounding, not to the bit; a
    misplaced row would move logits by their own size)."""
    path = quantized(files[case][1], tmp_path / "q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    blocks = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, quant_kernel="float")
    assert "Q8_0" in {m.qtype for m in blocks.engine.model.modules() if hasattr(m, "qtype")}
    dense = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, dtype="float32")
    a = blocks.prompt_logits({"prompt_token_ids": PROMPTS[1]})
    b = dense.prompt_logits({"prompt_token_ids": PROMPTS[1]})
    assert (a - b).abs().max() / b.abs().max() < 1e-3
    # on the integer kernels: 16 identical greedy prompts at once give one answer, the lone request's
    ints = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=256)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = ints.generate([{"prompt_token_ids": PROMPTS[1]}], greedy)[0].outputs[0].token_ids
    crowd = ints.generate([{"prompt_token_ids": PROMPTS[1]}] * 16, greedy)
    assert {tuple(o.outputs[0].token_ids) for o in crowd} == {tuple(alone)}
    assert ints.engine.kv.all_free()


def test_gated_deltanet_projections_in_different_formats_stay_blocks(files, tmp_path, monkeypatch):
    """Q4_K_M writes a Qwen3.5 layer's attn_qkv in one format and its attn_gate (z) in another:
    both stay blocks in the fused projection (row runs, each on its own kernel), nothing falls back
    to float32, and the logits are the dequantized file's."""
    formats = {"attn_qkv": gguf.GGMLQuantizationType.Q8_0, "attn_gate": gguf.GGMLQuantizationType.Q5_0}

    def mixed(name: str, data, stored):
        qtype = next((q for part, q in formats.items() if f".{part}." in name), None)
        if qtype is None:
            return data, list(data.shape), stored
        return gguf.quants.quantize(data, qtype), list(data.shape), qtype

    path = rewrite(files["qwen35-odd-pattern"][1], tmp_path / "mixed.gguf", tensor=mixed)
    blocks = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, quant_kernel="float")
    projections = [m.in_proj_qkvz for m in blocks.engine.model.modules() if hasattr(m, "in_proj_qkvz")]
    assert projections and all([q.qtype for q in p.parts()] == ["Q8_0", "Q5_0"] for p in projections)
    dense = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, dtype="float32")
    a = blocks.prompt_logits({"prompt_token_ids": PROMPTS[1]})
    b = dense.prompt_logits({"prompt_token_ids": PROMPTS[1]})
    assert (a - b).abs().max() / b.abs().max() < 1e-3
    # the one-call decode step takes the parts as they are, with the module path's bits
    ints = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    fused = ints.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)
    assert ints.engine.model.fused_decoder is not None and ints.engine.model.fused_decoder.steps >= 7
    monkeypatch.setattr(ints.engine.model, "fused_decode", False)
    modules = ints.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)
    for f, m in zip(fused, modules):
        assert f.outputs[0].token_ids == m.outputs[0].token_ids
        assert f.outputs[0].logprobs == m.outputs[0].logprobs
    assert ints.engine.kv.all_free()


def _refused(path, *words):
    with pytest.raises((ValueError, WeightMismatchError)) as e:
        load_model(str(path), torch.float32)
    for w in (path.name, *words):
        assert w in str(e.value)


def test_bad_files_are_refused_naming_the_file_and_the_problem(files, tmp_path):
    """Each refused before a weight is read (check_weights and the reader run first)."""
    no_vocab = {"tokenizer.ggml.tokens": None, "tokenizer.ggml.merges": None, "tokenizer.ggml.token_type": None}
    src = rewrite(files["qwen35-odd-pattern"][1], tmp_path / "src.gguf", no_vocab)  # smaller and quicker to rewrite
    load_model(str(src), torch.float32)  # the good file loads
    string = gguf.GGUFValueType.STRING
    _refused(rewrite(src, tmp_path / "arch.gguf", {"general.architecture": ("mamba9", string, None)}), "'mamba9'")
    flags = ([True, False, True], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL)
    _refused(
        rewrite(src, tmp_path / "layers.gguf", {"qwen35.attention.recurrent_layers": flags}), "3 entries for 5 layers"
    )

    def narrow(name, data, qtype):
        return (
            (data[:, :-1], list(data[:, :-1].shape), qtype)
            if name == "blk.0.ssm_out.weight"
            else (data, list(data.shape), qtype)
        )

    _refused(rewrite(src, tmp_path / "shape.gguf", tensor=narrow), "blk.0.ssm_out.weight", "[64, 127]")

    def shorter(name, data, qtype):  # a shape the transforms take, and the model does not
        return (
            (data[:-1], list(data[:-1].shape), qtype)
            if name == "blk.1.attn_output.weight"
            else (data, list(data.shape), qtype)
        )

    _refused(rewrite(src, tmp_path / "rows.gguf", tensor=shorter), "model.layers.1.self_attn.o_proj.weight")

    def as_ints(name, data, qtype):
        if name == "blk.0.ssm_norm.weight":
            return data.astype(np.int32), list(data.shape), gguf.GGMLQuantizationType.I32
        return data, list(data.shape), qtype

    _refused(rewrite(src, tmp_path / "type.gguf", tensor=as_ints), "blk.0.ssm_norm.weight", "I32")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    _refused(cut, "not a readable GGUF file")


@pytest.mark.slow  # 21 s of the default suite's longest file (its worker is the suite's long pole)
def test_a_file_with_nextn_blocks_keeps_them_aside(files, tmp_path):
    """An MTP block after the trunk (nextn_predict_layers) is not read, and not an error."""
    src = files["qwen3next-moe"][1]
    count, array = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.ARRAY
    fields = {
        "qwen3next.block_count": (5, count, None),
        "qwen3next.nextn_predict_layers": (1, count, None),
        "qwen3next.attention.recurrent_layers": ([True, True, True, False, False], array, gguf.GGUFValueType.BOOL),
    }
    mtp = [
        (t.name.replace("blk.3.", "blk.4."), t)
        for t in gguf.GGUFReader(str(src)).tensors
        if t.name.startswith("blk.3.")
    ]
    path = rewrite(src, tmp_path / "mtp.gguf", fields, added=mtp)
    assert any(t.name.startswith("blk.4.") for t in gguf.GGUFReader(str(path)).tensors)
    llm = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20)
    assert llm.engine.model.cfg.num_layers == 4
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    ref = files["qwen3next-moe"][0]
    want = ref.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=4, do_sample=False)[0, len(PROMPTS[1]) :].tolist()
    assert out[0].outputs[0].token_ids == want


# ---- the transforms on blocks, against the same transforms on their float values -----------------


def _q8(rows: int, cols: int, seed: int) -> BlockTensor:
    data = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).numpy()
    return BlockTensor.from_rows("Q8_0", gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0))


def test_block_transforms_equal_their_float_counterparts():
    w = _q8(24, 128, 0)
    rows = torch.randperm(24, generator=torch.Generator().manual_seed(1))
    assert torch.equal(take_rows(w, rows).dequantize(), w.dequantize()[rows])
    order = torch.tensor([2, 0, 3, 1])
    aligned = take_column_groups(w, order, 32)  # whole Q8_0 blocks: stays blocks
    assert isinstance(aligned, BlockTensor) and torch.equal(
        aligned.dequantize(), take_column_groups(w.dequantize(), order, 32)
    )
    split = take_column_groups(w, torch.tensor([1, 0, 3, 2, 5, 4, 7, 6]), 16)  # half blocks: dequantized
    assert torch.equal(split, take_column_groups(w.dequantize(), torch.tensor([1, 0, 3, 2, 5, 4, 7, 6]), 16))
    parts = experts(w, 3)
    assert all(torch.equal(p.dequantize(), w.dequantize()[8 * i : 8 * (i + 1)]) for i, p in enumerate(parts))


def test_block_rows_join_scatter_and_fall_back_to_float():
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.zeros(8, 64))
            self.b = torch.nn.Parameter(torch.zeros(8, 64))

    model, kept = Holder(), {}
    rows = BlockRows(model, kept)
    x, y = _q8(4, 64, 1), _q8(4, 64, 2)
    even, odd = torch.arange(0, 8, 2), torch.arange(1, 8, 2)
    rows.place("a", even, x)
    assert "a" not in kept  # waits for its other rows
    rows.place("a", odd, y)
    joined = kept["a"].dequantize()
    assert torch.equal(joined[even], x.dequantize()) and torch.equal(joined[odd], y.dequantize())
    rows.place("b", even, x)
    rows.place("b", odd, y.dequantize())  # a float part: the whole parameter is float
    rows.finish()
    assert (
        "b" not in kept
        and torch.equal(model.b.data[even], x.dequantize())
        and torch.equal(model.b.data[odd], y.dequantize())
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen35-odd-pattern", "nemotron_h-moe"])
def test_quantized_hybrid_files_at_tp2_and_pp2_match_one_rank(files, tmp_path, case):
    """A Q8_0 file's blocks (BlockRows' joins, experts split by rows) sharded over two ranks and cut
    into two stages: one rank's tokens, logits within 1e-4. The float kernel on float32 KV, as for
    SmolLM2 in test_tensor_parallel.py: experts summed on two ranks change the last bit, which
    int8's activation codes would turn into more."""
    from tests.test_tensor_parallel import _same

    path = quantized(files[case][1], tmp_path / "q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    settings = dict(quant_kernel="float", kv_cache_dtype="float32", block_size=16, kv_cache_memory_bytes=64 << 20)
    _same(str(path), prompts, **settings)
