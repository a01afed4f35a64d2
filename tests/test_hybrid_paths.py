"""The KV handoff for recurrent hybrids: a span carries the recurrent state at position n (and MLA
latents); workers unlike in block size, layout and KV dtype decode the lone worker's tokens; a
span without a state a layer needs, or with state at the wrong position, is refused before any
write."""

from __future__ import annotations

import pytest
import torch
import xxhash

from baton import LLM, SamplingParams
from baton.handoff import wire
from baton.handoff.errors import InvalidKVImport
from tests.test_handoff import prefill_output, repack, run_imported
from tests.test_kimi_linear import kimi  # noqa: F401  (fixtures)
from tests.test_nemotron_h import nemotron  # noqa: F401
from tests.test_recurrent_hybrid import _ids, qwen3_next  # noqa: F401

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
FAMILIES = ["qwen3_next", "kimi", "nemotron"]


def _state(llm: LLM):
    e = llm.engine
    digest = xxhash.xxh64()
    for t in e.storage.k + e.storage.v + [t for ts in e.states.running for t in ts]:
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    free = [e.kv.num_free_blocks(g.group_id) for g in e.kv_spec.groups]
    return free, len(e.kv.free_slots), dict(e.kv.block_tables), digest.hexdigest(), dict(e.requests)


@pytest.mark.parametrize("family", FAMILIES)
def test_handoff_between_unlike_workers_gives_the_lone_workers_tokens(family, request):
    _, path = request.getfixturevalue(family)
    prefill = LLM(str(path), progress=False, block_size=16, max_num_batched_tokens=64)
    for decode_args in ({"block_size": 32, "kv_layout": "HND"}, {"block_size": 8, "kv_cache_dtype": "bfloat16"}):
        decode = LLM(str(path), progress=False, **decode_args)
        for n in (7, 150):
            ids = _ids(n, 50 + n)
            lone = decode.generate([{"prompt_token_ids": ids}], GREEDY)[0].outputs[0].token_ids
            for fmt in ("grouped", "dense"):
                span = prefill_output(prefill, ids, fmt).kv_span
                header, _ = wire.read_header(span, decode.engine.kv_secret)
                states = [t for t in header["tensors"] if t["kind"] == "state"]
                assert states and all(t["start"] == n for t in states)
                out = run_imported(decode, ids, span, GREEDY)
                assert out.outputs[0].token_ids == lone, (family, decode_args, n, fmt)
                assert decode.engine.kv.all_free()


@pytest.mark.parametrize("family", FAMILIES)
def test_spans_missing_state_or_with_state_elsewhere_are_refused_before_any_write(family, request):
    _, path = request.getfixturevalue(family)
    prefill = LLM(str(path), progress=False, block_size=16)
    decode = LLM(str(path), progress=False, block_size=32)
    ids = _ids(40, 60)
    blob = prefill_output(prefill, ids).kv_span
    secret = decode.engine.kv_secret

    def drop_state(h):
        h["tensors"] = [t for t in h["tensors"] if t["kind"] != "state"]

    def move_state(h):
        next(t for t in h["tensors"] if t["kind"] == "state")["start"] = 32

    def bad_index(h):
        next(t for t in h["tensors"] if t["kind"] == "state")["index"] = 7

    before = _state(decode)
    for edit, field in ((drop_state, "state"), (move_state, "state_position"), (bad_index, "state_index")):
        with pytest.raises(InvalidKVImport) as err:
            decode.engine.add_request({"prompt_token_ids": ids}, GREEDY, kv_span=repack(blob, secret, edit))
        assert err.value.field == field, str(err.value)
        assert _state(decode) == before
