"""tensor_parallel's SliceTracker: a split layer's slice followed through the operations
attention and MLP code uses, to the dropout that needs it; what it cannot follow is named.

The reference is the whole tensor: each rank's tagged slice must index exactly the elements
the whole computation's result holds there."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fzero
from fzero import optim
from fzero.rng import Slice, Unknown, slice_of, with_slice
from fzero.transforms.tensor_parallel._slices import SliceTracker

B, T, C, H = 2, 5, 12, 4
HD = C // H


def _attention(qkv, heads):
    q, k, v = qkv.chunk(3, dim=2)
    q, k, v = (t.view(B, T, heads, -1).transpose(1, 2) for t in (q, k, v))
    probs = torch.softmax((q @ k.transpose(-2, -1)) * HD ** -0.5 + torch.zeros(T, T), dim=-1)
    y = (probs @ v).transpose(1, 2).contiguous().view(B, T, -1)
    return probs, y


def _take(whole: torch.Tensor, tag: Slice, local: torch.Tensor) -> torch.Tensor:
    """The elements of ``whole`` a rank holding ``local`` with ``tag`` holds."""
    assert tag.parts == 1 and whole.shape[tag.dim] == tag.whole
    return whole.narrow(tag.dim, tag.offset, local.shape[tag.dim])


@pytest.mark.parametrize("tp", [2, 4])
def test_the_slice_of_a_fused_qkv_is_followed_through_attention(tp):
    g = torch.Generator().manual_seed(0)
    whole_qkv = torch.randn(B, T, 3 * C, generator=g)
    whole_probs, whole_y = _attention(whole_qkv, H)
    for r in range(tp):
        n = C // tp
        local = torch.cat([whole_qkv[..., b * C + r * n: b * C + (r + 1) * n] for b in range(3)], -1)
        with SliceTracker():
            probs, y = _attention(with_slice(local, Slice(2, r * n, 3 * C, parts=3)), H // tp)
        assert slice_of(probs) == Slice(1, r * H // tp, H)
        assert slice_of(y) == Slice(2, r * n, C)
        torch.testing.assert_close(probs, _take(whole_probs, slice_of(probs), probs))
        torch.testing.assert_close(y, _take(whole_y, slice_of(y), y))


def test_operations_that_mix_the_split_dim_are_unknown_and_named():
    x = with_slice(torch.randn(B, T, C // 2), Slice(2, 0, C))
    with SliceTracker():
        assert slice_of(x.sum(-1)) == Unknown("sum")
        assert slice_of(x[..., :3]) == Unknown("__getitem__")
        assert slice_of(x[:, 1:]) == Slice(2, 0, C)  # another dim: still the slice
        assert slice_of(torch.softmax(x, -1)) == Unknown("softmax")
        assert slice_of(x @ torch.randn(C // 2, 3)) == Unknown("matmul")  # contracts the split dim
        assert slice_of(F.gelu(x) * 2 + 1) == Slice(2, 0, C)
        assert slice_of(x.view(B, T, 1, C // 2)) is not None  # a local size-1 dim is fine


def test_a_dropout_on_a_tensor_whose_slice_is_unknown_is_an_error_naming_the_operation():
    def step(state, batch):
        x = with_slice(batch.clone(), Unknown("cumprod"))
        F.dropout(x, 0.1, True)
        return state, {}

    apply, params = fzero.functionalize(nn.Linear(1, 1))
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
    with pytest.raises(ValueError, match="slice by 'cumprod'.*Move the dropout after the row-parallel layer"):
        fzero.Step(step)(state, torch.ones(2, 3))
