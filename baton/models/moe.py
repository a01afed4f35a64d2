"""Mixture of experts: a router picks top-k experts per token, each expert runs only on the
tokens routed to it, and a shared expert (optionally gated) runs on every token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.models.layers import gated_activation
from baton.models.model_config import TextModelConfig


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into one projection."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_activation(self.gate_up_proj(x), False))


def dense_mlp(hidden_size: int, intermediate_size: int) -> MLP:
    return MLP(hidden_size, intermediate_size)


class SparseMoE(nn.Module):
    """Qwen-style routing: softmax over the experts, top-k, renormalized when `norm_topk_prob`;
    the shared expert's output is scaled by sigmoid(shared_expert_gate(x)) when `shared_gate`.
    A token's sum over its experts runs in expert order, whatever else is in the batch."""

    def __init__(self, cfg: TextModelConfig, shared_gate: bool) -> None:
        super().__init__()
        hf = cfg.hf
        self.num_experts = int(hf["num_experts"])
        self.top_k = int(hf["num_experts_per_tok"])
        self.norm_topk_prob = bool(hf.get("norm_topk_prob", True))
        self.gate = nn.Linear(cfg.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList(
            [MLP(cfg.hidden_size, int(hf["moe_intermediate_size"])) for _ in range(self.num_experts)]
        )
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        self.shared_expert = MLP(cfg.hidden_size, shared) if shared else None
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if shared and shared_gate else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids), both [T, top_k]."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = run_experts(self.experts, x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


def run_experts(experts: nn.ModuleList, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each expert on the rows routed to it, scaled by the routing weight, summed per token."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        rows, slot = torch.where(ids == e)
        out.index_add_(0, rows, experts[e](x[rows]) * weights[rows, slot, None])
    return out


def sigmoid_grouped_route(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3-style routing (also Kimi, NemotronH): sigmoid scores; the correction bias only
    steers selection; experts in `n_group` contiguous groups, a group scored by the sum of its two
    best biased scores, only the `topk_group` best groups eligible; top-k of those; the weights are
    the unbiased scores, renormalized when `norm_topk_prob`, times `scaling`. logits [T, E] ->
    (float32 weights, expert ids), both [T, top_k]."""
    scores = logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group > 1:
        t, e = choice.shape
        group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids
