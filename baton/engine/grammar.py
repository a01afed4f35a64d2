"""Structured outputs on llguidance. A request's schema, regex, choice or grammar compiles (once per
distinct spec, checked against the vocabulary) into an llguidance grammar, and each constrained
sequence gets a matcher. A step's masks are computed on a worker thread while the model runs, as
a packed bitmask (a bit per token), and applied to the rows that need one; a matcher advances only
with a token appended to its sequence."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance.hf
import torch
from llguidance import LLMatcher
from llguidance.gbnf_to_lark import gbnf_to_lark

from baton import ops
from baton.sampling_params import StructuredOutputsParams

MAX_CACHED_GRAMMARS = 256
# JSON as compact as json.dumps(separators=(", ", ": ")) writes it, with no free whitespace: small
# models left free whitespace tend to emit newlines until max_tokens
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A structured output spec that does not compile (HTTP 400)."""


@dataclass
class StepMasks:
    """The masks of one step's constrained rows: bitmask[i] is for requests[i] at its sample row
    offsets[i] (0: its next token; j: after its first j drafts)."""

    requests: list  # the Requests, in row order of `bitmask`
    offsets: list[int]
    bitmask: torch.Tensor  # int32 [len(requests), ceil(vocab / 32)]


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer = None  # built on first use: converting a 262k vocabulary takes a second
        self._lock = threading.Lock()
        self._templates: OrderedDict[str, LLMatcher] = OrderedDict()  # spec as JSON -> its unused matcher
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="baton-grammar")
        self.num_compiled = 0
        self.compile_seconds = 0.0
        self.mask_seconds = 0.0
        self.mask_steps = 0

    def tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                if self._hf_tokenizer is None:
                    raise GrammarError("structured outputs need the model's tokenizer; this model has none")
                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None
                    )
                except ValueError as e:
                    raise GrammarError(f"structured outputs are not available for this tokenizer: {e}") from None
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutputsParams) -> LLMatcher:
        """A fresh matcher of the spec, kept as the template its requests copy (GrammarError naming
        the problem if the spec does not compile). The server calls it on its own thread before a
        request reaches the engine, so the engine's thread only ever copies a built matcher."""
        key = json.dumps(
            [
                spec.json,
                spec.json_object,
                spec.regex,
                spec.choice,
                spec.grammar,
                spec.thinking,
                spec.whitespace_pattern,
            ],
            sort_keys=True,
            default=str,
        )
        with self._lock:
            if key in self._templates:
                self._templates.move_to_end(key)
                return self._templates[key]
        start = time.perf_counter()
        template = LLMatcher(self.tokenizer(), _to_grammar(spec), log_level=0)  # compiles it, or is_error()
        if template.is_error():
            raise GrammarError(f"the structured output spec does not compile: {template.get_error()}")
        with self._lock:
            self.num_compiled += 1
            self.compile_seconds += time.perf_counter() - start
            self._templates[key] = template
            if len(self._templates) > MAX_CACHED_GRAMMARS:
                self._templates.popitem(last=False)
        return template

    def matcher(self, spec: StructuredOutputsParams) -> LLMatcher:
        """A request's own matcher: a copy of the spec's template, at the start of the grammar."""
        template = self.compile(spec)
        with self._lock:
            return template.deep_copy()

    def start_masks(self, entries: list[tuple]) -> Future[StepMasks]:
        """The masks of (request with a matcher, its drafts) pairs, computed on the worker thread: one
        for its next token and one after each draft (the matcher steps through them and back)."""
        return self._pool.submit(self._compute, list(entries))

    def _compute(self, entries: list[tuple]) -> StepMasks:
        start = time.perf_counter()
        requests, offsets = [], []
        for req, drafts in entries:
            requests += [req] * (len(drafts) + 1)
            offsets += range(len(drafts) + 1)
        bitmask = torch.full((len(requests), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        i = 0
        for req, drafts in entries:
            for j in range(len(drafts) + 1):
                row = bitmask[i]
                req.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
                i += 1
                if j < len(drafts) and not req.matcher.consume_token(drafts[j]):
                    raise AssertionError("a draft the grammar forbids reached verification")
            if drafts:
                req.matcher.rollback(len(drafts))
        self.mask_seconds += time.perf_counter() - start
        self.mask_steps += 1
        return StepMasks(requests, offsets, bitmask)

    @staticmethod
    def allowed_drafts(req, drafts: list[int]) -> list[int]:
        """`drafts` cut at the first token the request's grammar forbids there."""
        if req.matcher is None or not drafts:
            return drafts
        return drafts[: req.matcher.validate_tokens(drafts)]


def apply_token_bitmask_(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set to -inf every token a row's mask leaves out: bitmask[i] (a bit per token, int32 words)
    is for logits row rows[i]."""
    ops.apply_token_bitmask_(logits, torch.tensor(rows, dtype=torch.long), bitmask)


# the thinking a reasoning model writes before its constrained answer: free text up to </think>
# (a lazy lexeme: it ends at the first </think>), then optional whitespace and the answer's grammar
_THINKING = {
    "optional": 'start: ("<think>" thought)? (/[ \\t\\n]+/)? @answer\n',
    "open": "start: thought (/[ \\t\\n]+/)? @answer\n",
}
_THOUGHT = 'thought[stop="</think>"]: /(.|\\n)*/\n'


def _to_grammar(spec: StructuredOutputsParams) -> str:
    answer = _answer_grammar(spec)
    if spec.thinking is None:
        return answer
    inner = json.loads(answer)["grammars"] if answer.lstrip().startswith("{") else [{"lark_grammar": answer}]
    if len(inner) != 1:
        raise GrammarError("a constraint after thinking must be one grammar")
    return json.dumps(
        {"grammars": [{"lark_grammar": _THINKING[spec.thinking] + _THOUGHT}, {**inner[0], "name": "answer"}]}
    )


def _answer_grammar(spec: StructuredOutputsParams) -> str:
    try:
        if spec.json is not None or spec.json_object:
            schema = spec.json if spec.json is not None else {"type": "object"}
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise GrammarError("a JSON schema is an object")
            options = JSON_OPTIONS
            if spec.whitespace_pattern is not None:  # the client's (outlines sends one): it says what may go between
                options = {"whitespace_flexible": True, "whitespace_pattern": spec.whitespace_pattern}
                options |= {"item_separator": ",", "key_separator": ":"}
            return LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if spec.regex is not None:
            return LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            return LLMatcher.grammar_from_lark(f"start: {alternatives}")
        text = spec.grammar or ""
        lark = gbnf_to_lark(text) if "::=" in text else text  # llama.cpp's GBNF, else Lark
        return LLMatcher.grammar_from_lark(lark)
    except GrammarError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a request's spec makes the converters raise is the request's fault
        raise GrammarError(f"the structured output spec does not compile: {type(e).__name__}: {str(e)[:500]}") from None
