"""fzero.tree: flatten/unflatten round trips, paths, dataclasses, structure errors."""

import dataclasses

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero.testing as ft
from fzero import tree


@settings(max_examples=40, deadline=None)
@given(ft.pytrees())
def test_flatten_unflatten_roundtrip(t):
    leaves, spec = tree.flatten(t)
    assert all(isinstance(x, torch.Tensor) for x in leaves)
    back = tree.unflatten(spec, leaves)
    ft.assert_trees_close(back, t, rtol=0, atol=0)
    assert tree.structure(back) == spec


@settings(max_examples=40, deadline=None)
@given(ft.pytrees())
def test_paths_name_every_leaf_uniquely(t):
    paths, leaves, _ = tree.flatten_with_path(t)
    names = [tree.keystr(p) for p in paths]
    assert len(set(names)) == len(names) == len(leaves)
    # Each name is Python access syntax: evaluating it on the tree gives the leaf.
    for name, leaf in zip(names, leaves):
        assert eval("t" + name, {"t": t}) is leaf  # noqa: S307 - our own generated paths


@settings(max_examples=25, deadline=None)
@given(ft.pytrees())
def test_map_with_path_agrees_with_map(t):
    a = tree.map(lambda x: x * 2, t)
    b = tree.map_with_path(lambda p, x: x * 2, t)
    ft.assert_trees_close(a, b, rtol=0, atol=0)


def test_dict_order_is_sorted_and_none_is_empty():
    t = {"b": torch.ones(1), "a": torch.zeros(1), "c": None}
    assert [tree.keystr(p) for p in tree.paths(t)] == ["['a']", "['b']"]
    assert len(tree.leaves([None, (None,)])) == 0


def test_private_namespace_not_global():
    @tree.dataclass
    class Box:
        x: torch.Tensor

    b = Box(torch.ones(2))
    assert len(tree.leaves(b)) == 1
    # The global optree registry does not know Box: it is a leaf there.
    assert optree.tree_leaves(b) == [b]


def test_dataclass_static_fields_and_replace():
    @tree.dataclass
    class S:
        w: torch.Tensor
        name: str = tree.field(static=True, default="s")

    s = S(torch.ones(3))
    assert [tree.keystr(p) for p in tree.paths(s)] == [".w"]
    s2 = tree.map(lambda x: x + 1, s)
    assert s2.name == "s" and torch.equal(s2.w, torch.full((3,), 2.0))
    s3 = s.replace(name="t")
    assert s3.name == "t" and tree.structure(s3) != tree.structure(s)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.w = torch.zeros(1)


def test_structure_error_names_key_path_and_both_sides():
    a = {"layer": {"w": torch.ones(2), "b": torch.ones(2)}}
    b = {"layer": {"w": torch.ones(2), "bias": torch.ones(2)}}
    with pytest.raises(tree.StructureError) as e:
        tree.map(lambda x, y: x + y, a, b)
    msg = str(e.value)
    assert "fzero.tree.map" in msg
    assert "['layer']" in msg
    assert "['layer']['b']" in msg and "['layer']['bias']" in msg


def test_structure_error_list_length():
    with pytest.raises(tree.StructureError, match=r"\['x'\].*list of length 2.*list of length 3"):
        tree.map(lambda x, y: x, {"x": [torch.ones(1)] * 2}, {"x": [torch.ones(1)] * 3})


def test_unflatten_wrong_count():
    _, spec = tree.flatten({"a": torch.ones(1), "b": torch.ones(1)})
    with pytest.raises(tree.StructureError, match="2 leaves, got 1"):
        tree.unflatten(spec, [torch.ones(1)])


def test_keystr_plain_tuples():
    assert tree.keystr(("a", 0, "b")) == "['a'][0]['b']"


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=30, unique=True), st.randoms(use_true_random=False))
def test_a_dict_of_tensors_walks_as_optree_walks_it(keys, rnd):
    # The fast path for a plain dict of tensors (the step's parameters, gradients and
    # moments) against optree itself: the leaves in its order, its spec, its map, which
    # calls f in flatten order and keeps the dict's own key order.
    rnd.shuffle(keys)
    d = {k: torch.full((1,), float(i)) for i, k in enumerate(keys)}
    ref_leaves, ref_spec = optree.tree_flatten(d, namespace=tree.NAMESPACE)
    assert tree._tensor_dict(d) is not None  # the path under test
    for _ in range(2):  # worked out, then from the cache
        leaves, spec = tree.flatten(d)
        assert [id(x) for x in leaves] == [id(x) for x in ref_leaves]
        assert spec == ref_spec and tree.structure(d) == ref_spec
        assert [id(x) for x in tree.leaves(d)] == [id(x) for x in ref_leaves]
        back = tree.unflatten(spec, leaves)
        assert list(back) == keys and all(back[k] is d[k] for k in keys)
        seen = []
        other = {k: torch.ones(1) for k in keys}
        out = tree.map(lambda x, y: seen.append(float(x)) or x + y, d, other)
        assert seen == [float(x) for x in ref_leaves]
        assert list(out) == keys and all(torch.equal(out[k], d[k] + 1) for k in keys)


