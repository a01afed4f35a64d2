"""Acceptance 4 and 5 on Gemma3: prefix hits for hybrid models, window-bounded sliding memory."""

from __future__ import annotations

import math

import pytest

from baton import LLM, SamplingParams
from baton.kv.manager import NULL_BLOCK
from tests.conftest import _words

PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def test_prefix_hit_on_a_shared_prefix_past_the_window(gemma3):
    tok = gemma3.get_tokenizer()
    prefix = tok.encode(_words(7, 200))[:600]  # past the 512-token sliding window
    assert len(prefix) == 600
    first = prefix + tok.encode(" Question one: what did the cat do?", add_special_tokens=False)
    second = prefix + tok.encode(" Question two: where was the train?", add_special_tokens=False)
    gemma3.generate([{"prompt_token_ids": first}], PARAMS)
    hit = gemma3.generate([{"prompt_token_ids": second}], PARAMS)[0]
    bs = gemma3.engine.kv.block_size
    assert hit.num_cached_tokens == (600 // bs) * bs  # every full shared block, no more
    cold = LLM("gemma3-270m", progress=False, enable_prefix_caching=False)
    cold_out = cold.generate([{"prompt_token_ids": second}], PARAMS)[0]
    assert cold_out.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == cold_out.outputs[0].token_ids
    assert gemma3.engine.kv.all_free()


@pytest.mark.slow
def test_sliding_memory_is_bounded_by_the_window(gemma3):
    engine = gemma3.engine
    bs = engine.kv.block_size
    sliding = [g for g in engine.kv_spec.groups if g.kind.is_sliding]
    assert sliding and sliding[0].kind.window == 512
    bound = math.ceil(512 / bs) + 1
    ids = gemma3.get_tokenizer().encode(_words(3, 420))[:3990]
    assert len(ids) == 3990
    rid = engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    req = engine.requests[rid][0]
    peak = {g.group_id: 0 for g in engine.kv_spec.groups}
    while not req.is_finished:
        decoding = req.num_computed_tokens >= len(ids)
        engine.step()
        tables = engine.kv.block_tables.get(req.request_id)
        if tables is None:
            break
        for g in sliding:
            held = sum(b != NULL_BLOCK for b in tables[g.group_id])
            assert held <= bound, f"{held} sliding blocks held at {req.num_computed_tokens} tokens"
            if decoding:
                peak[g.group_id] = max(peak[g.group_id], held)
        for g in engine.kv_spec.groups:
            if not g.kind.is_sliding:  # full layers keep every position
                assert sum(b != NULL_BLOCK for b in tables[g.group_id]) == math.ceil(req.num_computed_tokens / bs)
    assert req.num_tokens == 4000
    assert all(peak[g.group_id] >= bound - 1 for g in sliding)
    assert engine.kv.all_free()
