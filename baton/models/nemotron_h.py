"""NemotronH (Nemotron-H, Nemotron-Nano-v2, Nemotron-3): a hybrid of Mamba2 layers (causal conv +
selective SSM, a constant-size state per request), plain causal GQA attention layers without any
positional encoding, squared-ReLU MLP layers and sigmoid-routed MoE layers; one mixer per layer.

Mamba2 runs on the shared recurrent scan: with the state h [heads, P, N] kept transposed as
[heads, N, P], h = exp(dt A) h + dt x (x) B and y = C h map onto S = S exp(decay); S += k (x) v;
out = q S with k = B, v = dt x, q = C, decay = dt A."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from baton.kv.spec import LayerKind
from baton.models.fused_decode import (
    DecodeBlock,
    FusedDecoding,
    StepBinding,
    attention_step,
    linear_args,
    packed_only,
    plain_float32,
    state_args,
)
from baton.models.gguf_blocks import BlockTensor
from baton.models.layers import RMSNorm, embedding, keep_blocks_for, pack_model, paged_attention, unwrapped
from baton.models.llama import ForwardContext
from baton.models.model_config import TextModelConfig
from baton.models.moe import ExpertElsewhere, SigmoidRouter, run_experts
from baton.models.recurrent import conv_over_segments, scan_over_segments, segments
from baton.ops import ops

# layer type names: transformers 5 (and the pattern string's letters), then transformers 4's
_TYPES = {
    "M": "mamba",
    "*": "attention",
    "-": "mlp",
    "E": "moe",
    "linear_attention": "mamba",
    "full_attention": "attention",
    "mamba": "mamba",
    "attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
}


def layer_types(hf: dict[str, Any]) -> list[str]:
    """Each layer's mixer: mamba, attention, mlp or moe."""
    types = hf.get("layers_block_type") or hf.get("layer_types") or list(hf.get("hybrid_override_pattern") or "")
    try:
        return [_TYPES[t] for t in types]
    except KeyError as e:
        raise ValueError(f"unsupported NemotronH layer type {e.args[0]!r}") from None


def mamba_dims(hf: dict[str, Any]) -> tuple[int, int, int, int, int]:
    """(heads, head_dim P, groups G, state size N, conv kernel K)."""
    return (
        int(hf["mamba_num_heads"]),
        int(hf["mamba_head_dim"]),
        int(hf.get("n_groups", hf.get("mamba_n_groups", 1))),
        int(hf["ssm_state_size"]),
        int(hf.get("conv_kernel", hf.get("mamba_d_conv", 4))),
    )


def layer_kinds(hf: dict[str, Any]) -> list[LayerKind]:
    nh, p, g, n, k = mamba_dims(hf)
    mamba = LayerKind.recurrent((nh * p + 2 * g * n, k - 1), (nh, n, p))
    kinds = {"mamba": mamba, "attention": LayerKind.full(), "mlp": LayerKind.none(), "moe": LayerKind.none()}
    types = layer_types(hf)
    if not types:
        raise ValueError("a NemotronH config needs layers_block_type or hybrid_override_pattern")
    return [kinds[t] for t in types]


