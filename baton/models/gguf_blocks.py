"""Matrices kept in GGUF block formats, as a file ships them: baton's kernels read the blocks
(baton/ops/quant_linear.cpp), so a Q4_K matrix costs 4.5 bits a weight per decode step, not 32."""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

# The formats baton's kernels read, by ggml's type name: (values, bytes) per block.
BLOCK_FORMATS = {
    name: gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    for name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
}
# The integer kernels sum K in up to this many parts (BlockTensor.k_parts): tensor parallelism of
# up to this many ranks splits a row-parallel linear's K along part edges.
MAX_K_PARTS = 8


def default_k_parts(blocks: int) -> int:
    """The largest power of two up to MAX_K_PARTS that divides a row's `blocks`."""
    parts = 1
    while parts < MAX_K_PARTS and blocks % (2 * parts) == 0:
        parts *= 2
    return parts


def slice_k_parts(blocks: int, start: int, stop: int) -> int:
    """The parts of a `blocks`-block row's default_k_parts that lie inside blocks [start, stop):
    a tensor-parallel shard's. 1 (a single chain, which rounds otherwise than the whole's) where the
    range cuts a part."""
    width = blocks // default_k_parts(blocks)
    return (stop - start) // width if start % width == 0 and (stop - start) % width == 0 else 1


@dataclass
class BlockTensor:
    """An [N, K] matrix in one GGUF block format: blocks uint8 [N, K / values, bytes] as the file
    ships them, or regrouped for the integer kernels, [ceil(N / 8), K / values, 8, bytes].

    k_parts is part of the integer kernels' arithmetic: each output sums its K in that many equal,
    contiguous parts, each from zero in block order, and adds the parts' sums pairwise as a balanced
    tree (parts 0+1, 2+3, then those, ...). A tensor-parallel shard of a row-parallel linear holds
    whole parts (the full weight's k_parts / ranks of them), and TPGroup.all_reduce adds the ranks'
    sums in the same tree, so d ranks give one rank's bits for every d dividing k_parts."""

    qtype: str
    blocks: torch.Tensor
    num_rows: int | None = None  # N, once regrouped
    k_parts: int = 0  # 0: default_k_parts of the row's blocks

    def __post_init__(self) -> None:
        if self.k_parts == 0:
            self.k_parts = default_k_parts(self.blocks.shape[1])
        if self.blocks.shape[1] % self.k_parts:
            raise ValueError(f"{self.blocks.shape[1]} blocks a row do not split into {self.k_parts} parts")

    def regroup(self, out: torch.Tensor | None = None) -> None:
        """Regroup for the integer kernels (baton/ops/quant_int.cpp), in place: a tied embedding and
        lm_head go on sharing one copy (a lookup reads a regrouped row back). `out`: uint8, at
        least regrouped_nbytes, where to keep them (a slice of a shared arena)."""
        if self.blocks.dim() == 3:
            from baton.ops import regroup_blocks

            self.num_rows = self.blocks.shape[0]
            regrouped = regroup_blocks(self.blocks)
            if out is not None:
                regrouped = out[: regrouped.numel()].view(regrouped.shape).copy_(regrouped)
            self.blocks = regrouped

    @property
    def regrouped_nbytes(self) -> int:
        """The bytes regroup keeps: the rows padded to whole groups of 8."""
        rows, blocks, nbytes = self.blocks.shape if self.blocks.dim() == 3 else (0, 0, 0)
        return -(-rows // 8) * 8 * blocks * nbytes

    @classmethod
    def from_rows(cls, qtype: str, rows: np.ndarray | torch.Tensor) -> BlockTensor:
        """From row bytes [N, row bytes] (what gguf's reader gives for a quantized tensor)."""
        _, nbytes = BLOCK_FORMATS[qtype]
        if isinstance(rows, np.ndarray):
            rows = np.ascontiguousarray(rows) if rows.flags.writeable else np.array(rows, copy=True)
        data = torch.as_tensor(rows).contiguous()
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] % nbytes:
            raise ValueError(f"{qtype} rows must be uint8 [N, blocks * {nbytes}], got {data.dtype} {tuple(data.shape)}")
        return cls(qtype, data.view(data.shape[0], -1, nbytes))

    @property
    def shape(self) -> tuple[int, int]:
        values, _ = BLOCK_FORMATS[self.qtype]
        return self.num_rows or self.blocks.shape[0], self.blocks.shape[1] * values

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], the values baton's kernels compute with."""
        from baton.ops import dequantize_rows

        return dequantize_rows(self.blocks, torch.arange(self.shape[0]))

    def kernel_weight(self) -> torch.Tensor:
        """What the kernels take (baton/ops/quant_linear.h): the blocks, regrouped ones as [groups,
        k_parts, blocks / k_parts, 8, bytes] when K is summed in parts."""
        if self.blocks.dim() == 3 or self.k_parts == 1:
            return self.blocks
        groups, blocks, lanes, nbytes = self.blocks.shape
        return self.blocks.view(groups, self.k_parts, blocks // self.k_parts, lanes, nbytes)

    def take_blocks(self, start: int, stop: int) -> BlockTensor:
        """Columns [start, stop) in blocks (a row-parallel shard), with slice_k_parts' parts."""
        parts = slice_k_parts(self.blocks.shape[1], start, stop)
        return BlockTensor(self.qtype, self.blocks[:, start:stop].contiguous(), k_parts=parts)


BlockWeight = BlockTensor | list[BlockTensor]
"""A matrix in GGUF blocks: one format, or row parts in several (stack_rows)."""


def stack_rows(parts: list[BlockTensor]) -> BlockWeight:
    """A fused projection's parts (q/k/v, gate/up) stacked by rows: consecutive parts of one format
    joined into one tensor; where formats differ (Q4_K_M ships Q4_K q and k beside a Q6_K v in some
    layers), a list of such runs, each computed in its own format and the outputs put side by side."""
    runs: list[list[BlockTensor]] = []
    for p in parts:
        if runs and runs[-1][0].qtype == p.qtype and runs[-1][0].blocks.shape[1:] == p.blocks.shape[1:]:
            runs[-1].append(p)
        else:
            runs.append([p])
    stacked = [BlockTensor(r[0].qtype, torch.cat([p.blocks for p in r])) for r in runs]
    return stacked[0] if len(stacked) == 1 else stacked
