"""Granite-4.0-H (GraniteMoeHybrid): Mamba2 layers beside causal GQA attention layers (rotary or
none, as `position_embedding_type` says), each followed by softmax-routed SiLU experts plus a
shared expert, or by one dense SiLU MLP. IBM's multipliers: the embedding's, each block's output
before the residual add (`residual_multiplier`), the attention scale, and logits divided by
`logits_scaling`. Checkpoints stack the experts ([experts, 2I, H] gate | up); llama.cpp's
granitehybrid files keep them apart (granite_hybrid_gguf.py). Bamba, its predecessor, is the
same program with a dense MLP, rotary on half of each head and no multipliers."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from baton.kv.spec import LayerKind
from baton.models.fused_decode import DecodeBlock, StepBinding, attention_step, mixer_mlp_blocks
from baton.models.gguf_blocks import BlockTensor
from baton.models.layers import PackedLinear, RMSNorm, StackedLinear, paged_attention, unwrapped
from baton.models.llama import Attention, ForwardContext, LlamaForCausalLM
from baton.models.mamba2 import Mamba2Dims, Mamba2Mixer, time_step_limit
from baton.models.model_config import TextModelConfig
from baton.models.moe import MLP, SparseMoE
from baton.models.qwen3_next import partial_rotary
from baton.models.rope import Rotary
from baton.models.weight_map import renamed

# transformers 5's layer type names, then IBM's checkpoints'
_TYPES = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention"}


def layer_types(hf: dict[str, Any]) -> list[str]:
    """Each layer's mixer: mamba or attention."""
    types = hf.get("layer_types") or hf.get("layers_block_type")
    if not types:
        raise ValueError("a GraniteMoeHybrid config needs layer_types")
    try:
        return [_TYPES[t] for t in types]
    except (KeyError, TypeError):
        raise ValueError(f"unsupported GraniteMoeHybrid layer types {types!r}; supported: {sorted(_TYPES)}") from None


def mamba_dims(hf: dict[str, Any]) -> Mamba2Dims:
    heads, hidden = int(hf["mamba_n_heads"]), int(hf["hidden_size"])
    head_dim = hf.get("mamba_d_head", "auto")
    if head_dim == "auto":
        inner = int(hf.get("mamba_expand", 2)) * hidden
        if heads < 1 or inner % heads:
            raise ValueError(f"mamba_n_heads ({heads}) must divide mamba_expand * hidden_size ({inner})")
        head_dim = inner // heads
    dt_min, dt_max = time_step_limit(hf.get("time_step_limit"))
    return Mamba2Dims(
        heads=heads,
        head_dim=int(head_dim),
        groups=int(hf.get("mamba_n_groups", 1)),
        state_size=int(hf.get("mamba_d_state", 256)),
        conv_kernel=int(hf.get("mamba_d_conv", 4)),
        bias=bool(hf.get("mamba_proj_bias", False)),
        conv_bias=bool(hf.get("mamba_conv_bias", True)),
        dt_min=dt_min,
        dt_max=dt_max,
        eps=float(hf.get("rms_norm_eps", 1e-6)),
    )


def layer_kinds(hf: dict[str, Any]) -> list[LayerKind]:
    types = layer_types(hf)
    if len(types) != int(hf["num_hidden_layers"]):
        raise ValueError(f"GraniteMoeHybrid config: {len(types)} layer types for {hf['num_hidden_layers']} layers")
    mamba = mamba_dims(hf).layer_kind() if "mamba" in types else None
    return [mamba if t == "mamba" else LayerKind.full() for t in types]


def _multiplier(hf: dict[str, Any], key: str) -> float:
    value = hf.get(key)
    value = 1.0 if value is None else float(value)
    if not (value == value and abs(value) != float("inf")) or value == 0:
        raise ValueError(f"GraniteMoeHybrid config: {key} must be a finite non-zero number, got {hf.get(key)!r}")
    return value


