"""Rank 0's commands to the other ranks, over torch.distributed broadcasts: a tree of plain values,
the step's metadata dataclasses and tensors, as a JSON header plus one byte buffer (no pickle).
Two broadcasts per message: the two lengths, then header and tensor bytes together."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import torch
import torch.distributed as dist

from baton.models.layers import GroupAttnMetadata, KVTile, PrefillSeq
from baton.models.recurrent import RecurrentSeq, StateMetadata

# the only classes a message may name: a header never makes a rank import or build anything else
_CLASSES = {c.__name__: c for c in (GroupAttnMetadata, KVTile, PrefillSeq, RecurrentSeq, StateMetadata)}
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool, torch.uint8)
}


def encode(tree: Any) -> tuple[bytes, torch.Tensor]:
    """(header, payload): the tree as JSON with tensors replaced by their place in the payload."""
    chunks: list[torch.Tensor] = []
    metas: list[list] = []
    offset = 0

    def walk(x: Any) -> Any:
        nonlocal offset
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, torch.Tensor):
            raw = x.detach().contiguous().view(-1).view(torch.uint8)
            metas.append([str(x.dtype).removeprefix("torch."), list(x.shape), offset])
            chunks.append(raw)
            offset += raw.numel()
            return {"x": len(metas) - 1}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            return {"t": [walk(v) for v in x]}
        if isinstance(x, dict):
            return {"d": {str(k): walk(v) for k, v in x.items()}}
        if dataclasses.is_dataclass(x) and type(x).__name__ in _CLASSES:
            return {"c": type(x).__name__, "f": {f.name: walk(getattr(x, f.name)) for f in dataclasses.fields(x)}}
        raise TypeError(f"a rank message cannot carry {type(x).__name__}")

    body = walk(tree)
    header = json.dumps({"body": body, "tensors": metas}).encode()
    payload = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    return header, payload


def decode(header: bytes, payload: torch.Tensor) -> Any:
    doc = json.loads(header)
    tensors = []
    for dtype, shape, offset in doc["tensors"]:
        dt = _DTYPES[dtype]
        n = dt.itemsize * math.prod(shape)
        tensors.append(payload[offset : offset + n].clone().view(dt).view(shape))

    def walk(x: Any) -> Any:
        if isinstance(x, list):
            return [walk(v) for v in x]
        if not isinstance(x, dict):
            return x
        if "x" in x:
            return tensors[x["x"]]
        if "t" in x:
            return tuple(walk(v) for v in x["t"])
        if "d" in x:
            return {k: walk(v) for k, v in x["d"].items()}
        return _CLASSES[x["c"]](**{k: walk(v) for k, v in x["f"].items()})

    return walk(doc["body"])


def broadcast(tree: Any | None, src: int = 0) -> Any:
    """Rank `src` sends `tree` (and gets the bytes it sent each rank); every other rank returns it."""
    if dist.get_rank() == src:
        header, payload = encode(tree)
        sizes = torch.tensor([len(header), payload.numel()], dtype=torch.int64)
        dist.broadcast(sizes, src)
        buf = torch.cat([torch.frombuffer(bytearray(header), dtype=torch.uint8), payload])
        dist.broadcast(buf, src)
        return sizes.nbytes + buf.numel()
    sizes = torch.empty(2, dtype=torch.int64)
    dist.broadcast(sizes, src)
    header_len, payload_len = sizes.tolist()
    buf = torch.empty(header_len + payload_len, dtype=torch.uint8)
    dist.broadcast(buf, src)
    return decode(bytes(buf[:header_len].numpy()), buf[header_len:])
