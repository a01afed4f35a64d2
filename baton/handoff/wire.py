"""KVSpan <-> bytes: a magic, a JSON header, then each tensor's raw little-endian bytes. No pickle.

    b"BATONKV1" | u32 LE header length | header (UTF-8 JSON) | u64 LE xxh64 of the header | tensors

The header lists each tensor's kind, layers, start position, shape, dtype, byte offset and length
in the body, and an xxh64 checksum of its bytes; the header has its own checksum. Reading checks
only the framing; everything about the model is `validate.py`'s job.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import torch
import xxhash

from baton.handoff.span import KVSpan, SpanTensor
from baton.handoff.validate import InvalidKVImport

MAGIC = b"BATONKV1"
VERSION = 1
_NUMPY_VIEW = {torch.float32: np.float32, torch.bfloat16: np.uint16, torch.float16: np.float16}


def tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous().cpu()
    arr = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    return arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()


def checksum(data: bytes | memoryview) -> str:
    return xxhash.xxh64(data).hexdigest()


def encode(span: KVSpan) -> bytes:
    body, entries, offset = [], [], 0
    for t in span.tensors:
        raw = tensor_bytes(t.data)
        entries.append(
            {
                "kind": t.kind,
                "layer_ids": list(t.layer_ids),
                "start": t.start,
                "shape": list(t.data.shape),
                "dtype": str(t.data.dtype).removeprefix("torch."),
                "offset": offset,
                "nbytes": len(raw),
                "xxh64": checksum(raw),
            }
        )
        body.append(raw)
        offset += len(raw)
    header = {
        "version": VERSION,
        "fingerprint": span.fingerprint,
        "prompt_token_ids": span.prompt_token_ids,
        "first_token": span.first_token,
        "layout": span.layout,
        "dtype": span.dtype,
        "tensors": entries,
    }
    return frame(header, b"".join(body))


def frame(header: dict, body: bytes) -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<I", len(head)) + head + struct.pack("<Q", xxhash.xxh64_intdigest(head)) + body


def read_header(blob: bytes) -> tuple[dict, memoryview]:
    """The header and the body after it; InvalidKVImport if the framing itself is broken."""
    if len(blob) < len(MAGIC) + 4 or blob[: len(MAGIC)] != MAGIC:
        raise InvalidKVImport("magic", MAGIC.decode(), repr(bytes(blob[: len(MAGIC)])))
    (n,) = struct.unpack_from("<I", blob, len(MAGIC))
    start = len(MAGIC) + 4
    if start + n + 8 > len(blob):
        raise InvalidKVImport("header_length", f"<= {len(blob) - start - 8}", n)
    head = bytes(blob[start : start + n])
    (digest,) = struct.unpack_from("<Q", blob, start + n)
    if digest != xxhash.xxh64_intdigest(head):
        raise InvalidKVImport("header_checksum", f"{xxhash.xxh64_intdigest(head):016x}", f"{digest:016x}")
    try:
        header = json.loads(head)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidKVImport("header", "valid JSON", str(e)) from None
    if not isinstance(header, dict):
        raise InvalidKVImport("header", "a JSON object", type(header).__name__)
    return header, memoryview(blob)[start + n + 8 :]


def tensor_from_bytes(raw: memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    arr = np.frombuffer(raw, dtype=np.dtype(_NUMPY_VIEW[dtype]).newbyteorder("<")).reshape(shape)
    t = torch.from_numpy(arr.astype(arr.dtype.newbyteorder("="), copy=True))
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def build_span(header: dict, tensors: list[torch.Tensor]) -> KVSpan:
    return KVSpan(
        fingerprint=header["fingerprint"],
        prompt_token_ids=list(header["prompt_token_ids"]),
        first_token=int(header["first_token"]),
        layout=header["layout"],
        dtype=header["dtype"],
        tensors=[
            SpanTensor(e["kind"], tuple(e["layer_ids"]), int(e["start"]), t) for e, t in zip(header["tensors"], tensors)
        ],
    )
