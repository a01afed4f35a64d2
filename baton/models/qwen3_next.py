"""Qwen3-Next and Qwen3.5 (text): Gated DeltaNet layers (causal conv + gated delta rule, a
constant-size state per request) beside gated full-attention layers (output gate, partial
rotary); Qwen3-Next's MLPs are MoE with a shared expert, Qwen3.5's dense."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from baton.kv.spec import LayerKind
from baton.models.fused_decode import (
    DecodeBlock,
    StepBinding,
    attention_step,
    linear_args,
    mixer_mlp_blocks,
    packed_only,
    state_args,
)
from baton.models.layers import RMSNorm, paged_attention, unwrapped
from baton.models.llama import ForwardContext, LlamaForCausalLM
from baton.models.model_config import TextModelConfig
from baton.models.moe import SparseMoE, dense_mlp
from baton.models.recurrent import conv_over_segments, scan_over_segments, segments
from baton.models.rope import Rotary
from baton.ops import ops, sigmoid, silu, softplus


def layer_kinds(hf: dict[str, Any]) -> list[LayerKind]:
    kh, vh = int(hf["linear_num_key_heads"]), int(hf["linear_num_value_heads"])
    dk, dv = int(hf["linear_key_head_dim"]), int(hf["linear_value_head_dim"])
    if min(kh, vh, dk, dv) < 1 or vh % kh:
        raise ValueError(
            f"linear_num_value_heads ({vh}) must be a positive multiple of linear_num_key_heads ({kh}), "
            f"head dims positive (got {dk}, {dv})"
        )
    conv_dim = 2 * kh * dk + vh * dv
    recurrent = LayerKind.recurrent((conv_dim, int(hf["linear_conv_kernel_dim"]) - 1), (vh, dk, dv))
    kinds = {"linear_attention": recurrent, "full_attention": LayerKind.full()}
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % int(hf.get("full_attention_interval", 4)) == 0 else "linear_attention"
        for i in range(int(hf["num_hidden_layers"]))
    ]
    try:
        return [kinds[t] for t in types]
    except KeyError as e:
        raise ValueError(f"unsupported Qwen3-Next layer type {e.args[0]!r}") from None


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight * silu(gate), in float32 (Qwen3-Next's RMSNormGated)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(x.dtype) * silu(gate.float())).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """in_proj_qkvz's rows are q | k | v | z (every head's q, then every head's k, ...) and
    in_proj_ba's b | a, as Qwen3.5 and llama.cpp store them apart, so a file whose q|k|v and z
    are in different block formats stays in blocks (stacked row runs); Qwen3-Next's checkpoints,
    interleaved per key head, are put in this order at load (`canonical_rows`)."""

    def __init__(self, cfg: TextModelConfig, layer_id: int) -> None:
        super().__init__()
        hf = cfg.hf
        self.layer_id = layer_id
        self.kh, self.vh = int(hf["linear_num_key_heads"]), int(hf["linear_num_value_heads"])
        self.dk, self.dv = int(hf["linear_key_head_dim"]), int(hf["linear_value_head_dim"])
        self.key_dim, self.value_dim = self.kh * self.dk, self.vh * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        kernel = int(hf["linear_conv_kernel_dim"])
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim, bias=False)
        self.in_proj_qkvz = nn.Linear(cfg.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * self.vh, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.vh))
        self.A_log = nn.Parameter(torch.zeros(self.vh))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.dv))
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)
        self.eps = cfg.rms_norm_eps

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n = x.shape[0]
        mixed, z = torch.split(self.in_proj_qkvz(x), [self.conv_dim, self.value_dim], dim=1)
        b, a = torch.split(self.in_proj_ba(x), [self.vh, self.vh], dim=1)
        (conv_state, rec_state), (conv_ckpt, rec_ckpt) = ctx.states.layer(self.layer_id)
        weight = self.conv1d.weight[:, 0]
        segs = list(segments(ctx.state_meta))
        conv_out = silu(conv_over_segments(mixed, segs, conv_state, conv_ckpt, weight, None))
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=1)
        r = self.vh // self.kh
        q = l2norm(q.float().view(n, self.kh, self.dk)).repeat_interleave(r, dim=1) * self.dk**-0.5
        k = l2norm(k.float().view(n, self.kh, self.dk)).repeat_interleave(r, dim=1)
        v = v.float().view(n, self.vh, self.dv)
        beta = sigmoid(b.float())
        decay = -self.A_log.float().exp() * softplus(a.float() + self.dt_bias.float())
        out = scan_over_segments(q, k, v, decay, beta, segs, rec_state, rec_ckpt)
        out = gated_rms_norm(out.to(x.dtype), z.view(n, self.vh, self.dv), self.norm.weight, self.eps)
        return self.out_proj(out.reshape(n, -1))

    def decode_step(self, binding: StepBinding):
        """This layer as a fused decoder's step (baton/ops/gdn_layer.cpp); None without float32
        recurrent state or with a projection off the packed kernels."""
        out_proj = unwrapped(self.out_proj)
        if binding.states is None or not packed_only(self, out_proj):
            return None
        return ops().GdnStep(
            key_heads=self.kh,
            value_heads=self.vh,
            key_dim=self.dk,
            value_dim=self.dv,
            conv_kernel=self.conv1d.weight.shape[-1],
            hidden=out_proj.out_features,
            **linear_args("in_proj", self.in_proj_qkvz),
            **linear_args("ba", self.in_proj_ba),
            **linear_args("out_proj", out_proj),
            conv_weight=self.conv1d.weight[:, 0].float().contiguous(),
            # forward's -A_log.float().exp(): the same op on the same [vh], once
            neg_exp_a=(-self.A_log.float().exp()).contiguous(),
            dt_bias=self.dt_bias.float().contiguous(),
            norm_weight=self.norm.weight.float().contiguous(),
            norm_eps=self.eps,
            **state_args(binding, self.layer_id),
        )


class GatedAttention(nn.Module):
    """q_proj gives each head its query and an output gate; q/k norm (1 + w); partial rotary."""

    def __init__(self, cfg: TextModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, 2 * self.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, 1.0)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, 1.0)
        self.scale = cfg.attn_scale

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        qg = self.q_proj(x).view(n, self.num_heads, 2 * d)
        q, gate = qg[..., :d].contiguous(), qg[..., d:].reshape(n, -1)
        k = self.k_proj(x).view(n, self.num_kv_heads, d)
        v = self.v_proj(x).view(n, self.num_kv_heads, d)
        self.q_norm.heads_(q)
        self.k_norm.heads_(k)
        q, k = partial_rotary(q, *rope), partial_rotary(k, *rope)
        cache, meta = ctx.for_layer(self.layer_id)
        out = paged_attention(q, k, v, cache, meta, self.scale)
        return self.o_proj(out.reshape(n, -1) * sigmoid(gate))

    def decode_step(self, binding: StepBinding):
        """This attention as a fused decoder's step (output gate, partial rotary as forward's torch
        ops); None off the packed kernels."""
        qkv = [self.q_proj, self.k_proj, self.v_proj]
        return attention_step(self, binding, qkv, rope="full", torch_rotary=True, output_gate=True)


def partial_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary on the first cos.shape[-1] dims of each head of x [T, heads, D]; the rest pass."""
    rot = cos.shape[-1]
    xr, half = x[..., :rot], rot // 2
    turned = torch.cat((xr[..., half:], xr[..., :half]), dim=-1)
    return torch.cat((xr * cos[:, None] + turned * signed_sin[:, None], x[..., rot:]), dim=-1)


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, cfg: TextModelConfig, layer_id: int) -> None:
        super().__init__()
        hf = cfg.hf
        self.recurrent = cfg.layer_kinds[layer_id].is_recurrent
        if self.recurrent:
            self.linear_attn = GatedDeltaNet(cfg, layer_id)
        else:
            self.self_attn = GatedAttention(cfg, layer_id)
        sparse = int(hf.get("num_experts", 0)) > 0 and (layer_id + 1) % int(hf.get("decoder_sparse_step", 1)) == 0
        if sparse and layer_id not in (hf.get("mlp_only_layers") or []):
            self.mlp = SparseMoE.from_config(cfg, shared_gate=True)
        else:
            self.mlp = dense_mlp(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, 1.0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, 1.0)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: dict, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.pre_norm(x, residual)
        h = self.linear_attn(h, ctx) if self.recurrent else self.self_attn(h, rope["full"], ctx)
        return self.mlp(self.post_attention_layernorm(h, residual)), residual

    def decode_blocks(self, binding: StepBinding) -> list[DecodeBlock] | None:
        """forward's blocks for the fused decoder, or None where a step cannot run there."""
        mixer = (self.linear_attn if self.recurrent else self.self_attn).decode_step(binding)
        mlp = unwrapped(self.mlp).decode_step(binding)
        return mixer_mlp_blocks(self.input_layernorm, mixer, self.post_attention_layernorm, mlp)


