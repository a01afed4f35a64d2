"""GLM-4.5-style MoE (Glm4MoeForCausalLM): Llama-shaped attention with q/k/v biases, optional q/k
norm and partial rotary; dense MLPs in the first `first_k_dense_replace` layers, DeepSeek-style
sigmoid-routed experts with a shared expert after; and `num_nextn_predict_layers` multi-token
prediction (MTP) layers, the drafter of speculative decoding.

An MTP layer at position q reads the target's final hidden state at q - 1 and the embedding of
the token at q (both normed, concatenated, projected), runs one decoder layer over its own KV
and predicts the token at q + 1 through the target's lm_head. Its KV is one more full-attention
layer of the KV spec (layer id num_hidden_layers + i): its slot q depends only on tokens up to q,
so it is cached, shared and handed off with the block that holds position q, like any layer's.
Slot 0 holds nothing (no hidden state precedes position 0): MTP queries read from position 1.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from baton.kv.spec import LayerKind
from baton.kv.storage import KVStorage
from baton.models.fused_decode import DecodeBlock, FusedDecoder, StepBinding, mixer_mlp_blocks
from baton.models.layers import RMSNorm, paged_attention, unwrapped
from baton.models.llama import Attention, ForwardContext, GatedMLP, LlamaForCausalLM
from baton.models.model_config import TextModelConfig
from baton.models.moe import GroupedSigmoidMoE
from baton.models.qwen3_next import partial_rotary
from baton.models.rope import Rotary


def num_mtp_layers(hf: dict[str, Any]) -> int:
    return int(hf.get("num_nextn_predict_layers") or hf.get("num_mtp_layers") or 0)


def layer_kinds(hf: dict[str, Any]) -> list[LayerKind]:
    """Every layer is full attention, the MTP layers' KV included (after the main layers)."""
    return [LayerKind.full()] * (int(hf["num_hidden_layers"]) + num_mtp_layers(hf))


class GlmAttention(Attention):
    """Llama's attention without an o_proj bias, with q/k norm by `use_qk_norm`, partial rotary."""

    partial_rotary = True

    def __init__(self, cfg: TextModelConfig, layer_id: int) -> None:
        super().__init__(cfg, layer_id)
        self.o_proj = nn.Linear(self.sizes[0], cfg.hidden_size, bias=False)
        qk_norm = bool(cfg.hf.get("use_qk_norm", False))
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        q_size, kv_size, _ = self.sizes
        qkv = self.qkv_proj(x)
        q = qkv[:, :q_size].reshape(n, self.num_heads, d)
        k = qkv[:, q_size : q_size + kv_size].reshape(n, self.num_kv_heads, d)
        v = qkv[:, q_size + kv_size :].reshape(n, self.num_kv_heads, d)
        if self.q_norm is not None:
            self.q_norm.heads_(q)
            self.k_norm.heads_(k)
        q, k = partial_rotary(q, *rope), partial_rotary(k, *rope)
        cache, meta = ctx.for_layer(self.layer_id)
        return self.o_proj(paged_attention(q, k, v, cache, meta, self.scale).reshape(n, -1))


def sparse_moe(cfg: TextModelConfig, swiglu_limit: float | None = None) -> GroupedSigmoidMoE:
    """DeepSeek-V3-style experts as GLM-4.5, DeepSeek-V3.2, GLM-5 and GLM-5.3-Flash (which clamps
    its SwiGLU at `swiglu_limit`) configure them."""
    hf = cfg.hf
    size = int(hf["moe_intermediate_size"])
    return GroupedSigmoidMoE(
        cfg.hidden_size,
        size,
        size * int(hf.get("n_shared_experts") or 0),
        swiglu_limit=swiglu_limit,
        num_experts=int(hf["n_routed_experts"]),
        top_k=int(hf["num_experts_per_tok"]),
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
    )


class Glm4MoeDecoderLayer(nn.Module):
    def __init__(self, cfg: TextModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = GlmAttention(cfg, layer_id)
        dense = layer_id < int(cfg.hf.get("first_k_dense_replace", 1))  # MTP layers are always sparse
        self.mlp = GatedMLP(cfg) if dense else sparse_moe(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: dict, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.pre_norm(x, residual)
        h = self.self_attn(h, rope=rope["full"], ctx=ctx)
        return self.mlp(self.post_attention_layernorm(h, residual)), residual

    def decode_blocks(self, binding: StepBinding) -> list[DecodeBlock] | None:
        """forward's blocks for the fused decoder, or None where a step cannot run there."""
        attn, mlp = self.self_attn.decode_step(binding), unwrapped(self.mlp).decode_step(binding)
        return mixer_mlp_blocks(self.input_layernorm, attn, self.post_attention_layernorm, mlp)


class MtpLayer(nn.Module):
    """norm(embedding) and norm(previous hidden) -> eh_proj -> a decoder layer -> shared_head.norm."""

    def __init__(self, cfg: TextModelConfig, layer_id: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = Glm4MoeDecoderLayer(cfg, layer_id)
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)

    def block_input(self, embeds: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(previous)), dim=-1))

    def forward(self, embeds: torch.Tensor, previous: torch.Tensor, rope: dict, ctx: ForwardContext) -> torch.Tensor:
        out, residual = self.block(self.block_input(embeds, previous), None, rope, ctx)
        return self.post_norm(out + residual)


