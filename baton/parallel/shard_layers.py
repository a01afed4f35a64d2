"""How each kind of layer splits over tensor-parallel ranks: attention and latent attention by
query heads (KV heads divided or replicated), the recurrent mixers (Gated DeltaNet, Kimi Delta
Attention, Mamba2) by their heads with the conv channels and state that go with them, LFM2's short
convolutions by channels, dense MLPs
by columns, MoE by experts. Each rule updates `local`, the config fields of this rank's part, and
a recurrent mixer records which channels of each state tensor's first dimension this rank holds
(`state_channels`: what a KV span's state splits into)."""

from __future__ import annotations

import torch
from torch import nn

from baton.models.glm5_flash import HyperConnection
from baton.models.kimi_linear import KimiDeltaAttention
from baton.models.lfm2 import ShortConv
from baton.models.llama import Attention, GatedMLP
from baton.models.mamba2 import Mamba2Mixer
from baton.models.mla import MLAttention
from baton.models.model_config import TextModelConfig
from baton.models.moe import MLP, ExpertElsewhere, GroupedSigmoidMoE, SparseMoE
from baton.models.nemotron_h import NemotronHMoE, NoPEAttention, Relu2MLP
from baton.models.qwen3_next import GatedAttention, GatedDeltaNet
from baton.parallel.shard import RowParallel, Sharder, even_split, head_split

_MLPS = (GatedMLP, MLP, Relu2MLP)
_MOES = (SparseMoE, GroupedSigmoidMoE, NemotronHMoE)


def shard_layer(layer: nn.Module, cfg: TextModelConfig, local: dict, sharder: Sharder) -> None:
    for name, child in list(layer.named_children()):
        rule = next((r for cls, r in _RULES.items() if isinstance(child, cls)), None)
        if rule is not None:
            rule(child, local, sharder)
        elif isinstance(child, _MOES):
            _shard_moe(child, sharder)
            setattr(layer, name, RowParallel(child, sharder.tp))
        elif isinstance(child, _MLPS):
            _shard_mlp(child, sharder)
            setattr(layer, name, RowParallel(child, sharder.tp))
            if isinstance(child, GatedMLP):  # the width of cfg.intermediate_size (fused decode reads it)
                local["intermediate_size"] = child.down_proj.in_features
        elif isinstance(child, HyperConnection):  # per-token math on the whole hidden state: replicated
            continue
        elif _has_linear(child):
            raise ValueError(f"tensor parallelism does not split {type(child).__name__} layers")


def _has_linear(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Linear) for m in module.modules())


def _rows(heads: range, width: int, offset: int = 0) -> torch.Tensor:
    return torch.arange(offset + heads.start * width, offset + heads.stop * width)


def _param(t: torch.Tensor, index: torch.Tensor | slice) -> nn.Parameter:
    return nn.Parameter(t.data[index].clone(), requires_grad=False)


def _out_proj(sharder: Sharder, linear: nn.Linear, cols: range) -> RowParallel:
    return RowParallel(sharder.take_cols(linear, cols, keep_bias=sharder.tp.rank == 0), sharder.tp)


def _attention(attn: Attention, local: dict, sharder: Sharder) -> None:
    """Llama's: fused qkv rows [q heads | k heads | v heads]."""
    tp, d = sharder.tp, attn.head_dim
    q, kv = head_split(attn.num_heads, attn.num_kv_heads, tp.size, tp.rank)
    q_size, kv_size, _ = attn.sizes
    rows = torch.cat([_rows(q, d), _rows(kv, d, q_size), _rows(kv, d, q_size + kv_size)])
    attn.qkv_proj = sharder.take_rows(attn.qkv_proj, rows)
    attn.o_proj = _out_proj(sharder, attn.o_proj, range(q.start * d, q.stop * d))
    attn.num_heads, attn.num_kv_heads = len(q), len(kv)
    attn.sizes = (len(q) * d, len(kv) * d, len(kv) * d)
    local.update(num_heads=len(q), num_kv_heads=len(kv))


def _separate_attention(attn: nn.Module, local: dict, sharder: Sharder) -> None:
    """q, k and v projections apart: Qwen3-Next's gated attention (q_proj holds each head's query
    and output gate, 2 d rows per head) and Nemotron-H's NoPE attention."""
    tp, d = sharder.tp, attn.head_dim
    q, kv = head_split(attn.num_heads, attn.num_kv_heads, tp.size, tp.rank)
    per_q = 2 * d if isinstance(attn, GatedAttention) else d
    attn.q_proj = sharder.take_rows(attn.q_proj, _rows(q, per_q))
    attn.k_proj = sharder.take_rows(attn.k_proj, _rows(kv, d))
    attn.v_proj = sharder.take_rows(attn.v_proj, _rows(kv, d))
    attn.o_proj = _out_proj(sharder, attn.o_proj, range(q.start * d, q.stop * d))
    attn.num_heads, attn.num_kv_heads = len(q), len(kv)
    local.update(num_heads=len(q), num_kv_heads=len(kv))


