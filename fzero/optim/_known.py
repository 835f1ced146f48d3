"""What each of fzero's transformations is, for the lowering (:mod:`fzero.optim.lowering`).

A :class:`~fzero.optim.GradientTransformation` is optax's pair ``(init, update)`` and nothing
more. Each factory of :mod:`fzero.optim` also *records* what it built: a small frozen
dataclass naming the transformation and its hyperparameters (``ScaleByAdam(b1, b2, eps,
eps_root)``, ``Chain(transforms)``, ...), under the transformation it returns. From these
records the lowering

* recognises the chains the fused kernels compute (:func:`fused_spec_of`: ``adamw`` is
  ``Chain(ScaleByAdam, AddDecayedWeights, ScaleByLearningRate)``, whoever chained it), and
* knows where an update may write in place (:func:`update`): which transformations may
  overwrite the updates they are handed (``inplace``), which may write their new state into
  the old one when the caller gives it up (``donates``), and what their returned updates are
  (``output``). Such an ``update`` takes the keyword-only extras ``inplace=True`` /
  ``donate=True``, and computes the same bits with them; without them it is pure.

A transformation of one's own has no record: it runs as optax runs it, out of place, and
is never fused.

Why a registry, not subclasses of ``GradientTransformation``: a NamedTuple subclass cannot
add a field without changing the tuple (``init, update = tx`` must keep working), and
hyperparameters stored on the instance would be attributes hung on the value. The record is
keyed by the transformation's ``update`` function -- what the transformation does -- and held
weakly, so it goes when the transformation does.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any, Literal

from fzero import tree

__all__ = ["FusedSpec", "fused_spec_of", "needs_whole_tensors"]

Output = Literal["new", "passthrough", "shared"]


# --------------------------------------------------------------------------- the records


class Known:
    """A record: which transformation this is. The defaults claim nothing."""

    inplace = False  # update takes inplace=True and may then overwrite the incoming updates
    donates = False  # update takes donate=True and may then write its new state into the old one
    # The update of a leaf reads the whole leaf (a factored second moment, an orthogonalised
    # matrix): under ZeRO each such leaf gets an owner rank that updates it whole
    # (fzero/optim/_owners.py). False: element-wise, so this rank's pieces are enough.
    whole_tensors = False

    @property
    def output(self) -> Output:
        """``"new"``: made by this call, held by nothing else; ``"passthrough"``: the incoming
        updates wherever it made none; ``"shared"``: possibly held elsewhere (by the state)."""
        return "shared"


@dataclasses.dataclass(frozen=True)
class Identity(Known):
    inplace = True
    output = "passthrough"


@dataclasses.dataclass(frozen=True)
class Scale(Known):
    step_size: float
    inplace = True
    output = "new"


@dataclasses.dataclass(frozen=True)
class ScaleBySchedule(Known):
    step_size_fn: Callable[[int], float]
    inplace = True
    output = "new"


@dataclasses.dataclass(frozen=True)
class ScaleByLearningRate(Known):
    learning_rate: float | Callable[[int], float]
    flip_sign: bool
    inplace = True
    output = "new"


@dataclasses.dataclass(frozen=True)
class ClipByGlobalNorm(Known):
    max_norm: float
    inplace = True
    output = "new"


@dataclasses.dataclass(frozen=True)
class ScaleByAdam(Known):
    b1: float
    b2: float
    eps: float
    eps_root: float
    bias_correction: bool = True
    donates = True
    output = "new"


@dataclasses.dataclass(frozen=True)
class ScaleByLion(Known):
    b1: float
    b2: float
    donates = True
    output = "new"


@dataclasses.dataclass(frozen=True)
class ScaleByTrustRatio(Known):
    min_norm: float
    trust_coefficient: float
    eps: float
    inplace = True
    output = "new"


@dataclasses.dataclass(frozen=True)
class AddDecayedWeights(Known):
    weight_decay: float
    inplace = True

    @property
    def output(self) -> Output:
        return "passthrough" if self.weight_decay == 0.0 else "new"


@dataclasses.dataclass(frozen=True)
class Trace(Known):
    decay: float
    nesterov: bool
    donates = True

    @property
    def output(self) -> Output:
        # Without nesterov the update is the new trace itself: shared with the state.
        return "new" if self.nesterov else "shared"


@dataclasses.dataclass(frozen=True, eq=False)
class Masked(Known):
    inner: Any  # a GradientTransformation
    mask: Any
    inplace = True

    @property
    def donates(self) -> bool:
        return donates(self.inner)

    @property
    def whole_tensors(self) -> bool:
        return needs_whole_tensors(self.inner)

    @property
    def output(self) -> Output:
        # Masked-out leaves pass through: new only where the incoming updates were too.
        return "shared" if output(self.inner) == "shared" else "passthrough"


@dataclasses.dataclass(frozen=True, eq=False)
class Chain(Known):
    transforms: tuple  # of GradientTransformation
    inplace = True

    @property
    def donates(self) -> bool:
        return any(donates(t) for t in self.transforms)

    @property
    def whole_tensors(self) -> bool:
        return any(needs_whole_tensors(t) for t in self.transforms)

    @property
    def output(self) -> Output:
        out: Output = "passthrough"
        for t in self.transforms:
            out = out if output(t) == "passthrough" else output(t)
        return out


@dataclasses.dataclass(frozen=True, eq=False)
class FromTorch(Known):
    """A ``torch.optim.Optimizer`` class run as a transformation (:func:`fzero.optim.from_torch`).
    ``elementwise``: ``True`` runs on pieces, ``False`` on whole tensors, ``None`` undeclared
    (a third-party class: refused under ZeRO >= 1, see :func:`check_partitionable`)."""

    optimizer_cls: type
    elementwise: bool | None
    # (grads, state, params) -> (params, state): one donated update that steps the optimizer
    # on the parameters themselves, in place (the lowering's path for a bare from_torch).
    step_in_place: Any = None
    inplace = True
    donates = True
    output = "new"

    @property
    def whole_tensors(self) -> bool:
        return self.elementwise is False


@dataclasses.dataclass(frozen=True, eq=False)
class Adafactor(Known):
    whole_tensors = True
    output = "new"


@dataclasses.dataclass(frozen=True, eq=False)
class Muon(Known):
    whole_tensors = True
    output = "new"


_RECORDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def record(tx, what: Known):
    """Record that ``tx`` is ``what`` (replacing an earlier record: a factory built on another
    says more precisely what it built); returns ``tx``."""
    _RECORDS[tx.update] = what
    return tx


def known(tx) -> Known | None:
    """The record of ``tx``, or ``None`` for a transformation of one's own."""
    try:
        return _RECORDS.get(tx.update)
    except TypeError:  # an update that cannot be weakly referenced was never recorded
        return None


