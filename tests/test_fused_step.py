"""The fused path as the step's optimizer: adam, adamw, lamb, lion and sgd through
``fzero_kernels``, one launch per flat group, against the unfused chain (itself tested
against torch.optim and optax's formulas in test_optim.py) and against torch.optim directly."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fzero
import fzero.testing as ft
import fzero_kernels
from fzero import optim
from fzero.transforms.shard_state._layout import build_layout
from fzero_kernels import _common

CASE = ft.ModelCase((3, 5, 2), "tanh", True, True, 3)  # three Linear layers: six leaves
KINDS = ("adam", "adamw", "lamb", "lion", "sgd")


def _tx(kind, clip):
    sched = optim.schedules.warmup_cosine(1e-2, warmup=2, total=8)
    tx = {
        "adam": lambda: optim.adam(1e-2, weight_decay=0.05),
        "adamw": lambda: optim.adamw(sched, weight_decay=0.1),
        "lamb": lambda: optim.lamb(1e-2, weight_decay=0.1),
        "lion": lambda: optim.lion(1e-3),
        "sgd": lambda: optim.sgd(sched, momentum=0.9, nesterov=True, weight_decay=0.01),
    }[kind]()
    return optim.chain(optim.clip_by_global_norm(0.05), tx) if clip else tx


def _launches():
    """Kernel launches so far (either backend), by the kernels' own counter."""
    return sum(n for (name, _), n in _common.CALLS.items()
               if name.rsplit(".", 1)[-1].rstrip("_").split("_reference")[0] in
               ("adamw", "adam", "adamw_multi", "adam_multi", "lion", "sgd", "lamb_partial_norms", "lamb_apply"))


def _train(kind, *, stage, mode, precision="fp32", clip=False, steps=3, nan_at=None, world=1, rank=0, **kw):
    apply, params = fzero.functionalize(CASE.make())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=_tx(kind, clip))
    step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), zero=stage, precision=precision, **kw)
    metrics, launches = [], []
    with optim.use_fused(mode), fzero_kernels.force_backend("reference"):
        state = step.init(state)
        for i in range(steps):
            batch = ft.local_batch(CASE.batch(4 * world, i), world, rank)
            if i == nan_at:
                batch["x"][0, 0] = float("nan")
            before = _launches()
            state, m = step(state, batch)
            launches.append(_launches() - before)
            metrics.append(m)
    return state, metrics, launches


def _assert_same(fused, plain, kind, what):
    (sf, mf, _), (sp, mp, _) = fused, plain
    got = fzero.gather({"params": sf.params, "opt_state": sf.opt_state, "extra": sf.extra, "step": sf.step})
    want = fzero.gather({"params": sp.params, "opt_state": sp.opt_state, "extra": sp.extra, "step": sp.step})
    ft.assert_trees_close(got, want, what=what)  # one structure: checkpoints cannot tell the paths apart
    for a, b in zip(mf, mp):
        assert a.keys() == b.keys(), what
        if "grad_norm" in a:  # the chain's norm, the same bits
            x, y = a["grad_norm"], b["grad_norm"]
            assert torch.equal(x, y) or (x.isnan() and y.isnan()), (what, x, y)
        if "skipped" in a:
            assert bool(a["skipped"]) == bool(b["skipped"]), what


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_fused_step_equals_unfused_step(kind, stage, precision):
    """Every kind × stage × precision, with and without clipping, and a non-finite update
    (skipped by both paths, leaving the same state): the fused step's parameters, masters,
    optimizer state, step and metrics are the unfused step's."""
    for clip in (False, True):
        kw = dict(stage=stage, precision=precision, clip=clip, nan_at=1)
        what = f"{kind} stage {stage} {precision} clip={clip}"
        fused = _train(kind, mode="on", **kw)
        plain = _train(kind, mode="off", **kw)
        assert sum(plain[2]) == 0 and all(n > 0 for n in fused[2]), (what, fused[2], plain[2])
        assert int(fused[0].step) == 2 and [bool(m["skipped"]) for m in fused[1]] == [False, True, False], what
        _assert_same(fused, plain, kind, what)


