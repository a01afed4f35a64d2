"""Fuzzing the KV import: any mutation of a span's header, tensor list or bytes is either harmless
(the plan equals the unmutated span's) or refused with InvalidKVImport; nothing else ever escapes,
and the receiver's KV manager never changes. Mutations are re-signed with the deployment's secret,
so they reach the validator; the same mutations unsigned must stop at the HMAC.

The worker is a random-weight Qwen3 with a full layer and two sliding ones (window 6) whose
dimensions all differ (layers 1/2/3, positions 23 or 6, 4 KV heads, head dim 16), so a relabelled
layout can never pass for the real one. `pytest -m slow` runs each property 2,000 times.
"""

from __future__ import annotations

import copy
import json
import struct

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton import LLM, SamplingParams
from baton.handoff import wire
from baton.handoff.errors import InvalidKVImport
from baton.handoff.replay import TransferLedger
from baton.handoff.validate import ImportPlan
from tests.test_random_models import make_model

SECRET = "fuzz deployment"
IDS = list(range(3, 26))  # 23 positions
CI = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
LONG = settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))


class Material:
    """One exported span, taken apart, and the plan its import makes (not a dataclass: hypothesis
    would print every byte of it in a failure report)."""

    def __init__(self, fmt: str, blob: bytes, header: dict, body: bytes, plan: ImportPlan) -> None:
        self.fmt, self.blob, self.header, self.body, self.plan = fmt, blob, header, body, plan

    def __repr__(self) -> str:
        return f"<{self.fmt} span, {len(self.blob)} bytes>"


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz-model")
    make_model(
        path,
        "Qwen3ForCausalLM",
        head_dim=16,
        num_attention_heads=8,
        num_key_value_heads=4,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
        layer_types=None,
    )
    common = dict(progress=False, num_kv_blocks=64, kv_secret=SECRET)
    # prefilled 4 tokens a step: by the last chunk the sliding layers hold positions from 12 only
    prefill = LLM(str(path), block_size=4, max_num_batched_tokens=4, **common)
    decode = LLM(str(path), block_size=8, kv_layout="HND", **common)
    return prefill, decode


def import_plan(decode: LLM, blob: bytes) -> ImportPlan:
    """The plan of a fresh receiver's first import of `blob`: every mutation meets the checks of the
    bytes, not the ledger's refusal of a transfer id seen before (tests/test_pd_pressure.py has that)."""
    handoff = decode.engine.handoff
    handoff.ledger = TransferLedger(handoff.span_ttl_s)
    return handoff.plan(blob, IDS)


@pytest.fixture(scope="module", params=["grouped", "dense"])
def material(workers, request) -> Material:
    prefill, decode = workers
    engine = prefill.engine
    rid = engine.add_request({"prompt_token_ids": IDS}, SamplingParams(max_tokens=1), export_kv=request.param)
    blob = None
    while blob is None:
        blob = next((o.kv_span for o in engine.step() if o.request_id == rid and o.finished), None)
    header, body = wire.read_header(blob, engine.handoff.secret)
    if request.param == "dense":
        assert [e["layer_starts"] for e in header["tensors"]] == [[0, 12, 12]] * 2
    return Material(request.param, blob, header, bytes(body), import_plan(decode, blob))


def same_plan(a: ImportPlan, b: ImportPlan) -> bool:
    """Equal but for the first token (any id is the signed sender's to choose, not a corruption) and
    for K and V exchanged throughout: relabelling every K tensor V and every V tensor K makes a
    well-formed span of equal shapes and checksums that its signer could have sent, which no check
    of the bytes can tell from the original."""
    same = a.prompt_token_ids == b.prompt_token_ids
    same = same and len(a.writes) == len(b.writes)
    pairs = list(zip(a.writes, b.writes))
    same = same and all(x.group_id == y.group_id and np.array_equal(x.positions, y.positions) for x, y in pairs)
    as_is = all(torch.equal(x.k, y.k) and torch.equal(x.v, y.v) for x, y in pairs)
    exchanged = all(torch.equal(x.k, y.v) and torch.equal(x.v, y.k) for x, y in pairs)
    return same and (as_is or exchanged)


def assert_refused_or_harmless(decode: LLM, m: Material, blob: bytes) -> None:
    try:
        plan = import_plan(decode, blob)
    except InvalidKVImport as e:
        assert e.field and "expected" in str(e) and "received" in str(e)
    else:
        assert same_plan(plan, m.plan)
        assert 0 <= plan.first_token < decode.engine.model_config.vocab_size
    kv = decode.engine.kv
    assert kv.all_free() and not kv.block_tables


def assert_unsigned_refused(decode: LLM, m: Material, blob: bytes) -> None:
    """The same bytes under the original signature (no secret to sign them again): refused at the HMAC."""
    unsigned = blob[: -wire.HMAC_BYTES] + m.blob[-wire.HMAC_BYTES :]
    if unsigned == m.blob:
        return
    with pytest.raises(InvalidKVImport) as err:
        import_plan(decode, unsigned)
    assert err.value.field == "hmac"


