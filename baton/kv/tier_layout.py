"""What a second-tier object holds of this worker's caches, and the only code that copies between
them: a block object is one block's rows of every paged group (an fp8 cache's per-block scales
with them, so the bits come back exactly), a state object every state group's tensors of one
checkpoint (a pooled indexer's open pool among them). Tensors are named, shaped and typed here,
from the caches, for `tier_objects.decode_object` to hold an object to."""

from __future__ import annotations

import torch

from baton.kv.spec import STATE_DTYPE, KVSpec
from baton.kv.state import StateStorage
from baton.kv.storage import FP8, KVStorage
from baton.kv.tier_objects import TensorSpec


def geometry(spec: KVSpec) -> dict:
    """What a tier object's tensors depend on besides the model and the KV dtype."""
    return {
        "block_size": spec.block_size,
        "groups": [
            [g.kind.name, g.kind.window, g.kind.pool, list(g.layer_ids), g.num_kv_heads, g.head_dim, g.v_head_dim]
            for g in spec.groups
        ],
        "state_groups": [[list(g.layer_ids), [list(s) for s in g.state_shapes]] for g in spec.state_groups],
    }


class TierLayout:
    def __init__(self, spec: KVSpec, storage: KVStorage, states: StateStorage | None) -> None:
        self.spec, self.storage, self.states = spec, storage, states
        self.block_size = spec.block_size
        self.block_specs: list[TensorSpec] = []
        for g in spec.groups:
            k, v = storage.group_view(g.group_id)
            rows = g.rows_per_block(self.block_size)
            for name, t, scale in (("k", k, storage.k_scale), ("v", v, storage.v_scale)):
                if t.shape[-1] == 0:  # MLA latents and pooled keys: K alone
                    continue
                prefix = f"g{g.group_id}.{name}"
                self.block_specs.append(TensorSpec(prefix, (t.shape[0], rows, *t.shape[2:]), t.dtype))
                if storage.dtype == FP8:
                    s = scale[g.group_id]
                    self.block_specs.append(TensorSpec(f"{prefix}_scale", (s.shape[0], s.shape[2]), s.dtype))
        self.state_specs = [
            TensorSpec(f"s{g}.{j}", (t.shape[0], *t.shape[2:]), STATE_DTYPE)
            for g, tensors in enumerate(states.checkpoints if states is not None and spec.has_state else [])
            for j, t in enumerate(tensors)
        ]

    def _block_views(self, group_id: int, block_id: int) -> list[torch.Tensor]:
        """A block's rows of one group (and fp8 scales) in block_specs' order, as views."""
        rows = self.spec.groups[group_id].rows_per_block(self.block_size)
        k, v = self.storage.group_view(group_id)
        out = []
        for t, scale in ((k, self.storage.k_scale), (v, self.storage.v_scale)):
            if t.shape[-1] == 0:
                continue
            out.append(t[:, block_id * rows : (block_id + 1) * rows])
            if self.storage.dtype == FP8:
                out.append(scale[group_id][:, block_id])
        return out

    def copy_block(self, block_ids: tuple[int, ...]) -> list[torch.Tensor]:
        """One block of every group (`block_ids[group]`), copied out in block_specs' order."""
        return [
            v.clone(memory_format=torch.contiguous_format)
            for g, b in enumerate(block_ids)
            for v in self._block_views(g, b)
        ]

    def write_block(self, group_id: int, block_id: int, tensors: list[torch.Tensor]) -> None:
        """A block object's tensors (block_specs' order) of one group into its block `block_id`."""
        prefix = f"g{group_id}."
        mine = [t for spec, t in zip(self.block_specs, tensors) if spec.name.startswith(prefix)]
        for view, values in zip(self._block_views(group_id, block_id), mine):
            view.copy_(values)

    def copy_state(self, cid: int) -> list[torch.Tensor]:
        return [x[:, cid].clone() for group in self.states.checkpoints for x in group]

    def write_state(self, cid: int, tensors: list[torch.Tensor]) -> None:
        it = iter(tensors)
        for group in self.states.checkpoints:
            for t in group:
                t[:, cid].copy_(next(it))
