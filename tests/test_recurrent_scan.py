"""The compiled recurrent-state scan (Gated DeltaNet, Kimi Delta Attention, Mamba2) against the
same recurrence written out token by token in torch (float64)."""

from __future__ import annotations

import pytest
import torch

from baton.ops import recurrent_scan_

T, H, DK, DV = 37, 3, 16, 24


def reference(q, k, v, decay, beta, state):
    """(out, state after) of the scan, one token at a time in float64."""
    q, k, v, decay, s = q.double(), k.double(), v.double(), decay.double(), state.double().clone()
    beta = None if beta is None else beta.double()
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    for t in range(q.shape[0]):
        g = decay[t].exp()
        s = s * (g[:, :, None] if g.dim() == 2 else g[:, None, None])  # per key channel: row i of S
        if beta is None:
            s = s + k[t][:, :, None] * v[t][:, None, :]
        else:
            kv_mem = torch.einsum("hi,hij->hj", k[t], s)
            delta = (v[t] - kv_mem) * beta[t][:, None]
            s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hi,hij->hj", q[t], s)
    return out.float(), s.float()


def random_case(kind, seed, t=T, h=H, dk=DK, dv=DV):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, dk, generator=g) / dk**0.5
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=g), dim=-1)
    v = torch.randn(t, h, dv, generator=g)
    if kind == "kda":  # per key channel decay
        decay = -torch.rand(t, h, dk, generator=g) * 0.5
    else:
        decay = -torch.rand(t, h, generator=g) * 0.5
    beta = None if kind == "mamba2" else torch.rand(t, h, generator=g)
    state = torch.randn(h, dk, dv, generator=g) * 0.1
    return q, k, v, decay, beta, state


KINDS = ["gdn", "kda", "mamba2"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dims", [(T, H, DK, DV), (5, 2, 7, 100), (1, 4, 128, 128)])
def test_matches_reference(kind, dims):
    q, k, v, decay, beta, state = random_case(kind, 0, *dims)
    want_out, want_state = reference(q, k, v, decay, beta, state)
    out = recurrent_scan_(q, k, v, decay, beta, state)
    assert out.shape == want_out.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_split_calls_are_bitwise_equal(kind):
    q, k, v, decay, beta, state = random_case(kind, 1)
    whole_state = state.clone()
    whole = recurrent_scan_(q, k, v, decay, beta, whole_state)
    parts = []
    for a, b in ((0, 3), (3, T)):
        parts.append(recurrent_scan_(q[a:b], k[a:b], v[a:b], decay[a:b], None if beta is None else beta[a:b], state))
    assert torch.equal(torch.cat(parts), whole)
    assert torch.equal(state, whole_state)


def test_token_by_token_is_bitwise_equal():
    q, k, v, decay, beta, state = random_case("gdn", 2)
    whole_state = state.clone()
    whole = recurrent_scan_(q, k, v, decay, beta, whole_state)
    steps = [
        recurrent_scan_(q[t : t + 1], k[t : t + 1], v[t : t + 1], decay[t : t + 1], beta[t : t + 1], state)
        for t in range(T)
    ]
    assert torch.equal(torch.cat(steps), whole)
    assert torch.equal(state, whole_state)


def test_zero_tokens_leave_state_unchanged():
    q, k, v, decay, beta, state = random_case("kda", 3, t=0)
    before = state.clone()
    out = recurrent_scan_(q, k, v, decay, beta, state)
    assert out.shape == (0, H, DV)
    assert torch.equal(state, before)


def test_bad_inputs_raise():
    q, k, v, decay, beta, state = random_case("gdn", 4)
    with pytest.raises(RuntimeError, match="q must be a contiguous float32 CPU tensor"):
        recurrent_scan_(q.double(), k, v, decay, beta, state)
    with pytest.raises(RuntimeError, match="state must be a contiguous float32 CPU tensor"):
        recurrent_scan_(q, k, v, decay, beta, state.half())
    with pytest.raises(RuntimeError, match="v must be a contiguous float32 CPU tensor"):
        recurrent_scan_(q, k, v.transpose(0, 1).contiguous().transpose(0, 1), decay, beta, state)
    with pytest.raises(RuntimeError, match=r"k \[37, 2, 16\] must match q"):
        recurrent_scan_(q, k[:, :2].contiguous(), v, decay, beta, state)
    with pytest.raises(RuntimeError, match=r"state \[2, 16, 24\] must be \[H=3, Dk=16, Dv=24\]"):
        recurrent_scan_(q, k, v, decay, beta, state[:2])
    with pytest.raises(RuntimeError, match=r"decay \[37, 2\] must be"):
        recurrent_scan_(q, k, v, decay[:, :2].contiguous(), beta, state)
    with pytest.raises(RuntimeError, match=r"decay \[37, 3, 15\] must be"):
        recurrent_scan_(q, k, v, torch.zeros(T, H, DK - 1), beta, state)
    with pytest.raises(RuntimeError, match=r"beta \[36, 3\] must be \[T=37, H=3\]"):
        recurrent_scan_(q, k, v, decay, beta[1:], state)
    with pytest.raises(RuntimeError, match="state must not share memory with v"):
        recurrent_scan_(q, k, v, decay, beta, v.view(-1)[: H * DK * DV].view(H, DK, DV))


def test_thread_count_does_not_change_bits():
    q, k, v, decay, beta, state = random_case("kda", 5, t=9, h=4, dk=32, dv=200)
    one_state = state.clone()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = recurrent_scan_(q, k, v, decay, beta, one_state)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(recurrent_scan_(q, k, v, decay, beta, state), one)
    assert torch.equal(state, one_state)
