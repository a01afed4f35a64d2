"""Prefix-aware routing against round-robin: three baton workers behind `baton router`, a
multi-tenant chat, prefix hit rate and TTFT per policy side by side.

    python -m bench.routing [--tenants 8] [--conversations 2] [--turns 4] [--concurrency 6]

Workload: 8 tenants, each with its own system prompt of about 1,000 tokens (distinct from the
first words on: its own company, rules and vocabulary); per tenant 2 conversations of 4 turns.
Each turn sends the conversation so far (system prompt, earlier user messages and the answers the
model gave) plus a new user message of about 40 tokens, greedy, 16 tokens out, streamed. The 16
conversations run at once in a shuffled order, at most --concurrency requests in flight.

Sizing: each worker (smollm2-135m, one thread: BATON_NUM_THREADS=1) has --num-kv-blocks 288 blocks
of 16 tokens, 4,608 tokens: about three tenants' system prompts with their conversations, far
from all eight (about 11,500 tokens). Round-robin sends every tenant to every worker, so each
worker's cache keeps about a third of what it is asked for; cache-aware routing gives each worker
about 8 / 3 tenants, which fit. The router remembers as much per worker (--cache-tokens-per-worker).

Each policy runs on fresh workers (started anew: empty caches) and its own router. Reported per
policy: prefix hit rate = sum(cached_tokens) / sum(prompt_tokens) over the answers' usage, median
and p90 TTFT (request sent to first content chunk), wall time, the workers' preemptions, and per
worker the router's requests and expected against reported prefix tokens; then the ratios
cache_aware / round_robin and whether the targets hold (hit rate >= 2x, lower median TTFT).
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
import urllib.request
from dataclasses import dataclass

import aiohttp

from baton.bench.procs import free_port, stop_processes, wait_healthy

MODEL = "smollm2-135m"
KV_BLOCKS, BLOCK_SIZE = 288, 16
COMPANIES = [
    ("Acme Umbrellas", "rain gear"),
    ("Globex Shipping", "freight and parcels"),
    ("Initech Payroll", "salary software"),
    ("Umbrella Pharmacy", "prescriptions"),
    ("Stark Solar", "rooftop panels"),
    ("Wayne Rail", "night trains"),
    ("Tyrell Gardens", "seeds and greenhouses"),
    ("Wonka Bakery", "cakes and sweets"),
]
WORDS = (
    "account address answer apply arrive basket battery billing bottle branch budget cable calendar cancel "
    "carton charge check claim client color comfort contract counter coupon credit damage deadline delay "
    "delivery deposit detail device discount document driver estimate exchange expire feature fee filter "
    "form freight guarantee handle invoice label ledger license limit locker manual margin member message "
    "meter notice number offer option order package parcel partner payment permit plan policy portal price "
    "product profile receipt record refund region renewal repair report request return review route "
    "schedule seal season service shelf shipment signature size stock storage supplier support surcharge "
    "ticket timing track transfer unit update upgrade voucher warehouse warranty weight window"
).split()


def system_prompt(tenant: int) -> str:
    name, trade = COMPANIES[tenant]
    rng = random.Random(1000 + tenant)
    vocab = rng.sample(WORDS, 60)  # each tenant talks about its own things
    rules = []
    for i in range(1, 29):
        words = " ".join(rng.choice(vocab) for _ in range(14))
        rules.append(f"Rule {i} of {name}: when a customer asks about {words}, answer with care.")
    return f"{name} ({trade}) support desk. You are its assistant; follow every rule below.\n" + "\n".join(rules)


def user_message(tenant: int, conversation: int, turn: int) -> str:
    rng = random.Random(f"{tenant}-{conversation}-{turn}")
    words = " ".join(rng.choice(WORDS) for _ in range(24))
    return f"Question {turn + 1}: I need help with my {words}. What should I do?"


@dataclass
class Sample:
    ttft: float
    prompt_tokens: int
    cached_tokens: int


async def ask(session: aiohttp.ClientSession, url: str, messages: list[dict], max_tokens: int) -> tuple[Sample, str]:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, text, usage = None, "", None
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            delta = "".join(c["delta"].get("content") or "" for c in chunk["choices"])
            if delta and ttft is None:
                ttft = time.perf_counter() - start
            text += delta
    if usage is None:
        raise RuntimeError("the stream carried no usage")
    sample = Sample(ttft if ttft is not None else time.perf_counter() - start, usage["prompt_tokens"], 0)
    sample.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
    return sample, text


async def run_workload(url: str, args: argparse.Namespace) -> tuple[list[Sample], float]:
    conversations = [(t, c) for t in range(args.tenants) for c in range(args.conversations)]
    random.Random(args.seed).shuffle(conversations)
    in_flight = asyncio.Semaphore(args.concurrency)
    samples: list[Sample] = []

    async def converse(session: aiohttp.ClientSession, tenant: int, conversation: int) -> None:
        messages = [{"role": "system", "content": system_prompt(tenant)}]
        for turn in range(args.turns):
            messages.append({"role": "user", "content": user_message(tenant, conversation, turn)})
            async with in_flight:
                sample, answer = await ask(session, url, messages, args.max_tokens)
            samples.append(sample)
            messages.append({"role": "assistant", "content": answer})

    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        await asyncio.gather(*(converse(session, t, c) for t, c in conversations))
    return samples, time.perf_counter() - start


def start(cmd: list[str], port: int, env: dict) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton.cli", *cmd, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    wait_healthy(f"http://127.0.0.1:{port}", proc, 300)
    return proc


def metrics(url: str) -> list[tuple[str, str, float]]:
    """(name, labels, value) of every sample on a Prometheus page."""
    rows = []
    for line in urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode().splitlines():
        if line and not line.startswith("#"):
            head, value = line.rsplit(" ", 1)
            name, _, labels = head.partition("{")
            rows.append((name, labels.rstrip("}"), float(value)))
    return rows


def warm_up(url: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    urllib.request.urlopen(req, timeout=300).read()


def run_policy(policy: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "BATON_NUM_THREADS": "1", "BATON_LOG_LEVEL": "WARNING"}
    serve = ["serve", "--model", MODEL, "--served-model-name", MODEL, "--max-model-len", "2048"]
    serve += ["--num-kv-blocks", str(KV_BLOCKS), "--block-size", str(BLOCK_SIZE)]
    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = []
    try:
        for port in ports:
            procs.append(start(serve, port, env))
        for url in urls:
            warm_up(url)
        router_port = free_port()
        router = ["router", "--workers", *urls, "--policy", policy]
        router += ["--cache-tokens-per-worker", str(KV_BLOCKS * BLOCK_SIZE)]
        procs.append(start(router, router_port, env))
        router_url = f"http://127.0.0.1:{router_port}"
        samples, wall = asyncio.run(run_workload(router_url, args))
        per_worker = {u: {} for u in urls}
        for name, labels, value in metrics(router_url):
            if labels.startswith('worker="'):
                per_worker[labels[8:-1]][name] = value
        preemptions = sum(v for u in urls for n, _, v in metrics(u) if n == "baton_preemptions_total")
    finally:
        stop_processes(procs)
    ttfts = sorted(s.ttft for s in samples)
    return {
        "requests": len(samples),
        "prompt_tokens": sum(s.prompt_tokens for s in samples),
        "hit_rate": sum(s.cached_tokens for s in samples) / sum(s.prompt_tokens for s in samples),
        "ttft_p50": statistics.median(ttfts),
        "ttft_p90": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "wall": wall,
        "preemptions": preemptions,
        "workers": list(per_worker.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--conversations", type=int, default=2, help="per tenant")
    ap.add_argument("--turns", type=int, default=4, help="per conversation")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    args = ap.parse_args()
    if not 1 <= args.tenants <= len(COMPANIES):
        ap.error(f"--tenants must be in [1, {len(COMPANIES)}]")
    print(
        f"3 workers ({MODEL}, 1 thread, {KV_BLOCKS} KV blocks of {BLOCK_SIZE} tokens each); {args.tenants} tenants "
        f"x {args.conversations} conversations x {args.turns} turns, {args.max_tokens} tokens out, "
        f"{args.concurrency} in flight",
        flush=True,
    )
    results = {}
    for policy in args.policies:
        r = results[policy] = run_policy(policy, args)
        print(
            f"{policy:<12} requests {r['requests']}  prompt tokens {r['prompt_tokens']}  hit rate {r['hit_rate']:.3f}  "
            f"TTFT p50 {r['ttft_p50']:.2f} s  p90 {r['ttft_p90']:.2f} s  wall {r['wall']:.1f} s  "
            f"preemptions {r['preemptions']:.0f}",
            flush=True,
        )
        for i, w in enumerate(r["workers"]):
            print(
                f"  worker {i}: requests {w.get('baton_router_requests_total', 0):.0f}  prefix tokens expected "
                f"{w.get('baton_router_prefix_tokens_expected_total', 0):.0f}, reported hit "
                f"{w.get('baton_router_prefix_tokens_hit_total', 0):.0f} of "
                f"{w.get('baton_router_prompt_tokens_total', 0):.0f} prompt tokens",
                flush=True,
            )
    if {"cache_aware", "round_robin"} <= results.keys():
        ca, rr = results["cache_aware"], results["round_robin"]
        hit_ratio, ttft_ratio = ca["hit_rate"] / max(rr["hit_rate"], 1e-9), ca["ttft_p50"] / rr["ttft_p50"]
        print(
            f"cache_aware / round_robin: hit rate {hit_ratio:.2f}x, median TTFT {ttft_ratio:.2f}x, "
            f"p90 TTFT {ca['ttft_p90'] / rr['ttft_p90']:.2f}x"
        )
        print(
            f"targets: hit rate >= 2x round-robin's: {'yes' if hit_ratio >= 2 else 'NO'}; "
            f"lower median TTFT: {'yes' if ttft_ratio < 1 else 'NO'}"
        )


if __name__ == "__main__":
    main()