class GraniteAttention(Attention):
    """Llama's attention with Granite's scale (`attention_multiplier`) and rotary only where the
    config asks for it."""

    def __init__(self, cfg: TextModelConfig, layer_id: int) -> None:
        super().__init__(cfg, layer_id)
        self.rotary = cfg.hf.get("position_embedding_type") == "rope"
        self.partial_rotary = self.rotary and cfg.rope["full"].partial_rotary_factor < 1  # Bamba: half
        self.scale = _multiplier(cfg.hf, "attention_multiplier")

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext) -> torch.Tensor:
        if not self.partial_rotary:
            return super().forward(x, rope if self.rotary else None, ctx)
        n, d = x.shape[0], self.head_dim
        q_size, kv_size, _ = self.sizes
        qkv = self.qkv_proj(x)
        q = qkv[:, :q_size].reshape(n, self.num_heads, d)
        k = qkv[:, q_size : q_size + kv_size].reshape(n, self.num_kv_heads, d)
        v = qkv[:, q_size + kv_size :].reshape(n, self.num_kv_heads, d)
        q, k = partial_rotary(q, *rope), partial_rotary(k, *rope)
        cache, meta = ctx.for_layer(self.layer_id)
        return self.o_proj(paged_attention(q, k, v, cache, meta, self.scale).reshape(n, -1))

    def decode_step(self, binding: StepBinding):
        if self.rotary:
            return super().decode_step(binding)
        if not isinstance(self.qkv_proj, (PackedLinear, StackedLinear)):
            return None
        return attention_step(self, binding, self.qkv_proj.parts(), rope=None)


class GraniteMoeHybridDecoderLayer(nn.Module):
    def __init__(self, cfg: TextModelConfig, layer_id: int) -> None:
        super().__init__()
        hf = cfg.hf
        self.recurrent = cfg.layer_kinds[layer_id].is_recurrent
        if self.recurrent:
            self.mamba = Mamba2Mixer(cfg.hidden_size, layer_id, mamba_dims(hf))
        else:
            self.self_attn = GraniteAttention(cfg, layer_id)
        shared = int(hf.get("shared_intermediate_size") or 0)
        experts = int(hf.get("num_local_experts") or 0)
        if experts:
            self.mlp: nn.Module = SparseMoE(
                cfg.hidden_size, experts, int(hf["num_experts_per_tok"]), cfg.intermediate_size, shared
            )
        elif shared:
            self.mlp = MLP(cfg.hidden_size, shared)
        else:
            raise ValueError("a GraniteMoeHybrid config needs num_local_experts or shared_intermediate_size")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.residual_multiplier = _multiplier(hf, "residual_multiplier")

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: dict, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer's, each block's output times residual_multiplier."""
        m = self.residual_multiplier
        h, residual = self.input_layernorm.pre_norm(x, residual)
        h = self.mamba(h, ctx) if self.recurrent else self.self_attn(h, rope["full"], ctx)
        return self.mlp(self.post_attention_layernorm(h * m, residual)) * m, residual

    def decode_blocks(self, binding: StepBinding) -> list[DecodeBlock] | None:
        mixer = (self.mamba if self.recurrent else self.self_attn).decode_step(binding)
        mlp = unwrapped(self.mlp).decode_step(binding)
        return mixer_mlp_blocks(
            self.input_layernorm, mixer, self.post_attention_layernorm, mlp, scale=self.residual_multiplier
        )


class GraniteMoeHybridForCausalLM(LlamaForCausalLM):
    layer_cls = GraniteMoeHybridDecoderLayer
    layer_kinds_from = staticmethod(layer_kinds)

    def __init__(self, cfg: TextModelConfig) -> None:
        super().__init__(cfg)
        self.embedding_multiplier = _multiplier(cfg.hf, "embedding_multiplier")
        self.logits_scaling = _multiplier(cfg.hf, "logits_scaling")
        rope = cfg.rope["full"]
        self.rotary = nn.ModuleDict({"full": Rotary(rope, int(cfg.head_dim * rope.partial_rotary_factor))})
        self.layer_kinds = ["full"]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling

    # ---- weights ---------------------------------------------------------------------------------
    # The names baton reads are Llama's with experts one by one (what llama.cpp's files hold,
    # gguf_weight_shapes); a checkpoint's stacked experts and fused shared expert are split on load.
    _UNFUSED = {
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def gguf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return super().hf_weight_shapes()

    def hf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {}
        for name, shape in self.gguf_weight_shapes().items():
            checkpoint = _checkpoint_name(name)
            if checkpoint is None:
                shapes[name] = shape
                continue
            hf, kind = checkpoint
            if kind == "within":  # an up_proj: its gate_proj's tensor holds it
                continue
            if kind == "router":
                shapes[hf] = shape
            elif kind == "experts_gate_up":
                layer = self.layers[int(name.split(".")[2])].mlp
                shapes[hf] = (len(layer.experts), 2 * shape[0], shape[1])
            elif kind == "experts_down":
                layer = self.layers[int(name.split(".")[2])].mlp
                shapes[hf] = (len(layer.experts), *shape)
            elif kind == "shared_gate_up":
                shapes[hf] = (2 * shape[0], shape[1])
            else:
                shapes[hf] = shape
        return shapes

    def load_weight(self, hf_name: str, tensor: torch.Tensor | BlockTensor) -> None:
        """A checkpoint's stacked experts and fused shared expert in the parts Llama's loading
        takes; llama.cpp's names as they are."""
        prefix, _, rest = hf_name.rpartition("block_sparse_moe.")
        if not prefix:
            prefix, _, rest = hf_name.rpartition("shared_mlp.")
            if not prefix:
                return super().load_weight(hf_name, tensor)
            shared = "mlp.shared_expert." if isinstance(self.layers[_layer(hf_name)].mlp, SparseMoE) else "mlp."
            if rest == "input_linear.weight":
                gate, up = tensor.chunk(2, dim=0)
                super().load_weight(f"{prefix}{shared}gate_proj.weight", gate)
                super().load_weight(f"{prefix}{shared}up_proj.weight", up)
            else:
                super().load_weight(f"{prefix}{shared}down_proj.weight", tensor)
            return
        if rest in ("router.layer.weight", "router.weight"):
            return super().load_weight(f"{prefix}mlp.gate.weight", tensor)
        for e, expert in enumerate(tensor.unbind(0)):
            if rest in ("input_linear.weight", "experts.gate_up_proj"):
                gate, up = expert.chunk(2, dim=0)
                super().load_weight(f"{prefix}mlp.experts.{e}.gate_proj.weight", gate)
                super().load_weight(f"{prefix}mlp.experts.{e}.up_proj.weight", up)
            else:
                super().load_weight(f"{prefix}mlp.experts.{e}.down_proj.weight", expert)


