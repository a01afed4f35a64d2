"""Continuous batching: running requests first (decodes and prefill chunks), then new ones,
all under one token budget per step; preempt the newest request when KV runs out."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from baton.config import SchedulerConfig
from baton.engine.request import Request, RequestStatus
from baton.kv.manager import KVManager
from baton.kv.prefix import needed_start
from baton.kv.spec import KVSpec


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start: int  # num_computed_tokens when scheduled
    spec_token_ids: list[int] = field(default_factory=list)  # drafts after the request's last token

    @property
    def is_decode(self) -> bool:
        """Each row a decode of one position (drafts verify as decodes at successive positions)."""
        return self.num_new_tokens == 1 or bool(self.spec_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    imported: list[Request] = field(default_factory=list)  # admitted imports: write their KV before the forward
    dropped_imports: list[Request] = field(default_factory=list)  # imports turned into local prefills

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_lost_tokens = 0  # the paged groups had them, but no state checkpoint was there
        self.group_hit_tokens = dict.fromkeys(group_labels(kv.spec), 0)  # tokens each group served from cache
        self._kept: list[str] | None = None  # requests finished inside keep_blocks
        # a second KV tier: puts what its lookup of a request found into the prefix cache
        self.adopt_from_tier: Callable[[Request], None] | None = None

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts, req.spec_token_ids = req.spec_token_ids, []
            if num_new == 1 and drafts:  # the bonus token and every accepted draft must fit max_len
                drafts = drafts[: max(0, min(budget - 1, req.max_len - req.num_tokens - 1))]
                num_new += len(drafts)
            else:
                drafts = []
            scheduled = True
            while not self.kv.allocate_slots(
                req.request_id, req.token_ids, req.num_computed_tokens, num_new, salt=req.cache_salt
            ):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                break
            out.scheduled.append(ScheduledRequest(req, num_new, req.num_computed_tokens, drafts))
            budget -= num_new
            i += 1
        if not out.preempted:
            self._admit_waiting(out, budget)
        out.scheduled.sort(key=lambda s: not s.is_decode)  # decodes first: the runner batches them
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            if not req.ready_to_schedule():
                skipped.append(req)
                continue
            if req.kv_import is not None:
                admitted = self._admit_import(out, req, budget)
                if admitted is None:
                    self.waiting.appendleft(req)
                    break
                if admitted:
                    budget -= out.scheduled[-1].num_new_tokens
                    continue
            cached = kv_tokens = 0
            if req.tier_load is not None and self.adopt_from_tier is not None:
                self.adopt_from_tier(req)  # a request that needs prompt logits leaves it to later ones
            if req.num_computed_tokens == 0 and not req.needs_prompt_logits and self.kv.enable_prefix_caching:
                hit = self.kv.find_cached_prefix(req.request_id, req.token_ids, req.cache_salt)
                cached, kv_tokens = hit.num_tokens, hit.kv_tokens
                if self._wait_for_shared_prefix(req, cached):
                    skipped.append(req)
                    continue
            done = req.num_computed_tokens  # > 0 only for a request whose prompt KV was imported
            num_new = min(req.num_tokens - done - cached, budget)
            if not self.kv.allocate_slots(req.request_id, req.token_ids, done, num_new, cached, req.cache_salt):
                self.waiting.appendleft(req)
                break
            if req.num_preemptions == 0 and done == 0:
                self.prefix_queried_tokens += req.num_tokens
                self.prefix_hit_tokens += cached
                self.prefix_lost_tokens += kv_tokens - cached
                for label, served in zip(self.group_hit_tokens, group_hits(self.kv.spec, cached)):
                    self.group_hit_tokens[label] += served
                req.num_cached_tokens = cached
            req.num_computed_tokens = done + cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new, req.num_computed_tokens))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

    def _admit_import(self, out: SchedulerOutput, req: Request, budget: int) -> bool | None:
        """An imported request takes its blocks and slot here, under the rules every request
        follows: True once admitted, None to wait, False once dropped to a local prefill (when
        nothing runs, nothing will free the room it lacks; a local prefill takes it in chunks)."""
        num_new = req.num_tokens - req.num_imported_tokens
        if num_new > budget:
            return None
        if not self.kv.allocate_for_import(req.request_id, req.num_imported_tokens, req.num_tokens):
            if self.running or out.scheduled:
                return None
            req.kv_import = None
            out.dropped_imports.append(req)
            return False
        req.num_computed_tokens = req.num_imported_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.imported.append(req)
        out.scheduled.append(ScheduledRequest(req, num_new, req.num_computed_tokens))
        return True

    def fall_back_to_prefill(self, out: SchedulerOutput, req: Request) -> None:
        """An admitted import that could not be written: what it took goes back, and it waits at the
        head to compute its tokens here (as a preempted request recomputes)."""
        out.scheduled = [s for s in out.scheduled if s.request is not req]
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.kv_import = None
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _wait_for_shared_prefix(self, req: Request, cached: int) -> bool:
        """Whether `req` should wait for a running request still prefilling a longer prefix it
        shares: it resumes there a step later instead of computing the same tokens beside it. The
        running one is asked to checkpoint its state there (recurrent layers resume only there)."""
        limit = (req.num_tokens - 1) // self.kv.block_size * self.kv.block_size
        for other in self.running:
            if other.num_computed_tokens >= other.num_prompt_tokens or other.cache_salt != req.cache_salt:
                continue
            shared = min(
                limit,
                self.kv.shared_prefix(
                    req.request_id,
                    req.token_ids,
                    other.request_id,
                    other.token_ids[: other.num_prompt_tokens],
                    (req.cache_salt, other.cache_salt),
                ),
            )
            if shared > cached and shared > other.num_computed_tokens:
                self.kv.request_checkpoint(other.request_id, shared)
                return True
        return False

    def _preempt(self, req: Request) -> None:
        """Recompute-style: drop its KV (the prefix cache may keep it) and requeue it first."""
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Remove a request wherever it is and give its blocks back (inside `keep_blocks`, when
        that ends)."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self._kept is not None:
            self._kept.append(req.request_id)
        else:
            self.kv.free(req.request_id)

    @contextmanager
    def keep_blocks(self) -> Iterator[None]:
        """Requests finished inside keep their blocks until it ends: the step that finished them
        still publishes what its forward computed (accepted drafts are known only after the tokens
        join, and a token may end the request)."""
        self._kept = []
        try:
            yield
        finally:
            kept, self._kept = self._kept, None
            for rid in kept:
                self.kv.free(rid)


def group_labels(spec: KVSpec) -> list[str]:
    return [f"{g.group_id}:{g.kind.name}" for g in spec.groups] + [f"state{g.group_id}" for g in spec.state_groups]


def group_hits(spec: KVSpec, cached: int) -> list[int]:
    """Tokens each group served for a hit of `cached`: a sliding group only its window's."""
    return [cached - needed_start(g, cached) for g in spec.groups] + [cached for _ in spec.state_groups]