def _latent_attention(mla: MLAttention, local: dict, sharder: Sharder) -> None:
    """The latent and its norm are every head's (replicated, as is its cache); the query, the
    latent's expansion kv_b_proj and o split by heads."""
    heads = even_split(mla.num_heads, sharder.tp.size, sharder.tp.rank)
    q_width = mla.dn + mla.dr
    if hasattr(mla, "q_proj"):
        mla.q_proj = sharder.take_rows(mla.q_proj, _rows(heads, q_width))
    else:
        mla.q_b_proj = sharder.take_rows(mla.q_b_proj, _rows(heads, q_width))
    mla.kv_b_proj.weight = _param(mla.kv_b_proj.weight, _rows(heads, mla.dn + mla.dv))
    mla.o_proj = _out_proj(sharder, mla.o_proj, range(heads.start * mla.dv, heads.stop * mla.dv))
    mla.num_heads = len(heads)
    local.update(num_heads=len(heads))


def _even_heads(n: int, what: str, sharder: Sharder) -> range:
    if n % sharder.tp.size:
        raise ValueError(f"{n} {what} do not split over {sharder.tp.size} ranks")
    return even_split(n, sharder.tp.size, sharder.tp.rank)


def _gated_delta_net(gdn: GatedDeltaNet, local: dict, sharder: Sharder) -> None:
    """By key heads, each with its r = vh / kh value heads: in_proj_qkvz's rows are
    [q | k | v | z], in_proj_ba's [b | a], the conv channels [q | k | v], the state per value head."""
    kh = _even_heads(gdn.kh, "Gated DeltaNet key heads", sharder)
    r, dk, dv = gdn.vh // gdn.kh, gdn.dk, gdn.dv
    vh = range(kh.start * r, kh.stop * r)
    channels = torch.cat([_rows(kh, dk), _rows(kh, dk, gdn.key_dim), _rows(vh, dv, 2 * gdn.key_dim)])
    gdn.in_proj_qkvz = sharder.take_rows(gdn.in_proj_qkvz, torch.cat([channels, _rows(vh, dv, gdn.conv_dim)]))
    gdn.in_proj_ba = sharder.take_rows(gdn.in_proj_ba, torch.cat([_rows(vh, 1), _rows(vh, 1, gdn.vh)]))
    gdn.conv1d.weight = _param(gdn.conv1d.weight, channels)
    gdn.dt_bias, gdn.A_log = _param(gdn.dt_bias, slice(vh.start, vh.stop)), _param(gdn.A_log, slice(vh.start, vh.stop))
    gdn.out_proj = _out_proj(sharder, gdn.out_proj, range(vh.start * dv, vh.stop * dv))
    gdn.kh, gdn.vh = len(kh), len(vh)
    gdn.key_dim, gdn.value_dim = len(kh) * dk, len(vh) * dv
    gdn.conv_dim = 2 * gdn.key_dim + gdn.value_dim
    local.setdefault("hf", {}).update(linear_num_key_heads=len(kh), linear_num_value_heads=len(vh))
    local.setdefault("state_channels", {})[gdn.layer_id] = [channels, torch.arange(vh.start, vh.stop)]


def _kimi_delta_attention(kda: KimiDeltaAttention, local: dict, sharder: Sharder) -> None:
    """By heads: in_proj's rows are q | k | v (heads x dim each) | f_a | g_a (low rank, every
    head's) | b (one per head); the conv channels [q | k | v]; gates and decays per head."""
    h, d = kda.heads, kda.dim
    heads = _even_heads(h, "Kimi Delta Attention heads", sharder)
    hd = h * d
    qkv = torch.cat([_rows(heads, d), _rows(heads, d, hd), _rows(heads, d, 2 * hd)])
    low_rank = torch.arange(3 * hd, 3 * hd + 2 * d)
    kda.in_proj = sharder.take_rows(kda.in_proj, torch.cat([qkv, low_rank, _rows(heads, 1, 3 * hd + 2 * d)]))
    kda.conv_weight = _param(kda.conv_weight, qkv)
    kda.f_b_proj = sharder.take_rows(kda.f_b_proj, _rows(heads, d))
    kda.g_b_proj = sharder.take_rows(kda.g_b_proj, _rows(heads, d))
    kda.dt_bias = _param(kda.dt_bias, _rows(heads, d))
    kda.A_log = _param(kda.A_log, slice(heads.start, heads.stop))
    kda.o_proj = _out_proj(sharder, kda.o_proj, range(heads.start * d, heads.stop * d))
    kda.heads = len(heads)
    kda.in_rows = {**kda.in_rows, "q_proj": len(heads) * d, "k_proj": len(heads) * d, "v_proj": len(heads) * d}
    kda.in_rows["b_proj"] = len(heads)
    lin = {**(sharder.model.cfg.hf.get("linear_attn_config") or {}), "num_heads": len(heads)}
    local.setdefault("hf", {}).update(linear_attn_config=lin, linear_num_heads=len(heads))
    local.setdefault("state_channels", {})[kda.layer_id] = [qkv, torch.arange(heads.start, heads.stop)]


