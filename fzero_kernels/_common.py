"""Shared machinery of the kernel families: backend choice, launcher checks, lazy Triton.

Nothing here imports ``triton`` at module import: ``fzero`` must import and train on a
machine without it (SPEC.md, ``fzero_kernels`` row). Kernels are written as plain
functions decorated with :func:`jit`, which only records them; the first launch imports
triton and builds them (:func:`ensure_triton`).

Triton fixes compiled-or-interpreted when it is imported: its own library (``tl.sum``'s
combine functions, ``tl.cdiv``, ...) is decorated then, under the ``TRITON_INTERPRET`` of
that moment. So ``TRITON_INTERPRET=1`` must be set before triton is first imported; the
kernels here are built in the mode triton was imported in. CPU tensors take the Triton
path only while ``TRITON_INTERPRET=1`` is set *and* triton is (or will be) interpreted.
"""
from __future__ import annotations

import array
import collections
import contextlib
import functools
import importlib.util
import math
import os
import sys
import threading
import warnings
from typing import Any, Iterator, Literal, NamedTuple, Sequence

import torch

# Bound to ``triton.language`` by ensure_triton() before any kernel body runs.
tl: Any = None

HAS_TRITON: bool = importlib.util.find_spec("triton") is not None

BACKEND_ENV = "FZERO_KERNELS_BACKEND"
Backend = Literal["auto", "triton", "reference"]
_BACKENDS = ("auto", "triton", "reference")

#: How many times each public function ran on each backend: ``CALLS[(name, backend)]``.
CALLS: collections.Counter = collections.Counter()