def bamba_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A Bamba config in GraniteMoeHybrid's keys."""
    n, attention = int(hf["num_hidden_layers"]), hf.get("attn_layer_indices") or []
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    if not isinstance(attention, list) or any(not isinstance(i, int) or not 0 <= i < n for i in attention):
        raise ValueError(f"Bamba config: attn_layer_indices must be layer numbers below {n}, got {attention!r}")
    return {
        **hf,
        "layer_types": ["attention" if i in attention else "mamba" for i in range(n)],
        "position_embedding_type": "rope",
        "num_local_experts": 0,
        "shared_intermediate_size": int(hf["intermediate_size"]),
        "attention_multiplier": head_dim**-0.5,
    }


# Bamba's checkpoint names for what Granite's program calls otherwise
_BAMBA_NAMES = {
    ".mlp.": ".feed_forward.",
    ".post_attention_layernorm.": ".pre_ff_layernorm.",
    "model.norm.": "model.final_layernorm.",
}


class BambaForCausalLM(GraniteMoeHybridForCausalLM):
    layer_kinds_from = staticmethod(lambda hf: layer_kinds(bamba_config(hf)))

    def __init__(self, cfg: TextModelConfig) -> None:
        super().__init__(dataclasses.replace(cfg, hf=bamba_config(cfg.hf)))

    def hf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return {renamed(n, _BAMBA_NAMES): shape for n, shape in self.gguf_weight_shapes().items()}

    def load_weight(self, hf_name: str, tensor: torch.Tensor | BlockTensor) -> None:
        LlamaForCausalLM.load_weight(self, renamed(hf_name, {v: k for k, v in _BAMBA_NAMES.items()}), tensor)


def _layer(hf_name: str) -> int:
    return int(hf_name.split(".")[2])


def _checkpoint_name(name: str) -> tuple[str, str] | None:
    """The checkpoint tensor (and how it holds this one) of a Llama-style name, where they differ:
    experts stacked in block_sparse_moe, the shared expert's gate | up fused in shared_mlp."""
    parts = name.split(".")
    if len(parts) < 5 or parts[3] != "mlp":
        return None
    layer = ".".join(parts[:3])
    rest = ".".join(parts[4:])
    if rest == "gate.weight":
        return f"{layer}.block_sparse_moe.router.layer.weight", "router"
    if parts[4] == "experts":
        if parts[6] == "down_proj":
            return f"{layer}.block_sparse_moe.output_linear.weight", "experts_down"
        if parts[6] == "gate_proj":
            return f"{layer}.block_sparse_moe.input_linear.weight", "experts_gate_up"
        return "", "within"  # up_proj: in the same stacked tensor as gate_proj
    if parts[4] == "shared_expert":
        rest = ".".join(parts[5:])
    if rest == "gate_proj.weight":
        return f"{layer}.shared_mlp.input_linear.weight", "shared_gate_up"
    if rest == "down_proj.weight":
        return f"{layer}.shared_mlp.output_linear.weight", "shared_down"
    if rest == "up_proj.weight":
        return "", "within"  # in shared_mlp.input_linear, after gate_proj
    return None
