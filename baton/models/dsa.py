"""DeepSeek Sparse Attention models: DeepSeek-V3.2 (DeepseekV32ForCausalLM) and GLM-5
(GlmMoeDsaForCausalLM). DeepSeek-V3's MLA with interleaved rotary (and yarn), a lightning indexer
(baton/models/indexer.py) on every layer of DeepSeek-V3.2 and on GLM-5's "full" layers, whose
"shared" layers read the keys the indexer layer before them selected; dense MLPs in the first
`first_k_dense_replace` layers, sigmoid-routed grouped experts with a shared expert after
(GLM-4.5's, which copied DeepSeek-V3's). The checkpoints' MTP layers are not read: transformers
drops them, so there is no reference to check a drafter against.

An indexer layer's cache row per token: the latent (kv_lora_rank + qk_rope_head_dim), then the
indexer key (index_head_dim); a shared layer's, the latent alone. The checkpoint's interleaved rope
channels (pairs (x0, x1), (x2, x3), ...; GLM-5's indexer too) are reordered at load to
[x0, x2, ... | x1, x3, ...], the order transformers' rotation writes them in, so baton's half-split
rotary computes the same rotation."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from baton.kv.spec import LayerKind
from baton.models.glm4_moe import Glm4MoeDecoderLayer, Glm4MoeForCausalLM, sparse_moe
from baton.models.layers import RMSNorm
from baton.models.llama import GatedMLP
from baton.models.mla import MLAttention
from baton.models.model_config import TextModelConfig
from baton.models.rope import Rotary


def mla_dims(hf: dict[str, Any]) -> tuple[int, int, int]:
    """(kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim)."""
    return int(hf.get("kv_lora_rank", 512)), int(hf.get("qk_nope_head_dim", 128)), int(hf.get("qk_rope_head_dim", 64))


def indexer_types(hf: dict[str, Any]) -> list[str]:
    """Each layer's indexer, "full" or "shared": indexer_types, else index_topk_pattern ("FSS..."),
    else every index_topk_freq-th layer from index_skip_topk_offset on (transformers' GLM-5 rule);
    every layer "full" for a config with none of them (DeepSeek-V3.2)."""
    n = int(hf["num_hidden_layers"])
    types, pattern = hf.get("indexer_types"), hf.get("index_topk_pattern")
    if types is None and isinstance(pattern, str):
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    elif types is None and pattern is not None:
        types = list(pattern)
    elif types is None and ("index_topk_freq" in hf or "index_skip_topk_offset" in hf):
        freq, offset = max(int(hf.get("index_topk_freq") or 1), 1), int(hf.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    types = list(types) if types is not None else ["full"] * n
    if len(types) != n or any(t not in ("full", "shared") for t in types) or types[0] != "full":
        raise ValueError(f"indexer_types must name 'full' or 'shared' for each of the {n} layers, the first full")
    return types


def layer_kinds(hf: dict[str, Any]) -> list[LayerKind]:
    rank, _, dr = mla_dims(hf)
    index_dim = int(hf.get("index_head_dim", 128))
    return [LayerKind.mla(rank + dr, index_dim if t == "full" else 0) for t in indexer_types(hf)]


def deinterleave_rows(t: torch.Tensor, starts: range, width: int) -> torch.Tensor:
    """t with rows [s, s + width) of each s in starts reordered evens first, then odds."""
    order = torch.cat((torch.arange(0, width, 2), torch.arange(1, width, 2)))
    t = t.clone()
    for s in starts:
        t[s : s + width] = t[s : s + width][order]
    return t


class DsaDecoderLayer(Glm4MoeDecoderLayer):
    """GLM-4.5's decoder layer with MLA and its indexer (or the selection before it) as the mixer."""

    def __init__(self, cfg: TextModelConfig, layer_id: int) -> None:
        nn.Module.__init__(self)
        hf = cfg.hf
        self.self_attn = MLAttention(cfg, layer_id, rotary=True, indexer=indexer_types(hf)[layer_id])
        types = hf.get("mlp_layer_types")
        dense = types[layer_id] == "dense" if types else layer_id < int(hf.get("first_k_dense_replace", 3))
        self.mlp = GatedMLP(cfg) if dense else sparse_moe(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV32ForCausalLM(Glm4MoeForCausalLM):
    layer_cls = DsaDecoderLayer
    layer_kinds_from = staticmethod(layer_kinds)
    mtp_drafts = False
    indexer_interleaved = False  # the indexer's rope channels: half-split (DeepSeek-V3.2)
    _INDEXER_ROPE_ROWS = tuple(f"indexer.{w}" for w in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias"))

    def __init__(self, cfg: TextModelConfig) -> None:
        super().__init__(cfg)
        self.rotary = nn.ModuleDict({"full": Rotary(cfg.rope["full"], mla_dims(cfg.hf)[2])})
        self._indexer_types = indexer_types(cfg.hf)

    def can_start_stage(self, layer: int) -> bool:
        """A shared layer reads the selection of the layer before it: never a pipeline stage's first."""
        return self._indexer_types[layer] == "full"

    def load_weight(self, hf_name: str, tensor: torch.Tensor) -> None:
        rank, dn, dr = mla_dims(self.cfg.hf)
        if hf_name.endswith("self_attn.q_b_proj.weight"):
            tensor = deinterleave_rows(tensor, range(dn, tensor.shape[0], dn + dr), dr)
        elif ".self_attn.kv_a_proj_with_mqa." in hf_name:
            tensor = deinterleave_rows(tensor, range(rank, rank + 1), dr)
        elif self.indexer_interleaved and hf_name.endswith(self._INDEXER_ROPE_ROWS):
            dim = int(self.cfg.hf.get("index_head_dim", 128))
            tensor = deinterleave_rows(tensor, range(0, tensor.shape[0], dim), dr)
        super().load_weight(hf_name, tensor)


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-5: DeepSeek-V3.2's layers, the indexer's rotary interleaved, shared indexer layers."""

    indexer_interleaved = True