FLOAT_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOWP_DTYPES = (torch.bfloat16, torch.float16)
# Codes of the LOWP / XDTYPE constexprs of the kernels.
DTYPE_CODE = {None: 0, torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


# --------------------------------------------------------------------------- backend
_forced: list[str] = []


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's CPU interpreter right now."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@functools.lru_cache(maxsize=1)
def _triton_import_error() -> str | None:
    if not HAS_TRITON:
        return "triton is not installed"
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # a broken install must not break fzero
        return f"importing triton failed ({type(e).__name__}: {e})"
    return None


_interpreted: list[bool] = []  # triton's mode, once read (it cannot change after its import)


def triton_interpreted() -> bool | None:
    """Whether the imported triton runs interpreted (None: triton is not imported yet).

    Read from triton's own library, which triton decorated at its import."""
    if _interpreted:
        return _interpreted[0]
    if "triton.language.standard" not in sys.modules:
        return None
    from triton.runtime.interpreter import InterpretedFunction

    _interpreted.append(isinstance(getattr(sys.modules["triton.language.standard"], "cdiv", None),
                                   InterpretedFunction))
    return _interpreted[0]


def _requested() -> str:
    if _forced:
        return _forced[-1]
    return os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"


def _why_not_triton(device: torch.device) -> str | None:
    """Why the Triton path cannot run for ``device`` right now, or None if it can.

    Imports triton only when it may be used (a CPU run without the interpreter never does).
    """
    if not HAS_TRITON:
        return "triton is not installed"
    if device.type == "cpu" and not interpreting():
        return "the tensors are on the CPU and TRITON_INTERPRET=1 is not set"
    err = _triton_import_error()  # a first import fixes triton's mode to the current env
    if err is not None:
        return err
    interpreted = triton_interpreted()
    if device.type == "cpu" and not interpreted:
        _warn_once("fzero_kernels: TRITON_INTERPRET=1 is set but triton was imported before it "
                   "(compiled mode), so CPU tensors use the torch reference; set it before the "
                   "first import of triton to run the kernels in the interpreter")
        return "TRITON_INTERPRET=1 was set after triton was imported in compiled mode"
    if device.type not in ("cpu", "cuda") and not interpreted:
        return f"Triton does not run on device type {device.type!r}"
    return None


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def choose(fn: str, device: torch.device) -> Literal["triton", "reference"]:
    """The backend ``fn`` runs on for tensors on ``device`` (and count the call)."""
    req = _requested()
    if req not in _BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {_BACKENDS} (env {BACKEND_ENV} or "
                         f"fzero_kernels.force_backend), got {req!r}")
    if req == "reference":
        chosen = "reference"
    else:
        why = _why_not_triton(device)
        if why is not None and req == "triton":
            raise RuntimeError(f"{fn}: the triton backend was forced but {why}")
        chosen = "triton" if why is None else "reference"
    CALLS[(fn, chosen)] += 1
    return chosen  # type: ignore[return-value]


def runs_reference(fn: str, reference: bool, device: torch.device) -> bool:
    """Whether a call of ``fn`` runs the torch reference: always for a ``*_reference``
    function (``reference``; counted here), else when :func:`choose` picks it."""
    if reference:
        CALLS[(fn, "reference")] += 1
        return True
    return choose(fn, device) == "reference"


def backend_for(tensor: torch.Tensor) -> Literal["triton", "reference"]:
    """Which backend a kernel called on ``tensor`` would run, without running it.

    ``"triton"`` for CUDA tensors, and for CPU tensors while ``TRITON_INTERPRET=1``, when
    triton imports; ``"reference"`` (pure torch) otherwise or when forced by
    ``FZERO_KERNELS_BACKEND=reference`` / :func:`force_backend`.

    >>> import torch, fzero_kernels
    >>> with fzero_kernels.force_backend("reference"):
    ...     fzero_kernels.backend_for(torch.zeros(3))
    'reference'
    """
    req = _requested()
    if req == "reference":
        return "reference"
    return "triton" if _why_not_triton(tensor.device) is None else "reference"


@contextlib.contextmanager
def force_backend(name: Backend) -> Iterator[None]:
    """Run the kernels of this block on ``name`` (``"auto"``, ``"triton"``, ``"reference"``).

    Takes precedence over the ``FZERO_KERNELS_BACKEND`` environment variable. Forcing
    ``"triton"`` where it cannot run raises when a kernel is called.
    """
    if name not in _BACKENDS:
        raise ValueError(f"fzero_kernels.force_backend: name must be one of {_BACKENDS}, got {name!r}")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


# --------------------------------------------------------------------------- checks
def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_flat(fn: str, name: str, t: Any, *, dtypes: Sequence[torch.dtype],
               like: torch.Tensor | None = None, like_name: str = "param") -> torch.Tensor:
    """Check ``t`` is a 1-D contiguous tensor of an allowed dtype, on ``like``'s device and
    of ``like``'s length. Errors start with ``fn`` and say what was got."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{fn}: {name} has dtype {str(t.dtype).replace('torch.', '')}, "
                        f"expected {_dtype_names(dtypes)}")
    if t.dim() != 1:
        raise ValueError(f"{fn}: {name} must be 1-D (a flat shard), got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous, got stride {t.stride()}")
    if like is not None:
        if t.device != like.device:
            raise ValueError(f"{fn}: {name} is on {t.device}, {like_name} is on {like.device}")
        if t.numel() != like.numel():
            raise ValueError(f"{fn}: {name} has {t.numel()} elements, {like_name} has {like.numel()}")
    return t


def check_contiguous(fn: str, name: str, t: Any, *, dtypes: Sequence[torch.dtype]) -> torch.Tensor:
    """Any-shape contiguous tensor of an allowed dtype, returned flattened (a view)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{fn}: {name} has dtype {str(t.dtype).replace('torch.', '')}, "
                        f"expected {_dtype_names(dtypes)}")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous, got shape {tuple(t.shape)} "
                         f"and stride {t.stride()}")
    return t.view(-1)


def check_update(fn: str, param: Any, grad: Any, **states: Any) -> None:
    """Check an optimizer update's tensors: ``param`` and each of ``states`` (keyword names
    are the caller's argument names) flat contiguous fp32, ``grad`` fp32, bf16 or fp16, all
    on ``param``'s device and of its length."""
    check_flat(fn, "param", param, dtypes=(torch.float32,))
    check_flat(fn, "grad", grad, dtypes=FLOAT_GRAD_DTYPES, like=param)
    for name, t in states.items():
        check_flat(fn, name, t, dtypes=(torch.float32,), like=param)


def check_lowp(fn: str, lowp: Any, param: torch.Tensor) -> torch.Tensor | None:
    if lowp is None:
        return None
    return check_flat(fn, "lowp_param", lowp, dtypes=LOWP_DTYPES, like=param)


