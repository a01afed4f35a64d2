"""Every recurrent family (and the sparse-attention models) along the paths that resume state:
preemption, and the KV handoff (a span
carries the recurrent state at position n and MLA latents; workers unlike in block size, layout and
KV dtype decode the lone worker's tokens; a span without a state a layer needs, or with state at
the wrong position, is refused before any write)."""

from __future__ import annotations

import pytest
import torch
import xxhash

from baton import LLM, SamplingParams
from baton.handoff import wire
from baton.handoff.errors import InvalidKVImport
from tests.test_dsa import dsa_glm5  # noqa: F401  (fixtures)
from tests.test_falcon_h1 import falcon  # noqa: F401
from tests.test_glm5_flash import flash  # noqa: F401
from tests.test_granite_hybrid import granite  # noqa: F401
from tests.test_handoff import prefill_output, repack, run_imported
from tests.test_kimi_linear import kimi  # noqa: F401
from tests.test_lfm2 import lfm2  # noqa: F401
from tests.test_nemotron_h import nemotron  # noqa: F401
from tests.test_recurrent_hybrid import _ids, qwen3_next  # noqa: F401

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
FAMILIES = ["qwen3_next", "kimi", "nemotron", "lfm2"]
GRANITE = pytest.param("granite", marks=pytest.mark.slow)  # Mamba2 as nemotron's; its own paths in -m slow
FALCON = pytest.param("falcon", marks=pytest.mark.slow)  # a layer with both KV and state


def _state(llm: LLM):
    e = llm.engine
    digest = xxhash.xxh64()
    for t in e.storage.k + e.storage.v + [t for ts in e.states.running for t in ts]:
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    free = [e.kv.num_free_blocks(g.group_id) for g in e.kv_spec.groups]
    return free, len(e.kv.free_slots), dict(e.kv.block_tables), digest.hexdigest(), dict(e.requests)


@pytest.mark.parametrize(
    "family", [*FAMILIES, GRANITE, FALCON, pytest.param("dsa_glm5", marks=pytest.mark.slow), "flash"]
)
def test_decode_after_a_prefix_hit_and_after_preemption_keeps_the_reference_logits(family, request, monkeypatch):
    ref, path = request.getfixturevalue(family)
    prompts = [_ids(60 + 7 * i, 10 + i) for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = {}
    with torch.no_grad():
        plain = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16).generate(
            [{"prompt_token_ids": p} for p in prompts], params
        )
        for p, out in zip(prompts, plain):
            new = out.outputs[0].token_ids
            expected[tuple(p)] = (new, ref(torch.tensor([p + new]), use_cache=False).logits[0][len(p) - 1 : -1])
    for caching in (False, True):
        small = LLM(
            str(path),
            progress=False,
            kv_cache_memory_bytes=64 << 20,
            block_size=16,
            num_kv_blocks=12,
            max_model_len=160,
            enable_prefix_caching=caching,
        )
        seen = _sampled_logits(small, monkeypatch)
        for run in [prompts]:
            seen.clear()
            outs = small.generate([{"prompt_token_ids": p} for p in run], params)
            for p, out in zip(run, outs):
                new, want = expected[tuple(p)]
                assert out.outputs[0].token_ids == new
                got = torch.stack(seen[f"{out.request_id}#0"])
                assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
        assert small.engine.scheduler.num_preemptions > 0
        assert small.engine.kv.all_free()
    roomy = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16)
    seen = _sampled_logits(roomy, monkeypatch)
    prompt = prompts[5]
    outs = [roomy.generate([{"prompt_token_ids": prompt}], params)[0] for _ in range(2)]
    assert outs[1].num_cached_tokens == (len(prompt) - 1) // 16 * 16  # resumed from a state checkpoint
    new, want = expected[tuple(prompt)]
    assert outs[1].outputs[0].token_ids == new
    got = torch.stack(seen[f"{outs[1].request_id}#0"])
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


def _sampled_logits(llm: LLM, monkeypatch) -> dict[str, list[torch.Tensor]]:
    """Per engine request id, the logits each of its tokens was sampled from."""
    seen: dict[str, list[torch.Tensor]] = {}
    execute = llm.engine.runner.execute

    def recording(batch):
        out = execute(batch)
        for rid, row in out.sample_rows.items():
            seen.setdefault(rid, []).append(out.logits[row].clone())
        return out

    monkeypatch.setattr(llm.engine.runner, "execute", recording)
    return seen


@pytest.mark.parametrize("family", [*FAMILIES, GRANITE, FALCON])
def test_handoff_between_unlike_workers_gives_the_lone_workers_tokens(family, request, monkeypatch):
    ref, path = request.getfixturevalue(family)
    prefill = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16, max_num_batched_tokens=64)
    for decode_args in ({"block_size": 32, "kv_layout": "HND"}, {"block_size": 8, "kv_cache_dtype": "bfloat16"}):
        decode = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, **decode_args)
        seen = _sampled_logits(decode, monkeypatch)
        for n in (7, 150):
            ids = _ids(n, 50 + n)
            lone = decode.generate([{"prompt_token_ids": ids}], GREEDY)[0]
            for fmt in ("grouped", "dense"):
                span = prefill_output(prefill, ids, fmt).kv_span
                header, _ = wire.read_header(span, decode.engine.handoff.secret)
                states = [t for t in header["tensors"] if t["kind"] == "state"]
                assert states and all(t["start"] == n for t in states)
                seen.clear()
                out = run_imported(decode, ids, span, GREEDY)
                new = out.outputs[0].token_ids
                assert new == lone.outputs[0].token_ids, (family, decode_args, n, fmt)
                if "kv_cache_dtype" not in decode_args:  # every decode step after the import: the reference's logits
                    with torch.no_grad():
                        full = ref(torch.tensor([ids + new]), use_cache=False).logits[0]
                    logits = seen[f"{out.request_id}#0"]
                    assert len(logits) == len(new) - 1
                    expected = full[n : n + len(logits)]
                    assert ((torch.stack(logits) - expected).abs().max() / expected.abs().max()).item() < 1e-4
                assert decode.engine.kv.all_free()


@pytest.mark.parametrize("family", FAMILIES)
def test_spans_missing_state_or_with_state_elsewhere_are_refused_before_any_write(family, request):
    _, path = request.getfixturevalue(family)
    prefill = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=16)
    decode = LLM(str(path), progress=False, kv_cache_memory_bytes=64 << 20, block_size=32)
    ids = _ids(40, 60)
    blob = prefill_output(prefill, ids).kv_span
    secret = decode.engine.handoff.secret

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
