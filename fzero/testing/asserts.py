"""``assert_trees_close``: two pytrees, one structure, leafwise-close values.

Example:
    >>> import torch
    >>> from fzero.testing import assert_trees_close
    >>> assert_trees_close({"w": torch.ones(2)}, {"w": torch.ones(2) + 1e-7})
    >>> assert_trees_close({"w": torch.ones(2)}, {"w": torch.zeros(2)})
    Traceback (most recent call last):
    AssertionError: assert_trees_close(trees): 1 leaves differ:
      ['w']: 2/2 elements differ (rtol=1e-05, atol=1e-06); worst at [0]: 1.0 vs expected 0.0; max abs err 1, max rel err 1e+30
"""

from __future__ import annotations

from typing import Any

import torch

from fzero import tree
from fzero.testing.tolerances import _for_dtypes, _row

__all__ = ["assert_trees_close"]


def assert_trees_close(actual: Any, expected: Any, *, tol: str | None = None, rtol: float | None = None,
                       atol: float | None = None, what: str = "trees") -> None:
    """Assert two pytrees have one structure and leafwise-close values.

    Args:
        actual, expected: the pytrees (a ``Params`` compares as the dict of its entries).
        tol: the row of :data:`fzero.testing.TOLERANCES` to compare by; default: the row of
            the leaves' dtype (the looser of the two sides), ``"exact"`` for a dtype without one.
        rtol, atol: override the row's.
        what: names the comparison in the error.

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
            r, t = _for_dtypes(a.dtype, e.dtype) if tol is None else _row(tol)[:2]
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


def _plain(x: Any) -> Any:
    from fzero._params import Params

    return tree.map(lambda p: {k: v for k, v in p.items() if v is not None} if isinstance(p, Params) else p,
                    x, is_leaf=lambda p: isinstance(p, Params))
