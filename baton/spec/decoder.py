"""Which requests draft, how many tokens each, and what verification accepted (vLLM's metrics).

A request drafts only in its decode phase and only when its sampling reads nothing but the
logits of its own row (penalties and bad words read the output itself, so a draft would change
them). Each request's k follows what its verifications accepted: all accepted raises it by one
(up to the configured k), a rejection sets it to one past what was accepted. Above
`disable_by_batch_size` running requests nobody drafts."""

from __future__ import annotations

import logging
import time

from baton.config import SpeculativeConfig
from baton.engine.request import Request
from baton.spec.ngram import propose_ngram

logger = logging.getLogger(__name__)
LOG_INTERVAL_S = 10.0


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, draft=None, allowed_drafts=None) -> None:
        self.config = config
        self.draft = draft  # a DraftModelProposer for method draft_model
        self.allowed_drafts = allowed_drafts  # (request, drafts) -> drafts cut where its grammar forbids
        k = config.num_speculative_tokens
        self.num_drafts = 0  # verifications with at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * k
        self._logged = (time.monotonic(), 0, 0, 0, [0] * k)  # when, and the counters then

    @property
    def max_k(self) -> int:
        return self.config.num_speculative_tokens

    def eligible(self, req: Request) -> bool:
        p = req.params
        return (
            not req.is_finished
            and req.num_computed_tokens == req.num_tokens - 1
            and req.export_kv is None
            and not p.uses_penalties
            and not req.bad_words_token_ids
        )

    def propose(self, running: list[Request]) -> None:
        """Set `spec_token_ids` of the running requests the next step verifies."""
        if self.draft is not None:
            self.draft.release({r.request_id for r in running})
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) >= limit:
            for req in running:
                req.spec_token_ids = []
            return
        wanted: list[tuple[Request, int]] = []
        for req in running:
            req.spec_token_ids = []
            if not self.eligible(req):
                continue
            if req.num_speculative_tokens == 0:
                req.num_speculative_tokens = self.max_k
            k = min(req.num_speculative_tokens, req.max_len - req.num_tokens - 1)
            if k > 0:
                wanted.append((req, k))
        if not wanted:
            return
        if self.draft is not None:
            proposals = self.draft.propose(wanted)
        else:
            c = self.config
            proposals = [propose_ngram(r.token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max) for r, k in wanted]
        for (req, _), drafts in zip(wanted, proposals):
            req.spec_token_ids = self.allowed_drafts(req, drafts) if self.allowed_drafts else drafts

    def record(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
        if self.config.adaptive:
            if num_accepted == num_drafts:
                req.num_speculative_tokens = min(self.max_k, req.num_speculative_tokens + 1)
            else:
                req.num_speculative_tokens = num_accepted + 1
        if time.monotonic() - self._logged[0] >= LOG_INTERVAL_S:
            self._log()

    def _log(self) -> None:
        """As vLLM logs it, over the last interval."""
        _, drafts, draft_tokens, accepted, per_position = self._logged
        drafts = self.num_drafts - drafts
        if drafts:
            rates = [(a - b) / drafts for a, b in zip(self.accepted_per_position, per_position)]
            logger.info(
                "spec decode: mean acceptance length %.2f, accepted %d of %d draft tokens (%.1f %%), "
                "per-position acceptance %s",
                1 + (self.num_accepted_tokens - accepted) / drafts,
                self.num_accepted_tokens - accepted,
                self.num_draft_tokens - draft_tokens,
                100 * (self.num_accepted_tokens - accepted) / max(1, self.num_draft_tokens - draft_tokens),
                ", ".join(f"{r:.2f}" for r in rates),
            )
        self._logged = (
            time.monotonic(),
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_position),
        )

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification: the accepted drafts plus the token the target adds."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
