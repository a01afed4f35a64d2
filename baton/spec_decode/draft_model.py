"""A draft model proposer: a smaller model with the target's vocabulary (or a quantized copy of
the target) drafts k tokens per request autoregressively, in its own paged KV cache.

The draft keeps, per request, the tokens whose KV it holds. Before drafting it resumes at the
longest prefix of those that the request's real tokens still share (rejected drafts fall away
there), computes the rest in one catch-up forward, samples its first draft from that, then one
batched decode forward per further draft. Only real tokens are published to its prefix cache,
so a new request resumes from the blocks of earlier ones, as the target does. Drafts are drawn
with the request's own sampling settings and the noise of the output position they propose:
a draft that agrees with the target's draw is accepted, so seeded requests keep their tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from baton.config import CacheConfig, EngineConfig, SchedulerConfig
from baton.engine.request import Request
from baton.engine.runner import ModelRunner
from baton.engine.sampler import sample
from baton.engine.scheduler import ScheduledRequest, SchedulerOutput
from baton.kv.memory import build_cache_memory
from baton.models.layers import can_pack_linears, describe_linears
from baton.models.loader import load_model
from baton.models.model_config import TextModelConfig

logger = logging.getLogger(__name__)


@dataclass
class DraftSeq:
    """What the runner reads of a sequence: its tokens (real ones, then drafts) and its id."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    salt: bytes = b""
    needs_prompt_logits: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, target: TextModelConfig, progress: bool = True) -> None:
        spec = config.speculative
        assert spec is not None and spec.model
        keep_blocks = spec.quantization is None
        loaded = load_model(spec.model, torch.float32, config.env.cache_dir, progress=progress, keep_blocks=keep_blocks)
        self.model, mc = loaded.model, loaded.config
        if mc.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model {spec.model} has a vocabulary of {mc.vocab_size} tokens, the target "
                f"{target.vocab_size}: a draft model must share the target's tokenizer"
            )
        if can_pack_linears(torch.float32):
            self.model.pack_linears(spec.quantization)
        logger.info("draft model %s: %s", loaded.path.name, describe_linears(self.model))
        cache = CacheConfig(
            block_size=config.cache.block_size,
            kv_cache_memory_bytes=config.cache.kv_cache_memory_bytes // 4,
            enable_prefix_caching=config.cache.enable_prefix_caching,
        )
        sched = config.scheduler
        limits = SchedulerConfig(sched.max_num_seqs, sched.max_num_batched_tokens)
        memory = build_cache_memory(mc, cache, limits, torch.float32)
        if memory.spec.has_state:
            raise ValueError(f"the draft model {spec.model} has recurrent layers; baton drafts with attention models")
        self.kv = memory.kv
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.runner = ModelRunner(self.model, memory.kv, memory.storage, memory.states)
        self.seqs: dict[str, DraftSeq] = {}
        self.seconds_per_draft: float | None = None  # of the latest proposal's decode forwards

    def release(self, keep: set[str]) -> None:
        """Free the draft KV of requests not in `keep` (finished, aborted or preempted)."""
        for rid in [r for r in self.seqs if r not in keep]:
            self.kv.free(rid)
            del self.seqs[rid]

    def propose(self, wanted: list[tuple[Request, int]]) -> list[list[int]]:
        """Up to k drafts for each (request, k)."""
        drafts: dict[str, list[int]] = {req.request_id: [] for req, _ in wanted}
        active = [(req, seq, k) for req, k in wanted if (seq := self._resume(req)) is not None]
        step = 0
        decode_seconds, decoded = 0.0, 0
        while active:
            start = time.perf_counter()
            logits = self._forward([seq for _, seq, _ in active], publish=step == 0)
            reqs = [req for req, _, _ in active]
            result = sample(torch.stack([logits[req.request_id] for req in reqs]), reqs, None, [step] * len(reqs))
            still = []
            for (req, seq, k), token, dead in zip(active, result.token_ids, result.dead):
                if dead:
                    continue
                drafts[req.request_id].append(token)
                if len(drafts[req.request_id]) == k or token in req.stop_token_ids:
                    continue
                if self.kv.allocate_slots(seq.request_id, seq.token_ids, seq.num_computed_tokens, 1):
                    seq.token_ids.append(token)
                    still.append((req, seq, k))
            if step > 0:  # the catch-up forward also computes new prompts: not a draft's cost
                decode_seconds += time.perf_counter() - start
                decoded += len(reqs)
            active = still
            step += 1
        if decoded:
            self.seconds_per_draft = decode_seconds / decoded
        return [drafts[req.request_id] for req, _ in wanted]

    def _forward(self, seqs: list[DraftSeq], publish: bool) -> dict[str, torch.Tensor]:
        """Compute every seq's uncomputed tokens (in forwards within the token budget); the logits
        after each one's last token. `publish`: its tokens are all real, so its blocks may be cached."""
        logits: dict[str, torch.Tensor] = {}
        pending = seqs
        while pending:
            batch, budget = SchedulerOutput(), self.max_num_batched_tokens
            for seq in pending:
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if n <= 0:
                    break
                batch.scheduled.append(ScheduledRequest(seq, n, seq.num_computed_tokens))  # type: ignore[arg-type]
                budget -= n
            batch.scheduled.sort(key=lambda s: not s.is_decode)
            out = self.runner.execute(batch)
            for s in batch.scheduled:
                seq = s.request
                seq.num_computed_tokens += s.num_new_tokens
                if seq.request_id in out.sample_rows:
                    logits[seq.request_id] = out.logits[out.sample_rows[seq.request_id]]
                if publish:
                    self.kv.cache_blocks(seq.request_id, seq.token_ids, seq.num_computed_tokens, seq.salt)
            pending = [seq for seq in pending if seq.num_computed_tokens < seq.num_tokens]
        return logits

    def _resume(self, req: Request) -> DraftSeq | None:
        """The draft's sequence of `req` with its real tokens, resumed where its KV still holds them."""
        rid = req.request_id
        seq = self.seqs.get(rid)
        if seq is None:
            seq = DraftSeq(rid, salt=req.cache_salt)
            hit = self.kv.find_cached_prefix(rid, req.token_ids, req.cache_salt)
            num_new = req.num_tokens - hit.num_tokens
            if not self.kv.allocate_slots(rid, req.token_ids, 0, num_new, hit.num_tokens, req.cache_salt):
                return None
            seq.num_computed_tokens = hit.num_tokens
            self.seqs[rid] = seq
        else:
            same = 0
            limit = min(seq.num_computed_tokens, req.num_tokens - 1)
            while same < limit and seq.token_ids[same] == req.token_ids[same]:
                same += 1
            seq.num_computed_tokens = same
            self.kv.trim(rid, same)
            if not self.kv.allocate_slots(rid, req.token_ids, same, req.num_tokens - same, salt=req.cache_salt):
                self.release(set(self.seqs) - {rid})  # its draft KV goes; it decodes without drafts
                return None
        seq.token_ids = list(req.token_ids)
        return seq
