"""vLLM's and OpenAI's request fields: honoured where baton has the meaning (whitespace_pattern,
continuous_usage_stats), accepted and logged where it has none (structural_tag, unknown fields),
and bounded like every other field."""

from __future__ import annotations

import json

import pytest
import requests

from tests.server_util import ServerProcess

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def server():
    s = ServerProcess()
    yield s
    s.terminate()


def _post(server, route: str, **body) -> requests.Response:
    body = {"model": "smollm2-135m", "temperature": 0.0, "max_tokens": 24, **body}
    return requests.post(f"{server.base_url}/v1/{route}", json=body, timeout=120, stream=body.get("stream", False))


def _chat(server, **body) -> requests.Response:
    return _post(server, "chat/completions", messages=[{"role": "user", "content": "Name and age?"}], **body)


def test_vllms_structured_output_fields_are_accepted_and_whitespace_pattern_honoured(server, caplog):
    for extra in ({"whitespace_pattern": r"\n"}, {"disable_any_whitespace": True}, {"structural_tag": {"x": 1}}):
        r = _chat(server, max_tokens=40, structured_outputs={"json": SCHEMA, **extra})
        assert r.status_code == 200, (extra, r.text)
        reply = r.json()["choices"][0]["message"]["content"]
        if r.json()["choices"][0]["finish_reason"] == "stop":
            json.loads(reply)
        if "whitespace_pattern" in extra:
            assert "\n" in reply and ", " not in reply  # the pattern, not baton's compact separators
    r = _chat(server, guided_json=SCHEMA, guided_whitespace_pattern=r"\n", max_tokens=40)
    assert r.status_code == 200 and "\n" in r.json()["choices"][0]["message"]["content"]
    for bad in ({"whitespace_pattern": "x" * 300}, {"whitespace_pattern": "(unclosed"}):
        r = _chat(server, structured_outputs={"json": SCHEMA, **bad})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", bad


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_continuous_usage_stats_put_the_counts_so_far_in_every_chunk(server, route):
    extra = {"messages": [{"role": "user", "content": "Count to ten."}]} if "chat" in route else {"prompt": "1, 2, 3,"}
    opts = {"include_usage": True, "continuous_usage_stats": True}
    seen = []
    with _post(server, route, stream=True, stream_options=opts, max_tokens=12, ignore_eos=True, **extra) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                assert "usage" in chunk, chunk
                seen.append(chunk["usage"]["completion_tokens"])
    assert seen == sorted(seen) and seen[-1] == 12 and len(seen) > 3


def test_fields_other_servers_take_are_ignored_not_refused(server):
    r = _chat(server, max_tokens=4, service_tier="auto", reasoning_effort="low", store=False, metadata={"a": "b"})
    assert r.status_code == 200
