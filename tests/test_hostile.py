"""A hostile or careless client hurts nobody else: poison requests beside a live stream, hang-ups
of non-streamed requests, a full queue, closed internal routes."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import requests

from baton import SamplingParams
from tests.server_util import ServerProcess

VOCAB = 49152  # SmolLM2
VICTIM = {"prompt": "A list of twenty fruits:", "max_tokens": 120, "temperature": 0, "ignore_eos": True}

# every one must be answered 4xx in OpenAI's shape, quickly, and harm nothing else
POISON: list[tuple[str, dict | bytes, int]] = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [VOCAB + 5]}, 400),
    ("/v1/completions", {"prompt": "x", "stream": True, "stop_token_ids": [VOCAB]}, 400),
    ("/v1/completions", {"prompt": "x", "seed": 2**70}, 400),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(VOCAB + 1): 5}}, 400),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"10": 1000}}, 400),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"ten": 1}}, 400),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [3, VOCAB]}, 400),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, 400),
    ("/v1/completions", {"prompt": "x", "bad_words": [5]}, 400),
    ("/v1/completions", {"prompt": [VOCAB], "max_tokens": 2}, 400),
    ("/v1/completions", {"prompt": [[1, 2], [-3]], "max_tokens": 2}, 400),
    ("/v1/completions", {"prompt": [[]], "max_tokens": 2}, 400),
    ("/v1/completions", {"prompt": ["x"] * 40_000, "n": 16, "max_tokens": 1}, 400),
    ("/v1/completions", {"prompt": "x", "top_k": 2**70}, 400),
    ("/v1/completions", {"prompt": "x", "n": 17}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2**70}, 400),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400),
    ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
    ("/v1/completions", b"[1, 2, 3]", 400),
    ("/v1/completions", b"\xff\xfe not json", 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 50}, 400),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": True}},
        400,
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": [1]}},
        400,
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "enable_thinking": "maybe"}, 400),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": {}, "whitespace_pattern": "(("}}, 400),
    ("/v1/completions", {"prompt": "x", "guided_json": {}, "guided_whitespace_pattern": " " * 300}, 400),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": "x"}}, 400),
    ("/v1/responses", {"input": []}, 400),
    ("/v1/responses", {"input": "x", "max_output_tokens": 0}, 400),
    ("/v1/responses", {"input": [{"type": "message", "role": "wizard", "content": "x"}]}, 400),
    ("/v1/responses", {"input": "x", "previous_response_id": "resp_" + "0" * 32}, 404),
    ("/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": "always"}, 400),
    ("/v1/internal/prefill", {"prompt": "x"}, 401),
    ("/v1/internal/kv", b"BATONKV3", 401),
]


@pytest.fixture(scope="module")
def server():
    limits = ("--max-num-seqs", "2", "--max-waiting-requests", "4", "--max-sequences-per-request", "64")
    srv = ServerProcess("--max-model-len", "1024", *limits)
    yield srv
    if srv.proc.poll() is None:
        assert srv.terminate() == 0


def _post(server, path: str, body, timeout: float = 60, **kw) -> requests.Response:
    if isinstance(body, bytes):
        return requests.post(
            f"{server.base_url}{path}", data=body, headers={"Content-Type": "application/json"}, timeout=timeout, **kw
        )
    return requests.post(f"{server.base_url}{path}", json=body, timeout=timeout, **kw)


def _stream_text(r: requests.Response) -> str:
    text = ""
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            event = json.loads(line[6:])
            assert "error" not in event, event
            text += event["choices"][0]["text"]
    return text


def _wait_idle(server, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.metric("baton_kv_blocks_used") == 0 and server.metric("baton_num_requests_running") == 0:
            return
        time.sleep(0.1)
    raise AssertionError("the server did not go idle: KV blocks or requests leaked")


def test_poison_requests_beside_a_live_stream(server, smollm2):
    expected = smollm2.generate([VICTIM["prompt"]], SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True))
    expected_text = expected[0].outputs[0].text
    with _post(server, "/v1/completions", {**VICTIM, "stream": True}, stream=True) as victim:
        lines = victim.iter_lines()
        first = next(line for line in lines if line.startswith(b"data: "))
        for path, body, status in POISON:
            r = _post(server, path, body, timeout=30)
            assert r.status_code == status, (path, body if isinstance(body, dict) else body[:40], r.text[:300])
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
        rest = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines if line.startswith(b"data: {"))
    assert json.loads(first[6:])["choices"][0]["text"] + rest == expected_text
    assert server.metric("baton_engine_step_failures_total") == 0
    again = _post(server, "/v1/completions", VICTIM).json()["choices"][0]["text"]
    assert again == expected_text
    _wait_idle(server)


def test_unknown_kv_transfer_id_is_prefilled_here(server):
    body = {"prompt": "The sky is", "max_tokens": 4, "temperature": 0, "kv_transfer_id": "never-parked"}
    r = _post(server, "/v1/completions", body, timeout=30)
    assert r.status_code == 200
    del body["kv_transfer_id"]
    assert r.json()["choices"][0]["text"] == _post(server, "/v1/completions", body).json()["choices"][0]["text"]


def _hang_up_after(server, body: dict, seconds: float) -> None:
    """Send a non-streamed request on a raw socket and close it without reading the answer."""
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        time.sleep(seconds)


def test_a_hung_up_non_streamed_request_is_aborted_and_frees_its_kv(server):
    aborted = _aborted(server)
    body = {"prompt": "Count to a thousand:", "max_tokens": 900, "ignore_eos": True, "temperature": 0}
    threads = [threading.Thread(target=_hang_up_after, args=(server, body, 0.8)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # 900 tokens would take many seconds: the abort must come within a step or two of the hang-up
    deadline = time.time() + 3
    while time.time() < deadline and server.metric("baton_num_requests_running") > 0:
        time.sleep(0.05)
    assert server.metric("baton_num_requests_running") == 0
    _wait_idle(server, timeout=2)
    assert _aborted(server) >= aborted + 3


def _aborted(server) -> float:
    try:
        return server.metric('baton_requests_total{outcome="abort"')
    except KeyError:  # none yet
        return 0.0


def test_a_full_queue_answers_503_with_retry_after(server):
    """Two sequences run at a time and four may wait: a seventh request is refused at once."""
    body = {"prompt": "Tell a story:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    streams = []
    try:
        for i in range(6):  # one at a time, each in the scheduler before the next is sent
            streams.append(_post(server, "/v1/completions", body, stream=True))
            assert streams[-1].status_code == 200
            deadline = time.time() + 30
            while time.time() < deadline and _in_scheduler(server) < i + 1:
                time.sleep(0.02)
        assert server.metric("baton_num_requests_waiting") == 4
        r = _post(server, "/v1/completions", {**body, "stream": False}, timeout=10)
        assert r.status_code == 503 and r.headers.get("Retry-After") and r.json()["error"]["code"] == 503
        assert server.metric('baton_requests_rejected_total{reason="queue_full"') >= 1
    finally:
        for stream in streams:
            stream.close()  # hang up: all six are aborted
    _wait_idle(server)
    assert server.metric("baton_num_requests_waiting") == 0


def _in_scheduler(server) -> float:
    return server.metric("baton_num_requests_running") + server.metric("baton_num_requests_waiting")


def test_a_plain_server_has_no_internal_routes(server):
    r = requests.post(f"{server.base_url}/v1/internal/kv", data=b"x", headers={"Authorization": "Bearer x"}, timeout=5)
    assert r.status_code == 401  # no kv secret configured: the guard refuses before any route
    assert "openapi" not in r.text
    spec = requests.get(f"{server.base_url}/openapi.json", timeout=5).json()
    assert not [p for p in spec["paths"] if p.startswith("/v1/internal")]
