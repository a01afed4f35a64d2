"""KV tensors: one K and one V tensor per group, [layers in group, slots, kv heads, head dim]."""

from __future__ import annotations

import math

import torch

from baton.kv.spec import KVSpec
from baton.ops import zeros_on_demand

KV_LAYOUTS = {"NHD": "LTHD", "HND": "LHTD"}  # storage layout -> axis order of a group's tensor


class KVStorage:
    """`layout` NHD stores [layers, slots, heads, dim], HND [layers, heads, slots, dim]; readers
    always get [slots, heads, dim] views, so only this class knows the physical order."""

    def __init__(
        self, spec: KVSpec, num_blocks: list[int], dtype: torch.dtype, layout: str = "NHD", device: str = "cpu"
    ) -> None:
        if layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {layout!r}")
        self.spec = spec
        self.dtype = dtype
        self.layout = layout
        self.span_layout = KV_LAYOUTS[layout]
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for g, n in zip(spec.groups, num_blocks):
            dims = {"L": len(g.layer_ids), "T": n * spec.block_size, "H": g.num_kv_heads, "D": g.head_dim}
            self.k.append(_zeros(tuple(dims[a] for a in self.span_layout), dtype, device))
            dims["D"] = g.v_head_dim  # 0 for MLA: its latent lives in K alone
            self.v.append(_zeros(tuple(dims[a] for a in self.span_layout), dtype, device))

    def group_view(self, group_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a group as [layers, slots, heads, dim] views."""
        if self.layout == "NHD":
            return self.k[group_id], self.v[group_id]
        return self.k[group_id].transpose(1, 2), self.v[group_id].transpose(1, 2)

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [slots, kv heads, head dim] views."""
        group_id, idx = self.spec.layer_to_group[layer_id]
        k, v = self.group_view(group_id)
        return k[idx], v[idx]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """The pool on transparent huge pages on the CPU (decode reads blocks scattered over it), zero and
    resident only as blocks fill: a large budget costs memory when used, not at start."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return zeros_on_demand(nbytes).view(dtype).view(shape)
