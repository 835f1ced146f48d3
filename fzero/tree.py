"""Pytree helpers with ``torch.Tensor`` leaves, on optree under fzero's own namespace.

fzero never touches optree's global registry: every registration made here (the
dataclasses decorated with :func:`dataclass`, and the optimizer states) lives in the
private namespace ``"fzero"``, so two libraries can register the same type differently
without clashing.

Conventions follow JAX and optree:

* ``flatten(tree) -> (leaves, spec)`` and ``unflatten(spec, leaves)``;
* ``None`` is an empty subtree, not a leaf;
* dict keys are sorted, so the leaf order is deterministic;
* a *path* is a tuple of entries; ``keystr(path)`` renders it as ``['blocks'][0].params``.

Example:
    >>> import torch
    >>> from fzero import tree
    >>> t = {"b": torch.ones(2), "a": [torch.zeros(1), None]}
    >>> leaves, spec = tree.flatten(t)
    >>> [x.shape[0] for x in leaves]
    [1, 2]
    >>> tree.keystr(tree.paths(t)[0])
    "['a'][0]"
"""

from __future__ import annotations

import builtins
import contextlib
import contextvars
import dataclasses
import difflib
import operator
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import optree
import torch

__all__ = [
    "NAMESPACE",
    "SpecCache",
    "Unchanged",
    "dataclass",
    "field",
    "flatten",
    "flatten_with_path",
    "keystr",
    "leading_size",
    "leaves",
    "map",
    "map_with_path",
    "paths",
    "structure",
    "unflatten",
    "assert_same_structure",
    "StructureError",
]

NAMESPACE = "fzero"

T = TypeVar("T")
PyTree = Any
Path = tuple


class StructureError(ValueError):
    """Two pytrees that had to share a structure do not; the message names the key paths."""


# --------------------------------------------------------------------------- the user's view

# Types that are pytree nodes for fzero's transforms but leaves for the user's own step:
# a ZeRO ``Shard`` is one node (this rank's piece of a leaf, and where it sits) to an
# optimizer, which updates pieces; to the ``train_step`` a user wrote for one device it is
# one tensor with global semantics, so ``leaves(grads)`` there yields the Shards, never the
# rank-local pieces. ``fzero.transforms.shard_state`` registers its Shard here.
_USER_LEAVES: list[type] = []
_USER_VIEW: contextvars.ContextVar[bool] = contextvars.ContextVar("fzero_user_view", default=False)


@contextlib.contextmanager
def user_view(on: bool = True):
    """Within the block, :data:`_USER_LEAVES` types are leaves (``on``: the user's step, as
    :class:`fzero.transforms.Step` runs it) or nodes (``on=False``: fzero's own machinery,
    entered by every primitive and by ``fzero.gather``)."""
    token = _USER_VIEW.set(on)
    try:
        yield
    finally:
        _USER_VIEW.reset(token)


def in_user_view() -> bool:
    """Whether :data:`_USER_LEAVES` types are leaves here (inside :func:`user_view`)."""
    return _USER_VIEW.get() and bool(_USER_LEAVES)


def _leafy(is_leaf):
    if not in_user_view():
        return is_leaf
    types = tuple(_USER_LEAVES)
    if is_leaf is None:
        return lambda x: isinstance(x, types)
    return lambda x: isinstance(x, types) or is_leaf(x)


# --------------------------------------------------------------------------- dicts of tensors

# A dict of tensors -- a model's parameters, their gradients, each moment of an optimizer --
# is the tree a step walks most. optree takes about 35 us to flatten 150 entries (it sorts
# the keys and builds a spec each time), twice that when each is a ZeRO Shard (a node whose
# flatten is a Python call); the same leaves in a cached key order take a tenth of that. So
# a plain dict whose values are all leaf tensors, or all nodes of one type registered with
# :func:`register_one_child` over leaf tensors, is walked here: its leaves in optree's order
# (the keys sorted) and its spec, both worked out by optree once per key sequence
# (insertion order: the spec keeps it for unflatten) and, for nodes, per node data (by
# identity: the entry holds them), and kept.
_LEAF_TENSORS = {torch.Tensor, torch.nn.Parameter}  # tensor types optree was seen to take as leaves
_ONE_CHILD: dict[type, tuple[Callable[[Any], Any], Callable[[Any], Any], Callable[[Any, Any], Any]]] = {}
_DICT_ORDER: dict[tuple, "_DictWalk"] = {}


