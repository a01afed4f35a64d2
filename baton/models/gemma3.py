"""Gemma3 text: per-layer sliding/full attention, a rope base per kind, sandwich norms,
(1 + w) RMS norms, a scaled embedding, q/k norm, tied embeddings."""

from __future__ import annotations

import torch
from torch import nn

from baton.models.layers import RMSNorm
from baton.models.llama import Attention, ForwardContext, GatedMLP, LlamaForCausalLM
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

    def forward(self, x: torch.Tensor, rope: dict, ctx: ForwardContext) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), rope[self.self_attn.kind], ctx)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_cls = Gemma3DecoderLayer
    norm_offset = 1.0

    def __init__(self, cfg: TextModelConfig) -> None:
        super().__init__(cfg)
        self.embed_scale = cfg.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)
