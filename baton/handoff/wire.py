"""KVSpan <-> bytes: a magic, a JSON header, each tensor's raw little-endian bytes, a signature. No pickle.

    b"BATONKV3" | u32 LE header length | header (UTF-8 JSON) | u64 LE xxh64 of the header | tensors
        | HMAC-SHA256(secret, every byte before it) (32 bytes)

The header lists each tensor's kind, layers, start position, shape, dtype, byte offset and length
in the body, and an xxh64 checksum of its bytes; the header has its own checksum. Checksums catch
corruption, the HMAC forgery: spans travel only between workers sharing a secret, and
`read_header` checks the signature before it parses anything, so bytes from whoever lacks the
secret never reach the JSON parser. Past the signature it checks only the framing and that the
header is a small, shallow JSON object; everything about the model is `validate.py`'s job.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct

import numpy as np
import torch
import xxhash

from baton.handoff.errors import InvalidKVImport
from baton.handoff.span import KVSpan, SpanTensor

MAGIC = b"BATONKV3"
VERSION = 3
HMAC_BYTES = 32
# a legitimate header is ~7 bytes per prompt token: 16 MiB is prompts of two million tokens
MAX_HEADER_BYTES = 16 << 20
MAX_JSON_DEPTH = 8  # a real header nests 4 deep (header > fingerprint > rope > kind)
MAX_JSON_CONTAINERS = 4096  # a real one has ~2 per model layer and ~4 per tensor
_MAX_INT_DIGITS = 19  # every integer fits in an int64
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_NUMPY_VIEW = {
    torch.float32: np.float32,
    torch.bfloat16: np.uint16,
    torch.float16: np.float16,
    torch.float8_e4m3fn: np.uint8,
}
_BITS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}  # dtypes numpy lacks, as their bits


def tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(tensor_view(t))


def tensor_view(t: torch.Tensor) -> memoryview:
    """A tensor's raw little-endian bytes, without a copy where it is contiguous on this CPU."""
    t = t.contiguous().cpu()
    arr = (t.view(_BITS[t.dtype]) if t.dtype in _BITS else t).numpy()
    if arr.size == 0:
        return memoryview(b"")
    return memoryview(np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("<"), copy=False))).cast("B")


def checksum(data: bytes | memoryview) -> str:
    return xxhash.xxh64(data).hexdigest()


def encode(span: KVSpan, secret: bytes) -> bytes:
    body, entries, offset = [], [], 0
    for t in span.tensors:
        raw = tensor_bytes(t.data)
        entry = {
            "kind": t.kind,
            "layer_ids": list(t.layer_ids),
            "start": t.start,
            "shape": list(t.data.shape),
            "dtype": str(t.data.dtype).removeprefix("torch."),
            "offset": offset,
            "nbytes": len(raw),
            "xxh64": checksum(raw),
        }
        if t.layer_starts is not None:
            entry["layer_starts"] = list(t.layer_starts)
        if t.index is not None:
            entry["index"] = t.index
        entries.append(entry)
        body.append(raw)
        offset += len(raw)
    header = {
        "version": VERSION,
        "fingerprint": span.fingerprint,
        "prompt_token_ids": span.prompt_token_ids,
        "first_token": span.first_token,
        "layout": span.layout,
        "dtype": span.dtype,
        "transfer_id": span.transfer_id,
        "expires_at": span.expires_at,
        "tensors": entries,
    }
    return frame(header, b"".join(body), secret)


def frame(header: dict, body: bytes | list[memoryview], secret: bytes, magic: bytes = MAGIC) -> bytes:
    """Frame and sign a header and body (tests use it to re-sign what they edited); `magic` names
    the kind of value (a KV span's by default, a KV tier object's: baton/kv/tier_objects.py). A body
    given as its parts is signed part by part and joined once."""
    head = json.dumps(header, separators=(",", ":")).encode()
    parts = [magic, struct.pack("<I", len(head)), head, struct.pack("<Q", xxhash.xxh64_intdigest(head))]
    parts += body if isinstance(body, list) else [body]
    mac = _hmac(secret)
    for part in parts:
        mac.update(part)
    return b"".join([*parts, mac.digest()])


def sign(data: bytes | memoryview, secret: bytes) -> bytes:
    mac = _hmac(secret)
    mac.update(data)
    return mac.digest()


def _hmac(secret: bytes):
    if not isinstance(secret, bytes) or not secret:
        raise ValueError("a KV span secret is a non-empty bytes value")
    return hmac.new(secret, digestmod=hashlib.sha256)


