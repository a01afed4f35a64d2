"""Split a loaded model for tensor parallelism, as Megatron does: fused qkv and gate_up
column-parallel (each rank its heads' and its columns' rows), o and down row-parallel (each rank
its input columns, one all-reduce after), the vocabulary split over embedding and lm_head, KV
heads divided (replicated where there are fewer than ranks), MoE experts divided among ranks.

It runs after the weights are loaded and before the linears are packed, on float weights and on
weights kept in GGUF blocks alike (a block format splits by rows anywhere and by columns at its
block boundaries; elsewhere that weight is dequantized to float32)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from baton.kv.spec import KVGroup, KVSpec
from baton.kv.state import StateStorage
from baton.kv.storage import KVStorage
from baton.models.gguf_blocks import BLOCK_FORMATS, BlockTensor, BlockWeight
from baton.models.layers import BlockEmbedding
from baton.models.model_config import TextModelConfig
from baton.parallel.comm import TPGroup

logger = logging.getLogger(__name__)


def even_split(n: int, size: int, rank: int) -> range:
    """Rank's contiguous share of n items; the first n % size ranks take one more."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def head_split(num_heads: int, num_kv_heads: int, size: int, rank: int) -> tuple[range, range]:
    """(query heads, KV heads) of a rank. With at least as many KV heads as ranks each rank takes
    whole KV groups; with fewer, each KV head is replicated on size / num_kv_heads ranks that
    split its query heads."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv = even_split(num_kv_heads, size, rank)
        return range(kv.start * group, kv.stop * group), kv
    per_head = size // num_kv_heads
    if size % num_kv_heads or group % per_head:
        raise ValueError(
            f"{num_heads} query heads over {num_kv_heads} KV heads do not split over {size} ranks "
            f"(each KV head's {group} query heads over {per_head} ranks)"
        )
    kv_head = rank // per_head
    q = even_split(group, per_head, rank % per_head)
    return range(kv_head * group + q.start, kv_head * group + q.stop), range(kv_head, kv_head + 1)


@dataclass
class CacheSplit:
    """How a KV span's heads and state channels map onto the ranks (what the handoff needs)."""

    shares: list[range]  # each rank's KV heads of the attention layers
    whole_spec: KVSpec  # the whole model's KV spec: what a span carries and is validated against


def split_caches(
    model: nn.Module, whole: TextModelConfig, storage: KVStorage, states: StateStorage, tp: TPGroup, block_size: int
) -> CacheSplit:
    """Tell this rank's KV and state storage which of the model's heads and state channels they
    hold (from shard_model), and return the split."""
    shares = [head_split(whole.num_heads, whole.num_kv_heads, tp.size, r)[1] for r in range(tp.size)]
    storage.kv_heads = shares[tp.rank]
    channels = getattr(model, "state_channels", None)
    if storage.spec.has_state and channels is not None:
        # a state no layer split (a pooled indexer's open pool) is every rank's whole: None
        states.channels = [
            channels.get(g.layer_ids[0], [None] * len(g.state_shapes)) for g in storage.spec.state_groups
        ]
    return CacheSplit(shares, KVSpec.build(whole.layer_kinds, whole.num_kv_heads, whole.head_dim, block_size))


def group_heads(group: KVGroup, shares: list[range], num_kv_heads: int) -> tuple[list[range], int]:
    """Each rank's heads of a group and the group's whole count: MLA latents and pooled keys are
    every rank's whole (replicated), attention K/V heads split as `shares` says."""
    if group.kind.has_latent:
        return [range(group.num_kv_heads)] * len(shares), group.num_kv_heads
    return shares, num_kv_heads


