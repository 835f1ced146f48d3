"""``load``: any checkpoint onto the current mesh, at any world size and ZeRO stage.

Resharding is interval overlap. Every tensor leaf is, on disk, a set of pieces: elements
``[start, stop)`` of the flattened leaf, each in some rank's file (a replicated leaf is one
piece ``[0, numel)``). A target leaf of ``like`` needs ``[a, b)``: its ``Shard``'s piece
(``ShardInfo.piece()``), or the whole leaf. The loader reads the overlap of ``[a, b)`` with
each saved piece straight into the new tensor. N -> M and stage s -> t are the same code.

A leaf split over ``tp`` is, on disk, its slices one after another (``_leaves.TPSlice``).
Loaded with the same split, slice ``t``'s range is an interval like any other. Loaded with
another (``tp=2 -> 1``, ``1 -> 2``, another ``tp``), the target's slice is cut from the rows
of the saved slices it overlaps along the split dim (:func:`_read_rows`), then its ZeRO
piece from that: one leaf at a time, so a rank holds at most its slice of one leaf extra.

Checksums: each rank verifies every block it reads, and rank ``f mod M`` verifies the header
and RNG blocks of the f-th file. Since the ranks' targets together cover every leaf, a load
with ``verify=True`` checks every byte of the checkpoint somewhere, and every rank learns of
a failure on any rank (the error names the file).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch

from fzero import tree
from fzero.checkpoint import _comm, _format, _leaves, _rng
from fzero.checkpoint._pending import wait_pending
from fzero.checkpoint._format import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    Files,
    Progress,
)
from fzero.transforms.shard_state import Shard

__all__ = ["load", "metadata", "manifest", "verify"]

WHERE = "fzero.checkpoint.load"


def _shape_str(shape) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _describe_like(x: Any, sl: _leaves.TPSlice | None = None) -> str:
    if sl is not None:
        t = x.local if isinstance(x, Shard) else x
        return (f"{_shape_str(sl.shape)} {_format.DTYPE_NAME.get(t.dtype, t.dtype)} (slice {sl.rank} of dim "
                f"{sl.dim} over tp={sl.size})")
    if isinstance(x, Shard):
        return f"{_shape_str(x.info.shape)} {_format.DTYPE_NAME.get(x.local.dtype, x.local.dtype)}"
    if isinstance(x, torch.Tensor):
        return f"{_shape_str(x.shape)} {_format.DTYPE_NAME.get(x.dtype, x.dtype)}"
    return f"{type(x).__name__} {x!r}"


def _describe_saved(rec: dict) -> str:
    if rec["kind"] == "tensor":
        tp = rec.get("tp")
        split = f" (dim {tp['dim']} split over tp={tp['size']})" if tp else ""
        return f"{_shape_str(rec['shape'])} {rec['dtype']}{split}"
    return f"{rec['type']} {rec['value']!r}"


def _match(path: str, man: dict, keys: list[str], leaves: list[Any], slices: list, *,
           alone: bool) -> tuple[list[dict], set[str]]:
    """The saved record of each leaf of ``like``, and the checkpoint's key paths ``like``
    does not have. A leaf missing from the checkpoint or mismatched is an error listing
    every difference; so are the extra key paths when this rank loads ``alone`` (in a
    larger world they may be other ranks' -- another pipeline stage's -- and are checked
    over all ranks by :func:`_agree_coverage`)."""
    saved = {rec["path"]: rec for rec in man["leaves"]}
    missing, mismatched = [], []  # (key, line)
    for key, x, sl in zip(keys, leaves, slices):
        rec = saved.get(key)
        if rec is None:
            missing.append((key, f"{key} {_describe_like(x, sl)}"))
            continue
        if isinstance(x, (Shard, torch.Tensor)):
            t = x.local if isinstance(x, Shard) else x
            whole = sl.real_shape if sl is not None else _leaves.global_shape(x)  # a tp slice matches its whole
            ok = rec["kind"] == "tensor" and _leaves.whole_shape(rec) == whole
            if ok and rec["dtype"] != _format.DTYPE_NAME.get(t.dtype):
                saved_dt = _format.DTYPE_OF.get(rec["dtype"])
                ok = saved_dt is not None and saved_dt.is_floating_point and t.dtype.is_floating_point
        elif _leaves.is_value(x):
            ok = rec["kind"] == "value" and rec["type"] == type(x).__name__
        else:
            raise TypeError(f"{WHERE}: leaf {key} of like is a {type(x).__name__}; a checkpoint holds tensors, "
                            f"fzero Shards and Python scalars")
        if not ok:
            mismatched.append((key, f"{key}: checkpoint {_describe_saved(rec)}, like {_describe_like(x, sl)}"))
    keyset = set(keys)
    extra = {rec["path"] for rec in man["leaves"] if rec["path"] not in keyset}
    shown_extra = [(rec["path"], f"{rec['path']} {_describe_saved(rec)}") for rec in man["leaves"]
                   if rec["path"] in extra] if alone else []
    if missing or shown_extra or mismatched:
        _mismatch(path, missing, shown_extra, mismatched, "extra in the checkpoint (not in like)")
    return [saved[k] for k in keys], extra


def _check_slices(path: str, keys: list[str], leaves: list[Any], recs: list[dict], slices: list) -> None:
    """Every tp slice of ``like`` can be cut from the checkpoint's leaf: its split dim divides
    by ``like``'s tp, and ``like`` holds a slice of the size that gives."""
    for key, x, rec, sl in zip(keys, leaves, recs, slices):
        if sl is None:
            continue
        if sl.shape[sl.dim] % sl.size:
            raise CheckpointError(
                f"{WHERE}: cannot split {key} of the checkpoint at {path}, {_describe_saved(rec)}, over tp={sl.size} "
                f"as like does: dim {sl.dim} of parameter {sl.name!r} has {sl.shape[sl.dim]} elements, which do not "
                f"divide by {sl.size}")
        problem = _leaves.slice_problem(key, x, sl)
        if problem is not None:
            raise CheckpointError(f"{WHERE}: like does not fit the checkpoint at {path}: {problem}")


