"""Building blocks shared by the model families: linears, norms, paged attention (rotary: rope.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from baton.kv.storage import LayerKV
from baton.models.gguf_blocks import BLOCK_FORMATS, BlockTensor, BlockWeight, slice_k_parts
from baton.ops import (
    dequantize_rows,
    empty_huge_pages,
    gated_act,
    ops,
    pack_weight_panels,
    packed_linear,
    panel_lanes,
    quant_kernel,
    rms_norm,
    rms_norm_heads_,
)
from baton.ops import paged_attention as paged_attention_op


class PackedLinear(nn.Module):
    """A linear over baton's own kernels: the weight packed once, either into float32 column panels
    (baton/ops/linear.cpp) that the kernel streams at close to the machine's read rate, or kept in a
    GGUF block format (baton/ops/quant_linear.cpp). Float32 panels against oneDNN's packed linears
    on SmolLM2's 121 projections: 1 row 25.4 -> 16.0 ms, 8 rows 26 -> 17, 32 rows 52 -> 46, 1,024
    rows 1,374 -> 1,386 (even). Every output is summed in the same order whatever the row count, so
    a row's bits do not depend on its batch."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int) -> None:
        super().__init__()
        self.packed = packed
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.qtype = "F32"  # or the GGUF block format's name

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None):
        """`out`: where to keep the panels (a slice of a shared arena), else a tensor of their own."""
        panels = pack_weight_panels(weight.detach().float().contiguous())
        packed = panels if out is None else out.view(panels.shape).copy_(panels)
        return cls(packed, bias, weight.shape[1], weight.shape[0])

    @classmethod
    def from_blocks(cls, weight: BlockTensor, bias: torch.Tensor | None) -> PackedLinear:
        if not ops().QUANT_KERNELS:
            raise RuntimeError(
                "weights in GGUF blocks need an x86-64 CPU with AVX2 and FMA (or AVX-512); "
                "run with --dtype float32 to dequantize them at load"
            )
        out_features, in_features = weight.shape
        linear = cls(weight.kernel_weight(), bias, in_features, out_features)
        linear.qtype = weight.qtype
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias, self.out_features)

    def parts(self) -> list[PackedLinear]:
        return [self]


class StackedLinear(nn.Module):
    """A fused projection whose row parts ship in different GGUF formats (stack_rows): each part
    on its own kernel, the outputs side by side."""

    def __init__(self, parts: list[PackedLinear]) -> None:
        super().__init__()
        self.stack = nn.ModuleList(parts)
        self.in_features, self.out_features = parts[0].in_features, sum(p.out_features for p in parts)

    @classmethod
    def from_blocks(cls, weights: list[BlockTensor], bias: torch.Tensor | None) -> StackedLinear:
        splits = [w.shape[0] for w in weights]
        biases = [None] * len(weights) if bias is None else bias.split(splits)
        return cls([PackedLinear.from_blocks(w, b) for w, b in zip(weights, biases)])

    @property
    def bias(self) -> torch.Tensor | None:
        biases = [p.bias for p in self.stack]
        return None if biases[0] is None else torch.cat(biases)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.stack], dim=-1)

    def parts(self) -> list[PackedLinear]:
        return list(self.stack)


def unwrapped(module: nn.Module) -> nn.Module:
    """The module, or the one a tensor-parallel wrapper holds (parallel/shard.py's RowParallel sums
    its output over the ranks; a fused decode step calls the sum back itself)."""
    return module.inner if getattr(module, "sums_over_ranks", False) else module


def embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """An embedding for the loader to fill, left uninitialised: on the meta device a model is built
    on, `normal_` alone would import torch._dynamo (2-3 s of every engine's start)."""
    return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))