def read_header(blob: bytes, secret: bytes, magic: bytes = MAGIC) -> tuple[dict, memoryview]:
    """The header and the body after it, once the signature is checked; InvalidKVImport if the
    magic, the signature, the framing or the header's JSON is wrong."""
    try:
        view = memoryview(blob).cast("B")
    except (TypeError, ValueError):  # not bytes, or a view that is not contiguous bytes
        raise InvalidKVImport("span", "bytes", type(blob).__name__) from None
    if len(view) < len(magic) or view[: len(magic)] != magic:
        raise InvalidKVImport("magic", magic.decode(), repr(bytes(view[: len(magic)])))
    minimum = len(magic) + 4 + 8 + HMAC_BYTES  # magic, header length, header checksum, signature
    if len(view) < minimum:
        raise InvalidKVImport("length", f">= {minimum} bytes", len(view))
    signed, signature = view[:-HMAC_BYTES], view[-HMAC_BYTES:]
    if not hmac.compare_digest(sign(signed, secret), signature):
        raise InvalidKVImport(
            "hmac", "a span signed with this deployment's kv secret", "a signature that does not match"
        )
    (n,) = struct.unpack_from("<I", signed, len(magic))
    start = len(magic) + 4
    if n > min(MAX_HEADER_BYTES, len(signed) - start - 8):
        raise InvalidKVImport("header_length", f"<= {min(MAX_HEADER_BYTES, len(signed) - start - 8)}", n)
    head = bytes(signed[start : start + n])
    (digest,) = struct.unpack_from("<Q", signed, start + n)
    if digest != xxhash.xxh64_intdigest(head):
        raise InvalidKVImport("header_checksum", f"{xxhash.xxh64_intdigest(head):016x}", f"{digest:016x}")
    return parse_header(head), signed[start + n + 8 :]


def parse_header(head: bytes) -> dict:
    """JSON of bounded shape: at most MAX_JSON_CONTAINERS arrays and objects nested at most
    MAX_JSON_DEPTH deep (checked on the brackets before parsing, and again after), integers of at
    most 19 digits, no NaN or Infinity."""
    brackets = head.translate(None, _NOT_BRACKETS)  # brackets inside strings count too: conservative
    if len(brackets) > 2 * MAX_JSON_CONTAINERS:
        raise InvalidKVImport("header", f"at most {MAX_JSON_CONTAINERS} JSON arrays and objects", len(brackets) // 2)
    depth = deepest = 0
    for b in brackets:
        depth += 1 if b in b"[{" else -1
        deepest = max(deepest, depth)
    if deepest > MAX_JSON_DEPTH:
        raise InvalidKVImport("header", f"JSON nested at most {MAX_JSON_DEPTH} deep", deepest)
    try:
        header = json.loads(head.decode("utf-8"), parse_int=_bounded_int, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidKVImport("header", "valid JSON", str(e)[:200]) from None
    if not isinstance(header, dict):
        raise InvalidKVImport("header", "a JSON object", type(header).__name__)
    if _depth(header) > MAX_JSON_DEPTH:  # brackets inside strings can hide nesting from the scan above
        raise InvalidKVImport("header", f"JSON nested at most {MAX_JSON_DEPTH} deep", f"> {MAX_JSON_DEPTH}")
    return header


def _depth(value: object) -> int:
    """Nesting depth of parsed JSON, without recursion (at most MAX_JSON_CONTAINERS containers)."""
    deepest, todo = 0, [(value, 1)] if isinstance(value, (dict, list)) else []
    while todo:
        v, d = todo.pop()
        deepest = max(deepest, d)
        todo.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, (dict, list)))
    return deepest


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a span may carry")


def tensor_from_bytes(raw: memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    arr = np.frombuffer(raw, dtype=np.dtype(_NUMPY_VIEW[dtype]).newbyteorder("<")).reshape(shape)
    t = torch.from_numpy(arr.astype(arr.dtype.newbyteorder("="), copy=True))
    return t.view(dtype) if dtype in _BITS else t


def build_span(header: dict, tensors: list[torch.Tensor]) -> KVSpan:
    """A KVSpan from a header `validate.plan_import` has accepted and its decoded tensors."""
    return KVSpan(
        fingerprint=header["fingerprint"],
        prompt_token_ids=list(header["prompt_token_ids"]),
        first_token=int(header["first_token"]),
        layout=header["layout"],
        dtype=header["dtype"],
        transfer_id=header["transfer_id"],
        expires_at=header["expires_at"],
        tensors=[
            SpanTensor(e["kind"], tuple(e["layer_ids"]), int(e["start"]), t, e.get("layer_starts"), e.get("index"))
            for e, t in zip(header["tensors"], tensors)
        ],
    )
