"""Kimi Linear: Kimi Delta Attention layers (short causal convs on q, k and v, then a gated delta
rule with a per-channel decay; a constant-size state per request) beside NoPE multi-head latent
attention layers (a paged latent cache, baton/models/mla.py), and a sigmoid-routed MoE with a
shared expert after the first dense layer(s).

Weights are read under the names of the original checkpoint, which is also how transformers
saves the model: self_attn.{q,k,v}_conv1d, self_attn.{f_a_proj,f_b_proj,dt_bias,A_log},
block_sparse_moe.experts.{e}.w1/w2/w3."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from baton.kv.spec import LayerKind
from baton.models.fused_decode import (
    DecodeBlock,
    StepBinding,
    linear_args,
    mixer_mlp_blocks,
    packed_only,
    state_args,
)
from baton.models.gguf_blocks import BlockTensor
from baton.models.layers import RMSNorm, unwrapped
from baton.models.llama import ForwardContext, LlamaForCausalLM
from baton.models.mla import MLAttention
from baton.models.model_config import TextModelConfig
from baton.models.moe import MLP, GroupedSigmoidMoE
from baton.models.recurrent import conv_over_segments, scan_over_segments, segments
from baton.models.weight_map import PartsWeightMap, kda_parts
from baton.ops import ops, sigmoid, silu, softplus


def _get(hf: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of `keys` the config sets (checkpoint names and transformers' aliases)."""
    return next((hf[k] for k in keys if hf.get(k) is not None), default)


def kda_dims(hf: dict[str, Any]) -> tuple[int, int, int]:
    """(heads, head dim, conv kernel) of the KDA layers: linear_attn_config wins, as in transformers."""
    lin = hf.get("linear_attn_config") or {}
    heads = lin.get("num_heads", hf.get("linear_num_heads", 32))
    dim = lin.get("head_dim", hf.get("linear_head_dim", 128))
    kernel = lin.get("short_conv_kernel_size", hf.get("linear_conv_kernel_dim", 4))
    return int(heads), int(dim), int(kernel)


def layer_types(hf: dict[str, Any]) -> list[str]:
    """layer_types, else linear_attn_config's 1-indexed layer lists, else full iff i > 0 and i % 4 == 0."""
    n = int(hf["num_hidden_layers"])
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    lin = hf.get("linear_attn_config") or {}
    if "full_attn_layers" in lin and "kda_layers" in lin:
        types: list[str | None] = [None] * n
        for i in lin["full_attn_layers"]:
            types[int(i) - 1] = "full_attention"
        for i in lin["kda_layers"]:
            types[int(i) - 1] = "linear_attention"
        if None in types:
            raise ValueError(f"linear_attn_config does not give every one of the {n} layers a type")
        return types  # type: ignore[return-value]
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]


def mlp_layer_types(hf: dict[str, Any]) -> list[str]:
    if hf.get("mlp_layer_types"):
        return list(hf["mlp_layer_types"])
    first_dense = int(_get(hf, "first_k_dense_replace", default=1))
    return ["dense" if i < first_dense else "sparse" for i in range(int(hf["num_hidden_layers"]))]


def layer_kinds(hf: dict[str, Any]) -> list[LayerKind]:
    heads, dim, kernel = kda_dims(hf)
    recurrent = LayerKind.recurrent((3 * heads * dim, kernel - 1), (heads, dim, dim))
    latent = int(hf.get("kv_lora_rank", 512)) + int(hf.get("qk_rope_head_dim", 64))
    kinds = {"linear_attention": recurrent, "full_attention": LayerKind.mla(latent)}
    try:
        return [kinds[t] for t in layer_types(hf)]
    except KeyError as e:
        raise ValueError(f"unsupported Kimi Linear layer type {e.args[0]!r}") from None


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)  # divide, as FLA / transformers do


