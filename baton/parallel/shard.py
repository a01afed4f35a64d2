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

import torch
import torch.nn.functional as F
from torch import nn

from baton.models.gguf_blocks import BLOCK_FORMATS, BlockTensor
from baton.models.layers import BlockEmbedding
from baton.models.llama import Attention, GatedMLP, LlamaForCausalLM
from baton.models.model_config import TextModelConfig
from baton.models.moe import MLP, ExpertElsewhere, GroupedSigmoidMoE, SparseMoE
from baton.models.qwen3_next import GatedAttention, GatedDeltaNet
from baton.models.qwen3_next import layer_kinds as qwen3_next_layer_kinds
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


def kv_head_shares(cfg: TextModelConfig, size: int) -> list[range]:
    """Each rank's KV heads of the attention layers (what a KV span's heads split into)."""
    return [head_split(cfg.num_heads, cfg.num_kv_heads, size, r)[1] for r in range(size)]


def _rows(heads: range, head_dim: int, offset: int = 0) -> torch.Tensor:
    return torch.arange(offset + heads.start * head_dim, offset + heads.stop * head_dim)


class Sharder:
    """Slices one model's linears in place; knows where each weight lives (dense, or in blocks)."""

    def __init__(self, model: nn.Module, tp: TPGroup) -> None:
        self.model, self.tp = model, tp
        self.blocks: dict[str, BlockTensor] = getattr(model, "block_weights", {})
        self.paths = {id(m): name for name, m in model.named_modules()}

    def take_rows(self, linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
        key = f"{self.paths[id(linear)]}.weight"
        bias = None if linear.bias is None else linear.bias.data[rows]
        if key in self.blocks:
            bt = self.blocks[key]
            self.blocks[key] = BlockTensor(bt.qtype, bt.blocks[rows].contiguous())
            return self._replace(linear, None, bias, in_features=linear.in_features, out_features=len(rows))
        return self._replace(linear, linear.weight.data[rows], bias)

    def take_cols(self, linear: nn.Linear, cols: range, keep_bias: bool) -> nn.Linear:
        key = f"{self.paths[id(linear)]}.weight"
        bias = linear.bias.data.clone() if linear.bias is not None and keep_bias else None
        if linear.bias is not None and not keep_bias:
            bias = torch.zeros_like(linear.bias.data)  # added once, by rank 0, before the sum
        if key in self.blocks:
            bt = self.blocks.pop(key)
            values, _ = BLOCK_FORMATS[bt.qtype]
            if cols.start % values == 0 and cols.stop % values == 0:
                self.blocks[key] = BlockTensor(bt.qtype, bt.blocks[:, cols.start // values : cols.stop // values])
                self.blocks[key].blocks = self.blocks[key].blocks.contiguous()
                return self._replace(linear, None, bias, in_features=len(cols), out_features=linear.out_features)
            logger.info("%s: %s columns %s are not whole blocks; kept as float32", key, bt.qtype, cols)
            return self._replace(linear, bt.dequantize()[:, cols.start : cols.stop], bias)
        return self._replace(linear, linear.weight.data[:, cols.start : cols.stop], bias)

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


class RowParallel(nn.Module):
    """A module whose output is this rank's partial sum: summed over the ranks after it."""

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
    sharder = Sharder(model, tp)
    local = _shard_vocab(model, cfg, sharder)
    for layer in list(model.layers) + list(getattr(model, "mtp", [])):
        layer = getattr(layer, "block", layer)  # an MTP layer's decoder block
        local = _shard_layer(layer, cfg, local, sharder)
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
    if type(model).forward is not LlamaForCausalLM.forward:  # its own one-call decode step sums nothing
        model.fused_decode = False
    return local


def _shard_vocab(model: nn.Module, cfg: TextModelConfig, sharder: Sharder) -> TextModelConfig:
    tp = sharder.tp
    shard = -(-cfg.vocab_size // tp.size)
    vocab = range(min(tp.rank * shard, cfg.vocab_size), min((tp.rank + 1) * shard, cfg.vocab_size))
    rows = torch.arange(vocab.start, vocab.stop)
    embed = model.embed_tokens
    key = "embed_tokens.weight"
    if model.lm_head is None:  # tied: the head gets its own copy of this rank's rows
        head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device="meta")
        sharder.paths[id(head)] = "lm_head"
        if key in sharder.blocks:
            sharder.blocks["lm_head.weight"] = sharder.blocks[key]
        else:
            head.weight = embed.weight
        model.lm_head = head
    model.lm_head = VocabParallelHead(sharder.take_rows(model.lm_head, rows), cfg.vocab_size, shard, tp)
    if key in sharder.blocks:
        bt = sharder.blocks.pop(key)
        inner: nn.Module = BlockEmbedding(BlockTensor(bt.qtype, bt.blocks[rows].contiguous()))
    else:
        inner = nn.Embedding.from_pretrained(embed.weight.data[rows].clone(), freeze=True)
    model.embed_tokens = VocabParallelEmbedding(inner, vocab, tp)
    return cfg


def _shard_layer(layer: nn.Module, cfg: TextModelConfig, local: TextModelConfig, sharder: Sharder) -> TextModelConfig:
    attn = getattr(layer, "self_attn", None)
    if isinstance(attn, Attention):
        local = _shard_attention(attn, local, sharder)
    elif isinstance(attn, GatedAttention):
        local = _shard_gated_attention(attn, local, sharder)
    elif attn is not None:
        raise ValueError(f"tensor parallelism does not split {type(attn).__name__} layers yet")
    if isinstance(getattr(layer, "linear_attn", None), GatedDeltaNet):
        local = _shard_gated_delta_net(layer.linear_attn, local, sharder)
    mlp = getattr(layer, "mlp", None)
    if isinstance(mlp, (GatedMLP, MLP)):
        inter = mlp.down_proj.in_features
        _shard_gated_mlp(mlp, sharder)
        if inter == cfg.intermediate_size:
            local = dataclasses.replace(local, intermediate_size=mlp.down_proj.in_features)
        layer.mlp = RowParallel(mlp, sharder.tp)
    elif isinstance(mlp, (SparseMoE, GroupedSigmoidMoE)):
        _shard_moe(mlp, sharder)
        layer.mlp = RowParallel(mlp, sharder.tp)
    elif mlp is not None:
        raise ValueError(f"tensor parallelism does not split {type(mlp).__name__} yet")
    return local


def _shard_attention(attn: Attention, local: TextModelConfig, sharder: Sharder) -> TextModelConfig:
    tp, d = sharder.tp, attn.head_dim
    q, kv = head_split(attn.num_heads, attn.num_kv_heads, tp.size, tp.rank)
    q_size, kv_size, _ = attn.sizes
    rows = torch.cat([_rows(q, d), _rows(kv, d, q_size), _rows(kv, d, q_size + kv_size)])
    attn.qkv_proj = sharder.take_rows(attn.qkv_proj, rows)
    attn.o_proj = RowParallel(sharder.take_cols(attn.o_proj, range(q.start * d, q.stop * d), tp.rank == 0), tp)
    attn.num_heads, attn.num_kv_heads = len(q), len(kv)
    attn.sizes = (len(q) * d, len(kv) * d, len(kv) * d)
    return dataclasses.replace(local, num_heads=len(q), num_kv_heads=len(kv))


def _shard_gated_attention(attn: GatedAttention, local: TextModelConfig, sharder: Sharder) -> TextModelConfig:
    """Qwen3-Next's: q_proj holds each head's query and output gate, [2 d] rows per head."""
    tp, d = sharder.tp, attn.head_dim
    q, kv = head_split(attn.num_heads, attn.num_kv_heads, tp.size, tp.rank)
    attn.q_proj = sharder.take_rows(attn.q_proj, _rows(q, 2 * d))
    attn.k_proj = sharder.take_rows(attn.k_proj, _rows(kv, d))
    attn.v_proj = sharder.take_rows(attn.v_proj, _rows(kv, d))
    attn.o_proj = RowParallel(sharder.take_cols(attn.o_proj, range(q.start * d, q.stop * d), tp.rank == 0), tp)
    attn.num_heads, attn.num_kv_heads = len(q), len(kv)
    return dataclasses.replace(local, num_heads=len(q), num_kv_heads=len(kv))


def _shard_gated_delta_net(gdn: GatedDeltaNet, local: TextModelConfig, sharder: Sharder) -> TextModelConfig:
    """Split by key heads, each with its r = vh / kh value heads: the projections' rows are laid
    out per key head, the conv channels as [q | k | v], the state per value head."""
    tp = sharder.tp
    if gdn.kh % tp.size:
        raise ValueError(f"{gdn.kh} Gated DeltaNet key heads do not split over {tp.size} ranks")
    kh = even_split(gdn.kh, tp.size, tp.rank)
    r, dk, dv = gdn.vh // gdn.kh, gdn.dk, gdn.dv
    vh = range(kh.start * r, kh.stop * r)
    gdn.in_proj_qkvz = sharder.take_rows(gdn.in_proj_qkvz, _rows(kh, 2 * dk + 2 * r * dv))
    gdn.in_proj_ba = sharder.take_rows(gdn.in_proj_ba, _rows(kh, 2 * r))
    channels = torch.cat([_rows(kh, dk), _rows(kh, dk, gdn.key_dim), _rows(vh, dv, 2 * gdn.key_dim)])
    gdn.conv1d.weight = nn.Parameter(gdn.conv1d.weight.data[channels].clone(), requires_grad=False)
    gdn.dt_bias = nn.Parameter(gdn.dt_bias.data[vh.start : vh.stop].clone(), requires_grad=False)
    gdn.A_log = nn.Parameter(gdn.A_log.data[vh.start : vh.stop].clone(), requires_grad=False)
    gdn.out_proj = RowParallel(sharder.take_cols(gdn.out_proj, range(vh.start * dv, vh.stop * dv), tp.rank == 0), tp)
    gdn.kh, gdn.vh = len(kh), len(vh)
    gdn.key_dim, gdn.value_dim = len(kh) * dk, len(vh) * dv
    gdn.conv_dim = 2 * gdn.key_dim + gdn.value_dim
    hf = {**local.hf, "linear_num_key_heads": len(kh), "linear_num_value_heads": len(vh)}
    return dataclasses.replace(local, hf=hf, layer_kinds=qwen3_next_layer_kinds(hf))


def _shard_gated_mlp(mlp: nn.Module, sharder: Sharder) -> None:
    """gate_up's rows are [gate | up]: this rank's columns of each; down's matching inputs."""
    inter = mlp.down_proj.in_features
    cols = even_split(inter, sharder.tp.size, sharder.tp.rank)
    rows = torch.cat([torch.arange(cols.start, cols.stop), torch.arange(inter + cols.start, inter + cols.stop)])
    mlp.gate_up_proj = sharder.take_rows(mlp.gate_up_proj, rows)
    mlp.down_proj = sharder.take_cols(mlp.down_proj, cols, keep_bias=sharder.tp.rank == 0)


def _shard_moe(moe: nn.Module, sharder: Sharder) -> None:
    """Each rank runs its share of the experts on the tokens routed to them (the router itself is
    replicated: every rank routes alike); the shared expert is split like a dense MLP."""
    tp = sharder.tp
    mine = even_split(len(moe.experts), tp.size, tp.rank)
    for e in range(len(moe.experts)):
        if e not in mine:
            moe.experts[e] = ExpertElsewhere()
    shared = getattr(moe, "shared_expert", None) or getattr(moe, "shared_experts", None)
    if shared is not None:
        _shard_gated_mlp(shared, sharder)
