"""Speculative decoding on and off, baton and llama.cpp's llama-server side by side, on SmolLM2 as
shipped (Q4_1) with an input-grounded workload: rewrite a given passage, edit a given piece of code.

    python -m bench.spec_decode [--repeats 3] [--output-len 128] [--k 4] [--peers baton llama.cpp]
                                [--weights gguf|f32] [--workloads c1 c8 c32]

Servers, each computing on the same 2 cores:
  baton            no speculation
  baton ngram      --speculative-config {"method": "ngram", ...} (prompt lookup)
  baton suffix     {"method": "suffix"} (suffix decoding over the prompt, output and recent outputs)
  baton draft      {"method": "draft_model"} with the target requantized to Q4_0 by llama-quantize
  llama.cpp        no speculation
  llama.cpp ngram  --spec-type ngram-simple (its prompt lookup)
  llama.cpp draft  --spec-type draft-simple --model-draft on the same Q4_0 file

All servers start first; every round then runs each workload on every server in turn, never two
at once (greedy, ignore_eos, streamed, fresh prompts each round); the table shows medians of the
rounds and the median of each round's ratio of a speculating server to its own without drafts.
Every speculating server's greedy texts are compared, request by request, with the same engine's
without drafts. Then a c8 workload whose prompts share a long system prompt: baton's prefix-cache
hit tokens with each method against none. Each baton server's acceptance per draft position comes
from its /metrics (baton_spec_decode_*); llama-server's from the acceptance lines it logs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

import aiohttp

from baton.bench.serve import _stats, one_request
from baton.config import EnvSettings
from baton.models.loader import resolve_model_path
from baton.tokenizer import apply_chat_template, load_tokenizer
from bench.peer_servers import CORES, Server, inherited_env, llama_cpp_binary, start_server, stop_servers
from bench.peers import baton_commit, served_weights

MODEL = "smollm2-135m"
PASSAGES = [
    "The river ran past the old mill, under the stone bridge and on to the harbor, where the fishing boats "
    "waited for the morning tide. Every spring the water rose over the lower fields, and every summer the "
    "children of the village waded across it to the island of willows, where the herons nested.",
    "Our team measured the time each request spent waiting in the queue, the time to its first token, and "
    "the time between tokens after that. The median stayed flat as the load grew, but the tail did not: "
    "past sixteen concurrent requests, one request in a hundred waited longer than a second.",
    "To reset the device, hold the power button for ten seconds until the light turns orange, then release "
    "it and press it once more. The device restarts with its factory settings; your saved networks and "
    "paired accessories are removed, and you will need to set them up again.",
    "The library opens at nine on weekdays and at ten on Saturdays. Books may be borrowed for three weeks "
    "and renewed twice, online or at the desk, unless another reader has reserved them. Late returns cost "
    "twenty cents a day, up to the price of the book.",
]
CODE = [
    (
        "total",
        "count",
        "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
        "    return total / len(values)\n\n\n"
        "def variance(values):\n    m = mean(values)\n    total = 0\n    for v in values:\n"
        "        total += (v - m) ** 2\n    return total / len(values)\n",
    ),
    (
        "items",
        "entries",
        "class Cart:\n    def __init__(self):\n        self.items = []\n\n    def add(self, name, price):\n"
        "        self.items.append((name, price))\n\n    def total(self):\n"
        "        return sum(price for _, price in self.items)\n\n    def clear(self):\n        self.items = []\n",
    ),
]
SYSTEM = "You are a careful assistant for a public library. " * 30  # the shared system prompt


def grounded_prompts(tokenizer, n: int, first: int = 0) -> list[list[int]]:
    """n distinct chat prompts that ask for text the prompt already holds (rewrites and edits),
    numbered from `first` (each round gets its own: no server sees a prompt twice)."""
    asks = []
    for p in PASSAGES:
        asks.append(f"Rewrite the following passage word for word, fixing only spelling mistakes:\n\n{p}")
        asks.append(f"Copy this paragraph exactly, then add one sentence at the end:\n\n{p}")
    for old, new, code in CODE:
        asks.append(f"Rename the variable `{old}` to `{new}` in this code and print the whole code:\n\n{code}")
    out = []
    for i in range(first, first + n):
        message = f"Task {i + 1}. {asks[i % len(asks)]}"
        out.append(apply_chat_template(tokenizer, [{"role": "user", "content": message}]))
    return out


def system_prompts(tokenizer, n: int) -> list[list[int]]:
    questions = ["When do you open?", "How long may I keep a book?", "What does a late return cost?", "Hello!"]
    return [
        apply_chat_template(
            tokenizer,
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{questions[i % 4]} ({i})"}],
        )
        for i in range(n)
    ]


WORKLOADS = [("c1", 4, 1), ("c8", 16, 8), ("c32", 64, 32)]  # (name, prompts, concurrency)
C1_GOAL = 1.5  # n-gram or suffix over no drafts at c1 on the shipped file


async def run_prompts(url: str, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    limit = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=1800)) as session:

        async def limited(prompt):
            async with limit:
                return await one_request(session, f"{url}/v1/completions", MODEL, prompt, output_len, {})

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "output_throughput": sum(r.output_tokens for r in ok) / duration,
        "tpot_ms": _stats(tpot)["median"],
        "ttft_ms": _stats([r.ttft for r in ok])["median"],
        "failed": len(results) - len(ok),
        "texts": [r.text if r.ok else None for r in results],
    }


def metrics(url: str) -> dict[str, float]:
    """baton's /metrics: each sample's value by its name and labels."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def acceptance(before: dict, after: dict, k: int) -> str:
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    drafts = delta.get("baton_spec_decode_num_drafts_total", 0.0)
    if not drafts:
        return "no drafts"
    key = 'baton_spec_decode_num_accepted_tokens_per_pos_total{{position="{}"}}'
    per_pos = [delta.get(key.format(i), 0.0) for i in range(k)]
    accepted = delta.get("baton_spec_decode_num_accepted_tokens_total", 0.0)
    proposed = delta.get("baton_spec_decode_num_draft_tokens_total", 0.0)
    return (
        f"mean acceptance length {1 + accepted / drafts:.2f}; accepted {accepted:.0f} of {proposed:.0f} drafted; "
        f"per position {', '.join(f'{a / drafts:.2f}' for a in per_pos)}"
    )