class KimiDeltaAttention(nn.Module):
    """`lower_bound` (GLM-5.3-Flash's safe gate): the per-channel log decay is
    lower_bound * sigmoid(exp(A_log) * raw) instead of -exp(A_log) * softplus(raw)."""

    def __init__(self, cfg: TextModelConfig, layer_id: int, lower_bound: float | None = None) -> None:
        super().__init__()
        self.lower_bound = lower_bound
        self.layer_id = layer_id
        self.heads, self.dim, kernel = kda_dims(cfg.hf)
        hd = self.heads * self.dim
        # one projection of x: q | k | v | f_a (forget-gate low rank) | g_a (output-gate low rank) | b
        self.in_rows = {"q_proj": hd, "k_proj": hd, "v_proj": hd, "f_a_proj": self.dim, "g_a_proj": self.dim}
        self.in_rows["b_proj"] = self.heads
        self.in_proj = nn.Linear(cfg.hidden_size, sum(self.in_rows.values()), bias=False)
        self.conv_weight = nn.Parameter(torch.empty(3 * hd, kernel))  # depthwise, channels [q | k | v]
        self.f_b_proj = nn.Linear(self.dim, hd, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(hd))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.g_b_proj = nn.Linear(self.dim, hd, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(self.dim))
        self.o_proj = nn.Linear(hd, cfg.hidden_size, bias=False)
        self.eps = cfg.rms_norm_eps

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n, h, d = x.shape[0], self.heads, self.dim
        qkv, f_a, g_a, b = torch.split(self.in_proj(x), [3 * h * d, d, d, h], dim=1)
        (conv_state, rec_state), (conv_ckpt, rec_ckpt) = ctx.states.layer(self.layer_id)
        segs = list(segments(ctx.state_meta))
        conv_out = conv_over_segments(qkv, segs, conv_state, conv_ckpt, self.conv_weight, None)
        q, k, v = silu(conv_out).float().view(n, 3, h, d).unbind(1)
        q, k = l2norm(q) * d**-0.5, l2norm(k)
        raw = self.f_b_proj(f_a.contiguous()).float().view(n, h, d) + self.dt_bias.float().view(h, d)
        if self.lower_bound is None:
            decay = -self.A_log.float().exp()[:, None] * softplus(raw)  # [n, h, d]: per key channel
        else:
            decay = self.lower_bound * sigmoid(self.A_log.float().exp()[:, None] * raw)
        beta = sigmoid(b.float())
        out = scan_over_segments(q, k, v, decay, beta, segs, rec_state, rec_ckpt)
        gate = self.g_b_proj(g_a.contiguous()).float().view(n, h, d)
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm.weight.float()
        return self.o_proj((out * sigmoid(gate)).to(x.dtype).reshape(n, -1))

    def decode_step(self, binding: StepBinding):
        """This layer as a fused decoder's step (baton/ops/kda_layer.cpp); None without
        recurrent state or with a projection off the packed kernels."""
        o_proj = unwrapped(self.o_proj)
        if binding.states is None or not packed_only(self, o_proj):
            return None
        # forward's A_log.float().exp() (negated without a lower bound): the same op on the same [h], once
        exp_a = self.A_log.float().exp()
        decay = (
            {"neg_exp_a": (-exp_a).contiguous()}
            if self.lower_bound is None
            else {"exp_a": exp_a.contiguous(), "lower_bound": self.lower_bound}
        )
        return ops().KdaStep(
            heads=self.heads,
            head_dim=self.dim,
            conv_kernel=self.conv_weight.shape[1],
            hidden=o_proj.out_features,
            **linear_args("in_proj", self.in_proj),
            **linear_args("out_proj", o_proj),
            conv_weight=self.conv_weight.float().contiguous(),
            **linear_args("f_b", self.f_b_proj),
            **linear_args("g_b", self.g_b_proj),
            dt_bias=self.dt_bias.float().contiguous(),
            **decay,
            o_norm=self.o_norm.weight.float().contiguous(),
            norm_eps=self.eps,
            **state_args(binding, self.layer_id),
        )


class KimiDecoderLayer(nn.Module):
    def __init__(self, cfg: TextModelConfig, layer_id: int) -> None:
        super().__init__()
        hf = cfg.hf
        self.recurrent = cfg.layer_kinds[layer_id].is_recurrent
        self.self_attn = KimiDeltaAttention(cfg, layer_id) if self.recurrent else MLAttention(cfg, layer_id)
        if mlp_layer_types(hf)[layer_id] == "sparse":
            moe_size = int(hf["moe_intermediate_size"])
            self.mlp = GroupedSigmoidMoE(
                cfg.hidden_size,
                moe_size,
                moe_size * int(_get(hf, "num_shared_experts", "n_shared_experts", default=0)),
                num_experts=int(_get(hf, "num_experts", "num_local_experts")),
                top_k=int(_get(hf, "num_experts_per_token", "num_experts_per_tok")),
                n_group=int(_get(hf, "num_expert_group", "n_group", default=1)),
                topk_group=int(_get(hf, "topk_group", default=1)),
                norm_topk_prob=bool(_get(hf, "moe_renormalize", "norm_topk_prob", default=True)),
                routed_scaling_factor=float(_get(hf, "routed_scaling_factor", default=1.0)),
            )
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.pre_norm(x, residual)
        h = self.self_attn(h, ctx)
        return self.mlp(self.post_attention_layernorm(h, residual)), residual

    def decode_blocks(self, binding: StepBinding) -> list[DecodeBlock] | None:
        """forward's blocks for the fused decoder, or None where a step cannot run there."""
        mixer, mlp = self.self_attn.decode_step(binding), unwrapped(self.mlp).decode_step(binding)
        return mixer_mlp_blocks(self.input_layernorm, mixer, self.post_attention_layernorm, mlp)


