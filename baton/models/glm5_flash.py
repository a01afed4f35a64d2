"""GLM-5.3-Flash (Glm5NextForConditionalGeneration, served as text; its vision tower is not read):
Kimi Delta Attention layers (a lower-bounded sigmoid forget gate) where i % 4 != 3, NoPE MLA with a
pooled sparse-attention indexer (baton/models/indexer.py) on the others, dense MLPs then
sigmoid-routed experts, SwiGLU clamped at `swiglu_limit`, and hyper-connections: the residual
stream is `hc_mult` copies of the hidden state, collapsed into each block's input and re-mixed
after it by per-token weights (pure per-token math, nothing cached), averaged before the final norm.

KV: each MLA layer's latents (a group of its own kind), its pooled indexer keys (layer ids after
the model's layers, a row per pool) and the raw [k | gate] rows of the open pool (state, layer ids
after those), so a chunk may end mid-pool and a rejected draft rolls back exactly."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from baton.kv.spec import LayerKind
from baton.models.fused_decode import DecodeBlock, StepBinding
from baton.models.glm4_moe import sparse_moe
from baton.models.kimi_linear import KimiDeltaAttention, kda_dims
from baton.models.layers import PackedLinear, RMSNorm, unwrapped
from baton.models.llama import ForwardContext, LlamaForCausalLM
from baton.models.mla import MLAttention
from baton.models.model_config import TextModelConfig
from baton.models.moe import MLP
from baton.models.weight_map import Part, PartsWeightMap, kda_parts
from baton.ops import hc_weights, ops

PREFIX = "model.language_model."


def layer_types(hf: dict[str, Any]) -> list[str]:
    """Each layer "linear_attention" (KDA) or "indexed_attention" (MLA + pooled indexer)."""
    n = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)]
    types = ["indexed_attention" if t == "full_attention" else t for t in types]
    if len(types) != n or any(t not in ("linear_attention", "indexed_attention") for t in types):
        raise ValueError(f"layer_types must name linear_attention or indexed_attention for each of the {n} layers")
    indexers = hf.get("indexer_types") or ["full"] * n
    if any(t == "indexed_attention" and indexers[i] != "full" for i, t in enumerate(types)):
        raise ValueError("every GLM-5.3-Flash MLA layer needs its own indexer (indexer_types 'full')")
    return types


def mla_layers(hf: dict[str, Any]) -> list[int]:
    return [i for i, t in enumerate(layer_types(hf)) if t == "indexed_attention"]


def pool_layers(hf: dict[str, Any], layer_id: int) -> tuple[int, int]:
    """(pooled keys, open-pool window): the cache layer ids of MLA layer `layer_id`'s indexer."""
    n, mla = int(hf["num_hidden_layers"]), mla_layers(hf)
    j = mla.index(layer_id)
    return n + j, n + len(mla) + j


def layer_kinds(hf: dict[str, Any]) -> list[LayerKind]:
    heads, dim, kernel = kda_dims(hf)
    recurrent = LayerKind.recurrent((3 * heads * dim, kernel - 1), (heads, dim, dim))
    mla = LayerKind.mla(int(hf.get("kv_lora_rank", 512)) + int(hf.get("qk_rope_head_dim") or 0))
    kinds = [recurrent if t == "linear_attention" else mla for t in layer_types(hf)]
    index_dim, pool = int(hf.get("index_head_dim", 128)), int(hf.get("index_kpool", 16))
    count = len(mla_layers(hf))
    kinds += [LayerKind.pooled(index_dim, pool)] * count
    if pool > 1:  # the open pool's raw rows: at most pool - 1
        kinds += [LayerKind.recurrent((pool - 1, 2 * index_dim))] * count
    return kinds


