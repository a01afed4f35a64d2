"""Kimi Linear (KDA recurrent layers + NoPE MLA over a paged latent cache + sigmoid-routed MoE):
a tiny random model matches transformers' torch reference in prompt logits (one-shot and chunked
prefill) and in greedy decode (absorbed MLA), and resumes from the prefix cache."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from baton import LLM, SamplingParams
from tests.test_fp8_kv import torch_fp8_writes
from tests.test_random_models import make_model

TINY = dict(  # /tmp/specs/kimi_tiny.py, in checkpoint-style keys
    vocab_size=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    rms_norm_eps=1e-5,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=None,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    num_experts=8,
    num_experts_per_token=2,
    num_expert_group=2,
    topk_group=1,
    moe_renormalize=True,
    num_shared_experts=1,
    moe_intermediate_size=32,
    routed_scaling_factor=2.446,
    first_k_dense_replace=1,
    linear_attn_config={
        "full_attn_layers": [2, 4],
        "kda_layers": [1, 3],
        "num_heads": 2,
        "head_dim": 16,
        "short_conv_kernel_size": 4,
    },
    tie_word_embeddings=False,
    max_position_embeddings=1024,
)
PROMPT = torch.randint(3, 256, (150,), generator=torch.Generator().manual_seed(1)).tolist()  # not a multiple of 64


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return build(tmp_path_factory.mktemp("kimi"))


def build(tmp_path):
    """(reference, directory): weights re-randomised at O(1) scale so a wrong term shows."""
    ref, path = make_model(tmp_path, "KimiLinearForCausalLM", **TINY)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue  # keep the FLA-style decay init
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 if "conv1d" in name else p.shape[-1] ** -0.5))
        for name, b in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    ref.save_pretrained(path)
    return ref, path


def _llm(path, chunk: int) -> LLM:
    return LLM(str(path), progress=False, block_size=16, max_num_batched_tokens=chunk, kv_cache_memory_bytes=64 << 20)


def test_reference_runs_torch_fallback():
    assert importlib.util.find_spec("fla") is None  # transformers' chunk_kda / fused_recurrent_kda in torch


@pytest.mark.parametrize("chunk", [1024, 37, 100])
def test_prompt_logits_match_reference(kimi, chunk):
    ref, path = kimi
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT]), use_cache=False).logits[0]
    got = _llm(path, chunk).prompt_logits({"prompt_token_ids": PROMPT})
    assert got.shape == expected.shape
    assert (got - expected).abs().max() / expected.abs().max() < 1e-4


def _reference_greedy(ref, ids: list[int], new: list[int]) -> list[int]:
    with torch.no_grad():
        logits = ref(torch.tensor([ids + new]), use_cache=False).logits[0]
    return [logits[len(ids) - 1 + i].argmax().item() for i in range(len(new))]


def test_greedy_decode_and_prefix_cache(kimi):
    ref, path = kimi
    llm = _llm(path, 64)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params)[0]
    new = out.outputs[0].token_ids
    assert len(new) == 8 and new == _reference_greedy(ref, PROMPT, new)
    again = llm.generate([{"prompt_token_ids": PROMPT}], params)[0]
    assert again.num_cached_tokens == 144  # 9 blocks of MLA latents + the KDA state checkpoint
    assert again.outputs[0].token_ids == new
    # decodes of different lengths in one step (the absorbed path's padded gather)
    prompts = [PROMPT[:40], PROMPT[60:133]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _reference_greedy(ref, p, o.outputs[0].token_ids)
    assert llm.engine.kv.all_free()


def test_fp8_latent_cache(kimi, monkeypatch):
    """MLA latents in fp8, a scale per block: the logits of the float32 model whose cache holds
    torch's e4m3 quantization of them, and a prefix-cache hit reads what its writer wrote."""
    _, path = kimi
    llm = LLM(str(path), progress=False, block_size=16, kv_cache_memory_bytes=64 << 20, kv_cache_dtype="fp8")
    assert llm.engine.storage.k[0].dtype == torch.float8_e4m3fn
    got = llm.prompt_logits({"prompt_token_ids": PROMPT})
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": PROMPT}], params)[0]
    again = llm.generate([{"prompt_token_ids": PROMPT}], params)[0]
    assert again.num_cached_tokens == 144 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.engine.kv.all_free()
    torch_fp8_writes(monkeypatch)
    assert torch.equal(got, _llm(path, 1024).prompt_logits({"prompt_token_ids": PROMPT}))
