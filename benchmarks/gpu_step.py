"""One GPU, one training step: plain PyTorch, the same under ``torch.compile``, and
``fzero.compile`` eager and with ``jit=True``, side by side in one run.

The contestants do the same math on the same batches from the same initial weights: a GPT
(``examples/gpt.py``) in GPT-2 124M or 350M shapes, bf16 autocast with fp32 weights,
AdamW (lr 3e-4, betas (0.9, 0.95), weight decay 0.1 on every parameter), gradients clipped
to global norm 1.0.

* ``plain``: the module, ``torch.autocast(bfloat16)``, ``loss.backward()``,
  ``clip_grad_norm_``, ``torch.optim.AdamW(fused=True)`` (``foreach`` on a CPU);
* ``compiled``: the same with ``torch.compile(module)``;
* ``fzero``: the pure ``train_step`` under ``fzero.compile(precision="bf16",
  clip_norm=1.0)``, one process;
* ``fzero-jit``: the same with ``jit=True`` (the model's forward and backward under
  ``torch.compile`` inside the step). Where this fzero has no such option (``compile``
  raises ``TypeError`` naming it), the contestant is reported ``unavailable`` with the
  message, and the others run;
* ``fzero-offload``: ``fzero`` with ``zero=1, offload_optimizer="cpu"``, the model built on the
  host and the step on the device (``Mesh(device=)``), as DeepSpeed users run ZeRO-Offload
  (not in the default set).

Each contestant is built alone and run for ``--build-steps`` steps (its compilation, if any,
happens there): its peak memory is ``torch.cuda.max_memory_allocated`` over those steps less
what was allocated before it was built (the contestants built before it stay resident but
idle, so this is its own footprint). Then the paired rounds: one step of each per round, the
order rotating, so drift in the machine hits all alike. Per contestant: the median step time,
its ratio to plain (the median over rounds of the two times in the same round), tokens/s and
MFU (the step's FLOPs, counted once with ``torch.utils.flop_counter`` on the plain step, over
the median time, over the device's dense bf16 peak from ``fzero.monitor.peak_flops``; none
on a CPU).

With ``--largest`` it searches the deepest GPT of the preset's width that trains two steps
with ``fzero`` and with ``fzero-offload`` (ZeRO-Offload: the optimizer's state and update on
the host). To keep the search inside minutes, the GPU's memory is capped at
``--largest-memory-gib`` (``torch.cuda.set_per_process_memory_fraction``): the ratio of the
two sizes is what is measured, and it hardly depends on the cap. The offload search starts at
3x the parameters of the deepest non-offloaded model (the target), doubles while it trains
(never past what half the host's memory holds) and bisects to 3% otherwise. Both searches
checkpoint every block's activations (``GPTConfig(remat=True)``, as ZeRO-Offload's large
models are trained; ``--no-largest-remat`` keeps them): what decides the depth is then the
states each keeps on the device, not activations, which offload does not move.

``--time-limit`` bounds the whole run: a contestant still building when its share runs out is
stopped and reported ``timeout``; the rounds and the search stop at the limit with what they
have. ``--json PATH`` writes the results, rewritten after every stage (so a run killed from
outside still leaves what it had measured).

Run on a GPU::

    python benchmarks/gpu_step.py --preset 124m --steps 30
    python benchmarks/gpu_step.py --preset 350m --contestants none --largest

On a CPU it runs too (``--device cpu --preset tiny --compile-backend eager``), to check the
script, not to measure. ``--preset host`` is the 350M preset's 24 blocks at width 32 on 8
tokens: the kernels do next to nothing, so the step time is the host's (Python and the
operators' dispatch), as at the start of a GPU step before the device is busy
(``--device cpu --preset host --contestants plain,fzero`` measures fzero's host work against
plain PyTorch's on any machine). ``benchmarks/gpu_check.py`` (``make gpu-check``) runs it on
a lent GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import fzero  # noqa: E402
from fzero import optim  # noqa: E402
from gpt import GPT, GPTConfig, init_weights  # noqa: E402

# n_layer, n_head, n_embd, block_size, vocab_size, batch. 16 sequences of 1024 tokens a step
# at both GPT-2 sizes: at 8 and 4 (the first H200 run) plain PyTorch itself reached 25% and 17%
# MFU and torch.compile 30% and 22%; by an estimate (not measured) the optimizer's passes over
# the states and the elementwise kernels took about as long as the matmuls there, so MFU
# measured the batch more than the framework.
PRESETS = {
    "124m": (12, 12, 768, 1024, 50304, 16),
    "350m": (24, 16, 1024, 1024, 50304, 16),
    "tiny": (2, 2, 64, 64, 256, 4),
    "host": (24, 2, 32, 8, 64, 1),  # the 350M depth, no compute: the host's work
}
# Built in this order, each with what is left of --time-limit: the cheap ones first, then
# fzero-jit, whose step time and MFU are targets, before the compiled reference (at 350M on
# the H200 the reference's compile took 36 s of the phase's 87).
CONTESTANTS = ("plain", "fzero", "fzero-jit", "compiled")
LR, BETAS, WEIGHT_DECAY, CLIP = 3e-4, (0.9, 0.95), 0.1, 1.0
MIB = 2**20


class Unavailable(Exception):
    """The contestant cannot be built by this fzero (an option it does not have yet)."""


class OutOfTime(BaseException):
    """Raised by the timer inside whatever runs when a time share ends. A BaseException, so
    that no ``except Exception`` on the way (torch.compile has several) swallows it."""


@contextlib.contextmanager
def time_box(seconds: float):
    """Raise :class:`OutOfTime` in the main thread after ``seconds`` (SIGALRM)."""
    if seconds <= 0:
        raise OutOfTime()
    if seconds == float("inf"):
        yield
        return

    def ring(signum, frame):
        raise OutOfTime()

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def make_model(cfg: GPTConfig, device: torch.device, seed: int = 0) -> GPT:
    """The GPT, its weights drawn on ``device`` itself (drawing a billion on the host first
    would take longer than the step it is for)."""
    torch.manual_seed(seed)
    with torch.device(device):
        return GPT(cfg)


def host_model(cfg: GPTConfig, device: torch.device, seed: int = 0) -> GPT:
    """The GPT in host memory, as a ZeRO-Offload user hands it over, its weights drawn on
    ``device`` a part at a time (the device's generator is quicker than the host's for a
    billion weights, and the whole fp32 model need not fit in the device's memory cap):
    each part (an embedding, a block, the final norm) made on ``meta``, materialised on the
    device, initialised as :class:`GPT` does, and moved to the host."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        module = GPT(cfg)

    def on_host(part: torch.nn.Module) -> torch.nn.Module:
        part = part.to_empty(device=device)
        init_weights(part, cfg.n_layer)
        return part.to("cpu")

    module.wte, module.wpe, module.ln_f = on_host(module.wte), on_host(module.wpe), on_host(module.ln_f)
    for i, block in enumerate(module.blocks):
        module.blocks[i] = on_host(block)
    module.lm_head.weight = module.wte.weight  # tied, as GPT ties them
    return module


def plain_step(module: torch.nn.Module, device: torch.device, compiled: bool = False, backend: str | None = None):
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(module.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY,
                            fused=fused, foreach=None if fused else True)
    model = (torch.compile(module, backend=backend) if backend else torch.compile(module)) if compiled else module

    def step(batch):
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            logits = model(batch["x"])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch["y"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def fzero_step(module: torch.nn.Module, device: torch.device | None = None, **options):
    """``fzero.compile(precision="bf16", clip_norm=1.0, **options)`` over ``module``, on
    ``device`` (``Mesh(device=)``) where given, else where the module is."""
    apply, params = fzero.functionalize(module)
    tx = optim.adamw(LR, BETAS[0], BETAS[1], 1e-8, WEIGHT_DECAY)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=tx)

    def train_step(state, batch):
        def loss_fn(p):
            logits = state.apply_fn(p, batch["x"])
            return F.cross_entropy(logits.float().flatten(0, 1), batch["y"].flatten())

        loss, grads = fzero.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads), {"loss": loss}

    try:
        step = fzero.compile(train_step, fzero.Mesh(dp=1, device=device), precision="bf16", clip_norm=CLIP, **options)
    except TypeError as e:
        missing = [k for k in options if k in str(e)]
        if missing:  # this fzero has no such option
            raise Unavailable(f"fzero.compile({', '.join(f'{k}=...' for k in missing)}): {e}") from None
        raise
    holder = {"state": step.init(state)}

    def run(batch):
        holder["state"], metrics = step(holder["state"], batch)
        return metrics["loss"].detach()

    return run