def test_a_dict_with_a_non_tensor_or_other_keys_takes_optrees_way():
    d = {"b": torch.ones(1), "a": None, "c": [torch.zeros(2)]}
    assert tree.leaves(d) == optree.tree_leaves(d, namespace=tree.NAMESPACE)
    t = {"b": torch.ones(1), "a": torch.zeros(1)}
    with pytest.raises(tree.StructureError, match="tree 1"):
        tree.map(lambda x, y: x, t, {"b": torch.ones(1), "a": None})
    with pytest.raises(tree.StructureError, match="tree 1"):
        tree.map(lambda x, y: x, t, {"b": torch.ones(1), "z": torch.ones(1)})
    reordered = {"a": torch.zeros(1), "b": torch.ones(1)}  # the same keys inserted in another order
    out = tree.map(lambda x, y: x + y, t, reordered)
    assert list(out) == ["b", "a"] and torch.equal(out["a"], torch.zeros(1)) and torch.equal(out["b"], torch.full((1,), 2.0))
    assert tree.leaves(t, is_leaf=lambda x: isinstance(x, dict)) == [t]  # an is_leaf: optree's way


class _LeafSub(torch.Tensor):
    pass


class _NodeSub(torch.Tensor):  # a tensor subclass some library made a pytree node
    pass


optree.register_pytree_node(_NodeSub, lambda x: ((x.as_subclass(torch.Tensor),), None, None),
                            lambda _, c: c[0].as_subclass(_NodeSub), namespace=tree.NAMESPACE)


def test_a_dict_of_tensor_subclasses_walks_as_optree_walks_it():
    # A subclass that optree takes as a leaf (mixed precision's NormWeight) is walked here;
    # one registered as a node is not: its leaves are what its flatten gives.
    leafy = {"b": torch.ones(1).as_subclass(_LeafSub), "a": torch.zeros(1)}
    assert tree._tensor_dict(leafy) is not None
    assert [id(x) for x in tree.leaves(leafy)] == [id(x) for x in optree.tree_leaves(leafy, namespace=tree.NAMESPACE)]
    noded = {"b": torch.ones(1).as_subclass(_NodeSub), "a": torch.zeros(1)}
    assert tree._tensor_dict(noded) is None
    got = tree.leaves(noded)
    assert [type(x) for x in got] == [torch.Tensor, torch.Tensor]
    assert tree.structure(noded) == optree.tree_structure(noded, namespace=tree.NAMESPACE)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=20, unique=True), st.randoms(use_true_random=False))
def test_a_dict_of_shards_walks_as_optree_walks_it(keys, rnd):
    # ZeRO's pieces: a dict of Shard nodes, each one child, walked by the fast path in fzero's
    # view and by optree in the user's (where a Shard is a leaf); a changed ShardInfo is a
    # new spec.
    from fzero.transforms.shard_state._shard import Shard, ShardInfo

    rnd.shuffle(keys)
    d = {k: Shard(torch.full((2,), float(i)), ShardInfo((4,), 4 * i, 2, 2, 0)) for i, k in enumerate(keys)}
    assert tree._tensor_dict(d) is not None  # the path under test
    ref_leaves, ref_spec = optree.tree_flatten(d, namespace=tree.NAMESPACE)
    for _ in range(2):  # worked out, then from the cache
        leaves, spec = tree.flatten(d)
        assert [id(x) for x in leaves] == [id(x) for x in ref_leaves] and spec == ref_spec
        assert tree.structure(d) == ref_spec and [id(x) for x in tree.leaves(d)] == [id(x) for x in ref_leaves]
        seen = []
        out = tree.map(lambda x, y: seen.append(float(x[0])) or x + y, d, tree.map(torch.ones_like, d))
        ref = optree.tree_map(lambda x: x + 1, d, namespace=tree.NAMESPACE)
        assert seen == [float(x[0]) for x in ref_leaves] and list(out) == keys
        assert all(type(out[k]) is Shard and out[k].info is d[k].info and torch.equal(out[k].local, ref[k].local)
                   for k in keys)
        back = tree.unflatten(spec, leaves)
        assert list(back) == keys and all(back[k].local is d[k].local and back[k].info == d[k].info for k in keys)
    with tree.user_view(True):  # a Shard is one leaf to the user's step
        assert tree._tensor_dict(d) is None and [id(x) for x in tree.leaves(d)] == [id(d[k]) for k in sorted(keys)]
    k0 = keys[0]
    moved = {**d, k0: Shard(d[k0].local, ShardInfo((4,), 99, 2, 2, 0))}
    assert tree.structure(moved) == optree.tree_structure(moved, namespace=tree.NAMESPACE) != ref_spec
    mixed = {**d, k0: torch.zeros(2)}  # a Shard dict with one tensor among them: optree's way
    assert (tree._tensor_dict(mixed) is None) == (len(keys) > 1)
    assert [id(x) for x in tree.leaves(mixed)] == [id(x) for x in optree.tree_leaves(mixed, namespace=tree.NAMESPACE)]
