"""Falcon-H1 (attention and a Mamba2 mixer side by side in every layer, muP multipliers folded at
load) against transformers' torch path: prompt logits at several prefill chunkings, greedy decode,
a prefix-cache hit through the mixers' state checkpoints, each gated-norm order and the biases."""

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
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    mamba_d_ssm=128,
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_chunk_size=16,
    mamba_rms_norm=True,
    mamba_norm_before_gate=False,
    tie_word_embeddings=False,
    rope_theta=10_000.0,
    # every multiplier away from 1, so a fold left out or put in the wrong place shows
    embedding_multiplier=5.66,
    lm_head_multiplier=0.39,
    attention_in_multiplier=1.3,
    attention_out_multiplier=0.94,
    key_multiplier=0.39,
    ssm_in_multiplier=1.25,
    ssm_out_multiplier=0.74,
    mlp_multipliers=[0.88, 0.59],
    ssm_multipliers=[0.35, 0.25, 0.35, 0.5, 0.35],
)
SHAPES = {
    "norm-after-gate": {},
    "no-norm-tied": {"mamba_rms_norm": False, "tie_word_embeddings": True},
    "norm-before-gate-mha": {"mamba_norm_before_gate": True, "num_key_value_heads": 4, "mamba_n_groups": 1},
    "biases-no-conv-bias": {
        "attention_bias": True,
        "mamba_proj_bias": True,
        "projectors_bias": True,
        "mamba_conv_bias": False,
    },
}
PROMPT = torch.randint(3, 256, (150,), generator=torch.Generator().manual_seed(1)).tolist()


def build(tmp_path, **overrides):
    """(reference, path): weights re-randomised at O(1) scale (A_log, D, dt_bias keep HF's init) so
    that both mixers move the logits."""
    return rerandomized(*make_model(tmp_path, "FalconH1ForCausalLM", **{**TINY, **overrides}))


@pytest.fixture(scope="module")
def falcon(tmp_path_factory):
    return build(tmp_path_factory.mktemp("falcon-h1"))


def test_each_layer_pages_its_attention_and_keeps_its_mixers_state(falcon):
    _, path = falcon
    llm = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16)
    spec = llm.engine.kv_spec
    assert [g.layer_ids for g in spec.groups] == [(0, 1, 2)]
    assert [g.layer_ids for g in spec.state_groups] == [(3, 4, 5)]
    assert spec.state_groups[0].state_shapes == ((128 + 2 * 2 * 16, 3), (8, 16, 16))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_prompt_logits_and_greedy_tokens_match_transformers(tmp_path, shape):
    ref, path = build(tmp_path, **SHAPES[shape])
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT]), use_cache=False).logits[0]
    assert expected.abs().max() > 1.0  # a signal the mixers move
    for chunk in (1024, 37):
        llm = LLM(
            str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16, max_num_batched_tokens=chunk
        )
        got = llm.prompt_logits({"prompt_token_ids": PROMPT})
        assert (got - expected).abs().max() / expected.abs().max() < 1e-4, chunk
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    new = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids
    assert llm.engine.model.fused_decoder is not None  # the decode steps ran as one call
    with torch.no_grad():
        logits = ref(torch.tensor([PROMPT + new]), use_cache=False).logits[0]
    assert new == logits[len(PROMPT) - 1 : -1].argmax(-1).tolist()
    assert llm.engine.kv.all_free()


def test_prefix_cache_hit_and_batch_independence(falcon):
    _, path = falcon
    llm = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": PROMPT}], params)[0]
    again = llm.generate([{"prompt_token_ids": PROMPT}], params)[0]
    assert again.num_cached_tokens == 144  # every full block: attention's pages, the mixers' checkpoint at 144
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    crowd = llm.generate([{"prompt_token_ids": PROMPT[:100]}] * 16, params)
    alone = llm.generate([{"prompt_token_ids": PROMPT[:100]}], params)[0].outputs[0].token_ids
    assert {tuple(o.outputs[0].token_ids) for o in crowd} == {tuple(alone)}
    assert llm.engine.kv.all_free()


def test_bad_configs_are_refused_by_name(tmp_path):
    _, path = build(tmp_path)
    config = json.loads((path / "config.json").read_text())
    for change, needle in (
        ({"mamba_n_heads": 7}, "mamba_n_heads"),
        ({"ssm_multipliers": [1.0, 2.0]}, "ssm_multipliers"),
        ({"key_multiplier": 0}, "key_multiplier"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"time_step_limit": [1.0, 0.5]}, "time step limits"),
    ):
        (path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=needle):
            LLM(str(path), progress=False, kv_cache_memory_bytes=16 << 20)
