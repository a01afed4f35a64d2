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
# Formats whose values are d * integer with the integer in int8's range: exactly Q8_0 blocks.
_WIDENS_TO_Q8_0 = ("Q4_0", "Q5_0", "Q8_0")
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

    def regroup(self) -> None:
        """Regroup for the integer kernels (baton/ops/quant_int.cpp), in place: a tied embedding and
        lm_head go on sharing one copy (a lookup reads a regrouped row back)."""
        if self.blocks.dim() == 3:
            from baton.ops import regroup_blocks

            self.num_rows = self.blocks.shape[0]
            self.blocks = regroup_blocks(self.blocks)

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


def concat_rows(parts: list[BlockTensor]) -> BlockTensor | None:
    """The parts stacked by rows (a fused q/k/v or gate/up projection) in one format: as they are
    when they share one; Q4_0 / Q5_0 parts widened to Q8_0 (exactly: the same d, the same integers)
    when mixed with Q8_0, as Gemma3's Q4_K_M file mixes Q5_0 q/k with a Q8_0 v. None when no format
    holds every part exactly."""
    qtypes = {p.qtype for p in parts}
    if len(qtypes) > 1:
        if not qtypes <= set(_WIDENS_TO_Q8_0):
            return None
        parts = [_to_q8_0(p) for p in parts]
    return BlockTensor(parts[0].qtype, torch.cat([p.blocks for p in parts]))


def _to_q8_0(t: BlockTensor) -> BlockTensor:
    if t.qtype == "Q8_0":
        return t
    b = t.blocks.numpy()
    if t.qtype == "Q4_0":
        qs = b[..., 2:18]
        ints = np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int16) - 8
    else:  # Q5_0: d, 32 high bits, 16 bytes of low nibbles
        qh = b[..., 2:6].copy().view(np.uint32)  # [N, blocks, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
        qs = b[..., 6:22]
        ints = (np.concatenate([qs & 0xF, qs >> 4], axis=-1) | high).astype(np.int16) - 16
    q8 = np.concatenate([b[..., :2], ints.astype(np.int8).view(np.uint8)], axis=-1)
    return BlockTensor("Q8_0", torch.from_numpy(np.ascontiguousarray(q8)))
