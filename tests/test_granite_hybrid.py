"""Granite-4.0-H (GraniteMoeHybrid: Mamba2 + attention, softmax MoE + shared expert or a dense MLP,
IBM's multipliers) and Bamba against transformers' torch path: prompt logits at several prefill
chunkings, greedy decode, a prefix-cache hit through the state checkpoints."""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from tests.test_random_models import make_model, rerandomized

TINY = dict(
    vocab_size=256,
    max_position_embeddings=512,
    hidden_size=64,
    num_hidden_layers=5,
    layer_types=["mamba", "attention", "mamba", "mamba", "attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=32,
    shared_intermediate_size=48,
    num_local_experts=6,
    num_experts_per_tok=2,
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_chunk_size=16,
    embedding_multiplier=6.0,
    residual_multiplier=0.4,
    attention_multiplier=0.2,
    logits_scaling=2.0,
    tie_word_embeddings=False,
)
SHAPES = {
    "moe-nope": {},
    "moe-rope-tied": {"position_embedding_type": "rope", "tie_word_embeddings": True},
    "dense": {"num_local_experts": 0, "layer_types": ["attention", "mamba", "mamba"], "num_hidden_layers": 3},
    "mha-one-group": {"num_key_value_heads": 4, "mamba_n_groups": 1, "position_embedding_type": "rope"},
}
BAMBA = dict(  # rotary on half of each head, a dense MLP, no multipliers
    vocab_size=256,
    max_position_embeddings=512,
    hidden_size=64,
    num_hidden_layers=4,
    attn_layer_indices=[1, 3],
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_chunk_size=16,
    tie_word_embeddings=False,
)
PROMPT = torch.randint(3, 256, (150,), generator=torch.Generator().manual_seed(1)).tolist()


def build(tmp_path, arch="GraniteMoeHybridForCausalLM", **overrides):
    """(reference, path): weights re-randomised at O(1) scale (A_log, D, dt_bias keep HF's init) so
    that every mixer moves the logits."""
    return rerandomized(*make_model(tmp_path, arch, **{**(BAMBA if arch == "BambaForCausalLM" else TINY), **overrides}))


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    return build(tmp_path_factory.mktemp("granite"))


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    return build(tmp_path_factory.mktemp("bamba"), "BambaForCausalLM")


def test_kv_spec_pages_attention_and_keeps_state_for_mamba(granite):
    _, path = granite
    llm = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16)
    spec = llm.engine.kv_spec
    assert [g.layer_ids for g in spec.groups] == [(1, 4)]
    assert [g.layer_ids for g in spec.state_groups] == [(0, 2, 3)]
    assert spec.state_groups[0].state_shapes == ((128 + 2 * 2 * 16, 3), (8, 16, 16))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_prompt_logits_match_transformers(tmp_path, shape):
    ref, path = build(tmp_path, **SHAPES[shape])
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT]), use_cache=False).logits[0]
    assert expected.abs().max() > 1.0  # a signal the mixers move
    for chunk in (1024, 37):
        llm = LLM(
            str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16, max_num_batched_tokens=chunk
        )
        got = llm.prompt_logits({"prompt_token_ids": PROMPT})
        assert got.shape == expected.shape
        assert (got - expected).abs().max() / expected.abs().max() < 1e-4, chunk
        assert llm.engine.kv.all_free()


def test_greedy_decode_and_prefix_cache_hit(granite):
    ref, path = granite
    llm = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": PROMPT}], params)[0]
    new = first.outputs[0].token_ids
    with torch.no_grad():
        logits = ref(torch.tensor([PROMPT + new]), use_cache=False).logits[0]
    assert new == logits[len(PROMPT) - 1 : -1].argmax(-1).tolist()
    again = llm.generate([{"prompt_token_ids": PROMPT}], params)[0]
    assert again.num_cached_tokens == 144  # every full block, resumed from the Mamba checkpoint at 144
    assert again.outputs[0].token_ids == new
    other = PROMPT[::-1][:97]
    both = llm.generate([{"prompt_token_ids": other}, {"prompt_token_ids": PROMPT[:120]}], params)
    alone = [llm.generate([{"prompt_token_ids": p}], params)[0] for p in (other, PROMPT[:120])]
    assert [o.outputs[0].token_ids for o in both] == [o.outputs[0].token_ids for o in alone]
    assert llm.engine.kv.all_free()


def test_bamba_logits_greedy_tokens_and_prefix_hit(bamba):
    ref, path = bamba
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT]), use_cache=False).logits[0]
    llm = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16, max_num_batched_tokens=37)
    assert llm.engine.model.layers[1].self_attn.partial_rotary  # half of each head
    got = llm.prompt_logits({"prompt_token_ids": PROMPT})
    assert expected.abs().max() > 1.0
    assert (got - expected).abs().max() / expected.abs().max() < 1e-4
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    new = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids
    with torch.no_grad():
        logits = ref(torch.tensor([PROMPT + new]), use_cache=False).logits[0]
    assert new == logits[len(PROMPT) - 1 : -1].argmax(-1).tolist()
    assert llm.engine.model.fused_decoder is not None
    again = llm.generate([{"prompt_token_ids": PROMPT}], params)[0]
    assert again.num_cached_tokens == 144 and again.outputs[0].token_ids == new
    assert llm.engine.kv.all_free()


def test_bad_configs_are_refused_by_name(tmp_path):
    import json

    _, path = build(tmp_path)
    config = json.loads((path / "config.json").read_text())
    for change, needle in (
        ({"layer_types": ["mamba", "cross_attention"] * 2 + ["mamba"]}, "layer types"),
        ({"residual_multiplier": 0}, "residual_multiplier"),
        ({"time_step_limit": [1.0, 0.5]}, "time step limits"),
        ({"mamba_n_heads": 7, "mamba_d_head": "auto"}, "mamba_n_heads"),
    ):
        (path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=needle):
            LLM(str(path), progress=False, kv_cache_memory_bytes=16 << 20)