def frame_head(head: bytes, body: bytes, secret: bytes = SECRET.encode()) -> bytes:
    """A frame around raw header bytes, checksummed and signed as a producer with the secret would."""
    signed = wire.MAGIC + struct.pack("<I", len(head)) + head + struct.pack("<Q", xxhash.xxh64_intdigest(head)) + body
    return signed + wire.sign(signed, secret)


# ---- strategies ------------------------------------------------------------------------------------
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 70),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.lists(st.integers(-3, 40), max_size=5),
    st.lists(st.booleans(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(0, 3), max_size=2),
)
TENSOR_FIELDS = ["kind", "layer_ids", "start", "shape", "dtype", "offset", "nbytes", "xxh64", "layer_starts", "new"]


def edit_value(data, container: dict, key: str) -> None:
    """Replace or delete container[key], or poke one element of it when it is a list."""
    action = data.draw(st.sampled_from(["replace", "delete", "element"]))
    if action == "delete":
        container.pop(key, None)
    elif action == "element" and isinstance(container.get(key), list) and container[key]:
        i = data.draw(st.integers(0, len(container[key]) - 1))
        container[key][i] = data.draw(st.one_of(JUNK, st.integers(-2, 30)))
    else:
        container[key] = data.draw(JUNK)


def mutate_header(data, h: dict) -> None:
    target = data.draw(st.sampled_from(["field", "fingerprint", "tokens", "tensor_list", "tensor_field"]))
    intact = {  # what the target needs, unless an earlier mutation took it away
        "fingerprint": isinstance(h.get("fingerprint"), dict) and isinstance(h["fingerprint"].get("rope"), dict),
        "tokens": isinstance(h.get("prompt_token_ids"), list) and h["prompt_token_ids"],
        "tensor_list": isinstance(h.get("tensors"), list) and h["tensors"],
        "tensor_field": isinstance(h.get("tensors"), list) and any(isinstance(e, dict) for e in h["tensors"]),
    }
    if not intact.get(target, True):
        target = "field"
    if target == "field":
        key = data.draw(st.sampled_from(["version", "fingerprint", "first_token", "layout", "dtype", "tensors", "new"]))
        if key == "layout" and data.draw(st.booleans()):
            h["layout"] = data.draw(st.permutations("LTHD").map("".join))
        else:
            edit_value(data, h, key)
    elif target == "fingerprint":
        fp = h["fingerprint"]
        key = data.draw(st.sampled_from(sorted(fp) + ["new"]))
        kinds = sorted(k for k, v in fp["rope"].items() if isinstance(v, dict))
        if key == "rope" and kinds and data.draw(st.booleans()):
            edit_value(data, fp["rope"][data.draw(st.sampled_from(kinds))], "theta")
        else:
            edit_value(data, fp, key)
    elif target == "tokens":
        ids = h["prompt_token_ids"]
        op = data.draw(st.sampled_from(["poke", "append", "drop", "bools", "swap"]))
        if op == "poke":
            ids[data.draw(st.integers(0, len(ids) - 1))] = data.draw(JUNK)
        elif op == "append":
            ids.append(data.draw(st.integers(-1, 300)))
        elif op == "drop":
            del ids[data.draw(st.integers(0, len(ids) - 1))]
        elif op == "bools":
            h["prompt_token_ids"] = [i % 2 == 1 for i in range(len(ids))]
        else:
            i, j = data.draw(st.integers(0, len(ids) - 1)), data.draw(st.integers(0, len(ids) - 1))
            ids[i], ids[j] = ids[j], ids[i]
    elif target == "tensor_list":
        t = h["tensors"]
        op = data.draw(st.sampled_from(["drop", "duplicate", "reorder", "replace"]))
        i = data.draw(st.integers(0, len(t) - 1))
        if op == "drop":
            del t[i]
        elif op == "duplicate":
            t.insert(data.draw(st.integers(0, len(t))), copy.deepcopy(t[i]))
        elif op == "reorder":
            h["tensors"] = data.draw(st.permutations(t))
        else:
            t[i] = data.draw(JUNK)
    else:
        entry = data.draw(st.sampled_from([e for e in h["tensors"] if isinstance(e, dict)]))
        key = data.draw(st.sampled_from(TENSOR_FIELDS))
        if key == "kind" and data.draw(st.booleans()):
            entry["kind"] = "v" if entry.get("kind") == "k" else "k"
        elif key in ("start", "offset", "nbytes") and _is_int(entry.get(key)) and data.draw(st.booleans()):
            entry[key] += data.draw(st.integers(-8, 8))
        else:
            edit_value(data, entry, key)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def mutated_bytes(data, raw: bytes, max_edits: int = 4) -> bytes:
    out = bytearray(raw)
    for _ in range(data.draw(st.integers(1, max_edits))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete"]))
        pos = data.draw(st.integers(0, max(0, len(out) - 1)))
        if op == "flip" and out:
            out[pos] ^= data.draw(st.integers(1, 255))
        elif op == "insert":
            out[pos:pos] = data.draw(st.binary(min_size=1, max_size=4))
        elif out:
            del out[pos : pos + data.draw(st.integers(1, 4))]
    return bytes(out)


# ---- properties ------------------------------------------------------------------------------------
def header_fields(decode: LLM, m: Material, data) -> None:
    header = json.loads(json.dumps(m.header))
    for _ in range(data.draw(st.integers(1, 2))):
        mutate_header(data, header)
    blob = wire.frame(header, m.body, SECRET.encode())
    assert_refused_or_harmless(decode, m, blob)
    assert_unsigned_refused(decode, m, blob)


def header_bytes(decode: LLM, m: Material, data) -> None:
    head = json.dumps(m.header, separators=(",", ":")).encode()
    blob = frame_head(mutated_bytes(data, head), m.body)
    assert_refused_or_harmless(decode, m, blob)
    assert_unsigned_refused(decode, m, blob)


def body_bytes(decode: LLM, m: Material, data) -> None:
    blob = wire.frame(m.header, mutated_bytes(data, m.body), SECRET.encode())
    assert_refused_or_harmless(decode, m, blob)
    assert_unsigned_refused(decode, m, blob)


def frame_bytes(decode: LLM, m: Material, data) -> None:
    """Raw edits anywhere in the frame, signed again or not at all; and bytes from nowhere."""
    mutated = mutated_bytes(data, m.blob[: -wire.HMAC_BYTES])
    assert_refused_or_harmless(decode, m, mutated + wire.sign(mutated, SECRET.encode()))
    assert_refused_or_harmless(decode, m, mutated + m.blob[-wire.HMAC_BYTES :])
    assert_refused_or_harmless(decode, m, data.draw(st.binary(max_size=200)))


PROPERTIES = [header_fields, header_bytes, body_bytes, frame_bytes]


@pytest.mark.parametrize("prop", PROPERTIES, ids=lambda p: p.__name__)
@CI
@given(data=st.data())
def test_mutated_spans_are_refused_or_harmless(workers, material, prop, data):
    prop(workers[1], material, data)


@pytest.mark.slow
@pytest.mark.parametrize("prop", PROPERTIES, ids=lambda p: p.__name__)
@LONG
@given(data=st.data())
def test_mutated_spans_are_refused_or_harmless_long(workers, material, prop, data):
    prop(workers[1], material, data)


def test_hostile_headers_are_refused_before_they_cost_anything(workers):
    """Deep nesting, many containers, huge integers, NaN, bad UTF-8, a header past the cap."""
    decode = workers[1]
    heads = [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 9 + b"1" + b"}" * 9,
        b"[" + b"[]," * 5000 + b"[]]",
        b'{"version":' + b"9" * 5000 + b"}",
        b'{"version":NaN}',
        b'{"version":2,"x":"\xff"}',
        b'"a string"',
    ]
    for head in heads:
        with pytest.raises(InvalidKVImport) as err:
            import_plan(decode, frame_head(head, b""))
        assert err.value.field == "header", head[:20]
    head = b'{"a":"' + b"]" * 40 + b'","b":' + b'{"b":' * 30 + b"1" + b"}" * 31  # brackets in a string hide depth
    with pytest.raises(InvalidKVImport) as err:
        import_plan(decode, frame_head(head, b""))
    assert err.value.field == "header" and "nested" in str(err.value)
    too_long = wire.MAGIC + struct.pack("<I", wire.MAX_HEADER_BYTES + 1) + bytes(wire.MAX_HEADER_BYTES + 9)
    with pytest.raises(InvalidKVImport) as err:
        import_plan(decode, too_long + wire.sign(too_long, SECRET.encode()))
    assert err.value.field == "header_length"
    assert decode.engine.kv.all_free() and not decode.engine.kv.block_tables


def test_bools_are_not_token_ids(workers):
    """[True, False] == [1, 0] in Python: a span claiming the prompt [1, 0, ...] in bools is refused."""
    prefill, decode = workers
    ids = [1, 0, 1, 1, 0, 1, 1]
    engine = prefill.engine
    rid = engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), export_kv="grouped")
    blob = None
    while blob is None:
        blob = next((o.kv_span for o in engine.step() if o.request_id == rid and o.finished), None)
    header, body = wire.read_header(blob, engine.handoff.secret)
    for field, edit in (
        ("prompt_token_ids", lambda h: h.update(prompt_token_ids=[bool(t) for t in ids])),
        ("first_token", lambda h: h.update(first_token=True)),
        ("positions", lambda h: h["tensors"][0].update(start=False)),
        ("shape", lambda h: h["tensors"][0]["shape"].__setitem__(0, True)),  # the full group has 1 layer
    ):
        h = json.loads(json.dumps(header))
        edit(h)
        with pytest.raises(InvalidKVImport) as err:
            decode.engine.handoff.plan(wire.frame(h, bytes(body), decode.engine.handoff.secret), ids)
        assert err.value.field == field
