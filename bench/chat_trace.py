"""Multi-user, multi-turn chat on a hybrid GGUF file: baton beside llama.cpp's llama-server (with its
defaults, and once more tuned as its users are advised), the same trace replayed on each.

    python -m bench.chat_trace [--model qwen3.5-1.5b] [--quant Q4_K_M] [--users 8] [--turns 6]
                               [--system-tokens 1000] [--repeats 3] [--peers baton llama.cpp llama.cpp-tuned]

The trace (seeded): one system prompt every user shares; per user and turn a user message and a
recorded assistant reply. The client holds each conversation: turn t sends the system prompt and
the recorded history (not what the engine answered) and the new message, `--max-tokens` tokens
back (greedy, EOS ignored). All users at once (c = users), each starting its next turn as soon as
its last one ends. Each repeat starts every server fresh (cold caches), the engines in turn.

Printed per engine (medians over the repeats): mean TTFT of each turn, the whole trace's wall time,
the prompt tokens it computed (baton: prompt_tokens - usage.prompt_tokens_details.cached_tokens;
llama-server: timings.prompt_n) and its peak resident memory; then baton's ratios to each
llama-server and the targets (turns >= 2 mean TTFT <= 0.5x, wall time <= 0.8x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from baton.bench.procs import peak_rss_mib
from baton.config import EnvSettings
from bench.hybrid_files import QUANTS, SHAPES, gguf_file, hf_dir
from bench.peer_servers import CORES, Server, start_server, stop_servers

TUNED = ["--ctx-checkpoints", "64", "--checkpoint-min-step", "256", "--cache-ram", "16384"]
TARGETS = {"later_ttft": 0.5, "wall": 0.8}


@dataclass
class Turn:
    ttft: float
    prompt_tokens: int
    computed: int  # prompt tokens the engine prefilled (not served from a cache)


@dataclass
class Run:
    turns: list[list[Turn]] = field(default_factory=list)  # [turn][user]
    wall: float = 0.0
    peak_rss_mib: float = 0.0


def _text(tokenizer, words: list[str], rng: random.Random, n: int) -> str:
    """About n tokens of random words, cut to at most n tokens."""
    text = " ".join(rng.choice(words) for _ in range(n))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n]
    return tokenizer.decode(ids).strip()


def make_trace(args: argparse.Namespace, tokenizer) -> tuple[str, list[list[tuple[str, str]]]]:
    """(system prompt, per user its turns' (message, recorded reply))."""
    rng = random.Random(args.seed)
    vocab = [w for w in tokenizer.get_vocab() if w.startswith("Ġ") and w[1:].isalpha() and len(w) > 3]
    words = sorted(w[1:] for w in vocab)
    system = _text(tokenizer, words, rng, args.system_tokens)
    users = [
        [
            (_text(tokenizer, words, rng, args.user_tokens), _text(tokenizer, words, rng, args.reply_tokens))
            for _ in range(args.turns)
        ]
        for _ in range(args.users)
    ]
    return system, users


async def one_turn(session: aiohttp.ClientSession, url: str, model: str, messages: list[dict], max_tokens: int) -> Turn:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, usage, timings = None, None, None
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:500]}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if ttft is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    if ttft is None or usage is None:
        raise RuntimeError(f"{url}: a stream without content or usage")
    prompt = int(usage["prompt_tokens"])
    if timings is not None:  # llama-server: what it prefilled
        computed = int(timings["prompt_n"])
    else:
        computed = prompt - int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return Turn(ttft, prompt, computed)


async def replay(url: str, model: str, system: str, users: list[list[tuple[str, str]]], max_tokens: int) -> Run:
    run = Run(turns=[[None] * len(users) for _ in range(len(users[0]))])  # type: ignore[list-item]

    async def user(u: int, session: aiohttp.ClientSession) -> None:
        history: list[dict] = [{"role": "system", "content": system}]
        for t, (message, reply) in enumerate(users[u]):
            history.append({"role": "user", "content": message})
            run.turns[t][u] = await one_turn(session, url, model, history, max_tokens)
            history.append({"role": "assistant", "content": reply})  # the recorded reply, not the engine's

    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=len(users), force_close=True)
    ) as session:
        start = time.perf_counter()
        await asyncio.gather(*(user(u, session) for u in range(len(users))))
        run.wall = time.perf_counter() - start
    return run


def start(peer: str, path: Path, model: str, args: argparse.Namespace, cache: Path, scratch: Path) -> Server:
    context = args.users * 4096
    if peer == "baton":
        # its default 1 GiB budget (start_server's is sized for attention-only KV), half of what the
        # running states leave for state checkpoints: each conversation's resume point is one
        extra = ["--max-num-seqs", str(args.users), "--kv-cache-memory-bytes", str(args.baton_kv_bytes)]
        extra += ["--state-checkpoint-fraction", "0.5", *shlex.split(args.baton_args)]
        return start_server("baton", model, path, cache, scratch / f"{peer}.log", extra)
    # its defaults with -np as the concurrency: start_server's shared pool (--kv-unified) undone
    extra = ["-np", str(args.users), "-c", str(context), "--no-kv-unified"]
    extra += TUNED if peer == "llama.cpp-tuned" else []
    return start_server("llama.cpp", model, path, cache, scratch / f"{peer}.log", extra, label=peer)


def summarize(runs: list[Run]) -> dict:
    med = statistics.median
    turns = len(runs[0].turns)
    per_turn = [med(statistics.fmean(x.ttft for x in r.turns[t]) for r in runs) for t in range(turns)]
    return {
        "per_turn": per_turn,
        "later_ttft": med(statistics.fmean(x.ttft for t in r.turns[1:] for x in t) for r in runs),
        "wall": med(r.wall for r in runs),
        "computed": med(sum(x.computed for t in r.turns for x in t) for r in runs),
        "later_computed": med(sum(x.computed for t in r.turns[1:] for x in t) for r in runs),
        "prompt": med(sum(x.prompt_tokens for t in r.turns for x in t) for r in runs),
        "rss": med(r.peak_rss_mib for r in runs),
    }


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def report(results: dict[str, dict], servers: dict[str, str], args: argparse.Namespace, path: Path) -> None:
    print(f"\n{path.name}: {args.users} users x {args.turns} turns, a {args.system_tokens}-token system prompt, "
          f"{args.user_tokens}-token messages, {args.reply_tokens}-token recorded replies, {args.max_tokens} tokens "
          f"back; medians of {args.repeats}; {cpu_name()}, {CORES} cores")  # fmt: skip
    head = "".join(f"{'turn ' + str(t + 1):>9}" for t in range(args.turns))
    print(f"{'engine':<16}{head}{'turns>=2':>10}{'wall s':>9}{'computed':>10}{'of prompt':>11}{'peak MiB':>10}")
    for peer, s in results.items():
        turns = "".join(f"{v:>9.2f}" for v in s["per_turn"])
        print(f"{peer:<16}{turns}{s['later_ttft']:>10.2f}{s['wall']:>9.1f}{s['computed']:>10.0f}"
              f"{s['prompt']:>11.0f}{s['rss']:>10.0f}")  # fmt: skip
    print("(TTFT in seconds, the mean over users; computed: prompt tokens prefilled over the trace)")
    base = results.get("baton")
    for peer, s in results.items():
        if base is None or peer == "baton":
            continue
        later, wall = base["later_ttft"] / s["later_ttft"], base["wall"] / s["wall"]
        ok = lambda v, k: "meets" if v <= TARGETS[k] else "misses"  # noqa: E731
        print(f"baton / {peer}: turns >= 2 TTFT {later:.2f}x ({ok(later, 'later_ttft')} <= {TARGETS['later_ttft']}x), "
              f"wall {wall:.2f}x ({ok(wall, 'wall')} <= {TARGETS['wall']}x), prompt tokens computed "
              f"{base['computed']:.0f} vs {s['computed']:.0f}, peak memory {base['rss'] / s['rss']:.2f}x")  # fmt: skip
    print("settings:")
    for line in servers.values():
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3.5-1.5b", choices=list(SHAPES))
    ap.add_argument("--quant", default="Q4_K_M", choices=QUANTS)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--user-tokens", type=int, default=80)
    ap.add_argument("--reply-tokens", type=int, default=120)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baton-kv-bytes", type=int, default=1 << 30, help="baton's KV + state budget")
    ap.add_argument("--baton-args", default="", help="more flags for baton serve, as one string")
    ap.add_argument("--peers", nargs="+", default=["baton", "llama.cpp", "llama.cpp-tuned"],
                    choices=["baton", "llama.cpp", "llama.cpp-tuned"])  # fmt: skip
    args = ap.parse_args()
    if min(args.users, args.turns, args.system_tokens, args.repeats, args.max_tokens) < 1:
        ap.error("users, turns, system tokens, repeats and max tokens must be positive")
    from transformers import AutoTokenizer

    cache = EnvSettings.read().cache_dir
    path = gguf_file(cache, args.model, args.quant)
    system, users = make_trace(args, AutoTokenizer.from_pretrained(str(hf_dir(cache, args.model))))
    scratch = cache / "bench" / "chat-trace"
    scratch.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[Run]] = {p: [] for p in args.peers}
    settings: dict[str, str] = {}
    for r in range(args.repeats):
        for peer in args.peers:
            server = start(peer, path, args.model, args, cache, scratch)
            try:
                run = asyncio.run(replay(server.url, args.model, system, users, args.max_tokens))
                run.peak_rss_mib = peak_rss_mib(server.proc.pid)
            finally:
                stop_servers([server])
            settings[peer] = server.settings()
            runs[peer].append(run)
            one = summarize([run])
            print(
                f"round {r + 1} {peer}: wall {run.wall:.1f} s, turns >= 2 TTFT {one['later_ttft']:.2f} s, "
                f"computed {one['computed']:,} of {one['prompt']:,}, peak {run.peak_rss_mib:,.0f} MiB",
                flush=True,
            )
    report({p: summarize(v) for p, v in runs.items()}, settings, args, path)


if __name__ == "__main__":
    main()
