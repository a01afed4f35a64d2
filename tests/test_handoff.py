"""The KV handoff at engine level: export on one worker, validate and import on another that differs
in block size, layout and KV dtype; every corruption refused before a byte is written."""

from __future__ import annotations

import json
import struct

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton import LLM, SamplingParams
from baton.handoff import wire
from baton.handoff.span import AXES, to_layout
from baton.handoff.validate import InvalidKVImport
from tests.conftest import _words

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2_decode() -> LLM:
    return LLM("smollm2-135m", progress=False, block_size=64, kv_layout="HND")


@pytest.fixture(scope="module")
def gemma3_decode() -> LLM:
    return LLM("gemma3-270m", progress=False, block_size=32, kv_layout="HND")


def prefill_span(llm: LLM, ids: list[int], fmt: str = "grouped") -> bytes:
    engine = llm.engine
    rid = engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0.0), export_kv=fmt)
    while rid in engine.requests:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                assert engine.kv.all_free()
                return out.kv_span
    raise AssertionError("no span")


def run_imported(llm: LLM, ids: list[int], blob: bytes, params=GREEDY):
    engine = llm.engine
    rid = engine.add_request({"prompt_token_ids": ids}, params, kv_span=blob)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def receiver_state(llm: LLM):
    e = llm.engine
    digest = xxhash.xxh64()
    for t in e.storage.k + e.storage.v:
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    free = [e.kv.num_free_blocks(g.group_id) for g in e.kv_spec.groups]
    tables = {rid: [list(t) for t in ts] for rid, ts in e.kv.block_tables.items()}
    return free, tables, digest.hexdigest(), dict(e.requests)


def repack(blob: bytes, edit_header=None, edit_body=None) -> bytes:
    """Re-frame a span as a consistent producer would, after editing its header or body."""
    header, body = wire.read_header(blob)
    header = json.loads(json.dumps(header))
    body = bytearray(body)
    if edit_header:
        edit_header(header)
    if edit_body:
        edit_body(header, body)
    return wire.frame(header, bytes(body))


_LOCAL: dict[tuple[str, int], list[int]] = {}  # the decode worker's own outputs, shared by both formats


@pytest.mark.parametrize("fmt", ["grouped", "dense"])
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_same_dtype_handoff_equals_local_decode(model, fmt, request):
    prefill: LLM = request.getfixturevalue(model)  # block 16, NHD
    decode: LLM = request.getfixturevalue(f"{model}_decode")  # block 64 / 32, HND
    tok = prefill.get_tokenizer()
    base = tok.encode(_words(11, 80))
    for n in (5, 16, 32, 700):  # under a block, one block (16), one decode block (32), past the window
        ids = base[:n]
        if (model, n) not in _LOCAL:
            _LOCAL[(model, n)] = decode.generate([{"prompt_token_ids": ids}], GREEDY)[0].outputs[0].token_ids
        expected = _LOCAL[(model, n)]
        out = run_imported(decode, ids, prefill_span(prefill, ids, fmt))
        assert out.outputs[0].token_ids == expected, f"{model} {fmt} n={n}"
        assert decode.engine.kv.all_free()


def test_bfloat16_kv_cache_converts_on_import(smollm2_decode):
    prefill = LLM("smollm2-135m", progress=False, kv_cache_dtype="bfloat16")
    ids = prefill.get_tokenizer().encode("A bfloat16 cache hands over to a float32 one.")
    blob = prefill_span(prefill, ids)
    header, _ = wire.read_header(blob)
    assert header["dtype"] == "bfloat16" and all(t["dtype"] == "bfloat16" for t in header["tensors"])
    engine = smollm2_decode.engine
    rid = engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=3, temperature=0.0), kv_span=blob)
    req = engine.requests[rid][0]
    span = wire.build_span(header, [None] * len(header["tensors"]))
    raw = wire.read_header(blob)[1]
    k_entry = header["tensors"][0]
    sent = wire.tensor_from_bytes(
        raw[k_entry["offset"] : k_entry["offset"] + k_entry["nbytes"]], torch.bfloat16, k_entry["shape"]
    )
    sent = to_layout(sent, span.layout, AXES)  # [layers, positions, heads, dim]
    table = engine.kv.block_tables[req.request_id][0]
    bs = engine.kv.block_size
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(len(ids))])
    k_layer0 = engine.storage.layer(0)[0][slots]
    assert torch.equal(k_layer0, sent[0].float())  # exactly the bfloat16 values, upcast
    while rid in engine.requests:
        engine.step()
    assert engine.kv.all_free()


