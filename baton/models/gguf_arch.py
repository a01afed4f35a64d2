"""What a family declares to be read from llama.cpp's GGUF files: its architecture names, the config
its metadata gives, its tensor names and the converter's transforms undone. The reader
(gguf_file.py) knows none of them; each family's module declares its own beside its HF loading.

A transform sees one GGUF tensor under its HF name and yields the HF tensors it stands for (a
fused GGUF tensor may stand for several). It is written once for three kinds of value: a float32
tensor, a matrix in GGUF blocks (BlockTensor: rows can be taken and reordered, columns only in
whole blocks) and a meta tensor of the stored shape, which is how the header is checked before a
byte of data is read."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from baton.models.gguf_blocks import BLOCK_FORMATS, BlockTensor

Value = torch.Tensor | BlockTensor
Transform = Callable[[str, Value, "GGUFMetadata"], Iterator[tuple[str, Value]]]


class GGUFMetadata:
    """A file's key-value metadata, read under its architecture's prefix, each value checked as read."""

    def __init__(self, fields: Any, arch: str, where: str, shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        self.fields, self.arch, self.where = fields, arch, where
        self.shapes = shapes or {}  # tensor name -> shape (torch's order: rows first)

    def block_has(self, index: int, name: str) -> bool:
        """Whether block `index` carries tensor `name` (e.g. "ssm_in.weight")."""
        return f"blk.{index}.{name}" in self.shapes

    def get(self, key: str, default: Any = None) -> Any:
        """`arch.key`, or `key` when it names a general.* / tokenizer.* field."""
        full = key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"
        return self.fields.get(full, default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.where}: metadata {self.arch}.{key} is missing")
        return value

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if value is None:
            return self.require(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < 0:
            raise ValueError(f"{self.where}: metadata {self.arch}.{key} must be a whole number, got {value!r}")
        return int(value)

    def real(self, key: str, default: float | None = None) -> float:
        value = self.get(key, default)
        if value is None:
            return self.require(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"{self.where}: metadata {self.arch}.{key} must be a finite number, got {value!r}")
        return float(value)

    def per_layer(self, key: str, num_layers: int, default: Any = None) -> list:
        """A per-layer value: an array of num_layers entries, or one value every layer shares."""
        value = self.get(key, default)
        if value is None:
            return self.require(key)
        if not isinstance(value, list):
            return [value] * num_layers
        if len(value) != num_layers:
            raise ValueError(
                f"{self.where}: metadata {self.arch}.{key} has {len(value)} entries for {num_layers} layers"
            )
        return value


@dataclass(frozen=True)
class GGUFArch:
    """One llama.cpp architecture as a baton model: `architecture` is the HF name it loads as (the
    registry's), `config` the HF-style config the metadata gives, `layer_names` the per-block
    tensors ("attn_q.weight" of blk.N -> "self_attn.q_proj.weight" of model.layers.N) and
    `global_names` the others, `transform` the converter's changes undone."""

    architecture: str
    config: Callable[[GGUFMetadata], dict[str, Any]]
    layer_names: dict[str, str]
    global_names: dict[str, str] = field(
        default_factory=lambda: {
            "token_embd.weight": "model.embed_tokens.weight",
            "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight",
        }
    )
    layer_prefix: str = "model.layers"
    transform: Transform | None = None
    ignored: tuple[str, ...] = ("rope_freqs.weight",)  # llama.cpp's own tables, not weights

    def hf_name(self, gguf_name: str) -> str | None:
        """The HF name a GGUF tensor is read under; None for one nothing reads."""
        if gguf_name in self.ignored:
            return None
        if gguf_name.startswith("blk."):
            _, index, rest = gguf_name.split(".", 2)
            hf = self.layer_names.get(rest)
            return None if hf is None else f"{self.layer_prefix}.{index}.{hf}"
        return self.global_names.get(gguf_name)

    def hf_tensors(self, hf_name: str, value: Value, meta: GGUFMetadata) -> Iterator[tuple[str, Value]]:
        if self.transform is None:
            yield hf_name, value
        else:
            yield from self.transform(hf_name, value, meta)


# llama.cpp's names for the pieces most families share (src/llama-arch.cpp)
ATTENTION_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
MLP_NAMES = {
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def base_config(meta: GGUFMetadata, architecture: str) -> dict[str, Any]:
    """The HF config fields every decoder's metadata gives (llama.cpp's LLM_KV names)."""
    cfg: dict[str, Any] = {"architectures": [architecture]}
    keys = {
        "context_length": "max_position_embeddings",
        "embedding_length": "hidden_size",
        "attention.head_count": "num_attention_heads",
        "attention.key_length": "head_dim",
        "attention.layer_norm_rms_epsilon": "rms_norm_eps",
        "rope.freq_base": "rope_theta",
    }
    for key, hf_key in keys.items():
        if meta.get(key) is not None:
            cfg[hf_key] = meta.real(key) if hf_key in ("rms_norm_eps", "rope_theta") else meta.integer(key)
    cfg["num_hidden_layers"] = meta.integer("block_count") - meta.integer("nextn_predict_layers", 0)
    if cfg["num_hidden_layers"] < 1:
        raise ValueError(f"{meta.where}: metadata {meta.arch}.block_count leaves no layers")
    scaling = meta.get("rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": meta.real("rope.scaling.factor")}
    elif scaling not in (None, "none"):
        raise ValueError(f"{meta.where}: unsupported rope scaling {scaling!r}")
    for key, hf_key in (
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
    ):
        if meta.get(key) is not None:
            cfg[hf_key] = meta.integer(key)
    return cfg


def uniform(meta: GGUFMetadata, key: str, num_layers: int, hf_key: str, cfg: dict[str, Any]) -> None:
    """A per-layer key whose non-zero entries must agree (llama.cpp writes 0 for a layer without
    the part, e.g. attention heads of a recurrent layer): cfg[hf_key] = that value."""
    values = {int(v) for v in meta.per_layer(key, num_layers) if v}
    if len(values) > 1:
        raise ValueError(f"{meta.where}: metadata {meta.arch}.{key} differs between layers: {sorted(values)}")
    if values:
        cfg[hf_key] = values.pop()


def attention_layers(
    meta: GGUFMetadata, num_layers: int, recurrent_tensor: str, attention_tensor: str = "attn_q.weight"
) -> list[bool]:
    """Whether each layer is attention rather than recurrent: attention exactly where its
    attention.head_count_kv is not 0 (llama.cpp's rule), checked against the tensors its block
    holds (`attention_tensor`, or `recurrent_tensor`, never both)."""
    kv = meta.per_layer("attention.head_count_kv", meta.integer("block_count"))[:num_layers]
    kinds = []
    for i in range(num_layers):
        recurrent, attention = meta.block_has(i, recurrent_tensor), meta.block_has(i, attention_tensor)
        if recurrent == attention or attention != bool(kv[i]):
            raise ValueError(
                f"{meta.where}: block {i} holds {'both mixers' if recurrent else 'no mixer'} or its tensors "
                f"disagree with attention.head_count_kv ({kv[i]})"
            )
        kinds.append(attention)
    return kinds


# ---- transforms on any of the three kinds of value ------------------------------------------------


def take_rows(value: Value, rows: torch.Tensor) -> Value:
    """Rows `rows` of a matrix or vector (the first axis), in that order."""
    if len(rows) and int(rows.max()) >= value.shape[0]:  # checked here: a meta tensor does not
        raise ValueError(f"row {int(rows.max())} of a tensor with {value.shape[0]}")
    if isinstance(value, BlockTensor):
        return BlockTensor(value.qtype, value.blocks[rows].contiguous())
    return value[rows]


def split_rows(value: Value, sizes: list[int]) -> list[Value]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [take_rows(value, torch.arange(s, s + n)) for s, n in zip(starts, sizes)]


def take_column_groups(value: Value, order: torch.Tensor, width: int) -> Value:
    """A matrix with its columns regrouped: groups of `width` columns in `order`. Blocks stay blocks
    where a group is whole blocks; otherwise (a K-quant's 256 values spanning two heads) the matrix
    is dequantized."""
    if len(value.shape) != 2 or order.numel() * width != value.shape[1]:
        raise ValueError(f"expected {order.numel() * width} columns, got shape {list(value.shape)}")
    cols = (order[:, None] * width + torch.arange(width)).flatten()
    if not isinstance(value, BlockTensor):
        return value[:, cols]
    values = BLOCK_FORMATS[value.qtype][0]
    if width % values:
        return value.dequantize()[:, cols]
    per = width // values
    blocks = (order[:, None] * per + torch.arange(per)).flatten()
    return BlockTensor(value.qtype, value.blocks[:, blocks].contiguous())


def experts(value: Value, count: int) -> list[Value]:
    """A stacked [experts, N, K] tensor (GGUF's ffn_*_exps) as its experts' [N, K] matrices; blocks
    come as [experts * N, K] rows."""
    if isinstance(value, BlockTensor):
        return split_rows(value, [value.shape[0] // count] * count)
    if value.dim() != 3 or value.shape[0] != count:
        raise ValueError(f"expected {count} stacked experts, got shape {list(value.shape)}")
    return list(value.unbind(0))


def each_expert(hf_name: str, value: Value, meta: GGUFMetadata) -> Iterator[tuple[str, Value]]:
    """A stacked ffn_*_exps tensor read under `...experts.<part>` as each expert's
    `...experts.<e>.<part>`."""
    for e, expert in enumerate(experts(value, meta.integer("expert_count"))):
        yield hf_name.replace(".experts.", f".experts.{e}."), expert


def float_op(value: Value, op: Callable[[torch.Tensor], torch.Tensor]) -> Value:
    """An elementwise undo (a norm's +1, ssm_a's -exp) on a float tensor; a vector in blocks is
    dequantized first."""
    return op(value.dequantize() if isinstance(value, BlockTensor) else value)


def reshaped(value: Value, *shape: int) -> Value:
    """A non-matrix (a conv kernel, a norm, a column of A) in its HF shape; one a file stores in
    blocks is dequantized first."""
    return float_op(value, lambda t: t.reshape(*shape))
