"""One sequence's state as it moves through the scheduler."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch

from baton.outputs import PositionLogprobs
from baton.sampling_params import SamplingParams

if TYPE_CHECKING:
    from baton.engine.detokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """A sequence: the prompt, the tokens generated so far, and how much of it the KV holds.

    `token_ids` is prompt + output; positions [0, num_computed_tokens) have KV in the cache.
    For n > 1 each sample is its own Request; the later ones wait for `leader` to finish
    its prompt, then find that prompt's blocks in the prefix cache.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: set[int],
        max_model_len: int,
        index: int = 0,
        leader: Request | None = None,
        prompt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.index = index
        self.leader = leader
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # the prefix-cache hit of the first schedule
        self.max_len = min(max_model_len, self.num_prompt_tokens + params.max_tokens)
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.eos_token_ids = set() if params.ignore_eos else eos_token_ids
        self.stop_token_ids = set(params.stop_token_ids) | self.eos_token_ids
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.prompt_logits: list[torch.Tensor] | None = None  # kept only for LLMEngine.prompt_logits
        self.cumulative_logprob = 0.0
        self.output_text = ""
        self.detokenizer: IncrementalDetokenizer | None = None  # the engine makes it at the first output token
        self.num_preemptions = 0
        self.export_kv: str | None = None  # "grouped" / "dense": export the prompt KV after prefill
        self.kv_span: bytes | None = None
        # a validated import (handoff.validate.ImportPlan) waiting for admission, and the positions
        # it makes computed once written
        self.kv_import = None
        self.num_imported_tokens = 0
        self.tier_load = None  # a second KV tier's lookup of this prompt (a Future), adopted at admission
        self.cache_salt = b""  # part of every block hash: requests with different salts never share blocks
        self.bad_words_token_ids: list[list[int]] = []  # params.bad_words, tokenized by the engine
        self.matcher = None  # structured outputs: the llguidance matcher of params.structured_outputs
        self.error: str | None = None  # why a constrained output ended early
        # speculative decoding: the drafts the next step verifies; its (accepted, tried) drafts, decayed
        self.spec_token_ids: list[int] = []
        self.spec_acceptance = (0.0, 0.0)
        # the seed of this sample's noise: a draft sampled with it agrees with the verify step's
        self.sampling_seed = params.seed

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def needs_prompt_logits(self) -> bool:
        wants = self.prompt_logprobs is not None or self.prompt_logits is not None
        return wants and self.num_computed_tokens < self.num_prompt_tokens

    def ready_to_schedule(self) -> bool:
        """n > 1 samples after the first wait until the first has computed the shared prompt; a
        prompt a second KV tier is looking up waits for the lookup."""
        if self.tier_load is not None and not self.tier_load.done():
            return False
        lead = self.leader
        return lead is None or lead.is_finished or lead.num_computed_tokens >= lead.num_prompt_tokens
