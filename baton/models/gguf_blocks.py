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


@dataclass
class BlockTensor:
    """An [N, K] matrix in one GGUF block format: blocks uint8 [N, K / values, bytes] as the file
    ships them, or regrouped for the integer kernels, [ceil(N / 8), K / values, 8, bytes]."""

    qtype: str
    blocks: torch.Tensor
    num_rows: int | None = None  # N, once regrouped

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
