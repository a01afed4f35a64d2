"""`POST /v1/responses` through the openai SDK: text and message input, instructions, tools as
function-call output items and their results as input items, a JSON schema text format, streaming
with the Responses events, previous_response_id, and bad input as 4xx."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests

from tests.server_util import ServerProcess

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "rainy": {"type": "boolean"}},
    "required": ["city", "rainy"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server():
    s = ServerProcess()
    yield s
    s.terminate()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")


def test_text_and_message_input_with_instructions(client):
    r = client.responses.create(model="smollm2-135m", input="Say hello.", max_output_tokens=12, temperature=0.0)
    assert r.status in ("completed", "incomplete") and r.output_text and r.usage.input_tokens > 0
    again = client.responses.create(
        model="smollm2-135m",
        instructions="You answer in one word.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}],
        max_output_tokens=12,
        temperature=0.0,
    )
    assert again.output_text and again.output[0].type == "message"
    cut = client.responses.create(model="smollm2-135m", input="Tell a long story.", max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_function_calls_out_and_their_results_back_in(client):
    r = client.responses.create(
        model="smollm2-135m", input="Weather in Paris?", tools=[WEATHER], tool_choice="required", max_output_tokens=60
    )
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    follow = client.responses.create(
        model="smollm2-135m",
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=16,
    )
    assert follow.output_text and follow.previous_response_id == r.id


def test_a_json_schema_text_format_validates(client):
    r = client.responses.create(
        model="smollm2-135m",
        input="Is it rainy in Oslo? Answer in JSON.",
        text={"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA}},
        max_output_tokens=40,
        temperature=0.0,
    )
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


def test_streamed_events_add_up_to_the_final_response(client):
    # (an answer cut by max_output_tokens ends in response.incomplete, as OpenAI's: this one finishes)
    args = {"model": "smollm2-135m", "input": "Say hi.", "max_output_tokens": 60, "temperature": 0.0}
    with client.responses.stream(**args) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas and final.output_text == deltas
    with client.responses.stream(
        model="smollm2-135m", input="Weather in Rome?", tools=[WEATHER], tool_choice="required", max_output_tokens=60
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    (call,) = [item for item in final.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_store_false_keeps_nothing_and_bad_input_is_a_4xx(server, client):
    r = client.responses.create(model="smollm2-135m", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="smollm2-135m", input="Hi", previous_response_id=r.id, max_output_tokens=2)
    for bad in (
        {"input": []},
        {"input": "x", "max_output_tokens": 0},
        {"input": [{"type": "message", "role": "robot", "content": "x"}]},
        {"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
        {"input": "x", "previous_response_id": "resp_" + "0" * 32},
    ):
        resp = requests.post(f"{server.base_url}/v1/responses", json={"model": "smollm2-135m", **bad}, timeout=60)
        assert 400 <= resp.status_code < 500 and resp.json()["error"]["message"], (bad, resp.text)
