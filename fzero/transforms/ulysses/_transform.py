"""``ulysses``: the step transform. Its ``init`` checks the model's heads against ``sp``;
its call cuts this rank's slice of the batch's sequence dim, gives the model the global
positions of that slice, and runs the inner step with :class:`UlyssesAttention` in place of
``F.scaled_dot_product_attention``."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from fzero.core import DataShard, Step, as_step, running
from fzero.distributed.mesh import Mesh
from fzero.transforms._batches import split_sequence
from fzero.transforms.ulysses._attention import WHERE, UlyssesAttention

__all__ = ["ulysses"]

# Where a Hugging Face-style config says how many heads attention has (GPT-2's n_head is an
# alias of num_attention_heads there).
_HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads")


def ulysses(step: Callable, mesh: Mesh | None = None) -> Step:
    """DeepSpeed-Ulysses sequence parallelism over the mesh's ``sp`` axis.

    Every ``sp`` rank of a ``dp`` coordinate passes the same local batch; the step cuts the
    sequence dim (dim 1 of every tensor of two dims or more) into ``sp`` equal slices and
    runs the inner step on this rank's. The model runs unchanged on its slice; its attention
    (``F.scaled_dot_product_attention``) runs on whole sequences for ``heads/sp`` heads,
    between all-to-alls over ``sp`` (:class:`UlyssesAttention`). A model whose ``forward``
    takes ``position_ids`` and is not given them is given the global positions of this
    rank's slice (``start + arange(seq/sp)``), so learned and rotary position embeddings see
    where the slice sits in the whole sequence. Under ``shard_state``, whose group spans
    ``dp`` x ``sp``, gradients and the loss are averaged over those ranks: a token-mean loss
    gives the one-process full-batch loss and gradient.

    Args:
        step: ``train_step(state, batch) -> (state, metrics)``.
        mesh: the :class:`fzero.Mesh`, with an ``sp`` axis (and no ``tp`` or ``pp``).

    Returns:
        A :class:`Step`.

    Raises:
        ValueError: a mesh with ``tp`` or ``pp`` beside ``sp`` (not supported together); at
            ``init``, a model config whose head counts do not divide by ``sp`` (naming each);
            at a call, a sequence length that does not divide by ``sp`` (naming the leaf and
            both sizes), an attention mask or attention dropout (this rank's slice cannot
            say them for the whole sequence), or a step whose model reached no
            ``F.scaled_dot_product_attention``.

    Example (a world of one, ``sp=1``: the step runs unchanged):
        >>> import torch, fzero
        >>> from fzero import optim
        >>> from fzero.transforms import ulysses
        >>> apply, params = fzero.functionalize(torch.nn.Linear(4, 2))
        >>> state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
        >>> step = ulysses(fzero.testing.mse_step, fzero.Mesh(dp=-1))
        >>> state, m = step(step.init(state), {"x": torch.randn(3, 4), "y": torch.randn(3, 2)})
        >>> int(state.step)
        1
    """
    mesh = mesh if mesh is not None else Mesh(dp=-1)
    sp, index = mesh.size("sp"), mesh.coords["sp"]
    others = [f"{a}={mesh.size(a)}" for a in ("tp", "pp") if mesh.size(a) > 1]
    if sp > 1 and others:
        raise ValueError(f"{WHERE}: sequence parallelism (sp={sp}) with {' and '.join(others)} is not supported: "
                         "Ulysses splits attention by heads over sp, as tensor parallelism does over tp; use one "
                         "of them (docs/parallelism.md)")
    group = mesh.group("sp")
    attention = UlyssesAttention(group, sp, mesh.timeout_s)
    inner = as_step(step)

    def before(state):
        if sp > 1 and dist.get_rank(group) != index:
            raise RuntimeError(f"{WHERE}: this rank is sp rank {dist.get_rank(group)} of its process group but sp "
                               f"coordinate {index} of {mesh}; the sp group must list its ranks in mesh order")
        module = getattr(state.apply_fn, "module", None)
        if sp > 1 and isinstance(module, torch.nn.Module):
            _check_heads(module, sp)
        return state

    def call(state, batch):
        if sp == 1:
            return inner(state, batch)
        part, length = split_sequence(batch, sp, index, where=WHERE)
        module = getattr(state.apply_fn, "module", None)
        attention.calls = 0
        with running(sequence_shard=DataShard(index, sp)), attention.installed(), \
                _model_inputs(module, index * (length // sp), sp):
            out = inner(state, part)
        if attention.calls == 0:
            raise ValueError(f"{WHERE}: the step ran no F.scaled_dot_product_attention under sp={sp}: each rank "
                             "attended within its slice of the sequence only. The model's attention must call "
                             "torch.nn.functional.scaled_dot_product_attention by that name (Hugging Face models: "
                             "attn_implementation=\"sdpa\")")
        return out

    return Step(call, before=before, name=f"ulysses({inner.__name__}, sp={sp})", inner=inner)


def _check_heads(module: torch.nn.Module, sp: int) -> None:
    """A Hugging Face-style ``config`` on the module says its heads: each count must divide
    by ``sp``, or the first call's attention would fail."""
    config = getattr(module, "config", None)
    if config is None:
        return
    counts = {f: getattr(config, f) for f in _HEAD_FIELDS if isinstance(getattr(config, f, None), int)}
    odd = {f: n for f, n in counts.items() if n % sp}
    if odd:
        raise ValueError(f"{WHERE}: step.init: the model's attention heads must divide by sp={sp} (each sp rank "
                         "attends for heads/sp of them), got " + ", ".join(f"config.{f}={n}" for f, n in odd.items()))


