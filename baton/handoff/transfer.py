"""Export a request's prompt KV from this worker's storage; apply a validated import to it."""

from __future__ import annotations

import numpy as np
import torch

from baton.handoff.span import AXES, KVSpan, SpanTensor, to_layout
from baton.handoff.validate import ImportPlan
from baton.kv.manager import KVManager
from baton.kv.storage import KVStorage


def _slots(kv: KVManager, request_id: str, group_id: int, positions: np.ndarray) -> torch.Tensor:
    table = np.asarray(kv.block_tables[request_id][group_id], dtype=np.int64)
    bs = kv.block_size
    return torch.from_numpy(table[positions // bs] * bs + positions % bs)


def export_span(
    kv: KVManager,
    storage: KVStorage,
    fingerprint: dict,
    request_id: str,
    prompt_token_ids: list[int],
    first_token: int,
    fmt: str = "grouped",
) -> KVSpan:
    """Grouped: one K and V per group, sliding groups their last `window` positions.
    Dense: one K and V over all layers and all positions (needs every position still held)."""
    n = len(prompt_token_ids)
    span = KVSpan(fingerprint, list(prompt_token_ids), first_token, storage.span_layout, str(storage.dtype)[6:])
    per_group = []
    for g in kv.spec.groups:
        start = max(0, n - g.kind.window) if (g.kind.is_sliding and fmt == "grouped") else 0
        slots = _slots(kv, request_id, g.group_id, np.arange(start, n))
        k, v = storage.group_view(g.group_id)  # [layers, slots, heads, dim]
        per_group.append((g, start, k[:, slots], v[:, slots]))
    if fmt == "grouped":
        for g, start, k, v in per_group:
            span.tensors.append(SpanTensor("k", g.layer_ids, start, to_layout(k, AXES, span.layout).contiguous()))
            span.tensors.append(SpanTensor("v", g.layer_ids, start, to_layout(v, AXES, span.layout).contiguous()))
        return span
    if fmt != "dense":
        raise ValueError(f"span format must be 'grouped' or 'dense', not {fmt!r}")
    num_layers = fingerprint["num_layers"]
    dense = {}
    for kind, i in (("k", 2), ("v", 3)):
        parts: list[torch.Tensor | None] = [None] * num_layers
        for entry in per_group:
            for j, layer_id in enumerate(entry[0].layer_ids):
                parts[layer_id] = entry[i][j]
        dense[kind] = torch.stack(parts)
        span.tensors.append(
            SpanTensor(kind, tuple(range(num_layers)), 0, to_layout(dense[kind], AXES, span.layout).contiguous())
        )
    return span


def apply_import(kv: KVManager, storage: KVStorage, request_id: str, plan: ImportPlan) -> None:
    """Allocate and write; only called with a plan that `plan_import` has checked."""
    if not kv.allocate_for_import(request_id, len(plan.prompt_token_ids)):
        raise RuntimeError("free blocks vanished between validation and import")  # single owner: cannot happen
    for w in plan.writes:
        slots = _slots(kv, request_id, w.group_id, w.positions)
        k, v = storage.group_view(w.group_id)
        for i in range(k.shape[0]):
            k[i].index_copy_(0, slots, w.k[i])
            v[i].index_copy_(0, slots, w.v[i])
