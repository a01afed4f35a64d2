"""KV tensors: one K and one V tensor per group, [layers in group, slots, kv heads, head dim]."""

from __future__ import annotations

import torch

from baton.kv.spec import KVSpec


class KVStorage:
    def __init__(self, spec: KVSpec, num_blocks: list[int], dtype: torch.dtype, device: str = "cpu") -> None:
        self.spec = spec
        self.dtype = dtype
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for g, n in zip(spec.groups, num_blocks):
            shape = (len(g.layer_ids), n * spec.block_size, g.num_kv_heads, g.head_dim)
            self.k.append(torch.zeros(shape, dtype=dtype, device=device))
            self.v.append(torch.zeros(shape, dtype=dtype, device=device))

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [slots, kv heads, head dim] views."""
        group_id, idx = self.spec.layer_to_group[layer_id]
        return self.k[group_id][idx], self.v[group_id][idx]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
