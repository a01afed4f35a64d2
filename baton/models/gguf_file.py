"""GGUF files: metadata to an HF-style config, tensors renamed to HF names (dequantized, or matrices
kept in their GGUF blocks)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from baton.models.gguf_blocks import BLOCK_FORMATS, BlockTensor

GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}

_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SKIPPED = {"rope_freqs.weight"}


class GGUFFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = gguf.GGUFReader(str(path))
        arch = self.field("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"{path.name}: unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
            )
        self.gguf_arch = arch
        self.architecture = GGUF_ARCHITECTURES[arch]
        self.config = self._config()

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            return default
        value = f.contents()
        return value

    def _config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"architectures": [self.architecture]}
        for key, hf_key in _CONFIG_KEYS.items():
            value = self.field(f"{self.gguf_arch}.{key}")
            if value is not None:
                cfg[hf_key] = value
        names = {t.name for t in self.reader.tensors}
        embd = next(t for t in self.reader.tensors if t.name == "token_embd.weight")
        cfg.setdefault("vocab_size", int(embd.shape[1]))
        cfg["tie_word_embeddings"] = "output.weight" not in names
        scaling = self.field(f"{self.gguf_arch}.rope.scaling.type")
        if scaling == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": self.field(f"{self.gguf_arch}.rope.scaling.factor")}
        elif scaling not in (None, "none"):
            raise ValueError(f"{self.path.name}: unsupported rope scaling {scaling!r}")
        if self.architecture == "Qwen2ForCausalLM":
            cfg["attention_bias"] = True
        if "sliding_window" in cfg and self.architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            cfg.pop("sliding_window")
        cfg["bos_token_id"] = self.field("tokenizer.ggml.bos_token_id")
        cfg["eos_token_id"] = self.field("tokenizer.ggml.eos_token_id")
        return cfg

    def hf_name(self, gguf_name: str) -> str | None:
        if gguf_name in _SKIPPED:
            return None
        base, _, suffix = gguf_name.rpartition(".")
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
        if m:
            part = m.group(2)
            if part == "ffn_norm":  # Gemma3 has sandwich norms: ffn_norm is the pre-MLP one
                hf = "pre_feedforward_layernorm" if self.gguf_arch == "gemma3" else "post_attention_layernorm"
            else:
                hf = _LAYER_NAMES.get(part, part)
            return f"model.layers.{m.group(1)}.{hf}.{suffix}"
        return f"{_GLOBAL_NAMES.get(base, base)}.{suffix}"

    def header(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """HF name -> (shape, stored type), read without dequantizing anything."""
        out = {}
        for t in self.reader.tensors:
            name = self.hf_name(t.name)
            if name is not None:
                out[name] = (tuple(int(d) for d in reversed(t.shape)), t.tensor_type.name)
        return out

    def tensors(self, keep_blocks: bool = False) -> Iterator[tuple[str, torch.Tensor | BlockTensor]]:
        """Every tensor under its HF name, dequantized to float32; with `keep_blocks`, matrices in
        a format baton's kernels read stay in their GGUF blocks (BlockTensor)."""
        heads = self.config["num_attention_heads"]
        kv_heads = self.config.get("num_key_value_heads", heads)
        for t in self.reader.tensors:
            name = self.hf_name(t.name)
            if name is None:
                continue
            blocks = keep_blocks and len(t.shape) == 2 and t.tensor_type.name in BLOCK_FORMATS
            if blocks:
                data = np.asarray(t.data).reshape(int(t.shape[1]), -1)  # rows of block bytes
            else:
                data = gguf.quants.dequantize(t.data, t.tensor_type)
                data = np.ascontiguousarray(data.reshape(tuple(int(d) for d in reversed(t.shape))))
            if self.gguf_arch in ("llama", "mistral") and name.endswith(("q_proj.weight", "k_proj.weight")):
                data = _unpermute_rope(data, heads if "q_proj" in name else kv_heads)  # rows: same for blocks
            if self.gguf_arch == "gemma3" and name.endswith("norm.weight"):
                data = data - 1.0  # llama.cpp stores Gemma's (1 + w) norm weights with the 1 added
            if blocks:
                yield name, BlockTensor.from_rows(t.tensor_type.name, np.array(data, copy=True))
            else:
                yield name, torch.from_numpy(np.array(data, copy=True) if not data.flags.writeable else data)


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-rope row order, back to HF's rotate-half order."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