class _DictWalk:
    """How a dict of tensors (or of one-child nodes) flattens: ``order`` (its keys in flatten
    order), ``spec``, and for nodes their ``child``/``make`` and the node data they held."""

    __slots__ = ("order", "spec", "child", "datum", "make", "data")

    def __init__(self, order, spec, node=None, data=None):
        self.order, self.spec, self.data = order, spec, data
        self.child, self.datum, self.make = node if node is not None else (None, None, None)

    def leaves(self, tree: dict) -> list:
        if self.child is None:
            return [tree[k] for k in self.order]
        child = self.child
        return [child(tree[k]) for k in self.order]


def register_one_child(cls: type, child: str, data: str, make: Callable[[Any, Any], Any]) -> None:
    """Declare ``cls`` (already an optree node in :data:`NAMESPACE`) a node with one child,
    ``getattr(x, child)``, and node data ``getattr(x, data)``, rebuilt as ``make(child,
    data)``: a dict of them over leaf tensors is then walked without optree, as a dict of
    tensors is."""
    _ONE_CHILD[cls] = (operator.attrgetter(child), operator.attrgetter(data), make)


def _leaf_tensors(values) -> bool:
    """Whether every one of ``values`` is a tensor that flattens as a leaf: a tensor subclass
    (mixed precision's ``NormWeight``) is asked of optree once, on the first one met."""
    if _LEAF_TENSORS.issuperset(builtins.map(type, values)):
        return True
    for x in values:
        t = type(x)
        if t in _LEAF_TENSORS:
            continue
        if not isinstance(x, torch.Tensor):
            return False
        leaves = optree.tree_leaves(x, namespace=NAMESPACE)
        if len(leaves) != 1 or leaves[0] is not x:  # a subclass registered as a node
            return False
        _LEAF_TENSORS.add(t)
    return True


def _tensor_dict(tree: Any) -> _DictWalk | None:
    """How ``tree`` flattens, when it is a non-empty plain ``dict`` whose values are all leaf
    tensors or all nodes of one :func:`register_one_child` type over leaf tensors (not in
    the user's view, where such a node is a leaf); else ``None``."""
    if type(tree) is not dict or not tree:
        return None
    values = tree.values()
    if _leaf_tensors(values):
        key, node, data = (tuple(tree), None), None, None
    else:
        first = type(next(iter(values)))
        node = _ONE_CHILD.get(first)
        if node is None or (in_user_view() and first in _USER_LEAVES) \
                or any(type(v) is not first for v in values) \
                or not _leaf_tensors(list(builtins.map(node[0], values))):
            return None
        data = tuple(builtins.map(node[1], values))
        key = (tuple(tree), tuple(builtins.map(id, data)))
    known = _DICT_ORDER.get(key)
    if known is None:
        paths, _, spec = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
        order = tuple(path[0] for path in paths)
        known = _DictWalk(order, spec, node, data)
        if len(_DICT_ORDER) >= 256:  # a bound, for a program that makes ever new key sets
            _DICT_ORDER.clear()
        _DICT_ORDER[key] = known
    return known


# --------------------------------------------------------------------------- basics


def flatten(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None):
    """``(leaves, spec)`` of ``tree``; ``spec`` rebuilds it with :func:`unflatten`."""
    if is_leaf is None:
        known = _tensor_dict(tree)
        if known is not None:
            return known.leaves(tree), known.spec
    return optree.tree_flatten(tree, is_leaf=_leafy(is_leaf), namespace=NAMESPACE)


def unflatten(spec, leaves: Sequence[Any]) -> PyTree:
    """Inverse of :func:`flatten`.

    Raises:
        StructureError: the number of leaves does not match the spec.
    """
    leaves = list(leaves)
    if len(leaves) != spec.num_leaves:
        raise StructureError(
            f"fzero.tree.unflatten: the spec has {spec.num_leaves} leaves, got {len(leaves)}: {spec}"
        )
    return optree.tree_unflatten(spec, leaves)


