"""Baton's compiled CPU ops, built once per machine by torch's extension builder (the system's c++;
ninja from PATH or the `ninja` wheel) and cached under ~/.cache/baton/ops: a later import loads
the cached library in well under a second, without running ninja.

A cache directory is named by everything the library depends on: the sources, torch, Python, the
compiler, and the CPU's instruction set (the library is built with -march=native, so a cache copied
to a CPU without those instructions must rebuild, not die of SIGILL). A build runs in a private
temporary directory renamed into place once complete, so a cache directory holds a whole library or
does not exist, and processes building at once never see each other's half-built files."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import secrets
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch

NAME = "baton_ops"
LIB = f"{NAME}.so"
# Compiled as five translation units: the bindings and unity_*.cpp, which include the other sources
# (torch's headers parsed five times, not twenty: a cold build takes about half as long).
SOURCES = [Path(__file__).with_name(f) for f in ("bindings.cpp", *(f"unity_{x}.cpp" for x in "abcd"))]
# -march=native: the library is built on the machine that runs it (AVX-512 where the CPU has it)
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fopenmp-simd")
LDFLAGS = ("-fopenmp",)


class OpsBuildError(RuntimeError):
    pass


@functools.cache
def ops() -> ModuleType:
    """The compiled ops: loaded from this machine's cache directory, built there first if it has none."""
    final = build_dir()
    if (final / LIB).is_file():
        try:
            return _load(final / LIB)
        except (ImportError, OSError):  # a damaged copy: build afresh in its place
            _remove(final)
    return _build(final)


def build_dir() -> Path:
    """This machine's cache directory of the ops."""
    root = Path(os.path.expanduser("~/.cache/baton/ops"))
    return root / cache_key(_cpu_flags(), _compiler_version(), platform.machine())


def cache_key(cpu_flags: str, compiler: str, machine: str) -> str:
    """The cache directory's name for these sources built by `compiler` (its --version) for a CPU
    of architecture `machine` with instruction-set `cpu_flags` (/proc/cpuinfo's flags)."""
    h = hashlib.sha256()
    flags = " ".join(sorted(cpu_flags.split()))
    for part in (torch.__version__, sys.implementation.cache_tag, machine, compiler, flags, *CFLAGS, *LDFLAGS):
        h.update(part.encode() + b"\0")
    for p in sorted(Path(__file__).parent.glob("*.[ch]*")):  # headers too, which torch's builder does not hash
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return f"torch-{torch.__version__}-{h.hexdigest()[:16]}"


def _cpu_flags() -> str:
    """The CPU's instruction-set flags: the `flags` line of /proc/cpuinfo (`Features` on ARM)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor()


def _compiler_version() -> str:
    """`--version` of the compiler torch's builder runs ($CXX, else c++); empty where there is none."""
    try:
        cxx = shlex.split(os.environ.get("CXX", "c++"))
        return subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, ValueError, subprocess.SubprocessError):
        return ""