def _torch_fused_calls(monkeypatch):
    """Count the calls of torch's fused CPU Adam/AdamW kernels, by name."""
    calls = {"_fused_adamw_": 0, "_fused_adam_": 0}
    for name in calls:
        real = getattr(torch, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(torch, name, counted)
    return calls


@pytest.mark.parametrize("kind", ["adam", "adamw"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_auto_on_the_cpu_runs_torchs_fused_kernel_and_equals_the_chain(monkeypatch, kind, stage, precision):
    """``"auto"`` on the CPU: Adam and AdamW run torch's own fused CPU kernel (one pass, the
    kernel of ``torch.optim.AdamW(fused=True)``), one call per step (per decay flag), no
    fzero_kernels launch; with clipping, a loss scale and a skipped non-finite update, the
    state and metrics are the chain's within fp32 rounding."""
    calls = _torch_fused_calls(monkeypatch)
    name = "_fused_adamw_" if kind == "adamw" else "_fused_adam_"
    for clip in (False, True):
        kw = dict(stage=stage, precision=precision, clip=clip, nan_at=1)
        what = f"{kind} stage {stage} {precision} clip={clip}"
        before = calls[name]
        auto = _train(kind, mode="auto", **kw)
        assert calls[name] - before == 3 and sum(auto[2]) == 0, (what, calls, auto[2])
        assert [bool(m["skipped"]) for m in auto[1]] == [False, True, False], what
        _assert_same(auto, _train(kind, mode="off", **kw), kind, what)


def test_auto_on_the_cpu_is_torch_optim_adamw_fused_bit_for_bit():
    """An independent reference: at stage 0 in one process each parameter is its own tensor,
    as torch.optim's are, and the update is ``torch.optim.AdamW(fused=True)``'s, bit for bit
    (the same kernel on the same tensors); the foreach AdamW within fp32 rounding."""
    tx = optim.adamw(1e-2, b1=0.8, b2=0.95, weight_decay=0.1)
    apply, params = fzero.functionalize(CASE.make())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=tx)
    step = fzero.compile(ft.mse_step, zero=0)
    refs = {}
    for how in ("fused", "foreach"):
        refs[how] = CASE.make()
        refs[how + "_opt"] = torch.optim.AdamW(refs[how].parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1,
                                               **{how: True})
    state = step.init(state)
    for i in range(4):
        b = CASE.batch(4, i)
        state, _ = step(state, b)
        for how in ("fused", "foreach"):
            refs[how + "_opt"].zero_grad()
            F.mse_loss(refs[how](b["x"]), b["y"]).backward()
            refs[how + "_opt"].step()
    got = fzero.gather(state.params)
    for k, v in refs["fused"].named_parameters():
        assert torch.equal(got[k], v.detach()), k
    ft.assert_trees_close(got, {k: v.detach() for k, v in refs["foreach"].named_parameters()}, what="foreach")


def test_torchs_fused_kernel_writes_nothing_it_is_not_given():
    """Torch's kernel writes its unscaling back into the gradients it reads: the path hands
    it new tensors when it scales or clips, so a caller's gradients (and, not donated, its
    parameters and moments) are as they were."""
    from fzero.optim.fused import fused_update

    tx = optim.chain(optim.clip_by_global_norm(0.01), optim.adamw(1e-2, weight_decay=0.1))
    params = {"a": torch.randn(5, 3), "b": torch.randn(7)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    state = tx.init(params)
    state = tx.update(grads, state, params)[1]  # moments not zero
    kept = [x.clone() for x in fzero.tree.leaves((params, grads, state))]
    new_p, new_s = fused_update(tx, grads, state, params, grad_scale=torch.tensor(4.0))
    assert all(torch.equal(a, b) for a, b in zip(kept, fzero.tree.leaves((params, grads, state))))
    with optim.use_fused("on"), fzero_kernels.force_backend("reference"):  # the kernels' arithmetic
        want_p, want_s = fused_update(tx, grads, state, params, grad_scale=torch.tensor(4.0))
    ft.assert_trees_close((new_p, new_s), (want_p, want_s))
    assert not torch.equal(new_p["a"], params["a"])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_launch_per_flat_group_and_step(kind, precision, stage):
    """Under ZeRO the kernel runs once per flat group (LAMB: its norms and apply launches),
    not once per leaf: one group of six leaves, then the groups of a 64-byte bucket (Adam
    and AdamW: those groups in one multi-tensor launch)."""
    per = 2 if kind == "lamb" else 1
    _, _, launches = _train(kind, stage=stage, mode="on", precision=precision)
    assert launches == [per] * 3, launches
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32  # buckets count the model's bytes
    params = {k: v.to(dtype) for k, v in CASE.make().named_parameters()}
    groups = len(build_layout(params, world=1, rank=0, bucket_bytes=64).groups)
    assert groups in (2, 3)
    _, _, launches = _train(kind, stage=stage, mode="on", precision=precision, bucket_bytes=64)
    assert launches == [1 if kind in ("adam", "adamw") else groups * per] * 3, launches


@pytest.mark.parametrize("kind", KINDS)
def test_stage_0_launches_once_per_group_of_leaves(kind):
    """Without ZeRO's flat groups each leaf is its own storage, so each is a run: Adam and
    AdamW update the six in one multi-tensor launch (two under a weights-only decay mask:
    one per decay flag), LAMB, Lion and SGD launch per leaf (docs/kernels.md)."""
    _, _, launches = _train(kind, stage=0, mode="on")
    assert launches == [{"adam": 1, "adamw": 1, "lamb": 12}.get(kind, 6)] * 3, launches
    if kind == "adamw":
        apply, params = fzero.functionalize(CASE.make())
        tx = optim.adamw(1e-2, weight_decay=0.5, mask=lambda p: {k: k.endswith("weight") for k in p})
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=tx)
        step = fzero.compile(ft.mse_step, zero=0)
        with optim.use_fused("on"), fzero_kernels.force_backend("reference"):
            state = step.init(state)
            before = _launches()
            step(state, CASE.batch(4))
        assert _launches() - before == 2


def test_a_weight_decay_mask_cuts_a_group_into_runs():
    """The kernels take one weight_decay per launch: a mask that alternates along the flat
    group (weights decayed, biases not) cuts it into six runs of equal flags, which AdamW
    updates in one multi-tensor launch per flag, and the update is still the chain's."""
    def train(mode):
        apply, params = fzero.functionalize(CASE.make())
        tx = optim.adamw(1e-2, weight_decay=0.5, mask=lambda p: {k: k.endswith("weight") for k in p})
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=tx)
        step = fzero.compile(ft.mse_step, zero=2)
        with optim.use_fused(mode), fzero_kernels.force_backend("reference"):
            state = step.init(state)
            before = _launches()
            state, _ = step(state, CASE.batch(4))
        return fzero.gather(state.params), _launches() - before

    (fused, n), (plain, _) = train("on"), train("off")
    assert n == 2
    ft.assert_trees_close(fused, plain)


def test_fused_zero_2_trains_like_torch_optim():
    """An independent reference: torch.optim's AdamW and SGD (Nesterov) on the same module."""
    for kind, make in [("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
                       ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True))]:
        tx = optim.adamw(1e-2, weight_decay=0.1) if kind == "adamw" else optim.sgd(0.05, momentum=0.9, nesterov=True)
        apply, params = fzero.functionalize(CASE.make())
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=tx)
        step = fzero.compile(ft.mse_step, zero=2)
        ref = CASE.make()
        opt = make(ref.parameters())
        with optim.use_fused("on"), fzero_kernels.force_backend("reference"):
            state = step.init(state)
            for i in range(4):
                b = CASE.batch(4, i)
                state, _ = step(state, b)
                opt.zero_grad()
                F.mse_loss(ref(b["x"]), b["y"]).backward()
                opt.step()
        ft.assert_trees_close(fzero.gather(state.params), {k: v.detach() for k, v in ref.named_parameters()},
                              what=kind)


