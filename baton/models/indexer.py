"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5).

Per token one key of `index_head_dim` (LayerNorm(wk(x)), rotary on its first rope channels), kept
in the layer's MLA cache row after the latent; per query `index_n_heads` queries (wq_b of the MLA's
q_a residual) whose ReLU'd, scaled dot products with every visible key, weighted per head by
weights_proj(x) / sqrt(heads), score the keys in float32. The query attends to the top
`index_topk` visible keys: to all of them while it sees no more than that (dense MLA, so scoring
is skipped there)."""

from __future__ import annotations

import torch
from torch import nn

from baton.models.model_config import TextModelConfig
from baton.models.recurrent import segments
from baton.models.rope import apply_rotary

SCORE_BYTES = 1 << 26  # the float32 [rows, heads, keys] products a prefill scores at once


class Indexer(nn.Module):
    def __init__(self, cfg: TextModelConfig, q_lora_rank: int, rope_dim: int) -> None:
        super().__init__()
        hf = cfg.hf
        self.heads, self.dim = int(hf.get("index_n_heads", 64)), int(hf.get("index_head_dim", 128))
        self.topk = int(hf.get("index_topk", 2048))
        if self.heads < 1 or self.dim < rope_dim or self.topk < 1:
            raise ValueError(
                f"the indexer needs index_n_heads >= 1, index_head_dim >= qk_rope_head_dim ({rope_dim}) and "
                f"index_topk >= 1, got {self.heads}, {self.dim}, {self.topk}"
            )
        self.rope_dim = rope_dim
        self.wq_b = nn.Linear(q_lora_rank, self.heads * self.dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.dim, bias=False)
        self.k_norm = nn.LayerNorm(self.dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.heads, bias=False)
        self.scale = self.dim**-0.5

    def _rotate(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Rotary on the first rope_dims channels of x [T, heads, D], in place (half-split: an
        interleaved checkpoint's rows are reordered at load)."""
        if rope is not None and self.rope_dim:
            x[..., : self.rope_dim] = apply_rotary(x[..., : self.rope_dim], *rope)

    def keys(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """The key each token of x [T, hidden] caches: [T, index_head_dim]."""
        k = self.k_norm(self.wk(x))
        self._rotate(k[:, None], rope)
        return k

    def queries(
        self, x: torch.Tensor, q_resid: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's queries [T, heads, D] and head weights [T, heads] (float32)."""
        q = self.wq_b(q_resid).view(x.shape[0], self.heads, self.dim)
        self._rotate(q, rope)
        return q, self.weights_proj(x).float() * self.heads**-0.5

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """[n, T] float32: row i's score of key t, keys [T, D] shared by the rows or [n, T, D] each
        its own; invisible keys are the caller's to mask."""
        per_head = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * self.scale  # [n, heads, T]
        return torch.matmul(w[:, None, :], per_head.relu_()).squeeze(1)

    def select(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """[n, T] bool: the top index_topk of each row's visible keys (all of them where it sees no more)."""
        k = min(self.topk, scores.shape[-1])
        top = scores.masked_fill(~visible, float("-inf")).topk(k, dim=-1).indices
        return torch.zeros_like(visible).scatter_(1, top, True) & visible

    def prefill_selection(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, start: int) -> torch.Tensor:
        """[n, T] bool for a chunk's queries at positions [start, start + n) over the context's keys
        [T, D] (position t at row t), causal; scored a block of rows at a time."""
        n, t = q.shape[0], keys.shape[0]
        rows = max(1, SCORE_BYTES // (4 * self.heads * t))
        out = []
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            visible = torch.arange(t)[None, :] <= torch.arange(start + r0, start + r1)[:, None]
            out.append(self.select(self.scores(q[r0:r1], w[r0:r1], keys), visible))
        return torch.cat(out)


class PooledIndexer(Indexer):
    """GLM-5.3-Flash's indexer (NoPE): a query scores *pools* of `index_kpool` consecutive tokens
    (pool p: tokens [p * kpool, (p + 1) * kpool)), each pool's key Σ_i softmax_i(gate[i] + ape[i])
    * k[i] per channel, a pure function of its own tokens; a pool is a candidate once its last
    token is visible. A query reads the tokens of its top index_topk / kpool pools and those of its
    own open pool (the tail). Pooled keys live in their own paged group (layer `pool_layer`: a row
    per pool); the last kpool - 1 raw [k | gate] rows, which complete the next pool, are state
    (layer `window_layer`), checkpointed like a conv window."""

    def __init__(self, cfg: TextModelConfig, q_lora_rank: int, pool_layer: int, window_layer: int) -> None:
        super().__init__(cfg, q_lora_rank, 0)
        self.pool = int(cfg.hf.get("index_kpool", 16))
        if not cfg.hf.get("index_kpool_always_select_tail", True):
            raise ValueError("index_kpool_always_select_tail false is not supported: a query reads its own open pool")
        if self.pool < 1 or self.topk < self.pool:
            raise ValueError(f"index_kpool must be in [1, index_topk={self.topk}], got {self.pool}")
        self.pool_layer, self.window_layer = pool_layer, window_layer
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(self.pool, self.dim))
        # a linear, so that it runs on the packed kernels: a row's bits then do not depend on the batch
        self.index_kpool_compress_gate = nn.Linear(cfg.hidden_size, self.dim, bias=False)
        self.index_kpool_compress_gate.keep_float = True  # pooling logits: never quantized

    def write_pools(self, x: torch.Tensor, ctx) -> None:
        """Each pool a row of x completes, written to its row of the pooled cache; the window of
        each request's last kpool - 1 raw rows moved on (its checkpoints recorded)."""
        raw = torch.cat((self.k_norm(self.wk(x)), self.index_kpool_compress_gate(x)), dim=-1).float()
        cache, meta = ctx.for_layer(self.pool_layer)
        window = checkpoints = None
        if self.pool > 1:
            (window,), (checkpoints,) = ctx.states.layer(self.window_layer)
        for s in segments(ctx.state_meta):
            rows = raw[s.lo : s.hi] if window is None else torch.cat((window[s.slot], raw[s.lo : s.hi]))
            ends = (meta.slot_mapping[s.lo : s.hi] >= 0).nonzero().flatten()
            if ends.numel():
                pools = rows[ends[:, None] + torch.arange(self.pool)]  # [pools, kpool, 2D]
                keys, gates = pools.split(self.dim, dim=-1)
                weights = (gates + self.index_kpool_compress_ape.float()).softmax(dim=1)
                cache.write(
                    meta.slot_mapping[s.lo + ends],
                    (weights * keys).sum(dim=1)[:, None].to(x.dtype),
                    None,
                    self._group(ctx).rows_per_block(meta.block_size),
                )
            if window is not None:
                window[s.slot].copy_(rows[rows.shape[0] - window.shape[1] :])
                for cid in s.checkpoints:
                    checkpoints[cid].copy_(window[s.slot])

    def _group(self, ctx):
        """The KV group of the pooled keys."""
        spec = ctx.storage.spec
        return spec.groups[spec.layer_to_group[self.pool_layer][0]]

    def _pool_keys(self, ctx, table: torch.Tensor, num_pools: int, dtype: torch.dtype) -> torch.Tensor:
        """Pooled keys [.., num_pools, D] of block_table rows `table` [.., blocks]."""
        cache, meta = ctx.for_layer(self.pool_layer)
        group, bs = self._group(ctx), meta.block_size
        first = torch.arange(num_pools) * self.pool  # each pool's first position
        slots = group.cache_rows(table[..., first // bs], first, bs)
        return cache.read_k(slots.reshape(-1), group.rows_per_block(bs), dtype).view(*slots.shape, self.dim)

    def _top_pools(self, q, w, keys, pos) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(each query's top pools [n, k], which of them are candidates, the complete pools it
        sees [n, 1]) given the pooled keys ([P, D] shared or [n, P, D] each its own)."""
        visible = (pos[:, None] + 1) // self.pool
        num_pools = keys.shape[-2]
        candidate = torch.arange(num_pools)[None, :] < visible
        scores = self.scores(q, w, keys).masked_fill(~candidate, float("-inf"))
        top = scores.topk(min(self.topk // self.pool, num_pools), dim=-1).indices
        return top, candidate.gather(1, top), visible

    def _mask(self, q, w, keys, pos: torch.Tensor, width: int) -> torch.Tensor:
        """[n, width] bool: the tokens queries at positions `pos` [n] read: their top pools' and
        their open pool's (a prefill chunk's mask over its context)."""
        top, real, visible = self._top_pools(q, w, keys, pos)
        picked = torch.zeros((q.shape[0], keys.shape[-2]), dtype=torch.bool).scatter_(1, top, real)
        tokens = torch.zeros((q.shape[0], width), dtype=torch.bool)
        covered = min(width, picked.shape[1] * self.pool)
        tokens[:, :covered] = picked.repeat_interleave(self.pool, dim=1)[:, :covered]
        t = torch.arange(width)[None, :]
        return tokens | ((t >= visible * self.pool) & (t <= pos[:, None]))

    def _positions(self, q, w, keys, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions [n, index_topk + kpool - 1 at most], which are real): the tokens decode
        queries at `pos` read, their top pools' then their open pool's, with no per-position work."""
        top, real, visible = self._top_pools(q, w, keys, pos)
        within = torch.arange(self.pool)
        pooled = (top[..., None] * self.pool + within).flatten(1)
        tail = visible * self.pool + within[None, :-1]
        positions = torch.cat((pooled, tail), dim=1)
        return positions, torch.cat((real.repeat_interleave(self.pool, dim=1), tail <= pos[:, None]), dim=1)

    def select_rows(self, ctx, q: torch.Tensor, w: torch.Tensor, meta, chosen: dict, dtype: torch.dtype) -> None:
        """The tokens each row reads, into `chosen` as MLAttention reads it: "decode" (positions,
        real) for the decode rows where any sees more than index_topk, a chunk's [n, context] mask by
        its first row."""
        _, pmeta = ctx.for_layer(self.pool_layer)
        nd = pmeta.num_decodes
        if nd and int(pmeta.decode_kv_lens.max()) > self.topk:
            pos = pmeta.decode_kv_lens - 1
            keys = self._pool_keys(ctx, pmeta.decode_block_ids, int(pmeta.decode_kv_lens.max()) // self.pool, dtype)
            chosen["decode"] = self._positions(q[:nd], w[:nd], keys, pos)
        for i, p in enumerate(meta.prefills):
            end = int(pmeta.kv_lens[p.q_end - 1])
            if end <= self.topk:
                continue
            keys = self._pool_keys(ctx, pmeta.block_table[nd + i], end // self.pool, dtype)
            pos = torch.arange(end - (p.q_end - p.q_start), end)
            rows = slice(p.q_start, p.q_end)
            chosen[p.q_start] = self._mask(q[rows], w[rows], keys, pos, end)