class Sharder:
    """Slices one model's linears in place; knows where each weight lives (dense, or in blocks)."""

    def __init__(self, model: nn.Module, tp: TPGroup) -> None:
        self.model, self.tp = model, tp
        self.blocks: dict[str, BlockWeight] = getattr(model, "block_weights", {})
        self.paths = {id(m): name for name, m in model.named_modules()}

    def take_rows(self, linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
        key = f"{self.paths[id(linear)]}.weight"
        bias = None if linear.bias is None else linear.bias.data[rows]
        if key in self.blocks:
            self.blocks[key] = _take_rows(self.blocks[key], rows)
            return self._replace(linear, None, bias, in_features=linear.in_features, out_features=len(rows))
        return self._replace(linear, linear.weight.data[rows], bias)

    def take_cols(self, linear: nn.Linear, cols: range, keep_bias: bool) -> nn.Linear:
        key = f"{self.paths[id(linear)]}.weight"
        bias = linear.bias.data.clone() if linear.bias is not None and keep_bias else None
        if linear.bias is not None and not keep_bias:
            bias = torch.zeros_like(linear.bias.data)  # added once, by rank 0, before the sum
        if key in self.blocks:
            weight = self.blocks.pop(key)
            parts = weight if isinstance(weight, list) else [weight]
            if all(cols.start % BLOCK_FORMATS[p.qtype][0] == 0 == cols.stop % BLOCK_FORMATS[p.qtype][0] for p in parts):
                taken = [
                    p.take_blocks(*(c // BLOCK_FORMATS[p.qtype][0] for c in (cols.start, cols.stop))) for p in parts
                ]
                self.blocks[key] = taken if isinstance(weight, list) else taken[0]
                return self._replace(linear, None, bias, in_features=len(cols), out_features=linear.out_features)
            logger.info("%s: columns %s are not whole blocks; kept as float32", key, cols)
            dense = torch.cat([p.dequantize() for p in parts])
            return self._replace(linear, dense[:, cols.start : cols.stop], bias)
        new = self._replace(linear, linear.weight.data[:, cols.start : cols.stop], bias)
        new.k_slice = (cols.start, cols.stop, linear.in_features)  # for quantization at load (pack_linears)
        return new

    def _replace(self, old: nn.Linear, weight, bias, in_features: int = 0, out_features: int = 0) -> nn.Linear:
        if weight is not None:
            out_features, in_features = weight.shape
        new = nn.Linear(in_features, out_features, bias=bias is not None, device="meta" if weight is None else "cpu")
        if weight is not None:
            new.weight = nn.Parameter(weight.contiguous().clone(), requires_grad=False)
        else:
            new.weight.requires_grad_(False)
        if bias is not None:
            new.bias = nn.Parameter(bias.contiguous().clone(), requires_grad=False)
        self.paths[id(new)] = self.paths[id(old)]
        return new


def _take_rows(weight: BlockWeight, rows: torch.Tensor) -> BlockWeight:
    """Rows `rows` (ascending) of a matrix in blocks; of row parts in several formats, each part's
    rows among them (parts left without rows dropped)."""
    if not isinstance(weight, list):
        return BlockTensor(weight.qtype, weight.blocks[rows].contiguous(), k_parts=weight.k_parts)
    taken, start = [], 0
    for part in weight:
        stop = start + part.blocks.shape[0]
        mine = rows[(rows >= start) & (rows < stop)] - start
        if len(mine):
            taken.append(BlockTensor(part.qtype, part.blocks[mine].contiguous(), k_parts=part.k_parts))
        start = stop
    return taken if len(taken) > 1 else taken[0]


class RowParallel(nn.Module):
    """A module whose output is this rank's partial sum: summed over the ranks after it."""

    sums_over_ranks = True  # models/layers.py's unwrapped() finds `inner` by it

    def __init__(self, inner: nn.Module, tp: TPGroup) -> None:
        super().__init__()
        self.inner, self.tp = inner, tp

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.tp.all_reduce(self.inner(*args, **kwargs))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the table; a token elsewhere looks up zeros, and the sum over the ranks
    is every token's own row, exactly."""

    def __init__(self, inner: nn.Module, vocab: range, tp: TPGroup) -> None:
        super().__init__()
        self.inner, self.vocab, self.tp = inner, vocab, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.vocab.start) & (input_ids < self.vocab.stop)
        local = torch.where(mine, input_ids - self.vocab.start, 0)
        x = self.inner(local)
        return self.tp.all_reduce(x.masked_fill_(~mine[..., None], 0))

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight


class VocabParallelHead(nn.Module):
    """This rank's vocabulary rows of the lm_head; the logits gathered from every rank (padded to
    equal shares for the gather, the padding cut)."""

    def __init__(self, inner: nn.Module, vocab_size: int, shard: int, tp: TPGroup) -> None:
        super().__init__()
        self.inner, self.vocab_size, self.shard, self.tp = inner, vocab_size, shard, tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.inner(hidden)
        if logits.shape[-1] < self.shard:
            logits = F.pad(logits, (0, self.shard - logits.shape[-1]))
        return self.tp.all_gather_last(logits)[..., : self.vocab_size]


def shard_model(model: nn.Module, cfg: TextModelConfig, tp: TPGroup) -> TextModelConfig:
    """Split `model` in place for rank tp.rank of tp.size; returns the config of this rank's part
    (its heads and widths), which sizes its KV cache and its fused decode step."""
    from baton.parallel.shard_layers import shard_layer

    sharder = Sharder(model, tp)
    _shard_vocab(model, cfg, sharder)
    local: dict = {}  # the config fields this rank's part changes (heads, widths, state shapes)
    for layer in list(model.layers) + list(getattr(model, "mtp", [])):
        shard_layer(getattr(layer, "block", layer), cfg, local, sharder)  # an MTP layer: its decoder block
    model.state_channels = local.pop("state_channels", {})  # layer -> its state tensors' channels here
    hf = {**cfg.hf, **local.pop("hf", {})}
    kinds = getattr(model, "layer_kinds_from", None)
    local = dataclasses.replace(cfg, **local, hf=hf, layer_kinds=kinds(hf) if kinds else cfg.layer_kinds)
    # weights kept in blocks are found by their linear's path, which the wrappers lengthened
    moved = {
        sharder.paths[id(m)]: name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and id(m) in sharder.paths
    }
    model.block_weights = {
        f"{moved.get(k.removesuffix('.weight'), k.removesuffix('.weight'))}.weight": v
        for k, v in sharder.blocks.items()
    }
    model.cfg, model.tp = local, tp
    return local


def _shard_vocab(model: nn.Module, cfg: TextModelConfig, sharder: Sharder) -> None:
    tp = sharder.tp
    name = "embeddings" if hasattr(model, "embeddings") else "embed_tokens"  # Nemotron-H's name
    shard = -(-cfg.vocab_size // tp.size)
    vocab = range(min(tp.rank * shard, cfg.vocab_size), min((tp.rank + 1) * shard, cfg.vocab_size))
    rows = torch.arange(vocab.start, vocab.stop)
    embed = getattr(model, name)
    key = f"{name}.weight"
    from baton.parallel.pipeline import StageInput

    if isinstance(embed, StageInput):  # a later pipeline stage: no table here
        embed = None
    if model.lm_head is None:  # tied: the head gets its own copy of this rank's rows
        head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device="meta")
        sharder.paths[id(head)] = "lm_head"
        if key in sharder.blocks:
            sharder.blocks["lm_head.weight"] = sharder.blocks[key]
        else:
            head.weight = embed.weight
        model.lm_head = head
    model.lm_head = VocabParallelHead(sharder.take_rows(model.lm_head, rows), cfg.vocab_size, shard, tp)
    if embed is None:
        return
    if key in sharder.blocks:
        bt = sharder.blocks.pop(key)
        inner: nn.Module = BlockEmbedding(BlockTensor(bt.qtype, bt.blocks[rows].contiguous()))
    else:
        inner = nn.Embedding.from_pretrained(embed.weight.data[rows].clone(), freeze=True)
    setattr(model, name, VocabParallelEmbedding(inner, vocab, tp))
