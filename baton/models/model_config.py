"""A model's HF config.json, normalized into one typed record the model code reads."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from baton.kv.spec import LayerKind


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0  # rotary on this fraction of each head's dims
    # yarn (DeepSeek-V3's): the ramp between beta_fast and beta_slow rotations, cos/sin scaled by
    # attention_factor (None: from factor, mscale and mscale_all_dim), and the softmax scale by
    # mscale(factor, mscale_all_dim)^2 where the model applies it
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass
class TextModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_kinds: list[LayerKind]
    rope: dict[str, RopeConfig]  # keyed by layer kind name ("full" / "sliding")
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    hf: dict[str, Any] = field(default_factory=dict)  # the raw (text) config, for family-specific fields

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5


def _rope_from(params: dict[str, Any] | None, default_theta: float) -> RopeConfig:
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3, yarn")
    factor = float(params.get("factor", 1.0))
    if not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"rope factor must be a positive number, got {params.get('factor')!r}")
    attention_factor = params.get("attention_factor")
    return RopeConfig(
        theta=float(params.get("rope_theta", default_theta)),
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(params.get("truncate", True)),
    )


def _layer_kinds(cfg: dict[str, Any], num_layers: int, sliding_pattern_default: int | None) -> list[LayerKind]:
    window = cfg.get("sliding_window")
    if cfg.get("layer_types"):
        types = cfg["layer_types"]
    elif sliding_pattern_default is not None:  # Gemma3 configs from before layer_types
        pattern = cfg.get("sliding_window_pattern", sliding_pattern_default)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    elif cfg.get("use_sliding_window") and window:  # Qwen2 / Qwen3
        first = cfg.get("max_window_layers", num_layers)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    elif "use_sliding_window" not in cfg and window:  # Mistral: every layer
        types = ["sliding_attention"] * num_layers
    else:
        types = ["full_attention"] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    kinds = []
    for t in types:
        if t == "sliding_attention":
            kinds.append(LayerKind.sliding(int(window)))
        elif t == "full_attention":
            kinds.append(LayerKind.full())
        else:
            raise ValueError(f"unsupported layer type {t!r}")
    return kinds


def _eos_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def parse_hf_config(
    cfg: dict[str, Any], architecture: str, layer_kinds_from: Callable[[dict], list[LayerKind]] | None = None
) -> TextModelConfig:
    """Read the fields the model code needs, in both the old and the new transformers formats.
    `layer_kinds_from`: the model family's own reading of its layer kinds (recurrent, MLA)."""
    is_gemma3 = architecture == "Gemma3ForCausalLM"
    if "text_config" in cfg:  # a multimodal config: its text model's, tied as the whole model says where it does not
        cfg = {"tie_word_embeddings": cfg.get("tie_word_embeddings", is_gemma3), **cfg["text_config"]}
    pattern = cfg.get("layers_block_type") or cfg.get("hybrid_override_pattern") or []  # NemotronH
    num_layers = int(cfg.get("num_hidden_layers") or len(pattern))
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    rope_params = cfg.get("rope_parameters") or {}
    if is_gemma3:
        per_kind = rope_params if "full_attention" in rope_params else {"full_attention": rope_params}
        full = _rope_from(
            {**(cfg.get("rope_scaling") or {}), **per_kind.get("full_attention", {})},
            cfg.get("rope_theta", 1_000_000.0),
        )
        sliding = _rope_from(per_kind.get("sliding_attention"), cfg.get("rope_local_base_freq", 10_000.0))
        rope = {"full": full, "sliding": sliding}
    else:
        r = _rope_from(rope_params or cfg.get("rope_scaling"), cfg.get("rope_theta", 10_000.0))
        if not rope_params and cfg.get("rope_scaling") is None:
            r = RopeConfig(
                theta=float(cfg.get("rope_theta", 10_000.0)),
                partial_rotary_factor=float(cfg.get("partial_rotary_factor", 1.0)),
            )
        rope = {"full": r, "sliding": r}
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or ("gelu_pytorch_tanh" if is_gemma3 else "silu")
    if layer_kinds_from is None and act not in ("silu", "gelu_pytorch_tanh"):  # hybrids read their own
        raise ValueError(f"unsupported activation {act!r}; supported: silu, gelu_pytorch_tanh")
    return TextModelConfig(
        architecture=architecture,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", cfg.get("norm_eps", 1e-6))),  # norm_eps: LFM2
        max_position_embeddings=int(cfg.get("max_position_embeddings") or cfg.get("model_max_length") or 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", is_gemma3)),
        layer_kinds=layer_kinds_from(cfg)
        if layer_kinds_from
        else _layer_kinds(cfg, num_layers, 6 if is_gemma3 else None),
        rope=rope,
        attention_bias=bool(cfg.get("attention_bias", architecture == "Qwen2ForCausalLM")),
        qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM"),
        hidden_act=act,
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256 if is_gemma3 else None),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        hf=cfg,
    )