def _mamba2(mixer: Mamba2Mixer, local: dict, sharder: Sharder) -> None:
    """By groups of heads (the gated norm is per group): in_proj's rows are z | x | B | C | dt, the
    conv channels x | B | C, the state and dt, A, D per head."""
    nh, p, g, n = mixer.nh, mixer.p, mixer.g, mixer.n
    groups = _even_heads(g, "Mamba2 groups", sharder)
    per = nh // g
    heads = range(groups.start * per, groups.stop * per)
    inner = nh * p
    x_rows, bc = _rows(heads, p), torch.cat([_rows(groups, n, inner), _rows(groups, n, inner + g * n)])
    conv = torch.cat([x_rows, bc])
    z_rows = _rows(heads, p)
    mixer.in_proj = sharder.take_rows(
        mixer.in_proj, torch.cat([z_rows, conv + inner, _rows(heads, 1, inner + mixer.conv_dim)])
    )
    mixer.conv1d.weight = _param(mixer.conv1d.weight, conv)
    if mixer.conv1d.bias is not None:
        mixer.conv1d.bias = _param(mixer.conv1d.bias, conv)
    for name in ("dt_bias", "A_log", "D"):
        setattr(mixer, name, _param(getattr(mixer, name), slice(heads.start, heads.stop)))
    if mixer.norm_mode != "none":
        mixer.norm.weight = _param(mixer.norm.weight, x_rows)
    mixer.out_proj = _out_proj(sharder, mixer.out_proj, range(heads.start * p, heads.stop * p))
    mixer.nh, mixer.g = len(heads), len(groups)
    mixer.inner = len(heads) * p
    mixer.conv_dim = mixer.inner + 2 * len(groups) * n
    local.setdefault("hf", {}).update(
        mamba_num_heads=len(heads),
        mamba_n_heads=len(heads),
        n_groups=len(groups),
        mamba_n_groups=len(groups),
        mamba_d_ssm=mixer.inner,  # Falcon-H1's
    )
    local.setdefault("state_channels", {})[mixer.layer_id] = [conv, torch.arange(heads.start, heads.stop)]


def _short_conv(conv: ShortConv, local: dict, sharder: Sharder) -> None:
    """By channels: in_proj's rows are B | C | x, each a channel's; the conv, its window and
    out_proj's columns go with them."""
    tp, hidden = sharder.tp, conv.channels
    mine = even_split(hidden, tp.size, tp.rank)
    channels = torch.arange(mine.start, mine.stop)
    conv.in_proj = sharder.take_rows(conv.in_proj, torch.cat([channels, channels + hidden, channels + 2 * hidden]))
    conv.conv.weight = _param(conv.conv.weight, channels)
    if conv.conv.bias is not None:
        conv.conv.bias = _param(conv.conv.bias, channels)
    conv.out_proj = _out_proj(sharder, conv.out_proj, mine)
    conv.channels = len(channels)
    local.setdefault("hf", {}).update(conv_channels=len(channels))
    local.setdefault("state_channels", {})[conv.layer_id] = [channels]


def _shard_mlp(mlp: nn.Module, sharder: Sharder) -> None:
    """Column-parallel in, row-parallel out; a gated MLP's gate_up rows are [gate | up]."""
    tp = sharder.tp
    inter = mlp.down_proj.in_features
    cols = even_split(inter, tp.size, tp.rank)
    rows = torch.arange(cols.start, cols.stop)
    if hasattr(mlp, "gate_up_proj"):
        mlp.gate_up_proj = sharder.take_rows(mlp.gate_up_proj, torch.cat([rows, rows + inter]))
    else:
        mlp.up_proj = sharder.take_rows(mlp.up_proj, rows)
    mlp.down_proj = sharder.take_cols(mlp.down_proj, cols, keep_bias=tp.rank == 0)


def _shard_moe(moe: nn.Module, sharder: Sharder) -> None:
    """Each rank runs its share of the experts on the tokens routed to them (the router itself is
    replicated: every rank routes alike); the shared expert is split like a dense MLP. A latent
    MoE's projection out of the latent is linear: each rank's partial sum goes through it, with the
    bias added once."""
    tp = sharder.tp
    mine = even_split(len(moe.experts), tp.size, tp.rank)
    for e in range(len(moe.experts)):
        if e not in mine:
            moe.experts[e] = ExpertElsewhere()
    shared = getattr(moe, "shared_expert", None) or getattr(moe, "shared_experts", None)
    if shared is not None:
        _shard_mlp(shared, sharder)
    fc2 = getattr(moe, "fc2_latent_proj", None)
    if fc2 is not None and fc2.bias is not None and tp.rank != 0:
        fc2.bias.data.zero_()


_RULES = {
    Attention: _attention,
    GatedAttention: _separate_attention,
    NoPEAttention: _separate_attention,
    MLAttention: _latent_attention,
    GatedDeltaNet: _gated_delta_net,
    KimiDeltaAttention: _kimi_delta_attention,
    Mamba2Mixer: _mamba2,
    ShortConv: _short_conv,
}