def _mismatch(path: str, missing, extra, mismatched, extra_title: str):
    lines = [f"{WHERE}: the checkpoint at {path} does not match `like`:"]
    for title, items in (("missing from the checkpoint (in like only)", missing), (extra_title, extra),
                         ("mismatched (shape, kind, or a dtype that cannot be cast)", mismatched)):
        if items:
            lines.append(f"  {title}: {len(items)}")
            lines += [f"    {line}" for _, line in items[:20]]
            if len(items) > 20:
                lines.append(f"    ... ({len(items) - 20} more)")
    raise CheckpointMismatchError("\n".join(lines), missing=[k for k, _ in missing],
                                  extra=[k for k, _ in extra], mismatched=[k for k, _ in mismatched])


def _agree_coverage(path: str, man: dict, world: _comm.World, extra: set[str] | None,
                    error: BaseException | None) -> None:
    """Every leaf of the checkpoint must be loaded by some rank: a pipelined checkpoint's
    leaves are spread over the stages' ``like`` trees, and a leaf no rank takes is an
    extra leaf, as in a world of one. The ranks exchange one bit per leaf (which they do
    not load) and an error if they already failed; every rank raises the same."""
    bits = 0
    if extra is not None:
        for i, rec in enumerate(man["leaves"]):
            if rec["path"] not in extra:
                bits |= 1 << i
    said = world.all_gather_json("which leaves each rank loads", {
        "loads": format(bits, "x"), "error": None if error is None else f"{type(error).__name__}: {error}"})
    if error is not None:
        raise error
    failed = [r for r, s in enumerate(said) if s["error"] is not None]
    if failed:
        raise CheckpointError(f"{WHERE}: loading {path} failed on rank {failed[0]}: {said[failed[0]]['error']}")
    covered = 0
    for s in said:
        covered |= int(s["loads"], 16)
    left = [(rec["path"], f"{rec['path']} {_describe_saved(rec)}") for i, rec in enumerate(man["leaves"])
            if not covered >> i & 1]
    if left:
        _mismatch(path, [], left, [], "extra in the checkpoint (in no rank's like)")


