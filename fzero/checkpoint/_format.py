"""The on-disk format: safetensors files with block checksums, and the JSON manifest.

A checkpoint is a directory::

    step_100/
        manifest.json            what every leaf is and where its bytes are (JSON, no code)
        rank00000.safetensors    what rank 0 owned (its pieces, some replicated leaves, its RNG)
        rank00001.safetensors    ...
        COMMITTED                written last; {"step", "manifest_crc32", ...}

Every data file is a valid safetensors file (``safetensors.safe_open`` reads it) that this
module writes itself, straight from the tensors' memory: a header, then each tensor's bytes.
Checksums are CRC-32 per *block*: the header is one block, and each tensor entry is cut
into blocks of ``block_bytes`` from its own first byte. A reader that needs part of a piece
(resharding) reads and verifies only the blocks that hold it; ``verify`` checks them all.
A file's checksum is the CRC-32 of its blocks' CRC-32s (little-endian u32, in file order),
so it covers every byte of the file.

Nothing here executes code on read: JSON is parsed with ``json.loads`` and tensor bytes are
read into buffers with ``os.preadv``. There is no pickle, and no ``torch.load``.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

__all__ = [
    "BLOCK_BYTES",
    "CheckpointError",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "CorruptCheckpointWarning",
    "FORMAT",
    "VERSION",
    "Progress",
]

FORMAT = "fzero.checkpoint"
VERSION = 2  # what a save writes when a leaf is split over tp (leaves' ``tp``); 1 otherwise
READS = (1, 2)
MANIFEST = "manifest.json"
MARKER = "COMMITTED"
# 4 MiB: a resharding read wastes at most two blocks per piece boundary, and the manifest
# carries ~3 bytes of CRC per MiB of checkpoint.
BLOCK_BYTES = 4 * 2**20


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says which file, leaf or rank."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is missing, truncated, not what the manifest says, or fails its
    checksum. ``file`` is the path of the offending file."""

    def __init__(self, message: str, file: str | os.PathLike | None = None):
        super().__init__(message)
        self.file = None if file is None else os.fspath(file)


