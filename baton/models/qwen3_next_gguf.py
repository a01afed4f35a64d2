"""Qwen3-Next's and Qwen3.5's GGUF files (llama.cpp's qwen3next, qwen35 and qwen35moe), read as a
Qwen3.5 checkpoint: split Gated DeltaNet projections, which its loading writes into Qwen3-Next's
interleaved rows (so a qwen3next file's MoE layers and the modules are Qwen3-Next's)."""

from __future__ import annotations

from typing import Any

import torch

from baton.models.gguf_arch import (
    ATTENTION_NAMES,
    MLP_NAMES,
    GGUFArch,
    GGUFMetadata,
    Value,
    base_config,
    experts,
    float_op,
    reshaped,
    take_column_groups,
    take_rows,
    uniform,
)


def _gguf_config(meta: GGUFMetadata) -> dict[str, Any]:
    cfg = base_config(meta, "Qwen3_5ForCausalLM")
    n = cfg["num_hidden_layers"]
    uniform(meta, "attention.head_count_kv", n, "num_key_value_heads", cfg)
    vh = meta.integer("ssm.time_step_rank")
    inner = meta.integer("ssm.inner_size")
    if vh < 1 or inner % vh:
        raise ValueError(f"{meta.where}: ssm.inner_size ({inner}) is not a multiple of ssm.time_step_rank ({vh})")
    cfg.update(
        intermediate_size=meta.integer("feed_forward_length", 0),
        linear_num_key_heads=meta.integer("ssm.group_count"),
        linear_num_value_heads=vh,
        linear_key_head_dim=meta.integer("ssm.state_size"),
        linear_value_head_dim=inner // vh,
        linear_conv_kernel_dim=meta.integer("ssm.conv_kernel"),
        partial_rotary_factor=meta.integer("rope.dimension_count") / cfg["head_dim"],
    )
    recurrent = meta.get("attention.recurrent_layers")
    if recurrent is not None:  # the array also covers the MTP blocks after the trunk
        flags = meta.per_layer("attention.recurrent_layers", meta.integer("block_count"))
        cfg["layer_types"] = ["linear_attention" if r else "full_attention" for r in flags[:n]]
    else:
        cfg["full_attention_interval"] = meta.integer("full_attention_interval", 4)
    if meta.get("expert_count"):
        cfg.update(
            num_experts=meta.integer("expert_count"),
            num_experts_per_tok=meta.integer("expert_used_count"),
            moe_intermediate_size=meta.integer("expert_feed_forward_length"),
            shared_expert_intermediate_size=meta.integer("expert_shared_feed_forward_length", 0),
            norm_topk_prob=bool(meta.get("expert_weights_norm", True)),
        )
    return cfg


def _gguf_transform(hf_name: str, value: Value, meta: GGUFMetadata):
    """The converter's changes undone: norms stored +1 (all but the gated norm's), ssm_a as
    -exp(A_log), the conv kernel squeezed, in_proj_ba as one matrix (qwen3next), experts stacked,
    and (qwen35, qwen35moe) the value heads in llama.cpp's tiled order (head i of key head h at
    i * kh + h) rather than grouped by key head (h * r + i)."""
    kh, vh = meta.integer("ssm.group_count"), meta.integer("ssm.time_step_rank")
    dk, dv = meta.integer("ssm.state_size"), meta.integer("ssm.inner_size") // vh
    tiled = meta.arch != "qwen3next" and vh != kh
    grouped = torch.arange(vh).view(vh // kh, kh).t().reshape(-1)  # grouped head -> its tiled position
    heads = lambda width: (grouped[:, None] * width + torch.arange(width)).flatten()  # noqa: E731
    attn = ".linear_attn."
    if hf_name.endswith("norm.weight") and not hf_name.endswith(".linear_attn.norm.weight"):
        value = float_op(value, lambda t: t - 1.0)
    elif hf_name.endswith(attn + "A_log"):
        value = float_op(value, lambda t: torch.log(-t))
    elif hf_name.endswith(attn + "conv1d.weight"):
        value = reshaped(value, value.shape[0], 1, -1)
    elif hf_name.endswith("shared_expert_gate.weight") and len(value.shape) == 1:  # llama-quantize writes it 1-D
        value = value.reshape(1, -1)
    elif hf_name.endswith(attn + "in_proj_ba.weight"):  # per key head: its r b rows, then its r a rows
        r = vh // kh
        per_head = torch.arange(kh)[:, None] * 2 * r + torch.arange(r)
        yield hf_name.replace("in_proj_ba", "in_proj_b"), take_rows(value, per_head.flatten())
        yield hf_name.replace("in_proj_ba", "in_proj_a"), take_rows(value, (per_head + r).flatten())
        return
    elif ".experts." in hf_name:
        for e, expert in enumerate(experts(value, meta.integer("expert_count"))):
            yield hf_name.replace(".experts.", f".experts.{e}."), expert
        return
    if tiled and attn in hf_name:
        if hf_name.endswith("in_proj_qkv.weight") or hf_name.endswith("conv1d.weight"):
            value = take_rows(value, torch.cat((torch.arange(2 * kh * dk), 2 * kh * dk + heads(dv))))
        elif hf_name.endswith("in_proj_z.weight"):
            value = take_rows(value, heads(dv))
        elif hf_name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            value = take_rows(value, grouped)
        elif hf_name.endswith("out_proj.weight"):
            value = take_column_groups(value, grouped, dv)
    yield hf_name, value


_GGUF_NAMES = {
    **{k: v for k, v in ATTENTION_NAMES.items() if not k.endswith(".bias")},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    **{k: v for k, v in MLP_NAMES.items() if k != "ffn_norm.weight"},
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_GGUF = GGUFArch("Qwen3_5ForCausalLM", _gguf_config, _GGUF_NAMES, transform=_gguf_transform)
GGUF_ARCHS = {"qwen3next": _GGUF, "qwen35": _GGUF, "qwen35moe": _GGUF}
