"""A model's parameters as the checkpoint tensors they are made of: each parameter names its parts
(checkpoint name, first row, shape), and loading copies each part into its rows. Families whose
checkpoints split what baton fuses (KDA's in_proj and conv, gate | up) share it; BlockRows gathers
such parts when they come in GGUF blocks."""

from __future__ import annotations

import logging

import torch

from baton.models.gguf_blocks import BlockTensor, stack_rows

logger = logging.getLogger(__name__)

Part = tuple[str, int | None, tuple[int, ...]]  # checkpoint name, first row (None: all of it), shape


def kda_parts(hf: str, shape: tuple[int, ...], in_rows: dict[str, int] | None) -> list[Part] | None:
    """A KDA layer's fused in_proj (q | k | v | f_a | g_a | b) and conv weight ([q | k | v]) as the
    checkpoint's tensors; None for another parameter."""
    if hf.endswith(".self_attn.in_proj.weight") and in_rows is not None:
        starts = [sum(list(in_rows.values())[:i]) for i in range(len(in_rows))]
        return [
            (hf.replace("in_proj", part), start, (r, shape[1])) for (part, r), start in zip(in_rows.items(), starts)
        ]
    if hf.endswith(".self_attn.conv_weight"):
        c = shape[0] // 3
        return [(hf.replace("conv_weight", f"{p}_conv1d.weight"), i * c, (c, 1, shape[1])) for i, p in enumerate("qkv")]
    return None


def renamed(name: str, table: dict[str, str]) -> str:
    """`name` with the first of `table`'s substrings it holds replaced (a family's checkpoint names
    for what baton's program calls otherwise, or back)."""
    for old, new in table.items():
        if old in name:
            return name.replace(old, new, 1)
    return name


class PartsWeightMap:
    """Mixed into a model class that defines `_hf_parts(name, shape) -> list[Part]`."""

    _weight_map: dict[str, tuple[str, int | None, tuple[int, ...]]] | None = None

    def _hf_parts(self, name: str, shape: tuple[int, ...]) -> list[Part]:
        raise NotImplementedError

    def _checkpoint_name(self, hf_name: str) -> str:
        """The name a checkpoint's tensor is mapped under (an alias the family accepts: itself by default)."""
        return hf_name

    def _weights(self) -> dict[str, tuple[str, int | None, tuple[int, ...]]]:
        if self._weight_map is None:
            self._weight_map = {
                hf: (name, start, shape)
                for name, p in self.named_parameters()  # type: ignore[attr-defined]
                for hf, start, shape in self._hf_parts(name, tuple(p.shape))
            }
        return self._weight_map

    def hf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return {hf: shape for hf, (_, _, shape) in self._weights().items()}

    def load_weight(self, hf_name: str, tensor: torch.Tensor | BlockTensor) -> None:
        """A float tensor is copied into its rows; a matrix in GGUF blocks waits in `block_rows` (the
        model's BlockRows) for its parameter's other parts, and stays blocks where a linear takes it."""
        name, start, shape = self._weights()[self._checkpoint_name(hf_name)]
        param = self.get_parameter(name).data  # type: ignore[attr-defined]
        dst = param if start is None else param[start : start + shape[0]]
        if isinstance(tensor, BlockTensor):
            module = self.get_submodule(name.rpartition(".")[0])  # type: ignore[attr-defined]
            if isinstance(module, torch.nn.Linear) and name.endswith(".weight"):
                rows = None if start is None else torch.arange(start, start + shape[0])
                self.block_rows.place(name, rows, tensor)  # type: ignore[attr-defined]
                return
            tensor = tensor.dequantize()
        dst.copy_(tensor.reshape(dst.shape))


class BlockRows:
    """A parameter's rows gathered from checkpoint tensors that arrive one at a time, float or in
    GGUF blocks. Float parts are copied into the parameter at once; parts in blocks wait until
    every row is there, then stay blocks: consecutive row runs stacked (formats may differ:
    stack_rows), scattered rows (an interleaved layout) joined where they share one format, and
    dequantized into the parameter otherwise (logged)."""

    def __init__(self, model: torch.nn.Module, block_weights: dict) -> None:
        self.model, self.block_weights = model, block_weights
        self.pending: dict[str, list[tuple[torch.Tensor, BlockTensor]]] = {}
        self.placed: dict[str, int] = {}

    def place(self, name: str, rows: torch.Tensor | None, value: torch.Tensor | BlockTensor) -> None:
        """`value` is rows `rows` of parameter `name` (None: all of it)."""
        param = self.model.get_parameter(name)
        if rows is None:
            rows = torch.arange(param.shape[0])
        if isinstance(value, BlockTensor):
            self.pending.setdefault(name, []).append((rows, value))
        else:
            param.data[rows] = value.reshape(len(rows), *param.shape[1:]).to(param.dtype)
        self.placed[name] = self.placed.get(name, 0) + len(rows)
        if self.placed[name] == param.shape[0] and name in self.pending:
            self._join(name, param)

    def _join(self, name: str, param: torch.Tensor) -> None:
        parts = sorted(self.pending.pop(name), key=lambda p: int(p[0][0]))
        if sum(len(r) for r, _ in parts) != param.shape[0]:  # some rows came as float: all float
            self._dequantize(name, param, parts)
            return
        order = torch.cat([r for r, _ in parts])
        if torch.equal(order, torch.arange(param.shape[0])):
            self.block_weights[name] = stack_rows([b for _, b in parts])
        elif len({(b.qtype, b.blocks.shape[1:]) for _, b in parts}) == 1:
            blocks = torch.empty(param.shape[0], *parts[0][1].blocks.shape[1:], dtype=torch.uint8)
            for rows, b in parts:
                blocks[rows] = b.blocks
            self.block_weights[name] = BlockTensor(parts[0][1].qtype, blocks)
        else:
            self._dequantize(name, param, parts)

    def _dequantize(self, name: str, param: torch.Tensor, parts: list[tuple[torch.Tensor, BlockTensor]]) -> None:
        formats = sorted({b.qtype for _, b in parts})
        logger.info("%s: parts in %s interleaved with others; kept as float32", name, "/".join(formats))
        for rows, b in parts:
            param.data[rows] = b.dequantize().to(param.dtype)

    def finish(self) -> None:
        """After the last tensor: parts whose other rows came as float are dequantized."""
        for name in list(self.pending):
            self._dequantize(name, self.model.get_parameter(name), self.pending.pop(name))