def donates(tx) -> bool:
    what = known(tx)
    return what is not None and what.donates


def output(tx) -> Output:
    what = known(tx)
    return "shared" if what is None else what.output


def needs_whole_tensors(tx) -> bool:
    """Whether some member of ``tx`` updates a leaf from the whole leaf (``Known.whole_tensors``:
    ``adafactor``, ``muon``, ``from_torch(..., elementwise=False)``), so that ZeRO must not
    hand it this rank's flat pieces alone. A transformation of one's own has no record and
    claims nothing (``False``)."""
    what = known(tx)
    return what is not None and what.whole_tensors


def _records(tx):
    """Every record in ``tx``, chains and masks opened."""
    what = known(tx)
    if what is None:
        return
    yield what
    if isinstance(what, Chain):
        for t in what.transforms:
            yield from _records(t)
    elif isinstance(what, Masked):
        yield from _records(what.inner)


def check_partitionable(tx, *, stage: int, where: str) -> None:
    """Refuse, under ZeRO ``stage`` >= 1, a ``from_torch`` optimizer whose kind is undeclared:
    run on this rank's flat pieces, a whole-tensor optimizer would compute something else
    without a sign. Raises :class:`ValueError` naming every such class and the keyword."""
    if stage < 1:
        return
    undeclared = [w.optimizer_cls for w in _records(tx) if isinstance(w, FromTorch) and w.elementwise is None]
    if undeclared:
        names = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in undeclared)
        raise ValueError(
            f"{where}: at ZeRO stage {stage} the optimizer's state and update are partitioned, and fzero cannot tell "
            f"whether {names} updates each element from that element alone or reads whole tensors (a factored "
            f"moment, an orthogonalisation). Declare it: fzero.optim.from_torch(cls, elementwise=True, ...) runs it "
            f"on this rank's flat pieces; elementwise=False gives each parameter an owner rank that updates it "
            f"whole. (At stage 0 every rank holds whole tensors, and it runs undeclared.)")


