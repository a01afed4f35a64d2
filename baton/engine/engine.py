"""The offline engine: add requests, step until done. `step()` reads top to bottom:
schedule -> run the model -> sample -> update requests, publish blocks, free what finished."""

from __future__ import annotations

import gc
import itertools
import logging
import time
from concurrent import futures

import torch

from baton.config import EngineConfig
from baton.engine.faults import Faults
from baton.engine.grammar import StructuredOutputs
from baton.engine.input_processor import InputProcessor, Prompt
from baton.engine.kv_handoff import KVHandoff
from baton.engine.kv_tier import KVTier
from baton.engine.model_setup import kv_cache_dtype, load_rank_model, spec_decoder
from baton.engine.output_processor import OutputProcessor, record_prompt_logprobs, request_output
from baton.engine.request import Request
from baton.engine.runner import ModelOutput, ModelRunner
from baton.engine.sampler import forbidden, sample
from baton.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from baton.handoff.errors import InvalidKVImport
from baton.handoff.validate import ImportPlan
from baton.kv.memory import build_cache_memory
from baton.outputs import RequestOutput
from baton.parallel.comm import TPGroup
from baton.parallel.ranks import Ranks
from baton.sampling_params import SamplingParams
from baton.spec_decode.verify import accept_drafts
from baton.tokenizer import generation_eos_ids, load_tokenizer

logger = logging.getLogger(__name__)


