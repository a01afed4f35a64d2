"""`baton serve` over two ranks: as one host and as two "hosts" (two process groups on loopback,
torchrun's conventions), the same tokens as one rank; a rank that dies takes the worker down
(503, then a non-zero exit), never a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests

from baton.bench.procs import free_port, process_tree
from tests.server_util import ServerProcess

PROMPT = {
    "model": "smollm2-135m",
    "prompt": "The three most useful things to know about paged attention are",
    "max_tokens": 24,
    "temperature": 0,
}
# the float GGUF kernel: SmolLM2's 3 KV heads split 2 / 1 over two ranks, cutting the integer
# kernels' K parts of o_proj (tests/test_tensor_parallel.py has the int8 kernels' exact TP)
SMALL = ("--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20), "--quant-kernel", "float")


def _complete(server: ServerProcess) -> list[str]:
    r = requests.post(f"{server.base_url}/v1/completions", json=PROMPT, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.slow
def test_two_hosts_on_loopback_give_the_one_rank_tokens():
    one = ServerProcess(*SMALL)
    try:
        expected = _complete(one)
    finally:
        one.terminate()
    port = free_port()
    common = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(port), *SMALL]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "baton.cli", "serve", "--node-rank", "1", *common],
        env={**os.environ, "BATON_LOG_LEVEL": "WARNING", "BATON_NUM_THREADS": "1"},
    )
    try:
        os.environ["BATON_NUM_THREADS"] = "1"
        try:
            node0 = ServerProcess("--node-rank", "0", *common)
        finally:
            del os.environ["BATON_NUM_THREADS"]
        try:
            assert _complete(node0) == expected
        finally:
            assert node0.terminate() == 0
        assert node1.wait(timeout=60) == 0  # the driver's stop ends the other host's ranks cleanly
    finally:
        if node1.poll() is None:
            node1.kill()


@pytest.mark.slow  # 19 s
def test_a_rank_that_dies_takes_the_worker_down_without_a_hang():
    server = ServerProcess("--tensor-parallel-size", "2", *SMALL)
    try:
        _complete(server)
        ranks = [p for p in process_tree(server.proc.pid) if p != server.proc.pid]
        assert ranks, "the driver started no rank process"
        answers: list = []

        def stream() -> None:
            try:
                body = {**PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
                with requests.post(f"{server.base_url}/v1/completions", json=body, stream=True, timeout=60) as r:
                    answers.append((r.status_code, b"".join(r.iter_content(None))))
            except requests.RequestException as e:
                answers.append(e)

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(1.0)
        os.kill(ranks[0], signal.SIGKILL)
        t.join(timeout=30)
        assert not t.is_alive(), "the in-flight request hung"
        code = server.proc.wait(timeout=30)
        assert code != 0
        assert answers and (isinstance(answers[0], Exception) or b"error" in answers[0][1] or answers[0][0] != 200)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
