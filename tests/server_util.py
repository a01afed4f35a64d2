"""Start `baton serve` as a real process for the HTTP tests, and stop it with SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import requests

from baton.bench.procs import free_port


class ServerProcess:
    """`baton serve ARGS`, healthy when this returns (with `wait=False`: once `wait_healthy()` does,
    so several servers load at once)."""

    def __init__(self, *args: str, timeout: float = 180.0, env: dict | None = None, wait: bool = True) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        # a file, not a pipe: a server that logs much (tracebacks of injected faults) never blocks on it
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "baton.cli", "serve", "--port", str(self.port), *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "BATON_LOG_LEVEL": "WARNING", **(env or {})},
        )
        self.timeout = timeout
        if wait:
            self.wait_healthy()

    def wait_healthy(self) -> None:
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()[-3000:]}")
            try:
                if requests.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        self.proc.kill()
        raise RuntimeError("server did not become healthy")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def terminate(self, timeout: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def metric(self, name: str, headers: dict | None = None) -> float:
        """Sum of a Prometheus metric's samples (all label sets)."""
        text = requests.get(f"{self.base_url}/metrics", headers=headers, timeout=10).text
        total, found = 0.0, False
        for line in text.splitlines():
            if line.startswith(name) and ("{" in name or line[len(name)] in " {"):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        if not found:
            raise KeyError(name)
        return total


class RouterProcess:
    """`baton router ARGS` as a real process, healthy (a worker up) when this returns."""

    def __init__(self, *args: str, timeout: float = 60.0, env: dict | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "baton.cli", "router", "--port", str(self.port), *args]
        env = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if requests.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except requests.ConnectionError:
                time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError("router did not start")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)
