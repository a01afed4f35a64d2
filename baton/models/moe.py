"""Mixture of experts: a router picks top-k experts per token, each expert runs only on the
tokens routed to it, and a shared expert (optionally gated) runs on every token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.models.fused_decode import StepBinding, gated_mlp_step, packed_only, plain_float32
from baton.models.layers import PackedLinear, gated_activation
from baton.models.model_config import TextModelConfig
from baton.ops import ops, row_linear, sigmoid, silu


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into one projection; with `swiglu_limit`
    (GLM-5.3-Flash) gate clamped from above and up on both sides at it first."""

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float | None = None) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu_limit is None:
            return self.down_proj(gated_activation(self.gate_up_proj(x), False))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        limit = self.swiglu_limit
        return self.down_proj(silu(gate.clamp(max=limit)) * up.clamp(-limit, limit))

    def decode_step(self, binding: StepBinding):
        """This MLP as a fused decoder's step; None unless its projections run on the packed kernels."""
        return gated_mlp_step(self.gate_up_proj, self.down_proj, False, self.swiglu_limit)


def dense_mlp(hidden_size: int, intermediate_size: int) -> MLP:
    return MLP(hidden_size, intermediate_size)


class SparseMoE(nn.Module):
    """Qwen-style routing: softmax over the experts, top-k, renormalized when `norm_topk_prob`;
    the shared expert's output is scaled by sigmoid(shared_expert_gate(x)) when `shared_gate`.
    A token's sum over its experts runs in expert order, whatever else is in the batch."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        shared_intermediate_size: int = 0,
        norm_topk_prob: bool = True,
        shared_gate: bool = False,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and the {num_experts} experts")
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList([MLP(hidden_size, intermediate_size) for _ in range(num_experts)])
        shared = shared_intermediate_size
        self.shared_expert = MLP(hidden_size, shared) if shared else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared and shared_gate else None

    @classmethod
    def from_config(cls, cfg: TextModelConfig, shared_gate: bool) -> SparseMoE:
        """Qwen's config keys."""
        hf = cfg.hf
        return cls(
            cfg.hidden_size,
            int(hf["num_experts"]),
            int(hf["num_experts_per_tok"]),
            int(hf["moe_intermediate_size"]),
            int(hf.get("shared_expert_intermediate_size") or 0),
            bool(hf.get("norm_topk_prob", True)),
            shared_gate,
        )

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
                shared = sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def decode_step(self, binding: StepBinding):
        """This MoE as a fused decoder's step (baton/ops/moe_layer.cpp); None unless every linear
        it holds runs on the packed kernels."""
        experts = [e for e in self.experts if not isinstance(e, ExpertElsewhere)]
        experts += [self.shared_expert] if self.shared_expert is not None else []
        linears = [self.gate, *[p for e in experts for p in (e.gate_up_proj, e.down_proj)]]
        linears += [self.shared_expert_gate] if self.shared_expert_gate is not None else []
        if not all(isinstance(m, PackedLinear) for m in linears):
            return None
        return ops().MoeStep(
            hidden=self.gate.in_features,
            router=self.gate.packed,
            top_k=self.top_k,
            norm_topk_prob=self.norm_topk_prob,
            **expert_arguments(self.experts, self.shared_expert),
            shared_gate=None if self.shared_expert_gate is None else self.shared_expert_gate.packed,
        )


class ExpertElsewhere(nn.Module):
    """An expert another tensor-parallel rank holds: its tokens' share of the sum comes from there."""


def expert_arguments(experts: nn.ModuleList, shared: nn.Module | None) -> dict:
    """The routed experts' and the shared expert's packed gate_up / down weights, as the fused MoE
    step takes gated-SiLU experts."""
    here = [e for e in experts if not isinstance(e, ExpertElsewhere)]
    absent = torch.empty(0)  # tensor parallel: an expert another rank holds
    return {
        "expert_in": [absent if isinstance(e, ExpertElsewhere) else e.gate_up_proj.packed for e in experts],
        "expert_out": [absent if isinstance(e, ExpertElsewhere) else e.down_proj.packed for e in experts],
        "moe_intermediate": here[0].down_proj.in_features if here else 1,
        "shared_in": None if shared is None else shared.gate_up_proj.packed,
        "shared_out": None if shared is None else shared.down_proj.packed,
        "shared_intermediate": 0 if shared is None else shared.down_proj.in_features,
    }