class CorruptCheckpointWarning(UserWarning):
    """A committed checkpoint was passed over because it is damaged (``latest(root,
    verify=True)``). ``path`` is the checkpoint; ``error`` the :class:`CheckpointError`
    that says which file and why."""

    def __init__(self, message: str, path: str | None = None, error: BaseException | None = None):
        super().__init__(message)
        self.path, self.error = path, error


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint's tree does not match ``like``. ``missing`` (in ``like`` only),
    ``extra`` (in the checkpoint only) and ``mismatched`` (both, different shape or kind)
    hold the key paths."""

    def __init__(self, message: str, *, missing=(), extra=(), mismatched=()):
        super().__init__(message)
        self.missing, self.extra, self.mismatched = list(missing), list(extra), list(mismatched)


class Progress(NamedTuple):
    """Bytes written (or read) so far by one rank: passed to a ``progress`` callback."""

    what: str  # "save" or "load"
    rank: int
    done_bytes: int
    total_bytes: int
    elapsed_s: float

    @property
    def bytes_per_s(self) -> float:
        return self.done_bytes / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def __str__(self) -> str:
        mb = 2**20
        return (f"fzero.checkpoint.{self.what} rank {self.rank}: {self.done_bytes / mb:.1f}/"
                f"{self.total_bytes / mb:.1f} MiB in {self.elapsed_s:.2f} s ({self.bytes_per_s / mb:.0f} MiB/s)")


class _Meter:
    """Calls ``progress`` at most every ``every_s`` seconds, and once at the end."""

    def __init__(self, what: str, rank: int, total: int, progress: Callable[[Progress], None] | None,
                 every_s: float = 1.0):
        self.what, self.rank, self.total, self.progress, self.every_s = what, rank, total, progress, every_s
        self.done = 0
        self.t0 = time.perf_counter()
        self.last = self.t0

    def add(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            now = time.perf_counter()
            if now - self.last >= self.every_s:
                self.last = now
                self.progress(Progress(self.what, self.rank, self.done, self.total, now - self.t0))

    def finish(self) -> Progress:
        p = Progress(self.what, self.rank, self.done, self.total, time.perf_counter() - self.t0)
        if self.progress is not None:
            self.progress(p)
        return p


# --------------------------------------------------------------------------- dtypes

# torch dtype <-> manifest name <-> safetensors code. A fixed table: names read from a
# manifest are looked up here, never resolved with getattr.
_DTYPES: list[tuple[torch.dtype, str, str]] = [
    (torch.float64, "float64", "F64"),
    (torch.float32, "float32", "F32"),
    (torch.float16, "float16", "F16"),
    (torch.bfloat16, "bfloat16", "BF16"),
    (torch.int64, "int64", "I64"),
    (torch.int32, "int32", "I32"),
    (torch.int16, "int16", "I16"),
    (torch.int8, "int8", "I8"),
    (torch.uint8, "uint8", "U8"),
    (torch.bool, "bool", "BOOL"),
    (torch.complex64, "complex64", "C64"),
]
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _DTYPES.append((getattr(torch, _name), _name, _code))
DTYPE_NAME = {d: n for d, n, _ in _DTYPES}
DTYPE_OF = {n: d for d, n, _ in _DTYPES}
SAFETENSORS_CODE = {d: c for d, _, c in _DTYPES}


def dtype_name(dtype: torch.dtype, where: str, path: str) -> str:
    try:
        return DTYPE_NAME[dtype]
    except KeyError:
        raise TypeError(f"{where}: leaf {path} has dtype {dtype}, which checkpoints do not store "
                        f"(supported: {', '.join(sorted(DTYPE_OF))})") from None


def dtype_of(name: str, file: str) -> torch.dtype:
    try:
        return DTYPE_OF[name]
    except KeyError:
        raise CorruptCheckpointError(f"unknown dtype {name!r} in {file}", file) from None


# --------------------------------------------------------------------------- bytes of tensors


def host_bytes(t: torch.Tensor):
    """The bytes of ``t`` (row-major) as a uint8 numpy array, sharing memory where possible."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return t.view(torch.uint8).numpy()


def block_crcs(buf, block: int) -> list[int]:
    """CRC-32 of each ``block``-byte block of ``buf`` (the last may be shorter)."""
    mv = memoryview(buf)
    return [zlib.crc32(mv[i: i + block]) for i in range(0, len(mv), block)] if len(mv) else []


def file_digest(head_crc: int, entry_crcs: Sequence[Sequence[int]]) -> str:
    """A file's checksum: CRC-32 of its blocks' CRC-32s in file order, as 8 hex digits."""
    crcs = [head_crc] + [c for cs in entry_crcs for c in cs]
    return f"{zlib.crc32(struct.pack(f'<{len(crcs)}I', *crcs)):08x}"


# --------------------------------------------------------------------------- checksum threads

_POOL: list = []  # [ThreadPoolExecutor] once made
if hasattr(os, "register_at_fork"):  # a forked child has none of its parent's threads: make its own
    os.register_at_fork(after_in_child=_POOL.clear)