class Glm4MoeForCausalLM(LlamaForCausalLM):
    layer_cls = Glm4MoeDecoderLayer
    layer_kinds_from = staticmethod(layer_kinds)
    mtp_drafts = True  # a subclass whose checkpoints' MTP layers no reference runs: False, they are not read

    def __init__(self, cfg: TextModelConfig) -> None:
        if cfg.hidden_act != "silu":
            raise ValueError(f"GLM-4 MoE supports hidden_act silu, got {cfg.hidden_act!r}")
        super().__init__(cfg)
        rope = cfg.rope["full"]
        self.rotary = nn.ModuleDict({"full": Rotary(rope, int(cfg.head_dim * rope.partial_rotary_factor))})
        self.layer_kinds = ["full"]
        mtp_layers = num_mtp_layers(cfg.hf)
        self.mtp = nn.ModuleList(
            [MtpLayer(cfg, cfg.num_layers + i) for i in range(mtp_layers if self.mtp_drafts else 0)]
        )
        self.skipped_weights = (
            () if self.mtp_drafts else tuple(f"model.layers.{cfg.num_layers + i}." for i in range(mtp_layers))
        )
        self._mtp_decoders_for: KVStorage | None = None  # the storage _mtp_decoders were built over
        self._mtp_decoders: dict[int, FusedDecoder | None] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The final (normed) hidden state of every row: the logits' input, and the MTP layers'."""
        x = self.embed(input_ids)
        rope = {"full": self.rotary["full"](positions, x.dtype)}
        if ctx.decode_only and self._fused_decoder_for(ctx.storage) is not None:
            return self.fused_decoder(x, rope, ctx)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, ctx)
        return self.norm(x, residual)

    def mtp_forward(
        self, layer: int, input_ids: torch.Tensor, previous: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """MTP layer `layer` on rows at `positions` (each with its token and the hidden state of the
        position before it); its hidden states, the lm_head's input for the token after each row."""
        embeds = self.embed(input_ids)
        rope = {"full": self.rotary["full"](positions, embeds.dtype)}
        mtp, decoder = self.mtp[layer], self._mtp_decoder_for(layer, ctx.storage)
        if decoder is None:
            return mtp(embeds, previous, rope, ctx)
        return decoder(mtp.block_input(embeds, previous), rope, ctx)  # its rows are decodes: one C++ call

    def _mtp_decoder_for(self, layer: int, storage: KVStorage) -> FusedDecoder | None:
        """MTP layer `layer`'s block as a fused decoder, shared_head.norm its final norm; built on
        first use, None where it cannot run there or fused decode is off."""
        if not self.fused_decode:
            return None
        if self._mtp_decoders_for is not storage:
            self._mtp_decoders_for, self._mtp_decoders = storage, {}
        if layer not in self._mtp_decoders:
            mtp = self.mtp[layer]
            build = FusedDecoder.build
            self._mtp_decoders[layer] = build(self, storage, None, mtp.post_norm, self.fused_rope_dims(), [mtp.block])
        return self._mtp_decoders[layer]

    # ---- weights: HF names in, fused parameters out --------------------------------------------
    _FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    # GLM-4.5 checkpoints give each MTP layer its own copies of the embedding and the head; the
    # target's are used (as transformers and vLLM do), these are read past
    _MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")

    def _hf_name(self, name: str) -> str:
        """Parameter name -> checkpoint name (MTP layer i is checkpoint layer num_hidden_layers + i)."""
        if name.startswith("lm_head."):
            return name
        if name.startswith("mtp."):
            i, rest = name.split(".", 2)[1:]
            rest = rest.removeprefix("block.").replace("post_norm.", "shared_head.norm.")
            return f"model.layers.{self.cfg.num_layers + int(i)}.{rest}"
        return f"model.{name}"

    def _parts(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, int, tuple[int, ...]]]:
        """(checkpoint name, first row in the parameter, shape) of each part of parameter `name`."""
        hf = self._hf_name(name)
        fused = next((f for f in self._FUSED if f".{f}." in hf), None)
        if fused is None:
            return [(hf, 0, shape)]
        rows = list(self._attention_of(name).sizes) if fused == "qkv_proj" else [shape[0] // 2] * 2
        starts = [sum(rows[:i]) for i in range(len(rows))]
        return [(hf.replace(fused, p), s, (r, *shape[1:])) for p, s, r in zip(self._FUSED[fused], starts, rows)]

    def _attention_of(self, name: str) -> GlmAttention:
        module = self.get_submodule(name.rsplit(".", 2)[0])
        assert isinstance(module, GlmAttention)
        return module

    def _weight_map(self) -> dict[str, tuple[str, int, tuple[int, ...]]]:
        if getattr(self, "_weights", None) is None:
            self._weights = {
                hf: (name, start, shape)
                for name, p in self.named_parameters()
                if not name.startswith("lm_head.") or self.lm_head is not None
                for hf, start, shape in self._parts(name, tuple(p.shape))
            }
        return self._weights

    def hf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {hf: shape for hf, (_, _, shape) in self._weight_map().items()}
        vocab = (self.cfg.vocab_size, self.cfg.hidden_size)
        for i in range(len(self.mtp)):
            for copy in self._MTP_COPIES:
                shapes[f"model.layers.{self.cfg.num_layers + i}.{copy}"] = vocab
        return shapes

    def load_weight(self, hf_name: str, tensor) -> None:
        if hf_name.endswith(self._MTP_COPIES) and hf_name not in self._weight_map():
            return
        name, start, shape = self._weight_map()[hf_name]
        param = self.get_parameter(name).data
        param[start : start + shape[0]].copy_(tensor)
