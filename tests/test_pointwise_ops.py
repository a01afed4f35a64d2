"""baton's pointwise ops and row linears (baton/ops/torch_rounding.h, pointwise.cpp): the module path
and the fused steps call them so that a row's bits are the same in any batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from baton.ops import pointwise, row_linear

REFERENCE = {
    "silu": lambda x: x * torch.sigmoid(x),
    "sigmoid": torch.sigmoid,
    "softplus": lambda x: torch.where(x > 20, x, torch.log1p(torch.exp(x))),
}


@pytest.mark.parametrize("op", sorted(REFERENCE))
def test_pointwise_matches_float64(op):
    x = torch.cat([torch.randn(997) * 8, torch.tensor([0.0, -0.0, 20.0, 20.5, -90.0, 90.0])])
    got = pointwise(x, op)
    want = REFERENCE[op](x.double())
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("op", sorted(REFERENCE))
def test_an_elements_bits_do_not_depend_on_the_tensor_around_it(op):
    """torch's own kernels take a tensor's tail through libm: a value's result would change with
    the tensor's length, as a row's does with its batch."""
    x = torch.randn(3 * 4099) * 6
    whole = pointwise(x, op)
    for start, stop in [(0, 1), (0, 7), (5, 21), (3, 4099), (4099, 2 * 4099 + 3), (1, 3 * 4099)]:
        assert torch.equal(pointwise(x[start:stop], op), whole[start:stop]), (start, stop)
    rows = x.view(3, 4099)[:, :13]  # strided rows
    assert torch.equal(pointwise(rows, op), whole.view(3, 4099)[:, :13])


def test_pointwise_keeps_torchs_ops_for_other_dtypes_and_refuses_unknown_ones():
    x = torch.randn(10, dtype=torch.bfloat16)
    assert torch.equal(pointwise(x, "silu"), F.silu(x))
    with pytest.raises(RuntimeError, match="unknown pointwise op 'tanh'"):
        pointwise(torch.randn(4), "tanh")


@pytest.mark.parametrize("out_features,in_features", [(1, 5), (7, 64), (64, 131)])
def test_row_linear_matches_float64_and_gives_a_row_the_same_bits_in_any_batch(out_features, in_features):
    w = torch.randn(out_features, in_features)
    x = torch.randn(37, in_features)
    full = row_linear(x, w)
    torch.testing.assert_close(full.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)
    for rows in (slice(0, 1), slice(4, 7), slice(36, 37)):
        assert torch.equal(row_linear(x[rows], w), full[rows])
    wide = torch.randn(37, 2 * in_features)
    assert torch.equal(row_linear(wide[:, :in_features], w)[3], row_linear(wide[3:4, :in_features], w)[0])


def test_row_linear_per_head_matches_einsum_and_rejects_mismatched_shapes():
    x, w = torch.randn(9, 4, 24), torch.randn(4, 6, 24)
    got = row_linear(x, w)
    torch.testing.assert_close(got, torch.einsum("thk,hnk->thn", x, w), rtol=1e-5, atol=1e-5)
    assert torch.equal(row_linear(x[2:3], w), got[2:3])
    with pytest.raises(RuntimeError, match="does not match"):
        row_linear(x, torch.randn(3, 6, 24))
    with pytest.raises(RuntimeError, match="does not match"):
        row_linear(torch.randn(2, 8), torch.randn(3, 7))
