"""A model's parameters as the checkpoint tensors they are made of: each parameter names its parts
(checkpoint name, first row, shape), and loading copies each part into its rows. Families whose
checkpoints split what baton fuses (KDA's in_proj and conv, gate | up) share it."""

from __future__ import annotations

import torch

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

    def load_weight(self, hf_name: str, tensor: torch.Tensor) -> None:
        name, start, shape = self._weights()[self._checkpoint_name(hf_name)]
        param = self.get_parameter(name).data  # type: ignore[attr-defined]
        dst = param if start is None else param[start : start + shape[0]]
        dst.copy_(tensor.reshape(dst.shape))
