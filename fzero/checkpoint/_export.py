"""``export``: the parameters of a checkpoint, whole, in one safetensors file.

It runs in one process from the files alone (no process group, no model needed): each
parameter is read piece by piece from whichever ranks' files hold it (a parameter split over
``tp`` is put together from its slices) and written under its ``named_parameters()`` name, so ``module.load_state_dict(safetensors.torch.load_file(f),
strict=True)`` takes it. Under mixed precision a parameter is read from its fp32 master
(``.master``), not from the low-precision copy the model computed with: what
``fzero.load_into`` writes, so the two ways of getting the trained model agree bit for bit.
Two names the params dict does not have, which a strict ``load_state_dict`` wants, come
with the module: the second names of tied parameters (``functionalize`` keeps each tied
parameter once, under its first name) and the buffers (the checkpoint's ``.buffers``, the
trained running statistics; the module's own where the checkpoint has none). Pass
``module=`` to add both.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import torch

from fzero.checkpoint import _format
from fzero.checkpoint._format import CheckpointError, Files
from fzero.checkpoint._load import _Reader, read_whole

__all__ = ["export"]

WHERE = "fzero.checkpoint.export"


def _name_under(rec: dict, *prefix: str) -> str | None:
    """The last key of a leaf saved at ``.<prefix[0]>['<prefix[1]>']...['name']`` (a
    TrainState's attribute, or a plain dict's key), else ``None``."""
    e = rec.get("entries") or []
    if len(e) != len(prefix) + 1 or not (e[-1][0] == "key" and isinstance(e[-1][1], str)):
        return None
    first, *rest = prefix
    if e[0] not in (["attr", first], ["key", first]) or any(x != ["key", k] for x, k in zip(e[1:], rest)):
        return None
    return e[-1][1]


def _param_name(rec: dict) -> str | None:
    return _name_under(rec, "params")


def export(
    path: str | os.PathLike,
    out_file: str | os.PathLike,
    *,
    module: torch.nn.Module | None = None,
    dtype: torch.dtype | None = torch.float32,
    verify: bool = True,
) -> dict[str, tuple[int, ...]]:
    """Write the checkpoint's parameters, consolidated, to the safetensors file ``out_file``.

    Args:
        path: a committed checkpoint (any world size, any ZeRO stage).
        out_file: the file to write (atomically: a temporary sibling, then a rename).
        module: the model; adds the aliases of tied parameters and the buffers (the
            checkpoint's, else the module's), so that
            ``module.load_state_dict(..., strict=True)`` accepts the file.
        dtype: floating parameters are cast to it (default fp32: full-precision weights);
            ``None`` keeps the saved dtypes. Under mixed precision the parameters are the
            fp32 masters either way, and ``torch.bfloat16`` (``float16``) gives exactly the
            low-precision copies the model computed with: they are the masters rounded.
        verify: check the checksum of every block read.

    Returns:
        ``{name: shape}`` of what was written.

    Raises:
        CheckpointError: the checkpoint has no ``params`` leaves, or (with ``module``) names
            the module has and the checkpoint cannot supply, or the other way round (both
            listed).
        CorruptCheckpointError: a missing, truncated or corrupted file (named).

    Example:
        >>> import tempfile, torch, fzero, fzero.checkpoint as ckpt
        >>> from safetensors.torch import load_file
        >>> model = torch.nn.Linear(2, 1)
        >>> apply, params = fzero.functionalize(model)
        >>> state = fzero.TrainState.create(apply_fn=apply, params=params, tx=fzero.optim.sgd(0.1))
        >>> tmp = tempfile.TemporaryDirectory(); root = tmp.name
        >>> _ = ckpt.save(f"{root}/s", state)
        >>> sorted(ckpt.export(f"{root}/s", f"{root}/model.safetensors"))
        ['bias', 'weight']
        >>> model.load_state_dict(load_file(f"{root}/model.safetensors"), strict=True)
        <All keys matched successfully>
    """
    path = os.path.abspath(os.fspath(path))
    out_file = os.path.abspath(os.fspath(out_file))
    man = _format.read_manifest(path, WHERE, verify=verify)
    leaves = [r for r in man["leaves"] if r["kind"] == "tensor"]
    recs = {n: r for r in leaves if (n := _param_name(r)) is not None}
    # Mixed precision: the fp32 masters, not the low-precision copies (frozen ones have none).
    recs.update({n: r for r in leaves if (n := _name_under(r, "master")) is not None and n in recs})
    saved_buffers = {n: r for r in leaves if (n := _name_under(r, "buffers")) is not None}
    if not recs:
        raise CheckpointError(f"{WHERE}: {path} has no parameters: export reads the leaves at .params['name'] "
                              f"(a TrainState's params dict)")
    files = Files(path, man, WHERE)
    reader = _Reader(files, man["block_bytes"], verify, None)
    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    try:
        for name, rec in recs.items():
            t = read_whole(reader, rec)  # a leaf split over tp: its slices put together
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            params[name] = t
        if module is not None:
            buffers = {name: read_whole(reader, rec) for name, rec in saved_buffers.items()}
    finally:
        files.close()
    tensors = params if module is None else _for_module(module, params, buffers, path)
    parent = os.path.dirname(out_file)
    if parent:
        os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out_file)}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        meta = {"fzero_checkpoint": path, "fzero_step": str(man.get("step"))}
        _format.write_file(tmp, [_format.WriteEntry(k, v) for k, v in tensors.items()], metadata=meta)
        os.replace(tmp, out_file)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _format.fsync_dir(parent)
    return {k: tuple(v.shape) for k, v in tensors.items()}


def _for_module(module: torch.nn.Module, params: dict[str, torch.Tensor], saved_buffers: dict[str, torch.Tensor],
                path: str) -> dict[str, Any]:
    """``params`` under every name of ``module.state_dict()``: tied aliases and buffers (the
    checkpoint's ``saved_buffers``, else the module's) added."""
    first: dict[int, str] = {}
    alias: dict[str, str] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        alias[n] = first.setdefault(id(p), n)
    buffers = dict(module.named_buffers(remove_duplicate=False))
    sd = module.state_dict(keep_vars=True)
    out, missing = {}, []
    for key in sd:
        if key in params:
            out[key] = params[key]
        elif key in alias and alias[key] in params:
            out[key] = params[alias[key]]  # a tied parameter's other name
        elif key in saved_buffers:
            out[key] = saved_buffers[key]
        elif key in buffers and buffers[key] is not None and buffers[key].device.type != "meta":
            out[key] = buffers[key].detach().cpu()
        else:
            missing.append(key)
    used = set(out) | {alias.get(k, k) for k in out}
    unexpected = sorted(set(params) - used)
    if missing or unexpected:
        lines = [f"{WHERE}: the parameters of {path} do not match {type(module).__name__}.state_dict():"]
        if missing:
            lines.append(f"  in the module, not in the checkpoint: {', '.join(missing)}")
        if unexpected:
            lines.append(f"  in the checkpoint, not in the module: {', '.join(unexpected)}")
        raise CheckpointError("\n".join(lines))
    for key, t in out.items():
        expect = sd[key].shape
        if tuple(t.shape) != tuple(expect):
            raise CheckpointError(f"{WHERE}: {key} has shape {tuple(t.shape)} in {path}, "
                                  f"{tuple(expect)} in {type(module).__name__}")
    return out
