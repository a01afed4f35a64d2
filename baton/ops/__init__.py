"""Baton's compiled CPU ops, built once per machine by torch's extension builder (the system's g++;
ninja from PATH or the `ninja` wheel) and cached under ~/.cache/baton/ops: a later import loads
the cached library in well under a second."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

SOURCES = [
    Path(__file__).with_name(f)
    for f in ("bindings.cpp", "paged_attention.cpp", "linear.cpp", "pointwise.cpp", "decode.cpp")
]
# -march=native: the library is built on the machine that runs it (AVX-512 where the CPU has it)
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fopenmp-simd"]


class OpsBuildError(RuntimeError):
    pass


@functools.cache
def ops() -> ModuleType:
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # torch's builder runs `ninja` from PATH: use the pip wheel's
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    # one build per source state (headers included, which torch's builder does not hash)
    digest = hashlib.sha1(b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.glob("*.[ch]*")))).hexdigest()
    build_dir = Path(os.path.expanduser("~/.cache/baton/ops")) / f"torch-{torch.__version__}-{digest[:12]}"
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(
            name="baton_ops",
            sources=[str(s) for s in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as e:
        raise OpsBuildError(
            f"building baton's CPU ops failed (needs g++ and ninja on PATH): {e}; build dir {build_dir}"
        ) from e


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_offset: torch.Tensor,
    kv_len: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """[seqs, heads, dim] attention of one query token per sequence over positions
    [kv_offset, kv_offset + kv_len) of the blocks its block_table row lists, read in place."""
    return ops().paged_decode_attention(q, k_cache, v_cache, block_table, kv_offset, kv_len, block_size, scale)


def panel_lanes() -> int:
    """Output features per panel of a packed weight."""
    return ops().PANEL_LANES


def pack_weight_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 -> [ceil(N / 16), K, 16] column panels for `panel_linear`."""
    return ops().pack_weight_panels(weight)


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [rows, K] @ W^T (+ bias) over a weight packed by `pack_weight_panels`; a row's result
    does not depend on the other rows."""
    return ops().panel_linear(x, panels, bias, out_features)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * (offset + weight) over float32 rows [T, D]; with `residual`,
    residual += x first (in place) and the sum is normalized."""
    return ops().rms_norm(x, residual, weight, eps, offset)


def rms_norm_heads_(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> None:
    """RMS norm of every head of x [T, heads, D] in place (q/k norm)."""
    ops().rms_norm_heads_(x, weight, eps, offset)


def rotary_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """x [T, heads, D] = x * cos + rotate_half(x) * sin in place; cos and sin [T, D], the sign of
    rotate_half folded into sin's first half."""
    ops().rotary_(x, cos, signed_sin)


def gated_act(gate_up: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> act(gate) * up, act silu or tanh-approximated gelu."""
    return ops().gated_act(gate_up, gelu_tanh)


def empty_huge_pages(nbytes: int) -> torch.Tensor:
    """`nbytes` uninitialized bytes (uint8) on transparent huge pages where the kernel grants them."""
    return ops().empty_huge_pages(nbytes)
