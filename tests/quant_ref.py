"""The activation quantization baton's integer GGUF kernels promise (baton/ops/quant_linear.cpp),
written from that contract in numpy (quantized_x), all in float32."""

from __future__ import annotations

import numpy as np
import torch


def quantized_x(x: torch.Tensor, per: int) -> np.ndarray:
    """x [..., K] as the kernels see it, in float64: codes times their block's scale. Per 32 values
    d = max |x| / 127; per 256 (the K formats, llama.cpp's Q8_K) the value of largest |x| gets code
    -128, d = 1 / (-128 / that value), and the codes stop at 127."""
    xb = x.detach().numpy().astype(np.float32).reshape(-1, x.shape[-1] // per, per)
    if per == 32:
        d = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
        inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), np.float32(0)).astype(np.float32)
    else:
        vmax = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)
        inv = np.where(vmax != 0, np.float32(-128) / np.where(vmax != 0, vmax, 1), np.float32(0)).astype(np.float32)
        d = np.where(inv != 0, np.float32(1) / np.where(inv != 0, inv, 1), np.float32(0)).astype(np.float32)
    q = np.minimum(np.rint(xb * inv), 127)
    assert np.abs(q).max() <= 128
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


def quantize_inputs(module: torch.nn.Module, per: int) -> None:
    """A transformers linear that, from now on, reads its input quantized as the kernels do."""

    def hook(_module, args):
        return (torch.from_numpy(quantized_x(args[0], per)).to(args[0].dtype),)

    module.register_forward_pre_hook(hook)
