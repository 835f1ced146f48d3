"""``save``, ``latest`` and retention: every rank writes what it owns, then one atomic commit.

The commit protocol (rank 0 decides, every rank learns the outcome):

1. rank 0 creates ``.NAME.tmp-<uuid>`` next to ``path`` and broadcasts its name;
2. every rank writes ``rankRRRRR.safetensors`` into it (what the plan gives it: its pieces
   of partitioned leaves, its share of the replicated leaves; and its RNG states) and
   fsyncs it (the plan, agreed before: ``_plan.py``);
3. the ranks all-gather what they wrote (offsets, checksums) or the error they hit;
4. rank 0 writes ``manifest.json``, then the ``COMMITTED`` marker, fsyncs, and renames the
   directory to ``path`` (the rename is the commit: before it, ``path`` does not exist or
   is the previous checkpoint), then applies retention; it broadcasts the outcome.

A rank killed at any moment leaves either no trace (a hidden ``.tmp-`` directory that
``latest`` ignores) or the complete, committed checkpoint. Nothing in the protocol
overwrites a committed checkpoint before its replacement is complete.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import shutil
import threading
import time
import uuid
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import torch

from fzero._version import __version__
from fzero.checkpoint import _comm, _format, _pending, _rng
from fzero.checkpoint._load import verify as verify_all
from fzero.checkpoint._pending import wait_pending
from fzero.checkpoint._format import MANIFEST, MARKER, CheckpointError, Progress
from fzero.checkpoint._plan import Plan, plan as make_plan
from fzero.transforms.shard_state import Shard

__all__ = ["SaveHandle", "latest", "save"]

WHERE = "fzero.checkpoint.save"

_STAGING: dict[str, torch.Tensor] = {}  # reused host buffer for asynchronous snapshots


class SaveHandle:
    """The result of :func:`save`: ``wait()`` blocks until the checkpoint is committed.

    Attributes:
        path: where the checkpoint is (being) committed.
        stats: this rank's :class:`Progress` of the write once it finished (bytes, seconds).
    """

    def __init__(self, path: str):
        self.path = path
        self.stats: Progress | None = None
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._reported = False
        self._thread: threading.Thread | None = None

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the save is committed; return its path.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
            CheckpointError: the save failed (on this or another rank; the message says).
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"fzero.checkpoint.SaveHandle.wait: the save to {self.path} did not finish "
                               f"within {timeout:g} s")
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            self._reported = True
            raise self._error
        return self.path

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "committed" if self.done() else "writing"
        return f"SaveHandle({self.path!r}, {state})"


def _step_of(state: Any, step: int | None) -> int | None:
    if step is not None:
        return int(step)
    s = state.get("step") if isinstance(state, dict) else getattr(state, "step", None)
    if isinstance(s, Shard):
        return None
    if isinstance(s, torch.Tensor) and s.numel() == 1:
        return int(s.reshape(()).item())
    if isinstance(s, int) and not isinstance(s, bool):
        return s
    return None


def _check_json(obj: Any, where: str, path: str = "metadata") -> None:
    if obj is None or isinstance(obj, (bool, int, str)):
        return
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise ValueError(f"{where}: {path} is {obj!r}; JSON has no NaN or infinity")
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: {path} has a key {k!r} of type {type(k).__name__}; JSON keys are strings")
            _check_json(v, where, f"{path}[{k!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_json(v, where, f"{path}[{i}]")
        return
    raise TypeError(f"{where}: {path} is a {type(obj).__name__}, which is not JSON-serialisable "
                    f"(use dicts, lists, str, int, float, bool, None)")


# --------------------------------------------------------------------------- save


def save(
    path: str | os.PathLike,
    state: Any,
    *,
    async_: bool = False,
    metadata: Any = None,
    keep: int | None = None,
    step: int | None = None,
    overwrite: bool = False,
    progress: bool | Callable[[Progress], None] = False,
    timeout_s: float | None = None,
) -> SaveHandle:
    """Save ``state`` (any pytree of tensors, ``Shard`` pieces and scalars) to the directory ``path``.

    Collective: every rank of the process group calls it with its own state (a process
    without a group is a world of one). The ranks' states may differ -- each pipeline
    stage holds its own parameters -- and the checkpoint holds their union, each key path
    once (a key path on several ranks must be the same leaf there). Each rank writes only
    what it owns: its pieces of partitioned leaves, and a share of the replicated leaves
    (spread over the ranks holding them, by size), in parallel, as safetensors; rank 0 then
    writes the JSON manifest and commits atomically (see the module docstring). Every
    rank's RNG states (torch, CUDA, Python, numpy) are saved too; :func:`load` restores them
    when asked.

    Args:
        path: the checkpoint directory to create (its parent is created if needed).
        state: the state, as the step returns it (``step.init(state)``'s layout).
        async_: copy what this rank writes off the training buffers, then write and commit
            in a background thread; returns at once. A later ``save`` waits for this one.
        metadata: a pytree of JSON values (dicts, lists, str, numbers, bools, None) stored
            in the manifest, e.g. the data loader's position; read it with
            :func:`fzero.checkpoint.metadata`.
        keep: after committing, delete all but the newest ``keep`` committed checkpoints
            in ``path``'s parent directory (by step, then time); ``None`` keeps all.
        step: the step recorded in the manifest (default ``state.step``).
        overwrite: replace an existing checkpoint at ``path`` (it is moved aside, then
            deleted, after the new one is complete); otherwise that is an error.
        progress: ``True`` prints each rank's bytes written and MiB/s to stderr every
            second; a callable receives :class:`Progress` instead.
        timeout_s: how long a rank waits for the others (default ``$FZERO_TIMEOUT``, 300 s).

    Returns:
        A :class:`SaveHandle`; for a synchronous save it is already committed.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False.
        TypeError, ValueError: a leaf that cannot be stored, metadata that is not JSON (named
            by key path), ``keep`` < 1.
        CheckpointError: writing failed on some rank (named); ranks hold different leaves
            under one key path, or a partitioned leaf has a piece (a split leaf a tp
            slice) no rank holds (named, with the ranks), or a tensor under a split
            parameter's name is not its slice; nothing was committed.

    Example:
        >>> import tempfile, torch, fzero.checkpoint as ckpt
        >>> tmp = tempfile.TemporaryDirectory(); root = tmp.name
        >>> h = ckpt.save(f"{root}/step_3", {"step": torch.tensor(3), "w": torch.ones(2)}, metadata={"epoch": 1})
        >>> ckpt.latest(root) == f"{root}/step_3", ckpt.metadata(h.path)
        (True, {'epoch': 1})
    """
    path = os.path.abspath(os.fspath(path))
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise ValueError(f"{WHERE}: keep={keep!r} must be a positive int or None")
    _check_json(metadata, WHERE)
    previous = _pending.current()
    if previous is not None:
        reported = previous._reported  # (wait() marks its error reported as it raises it)
        try:
            previous.wait()  # a second save waits for the first
        except BaseException as e:
            if not reported:
                raise CheckpointError(f"{WHERE}: the previous asynchronous save to {previous.path} failed: {e}") from e
    world = _comm.world(WHERE, timeout_s, path=path)
    plan = make_plan(state, world)
    step_value = _step_of(state, step)
    rng_tensors, rng_json = _rng.capture()
    entries = [_format.WriteEntry(k, t.detach().reshape(t.shape)) for k, t in rng_tensors.items()]
    entries += [_format.WriteEntry(k, t.detach()) for k, t in plan.mine]
    callback = _printer if progress is True else (progress or None)
    handle = SaveHandle(path)
    args = (handle, path, plan, entries, world, step_value, metadata, rng_json, keep, overwrite, callback)
    if not async_:
        _run(*args)
        return handle
    args = (handle, path, plan, _snapshot(entries), *args[3 + 1:])
    handle._thread = threading.Thread(target=_run, args=args, name="fzero-checkpoint-save", daemon=False)
    _pending.set_current(handle)
    handle._thread.start()
    return handle


def _finish_at_exit() -> None:
    # Runs as the interpreter starts to exit, before it joins the save's thread and before
    # concurrent.futures stops its pools (its hook was registered first, by _format's
    # import, and these hooks run last-registered first): a save started just before the
    # program's end is committed, not failed with "cannot schedule new futures after
    # shutdown".
    with contextlib.suppress(BaseException):
        wait_pending()


threading._register_atexit(_finish_at_exit)


def _printer(p: Progress) -> None:
    import sys

    print(p, file=sys.stderr, flush=True)


def _snapshot(entries: list[_format.WriteEntry]) -> list[_format.WriteEntry]:
    """Copies of the entries' tensors in one reused host buffer (pinned when on GPU)."""
    align = 64
    offsets, total = [], 0
    for e in entries:
        offsets.append(total)
        total += -(-e.tensor.numel() * e.tensor.element_size() // align) * align
    on_gpu = any(e.tensor.device.type != "cpu" for e in entries)
    buf = _STAGING.get("buf")
    if buf is None or buf.numel() < total or (on_gpu and not buf.is_pinned()):
        _STAGING.pop("buf", None)
        buf = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=on_gpu and torch.cuda.is_available())
        _STAGING["buf"] = buf
    out = []
    for e, o in zip(entries, offsets):
        t = e.tensor
        n = t.numel() * t.element_size()
        dst = buf[o: o + n].view(t.dtype).view(t.shape) if n else torch.empty(t.shape, dtype=t.dtype)
        dst.copy_(t, non_blocking=on_gpu)
        out.append(_format.WriteEntry(e.name, dst))
    if on_gpu:
        torch.cuda.synchronize()
    return out


def _run(handle: SaveHandle, path: str, plan: Plan, entries, world: _comm.World, step: int | None,
         metadata: Any, rng_json: dict, keep: int | None, overwrite: bool, callback) -> None:
    try:
        _write_and_commit(handle, path, plan, entries, world, step, metadata, rng_json, keep, overwrite, callback)
    except BaseException as e:  # noqa: BLE001  (reported by wait(), or raised below when synchronous)
        handle._error = e
        if handle._thread is not None:  # nobody may be waiting yet: say so now, too
            import sys

            print(f"{WHERE}: the asynchronous save to {path} failed: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        handle._done.set()
    if handle._thread is None and handle._error is not None:
        handle._reported = True
        raise handle._error


def _write_and_commit(handle, path, plan, entries, world, step, metadata, rng_json, keep, overwrite, callback):
    parent, name = os.path.split(path)
    # 1. rank 0 makes the temporary directory.
    decision: dict[str, Any]
    if world.rank == 0:
        try:
            os.makedirs(parent, exist_ok=True)
            if os.path.lexists(path) and not overwrite:
                raise FileExistsError(f"{WHERE}: {path} already exists (pass overwrite=True to replace it)")
            for stale in os.listdir(parent):  # debris of a save to this path that was killed
                if stale.startswith(f".{name}.tmp-"):
                    shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
            tmp = os.path.join(parent, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
            os.mkdir(tmp)
            decision = {"tmp": tmp}
        except Exception as e:  # noqa: BLE001
            decision = {"error": f"{type(e).__name__}: {e}", "exists": isinstance(e, FileExistsError)}
    else:
        decision = {}
    decision = world.broadcast_json("checkpoint directory", decision)
    if "error" in decision:
        if decision.get("exists"):
            raise FileExistsError(decision["error"].split(": ", 1)[1])
        raise CheckpointError(f"{WHERE}: rank 0 could not create a directory next to {path}: {decision['error']}")
    tmp = decision["tmp"]

    # 2. every rank writes its file.
    fname = f"rank{world.rank:05d}.safetensors"
    total = sum(e.tensor.numel() * e.tensor.element_size() for e in entries)
    meter = _format._Meter("save", world.rank, total, callback)
    try:
        written: dict[str, Any] = _format.write_file(os.path.join(tmp, fname), entries, meter=meter)
        written.update(ok=True, file=fname, rng=rng_json, fingerprint=plan.fingerprint)
    except Exception as e:  # noqa: BLE001
        written = {"ok": False, "error": _write_error(e, os.path.join(tmp, fname), meter.done, total)}
    handle.stats = meter.finish()

    # 3. rank 0 learns what everyone wrote; 4. it commits.
    reports = world.all_gather_json("what each rank wrote", written)
    outcome: dict[str, Any] = {}
    if world.rank == 0:
        try:
            outcome = _commit(path, tmp, plan, reports, world, step, metadata, keep, overwrite)
        except Exception as e:  # noqa: BLE001
            outcome = {"error": f"{type(e).__name__}: {e}"}
        if "error" in outcome:
            shutil.rmtree(tmp, ignore_errors=True)
    outcome = world.broadcast_json("commit outcome", outcome)
    if "error" in outcome:
        before = latest(parent)
        raise CheckpointError(f"{WHERE}: nothing was committed to {path}: {outcome['error']}; the newest committed "
                              f"checkpoint in {parent} is unchanged: "
                              f"{os.path.basename(before) if before else 'there is none'}")


# errno -> what it means for a checkpoint being written
_STORAGE_ERRNOS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EFBIG: "the file size limit was reached",
    errno.EIO: "the storage reported an I/O error",
    errno.EROFS: "the file system is read-only",
}


def _write_error(e: BaseException, file: str, done: int, total: int) -> str:
    """What went wrong writing ``file``: the cause in words when the storage refused
    (disk full, quota, size limit, I/O error), the file, and how far the write got."""
    code = getattr(e, "errno", None)
    cause = _STORAGE_ERRNOS.get(code)
    what = f"{type(e).__name__}: {e}" if code is None else f"{errno.errorcode.get(code, code)}: {e.strerror or e}"
    if cause is None:
        return f"{what} (writing {file}, after {done} of {total} tensor bytes)"
    return f"{cause} ({what}) writing {file}, after {done} of {total} tensor bytes"


def _commit(path, tmp, plan, reports, world, step, metadata, keep, overwrite) -> dict:
    failed = [f"rank {r}: {rep['error']}" for r, rep in enumerate(reports) if not rep.get("ok")]
    if failed:
        return {"error": "writing failed on " + "; ".join(failed)}
    bad = [r for r, rep in enumerate(reports) if rep["fingerprint"] != reports[0]["fingerprint"]]
    if bad:  # the plan is agreed before writing: this is a bug, caught before it is committed
        return {"error": f"rank(s) {', '.join(map(str, bad))} planned another checkpoint than rank 0"}
    where: dict[tuple[int, str], dict] = {}
    files, rng = {}, []
    for r, rep in enumerate(reports):
        files[rep["file"]] = {"rank": r, "bytes": rep["bytes"], "head_bytes": rep["head_bytes"],
                              "head_crc32": rep["head_crc32"], "crc32": rep["crc32"]}
        for e in rep["entries"]:
            where[(r, e["name"])] = {"file": rep["file"], **{k: e[k] for k in ("offset", "nbytes", "crc32")}}
        rng_entry: dict[str, Any] = {"rank": r, **rep["rng"], "tensors": {}}
        for e in rep["entries"]:
            if e["name"].startswith("rng."):
                rng_entry["tensors"][e["name"]] = where[(r, e["name"])]
        rng.append(rng_entry)
    leaves = []
    for rec in plan.records:
        rec = dict(rec)
        if rec["kind"] == "tensor":
            rec["pieces"] = [{**p, **where[(p["rank"], p["name"])]} for p in rec["pieces"]]
        leaves.append(rec)
    split = [rec["tp"]["size"] for rec in plan.records if rec.get("tp")]
    manifest = {
        # Version 1 where nothing is split over tp: a reader of version 1 only refuses a split
        # checkpoint rather than read its slices, one after another, as a whole tensor.
        "format": _format.FORMAT, "version": _format.VERSION if split else 1,
        "fzero_version": __version__, "torch_version": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "created_unix": time.time(),
        "step": step, "world_size": world.size, "stages": plan.stages, "tp": max(split, default=1),
        "block_bytes": _format.BLOCK_BYTES, "treespec": plan.treespec, "parts": plan.parts,
        "leaves": leaves, "files": files, "rng": rng, "metadata": metadata,
    }
    data = _format.write_json(os.path.join(tmp, MANIFEST), manifest)
    _format.write_json(os.path.join(tmp, MARKER), {"format": _format.FORMAT, "step": step,
                                                  "manifest_crc32": zlib.crc32(data), "time": time.time()})
    _format.fsync_dir(tmp)
    parent, name = os.path.split(path)
    old = None
    if os.path.lexists(path):
        if not overwrite:
            raise FileExistsError(f"{path} appeared while saving (pass overwrite=True to replace it)")
        old = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:12]}")
        os.rename(path, old)
    os.rename(tmp, path)  # the commit
    _format.fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if keep is not None:
        _retain(parent, keep, path)
    return {"ok": True}


