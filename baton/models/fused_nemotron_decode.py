"""A packed float32 NemotronH's decode-only steps as one C++ call per step
(baton/ops/nemotron_decode.cpp): Mamba2, NoPE attention, squared-ReLU MLP and sigmoid-routed MoE
layers, bound to the KV storage and the recurrent state storage they write. A row's bits are
those of the module-by-module path."""

from __future__ import annotations

import torch

from baton.kv.spec import STATE_DTYPE
from baton.kv.state import StateStorage
from baton.kv.storage import KVStorage
from baton.models.fused_decode import step_arguments
from baton.models.layers import PackedLinear, unwrapped
from baton.models.moe import ExpertElsewhere
from baton.ops import ops


def _bias(linear: PackedLinear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.float().contiguous()


class FusedNemotronDecoder:
    def __init__(self, model: torch.nn.Module, storage: KVStorage, states: StateStorage) -> None:
        from baton.models.nemotron_h import Mamba2Mixer, NemotronHMoE, NoPEAttention, mamba_dims

        cfg = model.cfg
        self.storage, self.states = storage, states
        self.steps = 0  # decode steps run through the C++ call
        nh, p, g, n, k = mamba_dims(cfg.hf)
        self._decoder = ops().FusedNemotronDecoder(
            hidden=cfg.hidden_size,
            eps=model.norm_f.eps,
            final_norm=model.norm_f.weight,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            scale=cfg.head_dim**-0.5,
            mamba_heads=nh,
            mamba_head_dim=p,
            mamba_groups=g,
            state_size=n,
            conv_kernel=k,
        )
        tp = getattr(model, "tp", None)
        if tp is not None and tp.size > 1:
            self._decoder.set_all_reduce(tp.all_reduce)
        absent = torch.empty(0)  # tensor parallel: an expert another rank holds
        for i, layer in enumerate(model.layers):
            norm, mixer = layer.norm.weight, unwrapped(layer.mixer)
            if isinstance(mixer, Mamba2Mixer):
                (conv_state, ssm_state), (conv_ckpt, ssm_ckpt) = states.layer(i)
                conv_bias = mixer.conv1d.bias
                self._decoder.add_mamba_layer(
                    norm=norm,
                    in_proj=mixer.in_proj.packed,
                    in_bias=_bias(mixer.in_proj),
                    out_proj=unwrapped(mixer.out_proj).packed,
                    out_bias=_bias(unwrapped(mixer.out_proj)),
                    conv_weight=mixer.conv1d.weight[:, 0].float().contiguous(),
                    conv_bias=None if conv_bias is None else conv_bias.float().contiguous(),
                    # Mamba2Mixer.forward's -A_log.float().exp(): the same op on the same [nh], once
                    neg_exp_a=(-mixer.A_log.float().exp()).contiguous(),
                    dt_bias=mixer.dt_bias.float().contiguous(),
                    d=mixer.D.float().contiguous(),
                    norm_weight=mixer.norm.weight.float().contiguous(),
                    dt_min=mixer.dt_min,
                    norm_eps=mixer.eps,
                    conv_state=conv_state,
                    ssm_state=ssm_state,
                    conv_checkpoints=conv_ckpt,
                    ssm_checkpoints=ssm_ckpt,
                )
            elif isinstance(mixer, NoPEAttention):
                k_cache, v_cache = storage.layer(i)
                self._decoder.add_attention_layer(
                    norm=norm,
                    q_proj=mixer.q_proj.packed,
                    k_proj=mixer.k_proj.packed,
                    v_proj=mixer.v_proj.packed,
                    o_proj=unwrapped(mixer.o_proj).packed,
                    k_cache=k_cache,
                    v_cache=v_cache,
                    group=storage.spec.layer_to_group[i][0],
                )
            elif isinstance(mixer, NemotronHMoE):
                gate, shared = mixer.gate, mixer.shared_experts
                fc1, fc2 = mixer.fc1_latent_proj, mixer.fc2_latent_proj
                self._decoder.add_moe_layer(
                    norm=norm,
                    router_weight=gate.weight,  # F.linear's very operand: plain, never packed
                    correction_bias=gate.e_score_correction_bias.float().contiguous(),
                    top_k=gate.top_k,
                    n_group=gate.n_group,
                    topk_group=gate.topk_group,
                    norm_topk_prob=gate.norm_topk_prob,
                    routed_scaling_factor=gate.routed_scaling_factor,
                    expert_up=[absent if isinstance(e, ExpertElsewhere) else e.up_proj.packed for e in mixer.experts],
                    expert_down=[
                        absent if isinstance(e, ExpertElsewhere) else e.down_proj.packed for e in mixer.experts
                    ],
                    moe_intermediate=next(
                        (e.up_proj.out_features for e in mixer.experts if not isinstance(e, ExpertElsewhere)), 1
                    ),
                    fc1=None if fc1 is None else fc1.packed,
                    fc1_bias=None if fc1 is None else _bias(fc1),
                    fc2=None if fc2 is None else fc2.packed,
                    fc2_bias=None if fc2 is None else _bias(fc2),
                    width=cfg.hidden_size if fc1 is None else fc1.out_features,
                    shared_up=None if shared is None else shared.up_proj.packed,
                    shared_up_bias=None if shared is None else _bias(shared.up_proj),
                    shared_down=None if shared is None else shared.down_proj.packed,
                    shared_down_bias=None if shared is None else _bias(shared.down_proj),
                    shared_intermediate=0 if shared is None else shared.up_proj.out_features,
                )
            else:  # Relu2MLP
                self._decoder.add_mlp_layer(
                    norm=norm,
                    up=mixer.up_proj.packed,
                    up_bias=_bias(mixer.up_proj),
                    down=mixer.down_proj.packed,
                    down_bias=_bias(mixer.down_proj),
                    intermediate=mixer.up_proj.out_features,
                )

    @staticmethod
    def supports(model: torch.nn.Module, storage: KVStorage, states: StateStorage | None) -> bool:
        """Packed float32 linears, a float32 router, KV cache and state; otherwise the module path runs."""
        if states is None or storage.dtype != torch.float32 or STATE_DTYPE != torch.float32:
            return False
        if model.norm_f.weight.dtype != torch.float32:
            return False
        for layer in model.layers:
            mixer = unwrapped(layer.mixer)
            gate = getattr(mixer, "gate", None)
            if gate is not None and gate.weight.dtype != torch.float32:
                return False
            linears = [m for m in mixer.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
            if not all(isinstance(m, PackedLinear) for m in linears):
                return False
        return True

    def __call__(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """x: the embedded decode tokens, one per row."""
        self.steps += 1
        return self._decoder.forward(x, *step_arguments(ctx))