def _load(lib: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, lib)
    if spec is None or spec.loader is None:
        raise ImportError(f"{lib} is not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(final: Path) -> ModuleType:
    """Builds into a temporary directory beside `final` and renames it into place; where another
    process's build got there first, this one is dropped (its module stays loaded)."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # torch's builder runs `ninja` from PATH: use the pip wheel's
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        module = cpp_extension.load(
            name=NAME,
            sources=[str(s) for s in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),  # copies: torch's builder appends to the list it is given
            build_directory=str(tmp),
            verbose=False,
        )
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed or interrupted build leaves nothing behind
        if isinstance(e, (RuntimeError, OSError, ImportError)):
            raise OpsBuildError(
                f"building baton's CPU ops failed (needs a C++ compiler, c++ or $CXX, and ninja on PATH): {e}"
            ) from e
        raise
    # a retried build in the same process is named baton_ops_v1 by torch: used, never published
    if (tmp / LIB).is_file():
        for _ in range(2):
            try:
                os.rename(tmp, final)  # atomic; fails where final is a non-empty directory
                return module
            except OSError:
                if (final / LIB).is_file():  # another process's build won
                    break
                _remove(final)  # a directory without a library (an interrupted copy): replace it
    shutil.rmtree(tmp, ignore_errors=True)
    return module


def _remove(path: Path) -> None:
    """Removes a cache directory another process may be reading or replacing: renamed aside first,
    so `path` itself is gone at once and never half deleted."""
    aside = path.with_name(f"{path.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.rename(path, aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_offset: torch.Tensor,
    kv_len: torch.Tensor,
    block_size: int,
    scale: float,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    row_seq: torch.Tensor | None = None,
) -> torch.Tensor:
    """[rows, heads, dim] attention of each query row over positions [kv_offset, kv_offset + kv_len)
    of the blocks block_table row row_seq[row] lists (row `row` without row_seq: one decode per
    table row), read in place. A row's bits do not depend on the other rows of the call. An fp8
    cache comes with its K and V scales, [blocks, kv heads] each."""
    k_scale, v_scale = kv_scales or (None, None)
    return ops().paged_attention(
        q, k_cache, v_cache, block_table, kv_offset, kv_len, block_size, scale, k_scale, v_scale, row_seq
    )


def write_kv_fp8(
    x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, block_size: int, fresh: bool
) -> None:
    """x [tokens, heads, dim] into an fp8 cache [slots, heads, dim] whose scales [blocks, heads] are
    powers of two: a run starting a block (or any run, when `fresh`) sets the block's scale, a later
    run raises it if needed and rescales the rows already there (baton/ops/fp8_kv.h)."""
    ops().write_kv_fp8(x, cache, scales, slots, block_size, fresh)


def read_kv_fp8(cache: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """The rows of an fp8 cache at `slots`, as float32 [n, heads, dim]."""
    return ops().read_kv_fp8(cache, scales, slots, block_size)


def panel_lanes() -> int:
    """Output features per panel of a packed weight."""
    return ops().PANEL_LANES


def pack_weight_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 -> [ceil(N / 16), K, 16] column panels for `packed_linear`."""
    return ops().pack_weight_panels(weight)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [rows, K] @ W^T (+ bias) over a weight packed by `pack_weight_panels` (float32) or kept in
    GGUF blocks (uint8 [N, blocks, block bytes]); a row's result does not depend on the other rows."""
    return ops().packed_linear(x, packed, bias, out_features)


def dequantize_rows(blocks: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float32 [len(ids), K]: rows `ids` of a weight in GGUF blocks."""
    return ops().dequantize_rows(blocks, ids)


def quant_block_values(blocks: torch.Tensor) -> int:
    """Values per block (32 or 256) of a weight in GGUF blocks; the block's bytes name its format."""
    return ops().quant_block_values(blocks)


def regroup_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF blocks [N, blocks, bytes] regrouped for the integer kernels: [ceil(N / 8), blocks, 8, bytes]."""
    return ops().regroup_blocks(blocks)


def set_quant_kernel(name: str) -> str:
    """The kernel of this process's GGUF-block linears: float (dequantized in registers, float32
    multiply-adds), int8 (x quantized per block, integer dot products on the best instruction set
    the CPU has) or int8-avx512_vnni / int8-avx_vnni / int8-avx2; one the CPU lacks raises.
    Returns the kernel in use."""
    return ops().set_quant_kernel(name)


def quant_kernel() -> str:
    """The kernel the GGUF-block linears use now."""
    return ops().quant_kernel()


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


def pointwise(x: torch.Tensor, op: str) -> torch.Tensor:
    """silu, sigmoid or softplus (beta 1, threshold 20) of x. In float32 every element goes through
    the vector function, so its bits are its value's alone: torch's own kernels take a tensor's
    tail element by element through libm, which makes a row's bits depend on its batch."""
    if x.dtype == torch.float32:
        return ops().pointwise(x, op)
    return {"silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid, "softplus": torch.nn.functional.softplus}[op](x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return pointwise(x, "silu")


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return pointwise(x, "sigmoid")


def softplus(x: torch.Tensor) -> torch.Tensor:
    return pointwise(x, "softplus")


def row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T with every output one dot product in a fixed order, whatever the row count (torch's
    linear picks its blocking by it): x [T, K], W [N, K]; or per head x [T, H, K], W [H, N, K].
    float32, for the small products the packed linears do not hold (routers, MLA's absorbed heads)."""
    if x.dtype != torch.float32:
        return torch.einsum("thk,hnk->thn", x, weight) if x.dim() == 3 else torch.nn.functional.linear(x, weight)
    return ops().row_linear(x, weight.contiguous())


def hc_weights(
    mixed: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A hyper-connection's (pre [T, n], post [T, n], comb [T, n, n]) from its mixing projection
    [T, (2 + n) n]: sigmoids, a softmax and `iters` Sinkhorn passes (float32)."""
    pre, post, comb = ops().hc_weights(mixed, base, scale, n, iters, eps)
    return pre, post, comb


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits[rows[i], t] = -inf wherever bit t of bitmask[i] is clear (int32 words, a bit per token)."""
    ops().apply_token_bitmask_(logits, rows, bitmask)


def empty_huge_pages(nbytes: int) -> torch.Tensor:
    """`nbytes` uninitialized bytes (uint8) on transparent huge pages where the kernel grants them."""
    return ops().empty_huge_pages(nbytes)


def zeros_on_demand(nbytes: int, huge_pages: bool = True) -> torch.Tensor:
    """`nbytes` zero bytes (uint8), resident only once touched: the kernel's zero pages, so a large
    pool costs memory as it fills; on transparent huge pages where granted if `huge_pages`."""
    return ops().zeros_on_demand(nbytes, huge_pages)


def recurrent_scan_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor | None,
    state: torch.Tensor,
) -> torch.Tensor:
    """The recurrent-state scan of Gated DeltaNet, Kimi Delta Attention and Mamba2's SSM over T
    tokens of H heads: returns out [T, H, Dv] and updates state [H, Dk, Dv] in place. Per head
    and token t, in order:

        S = S * exp(decay[t])                  # decay [T, H] per head, or [T, H, Dk] per row of S
        if beta is None: S = S + outer(k[t], v[t])
        else:            S = S + outer(k[t], (v[t] - k[t] @ S) * beta[t])   # beta [T, H]
        out[t] = q[t] @ S

    q, k [T, H, Dk] come already normalized and scaled. All tensors contiguous float32 on the
    CPU; state shares no memory with the inputs. A token's result (and the state after it) is
    bitwise the same however the sequence is cut into calls; T = 0 leaves state as it is."""
    return ops().recurrent_scan_(q, k, v, decay, beta, state)
