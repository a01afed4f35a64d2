"""The GGUF-block linears of a ~1.1B Llama (hidden 2048, 16 layers, 32 / 8 heads, MLP 8192, vocab
49152), float kernel against int8 kernel, beside the bytes-read floor.

    python -m bench.quant_kernels [--formats Q4_K Q4_0 Q8_0] [--rows 1 8 128] [--repeats 5]

One layer's projections (qkv 3072 x 2048, o 2048 x 2048, gate_up 16384 x 2048, down 2048 x 8192)
in the format, the lm_head (49152 x 2048) in Q6_K, as a Q4_K_M file has it; random blocks (their
timing does not depend on the values), a tensor of its own per layer. Prints, per format and row
count, the milliseconds of one token's linears (16 layers + lm_head, median of --repeats), the
rate the weights stream at, the floor (the weights' bytes at limits.py's large-read rate) and
the ratios int8 / float and int8 / floor; then, per format, the rate torch's `sum` reads the same
buffers at (the int8 layout viewed as float32, in the same order): what "at the read rate" means
for these tensors, which read slower than limits.py's one 1 GiB buffer. CPU and kernels are
printed first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from baton.models.gguf_blocks import BLOCK_FORMATS, BlockTensor
from baton.ops import packed_linear, set_quant_kernel
from bench.limits import read_gbs

LAYERS = 16
SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
LM_HEAD = (49152, 2048)


def blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    values, nbytes = BLOCK_FORMATS[qtype]
    raw = rng.integers(0, 256, (n, k // values, nbytes), dtype=np.uint8)
    scale = np.full((n, k // values, 1), 1e-3, dtype=np.float16).view(np.uint8)
    at = 208 if qtype == "Q6_K" else 0
    raw[..., at : at + 2] = scale
    if qtype in ("Q4_K", "Q5_K", "Q4_1", "Q5_1"):
        raw[..., 2:4] = scale
    return torch.from_numpy(raw)


def int8_weight(qtype: str, shipped: torch.Tensor) -> torch.Tensor:
    """The blocks as loading lays them out for the integer kernels: regrouped, K in its parts."""
    t = BlockTensor(qtype, shipped)
    t.regroup()
    return t.kernel_weight()


def token_ms(weights: list[tuple[torch.Tensor, int, int]], rows: int, repeats: int) -> float:
    xs = {k: torch.randn(rows, k) for _, _, k in weights}
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for w, n, k in weights:
            packed_linear(xs[k], w, None, n)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def read_ms(weights: list[tuple[torch.Tensor, int, int]], repeats: int) -> float:
    """Milliseconds torch's sum takes over the weights' bytes, in order (median of `repeats`)."""
    views = [w.reshape(-1).view(torch.float32) for w, _, _ in weights]
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for v in views:
            v.sum()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", nargs="+", default=["Q4_K", "Q4_0", "Q8_0"], choices=list(BLOCK_FORMATS))
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 128])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"CPU: {cpu}, {torch.get_num_threads()} threads; int8 kernel: {set_quant_kernel('int8')}")
    rate = read_gbs()
    print(f"large read: {rate:.1f} GB/s")
    rng = np.random.default_rng(0)
    head = blocks("Q6_K", *LM_HEAD, rng)
    heads = ("format", "rows", "float ms", "int8 ms", "int8/float", "GB/s", "floor ms", "int8/floor")
    print(" ".join(f"{h:>{w}}" for h, w in zip(heads, (6, 5, 9, 8, 10, 6, 8, 10))))
    for qtype in args.formats:
        # a tensor of its own per layer, as in a model: one layer's set would stay in L3
        weights = [(blocks(qtype, n, k, rng), n, k) for _ in range(LAYERS) for n, k in SHAPES.values()]
        weights.append((head, *LM_HEAD))
        nbytes = sum(w.numel() for w, _, _ in weights)
        layouts = {"float": weights, "int8": [(int8_weight(qtype, w), n, k) for w, n, k in weights]}
        for rows in args.rows:
            ms = {}
            for kernel in ("float", "int8"):
                set_quant_kernel(kernel)
                ms[kernel] = token_ms(layouts[kernel], rows, args.repeats)
            floor = nbytes / rate / 1e6
            print(
                f"{qtype:<6} {rows:>5} {ms['float']:>9.1f} {ms['int8']:>8.1f} {ms['int8'] / ms['float']:>10.2f} "
                f"{nbytes / ms['int8'] / 1e6:>6.1f} {floor:>8.1f} {ms['int8'] / floor:>10.2f}"
            )
        same = read_ms(layouts["int8"], args.repeats)
        print(f"{qtype:<6} torch sum over the same buffers: {same:.1f} ms, {nbytes / same / 1e6:.1f} GB/s")
    set_quant_kernel("int8")


if __name__ == "__main__":
    main()
