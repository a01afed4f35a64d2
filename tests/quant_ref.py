"""The activation quantization baton's integer GGUF kernels promise (baton/ops/quant_linear.cpp),
written from that contract in numpy: per block of `per` values (32, or 256 for the K formats),
d = max|x| / 127 and codes round(x * (1 / d)) to nearest even, all in float32."""

from __future__ import annotations

import numpy as np
import torch


def quantized_x(x: torch.Tensor, per: int) -> np.ndarray:
    """x [..., K] as the kernels see it, in float64: codes times their block's scale."""
    xb = x.detach().numpy().astype(np.float32).reshape(-1, x.shape[-1] // per, per)
    d = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv)
    assert np.abs(q).max() <= 127
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


def quantize_inputs(module: torch.nn.Module, per: int) -> None:
    """A transformers linear that, from now on, reads its input quantized as the kernels do."""

    def hook(_module, args):
        return (torch.from_numpy(quantized_x(args[0], per)).to(args[0].dtype),)

    module.register_forward_pre_hook(hook)