def batches(cfg: GPTConfig, batch: int, n: int, device: torch.device) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
        out.append({"x": x[:, :-1].to(device), "y": x[:, 1:].to(device)})
    return out


def count_flops(cfg: GPTConfig, device: torch.device, batch: dict) -> int:
    """FLOPs of one plain step (forward, backward; the optimizer's elementwise work is not
    counted, as MFU conventionally leaves it out)."""
    from torch.utils.flop_counter import FlopCounterMode

    from fzero.monitor._flops import CPU_ATTENTION  # the CPU's fused attention, counted as CUDA's

    module = make_model(cfg, device)
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            logits = module(batch["x"])
        F.cross_entropy(logits.float().flatten(0, 1), batch["y"].flatten()).backward()
    del module
    free(device)
    return counter.get_total_flops()


def build(name: str, cfg: GPTConfig, device: torch.device, backend: str | None = None):
    if name == "fzero-offload":
        # ZeRO-Offload as DeepSpeed runs it: the model handed over on the host, the step on
        # the device (Mesh(device=)); init moves there only what the device computes with,
        # the masters and moments staying on the host.
        module = host_model(cfg, device)
        free(device)
        return fzero_step(module, device=device, zero=1, offload_optimizer="cpu", pin_memory=device.type == "cuda")
    module = make_model(cfg, device)
    if name == "plain":
        return plain_step(module, device)
    if name == "compiled":
        return plain_step(module, device, compiled=True, backend=backend)
    if name == "fzero":
        return fzero_step(module)
    if name == "fzero-jit":
        return fzero_step(module, jit=True)
    raise ValueError(f"unknown contestant {name!r}")


