"""Nemotron-H's GGUF files (llama.cpp's nemotron_h and nemotron_h_moe), read as a NemotronH
checkpoint."""

from __future__ import annotations

from typing import Any

from baton.models.gguf_arch import (
    ATTENTION_NAMES,
    GGUFArch,
    GGUFMetadata,
    Value,
    base_config,
    each_expert,
    uniform,
)
from baton.models.mamba2 import gguf_names, gguf_undone


def _gguf_config(meta: GGUFMetadata) -> dict[str, Any]:
    """Each layer's mixer from the tensors its block holds (today's converter writes every
    Nemotron-H as nemotron_h_moe and leaves a dense MLP layer's feed_forward_length 0), checked
    against the per-layer KV heads: attention exactly where there are some."""
    cfg = base_config(meta, "NemotronHForCausalLM")
    n = cfg["num_hidden_layers"]
    kv = meta.per_layer("attention.head_count_kv", meta.integer("block_count"))[:n]
    meta.per_layer("feed_forward_length", meta.integer("block_count"))
    pattern = ""
    for i in range(n):
        kind = next((k for k, t in _MIXER_TENSORS.items() if meta.block_has(i, t)), None)
        if kind is None or (kind == "*") != bool(kv[i]):
            raise ValueError(
                f"{meta.where}: block {i} holds no mixer baton knows, or its tensors disagree with "
                f"attention.head_count_kv ({kv[i]})"
            )
        pattern += kind
    cfg["hybrid_override_pattern"] = pattern
    uniform(meta, "attention.head_count_kv", n, "num_key_value_heads", cfg)
    mlp = [i for i, kind in enumerate(pattern) if kind == "-"]
    cfg["intermediate_size"] = meta.per_layer("feed_forward_length", meta.integer("block_count"))[mlp[0]] if mlp else 0
    if mlp and not cfg["intermediate_size"]:  # the converter's 0: the matrix says
        cfg["intermediate_size"] = meta.shapes[f"blk.{mlp[0]}.ffn_up.weight"][0]
    heads = meta.integer("ssm.time_step_rank")
    inner = meta.integer("ssm.inner_size")
    if heads < 1 or inner % heads:
        raise ValueError(f"{meta.where}: ssm.inner_size ({inner}) is not a multiple of ssm.time_step_rank ({heads})")
    cfg.update(
        layer_norm_epsilon=meta.real("attention.layer_norm_epsilon", meta.get("attention.layer_norm_rms_epsilon")),
        mamba_num_heads=heads,
        mamba_head_dim=inner // heads,
        n_groups=meta.integer("ssm.group_count"),
        ssm_state_size=meta.integer("ssm.state_size"),
        conv_kernel=meta.integer("ssm.conv_kernel"),
        # the file keeps no dt floor (llama.cpp applies none): transformers' default, which the
        # checkpoints it was converted from clamp at
        time_step_min=0.001,
    )
    if "E" in pattern:
        if meta.get("moe_latent_size"):
            raise ValueError(f"{meta.where}: latent MoE layers (moe_latent_size) are not read from GGUF yet")
        cfg.update(
            n_routed_experts=meta.integer("expert_count"),
            num_experts_per_tok=meta.integer("expert_used_count"),
            moe_intermediate_size=meta.integer("expert_feed_forward_length"),
            moe_shared_expert_intermediate_size=meta.integer("expert_shared_feed_forward_length", 0),
            n_group=meta.integer("expert_group_count", 1),
            topk_group=meta.integer("expert_group_used_count", 1),
            norm_topk_prob=bool(meta.get("expert_weights_norm", True)),
            routed_scaling_factor=meta.real("expert_weights_scale", 1.0),
        )
    return cfg


_MIXER_TENSORS = {"M": "ssm_in.weight", "*": "attn_q.weight", "E": "ffn_gate_inp.weight", "-": "ffn_up.weight"}


def _gguf_transform(hf_name: str, value: Value, meta: GGUFMetadata):
    """The converter's changes undone: the Mamba2 mixers' (mamba2.gguf_undone), experts stacked."""
    if ".experts." in hf_name:
        yield from each_expert(hf_name, value, meta)
        return
    yield hf_name, gguf_undone(hf_name.split(".mixer.", 1)[-1], value)


_GGUF_NAMES = {
    "attn_norm.weight": "norm.weight",
    **{
        k: v.replace("self_attn.", "mixer.")
        for k, v in ATTENTION_NAMES.items()
        if k.startswith("attn_") and "norm" not in k
    },
    "ffn_up.weight": "mixer.up_proj.weight",
    "ffn_down.weight": "mixer.down_proj.weight",
    **gguf_names("mixer"),
    "ffn_gate_inp.weight": "mixer.gate.weight",
    "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "ffn_up_exps.weight": "mixer.experts.up_proj.weight",
    "ffn_down_exps.weight": "mixer.experts.down_proj.weight",
    "ffn_up_shexp.weight": "mixer.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mixer.shared_experts.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "backbone.embeddings.weight",
    "output_norm.weight": "backbone.norm_f.weight",
    "output.weight": "lm_head.weight",
}
GGUF_ARCHS = {
    arch: GGUFArch(
        "NemotronHForCausalLM",
        _gguf_config,
        _GGUF_NAMES,
        _GLOBAL_NAMES,
        layer_prefix="backbone.layers",
        transform=_gguf_transform,
    )
    for arch in ("nemotron_h", "nemotron_h_moe")
}
