"""Which requests draft, how many tokens each, and what verification accepted (vLLM's metrics).

A request drafts only in its decode phase and only when its sampling reads nothing but the
logits of its own row (penalties and bad words read the output itself, so a draft would change
them). How far it drafts is a cost decision made each step: a draft row costs what one more row
of the batch costs, and pays only if its chance of being accepted is at least that cost over
the cost per token of the batch without drafts. The step costs come from the engine's own
decode steps (seconds = a + b * rows, least squares over the recent ones), each request's
acceptance from its own verifications; so a lone request drafts deep, a large batch drafts
only what is near-certain, and above `disable_by_batch_size` running requests nobody drafts."""

from __future__ import annotations

import logging
import math
import time
from collections import deque

from baton.config import SpeculativeConfig
from baton.engine.request import Request
from baton.spec_decode.ngram import propose_ngram

logger = logging.getLogger(__name__)
LOG_INTERVAL_S = 10.0
PRIOR_ACCEPTANCE = 0.7  # a request's acceptance before its first verification, worth PRIOR_WEIGHT drafts
PRIOR_WEIGHT = 2.0
DECAY = 0.8  # of a request's acceptance history, per verification
MARGIN = 1.15  # a draft must beat its cost by this much: step times are noisy, and a wrong guess costs


class StepCost:
    """seconds = a + b * rows of the recent decode-only steps (forward and sampling), fitted by least
    squares over the steps near the batch size asked about (a row's cost is not the same at every
    size: the kernels change paths), else over all; until rows vary enough to tell b from a,
    b = `prior_ratio` * a."""

    def __init__(self, window: int = 1024, prior_ratio: float = 0.2, refit_every: int = 16) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.prior_ratio = prior_ratio
        self.refit_every = refit_every
        self._fits: dict[int | None, tuple[float, float] | None] = {}  # kept between refits

    def add(self, rows: int, seconds: float) -> None:
        self.samples.append((rows, seconds))
        if len(self.samples) % self.refit_every == 0 or len(self.samples) < self.refit_every:
            self._fits.clear()

    def fit(self, batch: int | None = None) -> tuple[float, float] | None:
        """(a, b) in seconds for batches near `batch` (None: all), or None before any step."""
        if batch not in self._fits:
            self._fits[batch] = self._fit(batch)
        return self._fits[batch]

    def _fit(self, batch: int | None) -> tuple[float, float] | None:
        if batch is not None:
            near = [(r, t) for r, t in self.samples if batch // 2 <= r <= 2 * batch + 8]
            local = _least_squares(near)
            if local is not None:
                return local
        if not self.samples:
            return None
        fitted = _least_squares(list(self.samples))
        if fitted is not None:
            return fitted
        mean_r = sum(r for r, _ in self.samples) / len(self.samples)
        a = sum(t for _, t in self.samples) / len(self.samples) / (1 + self.prior_ratio * mean_r)
        return a, self.prior_ratio * a

    def threshold(self, batch: int, draft_seconds: float) -> float:
        """The acceptance a draft needs to pay in a batch of `batch` decodes: its verify row's cost
        b plus what drafting it cost, over the batch's cost per token (a + b * batch) / batch."""
        fit = self.fit(batch)
        if fit is None:
            return 0.0
        a, b = fit
        return min(1.0, MARGIN * (b + draft_seconds) * batch / (a + b * batch))


def _least_squares(samples: list[tuple[int, float]]) -> tuple[float, float] | None:
    n = len(samples)
    if n < 16:
        return None
    mean_r = sum(r for r, _ in samples) / n
    mean_t = sum(t for _, t in samples) / n
    var = sum((r - mean_r) ** 2 for r, _ in samples)
    if var < n * 0.25:
        return None
    b = sum((r - mean_r) * (t - mean_t) for r, t in samples) / var
    a = mean_t - b * mean_r
    return (a, b) if a > 0 and b > 0 else None


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, draft=None, allowed_drafts=None) -> None:
        self.config = config
        self.draft = draft  # a SuffixProposer, DraftModelProposer or MtpProposer; None: n-gram
        self.allowed_drafts = allowed_drafts  # (request, drafts) -> drafts cut where its grammar forbids
        k = config.num_speculative_tokens
        self.num_drafts = 0  # verifications with at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * k
        self._logged = (time.monotonic(), 0, 0, 0, [0] * k)  # when, and the counters then
        self.cost = StepCost()
        self.draft_seconds = 0.0  # what proposing one draft token costs (EWMA; n-gram's is nothing)

    @property
    def max_k(self) -> int:
        return self.config.num_speculative_tokens

    def release(self, live: set[str]) -> None:
        """Forget (and free the draft KV of) requests that are not running or waiting any more."""
        if self.draft is not None:
            self.draft.release(live)

    def after_step(self, batch, hidden) -> None:
        """What the drafter learns from every step (MTP: the pairs it made known)."""
        if self.draft is not None and hasattr(self.draft, "update"):
            self.draft.update(batch, hidden)

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
        if self.draft is not None and hasattr(self.draft, "observe"):
            self.draft.observe(running)
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) >= limit:
            for req in running:
                req.spec_token_ids = []
            return
        threshold = self.cost.threshold(len(running), self.draft_seconds)
        wanted: list[tuple[Request, int]] = []
        for req in running:
            req.spec_token_ids = []
            if not self.eligible(req):
                continue
            k = min(self.draft_length(req, threshold), req.max_len - req.num_tokens - 1)
            if k > 0:
                wanted.append((req, k))
            else:  # its history fades back to the prior: it tries again later
                hits, tries = req.spec_acceptance
                req.spec_acceptance = (DECAY * hits, DECAY * tries)
        if not wanted:
            return
        if self.draft is not None:
            start = time.perf_counter()
            proposals = self.draft.propose(wanted)
            drafted = sum(len(p) for p in proposals)
            # a draft model reports its decode forwards' cost (its catch-up also prefills new prompts)
            per_token = getattr(self.draft, "seconds_per_draft", None)
            if per_token is None and drafted:
                per_token = (time.perf_counter() - start) / drafted
            if per_token is not None:
                self.draft_seconds = per_token if not self.draft_seconds else 0.8 * self.draft_seconds + 0.2 * per_token
        else:
            c = self.config
            proposals = [propose_ngram(r.token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max) for r, k in wanted]
        for (req, _), drafts in zip(wanted, proposals):
            req.spec_token_ids = self.allowed_drafts(req, drafts) if self.allowed_drafts else drafts

    def draft_length(self, req: Request, threshold: float) -> int:
        """The most drafts whose chance of acceptance (the request's per-draft rate to the power of
        the position) still pays `threshold`."""
        if not self.config.adaptive:
            return self.max_k
        hits, tries = req.spec_acceptance
        rate = (hits + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (tries + PRIOR_WEIGHT)
        if rate >= 1.0 or threshold <= 0.0:
            return self.max_k
        if rate <= threshold or rate <= 0.0:
            return 0
        return min(self.max_k, int(math.log(threshold) / math.log(rate)))

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode-only step's rows and its forward's seconds: the cost model's data."""
        self.cost.add(rows, seconds)

    def record(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
        # each draft tried until the first rejection: `num_accepted` hits in as many tries, plus one
        hits, tries = req.spec_acceptance
        req.spec_acceptance = (
            DECAY * hits + num_accepted,
            DECAY * tries + num_accepted + (num_accepted < num_drafts),
        )
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
