"""Kimi Linear's GGUF files (llama.cpp's kimi-linear), read as a KimiLinear checkpoint under the names
baton reads from GGUF (KimiLinearForCausalLM.gguf_weight_shapes: each MLA layer's kv_b_proj as the
k_b and v_b the converter splits it into)."""

from __future__ import annotations

from typing import Any

import torch

from baton.models.gguf_arch import (
    GGUFArch,
    GGUFMetadata,
    Value,
    attention_layers,
    base_config,
    each_expert,
    float_op,
    reshaped,
)


def _gguf_config(meta: GGUFMetadata) -> dict[str, Any]:
    """A layer is MLA where its attention.head_count_kv is 1 (llama.cpp's MQA view of the latent),
    KDA where 0; the KDA head count is its ssm_beta's rows (the file does not say it); llama.cpp
    always renormalises the routed weights and routes by sigmoid, the only gating it reads here."""
    cfg = base_config(meta, "KimiLinearForCausalLM")
    cfg.pop("head_dim", None)  # attention.key_length is the latent's width here, not a head's
    n = cfg["num_hidden_layers"]
    mla = attention_layers(meta, n, "ssm_beta.weight", "attn_kv_a_mqa.weight")
    kda = next((i for i, m in enumerate(mla) if not m), None)
    gating = meta.integer("expert_gating_func", 2)
    if gating != 2:
        raise ValueError(f"{meta.where}: expert_gating_func {gating} is not sigmoid (2), which Kimi Linear routes by")
    rope = meta.integer("rope.dimension_count", 0)
    key_mla = meta.integer("attention.key_length_mla")
    if key_mla <= rope:
        raise ValueError(f"{meta.where}: attention.key_length_mla ({key_mla}) leaves no room beside rope ({rope})")
    head_dim = meta.integer("kda.head_dim")
    cfg.update(
        layer_types=["full_attention" if m else "linear_attention" for m in mla],
        num_key_value_heads=cfg["num_attention_heads"],
        intermediate_size=meta.integer("feed_forward_length"),
        hidden_act="silu",
        kv_lora_rank=meta.integer("attention.kv_lora_rank"),
        q_lora_rank=meta.integer("attention.q_lora_rank", 0) or None,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=key_mla - rope,
        v_head_dim=meta.integer("attention.value_length_mla"),
        linear_attn_config={
            "num_heads": meta.shapes[f"blk.{kda}.ssm_beta.weight"][0] if kda is not None else 1,
            "head_dim": head_dim,
            "short_conv_kernel_size": meta.integer("ssm.conv_kernel"),
        },
        tie_word_embeddings=False,
    )
    if meta.integer("expert_count", 0):
        cfg.update(
            num_experts=meta.integer("expert_count"),
            num_experts_per_token=meta.integer("expert_used_count"),
            moe_intermediate_size=meta.integer("expert_feed_forward_length"),
            num_shared_experts=meta.integer("expert_shared_count", 0),
            first_k_dense_replace=meta.integer("leading_dense_block_count", 0),
            routed_scaling_factor=meta.real("expert_weights_scale", 1.0) or 1.0,
            num_expert_group=meta.integer("expert_group_count", 1) or 1,
            topk_group=meta.integer("expert_group_used_count", 1) or 1,
            moe_renormalize=bool(meta.get("expert_weights_norm", True)),
        )
    else:
        cfg["first_k_dense_replace"] = n
    return cfg


def _gguf_transform(hf_name: str, value: Value, meta: GGUFMetadata):
    """The converter's changes undone: ssm_a stored as -exp(A_log), the conv kernels as
    [1, C, 1, K], experts stacked, kv_b split per head into k_b [H, R, dn] (transposed) and
    v_b [H, dv, R] (each read as rows of kv_b; dequantized, as kv_b_proj stays float)."""
    if ".experts." in hf_name:
        yield from each_expert(hf_name, value, meta)
        return
    heads, rank = meta.integer("attention.head_count"), meta.integer("attention.kv_lora_rank")
    if hf_name.endswith(".A_log"):
        value = float_op(value, lambda t: torch.log(-t).reshape(1, 1, -1, 1))
    elif hf_name.endswith("_conv1d.weight"):
        value = reshaped(value, -1, 1, value.shape[-1])
    elif hf_name.endswith(".kv_b_proj.k_b"):
        value = float_op(value, lambda t: t.reshape(heads, rank, -1).transpose(1, 2).reshape(-1, rank))
    elif hf_name.endswith(".kv_b_proj.v_b"):
        value = float_op(value, lambda t: t.reshape(-1, rank))
    yield hf_name, value


_MOE = "block_sparse_moe."
_GGUF_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ssm_conv1d_q.weight": "self_attn.q_conv1d.weight",
    "ssm_conv1d_k.weight": "self_attn.k_conv1d.weight",
    "ssm_conv1d_v.weight": "self_attn.v_conv1d.weight",
    "ssm_f_a.weight": "self_attn.f_a_proj.weight",
    "ssm_f_b.weight": "self_attn.f_b_proj.weight",
    "ssm_g_a.weight": "self_attn.g_a_proj.weight",
    "ssm_g_b.weight": "self_attn.g_b_proj.weight",
    "ssm_beta.weight": "self_attn.b_proj.weight",
    "ssm_a": "self_attn.A_log",
    "ssm_dt.bias": "self_attn.dt_bias",
    "ssm_norm.weight": "self_attn.o_norm.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_k_b.weight": "self_attn.kv_b_proj.k_b",
    "attn_v_b.weight": "self_attn.kv_b_proj.v_b",
    "ffn_gate.weight": _MOE + "gate_proj.weight",
    "ffn_up.weight": _MOE + "up_proj.weight",
    "ffn_down.weight": _MOE + "down_proj.weight",
    "ffn_gate_inp.weight": _MOE + "gate.weight",
    "exp_probs_b.bias": _MOE + "gate.e_score_correction_bias",
    "ffn_gate_exps.weight": _MOE + "experts.w1.weight",
    "ffn_up_exps.weight": _MOE + "experts.w3.weight",
    "ffn_down_exps.weight": _MOE + "experts.w2.weight",
    "ffn_gate_shexp.weight": _MOE + "shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": _MOE + "shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": _MOE + "shared_experts.down_proj.weight",
}
GGUF_ARCHS = {"kimi-linear": GGUFArch("KimiLinearForCausalLM", _gguf_config, _GGUF_NAMES, transform=_gguf_transform)}
