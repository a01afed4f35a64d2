"""A decode step's attention time at a long context on the GLM-5.3-Flash-shaped random model
(bench/hybrid_models.py: glm5-flash-100m, index_topk 1,024, index_kpool 16): its MLA layers with
the pooled indexer (scoring, selection and the attention over what it selects) against the same
layers with the indexer off (dense MLA over every position), same prompt, same cache. Measured
both in the one-call decode step (its profile's attention part: selection and the absorbed
attention of every MLA layer) and module by module (the MLA layers' forward, projections included).

    python -m bench.dsa_attention [--context 16384] [--steps 16]

Prints milliseconds per decode step both ways and sparse / dense; the floor the issue sets is 0.25."""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from baton import LLM, SamplingParams
from baton.config import EnvSettings
from baton.models.mla import MLAttention
from bench.hybrid_models import build


def timed_decode_ms(llm: LLM, ids: list[int], steps: int) -> list[float]:
    """Per decode step, the milliseconds spent in the model's MLA layers."""
    layers = [m for m in llm.engine.model.modules() if isinstance(m, MLAttention)]
    per_step: list[float] = []
    seen = [0.0, 0]

    def wrap(module: MLAttention):
        forward = module.forward

        def timed(x, ctx, rope=None):
            if not ctx.decode_only:
                return forward(x, ctx, rope)
            start = time.perf_counter()
            out = forward(x, ctx, rope)
            seen[0] += time.perf_counter() - start
            seen[1] += 1
            if seen[1] == len(layers):
                per_step.append(seen[0] * 1e3)
                seen[0], seen[1] = 0.0, 0
            return out

        module.forward = timed

    for m in layers:
        wrap(m)
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    for m in layers:
        del m.forward
    return per_step


def fused_attention_ms(llm: LLM, ids: list[int], steps: int) -> float:
    """The one-call decode step's attention milliseconds per step (mean over `steps`), the context
    cached first; the decoder is rebuilt for the layers' current indexer settings."""
    model = llm.engine.model
    model._fused_for = None
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids}], greedy)  # (re)builds the decoder at its decode step
    decoder = model.fused_decoder
    decoder.set_profiling(True)
    before = decoder.steps
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    seconds = decoder.profile()["attention (KV write, kernel)"]
    decoder.set_profiling(False)
    return seconds * 1e3 / (decoder.steps - before)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(2)
    path = build(EnvSettings.read().cache_dir, "glm5-flash-100m")
    rng = random.Random(0)
    ids = [rng.randrange(10, 31000) for _ in range(args.context)]
    llm = LLM(
        str(path),
        progress=False,
        max_num_batched_tokens=2048,
        max_model_len=args.context + args.steps + 16,
        kv_cache_memory_bytes=2 << 30,
    )
    mla = [m for m in llm.engine.model.modules() if isinstance(m, MLAttention)]
    topk, pool = mla[0].topk, mla[0].pool
    start = time.perf_counter()
    fused_sparse = fused_attention_ms(llm, ids, args.steps)  # prefills the context, then decodes
    prefill_s = time.perf_counter() - start
    model = llm.engine.model
    model.fused_decode = False
    sparse = timed_decode_ms(llm, ids, args.steps)  # resumes the cached prefix
    indexers = [(m.indexer, m.topk) for m in mla]
    for m in mla:  # the indexer off: every query reads every position
        m.indexer, m.topk = None, None
    dense = timed_decode_ms(llm, ids, args.steps)
    model.fused_decode = True
    fused_dense = fused_attention_ms(llm, ids, args.steps)
    for m, (indexer, k) in zip(mla, indexers):
        m.indexer, m.topk = indexer, k
    s, d = statistics.median(sparse), statistics.median(dense)
    print(f"glm5-flash-100m, context {args.context}, index_topk {topk}, index_kpool {pool}, {len(mla)} MLA layers")
    print(f"first run (prefill + decode): {prefill_s:.1f} s")
    print(f"one-call decode step, attention part per step (selection + attention), mean of {args.steps} steps:")
    print(f"  sparse (pooled indexer): {fused_sparse:8.2f} ms")
    print(f"  dense (indexer off):     {fused_dense:8.2f} ms")
    print(f"  sparse / dense:          {fused_sparse / fused_dense:8.3f}   (floor: <= 0.25)")
    print(f"module path, MLA layers per decode step, median of {len(sparse)} / {len(dense)} steps:")
    print(f"  sparse (pooled indexer): {s:8.2f} ms")
    print(f"  dense (indexer off):     {d:8.2f} ms")
    print(f"  sparse / dense:          {s / d:8.3f}   (floor: <= 0.25)")


if __name__ == "__main__":
    main()
