"""Drafts from the target's own multi-token-prediction layer (GLM-4.5's `num_nextn_predict_layers`).

The MTP layer's slot q holds the pair (the target's hidden state at q - 1, the token at q). After
every step, each scheduled request's new pairs are computed in one batched MTP forward: those
whose hidden state the step's forward produced and whose token is known (the newest one is the
token just sampled or accepted). So the MTP KV stays one position ahead of the target's, and the
output of the newest pair is the first draft; further drafts chain the layer on its own output
(slots past the request's tokens, rewritten by real pairs when the target gets there).

The hidden state of each block's last position is kept beside the block: a request that resumes
from a prefix hit at L computes the pair at L from it, so no cached block is dropped for the
drafter (vLLM drops the last matched block on every hit for this). An imported request (PD) gets
its MTP slots in the span; its first step computes the last prompt position again, for the
hidden state the next pair needs.
"""

from __future__ import annotations

import numpy as np
import torch

from baton.engine.request import Request
from baton.engine.sampler import sample
from baton.engine.scheduler import SchedulerOutput
from baton.kv.manager import KVManager
from baton.kv.storage import KVStorage
from baton.models.layers import GroupAttnMetadata
from baton.models.llama import ForwardContext


class MtpProposer:
    def __init__(self, model: torch.nn.Module, kv: KVManager, storage: KVStorage) -> None:
        if not getattr(model, "mtp", None):
            raise ValueError("speculative method mtp: this model has no MTP layers baton runs")
        self.model = model
        self.kv = kv
        self.storage = storage
        self.layer_id = model.cfg.num_layers  # the first MTP layer's KV layer
        self.group_id = kv.spec.layer_to_group[self.layer_id][0]
        self.block_size = kv.block_size
        num_blocks = kv.pools[self.group_id].num_blocks
        self.block_hidden = torch.zeros(num_blocks, model.cfg.hidden_size)  # hidden state of each block's last position
        self.valid: dict[str, int] = {}  # request -> its MTP slots [1, valid] hold real pairs
        self.preemptions: dict[str, int] = {}  # request -> its preemptions when `valid` was set
        self.carried: dict[str, tuple[int, torch.Tensor]] = {}  # request -> (position, hidden) its next pair needs
        self.newest: dict[str, torch.Tensor] = {}  # request -> MTP output of its newest pair (the first draft's)

    def imported(self, request_id: str, num_computed_tokens: int) -> None:
        """A request whose prompt KV (the MTP layer's slots [1, n - 1] with it) came in a span; its
        first step computes position n - 1 again, so the pairs from n on are formed here."""
        self.valid[request_id] = num_computed_tokens
        self.preemptions[request_id] = 0

    def release(self, keep: set[str]) -> None:
        for rid in [r for r in self.valid if r not in keep]:
            del self.valid[rid]
            self.preemptions.pop(rid, None)
            self.carried.pop(rid, None)
            self.newest.pop(rid, None)

    # ---- after every step: the pairs it made known ---------------------------------------------
    @torch.inference_mode()
    def update(self, batch: SchedulerOutput, hidden: torch.Tensor) -> None:
        """`hidden`: the target's final hidden state of every row of the step, in batch order."""
        bs = self.block_size
        rows, tokens, previous, positions = [], [], [], []
        row = 0
        for s in batch.scheduled:
            req, rid = s.request, s.request.request_id
            first = row
            row += s.num_new_tokens
            table = self.kv.block_tables.get(rid, [None])[self.group_id]
            if table is None:
                continue
            done = req.num_computed_tokens  # after acceptance: positions [0, done) hold real KV
            for p in range(s.start, done):  # the hidden state of each block's last position
                if p % bs == bs - 1:
                    self.block_hidden[table[p // bs]] = hidden[first + p - s.start]
            valid = self.valid.get(rid)
            if valid is None or self.preemptions.get(rid) != req.num_preemptions:  # new, or restarted
                valid = max(0, s.start - 1)  # a prefix hit at s.start brought the slots before it
                self.preemptions[rid] = req.num_preemptions
            last = min(done, req.num_tokens - 1)
            if req.is_finished:
                last = min(last, done - 1)  # its blocks end there: no slot past them
            elif last >= len(table) * bs and not self.kv.allocate_slots(
                rid, req.token_ids, done, 1, salt=req.cache_salt
            ):
                last = len(table) * bs - 1  # no room for the newest pair's slot yet: it waits a step
            carried = self.carried.pop(rid, None)
            for q in range(valid + 1, last + 1):
                if q - 1 >= s.start:
                    h = hidden[first + q - 1 - s.start]
                elif carried is not None and carried[0] == q - 1:
                    h = carried[1]
                else:  # a prefix hit at q: the hidden state kept with the block before it
                    assert q % bs == 0, f"MTP pair {q} of {rid} has no hidden state"
                    h = self.block_hidden[table[(q - 1) // bs]]
                rows.append((rid, q))
                tokens.append(req.token_ids[q])
                previous.append(h)
                positions.append(q)
            self.valid[rid] = max(valid, last)
            if done > s.start and self.valid[rid] < done:  # the next pair's hidden state, for the next step
                self.carried[rid] = (done - 1, hidden[first + done - 1 - s.start].clone())
        self.newest = {}
        if not rows:
            return
        out = self._forward(rows, tokens, torch.stack(previous), positions)
        for i, (rid, q) in enumerate(rows):
            if self.valid.get(rid) == q:
                self.newest[rid] = out[i]

    # ---- drafting ------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Request, int]]) -> list[list[int]]:
        drafts: dict[str, list[int]] = {req.request_id: [] for req, _ in wanted}
        active = []  # (request, drafts wanted, the MTP output the next draft comes from)
        for req, k in wanted:
            rid = req.request_id
            if rid not in self.newest or self.valid.get(rid) != req.num_tokens - 1:
                continue
            # chained drafts write slots num_tokens .. num_tokens + k - 2
            if k > 1 and not self.kv.allocate_slots(rid, req.token_ids, req.num_tokens, k - 1, salt=req.cache_salt):
                k = 1
            active.append((req, k, self.newest[rid]))
        step = 0
        while active:
            reqs = [req for req, _, _ in active]
            logits = self.model.compute_logits(torch.stack([h for _, _, h in active])).float()
            result = sample(logits, reqs, None, [step] * len(reqs))
            chained = []
            for (req, k, h), token, dead in zip(active, result.token_ids, result.dead):
                if dead:
                    continue
                drafts[req.request_id].append(token)
                if len(drafts[req.request_id]) < k and token not in req.stop_token_ids:
                    chained.append((req, k, h))
            if not chained:
                break
            rows = [(req.request_id, req.num_tokens + step) for req, _, _ in chained]
            tokens = [drafts[req.request_id][-1] for req, _, _ in chained]
            out = self._forward(rows, tokens, torch.stack([h for _, _, h in chained]), [q for _, q in rows])
            active = [(req, k, out[i]) for i, (req, k, _) in enumerate(chained)]
            step += 1
        return [drafts[req.request_id] for req, _ in wanted]

    def _forward(
        self, rows: list[tuple[str, int]], tokens: list[int], previous: torch.Tensor, positions: list[int]
    ) -> torch.Tensor:
        """The MTP layer on pairs (request, slot q): each row writes its slot and, as a decode,
        reads the request's slots [1, q] (all rows' slots are written first)."""
        bs = self.block_size
        slots, blocks, lens = [], [], []
        for rid, q in rows:
            table = self.kv.block_tables[rid][self.group_id]
            slots.append(table[q // bs] * bs + q % bs)
            blocks.append(table[: q // bs + 1])
            lens.append(q)
        width = max(len(b) for b in blocks)
        block_ids = np.zeros((len(rows), width), dtype=np.int64)
        for i, b in enumerate(blocks):
            block_ids[i, : len(b)] = b
        meta = GroupAttnMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_size=bs,
            num_decodes=len(rows),
            block_table=torch.from_numpy(block_ids),
            kv_offsets=torch.ones(len(rows), dtype=torch.long),  # slot 0 holds no pair
            kv_lens=torch.tensor(lens, dtype=torch.long),
            row_seq=None,
            prefills=[],
        )
        groups = [meta if g.group_id == self.group_id else None for g in self.kv.spec.groups]
        ctx = ForwardContext(self.storage, groups)  # type: ignore[arg-type]
        ids = torch.tensor(tokens, dtype=torch.long)
        return self.model.mtp_forward(0, ids, previous.to(self.model.norm.weight.dtype), torch.tensor(positions), ctx)