class BlockEmbedding(nn.Module):
    """An embedding table kept in a GGUF block format: a lookup dequantizes only the rows it reads
    (Gemma3's 262k x 640 table is 178 MB in Q8_0 against 671 MB as float32)."""

    def __init__(self, weight: BlockTensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(self.weight.blocks, input_ids.reshape(-1)).view(*input_ids.shape, -1)


def can_pack_linears(dtype: torch.dtype) -> bool:
    return dtype == torch.float32


def pack_linears(
    model: nn.Module, block_weights: dict[str, BlockWeight] | None = None, quantization: str | None = None
) -> None:
    """Swap every nn.Linear of a loaded float32 model for a PackedLinear (the dense weight is freed):
    over `block_weights[name + ".weight"]` where the checkpoint shipped the weight in GGUF blocks,
    else quantized into `quantization` (a GGUF format such as q4_k) where its input width allows
    and the linear is not marked `keep_float` (a tiny, precision-bound mix), else float32 panels.
    Blocks are regrouped by 8 rows for the integer kernels when one is in use.
    All panels live in one arena on transparent huge pages: a decode step streams every weight, and
    with 4 KiB pages that is a TLB miss every 4 KiB (1 row: 3%, 8 rows: 9% faster, A/B)."""
    block_weights = block_weights or {}
    linears = [
        (parent, name, child, f"{prefix}.{name}".lstrip("."))
        for prefix, parent in model.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    blocks: dict[str, BlockWeight] = {}
    for _, _, child, full in linears:
        weight = block_weights.get(f"{full}.weight")
        if weight is None and quantization is not None and not getattr(child, "keep_float", False):
            weight = quantize_weight(child.weight, quantization, getattr(child, "k_slice", None))
        if weight is not None:
            blocks[full] = weight
    if quant_kernel().startswith("int8"):
        regroup_on_huge_pages([part for w in blocks.values() for part in (w if isinstance(w, list) else [w])])
    floats = [(parent, name, child) for parent, name, child, full in linears if full not in blocks]
    lanes = panel_lanes()
    sizes = [-(-child.out_features // lanes) * lanes * child.in_features for _, _, child in floats]
    arena = empty_huge_pages(4 * sum(sizes)).view(torch.float32)
    offset = 0
    for (parent, name, child), size in zip(floats, sizes):
        setattr(parent, name, PackedLinear.from_float(child.weight, child.bias, arena[offset : offset + size]))
        child.weight = None  # free the dense copy now, not after the loop
        offset += size
    for parent, name, child, full in linears:
        weight = blocks.get(full)
        if isinstance(weight, list):
            setattr(parent, name, StackedLinear.from_blocks(weight, child.bias))
        elif weight is not None:
            setattr(parent, name, PackedLinear.from_blocks(weight, child.bias))


def regroup_on_huge_pages(weights: list[BlockTensor]) -> None:
    """Regroup GGUF blocks for the integer kernels into one arena on transparent huge pages, as the
    float panels are: with 4 KiB pages a decode step's stream of every weight misses the TLB every
    4 KiB (one row of Q4_K [6144, 2048] on 2 Zen 3 cores: 25.5 -> 27.9 GB/s; [512, 2048]: 14-17 ->
    21-22). One weight at a time, so loading holds one extra copy at most; a weight shared by
    several linears (a tied embedding and lm_head) is regrouped once."""
    todo = list({id(w): w for w in weights if w.blocks.dim() == 3}.values())
    sizes = [-(-w.regrouped_nbytes // 64) * 64 for w in todo]  # each weight 64-byte aligned
    arena = empty_huge_pages(sum(sizes))
    offset = 0
    for weight, size in zip(todo, sizes):
        weight.regroup(arena[offset : offset + size])
        offset += size


def keep_blocks_for(model: nn.Module, name: str, weight: BlockTensor) -> bool:
    """Whether parameter `name` takes `weight` as blocks (an nn.Linear's weight, which pack_linears
    installs, or the embedding's, which pack_model makes a BlockEmbedding); any other (a router's
    plain parameter, a file's odd choice) is dequantized into it here, at load, not left unread."""
    module, _, attr = name.rpartition(".")
    if attr == "weight" and isinstance(model.get_submodule(module), nn.Linear | nn.Embedding):
        return True
    param = model.get_parameter(name)
    param.data.copy_(weight.dequantize().reshape(param.shape))
    return False


def pack_model(
    model: nn.Module, embed_attr: str, block_weights: dict[str, BlockWeight], quantization: str | None
) -> None:
    """pack_linears for a whole causal LM whose embedding is `model.<embed_attr>`: a tied lm_head gets
    its own packed copy when float (the embedding stays a plain table for lookups); in GGUF blocks,
    the embedding and the lm_head read the same blocks."""
    embed = block_weights.pop(f"{embed_attr}.weight", None)
    if model.lm_head is None:
        model.lm_head = nn.Linear(model.cfg.hidden_size, model.cfg.vocab_size, bias=False, device="meta")
        model.lm_head.weight = getattr(model, embed_attr).weight
    if embed is not None and model.cfg.tie_word_embeddings:  # a later pipeline stage's head too
        block_weights.setdefault("lm_head.weight", embed)
    if embed is not None and isinstance(getattr(model, embed_attr), nn.Embedding):  # not a later stage's input
        setattr(model, embed_attr, BlockEmbedding(embed))
    pack_linears(model, block_weights, quantization)
    block_weights.clear()


def describe_linears(model: nn.Module) -> str:
    """The packed linears' formats and the weight bytes a decode step reads through them."""
    counts: dict[str, int] = {}
    nbytes = 0
    for m in model.modules():  # a StackedLinear's parts are PackedLinears
        if isinstance(m, PackedLinear):
            counts[m.qtype] = counts.get(m.qtype, 0) + 1
            nbytes += m.packed.numel() * m.packed.element_size()
    formats = ", ".join(f"{n} {q}" for q, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return f"linears {formats or 'none packed'}; {nbytes / 2**20:.1f} MiB of weights read per token"


def quantize_weight(
    weight: torch.Tensor, quantization: str, k_slice: tuple[int, int, int] | None = None
) -> BlockTensor | None:
    """`weight` [N, K] in the GGUF format `quantization` (q8_0, q4_k, ...); None where K is not a
    whole number of its blocks. k_slice (start, stop, whole K): the weight is those columns of a
    row-parallel linear's, and keeps the whole one's K parts that lie inside them."""
    from baton.models.quantize import QUANT_TYPES, can_quantize, quantize_matrix

    qtype = QUANT_TYPES[quantization]
    if weight.device.type == "meta" or not can_quantize(qtype, weight.shape[1]):
        return None
    blocks = BlockTensor.from_rows(qtype.name, quantize_matrix(weight.detach().float(), qtype))
    values = BLOCK_FORMATS[qtype.name][0]
    if k_slice is not None and all(c % values == 0 for c in k_slice):
        start, stop, whole = (c // values for c in k_slice)
        blocks.k_parts = slice_k_parts(whole, start, stop)
    return blocks


class RMSNorm(nn.Module):
    """`offset=1.0` gives Gemma's (1 + w) scaling computed in float32 before the cast back.
    Given the residual stream, `residual += x` first (in place) and the sum is normalized: the
    pre-norm block's add and norm in one pass."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0.0 else torch.zeros(dim), requires_grad=False)
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype == torch.float32:  # baton/ops/pointwise.cpp: one pass instead of 5-7 torch ops
            return rms_norm(x, self.weight, self.eps, self.offset, residual)
        if residual is not None:
            x = residual.add_(x)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)

    def pre_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A pre-norm block's input and the residual stream: the first block's x starts the stream;
        a later one's is added to it (in place) before the norm."""
        return (self(x), x) if residual is None else (self(x, residual), residual)

    def heads_(self, x: torch.Tensor) -> None:
        """Normalize every head of x [T, heads, D] in place (q/k norm)."""
        if x.dtype == torch.float32:
            rms_norm_heads_(x, self.weight, self.eps, self.offset)
        else:
            x.copy_(self(x))


def gated_activation(gate_up: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> act(gate) * up."""
    if gate_up.dtype == torch.float32:
        return gated_act(gate_up, gelu_tanh)
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") if gelu_tanh else F.silu(gate)) * up


@dataclass
class KVTile:
    """Context positions one attention call of an MLA prefill chunk reads: rows [lo, hi) of the
    chunk's K/V source (its kv_slots, or the batch rows when the chunk is the whole context)."""

    lo: int
    hi: int
    mask: torch.Tensor | None  # [q, hi - lo] float32 0 / -inf; None: every query sees every position
    blind_rows: torch.Tensor | None  # [q] bool: queries that see no position of this tile


@dataclass
class PrefillSeq:
    """One request's chunk of queries: token rows [q_start, q_end) of the flat batch. kv_slots and
    tiles are MLA's (it expands latents tile by tile); other layers read through the block table."""

    q_start: int
    q_end: int
    kv_slots: torch.Tensor | None  # None: the chunk is the whole context, read K/V from the batch
    tiles: list[KVTile]  # newest first, the first holding every query's own position; [] = plain causal


@dataclass
class GroupAttnMetadata:
    """How one KV group's layers read and write the cache in this step."""

    slot_mapping: torch.Tensor  # [num_tokens] slot each new token's K/V is written to
    block_size: int
    num_decodes: int  # the first num_decodes rows of the batch are single-token decodes
    block_table: torch.Tensor  # [seqs, max_blocks]: a row per decode, in order, then one per prefill chunk
    kv_offsets: torch.Tensor  # [num_tokens] first position each row reads, counted from its table row's start
    kv_lens: torch.Tensor  # [num_tokens] positions each row reads from there on
    row_seq: torch.Tensor | None  # [num_tokens] each row's block_table row; None: row i reads row i
    prefills: list[PrefillSeq]

    @property
    def decode_block_ids(self) -> torch.Tensor | None:  # [num_decodes, max_blocks] blocks each decode reads
        return self.block_table[: self.num_decodes] if self.num_decodes else None

    @property
    def decode_kv_offsets(self) -> torch.Tensor | None:
        return self.kv_offsets[: self.num_decodes] if self.num_decodes else None

    @property
    def decode_kv_lens(self) -> torch.Tensor | None:
        return self.kv_lens[: self.num_decodes] if self.num_decodes else None


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    cache: LayerKV,
    meta: GroupAttnMetadata,
    scale: float,
) -> torch.Tensor:
    """Every row's attention over its context, read in place from the blocks (baton/ops/
    paged_attention.cpp): decodes and prefill chunks in one call, a row's bits the same in both."""
    cache.write(meta.slot_mapping, k, v, meta.block_size)
    return paged_attention_op(
        q,
        cache.k,
        cache.v,
        meta.block_table,
        meta.kv_offsets,
        meta.kv_lens,
        meta.block_size,
        scale,
        cache.scales,
        meta.row_seq,
    )
