"""Tool calls in the model's own format (baton/server/tool_formats.py): with chat templates that
render tools in the Hermes, Llama 3.x JSON, Mistral and GLM-4.5 formats (written here from each format's
published description, on SmolLM2's vocabulary), the template renders tools and history, a
forced, `required` or parallel call is held to the format's syntax, and the reply is parsed back;
streamed deltas add up to the message."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from baton.server.tool_formats import Glm45Format, HermesFormat, Llama3JsonFormat, MistralFormat, template_format
from tests.server_util import ServerProcess

HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for tc in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3_TEMPLATE = """{%- if tools %}<|start_header_id|>system<|end_header_id|>

Given the following functions, please respond with a JSON for a function call with its proper \
arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. \
Do not use variables.

{% for t in tools %}{{ t | tojson }}

{% endfor %}<|eot_id|>{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", \
"parameters": {{ tc.function.arguments | tojson }}}\
{% if not loop.last %}; {% endif %}{% endfor %}<|eom_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL_TEMPLATE = """{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or message.role == 'system' %}[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS][\
{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\
{% if not loop.last %}, {% endif %}{% endfor %}]</s>
{%- elif message.role == 'assistant' %}{{ message.content }}</s>
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{"content": {{ message.content | tojson }}}[/TOOL_RESULTS]
{%- endif %}
{%- endfor %}"""

GLM45_TEMPLATE = """[gMASK]<sop>
{%- if tools %}<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
<arg_key>{arg-key-2}</arg_key>
<arg_value>{arg-value-2}</arg_value>
...
</tool_call>{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' or m.role == 'user' %}<|{{ m.role }}|>
{{ m.content }}
{%- elif m.role == 'assistant' %}<|assistant|>
<think></think>
{{ m.content }}
{%- for tc in m.tool_calls or [] %}
<tool_call>{{ tc.function.name }}
{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>
<arg_value>{{ v if v is string else v | tojson }}</arg_value>
{% endfor %}</tool_call>
{%- endfor %}
{%- elif m.role == 'tool' %}<|observation|>
<tool_response>
{{ m.content }}
</tool_response>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""

TEMPLATES = {
    "hermes": HERMES_TEMPLATE,
    "llama3_json": LLAMA3_TEMPLATE,
    "mistral": MISTRAL_TEMPLATE,
    "glm45": GLM45_TEMPLATE,
}
# the syntax never in content
MARKERS = {"hermes": "<tool_call>", "llama3_json": '{"name"', "mistral": "[TOOL_CALLS]", "glm45": "<tool_call>"}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in UTC?"}]


@pytest.fixture(scope="module")
def saved_tokenizer(smollm2, tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    smollm2.engine.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(TEMPLATES))
def client(request, saved_tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    tok = AutoTokenizer.from_pretrained(saved_tokenizer)
    tok.chat_template = TEMPLATES[request.param]
    tok.save_pretrained(path)
    server = ServerProcess("--tokenizer", str(path))
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    client.format_name = request.param
    yield client
    server.terminate()


def _check_calls(calls) -> None:
    for call in calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        schema = {**tool["function"]["parameters"], "additionalProperties": False}
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_the_template_shows_its_format():
    assert [template_format(None, t).name for t in TEMPLATES.values()] == list(TEMPLATES)
    assert template_format(None, "{{ messages }}") is None and template_format("generic", HERMES_TEMPLATE) is None


def test_hermes_replies_parse_back_and_a_cut_call_shows_no_syntax():
    fmt = HermesFormat()
    call_f = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    call_g = '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    content, calls = fmt.parse(f"Sure.\n{call_f}\n{call_g}")
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    assert fmt.parse('<tool_call>\n{"name": "f", "argu') == (None, [])
    assert fmt.parse("just text") == ("just text", [])


@pytest.mark.parametrize("parallel", [False, True])
def test_required_named_and_parallel_calls_stream_as_they_answer(client, parallel):
    kw = dict(model="smollm2-135m", messages=ASK, tools=[WEATHER, TIME], max_tokens=120, temperature=0.0)
    r = client.chat.completions.create(tool_choice="required", parallel_tool_calls=parallel, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert parallel or len(choice.message.tool_calls) == 1
    assert MARKERS[client.format_name] not in (choice.message.content or "")
    _check_calls(choice.message.tool_calls)
    named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_time"}}, **kw)
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_time"]
    # streamed: the deltas accumulate to the same calls
    calls: dict[int, dict] = {}
    for chunk in client.chat.completions.create(
        tool_choice="required", parallel_tool_calls=parallel, stream=True, **kw
    ):
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    expected = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
    assert [calls[i] for i in sorted(calls)] == expected


def test_a_tool_result_goes_back_through_the_template(client):
    kw = dict(model="smollm2-135m", tools=[WEATHER], max_tokens=60, temperature=0.0)
    r = client.chat.completions.create(messages=ASK, tool_choice="required", **kw)
    call = r.choices[0].message.tool_calls[0]
    history = [*ASK, r.choices[0].message.model_dump(exclude_none=True)]
    history.append({"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear", "celsius": 18}'})
    final = client.chat.completions.create(messages=history, tool_choice="none", **kw)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    auto = client.chat.completions.create(messages=history, **kw)
    assert MARKERS[client.format_name] not in (auto.choices[0].message.content or "")


def test_llama3_and_mistral_replies_parse_back():
    llama, mistral = Llama3JsonFormat(), MistralFormat()
    content, calls = llama.parse('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}')
    assert content is None and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    assert llama.parse('{"name": "f", "param') == (None, []) and llama.parse("Hello!") == ("Hello!", [])
    content, calls = mistral.parse('Let me check.[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]')
    assert content == "Let me check." and calls[0]["function"]["name"] == "f"
    assert mistral.parse('[TOOL_CALLS][{"name": "f", "argum') == (None, [])


def test_glm45_replies_parse_back_with_string_values_as_themselves():
    fmt = Glm45Format()
    tools = [WEATHER, {"type": "function", "function": {"name": "g", "parameters": {"properties": {"n": {}}}}}]
    call_f = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n</tool_call>"
    call_g = '<tool_call>g\n<arg_key>n</arg_key>\n<arg_value>{"a": [1, 2]}</arg_value>\n</tool_call>'
    content, calls = fmt.parse(f"Checking.\n{call_f}\n{call_g}", tools)
    assert content == "Checking." and [c["function"]["name"] for c in calls] == ["get_weather", "g"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "42"}, {"n": {"a": [1, 2]}}]
    assert fmt.parse("Hm. <tool_call>get_weather\n<arg_key>ci", tools) == ("Hm.", [])
    assert fmt.parse("no call", tools) == ("no call", [])


def test_glm45_grammar_takes_only_the_schemas_keys_once_in_order(smollm2):
    from baton.engine.grammar import StructuredOutputs

    tok = smollm2.engine.tokenizer
    odd = {"name": "odd", "parameters": {"type": "object", "properties": {'k"\\é': {"type": "integer"}}}}
    spec = Glm45Format().grammar([WEATHER, {"type": "function", "function": odd}], parallel=False)
    outputs = StructuredOutputs(tok, len(tok), {tok.eos_token_id})

    def accepts(text: str) -> bool:
        matcher, ids = outputs.matcher(spec), tok.encode(text, add_special_tokens=False)
        return matcher.consume_tokens(ids) and matcher.is_accepting()

    arg = "<arg_key>{}</arg_key>\n<arg_value>{}</arg_value>\n"
    call = "<tool_call>{}\n{}</tool_call>"
    assert accepts(call.format("get_weather", arg.format("city", "Paris")))
    assert accepts(call.format("odd", arg.format('k"\\é', "12"))) and accepts(call.format("odd", ""))
    assert not accepts(call.format("odd", arg.format('k"\\é', '"12"')))  # an integer, not a string
    assert not accepts(call.format("get_weather", ""))  # city is required
    assert not accepts(call.format("get_weather", arg.format("city", "Paris") * 2))  # once
    assert not accepts(call.format("get_weather", arg.format("city", "Paris") + arg.format("zone", "UTC")))
    assert not accepts(call.format("get_weather", arg.format("city", "Paris")) * 2)  # not parallel


def test_glm45_thinks_then_calls_with_its_reasoning_parser_streamed_as_not(saved_tokenizer, tmp_path):
    tok = AutoTokenizer.from_pretrained(saved_tokenizer)
    end = "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
    opened = end.replace("{% endif %}", "{% if think %}<think>{% endif %}{% endif %}")
    tok.chat_template = GLM45_TEMPLATE.replace(end, opened)
    tok.save_pretrained(tmp_path)
    server = ServerProcess("--tokenizer", str(tmp_path), "--reasoning-parser", "glm45")
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        kw = dict(model="smollm2-135m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=200)
        kw |= dict(temperature=0.0, extra_body={"chat_template_kwargs": {"think": True}})
        message = client.chat.completions.create(**kw).choices[0].message
        thought = message.model_extra["reasoning_content"]
        assert thought and "<think>" not in thought and "</think>" not in thought
        _check_calls(message.tool_calls)
        reasoning, calls = "", {}
        for chunk in client.chat.completions.create(stream=True, **kw):
            delta = chunk.choices[0].delta if chunk.choices else None
            reasoning += (delta and (delta.model_extra or {}).get("reasoning_content")) or ""
            for d in (delta and delta.tool_calls) or []:
                call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
        assert reasoning == thought
        assert [calls[i] for i in sorted(calls)] == [
            {"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls
        ]
    finally:
        server.terminate()
