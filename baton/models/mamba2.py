"""The Mamba2 mixer (causal conv + selective SSM, a constant-size state per request) that
Nemotron-H and Granite-4.0-H share; each family reads its own config into `Mamba2Dims`.

Mamba2 runs on the shared recurrent scan: with the state h [heads, P, N] kept transposed as
[heads, N, P], h = exp(dt A) h + dt x (x) B and y = C h map onto S = S exp(decay); S += k (x) v;
out = q S with k = B, v = dt x, q = C, decay = dt A."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from baton.kv.spec import LayerKind
from baton.models.fused_decode import StepBinding, linear_args, packed_only, state_args
from baton.models.gguf_arch import Value, float_op, reshaped
from baton.models.layers import unwrapped
from baton.models.llama import ForwardContext
from baton.models.recurrent import conv_over_segments, scan_over_segments, segments
from baton.ops import ops, silu, softplus

NORM_MODES = ("none", "after_gate", "before_gate")  # the step's `norm` argument: the index


@dataclass(frozen=True)
class Mamba2Dims:
    heads: int
    head_dim: int  # P
    groups: int  # G: B and C per group of heads, the gated norm per group
    state_size: int  # N
    conv_kernel: int
    bias: bool = False  # in_proj's (and out_proj's unless out_bias says)
    conv_bias: bool = True
    dt_min: float = 0.0  # dt clamped to [dt_min, dt_max] at every position
    dt_max: float = math.inf
    eps: float = 1e-5  # the gated norm's
    out_bias: bool | None = None  # out_proj's; None: as in_proj's
    # y * silu(z) then the grouped RMS norm ("after_gate": Nemotron-H, Granite), the norm then the
    # gate ("before_gate"), or the gate alone ("none"): Falcon-H1 has all three
    norm: str = "after_gate"

    def __post_init__(self) -> None:
        if self.norm not in NORM_MODES:
            raise ValueError(f"Mamba2 norm must be one of {NORM_MODES}, got {self.norm!r}")
        if min(self.heads, self.head_dim, self.groups, self.state_size, self.conv_kernel) < 1:
            raise ValueError(f"Mamba2 dimensions must be positive, got {self}")
        if self.heads % self.groups:
            raise ValueError(f"Mamba2 heads ({self.heads}) must be a multiple of groups ({self.groups})")
        if not self.dt_min <= self.dt_max:
            raise ValueError(f"Mamba2 time step limits [{self.dt_min}, {self.dt_max}] are empty")

    def layer_kind(self) -> LayerKind:
        """The state a layer keeps per request: the conv's last K - 1 inputs and h [heads, N, P]."""
        conv_dim = self.heads * self.head_dim + 2 * self.groups * self.state_size
        return LayerKind.recurrent((conv_dim, self.conv_kernel - 1), (self.heads, self.state_size, self.head_dim))


def gguf_names(module: str) -> dict[str, str]:
    """llama.cpp's names for a Mamba2 mixer's tensors, under the layer's `module` (mamba, mixer)."""
    parts = {
        "ssm_in.weight": "in_proj.weight",
        "ssm_conv1d.weight": "conv1d.weight",
        "ssm_conv1d.bias": "conv1d.bias",
        "ssm_dt.bias": "dt_bias",
        "ssm_a": "A_log",
        "ssm_d": "D",
        "ssm_norm.weight": "norm.weight",
        "ssm_out.weight": "out_proj.weight",
    }
    return {gguf: f"{module}.{hf}" for gguf, hf in parts.items()}


def gguf_undone(part: str, value: Value) -> Value:
    """A Mamba2 mixer's tensor `part` (A_log, D, norm.weight, conv1d.weight, ...) as llama.cpp's
    converter wrote it, back in HF's shape: ssm_a stored as -exp(A_log), A and D as columns, the
    gated norm as [groups, inner / groups], the conv kernel squeezed."""
    if part == "A_log":
        return float_op(value, lambda t: torch.log(-t).reshape(-1))
    if part in ("D", "norm.weight"):
        return reshaped(value, -1)
    if part == "conv1d.weight":
        return reshaped(value, value.shape[0], 1, -1)
    return value


def time_step_limit(value: object) -> tuple[float, float]:
    """A config's `time_step_limit` ([min, max]; JSON has no infinity, so checkpoints write it as
    "Infinity", {"__float__": "Infinity"} or a bare Infinity)."""

    def real(v: object) -> float:
        if isinstance(v, dict) and "__float__" in v:
            v = v["__float__"]
        try:
            out = float(v)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(f"time_step_limit holds {v!r}, not a number") from None
        if math.isnan(out):
            raise ValueError("time_step_limit holds NaN")
        return out

    if value is None:
        return 0.0, math.inf
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"time_step_limit must be [min, max], got {value!r}")
    return real(value[0]), real(value[1])


