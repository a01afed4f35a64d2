"""Structured outputs and tool calls through `baton serve` with the official openai client:
response_format, vLLM's structured_outputs, llama.cpp's grammar, a tool-call round trip (call,
tool result, final answer), streamed tool calls, and compile errors as 400s."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import requests

from tests.server_util import ServerProcess

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
    },
}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-model-len", "1024")
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")


def test_response_format_json_schema_and_json_object(client):
    schema = {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 30}, "year": {"type": "integer", "maximum": 2100}},
        "required": ["title", "year"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Name a book and its year."}],
        response_format={"type": "json_schema", "json_schema": {"name": "book", "schema": schema}},
        max_tokens=80,
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Any JSON object, please."}],
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_vllm_extras_and_llama_cpp_grammar(client):
    r = client.completions.create(
        model="smollm2-135m",
        prompt="A phone number: ",
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": r"\+1-[0-9]{3}-[0-9]{4}"}},
    )
    assert re.fullmatch(r"\+1-[0-9]{3}-[0-9]{4}", r.choices[0].text)
    r = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Is water wet?"}],
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(
        model="smollm2-135m",
        prompt="Answer: ",
        max_tokens=20,
        extra_body={"grammar": 'root ::= "It is " ("true" | "false") "."'},
    )
    assert r.choices[0].text in ("It is true.", "It is false.")


def test_specs_that_do_not_compile_are_400s(server, client):
    cases = [
        {"structured_outputs": {"regex": "([0-9]"}},
        {"grammar": "root ::= nowhere"},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
        {"structured_outputs": {"regex": "a"}, "grammar": 'root ::= "a"'},  # two constraints at once
        {"structured_outputs": {"regex": "a", "choice": ["b"]}},
    ]
    for extra in cases:
        body = {"model": "smollm2-135m", "prompt": "x", "max_tokens": 4, **extra}
        r = requests.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["message"], extra
    # the server still answers
    assert client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=2).choices[0].text is not None


def test_tool_call_round_trip(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(
        model="smollm2-135m", messages=messages, tools=[WEATHER, TIME], tool_choice="required", max_tokens=80
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name in ("get_weather", "get_time")
    tool = WEATHER if call.function.name == "get_weather" else TIME
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    # a named function
    r = client.chat.completions.create(
        model="smollm2-135m",
        messages=messages,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
    )
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # the tool's result goes back, and the model answers
    messages += [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})},
    ]
    final = client.chat.completions.create(model="smollm2-135m", messages=messages, tools=[WEATHER], max_tokens=60)
    answer = final.choices[0]
    assert answer.message.tool_calls or (answer.message.content and answer.finish_reason in ("stop", "length"))
    final = client.chat.completions.create(
        model="smollm2-135m", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=30
    )
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_streamed_tool_call(client):
    stream = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=80,
        stream=True,
    )
    name, arguments, finish = "", "", None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                name += call.function.name or ""
                arguments += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert name == "get_weather" and finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_unknown_named_tool_is_a_400(server):
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": "x"}],
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "nope"}},
    }
    r = requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]


ADD = {  # no additionalProperties: held strictly all the same, as OpenAI's strict mode
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}


def test_arguments_name_only_the_schemas_properties_and_calls_may_go_in_parallel(client):
    messages = [{"role": "user", "content": "Add 2 and 3, and ping the server."}]
    for _ in range(2):
        r = client.chat.completions.create(
            model="smollm2-135m", messages=messages, tools=[ADD, PING], tool_choice="required", max_tokens=60
        )
        for call in r.choices[0].message.tool_calls:
            arguments = json.loads(call.function.arguments)
            allowed = {"add": {"a", "b"}, "ping": set()}[call.function.name]
            assert set(arguments) <= allowed, arguments
    r = client.chat.completions.create(
        model="smollm2-135m",
        messages=messages,
        tools=[ADD, PING],
        tool_choice="required",
        parallel_tool_calls=True,
        max_tokens=120,
    )
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and 1 <= len(calls) <= 16
    assert len({c.id for c in calls}) == len(calls)
    # the calls and their results go back as history
    messages.append(r.choices[0].message.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in calls]
    final = client.chat.completions.create(model="smollm2-135m", messages=messages, tool_choice="none", max_tokens=8)
    assert final.choices[0].message.content


def test_a_cut_reply_shows_none_of_the_tool_format(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(
        model="smollm2-135m", messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=4
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls and not choice.message.content


def test_a_cut_response_keeps_what_it_said_and_a_cut_call_nothing():
    from baton.server.tools import parse_reply

    assert parse_reply('{"response": "Once upon a ti') == ("Once upon a ti", [])
    assert parse_reply('{"response": "caf\\u00e') == ("caf", [])  # a cut escape is dropped
    assert parse_reply('{"response": "a \\"quoted\\" wo') == ('a "quoted" wo', [])
    assert parse_reply('{"tool_call": {"name": "get_wea') == (None, [])
    assert parse_reply('{"tool_calls": [{"name": "ping", "arguments": {}}, {"na') == (None, [])
    content, calls = parse_reply(
        '{"tool_calls": [{"name": "ping", "arguments": {}}, {"name": "add", "arguments": {"a": 1}}]}'
    )
    assert content is None and [c["function"]["name"] for c in calls] == ["ping", "add"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": 1}


def test_strict_schemas_close_every_object_that_does_not_say_otherwise():
    from baton.server.tools import strict_schema

    schema = {
        "type": "object",
        "properties": {
            "point": {"type": "object", "properties": {"x": {"type": "number"}}},
            "tags": {"type": "array", "items": {"properties": {"k": {"type": "string"}}}},
            "open": {"type": "object", "additionalProperties": {"type": "integer"}},
        },
        "$defs": {"d": {"type": "object"}},
        "anyOf": [{"type": "object", "properties": {"point": {}}}],
    }
    strict = strict_schema(schema)
    assert strict["additionalProperties"] is False
    assert strict["properties"]["point"]["additionalProperties"] is False
    assert strict["properties"]["tags"]["items"]["additionalProperties"] is False
    assert strict["properties"]["open"]["additionalProperties"] == {"type": "integer"}  # said otherwise: kept
    assert strict["$defs"]["d"]["additionalProperties"] is False and strict["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy
    nested: dict = {"type": "object"}
    for _ in range(100):
        nested = {"type": "object", "properties": {"x": nested}}
    with pytest.raises(ValueError, match="nests deeper"):
        strict_schema(nested)


def test_the_openai_sdks_parse_and_stream_helpers(client):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        population: int

    messages = [{"role": "user", "content": "Name a large city and its population, as JSON."}]
    parsed = client.chat.completions.parse(model="smollm2-135m", messages=messages, response_format=City, max_tokens=60)
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and city.name
    with client.chat.completions.stream(
        model="smollm2-135m", messages=messages, response_format=City, max_tokens=60
    ) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "content.delta")
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == City.model_validate_json(deltas)
    weather = openai.pydantic_function_tool(City, name="record_city")
    r = client.chat.completions.parse(
        model="smollm2-135m", messages=messages, tools=[weather], tool_choice="required", max_tokens=60
    )
    assert isinstance(r.choices[0].message.tool_calls[0].function.parsed_arguments, City)
