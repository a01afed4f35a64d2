"""Acceptance 3 and 6: outputs independent of batch composition, chunking, prefix hits, preemption."""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from baton.models.fused_decode import FusedDecoder
from tests.conftest import PROMPTS, _words

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _tokens(llm: LLM, prompts, params=PARAMS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("model", ["smollm2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_batch_invariance(model, request):
    base: LLM = request.getfixturevalue(model)
    # six short prompts and one of ~200 tokens (prefilled in chunks of 64 below)
    prompts = [{"prompt_token_ids": base.get_tokenizer().encode(p)} for p in [*PROMPTS[:6], _words(1, 20)]]
    one_at_a_time = [_tokens(base, [p])[0] for p in prompts]
    hits = base.engine.scheduler.prefix_hit_tokens
    assert _tokens(base, prompts) == one_at_a_time  # all together, on a warm prefix cache
    assert base.engine.scheduler.prefix_hit_tokens > hits
    name = "smollm2-135m" if model == "smollm2" else "gemma3-270m"
    chunked = LLM(name, progress=False, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert _tokens(chunked, prompts) == one_at_a_time  # together, cold, prefill in chunks of <= 64
    assert chunked.engine.kv.all_free()


@pytest.mark.parametrize("model", ["smollm2", "gemma3", "smollm2_fp8"])
def test_fused_decode_step_gives_the_module_path_bits(model, request, monkeypatch):
    """Decode-only steps run as one C++ call (baton/models/fused_decode.py); steps with a prefill
    run module by module. A decode row must come out the same either way (on an fp8 cache too)."""
    llm: LLM = request.getfixturevalue(model)
    prompts = [{"prompt_token_ids": llm.get_tokenizer().encode(p)} for p in PROMPTS[:3]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
    llm.generate(prompts, params)  # both runs below then find the same prompt blocks cached
    calls = []
    fused_call = FusedDecoder.__call__
    monkeypatch.setattr(FusedDecoder, "__call__", lambda self, *a: calls.append(1) or fused_call(self, *a))
    fused = llm.generate(prompts, params)
    fused_steps = len(calls)
    assert fused_steps >= 11  # every step after the prefills
    monkeypatch.setattr(llm.engine.model, "fused_decode", False)
    modules = llm.generate(prompts, params)
    assert len(calls) == fused_steps  # this run went module by module
    for a, b in zip(fused, modules):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: e.logprob for t, e in x.items()} == {t: e.logprob for t, e in y.items()}
    assert llm.engine.kv.all_free()


@pytest.fixture(scope="module")
def smollm2_fp8(smollm2) -> LLM:
    return LLM("smollm2-135m", progress=False, kv_cache_dtype="fp8")


def test_warm_prefix_cache_gives_same_tokens(smollm2):
    prompts = [{"prompt_token_ids": smollm2.get_tokenizer().encode(_words(1, 30))}]  # ~300 tokens: many blocks
    cold = LLM("smollm2-135m", progress=False, enable_prefix_caching=False)
    expected = _tokens(cold, prompts)
    _tokens(smollm2, prompts)  # warm
    before = smollm2.engine.scheduler.prefix_hit_tokens
    assert _tokens(smollm2, prompts) == expected
    assert smollm2.engine.scheduler.prefix_hit_tokens > before


def test_preemption_completes_with_same_outputs(smollm2):
    tok = smollm2.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(p)} for p in PROMPTS[:6]]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = _tokens(smollm2, prompts, params)
    # 12 blocks of 16 tokens: one request needs up to 4; six at once cannot fit.
    small = LLM("smollm2-135m", progress=False, num_kv_blocks=12, max_model_len=128, enable_prefix_caching=False)
    assert _tokens(small, prompts, params) == expected
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.kv.all_free()
    # With prefix caching on, a preempted request's blocks may be found again on resume.
    cached = LLM("smollm2-135m", progress=False, num_kv_blocks=12, max_model_len=128)
    assert _tokens(cached, prompts, params) == expected
    assert cached.engine.scheduler.num_preemptions > 0
    assert cached.engine.kv.all_free()


def test_int8_kernel_tokens_hold_across_batching_chunking_prefix_hits_and_preemption():
    """The integer GGUF kernels (the default) on the default float16 KV: a row's bits independent
    of its batch in the linears and the attention, so greedy tokens are too."""
    llm = LLM("smollm2-135m", progress=False)
    assert llm.engine.storage.dtype == torch.float16
    from baton.ops import quant_kernel

    assert quant_kernel().startswith("int8-")
    prompts = [{"prompt_token_ids": llm.get_tokenizer().encode(p)} for p in [*PROMPTS[:5], _words(1, 20)]]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    alone = [_tokens(llm, [p], params)[0] for p in prompts]
    assert _tokens(llm, prompts, params) == alone  # together, every prompt a prefix hit
    chunked = LLM("smollm2-135m", progress=False, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert _tokens(chunked, prompts, params) == alone
    small = LLM("smollm2-135m", progress=False, num_kv_blocks=12, max_model_len=128, enable_prefix_caching=False)
    assert _tokens(small, prompts[:5], params) == alone[:5]
    assert small.engine.scheduler.num_preemptions > 0 and small.engine.kv.all_free()