def check_scale(fn: str, grad_scale: Any, device: torch.device) -> float | torch.Tensor:
    """``grad_scale`` as a positive float, or a 1-element tensor on ``device`` made fp32.

    A tensor lets a caller pass a scale computed on the device (loss scale divided by a
    clip coefficient) without a host sync.
    """
    if isinstance(grad_scale, torch.Tensor):
        if grad_scale.numel() != 1:
            raise ValueError(f"{fn}: grad_scale must be a float or a 1-element tensor, "
                             f"got shape {tuple(grad_scale.shape)}")
        if grad_scale.device != device:
            raise ValueError(f"{fn}: grad_scale is on {grad_scale.device}, param is on {device}")
        if grad_scale.dim() == 0 and grad_scale.dtype == torch.float32:
            return grad_scale  # (the common case: skip two no-op calls, ~10 us of host time)
        return grad_scale.reshape(()).to(torch.float32)
    if isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float)):
        raise TypeError(f"{fn}: grad_scale must be a float or a 1-element tensor, "
                        f"got {type(grad_scale).__name__}")
    g = float(grad_scale)
    if not (math.isfinite(g) and g > 0):
        raise ValueError(f"{fn}: grad_scale must be positive and finite, got {grad_scale!r}")
    return g


def check_found_inf(fn: str, found_inf: Any, device: torch.device) -> torch.Tensor | None:
    """``found_inf`` as a 0-dim fp32 tensor on ``device`` (nonzero: skip), or None."""
    if found_inf is None:
        return None
    if not isinstance(found_inf, torch.Tensor) or found_inf.numel() != 1:
        shape = tuple(found_inf.shape) if isinstance(found_inf, torch.Tensor) else type(found_inf).__name__
        raise TypeError(f"{fn}: found_inf must be None or a 1-element tensor, got {shape}")
    if found_inf.device != device:
        raise ValueError(f"{fn}: found_inf is on {found_inf.device}, param is on {device}")
    if found_inf.dim() == 0 and found_inf.dtype == torch.float32:
        return found_inf
    return found_inf.reshape(()).to(torch.float32)


def check_step(fn: str, step: Any) -> int:
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        step = step.item()  # a host-side count is expected; accept a CPU scalar tensor
    if isinstance(step, float) and step.is_integer():
        step = int(step)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"{fn}: step must be an int >= 1 (1-based, for bias correction), got {step!r}")
    return step


def check_hyper(fn: str, **values: float) -> None:
    """Check finite, non-negative hyperparameters; ``beta*`` / ``momentum`` in [0, 1)."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{fn}: {name} must be a finite number >= 0, got {v!r}")
        if name.startswith("beta") and not v < 1:
            raise ValueError(f"{fn}: {name} must be in [0, 1), got {v!r}")


def new_flag(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float32, device=device)


def nonfinite_flag(x: torch.Tensor) -> torch.Tensor:
    """0-dim fp32: 1.0 if any element of ``x`` is inf or nan (a device op, no host sync)."""
    return torch.logical_not(torch.isfinite(x)).any().to(torch.float32)


def skip_mode(found_inf: torch.Tensor | None) -> Literal["write", "skip", "blend"]:
    """How a reference honours ``found_inf``: ``"write"`` in place (no flag), ``"skip"``
    (a CPU flag that is set: there is no asynchrony to lose by reading it), or ``"blend"``
    (a device flag: compute on copies and ``torch.where`` them in, so no host sync)."""
    if found_inf is None:
        return "write"
    if found_inf.device.type == "cpu":
        return "skip" if bool(found_inf) else "write"
    return "blend"


def blend(found_inf: torch.Tensor, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst = found_inf ? dst : new`` for each pair, on the device."""
    keep = found_inf != 0
    for dst, new in pairs:
        dst.copy_(torch.where(keep, dst, new.to(dst.dtype)))


