"""A packed float32 Kimi Linear's decode-only steps as one C++ call per step
(baton/ops/kimi_decode.cpp): Kimi Delta Attention and absorbed NoPE MLA layers, dense or
grouped-sigmoid MoE MLPs, bound to the latent KV storage and the recurrent state storage they
write. A row's bits are those of the module-by-module path."""

from __future__ import annotations

import torch

from baton.kv.spec import STATE_DTYPE
from baton.kv.state import StateStorage
from baton.kv.storage import KVStorage
from baton.models.fused_decode import step_arguments
from baton.models.layers import PackedLinear, unwrapped
from baton.models.moe import GroupedSigmoidMoE, expert_arguments
from baton.ops import ops


def _bias(linear: PackedLinear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.float().contiguous()


class FusedKimiDecoder:
    def __init__(self, model: torch.nn.Module, storage: KVStorage, states: StateStorage) -> None:
        from baton.models.kimi_linear import kda_dims
        from baton.models.mla import MLAttention

        cfg = model.cfg
        self.storage, self.states = storage, states
        self.steps = 0  # decode steps run through the C++ call
        heads, dim, kernel = kda_dims(cfg.hf)
        mla = next((layer.self_attn for layer in model.layers if isinstance(layer.self_attn, MLAttention)), None)
        self._decoder = ops().FusedKimiDecoder(
            hidden=cfg.hidden_size,
            eps=model.norm.eps,
            final_norm=model.norm.weight,
            heads=cfg.num_heads,
            kv_lora_rank=0 if mla is None else mla.rank,
            nope_dim=0 if mla is None else mla.dn,
            rope_dim=0 if mla is None else mla.dr,
            v_dim=0 if mla is None else mla.dv,
            scale=1.0 if mla is None else mla.scale,
            q_lora_rank=0 if mla is None or hasattr(mla, "q_proj") else mla.q_a_proj.out_features,
            kda_heads=heads,
            kda_dim=dim,
            conv_kernel=kernel,
        )
        tp = getattr(model, "tp", None)
        if tp is not None and tp.size > 1:
            self._decoder.set_all_reduce(tp.all_reduce)
        for i, layer in enumerate(model.layers):
            norms = dict(input_norm=layer.input_layernorm.weight, post_attn_norm=layer.post_attention_layernorm.weight)
            attn = layer.self_attn
            if layer.recurrent:
                (conv_state, rec_state), (conv_ckpt, rec_ckpt) = states.layer(i)
                self._decoder.add_kda_layer(
                    **norms,
                    in_proj=attn.in_proj.packed,
                    o_proj=unwrapped(attn.o_proj).packed,
                    conv_weight=attn.conv_weight.float().contiguous(),
                    f_b=attn.f_b_proj.packed,
                    g_b=attn.g_b_proj.packed,
                    dt_bias=attn.dt_bias.float().contiguous(),
                    # KimiDeltaAttention.forward's -A_log.float().exp(): the same op on the same [h], once
                    neg_exp_a=(-attn.A_log.float().exp()).contiguous(),
                    o_norm=attn.o_norm.weight.float().contiguous(),
                    norm_eps=attn.eps,
                    conv_state=conv_state,
                    rec_state=rec_state,
                    conv_checkpoints=conv_ckpt,
                    rec_checkpoints=rec_ckpt,
                )
            else:
                lora = not hasattr(attn, "q_proj")
                k_cache, _ = storage.layer(i)
                self._decoder.add_mla_layer(
                    **norms,
                    q_proj=None if lora else attn.q_proj.packed,
                    q_a=attn.q_a_proj.packed if lora else None,
                    q_a_bias=_bias(attn.q_a_proj) if lora else None,
                    q_a_norm=attn.q_a_layernorm.weight if lora else None,
                    q_b=attn.q_b_proj.packed if lora else None,
                    kv_a=attn.kv_a_proj_with_mqa.packed,
                    kv_a_bias=_bias(attn.kv_a_proj_with_mqa),
                    kv_a_norm=attn.kv_a_layernorm.weight,
                    kv_b=attn.kv_b_proj.weight,  # einsum's very operand: plain, never packed
                    o_proj=unwrapped(attn.o_proj).packed,
                    o_bias=_bias(unwrapped(attn.o_proj)),
                    k_cache=k_cache,
                    group=storage.spec.layer_to_group[i][0],
                )
            mlp = unwrapped(layer.mlp)
            if isinstance(mlp, GroupedSigmoidMoE):
                gate, shared = mlp.gate, mlp.shared_experts
                self._decoder.set_moe(
                    router_weight=gate.weight,  # F.linear's very operand: plain, never packed
                    correction_bias=gate.e_score_correction_bias.float().contiguous(),
                    top_k=gate.top_k,
                    n_group=gate.n_group,
                    topk_group=gate.topk_group,
                    norm_topk_prob=gate.norm_topk_prob,
                    routed_scaling_factor=gate.routed_scaling_factor,
                    **expert_arguments(mlp.experts, shared),
                )
            else:
                self._decoder.set_dense_mlp(
                    gate_up=mlp.gate_up_proj.packed,
                    down=mlp.down_proj.packed,
                    intermediate=mlp.down_proj.in_features,
                )

    @staticmethod
    def supports(model: torch.nn.Module, storage: KVStorage, states: StateStorage | None) -> bool:
        """Packed float32 linears, float32 router and kv_b weights, KV cache and state; otherwise the
        module path runs."""
        if states is None or storage.dtype != torch.float32 or STATE_DTYPE != torch.float32:
            return False
        if model.norm.weight.dtype != torch.float32:
            return False
        for layer in model.layers:
            plain = [getattr(layer.self_attn, "kv_b_proj", None), getattr(unwrapped(layer.mlp), "gate", None)]
            if any(m is not None and m.weight.dtype != torch.float32 for m in plain):
                return False
            modules = [*layer.self_attn.modules(), *layer.mlp.modules()]
            if not all(isinstance(m, PackedLinear) for m in modules if isinstance(m, (torch.nn.Linear, PackedLinear))):
                return False
        return True

    def __call__(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """x: the embedded decode tokens, one per row."""
        self.steps += 1
        return self._decoder.forward(x, *step_arguments(ctx))
