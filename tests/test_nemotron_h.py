"""NemotronH (Mamba2 + NoPE attention + relu2 MLP + sigmoid MoE) against transformers' torch path:
prompt logits at several prefill chunkings, greedy decode, a prefix-cache hit through the state
checkpoints."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from baton import LLM, SamplingParams
from tests.test_random_models import make_model, rerandomized

TINY = dict(  # /tmp/specs/mamba2_tiny.py's config: every layer kind, MoE with grouped routing
    vocab_size=256,
    max_position_embeddings=512,
    hybrid_override_pattern="ME*M-E",
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    mamba_num_heads=8,
    mamba_head_dim=8,
    n_groups=2,
    ssm_state_size=16,
    conv_kernel=4,
    chunk_size=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    tie_word_embeddings=False,
)
PROMPT = torch.randint(3, 256, (150,), generator=torch.Generator().manual_seed(1)).tolist()


def build(tmp_path, **overrides):
    """(reference, path): weights re-randomised at O(1) scale (A_log, D, dt_bias keep HF's init) so
    that every mixer moves the logits."""
    return rerandomized(
        *make_model(tmp_path, "NemotronHForCausalLM", **{**TINY, **overrides}), router_bias="e_score_correction_bias"
    )


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    return build(tmp_path_factory.mktemp("nemotron_h"))


def test_reference_runs_the_torch_fallbacks():
    assert importlib.util.find_spec("mamba_ssm") is None and importlib.util.find_spec("causal_conv1d") is None


def test_kv_spec_pages_attention_and_keeps_state_for_mamba_only(nemotron):
    _, path = nemotron
    llm = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16)
    spec = llm.engine.kv_spec
    assert [g.layer_ids for g in spec.groups] == [(2,)]  # '*' only
    assert [g.layer_ids for g in spec.state_groups] == [(0, 3)]  # 'M' only
    assert spec.state_groups[0].state_shapes == ((64 + 2 * 2 * 16, 3), (8, 16, 8))
    assert spec.layer_to_group[1] is spec.layer_to_state[1] is None  # MoE: no memory
    assert spec.layer_to_group[4] is spec.layer_to_state[4] is None  # MLP: no memory


@pytest.mark.parametrize("chunk", [1024, 37, 100])
def test_prompt_logits_match_transformers(nemotron, chunk):
    ref, path = nemotron
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT]), use_cache=False).logits[0]
    llm = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16, max_num_batched_tokens=chunk)
    got = llm.prompt_logits({"prompt_token_ids": PROMPT})
    assert got.shape == expected.shape
    assert expected.abs().max() > 1.0  # a signal the mixers move
    assert (got - expected).abs().max() / expected.abs().max() < 1e-4
    assert llm.engine.kv.all_free()


def test_greedy_decode_and_prefix_cache_hit(nemotron):
    ref, path = nemotron
    llm = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": PROMPT}], params)[0]
    new = first.outputs[0].token_ids
    assert len(new) == 8
    with torch.no_grad():
        logits = ref(torch.tensor([PROMPT + new]), use_cache=False).logits[0]
    assert new == logits[len(PROMPT) - 1 : -1].argmax(-1).tolist()
    again = llm.generate([{"prompt_token_ids": PROMPT}], params)[0]
    assert again.num_cached_tokens == 144  # every full block, resumed from the Mamba checkpoint at 144
    assert again.outputs[0].token_ids == new
    # two different requests in one batch keep their own state slots
    other = PROMPT[::-1][:97]
    both = llm.generate([{"prompt_token_ids": other}, {"prompt_token_ids": PROMPT[:120]}], params)
    alone = [llm.generate([{"prompt_token_ids": p}], params)[0] for p in (other, PROMPT[:120])]
    assert [o.outputs[0].token_ids for o in both] == [o.outputs[0].token_ids for o in alone]
    assert llm.engine.kv.all_free()


def test_latent_moe_prompt_logits(tmp_path):
    """Nemotron-3-Super-style MoE: experts run in a latent space between fc1/fc2_latent_proj."""
    ref, path = build(tmp_path, moe_latent_size=32, hybrid_override_pattern="E*M")
    ids = PROMPT[:40]
    with torch.no_grad():
        expected = ref(torch.tensor([ids]), use_cache=False).logits[0]
    got = LLM(
        str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16, max_num_batched_tokens=17
    ).prompt_logits({"prompt_token_ids": ids})
    assert (got - expected).abs().max() / expected.abs().max() < 1e-4
