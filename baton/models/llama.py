"""Llama and its close relatives: Mistral (sliding window), Qwen2 (qkv bias), Qwen3 (q/k norm)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from baton.kv.state import StateStorage
from baton.kv.storage import KVStorage, LayerKV
from baton.models.fused_decode import (
    DecodeBlock,
    FusedDecoding,
    StepBinding,
    attention_step,
    gated_mlp_step,
    mixer_mlp_blocks,
)
from baton.models.gguf_arch import (
    ATTENTION_NAMES,
    MLP_NAMES,
    GGUFArch,
    GGUFMetadata,
    Value,
    base_config,
    take_rows,
)
from baton.models.gguf_blocks import BlockTensor, BlockWeight
from baton.models.layers import (
    GroupAttnMetadata,
    PackedLinear,
    RMSNorm,
    StackedLinear,
    embedding,
    gated_activation,
    keep_blocks_for,
    pack_model,
    paged_attention,
    unwrapped,
)
from baton.models.model_config import TextModelConfig
from baton.models.recurrent import StateMetadata
from baton.models.rope import Rotary, apply_rotary
from baton.models.weight_map import BlockRows


@dataclass
class ForwardContext:
    storage: KVStorage
    groups: list[GroupAttnMetadata]
    states: StateStorage | None = None  # recurrent layers' running slots and checkpoints
    state_meta: StateMetadata | None = None
    # the keys the last sparse-attention indexer selected this step, for the layers that share them (GLM-5)
    selection: dict = field(default_factory=dict)

    def for_layer(self, layer_id: int) -> tuple[LayerKV, GroupAttnMetadata]:
        return self.storage.layer_kv(layer_id), self.groups[self.storage.spec.layer_to_group[layer_id][0]]

    @property
    def decode_only(self) -> bool:
        return all(not g.prefills for g in self.groups)


class Attention(nn.Module):
    """Fused qkv projection (one matmul instead of three), optional q/k norm, paged KV."""

    partial_rotary = False  # rotary over whole heads by baton's op (a subclass: the first channels, as torch ops)

    def __init__(self, cfg: TextModelConfig, layer_id: int, norm_offset: float = 0.0) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        o_bias = cfg.attention_bias and cfg.architecture != "Qwen2ForCausalLM"
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, norm_offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, norm_offset) if cfg.qk_norm else None
        self.kind = cfg.layer_kinds[layer_id].name
        self.scale = cfg.attn_scale

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, ctx: ForwardContext
    ) -> torch.Tensor:
        """rope: the rows' cos and signed sin; None: no positional encoding (Granite-4.0-H)."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size, _ = self.sizes
        v = qkv[:, q_size + kv_size :].view(n, self.num_kv_heads, self.head_dim)
        qk = qkv[:, : q_size + kv_size].view(n, -1, self.head_dim)  # q heads then k heads
        if self.q_norm is not None:
            self.q_norm.heads_(qk[:, : self.num_heads])
            self.k_norm.heads_(qk[:, self.num_heads :])
        qk = qk.contiguous() if rope is None else apply_rotary(qk, *rope)  # q and k heads in one pass
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        cache, meta = ctx.for_layer(self.layer_id)
        out = paged_attention(q, k, v, cache, meta, self.scale)
        return self.o_proj(out.reshape(n, -1))

    def decode_step(self, binding: StepBinding):
        """This attention as a fused decoder's step; None off the packed kernels."""
        if not isinstance(self.qkv_proj, (PackedLinear, StackedLinear)):
            return None
        return attention_step(self, binding, self.qkv_proj.parts(), rope=self.kind, torch_rotary=self.partial_rotary)


class GatedMLP(nn.Module):
    def __init__(self, cfg: TextModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_activation(self.gate_up_proj(x), self.gelu))

    def decode_step(self, binding: StepBinding):
        return gated_mlp_step(self.gate_up_proj, self.down_proj, self.gelu)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: TextModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = GatedMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: dict, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream (the embedding
        itself at the first layer, residual None). Returns this layer's output and the stream."""
        h, residual = self.input_layernorm.pre_norm(x, residual)
        h = self.self_attn(h, rope[self.self_attn.kind], ctx)
        return self.mlp(self.post_attention_layernorm(h, residual)), residual

    def decode_blocks(self, binding: StepBinding) -> list[DecodeBlock] | None:
        """forward's blocks for the fused decoder, or None where a step cannot run there."""
        attn, mlp = self.self_attn.decode_step(binding), unwrapped(self.mlp).decode_step(binding)
        return mixer_mlp_blocks(self.input_layernorm, attn, self.post_attention_layernorm, mlp)


