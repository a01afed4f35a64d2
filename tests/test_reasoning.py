"""Reasoning parsers (baton/server/reasoning.py): thoughts apart from the answer, the same whether
streamed or not, and chat template variables checked before they reach the template."""

from __future__ import annotations

import json
import re

import pytest
import requests

from baton.server.reasoning import PARSERS
from tests.server_util import ServerProcess

TEXTS = [
    "<think>first I add 2 and 2</think>The answer is 4.",
    "<think>unfinished thought",
    "plain answer, no thoughts",
    "thoughts without the opening tag</think>\n\nanswer",
    "<think></think>",
    "<thi",
    "a < b and </thin are not tags</think>x",
]


@pytest.mark.parametrize("name", list(PARSERS))
@pytest.mark.parametrize("opened", [False, True])
def test_a_stream_only_grows_and_adds_up_to_the_finished_split(name, opened):
    parser = PARSERS[name]
    for text in TEXTS:
        final = parser.split(text, opened, True)
        sent = ("", "")
        for n in range(len(text) + 1):
            now = parser.split(text[:n], opened, n == len(text))
            assert now[0].startswith(sent[0]) and now[1].startswith(sent[1]), (name, text, n)
            sent = now
        assert sent == final
        assert "".join(final) in (text, text.replace("<think>", "", 1).replace("</think>", "", 1)), (name, text)


def test_the_parsers_split_as_vllms_do():
    qwen3, r1 = PARSERS["qwen3"], PARSERS["deepseek_r1"]
    assert qwen3.split("<think>a</think>b", False, True) == ("a", "b")
    assert qwen3.split("no thinking", False, True) == ("", "no thinking")
    assert qwen3.split("a</think>b", True, True) == ("a", "b")  # the template opened it
    assert r1.split("a</think>b", False, True) == ("a", "b")
    assert r1.split("still thinking", False, True) == ("still thinking", "")


THINK = r"<think>[a-z ]{5,30}</think>[A-Za-z ]{5,30}"


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--reasoning-parser", "qwen3", "--no-ui")
    yield s
    s.terminate()


def _chat(server, **extra) -> requests.Response:
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": "What is 2 + 2? Think first."}],
        "max_tokens": 48,
        "temperature": 0.0,
        **extra,
    }
    return requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120, stream=extra.get("stream"))


def test_thoughts_and_answer_apart_streamed_as_not(server):
    # thinking off: the constraint holds from the first token (as vLLM), here one that thinks anyway
    forced = {"structured_outputs": {"regex": THINK}, "chat_template_kwargs": {"enable_thinking": False}}
    message = _chat(server, **forced).json()["choices"][0]["message"]
    # the regex's two parts, the tags between them gone
    assert re.fullmatch(r"[a-z ]{5,30}", message["reasoning_content"])
    assert re.fullmatch(r"[A-Za-z ]{5,30}", message["content"])
    reasoning = content = ""
    with _chat(server, stream=True, **forced) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    reasoning += choice["delta"].get("reasoning_content") or ""
                    content += choice["delta"].get("content") or ""
    assert (reasoning, content) == (message["reasoning_content"], message["content"])
    plain = _chat(server, max_tokens=8).json()["choices"][0]["message"]
    assert plain["reasoning_content"] is None and plain["content"]


def test_template_variables_reach_the_template_and_reserved_ones_are_refused(server):
    assert _chat(server, max_tokens=4, chat_template_kwargs={"enable_thinking": False}).status_code == 200
    assert _chat(server, max_tokens=4, enable_thinking=True).status_code == 200
    for bad in ({"chat_template": "{{ 7 * 7 }}"}, {"tokenize": True}, {"__class__": 1}, {str(i): 1 for i in range(17)}):
        r = _chat(server, max_tokens=4, chat_template_kwargs=bad)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", bad
    assert _chat(server, max_tokens=4, chat_template_kwargs={"x": "y" * 5000}).status_code == 400


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "unit": {"enum": ["apples", "pears"]}},
    "required": ["answer", "unit"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("thinking", ["optional", "open"])
def test_a_constraint_after_thinking_holds_once_the_thinking_ends(smollm2, thinking):
    from baton.sampling_params import StructuredOutputsParams

    spec = StructuredOutputsParams(json=SCHEMA, thinking=thinking)
    tok = smollm2.engine.tokenizer

    def accepts(text: str) -> bool:
        matcher = smollm2.engine.structured.matcher(spec)
        return all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and (
            matcher.is_accepting()
        )

    answer = '{"answer": 4, "unit": "pears"}'
    assert accepts(f"<think>2 pears and 2 pears {{not json}}</think>\n\n{answer}")
    assert not accepts('<think>x</think>{"answer": "four", "unit": "pears"}')  # the schema, after the thinking
    assert not accepts("<think>x</think>plain words")
    assert accepts(f"still thinking</think>{answer}") == (thinking == "open")
    assert accepts(answer) == (thinking == "optional")  # optional: no thinking at all


def test_a_json_schema_reply_validates_with_a_reasoning_parser(server):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    message = _chat(server, response_format=fmt).json()["choices"][0]["message"]
    jsonschema.validate(json.loads(message["content"]), SCHEMA)


def test_no_ui_serves_no_page(server):  # this module's server runs with --no-ui (the page: test_chat_page.py)
    assert requests.get(f"{server.base_url}/", timeout=10).status_code == 404
    assert requests.get(f"{server.base_url}/static/chat.js", timeout=10).status_code == 404