def reference_targets(mode: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors a reference updates: the originals, or copies when blending."""
    return tensors if mode == "write" else tuple(t.clone() for t in tensors)


def finish_reference(mode: str, found_inf: torch.Tensor | None, originals: Sequence[torch.Tensor],
                     results: Sequence[torch.Tensor], lowp: torch.Tensor | None) -> None:
    """Commit a reference's results (blend if needed) and write the low-precision copy."""
    if mode == "blend":
        pairs = list(zip(originals, results))
        if lowp is not None:
            pairs.append((lowp, results[0].to(lowp.dtype)))
        blend(found_inf, pairs)
    elif lowp is not None:
        lowp.copy_(results[0])  # copy_ rounds to nearest even, as .to(dtype)


# --------------------------------------------------------------------------- segments
def segment_offsets(fn: str, segments: Any, n: int) -> tuple[int, ...]:
    """Normalise a segment table (offsets, length S+1, from 0 to n, non-decreasing).

    A CUDA tensor is read back to the host (a sync); pass a tuple or a CPU tensor to avoid it.
    """
    if isinstance(segments, torch.Tensor):
        if segments.dim() != 1 or segments.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{fn}: segments must be a 1-D int64 tensor of offsets, got "
                            f"{segments.dtype} of shape {tuple(segments.shape)}")
        offs = tuple(int(v) for v in segments.tolist())
    else:
        try:
            offs = tuple(int(v) for v in segments)
        except TypeError:
            raise TypeError(f"{fn}: segments must be a sequence of int offsets, got "
                            f"{type(segments).__name__}") from None
    if len(offs) < 2 and n > 0:
        raise ValueError(f"{fn}: segments needs at least 2 offsets (start and end), got {list(offs)}")
    if offs and (offs[0] != 0 or offs[-1] != n):
        raise ValueError(f"{fn}: segments must start at 0 and end at {n} (the shard length), "
                         f"got {offs[0]} .. {offs[-1]}")
    for i in range(len(offs) - 1):
        if offs[i + 1] < offs[i]:
            raise ValueError(f"{fn}: segments must be non-decreasing, got offsets[{i}]={offs[i]} "
                             f"> offsets[{i + 1}]={offs[i + 1]}")
    return offs


def segment_ids(fn: str, tensor_ids: Any, num_tensors: int | None, n_segments: int) -> tuple[tuple[int, ...], int]:
    """The output slot of each segment, and the number of slots."""
    if tensor_ids is None:
        if num_tensors is not None and num_tensors != n_segments:
            raise ValueError(f"{fn}: num_tensors={num_tensors} without tensor_ids must equal the "
                             f"number of segments, {n_segments}")
        return tuple(range(n_segments)), n_segments
    ids = tuple(int(v) for v in (tensor_ids.tolist() if isinstance(tensor_ids, torch.Tensor) else tensor_ids))
    if len(ids) != n_segments:
        raise ValueError(f"{fn}: tensor_ids has {len(ids)} entries, segments has {n_segments} segments")
    if num_tensors is None:
        raise ValueError(f"{fn}: tensor_ids needs num_tensors (the same on every rank)")
    for i, v in enumerate(ids):
        if not 0 <= v < num_tensors:
            raise ValueError(f"{fn}: tensor_ids[{i}]={v} is outside [0, num_tensors={num_tensors})")
    return ids, int(num_tensors)


@functools.lru_cache(maxsize=128)
def _program_table(offsets: tuple[int, ...], ids: tuple[int, ...], chunk: int,
                   device: torch.device) -> tuple[torch.Tensor, int]:
    starts = torch.tensor(offsets[:-1], dtype=torch.int64)
    ends = torch.tensor(offsets[1:], dtype=torch.int64)
    nchunks = (ends - starts + chunk - 1) // chunk
    P = int(nchunks.sum())
    seg = torch.repeat_interleave(torch.arange(len(starts)), nchunks)
    first = torch.cumsum(nchunks, 0) - nchunks
    pstart = starts[seg] + (torch.arange(P) - first[seg]) * chunk
    pend = torch.minimum(pstart + chunk, ends[seg])
    table = torch.stack([torch.tensor(ids, dtype=torch.int64)[seg], pstart, pend], dim=1).contiguous()
    return to_device(table, device), P


def _device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device``: the object itself when it is one (a caller may tell
    two CPU devices apart by identity)."""
    return device if isinstance(device, torch.device) else torch.device(device)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small host tensor copied to ``device`` without a host sync: from page-locked memory,
    asynchronously, on a CUDA device (a pageable copy waits for the stream; the pinned
    block is not reused before the copy has run)."""
    device = _device(device)
    if device.type != "cuda":  # the same call, asynchronous in name (a CPU copy is done when it returns)
        return host.to(device, non_blocking=True)
    return host.pin_memory().to(device, non_blocking=True)