class LlamaForCausalLM(FusedDecoding, nn.Module):
    """Also serves Mistral, Qwen2 and Qwen3: their differences are config flags."""

    layer_cls = LlamaDecoderLayer
    norm_offset = 0.0

    def __init__(self, cfg: TextModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([self.layer_cls(cfg, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.norm_offset)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = nn.ModuleDict({kind: Rotary(rope, cfg.head_dim) for kind, rope in cfg.rope.items()})
        self.layer_kinds = [k for k in dict.fromkeys(kind.name for kind in cfg.layer_kinds) if k in self.rotary]
        self.fused_decode = True  # decode-only steps as one C++ call where every layer has its steps
        self.block_weights: dict[str, BlockWeight] = {}  # weights kept in GGUF blocks, by parameter name
        self.block_rows = BlockRows(self, self.block_weights)  # fused projections' parts so far
        self.requires_grad_(False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed(input_ids)
        rope = {kind: self.rotary[kind](positions, x.dtype) for kind in self.layer_kinds}
        # a recurrent hybrid's rows must each be one token too (a verified draft's are not)
        one_token_rows = ctx.state_meta is None or all(s.q_end - s.q_start == 1 for s in ctx.state_meta.seqs)
        if ctx.decode_only and one_token_rows and self._fused_decoder_for(ctx.storage, ctx.states) is not None:
            return self.fused_decoder(x, rope, ctx)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, ctx)
        return self.norm(x, residual)

    def fused_final_norm(self) -> RMSNorm | None:
        return self.norm if isinstance(self.norm, RMSNorm) else None  # a pipeline stage before the last: none

    def fused_rope_dims(self) -> dict[str, int]:
        return {kind: self.rotary[kind].inv_freq.numel() * 2 for kind in self.layer_kinds}

    def pack_linears(self, quantization: str | None = None) -> None:
        """Run the projections and the lm_head on baton's packed kernels (after loading): in the GGUF
        formats the checkpoint shipped them in, else quantized into `quantization`, else float32."""
        pack_model(self, "embed_tokens", self.block_weights, quantization)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(hidden)
        if self.cfg.final_logit_softcapping:
            cap = self.cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ---- weights: HF names in, fused parameters out --------------------------------------------
    _UNFUSED = {
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    }

    def _shard_rows(self, fused: str, param: str) -> list[int]:
        """The rows each checkpoint part of fused parameter `param` takes, in order."""
        if fused.endswith("qkv_proj"):  # the layer's own: a hybrid's first layer may have no attention
            return list(self.layers[int(param.split(".")[1])].self_attn.sizes)
        return [self.get_parameter(param).shape[0] // 2] * 2

    def hf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF checkpoint name this model needs, with its shape."""
        shapes: dict[str, tuple[int, ...]] = {}
        for name, p in self.named_parameters():
            hf = name if name.startswith("lm_head.") else f"model.{name}"
            fused = next((f for f in self._UNFUSED if f".{f}." in hf), None)
            if fused is None:
                shapes[hf] = tuple(p.shape)
                continue
            for part, rows in zip(self._UNFUSED[fused], self._shard_rows(fused, name)):
                shapes[hf.replace(fused, part)] = (rows, *p.shape[1:])
        return shapes

    def load_weight(self, hf_name: str, tensor: torch.Tensor | BlockTensor) -> None:
        """A float tensor is copied into its parameter; a matrix in GGUF blocks is kept for
        pack_linears (a fused projection's parts gathered by BlockRows)."""
        name = hf_name.removeprefix("model.")
        for fused, parts in self._UNFUSED.items():
            for shard, part in enumerate(parts):
                if f".{part}." in name:
                    target = name.replace(part, fused)
                    rows = self._shard_rows(fused, target)
                    start = sum(rows[:shard])
                    self.block_rows.place(target, torch.arange(start, start + rows[shard]), tensor)
                    return
        if isinstance(tensor, BlockTensor):
            if keep_blocks_for(self, name, tensor):
                self.block_weights[name] = tensor
            return
        self.get_parameter(name).data.copy_(tensor)

    def finish_loading(self) -> None:
        """After the last tensor: a fused projection whose other parts came as float tensors (formats
        baton's kernels do not read, dequantized at load, as Q3_K_M's Q3_K q and k beside a Q5_K v)
        has its parts in blocks dequantized into their rows of the float parameter."""
        self.block_rows.finish()


# ---- GGUF: llama.cpp's llama, mistral, qwen2 and qwen3 files --------------------------------------


def llama_gguf_config(meta: GGUFMetadata, architecture: str) -> dict:
    cfg = base_config(meta, architecture)
    cfg["intermediate_size"] = meta.integer("feed_forward_length")
    cfg["num_key_value_heads"] = meta.integer("attention.head_count_kv", cfg["num_attention_heads"])
    window = meta.get("attention.sliding_window")
    if window and architecture in ("MistralForCausalLM", "Gemma3ForCausalLM"):
        cfg["sliding_window"] = meta.integer("attention.sliding_window")
    if architecture == "Qwen2ForCausalLM":
        cfg["attention_bias"] = True
    return cfg


def rope_rows_unpermuted(hf_name: str, value: Value, meta: GGUFMetadata) -> Value:
    """llama.cpp's converter stores Llama-style q and k rows in interleaved-rope order: back to HF's
    rotate-half (other tensors as they are). A per-layer head_count_kv is read at the tensor's layer."""
    if not hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        return value
    heads = meta.integer("attention.head_count")
    if "k_proj" in hf_name:
        if isinstance(meta.get("attention.head_count_kv"), list):
            per_layer = meta.per_layer("attention.head_count_kv", meta.integer("block_count"))
            heads = int(per_layer[int(hf_name.split(".")[2])])
        else:
            heads = meta.integer("attention.head_count_kv", heads)
    n = value.shape[0]
    dim = n // heads // 2
    return take_rows(value, torch.arange(n).view(heads, dim, 2).transpose(1, 2).reshape(n))


def _unpermute_rope(hf_name: str, value: Value, meta: GGUFMetadata):
    yield hf_name, rope_rows_unpermuted(hf_name, value, meta)


_LLAMA_NAMES = {**ATTENTION_NAMES, **MLP_NAMES}


def _llama_arch(architecture: str, rope_interleaved: bool) -> GGUFArch:
    return GGUFArch(
        architecture,
        lambda meta: llama_gguf_config(meta, architecture),
        _LLAMA_NAMES,
        transform=_unpermute_rope if rope_interleaved else None,
    )


GGUF_ARCHS = {
    "llama": _llama_arch("LlamaForCausalLM", True),
    "mistral": _llama_arch("MistralForCausalLM", True),
    "qwen2": _llama_arch("Qwen2ForCausalLM", False),
    "qwen3": _llama_arch("Qwen3ForCausalLM", False),
}