def _error(e: BaseException) -> str:
    """The exception and the last lines of its traceback, short enough for a JSON field."""
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    return (f"{type(e).__name__}: {e}".strip()[:600] + " | " + "".join(tb[-3:]).strip()[-600:]).strip(" |")


def params_of(cfg: GPTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def with_depth(cfg: GPTConfig, n_layer: int) -> GPTConfig:
    return GPTConfig(**{**vars(cfg), "n_layer": n_layer})


# --------------------------------------------------------------------------- the step contest


class Bench:
    """The contest of one preset; ``self.result`` is what ``--json`` writes."""

    def __init__(self, args, cfg: GPTConfig, device: torch.device, batch: int, deadline: float, emit):
        self.args, self.cfg, self.device, self.batch, self.deadline, self.emit = args, cfg, device, batch, deadline, emit
        self.tokens = batch * cfg.block_size

    def run(self, names: list[str], result: dict) -> None:
        args, cfg, device = self.args, self.cfg, self.device
        data = batches(cfg, self.batch, 4, device)
        from fzero.monitor import peak_flops

        peak = peak_flops(device, "bf16")
        flops = count_flops(cfg, device, data[0])
        result.update(flops_per_step=flops, peak_flops=peak, tokens_per_step=self.tokens,
                      contestants={n: {"status": "pending"} for n in names})
        self.emit()
        runs = {}
        # Each build may take what is left less a reserve for the rounds.
        reserve = max(2.0, 0.1 * args.time_limit) if args.time_limit else 0.0
        for n in names:
            entry = result["contestants"][n]
            left = self.deadline - time.monotonic() - reserve
            if left <= 0:
                entry.update(status="timeout", error="not built: the time limit was reached before its turn")
                self.emit()
                continue
            free(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            t0 = time.perf_counter()
            run, losses = None, []
            try:
                with time_box(left):
                    run = build(n, cfg, device, args.compile_backend)
                    for i in range(args.build_steps):
                        losses.append(float(run(data[i % len(data)])))
                    sync(device)
            except Unavailable as e:
                entry.update(status="unavailable", error=str(e)[:1200])
            except OutOfTime:
                entry.update(status="timeout", error=f"still building after {time.perf_counter() - t0:.0f} s, "
                                                     "when its share of the time limit ran out")
            except torch.cuda.OutOfMemoryError as e:
                entry.update(status="oom", error=_error(e))
            except Exception as e:  # noqa: BLE001 - one contestant's failure is recorded, the rest run
                entry.update(status="failed", error=_error(e))
            else:
                entry.update(status="ok", build_s=round(time.perf_counter() - t0, 2), first_loss=losses[0])
                if device.type == "cuda":
                    peak_bytes = torch.cuda.max_memory_allocated(device) - base
                    entry.update(peak_mem_bytes=int(peak_bytes), peak_mem_mib=round(peak_bytes / MIB, 1))
                else:
                    entry.update(peak_mem_bytes=None, peak_mem_mib=None)
                runs[n] = run
            if n not in runs:
                del run
                free(device)
            self.emit()
        self.rounds(runs, data, result, flops, peak)

    def rounds(self, runs: dict, data: list, result: dict, flops: int, peak: float | None) -> None:
        args, device = self.args, self.device
        names = list(runs)
        times = {n: [] for n in names}
        ratios = {n: [] for n in names}
        cut = False
        total = args.warmup + args.steps
        i = 0
        while i < total and names:
            if time.monotonic() > self.deadline:
                cut = True
                break
            order = names[i % len(names):] + names[:i % len(names)]
            this = {}
            for n in list(order):
                sync(device)
                t0 = time.perf_counter()
                try:
                    loss = runs[n](data[i % len(data)])
                    sync(device)
                    float(loss)
                except Exception as e:  # noqa: BLE001
                    result["contestants"][n].update(status="failed", error="in the timed rounds: " + _error(e))
                    names.remove(n)
                    del runs[n]
                    continue
                this[n] = time.perf_counter() - t0
            if i >= args.warmup:
                for n, t in this.items():
                    times[n].append(t)
                    if "plain" in this:
                        ratios[n].append(t / this["plain"])
            i += 1
        del runs
        free(device)
        result["rounds"] = max(0, i - args.warmup)
        result["rounds_cut_by_time_limit"] = cut
        ref = statistics.median(times["plain"]) if times.get("plain") else None
        for n in times:
            entry = result["contestants"][n]
            if not times[n]:
                entry.update(status="failed" if entry["status"] == "ok" else entry["status"],
                             error=entry.get("error") or "no timed round finished inside the time limit")
                continue
            t = statistics.median(times[n])
            entry.update(
                step_ms=round(t * 1e3, 3),
                step_ms_min=round(min(times[n]) * 1e3, 3),
                timed_steps=len(times[n]),
                vs_plain=round(statistics.median(ratios[n]), 4) if ratios[n] else None,
                vs_plain_of_medians=round(t / ref, 4) if ref else None,
                tokens_per_s=round(self.tokens / t, 1),
                mfu=round(flops / t / peak, 4) if peak else None,
            )
            plain_mem = result["contestants"].get("plain", {}).get("peak_mem_bytes")
            mem = entry.get("peak_mem_bytes")
            entry["mem_vs_plain"] = round(mem / plain_mem, 4) if mem is not None and plain_mem else None
        self.emit()


# --------------------------------------------------------------------------- the largest model


def trains(name: str, cfg: GPTConfig, device: torch.device, batch: int) -> bool:
    """Whether ``name`` trains two steps of ``cfg`` on ``device`` without running out of memory."""
    run = None
    try:
        data = batches(cfg, batch, 1, device)
        run = build(name, cfg, device)
        for _ in range(2):
            run(data[0])
        sync(device)
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    except RuntimeError as e:  # the host's pinned memory, or an allocation inside a kernel library
        if "out of memory" in str(e).lower():
            return False
        raise
    finally:
        del run
        free(device)


def deepest(fits, start: int, cap: int, deadline: float, rel: float = 1 / 32) -> dict:
    """The most blocks ``n`` in ``[1, cap]`` with ``fits(n)`` (monotone: fits up to some depth,
    not beyond): from ``start``, doubling while it fits, then bisecting until the bounds are
    within ``rel`` of each other; stops at ``deadline`` with the bounds it has.

    Returns ``{"depth": deepest seen to fit (0: none), "fails_at": shallowest seen to fail
    (None: none failed), "exact": bounds met, "tries": [[n, fits], ...]}``.

    Example:
        >>> r = deepest(lambda n: n <= 37, 12, 1000, float("inf"))
        >>> r["depth"], r["fails_at"], r["exact"]
        (37, 38, True)
        >>> deepest(lambda n: True, 12, 100, float("inf"))["depth"]
        100
    """
    lo, hi, tries = 0, None, []

    def out_of_time():
        return time.monotonic() > deadline

    def check(n):
        """fits(n), or None when the deadline came first (a try is stopped there)."""
        try:
            with time_box(deadline - time.monotonic()):
                ok = fits(n)
        except OutOfTime:
            tries.append([n, None])
            return None
        tries.append([n, ok])
        return ok

    n = max(1, min(start, cap))
    while not out_of_time():
        ok = check(n)
        if ok is None:
            break
        if ok:
            lo = n
            if n >= cap:
                break
            n = min(cap, n * 2)
        else:
            hi = n
            break
    while hi is not None and hi - lo > max(1, int(lo * rel)) and not out_of_time():
        mid = (lo + hi) // 2
        ok = check(mid)
        if ok is None:
            break
        if ok:
            lo = mid
        else:
            hi = mid
    exact = (hi is not None and hi - lo <= max(1, int(lo * rel))) or (hi is None and lo >= cap)
    return {"depth": lo, "fails_at": hi, "exact": bool(exact), "tries": tries}


def largest(args, cfg: GPTConfig, device: torch.device, batch: int, deadline: float, result: dict, emit) -> None:
    """The ``--largest`` search, into ``result``."""
    if device.type != "cuda":
        result.update(status="skipped", reason="needs a GPU: it searches what fits in the device's memory")
        emit()
        return
    cfg = GPTConfig(**{**vars(cfg), "remat": args.largest_remat})
    total = torch.cuda.get_device_properties(device).total_memory
    cap_bytes = min(total, int(args.largest_memory_gib * 2**30)) if args.largest_memory_gib else total
    torch.cuda.set_per_process_memory_fraction(cap_bytes / total, device)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    per_layer = params_of(with_depth(cfg, 2)) - params_of(with_depth(cfg, 1))
    fixed = params_of(with_depth(cfg, 1)) - per_layer

    def depth_for(n_params: float) -> int:
        return max(1, int((n_params - fixed) // per_layer))

    # ZeRO-Offload keeps fp32 masters, the two Adam moments and the fp32 gradient pieces on
    # the host: 16 B a parameter, and at init the fp32 module handed over and the moments
    # TrainState.create made beside them: 28; never ask for more than half the host's memory.
    host_cap = depth_for(0.5 * host / 28)
    result.update(status="running", width=cfg.n_embd, batch=batch, block_size=cfg.block_size, remat=cfg.remat,
                  device_memory_cap_bytes=cap_bytes, device_memory_bytes=total, host_memory_bytes=host,
                  params_per_block=per_layer, params_outside_blocks=fixed)
    emit()
    share = (deadline - time.monotonic()) * 0.35  # the search without offload is the quicker one
    base = deepest(lambda n: trains("fzero", with_depth(cfg, n), device, batch), cfg.n_layer, 4096,
                   time.monotonic() + share)
    base["params"] = params_of(with_depth(cfg, base["depth"])) if base["depth"] else 0
    result["fzero"] = base
    emit()
    if not base["depth"]:
        result.update(status="failed", reason="fzero trained no depth of this width under the memory cap")
        emit()
        return
    start = depth_for(3 * base["params"])
    off = deepest(lambda n: trains("fzero-offload", with_depth(cfg, n), device, batch), start, host_cap, deadline)
    off["params"] = params_of(with_depth(cfg, off["depth"])) if off["depth"] else 0
    off["host_cap_depth"] = host_cap
    result["fzero-offload"] = off
    result["ratio"] = round(off["params"] / base["params"], 4)
    result["ratio_is_lower_bound"] = not off["exact"] or off["fails_at"] is None
    result["status"] = "ok"
    emit()


# --------------------------------------------------------------------------- main


def versions(device: torch.device) -> dict:
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "fzero": fzero.__version__}
    for mod in ("triton", "optree"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            out[mod] = None
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", choices=sorted(PRESETS), default="124m")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the preset's)")
    p.add_argument("--steps", type=int, default=20, help="timed paired rounds")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds after the build steps")
    p.add_argument("--build-steps", type=int, default=3,
                   help="steps each contestant runs alone when built (compilation, peak memory)")
    p.add_argument("--contestants", default=",".join(CONTESTANTS),
                   help=f"comma-separated, or 'none' (default: {','.join(CONTESTANTS)})")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile's backend for every compile in the process (default: torch's, "
                        "inductor); 'eager' makes a CPU dry run quick")
    p.add_argument("--largest", action="store_true", help="also search the deepest GPT that trains, with and "
                                                         "without offload (CUDA only)")
    p.add_argument("--largest-memory-gib", type=float, default=12.0,
                   help="GPU memory the --largest search may use (0: all of it)")
    p.add_argument("--largest-batch", type=int, default=None, help="sequences per step in the search "
                                                                  "(default: the preset's)")
    p.add_argument("--largest-remat", action=argparse.BooleanOptionalAction, default=True,
                   help="checkpoint every block's activations in the search, both contestants (default: on)")
    p.add_argument("--time-limit", type=float, default=None, help="seconds for the whole run")
    p.add_argument("--json", default=None, help="write the results here (rewritten after every stage)")
    args = p.parse_args(argv)
    start = time.monotonic()
    deadline = start + args.time_limit if args.time_limit else float("inf")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # the memory cap and the peak counters want an index
        device = torch.device("cuda", torch.cuda.current_device())
    if args.compile_backend:  # every torch.compile of the process, fzero's jit included
        real_compile = torch.compile

        def compile_with_backend(*a, **k):
            k.setdefault("backend", args.compile_backend)
            return real_compile(*a, **k)

        torch.compile = compile_with_backend
    n_layer, n_head, n_embd, block, vocab, batch = PRESETS[args.preset]
    batch = args.batch or batch
    cfg = GPTConfig(vocab_size=vocab, block_size=block, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    names = [] if args.contestants.strip() == "none" else [n.strip() for n in args.contestants.split(",") if n.strip()]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {"preset": args.preset, "device": where, "versions": versions(device), "params": params_of(cfg),
              "config": {"n_layer": n_layer, "n_head": n_head, "n_embd": n_embd, "block_size": block,
                         "vocab_size": vocab, "batch": batch, "precision": "bf16 autocast, fp32 weights",
                         "optimizer": "AdamW lr 3e-4 betas (0.9, 0.95) wd 0.1, clip 1.0",
                         "compile_backend": args.compile_backend or "default"},
              "steps": args.steps, "warmup": args.warmup, "build_steps": args.build_steps,
              "time_limit_s": args.time_limit, "status": "running"}

    def emit():
        result["seconds"] = round(time.monotonic() - start, 2)
        if args.json:
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(result, f, indent=1)
            os.replace(tmp, args.json)

    emit()
    try:
        if names:
            # With a search to follow, the contest takes 60% of the time.
            until = start + 0.6 * args.time_limit if args.largest and args.time_limit else deadline
            Bench(args, cfg, device, batch, until, emit).run(names, result)
            print_table(result)
        if args.largest:
            result["largest"] = {}
            try:
                largest(args, cfg, device, args.largest_batch or batch, deadline, result["largest"], emit)
            except Exception as e:  # noqa: BLE001
                result["largest"].update(status="failed", reason=_error(e))
            print_largest(result["largest"])
        result["status"] = "ok"
    except Exception as e:  # noqa: BLE001
        result.update(status="failed", error=_error(e))
        raise
    finally:
        emit()
    return result


def print_table(r: dict) -> None:
    cfg = r["config"]
    print(f"device: {r['device']}; torch {r['versions']['torch']}; GPT {r['preset']}: {r['params'] / 1e6:.1f}M "
          f"parameters, batch {cfg['batch']} x {cfg['block_size']} tokens; bf16 autocast, AdamW, clip 1.0; "
          f"{r.get('rounds', 0)} paired rounds after {r['warmup']} warmup; {r['flops_per_step'] / 1e12:.3f} TFLOP "
          "per step (counted on the plain step)")
    print("| contestant | median step (ms) | × plain | tokens/s | MFU | peak memory (MiB) | × plain | status |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")

    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    for n, e in r["contestants"].items():
        print(f"| {n} | {f(e.get('step_ms'), '.1f')} | {f(e.get('vs_plain'), '.3f')} | "
              f"{f(e.get('tokens_per_s'), ',.0f')} | {f(e.get('mfu'), '.1%')} | {f(e.get('peak_mem_mib'), '.0f')} | "
              f"{f(e.get('mem_vs_plain'), '.3f')} | {e['status']} |")
        if e.get("error"):
            print(f"  {n}: {e['error'][:300]}")
    first = {n: e["first_loss"] for n, e in r["contestants"].items() if "first_loss" in e}
    print("first-step losses (same weights, same batch):", ", ".join(f"{n} {v:.5f}" for n, v in first.items()))


def print_largest(r: dict) -> None:
    if r.get("status") != "ok":
        print(f"--largest: {r.get('status')}: {r.get('reason', '')}")
        return
    print(f"deepest GPT of width {r['width']} that trains two steps at batch {r['batch']} x {r['block_size']}, "
          f"device memory capped at {r['device_memory_cap_bytes'] / 2**30:.1f} GiB:")
    for n in ("fzero", "fzero-offload"):
        e = r[n]
        print(f"  {n}: {e['depth']} blocks, {e['params'] / 1e6:.0f}M parameters "
              f"(fails at {e['fails_at']}; {'exact' if e['exact'] else 'search cut short'})")
    print(f"  ratio {r['ratio']:.2f}{' (a lower bound)' if r['ratio_is_lower_bound'] else ''}")


if __name__ == "__main__":
    main()
