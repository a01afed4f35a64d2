"""Structured outputs (llguidance): every output under a JSON schema validates (jsonschema), regex and
choice outputs match, a permissive grammar leaves greedy output alone, unconstrained neighbours
keep their bits, forced tokens skip the model, and a dead end ends only its own request."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from baton import LLM, SamplingParams
from baton.engine.grammar import GrammarError
from baton.sampling_params import StructuredOutputsParams

SCHEMAS = [
    {  # nesting, enums, a bounded array
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "kind": {"enum": ["cat", "dog", "bird"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
            "owner": {
                "type": "object",
                "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
                "required": ["age"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "kind", "tags", "owner"],
        "additionalProperties": False,
    },
    {  # anyOf and a string pattern
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "value": {"anyOf": [{"type": "boolean"}, {"type": "integer", "minimum": -5, "maximum": 5}]},
        },
        "required": ["id", "value"],
        "additionalProperties": False,
    },
    {  # an array at the top, bounded
        "type": "array",
        "items": {"type": "object", "properties": {"x": {"enum": [1, 2, 3]}}, "required": ["x"]},
        "minItems": 2,
        "maxItems": 4,
    },
]
PROMPT = "Describe a pet as JSON:"


def _constrained(spec: StructuredOutputsParams, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 160), structured_outputs=spec, **kw)


@pytest.mark.parametrize("model", ["smollm2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_every_output_validates_against_its_schema(model, request):
    llm: LLM = request.getfixturevalue(model)
    for schema in SCHEMAS:
        params = [
            _constrained(StructuredOutputsParams(json=schema), temperature=t, seed=s)
            for t, s in ((0.0, None), (0.8, 1), (1.0, 2))
        ]
        outs = llm.generate([PROMPT] * len(params), params)
        for out in outs:
            c = out.outputs[0]
            assert c.finish_reason == "stop" and c.error is None, (schema, c.text)
            jsonschema.validate(json.loads(c.text), schema)
    assert llm.engine.kv.all_free()


@pytest.mark.parametrize("model", ["smollm2", pytest.param("gemma3", marks=pytest.mark.slow)])  # gemma3: 11 s
def test_regex_choice_and_grammars_match(model, request):
    llm: LLM = request.getfixturevalue(model)
    cases = [
        (StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        (StructuredOutputsParams(choice=["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
        (  # llama.cpp's GBNF
            StructuredOutputsParams(grammar='root ::= "The answer is " [0-9] [0-9]? [0-9]? "."'),
            lambda t: re.fullmatch(r"The answer is [0-9]{1,3}\.", t),
        ),
        (  # llguidance's Lark
            StructuredOutputsParams(grammar='start: "color: " COLOR\nCOLOR: "red" | "green" | "blue"'),
            lambda t: t in ("color: red", "color: green", "color: blue"),
        ),
    ]
    for spec, ok in cases:
        for temperature, seed in ((0.0, None), (1.0, 3)):
            out = llm.generate(["Answer: "], _constrained(spec, temperature=temperature, seed=seed, max_tokens=40))[0]
            c = out.outputs[0]
            assert c.finish_reason == "stop" and ok(c.text), (spec, c.text)


def test_a_grammar_admitting_everything_leaves_greedy_output_alone(smollm2):
    prompts = ["The capital of France is", "def add(a, b):\n"]
    plain = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3)
    free = _constrained(StructuredOutputsParams(regex=r"(.|\n)*"), temperature=0.0, max_tokens=24, logprobs=3)
    for a, b in zip(smollm2.generate(prompts, plain), smollm2.generate(prompts, free)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: e.logprob for t, e in x.items()} == {t: e.logprob for t, e in y.items()}


def test_unconstrained_neighbours_keep_their_bits(smollm2):
    plain = SamplingParams(max_tokens=20, temperature=0.0, logprobs=2)
    prompts = ["Once upon a time", "The three primary colors are"]
    alone = smollm2.generate(prompts, plain)
    spec = _constrained(StructuredOutputsParams(json=SCHEMAS[0]), temperature=0.0)
    mixed = smollm2.generate([prompts[0], PROMPT, prompts[1], PROMPT], [plain, spec, plain, spec])
    for a, b in zip(alone, [mixed[0], mixed[2]]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [sorted(p.items()) for p in a.outputs[0].logprobs] == [sorted(p.items()) for p in b.outputs[0].logprobs]
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS[0])


def test_forced_tokens_are_appended_without_a_model_call(smollm2, monkeypatch):
    schema = {
        "type": "object",
        "properties": {"status": {"enum": ["accepted"]}, "code": {"enum": [200]}},
        "required": ["status", "code"],
        "additionalProperties": False,
    }
    steps = []
    execute = smollm2.engine.runner.execute
    monkeypatch.setattr(smollm2.engine.runner, "execute", lambda batch: steps.append(1) or execute(batch))
    out = smollm2.generate(["Status:"], _constrained(StructuredOutputsParams(json=schema), temperature=0.0))[0]
    c = out.outputs[0]
    assert json.loads(c.text) == {"status": "accepted", "code": 200}
    assert len(steps) < len(c.token_ids)  # one forward for the prompt, then forced tokens in bulk


def test_specs_that_do_not_compile_are_refused(smollm2):
    bad = [
        StructuredOutputsParams(regex="([0-9]"),
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
        StructuredOutputsParams(json="{not json"),
        StructuredOutputsParams(grammar="root ::= undefined_rule"),
    ]
    for spec in bad:
        with pytest.raises(GrammarError, match="does not compile"):
            smollm2.generate(["x"], _constrained(spec))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    assert smollm2.engine.kv.all_free() and not smollm2.engine.requests


def test_a_dead_end_stops_only_its_own_request(smollm2):
    """allowed_token_ids that the grammar forbids: no token is left; the request ends with an error
    instead of sampling from -inf logits, and its neighbour finishes untouched."""
    digits = StructuredOutputsParams(regex=r"[0-9]+")
    tok = smollm2.get_tokenizer()
    letters = tok.encode("hello", add_special_tokens=False)
    stuck = _constrained(digits, allowed_token_ids=letters, temperature=0.0)
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    expected = smollm2.generate(["Count: 1, 2,"], plain)[0].outputs[0].token_ids
    dead, other = smollm2.generate(["Count:", "Count: 1, 2,"], [stuck, plain])
    c = dead.outputs[0]
    assert c.finish_reason == "stop" and "structured output" in c.error and not c.token_ids
    assert other.outputs[0].token_ids == expected
    assert smollm2.engine.kv.all_free()


def test_token_bitmask_applies_bit_for_bit():
    import torch

    from baton.engine.grammar import apply_token_bitmask_

    g = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word is partial
    logits = torch.randn(5, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 32), generator=g, dtype=torch.int32)
    bitmask[0, 3] = -1  # a whole word allowed
    got = logits.clone()
    apply_token_bitmask_(got, [3, 1], bitmask)
    expected = logits.clone()
    for i, row in enumerate([3, 1]):
        for t in range(vocab):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    assert torch.equal(got, expected)
