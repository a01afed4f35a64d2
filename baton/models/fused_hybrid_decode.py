"""A packed float32 Qwen3-Next's decode-only steps as one C++ call per step
(baton/ops/hybrid_decode.cpp): Gated DeltaNet and gated attention layers, dense or MoE MLPs,
bound to the KV storage and the recurrent state storage they write. A row's bits are those of
the module-by-module path."""

from __future__ import annotations

import torch

from baton.kv.spec import STATE_DTYPE
from baton.kv.state import StateStorage
from baton.kv.storage import KVStorage
from baton.models.layers import PackedLinear, unwrapped
from baton.models.moe import ExpertElsewhere, SparseMoE
from baton.models.recurrent import StateMetadata
from baton.ops import ops


def step_arguments(ctx) -> list:
    """What every fused hybrid decoder's forward takes after its inputs: per KV group the slot
    mapping and decode blocks / offsets / lengths, the block size, then `decode_state_rows`."""
    groups = ctx.groups
    return [
        [g.slot_mapping for g in groups],
        [g.decode_block_ids for g in groups],
        [g.decode_kv_offsets for g in groups],
        [g.decode_kv_lens for g in groups],
        groups[0].block_size if groups else 1,
        *decode_state_rows(ctx.state_meta),
    ]


def decode_state_rows(meta: StateMetadata | None) -> tuple[list[int], list[int], list[int], list[int]]:
    """A decode step's recurrent metadata as the C++ steps take it: each row's state slot, and per
    checkpoint to take its row, its offset (0: before the row's token, 1: after) and its id."""
    seqs = meta.seqs if meta is not None else []
    slots, snap_rows, snap_offsets, snap_ids = [0] * len(seqs), [], [], []
    for seq in seqs:  # one row each
        slots[seq.q_start] = seq.slot
        for offset, cid in seq.snapshots:
            snap_rows.append(seq.q_start)
            snap_offsets.append(offset)
            snap_ids.append(cid)
    return slots, snap_rows, snap_offsets, snap_ids