# --------------------------------------------------------------------------- latest / retention


def _committed(root: str) -> list[tuple[tuple, str]]:
    out = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    for name in names:
        if name.startswith("."):
            continue
        p = os.path.join(root, name)
        marker = _format.read_marker(p) if os.path.isdir(p) else None
        if marker is None or marker.get("format") != _format.FORMAT:
            continue
        s = marker.get("step")
        t = marker.get("time")
        key = (s if isinstance(s, int) else -1, t if isinstance(t, (int, float)) else 0.0, name)
        out.append((key, p))
    out.sort()
    return out


def latest(root: str | os.PathLike, *, verify: bool = False) -> str | None:
    """The newest committed checkpoint in the directory ``root``, or ``None``.

    Newest means the highest step, then the latest commit. Directories whose save did not
    finish (no ``COMMITTED`` marker, or a hidden ``.tmp-`` directory) are never returned.

    With ``verify=True`` the candidates are checked newest first, every byte against its
    checksums (as :func:`fzero.checkpoint.verify` does), and the newest intact one is
    returned: each damaged one passed over (a flipped byte, a truncated or missing file, a
    damaged manifest) gives a :class:`CorruptCheckpointWarning` naming it and saying why
    (its ``path`` and ``error`` attributes hold the same). It reads every byte of each
    checkpoint it checks, in this process: on a job's every rank, that is the checkpoint
    read once per rank.

    Example:
        >>> import tempfile, fzero.checkpoint as ckpt
        >>> with tempfile.TemporaryDirectory() as empty:
        ...     ckpt.latest(empty) is None
        True
    """
    found = _committed(os.path.abspath(os.fspath(root)))
    if not verify:
        return found[-1][1] if found else None
    for _, p in reversed(found):
        try:
            verify_all(p)
        except (CheckpointError, OSError) as e:
            why = str(e).removeprefix("fzero.checkpoint.verify: ")
            warnings.warn(_format.CorruptCheckpointWarning(
                f"fzero.checkpoint.latest: skipped the damaged checkpoint {p}: {why}", p, e), stacklevel=2)
            continue
        return p
    return None


