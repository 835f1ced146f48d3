"""Batches given to a compiled step: leaves of every bad kind, trees that change; and the
check each case is held to (plain PyTorch's step, or the state before a non-finite batch).
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

import torch
from hypothesis import strategies as st

from fzero.testing.fuzz._outcome import Outcome, describe, outcome


LeafKind = Literal["good", "float64", "float16", "bfloat16", "int64", "bool", "complex64", "flat", "extra_dim",
                   "wide", "empty", "nan", "inf", "list", "none", "str", "scalar", "int", "numpy", "noncontig",
                   "meta"]
LEAF_KINDS: tuple[str, ...] = LeafKind.__args__  # type: ignore[attr-defined]


def make_leaf(kind: str, rows: int, cols: int, seed: int) -> Any:
    """One batch leaf of ``rows x cols`` normal values, made bad as ``kind`` says."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g)
    if kind in ("float64", "float16", "bfloat16", "int64", "bool", "complex64"):
        return t.to(getattr(torch, kind))
    if kind == "flat":
        return t.reshape(-1)
    if kind == "extra_dim":
        return t[None]
    if kind == "wide":
        return torch.randn(rows, cols + 1 + seed % 3, generator=g)
    if kind == "empty":
        return torch.randn(0, cols)
    if kind in ("nan", "inf"):
        t[seed % rows, seed % cols] = math.nan if kind == "nan" else -math.inf
        return t
    if kind == "list":
        return t.tolist()
    if kind == "numpy":
        return t.numpy()
    if kind == "noncontig":
        return torch.randn(cols, rows, generator=g).t()
    if kind == "meta":
        return torch.empty(rows, cols, device="meta")
    return {"none": None, "str": "x", "scalar": torch.tensor(1.0), "int": 3}.get(kind, t)


@st.composite
def batches(draw, *, d_in: int = 4, d_out: int = 2, max_rows: int = 7, good_weight: int = 3) -> dict:
    """``{"rows", "x", "y", "tree", "batch"}``: a batch for ``Linear(d_in, d_out)`` under an
    MSE step; each leaf good or bad (:data:`LEAF_KINDS`), its tree a dict ``{x, y}`` or one
    missing, extra, tupled, nested or listed."""
    rows = draw(st.integers(1, max_rows))
    kinds = ("good",) * good_weight + LEAF_KINDS[1:]
    kx, ky = draw(st.sampled_from(kinds)), draw(st.sampled_from(kinds))
    seed = draw(st.integers(0, 2**16))
    b: Any = {"x": make_leaf(kx, rows, d_in, seed), "y": make_leaf(ky, rows, d_out, seed + 1)}
    tree = draw(st.sampled_from(["dict"] * 4 + ["missing", "extra", "tuple", "nested", "list"]))
    if tree == "missing":
        b.pop(draw(st.sampled_from(["x", "y"])))
    elif tree == "extra":
        b["z"] = make_leaf(draw(st.sampled_from(kinds)), rows, 3, seed + 2)
    elif tree == "tuple":
        b = (b["x"], b["y"])
    elif tree == "nested":
        b = {**b, "meta": {"ids": torch.arange(rows)}}
    elif tree == "list":
        b = [b]
    return {"rows": rows, "x": kx, "y": ky, "tree": tree, "batch": b}


def linear(seed: int = 0) -> torch.nn.Module:
    """The ``Linear(4, 2)`` every case trains, its weights from ``seed``."""
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 2)


_STEPS: dict = {}


def _compiled(accumulate: int, precision: str) -> tuple[Any, Any]:
    """One compiled step (SGD 0.1, momentum 0.9, one process) per (accumulate, precision), shared by the
    cases: a batch tree that changes between calls is part of what is drawn."""
    import fzero
    from fzero import optim
    from fzero.testing.steps import mse_step

    key = (accumulate, precision)
    if key not in _STEPS:
        apply, params = fzero.functionalize(linear())
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1, 0.9))
        step = fzero.compile(mse_step, accumulate=accumulate, precision=precision, donate=False)
        _STEPS[key] = (step, step.init(state))
    return _STEPS[key]


def _torch_sgd_step(batch: dict) -> dict[str, torch.Tensor]:
    """Plain PyTorch's SGD(0.1, momentum 0.9) step of ``mse_step`` on ``batch``: the new weights."""
    import torch.nn.functional as F

    module = linear()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    F.mse_loss(module(batch["x"]), batch["y"]).backward()
    opt.step()
    return {k: v.detach() for k, v in module.state_dict().items()}


def _finite(t: Any) -> bool:
    return not isinstance(t, torch.Tensor) or t.device.type == "meta" or not t.is_floating_point() or bool(
        torch.isfinite(t).all())


_LEAF_PATH = re.compile(r"\[('[^']*'|\d+)\]")


def batch_case(case: dict, accumulate: int, precision: str) -> Outcome:
    """A drawn batch (:func:`batches`) given to a compiled step ends in fzero's error naming
    the leaf, in the error the step's own code raised, or in a correct step: plain
    PyTorch's weights for an fp32 batch; the state before it for a batch with NaN or inf
    (the update skipped). An empty batch runs as plain PyTorch runs it (a NaN loss, zero
    gradients, an update)."""
    import warnings

    import fzero
    from fzero.testing.asserts import assert_trees_close

    step, state = _compiled(accumulate, precision)
    batch = case["batch"]
    before = {k: v.clone() for k, v in fzero.gather(state.params).items()}
    momentum_before = [t.clone() for t in fzero.tree.leaves(state.opt_state) if isinstance(t, torch.Tensor)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kind, result = outcome(lambda: step(state, batch), named=(ValueError, TypeError, RuntimeError),
                               prefix="fzero", user_files=("fzero/testing/steps.py",))
    what = f"x {case['x']}, y {case['y']}, tree {case['tree']}, accumulate {accumulate}, {precision}"
    assert kind != "bug", f"{what}: {describe(result)}"
    if kind == "named":  # a batch's problem names the leaf by its key path
        assert _LEAF_PATH.search(str(result)) or "batch" in str(result), f"{what}: {result}"
    if kind != "ran":
        return kind
    new, _ = result
    after = fzero.gather(new.params)
    leaves = [batch[k] for k in ("x", "y") if k in batch] if isinstance(batch, dict) else []  # what the step reads
    if not all(_finite(t) for t in leaves):
        assert all(torch.equal(after[k], before[k]) for k in before), f"{what}: a non-finite batch changed the params"
        assert int(new.step) == int(state.step), f"{what}: a non-finite batch's update was counted"
        momentum = [t for t in fzero.tree.leaves(new.opt_state) if isinstance(t, torch.Tensor)]
        same = len(momentum) == len(momentum_before) and all(map(torch.equal, momentum, momentum_before))
        assert same, f"{what}: a non-finite batch moved the optimizer's momentum"
    elif precision == "fp32" and case["tree"] in ("dict", "extra", "nested"):
        assert_trees_close(after, _torch_sgd_step(batch), rtol=1e-5, atol=1e-6)
    return kind
