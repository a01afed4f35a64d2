"""Multi-head latent attention (DeepSeek-V2 shapes): the paged cache holds one normalized latent c
[R] and one key part kr [dr] shared by every head per token; kr carries rotary (DeepSeek) or not
(NoPE: Kimi Linear). A layer with a sparse-attention indexer (baton/models/indexer.py) keeps its
indexer key after them in the same row, and each query attends to the keys its indexer selects.

Prefill expands the context's latents through kv_b_proj into per-head K_nope and V and runs
causal attention over KV tiles; decode absorbs W_UK into the query and W_UV into the output, so
it reads only the cached latents (of the selected keys, with an indexer)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from baton.kv.storage import LayerKV
from baton.models.fused_decode import StepBinding, linear_args, packed_only, plain_float32
from baton.models.indexer import Indexer, PooledIndexer
from baton.models.layers import GroupAttnMetadata, KVTile, PrefillSeq, RMSNorm, unwrapped
from baton.models.model_config import TextModelConfig
from baton.models.rope import apply_rotary, yarn_mscale
from baton.ops import ops

LATENT_NORM_EPS = 1e-6  # kv_a_layernorm / q_a_layernorm are built without eps: the class default


Rope = tuple[torch.Tensor, torch.Tensor]


class MLAttention(nn.Module):
    """`rotary`: kr and each head's rope part of q carry rotary (half-split: an interleaved
    checkpoint's rows are reordered at load), the softmax scale yarn's mscale^2 where the rope is
    yarn with mscale_all_dim. `indexer`: "full" where the layer's own sparse-attention indexer
    selects the keys each query reads, "pooled" where its pooled indexer does (GLM-5.3-Flash, its
    caches at `pool_layers`), "shared" where it reads the keys the last indexer layer before it
    selected in this step (GLM-5), "none" where every query reads every earlier key."""

    def __init__(
        self,
        cfg: TextModelConfig,
        layer_id: int,
        rotary: bool = False,
        indexer: str = "none",
        latent_eps: float = LATENT_NORM_EPS,
        pool_layers: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        hf = cfg.hf
        self.layer_id = layer_id
        self.num_heads = cfg.num_heads
        self.rank = int(hf.get("kv_lora_rank", 512))
        self.dn = int(hf.get("qk_nope_head_dim", 128))
        self.dr = int(hf.get("qk_rope_head_dim", 64))
        self.dv = int(hf.get("v_head_dim") or 128)
        self.scale = (self.dn + self.dr) ** -0.5
        self.rotary = rotary
        rope = cfg.rope["full"]
        if rotary and rope.rope_type == "yarn" and rope.mscale_all_dim:
            self.scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
        h, q_out, bias = cfg.hidden_size, self.num_heads * (self.dn + self.dr), bool(hf.get("attention_bias", False))
        q_lora = hf.get("q_lora_rank")
        if q_lora:
            self.q_a_proj = nn.Linear(h, int(q_lora), bias=bias)
            self.q_a_layernorm = RMSNorm(int(q_lora), latent_eps)
            self.q_b_proj = nn.Linear(int(q_lora), q_out, bias=False)
        else:
            self.q_proj = nn.Linear(h, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.dr, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, latent_eps)
        # A plain parameter, not an nn.Linear: pack_linears leaves it dense, since decode reads its
        # per-head W_UK / W_UV blocks and prefill expands latents through it.
        self.kv_b_proj = nn.Module()
        self.kv_b_proj.weight = nn.Parameter(torch.empty(self.num_heads * (self.dn + self.dv), self.rank))
        self.o_proj = nn.Linear(self.num_heads * self.dv, h, bias=bias)
        if indexer in ("full", "pooled") and not q_lora:
            raise ValueError("a sparse-attention indexer reads the q_lora residual: q_lora_rank must be set")
        self.indexer: Indexer | None = None
        if indexer == "full":
            self.indexer = Indexer(cfg, int(q_lora), self.dr)
        elif indexer == "pooled":
            self.indexer = PooledIndexer(cfg, int(q_lora), *pool_layers)
        self.topk = None if indexer == "none" else int(hf.get("index_topk", 2048))  # None: dense
        self.pool = self.indexer.pool if isinstance(self.indexer, PooledIndexer) else 1
        self.latent = self.rank + self.dr  # a cache row: the latent, then the indexer key (if any)

    def decode_step(self, binding: StepBinding):
        """This attention as a fused decoder's step for decode rows (baton/ops/mla_layer.cpp); None
        unless its projections run on the packed kernels, kv_b_proj's weight (the absorbed
        einsum's very operand, never packed) is float32 and the KV cache float32 or fp8."""
        o_proj = unwrapped(self.o_proj)
        lora = not hasattr(self, "q_proj")
        cache = binding.storage.layer_kv(self.layer_id)
        if not packed_only(self, o_proj) or not plain_float32(self.kv_b_proj.weight) or not _step_cache(cache):
            return None
        index = self.indexer
        pooled = pooled_indexer_args(index, binding) if isinstance(index, PooledIndexer) else {}
        if pooled is None:
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
            latent_eps=self.kv_a_layernorm.eps,
            rope=binding.rope("full") if self.rotary else -1,
            topk=self.topk or 0,
            selection=binding.selection if self.topk else None,
            **linear_args("q_proj", None if lora else self.q_proj),
            **linear_args("q_a", self.q_a_proj if lora else None),
            q_a_norm=self.q_a_layernorm.weight if lora else None,
            **linear_args("q_b", self.q_b_proj if lora else None),
            **linear_args("kv_a", self.kv_a_proj_with_mqa),
            kv_a_norm=self.kv_a_layernorm.weight,
            kv_b=self.kv_b_proj.weight,
            **linear_args("o_proj", o_proj),
            **({} if index is None else indexer_args(index)),
            **pooled,
            k_cache=cache.k,
            k_scale=cache.k_scale,
            group=binding.kv_group(self.layer_id),
        )

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, dn, R] and W_UV [H, dv, R]: views of kv_b_proj's weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.dn + self.dv, self.rank)
        return w[:, : self.dn], w[:, self.dn :]

    def forward(self, x: torch.Tensor, ctx, rope: Rope | None = None) -> torch.Tensor:
        n = x.shape[0]
        q_resid = self.q_a_layernorm(self.q_a_proj(x)) if hasattr(self, "q_a_proj") else None
        q = self.q_proj(x) if q_resid is None else self.q_b_proj(q_resid)
        q = q.view(n, self.num_heads, self.dn + self.dr)
        ckv = self.kv_a_proj_with_mqa(x)
        k_rot = ckv[:, None, self.rank :]
        if self.rotary:
            q[..., self.dn :] = apply_rotary(q[..., self.dn :], *rope)
            k_rot = apply_rotary(k_rot.contiguous(), *rope)
        parts = [self.kv_a_layernorm(ckv[:, : self.rank].contiguous()), k_rot[:, 0]]
        cache, meta = ctx.for_layer(self.layer_id)  # K: [slots, 1, latent (+ indexer key)]; no V
        scoring = self.indexer is not None and self._scores(meta)  # else every key is read: no queries
        index = None
        if self.indexer is not None and self.pool == 1:
            parts.append(self.indexer.keys(x, rope if self.rotary else None).to(x.dtype))
            if scoring:
                index = self.indexer.queries(x, q_resid, rope if self.rotary else None)
        cache.write(meta.slot_mapping, torch.cat(parts, dim=-1)[:, None], None, meta.block_size)
        out = torch.empty((n, self.num_heads, self.dv), dtype=x.dtype)
        nd, chosen = meta.num_decodes, ctx.selection
        if isinstance(self.indexer, PooledIndexer):  # selects here, from its own caches
            chosen.clear()
            self.indexer.write_pools(x, ctx)
            if scoring:
                self.indexer.select_rows(ctx, *self.indexer.queries(x, q_resid, None), meta, chosen, x.dtype)
        if nd:
            out[:nd] = self._decode(
                q[:nd], cache, meta, None if index is None else (index[0][:nd], index[1][:nd]), chosen
            )
        for p in meta.prefills:
            rows = slice(p.q_start, p.q_end)
            chunk_index = None if index is None else (index[0][rows], index[1][rows])
            out[rows] = self._prefill(q[rows], meta.slot_mapping[rows], cache, p, meta.block_size, chunk_index, chosen)
        return self.o_proj(out.reshape(n, -1))

    def _scores(self, meta: GroupAttnMetadata) -> bool:
        """Whether a row of the step sees more than index_topk keys: a decode's context, or a
        prefill chunk's (its last row's)."""
        decode = meta.num_decodes and int(meta.decode_kv_lens.max()) > self.topk
        return bool(decode) or any(int(meta.kv_lens[p.q_end - 1]) > self.topk for p in meta.prefills)

    def _latents(self, cache: LayerKV, slots: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
        """Cached latents at `slots` (any shape) as [*slots.shape, R + dr]."""
        return cache.read_k(slots.reshape(-1), block_size, dtype).view(*slots.shape, -1)

    def _decode(
        self,
        q: torch.Tensor,
        cache: LayerKV,
        meta: GroupAttnMetadata,
        index: tuple[torch.Tensor, torch.Tensor] | None,
        chosen: dict,
    ) -> torch.Tensor:
        """Absorbed attention of single-token queries q [nd, H, dn + dr] over their cached latents;
        with an indexer (`index`: the rows' queries and head weights) over the latents it selects,
        which it leaves in `chosen` for the layers that share them."""
        bs, blocks = meta.block_size, meta.decode_block_ids
        lens, longest = meta.decode_kv_lens, int(meta.decode_kv_lens.max())
        sparse = self.topk is not None and longest > self.topk
        if sparse and index is None:  # chosen already (a pooled indexer, a shared layer): read only those
            pos, valid = chosen["decode"]
        else:
            pos = torch.arange(longest)[None, :] + meta.decode_kv_offsets[:, None]  # within the listed blocks
            valid = torch.arange(longest)[None, :] < lens[:, None]
        block = blocks.gather(1, (pos // bs).clamp(max=blocks.shape[1] - 1))
        slots = torch.where(valid, block * bs + pos % bs, 0)
        rows = self._latents(cache, slots, bs, q.dtype)  # [nd, L, R + dr (+ indexer key)]
        if sparse and index is not None:  # scored over every key: gather the selected rows
            scores = self.indexer.scores(*index, rows[..., self.latent :]).masked_fill(~valid, float("-inf"))
            top = scores.topk(self.topk, dim=-1).indices
            chosen["decode"] = pos.gather(1, top), valid.gather(1, top)
            rows, valid = rows.gather(1, top[..., None].expand(-1, -1, rows.shape[-1])), chosen["decode"][1]
        rows = rows[..., : self.latent]
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
        k_rot = latents[:, None, self.rank : self.latent].expand(t, h, self.dr)
        k = torch.cat((kv[..., : self.dn], k_rot), dim=-1)
        return _pad(k, width), _pad(kv[..., self.dn :], width)

    def _prefill(
        self,
        q: torch.Tensor,
        slots: torch.Tensor,
        cache: LayerKV,
        p: PrefillSeq,
        block_size: int,
        index: tuple[torch.Tensor, torch.Tensor] | None,
        chosen: dict,
    ) -> torch.Tensor:
        """A chunk's attention over its context, tile by tile merged by log-sum-exp (as layers'
        _prefill_attention): the latents are expanded one tile at a time. `slots`: where the chunk's
        own latents were written; `index`: the chunk's indexer queries and head weights, whose
        selection it leaves in `chosen` for the layers that share it."""
        width = max(self.dn + self.dr, self.dv)
        qh = _pad(q, width).transpose(0, 1)[None]  # [1, H, q, width]
        n = q.shape[0]
        context = n if p.kv_slots is None else p.kv_slots.shape[0]
        tiles, sparse = p.tiles, self.topk is not None and context > self.topk
        if p.kv_slots is None or sparse:
            # what the cache holds, as it rounds: the chunk's own rows, or (to score) the whole context
            src = self._latents(cache, slots if p.kv_slots is None else p.kv_slots, block_size, q.dtype)
            if sparse:
                if index is not None:
                    chosen[p.q_start] = self.indexer.prefill_selection(*index, src[:, self.latent :], context - n)
                tiles = _selected_tiles(tiles or [KVTile(0, context, None, None)], chosen[p.q_start])
            elif not tiles:
                k, v = self._expand(src, q.dtype, width)
                out = F.scaled_dot_product_attention(
                    qh, k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, scale=self.scale
                )
                return out[0].transpose(0, 1)[..., : self.dv]
        else:
            src = None

        def load(t: KVTile) -> tuple[torch.Tensor, torch.Tensor]:
            rows = (
                src[t.lo : t.hi]
                if src is not None
                else self._latents(cache, p.kv_slots[t.lo : t.hi], block_size, q.dtype)
            )
            k, v = self._expand(rows, q.dtype, width)
            return k.transpose(0, 1)[None], v.transpose(0, 1)[None]

        return tiled_attention(qh, tiles, load, self.scale)[0].transpose(0, 1)[..., : self.dv]


def _selected_tiles(tiles: list[KVTile], chosen: torch.Tensor) -> list[KVTile]:
    """The tiles masked to the keys `chosen` [q, context] (causal already) lets each query read."""
    out = []
    for t in tiles:
        allowed = chosen[:, t.lo : t.hi]
        mask = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill_(~allowed, float("-inf"))
        blind = ~allowed.any(dim=1)
        out.append(KVTile(t.lo, t.hi, mask, blind if bool(blind.any()) else None))
    return out


def indexer_args(index: Indexer) -> dict:
    """A per-token indexer's arguments to the MLA step."""
    return {
        "index_heads": index.heads,
        "index_dim": index.dim,
        **linear_args("index_wq_b", index.wq_b),
        **linear_args("index_wk", index.wk),
        **linear_args("index_weights", index.weights_proj),
        "index_k_norm": index.k_norm.weight,
        "index_k_norm_bias": index.k_norm.bias,
        "index_k_norm_eps": index.k_norm.eps,
    }


def pooled_indexer_args(index: PooledIndexer, binding: StepBinding) -> dict | None:
    """A pooled indexer's further arguments to the MLA step: its compression weights, its pooled-key
    cache and group, the open pool's window state; None where ape is not float32, the cache
    neither float32 nor fp8, or (a pool of more than one token) there is no state storage
    (packed_only checked the gate)."""
    pool_cache = binding.storage.layer_kv(index.pool_layer)
    ape = index.index_kpool_compress_ape
    if not plain_float32(ape) or not _step_cache(pool_cache) or (index.pool > 1 and binding.states is None):
        return None
    window = {}
    if index.pool > 1:
        (state,), (checkpoints,) = binding.states.layer(index.window_layer)
        window = {"window_state": state, "window_checkpoints": checkpoints}
    return {
        "index_pool": index.pool,
        "index_gate": index.index_kpool_compress_gate.packed,
        "index_ape": ape.contiguous(),
        "pool_cache": pool_cache.k,
        "pool_scale": pool_cache.k_scale,
        "pool_group": binding.kv_group(index.pool_layer),
        **window,
    }


def _step_cache(cache: LayerKV) -> bool:
    """A cache the MLA step reads: float32, or fp8 with its scales."""
    return cache.k.dtype in (torch.float32, torch.float8_e4m3fn)


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
