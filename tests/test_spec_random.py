"""Every proposer on the random hybrids (Qwen3-Next: Gated DeltaNet + attention + MoE; Granite-4.0-H:
Mamba2 + attention + MoE; GLM-4-MoE with its MTP layer): greedy output with speculation is the
output without it, batched, in chunks, on prefix hits, under preemption and after a PD import;
nothing leaks."""

from __future__ import annotations

import pytest

from baton import LLM, SamplingParams
from tests.test_falcon_h1 import falcon  # noqa: F401 - the fixture
from tests.test_granite_hybrid import granite  # noqa: F401 - the fixture
from tests.test_handoff import prefill_span, run_imported
from tests.test_lfm2 import lfm2  # noqa: F401 - the fixture
from tests.test_mtp import GLM, glm  # noqa: F401 - the fixture
from tests.test_random_models import make_model
from tests.test_recurrent_hybrid import QWEN3_NEXT
from tests.test_spec_decode import _all_free, _loops

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("qwen3-next-matrix"), "Qwen3NextForCausalLM", **QWEN3_NEXT)[1]


@pytest.fixture(scope="module")
def llama_draft(tmp_path_factory):
    """An attention-only draft over the same 256-token vocabulary."""
    return make_model(tmp_path_factory.mktemp("llama-draft"), "LlamaForCausalLM", num_hidden_layers=1)[1]


CASES = [  # the default suite runs one per model; `-m slow` all of them
    ("qwen3_next", "ngram"),
    pytest.param("qwen3_next", "draft_model", marks=pytest.mark.slow),
    pytest.param("granite", "ngram", marks=pytest.mark.slow),  # Mamba2 state rolled back per draft
    pytest.param("lfm2", "ngram", marks=pytest.mark.slow),  # conv windows rolled back per draft
    pytest.param("falcon", "ngram", marks=pytest.mark.slow),  # KV and state of one layer rolled back
    pytest.param("glm", "ngram", marks=pytest.mark.slow),
    pytest.param("glm", "draft_model", marks=pytest.mark.slow),
    ("glm", "mtp"),
]


@pytest.mark.parametrize(("model", "method"), CASES)
def test_every_proposer_is_exact_on_the_random_hybrids(model, method, request, llama_draft):
    path = request.getfixturevalue(model)
    path = path[1] if isinstance(path, tuple) else path
    config = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "ngram":
        config["prompt_lookup_min"] = 1
    if method == "draft_model":
        config["model"] = str(llama_draft)
    prompts = _loops(5)
    off = LLM(str(path), progress=False)
    expected = [o.outputs[0].token_ids for o in off.generate(prompts, PARAMS)]

    def tokens(llm: LLM, order=slice(None)) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts[order], PARAMS)]

    on = LLM(str(path), progress=False, speculative_config=config)
    assert tokens(on) == expected
    assert tokens(on, slice(None, None, -1)) == expected[::-1]  # prefix hits
    assert on.engine.spec.num_drafts > 0
    assert _all_free(on)
    chunked = LLM(str(path), progress=False, max_num_batched_tokens=16, speculative_config=config)
    assert tokens(chunked) == expected and _all_free(chunked)
    small = LLM(str(path), progress=False, num_kv_blocks=11, max_model_len=160, speculative_config=config)
    assert tokens(small) == expected
    assert small.engine.scheduler.num_preemptions > 0 and _all_free(small)
    ids = prompts[0]["prompt_token_ids"]
    drafts = on.engine.spec.num_draft_tokens
    imported = run_imported(on, ids, prefill_span(on, ids), PARAMS)  # the span carries the MTP layer's slots
    assert imported.outputs[0].token_ids == expected[0]
    assert on.engine.spec.num_draft_tokens > drafts  # the decode worker speculated on it
    assert _all_free(on)
