"""Where the milliseconds of one decode step go, offline, at a given concurrency.

    python -m bench.profile_decode [--model smollm2-135m] [--concurrency 8] [--steps 40] [--modules]
        [--dtype auto|float32] [--quantization q8_0|q4_k|...] [--kv-cache-dtype fp8]

--model also takes a recurrent family's random model (bench/hybrid_models.py: qwen3-next-100m, ...).

`concurrency` requests with random 128-token prompts are prefilled, then `--steps` decode
steps are timed. Each part of `LLMEngine.step` is wrapped with a timer: scheduling, building
the batch tensors (positions, slot mappings, KV read indices), the model, the lm_head, sampling,
and the output bookkeeping (detokenizing, stop checks, RequestOutput). A decode-only step runs
the model as one C++ call (baton/models/fused_decode.py), which times its own parts: attention
(KV write and the paged kernel), the linears, and norms / rotary / activation. `--modules`
profiles the module-by-module path instead (the one steps with a prefill take), where the
attention calls are timed from Python. The HTTP share is the server's median TPOT at the same
concurrency (`baton bench serve`) minus the step time printed here.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import defaultdict

import numpy as np

import baton.engine.engine as engine_mod
import baton.models.llama as llama_mod
from baton import LLM, SamplingParams
from baton.config import EnvSettings
from bench.hybrid_models import FAMILIES, build

timers: dict[str, float] = defaultdict(float)


def timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timers[name] += time.perf_counter() - start

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--modules", action="store_true", help="profile the module-by-module path")
    ap.add_argument("--dtype", default="auto", help="auto: a GGUF file's matrices as shipped; float32: dequantized")
    ap.add_argument("--quantization", default=None, help="quantize a float checkpoint at load (q8_0, q4_k, ...)")
    ap.add_argument("--kv-cache-dtype", default=None, help="float32 (default), bfloat16, float16 or fp8")
    args = ap.parse_args()
    model_path = str(build(EnvSettings.read().cache_dir, args.model)) if args.model in FAMILIES else args.model
    llm = LLM(
        model_path,
        progress=False,
        fused_decode=not args.modules,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.concurrency,  # a big hybrid's 32 default slots of state may not fit the default budget
    )
    engine = llm.engine
    runner, model = engine.runner, engine.model

    llama_mod.paged_attention = timed("attention", llama_mod.paged_attention)
    engine_mod.sample = timed("sampling", engine_mod.sample)
    engine.scheduler.schedule = timed("scheduling", engine.scheduler.schedule)
    runner._group_metadata = timed("batch tensors", runner._group_metadata)
    model.forward = timed("model", model.forward)
    model.compute_logits = timed("lm_head", model.compute_logits)
    engine.output.append_token = timed("outputs", engine.output.append_token)
    engine._outputs = timed("outputs", engine._outputs)

    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
    for _ in range(args.concurrency):
        engine.add_request({"prompt_token_ids": rng.integers(0, vocab, args.input_len).tolist()}, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for rs in engine.requests.values() for r in rs):
        engine.step()
    for _ in range(3):  # warm up the decode path
        engine.step()
    fused = model.fused_decoder
    if fused is not None:
        fused.set_profiling(True)
    timers.clear()
    step_times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    ms = {k: v / args.steps * 1e3 for k, v in timers.items()}
    step = statistics.median(step_times) * 1e3
    mean = sum(step_times) / len(step_times) * 1e3
    if fused is not None:
        inside = {k: v / args.steps * 1e3 for k, v in fused.profile().items()}
        model_parts = {**inside, "model glue (embedding, rope, the call)": ms["model"] - sum(inside.values())}
    else:
        model_parts = {
            "attention (KV write, kernel)": ms["attention"],
            "linears, norms, rotary": ms["model"] - ms["attention"],
        }
    parts = {
        **model_parts,
        "lm_head": ms["lm_head"],
        "sampling": ms["sampling"],
        "scheduling": ms["scheduling"],
        "batch tensors": ms["batch tensors"],
        "outputs (detokenize, stops)": ms["outputs"],
    }
    parts["other (step glue)"] = mean - sum(parts.values())
    path = "fused C++ decode step" if fused is not None else "module by module"
    print(f"{args.model}, {args.concurrency} sequences decoding, context ~{args.input_len}, {args.steps} steps, {path}")
    print(f"step: median {step:.2f} ms, mean {mean:.2f} ms ({args.concurrency / mean * 1e3:.1f} tok/s)")
    for name, value in parts.items():
        print(f"  {name:<34}{value:8.2f} ms {100 * value / mean:6.1f}%")


if __name__ == "__main__":
    main()
