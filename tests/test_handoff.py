"""The KV handoff at engine level: export on one worker, validate and import on another that differs
in block size, layout and KV dtype; every corruption and every unsigned span refused before a byte
is written. (Fuzzing the import: tests/test_wire_fuzz.py.)"""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest
import torch
import xxhash

from baton import LLM, SamplingParams
from baton.handoff import wire
from baton.handoff.errors import InvalidKVImport
from baton.handoff.span import AXES, to_layout
from baton.handoff.transfer import _slots
from tests.conftest import _words
from tests.test_random_models import make_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2_decode(smollm2) -> LLM:
    return LLM("smollm2-135m", progress=False, block_size=64, kv_layout="HND", kv_cache_memory_bytes=256 << 20)


@pytest.fixture(scope="module")
def gemma3_decode(gemma3) -> LLM:
    return LLM("gemma3-270m", progress=False, block_size=32, kv_layout="HND", kv_cache_memory_bytes=256 << 20)


def prefill_output(llm: LLM, ids: list[int], fmt: str = "grouped"):
    engine = llm.engine
    rid = engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0.0), export_kv=fmt)
    while rid in engine.requests:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                assert engine.kv.all_free()
                return out
    raise AssertionError("no span")


def prefill_span(llm: LLM, ids: list[int], fmt: str = "grouped") -> bytes:
    return prefill_output(llm, ids, fmt).kv_span


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
    for t in e.storage.k + e.storage.v + e.storage.k_scale + e.storage.v_scale:
        digest.update(t.contiguous().view(torch.uint8).numpy())  # hashed in place, not copied
    free = [e.kv.num_free_blocks(g.group_id) for g in e.kv_spec.groups]
    tables = {rid: [list(t) for t in ts] for rid, ts in e.kv.block_tables.items()}
    return free, tables, digest.hexdigest(), dict(e.requests)


def repack(blob: bytes, secret: bytes, edit_header=None, edit_body=None, sign_with: bytes | None = None) -> bytes:
    """Re-frame a span as a consistent producer holding the secret would (or one signing with
    `sign_with`), after editing its header or body."""
    header, body = wire.read_header(blob, secret)
    header = json.loads(json.dumps(header))
    body = bytearray(body)
    if edit_header:
        edit_header(header)
    if edit_body:
        edit_body(header, body)
    return wire.frame(header, bytes(body), sign_with or secret)


_LOCAL: dict[tuple[str, int], list[int]] = {}  # the decode worker's own outputs, shared by both formats


@pytest.mark.parametrize("fmt", ["grouped", "dense"])
@pytest.mark.parametrize("model", ["smollm2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_same_dtype_handoff_equals_local_decode(model, fmt, request):
    prefill: LLM = request.getfixturevalue(model)  # block 16, NHD
    decode: LLM = request.getfixturevalue(f"{model}_decode")  # block 64 / 32, HND
    tok = prefill.get_tokenizer()
    base = tok.encode(_words(11, 80))
    # under a block, one block (16), one decode block (32), many blocks (Gemma3: past its window)
    for n in (5, 16, 32, 700 if model == "gemma3" else 300):
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
    secret = smollm2_decode.engine.handoff.secret
    header, _ = wire.read_header(blob, secret)
    assert header["dtype"] == "bfloat16" and all(t["dtype"] == "bfloat16" for t in header["tensors"])
    engine = smollm2_decode.engine
    rid = engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=3, temperature=0.0), kv_span=blob)
    req = engine.requests[rid][0]
    assert req.request_id not in engine.kv.block_tables  # queued: blocks come at admission
    batch = engine.schedule()  # admitted and written; the forward has not run
    span = wire.build_span(header, [None] * len(header["tensors"]))
    raw = wire.read_header(blob, secret)[1]
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
    engine.run(batch)
    while rid in engine.requests:
        engine.step()
    assert engine.kv.all_free()


