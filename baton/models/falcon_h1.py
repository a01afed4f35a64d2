"""Falcon-H1: in every layer, causal GQA attention and a Mamba2 mixer read the same normed input and
their outputs are summed before the residual add; then a dense SiLU MLP. Its muP multipliers
(attention's input, key and output, the mixer's input, output and per-segment in_proj scales, the
MLP's gate and down) are folded into the weights at load, as llama.cpp's converter folds them into
its falcon-h1 files; the embedding's and the lm_head's stay scales (a tied lm_head shares the
embedding). A layer's attention keeps its KV under cache layer i, its mixer's state under
num_layers + i."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from baton.kv.spec import LayerKind
from baton.models.fused_decode import DecodeBlock, StepBinding, mixer_mlp_blocks
from baton.models.gguf_arch import ATTENTION_NAMES, GGUFArch, GGUFMetadata, Value, base_config
from baton.models.gguf_blocks import BlockTensor
from baton.models.layers import RMSNorm, unwrapped
from baton.models.llama import Attention, ForwardContext, LlamaForCausalLM
from baton.models.mamba2 import Mamba2Dims, Mamba2Mixer, gguf_names, gguf_undone, time_step_limit
from baton.models.model_config import TextModelConfig
from baton.models.moe import MLP
from baton.models.rope import Rotary
from baton.models.weight_map import renamed
from baton.ops import ops


def mamba_dims(hf: dict[str, Any]) -> Mamba2Dims:
    heads, hidden = int(hf.get("mamba_n_heads", 128)), int(hf["hidden_size"])
    inner = int(hf.get("mamba_d_ssm") or int(hf.get("mamba_expand", 2)) * hidden)
    head_dim = hf.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim == "auto" and heads > 0 else int(head_dim)
    if heads < 1 or heads * head_dim != inner:
        raise ValueError(
            f"Falcon-H1 config: mamba_n_heads ({heads}) x mamba_d_head ({head_dim}) != mamba_d_ssm ({inner})"
        )
    if not hf.get("mamba_rms_norm", False):
        norm = "none"
    else:
        norm = "before_gate" if hf.get("mamba_norm_before_gate", True) else "after_gate"
    dt_min, dt_max = time_step_limit(hf.get("time_step_limit"))
    return Mamba2Dims(
        heads=heads,
        head_dim=head_dim,
        groups=int(hf.get("mamba_n_groups", 1)),
        state_size=int(hf.get("mamba_d_state", 256)),
        conv_kernel=int(hf.get("mamba_d_conv", 4)),
        bias=bool(hf.get("mamba_proj_bias", False)),
        out_bias=bool(hf.get("projectors_bias", False)),
        conv_bias=bool(hf.get("mamba_conv_bias", True)),
        dt_min=dt_min,
        dt_max=dt_max,
        eps=float(hf.get("rms_norm_eps", 1e-5)),
        norm=norm,
    )


def layer_kinds(hf: dict[str, Any]) -> list[LayerKind]:
    """Every layer's attention KV, then every layer's Mamba2 state."""
    n = int(hf["num_hidden_layers"])
    return [LayerKind.full()] * n + [mamba_dims(hf).layer_kind()] * n


def _multiplier(value: Any, key: str) -> float:
    value = 1.0 if value is None else value
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value == 0:
        raise ValueError(f"Falcon-H1 config: {key} must be a finite non-zero number, got {value!r}")
    return float(value)


def _multipliers(hf: dict[str, Any], key: str, count: int) -> list[float]:
    values = hf.get(key)
    if values is None:
        return [1.0] * count
    if not isinstance(values, list) or len(values) != count:
        raise ValueError(f"Falcon-H1 config: {key} must be a list of {count} numbers, got {values!r}")
    return [_multiplier(v, key) for v in values]


def folded_scales(hf: dict[str, Any]) -> dict[str, float | list[float]]:
    """What each projection's weight (and bias) is multiplied by at load, where not 1: the config's
    multipliers, by the layer-relative parameter name (a list: per output row)."""
    m = {k: _multiplier(hf.get(k), k) for k in _SCALARS}
    gate, down = _multipliers(hf, "mlp_multipliers", 2)
    dims = mamba_dims(hf)
    gn = dims.groups * dims.state_size
    inner = dims.heads * dims.head_dim
    widths = (inner, inner, gn, gn, dims.heads)  # in_proj's z | x | B | C | dt
    mup = [s for w, s in zip(widths, _multipliers(hf, "ssm_multipliers", 5)) for _ in range(w)]
    a_in = m["attention_in_multiplier"]
    scales = {
        "self_attn.q_proj.weight": a_in,
        "self_attn.k_proj.weight": a_in * m["key_multiplier"],
        "self_attn.k_proj.bias": m["key_multiplier"],
        "self_attn.v_proj.weight": a_in,
        "self_attn.o_proj.weight": m["attention_out_multiplier"],
        "self_attn.o_proj.bias": m["attention_out_multiplier"],
        "mamba.in_proj.weight": [s * m["ssm_in_multiplier"] for s in mup],
        "mamba.in_proj.bias": mup,
        "mamba.out_proj.weight": m["ssm_out_multiplier"],
        "mamba.out_proj.bias": m["ssm_out_multiplier"],
        "mlp.gate_proj.weight": gate,
        "mlp.down_proj.weight": down,
    }
    return {k: v for k, v in scales.items() if any(s != 1.0 for s in (v if isinstance(v, list) else [v]))}


_SCALARS = (
    "attention_in_multiplier",
    "attention_out_multiplier",
    "key_multiplier",
    "ssm_in_multiplier",
    "ssm_out_multiplier",
)


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, cfg: TextModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mamba = Mamba2Mixer(cfg.hidden_size, cfg.num_layers + layer_id, mamba_dims(cfg.hf))
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: dict, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.pre_norm(x, residual)
        h = self.mamba(h, ctx) + self.self_attn(h, rope["full"], ctx)
        return self.mlp(self.post_attention_layernorm(h, residual)), residual

    def decode_blocks(self, binding: StepBinding) -> list[DecodeBlock] | None:
        mamba, attn = self.mamba.decode_step(binding), self.self_attn.decode_step(binding)
        mixers = None if mamba is None or attn is None else ops().ParallelStep(first=mamba, second=attn)
        mlp = unwrapped(self.mlp).decode_step(binding)
        return mixer_mlp_blocks(self.input_layernorm, mixers, self.post_attention_layernorm, mlp)


# Falcon-H1's checkpoint names for what baton's Llama-style program calls otherwise
_NAMES = {
    ".mlp.": ".feed_forward.",
    ".post_attention_layernorm.": ".pre_ff_layernorm.",
    "model.norm.": "model.final_layernorm.",
}


class FalconH1ForCausalLM(LlamaForCausalLM):
    layer_cls = FalconH1DecoderLayer
    layer_kinds_from = staticmethod(layer_kinds)

    def __init__(self, cfg: TextModelConfig) -> None:
        hf = cfg.hf
        if hf.get("mlp_bias"):
            raise ValueError("Falcon-H1 config: mlp_bias is not supported")
        if cfg.hidden_act != "silu":
            raise ValueError(f"Falcon-H1 supports hidden_act silu, got {cfg.hidden_act!r}")
        super().__init__(cfg)
        self.embedding_multiplier = _multiplier(hf.get("embedding_multiplier"), "embedding_multiplier")
        self.lm_head_multiplier = _multiplier(hf.get("lm_head_multiplier"), "lm_head_multiplier")
        self.folded = folded_scales(hf)
        self.rotary = nn.ModuleDict({"full": Rotary(cfg.rope["full"], cfg.head_dim)})
        self.layer_kinds = ["full"]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.lm_head_multiplier

    def cache_layers(self, layers: range) -> list[int]:
        """The cache layer ids a pipeline stage of `layers` holds: their attention's and their mixers'."""
        return [*layers, *(self.cfg.num_layers + i for i in layers)]

    # ---- weights: Falcon-H1's names in, multipliers folded -------------------------------------
    def gguf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return super().hf_weight_shapes()

    def hf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return {renamed(n, _NAMES): shape for n, shape in self.gguf_weight_shapes().items()}

    def load_weight(self, hf_name: str, tensor: torch.Tensor | BlockTensor) -> None:
        name = renamed(hf_name, {v: k for k, v in _NAMES.items()})
        part = name.split(".", 3)[3] if name.startswith("model.layers.") else ""
        scale = self.folded.get(part)
        if scale is not None:
            if isinstance(tensor, BlockTensor):  # llama.cpp's files hold them folded; their config says 1
                raise ValueError(f"{hf_name}: a multiplier cannot be folded into GGUF blocks")
            if isinstance(scale, list):  # per output row
                rows = torch.tensor(scale, dtype=tensor.dtype, device=tensor.device)
                tensor = tensor * (rows[:, None] if tensor.dim() == 2 else rows)
            else:
                tensor = tensor * scale
        super().load_weight(name, tensor)


def _gguf_config(meta: GGUFMetadata) -> dict[str, Any]:
    """llama.cpp's falcon-h1 metadata; its converter folded every multiplier into the weights (a
    tied file's lm_head is the scaled embedding, as llama.cpp reads it), and its graph gates before
    the grouped norm, which the file has where blocks carry ssm_norm."""
    cfg = base_config(meta, "FalconH1ForCausalLM")
    n = cfg["num_hidden_layers"]
    kv = {int(v) for v in meta.per_layer("attention.head_count_kv", meta.integer("block_count"))[:n]}
    if len(kv) != 1 or 0 in kv:
        raise ValueError(f"{meta.where}: metadata {meta.arch}.attention.head_count_kv must be one non-zero value")
    heads, inner = meta.integer("ssm.time_step_rank"), meta.integer("ssm.inner_size")
    if heads < 1 or inner % heads:
        raise ValueError(f"{meta.where}: ssm.inner_size ({inner}) is not a multiple of ssm.time_step_rank ({heads})")
    norms = {meta.block_has(i, "ssm_norm.weight") for i in range(n)}
    conv_bias = {meta.block_has(i, "ssm_conv1d.bias") for i in range(n)}
    if len(norms) > 1 or len(conv_bias) > 1:
        raise ValueError(f"{meta.where}: some blocks carry ssm_norm or ssm_conv1d.bias and others do not")
    cfg.update(
        num_key_value_heads=kv.pop(),
        intermediate_size=meta.integer("feed_forward_length"),
        hidden_act="silu",
        mamba_d_ssm=inner,
        mamba_n_heads=heads,
        mamba_d_head=inner // heads,
        mamba_n_groups=meta.integer("ssm.group_count"),
        mamba_d_state=meta.integer("ssm.state_size"),
        mamba_d_conv=meta.integer("ssm.conv_kernel"),
        mamba_conv_bias=conv_bias.pop(),
        mamba_rms_norm=norms.pop(),
        mamba_norm_before_gate=False,
    )
    return cfg


def _gguf_transform(hf_name: str, value: Value, meta: GGUFMetadata):
    yield hf_name, gguf_undone(hf_name.split(".mamba.", 1)[1], value) if ".mamba." in hf_name else value


_GGUF_NAMES = {
    **{k: v for k, v in ATTENTION_NAMES.items() if "_norm." not in k or k == "attn_norm.weight"},
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm": "post_attention_layernorm.weight",  # (the converter writes it without .weight)
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    **gguf_names("mamba"),
}
GGUF_ARCHS = {"falcon-h1": GGUFArch("FalconH1ForCausalLM", _gguf_config, _GGUF_NAMES, transform=_gguf_transform)}