def run_experts(experts: nn.ModuleList, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each expert on the rows routed to it, scaled by the routing weight, summed per token."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        if isinstance(experts[e], ExpertElsewhere):
            continue
        rows, slot = torch.where(ids == e)
        out.index_add_(0, rows, experts[e](x[rows]) * weights[rows, slot, None])
    return out


class SigmoidRouter(nn.Module):
    """DeepSeek-V3-style router (Kimi Linear): sigmoid scores; a per-expert correction bias that
    steers the selection only; experts chosen within the `topk_group` best of `n_group` contiguous
    groups (a group scores the sum of its two best biased scores); weights are the unbiased scores
    of the chosen experts, renormalized when `norm_topk_prob` (sum + `norm_eps`: DeepSeek's 1e-20,
    LFM2-MoE's 1e-6), times `routed_scaling_factor`. Its weights stay plain parameters (never
    packed): routing runs in float32 like transformers'."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        n_group: int = 1,
        topk_group: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
        norm_eps: float = 1e-20,
    ) -> None:
        super().__init__()
        if n_group > 1 and (num_experts % n_group or num_experts // n_group < 2):
            raise ValueError(f"{num_experts} experts do not split into {n_group} groups of two or more")
        self.num_experts, self.top_k = num_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.norm_eps = norm_eps
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))

    def step_arguments(self) -> dict:
        """This router's arguments to the fused MoE step (ops().MoeStep)."""
        return {
            "hidden": self.weight.shape[1],
            "router_weight": self.weight,  # row_linear's operand: plain, never packed
            "correction_bias": self.e_score_correction_bias.float().contiguous(),
            "top_k": self.top_k,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
            "router_norm_eps": self.norm_eps,
        }

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32, expert ids), both [T, top_k]."""
        scores = sigmoid(row_linear(x.float(), self.weight.float()))
        choice = scores + self.e_score_correction_bias.float()
        t, g = x.shape[0], self.n_group
        if g > 1:  # one group is always kept
            group_scores = choice.view(t, g, -1).topk(2, dim=-1)[0].sum(dim=-1)
            groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
            choice = choice.masked_fill(~keep.repeat_interleave(self.num_experts // g, dim=1), float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + self.norm_eps)
        return weights * self.routed_scaling_factor, ids


class GroupedSigmoidMoE(nn.Module):
    """SigmoidRouter over `num_experts` gated-SiLU experts (each run only on its tokens) plus an
    ungated shared expert of width `shared_intermediate_size` (none when 0) on every token."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        shared_intermediate_size: int,
        swiglu_limit: float | None = None,
        **router,
    ) -> None:
        super().__init__()
        self.gate = SigmoidRouter(hidden_size, **router)
        self.swiglu_limit = swiglu_limit
        mlp = lambda size: MLP(hidden_size, size, swiglu_limit)  # noqa: E731
        self.experts = nn.ModuleList([mlp(intermediate_size) for _ in range(self.gate.num_experts)])
        self.shared_experts = mlp(shared_intermediate_size) if shared_intermediate_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = run_experts(self.experts, x, weights.to(x.dtype), ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)

    def decode_step(self, binding: StepBinding):
        """This MoE as a fused decoder's step (baton/ops/moe_layer.cpp); None unless its experts run
        on the packed kernels and the router's weight is plain float32."""
        gate = self.gate
        if not packed_only(self.experts, *([self.shared_experts] if self.shared_experts is not None else [])):
            return None
        if not plain_float32(gate.weight):
            return None
        return ops().MoeStep(
            **gate.step_arguments(),
            **expert_arguments(self.experts, self.shared_experts),
            swiglu_limit=self.swiglu_limit,
        )