def _corrupt_cases():
    def first_tensor(h):
        return h["tensors"][0]

    def shift_full_start(h, body):  # a full group's tensors starting at 3, consistently re-described
        for e in h["tensors"]:
            t = wire.tensor_from_bytes(
                memoryview(body)[e["offset"] : e["offset"] + e["nbytes"]], getattr(torch, e["dtype"]), e["shape"]
            )
            e["start"] = 3
            e["shape"][1] -= 3
            raw = wire.tensor_bytes(t[:, 3:])
            e["nbytes"] = len(raw)
            e["xxh64"] = wire.checksum(raw)
            body[e["offset"] : e["offset"] + len(raw)] = raw  # offsets stay valid: the data shrank

    return {
        "fingerprint.weights_layout_sha256": (lambda h: h["fingerprint"].update(weights_layout_sha256="0" * 64), None),
        "fingerprint.weights_content_sha256": (lambda h: h["fingerprint"].update(weights_content_sha256="0"), None),
        "fingerprint.num_kv_heads": (lambda h: h["fingerprint"].update(num_kv_heads=3.0), None),  # 3.0 is not 3
        "fingerprint.extra": (lambda h: h["fingerprint"].update(extra=1), None),
        "layer_count": (lambda h: h["fingerprint"].update(num_layers=29), None),
        "layer_to_group": (lambda h: first_tensor(h).update(layer_ids=list(range(15))), None),
        "shape": (lambda h: first_tensor(h)["shape"].__setitem__(2, 4), None),
        "dtype": (lambda h: first_tensor(h).update(dtype="int8"), None),
        "nbytes": (lambda h: first_tensor(h).update(nbytes=first_tensor(h)["nbytes"] - 4), None),
        "checksum": (None, lambda h, b: b.__setitem__(100, b[100] ^ 0x40)),
        "positions": (None, shift_full_start),
        "prompt_token_ids": (lambda h: h["prompt_token_ids"].__setitem__(2, h["prompt_token_ids"][2] + 1), None),
        "body_length": (None, lambda h, b: b.__delitem__(slice(len(b) - 1000, None))),
        "version": (lambda h: h.update(version=True), None),  # True == 1 in Python, but not a version
        "tensors[1].offset": (lambda h: h["tensors"][1].update(offset=-8), None),
    }


@pytest.mark.parametrize("field", list(_corrupt_cases()))
def test_each_corruption_is_refused_before_any_write(field, smollm2, smollm2_decode):
    ids = smollm2.get_tokenizer().encode("One corrupted handoff, and nothing may change.")
    edit_header, edit_body = _corrupt_cases()[field]
    blob = repack(prefill_span(smollm2, ids), smollm2_decode.engine.handoff.secret, edit_header, edit_body)
    before = receiver_state(smollm2_decode)
    with pytest.raises(InvalidKVImport) as err:
        smollm2_decode.engine.add_request({"prompt_token_ids": ids}, GREEDY, kv_span=blob)
    assert err.value.field == field and field in str(err.value)
    assert "expected" in str(err.value) and "received" in str(err.value)
    assert receiver_state(smollm2_decode) == before


def test_unsigned_spans_are_refused_before_parsing(smollm2, smollm2_decode):
    """Correct xxh64 checksums, a consistent header, but no secret: refused at the signature."""
    ids = smollm2.get_tokenizer().encode("Only workers holding the secret hand KV over.")
    blob = prefill_span(smollm2, ids)
    secret = smollm2_decode.engine.handoff.secret
    before = receiver_state(smollm2_decode)
    forged = [
        repack(blob, secret, sign_with=b"a guessed secret"),
        repack(blob, secret, lambda h: h.update(first_token=5), sign_with=b"a guessed secret"),
        blob[:-1] + bytes([blob[-1] ^ 1]),  # the signature itself
        blob[:100] + bytes([blob[100] ^ 1]) + blob[101:],  # the header, its xxh64 left stale
        wire.MAGIC + b"\xff\xff\xff\xff" + b"{" * 40 + bytes(32),  # a header no parser should meet
    ]
    for bad in forged:
        with pytest.raises(InvalidKVImport) as err:
            smollm2_decode.engine.add_request({"prompt_token_ids": ids}, GREEDY, kv_span=bad)
        assert err.value.field == "hmac", bad[:40]
    assert receiver_state(smollm2_decode) == before


def test_a_span_is_imported_once_before_it_expires_and_holds_only_numbers(smollm2, smollm2_decode):
    """Signed by a holder of the secret and otherwise sound: a second import of one transfer id, a
    span past its expiry (or one claiming a far one), and a NaN or an infinity among its values are
    each refused before anything is written."""
    ids = smollm2.get_tokenizer().encode("A span is good for one import, and only for a while.")
    blob = prefill_span(smollm2, ids)
    secret = smollm2_decode.engine.handoff.secret
    engine = smollm2_decode.engine
    out = run_imported(smollm2_decode, ids, blob)
    assert engine.kv.all_free() and len(out.outputs[0].token_ids) == GREEDY.max_tokens

    def poke(value):
        def edit(header, body):
            e = next(t for t in header["tensors"] if t["kind"] == "v")
            struct.pack_into("<f", body, e["offset"] + 4 * 7, value)
            e["xxh64"] = xxhash.xxh64(bytes(body[e["offset"] : e["offset"] + e["nbytes"]])).hexdigest()

        return edit

    fresh = {"transfer_id": "0123456789abcdef" * 2}  # a new id: only the edit below can refuse it
    cases = [
        (blob, "transfer_id"),
        (repack(blob, secret, lambda h: h.update(fresh, expires_at=h["expires_at"] - 3600)), "expires_at"),
        (repack(blob, secret, lambda h: h.update(fresh, expires_at=h["expires_at"] + 86400)), "expires_at"),
        (repack(blob, secret, lambda h: h.update(fresh, transfer_id="not hex")), "transfer_id"),
        (repack(blob, secret, lambda h: h.update(fresh), poke(float("nan"))), "v.values"),
        (repack(blob, secret, lambda h: h.update(fresh), poke(float("inf"))), "v.values"),
    ]
    before = receiver_state(smollm2_decode)
    for bad, field in cases:
        with pytest.raises(InvalidKVImport) as err:
            engine.add_request({"prompt_token_ids": ids}, GREEDY, kv_span=bad)
        assert err.value.field == field
    assert receiver_state(smollm2_decode) == before
    assert run_imported(smollm2_decode, ids, repack(blob, secret, lambda h: h.update(fresh))).outputs[0].token_ids