def _eps(cfg: TextModelConfig) -> float:
    return float(cfg.hf.get("layer_norm_epsilon", cfg.rms_norm_eps))


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: TextModelConfig, layer_id: int) -> None:
        super().__init__()
        hf = cfg.hf
        self.layer_id = layer_id
        self.nh, self.p, self.g, self.n, k = mamba_dims(hf)
        self.inner = self.nh * self.p
        self.conv_dim = self.inner + 2 * self.g * self.n
        bias = bool(hf.get("use_bias", False))
        self.in_proj = nn.Linear(cfg.hidden_size, self.inner + self.conv_dim + self.nh, bias=bias)
        conv_bias = bool(hf.get("use_conv_bias", hf.get("mamba_conv_bias", True)))
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, k, groups=self.conv_dim, bias=conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.nh))
        self.A_log = nn.Parameter(torch.zeros(self.nh))
        self.D = nn.Parameter(torch.ones(self.nh))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.inner))
        self.out_proj = nn.Linear(self.inner, cfg.hidden_size, bias=bias)
        # HF's full-sequence (chunked) path clamps dt from below; we clamp at every position, decode too
        self.dt_min = float(hf.get("time_step_min", hf.get("mamba_dt_min", 0.0)))
        self.eps = _eps(cfg)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, nh, p, g, n = x.shape[0], self.nh, self.p, self.g, self.n
        z, xbc, dt = torch.split(self.in_proj(x), [self.inner, self.conv_dim, nh], dim=1)
        (conv_state, ssm_state), (conv_ckpt, ssm_ckpt) = ctx.states.layer(self.layer_id)
        weight, bias = self.conv1d.weight[:, 0], self.conv1d.bias
        segs = list(segments(ctx.state_meta))
        conv_out = conv_over_segments(xbc, segs, conv_state, conv_ckpt, weight, bias)
        xs, b, c = torch.split(F.silu(conv_out).float(), [self.inner, g * n, g * n], dim=1)
        xs = xs.view(t, nh, p)
        b = b.view(t, g, n).repeat_interleave(nh // g, dim=1)  # head h reads group h // (nh / g)
        c = c.view(t, g, n).repeat_interleave(nh // g, dim=1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(min=self.dt_min)  # [T, nh]
        decay = dt * -self.A_log.float().exp()
        v = xs * dt[..., None]
        y = scan_over_segments(c, b, v, decay, None, segs, ssm_state, ssm_ckpt)
        y = (y + self.D.float()[:, None] * xs).reshape(t, self.inner) * F.silu(z.float())
        y = y.view(t, g, -1)  # gated RMSNorm per group, gate first, in float32
        y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).reshape(t, -1)
        return self.out_proj((self.norm.weight.float() * y).to(x.dtype))

    def decode_step(self, binding: StepBinding):
        """This mixer as a fused decoder's step (baton/ops/mamba_layer.cpp); None without
        recurrent state or with a projection off the packed kernels."""
        out_proj = unwrapped(self.out_proj)
        if binding.states is None or not packed_only(self, out_proj):
            return None
        conv_bias = self.conv1d.bias
        return ops().MambaStep(
            heads=self.nh,
            head_dim=self.p,
            groups=self.g,
            state_size=self.n,
            conv_kernel=self.conv1d.weight.shape[-1],
            hidden=out_proj.out_features,
            **linear_args("in_proj", self.in_proj),
            **linear_args("out_proj", out_proj),
            conv_weight=self.conv1d.weight[:, 0].float().contiguous(),
            conv_bias=None if conv_bias is None else conv_bias.float().contiguous(),
            # forward's -A_log.float().exp(): the same op on the same [nh], once
            neg_exp_a=(-self.A_log.float().exp()).contiguous(),
            dt_bias=self.dt_bias.float().contiguous(),
            d=self.D.float().contiguous(),
            norm_weight=self.norm.weight.float().contiguous(),
            dt_min=self.dt_min,
            norm_eps=self.eps,
            **state_args(binding, self.layer_id),
        )


class NoPEAttention(nn.Module):
    """Causal GQA over the paged cache; no rotary, no q/k norm, no biases."""

    def __init__(self, cfg: TextModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.scale = d**-0.5

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        q = self.q_proj(x).view(n, self.num_heads, d)
        k = self.k_proj(x).view(n, self.num_kv_heads, d)
        v = self.v_proj(x).view(n, self.num_kv_heads, d)
        cache, meta = ctx.for_layer(self.layer_id)
        return self.o_proj(paged_attention(q, k, v, cache, meta, self.scale).reshape(n, -1))

    def decode_step(self, binding: StepBinding):
        """This attention as a fused decoder's step (no rotary); None off the packed kernels."""
        return attention_step(self, binding, [self.q_proj, self.k_proj, self.v_proj], rope=None)


class Relu2MLP(nn.Module):
    """down(relu(up(x))^2): not gated."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())

    def decode_step(self, binding: StepBinding):
        """This MLP as a fused decoder's step (baton/ops/mlp_layer.cpp); None off the packed kernels."""
        down = unwrapped(self.down_proj)
        if not packed_only(self, down):
            return None
        return ops().Relu2MlpStep(
            **linear_args("up", self.up_proj),
            **linear_args("down", down),
            intermediate=self.up_proj.out_features,
            hidden=down.out_features,
        )


class NemotronHMoE(nn.Module):
    """Sigmoid-routed relu2 experts (optionally in a latent space) plus an unweighted shared expert."""

    def __init__(self, cfg: TextModelConfig) -> None:
        super().__init__()
        hf = cfg.hf
        bias = bool(hf.get("mlp_bias", False))
        num_experts = int(hf["n_routed_experts"])
        latent = hf.get("moe_latent_size")
        width = int(latent) if latent else cfg.hidden_size
        self.gate = SigmoidRouter(
            cfg.hidden_size,
            num_experts,
            int(hf["num_experts_per_tok"]),
            int(hf.get("n_group", 1)),
            int(hf.get("topk_group", 1)),
            bool(hf.get("norm_topk_prob", True)),
            float(hf.get("routed_scaling_factor", 1.0)),
        )
        self.experts = nn.ModuleList(Relu2MLP(width, int(hf["moe_intermediate_size"])) for _ in range(num_experts))
        shared = int(hf.get("moe_shared_expert_intermediate_size") or 0)
        self.shared_experts = Relu2MLP(cfg.hidden_size, shared, bias) if shared else None
        self.fc1_latent_proj = nn.Linear(cfg.hidden_size, width, bias=bias) if latent else None
        self.fc2_latent_proj = nn.Linear(width, cfg.hidden_size, bias=bias) if latent else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        weights, ids = self.gate(x)
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        out = run_experts(self.experts, h, weights.to(h.dtype), ids)  # each expert on its routed rows only
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        return out if self.shared_experts is None else out + self.shared_experts(x)

    def decode_step(self, binding: StepBinding):
        """This MoE as a fused decoder's step (baton/ops/moe_layer.cpp); None unless its linears run
        on the packed kernels and the router's weight is plain float32."""
        gate, shared = self.gate, self.shared_experts
        fc1, fc2 = self.fc1_latent_proj, self.fc2_latent_proj
        experts = self.experts
        if not packed_only(*[m for m in (*experts, shared, fc1, fc2) if m is not None]):
            return None
        if not plain_float32(gate.weight):
            return None
        absent = torch.empty(0)  # tensor parallel: an expert another rank holds
        here = [e for e in experts if not isinstance(e, ExpertElsewhere)]
        return ops().MoeStep(
            **gate.step_arguments(),
            relu2=True,
            expert_in=[absent if isinstance(e, ExpertElsewhere) else e.up_proj.packed for e in experts],
            expert_out=[absent if isinstance(e, ExpertElsewhere) else e.down_proj.packed for e in experts],
            moe_intermediate=here[0].up_proj.out_features if here else 1,
            **linear_args("fc1", fc1),
            **linear_args("fc2", fc2),
            width=None if fc1 is None else fc1.out_features,
            **linear_args("shared_in", None if shared is None else shared.up_proj),
            **linear_args("shared_out", None if shared is None else shared.down_proj),
            shared_intermediate=0 if shared is None else shared.up_proj.out_features,
        )


class NemotronHBlock(nn.Module):
    """x + mixer(RMSNorm(x)): one norm, one mixer."""

    def __init__(self, cfg: TextModelConfig, layer_id: int, kind: str) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, _eps(cfg))
        if kind == "mamba":
            self.mixer: nn.Module = Mamba2Mixer(cfg, layer_id)
        elif kind == "attention":
            self.mixer = NoPEAttention(cfg, layer_id)
        elif kind == "mlp":
            self.mixer = Relu2MLP(cfg.hidden_size, cfg.intermediate_size, bool(cfg.hf.get("mlp_bias", False)))
        else:
            self.mixer = NemotronHMoE(cfg)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer: x is the previous output, not yet added to the stream `residual`."""
        h, residual = self.norm.pre_norm(x, residual)
        return self.mixer(h, ctx), residual

    def decode_blocks(self, binding: StepBinding) -> list[DecodeBlock] | None:
        """forward's block for the fused decoder, or None where its mixer cannot run there."""
        step = unwrapped(self.mixer).decode_step(binding)
        return None if step is None else [DecodeBlock(self.norm, step)]


class NemotronHForCausalLM(FusedDecoding, nn.Module):
    layer_kinds_from = staticmethod(layer_kinds)

    def __init__(self, cfg: TextModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        types = layer_types(cfg.hf)
        if len(types) != cfg.num_layers:
            raise ValueError(f"NemotronH config: {len(types)} layer types for {cfg.num_layers} layers")
        self.embeddings = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(NemotronHBlock(cfg, i, t) for i, t in enumerate(types))
        self.norm_f = RMSNorm(cfg.hidden_size, _eps(cfg))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.fused_decode = True  # decode-only steps as one C++ call (baton/models/fused_decode.py)
        self.block_weights: dict[str, BlockTensor] = {}  # weights kept in GGUF blocks, by parameter name
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.embeddings(input_ids), None  # no positional encoding anywhere
        one_token_rows = ctx.state_meta is None or all(s.q_end - s.q_start == 1 for s in ctx.state_meta.seqs)
        if ctx.decode_only and one_token_rows and self._fused_decoder_for(ctx.storage, ctx.states) is not None:
            return self.fused_decoder(x, {}, ctx)
        for layer in self.layers:
            x, residual = layer(x, residual, ctx)
        return self.norm_f(x, residual)

    def fused_final_norm(self) -> RMSNorm | None:
        return self.norm_f if isinstance(self.norm_f, RMSNorm) else None  # a pipeline stage before the last: none

    def pack_linears(self, quantization: str | None = None) -> None:
        pack_model(self, "embeddings", self.block_weights, quantization)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.embeddings.weight) if self.lm_head is None else self.lm_head(hidden)

    # ---- weights: checkpoints name them backbone.* (transformers 5 loads them as model.*) -------
    def hf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            name if name.startswith("lm_head.") else f"backbone.{name}": tuple(p.shape)
            for name, p in self.named_parameters()
        }

    def load_weight(self, hf_name: str, tensor: torch.Tensor | BlockTensor) -> None:
        name = hf_name.removeprefix("backbone.").removeprefix("model.")
        if isinstance(tensor, BlockTensor):
            if keep_blocks_for(self, name, tensor):
                self.block_weights[name] = tensor
        else:
            self.get_parameter(name).data.copy_(tensor)
