"""Turn a scheduled batch into tensors (positions, slot mappings, KV read indices) and run it."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from baton.engine.scheduler import SchedulerOutput
from baton.kv.manager import KVManager
from baton.kv.spec import KVGroup
from baton.kv.state import StateStorage
from baton.kv.storage import KVStorage
from baton.models.layers import GroupAttnMetadata, KVTile, PrefillSeq
from baton.models.llama import ForwardContext
from baton.models.recurrent import RecurrentSeq, StateMetadata
from baton.ops import ops
from baton.parallel.pipeline import micro_batches, run_stage
from baton.parallel.ranks import Ranks


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [rows, vocab] float32
    sample_rows: dict[str, int]  # request id -> row of its next-token logits (then one per draft)
    prompt_rows: dict[str, tuple[int, int]]  # request id -> rows [start, end) of its chunk's logits
    hidden: torch.Tensor  # the model's final hidden state of every row, in batch order (the MTP drafter's)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVManager,
        storage: KVStorage,
        states: StateStorage,
        ranks: Ranks | None = None,
    ) -> None:
        self.model = model
        self.ranks = ranks  # tensor parallel: the other ranks run every forward with this metadata
        self.kv = kv
        self.storage = storage
        self.states = states
        self.block_size = kv.block_size
        ops()  # build (first run on a machine) or load the compiled ops now, not on the first decode

    def _group_metadata(self, group: KVGroup, batch: SchedulerOutput) -> GroupAttnMetadata:
        """Each row's slot and context: decodes (verified drafts too) first, a block_table row each;
        then each prefill chunk's rows, reading one table row. Every table row starts at the request's
        first block, so a row's positions [lo, pos] (lo: 0, or where its sliding window starts) are
        the same numbers in a decode and in a chunk: the kernel's grid, and so its bits, follow them."""
        bs = self.block_size
        window = group.kind.window if group.kind.is_sliding else None
        slot_parts, decode_tables, chunk_tables, decode_rows, chunk_rows, prefills = [], [], [], [], [], []
        row = 0
        for s in batch.scheduled:
            table = np.asarray(self.kv.block_tables[s.request.request_id][group.group_id], dtype=np.int64)
            end = s.start + s.num_new_tokens
            pos = np.arange(s.start, end)
            lo = np.zeros_like(pos) if window is None else np.maximum(0, pos - window + 1)
            rows = group.cache_rows(table[pos // bs], pos, bs)
            # a pooled group's row is written by the token that completes its pool; the others: -1
            slot_parts.append(np.where((pos + 1) % group.kind.pool == 0, rows, -1) if group.kind.is_pooled else rows)
            if s.is_decode:  # a verified draft reads exactly what a decode at its position would
                for p, first in zip(pos.tolist(), lo.tolist(), strict=True):
                    decode_tables.append(table[: p // bs + 1])
                    decode_rows.append((first, p + 1 - first))
                row += s.num_new_tokens
                continue
            chunk_tables.append(table[: (end - 1) // bs + 1])
            chunk_rows.append((lo, pos + 1 - lo))
            if group.kind.is_mla:
                prefills.append(self._mla_prefill(row, s.start, end, table, window))
            else:
                prefills.append(PrefillSeq(row, row + s.num_new_tokens, None, []))
            row += s.num_new_tokens
        tables = decode_tables + chunk_tables
        block_table = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
        for i, t in enumerate(tables):
            block_table[i, : len(t)] = t
        nd = len(decode_rows)
        offsets = np.concatenate([np.array([o for o, _ in decode_rows], dtype=np.int64)] + [o for o, _ in chunk_rows])
        lens = np.concatenate([np.array([n for _, n in decode_rows], dtype=np.int64)] + [n for _, n in chunk_rows])
        row_seq = None
        if chunk_rows:
            seqs = [np.arange(nd)] + [np.full(len(o), nd + i) for i, (o, _) in enumerate(chunk_rows)]
            row_seq = torch.from_numpy(np.concatenate(seqs).astype(np.int64, copy=False))
        return GroupAttnMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts).astype(np.int64, copy=False)),
            block_size=bs,
            num_decodes=nd,
            block_table=torch.from_numpy(block_table),
            kv_offsets=torch.from_numpy(offsets.astype(np.int64, copy=False)),
            kv_lens=torch.from_numpy(lens.astype(np.int64, copy=False)),
            row_seq=row_seq,
            prefills=prefills,
        )

    def _mla_prefill(self, row: int, start: int, end: int, table: np.ndarray, window: int | None) -> PrefillSeq:
        """An MLA chunk: the slots of its context and the tiles its flash calls read."""
        n = end - start
        if start == 0 and (window is None or n <= window):
            return PrefillSeq(row, row + n, None, [])  # K/V from the batch, causal
        bs = self.block_size
        kv_start = 0 if window is None else max(0, start - window + 1)
        kv_pos = np.arange(kv_start, end)
        kv_slots = table[kv_pos // bs] * bs + kv_pos % bs
        slots = None if start == 0 else torch.from_numpy(kv_slots)
        return PrefillSeq(row, row + n, slots, _kv_tiles(start, end, kv_start, window))

    def _state_metadata(self, batch: SchedulerOutput) -> StateMetadata | None:
        """Each request's state slot (set from zeros or a checkpoint before its first forward) and
        the checkpoints to record at block boundaries inside its rows."""
        if not self.kv.spec.has_state:
            return None
        seqs, row = [], 0
        for s in batch.scheduled:
            rid = s.request.request_id
            restore = self.kv.pop_restore(rid)
            if restore is not None:
                slot, cid = restore
                if cid is None:
                    self.states.reset(slot)
                else:
                    self.states.restore(slot, cid)
            slot = self.kv.state_slots[rid]
            snaps = [
                (p - s.start, cid)
                for p, cid in self.kv.pending_snapshots.get(rid, [])
                if 0 < p - s.start <= s.num_new_tokens  # a pipeline's micro-batch holds a piece of the chunk
            ]
            # the state after each verify row but the last: the accepted one is committed after sampling
            snaps += [(j + 1, self.states.scratch(slot, j)) for j in range(len(s.spec_token_ids))]
            seqs.append(RecurrentSeq(row, row + s.num_new_tokens, slot, sorted(snaps)))
            row += s.num_new_tokens
        return StateMetadata(seqs)

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        try:
            return self._execute(batch)
        except Exception as e:
            if self.ranks is not None:  # the other ranks may be waiting in a collective of this step
                self.ranks.lose(f"a step failed on the driver ({type(e).__name__}: {e})")
            raise

    def _execute(self, batch: SchedulerOutput) -> ModelOutput:
        input_ids, positions, logit_rows = [], [], []
        sample_rows: dict[str, int] = {}
        prompt_rows: dict[str, tuple[int, int]] = {}
        row = 0
        for s in batch.scheduled:
            req, end = s.request, s.start + s.num_new_tokens
            input_ids.extend(req.token_ids[s.start : end - len(s.spec_token_ids)])
            input_ids.extend(s.spec_token_ids)
            positions.append(np.arange(s.start, end))
            if s.spec_token_ids:  # every row samples: the last token's next and each draft's
                sample_rows[req.request_id] = len(logit_rows)
                logit_rows.extend(range(row, row + s.num_new_tokens))
            elif req.needs_prompt_logits:
                prompt_rows[req.request_id] = (len(logit_rows), len(logit_rows) + s.num_new_tokens)
                logit_rows.extend(range(row, row + s.num_new_tokens))
                if end == req.num_tokens:
                    sample_rows[req.request_id] = len(logit_rows) - 1
            elif end == req.num_tokens:
                sample_rows[req.request_id] = len(logit_rows)
                logit_rows.append(row + s.num_new_tokens - 1)
            row += s.num_new_tokens
        ids, pos = torch.tensor(input_ids, dtype=torch.long), torch.from_numpy(np.concatenate(positions))
        if self.ranks is not None and self.ranks.stage is not None:  # the final hidden stays on the last stage
            return ModelOutput(self._pipeline(batch, ids, pos, logit_rows), sample_rows, prompt_rows, torch.empty(0))
        ctx = ForwardContext(
            self.storage,
            [self._group_metadata(g, batch) for g in self.kv.spec.groups],
            self.states,
            self._state_metadata(batch),
        )
        # else every row, in order (logit_rows is increasing)
        rows = torch.tensor(logit_rows, dtype=torch.long) if len(logit_rows) < len(input_ids) else None
        if self.ranks is not None:
            self.ranks.send(
                {
                    "op": "forward",
                    "input_ids": ids,
                    "positions": pos,
                    "groups": ctx.groups,
                    "state_meta": ctx.state_meta,
                    "journal": self._take_journal(),
                    "logit_rows": rows,
                }
            )
        hidden = self.model(ids, pos, ctx)
        every_row = hidden
        if rows is not None:
            hidden = hidden[rows]
        logits = self.model.compute_logits(hidden).float()
        return ModelOutput(logits, sample_rows, prompt_rows, every_row)

    def _take_journal(self) -> list[list]:
        journal, self.states.journal = self.states.journal, []
        return journal

    def _pipeline(self, batch: SchedulerOutput, ids: torch.Tensor, pos: torch.Tensor, logit_rows: list[int]):
        """The step as micro-batches through the pipeline's stages; the logits of `logit_rows`."""
        stage = self.ranks.stage
        steps, row = [], 0
        # more micro-batches shrink the pipeline's bubble and cost a message and a context read each:
        # two per stage paid on a 1,000-token prefill (458 -> 586 tok/s at PP=2), one per stage on decodes
        count = stage.count * (2 if batch.num_batched_tokens >= 128 else 1)
        for mb in micro_batches(batch.scheduled, count):
            sub = SchedulerOutput(mb)
            n = sub.num_batched_tokens
            rows = [r - row for r in logit_rows if row <= r < row + n]
            steps.append(
                {
                    "input_ids": ids[row : row + n],
                    "positions": pos[row : row + n],
                    "groups": [self._group_metadata(g, sub) for g in self.kv.spec.groups],
                    "state_meta": self._state_metadata(sub),
                    "logit_rows": torch.tensor(rows, dtype=torch.long) if len(rows) < n else None,
                }
            )
            row += n
        self.ranks.send({"op": "pipeline", "steps": steps, "journal": self._take_journal()})
        forward = partial(forward_step, self.model, self.storage, self.states)
        return torch.cat(run_stage(self.model, stage, steps, forward))


def forward_step(model: torch.nn.Module, storage: KVStorage, states: StateStorage, step: dict) -> torch.Tensor:
    """The model on one step's (or micro-batch's) metadata as the driver sends it to every rank."""
    return model(
        step["input_ids"], step["positions"], ForwardContext(storage, step["groups"], states, step["state_meta"])
    )


KV_TILE = 1024  # context positions one prefill attention call reads (at least the chunk's length)


def _kv_tiles(q_start: int, end: int, kv_start: int, window: int | None) -> list[KVTile]:
    """Split the context [kv_start, end) of queries at [q_start, end) into tiles, newest first;
    masks only where a tile is not visible to every query (the causal edge, a window's edge)."""
    q_pos = np.arange(q_start, end)
    size = max(KV_TILE, end - q_start)
    tiles = []
    for hi in range(end, kv_start, -size):
        lo = max(kv_start, hi - size)
        if hi - 1 <= q_start and (window is None or lo > end - 1 - window):
            tiles.append(KVTile(lo - kv_start, hi - kv_start, None, None))
            continue
        kv_pos = np.arange(lo, hi)
        visible = kv_pos[None, :] <= q_pos[:, None]
        if window is not None:
            visible &= kv_pos[None, :] > q_pos[:, None] - window
        mask = torch.from_numpy(np.where(visible, np.float32(0), np.float32(-np.inf)))
        blind = ~visible.any(axis=1)
        tiles.append(KVTile(lo - kv_start, hi - kv_start, mask, torch.from_numpy(blind) if blind.any() else None))
    return tiles
