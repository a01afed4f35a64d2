"""The second KV tier's objects (baton/kv/tier_objects.py): keys stable across processes and bound to
the model, and bytes that are checked whole before a tensor is built."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from baton.handoff.wire import frame, read_header
from baton.kv.tier_objects import (
    MAGIC,
    BadTierObject,
    TensorSpec,
    chunk_keys,
    decode_object,
    encode_object,
    namespace_digest,
    state_key,
)

SECRET = b"tier secret"
FINGERPRINT = {"architecture": "LlamaForCausalLM", "weights_content_sha256": "ab" * 32}
GEOMETRY = {"block_size": 16, "groups": [["full", [0, 1], 2, 64]]}
TOKENS = list(range(100, 164))


def _ns(**edit) -> bytes:
    return namespace_digest({**FINGERPRINT, **edit}, "float16", GEOMETRY)


def test_keys_are_stable_chained_and_bound_to_model_salt_and_tokens():
    keys = chunk_keys(_ns(), TOKENS, 16)
    assert len(keys) == 4 and len(set(keys)) == 4
    assert chunk_keys(_ns(), TOKENS[:40], 16) == keys[:2]  # a prefix's keys are the prefix of keys
    # the same in another process (no PYTHONHASHSEED dependence)
    code = (
        "from baton.kv.tier_objects import chunk_keys, namespace_digest;"
        f"print(chunk_keys(namespace_digest({FINGERPRINT!r}, 'float16', {GEOMETRY!r}), {TOKENS!r}, 16)[-1].hex())"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == keys[-1].hex()
    assert chunk_keys(_ns(weights_content_sha256="cd" * 32), TOKENS, 16)[0] != keys[0]  # one weight differs
    assert chunk_keys(namespace_digest(FINGERPRINT, "fp8", GEOMETRY), TOKENS, 16)[0] != keys[0]
    assert chunk_keys(_ns(), TOKENS, 16, salt=b"tenant")[0] != keys[0]
    changed = TOKENS[:20] + [7] + TOKENS[21:]
    assert chunk_keys(_ns(), changed, 16)[:1] == keys[:1] and chunk_keys(_ns(), changed, 16)[1] != keys[1]
    assert state_key(keys[0]) not in keys


def _object(**tensors) -> tuple[bytes, list[TensorSpec], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    data = [("k0", torch.randn(2, 16, 2, 64, generator=g).half()), ("scale", torch.rand(2, 1, 2, generator=g))]
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in data]
    key = chunk_keys(_ns(), TOKENS, 16)[1]
    return encode_object("kv", key, 16, 32, TOKENS[16:32], data, SECRET), specs, [t for _, t in data]


def _decode(blob: bytes, specs, **edit):
    args = dict(kind="kv", key=chunk_keys(_ns(), TOKENS, 16)[1], start=16, end=32, tokens=TOKENS[16:32])
    args.update(edit)
    return decode_object(blob, SECRET, expected=specs, **args)


def test_an_object_round_trips_bit_for_bit():
    blob, specs, tensors = _object()
    for got, want in zip(_decode(blob, specs), tensors):
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _resigned(blob: bytes, edit) -> bytes:
    header, body = read_header(blob, SECRET, MAGIC)
    body = bytes(body)
    body = edit(header, body) or body
    return frame(header, body, SECRET, MAGIC)


@pytest.mark.parametrize(
    "name",
    ["flipped byte", "truncated", "other secret", "other model", "other tokens", "lying shape", "lying dtype",
     "short body", "not an object", "other kind"],
)  # fmt: skip
def test_every_bad_object_is_refused_before_a_tensor_is_built(name):
    blob, specs, _ = _object()
    bad, edit = blob, {}
    if name == "flipped byte":
        i = len(blob) // 2
        bad = blob[:i] + bytes([blob[i] ^ 1]) + blob[i + 1 :]
    elif name == "truncated":
        bad = blob[: len(blob) - 100]
    elif name == "other secret":
        header, body = read_header(blob, SECRET, MAGIC)
        bad = frame(header, bytes(body), b"another secret", MAGIC)
    elif name == "other model":  # an object another model's worker wrote, found under this key
        other = chunk_keys(_ns(weights_content_sha256="cd" * 32), TOKENS, 16)[1]
        bad = encode_object("kv", other, 16, 32, TOKENS[16:32], [], SECRET)
    elif name == "other tokens":
        edit = {"tokens": TOKENS[17:33]}
    elif name == "lying shape":  # signed by a holder of the secret, header and body agreeing with each other

        def grow(h, b):
            h["tensors"][0]["shape"] = [2, 16, 2, 32]
            h["tensors"][0]["nbytes"] //= 2

        bad = _resigned(blob, grow)
    elif name == "lying dtype":
        bad = _resigned(blob, lambda h, b: h["tensors"][0].update(dtype="bfloat16"))
    elif name == "short body":
        bad = _resigned(blob, lambda h, b: b[:-8])
    elif name == "not an object":
        bad = json.dumps({"k0": [1, 2]}).encode()
    elif name == "other kind":
        edit = {"kind": "state"}
    with pytest.raises(BadTierObject):
        _decode(bad, specs, **edit)
