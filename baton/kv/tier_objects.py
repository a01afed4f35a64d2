"""The second KV tier's objects: content-addressed keys and self-validating bytes.

A key is SHA-256 over the tier namespace (the model's fingerprint with its weights' content, the
KV dtype and geometry, the object layout version), the cache salt and a SHA-256 chain over the
prompt's tokens by chunk: two processes or machines derive the same keys, and no token sequence can
be made to collide with another's (the engine's own xxh3 block hashes are fast, not strong).

An object is framed and signed as a KV span is (baton/handoff/wire.py, its own magic): a header
naming its kind ("kv": one chunk's rows of every paged group; "state": the recurrent state at the
chunk's end), its key, its positions and tokens, and each tensor's name, shape, dtype, offset and
checksum; the body; an HMAC with the tier secret. `decode_object` takes nothing on trust: the
signature first, then the header against what this worker expects at that key (positions, tokens,
every tensor's name, shape and dtype, computed here, not read from the object), then the lengths
and checksums. Anything wrong raises BadTierObject before a tensor is built.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from baton.handoff.errors import InvalidKVImport
from baton.handoff.wire import checksum, frame, read_header, tensor_from_bytes, tensor_view

MAGIC = b"BATONKT1"
LAYOUT_VERSION = 1
KINDS = ("kv", "state")
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


class BadTierObject(ValueError):
    """A tier object that fails a check: a miss for the caller, who deletes and counts it."""


@dataclass(frozen=True)
class TensorSpec:
    """What a worker expects of one tensor of an object: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


def namespace_digest(fingerprint: dict, kv_dtype: str, geometry: dict) -> bytes:
    """What every key of one worker's tier binds: model (weights' content included), KV dtype and
    geometry (block size, groups, state shapes), the object layout version."""
    material = {"version": LAYOUT_VERSION, "fingerprint": fingerprint, "kv_dtype": kv_dtype, "geometry": geometry}
    return hashlib.sha256(json.dumps(material, sort_keys=True, separators=(",", ":")).encode()).digest()


def chunk_keys(
    namespace: bytes, token_ids: Sequence[int], chunk_tokens: int, salt: bytes = b"", parent: bytes | None = None
) -> list[bytes]:
    """The key of each whole chunk of `chunk_tokens` tokens: key_i = SHA-256(namespace, salt,
    key_{i-1}, chunk i's tokens); `parent`: the key of the chunk before `token_ids` (they go on a
    chain already begun)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    keys: list[bytes] = []
    parent = parent or b"\0" * 32
    for i in range(len(token_ids) // chunk_tokens):
        h = hashlib.sha256()
        h.update(namespace)
        h.update(struct.pack("<I", len(salt)) + salt)
        h.update(parent)
        h.update(struct.pack(f"<{chunk_tokens}i", *token_ids[i * chunk_tokens : (i + 1) * chunk_tokens]))
        parent = h.digest()
        keys.append(parent)
    return keys


def state_key(chunk_key: bytes) -> bytes:
    """The key of the recurrent state at a chunk's end (an object apart: it may be lost alone)."""
    return hashlib.sha256(b"state" + chunk_key).digest()


def encode_object(
    kind: str,
    key: bytes,
    start: int,
    end: int,
    tokens: Sequence[int],
    tensors: Sequence[tuple[str, torch.Tensor]],
    secret: bytes,
) -> bytes:
    """An object's bytes: `tokens` are positions [start, end)'s."""
    if kind not in KINDS or len(tokens) != end - start:
        raise ValueError(f"an object is of kind {KINDS} over its positions' tokens")
    body, entries, offset = [], [], 0
    for name, t in tensors:
        raw = tensor_view(t)
        dtype = str(t.dtype).removeprefix("torch.")
        entries.append(
            {
                "name": name,
                "shape": list(t.shape),
                "dtype": dtype,
                "offset": offset,
                "nbytes": len(raw),
                "xxh64": checksum(raw),
            }
        )
        body.append(raw)
        offset += len(raw)
    header = {**_identity(kind, key, start, end, tokens), "tensors": entries}
    return frame(header, body, secret, MAGIC)


def _identity(kind: str, key: bytes, start: int, end: int, tokens: Sequence[int]) -> dict:
    """The header fields that name what an object is: written by encode_object, required by decode_object."""
    return {
        "version": LAYOUT_VERSION,
        "kind": kind,
        "key": key.hex(),
        "start": start,
        "end": end,
        "tokens": list(tokens),
    }


def decode_object(
    blob: bytes,
    secret: bytes,
    kind: str,
    key: bytes,
    start: int,
    end: int,
    tokens: Sequence[int],
    expected: Sequence[TensorSpec],
) -> list[torch.Tensor]:
    """The object's tensors, in `expected`'s order, once every check passed; BadTierObject if any fails."""
    try:
        header, body = read_header(blob, secret, MAGIC)
    except InvalidKVImport as e:
        if e.field == "hmac":
            raise BadTierObject("signature: not made with this tier's secret") from None
        raise BadTierObject(f"{e.field}: expected {e.expected}, got {str(e.received)[:80]}") from None
    for field, value in _identity(kind, key, start, end, tokens).items():
        if header.get(field) != value:
            raise BadTierObject(f"{field}: expected {str(value)[:80]}, got {str(header.get(field))[:80]}")
    entries = header.get("tensors")
    if not isinstance(entries, list) or len(entries) != len(expected):
        raise BadTierObject(f"tensors: expected {len(expected)}")
    out, offset = [], 0
    for spec, e in zip(expected, entries):
        dtype = str(spec.dtype).removeprefix("torch.")
        if not isinstance(e, dict) or (e.get("name"), e.get("shape"), e.get("dtype")) != (
            spec.name,
            list(spec.shape),
            dtype,
        ):
            raise BadTierObject(f"tensor {spec.name}: expected shape {list(spec.shape)} {dtype}")
        if (e.get("offset"), e.get("nbytes")) != (offset, spec.nbytes):
            raise BadTierObject(f"tensor {spec.name}: expected bytes [{offset}, {offset + spec.nbytes})")
        raw = body[offset : offset + spec.nbytes]
        if len(raw) != spec.nbytes or checksum(raw) != e.get("xxh64"):
            raise BadTierObject(f"tensor {spec.name}: checksum")
        out.append(tensor_from_bytes(raw, DTYPES[dtype], list(spec.shape)))
        offset += spec.nbytes
    if offset != len(body):
        raise BadTierObject(f"body: expected {offset} bytes, got {len(body)}")
    return out
