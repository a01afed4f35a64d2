"""Disaggregated (router -> prefill worker -> decode worker) against one lone worker.

For every cell of inputs {128, 2000} x outputs {32, 128} x concurrency {1, 4}: token agreement of
the routed greedy outputs with the lone worker's, remote and local prefill counts, request
errors, and TTFT / output tokens/s with and without the handoff (`baton bench serve`, medians of
--repeats runs). Workers differ as in a real deployment: prefill block 16 NHD, decode block 64 HND.
    python -m bench.pd_matrix [--model smollm2-135m] [--repeats 3] [--prompts-per-stream 2]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import urllib.request
from pathlib import Path
from tempfile import TemporaryDirectory

from baton.bench.procs import run_bench, stop_processes, wait_healthy
from baton.bench.serve import random_prompts

CELLS = [(i, o, c) for i in (128, 2000) for o in (32, 128) for c in (1, 4)]


KV_SECRET = secrets.token_hex(32)  # shared by the workers and the router, through the environment


def start(args: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton.cli", *args, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "BATON_KV_SECRET": KV_SECRET},
    )
    wait_healthy(f"http://127.0.0.1:{port}", proc, 300)
    return proc


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1200) as r:
        return json.loads(r.read())


def metric(url: str, prefix: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts-per-stream", type=int, default=2)
    ap.add_argument("--port", type=int, default=8300)
    args = ap.parse_args()
    serve = ["serve", "--model", args.model, "--served-model-name", args.model, "--max-model-len", "4096"]
    ports = {name: args.port + k for k, name in enumerate(("prefill", "decode", "lone", "router"))}
    url = {name: f"http://127.0.0.1:{p}" for name, p in ports.items()}
    procs = []
    try:
        procs.append(start([*serve, "--kv-role", "prefill", "--block-size", "16"], ports["prefill"]))
        procs.append(
            start([*serve, "--kv-role", "decode", "--block-size", "64", "--kv-layout", "HND"], ports["decode"])
        )
        procs.append(start(serve, ports["lone"]))
        procs.append(start(["router", "--prefill", url["prefill"], "--decode", url["decode"]], ports["router"]))
        rows = []
        with TemporaryDirectory() as tmp:
            for cell, (i, o, c) in enumerate(CELLS):
                n = args.prompts_per_stream * c
                prompts = random_prompts(n, i, seed=1000 + i + o + c)
                agree = 0
                for p in prompts:
                    body = {
                        "model": args.model,
                        "prompt": p,
                        "max_tokens": o,
                        "temperature": 0,
                        "ignore_eos": True,
                        "return_token_ids": True,
                    }
                    a = post(f"{url['router']}/v1/completions", body)["choices"][0]["token_ids"]
                    b = post(f"{url['lone']}/v1/completions", body)["choices"][0]["token_ids"]
                    agree += a == b
                remote0 = metric(url["router"], 'baton_router_prefills_total{where="remote"')
                local0 = metric(url["router"], 'baton_router_prefills_total{where="local"')
                runs = {"router": [], "lone": []}
                for r in range(args.repeats):
                    # fresh prompts for every cell and repeat: a prompt seen before would be a prefix-cache hit
                    seed = 100 * cell + r
                    for name in ("router", "lone"):
                        runs[name].append(run_bench(url[name], args.model, n, i, o, c, seed, Path(tmp) / "b.json"))
                remote = metric(url["router"], 'baton_router_prefills_total{where="remote"') - remote0
                local = metric(url["router"], 'baton_router_prefills_total{where="local"') - local0

                def med(name: str, key: str, stat: str | None = None, runs=runs) -> float:
                    return statistics.median(x[key][stat] if stat else x[key] for x in runs[name])

                rows.append(
                    (
                        i,
                        o,
                        c,
                        f"{agree}/{n}",
                        int(remote),
                        int(local),
                        int(sum(x["failed"] for xs in runs.values() for x in xs)),
                        med("router", "ttft_ms", "median"),
                        med("lone", "ttft_ms", "median"),
                        med("router", "output_throughput"),
                        med("lone", "output_throughput"),
                    )
                )
                print(rows[-1], flush=True)
        print(f"\n{args.model}, prefill fp32 block 16 NHD -> decode fp32 block 64 HND; medians of {args.repeats}")
        print(
            f"{'in':>5} {'out':>4} {'conc':>4} {'agree':>6} {'remote':>6} {'local':>5} {'errors':>6} "
            f"{'TTFT pd':>8} {'TTFT 1':>8} {'tok/s pd':>9} {'tok/s 1':>8}"
        )
        for r in rows:
            print(
                f"{r[0]:>5} {r[1]:>4} {r[2]:>4} {r[3]:>6} {r[4]:>6} {r[5]:>5} {r[6]:>6} "
                f"{r[7]:>8.0f} {r[8]:>8.0f} {r[9]:>9.1f} {r[10]:>8.1f}"
            )
    finally:
        stop_processes(procs)


if __name__ == "__main__":
    main()
