"""Structured-output libraries, unchanged, against a real `baton serve` (SmolLM2-135M): outlines'
vLLM client (JSON schema with its whitespace pattern, regex, Lark grammar) and OpenAI client
(JSON schema), and instructor's TOOLS, JSON_SCHEMA and JSON modes. Every output is checked
independently of the library: against the schema (jsonschema), the regex (re), the grammar
(lark). Slow: `make test-slow` installs the `clients` extra they need."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server_util import ServerProcess

outlines = pytest.importorskip("outlines")
instructor = pytest.importorskip("instructor")
lark = pytest.importorskip("lark")

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
# greedy, a 135M model repeats a phrase inside a JSON string until max_tokens
SAMPLING = {"temperature": 0, "frequency_penalty": 1.0, "max_tokens": 160}


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: float


@pytest.fixture(scope="module")
def server():
    s = ServerProcess()
    yield s
    s.terminate()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")


def test_outlines_vllm_client_json_regex_and_lark(client):
    from outlines.types import CFG, Regex

    model = outlines.from_vllm(client, MODEL)
    reply = model("Describe Paris as JSON.", City, **SAMPLING)
    jsonschema.validate(json.loads(reply), City.model_json_schema())
    City.model_validate_json(reply)

    date = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
    reply = model("When did the Apollo 11 landing happen? Give a date.", Regex(date), **SAMPLING)
    assert re.fullmatch(date, reply), reply

    grammar = """
?start: expr
?expr: term (("+" | "-") term)*
?term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,4}/
"""
    reply = model("Write an arithmetic expression that equals 10.", CFG(grammar), **SAMPLING)
    lark.Lark(grammar, parser="lalr").parse(reply)  # raises unless the reply is in the grammar


def test_outlines_openai_client_json_schema(client):
    model = outlines.from_openai(client, MODEL)
    reply = model("Describe Rome as JSON.", City, **SAMPLING)
    City.model_validate_json(reply)


# JSON mode holds the reply to JSON, not to the schema, which instructor only describes in a system
# message: a 135M model needs an example of the object to write one (TOOLS and JSON_SCHEMA do not)
EXAMPLE = ' For example, Paris is {"name": "Paris", "country": "France", "population_millions": 2.1}.'


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA", "JSON"])
def test_instructor_modes_give_valid_objects(client, mode):
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    city = patched.chat.completions.create(
        model=MODEL,
        response_model=City,
        messages=[{"role": "user", "content": f"Describe Tokyo.{EXAMPLE}"}],
        max_retries=0,  # the first reply must validate: no second chance
        **SAMPLING,
    )
    assert isinstance(city, City) and city.name and city.country
