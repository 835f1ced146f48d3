"""``Deferred``: the placeholder of a gradient that no rank has yet.

Under ``accumulate``, ``shard_state`` at stages 0-1 reduces once per update (see
``docs/zero.md``); in the micro-batches before the last, ``value_and_grad`` returns these
in place of the gradients. The handlers that sum or check gradients (``accumulate``,
``mixed_precision``) leave them out; anything else is refused with an error naming the
operation.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Deferred", "is_deferred"]


class Deferred:
    """A gradient that is not available yet: a placeholder in the gradient tree.

    Under ``accumulate``, ``shard_state`` at stages 0-1 adds each micro-batch's gradient
    into its reduce buffers and all-reduces the sum once, at the update's last micro-batch
    (as DDP's ``no_sync`` does); before that no rank has the micro-batch's global gradient.
    ``value_and_grad`` then returns these placeholders, which the step passes on to
    ``state.apply_gradients`` unchanged; the handlers that sum or check gradients leave them
    out (the last micro-batch's gradient holds the whole sum). Any computation with one is
    an error naming the operation: never a silently rank-local value.
    """

    __slots__ = ("name", "shape", "dtype")

    def __init__(self, name: str, shape: tuple[int, ...], dtype):
        self.name, self.shape, self.dtype = name, tuple(shape), dtype

    def _refuse(self, op: str):
        raise TypeError(
            f"fzero.value_and_grad: {op} on the gradient of {self.name!r}, which no rank has in this "
            "micro-batch: under accumulate, shard_state stages 0-1 sum the micro-batches' gradients "
            "locally and reduce them once, at the update's last micro-batch; pass the gradients to "
            "state.apply_gradients unchanged"
        )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        op = getattr(func, "__name__", str(func))
        found = _first_deferred((args, kwargs or {}))
        if found is None:
            raise TypeError(f"fzero.value_and_grad: {op} on a gradient that no rank has in this micro-batch")
        found._refuse(op)

    def __getattr__(self, name: str):
        if name.startswith("_"):  # probes (copy, pickle, hasattr(x, "_fields")) stay plain misses
            raise AttributeError(name)
        self._refuse(f"Tensor.{name}")

    def __repr__(self) -> str:
        return f"Deferred({self.name!r}, shape={self.shape}, dtype={self.dtype})"

    __hash__ = object.__hash__


def _refusing(op: str):
    def method(self, *args):
        self._refuse(op)

    return method


# Python looks operators up on the type, never through __getattr__: each one refuses.
for _op in ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "floordiv", "pow", "matmul",
            "rmatmul", "neg", "abs", "lt", "le", "gt", "ge", "eq", "ne", "bool", "float", "int", "index",
            "len", "iter", "getitem", "setitem", "iadd", "isub", "imul", "itruediv"):
    setattr(Deferred, f"__{_op}__", _refusing(f"__{_op}__"))
del _op


def _first_deferred(x) -> Deferred | None:
    if isinstance(x, Deferred):
        return x
    items = x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else ()
    for item in items:
        found = _first_deferred(item)
        if found is not None:
            return found
    return None


def is_deferred(x: Any) -> bool:
    return isinstance(x, Deferred)