ACCEPTANCE_LINE = re.compile(
    r"draft acceptance = [\d.]+ \(\s*(\d+) accepted /\s*(\d+) generated\), mean len =\s*([\d.]+)"
)


def llama_acceptance(log: Path) -> str:
    """llama-server logs each finished request's draft acceptance and mean accepted length (it
    gives no per-position figures): summed and averaged over the run."""
    accepted = generated = 0
    lengths = []
    for line in log.read_text(errors="replace").splitlines():
        m = ACCEPTANCE_LINE.search(line)
        if m:
            accepted += int(m.group(1))
            generated += int(m.group(2))
            lengths.append(float(m.group(3)))
    if not generated:
        return "no acceptance lines in its log"
    mean = sum(lengths) / len(lengths)
    return f"accepted {accepted} of {generated} drafted; its mean len (per request, averaged) {mean:.2f}"


def q4_0_draft(cache: Path, target: Path) -> Path:
    """The target requantized to Q4_0 by llama.cpp's llama-quantize, made once: the draft both use."""
    out = cache / "peers" / "gguf" / f"{MODEL}-q4_0.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        quantize = llama_cpp_binary(cache, "llama-quantize")
        cmd = [str(quantize), "--allow-requantize", str(target), str(out), "Q4_0", str(CORES)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def server_specs(k: int, draft: Path, peers: list[str]) -> list[tuple[str, str, list[str]]]:
    """(label, peer, extra flags) of every server, in run order."""
    ngram = {"method": "ngram", "num_speculative_tokens": k}
    suffix = {"method": "suffix", "num_speculative_tokens": k}
    drafted = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
    specs = []
    if "baton" in peers:
        specs += [
            ("baton", "baton", []),
            ("baton ngram", "baton", ["--speculative-config", json.dumps(ngram)]),
            ("baton suffix", "baton", ["--speculative-config", json.dumps(suffix)]),
            ("baton draft", "baton", ["--speculative-config", json.dumps(drafted)]),
        ]
    if "llama.cpp" in peers:
        specs += [
            ("llama.cpp", "llama.cpp", []),
            (
                "llama.cpp ngram",
                "llama.cpp",
                ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3"]
                + ["--spec-ngram-simple-size-m", str(k)],
            ),
            (
                "llama.cpp draft",
                "llama.cpp",
                ["--spec-type", "draft-simple", "--model-draft", str(draft), "--spec-draft-n-max", str(k)],
            ),
        ]
    return specs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (llama.cpp: the most drafted)")
    ap.add_argument("--peers", nargs="+", default=["baton", "llama.cpp"], choices=["baton", "llama.cpp"])
    ap.add_argument(
        "--weights",
        choices=["gguf", "f32"],
        default="gguf",
        help="the target: gguf, the packaged Q4_1 file as shipped (the issue's rows); f32, its float32 "
        "export (llama-server: the same as an F32 GGUF), where a Q4_0 draft reads a sixth of the bytes",
    )
    names = [w[0] for w in WORKLOADS]
    ap.add_argument("--workloads", nargs="+", default=names, choices=names)
    args = ap.parse_args()
    WORKLOADS[:] = [w for w in WORKLOADS if w[0] in args.workloads]
    cache = EnvSettings.read().cache_dir
    scratch = cache / "peers" / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    shipped = resolve_model_path(MODEL)
    draft = q4_0_draft(cache, shipped)
    tokenizer = load_tokenizer(shipped, cache)
    prompts = {
        (name, repeat): grounded_prompts(tokenizer, n, 1000 * repeat + 100 * i)
        for repeat in range(args.repeats)
        for i, (name, n, _) in enumerate(WORKLOADS)
    }
    results: dict[tuple[str, str], list[dict]] = {}
    notes: dict[str, str] = {}
    hits: dict[str, float] = {}
    settings: list[str] = []
    servers: list[tuple[str, str, Server, Path, dict]] = []  # label, peer, server, log, metrics at start
    try:
        for label, peer, extra in server_specs(args.k, draft, args.peers):
            log = scratch / f"spec-{label.replace(' ', '-')}.log"
            weights = shipped if args.weights == "gguf" else served_weights(peer, MODEL, "f32", cache)
            try:
                server = start_server(peer, MODEL, weights, cache, log, extra, label)
            except (RuntimeError, subprocess.CalledProcessError) as e:
                print(f"{label} did not start ({e}); see {log}", flush=True)
                continue
            settings.append(server.settings())
            servers.append((label, peer, server, log, metrics(server.url) if peer == "baton" else {}))
        # rounds: each workload on every server in turn (never two at once), so drift hits all alike
        for repeat in range(args.repeats):
            for name, _, concurrency in WORKLOADS:
                for label, _, server, _, _ in servers:
                    r = asyncio.run(run_prompts(server.url, prompts[(name, repeat)], args.output_len, concurrency))
                    results.setdefault((name, label), []).append(r)
                    print(
                        f"[{name} #{repeat + 1}] {label}: {r['output_throughput']:.1f} tok/s, "
                        f"TPOT {r['tpot_ms']:.1f} ms, TTFT {r['ttft_ms']:.0f} ms, failed {r['failed']}",
                        flush=True,
                    )
        for label, peer, server, log, before in servers:
            if peer == "baton":
                notes[label] = acceptance(before, metrics(server.url), args.k)
                start = metrics(server.url).get("baton_prefix_cache_hit_tokens_total", 0.0)
                asyncio.run(run_prompts(server.url, system_prompts(tokenizer, 16), 32, 8))
                hits[label] = metrics(server.url).get("baton_prefix_cache_hit_tokens_total", 0.0) - start
            else:
                notes[label] = llama_acceptance(log)
    finally:
        stop_servers([server for _, _, server, _, _ in servers])
    labels = list(dict.fromkeys(label for _, label in results))
    print(f"\nbaton {baton_commit()}")
    print(
        f"SmolLM2 {shipped.name if args.weights == 'gguf' else 'float32'} target, {CORES} cores each; greedy, "
        f"{args.output_len} output tokens, "
        f"k={args.k}; medians of {args.repeats}"
    )
    print(f"{'workload':<10}{'server':<18}{'output tok/s':>14}{'TPOT ms':>10}{'TTFT ms':>10}{'vs off':>8}")
    # the goal at c1 on the shipped file: n-gram or suffix at least C1_GOAL (either meets it); elsewhere no loss
    goals = {("c1", "baton ngram"): C1_GOAL, ("c1", "baton suffix"): C1_GOAL} if args.weights == "gguf" else {}
    best_c1 = 0.0
    for name, _, _ in WORKLOADS:
        for label in labels:
            runs = results.get((name, label))
            if not runs:
                continue
            tput = statistics.median(r["output_throughput"] for r in runs)
            base = results.get((name, label.split(" ")[0]))
            ratio = None
            if base and " " in label:  # the median of each round's ratio to the same server without drafts
                ratio = statistics.median(r["output_throughput"] / b["output_throughput"] for r, b in zip(runs, base))
            line = f"{name:<10}{label:<18}{tput:>14.1f}{statistics.median(r['tpot_ms'] for r in runs):>10.1f}"
            line += f"{statistics.median(r['ttft_ms'] for r in runs):>10.0f}"
            line += f"{ratio:>8.2f}" if ratio is not None else f"{'':>8}"
            if ratio is not None and label.startswith("baton"):
                goal = goals.get((name, label), 1.0)
                line += f"  target >= {goal}x: {'met' if ratio >= goal else 'MISSED'}"
                if (name, label) in goals:
                    best_c1 = max(best_c1, ratio)
            print(line)
    if goals:
        met = "met" if best_c1 >= C1_GOAL else "MISSED"
        print(f"c1, n-gram or suffix >= {C1_GOAL}x: {met} (best {best_c1:.2f}x)")
    print("\ngreedy outputs against the same server without drafts, request by request (every round)")
    for label in labels:
        base_label = label.split(" ")[0]
        if " " not in label or base_label not in labels:
            continue
        pairs = [
            (a, b)
            for (name, lab), runs in results.items()
            if lab == label
            for run, base in zip(runs, results[(name, base_label)])
            for a, b in zip(run["texts"], base["texts"])
            if a is not None and b is not None
        ]
        same = sum(a == b for a, b in pairs)
        print(f"  {label:<18}{same} of {len(pairs)} identical{'' if same == len(pairs) else ': DIFFER'}")
    print("\nacceptance (over all rounds)")
    for label in labels:
        print(f"  {label:<18}{notes.get(label, '')}")
    if hits:
        print("\nshared system prompt, c8, 16 requests: baton prefix-cache hit tokens")
        for label, n in hits.items():
            same = "" if label == "baton" else f"  ({'equal to' if n == hits.get('baton') else 'DIFFERS from'} off)"
            print(f"  {label:<18}{n:>8.0f}{same}")
    print("\nsettings (variables set over the inherited environment, then the command)")
    print("\n".join(settings))
    print(f"  inherited by all: {inherited_env() or 'none of the relevant variables set'}")


if __name__ == "__main__":
    main()
