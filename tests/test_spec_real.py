"""The real models (SmolLM2, Gemma3 past its sliding window) with each proposer that runs on
them: greedy output with speculation is the output without it, batched, in chunks, on prefix
hits, under preemption and after a PD import; nothing leaks. Long: `pytest -m slow`."""

from __future__ import annotations

import pytest

from baton import LLM, SamplingParams
from tests.conftest import PROMPTS
from tests.test_handoff import prefill_span, run_imported
from tests.test_spec_decode import GROUNDED, NGRAM, _all_free, _ids, _tokens

PARAMS = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
NAMES = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}


def _config(model: str, method: str) -> dict:
    if method == "ngram":
        return NGRAM
    # a same-size draft of quantized weights does not pay: without adaptive it drafts anyway
    return {"method": "draft_model", "model": NAMES[model], "quantization": "q4_0", "adaptive": False}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_speculation_is_exact_on_the_real_models(model, method, request):
    base: LLM = request.getfixturevalue(model)
    name, config = NAMES[model], _config(model, method)
    prompts = _ids(base, GROUNDED + PROMPTS[3:5] + PROMPTS[7:])  # the last: 1,260 tokens, past Gemma3's window
    expected = [_tokens(base, [p], PARAMS)[0] for p in prompts]
    on = LLM(name, progress=False, speculative_config=config)
    assert _tokens(on, prompts, PARAMS) == expected
    assert _tokens(on, prompts[::-1], PARAMS) == expected[::-1]  # prefix hits (the draft's cache too)
    assert on.engine.spec.num_accepted_tokens > 0 and _all_free(on)
    ids = prompts[0]["prompt_token_ids"]
    drafted = on.engine.spec.num_draft_tokens
    assert run_imported(on, ids, prefill_span(base, ids), PARAMS).outputs[0].token_ids == expected[0]
    assert on.engine.spec.num_draft_tokens > drafted and _all_free(on)
    chunked = LLM(name, progress=False, max_num_batched_tokens=64, speculative_config=config)
    assert _tokens(chunked, prompts, PARAMS) == expected and _all_free(chunked)
    short = [0, 1, 3, 4]  # GROUNDED[2] is ~820 tokens
    small = LLM(name, progress=False, num_kv_blocks=12, max_model_len=160, speculative_config=config)
    assert _tokens(small, [prompts[i] for i in short], PARAMS) == [expected[i] for i in short]
    assert small.engine.scheduler.num_preemptions > 0 and _all_free(small)