def program_table(offsets: tuple[int, ...], ids: tuple[int, ...], chunk: int,
                  device: torch.device) -> tuple[torch.Tensor, int, bool]:
    """Rows ``(slot, start, end)``: one program each, never straddling a segment, at most
    ``chunk`` elements; their number; and whether every offset is a multiple of 16
    (then the kernel may use 16-byte vector loads). Cached, so a fixed segment table costs
    one host-to-device copy."""
    table, programs = _program_table(offsets, ids, chunk, _device(device))
    return table, programs, all(o % 16 == 0 for o in offsets)


# --------------------------------------------------------------------------- multi-tensor tables
#: Elements a multi-tensor program covers at most (torch's multi_tensor_apply's chunk): a
#: big tensor is split among many programs, a small one takes one program of its own.
MULTI_CHUNK = 1 << 16


@functools.lru_cache(maxsize=16)
def _tensor_table(addresses: tuple[int, ...], sizes: tuple[int, ...], chunk: int,
                  device: torch.device) -> tuple[torch.Tensor, int]:
    k = len(sizes)
    columns = torch.frombuffer(array.array("q", addresses), dtype=torch.int64).view(-1, k).t()  # a row per tensor
    n = torch.tensor(sizes, dtype=torch.int64)
    last = torch.cumsum((n + chunk - 1) // chunk, 0)  # one past each tensor's last program
    P = int(last[-1])
    # The tensor of each program (searchsorted: repeat_interleave took 6 ms on 290 tensors here).
    seg = torch.searchsorted(last, torch.arange(P), right=True)
    start = (torch.arange(P) - (last - (n + chunk - 1) // chunk)[seg]) * chunk
    end = torch.minimum(start + chunk, n[seg])
    table = torch.cat([columns[seg], start[:, None], end[:, None]], dim=1).contiguous()
    return to_device(table, device), P


def tensor_table(columns: Sequence[Sequence[torch.Tensor | None]], chunk: int,
                 device: torch.device) -> tuple[torch.Tensor, int, bool]:
    """The program table of a multi-tensor launch: int64 rows ``(address of the i-th tensor
    of each column (0 for None), start, end)``, one per program, each covering at most
    ``chunk`` elements ``[start, end)`` of one tensor (its length is ``columns[0]``'s;
    empty tensors get no program); the number of rows; and whether every address is
    16-byte aligned and every length a multiple of 16 (then the kernel may load 16 bytes
    at a time: starts are multiples of ``chunk``).

    Built on the host from the tensors' addresses and copied without a host sync
    (:func:`to_device`); cached by address, so a step whose tensors sit where they sat
    before (the caching allocator's usual case) copies nothing."""
    sizes = tuple(t.numel() for t in columns[0])
    addresses = tuple(0 if t is None else t.data_ptr() for col in columns for t in col)
    table, programs = _tensor_table(addresses, sizes, chunk, _device(device))
    aligned = all(a % 16 == 0 for a in addresses) and all(n % 16 == 0 for n in sizes)
    return table, programs, aligned


# --------------------------------------------------------------------------- launch config
def elementwise_config(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of the elementwise update kernels.

    8 fp32 per thread keeps two 16-byte loads in flight per thread and stream; big shards
    take bigger blocks so the grid stays small (the Triton tutorials' vector-add heuristic).
    """
    if n >= 1 << 22:
        return 2048, 8
    return 1024, 4


#: A reduction program covers up to this many blocks, so a program adds to its segment's
#: accumulator once per ``BLOCK * REDUCTION_BLOCKS`` elements (few atomics, full grid).
REDUCTION_BLOCKS = 16


def reduction_config(n: int) -> tuple[int, int, int]:
    """(BLOCK, num_warps, chunk) of the reduction kernels."""
    block, warps = elementwise_config(n)
    return block, warps, block * REDUCTION_BLOCKS


# --------------------------------------------------------------------------- lazy triton
_REGISTRY: list["_LazyKernel"] = []
_LOCK = threading.Lock()
_built = [0]  # how many of _REGISTRY ensure_triton() has built


class _LazyKernel:
    """Placeholder for a Triton function until :func:`ensure_triton` builds it."""

    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn)
        _REGISTRY.append(self)

    def __getitem__(self, grid):
        ensure_triton()
        return self.fn.__globals__[self.fn.__name__][grid]

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.fn.__name__} is a Triton function: launch it as "
                           f"{self.fn.__name__}[grid](...) from a launcher")


def jit(fn):
    """Record ``fn`` as a Triton kernel or device function, built on first launch."""
    return _LazyKernel(fn)


def ensure_triton() -> None:
    """Import triton and replace every registered placeholder by its built function,
    interpreted or compiled as triton itself was imported."""
    if _built[0] == len(_REGISTRY):
        return  # (the launch path: every registered function is built)
    err = _triton_import_error()
    if err is not None:
        raise RuntimeError(f"fzero_kernels: cannot launch a Triton kernel: {err}")
    with _LOCK:
        pending = [k for k in _REGISTRY if isinstance(k.fn.__globals__.get(k.fn.__name__), _LazyKernel)]
        if not pending:
            _built[0] = len(_REGISTRY)
            return
        import triton.language as language
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        build = InterpretedFunction if triton_interpreted() else JITFunction
        for k in pending:
            k.fn.__globals__["tl"] = language
        for k in pending:
            k.fn.__globals__[k.fn.__name__] = build(k.fn)
        _built[0] = len(_REGISTRY)


def launch(kernel, programs: int, *args, num_warps: int, **constexprs) -> None:
    """Launch ``kernel`` on a 1-D grid. FP contraction is off so the compiled kernel
    rounds like the interpreter and the torch reference (memory-bound: costs nothing)."""
    if programs <= 0:
        return
    ensure_triton()
    if isinstance(kernel, _LazyKernel):  # the launcher read the placeholder before the build
        kernel = kernel.fn.__globals__[kernel.fn.__name__]
    kernel[(programs,)](*args, **constexprs, num_warps=num_warps, enable_fp_fusion=False)


# --------------------------------------------------------------------------- device functions
@jit
def program_row(table_ptr, ALIGNED: tl.constexpr):
    """(slot, start, end) of this program's row of a :func:`program_table`."""
    row = table_ptr + 3 * tl.program_id(0).to(tl.int64)
    slot = tl.load(row)
    start = tl.load(row + 1)
    end = tl.load(row + 2)
    if ALIGNED:  # every segment offset is a multiple of 16: lets loads vectorize
        start = tl.multiple_of(start, 16)
        end = tl.multiple_of(end, 16)
    return slot, start, end


@jit
def table_pointer(row, column, ELEMENT: tl.constexpr, ALIGNED: tl.constexpr):
    """The pointer in ``column`` of a :func:`tensor_table` row, to ``ELEMENT``s."""
    ptr = tl.load(row + column).to(tl.pointer_type(ELEMENT))
    if ALIGNED:  # every address is 16-byte aligned: lets loads and stores vectorize
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@jit
def grad_coef(flag_ptr, sumsq_ptr, max_norm, CLIP: tl.constexpr):
    """The clip coefficient of torch's ``clip_grad_norm_``, ``min(1, max_norm / (norm + 1e-6))``
    with ``norm = sqrt(grad_sumsq)`` in fp32 (1.0 without CLIP). A non-finite sum of squares
    sets the flag (and :func:`write_mask` skips the step)."""
    if CLIP:
        sumsq = tl.load(sumsq_ptr)
        tl.store(flag_ptr, 1.0, mask=~(tl.abs(sumsq) <= 1.7976931348623157e308))
        norm = tl.sqrt(sumsq).to(tl.float32)
        coef = tl.minimum(tl.div_rn(max_norm, norm + 1e-6), 1.0)
    else:
        coef = 1.0
    return coef


@jit
def unscaled(grad_ptr, offs, mask, scale_ptr, grad_scale, coef,
             SCALE_FROM_PTR: tl.constexpr, CLIP: tl.constexpr):
    """Load grad in fp32, divide by grad_scale (IEEE division, as torch), then times the
    clip coefficient (as torch's unscale, then clip)."""
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SCALE_FROM_PTR:
        s = tl.load(scale_ptr)
    else:
        s = grad_scale
    g = tl.div_rn(g, s)
    if CLIP:
        g = g * coef
    return g


@jit
def nonfinite_lanes(x):
    """int32 per lane: 1 where ``x`` is inf or nan (|x| <= FLT_MAX is False exactly there)."""
    return (~(tl.abs(x) <= 3.4028234663852886e38)).to(tl.int32)


@jit
def store_flag(flag_ptr, lanes):
    """Set the 0-dim flag to 1.0 if any lane is set. Every program writes the same value,
    so a plain store is race-free, and a program stores at most once (no atomics traffic)."""
    bad = tl.max(lanes, axis=0)
    tl.store(flag_ptr, 1.0, mask=bad > 0)


@jit
def write_mask(mask, found_inf_ptr, sumsq_ptr, HAS_FOUND_INF: tl.constexpr, CLIP: tl.constexpr):
    """``mask`` cleared everywhere when the caller's found_inf is nonzero, or when the
    clip's sum of squares is not finite: a skipped step reads and writes no state."""
    # tl.where, not `mask & scalar`: the interpreter cannot broadcast a scalar bool in `&`.
    if HAS_FOUND_INF:
        mask = tl.where(tl.load(found_inf_ptr) == 0.0, mask, False)
    if CLIP:
        mask = tl.where(tl.abs(tl.load(sumsq_ptr)) <= 1.7976931348623157e308, mask, False)
    return mask


@jit
def update_block(param_ptr, grad_ptr, flag_ptr, scale_ptr, grad_scale, sumsq_ptr, max_norm, found_inf_ptr, n,
                 SCALE_FROM_PTR: tl.constexpr, CLIP: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
                 BLOCK: tl.constexpr):
    """The opening of every elementwise update kernel, for this program's block: the offsets,
    the write mask (cleared when the step is skipped: a skipped step reads and writes no
    state), the unscaled, clipped fp32 gradient (whose non-finite lanes set the flag), and
    param loaded under the write mask."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    coef = grad_coef(flag_ptr, sumsq_ptr, max_norm, CLIP)
    g = unscaled(grad_ptr, offs, mask, scale_ptr, grad_scale, coef, SCALE_FROM_PTR, CLIP)
    store_flag(flag_ptr, nonfinite_lanes(g))
    wmask = write_mask(mask, found_inf_ptr, sumsq_ptr, HAS_FOUND_INF, CLIP)
    p = tl.load(param_ptr + offs, mask=wmask, other=0.0)
    return offs, wmask, g, p


@jit
def bf16_bits(x):
    """fp32 -> bf16 round-to-nearest-even as int16 bits, by integer ops on the fp32 pattern.

    ``x.to(tl.bfloat16)`` truncates under the interpreter (triton 3.9: fp32 1 + 2^-8 + 2^-9
    becomes 0x3F80 where torch's cast gives 0x3F81), so the kernel rounds itself to equal
    torch's cast bit for bit; nan becomes the quiet nan 0x7FC0.
    """
    b = x.to(tl.uint32, bitcast=True)
    r = (b + (0x7FFF + ((b >> 16) & 1))) >> 16
    r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
    return r.to(tl.int16)


@jit
def store_lowp(lowp_ptr, offs, x, mask, LOWP: tl.constexpr):
    """Write ``x`` (fp32) to the low-precision copy: LOWP 1 = bf16 (an int16 view), 2 = fp16."""
    if LOWP == 1:
        tl.store(lowp_ptr + offs, bf16_bits(x), mask=mask)
    elif LOWP == 2:
        tl.store(lowp_ptr + offs, x.to(tl.float16), mask=mask)


def lowp_arg(lowp: torch.Tensor | None, dummy: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The pointer argument and LOWP code for an optional low-precision copy."""
    if lowp is None:
        return dummy, 0
    if lowp.dtype == torch.bfloat16:
        return lowp.view(torch.int16), 1
    return lowp, 2


def scale_args(scale: float | torch.Tensor, dummy: torch.Tensor) -> tuple[torch.Tensor, float, bool]:
    """(scale_ptr, grad_scale, SCALE_FROM_PTR) for a float or device-tensor scale."""
    if isinstance(scale, torch.Tensor):
        return scale, 1.0, True
    return dummy, scale, False


def grad_args(g: "GradArgs", dummy: torch.Tensor) -> tuple[tuple, dict]:
    """Kernel arguments ``(scale_ptr, grad_scale, sumsq_ptr, max_norm, found_inf_ptr)`` and
    constexprs ``SCALE_FROM_PTR, CLIP, HAS_FOUND_INF`` of the gradient's treatment."""
    scale_ptr, scale_val, from_ptr = scale_args(g.scale, dummy)
    clip = g.sumsq is not None
    args = (scale_ptr, scale_val, g.sumsq if clip else dummy, g.max_norm if clip else 1.0,
            g.found if g.found is not None else dummy)
    return args, dict(SCALE_FROM_PTR=from_ptr, CLIP=clip, HAS_FOUND_INF=g.found is not None)


# --------------------------------------------------------------------------- gradient treatment
class GradArgs(NamedTuple):
    """Checked ``grad_scale``, clip (``grad_sumsq``, ``max_norm``) and ``found_inf``."""
    scale: float | torch.Tensor
    sumsq: torch.Tensor | None
    max_norm: float
    found: torch.Tensor | None


def check_grad_args(fn: str, device: torch.device, grad_scale: Any, grad_sumsq: Any, max_norm: Any,
                    found_inf: Any = None) -> GradArgs:
    scale = check_scale(fn, grad_scale, device)
    if (grad_sumsq is None) != (max_norm is None):
        raise ValueError(f"{fn}: grad_sumsq and max_norm go together (clip by global norm), got "
                         f"grad_sumsq={'a tensor' if grad_sumsq is not None else None} and max_norm={max_norm!r}")
    sumsq = None
    if grad_sumsq is not None:
        if not isinstance(grad_sumsq, torch.Tensor) or grad_sumsq.numel() != 1:
            got = tuple(grad_sumsq.shape) if isinstance(grad_sumsq, torch.Tensor) else type(grad_sumsq).__name__
            raise TypeError(f"{fn}: grad_sumsq must be a 1-element tensor (from sum_of_squares), got {got}")
        if grad_sumsq.device != device:
            raise ValueError(f"{fn}: grad_sumsq is on {grad_sumsq.device}, param is on {device}")
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not (
                math.isfinite(max_norm) and max_norm > 0):
            raise ValueError(f"{fn}: max_norm must be a positive finite number, got {max_norm!r}")
        sumsq = grad_sumsq if grad_sumsq.dim() == 0 and grad_sumsq.dtype == torch.float64 \
            else grad_sumsq.reshape(()).to(torch.float64)
    return GradArgs(scale, sumsq, float(max_norm) if max_norm is not None else 1.0,
                    check_found_inf(fn, found_inf, device))


def reference_grad(grad: torch.Tensor, g: GradArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Pure torch: (grad / grad_scale [* clip coefficient] in fp32, the non-finite flag, and
    the effective found_inf: the caller's, or'ed with a non-finite clip sum of squares)."""
    x = torch.div(grad.to(torch.float32), g.scale)
    found = g.found
    if g.sumsq is None:
        return x, nonfinite_flag(x), found
    bad = torch.logical_not(torch.isfinite(g.sumsq))
    norm = g.sumsq.sqrt().to(torch.float32)
    x.mul_(torch.clamp(g.max_norm / (norm + 1e-6), max=1.0))  # clip_grad_norm_'s coefficient
    flag = torch.maximum(nonfinite_flag(x), bad.to(torch.float32))
    found = bad.to(torch.float32) if found is None else torch.maximum(found, bad.to(torch.float32))
    return x, flag, found


# --------------------------------------------------------------------------- launchers
def launch_update(kernel, tensors: Sequence[torch.Tensor], lowp: torch.Tensor | None, ga: GradArgs,
                  scalars: Sequence[float], *, flag: torch.Tensor | None = None, **constexprs: Any) -> torch.Tensor:
    """Launch an elementwise update kernel over ``tensors[0]`` (param); return its flag
    (``flag``, a zeroed one shared with other launches, or a new one).

    Every such kernel opens with :func:`update_block` and takes ``(*tensors, lowp_ptr,
    flag_ptr, <grad_args>, n, *scalars)``, the constexprs of :func:`grad_args`, ``LOWP``,
    ``BLOCK`` and its own ``constexprs``; block and warps come from :func:`elementwise_config`.
    """
    param = tensors[0]
    flag = new_flag(param.device) if flag is None else flag
    n = param.numel()
    block, warps = elementwise_config(n)
    lowp_ptr, lowp_code = lowp_arg(lowp, param)
    gargs, gconst = grad_args(ga, param)
    launch(kernel, -(-n // block), *tensors, lowp_ptr, flag, *gargs, n, *scalars,
           num_warps=warps, LOWP=lowp_code, BLOCK=block, **constexprs, **gconst)
    return flag
