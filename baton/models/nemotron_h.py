"""NemotronH (Nemotron-H, Nemotron-Nano-v2, Nemotron-3): a hybrid of Mamba2 layers (causal conv +
selective SSM, a constant-size state per request), plain causal GQA attention layers without any
positional encoding, squared-ReLU MLP layers and sigmoid-routed MoE layers; one mixer per layer
(the Mamba2 mixer: baton/models/mamba2.py)."""

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
)
from baton.models.gguf_blocks import BlockTensor
from baton.models.layers import RMSNorm, embedding, keep_blocks_for, pack_model, paged_attention, unwrapped
from baton.models.llama import ForwardContext
from baton.models.mamba2 import Mamba2Dims, Mamba2Mixer
from baton.models.model_config import TextModelConfig
from baton.models.moe import ExpertElsewhere, SigmoidRouter, run_experts
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


def mamba_dims(hf: dict[str, Any]) -> Mamba2Dims:
    return Mamba2Dims(
        heads=int(hf["mamba_num_heads"]),
        head_dim=int(hf["mamba_head_dim"]),
        groups=int(hf.get("n_groups", hf.get("mamba_n_groups", 1))),
        state_size=int(hf["ssm_state_size"]),
        conv_kernel=int(hf.get("conv_kernel", hf.get("mamba_d_conv", 4))),
        bias=bool(hf.get("use_bias", False)),
        conv_bias=bool(hf.get("use_conv_bias", hf.get("mamba_conv_bias", True))),
        dt_min=float(hf.get("time_step_min", hf.get("mamba_dt_min", 0.0))),
        eps=float(hf.get("layer_norm_epsilon", hf.get("rms_norm_eps", 1e-6))),  # parse_hf_config's default
    )


def layer_kinds(hf: dict[str, Any]) -> list[LayerKind]:
    kinds = {
        "mamba": mamba_dims(hf).layer_kind(),
        "attention": LayerKind.full(),
        "mlp": LayerKind.none(),
        "moe": LayerKind.none(),
    }
    types = layer_types(hf)
    if not types:
        raise ValueError("a NemotronH config needs layers_block_type or hybrid_override_pattern")
    return [kinds[t] for t in types]


def _eps(cfg: TextModelConfig) -> float:
    return float(cfg.hf.get("layer_norm_epsilon", cfg.rms_norm_eps))


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
            self.mixer: nn.Module = Mamba2Mixer(cfg.hidden_size, layer_id, mamba_dims(cfg.hf))
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
