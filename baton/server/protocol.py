"""OpenAI request bodies (pydantic), and their translation into SamplingParams."""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from baton.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_SEED, SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)
NonNegInt = Annotated[int, Field(ge=0)]
MAX_STOP = 64  # stop strings / stop token ids / bad words of one request
MAX_TOOLS = 128
MAX_WHITESPACE_PATTERN = 256
_warned_fields: set[str] = set()  # request fields baton ignores, each logged once


def _warn_ignored(name: str, what: str) -> None:
    """Log once per name (and at most 256 names) that a field is accepted and ignored."""
    if name not in _warned_fields and len(_warned_fields) < 256:
        _warned_fields.add(name)
        logger.warning("%s %r is not supported here and is ignored", what, name)


MAX_TEMPLATE_KWARGS = 16
# what apply_chat_template itself takes (a client must not swap the template or the rendering mode)
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
TemplateValue = bool | int | float | Annotated[str, Field(max_length=4096)] | None


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (with include_usage)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` extra."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace_pattern: str | None = Field(None, max_length=MAX_WHITESPACE_PATTERN)  # JSON: what whitespace may be
    disable_any_whitespace: bool | None = None  # JSON is compact here already; False is not honoured
    structural_tag: Any = None  # vLLM's tool-call triggers: accepted, not honoured (logged)


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints; unknown fields are ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, lt=2**31)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    stop: str | list[str] | None = Field(None, max_length=MAX_STOP)
    stop_token_ids: list[NonNegInt] | None = Field(None, max_length=MAX_STOP)
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = None
    allowed_token_ids: list[NonNegInt] | None = Field(None, min_length=1)
    bad_words: list[str] | None = Field(None, max_length=MAX_STOP)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    user: str | None = None
    kv_transfer_id: str | None = Field(None, max_length=64)  # a KV span parked here by /v1/internal/kv
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs (and its older
    # guided_* fields), llama.cpp's grammar (GBNF) and json_schema; at most one of them
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = Field(None, max_length=MAX_WHITESPACE_PATTERN)
    grammar: str | None = None
    json_schema: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _log_ignored(cls, data: Any) -> Any:
        """Fields OpenAI or vLLM take that baton has no equivalent for are ignored, each logged once."""
        if isinstance(data, dict):
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            for name in data:
                if isinstance(name, str) and name not in known:
                    _warn_ignored(name[:64], "request field")
        return data

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return bias

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens),
            stop=self.stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=self.structured_spec(),
        )

    def structured_spec(self) -> StructuredOutputsParams | None:
        specs: dict[str, StructuredOutputsParams] = {}
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            specs["response_format"] = StructuredOutputsParams(json_object=True)
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ValueError("response_format json_schema needs json_schema.schema")
            specs["response_format"] = StructuredOutputsParams(json=rf.json_schema.schema_)
        if self.structured_outputs is not None:
            so = self.structured_outputs
            if so.structural_tag is not None:
                _warn_ignored("structural_tag", "structured_outputs field")
            if any(x is not None for x in (so.json_, so.json_object, so.regex, so.choice, so.grammar)):
                specs["structured_outputs"] = StructuredOutputsParams(
                    json=so.json_,
                    json_object=so.json_object,
                    regex=so.regex,
                    choice=so.choice,
                    grammar=so.grammar,
                    whitespace_pattern=so.whitespace_pattern,
                )
        guided = {
            "guided_json": "json",
            "guided_regex": "regex",
            "guided_choice": "choice",
            "guided_grammar": "grammar",
        }
        for name, key in guided.items():
            if getattr(self, name) is not None:
                pattern = self.guided_whitespace_pattern if key == "json" else None
                specs[name] = StructuredOutputsParams(**{key: getattr(self, name)}, whitespace_pattern=pattern)
        if self.grammar is not None:
            specs["grammar"] = StructuredOutputsParams(grammar=self.grammar)
        if self.json_schema is not None:
            specs["json_schema"] = StructuredOutputsParams(json=self.json_schema)
        if len(specs) > 1:
            raise ValueError(f"give one way to constrain the output, not {', '.join(specs)}")
        return next(iter(specs.values()), None)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    """The one content part a text model takes; other types (image_url, input_audio) are refused."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(max_length=64)
    arguments: str | dict = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = Field(None, max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=128)

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _template_call(call: ToolCall) -> dict:
    """A call as chat templates take it (transformers' convention, as vLLM passes it): arguments an
    object, not the JSON text of one; text that is not a JSON object stays text."""
    out = call.model_dump()
    if isinstance(call.function.arguments, str):
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            return out
        if isinstance(arguments, dict):
            out["function"]["arguments"] = arguments
    return out


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # variables for the chat template (vLLM's chat_template_kwargs; enable_thinking also on its own)
    chat_template_kwargs: dict[str, TemplateValue] | None = Field(None, max_length=MAX_TEMPLATE_KWARGS)
    enable_thinking: bool | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, kwargs: dict | None) -> dict | None:
        for key in kwargs or {}:
            if not key.isidentifier() or key in RESERVED_TEMPLATE_KWARGS or key.startswith("_"):
                raise ValueError(f"chat_template_kwargs cannot set {key[:64]!r}")
        return kwargs

    def template_kwargs(self) -> dict:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.enable_thinking is not None:
            kwargs["enable_thinking"] = self.enable_thinking
        return kwargs

    def thinking_enabled(self) -> bool:
        return self.template_kwargs().get("enable_thinking") is not False

    def tool_choice_value(self) -> str | dict | None:
        tc = self.tool_choice
        return tc.model_dump() if isinstance(tc, NamedToolChoice) else tc


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[NonNegInt]


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
