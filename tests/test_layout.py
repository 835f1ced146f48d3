"""ZeRO's flat layout: each rank's pieces of the parameters, cut from full parameters and
from an owned slice, against the layout's definition computed here with ``torch.cat`` and
slices (FSDP1's: the group's parameters concatenated in order, padded to a multiple of the
``dp`` size N, rank r owning elements [r*c, (r+1)*c) with c = padded / N)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fzero.transforms.shard_state._layout import build_layout

SHAPES = st.lists(st.one_of(st.tuples(st.integers(1, 7)), st.tuples(st.integers(1, 4), st.integers(1, 5)),
                            st.just((1,))), min_size=1, max_size=9)


def _params(shapes):
    g = torch.Generator().manual_seed(len(shapes))
    return {f"p{i}": torch.randn(s, generator=g) for i, s in enumerate(shapes)}


def _expected(params, layout, rank, world):
    """Each parameter's piece on ``rank``, from the definition: a slice of its group's
    concatenation, intersected with the rank's owned range."""
    out = {}
    for g in layout.groups:
        flat = torch.cat([params[n].reshape(-1) for n in g.names])
        assert g.padded % world == 0 and g.padded >= flat.numel()
        chunk = g.padded // world
        lo, hi = rank * chunk, (rank + 1) * chunk
        start = 0
        for n in g.names:
            size = params[n].numel()
            a, b = max(start, lo), min(start + size, hi)
            out[n] = flat[a:b] if a < b else flat[:0]
            start += size
    return out


@settings(max_examples=60, deadline=None)
@given(shapes=SHAPES, world=st.integers(1, 4), bucket=st.sampled_from([16, 64, 2**20]))
def test_pieces_are_the_definitions_slices_from_full_parameters_and_from_the_owned_slice(shapes, world, bucket):
    params = _params(shapes)
    for rank in range(world):
        layout = build_layout(params, world=world, rank=rank, bucket_bytes=bucket)
        expected = _expected(params, layout, rank, world)
        full = layout.regroup(params)  # views of one flat buffer per group: cut by one split
        assert all(g.flat_of(full) is not None for g in layout.groups)
        apart = {k: v.clone() for k, v in params.items()}  # tensors of their own: a slice each
        assert all(g.flat_of(apart) is None for g in layout.groups)
        for source in (full, apart):
            pieces = layout.piece_views(source)
            assert list(pieces) == list(source)
            for name, piece in pieces.items():
                assert torch.equal(piece.local, expected[name]), (name, rank, world)
                if piece.local.numel():  # a view of the parameter's storage, not a copy
                    assert piece.local.untyped_storage().data_ptr() == source[name].untyped_storage().data_ptr()
                    assert piece.info.piece() != (0, 0)
        for g in layout.groups:  # from the owned slice, as the reduced gradients and owned copies are cut
            lo, hi = g.owned
            local = layout.flatten_full(params, g)[lo:hi].clone()
            for name, piece in zip(g.names, g.pieces(local)):
                assert torch.equal(piece.local, expected[name]), (name, rank, world)
                assert piece.info.shape == tuple(params[name].shape)
            # a slice other than the owned one's size is cut a parameter at a time
            longer = torch.cat([local, torch.zeros(1)])
            assert all(torch.equal(a.local, b.local) for a, b in zip(g.pieces(longer), g.pieces(local)))


def test_a_parameter_moved_within_its_flat_buffer_is_not_taken_as_laid_out():
    """The flat buffer's split is taken only where every parameter sits at its offset."""
    params = {"a": torch.arange(4.0), "b": torch.arange(4.0, 10.0)}
    layout = build_layout(params, world=2, rank=1)
    full = layout.regroup(params)
    g = layout.groups[0]
    base = full["a"]._base
    assert g.flat_of(full) is base
    first, second = g.names  # laid out in this order: put them the other way round
    n = full[second].numel()
    swapped = {second: base[:n], first: base[n:10]}  # the same buffer, at other offsets
    assert sorted(g.names) == ["a", "b"] and g.flat_of(swapped) is None
    pieces, expected = layout.piece_views(swapped), _expected(swapped, layout, 1, 2)
    for name in ("a", "b"):
        assert torch.equal(pieces[name].local, expected[name]), name
    assert sum(p.local.numel() for p in pieces.values()) == 5
