"""Random-weight hybrid models of each recurrent family, saved once under the cache as HF
directories (no checkpoint of these families fits this machine): the benchmark subjects."""

from __future__ import annotations

from pathlib import Path

_DSA = dict(  # the DeepSeek Sparse Attention families' shared shape, about 100M parameters
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    moe_intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    n_shared_experts=1,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    kv_lora_rank=128,
    q_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    index_topk=256,
    index_head_dim=64,
    index_n_heads=16,
    max_position_embeddings=8192,
    pad_token_id=0,
    tie_word_embeddings=False,
)

FAMILIES: dict[str, tuple[str, dict]] = {
    # Qwen3-Next-shaped, about 100M parameters: 6 Gated DeltaNet + 2 gated attention layers, MoE
    "qwen3-next-100m": (
        "Qwen3NextForCausalLM",
        dict(
            vocab_size=32000,
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=256,
            shared_expert_intermediate_size=512,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
        ),
    ),
    # Kimi-Linear-shaped: KDA layers beside MLA (every fourth), grouped sigmoid MoE
    "kimi-linear-100m": (
        "KimiLinearForCausalLM",
        dict(
            vocab_size=32000,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=8,
            q_lora_rank=None,
            kv_lora_rank=128,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            num_experts=16,
            num_experts_per_token=4,
            num_expert_group=4,
            topk_group=2,
            moe_renormalize=True,
            num_shared_experts=1,
            moe_intermediate_size=256,
            routed_scaling_factor=2.446,
            first_k_dense_replace=1,
            linear_attn_config={
                "full_attn_layers": [4, 8],
                "kda_layers": [1, 2, 3, 5, 6, 7],
                "num_heads": 8,
                "head_dim": 64,
                "short_conv_kernel_size": 4,
            },
            max_position_embeddings=8192,
            tie_word_embeddings=False,
        ),
    ),
    # Nemotron-H-shaped: Mamba2 layers, NoPE attention, relu2 MLP and MoE layers
    "nemotron-h-100m": (
        "NemotronHForCausalLM",
        dict(
            vocab_size=32000,
            hidden_size=512,
            hybrid_override_pattern="M-M*M-ME-M*ME",
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=1536,
            mamba_num_heads=16,
            mamba_head_dim=64,
            n_groups=4,
            ssm_state_size=64,
            conv_kernel=4,
            chunk_size=128,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            moe_intermediate_size=256,
            moe_shared_expert_intermediate_size=512,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
        ),
    ),
    # DeepSeek-V3.2-shaped: MLA with interleaved rotary and yarn, an indexer on every layer, MoE
    "deepseek-v32-100m": ("DeepseekV32ForCausalLM", dict(**_DSA, first_k_dense_replace=1)),
    # GLM-5-shaped: the same with the indexer's rotary interleaved and every other layer sharing
    "glm5-100m": ("GlmMoeDsaForCausalLM", dict(**_DSA, first_k_dense_replace=1, index_topk_freq=2)),
    # GLM-5.3-Flash-shaped: KDA (i % 4 != 3) beside NoPE MLA with a pooled indexer (kpool 16),
    # hyper-connections (4 streams), clamped SwiGLU; index_topk 1,024 as bench/dsa_attention.py asks
    "glm5-flash-100m": (
        "Glm5NextForConditionalGeneration",
        dict(
            text_config=dict(
                vocab_size=32000,
                hidden_size=512,
                intermediate_size=1408,
                moe_intermediate_size=256,
                num_hidden_layers=8,
                num_attention_heads=8,
                num_key_value_heads=8,
                n_shared_experts=1,
                n_routed_experts=16,
                num_experts_per_tok=4,
                kv_lora_rank=256,
                q_lora_rank=256,
                qk_rope_head_dim=0,
                qk_nope_head_dim=64,
                v_head_dim=64,
                index_topk=1024,
                index_head_dim=64,
                index_n_heads=16,
                index_kpool=16,
                linear_num_heads=8,
                linear_head_dim=64,
                hc_mult=4,
                pad_token_id=0,
                mlp_layer_types=["dense"] + ["sparse"] * 7,
                max_position_embeddings=32768,
                tie_word_embeddings=False,
            ),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=512),
        ),
    ),
}


def build(cache: Path, name: str) -> Path:
    """The saved model directory for `name`, built (seeded) on first use."""
    out = cache / "bench" / name
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    arch, config = FAMILIES[name]
    torch.manual_seed(0)
    model_cls = getattr(transformers, arch)
    model = model_cls(model_cls.config_class(**config)).eval()
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters", flush=True)
    model.save_pretrained(out)
    return out