def _corrupt_cases():
    def first_tensor(h):
        return h["tensors"][0]

    def shift_full_start(h, body):  # a full group's tensors starting at 3, consistently re-described
        for e in h["tensors"]:
            t = wire.tensor_from_bytes(
                memoryview(body)[e["offset"] : e["offset"] + e["nbytes"]], torch.float32, e["shape"]
            )
            e["start"] = 3
            e["shape"][1] -= 3
            raw = wire.tensor_bytes(t[:, 3:])
            e["nbytes"] = len(raw)
            e["xxh64"] = wire.checksum(raw)
            body[e["offset"] : e["offset"] + len(raw)] = raw  # offsets stay valid: the data shrank

    return {
        "fingerprint.weights_sha256": (lambda h: h["fingerprint"].update(weights_sha256="0" * 64), None),
        "layer_count": (lambda h: h["fingerprint"].update(num_layers=29), None),
        "layer_to_group": (lambda h: first_tensor(h).update(layer_ids=list(range(15))), None),
        "shape": (lambda h: first_tensor(h)["shape"].__setitem__(2, 4), None),
        "dtype": (lambda h: first_tensor(h).update(dtype="int8"), None),
        "nbytes": (lambda h: first_tensor(h).update(nbytes=first_tensor(h)["nbytes"] - 4), None),
        "checksum": (None, lambda h, b: b.__setitem__(100, b[100] ^ 0x40)),
        "positions": (None, shift_full_start),
        "prompt_token_ids": (lambda h: h["prompt_token_ids"].__setitem__(2, h["prompt_token_ids"][2] + 1), None),
        "body_length": (None, lambda h, b: b.__delitem__(slice(len(b) - 1000, None))),
    }


@pytest.mark.parametrize("field", list(_corrupt_cases()))
def test_each_corruption_is_refused_before_any_write(field, smollm2, smollm2_decode):
    ids = smollm2.get_tokenizer().encode("One corrupted handoff, and nothing may change.")
    edit_header, edit_body = _corrupt_cases()[field]
    blob = repack(prefill_span(smollm2, ids), edit_header, edit_body)
    before = receiver_state(smollm2_decode)
    with pytest.raises(InvalidKVImport) as err:
        smollm2_decode.engine.add_request({"prompt_token_ids": ids}, GREEDY, kv_span=blob)
    assert err.value.field == field and field in str(err.value)
    assert "expected" in str(err.value) and "received" in str(err.value)
    assert receiver_state(smollm2_decode) == before


