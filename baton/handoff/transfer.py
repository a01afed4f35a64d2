"""Export a request's prompt KV from this worker's storage; apply a validated import to it."""

from __future__ import annotations

import numpy as np
import torch

from baton.handoff.span import AXES, SCALE_KINDS, KVSpan, SpanTensor, to_layout
from baton.handoff.validate import ImportPlan
from baton.kv.manager import NULL_BLOCK, KVManager
from baton.kv.state import StateStorage
from baton.kv.storage import FP8, KVStorage


def _slots(kv: KVManager, request_id: str, group_id: int, positions: np.ndarray) -> torch.Tensor:
    table = np.asarray(kv.block_tables[request_id][group_id], dtype=np.int64)
    bs = kv.block_size
    blocks = table[positions // bs]
    if (blocks == NULL_BLOCK).any():  # a NULL entry would index the pool's last block: another request's KV
        raise RuntimeError(f"positions of group {group_id} of request {request_id} are no longer held")
    return torch.from_numpy(blocks * bs + positions % bs)


def held_start(kv: KVManager, request_id: str, group_id: int) -> int:
    """First position whose block the request still holds in this group (sliding groups drop
    blocks that fell out of the window: after a prefix-cache hit, during a chunked prefill)."""
    table = kv.block_tables[request_id][group_id]
    return next((i for i, b in enumerate(table) if b != NULL_BLOCK), len(table)) * kv.block_size


def export_span(
    kv: KVManager,
    storage: KVStorage,
    fingerprint: dict,
    request_id: str,
    prompt_token_ids: list[int],
    first_token: int,
    fmt: str = "grouped",
    states: StateStorage | None = None,
) -> KVSpan:
    """Grouped: one K and V per group, sliding groups their last `window` positions.
    Dense: one K and V over all layers and positions; each layer's `layer_starts` entry says from
    where it holds real K/V (full layers 0, sliding ones where their held blocks begin), and the
    positions before are zeros: nothing is read that this worker no longer holds."""
    if fmt not in ("grouped", "dense"):
        raise ValueError(f"span format must be 'grouped' or 'dense', not {fmt!r}")
    n = len(prompt_token_ids)
    span = KVSpan(fingerprint, list(prompt_token_ids), first_token, storage.span_layout, str(storage.dtype)[6:])
    if kv.spec.has_state:  # the slot holds the state after the whole prompt: position n
        assert states is not None
        slot = kv.state_slots[request_id]
        for sg in kv.spec.state_groups:
            for j, t in enumerate(states.running[sg.group_id]):
                span.tensors.append(SpanTensor("state", sg.layer_ids, n, t[:, slot].clone(), None, j))
    bs = kv.block_size
    if fmt == "grouped":
        for g in kv.spec.groups:
            start = max(0, n - g.kind.window) if g.kind.is_sliding else 0
            slots = _slots(kv, request_id, g.group_id, np.arange(start, n))
            for kind, data, scale in _group_tensors(storage, g.group_id):  # [layers, slots, heads, dim]
                held = data[:, slots]
                span.tensors.append(SpanTensor(kind, g.layer_ids, start, _out(held, span.layout)))
                if scale is not None:  # [layers, blocks, heads] -> per position [layers, T, heads, 1]
                    per_position = scale[:, slots // bs, :, None]
                    span.tensors.append(
                        SpanTensor(SCALE_KINDS[kind], g.layer_ids, start, _out(per_position, span.layout))
                    )
        return span
    num_layers = fingerprint["num_layers"]
    layer_starts = [n] * num_layers  # layers without K/V (recurrent) hold nothing
    dense: dict[str, torch.Tensor] = {}
    for kind, data, scale in _group_tensors(storage, 0):
        dense[kind] = torch.zeros((num_layers, n, *data.shape[2:]), dtype=data.dtype)
        if scale is not None:
            dense[SCALE_KINDS[kind]] = torch.zeros((num_layers, n, data.shape[2], 1))
    for g in kv.spec.groups:
        start = min(held_start(kv, request_id, g.group_id), n)
        slots = _slots(kv, request_id, g.group_id, np.arange(start, n))
        for kind, data, scale in _group_tensors(storage, g.group_id):
            dense[kind][list(g.layer_ids), start:] = data[:, slots]
            if scale is not None:
                dense[SCALE_KINDS[kind]][list(g.layer_ids), start:] = scale[:, slots // bs, :, None]
        for layer_id in g.layer_ids:
            layer_starts[layer_id] = start
    for kind, data in dense.items():
        span.tensors.append(SpanTensor(kind, tuple(range(num_layers)), 0, _out(data, span.layout), tuple(layer_starts)))
    return span


def _group_tensors(storage: KVStorage, group_id: int) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """("k", K, its scales) and ("v", V, its scales) of a group: [layers, slots, heads, dim], fp8 as
    its bits (uint8: torch indexes those), scales [layers, blocks, heads] or None."""
    k, v = storage.group_view(group_id)
    if storage.dtype != FP8:
        return [("k", k, None), ("v", v, None)]
    return [
        ("k", k.view(torch.uint8), storage.k_scale[group_id]),
        ("v", v.view(torch.uint8), storage.v_scale[group_id]),
    ]


def _out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A [layers, T, heads, dim] tensor in the span's layout, fp8 bits as fp8 again."""
    t = to_layout(t, AXES, layout).contiguous()
    return t.view(FP8) if t.dtype == torch.uint8 else t


def apply_import(kv: KVManager, storage: KVStorage, states: StateStorage, request_id: str, plan: ImportPlan) -> None:
    """Allocate and write; only called with a plan that `plan_import` has checked."""
    if not kv.allocate_for_import(request_id, len(plan.prompt_token_ids)):
        raise RuntimeError("free blocks vanished between validation and import")  # single owner: cannot happen
    for gid, j, t in plan.states:
        states.running[gid][j][:, kv.state_slots[request_id]].copy_(t)
    for w in plan.writes:
        slots = _slots(kv, request_id, w.group_id, w.positions)
        for i, layer_id in enumerate(kv.spec.groups[w.group_id].layer_ids):
            storage.layer_kv(layer_id).write(slots, w.k[i], w.v[i], kv.block_size, fresh=True)
