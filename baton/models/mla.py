"""Multi-head latent attention (DeepSeek-V2 shapes) without rotary, as in Kimi Linear: the paged
cache holds one normalized latent c [R] and one key part kr [dr] shared by every head per token.

Prefill expands the context's latents through kv_b_proj into per-head K_nope and V and runs
causal attention over KV tiles; decode absorbs W_UK into the query and W_UV into the output, so
it reads only the cached latents."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from baton.kv.storage import LayerKV
from baton.models.fused_decode import StepBinding, linear_args, packed_only, plain_float32
from baton.models.layers import GroupAttnMetadata, KVTile, PrefillSeq, RMSNorm, unwrapped
from baton.models.model_config import TextModelConfig
from baton.ops import ops

LATENT_NORM_EPS = 1e-6  # kv_a_layernorm / q_a_layernorm are built without eps: the class default


class MLAttention(nn.Module):
    def __init__(self, cfg: TextModelConfig, layer_id: int) -> None:
        super().__init__()
        hf = cfg.hf
        self.layer_id = layer_id
        self.num_heads = cfg.num_heads
        self.rank = int(hf.get("kv_lora_rank", 512))
        self.dn = int(hf.get("qk_nope_head_dim", 128))
        self.dr = int(hf.get("qk_rope_head_dim", 64))
        self.dv = int(hf.get("v_head_dim") or 128)
        self.scale = (self.dn + self.dr) ** -0.5
        h, q_out, bias = cfg.hidden_size, self.num_heads * (self.dn + self.dr), bool(hf.get("attention_bias", False))
        q_lora = hf.get("q_lora_rank")
        if q_lora:
            self.q_a_proj = nn.Linear(h, int(q_lora), bias=bias)
            self.q_a_layernorm = RMSNorm(int(q_lora), LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(int(q_lora), q_out, bias=False)
        else:
            self.q_proj = nn.Linear(h, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.dr, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        # A plain parameter, not an nn.Linear: pack_linears leaves it dense, since decode reads its
        # per-head W_UK / W_UV blocks and prefill expands latents through it.
        self.kv_b_proj = nn.Module()
        self.kv_b_proj.weight = nn.Parameter(torch.empty(self.num_heads * (self.dn + self.dv), self.rank))
        self.o_proj = nn.Linear(self.num_heads * self.dv, h, bias=bias)

    def decode_step(self, binding: StepBinding):
        """This attention as a fused decoder's step for decode rows (baton/ops/mla_layer.cpp); None
        unless its projections run on the packed kernels, kv_b_proj's weight (the absorbed
        einsum's very operand, never packed) is float32 and the latent cache is float32."""
        o_proj = unwrapped(self.o_proj)
        lora = not hasattr(self, "q_proj")
        cache = binding.storage.layer_kv(self.layer_id).k
        if not packed_only(self, o_proj) or not plain_float32(self.kv_b_proj.weight, cache):
            return None
        return ops().MlaStep(
            heads=self.num_heads,
            kv_lora_rank=self.rank,
            nope_dim=self.dn,
            rope_dim=self.dr,
            v_dim=self.dv,
            hidden=o_proj.out_features,
            q_lora_rank=self.q_a_proj.out_features if lora else 0,
            scale=self.scale,
            **linear_args("q_proj", None if lora else self.q_proj),
            **linear_args("q_a", self.q_a_proj if lora else None),
            q_a_norm=self.q_a_layernorm.weight if lora else None,
            **linear_args("q_b", self.q_b_proj if lora else None),
            **linear_args("kv_a", self.kv_a_proj_with_mqa),
            kv_a_norm=self.kv_a_layernorm.weight,
            kv_b=self.kv_b_proj.weight,
            **linear_args("o_proj", o_proj),
            k_cache=cache,
            group=binding.kv_group(self.layer_id),
        )

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, dn, R] and W_UV [H, dv, R]: views of kv_b_proj's weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.dn + self.dv, self.rank)
        return w[:, : self.dn], w[:, self.dn :]

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(n, self.num_heads, self.dn + self.dr)
        ckv = self.kv_a_proj_with_mqa(x)
        latent = torch.cat((self.kv_a_layernorm(ckv[:, : self.rank].contiguous()), ckv[:, self.rank :]), dim=-1)
        cache, meta = ctx.for_layer(self.layer_id)  # K: [slots, 1, R + dr]; no V
        cache.write(meta.slot_mapping, latent[:, None], None, meta.block_size)
        out = torch.empty((n, self.num_heads, self.dv), dtype=x.dtype)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], cache, meta)
        for p in meta.prefills:
            chunk = slice(p.q_start, p.q_end)
            out[chunk] = self._prefill(q[chunk], meta.slot_mapping[chunk], cache, p, meta.block_size)
        return self.o_proj(out.reshape(n, -1))

    def _latents(self, cache: LayerKV, slots: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
        """Cached latents at `slots` (any shape) as [*slots.shape, R + dr]."""
        return cache.read_k(slots.reshape(-1), block_size, dtype).view(*slots.shape, -1)

    def _decode(self, q: torch.Tensor, cache: LayerKV, meta: GroupAttnMetadata) -> torch.Tensor:
        """Absorbed attention of single-token queries q [nd, H, dn + dr] over their cached latents."""
        bs, blocks = meta.block_size, meta.decode_block_ids
        lens, longest = meta.decode_kv_lens, int(meta.decode_kv_lens.max())
        pos = torch.arange(longest)[None, :] + meta.decode_kv_offsets[:, None]  # within the listed blocks
        valid = torch.arange(longest)[None, :] < lens[:, None]
        block = blocks.gather(1, (pos // bs).clamp(max=blocks.shape[1] - 1))
        slots = torch.where(valid, block * bs + pos % bs, 0)
        rows = self._latents(cache, slots, bs, q.dtype)  # [nd, L, R + dr]
        w_uk, w_uv = self._absorbed()
        q_lat = torch.einsum("nhd,hdr->nhr", q[..., : self.dn], w_uk.to(q.dtype))
        scores = torch.einsum("nhc,nlc->nhl", torch.cat((q_lat, q[..., self.dn :]), dim=-1), rows) * self.scale
        scores = scores.float().masked_fill(~valid[:, None, :], float("-inf"))
        o_lat = torch.einsum("nhl,nlr->nhr", scores.softmax(-1).to(q.dtype), rows[..., : self.rank])
        return torch.einsum("nhr,hvr->nhv", o_lat, w_uv.to(q.dtype))

    def _expand(self, latents: torch.Tensor, dtype: torch.dtype, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [T, R + dr] -> K [T, H, dn + dr] and V [T, H, dv], zero-padded to `width` dims."""
        latents = latents.to(dtype)
        t, h = latents.shape[0], self.num_heads
        kv = F.linear(latents[:, : self.rank], self.kv_b_proj.weight.to(dtype)).view(t, h, self.dn + self.dv)
        k = torch.cat((kv[..., : self.dn], latents[:, None, self.rank :].expand(t, h, self.dr)), dim=-1)
        return _pad(k, width), _pad(kv[..., self.dn :], width)

    def _prefill(
        self,
        q: torch.Tensor,
        slots: torch.Tensor,
        cache: LayerKV,
        p: PrefillSeq,
        block_size: int,
    ) -> torch.Tensor:
        """A chunk's attention over its context, tile by tile merged by log-sum-exp (as layers'
        _prefill_attention): the latents are expanded one tile at a time. `slots`: where the chunk's
        own latents were written."""
        width = max(self.dn + self.dr, self.dv)
        qh = _pad(q, width).transpose(0, 1)[None]  # [1, H, q, width]
        if p.kv_slots is None:  # the chunk is the whole context: what the cache holds, as it rounds
            src = self._latents(cache, slots, block_size, q.dtype)
            if not p.tiles:
                k, v = self._expand(src, q.dtype, width)
                out = F.scaled_dot_product_attention(
                    qh, k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, scale=self.scale
                )
                return out[0].transpose(0, 1)[..., : self.dv]

        def load(t: KVTile) -> tuple[torch.Tensor, torch.Tensor]:
            rows = (
                src[t.lo : t.hi]
                if p.kv_slots is None
                else self._latents(cache, p.kv_slots[t.lo : t.hi], block_size, q.dtype)
            )
            k, v = self._expand(rows, q.dtype, width)
            return k.transpose(0, 1)[None], v.transpose(0, 1)[None]

        return tiled_attention(qh, p.tiles, load, self.scale)[0].transpose(0, 1)[..., : self.dv]


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad the last dim to `width` (the CPU flash kernel wants one head size for q, k and v;
    zeros in q and k leave the scores alone, zeros in v only add output dims that are dropped)."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def tiled_attention(
    qh: torch.Tensor,  # [1, heads, q, dim]
    tiles: list[KVTile],
    load: Callable[[KVTile], tuple[torch.Tensor, torch.Tensor]],  # a tile's K and V, [1, heads, t, dim]
    scale: float,
) -> torch.Tensor:
    """Attention over KV tiles, one flash call each, merged by log-sum-exp: [1, heads, q, dim]."""
    out = lse = None
    for t in tiles:
        kt, vt = load(t)
        mask = None if t.mask is None else t.mask.to(qh.dtype)
        tile_out, tile_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qh, kt, vt, attn_mask=mask, scale=scale
        )
        if t.blind_rows is not None:  # the kernel reports log-sum-exp 0 for a row that saw nothing
            tile_lse = tile_lse.masked_fill(t.blind_rows, float("-inf"))
        if out is None:
            out, lse = tile_out, tile_lse
            continue
        merged = torch.logaddexp(lse, tile_lse)
        out = out * (lse - merged).exp()[..., None] + tile_out * (tile_lse - merged).exp()[..., None]
        lse = merged
    return out