# --------------------------------------------------------------------------- in place


def update(tx, updates, state, params, *, new: bool, donate: bool):
    """``tx.update(updates, state, params)``, told to write into ``updates`` when they are
    ``new`` and into ``state`` when the caller gives it up, each where ``tx``'s record says
    it can. Same bits either way."""
    what = known(tx)
    kwargs = {}
    if what is not None:
        if new and what.inplace:
            kwargs["inplace"] = True
        if donate and what.donates:
            kwargs["donate"] = True
    return tx.update(updates, state, params, **kwargs)


def still_new(tx, new: bool) -> bool:
    """Whether ``tx``'s returned updates are new, given whether its incoming ones were."""
    out = output(tx)
    return out == "new" or (out == "passthrough" and new)


# --------------------------------------------------------------------------- known chains


FusedKind = Literal["adam", "adamw", "sgd", "lamb", "lion"]


@dataclasses.dataclass(frozen=True)
class FusedSpec:
    """Which optimizer a chain is, and its hyperparameters: what :func:`fused_spec_of`
    recognises and the fused kernels compute. Fields an optimizer does not use are ``None``.

    Attributes:
        kind: ``"adam"`` (L2 weight decay added to the gradient, as ``torch.optim.Adam``),
            ``"adamw"`` (decoupled, as ``torch.optim.AdamW``), ``"sgd"``, ``"lamb"``, ``"lion"``.
        learning_rate: a float, or a schedule ``fn(count) -> float`` (``count`` 0-based).
        b1, b2, eps, eps_root: the moment decay rates and stabilisers, as in optax.
        weight_decay: the weight-decay coefficient (0.0 when off).
        mask: the weight-decay mask (pytree of bools or callable) or ``None`` for all leaves.
        momentum, nesterov: SGD's momentum (``None`` when off) and Nesterov flag.
        clip_norm: the bound of a ``clip_by_global_norm`` in front, else ``None``.
    """

    kind: FusedKind
    learning_rate: Any
    b1: float | None = None
    b2: float | None = None
    eps: float | None = None
    eps_root: float | None = None
    weight_decay: float = 0.0
    mask: Any = None
    momentum: float | None = None
    nesterov: bool = False
    clip_norm: float | None = None

    def __hash__(self) -> int:
        # A mask given as a dict is not hashable itself: hash its structure and leaves.
        def key(x):
            try:
                hash(x)
                return x
            except TypeError:
                return (tree.structure(x), tuple(tree.leaves(x)))

        return hash(tuple(key(getattr(self, f.name)) for f in dataclasses.fields(self)))


def _members(tx) -> list[Known] | None:
    """The records of ``tx``'s members, nested chains flattened, identities left out; ``None``
    where one has no record."""
    what = known(tx)
    if what is None:
        return None
    if isinstance(what, Identity):
        return []
    if not isinstance(what, Chain):
        return [what]
    out: list[Known] = []
    for t in what.transforms:
        sub = _members(t)
        if sub is None:
            return None
        out += sub
    return out


def _decay(what: Known) -> dict | None:
    """``weight_decay`` and ``mask`` of an ``add_decayed_weights``, masked or not."""
    if isinstance(what, AddDecayedWeights):
        return dict(weight_decay=what.weight_decay, mask=None)
    if isinstance(what, Masked) and isinstance(inner := known(what.inner), AddDecayedWeights):
        return dict(weight_decay=inner.weight_decay, mask=what.mask)
    return None