def _intact(path: str) -> bool:
    """Whether ``path`` looks intact without reading its tensor bytes: its marker and
    manifest check out, and every data file is there, at its recorded size, with its
    header's checksum. (A flipped byte inside tensor data needs every byte read:
    :func:`fzero.checkpoint.verify`.)"""
    try:
        man = _format.read_manifest(path, "fzero.checkpoint.save(keep=)")
        files = _format.Files(path, man, "fzero.checkpoint.save(keep=)")
        try:
            for name in man["files"]:
                files.check_head(name)
        finally:
            files.close()
    except (CheckpointError, OSError, KeyError, TypeError, ValueError):
        return False
    return True


def _retain(root: str, keep: int, just: str) -> None:
    """Delete all but the newest ``keep`` intact checkpoints (and damaged ones older than
    them). Only checkpoints that look intact (:func:`_intact`) count: damaged ones among the
    newest are left, and while fewer than ``keep`` intact ones exist nothing is deleted, so
    retention never deletes the only intact checkpoint. ``just`` (the checkpoint just
    written) always stays, even if older by step."""
    found = [p for _, p in _committed(root)]
    kept, intact = {just}, int(_intact(just))
    for p in reversed(found):
        if intact >= keep:
            break
        if p != just and _intact(p):
            kept.add(p)
            intact += 1
        elif p != just:
            kept.add(p)  # damaged but newer than the kept intact ones: left for the user to see
    if intact < keep:
        kept = set(found)  # too few intact checkpoints: delete nothing
    for p in found:
        if p in kept:
            continue
        # Renamed first, so a crash while deleting never leaves a half-deleted checkpoint
        # that still looks committed.
        trash = os.path.join(root, f".{os.path.basename(p)}.del-{uuid.uuid4().hex[:12]}")
        try:
            os.rename(p, trash)
        except OSError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
    # Debris of saves that were killed (temporary and half-deleted directories).
    for name in os.listdir(root):
        # (.old- directories are left alone: after a crash mid-overwrite one may be the only copy.)
        if name.startswith(".") and (".tmp-" in name or ".del-" in name):
            p = os.path.join(root, name)
            try:
                age = time.time() - os.stat(p).st_mtime
            except OSError:
                continue
            if age > 3600 or ".del-" in name:  # a young .tmp- may be another save in progress
                shutil.rmtree(p, ignore_errors=True)
