"""The planned modules as a tensor-parallel step runs them, in place only while it runs.

A split layer's ``forward`` must be the style's (the affine map of this rank's slice with
Megatron's *f* or *g* around it) and a module that reads a size its projections split
(GPT-2's attention reads ``split_size``) must read this rank's, but only while a step runs:
the module is the user's, and outside the step it is the user's own code again, so
``fzero.load_into`` can put whole weights into it and ``module(x)`` computes what the plain
module computes. :meth:`Rewrite.applied` installs the planned forwards and divided attributes
on entry and puts back exactly what it found on exit (an attribute the instance did not hold
itself, as ``forward``, is deleted again, so the class's is found), whatever the step raised.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from fzero.transforms.tensor_parallel import _sequence
from fzero.transforms.tensor_parallel._styles import _SHARED_INPUT, ColwiseParallel, DivideAttributes

_ABSENT = object()


def shared_input_scope(forward):
    """``forward`` opening a scope in which column-parallel layers that read one tensor pass
    it through Megatron's *f* once (see ``_styles._copy_to_tp``)."""

    @functools.wraps(forward)
    def scoped(*args, **kwargs):
        token = _SHARED_INPUT.set({})
        try:
            return forward(*args, **kwargs)
        finally:
            _SHARED_INPUT.reset(token)

    return scoped


class Rewrite:
    """What a tensor-parallel step changes in the user's module while it runs.

    Args:
        module: the user's module.
        chosen: the planned modules this rank runs, by name, to their styles
            (``resolve_plan``'s first result).
        tp: the ``tp`` degree (attributes are divided by it).
        group, timeout_s: the ``tp`` process group and its collectives' timeout.
        sequence_parallel: the split layers take and give sequence shards (``_sequence.py``):
            a column-parallel layer all-gathers its input, a row-parallel one reduce-scatters
            its output.
    """

    def __init__(self, module: torch.nn.Module, chosen: Mapping[str, Any], tp: int, group, timeout_s: float, *,
                 sequence_parallel: bool = False):
        self.tp = tp
        self.forwards: list[tuple[torch.nn.Module, Any]] = []
        self.divided: list[tuple[torch.nn.Module, str]] = []
        siblings: collections.Counter = collections.Counter()
        for name, style in chosen.items():
            m = module.get_submodule(name)
            if isinstance(style, DivideAttributes):
                self.divided += [(m, attr) for attr in style.names]
                continue
            if isinstance(style, (_sequence.SequenceParallel, _sequence.PrepareModuleInput)):
                forward = functools.partial(style.forward, m, group=group, timeout_s=timeout_s, name=name)
            elif sequence_parallel:
                on_shards = _sequence.colwise_forward if isinstance(style, ColwiseParallel) else \
                    _sequence.rowwise_forward
                forward = functools.partial(on_shards, style, m, group=group, timeout_s=timeout_s, name=name)
            else:
                forward = functools.partial(style.forward, m, group=group, timeout_s=timeout_s)
            self.forwards.append((m, forward))
            if isinstance(style, ColwiseParallel) and not sequence_parallel:
                siblings[name.rpartition(".")[0]] += 1
        # The modules whose forward calls several column-parallel children: where they read one
        # input, it is all-reduced once in backward (Megatron's count).
        self.scopes = [module.get_submodule(parent) for parent, n in siblings.items() if n > 1]

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The planned forwards, shared-input scopes and divided attributes in place for the
        block; on exit the module is as it was on entry."""
        undo: list[tuple[torch.nn.Module, str, Any]] = []

        def put(m: torch.nn.Module, attr: str, value: Any) -> None:
            undo.append((m, attr, m.__dict__.get(attr, _ABSENT)))  # the instance's own, or none
            setattr(m, attr, value)

        try:
            for m, forward in self.forwards:
                put(m, "forward", forward)
            for m in self.scopes:
                put(m, "forward", shared_input_scope(m.forward))
            for m, attr in self.divided:
                put(m, attr, getattr(m, attr) // self.tp)
            yield
        finally:
            for m, attr, old in reversed(undo):
                if old is _ABSENT:
                    delattr(m, attr)  # the instance had none of its own: the class's again
                else:
                    setattr(m, attr, old)
