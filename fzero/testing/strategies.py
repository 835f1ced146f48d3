"""Hypothesis strategies: shapes, tensors, pytrees and small random models.

Tensors are drawn from a seed (hypothesis shrinks the seed and the shapes, not millions of
floats), so strategies stay fast for realistic sizes.

Example:
    >>> from hypothesis import find
    >>> import fzero.testing as ft
    >>> find(ft.shapes(min_dims=2), lambda s: True)
    (1, 1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from hypothesis import strategies as st

__all__ = ["FLOAT_DTYPES", "ModelCase", "dtypes", "models", "pytrees", "seeds", "shapes", "tensors"]

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def seeds() -> st.SearchStrategy[int]:
    """Seeds for torch generators."""
    return st.integers(min_value=0, max_value=2**31 - 1)


def shapes(*, min_dims: int = 0, max_dims: int = 3, min_side: int = 1, max_side: int = 6) -> st.SearchStrategy:
    """Tensor shapes (tuples of ints)."""
    return st.lists(
        st.integers(min_value=min_side, max_value=max_side), min_size=min_dims, max_size=max_dims
    ).map(tuple)


def dtypes(choices: Sequence[torch.dtype] = (torch.float32,)) -> st.SearchStrategy[torch.dtype]:
    """Floating dtypes to draw from (fp32 only by default)."""
    return st.sampled_from(tuple(choices))


@st.composite
def tensors(draw, *, shape=None, dtype=None, scale: float = 1.0) -> torch.Tensor:
    """A tensor of normal values times ``scale``, from a drawn seed."""
    shape = draw(shapes()) if shape is None else shape
    dtype = draw(dtypes()) if dtype is None else dtype
    g = torch.Generator().manual_seed(draw(seeds()))
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


@st.composite
def pytrees(draw, *, max_depth: int = 3, max_children: int = 4, dtype_choices=(torch.float32,), leaf=None):
    """A dict of nested dicts / lists / tuples of tensors, with at least one leaf.

    Args:
        max_depth: nesting depth at most.
        max_children: children per node at most.
        dtype_choices: dtypes the tensor leaves are drawn from.
        leaf: a strategy for leaves, instead of tensors.
    """
    leaf_st = leaf if leaf is not None else _tensor_leaves(tuple(dtype_choices))
    keys = st.text(alphabet="abcdefghij_", min_size=1, max_size=4)

    def node(depth):
        if depth >= max_depth:
            return leaf_st
        child = st.deferred(lambda: node(depth + 1))
        return st.one_of(
            leaf_st,
            st.dictionaries(keys, child, min_size=1, max_size=max_children),
            st.lists(child, min_size=1, max_size=max_children),
            st.lists(child, min_size=1, max_size=max_children).map(tuple),
        )

    return draw(st.dictionaries(keys, node(1), min_size=1, max_size=max_children))


def _tensor_leaves(dts: tuple) -> st.SearchStrategy:
    return st.builds(lambda t, d: t.to(d), tensors(dtype=torch.float32), st.sampled_from(dts))


# --------------------------------------------------------------------------- models


@dataclasses.dataclass(frozen=True)
class ModelCase:
    """A small random model and a batch for it, reproducible from ``seed``.

    ``make()`` builds the ``nn.Module``; ``batch(n)`` draws a regression batch
    ``{"x": (n, d_in), "y": (n, d_out)}``.
    """

    widths: tuple[int, ...]
    activation: str
    layernorm: bool
    bias: bool
    seed: int

    def make(self) -> torch.nn.Module:
        torch.manual_seed(self.seed)
        act = {"tanh": torch.nn.Tanh, "gelu": torch.nn.GELU, "relu": torch.nn.ReLU}[self.activation]
        layers: list[torch.nn.Module] = []
        for i, (a, b) in enumerate(zip(self.widths[:-1], self.widths[1:])):
            layers.append(torch.nn.Linear(a, b, bias=self.bias))
            if i < len(self.widths) - 2:
                # LayerNorm over one or two features outputs a constant (its bias, or ±1 times
                # its weight): the gradient reaching the layer before is pure rounding noise,
                # which Adam amplifies -- not a model to compare trajectories on.
                if self.layernorm and b > 2:
                    layers.append(torch.nn.LayerNorm(b))
                layers.append(act())
        return torch.nn.Sequential(*layers)

    def batch(self, n: int, seed: int = 0) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 7919 + seed)
        return {
            "x": torch.randn(n, self.widths[0], generator=g),
            "y": torch.randn(n, self.widths[-1], generator=g),
        }


@st.composite
def models(draw, *, max_layers: int = 3, max_width: int = 12) -> ModelCase:
    """Small random MLPs (depth, widths, activation, LayerNorm, bias all drawn)."""
    n = draw(st.integers(min_value=1, max_value=max_layers))
    widths = tuple(draw(st.lists(st.integers(1, max_width), min_size=n + 1, max_size=n + 1)))
    return ModelCase(
        widths=widths,
        activation=draw(st.sampled_from(["tanh", "gelu", "relu"])),
        layernorm=draw(st.booleans()),
        bias=draw(st.booleans()),
        seed=draw(st.integers(0, 10_000)),
    )
