"""Prefill/decode disaggregation over HTTP: router, workers that differ in block size and layout,
fallback to a local prefill when the prefill side dies or a span is refused."""

from __future__ import annotations

import hashlib
import hmac
import os
import signal
import subprocess
import sys
import threading

import pytest
import requests

from baton.bench.procs import process_tree, wait_healthy
from tests.server_util import RouterProcess, ServerProcess, free_port

PROMPTS = [
    "Hi",  # shorter than a block
    "The quick brown fox jumps over the lazy dog and then",  # about one 16-token block
    "Write a long story about a lighthouse keeper. " * 60,  # ~600 tokens: past Gemma3's 512 window
]


KEY = "pd-test-key"  # every process runs with --api-key
SECRET = "pd-test-kv-secret"  # and the deployment's own kv secret, through the environment
SECRET_ENV = {"BATON_KV_SECRET": SECRET}
AUTH = {"Authorization": f"Bearer {KEY}"}
INTERNAL = {"Authorization": f"Bearer {SECRET}"}


def pd_router(prefill: list[str], decode: list[str], span_format: str = "grouped") -> RouterProcess:
    args = ["--decode", *decode, "--span-format", span_format, "--api-key", KEY]
    return RouterProcess(*args, *(["--prefill", *prefill] if prefill else []), env=SECRET_ENV)


@pytest.fixture(
    scope="module",
    params=[("smollm2-135m", "grouped"), pytest.param(("gemma3-270m", "dense"), marks=pytest.mark.slow)],
    ids=lambda p: p[0],
)
def trio(request):
    model, span_format = request.param
    keyed = ("--model", model, "--api-key", KEY)
    prefill = ServerProcess(*keyed, "--kv-role", "prefill", "--block-size", "16", env=SECRET_ENV, wait=False)
    decode = ServerProcess(
        *keyed, "--kv-role", "decode", "--block-size", "64", "--kv-layout", "HND", env=SECRET_ENV, wait=False
    )
    prefill.wait_healthy()  # the two load at once
    decode.wait_healthy()
    router = pd_router([prefill.base_url], [decode.base_url], span_format)
    router.model = model
    yield prefill, decode, router
    router.stop()
    for srv in (prefill, decode):
        if srv.proc.poll() is None:
            srv.terminate()


