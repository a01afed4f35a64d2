"""LFM2 (Liquid): short gated convolutions (in_proj into B, C, x; y = C * conv(B * x), a depthwise
causal conv of a few taps, its window the layer's whole state) beside GQA attention layers with
q/k norms; a SwiGLU MLP after each; the final norm is checkpointed as `embedding_norm`. LFM2-MoE:
after `num_dense_layers` dense ones, sigmoid-routed experts (an expert bias steering the choice)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from baton.kv.spec import LayerKind
from baton.models.fused_decode import DecodeBlock, StepBinding, linear_args, mixer_mlp_blocks, packed_only
from baton.models.gguf_arch import (
    GGUFArch,
    GGUFMetadata,
    Value,
    attention_layers,
    base_config,
    each_expert,
    reshaped,
    uniform,
)
from baton.models.layers import RMSNorm, unwrapped
from baton.models.llama import Attention, ForwardContext, LlamaForCausalLM
from baton.models.model_config import TextModelConfig
from baton.models.moe import MLP, GroupedSigmoidMoE
from baton.models.recurrent import conv_over_segments, segments
from baton.models.weight_map import renamed
from baton.ops import ops


def layer_types(hf: dict[str, Any]) -> list[str]:
    n = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None:
        attention = hf.get("full_attn_idxs")
        attention = range(n) if attention is None else attention
        types = ["full_attention" if i in attention else "conv" for i in range(n)]
    if len(types) != n or not set(types) <= {"conv", "full_attention"}:
        raise ValueError(f"LFM2 config: layer_types must be {n} of conv / full_attention, got {types!r}")
    return list(types)


def conv_kernel(hf: dict[str, Any]) -> int:
    k = int(hf.get("conv_L_cache", 3))
    if k < 2:
        raise ValueError(f"LFM2 config: conv_L_cache must be at least 2, got {k}")
    return k


def layer_kinds(hf: dict[str, Any]) -> list[LayerKind]:
    # conv_channels: a tensor-parallel rank's share of the hidden channels (shard_layers.py)
    conv = LayerKind.recurrent((int(hf.get("conv_channels") or hf["hidden_size"]), conv_kernel(hf) - 1))
    return [conv if t == "conv" else LayerKind.full() for t in layer_types(hf)]


def ff_dim(hf: dict[str, Any]) -> int:
    """The MLP's width: intermediate_size, cut to 2/3, scaled and rounded up as the config says."""
    width = int(hf.get("block_ff_dim") or hf["intermediate_size"])
    if hf.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        if hf.get("block_ffn_dim_multiplier") is not None:
            width = int(float(hf["block_ffn_dim_multiplier"]) * width)
        multiple = int(hf.get("block_multiple_of", 256))
        width = multiple * ((width + multiple - 1) // multiple)
    if width < 1:
        raise ValueError(f"LFM2 config gives an MLP width of {width}")
    return width


class ShortConv(nn.Module):
    def __init__(self, hidden_size: int, layer_id: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.channels = hidden_size  # a tensor-parallel rank's share after sharding
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.conv = nn.Conv1d(hidden_size, hidden_size, kernel, groups=hidden_size, bias=bias)
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        b, c, v = self.in_proj(x).chunk(3, dim=-1)
        (conv_state,), (conv_ckpt,) = ctx.states.layer(self.layer_id)
        segs = list(segments(ctx.state_meta))
        conv = conv_over_segments(b * v, segs, conv_state, conv_ckpt, self.conv.weight[:, 0], self.conv.bias)
        return self.out_proj(c * conv)

    def decode_step(self, binding: StepBinding):
        """This layer as a fused decoder's step (baton/ops/shortconv_layer.cpp); None without state
        or with a projection off the packed kernels."""
        out_proj = unwrapped(self.out_proj)
        if binding.states is None or not packed_only(self, out_proj):
            return None
        (conv_state,), (conv_ckpt,) = binding.states.layer(self.layer_id)
        bias = self.conv.bias
        return ops().ShortConvStep(
            hidden=out_proj.out_features,
            channels=self.channels,
            conv_kernel=self.conv.weight.shape[-1],
            **linear_args("in_proj", self.in_proj),
            **linear_args("out_proj", out_proj),
            conv_weight=self.conv.weight[:, 0].float().contiguous(),
            conv_bias=None if bias is None else bias.float().contiguous(),
            conv_state=conv_state,
            conv_checkpoints=conv_ckpt,
        )


def feed_forward(cfg: TextModelConfig, layer_id: int) -> nn.Module:
    """LFM2's MLP (its width adjusted as ff_dim says), or LFM2-MoE's: dense (intermediate_size as it
    is) before num_dense_layers, experts after."""
    hf = cfg.hf
    if "num_experts" not in hf:
        return MLP(cfg.hidden_size, ff_dim(hf))
    if layer_id < int(hf.get("num_dense_layers", 0)):
        return MLP(cfg.hidden_size, cfg.intermediate_size)
    return GroupedSigmoidMoE(
        cfg.hidden_size,
        int(hf["moe_intermediate_size"]),
        0,
        num_experts=int(hf["num_experts"]),
        top_k=int(hf["num_experts_per_tok"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        norm_eps=1e-6,
    )


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, cfg: TextModelConfig, layer_id: int) -> None:
        super().__init__()
        hf = cfg.hf
        self.recurrent = cfg.layer_kinds[layer_id].is_recurrent
        if self.recurrent:
            self.conv = ShortConv(cfg.hidden_size, layer_id, conv_kernel(hf), bool(hf.get("conv_bias", False)))
        else:
            self.self_attn = Attention(cfg, layer_id)
        self.feed_forward: nn.Module = feed_forward(cfg, layer_id)
        self.operator_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: dict, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.operator_norm.pre_norm(x, residual)
        h = self.conv(h, ctx) if self.recurrent else self.self_attn(h, rope["full"], ctx)
        return self.feed_forward(self.ffn_norm(h, residual)), residual

    def decode_blocks(self, binding: StepBinding) -> list[DecodeBlock] | None:
        mixer = (self.conv if self.recurrent else self.self_attn).decode_step(binding)
        mlp = unwrapped(self.feed_forward).decode_step(binding)
        return mixer_mlp_blocks(self.operator_norm, mixer, self.ffn_norm, mlp)


# baton's parameter names -> the checkpoint's (after Llama's "model." prefix and unfused parts)
_RENAMED = {
    "model.norm.": "model.embedding_norm.",
    ".self_attn.o_proj.": ".self_attn.out_proj.",
    ".self_attn.q_norm.": ".self_attn.q_layernorm.",
    ".self_attn.k_norm.": ".self_attn.k_layernorm.",
    ".down_proj.": ".w2.",  # the dense MLP's and each expert's
    ".feed_forward.gate.e_score_correction_bias": ".feed_forward.expert_bias",
}


class Lfm2ForCausalLM(LlamaForCausalLM):
    layer_cls = Lfm2DecoderLayer
    layer_kinds_from = staticmethod(layer_kinds)
    _UNFUSED = {
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "gate_up_proj": ("w1", "w3"),  # the dense MLP's and each expert's
    }

    def __init__(self, cfg: TextModelConfig) -> None:
        super().__init__(cfg)
        self.rotary = nn.ModuleDict({k: r for k, r in self.rotary.items() if k == "full"})
        self.layer_kinds = ["full"]

    def _shard_rows(self, fused: str, param: str) -> list[int]:
        if fused.endswith("gate_up_proj"):
            return [self.get_parameter(param).shape[0] // 2] * 2
        return super()._shard_rows(fused, param)

    def hf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {renamed(n, _RENAMED): shape for n, shape in super().hf_weight_shapes().items()}
        if not self.cfg.hf.get("use_expert_bias", True):  # none in the checkpoint: zeros steer nothing
            shapes = {n: s for n, s in shapes.items() if not n.endswith(".expert_bias")}
        return shapes

    def finish_loading(self) -> None:
        super().finish_loading()
        if not self.cfg.hf.get("use_expert_bias", True):  # no tensor came for it: zeros, which steer nothing
            for layer in self.layers:
                if isinstance(layer.feed_forward, GroupedSigmoidMoE):
                    layer.feed_forward.gate.e_score_correction_bias.data.zero_()

    def load_weight(self, hf_name: str, tensor) -> None:
        super().load_weight(renamed(hf_name, {new: old for old, new in _RENAMED.items()}), tensor)


# ---- GGUF: llama.cpp's lfm2 files ----------------------------------------------------------------


def _gguf_config(meta: GGUFMetadata, architecture: str = "Lfm2ForCausalLM") -> dict[str, Any]:
    """A layer is a short conv exactly where its attention.head_count_kv is 0 (llama.cpp's rule),
    checked against its tensors; feed_forward_length is the MLP's width as used."""
    cfg = base_config(meta, architecture)
    n = cfg["num_hidden_layers"]
    attention = attention_layers(meta, n, "shortconv.in_proj.weight")
    types = ["full_attention" if a else "conv" for a in attention]
    uniform(meta, "attention.head_count_kv", n, "num_key_value_heads", cfg)
    cfg.update(
        layer_types=types,
        conv_L_cache=meta.integer("shortconv.l_cache"),
        conv_bias=any(meta.block_has(i, "shortconv.in_proj.bias") for i in range(n)),
        intermediate_size=meta.integer("feed_forward_length"),
        block_auto_adjust_ff_dim=False,
    )
    if architecture == "Lfm2MoeForCausalLM":
        if meta.get("expert_gating_func", 2) != 2:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
            raise ValueError(f"{meta.where}: lfm2moe experts gated by {meta.get('expert_gating_func')}, not sigmoid")
        cfg.update(
            num_experts=meta.integer("expert_count"),
            num_experts_per_tok=meta.integer("expert_used_count"),
            moe_intermediate_size=meta.integer("expert_feed_forward_length"),
            num_dense_layers=meta.integer("leading_dense_block_count", 0),
            norm_topk_prob=bool(meta.get("expert_weights_norm", True)),
            routed_scaling_factor=meta.real("expert_weights_scale", 1.0) or 1.0,
            use_expert_bias=any(meta.block_has(i, "exp_probs_b.bias") for i in range(n)),
        )
    return cfg


def _gguf_transform(hf_name: str, value: Value, meta: GGUFMetadata):
    if hf_name.endswith(".conv.conv.weight"):  # stored squeezed [C, K]
        value = reshaped(value, value.shape[0], 1, -1)
    elif ".experts." in hf_name:  # stacked [experts, N, K]
        yield from each_expert(hf_name, value, meta)
        return
    yield hf_name, value


_GGUF_NAMES = {
    "attn_norm.weight": "operator_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.out_proj.weight",
    "attn_q_norm.weight": "self_attn.q_layernorm.weight",
    "attn_k_norm.weight": "self_attn.k_layernorm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
    **{
        f"shortconv.{part}.{kind}": f"conv.{part}.{kind}"
        for part in ("conv", "in_proj", "out_proj")
        for kind in ("weight", "bias")
    },
}
_GGUF_EXPERT_NAMES = {
    "ffn_gate_inp.weight": "feed_forward.gate.weight",
    "exp_probs_b.bias": "feed_forward.expert_bias",
    "ffn_gate_exps.weight": "feed_forward.experts.w1.weight",
    "ffn_up_exps.weight": "feed_forward.experts.w3.weight",
    "ffn_down_exps.weight": "feed_forward.experts.w2.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "token_embd_norm.weight": "model.embedding_norm.weight",  # the final norm (llama.cpp's name)
    "output.weight": "lm_head.weight",
}
GGUF_ARCHS = {
    "lfm2": GGUFArch("Lfm2ForCausalLM", _gguf_config, _GGUF_NAMES, _GLOBAL_NAMES, transform=_gguf_transform),
    "lfm2moe": GGUFArch(
        "Lfm2MoeForCausalLM",
        lambda meta: _gguf_config(meta, "Lfm2MoeForCausalLM"),
        {**_GGUF_NAMES, **_GGUF_EXPERT_NAMES},
        _GLOBAL_NAMES,
        transform=_gguf_transform,
    ),
}