class StepFailed(RuntimeError):
    """An engine step raised; `request_ids` (already aborted) were the requests in it."""

    def __init__(self, request_ids: list[str]) -> None:
        super().__init__(f"engine step failed for requests {', '.join(request_ids)}")
        self.request_ids = request_ids


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        if config.env.num_threads:
            torch.set_num_threads(config.env.num_threads)
        torch.manual_seed(config.seed)
        self.ranks = Ranks.start(config) if config.parallel.world_size > 1 else None
        rank_model = load_rank_model(config, self.ranks.tp if self.ranks else TPGroup(), 0, progress)
        if self.ranks is not None:
            self.ranks.stage = rank_model.stage
        loaded = rank_model.loaded
        self.model, self.model_config = rank_model.model, loaded.config
        self.tokenizer = load_tokenizer(loaded.path, config.env.cache_dir, config.model.tokenizer)
        cache, sched = config.cache, config.scheduler
        mc = self.model_config
        kv_dtype = kv_cache_dtype(config, rank_model)
        spec = config.speculative
        stage = rank_model.stage
        memory = build_cache_memory(
            rank_model.local_config,
            cache,
            sched,
            kv_dtype,
            spec.num_speculative_tokens if spec else 0,
            layers=stage.cache_layers if stage else None,
        )
        if self.ranks is not None:
            self.ranks.build_caches(memory, kv_dtype)
        self.kv_spec, self.kv, self.storage, self.states = memory.spec, memory.kv, memory.storage, memory.states
        self.max_model_len = memory.max_model_len
        self.handoff = KVHandoff(config, loaded, memory, self.ranks)
        self.scheduler = Scheduler(sched, self.kv, self.max_model_len)
        self.tier = (
            KVTier(config, self.kv, self.storage, self.states, self.handoff.fingerprint)
            if config.kv_tier.kv_tier
            else None
        )
        if self.tier is not None:
            self.scheduler.adopt_from_tier = self.tier.adopt
        self.runner = ModelRunner(self.model, self.kv, self.storage, self.states, self.ranks)
        self.eos_token_ids = set(mc.eos_token_ids) | generation_eos_ids(loaded.path)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.structured = StructuredOutputs(self.tokenizer, mc.vocab_size, self.eos_token_ids)
        self.inputs = InputProcessor(self.tokenizer, mc.vocab_size, self.max_model_len, self.structured)
        self.output = OutputProcessor(self.tokenizer, self.scheduler.finish)
        self.spec = (
            spec_decoder(config, self.model, self.model_config, self.kv, self.storage, self.structured, progress)
            if spec is not None
            else None
        )
        self.requests: dict[str, list[Request]] = {}  # request id -> its n samples
        self.faults = Faults(config.env.faults)
        self.prefills = {"remote": 0, "local": 0}  # prompts by where their KV was computed
        self.num_kv_imports_failed = 0  # admitted imports that could not be written, then prefilled here
        self.num_steps_with_work = 0  # steps that scheduled something: the loop's progress
        self._touched: set[str] = set()  # requests changed outside a step (an import), reported next step
        self._ids = itertools.count()
        # What loading left (modules, tokenizer, weights' metadata) lives as long as the engine: out
        # of the collector's reach, a step's few allocations no longer set off full collections
        # that walk all of it (~1 ms a step at c1), as vLLM's engine core does after startup.
        gc.collect()
        gc.freeze()

    def shutdown(self) -> None:
        """Finish the KV tier's writes; stop the other tensor-parallel ranks."""
        if self.tier is not None:
            self.tier.close()
        if self.ranks is not None:
            self.ranks.stop()

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        kv_span: bytes | None = None,
        export_kv: str | None = None,
        kv_import: ImportPlan | None = None,
    ) -> str:
        """`kv_span`: the prompt's KV computed elsewhere; validated before anything is written
        (InvalidKVImport), then the request waits for admission like any other and decodes from
        its first token. `kv_import`: a span `handoff.plan` validated already (off this thread).
        `export_kv` ("grouped" / "dense"): prefill only, and put the encoded span in the output."""
        text, token_ids = self.inputs.tokenize(prompt)
        bad_words = self.inputs.check(token_ids, params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        if kv_span is not None or kv_import is not None or export_kv is not None:
            if params.n != 1 or params.logprobs is not None or params.prompt_logprobs is not None:
                raise InvalidKVImport("request", "n=1 and no logprobs", f"n={params.n}, logprobs={params.logprobs}")
            if export_kv not in (None, "grouped", "dense"):
                raise ValueError(f"export_kv must be 'grouped' or 'dense', not {export_kv!r}")
            geometries = {(g.num_kv_heads, g.head_dim, g.v_head_dim, g.kind.pool) for g in self.kv_spec.groups}
            if export_kv == "dense" and len(geometries) > 1:
                raise ValueError(
                    "the dense span format holds one KV geometry and this model's groups differ: use grouped"
                )
        if kv_span is not None:
            kv_import = self.handoff.plan(kv_span, token_ids)
        if kv_import is not None:
            return self._add_imported(request_id, text, token_ids, params, kv_import, bad_words)
        samples: list[Request] = []
        for i in range(params.n):
            req = Request(
                f"{request_id}#{i}",
                token_ids,
                params,
                self.eos_token_ids,
                self.max_model_len,
                i,
                leader=samples[0] if samples and self.kv.enable_prefix_caching else None,
                prompt=text,
            )
            req.export_kv = export_kv
            req.bad_words_token_ids = bad_words
            self._attach_grammar(req)
            samples.append(req)
            self.scheduler.add(req)
        if self.tier is not None and not samples[0].needs_prompt_logits:
            self.tier.track(samples[0])
        self.requests[request_id] = samples
        self.prefills["local"] += 1
        return request_id

    def _add_imported(
        self,
        request_id: str,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        plan: ImportPlan,
        bad_words: list[list[int]],
    ) -> str:
        if plan.prompt_token_ids != token_ids:
            raise InvalidKVImport("prompt_token_ids", "the request's tokens", "a span planned for other tokens")
        req = Request(f"{request_id}#0", token_ids, params, self.eos_token_ids, self.max_model_len, prompt=text)
        req.bad_words_token_ids = bad_words
        self._attach_grammar(req)
        why = forbidden(req, plan.first_token, self.model_config.vocab_size)
        if why is not None:  # sampled elsewhere, it must pass the masks a token sampled here would
            allowed = "a token the request's constraints allow"
            raise InvalidKVImport("first_token", allowed, f"{plan.first_token}: {why}")
        req.num_imported_tokens = len(token_ids)
        if self.spec is not None and hasattr(self.spec.draft, "imported"):
            # the MTP drafter needs the target's hidden state at the last prompt position: its first
            # step computes that position again (the same bits, in the request's own block)
            req.num_imported_tokens -= 1
        # imported KV was computed elsewhere: its own salt keeps every other request from resuming
        # from its blocks (a preempted import recomputing here still resumes from its own)
        req.cache_salt = b"kv-import:" + plan.transfer_id.encode()
        self.requests[request_id] = [req]
        self.output.append_token(req, plan.first_token, None, 0.0)
        self._touched.add(request_id)
        if req.is_finished:  # its first token ended it: the span's prefill served it whole
            self.prefills["remote"] += 1
        else:
            req.kv_import = plan  # its blocks and slot come when the scheduler admits it
            self.scheduler.add(req)
        return request_id

    def _attach_grammar(self, req: Request) -> None:
        spec = req.params.structured_outputs
        if spec is not None:
            req.matcher = self.structured.matcher(spec)
        if self.spec is not None and req.sampling_seed is None:  # drafts and verification share its noise
            req.sampling_seed = int(torch.randint(1 << 62, ()))

    def abort_request(self, request_id: str) -> None:
        for req in self.requests.pop(request_id, []):
            if not req.is_finished:
                self.scheduler.finish(req, "abort")
            if self.tier is not None:
                self.tier.forget(req.request_id)
        if self.spec is not None:
            self.spec.release(self._live_requests())

    def _live_requests(self) -> set[str]:
        return {r.request_id for r in self.scheduler.running} | {r.request_id for r in self.scheduler.waiting}

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._touched)

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Advance every scheduled request by one forward pass. If the pass raises, the requests
        of this step are aborted (their blocks freed) and StepFailed names them; the engine stays
        usable for everything else: nothing of the failed step is left behind."""
        batch = self.schedule()
        if not batch.scheduled and self.tier is not None:
            self.tier.wait(0.005)  # nothing runs until a lookup is done: wait for it, not spin
        return self.run(batch)

    def schedule(self) -> SchedulerOutput:
        """The step's batch, with the imports it admitted written into their blocks."""
        if self.tier is not None:
            self.tier.before_schedule()
        batch = self.scheduler.schedule()
        self.prefills["local"] += len(batch.dropped_imports)
        for req in batch.imported:
            self._write_import(batch, req)
        return batch

    def run(self, batch: SchedulerOutput) -> list[RequestOutput]:
        """The forward, sampling and bookkeeping of a scheduled batch (`step` = schedule + run)."""
        if not batch.scheduled:
            return self._outputs(batch)
        self.num_steps_with_work += 1
        try:
            return self._execute(batch)
        except Exception as e:
            failed = sorted({s.request.request_id.rpartition("#")[0] for s in batch.scheduled})
            for rid in failed:
                self.abort_request(rid)
            raise StepFailed(failed) from e

    def _write_import(self, batch: SchedulerOutput, req: Request) -> None:
        """Write an admitted import into the blocks the scheduler gave it; if that fails, what it
        took goes back and the request is prefilled here instead."""
        plan, req.kv_import = req.kv_import, None
        try:
            self.faults.hit("import_alloc", [req])
            self.handoff.apply(req, plan, self.faults)
            if req.num_imported_tokens < len(plan.prompt_token_ids):  # the MTP drafter's own bookkeeping
                self.spec.draft.imported(req.request_id, req.num_computed_tokens)
        except Exception:
            logger.exception("request %s: writing its imported KV failed; prefilling it here", req.request_id)
            self.scheduler.fall_back_to_prefill(batch, req)
            self.num_kv_imports_failed += 1
            self.prefills["local"] += 1
            return
        self.prefills["remote"] += 1
        self.kv.cache_blocks(req.request_id, req.token_ids, req.num_computed_tokens, req.cache_salt)
        self.kv.remove_skipped_blocks(req.request_id, req.num_computed_tokens)

    def _execute(self, batch: SchedulerOutput) -> list[RequestOutput]:
        # the masks of constrained rows that sample this step, computed while the model runs
        constrained = [
            (s.request, s.spec_token_ids)
            for s in batch.scheduled
            if s.request.matcher is not None and s.start + s.num_new_tokens >= s.request.num_tokens
        ]
        masks = self.structured.start_masks(constrained) if constrained else None
        try:
            self._run(batch, masks)
        finally:
            if masks is not None:  # the grammar thread is done with this step's matchers, whatever raised
                futures.wait([masks])
        return self._outputs(batch)

    def _run(self, batch: SchedulerOutput, masks: futures.Future | None) -> None:
        requests = [s.request for s in batch.scheduled]
        start = time.perf_counter()
        out = self.runner.execute(batch)
        self.faults.hit("forward", requests)
        for s in batch.scheduled:
            r = s.request
            r.num_computed_tokens += s.num_new_tokens - len(s.spec_token_ids)  # drafts count once accepted
            self.kv.cache_blocks(r.request_id, r.token_ids, r.num_computed_tokens, r.cache_salt)
        for rid, (a, b) in out.prompt_rows.items():
            record_prompt_logprobs(next(s for s in batch.scheduled if s.request.request_id == rid), out.logits[a:b])
        to_sample = [s for s in batch.scheduled if s.request.request_id in out.sample_rows]
        exports: list[tuple[Request, int]] = []  # prefill-only requests of this step, and their first token
        with self.scheduler.keep_blocks():
            if to_sample:
                self._sample(out, to_sample, masks, exports)
            if self.spec is not None and all(s.is_decode for s in batch.scheduled):  # forward and sampling
                self.spec.observe_step(batch.num_batched_tokens, time.perf_counter() - start)
            if self.spec is not None:
                self.faults.hit("spec", requests)
                self.spec.after_step(batch, out.hidden)  # inside: requests that just finished still have blocks
            for req, first_token in exports:  # after the drafter's update: its layer's KV goes too
                self.faults.hit("export", [req])
                req.kv_span = self.handoff.export(req.request_id, req.prompt_token_ids, first_token, req.export_kv)
        for s in batch.scheduled:
            if not s.request.is_finished and s.request.export_kv is None:  # exports keep every position
                self.kv.remove_skipped_blocks(s.request.request_id, s.request.num_computed_tokens)
        if self.tier is not None:  # before the next schedule reuses any block
            self.tier.after_step()
        if self.spec is not None:
            self.spec.release(self._live_requests())
            self.spec.propose(self.scheduler.running)

    def _sample(self, out: ModelOutput, to_sample: list[ScheduledRequest], masks, exports: list) -> None:
        """A token for each request that takes one (and one per draft it verifies), appended."""
        rows, reqs, offsets = [], [], []
        for s in to_sample:
            first = out.sample_rows[s.request.request_id]
            for j in range(len(s.spec_token_ids) + 1):
                rows.append(first + j)
                reqs.append(s.request)
                offsets.append(j)
        logits = out.logits if rows == list(range(out.logits.shape[0])) else out.logits[torch.tensor(rows)]
        self.faults.hit("sample", reqs)
        result = sample(logits, reqs, masks.result() if masks is not None else None, offsets)
        i = 0
        for s in to_sample:
            n = len(s.spec_token_ids) + 1
            if n == 1 or result.dead[i]:
                self._take_token(s.request, result, i, exports)
            else:
                rows_of = slice(i, i + n)
                accepted = accept_drafts(
                    s,
                    result.token_ids[rows_of],
                    result.logprobs[rows_of],
                    result.sampled_logprobs[rows_of],
                    self.output,
                    self.kv,
                    self.states,
                )
                self.spec.record(s.request, n - 1, accepted)
            i += n

    def _take_token(self, req: Request, result, i: int, exports: list) -> None:
        if result.dead[i]:  # its grammar, allowed_token_ids, bad words, ... left no token
            why = req.matcher.get_error() if req.matcher is not None and req.matcher.is_error() else "none is left"
            req.error = f"no token satisfies the request's constraints (structured output, allowed tokens): {why}"
            self.scheduler.finish(req, "stop")
            return
        self.faults.hit("output", [req])
        if req.export_kv is not None and req.num_output_tokens == 0:
            exports.append((req, result.token_ids[i]))
        self.output.append_token(req, result.token_ids[i], result.logprobs[i], result.sampled_logprobs[i])
        if req.export_kv is not None and not req.is_finished:
            self.scheduler.finish(req, "length")  # a prefill-only request ends at its first token

    def prompt_logits(self, prompt: Prompt) -> torch.Tensor:
        """Float32 logits at every prompt position, computed by the ordinary scheduled path."""
        rid = self.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        req = self.requests[rid][0]
        req.prompt_logits = []
        while not req.is_finished:
            self.step()
        return torch.cat(req.prompt_logits)

    def _outputs(self, batch: SchedulerOutput) -> list[RequestOutput]:
        touched, self._touched = self._touched, set()
        touched |= {s.request.request_id.rpartition("#")[0] for s in batch.scheduled}
        touched |= {r.request_id.rpartition("#")[0] for r in batch.preempted}
        outs = []
        for rid in touched:
            samples = self.requests.get(rid)
            if samples is None:
                continue
            out = request_output(rid, samples)
            if out.finished:
                del self.requests[rid]
                for req in samples if self.tier is not None else ():
                    self.tier.forget(req.request_id)
            outs.append(out)
        return outs
