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

from baton.models.layers import apply_rotary
from baton.models.model_config import TextModelConfig

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