class Qwen3NextForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3NextDecoderLayer
    norm_offset = 1.0
    layer_kinds_from = staticmethod(layer_kinds)

    def __init__(self, cfg: TextModelConfig) -> None:
        super().__init__(cfg)
        rope = cfg.rope["full"]
        self.rotary = nn.ModuleDict({"full": Rotary(rope, int(cfg.head_dim * rope.partial_rotary_factor))})
        self.layer_kinds = ["full"]

    _UNFUSED = {"gate_up_proj": ("gate_proj", "up_proj")}  # of the dense MLPs, the experts, the shared expert

    def load_weight(self, hf_name: str, tensor: torch.Tensor) -> None:
        part = next((p for p in _GDN_PARTS if f".linear_attn.{p}." in hf_name), None)
        if part is None:
            return super().load_weight(hf_name, tensor)
        module = hf_name.removeprefix("model.").rsplit(".", 2)[0]
        fused = "in_proj_ba" if part in ("in_proj_ba", "in_proj_b", "in_proj_a") else "in_proj_qkvz"
        self.block_rows.place(f"{module}.{fused}.weight", canonical_rows(self.get_submodule(module), part), tensor)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5's text model is Qwen3-Next's program with dense MLPs; only its checkpoint differs:
    Gated DeltaNet projections stored apart (q|k|v, z, b, a) rather than interleaved per key head.
    (Its text positions are one-dimensional: the three mrope sections see the same position,
    which is plain rotary.)"""

    def hf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().hf_weight_shapes()
        for name in [n for n in shapes if ".linear_attn.in_proj_" in n]:
            del shapes[name]
        for name, gdn in self.named_modules():
            if isinstance(gdn, GatedDeltaNet):
                for part in _SPLIT_PARTS:  # each part's rows: canonical_rows', the one place that knows them
                    shapes[f"model.{name}.{part}.weight"] = (
                        len(canonical_rows(gdn, part)),
                        gdn.in_proj_qkvz.in_features,
                    )
        return shapes


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """A multimodal Qwen3.5 checkpoint (how Qwen publishes the family) served as text: its language
    model's weights under `model.language_model.`; the vision tower's and the MTP layer's are not
    read (requests carry text only)."""

    skipped_weights = ("model.visual.", "mtp.")

    def hf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return {_language_model(n): shape for n, shape in super().hf_weight_shapes().items()}

    def load_weight(self, hf_name: str, tensor: torch.Tensor) -> None:
        super().load_weight(hf_name.replace("model.language_model.", "model.", 1), tensor)


def _language_model(name: str) -> str:
    return name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name


_SPLIT_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # Qwen3.5's (and llama.cpp's)
_GDN_PARTS = ("in_proj_qkvz", "in_proj_ba", *_SPLIT_PARTS)  # and Qwen3-Next's interleaved ones


def canonical_rows(gdn: GatedDeltaNet, part: str) -> torch.Tensor:
    """Where the rows of checkpoint projection `part` go in the module's q|k|v|z and b|a: Qwen3.5's
    parts are runs; Qwen3-Next's interleave per key head h [q_h, k_h, v and z of its r value
    heads] and [b, a of its r heads]."""
    kh, r, dk, dv = gdn.kh, gdn.vh // gdn.kh, gdn.dk, gdn.dv
    runs = {
        "in_proj_qkv": (0, gdn.conv_dim),
        "in_proj_z": (gdn.conv_dim, gdn.value_dim),
        "in_proj_b": (0, gdn.vh),
        "in_proj_a": (gdn.vh, gdn.vh),
    }
    if part in runs:
        start, n = runs[part]
        return torch.arange(start, start + n)
    head = torch.arange(kh)[:, None]
    if part == "in_proj_ba":
        heads = head * r + torch.arange(r)
        return torch.cat((heads, heads + gdn.vh), dim=1).flatten()
    q, k = head * dk + torch.arange(dk), gdn.key_dim + head * dk + torch.arange(dk)
    v = 2 * gdn.key_dim + head * r * dv + torch.arange(r * dv)
    return torch.cat((q, k, v, v + gdn.value_dim), dim=1).flatten()
