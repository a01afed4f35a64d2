"""KV tensors: one K and one V tensor per group, [layers in group, slots, kv heads, head dim]; with
an fp8 cache also a K and a V scale per (layer, block, kv head)."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

from baton.kv.spec import KVSpec
from baton.ops import read_kv_fp8, write_kv_fp8, zeros_on_demand

FP8 = torch.float8_e4m3fn  # vLLM's --kv-cache-dtype fp8
KV_LAYOUTS = {"NHD": "LTHD", "HND": "LHTD"}  # storage layout -> axis order of a group's tensor


@dataclass
class LayerKV:
    """One layer's K and V caches as [slots, kv heads, head dim] views, and an fp8 cache's scales
    ([blocks, kv heads] each, None for other dtypes). Its `write` and `read` are the only code that
    turns cached values into numbers and back."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.k_scale is None else (self.k_scale, self.v_scale)

    def write(
        self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, block_size: int, fresh: bool = False
    ) -> None:
        """k and v [tokens, kv heads, dim] to `slots` (v None: MLA, whose latent is K alone). An fp8
        cache quantizes per block and head; `fresh`: the blocks hold nothing yet, even where a write
        starts mid-block (an import of a sliding window)."""
        for cache, scale, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            if x is None:
                continue
            if scale is None:
                cache.index_copy_(0, slots, x.to(cache.dtype))
            else:
                write_kv_fp8(x, cache, scale, slots, block_size, fresh)

    def read_k(self, slots: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
        return _read(self.k, self.k_scale, slots, block_size, dtype)

    def read_v(self, slots: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
        return _read(self.v, self.v_scale, slots, block_size, dtype)


def _read(
    cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    if scale is None:
        return cache[slots].to(dtype)
    return read_kv_fp8(cache, scale, slots, block_size).to(dtype)


class KVStorage:
    """`layout` NHD stores [layers, slots, heads, dim], HND [layers, heads, slots, dim]; readers
    always get [slots, heads, dim] views, so only this class knows the physical order."""

    def __init__(
        self,
        spec: KVSpec,
        num_blocks: list[int],
        dtype: torch.dtype,
        layout: str = "NHD",
        device: str = "cpu",
        layers: Collection[int] | None = None,
    ) -> None:
        """`layers`: a pipeline stage's layers, the only ones given memory (default: all)."""
        if layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {layout!r}")
        self.spec = spec
        self.dtype = dtype
        self.layout = layout
        self.kv_heads: range | None = None  # tensor parallel: which of the model's KV heads these are
        self.span_layout = KV_LAYOUTS[layout]
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.k_scale: list[torch.Tensor] = []  # fp8: [layers, blocks, kv heads] float32 per group
        self.v_scale: list[torch.Tensor] = []
        self._index: dict[int, tuple[int, int]] = {}  # layer -> (group, index in the group's tensors)
        for g, n in zip(spec.groups, num_blocks):
            held = [i for i in g.layer_ids if layers is None or i in layers]
            self._index.update({layer_id: (g.group_id, j) for j, layer_id in enumerate(held)})
            if dtype == FP8:
                self.k_scale.append(torch.zeros((len(held), n, g.num_kv_heads), device=device))
                self.v_scale.append(torch.zeros((len(held), n, g.num_kv_heads), device=device))
            dims = {"L": len(held), "T": n * g.rows_per_block(spec.block_size), "H": g.num_kv_heads, "D": g.head_dim}
            self.k.append(pool_zeros(tuple(dims[a] for a in self.span_layout), dtype, device))
            dims["D"] = g.v_head_dim  # 0 for MLA and pooled keys: K alone
            self.v.append(pool_zeros(tuple(dims[a] for a in self.span_layout), dtype, device))

    def group_view(self, group_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a group as [layers, slots, heads, dim] views."""
        if self.layout == "NHD":
            return self.k[group_id], self.v[group_id]
        return self.k[group_id].transpose(1, 2), self.v[group_id].transpose(1, 2)

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [slots, kv heads, head dim] views."""
        group_id, idx = self._index[layer_id]
        k, v = self.group_view(group_id)
        return k[idx], v[idx]

    def layer_kv(self, layer_id: int) -> LayerKV:
        k, v = self.layer(layer_id)
        if self.dtype != FP8:
            return LayerKV(k, v)
        group_id, idx = self._index[layer_id]
        return LayerKV(k, v, self.k_scale[group_id][idx], self.v_scale[group_id][idx])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v + self.k_scale + self.v_scale)


def pool_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str, huge_pages: bool = True) -> torch.Tensor:
    """A pool (KV blocks, recurrent state slots and checkpoints), zero and resident only as it fills
    on the CPU: a large budget costs memory when used, not at start (torch.zeros writes every page).
    `huge_pages`: on transparent huge pages (decode reads KV blocks scattered over the pool)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return zeros_on_demand(nbytes, huge_pages).view(dtype).view(shape)