def leaves(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> list:
    """The leaves of ``tree`` in flatten order."""
    if is_leaf is None:
        known = _tensor_dict(tree)
        if known is not None:
            return known.leaves(tree)
    return optree.tree_leaves(tree, is_leaf=_leafy(is_leaf), namespace=NAMESPACE)


def leading_size(tree: PyTree) -> int | None:
    """The leading size of the first tensor leaf with a dimension (a batch's rows), or
    ``None`` when ``tree`` has none.

    Example:
        >>> import torch
        >>> leading_size({"x": torch.zeros(8, 3), "y": torch.zeros(8)}), leading_size({"n": torch.tensor(1)})
        (8, None)
    """
    for leaf in leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


def structure(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None):
    """The spec of ``tree`` (what :func:`flatten` returns second)."""
    if is_leaf is None:
        known = _tensor_dict(tree)
        if known is not None:
            return known.spec
    return optree.tree_structure(tree, is_leaf=_leafy(is_leaf), namespace=NAMESPACE)


class SpecCache:
    """Values worked out from a tree's structure, kept by key (a spec, or a tuple holding
    one): a step asks for the same structures' paths, names or flags every time, and working
    them out is Python over every leaf. Specs that are equal (same node types, keys and node
    data) give the same values; a key that cannot be hashed (a spec with unhashable node
    data) is worked out every time. At most ``kept`` values are held (then all are dropped).

    Example:
        >>> cache = SpecCache()
        >>> spec = structure({"a": 1, "b": 2})
        >>> cache.get(spec, lambda: spec.num_leaves), cache.get(spec, lambda: 0)
        (2, 2)
    """

    def __init__(self, kept: int = 512):
        self.kept, self.values = kept, {}

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        """The value kept for ``key``, else ``make()``, kept."""
        try:
            hit = self.values.get(key)
        except TypeError:  # unhashable node data
            return make()
        if hit is None:
            if len(self.values) >= self.kept:
                self.values.clear()
            hit = self.values[key] = make()
        return hit


_PATHS = SpecCache()


def _spec_paths(spec) -> tuple[Path, ...]:
    return _PATHS.get(spec, lambda: tuple(tuple(a) for a in spec.accessors()))


def flatten_with_path(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None):
    """``(paths, leaves, spec)``; each path is a tuple of optree path entries."""
    lv, spec = optree.tree_flatten(tree, is_leaf=_leafy(is_leaf), namespace=NAMESPACE)
    return list(_spec_paths(spec)), lv, spec


def paths(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> list[Path]:
    """The path of every leaf, in flatten order."""
    return flatten_with_path(tree, is_leaf)[0]


def keystr(path: Path) -> str:
    """Render a path as Python access syntax: ``['a'][0].params``.

    Plain tuples of dict keys and indices are accepted too.
    """
    out = []
    for entry in path:
        if isinstance(entry, optree.PyTreeEntry):
            out.append(entry.codify(""))
        elif isinstance(entry, int):
            out.append(f"[{entry}]")
        else:
            out.append(f"[{entry!r}]")
    return "".join(out)


def _path_names(tree: PyTree, is_leaf=None) -> list[str]:
    return [keystr(p) for p in paths(tree, is_leaf)]


# --------------------------------------------------------------------------- structure errors


def _describe(node: Any) -> str:
    if isinstance(node, dict):
        return f"dict with keys {sorted(repr(k) for k in node.keys())}"
    if isinstance(node, (list, tuple)):
        return f"{type(node).__name__} of length {len(node)}"
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return f"{type(node).__name__}"
    if node is None:
        return "None"
    shape = getattr(node, "shape", None)
    if shape is not None:
        return f"{type(node).__name__} of shape {tuple(shape)}"
    return type(node).__name__


def _first_difference(a: PyTree, b: PyTree, path: str = "") -> tuple[str, str, str] | None:
    """Walk both trees together; return (path, what a has, what b has) at the first node
    whose kind or children differ."""
    spec_a = optree.tree_structure(a, is_leaf=_leafy(None), namespace=NAMESPACE)
    spec_b = optree.tree_structure(b, is_leaf=_leafy(None), namespace=NAMESPACE)
    if spec_a == spec_b:
        return None
    if spec_a.is_leaf() or spec_b.is_leaf():
        return path or "<root>", _describe(a), _describe(b)
    if type(a) is not type(b):
        return path or "<root>", _describe(a), _describe(b)
    ca, ma, ea = _children(a)
    cb, mb, eb = _children(b)
    if ea != eb or ma != mb or len(ca) != len(cb):
        return path or "<root>", _describe(a), _describe(b)
    for entry, xa, xb in zip(ea, ca, cb):
        sub = _first_difference(xa, xb, path + _entry_str(a, entry))
        if sub is not None:
            return sub
    return path or "<root>", _describe(a), _describe(b)


def _children(node):
    children, meta, entries, *_ = optree.tree_flatten_one_level(node, namespace=NAMESPACE)
    return list(children), meta, tuple(entries)


def _entry_str(node: Any, entry: Any) -> str:
    if dataclasses.is_dataclass(node):
        return f".{entry}"
    if isinstance(entry, int) and not isinstance(node, dict):
        return f"[{entry}]"
    return f"[{entry!r}]"


def assert_same_structure(a: PyTree, b: PyTree, *, what: str = "fzero.tree", names=("tree 0", "tree 1")):
    """Raise :class:`StructureError` naming the first differing key path, and the leaf paths
    present on one side only, when ``a`` and ``b`` differ in structure."""
    if structure(a) == structure(b):
        return
    pa, pb = set(_path_names(a)), set(_path_names(b))
    lines = [f"{what}: {names[1]} does not have the structure of {names[0]}."]
    diff = _first_difference(a, b)
    if diff is not None:
        p, da, db = diff
        lines.append(f"  first difference at {p}: {names[0]} has {da}, {names[1]} has {db}")
    only_a, only_b = sorted(pa - pb), sorted(pb - pa)
    if only_a:
        lines.append(f"  key paths only in {names[0]}: {_clip(only_a)}")
    if only_b:
        lines.append(f"  key paths only in {names[1]}: {_clip(only_b)}")
        for p in only_b[:3]:
            close = difflib.get_close_matches(p, sorted(pa), n=1)
            if close:
                lines.append(f"  ({p} is close to {close[0]})")
    raise StructureError("\n".join(lines))


def _clip(items: list[str], n: int = 8) -> str:
    shown = ", ".join(items[:n])
    return shown + (f", ... ({len(items) - n} more)" if len(items) > n else "")


# --------------------------------------------------------------------------- maps


def map(f: Callable[..., Any], tree: PyTree, *rest: PyTree, is_leaf=None) -> PyTree:  # noqa: A001
    """Apply ``f`` leafwise over one or more trees of one structure.

    Raises:
        StructureError: a tree in ``rest`` differs in structure; the message names the key path.
    """
    if is_leaf is None:
        known = _tensor_dict(tree)
        if known is not None and all(_tensor_dict(o) is known for o in rest):  # the same keys, in the same order
            # f called in flatten order (a collective inside f runs in the same order on
            # every rank), the result in the tree's own key order, as optree builds it
            if known.child is None:
                out = {k: f(tree[k], *(o[k] for o in rest)) for k in known.order}
            else:  # each node rebuilt over f of its child, with its own node data
                child, datum, make = known.child, known.datum, known.make
                out = {k: make(f(child(tree[k]), *(child(o[k]) for o in rest)), datum(tree[k])) for k in known.order}
            return {k: out[k] for k in tree}
    for i, other in enumerate(rest):
        if is_leaf is None:
            assert_same_structure(tree, other, what="fzero.tree.map", names=("tree 0", f"tree {i + 1}"))
    return optree.tree_map(f, tree, *rest, is_leaf=_leafy(is_leaf), namespace=NAMESPACE)


def map_with_path(f: Callable[..., Any], tree: PyTree, *rest: PyTree, is_leaf=None) -> PyTree:
    """Like :func:`map`, but ``f(path, leaf, *others)``; render ``path`` with :func:`keystr`."""
    for i, other in enumerate(rest):
        if is_leaf is None:
            assert_same_structure(tree, other, what="fzero.tree.map_with_path", names=("tree 0", f"tree {i + 1}"))
    p, lv, spec = flatten_with_path(tree, is_leaf)
    others = [flatten(o, is_leaf)[0] for o in rest]
    return unflatten(spec, [f(pi, *xs) for pi, *xs in zip(p, lv, *others)])


# --------------------------------------------------------------------------- dataclasses


def field(*, static: bool = False, **kwargs) -> Any:
    """A dataclass field; ``static=True`` keeps it out of the leaves (it becomes part of the
    spec, so it must be hashable-comparable: functions, strings, numbers)."""
    metadata = dict(kwargs.pop("metadata", {}) or {})
    metadata["fzero_static"] = static
    return dataclasses.field(metadata=metadata, **kwargs)


def dataclass(cls: type[T] | None = None, /, *, frozen: bool = True, **kwargs):
    """Make ``cls`` a frozen dataclass registered as a pytree node in fzero's namespace.

    Fields made with ``field(static=True)`` are static (carried in the spec, not leaves).
    Instances get ``replace(**changes)``.

    Example:
        >>> import torch
        >>> from fzero import tree
        >>> @tree.dataclass
        ... class Point:
        ...     x: torch.Tensor
        ...     name: str = tree.field(static=True, default="p")
        >>> tree.keystr(tree.paths(Point(torch.zeros(1)))[0])
        '.x'
    """

    def wrap(c):
        c = dataclasses.dataclass(c, frozen=frozen, **kwargs)
        fields = dataclasses.fields(c)
        dynamic = tuple(f.name for f in fields if not f.metadata.get("fzero_static", False))
        static = tuple(f.name for f in fields if f.metadata.get("fzero_static", False))

        def flatten_fn(obj):
            children = tuple(getattr(obj, n) for n in dynamic)
            meta = tuple(getattr(obj, n) for n in static)
            return children, meta, dynamic

        def unflatten_fn(meta, children):
            obj = object.__new__(c)
            for n, v in zip(dynamic, children):
                object.__setattr__(obj, n, v)
            for n, v in zip(static, meta):
                object.__setattr__(obj, n, v)
            return obj

        optree.register_pytree_node(
            c, flatten_fn, unflatten_fn, path_entry_type=optree.GetAttrEntry, namespace=NAMESPACE
        )
        if not hasattr(c, "replace"):
            c.replace = lambda self, **changes: dataclasses.replace(self, **changes)
        return c

    return wrap if cls is None else wrap(cls)



class Unchanged:
    """Which tensors a value was worked out from, as they were: :meth:`holds` says whether a
    list of tensors is exactly those -- the same objects, in any order (in the same order when
    ``ordered``), none written in place since (their version counters) -- so a value can be
    handed on and trusted only for them (a norm, a verdict on gradients).

    Example:
        >>> a, b = torch.ones(2), torch.ones(3)
        >>> seen = Unchanged([a, b])
        >>> seen.holds([b, a]), seen.holds([a, b.clone()]), Unchanged([a, b], ordered=True).holds([b, a])
        (True, False, False)
        >>> _ = a.add_(1); seen.holds([a, b])
        False
    """

    __slots__ = ("_seen", "_order")

    def __init__(self, tensors, ordered: bool = False):
        tensors = list(tensors)
        self._seen = {id(t): (t, t._version) for t in tensors}
        self._order = tuple(builtins.map(id, tensors)) if ordered else None

    def holds(self, tensors) -> bool:
        if self._order is not None and tuple(builtins.map(id, tensors)) != self._order:
            return False
        if len(self._seen) != len({id(t) for t in tensors}):
            return False
        for t in tensors:
            k = self._seen.get(id(t))
            if k is None or k[0] is not t or k[1] != t._version:
                return False
        return True
