"""What happens to a request when a token joins it (sampled, forced by its grammar, or imported with
its KV): the grammar advances, stop tokens, stop strings and the length limit are checked, and
the text grows by incremental detokenizing. And the RequestOutput of a request's samples."""

from __future__ import annotations

from collections.abc import Callable

import torch

from baton.engine.detokenizer import IncrementalDetokenizer
from baton.engine.request import Request
from baton.engine.sampler import top_logprobs
from baton.engine.scheduler import ScheduledRequest
from baton.outputs import CompletionOutput, Logprob, RequestOutput


class OutputProcessor:
    def __init__(self, tokenizer, finish: Callable[[Request, str], None]) -> None:
        self.tokenizer = tokenizer
        self.finish = finish  # the scheduler's: ends a request and frees its blocks

    def append_token(self, req: Request, token: int, logprobs, sampled_logprob: float) -> None:
        self._append(req, token, logprobs, sampled_logprob)
        if req.matcher is None or req.is_finished or req.export_kv is not None:
            return
        for forced in req.matcher.compute_ff_tokens():  # what the grammar forces joins without sampling
            if req.is_finished:
                break
            self._append(req, forced, {forced: Logprob(0.0, 1)} if req.logprobs is not None else None, 0.0)

    def _append(self, req: Request, token: int, logprobs, sampled_logprob: float) -> None:
        req.token_ids.append(token)
        if req.logprobs is not None:
            req.logprobs.append(logprobs)
            req.cumulative_logprob += sampled_logprob
        if req.matcher is not None and not req.matcher.consume_token(token):
            req.error = f"token {token} is outside the structured output: {req.matcher.get_error()}"
            self.finish(req, "stop")
            return
        self._check_stops(req, token)
        if req.matcher is not None and not req.is_finished and req.matcher.is_stopped():
            self.finish(req, "stop")  # the grammar is complete: nothing may follow

    def _check_stops(self, req: Request, token: int) -> None:
        p = req.params
        detok = self._detokenizer(req)
        if token in req.stop_token_ids:  # the sampler masks them until min_tokens
            req.stop_reason = None if token in req.eos_token_ids else token
            req.output_text = detok.text + detok.pending  # the stop token's own text left out
            self.finish(req, "stop")
            return
        previous = len(detok.text)  # final text: a stop string not found before may only end past it
        detok.append(token)
        req.output_text = detok.text + detok.pending  # == decode(output_token_ids), as a stop string sees it
        if p.stop and req.num_output_tokens >= p.min_tokens:
            longest = max(len(s) for s in p.stop)
            start = max(0, previous - longest + 1)
            hits = [(req.output_text.find(s, start), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                idx, stop = min(hits)
                req.output_text = req.output_text[: idx + len(stop) if p.include_stop_str_in_output else idx]
                req.stop_reason = stop
                self.finish(req, "stop")
                return
        if req.num_tokens >= req.max_len:
            self.finish(req, "length")

    def _detokenizer(self, req: Request) -> IncrementalDetokenizer:
        if req.detokenizer is None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.params.skip_special_tokens)
        return req.detokenizer


def request_output(request_id: str, samples: list[Request]) -> RequestOutput:
    first = samples[0]
    return RequestOutput(
        request_id=request_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        prompt_logprobs=first.prompt_logprobs,
        outputs=[
            CompletionOutput(
                index=r.index,
                text=r.output_text if r.is_finished or r.detokenizer is None else r.detokenizer.text,
                token_ids=list(r.output_token_ids),
                cumulative_logprob=r.cumulative_logprob if r.logprobs is not None else None,
                logprobs=r.logprobs,
                finish_reason=r.finish_reason,
                stop_reason=r.stop_reason,
                error=r.error,
            )
            for r in samples
        ],
        finished=all(r.is_finished for r in samples),
        num_cached_tokens=first.num_cached_tokens,
        kv_span=first.kv_span,
    )


def record_prompt_logprobs(s: ScheduledRequest, logits: torch.Tensor) -> None:
    """A prefill chunk's logits into its request's prompt logprobs (and prompt logits, when kept)."""
    req = s.request
    if req.prompt_logits is not None and s.start == sum(t.shape[0] for t in req.prompt_logits):
        req.prompt_logits.append(logits[: req.num_prompt_tokens - s.start].clone())
    if req.prompt_logprobs is None:
        return
    # row j predicts the token at position start + j + 1; keep prompt positions not yet recorded
    targets = torch.tensor(req.token_ids[s.start + 1 : s.start + 1 + logits.shape[0]], dtype=torch.long)
    keep = min(len(targets), req.num_prompt_tokens - len(req.prompt_logprobs))
    first = len(req.prompt_logprobs) - (s.start + 1)
    if keep <= 0 or first < 0:
        return
    lp = logits[first : first + keep].log_softmax(dim=1)
    req.prompt_logprobs.extend(top_logprobs(lp, targets[first : first + keep], req.params.prompt_logprobs))
