"""Quantize float weight matrices into GGML block formats (byte layouts as in ggml / gguf-py).

Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 go through ``gguf.quants.quantize``; Q4_K, Q5_K and Q6_K, which gguf-py
can only dequantize, are quantized here with vectorized numpy: per-sub-block scale (and min) from a small
search with least-squares refits, 6-bit (int8 for Q6_K) scales against an fp16 super-block scale, then q
re-rounded against the quantized scales.  This is simpler than llama.cpp's quantizer, so bytes differ from it.
The result of ``quantize_matrix`` reads back with ``gguf.quants.dequantize(result, qtype)``.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

QUANT_TYPES: dict[str, QT] = {
    "q8_0": QT.Q8_0,
    "q4_0": QT.Q4_0,
    "q4_1": QT.Q4_1,
    "q5_0": QT.Q5_0,
    "q5_1": QT.Q5_1,
    "q4_k": QT.Q4_K,
    "q5_k": QT.Q5_K,
    "q6_k": QT.Q6_K,
}

_FP16_MAX = float(np.finfo(np.float16).max)  # 65504

# Range of w each format can represent with finite fp16 scales; inputs are clipped to it so that no stored
# scale overflows to inf.  (Q4_1/Q5_1 store the block minimum itself as fp16; Q4_K/Q5_K subtract dmin*m >= 0.)
_INPUT_RANGE: dict[QT, tuple[float, float]] = {
    QT.Q8_0: (-_FP16_MAX * 127, _FP16_MAX * 127),
    QT.Q4_0: (-_FP16_MAX * 8, _FP16_MAX * 8),
    QT.Q5_0: (-_FP16_MAX * 16, _FP16_MAX * 16),
    QT.Q4_1: (-_FP16_MAX, _FP16_MAX),
    QT.Q5_1: (-_FP16_MAX, _FP16_MAX),
    QT.Q4_K: (-_FP16_MAX * 63, _FP16_MAX * 63 * 15),
    QT.Q5_K: (-_FP16_MAX * 63, _FP16_MAX * 63 * 31),
    QT.Q6_K: (-_FP16_MAX * 128 * 32, _FP16_MAX * 128 * 32),
}
_FP16_TINY = np.float32(2.0**-24)  # smallest fp16 subnormal


def _qtype(qtype: str | QT) -> QT:
    if isinstance(qtype, str):
        try:
            return QUANT_TYPES[qtype.lower()]
        except KeyError:
            raise ValueError(f"unsupported quant type {qtype!r}; expected one of {sorted(QUANT_TYPES)}") from None
    qt = QT(qtype)
    if qt not in QUANT_TYPES.values():
        raise ValueError(f"unsupported quant type {qt.name}")
    return qt


def block_shape(qtype: str | QT) -> tuple[int, int]:
    """(values per block, bytes per block) of ``qtype``."""
    block, size = gguf.GGML_QUANT_SIZES[_qtype(qtype)]
    return int(block), int(size)


def can_quantize(qtype: str | QT, in_features: int) -> bool:
    """Whether a row of ``in_features`` values splits into whole blocks of ``qtype``."""
    return in_features > 0 and in_features % block_shape(qtype)[0] == 0


def _fp16_scale(x: np.ndarray) -> np.ndarray:
    """Round a super-block scale to fp16, clamped to its finite range and kept nonzero where x is."""
    d = np.clip(x, -_FP16_MAX, _FP16_MAX).astype(np.float16).astype(np.float32)
    return np.where((d == 0) & (x != 0), np.copysign(_FP16_TINY, x), d)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b with 0 where b == 0."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.where(b == 0, np.float32(0), a / np.where(b == 0, np.float32(1), b)).astype(np.float32)


def _pack_scale_min_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and 8 six-bit mins per block into ggml's 12 bytes (inverse of get_scale_min_k4)."""
    sc = sc.astype(np.uint8)
    mn = mn.astype(np.uint8)
    b0 = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    b1 = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    b2 = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([b0, b1, b2], axis=1)


# Candidate inverse-scale offsets tried per sub-block (as in ggml's make_qkx2_quants / make_qx_quants);
# each candidate's rounding is followed by a least-squares fit of scale (and min), the best error wins.
_KX_STEPS = np.arange(-10, 11, dtype=np.float32) * np.float32(0.1)  # Q4_K / Q5_K: nmax - 1 .. nmax + 1
_Q6_STEPS = np.arange(-40, 11, 2, dtype=np.float32) * np.float32(0.1)  # Q6_K: 32 - 4 .. 32 + 1