class Mamba2Mixer(nn.Module):
    def __init__(self, hidden_size: int, layer_id: int, dims: Mamba2Dims) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.nh, self.p, self.g, self.n = dims.heads, dims.head_dim, dims.groups, dims.state_size
        self.inner = self.nh * self.p
        self.conv_dim = self.inner + 2 * self.g * self.n
        self.in_proj = nn.Linear(hidden_size, self.inner + self.conv_dim + self.nh, bias=dims.bias)
        k = dims.conv_kernel
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, k, groups=self.conv_dim, bias=dims.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.nh))
        self.A_log = nn.Parameter(torch.zeros(self.nh))
        self.D = nn.Parameter(torch.ones(self.nh))
        self.norm_mode = dims.norm
        if dims.norm != "none":
            self.norm = nn.Module()
            self.norm.weight = nn.Parameter(torch.ones(self.inner))
        out_bias = dims.bias if dims.out_bias is None else dims.out_bias
        self.out_proj = nn.Linear(self.inner, hidden_size, bias=out_bias)
        # HF's full-sequence (chunked) path clamps dt; we clamp at every position, decode too
        self.dt_min, self.dt_max = dims.dt_min, dims.dt_max
        self.eps = dims.eps

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, nh, p, g, n = x.shape[0], self.nh, self.p, self.g, self.n
        z, xbc, dt = torch.split(self.in_proj(x), [self.inner, self.conv_dim, nh], dim=1)
        (conv_state, ssm_state), (conv_ckpt, ssm_ckpt) = ctx.states.layer(self.layer_id)
        weight, bias = self.conv1d.weight[:, 0], self.conv1d.bias
        segs = list(segments(ctx.state_meta))
        conv_out = conv_over_segments(xbc, segs, conv_state, conv_ckpt, weight, bias)
        xs, b, c = torch.split(silu(conv_out).float(), [self.inner, g * n, g * n], dim=1)
        xs = xs.view(t, nh, p)
        b = b.view(t, g, n).repeat_interleave(nh // g, dim=1)  # head h reads group h // (nh / g)
        c = c.view(t, g, n).repeat_interleave(nh // g, dim=1)
        dt = softplus(dt.float() + self.dt_bias.float()).clamp(self.dt_min, self.dt_max)  # [T, nh]
        decay = dt * -self.A_log.float().exp()
        v = xs * dt[..., None]
        y = scan_over_segments(c, b, v, decay, None, segs, ssm_state, ssm_ckpt)
        y = (y + self.D.float()[:, None] * xs).reshape(t, self.inner)
        if self.norm_mode != "before_gate":
            y = y * silu(z.float())
        if self.norm_mode != "none":
            y = y.view(t, g, -1)  # RMSNorm per group, in float32
            y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).reshape(t, -1)
            y = self.norm.weight.float() * y
        if self.norm_mode == "before_gate":
            y = y * silu(z.float())
        return self.out_proj(y.to(x.dtype))

    def decode_step(self, binding: StepBinding):
        """This mixer as a fused decoder's step (baton/ops/mamba_layer.cpp); None without
        recurrent state or with a projection off the packed kernels."""
        out_proj = unwrapped(self.out_proj)
        if binding.states is None or not packed_only(self, out_proj):
            return None
        conv_bias = self.conv1d.bias
        return ops().MambaStep(
            heads=self.nh,
            head_dim=self.p,
            groups=self.g,
            state_size=self.n,
            conv_kernel=self.conv1d.weight.shape[-1],
            hidden=out_proj.out_features,
            **linear_args("in_proj", self.in_proj),
            **linear_args("out_proj", out_proj),
            conv_weight=self.conv1d.weight[:, 0].float().contiguous(),
            conv_bias=None if conv_bias is None else conv_bias.float().contiguous(),
            # forward's -A_log.float().exp(): the same op on the same [nh], once
            neg_exp_a=(-self.A_log.float().exp()).contiguous(),
            dt_bias=self.dt_bias.float().contiguous(),
            d=self.D.float().contiguous(),
            norm=NORM_MODES.index(self.norm_mode),
            norm_weight=self.norm.weight.float().contiguous() if self.norm_mode != "none" else None,
            dt_min=self.dt_min,
            dt_max=self.dt_max,
            norm_eps=self.eps,
            **state_args(binding, self.layer_id),
        )
