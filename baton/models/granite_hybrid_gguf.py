"""Granite-4.0-H's and Bamba's GGUF files (llama.cpp's granitehybrid), read as a GraniteMoeHybrid
checkpoint under the names baton reads from GGUF (GraniteMoeHybridForCausalLM.gguf_weight_shapes:
experts one by one, gate and up apart)."""

from __future__ import annotations

from typing import Any

from baton.models.gguf_arch import (
    ATTENTION_NAMES,
    MLP_NAMES,
    GGUFArch,
    GGUFMetadata,
    Value,
    attention_layers,
    base_config,
    each_expert,
    uniform,
)
from baton.models.llama import rope_rows_unpermuted
from baton.models.mamba2 import gguf_names, gguf_undone


def _gguf_config(meta: GGUFMetadata) -> dict[str, Any]:
    """A layer is Mamba2 exactly where its attention.head_count_kv is 0 (llama.cpp's rule), checked
    against the tensors its block holds; the multipliers from their *_scale keys (absent: none,
    and the attention scale llama.cpp's 1/sqrt(head_dim)); rotary where rope.scaling.finetuned."""
    cfg = base_config(meta, "GraniteMoeHybridForCausalLM")
    n = cfg["num_hidden_layers"]
    cfg["layer_types"] = ["attention" if a else "mamba" for a in attention_layers(meta, n, "ssm_in.weight")]
    uniform(meta, "attention.head_count_kv", n, "num_key_value_heads", cfg)
    heads, inner = meta.integer("ssm.time_step_rank"), meta.integer("ssm.inner_size")
    if heads < 1 or inner % heads:
        raise ValueError(f"{meta.where}: ssm.inner_size ({inner}) is not a multiple of ssm.time_step_rank ({heads})")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg.update(
        mamba_n_heads=heads,
        mamba_d_head=inner // heads,
        mamba_n_groups=meta.integer("ssm.group_count"),
        mamba_d_state=meta.integer("ssm.state_size"),
        mamba_d_conv=meta.integer("ssm.conv_kernel"),
        mamba_conv_bias=any(meta.block_has(i, "ssm_conv1d.bias") for i in range(n)),
        embedding_multiplier=meta.real("embedding_scale", 1.0) or 1.0,
        residual_multiplier=meta.real("residual_scale", 1.0) or 1.0,
        logits_scaling=meta.real("logit_scale", 1.0) or 1.0,
        attention_multiplier=meta.real("attention.scale", 0.0) or head_dim**-0.5,
        position_embedding_type="rope" if meta.get("rope.scaling.finetuned", True) else None,
    )
    rotary = meta.integer("rope.dimension_count", head_dim)
    if cfg["position_embedding_type"] == "rope" and rotary != head_dim:  # Bamba: half of each head
        if not 0 < rotary < head_dim or rotary % 2:
            raise ValueError(f"{meta.where}: rope.dimension_count {rotary} does not fit heads of {head_dim}")
        theta = cfg.get("rope_theta", 10_000.0)
        cfg["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": theta,
            "partial_rotary_factor": rotary / head_dim,
        }
    if meta.integer("expert_count", 0):
        cfg.update(
            num_local_experts=meta.integer("expert_count"),
            num_experts_per_tok=meta.integer("expert_used_count"),
            intermediate_size=meta.shapes["blk.0.ffn_down_exps.weight"][-1],
            shared_intermediate_size=meta.integer("expert_shared_feed_forward_length", 0),
        )
    else:
        dense = meta.shapes.get("blk.0.ffn_up.weight")
        if dense is None:
            raise ValueError(f"{meta.where}: block 0 holds neither experts nor an ffn_up.weight")
        cfg.update(num_local_experts=0, intermediate_size=dense[0], shared_intermediate_size=dense[0])
    return cfg


def _gguf_transform(hf_name: str, value: Value, meta: GGUFMetadata):
    """The converter's changes undone: q and k rows back from llama.cpp's interleaved-rope order
    (it permutes them whether or not the model uses rotary), the Mamba2 mixers'
    (mamba2.gguf_undone), experts one by one."""
    if ".experts." in hf_name:
        yield from each_expert(hf_name, value, meta)
        return
    value = rope_rows_unpermuted(hf_name, value, meta)
    yield hf_name, gguf_undone(hf_name.split(".mamba.", 1)[1], value) if ".mamba." in hf_name else value


_GGUF_NAMES = {
    **ATTENTION_NAMES,
    **MLP_NAMES,
    **gguf_names("mamba"),
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
GGUF_ARCHS = {
    "granitehybrid": GGUFArch("GraniteMoeHybridForCausalLM", _gguf_config, _GGUF_NAMES, transform=_gguf_transform)
}
