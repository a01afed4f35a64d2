"""What recurrent-state layers (Gated DeltaNet, Kimi Delta Attention, Mamba2) share: how a step's
rows map to requests' state slots, the causal conv over a slot's conv window, the token-by-token
state scan, and the snapshots that become state checkpoints.

A request's rows are processed as segments cut at its snapshot positions; after a segment that
ends at one, every state tensor of the layer is copied to that checkpoint. The scan is sequential
over tokens, so the state at a position has the same bits however the scheduler cut the prefill
into chunks, and the same in any batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from baton.ops import recurrent_scan_


@dataclass
class RecurrentSeq:
    """One request's rows [q_start, q_end) of the flat batch and its running state slot."""

    q_start: int
    q_end: int
    slot: int
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (rows from q_start, checkpoint id), sorted


@dataclass
class StateMetadata:
    seqs: list[RecurrentSeq]


@dataclass
class Segment:
    lo: int
    hi: int
    slot: int
    checkpoints: tuple[int, ...]  # where to copy the state after row hi - 1


def segments(meta: StateMetadata) -> Iterator[Segment]:
    for seq in meta.seqs:
        lo = seq.q_start
        cuts: dict[int, list[int]] = {}
        for rows, cid in seq.snapshots:
            cuts.setdefault(rows, []).append(cid)
        for rows, cids in cuts.items():
            hi = seq.q_start + rows
            yield Segment(lo, hi, seq.slot, tuple(cids))
            lo = hi
        if lo < seq.q_end:
            yield Segment(lo, seq.q_end, seq.slot, ())


def causal_conv1d(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Depthwise causal conv of rows x [n, C] continuing from conv_state [C, K-1] (the K-1 inputs
    before them), which is updated in place. weight [C, K]. Returns [n, C], before activation."""
    window = torch.cat((conv_state.t(), x.to(conv_state.dtype)), dim=0)  # [K-1+n, C]
    bias = None if bias is None else bias.to(window.dtype)
    out = F.conv1d(window.t()[None], weight[:, None, :].to(window.dtype), bias, groups=weight.shape[0])[0].t()
    conv_state.copy_(window[window.shape[0] - conv_state.shape[1] :].t())
    return out.to(x.dtype)


def scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor | None,
    state: torch.Tensor,
) -> torch.Tensor:
    """recurrent_scan_ over float32 copies: S = S * exp(decay); S += k (x) (beta * (v - k S)) (or
    k (x) v without beta); out = q S. state [H, Dk, Dv] is updated in place."""
    f = lambda t: t.float().contiguous()  # noqa: E731
    return recurrent_scan_(f(q), f(k), f(v), f(decay), None if beta is None else f(beta), state)


def conv_over_segments(
    x: torch.Tensor,
    segs: list[Segment],
    conv_state: torch.Tensor,  # [slots, C, K-1]
    conv_checkpoints: torch.Tensor,  # [checkpoints, C, K-1]
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """`causal_conv1d` of each segment's rows from its slot's window; checkpoints recorded."""
    out = torch.empty_like(x)
    for s in segs:
        out[s.lo : s.hi] = causal_conv1d(x[s.lo : s.hi], conv_state[s.slot], weight, bias)
        for cid in s.checkpoints:
            conv_checkpoints[cid].copy_(conv_state[s.slot])
    return out


def scan_over_segments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor | None,
    segs: list[Segment],
    state: torch.Tensor,  # [slots, H, Dk, Dv]
    checkpoints: torch.Tensor,  # [checkpoints, H, Dk, Dv]
) -> torch.Tensor:
    """`scan` of each segment's rows from its slot's state; checkpoints recorded. [T, H, Dv] float32."""
    out = torch.empty((q.shape[0], v.shape[1], v.shape[2]), dtype=torch.float32)
    for s in segs:
        rows = slice(s.lo, s.hi)
        out[rows] = scan(q[rows], k[rows], v[rows], decay[rows], None if beta is None else beta[rows], state[s.slot])
        for cid in s.checkpoints:
            checkpoints[cid].copy_(state[s.slot])
    return out
