"""Tensor and pipeline parallel's overhead on this host: TP=2 and PP=2 with one thread per rank
against TP=1 with two threads (the same two cores), on the same weights. On 2 cores the figure
that matters is the overhead, not a speed-up.

Prints per configuration: prefill tokens/s (one long prompt), decode TPOT at 1 sequence and
tokens/s at 8, and the driver's communication per step (TP's all-reduces and the logits'
all-gather, PP's receives, the metadata broadcast: calls, milliseconds, bytes) and bytes per token.
    python -m bench.parallel [--model smollm2-135m] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPT = "The history of the printing press begins in"
LONG = "Write a long story about a lighthouse keeper who finds a message in a bottle. " * 60


def measure(model: str, tp: int, pp: int, tokens: int, port: int) -> dict:
    from baton import LLM, SamplingParams

    llm = LLM(
        model, progress=False, tensor_parallel_size=tp, pipeline_parallel_size=pp, master_port=port, max_model_len=2048
    )
    stats = llm.engine.ranks.tp.stats if llm.engine.ranks else None
    out: dict = {}

    def timed(prompts: list[str], n: int) -> tuple[float, int]:
        if stats:
            stats.reset()
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)

    timed([PROMPT], 8)  # warm up
    seconds, _ = timed([LONG], 1)
    prompt_tokens = len(llm.get_tokenizer().encode(LONG))
    out["prefill_tok_s"] = prompt_tokens / seconds
    first, _ = timed([PROMPT], 1)
    total, _ = timed([PROMPT], tokens + 1)
    out["tpot_ms"] = (total - first) / tokens * 1e3
    if stats:
        steps = stats.by_op["broadcast"][0]
        out["comm_c1"] = {op: [c / steps, s / steps * 1e3, b / steps] for op, (c, s, b) in stats.by_op.items()}
        out["bytes_per_token_c1"] = stats.bytes / (tokens + 1)
        out["comm_ms_per_step_c1"] = stats.seconds / steps * 1e3
    seconds, generated = timed([f"{PROMPT} {i}" for i in range(8)], tokens)
    out["c8_tok_s"] = generated / seconds
    if stats:
        out["comm_ms_per_step_c8"] = stats.seconds / stats.by_op["broadcast"][0] * 1e3
        out["bytes_per_token_c8"] = stats.bytes / generated
    llm.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--one", nargs=3, type=int, metavar=("TP", "PP", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.model, *args.one[:2], args.tokens, args.one[2])))
        return
    from baton.bench.procs import free_port

    results = {}
    layouts = (("TP=1, 2 threads", 1, 1, 2), ("TP=2, 1 thread per rank", 2, 1, 1), ("PP=2, 1 thread per rank", 1, 2, 1))
    for label, tp, pp, threads in layouts:
        env = {**os.environ, "BATON_NUM_THREADS": str(threads), "BATON_LOG_LEVEL": "WARNING"}
        cmd = [sys.executable, __file__, "--model", args.model, "--tokens", str(args.tokens)]
        done = subprocess.run(
            [*cmd, "--one", str(tp), str(pp), str(free_port())], env=env, capture_output=True, text=True
        )
        if done.returncode != 0:
            sys.exit(f"{label} failed:\n{done.stderr[-3000:]}")
        results[label] = json.loads(done.stdout.strip().splitlines()[-1])
    one = results[layouts[0][0]]
    print(f"{args.model}, {args.tokens} decode tokens")
    print(f"{'':28}{'prefill tok/s':>14}{'TPOT c1 ms':>12}{'c8 tok/s':>10}")
    for label, r in results.items():
        print(f"{label:28}{r['prefill_tok_s']:14.0f}{r['tpot_ms']:12.2f}{r['c8_tok_s']:10.1f}")
    for label, r in list(results.items())[1:]:
        print(
            f"{label} / TP=1: prefill {r['prefill_tok_s'] / one['prefill_tok_s']:.2f}x, "
            f"TPOT {r['tpot_ms'] / one['tpot_ms']:.2f}x, c8 {r['c8_tok_s'] / one['c8_tok_s']:.2f}x"
        )
        print(
            f"  driver's communication per decode step: c1 {r['comm_ms_per_step_c1']:.3f} ms "
            f"({r['comm_ms_per_step_c1'] / r['tpot_ms']:.0%} of TPOT), c8 {r['comm_ms_per_step_c8']:.3f} ms; "
            f"bytes moved per token: c1 {r['bytes_per_token_c1']:.0f}, c8 {r['bytes_per_token_c8']:.0f}"
        )
        for op, (calls, ms, nbytes) in r["comm_c1"].items():
            print(f"    c1 per step: {op:11} {calls:5.1f} calls {ms:7.3f} ms {nbytes:9.0f} bytes")


if __name__ == "__main__":
    main()