def _fit_scale_min(xs: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block (last axis) scale >= 0 and min >= 0 with xs ~= scale * q - min, q in [0, nmax]."""
    n = xs.shape[-1]
    lo = np.minimum(xs.min(axis=-1), 0)  # ggml keeps the offset non-positive: min >= 0
    span = xs.max(axis=-1) - lo  # >= 0
    sx = xs.sum(axis=-1)
    best_a = span / np.float32(nmax)
    best_b = lo
    q = np.clip(np.rint(_div(xs - lo[..., None], best_a[..., None])), 0, nmax)
    best_err = np.square(best_a[..., None] * q + lo[..., None] - xs).sum(axis=-1)
    for step in _KX_STEPS:
        q = np.clip(np.rint((xs - lo[..., None]) * _div(np.float32(nmax) + step, span)[..., None]), 0, nmax)
        sq = q.sum(axis=-1)
        sqq = np.square(q).sum(axis=-1)
        sqx = (q * xs).sum(axis=-1)
        a = _div(n * sqx - sq * sx, n * sqq - sq * sq)
        b = (sx - a * sq) / n
        pos = b > 0  # offset must stay non-positive: refit the scale alone
        a = np.where(pos, _div(sqx, sqq), a)
        b = np.where(pos, np.float32(0), b)
        err = np.square(a[..., None] * q + b[..., None] - xs).sum(axis=-1)
        better = (err < best_err) & (a > 0)
        best_err = np.where(better, err, best_err)
        best_a = np.where(better, a, best_a)
        best_b = np.where(better, b, best_b)
    return best_a, -best_b


def _quantize_k_scale_min(x: np.ndarray, nmax: int) -> tuple[np.ndarray, ...]:
    """Shared Q4_K/Q5_K quantization of blocks ``x`` [B, 256]: w ~= d*sc*q - dmin*m.

    Returns (d, dmin) as fp16 bytes [B, 2] each, 6-bit sc and m [B, 8] and q [B, 8, 32] in [0, nmax].
    """
    n = x.shape[0]
    xs = x.reshape(n, 8, 32)
    scale, the_min = _fit_scale_min(xs, nmax)

    # Super-block scales so that the largest sub-block scale / min map to 63.
    d = _fp16_scale(scale.max(axis=1, keepdims=True) / 63)
    dmin = _fp16_scale(the_min.max(axis=1, keepdims=True) / 63)
    # 6-bit sc and m: of floor/ceil of each, keep the pair whose re-rounded q fit the sub-block best (a scale
    # rounded down can no longer cover the sub-block's range, which costs much more than its rounding error).
    sc_f = np.floor(_div(scale, d))
    m_f = np.floor(_div(the_min, dmin))
    best_err = np.square(xs).sum(axis=2)  # all-zero sub-block (sc = m = 0) as the fallback
    sc = np.zeros_like(sc_f)
    m = np.zeros_like(m_f)
    q = np.zeros_like(xs)
    for dsc, dm_ in ((0, 0), (1, 0), (0, 1), (1, 1)):
        sc_c = np.clip(sc_f + dsc, 0, 63)
        m_c = np.clip(m_f + dm_, 0, 63)
        ds = (d * sc_c)[:, :, None]
        dm = (dmin * m_c)[:, :, None]
        q_c = np.clip(np.rint(_div(xs + dm, ds)), 0, nmax)
        err = np.square(ds * q_c - dm - xs).sum(axis=2)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        sc = np.where(better, sc_c, sc)
        m = np.where(better, m_c, m)
        q = np.where(better[..., None], q_c, q)
    q = q.astype(np.uint8)
    d16 = d.astype(np.float16).view(np.uint8)
    dmin16 = dmin.astype(np.float16).view(np.uint8)
    return d16, dmin16, sc.astype(np.uint8), m.astype(np.uint8), q


def _quantize_q4_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    d, dmin, sc, m, q = _quantize_k_scale_min(x, 15)
    q = q.reshape(n, 4, 2, 32)  # sub-block 2i: low nibbles of qs[32i:32i+32], 2i+1: high nibbles
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([d, dmin, _pack_scale_min_k4(sc, m), qs], axis=1)


def _quantize_q5_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    d, dmin, sc, m, q = _quantize_k_scale_min(x, 31)
    # qh[l] bit j = bit 4 of sub-block j's value l
    hi = ((q >> 4) & 1).astype(np.uint8)  # [B, 8, 32]
    qh = np.zeros((n, 32), dtype=np.uint8)
    for j in range(8):
        qh |= hi[:, j] << j
    lo = (q & 0x0F).reshape(n, 4, 2, 32)
    qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([d, dmin, _pack_scale_min_k4(sc, m), qh, qs], axis=1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K: w ~= d*sc*q, q in [-32, 31] per 16 values, sc int8, layout ql[128] qh[64] scales[16] d."""
    n = x.shape[0]
    xs = x.reshape(n, 16, 16)
    # Start from the signed extreme of each sub-block mapped to -32 (the longer side of [-32, 31]), as ggml
    # does, then try slightly different inverse scales, each with a least-squares scale for its rounding.
    imax = np.abs(xs).argmax(axis=2)[:, :, None]
    ext = np.take_along_axis(xs, imax, axis=2)[:, :, 0]
    scale = ext / np.float32(-32)  # [B, 16], signed
    q = np.clip(np.rint(_div(xs, scale[..., None])), -32, 31)
    best_err = np.square(scale[..., None] * q - xs).sum(axis=2)
    for step in _Q6_STEPS:
        q = np.clip(np.rint(xs * _div(-(np.float32(32) + step), ext)[..., None]), -32, 31)
        s = _div((q * xs).sum(axis=2), np.square(q).sum(axis=2))
        err = np.square(s[..., None] * q - xs).sum(axis=2)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        scale = np.where(better, s, scale)
    # Super-block: the sub-block scale with the largest magnitude maps to sc ~= -128.
    iext = np.abs(scale).argmax(axis=1)[:, None]
    max_scale = np.take_along_axis(scale, iext, axis=1)
    d = _fp16_scale(max_scale / -128.0)
    # int8 sc: floor or ceil, whichever re-rounded q fit the sub-block best (see _quantize_k_scale_min).
    sc_f = np.floor(_div(scale, d))
    best_err = np.square(xs).sum(axis=2)
    sc = np.zeros_like(sc_f)
    q = np.zeros_like(xs)
    for dsc in (0, 1):
        sc_c = np.clip(sc_f + dsc, -128, 127)
        ds = (d * sc_c)[:, :, None]
        q_c = np.clip(np.rint(_div(xs, ds)), -32, 31)
        err = np.square(ds * q_c - xs).sum(axis=2)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        sc = np.where(better, sc_c, sc)
        q = np.where(better[..., None], q_c, q)
    q6 = (q + 32).astype(np.uint8).reshape(n, 256)

    # value v = h*128 + r: low nibble in ql[h*64 + r%64] (nibble r//64),
    # high 2 bits in qh[h*32 + r%32] (shift 2*(r//32))
    lo = (q6 & 0x0F).reshape(n, 2, 2, 64)
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(n, 128)
    hb = (q6 >> 4).reshape(n, 2, 4, 32)
    qh = (hb[:, :, 0] | (hb[:, :, 1] << 2) | (hb[:, :, 2] << 4) | (hb[:, :, 3] << 6)).reshape(n, 64)
    scales = sc.astype(np.int8).view(np.uint8)
    return np.concatenate([ql, qh, scales, d.astype(np.float16).view(np.uint8)], axis=1)


_K_QUANTIZERS = {QT.Q4_K: _quantize_q4_k, QT.Q5_K: _quantize_q5_k, QT.Q6_K: _quantize_q6_k}


def quantize_matrix(weight: np.ndarray | torch.Tensor, qtype: str | QT) -> np.ndarray:
    """Quantize a float matrix [N, K] to uint8 [N, K // block * bytes_per_block] in ``qtype``'s ggml layout.

    Values beyond what the format can represent with finite fp16 scales are clipped; NaN/inf raise.
    """
    qt = _qtype(qtype)
    if isinstance(weight, torch.Tensor):
        weight = weight.detach().to("cpu", torch.float32).numpy()
    w = np.ascontiguousarray(weight, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D matrix, got shape {w.shape}")
    rows, cols = w.shape
    block, size = block_shape(qt)
    if not can_quantize(qt, cols):
        raise ValueError(f"in_features {cols} is not a positive multiple of the {qt.name} block size {block}")
    if not np.isfinite(w).all():
        raise ValueError("weight has NaN or inf values")
    lo, hi = (np.float32(v) for v in _INPUT_RANGE[qt])
    if w.size and (w.min() < lo or w.max() > hi):
        w = np.clip(w, lo, hi)
    if rows == 0:
        return np.zeros((0, cols // block * size), dtype=np.uint8)

    if qt in _K_QUANTIZERS:
        out = _K_QUANTIZERS[qt](w.reshape(-1, block))
    else:
        out = gguf.quants.quantize(w, qt)
    out = np.ascontiguousarray(out, dtype=np.uint8).reshape(rows, cols // block * size)
    return out
