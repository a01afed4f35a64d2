"""The hybrid, MoE and sparse-attention families' decode-only steps as one C++ call (baton/models/fused_decode.py
over each layer's declared steps): the bits of the module-by-module path, prefix-cache hits, and
state checkpoints (Gated DeltaNet, KDA, Mamba2, LFM2's conv windows) taken during decode. (The Llama family's are in
test_batching.py and test_random_models.py.)"""

from __future__ import annotations

import pytest

from baton import LLM, SamplingParams
from tests.test_dsa import dsa_glm5, dsa_v32  # noqa: F401  (the random model fixtures)
from tests.test_falcon_h1 import falcon  # noqa: F401
from tests.test_glm5_flash import flash  # noqa: F401
from tests.test_granite_hybrid import bamba, granite  # noqa: F401
from tests.test_kimi_linear import kimi  # noqa: F401
from tests.test_lfm2 import lfm2, lfm2_moe  # noqa: F401
from tests.test_mtp import glm  # noqa: F401
from tests.test_nemotron_h import nemotron  # noqa: F401
from tests.test_recurrent_hybrid import _ids, qwen3_5, qwen3_next  # noqa: F401

FAMILIES = pytest.mark.parametrize(
    "family",
    [
        *("qwen3_next", "qwen3_5", "kimi", "nemotron", "granite", "bamba", "lfm2", "lfm2_moe", "falcon"),
        *("glm", "dsa_v32", "dsa_glm5", "flash"),
    ],
)

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)


def _tokens(out) -> list[int]:
    return out.outputs[0].token_ids


def _logprobs(out) -> list[float]:
    return [entry[tok].logprob for tok, entry in zip(_tokens(out), out.outputs[0].logprobs)]


def _fused_steps(llm: LLM) -> int:
    decoder = llm.engine.model.fused_decoder
    return 0 if decoder is None else decoder.steps


@FAMILIES
@pytest.mark.parametrize("weights", ["float32", "q4_0"])
def test_fused_decode_has_the_bits_of_the_module_path(family, weights, request, monkeypatch):
    """float32, and 4-bit weights beside an fp8 KV cache (MLA latents and pooled keys included).
    DeepSeek-V3.2 and GLM-5: rotary MLA, their indexers' top-k
    (every prompt here is longer than index_topk), GLM-5's shared selections; GLM-5.3-Flash: the
    pooled indexer (pools completed and checkpointed by decode rows), lower-bounded KDA, clamped
    SwiGLU and hyper-connections."""
    _, path = request.getfixturevalue(family)
    narrow = {} if weights == "float32" else {"quantization": weights, "kv_cache_dtype": "fp8"}
    # no prefix cache: both runs take the same steps, so this compares the two paths alone (a
    # prompt's bits across batches, chunks and hits: test_batch_invariance_hybrids.py)
    llm = LLM(
        str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16, enable_prefix_caching=False, **narrow
    )
    prompts = [{"prompt_token_ids": _ids(n, 50 + n)} for n in (150, 40, 77)]
    fused = llm.generate(prompts, PARAMS)
    assert _fused_steps(llm) >= PARAMS.max_tokens - 1  # the decode steps ran as one C++ call
    monkeypatch.setattr(llm.engine.model, "fused_decode", False)
    steps = _fused_steps(llm)
    modules = llm.generate(prompts, PARAMS)
    assert _fused_steps(llm) == steps
    for f, m in zip(fused, modules):
        assert _tokens(f) == _tokens(m)
        assert _logprobs(f) == _logprobs(m)  # bitwise, not just close
    assert llm.engine.kv.all_free()


@FAMILIES
def test_prefix_cache_repeat_with_fused_decode(family, request):
    _, path = request.getfixturevalue(family)
    llm = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16)
    prompt = {"prompt_token_ids": _ids(150, 2)}
    first = llm.generate([prompt], PARAMS)[0]
    again = llm.generate([prompt], PARAMS)[0]
    assert again.num_cached_tokens == 144
    assert _tokens(again) == _tokens(first) and _logprobs(again) == _logprobs(first)
    assert _fused_steps(llm) >= 2 * (PARAMS.max_tokens - 1)
    assert llm.engine.kv.all_free()


@FAMILIES
def test_checkpoints_taken_during_fused_decode_resume_a_longer_prompt(family, request):
    _, path = request.getfixturevalue(family)
    llm = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16)
    prompt = _ids(150, 3)
    answer = _tokens(
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    )
    assert len(answer) == 30 and _fused_steps(llm) >= 29
    # blocks 160 and 176 were reached by decode steps: their state checkpoints came from the C++ step
    follow_up = {"prompt_token_ids": prompt + answer + _ids(5, 4)}
    out = llm.generate([follow_up], PARAMS)[0]
    assert out.num_cached_tokens == (150 + 30 - 1) // 16 * 16 == 176
    cold = LLM(
        str(path),
        progress=False,
        kv_cache_memory_bytes=64 << 20,
        block_size=16,
        enable_prefix_caching=False,
        fused_decode=False,
    )
    expected = cold.generate([follow_up], PARAMS)[0]
    assert _tokens(out) == _tokens(expected)
    assert max(abs(a - b) for a, b in zip(_logprobs(out), _logprobs(expected))) < 1e-5
    assert llm.engine.kv.all_free()
