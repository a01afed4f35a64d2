"""Gemma3 text: per-layer sliding/full attention, a rope base per kind, sandwich norms,
(1 + w) RMS norms, a scaled embedding, q/k norm, tied embeddings."""

from __future__ import annotations

import torch
from torch import nn

from baton.models.fused_decode import DecodeBlock, StepBinding, mixer_mlp_blocks
from baton.models.gguf_arch import ATTENTION_NAMES, MLP_NAMES, GGUFArch, GGUFMetadata, Value, float_op
from baton.models.layers import RMSNorm, unwrapped
from baton.models.llama import Attention, ForwardContext, GatedMLP, LlamaForCausalLM, llama_gguf_config
from baton.models.model_config import TextModelConfig


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: TextModelConfig, layer_id: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = Attention(cfg, layer_id, norm_offset=1.0)
        self.mlp = GatedMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, 1.0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, 1.0)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, 1.0)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, 1.0)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: dict, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sandwich norms: the stream takes post_attention_layernorm(attn) and
        post_feedforward_layernorm(mlp); the latter is added by the next layer's input norm."""
        h, residual = self.input_layernorm.pre_norm(x, residual)
        h = self.self_attn(h, rope[self.self_attn.kind], ctx)
        h = self.mlp(self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual))
        return self.post_feedforward_layernorm(h), residual

    def decode_blocks(self, binding: StepBinding) -> list[DecodeBlock] | None:
        """forward's blocks for the fused decoder (sandwich norms), or None where a step cannot run there."""
        attn, mlp = self.self_attn.decode_step(binding), unwrapped(self.mlp).decode_step(binding)
        return mixer_mlp_blocks(
            self.input_layernorm,
            attn,
            self.pre_feedforward_layernorm,
            mlp,
            post_mixer_norm=self.post_attention_layernorm,
            post_mlp_norm=self.post_feedforward_layernorm,
        )


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_cls = Gemma3DecoderLayer
    norm_offset = 1.0

    def __init__(self, cfg: TextModelConfig) -> None:
        super().__init__(cfg)
        self.embed_scale = cfg.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)


def _gemma3_norms(hf_name: str, value: Value, meta: GGUFMetadata):
    """llama.cpp stores Gemma's (1 + w) norm weights with the 1 added."""
    yield hf_name, float_op(value, lambda t: t - 1.0) if hf_name.endswith("norm.weight") else value


GGUF_ARCHS = {
    "gemma3": GGUFArch(
        "Gemma3ForCausalLM",
        lambda meta: llama_gguf_config(meta, "Gemma3ForCausalLM"),
        {
            **ATTENTION_NAMES,
            **MLP_NAMES,
            "ffn_norm.weight": "pre_feedforward_layernorm.weight",  # sandwich norms: ffn_norm is the pre-MLP one
            "post_attention_norm.weight": "post_attention_layernorm.weight",
            "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        },
        transform=_gemma3_norms,
    )
}
