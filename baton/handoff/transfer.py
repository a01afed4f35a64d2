"""Export a request's prompt KV from this worker's storage; apply a validated import to it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from baton.handoff.span import AXES, SCALE_KINDS, KVSpan, SpanTensor, span_rows, to_layout
from baton.handoff.validate import ImportPlan
from baton.kv.manager import NULL_BLOCK, KVManager
from baton.kv.state import StateStorage
from baton.kv.storage import FP8, KVStorage


def _slots(kv: KVManager, request_id: str, group_id: int, positions: np.ndarray) -> torch.Tensor:
    """The cache rows of `positions` (of a pooled group: of those pools) in the request's blocks."""
    table = np.asarray(kv.block_tables[request_id][group_id], dtype=np.int64)
    group = kv.spec.groups[group_id]
    positions = positions * group.kind.pool  # a pooled group's: each pool's first position
    blocks = table[positions // kv.block_size]
    if (blocks == NULL_BLOCK).any():  # a NULL entry would index the pool's last block: another request's KV
        raise RuntimeError(f"positions of group {group_id} of request {request_id} are no longer held")
    return torch.from_numpy(group.cache_rows(blocks, positions, kv.block_size))


def held_start(kv: KVManager, request_id: str, group_id: int) -> int:
    """First position whose block the request still holds in this group (sliding groups drop
    blocks that fell out of the window: after a prefix-cache hit, during a chunked prefill)."""
    table = kv.block_tables[request_id][group_id]
    return next((i for i, b in enumerate(table) if b != NULL_BLOCK), len(table)) * kv.block_size


# A group's K/V (and fp8 scales) at some slots: [("k", [layers, T, heads, dim], per-position
# scales [layers, T, heads, 1] or None), ("v", ...)]. Tensor parallel reads every rank's heads.
GroupReader = Callable[[int, torch.Tensor], list[tuple[str, torch.Tensor, torch.Tensor | None]]]


def read_group(storage: KVStorage, block_size: int) -> GroupReader:
    """This process's own KV: fp8 as its bits (uint8: torch indexes those)."""

    def read(group_id: int, slots: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
        k, v = storage.group_view(group_id)
        if storage.dtype != FP8:
            return [("k", k[:, slots], None), ("v", v[:, slots], None)]
        scales = (storage.k_scale[group_id], storage.v_scale[group_id])
        rows = storage.spec.groups[group_id].rows_per_block(block_size)
        return [
            (kind, t.view(torch.uint8)[:, slots], scale[:, slots // rows, :, None])
            for kind, t, scale in (("k", k, scales[0]), ("v", v, scales[1]))
        ]

    return read


def export_span(
    kv: KVManager,
    storage: KVStorage,
    fingerprint: dict,
    request_id: str,
    prompt_token_ids: list[int],
    first_token: int,
    fmt: str = "grouped",
    states: StateStorage | None = None,
    read: GroupReader | None = None,
    read_state: Callable[[int], list[list[torch.Tensor]]] | None = None,
) -> KVSpan:
    """Grouped: one K and V per group, sliding groups their last `window` positions.
    Dense: one K and V over all layers and positions; each layer's `layer_starts` entry says from
    where it holds real K/V (full layers 0, sliding ones where their held blocks begin), and the
    positions before are zeros: nothing is read that this worker no longer holds."""
    if fmt not in ("grouped", "dense"):
        raise ValueError(f"span format must be 'grouped' or 'dense', not {fmt!r}")
    read = read or read_group(storage, kv.block_size)
    n = len(prompt_token_ids)
    span = KVSpan(fingerprint, list(prompt_token_ids), first_token, storage.span_layout, str(storage.dtype)[6:])
    if kv.spec.has_state:  # the slot holds the state after the whole prompt: position n
        assert states is not None
        slot_state = (read_state or states.read_slot)(kv.state_slots[request_id])
        for sg in kv.spec.state_groups:
            for j, t in enumerate(slot_state[sg.group_id]):
                span.tensors.append(SpanTensor("state", sg.layer_ids, n, t, None, j))
    if fmt == "grouped":
        for g in kv.spec.groups:
            start = max(0, n - g.kind.window) if g.kind.is_sliding else 0
            for kind, held, scale in read(g.group_id, _slots(kv, request_id, g.group_id, span_rows(g, start, n))):
                span.tensors.append(SpanTensor(kind, g.layer_ids, start, _out(held, span.layout)))
                if scale is not None:
                    span.tensors.append(SpanTensor(SCALE_KINDS[kind], g.layer_ids, start, _out(scale, span.layout)))
        return span
    num_layers = fingerprint["num_layers"]
    layer_starts = [n] * num_layers  # layers without K/V (recurrent) hold nothing
    dense: dict[str, torch.Tensor] = {}
    for g in kv.spec.groups:
        start = min(held_start(kv, request_id, g.group_id), n)
        for kind, held, scale in read(g.group_id, _slots(kv, request_id, g.group_id, np.arange(start, n))):
            for name, t in ((kind, held), (SCALE_KINDS[kind], scale)):
                if t is None:
                    continue
                if name not in dense:
                    dense[name] = torch.zeros((num_layers, n, *t.shape[2:]), dtype=t.dtype)
                dense[name][list(g.layer_ids), start:] = t
        for layer_id in g.layer_ids:
            layer_starts[layer_id] = start
    for kind, data in dense.items():
        span.tensors.append(SpanTensor(kind, tuple(range(num_layers)), 0, _out(data, span.layout), tuple(layer_starts)))
    return span


def _out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A [layers, T, heads, dim] tensor in the span's layout, fp8 bits as fp8 again."""
    t = to_layout(t, AXES, layout).contiguous()
    return t.view(FP8) if t.dtype == torch.uint8 else t


def apply_import(
    kv: KVManager, storage: KVStorage, states: StateStorage, request_id: str, plan: ImportPlan
) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Write a plan that `plan_import` has checked into the blocks and state slot the scheduler
    allocated for it (`KVManager.allocate_for_import`). Returns each group's (id, slots, K, V)
    with every head: tensor parallel's other ranks write their heads."""
    for gid, j, t in plan.states:
        states.write_state(kv.state_slots[request_id], gid, j, t)
    written = []
    for w in plan.writes:
        slots = _slots(kv, request_id, w.group_id, w.positions)
        write_group(kv.spec.groups[w.group_id].layer_ids, storage, kv.block_size, slots, w.k, w.v)
        written.append((w.group_id, slots, w.k, w.v))
    return written


def write_group(
    layer_ids: tuple[int, ...],
    storage: KVStorage,
    block_size: int,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """K and V [layers, T, every head, dim] into a group's layers (this rank's heads of them)."""
    group = storage.spec.groups[storage.spec.layer_to_group[layer_ids[0]][0]]
    heads = storage.kv_heads
    if heads is not None and not group.kind.has_latent:  # MLA latents and pooled keys: every rank's whole
        k, v = k[:, :, heads.start : heads.stop], v[:, :, heads.start : heads.stop]
    rows = group.rows_per_block(block_size)
    for i, layer_id in enumerate(layer_ids):
        storage.layer_kv(layer_id).write(slots, k[i], v[i], rows, fresh=True)
