"""The physical limits of this machine for each serving workload, from two measurements:
a large float32 matmul (GFLOP/s) and a large copy (GB/s).

    python -m bench.limits [--model smollm2-135m] [--threads 2]

Per workload it prints the floor on median TPOT at concurrency 1 (every weight read once per
token, plus the KV read), the ceiling on output tokens/s (every token's matmul FLOPs at the
measured rate, prefill included, since the same cores do both), and the floor on TTFT for a
long prompt (its FLOPs, attention included). Measured figures can then be read as a fraction
of these. Activations, norms and Python are ignored: the floors are optimistic.

bench/peers.py uses `read_gbs`, `decode_weight_bytes` and `kv_read_bytes` for its floors.
"""

from __future__ import annotations

import argparse
import time

import gguf
import torch

from baton.config import EnvSettings
from baton.models.loader import load_model
from baton.models.model_config import TextModelConfig


def best_of(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_gflops(n: int = 4096) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / best_of(lambda: a @ b) / 1e9


def copy_gbs(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes // 4).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / best_of(lambda: dst.copy_(src)) / 1e9  # read + write


def read_gbs(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes // 4).normal_()
    return nbytes / best_of(lambda: src.sum()) / 1e9


def decode_weight_bytes(reader: gguf.GGUFReader) -> tuple[int, int]:
    """Bytes of weights one decode step reads from a GGUF file's matrices, as stored (quantized or
    not) and as float32: every matrix but the token embedding, a lookup, which is read whole as the
    lm_head when the file has no separate output matrix (tied embeddings)."""
    names = {t.name for t in reader.tensors}
    matrices = [t for t in reader.tensors if len(t.shape) >= 2]
    read = [t for t in matrices if t.name != "token_embd.weight" or "output.weight" not in names]
    return sum(int(t.n_bytes) for t in read), sum(4 * int(t.n_elements) for t in read)


def kv_read_bytes(cfg: TextModelConfig, ctx: int, dtype_bytes: int = 4) -> int:
    """K and V of `ctx` positions in every layer: a full-attention layer holds them all, a sliding
    one at most its window."""
    per_position = 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    return per_position * sum(min(ctx, k.window) if k.is_sliding else ctx for k in cfg.layer_kinds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    flops = matmul_gflops() * 1e9
    read = read_gbs() * 1e9
    copy = copy_gbs() * 1e9
    print(f"float32 matmul 4096^2: {flops / 1e9:.1f} GFLOP/s; read {read / 1e9:.1f} GB/s; copy {copy / 1e9:.1f} GB/s")

    loaded = load_model(args.model, torch.float32, EnvSettings.read().cache_dir, progress=False)
    cfg, model = loaded.config, loaded.model
    total = sum(p.numel() for p in model.parameters())
    embed = model.embed_tokens.weight.numel()
    head = embed if cfg.tie_word_embeddings else model.lm_head.weight.numel()
    body = total - embed - (0 if cfg.tie_word_embeddings else head)
    weight_bytes = 4 * (body + head)  # what a decode step reads: the embedding is a lookup
    full = [k for k in cfg.layer_kinds if not k.is_sliding]
    windows = [k.window for k in cfg.layer_kinds if k.is_sliding]

    def attn_flops(q: int, ctx: int) -> float:  # QK^T and PV per query, over the context it sees
        return 4 * cfg.num_heads * cfg.head_dim * (len(full) * ctx + sum(min(ctx, w) for w in windows)) * q

    print(
        f"{args.model}: {body / 1e6:.1f} M body + {head / 1e6:.1f} M lm_head parameters; "
        f"decode reads {weight_bytes / 1e6:.0f} MB of weights per step"
    )
    print(f"{'workload':<22}{'floor':>42}")
    for name, n, inp, out, conc in [
        ("128in/64out c1", 32, 128, 64, 1),
        ("128in/64out c8", 32, 128, 64, 8),
        ("128in/128out c32", 64, 128, 128, 32),
        ("2000in/32out c1", 8, 2000, 32, 1),
        ("8000in/1out c1", 1, 8000, 1, 1),
    ]:
        mid = inp + out // 2
        # one decode step for `conc` sequences: weights once, each sequence's KV, the larger of bytes and FLOPs
        step = max(
            (weight_bytes + conc * kv_read_bytes(cfg, mid)) / read,
            conc * (2 * (body + head) + attn_flops(1, mid)) / flops,
        )
        prefill_flops = inp * 2 * body + 2 * head + attn_flops(inp, inp) / 2
        decode_flops = (out - 1) * (2 * (body + head) + attn_flops(1, mid))
        work = n * (prefill_flops + decode_flops) / flops  # all the FLOPs of the run, on all cores
        steps = n / conc * (out - 1) * step  # every decode step at least `step`
        ceiling = n * out / max(work, steps)
        ttft = prefill_flops / flops
        print(f"{name:<22}TPOT >= {step * 1e3:6.1f} ms, output <= {ceiling:6.1f} tok/s, TTFT >= {ttft * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