def crc_pool():
    """Threads that compute CRC-32s while the caller reads or writes (zlib releases the GIL),
    or ``None`` on a machine with a core or less per rank. Sized to the cores per local rank
    (``$LOCAL_WORLD_SIZE``, set by torchrun), at most 8; ``$FZERO_CHECKPOINT_THREADS`` overrides."""
    if not _POOL:
        env = os.environ.get("FZERO_CHECKPOINT_THREADS")
        if env is not None:
            n = int(env)
        else:
            local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
            n = min(8, (os.cpu_count() or 1) // local)
        _POOL.append(ThreadPoolExecutor(n, thread_name_prefix="fzero-checkpoint-crc") if n >= 1 else None)
    return _POOL[0]


def _crc(pool, chunk):
    return pool.submit(zlib.crc32, chunk) if pool is not None else _Done(zlib.crc32(chunk))


class _Done:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


# --------------------------------------------------------------------------- writing


class WriteEntry(NamedTuple):
    name: str
    tensor: torch.Tensor


def write_file(path: str, entries: Sequence[WriteEntry], *, block: int = BLOCK_BYTES,
               meter: _Meter | None = None, fsync: bool = True, metadata: dict[str, str] | None = None) -> dict:
    """Write ``entries`` as a safetensors file, checksumming blocks on the way.

    Returns:
        ``{"bytes", "head_bytes", "head_crc32", "crc32", "entries": [{"name", "offset",
        "nbytes", "crc32": [...]}]}``; ``offset`` is absolute in the file.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "writer": FORMAT, **(metadata or {})}}
    off = 0
    sizes = []
    for e in entries:
        n = e.tensor.numel() * e.tensor.element_size()
        header[e.name] = {"dtype": SAFETENSORS_CODE[e.tensor.dtype], "shape": list(e.tensor.shape),
                          "data_offsets": [off, off + n]}
        sizes.append(n)
        off += n
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-(8 + len(hjson)) % 8)  # safetensors pads the header to 8 bytes
    head = struct.pack("<Q", len(hjson)) + hjson
    head_crc = zlib.crc32(head)
    records = []
    pos = len(head)
    pool = crc_pool()
    with open(path, "wb", buffering=0) as f:
        _write_all(f, memoryview(head))
        for e, n in zip(entries, sizes):
            buf = host_bytes(e.tensor)
            mv = memoryview(buf)
            crcs = []
            for i in range(0, n, block):
                chunk = mv[i: i + block]
                crcs.append(_crc(pool, chunk))  # checksummed on a thread while we write
                _write_all(f, chunk)
                if meter is not None:
                    meter.add(len(chunk))
            records.append({"name": e.name, "offset": pos, "nbytes": n, "crc32": crcs, "_keep": buf})
            pos += n
        for r in records:
            r["crc32"] = [c.result() for c in r["crc32"]]
            del r["_keep"]
        if fsync:
            os.fsync(f.fileno())
    return {"bytes": pos, "head_bytes": len(head), "head_crc32": head_crc,
            "crc32": file_digest(head_crc, [r["crc32"] for r in records]), "entries": records}


def _write_all(f, mv: memoryview) -> None:
    mv = mv.cast("B") if mv.format != "B" else mv
    while len(mv):
        n = f.write(mv)
        mv = mv[n:]


def fsync_dir(path: str) -> None:
    """Make a rename or a new file in ``path`` durable (POSIX; a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path: str, obj: Any, *, fsync: bool = True) -> bytes:
    data = json.dumps(obj, indent=1, allow_nan=False).encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return data


# --------------------------------------------------------------------------- reading


class Files:
    """Open checkpoint files by name, checked against the manifest's sizes; read ranges."""

    def __init__(self, root: str, manifest: dict, where: str):
        self.root, self.manifest, self.where = root, manifest, where
        self.fds: dict[str, int] = {}

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def fd(self, name: str) -> int:
        fd = self.fds.get(name)
        if fd is not None:
            return fd
        info = self.manifest["files"].get(name)
        path = self.path(name)
        if info is None:
            raise CorruptCheckpointError(f"{self.where}: the manifest refers to {path}, which it does not list "
                                         f"among its files", path)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.where}: checkpoint file {path} is missing", path) from None
        except OSError as e:
            raise CorruptCheckpointError(f"{self.where}: cannot open checkpoint file {path}: {e}", path) from None
        size = os.fstat(fd).st_size
        if size != info["bytes"]:
            os.close(fd)
            what = "truncated" if size < info["bytes"] else "longer than written"
            raise CorruptCheckpointError(f"{self.where}: checkpoint file {path} is {what}: the manifest says "
                                         f"{info['bytes']} bytes, it has {size}", path)
        self.fds[name] = fd
        return fd

    def read_into(self, name: str, offset: int, buf) -> None:
        """Fill ``buf`` (a writable buffer) with the file's bytes from ``offset``."""
        fd = self.fd(name)
        mv = memoryview(buf).cast("B")
        done = 0
        while done < len(mv):
            n = os.preadv(fd, [mv[done:]], offset + done)
            if n <= 0:
                path = self.path(name)
                raise CorruptCheckpointError(f"{self.where}: checkpoint file {path} ended at byte {offset + done}, "
                                             f"before the {len(mv)} bytes at {offset} the manifest lists", path)
            done += n

    def check_head(self, name: str) -> None:
        info = self.manifest["files"][name]
        buf = bytearray(info["head_bytes"])
        self.read_into(name, 0, buf)
        if zlib.crc32(buf) != info["head_crc32"]:
            path = self.path(name)
            raise CorruptCheckpointError(f"{self.where}: checksum mismatch in {path}, bytes [0, {len(buf)}) "
                                         f"(the safetensors header): the file is corrupted", path)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def check_blocks(files: Files, piece: dict, mv, first_block: int, block: int, what: str,
                 pending: list | None = None) -> None:
    """Compare the CRC-32 of each whole block in ``mv`` (which starts at ``first_block`` of
    ``piece``) with the manifest's; with ``pending``, queue the CRC-32s on the checksum
    threads and leave the comparison to :func:`check_pending`."""
    pool = crc_pool() if pending is not None else None
    for k in range(first_block, first_block + -(-len(mv) // block) if len(mv) else first_block):
        lo = (k - first_block) * block
        got = _crc(pool, mv[lo: lo + block])
        if pending is not None:
            pending.append((files, piece, k, block, what, got))
        else:
            _compare(files, piece, k, block, what, got)


def check_pending(pending: list) -> None:
    """Compare the queued CRC-32s (see :func:`check_blocks`) with the manifest's."""
    try:
        for item in pending:
            _compare(*item)
    finally:
        pending.clear()


def _compare(files: Files, piece: dict, k: int, block: int, what: str, got) -> None:
    crcs = piece["crc32"]
    if k >= len(crcs) or got.result() != crcs[k]:
        path = files.path(piece["file"])
        a = piece["offset"] + k * block
        b = min(piece["offset"] + piece["nbytes"], a + block)
        raise CorruptCheckpointError(
            f"{files.where}: checksum mismatch in {path}, bytes [{a}, {b}) ({what}): the file is corrupted", path)


def read_manifest(path: str, where: str, *, verify: bool = True) -> dict:
    """The parsed manifest of the committed checkpoint at ``path``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: ``path`` is not a committed fzero checkpoint.
        CorruptCheckpointError: the manifest or the marker is damaged (named).
    """
    if not os.path.isdir(path):
        if os.path.exists(path):
            raise CheckpointError(f"{where}: {path} is not a checkpoint directory")
        raise FileNotFoundError(f"{where}: no checkpoint at {path}")
    marker_path = os.path.join(path, MARKER)
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.exists(marker_path):
        hint = "" if os.path.exists(manifest_path) else " (no manifest.json either)"
        raise CheckpointError(f"{where}: {path} is not a committed fzero checkpoint: it has no {MARKER} marker"
                              f"{hint}; a save that did not finish leaves no marker")
    marker = _load_json(marker_path, where)
    try:
        with open(manifest_path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: {manifest_path} is missing", manifest_path) from None
    if verify and isinstance(marker, dict) and zlib.crc32(data) != marker.get("manifest_crc32"):
        raise CorruptCheckpointError(f"{where}: checksum mismatch in {manifest_path} (the {MARKER} marker "
                                     f"records another): the manifest is corrupted", manifest_path)
    manifest = _parse_json(data, manifest_path, where)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{where}: {manifest_path} is not an fzero checkpoint manifest", manifest_path)
    if manifest.get("version") not in READS:
        raise CheckpointError(f"{where}: {path} has format version {manifest.get('version')!r}; this fzero "
                              f"reads versions {', '.join(map(str, READS))}")
    problem = _schema_problem(manifest)
    if problem is not None:
        raise CorruptCheckpointError(f"{where}: {manifest_path} is not a valid manifest ({problem}): the file is "
                                     f"corrupted", manifest_path)
    return manifest


_FILE_NAME = re.compile(r"rank[0-9]{5,}\.safetensors")
_VALUE_TYPES = {"int": int, "float": (float, int, str), "bool": bool, "str": str}


def _is_int(x: Any, lo: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo


def _schema_problem(m: dict) -> str | None:
    """What is wrong with a manifest's structure, or ``None``. A manifest passed its checksum
    unless ``verify=False``; this keeps a hand-edited or hostile one from steering reads
    outside the checkpoint's own files (names are checked) or failing with a KeyError."""
    if not (_is_int(m.get("block_bytes"), 1) and _is_int(m.get("world_size"), 1)):
        return "block_bytes and world_size must be positive ints"
    files = m.get("files")
    if not isinstance(files, dict):
        return "files must be an object"
    for name, f in files.items():
        if not _FILE_NAME.fullmatch(name):
            return f"file name {name!r} is not rankNNNNN.safetensors"
        if not (isinstance(f, dict) and all(_is_int(f.get(k)) for k in ("bytes", "head_bytes", "head_crc32", "rank"))
                and isinstance(f.get("crc32"), str)):
            return f"files[{name!r}] lacks bytes, head_bytes, head_crc32, rank or crc32"
        if f["head_bytes"] > f["bytes"]:
            return f"files[{name!r}] has a header of {f['head_bytes']} bytes in a file of {f['bytes']}"

    def piece_problem(p: Any, where: str) -> str | None:
        if not isinstance(p, dict) or not isinstance(p.get("file"), str) or p["file"] not in files:
            return f"{where}: a piece names no listed file"
        if not all(_is_int(p.get(k)) for k in ("offset", "nbytes")) or not isinstance(p.get("crc32"), list):
            return f"{where}: a piece lacks offset, nbytes or crc32"
        if not all(_is_int(c) for c in p["crc32"]):
            return f"{where}: a piece's crc32 must be a list of ints"
        if p["offset"] + p["nbytes"] > files[p["file"]]["bytes"]:
            return (f"{where}: a piece's bytes [{p['offset']}, {p['offset'] + p['nbytes']}) lie past the end of "
                    f"{p['file']} ({files[p['file']]['bytes']} bytes)")
        return None

    leaves = m.get("leaves")
    if not isinstance(leaves, list):
        return "leaves must be a list"
    for rec in leaves:
        if not isinstance(rec, dict) or not isinstance(rec.get("path"), str):
            return "a leaf has no path"
        where = rec["path"]
        entries = rec.get("entries")
        if entries is not None and not (isinstance(entries, list) and all(
                isinstance(e, list) and len(e) == 2 and e[0] in ("attr", "key", "index")
                and isinstance(e[1], (str, int)) and not isinstance(e[1], bool) for e in entries)):
            return f"{where}: entries must be a list of [\"attr\" | \"key\" | \"index\", name]"
        kind = rec.get("kind")
        if kind == "value":
            type_name = rec.get("type")
            if not (isinstance(type_name, str) and isinstance(rec.get("value"), _VALUE_TYPES.get(type_name, ()))):
                return f"{where}: bad value"
            if type_name == "float" and isinstance(rec["value"], str) and not _is_float_text(rec["value"]):
                return f"{where}: float value {rec['value']!r} is not a number"
        elif kind == "tensor":
            if not isinstance(rec.get("dtype"), str) or rec["dtype"] not in DTYPE_OF:
                return f"{where}: unknown dtype {rec.get('dtype')!r}"
            shape = rec.get("shape")
            if not (isinstance(shape, list) and all(_is_int(d) for d in shape)):
                return f"{where}: bad shape"
            pieces = rec.get("pieces")
            if not isinstance(pieces, list):
                return f"{where}: no pieces"
            sharding = rec.get("sharding")
            if sharding is not None and not (isinstance(sharding, dict)
                                             and all(_is_int(sharding.get(k)) for k in ("offset", "chunk"))
                                             and _is_int(sharding.get("world"), 1)):
                return f"{where}: bad sharding {sharding!r}"
            tp = rec.get("tp")
            if tp is not None and not (isinstance(tp, dict) and _is_int(tp.get("dim")) and _is_int(tp.get("size"), 1)
                                       and tp["dim"] < len(shape) and shape[tp["dim"]] % tp["size"] == 0
                                       and _fused_ok(tp.get("fused"), shape)):
                return f"{where}: bad tp split {tp!r} of shape {shape}"
            numel, item, held = math.prod(shape), DTYPE_OF[rec["dtype"]].itemsize, 0
            for p in pieces:
                if not (_is_int(p.get("start")) and _is_int(p.get("stop")) if isinstance(p, dict) else False):
                    return f"{where}: a piece lacks start or stop"
                if not p["start"] <= p["stop"] <= numel:
                    return f"{where}: a piece holds elements [{p['start']}, {p['stop']}) of a leaf of {numel}"
                bad = piece_problem(p, where)
                if bad:
                    return bad
                if p["nbytes"] != (p["stop"] - p["start"]) * item:
                    return (f"{where}: a piece of {p['stop'] - p['start']} {rec['dtype']} elements says it has "
                            f"{p['nbytes']} bytes")
                held += p["stop"] - p["start"]
            if held < numel:  # every element is in some piece: a shape the files cannot hold is refused here
                return f"{where}: its pieces hold {held} of the {numel} elements of shape {shape}"
        else:
            return f"{where}: unknown kind {rec.get('kind')!r}"
    rng = m.get("rng")
    if not isinstance(rng, list):
        return "rng must be a list"
    for e in rng:
        if not (isinstance(e, dict) and _is_int(e.get("rank")) and isinstance(e.get("tensors", {}), dict)):
            return "bad rng entry"
        bad = _rng_problem(e)
        if bad:
            return f"rng of rank {e['rank']}: {bad}"
        for name, p in e.get("tensors", {}).items():
            bad = piece_problem(p, f"rng {name}")
            if bad:
                return bad
    return None


def _is_float_text(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _fused_ok(fused: Any, shape: list) -> bool:
    """A tp record's ``fused`` view: none, or ``[d, p]`` with axes ``d`` and ``d + 1`` in ``shape``."""
    return not fused or (isinstance(fused, list) and len(fused) == 2 and all(_is_int(x) for x in fused)
                         and fused[0] + 1 < len(shape))


def _rng_problem(e: dict) -> str | None:
    """What is wrong with a saved rank's Python and numpy generator states (as
    :mod:`fzero.checkpoint._rng` writes them), or ``None``."""
    py = e.get("python")
    if py is not None:
        if not (isinstance(py, dict) and _is_int(py.get("version")) and isinstance(py.get("state"), list)
                and all(_is_int(x) for x in py["state"])
                and "gauss_next" in py and (py["gauss_next"] is None or isinstance(py["gauss_next"], (int, float)))):
            return "python state must be {version: int, state: [ints], gauss_next: number or null}"
    npy = e.get("numpy")
    if npy is not None:
        if not (isinstance(npy, dict) and isinstance(npy.get("kind"), str) and isinstance(npy.get("keys"), list)
                and all(_is_int(k) and k < 2**32 for k in npy["keys"])
                and all(_is_int(npy.get(k)) for k in ("pos", "has_gauss"))
                and isinstance(npy.get("cached_gaussian"), (int, float))
                and not isinstance(npy.get("cached_gaussian"), bool)):
            return "numpy state must be {kind: str, keys: [uint32], pos: int, has_gauss: int, cached_gaussian: number}"
    return None


def _load_json(path: str, where: str) -> Any:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: {path} is missing", path) from None
    return _parse_json(data, path, where)


def _parse_json(data: bytes, path: str, where: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nested too deeply
        raise CorruptCheckpointError(f"{where}: {path} is not valid JSON ({e}): the file is corrupted", path) from None


def read_marker(path: str) -> dict | None:
    """The ``COMMITTED`` marker of ``path`` if it is a committed checkpoint, else ``None``."""
    try:
        with open(os.path.join(path, MARKER), "rb") as f:
            marker = json.loads(f.read())
    except (OSError, ValueError, RecursionError):
        return None
    return marker if isinstance(marker, dict) else None
