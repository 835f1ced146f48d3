"""Property-testing helpers: hypothesis strategies and ``assert_trees_close``.

fzero's own tests use these, and so can users who property-test their own steps:

    >>> from hypothesis import given, settings
    >>> import fzero.testing as ft
    >>> @settings(max_examples=5, deadline=None)
    ... @given(ft.pytrees())
    ... def test_roundtrip(t):
    ...     leaves, spec = fzero.tree.flatten(t)
    ...     ft.assert_trees_close(fzero.tree.unflatten(spec, leaves), t)
    >>> import fzero; test_roundtrip()

Tensors are drawn from a seed (hypothesis shrinks the seed and the shapes, not millions of
floats), so strategies stay fast for realistic sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from hypothesis import strategies as st

from fzero import tree

__all__ = [
    "TOLERANCES",
    "ModelCase",
    "assert_trees_close",
    "dtypes",
    "models",
    "pytrees",
    "seeds",
    "shapes",
    "tensors",
]

# One table of tolerances for the whole project: (rtol, atol) by the dtype compared.
# fp32: reduction-order error over a few steps of training (SPEC: relative 1e-5).
# bf16 / fp16: a few units in the last place of their 8 / 11-bit mantissas.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.bfloat16: (2e-2, 1e-2),
    torch.float16: (2e-3, 1e-3),
}

def _plain(x: Any) -> Any:
    from fzero._params import Params

    return tree.map(lambda p: {k: v for k, v in p.items() if v is not None} if isinstance(p, Params) else p,
                    x, is_leaf=lambda p: isinstance(p, Params))


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


# --------------------------------------------------------------------------- comparison


def assert_trees_close(actual: Any, expected: Any, *, rtol: float | None = None, atol: float | None = None,
                       what: str = "trees") -> None:
    """Assert two pytrees have one structure and leafwise-close values.

    Tolerances default to :data:`TOLERANCES` for the leaves' dtype (the looser of the two).
    Non-tensor leaves must be equal.

    Raises:
        AssertionError: naming every key path that differs, with the largest absolute and
            relative error and where it is.
    """
    # A Params compares as the dict of its entries (its frozen entries' None gradients are
    # absent, as in a reference built from named_parameters() that require grad).
    actual, expected = _plain(actual), _plain(expected)
    try:
        tree.assert_same_structure(expected, actual, what=f"assert_trees_close({what})", names=("expected", "actual"))
    except tree.StructureError as e:
        raise AssertionError(str(e)) from None
    paths, exp_leaves, _ = tree.flatten_with_path(expected)
    act_leaves = tree.leaves(actual)
    problems = []
    for path, a, e in zip(paths, act_leaves, exp_leaves):
        name = tree.keystr(path) or "<root>"
        if isinstance(e, torch.Tensor) or isinstance(a, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor)):
                problems.append(f"{name}: {type(a).__name__} vs {type(e).__name__}")
                continue
            if a.shape != e.shape:
                problems.append(f"{name}: shape {tuple(a.shape)} vs expected {tuple(e.shape)}")
                continue
            r, t = _tolerance(a.dtype, e.dtype)
            r = r if rtol is None else rtol
            t = t if atol is None else atol
            a64, e64 = a.detach().double().cpu(), e.detach().double().cpu()
            same_nonfinite = (~torch.isfinite(e64)) & (a64.isnan() & e64.isnan() | (a64 == e64))
            err = (a64 - e64).abs().masked_fill(same_nonfinite, 0.0)
            bad = err > t + r * e64.abs()
            if bad.any():
                i = int(torch.argmax((err - t - r * e64.abs()).flatten()))
                idx = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), e.shape)) if e.dim() else ()
                rel = err / e64.abs().clamp_min(1e-30)
                problems.append(
                    f"{name}: {int(bad.sum())}/{e.numel()} elements differ (rtol={r:g}, atol={t:g}); "
                    f"worst at {list(idx)}: {a64.flatten()[i].item()!r} vs expected {e64.flatten()[i].item()!r}; "
                    f"max abs err {err.max().item():.3g}, max rel err {rel.max().item():.3g}"
                )
        elif a != e:
            problems.append(f"{name}: {a!r} vs expected {e!r}")
    if problems:
        raise AssertionError(f"assert_trees_close({what}): {len(problems)} leaves differ:\n  " + "\n  ".join(problems))


def _tolerance(*dts: torch.dtype) -> tuple[float, float]:
    tols = [TOLERANCES.get(d, (0.0, 0.0)) for d in dts]
    return max(t[0] for t in tols), max(t[1] for t in tols)