def test_checkpoint_written_by_the_fused_path_loads_into_the_unfused_one(tmp_path):
    fused, _, _ = _train("lamb", stage=2, mode="on", clip=True)
    fzero.checkpoint.save(str(tmp_path / "c"), fused)
    apply, params = fzero.functionalize(CASE.make())
    like = fzero.TrainState.create(apply_fn=apply, params=params, tx=_tx("lamb", True))
    step = fzero.compile(ft.mse_step, zero=2)
    with optim.use_fused("off"):
        like = step.init(like)
        loaded = fzero.checkpoint.load(str(tmp_path / "c"), like=like)
        ft.assert_trees_close(fzero.gather(loaded.opt_state), fzero.gather(fused.opt_state), tol="exact")
        step(loaded, CASE.batch(4, 9))  # and it steps


def _two_ranks(kind, stage, precision, clip):
    r, n = dist.get_rank(), dist.get_world_size()
    out = [_train(kind, stage=stage, mode=m, precision=precision, clip=clip, nan_at=1, world=n, rank=r)
           for m in ("on", "off")]
    per = 2 if kind == "lamb" else 1
    assert out[0][2] == [per, per, per], out[0][2]  # the nan update runs the kernels too, and is discarded
    _assert_same(out[0], out[1], kind, f"{kind} stage {stage} {precision} clip={clip} rank {r}")
    return True


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("kind,stage,precision,clip", [("adamw", 1, "fp32", True), ("lamb", 2, "bf16", True),
                                                       ("lion", 3, "fp32", False), ("sgd", 3, "bf16", True),
                                                       ("adam", 2, "fp32", False)])
def test_fused_step_on_two_ranks(ranks, kind, stage, precision, clip):
    """Real ranks: each rank's kernel updates its own piece of the flat group, LAMB's
    per-tensor norms and the clip's sum of squares summed across ranks."""
    assert ranks(2).run(_two_ranks, kind, stage, precision, clip) == [True, True]


