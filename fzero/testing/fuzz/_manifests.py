"""Checkpoint manifests: mutations of a saved ``manifest.json``, and the check each mutated
checkpoint is held to when read six ways under an audit hook.
"""

from __future__ import annotations

import copy
import math
from typing import Any, NamedTuple

import torch
from hypothesis import strategies as st

from fzero.testing.fuzz._outcome import Outcome, describe, outcome


_HOSTILE = ["", "../../../etc/passwd", "/etc/passwd", "rank00000.safetensors", "rank00001.safetensors",
            "../rank00000.safetensors", "float128", "object", "F32", "tensor", "value", "int", "float", "str",
            "bool", "nan", "__import__('os').system('touch /tmp/fzero-fuzz-pwned')"]
_MANIFEST_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3),
    st.sampled_from([2**62, 2**64, -2**63, 10**30, 1.5, math.nan, math.inf]), st.sampled_from(_HOSTILE),
    st.lists(st.integers(-1, 2**40), max_size=4), st.just({}), st.just([]),
    st.lists(st.sampled_from([0, 5, 2**62]), max_size=3))
_RENAMES = ["../rank00000.safetensors", "rank00000.safetensors/../../x", "/tmp/rank00000.safetensors", "zz",
            "rank99999.safetensors", "rank00000.safetensors\x00"]


def manifest_nodes(manifest: Any) -> list[tuple]:
    """Every place in a manifest (as key/index paths), but only the first few numbers of the
    long RNG state arrays, so a draw lands on a structural field as often as on a number."""
    out: list[tuple] = []

    def walk(x: Any, path: tuple) -> None:
        if path and not (path[0] == "rng" and len(path) > 4 and isinstance(path[-1], int) and path[-1] > 2):
            out.append(path)
        items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
        for k, v in items:
            walk(v, path + (k,))

    walk(manifest, ())
    return out


@st.composite
def manifest_mutations(draw, nodes: list[tuple], *, max_changes: int = 3) -> list[tuple[tuple, str, Any]]:
    """1 to ``max_changes`` changes ``(where, "del" | "set" | "rename", value)`` to a
    manifest whose places are ``nodes`` (:func:`manifest_nodes`)."""
    out = []
    for _ in range(draw(st.integers(1, max_changes))):
        where = draw(st.sampled_from(nodes))
        op = draw(st.sampled_from(["del", "set", "set", "set", "rename"]))
        value = draw(_MANIFEST_VALUES) if op == "set" else draw(st.sampled_from(_RENAMES)) if op == "rename" else None
        out.append((where, op, value))
    return out


def apply_mutations(manifest: dict, changes: list[tuple[tuple, str, Any]]) -> dict:
    """A copy of ``manifest`` with ``changes`` made (a change whose place a previous one
    removed is skipped)."""
    m = copy.deepcopy(manifest)
    for where, op, value in changes:
        cur: Any = m
        try:
            for k in where[:-1]:
                cur = cur[k]
            k = where[-1]
            if op == "del":
                del cur[k]
            elif op == "set":
                cur[k] = copy.deepcopy(value)
            elif isinstance(cur, dict) and k in cur:
                cur[value] = cur.pop(k)
        except (KeyError, IndexError, TypeError):
            pass
    return m


class SavedCheckpoint(NamedTuple):
    """A small committed checkpoint to mutate: its root, its directory, its manifest and
    the manifest's places (:func:`manifest_nodes`)."""

    root: str
    path: str
    manifest: dict
    nodes: list


SAVED_STATE = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(5, dtype=torch.int64), "n": 7, "lr": 0.5,
               "flag": True}
