"""A packed float32 Llama-family model's decode-only steps as one C++ call per step
(baton/ops/decode.cpp), bound to the KV storage it writes."""

from __future__ import annotations

import torch

from baton.kv.storage import FP8, KVStorage
from baton.models.layers import GroupAttnMetadata, PackedLinear, RMSNorm, StackedLinear, unwrapped
from baton.ops import ops


class FusedDecoder:
    def __init__(self, model: torch.nn.Module, storage: KVStorage) -> None:
        cfg = model.cfg
        self.storage = storage
        self.kinds = model.layer_kinds  # rope kind -> its index in forward's cos/sin lists
        # a pipeline stage before the last has no final norm: it hands on the residual stream
        final = model.norm if isinstance(model.norm, RMSNorm) else None
        norm = model.layers[0].input_layernorm  # every norm's eps and offset
        self._decoder = ops().FusedDecoder(
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            hidden=cfg.hidden_size,
            intermediate=cfg.intermediate_size,
            eps=norm.eps,
            norm_offset=norm.offset,
            scale=cfg.attn_scale,
            gelu_tanh=cfg.hidden_act == "gelu_pytorch_tanh",
            final_norm=None if final is None else final.weight,
        )
        tp = getattr(model, "tp", None)
        if tp is not None and tp.size > 1:
            self._decoder.set_all_reduce(tp.all_reduce)
        for layer in model.layers:
            # a tensor-parallel model's o and MLP sum over the ranks (parallel/shard.py's RowParallel)
            attn, mlp = layer.self_attn, unwrapped(layer.mlp)
            o_proj = unwrapped(attn.o_proj)
            cache = storage.layer_kv(attn.layer_id)
            self._decoder.add_layer(
                input_norm=layer.input_layernorm.weight,
                post_attn_norm=layer.post_attention_layernorm.weight,
                pre_ff_norm=_weight(getattr(layer, "pre_feedforward_layernorm", None)),
                post_ff_norm=_weight(getattr(layer, "post_feedforward_layernorm", None)),
                q_norm=_weight(attn.q_norm),
                k_norm=_weight(attn.k_norm),
                qkv=[p.packed for p in attn.qkv_proj.parts()],
                qkv_rows=[p.out_features for p in attn.qkv_proj.parts()],
                qkv_bias=attn.qkv_proj.bias,
                o=o_proj.packed,
                o_bias=o_proj.bias,
                gate_up=[p.packed for p in mlp.gate_up_proj.parts()],
                gate_up_rows=[p.out_features for p in mlp.gate_up_proj.parts()],
                down=mlp.down_proj.packed,
                k_cache=cache.k,
                v_cache=cache.v,
                k_scale=cache.k_scale,
                v_scale=cache.v_scale,
                rope=self.kinds.index(attn.kind),
                group=storage.spec.layer_to_group[attn.layer_id][0],
            )

    @staticmethod
    def supports(model: torch.nn.Module, storage: KVStorage) -> bool:
        """Packed float32 linears and a float32, float16, bfloat16 or fp8 KV cache; otherwise the
        module path runs."""
        return storage.dtype in (torch.float32, torch.float16, torch.bfloat16, FP8) and all(
            isinstance(getattr(getattr(layer, "self_attn", None), "qkv_proj", None), (PackedLinear, StackedLinear))
            for layer in model.layers
        )

    def set_profiling(self, on: bool) -> None:
        """With profiling on, each step adds the wall time of its parts to `profile()`."""
        self._decoder.set_profiling(on)

    def profile(self) -> dict[str, float]:
        """Seconds spent in attention (KV write and kernel), linears, and norms / rotary / activation."""
        return self._decoder.profile()

    def __call__(
        self, x: torch.Tensor, rope: dict[str, tuple[torch.Tensor, torch.Tensor]], groups: list[GroupAttnMetadata]
    ) -> torch.Tensor:
        return self._decoder.forward(
            x,
            [rope[kind][0] for kind in self.kinds],
            [rope[kind][1] for kind in self.kinds],
            [g.slot_mapping for g in groups],
            [g.decode_block_ids for g in groups],
            [g.decode_kv_offsets for g in groups],
            [g.decode_kv_lens for g in groups],
            groups[0].block_size,
        )


def _weight(norm: torch.nn.Module | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight
