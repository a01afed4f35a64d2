"""`baton bench serve`: drive any OpenAI-compatible server the way vLLM's `bench serve` does.

Random prompts of exactly --input-len tokens (sent as token ids), --output-len tokens generated
with ignore_eos, streamed; measured client side: TTFT, TPOT = (e2e - TTFT) / (output tokens - 1),
ITL (gaps between streamed chunks), end-to-end latency, throughputs and failures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""
    text: str = ""  # the streamed text, joined


def random_prompts(n: int, input_len: int, seed: int, low: int = 1000, high: int = 10000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(n)]


async def one_request(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], output_len: int, headers: dict
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"].get("completion_tokens", 0)
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    result.text += choices[0]["text"]
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or output_len
        result.ok = result.ttft > 0
        if not result.ok:
            result.error = "no tokens streamed"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_benchmark(args: argparse.Namespace) -> dict:
    prompts = random_prompts(args.num_prompts, args.input_len, args.seed)
    url = args.base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(args.max_concurrency)
    # a fresh connection per request: some servers close idle keep-alive connections under a pool
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def limited(prompt: list[int]) -> RequestResult:
            async with limit:
                return await one_request(session, url, args.model, prompt, args.output_len, headers)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, args)


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, max(0, round(0.99 * len(ordered) + 0.5) - 1))]
    return {"mean": statistics.fmean(values) * 1000, "median": statistics.median(values) * 1000, "p99": p99 * 1000}


def summarize(results: list[RequestResult], duration: float, args: argparse.Namespace) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = args.input_len * len(ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2el_ms": _stats([r.e2e for r in ok]),
    }


def print_report(s: dict) -> None:
    rows = [
        ("Successful requests", s["completed"]),
        ("Failed requests", s["failed"]),
        ("Maximum request concurrency", s["max_concurrency"]),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Total input tokens", s["total_input_tokens"]),
        ("Total generated tokens", s["total_output_tokens"]),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
    ]
    for metric, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL")):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {label} (ms)", f"{s[metric][stat]:.2f}"))
    print("=" * 50)
    for name, value in rows:
        print(f"{name:<40}{value:>10}")
    for err in s["errors"]:
        print(f"error: {err}")
    print("=" * 50)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=1)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--save-json", default=None)


def main(args: argparse.Namespace) -> dict:
    for name in ("num_prompts", "input_len", "output_len", "max_concurrency"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    summary = asyncio.run(run_benchmark(args))
    print_report(summary)
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump({**summary, "args": {k: v for k, v in vars(args).items() if k != "func"}}, f, indent=2)
    return summary
