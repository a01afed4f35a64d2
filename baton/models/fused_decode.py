"""A model's decode-only steps as one C++ call per step (baton/ops/fused_decoder.h): the blocks
its layers declare (`decode_blocks`: a pre-norm, a layer step, an optional post-norm), bound to
the KV storage and recurrent state they write. The steps call the module path's kernels in its
order, so a row's bits are the module path's."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from baton.kv.state import StateStorage
from baton.kv.storage import FP8, KVStorage
from baton.models.layers import PackedLinear, RMSNorm, StackedLinear, unwrapped
from baton.models.recurrent import StateMetadata
from baton.ops import ops


@dataclass
class StepBinding:
    """What a layer needs to build its steps: the storage its KV lives in, the recurrent state
    storage, and per rope kind (in the order the step's cos / sin lists take them) its width."""

    storage: KVStorage
    states: StateStorage | None
    rope_dims: dict[str, int]
    # the keys a sparse-attention layer selects in a step, for the layers sharing them (GLM-5)
    selection: object = field(default_factory=lambda: ops().Selection())

    def kv_group(self, layer_id: int) -> int:
        return self.storage.spec.layer_to_group[layer_id][0]

    def rope(self, kind: str) -> int:
        return list(self.rope_dims).index(kind)


@dataclass
class DecodeBlock:
    pre_norm: RMSNorm
    step: object  # an ops().LayerStep
    post_norm: RMSNorm | None = None
    hc: object | None = None  # an ops().HyperWeights: the block's hyper-connection (GLM-5.3-Flash)
    scale: float = 1.0  # the block's output times this before the residual add (Granite's residual_multiplier)


def norm_weights(norm: RMSNorm | None):
    return ops().NormWeights() if norm is None else ops().NormWeights(norm.weight, norm.eps, norm.offset)


def step_bias(linear: torch.nn.Module) -> torch.Tensor | None:
    """A linear's bias as a step takes it: float32, contiguous, or None."""
    return None if linear.bias is None else linear.bias.float().contiguous()


def linear_args(name: str, linear: PackedLinear | StackedLinear | None) -> dict:
    """A packed projection as a step takes it: `name` its weight (or, stacked, its parts' weights
    and `name`_rows their output counts), `name`_bias its bias (a step takes a None argument as
    not given)."""
    if linear is None:
        return {}
    if isinstance(linear, StackedLinear):
        parts = linear.parts()
        weights = {name: [p.packed for p in parts], f"{name}_rows": [p.out_features for p in parts]}
    else:
        weights = {name: linear.packed}
    return {**weights, f"{name}_bias": step_bias(linear)}


def state_args(binding: StepBinding, layer_id: int) -> dict:
    """A recurrent layer's running states and checkpoints, as its step takes them."""
    (conv_state, rec_state), (conv_ckpt, rec_ckpt) = binding.states.layer(layer_id)
    return dict(conv_state=conv_state, rec_state=rec_state, conv_checkpoints=conv_ckpt, rec_checkpoints=rec_ckpt)


def packed_only(*modules: torch.nn.Module) -> bool:
    """Every linear inside the modules runs on the packed kernels (float32 panels or GGUF blocks)."""
    linears = [m for module in modules for m in module.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
    return all(isinstance(m, PackedLinear) for m in linears)


def plain_float32(*weights: torch.Tensor) -> bool:
    """Weights a step reads as plain float32 tensors (an einsum's or F.linear's very operand)."""
    return all(w.dtype == torch.float32 for w in weights)


def attention_step(
    attn: torch.nn.Module,
    binding: StepBinding,
    qkv: list[PackedLinear],
    *,
    rope: str | None,
    torch_rotary: bool = False,
    output_gate: bool = False,
):
    """`attn` (num_heads, num_kv_heads, head_dim, scale, layer_id, o_proj and the optional q_norm /
    k_norm of its module) as a step (baton/ops/attention_layer.cpp) over its projections `qkv`,
    stacked by rows: rotary of kind `rope` (None: none) over whole heads by baton's op, or
    (torch_rotary) over the kind's width as separate torch ops; None off the packed kernels."""
    o_proj = unwrapped(attn.o_proj)  # tensor parallel: the decoder sums the output over the ranks
    if not packed_only(*qkv, o_proj):
        return None
    biases = [m.bias for m in qkv]
    cache = binding.storage.layer_kv(attn.layer_id)
    return ops().AttentionStep(
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        hidden=o_proj.out_features,
        scale=attn.scale,
        rope=0 if rope is None else binding.rope(rope),
        rotary_dim=0 if rope is None else binding.rope_dims[rope] if torch_rotary else attn.head_dim,
        torch_rotary=torch_rotary or rope is None,
        output_gate=output_gate,
        qkv=[m.packed for m in qkv],
        qkv_rows=[m.out_features for m in qkv],
        qkv_bias=None if any(b is None for b in biases) else torch.cat(biases),
        q_norm=norm_weights(getattr(attn, "q_norm", None)),
        k_norm=norm_weights(getattr(attn, "k_norm", None)),
        **linear_args("o", o_proj),
        k_cache=cache.k,
        v_cache=cache.v,
        k_scale=cache.k_scale,
        v_scale=cache.v_scale,
        group=binding.kv_group(attn.layer_id),
    )


def mixer_mlp_blocks(
    mixer_norm: RMSNorm,
    mixer,
    mlp_norm: RMSNorm,
    mlp,
    post_mixer_norm: RMSNorm | None = None,
    post_mlp_norm: RMSNorm | None = None,
    scale: float = 1.0,
) -> list[DecodeBlock] | None:
    """A pre-norm layer's two blocks (its mixer's step, then its MLP's), or None where either step
    cannot run in the fused decoder. Sandwich norms (Gemma) add a norm after each; `scale`
    multiplies each block's output (Granite)."""
    if mixer is None or mlp is None:
        return None
    return [
        DecodeBlock(mixer_norm, mixer, post_mixer_norm, scale=scale),
        DecodeBlock(mlp_norm, mlp, post_mlp_norm, scale=scale),
    ]


def gated_mlp_step(
    gate_up_proj: torch.nn.Module, down_proj: torch.nn.Module, gelu_tanh: bool, swiglu_limit: float | None = None
):
    """down(act(gate) * up) as a step (baton/ops/mlp_layer.cpp), clamped at `swiglu_limit` where
    given; None unless both projections run on the packed kernels (a tensor-parallel down_proj:
    the decoder sums the output itself)."""
    down = unwrapped(down_proj)
    if not isinstance(gate_up_proj, (PackedLinear, StackedLinear)) or not isinstance(down, PackedLinear):
        return None
    return ops().GatedMlpStep(
        gate_up=[p.packed for p in gate_up_proj.parts()],
        gate_up_rows=[p.out_features for p in gate_up_proj.parts()],
        down=down.packed,
        intermediate=down.in_features,
        hidden=down.out_features,
        gelu_tanh=gelu_tanh,
        swiglu_limit=swiglu_limit,
    )


class FusedDecoder:
    def __init__(
        self, model: torch.nn.Module, blocks: list[DecodeBlock], final_norm: RMSNorm | None, rope_kinds: list[str]
    ) -> None:
        self.rope_kinds = rope_kinds
        # final_norm None: a pipeline stage before the last, which hands on the residual stream;
        # hc_mult: hyper-connections over that many streams (GLM-5.3-Flash)
        self._decoder = ops().FusedDecoder(
            hidden=model.cfg.hidden_size, final_norm=norm_weights(final_norm), streams=getattr(model, "hc_mult", 0)
        )
        tp = getattr(model, "tp", None)
        if tp is not None and tp.size > 1:  # every block's output is this rank's partial sum
            self._decoder.set_all_reduce(tp.all_reduce)
        for b in blocks:
            hc = ops().HyperWeights() if b.hc is None else b.hc
            self._decoder.add_block(norm_weights(b.pre_norm), b.step, norm_weights(b.post_norm), hc, b.scale)
        self.steps = 0

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        storage: KVStorage,
        states: StateStorage | None,
        final_norm: RMSNorm | None,
        rope_dims: dict[str, int],
        layers: list[torch.nn.Module] | None = None,
    ) -> FusedDecoder | None:
        """The decoder of `layers` (`model`'s by default) over `storage` and `states`; None where a
        layer cannot run as a step (its `decode_blocks` says None), the KV cache is of a dtype the
        steps lack, or the model is not float32, as the steps compute."""
        if storage.dtype not in (torch.float32, torch.float16, torch.bfloat16, FP8):
            return None
        if final_norm is not None and final_norm.weight.dtype != torch.float32:
            return None
        binding = StepBinding(storage, states, rope_dims)
        blocks = []
        for layer in model.layers if layers is None else layers:
            declared = layer.decode_blocks(binding)
            if declared is None:
                return None
            blocks += declared
        return cls(model, blocks, final_norm, list(rope_dims))

    def set_profiling(self, on: bool) -> None:
        """With profiling on, each step adds the wall time of its parts to `profile()`."""
        self._decoder.set_profiling(on)

    def profile(self) -> dict[str, float]:
        """Seconds spent in each part of the steps (linears, attention, norms, ...)."""
        return self._decoder.profile()

    def __call__(self, x: torch.Tensor, rope: dict[str, tuple[torch.Tensor, torch.Tensor]], ctx) -> torch.Tensor:
        """x: the embedded decode tokens, one per row; rope: each kind's cos and signed sin."""
        self.steps += 1
        return self._decoder.forward(
            x,
            [rope[kind][0] for kind in self.rope_kinds],
            [rope[kind][1] for kind in self.rope_kinds],
            *step_arguments(ctx),
        )


class FusedDecoding:
    """A model whose decode-only steps run as one call: `fused_decoder` over the storage and
    states of the step, built on first use, unless `fused_decode` is off or does not apply. The
    model gives its final norm (`fused_final_norm`) and rope widths (`fused_rope_dims`)."""

    fused_decode = True
    fused_decoder: FusedDecoder | None = None
    _fused_for: tuple[object, object] | None = None  # the storage and states fused_decoder was decided for

    def _fused_decoder_for(self, storage: KVStorage, states: StateStorage | None = None) -> FusedDecoder | None:
        if not self.fused_decode:
            return None
        if self._fused_for is None or self._fused_for[0] is not storage or self._fused_for[1] is not states:
            self._fused_for = (storage, states)
            final = self.fused_final_norm()  # None on a pipeline stage before the last
            self.fused_decoder = FusedDecoder.build(self, storage, states, final, self.fused_rope_dims())
        return self.fused_decoder

    def fused_final_norm(self) -> RMSNorm | None:
        raise NotImplementedError

    def fused_rope_dims(self) -> dict[str, int]:
        return {}


def step_arguments(ctx) -> list:
    """What a fused decoder's forward takes after x (and the rope lists): per KV group the slot
    mapping and decode blocks / offsets / lengths, the block size, then `decode_state_rows`."""
    groups = [g for g in ctx.groups if g is not None]  # a group the step does not touch: None
    none = torch.empty(0, dtype=torch.long)

    def each(field: str) -> list[torch.Tensor]:
        return [none if g is None else getattr(g, field) for g in ctx.groups]

    return [
        each("slot_mapping"),
        each("decode_block_ids"),
        each("decode_kv_offsets"),
        each("decode_kv_lens"),
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
