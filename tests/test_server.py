"""Acceptance of the HTTP server: the official openai client, concurrency, errors, disconnects, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import openai
import pytest
import requests

from baton import SamplingParams
from tests.server_util import ServerProcess

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--api-key", KEY, "--max-request-bytes", "65536", "--max-model-len", str(MAX_MODEL_LEN))
    yield srv
    if srv.proc.poll() is None:
        assert srv.terminate() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY)


def test_openai_client_completion_chat_and_streams_match_generate(server, client, smollm2):
    prompt = "The three largest cities in Europe are"
    expected = smollm2.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0].outputs[0]
    comp = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=24, temperature=0)
    assert comp.choices[0].text == expected.text
    assert comp.usage.completion_tokens == len(expected.token_ids)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="smollm2-135m", prompt=prompt, max_tokens=24, temperature=0, stream=True
        )
    )
    assert streamed == expected.text

    messages = [{"role": "user", "content": "Name two colors."}]
    chat_expected = smollm2.chat(messages, SamplingParams(max_tokens=32, temperature=0.0))[0].outputs[0]
    chat = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=32, temperature=0)
    assert chat.choices[0].message.content == chat_expected.text
    assert chat.choices[0].finish_reason == chat_expected.finish_reason
    stream = client.chat.completions.create(
        model="smollm2-135m",
        messages=messages,
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_expected.text
    assert chunks[-1].usage.completion_tokens == len(chat_expected.token_ids)


def test_token_ids_logprobs_and_stop_strings(server, client, smollm2):
    messages = [{"role": "user", "content": "Count to five."}]
    expected = smollm2.chat(messages, SamplingParams(max_tokens=16, temperature=0.0, logprobs=2))[0]
    r = requests.post(
        f"{server.base_url}/v1/chat/completions",
        headers=AUTH,
        timeout=60,
        json={
            "messages": messages,
            "max_tokens": 16,
            "temperature": 0,
            "return_token_ids": True,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ).json()
    assert r["prompt_token_ids"] == expected.prompt_token_ids
    assert r["choices"][0]["token_ids"] == expected.outputs[0].token_ids
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == len(expected.outputs[0].token_ids) and all(len(c["top_logprobs"]) == 2 for c in content)
    for c, tok, entry in zip(content, expected.outputs[0].token_ids, expected.outputs[0].logprobs):
        assert abs(c["logprob"] - entry[tok].logprob) < 1e-5
    full = client.completions.create(model="smollm2-135m", prompt="One, two, three,", max_tokens=20, temperature=0)
    text = full.choices[0].text
    cut = text.split()[2]
    stopped = client.completions.create(
        model="smollm2-135m", prompt="One, two, three,", max_tokens=20, temperature=0, stop=[cut], stream=True
    )
    assert "".join(c.choices[0].text for c in stopped) == text[: text.index(cut)]


def test_echo_logprobs_scores_the_prompt(server, smollm2):
    """What lm-eval's local-completions sends for loglikelihood: echo, logprobs, max_tokens 0 / 1."""
    ids = smollm2.get_tokenizer().encode("Paris is the capital of France.")
    expected = smollm2.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    for max_tokens in (0, 1):
        r = requests.post(
            f"{server.base_url}/v1/completions",
            headers=AUTH,
            timeout=60,
            json={"prompt": ids, "max_tokens": max_tokens, "echo": True, "logprobs": 1, "temperature": 0},
        ).json()
        lp = r["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + max_tokens and lp["token_logprobs"][0] is None
        for pos in range(1, len(ids)):
            assert abs(lp["token_logprobs"][pos] - expected.prompt_logprobs[pos][ids[pos]].logprob) < 1e-5
        assert r["usage"]["completion_tokens"] == max_tokens


def test_32_concurrent_streaming_chats(server, smollm2):
    questions = [f"Give one fact about the number {i}." for i in range(32)]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    expected = [o.outputs[0].text for o in smollm2.chat([[{"role": "user", "content": q}] for q in questions], params)]
    aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=KEY)

    async def one(q: str) -> str:
        stream = await aclient.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": q}], max_tokens=10, temperature=0, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_of_them():
        return await asyncio.gather(*[one(q) for q in questions])

    assert asyncio.run(all_of_them()) == expected


def _post(server, path: str, body, headers=AUTH, raw: bytes | None = None):
    return requests.post(
        f"{server.base_url}{path}",
        headers=headers,
        timeout=30,
        **({"data": raw} if raw is not None else {"json": body}),
    )


def _assert_error(r, status: int, param: str | None = None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    assert "Traceback" not in r.text
    if param is not None:
        assert err["param"] == param


def test_error_negative_temperature(server):
    _assert_error(_post(server, "/v1/completions", {"prompt": "hi", "temperature": -0.5}), 400, "temperature")


def test_error_max_tokens_past_context(server):
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN})
    _assert_error(r, 400)
    assert "exceeds the context" in r.json()["error"]["message"]


def test_error_prompt_longer_than_max_model_len(server):
    r = _post(server, "/v1/completions", {"prompt": [1] * (MAX_MODEL_LEN + 5), "max_tokens": 1})
    _assert_error(r, 400)
    assert f"{MAX_MODEL_LEN + 5} tokens" in r.json()["error"]["message"]


def test_error_malformed_json(server):
    _assert_error(
        _post(
            server,
            "/v1/completions",
            None,
            headers={**AUTH, "Content-Type": "application/json"},
            raw=b'{"prompt": "hi",',
        ),
        400,
    )


