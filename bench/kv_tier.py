"""The second KV tier on SmolLM2: a long prompt's TTFT cold and after a restart on the same disk
tier, for each KV dtype; and c8 throughput with the tier on (nothing to hit) against off.

    python -m bench.kv_tier [--prompt-tokens 7900] [--dtypes float32 bfloat16 fp8] [--rounds 3]

Restart: a server with `--kv-tier disk:DIR` answers the prompt (cold: nothing in the tier), its
writes finish, it stops; a new server on DIR answers the same prompt. Printed: both TTFTs and
their ratio (target <= 0.2), the tokens the second served from cache (target >= the prompt's last
whole block), and whether the two answers' tokens are identical.
c8: offline engines with the tier off and on (nothing to hit) taking turns round by round on fresh
prompts (32 of 128 tokens, 64 out, 8 running); output tok/s and the median of the rounds' ratios
(target >= 0.97).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from baton.bench.procs import free_port, stop_processes, wait_healthy
from baton.bench.serve import random_prompts

MODEL = "smollm2-135m"
SECRET = "bench-tier-secret"


def start(args: list[str], log: Path) -> tuple[str, subprocess.Popen]:
    port = free_port()
    cmd = [sys.executable, "-m", "baton.cli", "serve", "--model", MODEL, "--port", str(port), *args]
    env = {**os.environ, "BATON_KV_TIER_SECRET": SECRET}
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 300)
    return url, proc


def metric(url: str, name: str) -> float:
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def timed(url: str, ids: list[int], max_tokens: int) -> tuple[float, list[str], int]:
    """(TTFT seconds, streamed text pieces, cached prompt tokens) of one streamed completion."""
    body = {
        "model": MODEL,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, pieces, cached = None, [], 0
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                ttft = ttft or time.perf_counter() - start
                pieces.append(chunk["choices"][0]["text"])
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ttft, pieces, cached


def restart(dtype: str, n: int, scratch: Path) -> None:
    tier = scratch / f"tier-{dtype}"
    args = ["--kv-tier", f"disk:{tier}", "--kv-cache-dtype", dtype, "--max-model-len", "8192"]
    ids = random_prompts(1, n, seed=7)[0]
    url, proc = start(args, scratch / f"cold-{dtype}.log")
    try:
        timed(url, random_prompts(1, 64, seed=1)[0], 4)  # warm-up on another prompt
        cold, cold_text, _ = timed(url, ids, 16)
        for _ in range(600):
            if metric(url, "baton_kv_tier_objects_written_total") >= n // 16:
                break
            time.sleep(0.1)
    finally:
        stop_processes([proc])
    url, proc = start(args, scratch / f"warm-{dtype}.log")
    try:
        timed(url, random_prompts(1, 64, seed=2)[0], 4)
        warm, warm_text, cached = timed(url, ids, 16)
        load_s = metric(url, "baton_kv_tier_load_seconds_total")
    finally:
        stop_processes([proc])
    target = (n - 1) // 16 * 16
    print(
        f"{dtype:9s} {n} tokens: cold TTFT {cold * 1000:8.1f} ms, after restart {warm * 1000:7.1f} ms "
        f"(ratio {warm / cold:.3f}, <=0.2: {'met' if warm / cold <= 0.2 else 'NOT met'}); cached {cached} "
        f"(>= {target}: {'met' if cached >= target else 'NOT met'}); load {load_s:.2f} s; "
        f"tokens identical: {cold_text == warm_text}",
        flush=True,
    )


def c8(rounds: int, scratch: Path) -> None:
    """Offline engines in this process, the tier off and on (a fresh directory: nothing to hit),
    taking turns on the same fresh prompts each round, first one then the other."""
    from baton import LLM, SamplingParams

    off = LLM(MODEL, progress=False, max_num_seqs=8)
    on = LLM(MODEL, progress=False, max_num_seqs=8, kv_tier=[f"disk:{scratch / 'tier-c8'}"], kv_tier_secret=SECRET)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    ratios = []
    for r in range(rounds):
        prompts = [{"prompt_token_ids": ids} for ids in random_prompts(32, 128, 1000 + r)]
        got = {}
        for name, llm in sorted({"off": off, "on": on}.items(), reverse=bool(r % 2)):
            start = time.perf_counter()
            llm.generate(prompts, params)
            got[name] = 32 * 64 / (time.perf_counter() - start)
            rates[name].append(round(got[name], 1))
        ratios.append(got["on"] / got["off"])
    on.engine.tier.flush()
    stats = on.engine.tier.metrics()
    ratio = statistics.median(ratios)
    print(
        f"c8 (32 prompts of 128 tokens, 64 out, 8 running) output tok/s, {rounds} rounds: tier off {rates['off']}, "
        f"on {rates['on']}; median on/off {ratio:.3f} (>=0.97: {'met' if ratio >= 0.97 else 'NOT met'}); "
        f"tier objects written {stats['objects_written']}, dropped {stats['writes_dropped']}, "
        f"hit tokens {stats['hit_tokens']}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=7900)
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16", "fp8"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--skip-c8", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="baton-bench-tier-") as tmp:
        scratch = Path(tmp)
        for dtype in args.dtypes:
            restart(dtype, args.prompt_tokens, scratch)
        if not args.skip_c8:
            c8(args.rounds, scratch)


if __name__ == "__main__":
    main()