class KimiLinearForCausalLM(PartsWeightMap, LlamaForCausalLM):
    """No rotary anywhere (NoPE MLA); decode-only steps as one C++ call (baton/models/fused_decode.py)."""

    layer_cls = KimiDecoderLayer
    layer_kinds_from = staticmethod(layer_kinds)

    def __init__(self, cfg: TextModelConfig) -> None:
        if cfg.hidden_act != "silu":
            raise ValueError(f"Kimi Linear supports hidden_act silu, got {cfg.hidden_act!r}")
        super().__init__(cfg)
        self.rotary = nn.ModuleDict()
        self.layer_kinds = []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed(input_ids)
        one_token_rows = ctx.state_meta is None or all(s.q_end - s.q_start == 1 for s in ctx.state_meta.seqs)
        if ctx.decode_only and one_token_rows and self._fused_decoder_for(ctx.storage, ctx.states) is not None:
            return self.fused_decoder(x, {}, ctx)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx)
        return self.norm(x, residual)

    # ---- weights: checkpoint names in, fused parameters out ------------------------------------
    def _hf_parts(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, int | None, tuple[int, ...]]]:
        """The checkpoint tensors (name, first row in the parameter or None for all of it, shape)
        that parameter `name` is made of."""
        hf = name if name.startswith("lm_head.") else f"model.{name}"
        hf = hf.replace(".mlp.", ".block_sparse_moe.")
        attn = getattr(self.layers[int(name.split(".")[1])], "self_attn", None) if name.startswith("layers.") else None
        kda = kda_parts(hf, shape, getattr(attn, "in_rows", None))
        if kda is not None:
            return kda
        if hf.endswith(".self_attn.A_log"):
            return [(hf, None, (1, 1, shape[0], 1))]
        if hf.endswith(".gate_up_proj.weight"):
            half = shape[0] // 2
            parts = ("w1", "w3") if ".experts." in hf else ("gate_proj", "up_proj")
            return [(hf.replace("gate_up_proj", part), i * half, (half, shape[1])) for i, part in enumerate(parts)]
        if ".experts." in hf and hf.endswith(".down_proj.weight"):
            return [(hf.replace("down_proj", "w2"), None, shape)]
        return [(hf, None, shape)]

    def _checkpoint_name(self, hf_name: str) -> str:
        # the original checkpoint names its dense MLP(s) `mlp.`; transformers saves `block_sparse_moe.`
        return hf_name.replace(".mlp.", ".block_sparse_moe.")

    # llama.cpp's files split each MLA layer's kv_b_proj into k_b and v_b (kimi_linear_gguf.py)
    _KV_B = ("kv_b_proj.k_b", "kv_b_proj.v_b")

    def gguf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = self.hf_weight_shapes()
        for name in [n for n in shapes if n.endswith(".kv_b_proj.weight")]:
            attn = self.layers[int(name.split(".")[2])].self_attn
            del shapes[name]
            for part, dim in zip(self._KV_B, (attn.dn, attn.dv)):
                shapes[name.replace("kv_b_proj.weight", part)] = (attn.num_heads * dim, attn.rank)
        return shapes

    def load_weight(self, hf_name: str, tensor: torch.Tensor | BlockTensor) -> None:
        part = next((p for p in self._KV_B if hf_name.endswith(p)), None)
        if part is None:
            return super().load_weight(hf_name, tensor)
        attn = self.layers[int(hf_name.split(".")[2])].self_attn
        head = torch.arange(attn.num_heads)[:, None] * (attn.dn + attn.dv)  # per head: its dn k rows, then dv v rows
        rows = head + torch.arange(attn.dn) if part == self._KV_B[0] else head + attn.dn + torch.arange(attn.dv)
        attn.kv_b_proj.weight.data[rows.flatten()] = tensor.reshape(-1, attn.rank)