class FusedHybridDecoder:
    def __init__(self, model: torch.nn.Module, storage: KVStorage, states: StateStorage) -> None:
        cfg, hf = model.cfg, model.cfg.hf
        self.storage, self.states = storage, states
        self.steps = 0  # decode steps run through the C++ call
        norm = model.norm
        rotary_dim = model.rotary["full"].inv_freq.numel() * 2
        self._decoder = ops().FusedHybridDecoder(
            hidden=cfg.hidden_size,
            eps=norm.eps,
            norm_offset=norm.offset,
            final_norm=norm.weight,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            rotary_dim=rotary_dim,
            scale=cfg.attn_scale,
            key_heads=int(hf["linear_num_key_heads"]),
            value_heads=int(hf["linear_num_value_heads"]),
            key_dim=int(hf["linear_key_head_dim"]),
            value_dim=int(hf["linear_value_head_dim"]),
            conv_kernel=int(hf["linear_conv_kernel_dim"]),
        )
        tp = getattr(model, "tp", None)
        if tp is not None and tp.size > 1:
            self._decoder.set_all_reduce(tp.all_reduce)
        for i, layer in enumerate(model.layers):
            norms = dict(input_norm=layer.input_layernorm.weight, post_attn_norm=layer.post_attention_layernorm.weight)
            if layer.recurrent:
                la = layer.linear_attn
                (conv_state, rec_state), (conv_ckpt, rec_ckpt) = states.layer(i)
                self._decoder.add_recurrent_layer(
                    **norms,
                    qkvz=la.in_proj_qkvz.packed,
                    ba=la.in_proj_ba.packed,
                    out_proj=unwrapped(la.out_proj).packed,
                    conv_weight=la.conv1d.weight[:, 0].float().contiguous(),
                    # GatedDeltaNet.forward's -A_log.float().exp(): the same op on the same [vh], once
                    neg_exp_a=(-la.A_log.float().exp()).contiguous(),
                    dt_bias=la.dt_bias.float().contiguous(),
                    norm_weight=la.norm.weight.float().contiguous(),
                    norm_eps=la.eps,
                    conv_state=conv_state,
                    rec_state=rec_state,
                    conv_checkpoints=conv_ckpt,
                    rec_checkpoints=rec_ckpt,
                )
            else:
                attn = layer.self_attn
                k_cache, v_cache = storage.layer(i)
                self._decoder.add_attention_layer(
                    **norms,
                    q_proj=attn.q_proj.packed,
                    q_bias=attn.q_proj.bias,
                    k_proj=attn.k_proj.packed,
                    k_bias=attn.k_proj.bias,
                    v_proj=attn.v_proj.packed,
                    v_bias=attn.v_proj.bias,
                    o_proj=unwrapped(attn.o_proj).packed,
                    o_bias=unwrapped(attn.o_proj).bias,
                    q_norm=attn.q_norm.weight,
                    k_norm=attn.k_norm.weight,
                    k_cache=k_cache,
                    v_cache=v_cache,
                    group=storage.spec.layer_to_group[i][0],
                )
            mlp = unwrapped(layer.mlp)
            if isinstance(mlp, SparseMoE):
                shared = mlp.shared_expert
                self._decoder.set_moe(
                    router=mlp.gate.packed,
                    top_k=mlp.top_k,
                    norm_topk_prob=mlp.norm_topk_prob,
                    **expert_arguments(mlp.experts, shared),
                    shared_gate=None if mlp.shared_expert_gate is None else mlp.shared_expert_gate.packed,
                )
            else:
                self._decoder.set_dense_mlp(
                    gate_up=mlp.gate_up_proj.packed,
                    down=mlp.down_proj.packed,
                    intermediate=mlp.down_proj.in_features,
                )

    @staticmethod
    def supports(model: torch.nn.Module, storage: KVStorage, states: StateStorage | None) -> bool:
        """Packed float32 linears, a float32 KV cache and float32 state; otherwise the module path runs."""
        if states is None or storage.dtype != torch.float32 or STATE_DTYPE != torch.float32:
            return False
        if model.norm.weight.dtype != torch.float32:
            return False
        for layer in model.layers:
            mixer = layer.linear_attn if layer.recurrent else layer.self_attn
            mlp = unwrapped(layer.mlp)
            experts = (
                [e for e in mlp.experts if not isinstance(e, ExpertElsewhere)] if isinstance(mlp, SparseMoE) else [mlp]
            )
            if isinstance(mlp, SparseMoE):
                experts += [e for e in (mlp.shared_expert,) if e is not None]
                linears = [mlp.gate] + ([] if mlp.shared_expert_gate is None else [mlp.shared_expert_gate])
            else:
                linears = []
            linears += [m for m in mixer.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
            linears += [p for e in experts for p in (e.gate_up_proj, e.down_proj)]
            if not all(isinstance(m, PackedLinear) for m in linears):
                return False
        return True

    def set_profiling(self, on: bool) -> None:
        """With profiling on, each step adds the wall time of its parts to `profile()`."""
        self._decoder.set_profiling(on)

    def profile(self) -> dict[str, float]:
        """Seconds spent in attention, the recurrent mixers, linears, experts, and the small ops."""
        return self._decoder.profile()

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx) -> torch.Tensor:
        """x: the embedded decode tokens, one per row; rope: the full-attention cos and signed sin."""
        self.steps += 1
        return self._decoder.forward(x, rope[0], rope[1], *step_arguments(ctx))


def expert_arguments(experts: torch.nn.ModuleList, shared: torch.nn.Module | None) -> dict:
    """The routed experts' and the shared expert's packed gate_up / down weights, as set_moe takes them."""
    here = [e for e in experts if not isinstance(e, ExpertElsewhere)]
    absent = torch.empty(0)  # tensor parallel: an expert another rank holds
    return {
        "expert_gate_up": [absent if isinstance(e, ExpertElsewhere) else e.gate_up_proj.packed for e in experts],
        "expert_down": [absent if isinstance(e, ExpertElsewhere) else e.down_proj.packed for e in experts],
        "moe_intermediate": here[0].down_proj.in_features if here else 1,
        "shared_gate_up": None if shared is None else shared.gate_up_proj.packed,
        "shared_down": None if shared is None else shared.down_proj.packed,
        "shared_intermediate": 0 if shared is None else shared.down_proj.in_features,
    }
