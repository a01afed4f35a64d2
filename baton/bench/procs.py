"""Servers as subprocesses for the benchmark scripts and tests: ports, health, memory, one bench run."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server for {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not healthy after {timeout}s")


def stop_processes(procs, timeout: float = 60) -> None:
    """SIGTERM them all, then wait for each (graceful shutdown), killing one that does not exit."""
    procs = list(procs)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()


def process_tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        children = subprocess.run(["pgrep", "-P", str(p)], capture_output=True, text=True).stdout.split()
        todo.extend(int(c) for c in children)
    return pids


def peak_rss_mib(pid: int) -> float:
    """Peak resident memory (VmHWM) of a process and all its descendants, in MiB
    (vLLM runs its engine core and workers as child processes)."""
    total = 0
    for p in process_tree(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text().splitlines()
        except OSError:  # it exited meanwhile
            continue
        total += next((int(line.split()[1]) for line in status if line.startswith("VmHWM:")), 0)
    return total / 1024


def run_bench(
    url: str, model: str, num_prompts: int, input_len: int, output_len: int, concurrency: int, seed: int, out: Path
) -> dict:
    """One `baton bench serve` run against `url`; returns its saved JSON."""
    cmd = [sys.executable, "-m", "baton.cli", "bench", "serve", "--base-url", url, "--model", model]
    cmd += ["--num-prompts", str(num_prompts), "--input-len", str(input_len), "--output-len", str(output_len)]
    cmd += ["--max-concurrency", str(concurrency), "--seed", str(seed), "--save-json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())