@contextlib.contextmanager
def _model_inputs(module, start: int, sp: int) -> Iterator[None]:
    """While the step runs, ``module.forward`` is given ``position_ids`` of this rank's slice
    in the whole sequence when its caller passes none (a model computes ``arange(seq)`` of
    the length it is handed otherwise, which is this rank's slice, not its place), and
    refuses an ``attention_mask`` (cut by sequence, a padding mask would make only the ranks
    whose slice holds padding build a mask, and the ranks would leave the step's
    all-to-alls out of step) and ``labels`` without ``shift_labels`` (shifted inside the
    model, each slice would lose its last pair)."""
    forward = getattr(module, "forward", None) if isinstance(module, torch.nn.Module) else None
    if forward is None:
        yield
        return
    signature = inspect.signature(forward)
    positions = "position_ids" in signature.parameters
    if not positions and not {"attention_mask", "labels"} & set(signature.parameters):
        yield
        return

    @functools.wraps(forward)
    def with_positions(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        mask = bound.arguments.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            raise ValueError(f"{WHERE}: {type(module).__name__}.forward was given an attention_mask of shape "
                             f"{tuple(mask.shape)} under sequence parallelism (sp={sp}): a mask cut by sequence "
                             "does not say what the whole sequence's attention masks. Train on unpadded (packed or "
                             "equal-length) sequences with a causal model and no attention_mask")
        labels = bound.arguments.get("labels")
        if isinstance(labels, torch.Tensor) and not isinstance(kwargs.get("shift_labels"), torch.Tensor):
            raise ValueError(f"{WHERE}: {type(module).__name__}.forward was given labels= under sequence "
                             f"parallelism (sp={sp}): a model that shifts its labels inside pairs each slice's "
                             "last token with nothing, not with the next slice's first. Shift the labels before "
                             "the batch is cut and pass them as shift_labels= (Hugging Face's loss takes them "
                             "as they are), or compute the loss from the logits")
        if positions and bound.arguments.get("position_ids") is None:
            x = next((bound.arguments[k] for k in ("input_ids", "inputs_embeds")
                      if isinstance(bound.arguments.get(k), torch.Tensor)), None)
            if x is None:
                x = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2), None)
            if x is not None:
                bound.arguments["position_ids"] = torch.arange(start, start + x.shape[1], device=x.device).unsqueeze(0)
                return forward(*bound.args, **bound.kwargs)
        return forward(*args, **kwargs)

    own = module.__dict__.get("forward")  # an instance's own forward (another transform's), put back after
    module.forward = with_positions
    try:
        yield
    finally:
        if own is None:
            del module.forward  # the class's forward again
        else:
            module.forward = own
