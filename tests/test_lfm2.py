"""LFM2 and LFM2-MoE (short gated convolutions + attention with q/k norms, SwiGLU MLPs or
sigmoid-routed experts) against transformers' torch path: prompt logits at several prefill
chunkings and shapes, greedy decode, a prefix-cache hit through the conv-window checkpoints (the
layer's only state)."""

from __future__ import annotations

import json

import pytest
import torch

from baton import LLM, SamplingParams
from tests.test_random_models import make_model, rerandomized

TINY = dict(
    vocab_size=256,
    max_position_embeddings=512,
    hidden_size=64,
    intermediate_size=192,  # 2/3 of it, rounded up to block_multiple_of: 128
    block_multiple_of=64,
    num_hidden_layers=5,
    layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    conv_L_cache=3,
    tie_word_embeddings=False,
)
SHAPES = {
    "untied": {},
    "tied-bias-mha": {"tie_word_embeddings": True, "conv_bias": True, "num_key_value_heads": 4},
    "kernel-4-first-attention": {
        "conv_L_cache": 4,
        "layer_types": ["full_attention", "conv", "conv"],
        "num_hidden_layers": 3,
        "block_auto_adjust_ff_dim": False,
    },
}
MOE = dict(  # LFM2-MoE: two dense layers, then 6 sigmoid-routed experts with an expert bias
    vocab_size=256,
    max_position_embeddings=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=6,
    num_experts_per_tok=2,
    num_dense_layers=2,
    routed_scaling_factor=1.5,
    num_hidden_layers=5,
    layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    conv_L_cache=3,
    tie_word_embeddings=False,
)
PROMPT = torch.randint(3, 256, (150,), generator=torch.Generator().manual_seed(1)).tolist()


def build(tmp_path, arch="Lfm2ForCausalLM", **overrides):
    """(reference, path): weights re-randomised at O(1) scale so that every layer moves the logits
    (and the experts' bias so that it steers the choice)."""
    return rerandomized(
        *make_model(tmp_path, arch, **{**(MOE if arch == "Lfm2MoeForCausalLM" else TINY), **overrides}),
        conv=".conv.conv",
        router_bias="expert_bias",
    )


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    return build(tmp_path_factory.mktemp("lfm2"))


@pytest.fixture(scope="module")
def lfm2_moe(tmp_path_factory):
    return build(tmp_path_factory.mktemp("lfm2-moe"), "Lfm2MoeForCausalLM")


@pytest.mark.parametrize("bias", [True, False])
def test_moe_logits_and_greedy_tokens_match_transformers(tmp_path, bias):
    ref, path = build(tmp_path, "Lfm2MoeForCausalLM", use_expert_bias=bias)
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT]), use_cache=False).logits[0]
    llm = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16, max_num_batched_tokens=37)
    got = llm.prompt_logits({"prompt_token_ids": PROMPT})
    assert (got - expected).abs().max() / expected.abs().max() < 1e-4
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    new = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids
    with torch.no_grad():
        logits = ref(torch.tensor([PROMPT + new]), use_cache=False).logits[0]
    assert new == logits[len(PROMPT) - 1 : -1].argmax(-1).tolist()
    assert llm.engine.model.fused_decoder is not None
    assert llm.engine.kv.all_free()


def test_kv_spec_pages_attention_and_keeps_the_conv_window(lfm2):
    _, path = lfm2
    llm = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16)
    spec = llm.engine.kv_spec
    assert [g.layer_ids for g in spec.groups] == [(1, 4)]
    assert [g.layer_ids for g in spec.state_groups] == [(0, 2, 3)]
    assert spec.state_groups[0].state_shapes == ((64, 2),)  # the window of the last 2 inputs: all


@pytest.mark.parametrize("shape", list(SHAPES))
def test_prompt_logits_match_transformers(tmp_path, shape):
    ref, path = build(tmp_path, **SHAPES[shape])
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT]), use_cache=False).logits[0]
    assert expected.abs().max() > 1.0
    for chunk in (1024, 37):
        llm = LLM(
            str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16, max_num_batched_tokens=chunk
        )
        got = llm.prompt_logits({"prompt_token_ids": PROMPT})
        assert (got - expected).abs().max() / expected.abs().max() < 1e-4, chunk
        assert llm.engine.kv.all_free()


def test_greedy_decode_and_prefix_cache_hit(lfm2):
    ref, path = lfm2
    llm = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    new = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids
    with torch.no_grad():
        logits = ref(torch.tensor([PROMPT + new]), use_cache=False).logits[0]
    assert new == logits[len(PROMPT) - 1 : -1].argmax(-1).tolist()
    assert llm.engine.model.fused_decoder is not None
    again = llm.generate([{"prompt_token_ids": PROMPT}], params)[0]
    assert again.num_cached_tokens == 144  # resumed from the window checkpoint at 144
    assert again.outputs[0].token_ids == new
    other = PROMPT[::-1][:97]
    both = llm.generate([{"prompt_token_ids": other}, {"prompt_token_ids": PROMPT[:120]}], params)
    alone = [llm.generate([{"prompt_token_ids": p}], params)[0] for p in (other, PROMPT[:120])]
    assert [o.outputs[0].token_ids for o in both] == [o.outputs[0].token_ids for o in alone]
    assert llm.engine.kv.all_free()


def test_bad_configs_are_refused_by_name(tmp_path):
    _, path = build(tmp_path)
    config = json.loads((path / "config.json").read_text())
    for change, needle in (
        ({"layer_types": ["conv", "sliding_attention", "conv", "conv", "full_attention"]}, "layer_types"),
        ({"conv_L_cache": 1}, "conv_L_cache"),
    ):
        (path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=needle):
            LLM(str(path), progress=False, kv_cache_memory_bytes=16 << 20)
