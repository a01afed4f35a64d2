"""Every check on an incoming span, all before anything is written (DESIGN.md, "Handoff").

`plan_import` reads the bytes, checks them against the receiver and returns an ImportPlan whose
tensors are already in the receiver's dtype and axis order; only `apply_import` then allocates
blocks and writes. Any failure raises InvalidKVImport naming the field, the expected and the
received value, and the receiver is exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from baton.handoff.span import AXES, SPAN_DTYPES, to_layout
from baton.kv.manager import KVManager
from baton.kv.spec import KVGroup


class InvalidKVImport(ValueError):
    def __init__(self, field: str, expected: Any, received: Any) -> None:
        self.field, self.expected, self.received = field, expected, received
        super().__init__(f"invalid KV import: {field}: expected {expected}, received {received}")


@dataclass
class GroupWrite:
    group_id: int
    positions: np.ndarray  # positions written, ascending
    k: torch.Tensor  # [layers in group, T, heads, dim] in the receiver's KV dtype
    v: torch.Tensor


@dataclass
class ImportPlan:
    prompt_token_ids: list[int]
    first_token: int
    source_dtype: str
    writes: list[GroupWrite]


def _check(ok: bool, field: str, expected: Any, received: Any) -> None:
    if not ok:
        raise InvalidKVImport(field, expected, received)


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _ints(x: Any) -> bool:
    return isinstance(x, list) and all(_int(v) for v in x)


def check_header(header: dict, fingerprint: dict, vocab_size: int, expected_tokens: list[int] | None) -> None:
    _check(header.get("version") == 1, "version", 1, header.get("version"))
    theirs = header.get("fingerprint")
    _check(isinstance(theirs, dict), "fingerprint", "an object", type(theirs).__name__)
    _check(
        theirs.get("num_layers") == fingerprint["num_layers"],
        "layer_count",
        fingerprint["num_layers"],
        theirs.get("num_layers"),
    )
    for key, ours in fingerprint.items():
        _check(theirs.get(key) == ours, f"fingerprint.{key}", ours, theirs.get(key))
    layout = header.get("layout")
    _check(isinstance(layout, str) and sorted(layout) == sorted(AXES), "layout", f"a permutation of {AXES}", layout)
    tokens = header.get("prompt_token_ids")
    _check(
        isinstance(tokens, list)
        and len(tokens) > 0
        and all(isinstance(t, int) and 0 <= t < vocab_size for t in tokens),
        "prompt_token_ids",
        f"a non-empty list of ids below {vocab_size}",
        str(tokens)[:80],
    )
    if expected_tokens is not None and tokens != expected_tokens:
        pairs = zip(tokens, expected_tokens)
        at = next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(tokens), len(expected_tokens)))
        raise InvalidKVImport(
            "prompt_token_ids",
            f"the request's {len(expected_tokens)} tokens",
            f"{len(tokens)} tokens, differing from position {at}",
        )
    first = header.get("first_token")
    _check(_int(first) and 0 <= first < vocab_size, "first_token", f"an id below {vocab_size}", first)
    _check(
        isinstance(header.get("tensors"), list) and header["tensors"],
        "tensors",
        "a non-empty list",
        header.get("tensors"),
    )


def _need_start(group: KVGroup, n: int) -> int:
    """First position the next query (at position n) can read in this group."""
    return max(0, n - group.kind.window + 1) if group.kind.is_sliding else 0


def plan_import(
    blob: bytes,
    *,
    fingerprint: dict,
    kv: KVManager,
    kv_dtype: torch.dtype,
    vocab_size: int,
    expected_tokens: list[int] | None,
) -> ImportPlan:
    from baton.handoff.wire import checksum, read_header, tensor_from_bytes

    header, body = read_header(blob)
    check_header(header, fingerprint, vocab_size, expected_tokens)
    spec = kv.spec
    n = len(header["prompt_token_ids"])
    layout = header["layout"]
    all_layers = tuple(range(fingerprint["num_layers"]))
    group_layers = {g.layer_ids for g in spec.groups}
    geometry = {"H": spec.groups[0].num_kv_heads, "D": spec.groups[0].head_dim}
    sources: dict[tuple[str, tuple[int, ...]], tuple[dict, memoryview]] = {}
    for i, e in enumerate(header["tensors"]):
        f = f"tensors[{i}]"
        _check(isinstance(e, dict), f, "an object", type(e).__name__)
        kind, layers = e.get("kind"), e.get("layer_ids")
        _check(isinstance(kind, str) and kind in ("k", "v"), f"{f}.kind", "'k' or 'v'", kind)
        layers = tuple(layers) if _ints(layers) else None
        _check(
            layers in group_layers or layers == all_layers,
            "layer_to_group",
            f"one of the receiver's groups {sorted(group_layers)} or all {len(all_layers)} layers",
            layers,
        )
        _check((kind, layers) not in sources, f"{f}.layer_ids", "each layer once per kind", f"{kind} {layers} twice")
        dtype = e.get("dtype")
        _check(isinstance(dtype, str) and dtype in SPAN_DTYPES, "dtype", f"one of {sorted(SPAN_DTYPES)}", dtype)
        start = e.get("start")
        _check(_int(start) and 0 <= start < n, "positions", f"a start in [0, {n})", start)
        want = {"L": len(layers), "T": n - start, **geometry}
        expected_shape = [want[a] for a in layout]
        _check(e.get("shape") == expected_shape, "shape", expected_shape, e.get("shape"))
        nbytes, offset = e.get("nbytes"), e.get("offset")
        size = int(np.prod(expected_shape)) * SPAN_DTYPES[e["dtype"]].itemsize
        _check(_int(nbytes) and nbytes == size, "nbytes", f"{size} ({e['dtype']} x {expected_shape})", nbytes)
        _check(_int(offset) and offset >= 0, f"{f}.offset", "a byte offset >= 0", offset)
        _check(offset + nbytes <= len(body), "body_length", f">= {offset + nbytes} bytes", len(body))
        raw = body[offset : offset + nbytes]
        _check(checksum(raw) == e.get("xxh64"), "checksum", e.get("xxh64"), checksum(raw))
        sources[(kind, layers)] = (e, raw)
    plans = []
    for g in spec.groups:
        need = _need_start(g, n)
        picked = {}
        for kind in ("k", "v"):
            src = sources.get((kind, g.layer_ids)) or sources.get((kind, all_layers))
            _check(src is not None, "layer_to_group", f"{kind} for layers {g.layer_ids}", "no tensor holding them")
            e = src[0]
            if not g.kind.is_sliding:
                _check(
                    e["start"] == 0,
                    "positions",
                    f"full-attention layers {g.layer_ids} from position 0",
                    f"from position {e['start']}",
                )
            _check(
                e["start"] <= need,
                "sliding_coverage",
                f"positions from {need} (window {g.kind.window})",
                f"from {e['start']}",
            )
            picked[kind] = src
        plans.append((g, need, picked))
    needed = kv.blocks_for_import(n)
    for g, blocks in zip(spec.groups, needed):
        _check(
            blocks <= kv.num_free_blocks(g.group_id),
            "free_blocks",
            f">= {blocks} free in group {g.group_id}",
            kv.num_free_blocks(g.group_id),
        )
    writes = []
    for g, need, picked in plans:
        out = {}
        for kind, (e, raw) in picked.items():
            t = to_layout(tensor_from_bytes(raw, SPAN_DTYPES[e["dtype"]], e["shape"]), layout, AXES)
            if len(e["layer_ids"]) != len(g.layer_ids):  # dense: pick this group's layers
                t = t[list(g.layer_ids)]
            out[kind] = t[:, need - e["start"] :].to(kv_dtype).contiguous()
        writes.append(GroupWrite(g.group_id, np.arange(need, n), out["k"], out["v"]))
    dtypes = sorted({e["dtype"] for e in header["tensors"]})
    return ImportPlan(list(header["prompt_token_ids"]), header["first_token"], "+".join(dtypes), writes)