def test_truncated_frame_and_sliding_coverage(gemma3, gemma3_decode):
    ids = gemma3.get_tokenizer().encode(_words(12, 80))[:600]
    blob = prefill_span(gemma3, ids)
    secret = gemma3_decode.engine.handoff.secret
    before = receiver_state(gemma3_decode)
    for cut, field in ((len(blob) // 3, "hmac"), (len(blob) - 1, "hmac"), (40, "length"), (4, "magic")):
        with pytest.raises(InvalidKVImport) as err:
            gemma3_decode.engine.add_request({"prompt_token_ids": ids}, GREEDY, kv_span=blob[:cut])
        assert err.value.field == field
    short = repack(blob, secret, edit_body=lambda h, b: b.__delitem__(slice(len(b) // 3, None)))
    with pytest.raises(InvalidKVImport) as err:  # signed, but the body lacks what the header lists
        gemma3_decode.engine.add_request({"prompt_token_ids": ids}, GREEDY, kv_span=short)
    assert err.value.field == "body_length"
    header, _ = wire.read_header(blob, secret)
    sliding = next(i for i, e in enumerate(header["tensors"]) if len(e["layer_ids"]) == 15)

    def late_window(h, body):  # the sliding tensors hold 100 positions less than the window needs
        for e in h["tensors"]:
            if len(e["layer_ids"]) != 15:
                continue
            t = wire.tensor_from_bytes(
                memoryview(body)[e["offset"] : e["offset"] + e["nbytes"]], getattr(torch, e["dtype"]), e["shape"]
            )
            raw = wire.tensor_bytes(t[:, 100:])
            e["start"] += 100
            e["shape"][1] -= 100
            e["nbytes"], e["xxh64"] = len(raw), wire.checksum(raw)
            body[e["offset"] : e["offset"] + len(raw)] = raw

    assert header["tensors"][sliding]["start"] == len(ids) - 512
    with pytest.raises(InvalidKVImport) as err:
        gemma3_decode.engine.add_request(
            {"prompt_token_ids": ids}, GREEDY, kv_span=repack(blob, secret, None, late_window)
        )
    assert err.value.field == "sliding_coverage"
    assert receiver_state(gemma3_decode) == before


def test_an_import_waits_for_room_and_holds_nothing_meanwhile(smollm2):
    """An import takes its blocks when the scheduler admits it, not when it arrives: behind a running
    request that holds the pool, it waits holding nothing, then runs from its span."""
    small = LLM("smollm2-135m", progress=False, num_kv_blocks=8, max_model_len=128)
    engine = small.engine
    ids = smollm2.get_tokenizer().encode(_words(13, 12))[:100]  # with its first token: 7 of 8 blocks
    blob = prefill_span(smollm2, ids)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    expected = smollm2.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
    engine.add_request({"prompt_token_ids": ids[:80]}, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # the squatter runs, holding 5 blocks
    rid = engine.add_request({"prompt_token_ids": ids}, params, kv_span=blob)
    req = engine.requests[rid][0]
    engine.step()
    assert req.status.value == "waiting" and req.request_id not in engine.kv.block_tables
    assert req.output_token_ids == expected[:1]  # its first token came with the span
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.request_id == rid), out)
    assert out.outputs[0].token_ids == expected
    assert engine.prefills == {"remote": 1, "local": 1} and engine.kv.all_free()


def test_wire_round_trip_is_exact(smollm2):
    ids = smollm2.get_tokenizer().encode("Round trip.")
    blob = prefill_span(smollm2, ids, "dense")
    secret = smollm2.engine.handoff.secret
    header, body = wire.read_header(blob, secret)
    tensors = [
        wire.tensor_from_bytes(body[e["offset"] : e["offset"] + e["nbytes"]], getattr(torch, e["dtype"]), e["shape"])
        for e in header["tensors"]
    ]
    assert wire.encode(wire.build_span(header, tensors), secret) == blob
    assert struct.unpack_from("<I", blob, 8)[0] == len(json.dumps(header, separators=(",", ":")).encode())


@pytest.mark.parametrize(
    "model, block_size, n", [("smollm2", 128, 40), pytest.param("gemma3", 1024, 600, marks=pytest.mark.slow)]
)
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


def dense_tensors(blob: bytes, secret: bytes) -> tuple[dict, dict[str, torch.Tensor]]:
    """The dense span's header and its K and V as [layers, positions, heads, dim]."""
    header, body = wire.read_header(blob, secret)
    out = {}
    for e in header["tensors"]:
        t = wire.tensor_from_bytes(
            body[e["offset"] : e["offset"] + e["nbytes"]], getattr(torch, e["dtype"]), e["shape"]
        )
        out[e["kind"]] = to_layout(t, header["layout"], AXES)
    return header, out


@pytest.mark.slow  # 20 s
def test_dense_export_sends_only_what_the_worker_holds(gemma3, gemma3_decode, monkeypatch):
    """After a chunked prefill or a prefix-cache hit, a sliding layer's table holds NULL blocks for
    positions out of its window; a dense export sends zeros there and says from where each layer is real."""
    secret = gemma3.engine.handoff.secret
    ids = gemma3.get_tokenizer().encode(_words(21, 80))[:700]
    cold = prefill_output(gemma3_decode, ids, "dense")  # first time either worker sees this prompt: one step
    with monkeypatch.context() as m:  # 128 tokens a step: by the last chunk the first 128 positions are gone
        m.setattr(gemma3.engine.scheduler.config, "max_num_batched_tokens", 128)
        chunked = prefill_output(gemma3, ids, "dense")
    hit = prefill_output(gemma3, ids, "dense")
    assert cold.num_cached_tokens == chunked.num_cached_tokens == 0 and hit.num_cached_tokens == 688
    cold_header, want = dense_tensors(cold.kv_span, secret)
    assert cold_header["tensors"][0]["layer_starts"] == [0] * 18
    sliding = [i for i, (kind, _) in enumerate(cold_header["fingerprint"]["layer_kinds"]) if kind == "sliding"]
    # held from the block (16 tokens) holding the first position the last step's queries read
    for out, first_held in ((chunked, (640 - 511) // 16 * 16), (hit, (688 - 511) // 16 * 16)):
        header, got = dense_tensors(out.kv_span, secret)
        starts = header["tensors"][0]["layer_starts"]
        assert starts == [first_held if i in sliding else 0 for i in range(18)]
        assert header["first_token"] == cold_header["first_token"]
        for kind in "kv":
            for layer, start in enumerate(starts):
                assert not got[kind][layer, :start].any()  # nothing the worker no longer holds
                real, ref = got[kind][layer, start:], want[kind][layer, start:]
                assert torch.allclose(real, ref, rtol=1e-4, atol=1e-4), (kind, layer)
        expected = gemma3_decode.generate([{"prompt_token_ids": ids}], GREEDY)[0].outputs[0].token_ids
        assert run_imported(gemma3_decode, ids, out.kv_span).outputs[0].token_ids == expected
        assert gemma3_decode.engine.kv.all_free()


@pytest.mark.slow  # 18 s
def test_dense_layer_starts_are_checked(gemma3, gemma3_decode):
    ids = gemma3.get_tokenizer().encode(_words(22, 80))[:600]
    blob = prefill_span(gemma3, ids, "dense")
    secret = gemma3.engine.handoff.secret
    header, _ = wire.read_header(blob, secret)
    sliding = [i for i, (kind, _) in enumerate(header["fingerprint"]["layer_kinds"]) if kind == "sliding"]
    full = next(i for i in range(18) if i not in sliding)
    need = len(ids) - 512 + 1  # the first position the next query reads in a sliding layer

    def starts(layer: int, at: int):
        def edit(h):
            for e in h["tensors"]:
                e["layer_starts"][layer] = at

        return edit

    before = receiver_state(gemma3_decode)
    for edit, field in (
        (starts(full, 1), "positions"),
        (starts(sliding[0], need + 1), "sliding_coverage"),
        (starts(sliding[0], len(ids) + 1), "tensors[0].layer_starts"),
        (lambda h: h["tensors"][0].update(layer_starts=[0] * 17), "tensors[0].layer_starts"),
        (lambda h: h["tensors"][0].update(layer_starts=[False] * 18), "tensors[0].layer_starts"),
    ):
        with pytest.raises(InvalidKVImport) as err:
            gemma3_decode.engine.add_request({"prompt_token_ids": ids}, GREEDY, kv_span=repack(blob, secret, edit))
        assert err.value.field == field
    assert receiver_state(gemma3_decode) == before
    ok = repack(blob, secret, starts(sliding[0], need))  # exactly the window the next query reads
    expected = gemma3_decode.generate([{"prompt_token_ids": ids}], GREEDY)[0].outputs[0].token_ids
    assert run_imported(gemma3_decode, ids, ok).outputs[0].token_ids == expected


def test_export_never_reads_a_null_block(gemma3):
    engine = gemma3.engine
    assert engine.kv.allocate_slots("probe", list(range(700)), 0, 700)
    engine.kv.remove_skipped_blocks("probe", 700)  # sliding groups drop what fell out of the window
    sliding = next(g for g in engine.kv_spec.groups if g.kind.is_sliding)
    with pytest.raises(RuntimeError, match="no longer held"):
        _slots(engine.kv, "probe", sliding.group_id, np.arange(0, 700))
    engine.kv.free("probe")


def test_fine_tunes_of_one_architecture_refuse_each_others_kv(tmp_path):
    """Same architecture, config and weight shapes, different weight values: the content hash differs."""
    ref, base = make_model(tmp_path / "base", "LlamaForCausalLM")
    with torch.no_grad():
        ref.model.layers[1].mlp.up_proj.weight.add_(1e-3)
    ref.save_pretrained(tmp_path / "tuned")
    shutil.copytree(base, tmp_path / "copy")  # the same bytes elsewhere: the same fingerprint
    small = dict(progress=False, num_kv_blocks=16, kv_secret="one deployment")
    workers = {name: LLM(str(tmp_path / name), **small) for name in ("base", "tuned", "copy")}
    prints = {name: llm.engine.handoff.fingerprint for name, llm in workers.items()}
    assert prints["base"] == prints["copy"]
    assert prints["tuned"]["weights_layout_sha256"] == prints["base"]["weights_layout_sha256"]
    assert prints["tuned"]["weights_content_sha256"] != prints["base"]["weights_content_sha256"]
    ids = list(range(1, 20))
    blob = prefill_span(workers["base"], ids)
    with pytest.raises(InvalidKVImport) as err:
        workers["tuned"].engine.add_request({"prompt_token_ids": ids}, GREEDY, kv_span=blob)
    assert err.value.field == "fingerprint.weights_content_sha256"
    assert workers["tuned"].engine.kv.all_free()
    expected = workers["copy"].generate([{"prompt_token_ids": ids}], GREEDY)[0].outputs[0].token_ids
    assert run_imported(workers["copy"], ids, blob).outputs[0].token_ids == expected