_LIKE = {"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.int64), "n": 0, "lr": 0.0, "flag": False}
READS = ("load", "load, verify=False", "load, restore_rng=True", "verify", "export", "inspect")


def save_checkpoint(root: str) -> SavedCheckpoint:
    """Save :data:`SAVED_STATE` (two tensors, three values) under ``root``/src."""
    import json
    import os

    import fzero.checkpoint as ckpt

    path = os.path.join(root, "src")
    ckpt.save(path, SAVED_STATE)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    _read(path, "inspect")  # every module a read imports, imported before any watch starts
    return SavedCheckpoint(root, path, manifest, manifest_nodes(manifest))


class _Watch:
    """An audit hook (installed once) that, while on, records files opened outside
    ``allowed`` and any code run, unpickled or spawned."""

    def __init__(self) -> None:
        import sys

        self.on, self.allowed, self.seen = False, (), []
        sys.addaudithook(self)

    def __call__(self, event: str, args: tuple) -> None:
        import os

        if not self.on:
            return
        if event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes, os.PathLike)):
            p = os.path.abspath(os.fsdecode(args[0]))
            if p not in self.allowed and not p.startswith(tuple(a for a in self.allowed if a.endswith(os.sep))):
                self.seen.append((event, p))
        elif event in ("exec", "pickle.find_class", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn"):
            self.seen.append((event, str(args)[:80]))


_WATCH: list = []


def write_manifest(path: str, manifest: dict) -> None:
    """Write ``manifest`` into the checkpoint at ``path``, with the ``COMMITTED`` marker's
    checksum of it updated: a consistent edit, which the manifest's checks (not its
    checksum) must catch."""
    import json
    import os
    import zlib

    data = json.dumps(manifest, indent=1).encode()
    with open(os.path.join(path, "manifest.json"), "wb") as f:
        f.write(data)
    with open(os.path.join(path, "COMMITTED")) as f:
        marker = json.load(f)
    marker["manifest_crc32"] = zlib.crc32(data)
    with open(os.path.join(path, "COMMITTED"), "w") as f:
        json.dump(marker, f)


def _export_file(path: str) -> str:
    import os

    return os.path.join(os.path.dirname(path), "export.safetensors")


def _read(path: str, how: str) -> Any:
    import contextlib
    import io
    import os

    import fzero.checkpoint as ckpt
    from fzero.checkpoint import cli

    if how == "load":
        return ckpt.load(path, like=_LIKE)
    if how == "load, verify=False":
        return ckpt.load(path, like=_LIKE, verify=False)
    if how == "load, restore_rng=True":
        return ckpt.load(path, like=_LIKE, restore_rng=True)
    if how == "verify":
        return ckpt.verify(path)
    if how == "export":
        return ckpt.export(path, _export_file(path))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = cli.main(["inspect", path])
    if rc != 0:
        raise ckpt.CheckpointError(f"fzero checkpoint inspect exited {rc}")
    return rc


def manifest_case(saved: SavedCheckpoint, changes: list, how: str, *, expect: Outcome | None = None) -> Outcome:
    """The checkpoint ``saved`` with its manifest changed by ``changes``, read as ``how``
    (:data:`READS`): a ``CheckpointError``, or a read that passed its checks (whose tensors
    are then the saved ones); never another exception, a file opened outside the
    checkpoint's root, code run or unpickled."""
    import os
    import shutil
    import sys

    from fzero.checkpoint import CheckpointError

    path = os.path.join(saved.root, "case")
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(saved.path, path)
    write_manifest(path, apply_mutations(saved.manifest, changes))
    if not _WATCH:
        _WATCH.append(_Watch())
    watch = _WATCH[0]
    # the checkpoint's own directory (not its sibling, the saved original), export's output
    # file, and Python's own files (a module imported lazily on the way)
    watch.allowed = (os.path.join(path, ""), path, _export_file(path), os.path.join(sys.prefix, ""),
                     os.path.join(sys.base_prefix, ""))
    watch.seen, watch.on = [], True
    try:
        kind, result = outcome(lambda: _read(path, how), named=(CheckpointError,), prefix="")
    finally:
        watch.on = False
    assert kind in ("ran", "named"), f"{changes}, {how}: {describe(result)}"
    assert not watch.seen, f"{changes}, {how}: {watch.seen}"
    assert expect is None or kind == expect, f"{changes}, {how}: {kind}, not {expect}: {result}"
    if kind == "ran" and how in ("load", "load, restore_rng=True"):  # what was read passed its checksums
        for k in ("w", "b"):
            assert torch.equal(result[k], SAVED_STATE[k]), f"{changes}, {how}: {k} read wrong"
    return kind