class HyperConnection(nn.Module):
    """From the streams [T, N, H]: `pre` collapses them into the block's input, `post` spreads the
    block's output over them, `comb` (doubly stochastic by Sinkhorn) mixes them into the next."""

    def __init__(self, cfg: TextModelConfig) -> None:
        super().__init__()
        hf = cfg.hf
        self.n = int(hf.get("hc_mult", 4))
        self.iters, self.eps = int(hf.get("hc_sinkhorn_iters", 20)), float(hf.get("hc_eps", 1e-6))
        if self.n < 1 or self.iters < 1:
            raise ValueError(f"hc_mult and hc_sinkhorn_iters must be >= 1, got {self.n} and {self.iters}")
        self.norm_eps = cfg.rms_norm_eps
        # a linear, so that it runs on the packed kernels: a row's bits then do not depend on the batch
        self.fn = nn.Linear(self.n * cfg.hidden_size, (2 + self.n) * self.n, bias=False)
        self.fn.keep_float = True  # feeds a Sinkhorn normalisation: never quantized
        self.base = nn.Parameter(torch.empty((2 + self.n) * self.n))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(post [T, N], comb [T, N, N], the block's input [T, H])."""
        flat = streams.reshape(streams.shape[0], -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        mixed = self.fn(flat.to(streams.dtype)).float()
        pre, post, comb = hc_weights(mixed, self.base.float(), self.scale.float(), self.n, self.iters, self.eps)
        return post, comb, (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

    def step_weights(self):
        """This hyper-connection as the fused decoder's blocks take it (ops().HyperWeights); None
        off the packed kernels."""
        if not isinstance(self.fn, PackedLinear):
            return None
        return ops().HyperWeights(
            fn=self.fn.packed,
            base=self.base.float().contiguous(),
            scale=self.scale.float().contiguous(),
            iters=self.iters,
            eps=self.eps,
            norm_eps=self.norm_eps,
        )

    @staticmethod
    def merge(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """The next streams: the block's output spread by post, plus the streams mixed by comb."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )


class FlashDecoderLayer(nn.Module):
    def __init__(self, cfg: TextModelConfig, layer_id: int) -> None:
        super().__init__()
        hf, h = cfg.hf, cfg.hidden_size
        limit = None if hf.get("swiglu_limit") is None else float(hf["swiglu_limit"])
        if layer_types(hf)[layer_id] == "linear_attention":
            bound = hf.get("linear_lower_bound")
            self.self_attn = KimiDeltaAttention(cfg, layer_id, None if bound is None else float(bound))
        else:
            pools = pool_layers(hf, layer_id)
            self.self_attn = MLAttention(
                cfg, layer_id, indexer="pooled", latent_eps=cfg.rms_norm_eps, pool_layers=pools
            )
        mlp_types = hf.get("mlp_layer_types") or ["dense"] * 3 + ["sparse"] * cfg.num_layers
        if mlp_types[layer_id] == "sparse":
            self.mlp = sparse_moe(cfg, limit)
        else:
            self.mlp = MLP(h, cfg.intermediate_size, limit)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def decode_blocks(self, binding: StepBinding) -> list[DecodeBlock] | None:
        """forward's blocks for the fused decoder (each with its hyper-connection), or None where a
        step cannot run there."""
        mixer, mlp = self.self_attn.decode_step(binding), unwrapped(self.mlp).decode_step(binding)
        attn_hc, ffn_hc = self.attn_hc.step_weights(), self.ffn_hc.step_weights()
        if mixer is None or mlp is None or attn_hc is None or ffn_hc is None:
            return None
        return [
            DecodeBlock(self.input_layernorm, mixer, hc=attn_hc),
            DecodeBlock(self.post_attention_layernorm, mlp, hc=ffn_hc),
        ]

    def forward(self, streams: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        post, comb, h = self.attn_hc(streams)
        streams = self.attn_hc.merge(post, comb, self.self_attn(self.input_layernorm(h), ctx), streams)
        post, comb, h = self.ffn_hc(streams)
        return self.ffn_hc.merge(post, comb, self.mlp(self.post_attention_layernorm(h)), streams)


class Glm5FlashForCausalLM(PartsWeightMap, LlamaForCausalLM):
    """The text model of a Glm5NextForConditionalGeneration checkpoint; its decode steps run as
    one call (FusedDecoding) over the layers' blocks and their hyper-connections."""

    layer_cls = FlashDecoderLayer
    layer_kinds_from = staticmethod(layer_kinds)

    def __init__(self, cfg: TextModelConfig) -> None:
        if cfg.hidden_act != "silu":
            raise ValueError(f"GLM-5.3-Flash supports hidden_act silu, got {cfg.hidden_act!r}")
        super().__init__(cfg)
        self.rotary = nn.ModuleDict()  # NoPE everywhere
        self.layer_kinds = []
        self.hc_mult = int(cfg.hf.get("hc_mult", 4))
        self.stage_stream_width = self.hc_mult * cfg.hidden_size  # what a pipeline stage hands on: the streams
        mtp = int(cfg.hf.get("num_nextn_predict_layers") or 0)
        self.skipped_weights = ("model.visual.", *(f"{PREFIX}layers.{cfg.num_layers + i}." for i in range(mtp)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed(input_ids)  # a later pipeline stage's input: the streams, flat
        one_token_rows = ctx.state_meta is None or all(s.q_end - s.q_start == 1 for s in ctx.state_meta.seqs)
        if ctx.decode_only and one_token_rows and self._fused_decoder_for(ctx.storage, ctx.states) is not None:
            return self.fused_decoder(x, {}, ctx)
        n, h = x.shape[0], self.cfg.hidden_size
        streams = (
            x.view(n, self.hc_mult, h) if x.shape[1] != h else x[:, None].expand(-1, self.hc_mult, -1).contiguous()
        )
        for layer in self.layers:
            streams = layer(streams, ctx)
        if not isinstance(self.norm, RMSNorm):  # a pipeline stage before the last hands on the streams
            return streams.reshape(n, -1)
        return self.norm(streams.mean(dim=1))

    def cache_layers(self, layers: range) -> list[int]:
        """The cache layer ids a pipeline stage of `layers` holds: theirs and their indexers'."""
        mla = set(mla_layers(self.cfg.hf))
        owned = [i for layer in layers if layer in mla for i in pool_layers(self.cfg.hf, layer)]
        return [*layers, *owned]

    # ---- weights: checkpoint names in, fused parameters out ------------------------------------
    _HC = {"attn_hc.": "hc_attn_", "ffn_hc.": "hc_ffn_"}

    def _hf_parts(self, name: str, shape: tuple[int, ...]) -> list[Part]:
        """The checkpoint tensors (name, first row in the parameter or None for all of it, shape)
        that parameter `name` is made of."""
        hf = name if name.startswith("lm_head.") else PREFIX + name
        for ours, theirs in self._HC.items():
            hf = hf.replace(ours, theirs)
        if hf.endswith(("hc_attn_fn.weight", "hc_ffn_fn.weight", "index_kpool_compress_gate.weight")):
            hf = hf.removesuffix(".weight")  # plain tensors there, linears here
        attn = getattr(self.layers[int(name.split(".")[1])], "self_attn", None) if name.startswith("layers.") else None
        kda = kda_parts(hf, shape, getattr(attn, "in_rows", None))
        if kda is not None:
            return kda
        if hf.endswith(".gate_up_proj.weight"):
            half = shape[0] // 2
            return [
                (hf.replace("gate_up_proj", p), i * half, (half, shape[1]))
                for i, p in enumerate(("gate_proj", "up_proj"))
            ]
        return [(hf, None, shape)]