INTERPRETED = textwrap.dedent(r"""
    import torch, fzero, fzero_kernels, fzero.testing as ft
    from fzero import optim
    from fzero_kernels import _common
    from torch.utils._python_dispatch import TorchDispatchMode
    case = ft.ModelCase((3, 5, 2), "tanh", True, True, 3)

    class HostReads(TorchDispatchMode):
        # A read of a tensor's value by the host (.item(), bool(), float()): on a GPU, a
        # sync. The counts are int64 CPU tensors by design (schedules read them), not counted.
        reads = 0
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default) \
                    and args[0].dtype != torch.int64:
                HostReads.reads += 1
            return func(*args, **(kwargs or {}))

    from fzero.optim import fused
    real = fused.fused_update
    def watched(*a, **k):
        with HostReads():
            return real(*a, **k)
    fused.fused_update = watched
    import fzero.train_state

    # Stage 0: six separate leaves, one multi-tensor launch (Adam, AdamW).
    for kind, stage, clip in [("adamw", 2, True), ("lamb", 3, True), ("lion", 1, False), ("sgd", 2, True),
                              ("adamw", 0, True), ("adam", 0, False)]:
        tx = {"adamw": lambda: optim.adamw(1e-2), "adam": lambda: optim.adam(1e-2, weight_decay=0.05),
              "lamb": lambda: optim.lamb(1e-2, weight_decay=0.1),
              "lion": lambda: optim.lion(1e-3), "sgd": lambda: optim.sgd(0.05, momentum=0.9)}[kind]
        out = []
        for mode in ("on", "off"):
            apply, params = fzero.functionalize(case.make())
            t = optim.chain(optim.clip_by_global_norm(0.05), tx()) if clip else tx()
            state = fzero.TrainState.create(apply_fn=apply, params=params, tx=t)
            step = fzero.compile(ft.mse_step, zero=stage)
            with optim.use_fused(mode):
                state = step.init(state)
                before = sum(v for (f, b), v in _common.CALLS.items() if b == "triton")
                for i in range(2):
                    state, m = step(state, case.batch(4, i))
                launched = sum(v for (f, b), v in _common.CALLS.items() if b == "triton") - before
            out.append((fzero.gather(state.params), fzero.gather(state.opt_state), launched))
        per = 2 if kind == "lamb" else 1
        assert out[0][2] == 2 * per and out[1][2] == 0, (kind, out[0][2], out[1][2])
        ft.assert_trees_close(out[0][:2], out[1][:2], what=kind)
    assert HostReads.reads == 0, HostReads.reads
    print("interpreted-ok")
""")


@pytest.mark.slow
def test_fused_step_under_the_triton_interpreter():
    """The Triton kernels themselves (interpreted on the CPU) as the step's optimizer: one
    launch per flat group (at stage 0, Adam's and AdamW's one multi-tensor launch), the
    chain's result, and no host read of a device value (norm, flags) on the way."""
    import triton  # noqa: F401  (a test dependency: a broken install fails here, it is not skipped)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "interpreted-ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton kernels)")
def test_fused_step_compiled_on_the_gpu_without_host_sync():
    """On a GPU: the compiled kernels as the step's optimizer equal the unfused chain, and
    the fused update makes no host sync (torch.cuda.set_sync_debug_mode raises on one);
    at stage 2 (one flat group) and, for the multi-tensor kernel, at stage 0."""
    import triton  # noqa: F401
    from fzero.optim import fused
    from fzero.optim.fused import fused_update

    for kind, stage in [(kind, 2) for kind in KINDS] + [("adamw", 0), ("adam", 0)]:
        out = []
        for mode in ("on", "off"):
            model = CASE.make().cuda()
            apply, params = fzero.functionalize(model)
            state = fzero.TrainState.create(apply_fn=apply, params=params, tx=_tx(kind, True))
            step = fzero.compile(ft.mse_step, zero=stage)
            real = fused.fused_update

            def strict(*a, **k):
                torch.cuda.set_sync_debug_mode("error")
                try:
                    return real(*a, **k)
                finally:
                    torch.cuda.set_sync_debug_mode("default")

            fused.fused_update = strict
            try:
                with optim.use_fused(mode):
                    state = step.init(state)
                    for i in range(3):
                        state, _ = step(state, {k: v.cuda() for k, v in CASE.batch(4, i).items()})
            finally:
                fused.fused_update = fused_update
            out.append(fzero.gather({"p": state.params, "s": state.opt_state}))
        ft.assert_trees_close(out[0], out[1], what=f"{kind} stage {stage}")