def _spec(ms: list[Known]) -> FusedSpec | None:
    """The optimizer whose chain is ``ms`` (a clip in front already taken off), by its shape:
    a descent step ``scale_by_learning_rate(lr)`` last, and before it one of the rows of
    :func:`fused_spec_of`. The kernels know no ``eps_root`` but LAMB's."""
    if not ms or not isinstance(ms[-1], ScaleByLearningRate) or not ms[-1].flip_sign:
        return None
    if any(isinstance(m, ScaleByAdam) and not m.bias_correction for m in ms):
        return None  # the kernels always correct the bias: such a chain runs as itself
    lr = ms[-1].learning_rate
    match ms[:-1]:
        case [ScaleByAdam(b1, b2, eps, 0.0), d] if (decay := _decay(d)) is not None:
            return FusedSpec("adamw", lr, b1=b1, b2=b2, eps=eps, eps_root=0.0, **decay)
        case [ScaleByAdam(b1, b2, eps, eps_root), d, ScaleByTrustRatio(0.0, 1.0, 0.0)] \
                if (decay := _decay(d)) is not None:
            return FusedSpec("lamb", lr, b1=b1, b2=b2, eps=eps, eps_root=eps_root, **decay)
        case [ScaleByLion(b1, b2), d] if (decay := _decay(d)) is not None:
            return FusedSpec("lion", lr, b1=b1, b2=b2, **decay)
        case [d, ScaleByAdam(b1, b2, eps, 0.0)] if (decay := _decay(d)) is not None:
            return FusedSpec("adam", lr, b1=b1, b2=b2, eps=eps, eps_root=0.0, **decay)
        case [d] if (decay := _decay(d)) is not None:
            return FusedSpec("sgd", lr, **decay)
        case [d, Trace(momentum, nesterov)] if momentum > 0.0 and (decay := _decay(d)) is not None:
            return FusedSpec("sgd", lr, momentum=momentum, nesterov=nesterov, **decay)
    return None


def fused_spec_of(tx) -> FusedSpec | None:
    """The :class:`FusedSpec` of ``tx`` when it is an optimizer the fused kernels compute,
    recognised by what its members are; else ``None``.

    Recognised, nested chains flattened and ``identity()`` left out, optionally after one
    ``clip_by_global_norm(c)`` (then ``clip_norm=c``), with ``decay`` an
    ``add_decayed_weights(weight_decay, mask)`` and ``lr`` a ``scale_by_learning_rate``:

    * adamw: ``scale_by_adam, decay, lr`` (``eps_root=0``);
    * lamb: ``scale_by_adam, decay, scale_by_trust_ratio(), lr`` (the trust ratio's defaults);
    * lion: ``scale_by_lion, decay, lr``;
    * adam: ``decay, scale_by_adam, lr`` (torch's L2 form, ``eps_root=0``);
    * sgd: ``decay, trace(momentum > 0, nesterov)?, lr``.

    So ``adamw(...)`` is recognised, and so is the same chain written by hand. Anything else
    (a mask around an optimizer, another member, a transformation of one's own) is ``None``
    and runs as its chain.

    Example:
        >>> from fzero import optim
        >>> spec = optim.fused_spec_of(optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3)))
        >>> spec.kind, spec.clip_norm, spec.weight_decay
        ('adamw', 1.0, 0.01)
        >>> optim.fused_spec_of(optim.chain(optim.scale(2.0), optim.adamw(1e-3))) is None
        True
    """
    if not callable(getattr(tx, "update", None)):
        raise TypeError(f"fzero.optim.fused_spec_of: expected a GradientTransformation, got {type(tx).__name__}")
    ms = _members(tx)
    if not ms:
        return None
    clip = None
    if isinstance(ms[0], ClipByGlobalNorm):
        clip, ms = ms[0].max_norm, ms[1:]
    spec = _spec(ms)
    return spec if spec is None or clip is None else dataclasses.replace(spec, clip_norm=clip)
