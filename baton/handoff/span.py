"""KVSpan: one request's prompt KV as a self-describing value, independent of any worker's layout.

A span holds, per tensor, K or V for some model layers over a run of positions [start, n):
*grouped* spans carry one K and one V tensor per KV group (full groups from position 0, sliding
groups the last `window` positions); *dense* spans one K and one V tensor over all layers and all
positions, as a producer that knows nothing of groups would send. Axes are named by `layout`, a
permutation of "LTHD" (layer, token position, KV head, head dim).

Every span names a transfer id (random, 32 hex digits) and an expiry (unix seconds), signed with
the rest: an importer takes a transfer id at most once, and no span after its expiry, so a span
captured on the way cannot be replayed.

Recurrent layers travel as `state` tensors: per state group and state tensor (`index`), the state
of its layers after the whole prompt, [layers, *state shape] in float32, with `start` = n (the
position the state is at). MLA layers' K holds their latent per token and their V is empty.

An fp8 span (dtype float8_e4m3fn) carries, beside each K and V tensor, a `k_scale` / `v_scale` tensor
over the same layers and positions with a head dim of 1 (float32): a value is code * scale. Scales per
position rather than per block keep the span free of the exporter's block size; the importer
dequantizes, then writes in its own KV dtype (an fp8 receiver quantizes again into its own blocks,
exactly where scales are powers of two and block boundaries agree).

A tensor may say, per layer, where its real K/V begin (`layer_starts`, one entry per entry of
`layer_ids`, each >= `start`); positions before a layer's start are zeros and never read. A dense
export needs it: a sliding layer no longer holds the positions that fell out of its window (after a
prefix-cache hit or a chunked prefill), and an exporter sends only what it holds. The importer
requires full layers to start at 0 and sliding layers at or before the first position the next
query reads, and reads nothing earlier.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field

import numpy as np
import torch

from baton.kv.spec import KVGroup
from baton.models.model_config import TextModelConfig

AXES = "LTHD"
SPAN_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
SCALE_KINDS = {"k": "k_scale", "v": "v_scale"}  # an fp8 K or V tensor's scales


@dataclass
class SpanTensor:
    kind: str  # "k", "v", "k_scale", "v_scale" or "state"
    layer_ids: tuple[int, ...]
    start: int  # first position held; the tensor holds positions [start, start + T)
    data: torch.Tensor  # axes in the span's layout
    layer_starts: tuple[int, ...] | None = None  # per layer, first real position; None: all from `start`
    index: int | None = None  # state tensors: which of the layer kind's state tensors


@dataclass
class KVSpan:
    fingerprint: dict
    prompt_token_ids: list[int]
    first_token: int
    layout: str
    dtype: str
    tensors: list[SpanTensor] = field(default_factory=list)
    # signed with the rest: a span is imported at most once, and never after it expires
    transfer_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    expires_at: float = 0.0  # unix seconds

    @property
    def num_positions(self) -> int:
        return len(self.prompt_token_ids)


def model_fingerprint(
    cfg: TextModelConfig, weights_header: dict[str, tuple[tuple[int, ...], str]], weights_content_sha256: str
) -> dict:
    """What two workers must agree on for one's KV to be valid in the other: the architecture and
    KV geometry, the weights' names, shapes and dtypes (`weights_layout_sha256`) and their bytes
    (`weights_content_sha256`, from `loader.weights_content_sha256`), so two fine-tunes of one
    architecture refuse each other's KV."""
    layout = json.dumps(sorted((name, list(shape), kind) for name, (shape, kind) in weights_header.items()))
    return {
        "architecture": cfg.architecture,
        "num_layers": cfg.num_layers,
        "layer_kinds": [[k.name, k.window] for k in cfg.layer_kinds],
        "layer_geometry": [
            {"state_shapes": [list(s) for s in k.state_shapes]}
            if k.is_recurrent
            else ([k.latent_dim, k.index_dim] if k.index_dim else k.latent_dim)
            for k in cfg.layer_kinds
        ],
        **({"indexer": indexer_fingerprint(cfg.hf)} if "index_topk" in cfg.hf else {}),
        "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rope": {kind: vars(r) for kind, r in sorted(cfg.rope.items())},
        "weights_layout_sha256": hashlib.sha256(layout.encode()).hexdigest(),
        "weights_content_sha256": weights_content_sha256,
    }


def indexer_fingerprint(hf: dict) -> dict:
    """The sparse-attention settings that decide which keys a query reads (and so its KV's meaning)."""
    keys = ("index_topk", "index_n_heads", "index_head_dim", "indexer_types", "index_topk_freq", "index_kpool")
    return {k: hf.get(k) for k in keys} | {"rope_interleave": hf.get("indexer_rope_interleave")}


def span_rows(group: KVGroup, start: int, n: int) -> np.ndarray:
    """What a span carries of a group for a prompt of n: positions [start, n), or a pooled
    group's complete pools [0, n // pool) (its open pool's rows travel as state)."""
    return np.arange(0, n // group.kind.pool) if group.kind.is_pooled else np.arange(start, n)


def to_layout(t: torch.Tensor, src: str, dst: str) -> torch.Tensor:
    """Permute a tensor's axes from one layout string to another."""
    return t.permute(*[src.index(a) for a in dst])
