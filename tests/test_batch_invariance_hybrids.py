"""A request's bits do not depend on its batch (docs/design.md, "Batch invariance is a kernel
property"): every hybrid, MoE and sparse-attention family, each prompt alone against the three
together in steps of at most 64 tokens (chunks of different prompts side by side, decodes beside
prefill chunks) and again on a warm prefix cache (resumed from state checkpoints). Logprobs are
compared bitwise, not within a tolerance."""

from __future__ import annotations

import pytest

from baton import LLM, SamplingParams
from tests.test_dsa import dsa_glm5, dsa_v32  # noqa: F401  (the random model fixtures)
from tests.test_falcon_h1 import falcon  # noqa: F401
from tests.test_fused_decode import _logprobs, _tokens
from tests.test_glm5_flash import flash  # noqa: F401
from tests.test_granite_hybrid import bamba, granite  # noqa: F401
from tests.test_kimi_linear import kimi  # noqa: F401
from tests.test_lfm2 import lfm2, lfm2_moe  # noqa: F401
from tests.test_mtp import glm  # noqa: F401
from tests.test_nemotron_h import nemotron  # noqa: F401
from tests.test_recurrent_hybrid import _ids, qwen3_5, qwen3_next  # noqa: F401

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)

# MLA's prefill runs torch's flash attention over latents expanded by torch's linear, and its
# absorbed decode torch's einsums: their blocking follows the chunk and the batch
MLA_GAP = pytest.mark.xfail(strict=True, reason="MLA attention is not row-invariant yet (docs/design.md)")
FAMILIES = pytest.mark.parametrize(
    "family",
    [
        *("qwen3_next", "qwen3_5", "nemotron", "granite", "bamba", "lfm2", "lfm2_moe", "falcon", "glm"),
        *(pytest.param(f, marks=MLA_GAP) for f in ("kimi", "dsa_v32", "dsa_glm5", "flash")),
    ],
)


@FAMILIES
def test_a_prompt_has_the_same_bits_alone_batched_chunked_and_resumed(family, request):
    _, path = request.getfixturevalue(family)
    prompts = [{"prompt_token_ids": _ids(n, 50 + n)} for n in (150, 40, 77)]
    alone = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16, enable_prefix_caching=False)
    expected = [alone.generate([p], PARAMS)[0] for p in prompts]
    llm = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16, max_num_batched_tokens=64)
    for run in ("cold", "warm"):
        outs = llm.generate(prompts, PARAMS)
        for prompt, out, ref in zip(prompts, outs, expected):
            where = f"{run}, {len(prompt['prompt_token_ids'])}-token prompt"
            assert _tokens(out) == _tokens(ref), where
            assert _logprobs(out) == _logprobs(ref), where
    assert outs[0].num_cached_tokens == 144  # the warm run resumed from the checkpoints
    assert llm.engine.kv.all_free()