def test_truncated_frame_and_sliding_coverage(gemma3, gemma3_decode):
    ids = gemma3.get_tokenizer().encode(_words(12, 80))[:600]
    blob = prefill_span(gemma3, ids)
    before = receiver_state(gemma3_decode)
    for cut, field in ((len(blob) // 3, "body_length"), (20, "header_length"), (4, "magic")):
        with pytest.raises(InvalidKVImport) as err:
            gemma3_decode.engine.add_request({"prompt_token_ids": ids}, GREEDY, kv_span=blob[:cut])
        assert err.value.field == field
    header, _ = wire.read_header(blob)
    sliding = next(i for i, e in enumerate(header["tensors"]) if len(e["layer_ids"]) == 15)

    def late_window(h, body):  # the sliding tensors hold 100 positions less than the window needs
        for e in h["tensors"]:
            if len(e["layer_ids"]) != 15:
                continue
            t = wire.tensor_from_bytes(
                memoryview(body)[e["offset"] : e["offset"] + e["nbytes"]], torch.float32, e["shape"]
            )
            raw = wire.tensor_bytes(t[:, 100:])
            e["start"] += 100
            e["shape"][1] -= 100
            e["nbytes"], e["xxh64"] = len(raw), wire.checksum(raw)
            body[e["offset"] : e["offset"] + len(raw)] = raw

    assert header["tensors"][sliding]["start"] == len(ids) - 512
    with pytest.raises(InvalidKVImport) as err:
        gemma3_decode.engine.add_request({"prompt_token_ids": ids}, GREEDY, kv_span=repack(blob, None, late_window))
    assert err.value.field == "sliding_coverage"
    assert receiver_state(gemma3_decode) == before


def test_not_enough_free_blocks(smollm2):
    small = LLM("smollm2-135m", progress=False, num_kv_blocks=8, max_model_len=128)
    ids = smollm2.get_tokenizer().encode(_words(13, 12))[:100]
    blob = prefill_span(smollm2, ids)
    assert small.engine.kv.allocate_slots("squatter", list(range(80)), 0, 80)  # 5 of 8 blocks taken
    before = receiver_state(small)
    with pytest.raises(InvalidKVImport) as err:
        small.engine.add_request({"prompt_token_ids": ids}, GREEDY, kv_span=blob)
    assert err.value.field == "free_blocks"
    assert receiver_state(small) == before
    small.engine.kv.free("squatter")
    out = run_imported(small, ids, blob, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4 and small.engine.kv.all_free()


class _Material(tuple):
    def __repr__(self) -> str:  # keep hypothesis' failure reports readable
        return f"<span of {len(self[0])} tokens, {len(self[1])} bytes>"


@pytest.fixture(scope="module")
def fuzz_material(smollm2, smollm2_decode):
    ids = smollm2.get_tokenizer().encode("Fuzzed spans must fail cleanly.")
    return _Material((ids, prefill_span(smollm2, ids)))


_FIELDS = ["first_token", "layout", "dtype", "start", "shape", "offset", "nbytes", "layer_ids", "kind", "version"]


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    byte_flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(1, 255)), max_size=3),
    field=st.sampled_from(_FIELDS + [None]),
    value=st.one_of(st.integers(-5, 70000), st.text(max_size=6), st.none(), st.lists(st.integers(0, 40), max_size=4)),
)
def test_fuzzed_spans_import_correctly_or_raise_invalid(fuzz_material, smollm2_decode, byte_flips, field, value):
    ids, blob = fuzz_material
    engine = smollm2_decode.engine

    def edit(h):
        if field in ("first_token", "layout", "version"):
            h[field] = value
        elif field is not None:
            h["tensors"][0][field] = value

    mutated = bytearray(repack(blob, edit))
    for pos, mask in byte_flips:
        mutated[pos % len(mutated)] ^= mask
    before = receiver_state(smollm2_decode)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        rid = engine.add_request({"prompt_token_ids": ids}, params, kv_span=bytes(mutated))
    except InvalidKVImport:
        assert receiver_state(smollm2_decode) == before
        return
    header, _ = wire.read_header(bytes(mutated))  # it was accepted: it must decode what it carried
    out = None
    while out is None:
        out = next((o for o in engine.step() if o.request_id == rid and o.finished), None)
    first = header["first_token"]
    expected = (
        smollm2_decode.generate(
            [{"prompt_token_ids": ids + [first]}], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        )[0]
        .outputs[0]
        .token_ids
    )
    assert out.outputs[0].token_ids == [first] + expected
    assert engine.kv.all_free()


def test_wire_round_trip_is_exact(smollm2):
    ids = smollm2.get_tokenizer().encode("Round trip.")
    blob = prefill_span(smollm2, ids, "dense")
    header, body = wire.read_header(blob)
    tensors = [
        wire.tensor_from_bytes(body[e["offset"] : e["offset"] + e["nbytes"]], torch.float32, e["shape"])
        for e in header["tensors"]
    ]
    assert wire.encode(wire.build_span(header, tensors)) == blob
    assert struct.unpack_from("<I", blob, 8)[0] == len(json.dumps(header, separators=(",", ":")).encode())


@pytest.mark.parametrize("model, block_size, n", [("smollm2", 128, 40), ("gemma3", 1024, 600)])
def test_single_block_decode_worker(model, block_size, n, request):
    """A decode worker whose whole KV budget is one block per group, one request at a time."""
    prefill: LLM = request.getfixturevalue(model)
    name = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}[model]
    tiny = LLM(
        name,
        progress=False,
        num_kv_blocks=1,
        block_size=block_size,
        max_model_len=block_size,
        max_num_seqs=1,
        enable_prefix_caching=False,
    )
    ids = prefill.get_tokenizer().encode(_words(14, 70))[:n]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = tiny.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
    out = run_imported(tiny, ids, prefill_span(prefill, ids), params)
    assert out.outputs[0].token_ids == expected
    assert tiny.engine.kv.all_free()