def test_error_wrong_types(server):
    _assert_error(_post(server, "/v1/completions", {"prompt": "hi", "max_tokens": "many"}), 400, "max_tokens")
    _assert_error(_post(server, "/v1/chat/completions", {"messages": "hello"}), 400, "messages")


def test_error_unknown_model(server):
    _assert_error(_post(server, "/v1/completions", {"prompt": "hi", "model": "gpt-9"}), 404, "model")


def test_error_body_too_large(server):
    _assert_error(_post(server, "/v1/completions", {"prompt": "x" * 70_000}), 413)


def test_error_missing_or_wrong_api_key(server):
    _assert_error(_post(server, "/v1/completions", {"prompt": "hi"}, headers={}), 401)
    _assert_error(_post(server, "/v1/completions", {"prompt": "hi"}, headers={"Authorization": "Bearer nope"}), 401)


def test_health_models_tokenize_detokenize(server, smollm2):
    assert requests.get(f"{server.base_url}/health", timeout=5).status_code == 200
    models = requests.get(f"{server.base_url}/v1/models", headers=AUTH, timeout=5).json()
    assert models["data"][0]["id"] == "smollm2-135m"
    for path, body in (("/tokenize", {"prompt": "Hello world"}), ("/detokenize", {"tokens": [1, 2]})):
        _assert_error(requests.post(f"{server.base_url}{path}", json=body, timeout=5), 401)  # behind the key
    toks = requests.post(f"{server.base_url}/tokenize", json={"prompt": "Hello world"}, headers=AUTH, timeout=5).json()
    assert toks["tokens"] == smollm2.get_tokenizer().encode("Hello world") and toks["count"] == len(toks["tokens"])
    body = {"tokens": toks["tokens"]}
    text = requests.post(f"{server.base_url}/detokenize", json=body, headers=AUTH, timeout=5).json()
    assert text["prompt"] == "Hello world"
    assert requests.get(f"{server.base_url}/metrics", timeout=5).status_code == 200  # open, as Prometheus expects


def test_disconnects_free_the_kv_and_the_server_still_answers(server, client):
    before = server.metric("baton_requests_total")

    def disconnect_mid_stream(i: int) -> None:
        with requests.post(
            f"{server.base_url}/v1/completions",
            headers=AUTH,
            stream=True,
            timeout=60,
            json={"prompt": f"Story number {i}:", "max_tokens": 400, "ignore_eos": True, "stream": True},
        ) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= 3:
                    break  # closing the response drops the connection mid-stream

    threads = [threading.Thread(target=disconnect_mid_stream, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.time() + 30
    while time.time() < deadline and (
        server.metric("baton_kv_blocks_used") > 0 or server.metric("baton_num_requests_running") > 0
    ):
        time.sleep(0.2)
    assert server.metric("baton_kv_blocks_used") == 0
    assert server.metric("baton_num_requests_running") == 0 and server.metric("baton_num_requests_waiting") == 0
    text = requests.get(f"{server.base_url}/metrics", timeout=5).text
    assert 'baton_requests_total{outcome="abort"}' in text
    assert server.metric("baton_requests_total") >= before + 20
    ok = client.completions.create(model="smollm2-135m", prompt="Still there?", max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")
    for name in (
        "baton_time_to_first_token_seconds_count",
        "baton_e2e_request_latency_seconds_count",
        "baton_prefix_cache_queried_tokens_total",
        "baton_preemptions_total",
    ):
        server.metric(name)  # present


def test_sigterm_finishes_or_aborts_and_exits_cleanly():
    srv = ServerProcess("--max-model-len", "512")
    results: list = []

    def long_request() -> None:
        try:
            r = requests.post(
                f"{srv.base_url}/v1/completions",
                timeout=120,
                json={"prompt": "Tell a long story.", "max_tokens": 60, "ignore_eos": True},
            )
            results.append(r.status_code)
        except requests.RequestException as e:
            results.append(type(e).__name__)

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(1.0)
    assert srv.terminate(timeout=90) == 0
    t.join(timeout=30)
    assert not t.is_alive() and results  # finished (200) or refused, never hung
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{srv.base_url}/health", timeout=2)
    json.dumps(results)


def test_bad_requests_do_not_disturb_a_running_stream(server, client, smollm2):
    prompt = "A list of ten fruits:"
    expected = smollm2.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    stream = client.completions.create(
        model="smollm2-135m", prompt=prompt, max_tokens=40, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    pieces = [next(stream).choices[0].text]
    for bad in (
        {"prompt": "x", "top_p": 0},
        {"prompt": [10**9]},
        {"prompt": "x", "n": 0},
        {"prompt": []},
        {"prompt": "x", "structured_outputs": {"regex": "([0-9]"}},  # an output constraint that does not compile
        {"prompt": "x", "grammar": "root ::= nowhere"},
        {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
    ):
        assert _post(server, "/v1/completions", bad).status_code == 400
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    unknown = {"type": "function", "function": {"name": "g"}}
    chat = {"messages": [{"role": "user", "content": "x"}], "tools": [tool], "tool_choice": unknown}
    assert _post(server, "/v1/chat/completions", chat).status_code == 400
    pieces += [c.choices[0].text for c in stream]
    assert "".join(pieces) == expected.outputs[0].text