# --------------------------------------------------------------------------- reading ranges


class _Reader:
    """Reads byte ranges of pieces; with ``verify``, the blocks' CRC-32s are computed on the
    checksum threads while the next bytes are read, and compared at :meth:`flush`."""

    RUN = 8  # blocks read per system call in a run of whole blocks: checksummed while the next run is read

    def __init__(self, files: Files, block: int, verify: bool, meter: _format._Meter | None):
        self.files, self.block, self.verify, self.meter = files, block, verify, meter
        self.pending: list = []

    def flush(self) -> None:
        """Compare every checksum queued so far (call before the buffers read into go away)."""
        _format.check_pending(self.pending)

    def read(self, piece: dict, bs: int, be: int, out, what: str, *, count: bool = True) -> None:
        """Bytes ``[bs, be)`` of ``piece``'s entry into ``out`` (a buffer of ``be - bs`` bytes)."""
        out = memoryview(out).cast("B")
        files, off, nb, B = self.files, piece["offset"], piece["nbytes"], self.block
        if self.meter is not None and count:
            self.meter.add(be - bs)
        if not self.verify:
            files.read_into(piece["file"], off + bs, out)
            return
        pos = bs
        while pos < be:
            k = pos // B
            blo, bhi = k * B, min((k + 1) * B, nb)
            if pos == blo and be >= bhi:
                # A run of whole blocks: read them straight into ``out`` and check them there.
                last = -(-nb // B) - 1 if be == nb else be // B - 1
                last = min(last, k + self.RUN - 1)
                run_hi = min((last + 1) * B, nb)
                dst = out[pos - bs: run_hi - bs]
                files.read_into(piece["file"], off + pos, dst)
                _format.check_blocks(files, piece, dst, k, B, what, self.pending)
                pos = run_hi
            else:  # a block we need only part of: read it whole to check it
                stage = bytearray(bhi - blo)
                files.read_into(piece["file"], off + blo, stage)
                _format.check_blocks(files, piece, memoryview(stage), k, B, what)
                hi = min(be, bhi)
                out[pos - bs: hi - bs] = memoryview(stage)[pos - blo: hi - blo]
                pos = hi


def _tensor_bytes(t: torch.Tensor):
    return t.view(-1).view(torch.uint8).numpy() if t.numel() else bytearray(0)


def _fill(reader: _Reader, rec: dict, a: int, b: int, dst: torch.Tensor) -> None:
    """Elements ``[a, b)`` of the saved leaf ``rec`` into the flat CPU tensor ``dst``."""
    item = dst.element_size()
    out = _tensor_bytes(dst)
    mv = memoryview(out).cast("B") if dst.numel() else memoryview(bytearray(0))
    covered = 0
    for p in rec["pieces"]:
        lo, hi = max(a, p["start"]), min(b, p["stop"])
        if hi <= lo:
            continue
        reader.read(p, (lo - p["start"]) * item, (hi - p["start"]) * item,
                    mv[(lo - a) * item: (hi - a) * item], rec["path"])
        covered += hi - lo
    if covered != b - a:
        raise CorruptCheckpointError(f"{WHERE}: the manifest's pieces of {rec['path']} cover {covered} of the "
                                     f"{b - a} elements [{a}, {b}) this rank needs: the manifest is inconsistent",
                                     os.path.join(reader.files.root, _format.MANIFEST))


def _read_rows(reader: _Reader, rec: dict, dim: int, lo: int, hi: int) -> torch.Tensor:
    """``whole.narrow(dim, lo, hi - lo)`` of the saved tensor leaf ``rec``, reading only the
    saved tp slices it overlaps when ``rec`` is split on ``dim`` (a leaf not split is one
    slice), and only the rows it needs of a slice whose rows are contiguous."""
    shape = [int(n) for n in rec["shape"]]
    dtype = _format.dtype_of(rec["dtype"], reader.files.path(_format.MANIFEST))
    split = rec.get("tp") or {"dim": dim, "size": 1}
    sd, size = split["dim"], split["size"]
    local = list(_leaves.slice_shape(shape, sd, size))
    n, outer, inner = math.prod(local), math.prod(local[:sd]), math.prod(local[sd + 1:])

    def rows(t: int, r0: int, r1: int) -> torch.Tensor:  # rows [r0, r1) along sd of slice t
        if outer == 1:  # they are contiguous: read just them
            out = torch.empty((r1 - r0) * inner, dtype=dtype)
            _fill(reader, rec, t * n + r0 * inner, t * n + r1 * inner, out)
            return out.view(local[:sd] + [r1 - r0] + local[sd + 1:])
        out = torch.empty(n, dtype=dtype)
        _fill(reader, rec, t * n, (t + 1) * n, out)
        return out.view(local).narrow(sd, r0, r1 - r0)

    if math.prod(shape) == 0:
        out = torch.empty(shape, dtype=dtype).narrow(dim, lo, hi - lo)
    elif sd != dim:  # split on another dim than the target's: the whole leaf, then its rows
        out = torch.cat([rows(t, 0, local[sd]) for t in range(size)], sd).narrow(dim, lo, hi - lo)
    else:
        L = local[sd]
        parts = [rows(t, max(lo, t * L) - t * L, min(hi, (t + 1) * L) - t * L) for t in range(lo // L, -(-hi // L))]
        out = torch.cat(parts, sd) if len(parts) > 1 else parts[0]
    reader.flush()
    return out


def read_whole(reader: _Reader, rec: dict) -> torch.Tensor:
    """The whole tensor leaf ``rec``, in its saved dtype (its tp slices put together)."""
    split = rec.get("tp")
    if split is not None:  # (a fused projection's view merged back: the same row-major order)
        whole = _read_rows(reader, rec, split["dim"], 0, rec["shape"][split["dim"]]).contiguous()
        return whole.view(_leaves.whole_shape(rec))
    t = torch.empty(math.prod(rec["shape"]), dtype=_format.dtype_of(rec["dtype"], reader.files.path(_format.MANIFEST)))
    _fill(reader, rec, 0, t.numel(), t)
    reader.flush()
    return t.view(rec["shape"])


def _load_leaf(reader: _Reader, rec: dict, x: Any, sl: _leaves.TPSlice | None, in_place: bool):
    if rec["kind"] == "value":
        v = rec["value"]
        return float(v) if rec["type"] == "float" and isinstance(v, str) else v
    saved_dtype = _format.dtype_of(rec["dtype"], reader.files.path(_format.MANIFEST))
    target = x.local if isinstance(x, Shard) else x
    a, b = x.info.piece() if isinstance(x, Shard) else (0, target.numel())
    direct = (in_place and target.dtype == saved_dtype and target.device.type == "cpu"
              and target.is_contiguous())
    flat = target.detach().view(-1) if direct else torch.empty(b - a, dtype=saved_dtype)
    saved = rec.get("tp")
    if (saved is None and sl is None) or (saved is not None and sl is not None
                                          and (saved["dim"], saved["size"], saved.get("fused")) ==
                                          (sl.dim, sl.size, list(sl.fused) if sl.fused else None)):
        base = sl.rank * sl.local_numel if sl is not None else 0  # slice sl.rank's elements on disk
        _fill(reader, rec, base + a, base + b, flat)
    else:  # re-sliced: this rank's tp slice (or the whole leaf), then its ZeRO piece
        if sl is None:
            part = read_whole(reader, rec)
        elif sl.fused or (saved or {}).get("fused"):  # a fused projection on either side: cut from the whole
            n = sl.local_shape[sl.dim]
            part = read_whole(reader, rec).view(sl.shape).narrow(sl.dim, sl.rank * n, n)
        else:
            part = _read_rows(reader, rec, sl.dim, sl.rank * sl.local_shape[sl.dim],
                              (sl.rank + 1) * sl.local_shape[sl.dim])
        flat.copy_(part.reshape(-1)[a:b])
    reader.flush()
    if direct:
        out = target
    elif in_place:
        with torch.no_grad():
            target.copy_(flat.view(target.shape))
        out = target
    else:
        # ``to`` returns the tensor itself where device and dtype match already.
        out = flat.view(target.shape).to(device=target.device, dtype=target.dtype)
    return Shard(out, x.info) if isinstance(x, Shard) else out


def _rng_tensors(reader: _Reader, entry: dict) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in entry.get("tensors", {}).items():
        reader.files.fd(p["file"])  # the file's size checked before its piece's bytes are allocated
        t = torch.empty(p["nbytes"], dtype=torch.uint8)
        reader.read(p, 0, p["nbytes"], _tensor_bytes(t), f"RNG state {name} of rank {entry['rank']}", count=False)
        reader.flush()
        out[name] = t
    return out


# --------------------------------------------------------------------------- load


def load(
    path: str | os.PathLike,
    like: Any,
    *,
    verify: bool = True,
    restore_rng: bool = False,
    in_place: bool = False,
    progress: bool | Callable[[Progress], None] = False,
    timeout_s: float | None = None,
) -> Any:
    """Load the checkpoint at ``path`` into the layout of ``like``.

    Collective when a process group exists (every rank calls it). ``like`` is a state as
    the step gives it (``step.init(state)``): its tree says which leaves to load, and its
    ``Shard`` pieces (and, under ``fzero.tensor_parallel``, its tp slices) say which
    elements this rank needs, whatever world size, ZeRO stage and tp the checkpoint was
    saved with. Ranks may load different parts of the checkpoint (each
    pipeline stage its own parameters, whatever the pipeline it was saved with); together
    they must load every leaf of it. Floating-point leaves are cast to ``like``'s dtype
    (fp32 <-> bf16/fp16) and placed on ``like``'s device. No code runs: the manifest is
    JSON and tensors are raw bytes.

    Args:
        path: a committed checkpoint directory (see :func:`latest`).
        like: the template state; it is not modified unless ``in_place``.
        verify: check the CRC-32 of every block read (and, over all ranks, every byte).
        restore_rng: also set this rank's torch/CUDA/Python/numpy RNG states to those saved
            by the same rank (needs the world size the checkpoint was saved with).
        in_place: write into ``like``'s tensors instead of new ones (saves the memory of a
            second copy; ``like`` and the result then share storage). A load that fails
            may leave ``like`` partly overwritten.
        progress: ``True`` prints bytes read per rank and MiB/s to stderr; or a callable
            receiving :class:`Progress`.
        timeout_s: how long a rank waits for the others (default ``$FZERO_TIMEOUT``).

    Returns:
        A state with ``like``'s structure and the checkpoint's values, ready to step.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointMismatchError: the trees differ: every key path missing from the
            checkpoint, mismatched, or extra in it (loaded by no rank) is listed with its
            shape.
        CorruptCheckpointError: a missing, truncated or corrupted file (named).
        CheckpointError: ``path`` was never committed; another rank failed (named); a
            split dim ``like``'s tp does not divide (the leaf, the parameter, both sizes).

    Example:
        >>> import tempfile, torch, fzero.checkpoint as ckpt
        >>> tmp = tempfile.TemporaryDirectory(); root = tmp.name
        >>> _ = ckpt.save(f"{root}/a", {"w": torch.arange(3.0)})
        >>> ckpt.load(f"{root}/a", like={"w": torch.zeros(3)})["w"].tolist()
        [0.0, 1.0, 2.0]
    """
    path = os.path.abspath(os.fspath(path))
    # An asynchronous save talks to the other ranks on the checkpoint's process group from
    # its thread; collectives from two threads on one group could pair up differently on
    # different ranks, so it finishes first.
    wait_pending()
    world = _comm.world(WHERE, timeout_s, path=path)
    prepared, error = None, None
    try:
        prepared = _prepare(path, like, world, verify, restore_rng)
    except Exception as e:  # noqa: BLE001  (every rank must reach the agreement below)
        error = e
    if world.size > 1:
        _agree_coverage(path, prepared[0] if prepared else {"leaves": []}, world,
                        prepared[4] if prepared else None, error)
    elif error is not None:
        raise error
    result = None
    try:
        result = _load_local(path, prepared, world, verify, restore_rng, in_place,
                             _printer if progress is True else (progress or None))
    except Exception as e:  # noqa: BLE001  (every rank must reach the agreement below)
        error = e
    if world.size > 1:
        status = world.all_gather_json("load outcome", None if error is None else f"{type(error).__name__}: {error}")
        failed = [r for r, s in enumerate(status) if s is not None]
        if failed and error is None:
            r = failed[0]
            raise CheckpointError(f"{WHERE}: loading {path} failed on rank {r}: {status[r]}")
    if error is not None:
        raise error
    return result


def _printer(p: Progress) -> None:
    import sys

    print(p, file=sys.stderr, flush=True)


def _prepare(path, like, world, verify, restore_rng):
    """``(manifest, leaves of like, its treespec, their saved records, extra key paths, their
    tp slices)``."""
    man = _format.read_manifest(path, WHERE, verify=verify)
    paths, leaves, spec = _leaves.flatten(like)
    keys = [_leaves.keystr(p) for p in paths]
    layout = _leaves.layout_of(like, WHERE)
    slices = _leaves.tp_slices(paths, leaves, layout)
    recs, extra = _match(path, man, keys, leaves, slices, alone=world.size == 1)
    _check_slices(path, keys, leaves, recs, slices)
    if restore_rng and man["world_size"] != world.size:
        raise CheckpointError(f"{WHERE}: restore_rng=True needs the world size the checkpoint was saved with "
                              f"({man['world_size']}); this world has {world.size}")
    return man, leaves, spec, recs, extra, slices


def _load_local(path, prepared, world, verify, restore_rng, in_place, callback):
    man, leaves, spec, recs, _, slices = prepared
    files = Files(path, man, WHERE)
    total = 0
    for rec, x in zip(recs, leaves):
        if rec["kind"] == "tensor":
            a, b = x.info.piece() if isinstance(x, Shard) else (0, x.numel())
            total += (b - a) * _format.dtype_of(rec["dtype"], _format.MANIFEST).itemsize
    meter = _format._Meter("load", world.rank, total, callback)
    reader = _Reader(files, man["block_bytes"], verify, meter)
    try:
        out = [_load_leaf(reader, rec, x, sl, in_place) for rec, x, sl in zip(recs, leaves, slices)]
        rng_by_rank = {e["rank"]: e for e in man["rng"]}
        if verify:  # this rank's share of the bytes no target reads: headers and RNG states
            for i, name in enumerate(sorted(man["files"])):
                if i % world.size == world.rank:
                    files.check_head(name)
                    entry = rng_by_rank.get(man["files"][name]["rank"])
                    if entry is not None and not (restore_rng and entry["rank"] == world.rank):
                        _rng_tensors(reader, entry)
        if restore_rng:
            entry = rng_by_rank.get(world.rank)
            if entry is None:
                raise CorruptCheckpointError(f"{WHERE}: {os.path.join(path, _format.MANIFEST)} has no RNG state of "
                                             f"rank {world.rank}", os.path.join(path, _format.MANIFEST))
            tensors = _rng_tensors(reader, entry)
            try:
                _rng.restore(tensors, entry)
            except (RuntimeError, ValueError, TypeError, IndexError) as e:  # a state its generator refuses
                raise CorruptCheckpointError(f"{WHERE}: the RNG state of rank {world.rank} in {path} cannot be "
                                             f"restored: {e}", os.path.join(path, _format.MANIFEST)) from e
    finally:
        files.close()
    meter.finish()
    return tree.unflatten(spec, out)



# --------------------------------------------------------------------------- read-only helpers


def manifest(path: str | os.PathLike) -> dict:
    """The parsed ``manifest.json`` of the committed checkpoint at ``path`` (see docs/checkpoints.md).

    Raises:
        FileNotFoundError, CheckpointError, CorruptCheckpointError: as :func:`load`.
    """
    return _format.read_manifest(os.path.abspath(os.fspath(path)), "fzero.checkpoint.manifest")


def metadata(path: str | os.PathLike) -> Any:
    """The user metadata saved with ``save(..., metadata=...)`` (``None`` if none).

    JSON round-trips it: tuples come back as lists.

    Example:
        >>> import tempfile, torch, fzero.checkpoint as ckpt
        >>> tmp = tempfile.TemporaryDirectory(); path = tmp.name + "/ck"
        >>> _ = ckpt.save(path, {"w": torch.zeros(1)}, metadata={"loader": {"epoch": 3, "seen": (1, 2)}})
        >>> ckpt.metadata(path)
        {'loader': {'epoch': 3, 'seen': [1, 2]}}
    """
    return _format.read_manifest(os.path.abspath(os.fspath(path)), "fzero.checkpoint.metadata").get("metadata")


def verify(path: str | os.PathLike) -> dict:
    """Check every byte of the checkpoint at ``path`` against its checksums (one process).

    Returns:
        ``{"files": n, "bytes": total}`` of what was checked.

    Raises:
        CorruptCheckpointError: a file is missing, truncated, has bytes the manifest does
            not account for, or fails a checksum; the message names it.
        CheckpointError: ``path`` is not a committed checkpoint.

    Example:
        >>> import tempfile, torch, fzero.checkpoint as ckpt
        >>> tmp = tempfile.TemporaryDirectory(); path = tmp.name + "/ck"
        >>> _ = ckpt.save(path, {"w": torch.zeros(1000)})
        >>> ckpt.verify(path)["files"]
        1
    """
    where = "fzero.checkpoint.verify"
    path = os.path.abspath(os.fspath(path))
    man = _format.read_manifest(path, where)
    files = Files(path, man, where)
    reader = _Reader(files, man["block_bytes"], True, None)
    by_file: dict[str, list[tuple[dict, str]]] = {name: [] for name in man["files"]}
    for rec in man["leaves"]:
        for p in rec.get("pieces", ()):
            by_file.setdefault(p["file"], []).append((p, rec["path"]))
    for e in man["rng"]:
        for name, p in e.get("tensors", {}).items():
            by_file.setdefault(p["file"], []).append((p, f"RNG state {name} of rank {e['rank']}"))
    total = 0
    block = man["block_bytes"]
    chunk = bytearray(max(1, (64 * 2**20) // block) * block)  # whole blocks, so none is read twice
    try:
        for name in sorted(by_file):
            info = man["files"].get(name)
            fpath = files.path(name)
            if info is None:
                raise CorruptCheckpointError(f"{where}: the manifest refers to {fpath}, which it does not list", fpath)
            files.check_head(name)
            pieces = sorted(by_file[name], key=lambda pe: pe[0]["offset"])
            pos = info["head_bytes"]
            crcs = []
            for p, what in pieces:
                if p["offset"] != pos:
                    raise CorruptCheckpointError(f"{where}: {fpath}: bytes [{pos}, {p['offset']}) are not accounted "
                                                 f"for by the manifest", fpath)
                for lo in range(0, p["nbytes"], len(chunk)):
                    hi = min(p["nbytes"], lo + len(chunk))
                    reader.read(p, lo, hi, memoryview(chunk)[: hi - lo], what)
                    reader.flush()  # before the chunk is reused
                pos += p["nbytes"]
                crcs.append(p["crc32"])
            if pos != info["bytes"]:
                raise CorruptCheckpointError(f"{where}: {fpath} has {info['bytes']} bytes; the manifest accounts for "
                                             f"{pos}", fpath)
            if _format.file_digest(info["head_crc32"], crcs) != info["crc32"]:
                raise CorruptCheckpointError(f"{where}: {fpath}: the block checksums do not add up to the file's "
                                             f"checksum {info['crc32']}: the manifest is inconsistent", fpath)
            total += pos
    finally:
        files.close()
    return {"files": len(by_file), "bytes": total}