def _complete(base: str, prompt: str, stream: bool = False, max_tokens: int = 16, **sampling) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream, **sampling}
    r = requests.post(f"{base}/v1/completions", json=body, timeout=120, stream=stream, headers=AUTH)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["text"]
    import json

    text = ""
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_router_outputs_equal_the_decode_workers_own(trio):
    _, decode, router = trio
    before = decode.metric('baton_prefills_total{where="remote"')
    for prompt in PROMPTS:
        expected = _complete(decode.base_url, prompt)
        assert _complete(router.base_url, prompt) == expected
        assert _complete(router.base_url, prompt, stream=True) == expected
    expected_remote = 2 * len(PROMPTS)
    if router.model == "smollm2-135m":  # the Gemma3 GGUF ships no chat template
        body = {"messages": [{"role": "user", "content": "Name a planet."}], "max_tokens": 12, "temperature": 0}
        direct = requests.post(f"{decode.base_url}/v1/chat/completions", timeout=60, json=body, headers=AUTH).json()
        routed = requests.post(f"{router.base_url}/v1/chat/completions", timeout=60, json=body, headers=AUTH).json()
        assert routed["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
        expected_remote += 1
    assert decode.metric('baton_prefills_total{where="remote"') - before == expected_remote
    assert decode.metric("baton_kv_blocks_used") == 0


def test_refused_span_falls_back_to_a_local_prefill(trio):
    _, decode, _ = trio
    rejected = decode.metric("baton_kv_imports_rejected_total")
    tid = requests.post(
        f"{decode.base_url}/v1/internal/kv", data=b"BATONKV3 not a span", timeout=10, headers=INTERNAL
    ).json()
    body = {"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0, "kv_transfer_id": tid["kv_transfer_id"]}
    r = requests.post(f"{decode.base_url}/v1/completions", json=body, timeout=60, headers=AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == _complete(decode.base_url, PROMPTS[1])
    assert decode.metric("baton_kv_imports_rejected_total") == rejected + 1


def test_internal_routes_need_the_secret(trio):
    prefill, decode, _ = trio
    for headers in ({}, {"Authorization": "Bearer wrong"}, AUTH):  # a tenant's API key is not the secret
        assert (
            requests.post(f"{decode.base_url}/v1/internal/kv", data=b"x", timeout=10, headers=headers).status_code
            == 401
        )
        r = requests.post(f"{prefill.base_url}/v1/internal/prefill", json={"prompt": "x"}, timeout=10, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # each worker opens only the route its role needs
    r = requests.post(f"{prefill.base_url}/v1/internal/kv", data=b"x", timeout=10, headers=INTERNAL)
    assert r.status_code == 404
    r = requests.post(f"{decode.base_url}/v1/internal/prefill", json={"prompt": "x"}, timeout=10, headers=INTERNAL)
    assert r.status_code == 404


def test_a_forged_span_is_refused_before_any_write(trio):
    """Right checksums, wrong HMAC: a client without the secret cannot import KV it made up."""
    prefill, decode, router = trio
    blob = requests.post(
        f"{prefill.base_url}/v1/internal/prefill",
        params={"format": "dense" if router.model == "gemma3-270m" else "grouped"},
        json={"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0},
        timeout=60,
        headers=INTERNAL,
    ).content
    signed = blob[:-32]
    assert blob[-32:] == hmac.new(SECRET.encode(), signed, hashlib.sha256).digest()  # the real one is signed
    forged = signed + hmac.new(b"not the secret", signed, hashlib.sha256).digest()
    rejected = decode.metric("baton_kv_imports_rejected_total")
    remote = decode.metric('baton_prefills_total{where="remote"')
    tid = requests.post(f"{decode.base_url}/v1/internal/kv", data=forged, timeout=10, headers=INTERNAL).json()
    body = {"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0, "kv_transfer_id": tid["kv_transfer_id"]}
    r = requests.post(f"{decode.base_url}/v1/completions", json=body, timeout=60, headers=AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == _complete(decode.base_url, PROMPTS[1])
    assert decode.metric("baton_kv_imports_rejected_total") == rejected + 1
    assert decode.metric('baton_prefills_total{where="remote"') == remote
    assert decode.metric("baton_kv_blocks_used") == 0


def test_a_seeded_sampled_request_through_the_router_equals_the_lone_worker(trio):
    _, decode, router = trio
    sampling = {"temperature": 1.0, "seed": 2**63 + 12345, "ignore_eos": True}
    before = decode.metric('baton_prefills_total{where="remote"')
    routed = _complete(router.base_url, PROMPTS[1], max_tokens=24, **sampling)
    assert decode.metric('baton_prefills_total{where="remote"') == before + 1  # it went through a handoff
    assert routed == _complete(decode.base_url, PROMPTS[1], max_tokens=24, **sampling)
    assert routed != _complete(decode.base_url, PROMPTS[1], max_tokens=24, **{**sampling, "seed": 1})


def test_killing_the_prefill_worker_never_hangs_a_request(trio):
    prefill, decode, trio_router = trio
    if trio_router.model != "smollm2-135m":
        pytest.skip("one model is enough to show the fallback")
    router = pd_router([prefill.base_url], [decode.base_url])  # its own router: the trio's stays intact
    expected = _complete(decode.base_url, PROMPTS[2], max_tokens=24)
    results: list = []

    def client() -> None:
        try:
            results.append(_complete(router.base_url, PROMPTS[2], max_tokens=24))
        except Exception as e:  # a clear failure is allowed, a hang is not
            results.append(e)

    threads = [threading.Thread(target=client) for _ in range(6)]
    for i, t in enumerate(threads):
        t.start()
        if i == 2:
            prefill.proc.kill()
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads)
    assert len(results) == 6 and all(r == expected for r in results), results
    local = float(
        next(
            line.split()[-1]
            for line in requests.get(f"{router.base_url}/metrics", timeout=5).text.splitlines()
            if line.startswith('baton_router_prefills_total{where="local"')
        )
    )
    assert local >= 1
    router.stop()


@pytest.mark.slow
def test_baton_pd_stops_its_workers_and_router_on_sigterm():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton.cli", "pd", "--model", "smollm2-135m", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=300)
        r = requests.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 4},
            timeout=120,
        )
        assert r.status_code == 200
        children = process_tree(proc.pid)[1:]
        assert len(children) >= 3  # prefill worker, decode worker, router
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
        for pid in children:
            assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]
    finally:
        if proc.poll() is None:
            proc.kill()
