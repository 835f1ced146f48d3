"""``fzero.optim.from_torch`` and the whole-tensor optimizers (``adafactor``, ``muon``):
against plain PyTorch (a module, backward on the full batch, ``torch.optim``), in one
process and on real gloo ranks at every ZeRO stage.

The model has a hidden ``6 x 6`` weight whose partition boundary falls mid-row (asserted):
an optimizer that reads whole rows or the whole matrix is wrong on a flat piece of it, and
one test shows that by running Adafactor on the pieces on purpose.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fzero
import fzero.testing as ft
from fzero import optim

D_IN, WIDTH, D_OUT = 5, 6, 3
GLOBAL_ROWS, STEPS = 6, 3

ELEMENTWISE_CASES = [
    ("SGD", dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    ("Adam", dict(lr=0.01, weight_decay=0.01)),
    ("AdamW", dict(lr=0.01, weight_decay=0.1)),
    ("Adamax", dict(lr=0.01)),
    ("NAdam", dict(lr=0.01)),
    ("RAdam", dict(lr=0.01)),
    ("RMSprop", dict(lr=0.01, momentum=0.5, centered=True)),
    ("Adagrad", dict(lr=0.05)),
    ("Adadelta", dict(lr=1.0)),
    ("ASGD", dict(lr=0.05)),
    ("Rprop", dict(lr=0.01)),
]


def _model():
    torch.manual_seed(0)
    return ft.Blocks(D_IN, WIDTH, 1, D_OUT)


def _batches(steps=STEPS):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(GLOBAL_ROWS, D_IN, generator=g), "y": torch.randn(GLOBAL_ROWS, D_OUT, generator=g)}
            for _ in range(steps)]


def _torch_run(make_opts, steps=STEPS) -> dict[str, torch.Tensor]:
    """Plain PyTorch: the module, backward on each full batch, the optimizers ``make_opts(model)``."""
    model = _model()
    opts = make_opts(model)
    for b in _batches(steps):
        for o in opts:
            o.zero_grad()
        F.mse_loss(model(b["x"]), b["y"]).backward()
        for o in opts:
            o.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _fzero_run(tx, stage: int, precision: str | None = None, steps=STEPS, **options):
    """fzero on this world's ranks, each with its rows of each batch; the whole parameters and
    the final state."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    apply, params = fzero.functionalize(_model())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=tx)
    if precision is not None:
        options["precision"] = precision
    step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), zero=stage, **options)
    state = step.init(state)
    for b in _batches(steps):
        state, _ = step(state, ft.local_batch(b, world, rank))
    return fzero.gather(state.params), state


def _mid_row_boundary(state) -> bool:
    """Whether some rank's piece of the hidden weight starts or stops inside a row."""
    piece = state.params["blocks.0.0.weight"]
    a, b = piece.info.piece()
    cuts = torch.tensor([a % WIDTH, b % WIDTH, int(0 < a < WIDTH * WIDTH or 0 < b < WIDTH * WIDTH)])
    dist.all_reduce(cuts)
    return bool(cuts[:2].sum() > 0 and cuts[2] > 0)


# --------------------------------------------------------------------------- one process


def _torch_params(model_params):
    return [p for p in model_params]


def test_from_torch_equals_torch_optimizers_in_one_process():
    """The unlaunched path. A compiled step owns its state (donate=True): an element-wise
    optimizer then steps the parameters themselves, in place, and the result is torch's, bit
    for bit. Undonated (pure: p + (new - old), one more rounding) and whole-tensor: fp32."""
    for name, kw in ELEMENTWISE_CASES:
        cls = getattr(torch.optim, name)
        ref = _torch_run(lambda m: [cls(m.parameters(), **kw)], steps=2)
        got, _ = _fzero_run(optim.from_torch(cls, **kw), 0, steps=2)
        ft.assert_trees_close(got, ref, tol="exact", what=f"{name}, donated")
        if name in ("RMSprop", "Rprop"):
            got, _ = _fzero_run(optim.from_torch(cls, **kw), 0, steps=2, donate=False)
            ft.assert_trees_close(got, ref, tol="fp32", what=f"{name}, not donated")
    ref = _torch_run(lambda m: [torch.optim.Adafactor(m.parameters(), lr=0.01)])
    got, _ = _fzero_run(optim.from_torch(torch.optim.Adafactor, lr=0.01), 0)
    ft.assert_trees_close(got, ref, tol="fp32", what="Adafactor")
    # last in a chain: the members before it run first, then it steps the parameters in place
    kw = dict(ELEMENTWISE_CASES)["NAdam"]
    ref = _torch_run(lambda m: [torch.optim.NAdam(m.parameters(), **kw)], steps=2)
    got, _ = _fzero_run(optim.chain(optim.scale(1.0), optim.from_torch(torch.optim.NAdam, **kw)), 0, steps=2)
    ft.assert_trees_close(got, ref, tol="exact", what="chain(scale(1.0), from_torch(NAdam)), donated")
    ref = _torch_run(_clipped(lambda m: [torch.optim.RMSprop(m.parameters(), lr=0.01)], 0.05), steps=2)
    got, _ = _fzero_run(optim.chain(optim.clip_by_global_norm(0.05), optim.from_torch(torch.optim.RMSprop, lr=0.01)),
                        0, steps=2)
    ft.assert_trees_close(got, ref, tol="fp32", what="chain(clip_by_global_norm, from_torch(RMSprop)), donated")


def test_a_schedule_drives_the_learning_rate_and_masks_choose_param_groups():
    sched = optim.schedules.warmup_cosine(0.05, warmup=1, total=STEPS)
    no_decay = lambda p: {k: v.ndim < 2 for k, v in p.items()}  # noqa: E731
    tx = optim.from_torch(torch.optim.AdamW, lr=sched, weight_decay=0.5,
                          param_groups=[{"mask": no_decay, "weight_decay": 0.0}])

    class Scheduled(torch.optim.AdamW):  # the reference sets each group's lr before its step, by count
        count = 0

        def step(self, closure=None):
            for g in self.param_groups:
                g["lr"] = sched(Scheduled.count)
            Scheduled.count += 1
            return super().step(closure)

    def groups(m):
        named = list(m.named_parameters())
        return [Scheduled([{"params": [p for _, p in named if p.ndim >= 2]},
                           {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}],
                          lr=0.0, weight_decay=0.5)]

    ref = _torch_run(groups)
    got, state = _fzero_run(tx, 0)
    ft.assert_trees_close(got, ref, tol="fp32", what="AdamW, scheduled, two groups")
    assert int(state.opt_state.count) == STEPS
    # the groups matter: with decay on the biases too, the result is another
    uniform, _ = _fzero_run(optim.from_torch(torch.optim.AdamW, lr=sched, weight_decay=0.5), 0)
    assert not torch.allclose(uniform["inp.bias"], ref["inp.bias"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", [lambda: optim.from_torch(torch.optim.Adam, lr=0.1),
                                  lambda: optim.from_torch(torch.optim.Adafactor, lr=0.1),
                                  lambda: optim.adafactor(0.1, min_dim_size_to_factor=1, momentum=0.9),
                                  lambda: optim.muon(0.1)], ids=["Adam", "Adafactor", "adafactor", "muon"])
def test_update_is_pure(make):
    tx = make()
    params = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    grads = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    state = tx.init(params)
    _, state = tx.update(grads, state, params)
    before = [t.clone() for t in fzero.tree.leaves((params, grads, state))]
    tx.update(grads, state, params)
    for a, b in zip(fzero.tree.leaves((params, grads, state)), before):
        assert torch.equal(a, b), "the update wrote into its inputs"


def test_a_donated_update_computes_the_same_writing_the_state_in_place():
    tx = optim.from_torch(torch.optim.Adam, lr=0.1)
    params = {"w": torch.randn(3, 4)}
    grads = {"w": torch.randn(3, 4)}
    _, state = tx.update(grads, tx.init(params), params)
    u1, s1 = tx.update(grads, state, params)
    u2, s2 = tx.update(grads, state, params, donate=True)
    ft.assert_trees_close((u2, s2), (u1, s1), tol="exact")
    assert s2.state["w"]["exp_avg"] is state.state["w"]["exp_avg"], "a donated state is written in place"


def test_state_is_tensors_keyed_like_the_params():
    tx = optim.from_torch(torch.optim.RMSprop, lr=1e-3)
    state = tx.init({"a": torch.zeros(2), "b": {"c": torch.zeros(3, 1)}})
    paths = [fzero.tree.keystr(p) for p in fzero.tree.paths(state)]
    assert paths == [".count", ".state['a']['step']", ".state['a']['square_avg']",
                     ".state['b']['c']['step']", ".state['b']['c']['square_avg']"]


def test_refused_classes_and_bad_groups_name_the_problem():
    with pytest.raises(TypeError, match="closure"):
        optim.from_torch(torch.optim.LBFGS)
    with pytest.raises(TypeError, match="Optimizer subclass"):
        optim.from_torch(optim.adamw)
    with pytest.raises(TypeError, match="'mask'"):
        optim.from_torch(torch.optim.SGD, lr=0.1, param_groups=[{"weight_decay": 0.0}])
    with pytest.raises(ValueError, match="refuses the hyperparameters"):
        optim.from_torch(torch.optim.SGD, lr=-1.0)


class ThirdParty(torch.optim.SGD):
    """An optimizer fzero does not know (a subclass may change what step() reads)."""


def test_whole_tensor_kinds_are_declared():
    from fzero.optim import _known

    assert _known.needs_whole_tensors(optim.from_torch(torch.optim.Adafactor))
    assert _known.needs_whole_tensors(optim.chain(optim.clip_by_global_norm(1.0), optim.muon(0.1)))
    assert _known.needs_whole_tensors(optim.adafactor(0.1))
    assert not _known.needs_whole_tensors(optim.from_torch(torch.optim.Adam))
    assert not _known.needs_whole_tensors(optim.from_torch(ThirdParty, elementwise=True, lr=0.1))
    assert _known.needs_whole_tensors(optim.from_torch(ThirdParty, elementwise=False, lr=0.1))
    assert not _known.needs_whole_tensors(optim.adamw(0.1))


# --------------------------------------------------------------------------- ranks


class _SideBySide(torch.nn.Module):
    """A copy of the model per optimizer; the loss is the sum of the copies' losses, so each
    copy's gradient is its own loss's."""

    def __init__(self, names):
        super().__init__()
        self.m = torch.nn.ModuleDict({name: _model() for name in names})

    def forward(self, x, y):
        return sum(F.mse_loss(m(x), y) for m in self.m.values())


def _side_by_side_step(state, batch):
    loss, grads = fzero.value_and_grad(lambda p: state.apply_fn(p, batch["x"], batch["y"]))(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def _elementwise_on_ranks(names):
    """Every listed optimizer at ZeRO 0-3, fp32 and bf16, against torch in one process on the
    full batch in fp32: fp32 runs to the SPEC's 1e-5, bf16 runs (bf16 compute, fp32 masters)
    to the "bf16 vs fp32" row. One run per stage and precision trains a copy of the model per
    optimizer, each copy's parameters masked to its own from_torch (so one step covers every
    class), and at each stage one class alone (a bare from_torch, which a donated step runs on
    the parameters in place: fp32 at stages 0 and 2, its state offloaded at 2; bf16 at 1 and
    3). Two updates: the
    second is the first that loads the state the first built (a third would repeat it)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    cases = [(name, kw) for name, kw in ELEMENTWISE_CASES if name in names]
    refs = {name: _torch_run(lambda m: [getattr(torch.optim, name)(m.parameters(), **kw)], steps=2)
            for name, kw in cases}

    def copy_of(name):
        return lambda p: {k: k.startswith(f"m.{name}.") for k in p}

    tx = optim.chain(*[optim.masked(optim.from_torch(getattr(torch.optim, name), **kw), copy_of(name))
                       for name, kw in cases])
    failures = []
    for stage in (0, 1, 2, 3):
        for precision, tol in ((None, "fp32"), ("bf16", "bf16 vs fp32")):
            apply, params = fzero.functionalize(_SideBySide([name for name, _ in cases]))
            step = fzero.compile(_side_by_side_step, fzero.Mesh(dp=-1), zero=stage,
                                 **({"precision": precision} if precision else {}))
            state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=tx))
            for b in _batches(2):
                state, _ = step(state, ft.local_batch(b, world, rank))
            got = fzero.gather(state.params)
            for name, _ in cases:
                try:
                    ft.assert_trees_close({k: got[f"m.{name}.{k}"] for k in refs[name]}, refs[name], tol=tol,
                                          what=f"{name} zero={stage} {precision or 'fp32'}")
                except AssertionError as e:
                    failures.append(str(e))
            # and one class alone, a bare from_torch: the path that steps the parameters in place
            if (stage % 2 == 1) != (precision is not None):
                continue
            name, kw = cases[(3 * stage) % len(cases)]
            options = {"offload_optimizer": "cpu"} if stage == 2 else {}
            got, _ = _fzero_run(optim.from_torch(getattr(torch.optim, name), **kw), stage, precision, steps=2,
                                **options)
            try:
                ft.assert_trees_close(got, refs[name], tol=tol, what=f"{name} alone zero={stage} "
                                                                    f"{precision or 'fp32'} {options}")
            except AssertionError as e:
                failures.append(str(e))
    return failures


@pytest.mark.multirank
@pytest.mark.slow
def test_elementwise_torch_optimizers_equal_torch_at_every_stage(ranks):
    names = [n for n, _ in ELEMENTWISE_CASES]
    results = ranks(2).run(_elementwise_on_ranks, names)
    assert results == [[], []], "\n".join(results[0] + results[1])


def _muon_and_adamw(lr, wd):
    def make(m):
        named = list(m.named_parameters())
        return [torch.optim.Muon([p for _, p in named if p.ndim == 2], lr=lr, weight_decay=wd),
                torch.optim.AdamW([p for _, p in named if p.ndim != 2], lr=lr, eps=1e-7, weight_decay=0.0)]
    return make


def _matrix(p):
    return {k: v.ndim == 2 for k, v in p.items()}


def _not_matrix(p):
    return {k: v.ndim != 2 for k, v in p.items()}


def _one_process(tx, steps=STEPS):
    """``tx`` by hand on whole tensors in this process: plain torch gradients, ``tx.update``."""
    model = _model()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = tx.init(params)
    for b in _batches(steps):
        live = {k: v.clone().requires_grad_() for k, v in params.items()}
        loss = F.mse_loss(torch.func.functional_call(model, live, (b["x"],)), b["y"])
        grads = dict(zip(live, torch.autograd.grad(loss, list(live.values()))))
        updates, state = tx.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params


def _clipped(make_opts, max_norm):
    """``make_opts``'s optimizers, each step after ``clip_grad_norm_(max_norm)``."""
    def make(m):
        opts = make_opts(m)

        class Clip(torch.optim.Optimizer):
            def __init__(self):
                super().__init__(list(m.parameters()), {})

            def step(self, closure=None):
                torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
        return [Clip(), *opts]
    return make


def _adafactor_on_pieces_differs(state) -> bool:
    """torch's Adafactor run on purpose on each rank's flat piece of the hidden weight (this
    layout's cuts), against the same step on the whole matrix: what an implementation that
    handed a whole-tensor optimizer its pieces would compute."""
    info = state.params["blocks.0.0.weight"].info
    g = torch.Generator().manual_seed(2)
    w, grad = torch.randn(info.shape, generator=g), torch.randn(info.shape, generator=g)
    whole = w.clone()
    whole.grad = grad.clone()
    torch.optim.Adafactor([whole], lr=0.02).step()
    pieces = [w.reshape(-1)[a:b].clone() for a, b in (info.piece(r) for r in range(info.world)) if b > a]
    for p, (a, b) in zip(pieces, [c for c in (info.piece(r) for r in range(info.world)) if c[1] > c[0]]):
        p.grad = grad.reshape(-1)[a:b].clone()
    torch.optim.Adafactor(pieces, lr=0.02).step()
    return not torch.allclose(torch.cat(pieces), whole.reshape(-1), rtol=1e-3, atol=1e-4)


def _whole_tensor_on_ranks(stages):
    """Two updates each (the second loads the state the first built)."""
    lr, wd = 0.02, 0.1
    adafactor_ref = _torch_run(lambda m: [torch.optim.Adafactor(m.parameters(), lr=lr)], steps=2)
    muon_ref = _torch_run(_muon_and_adamw(lr, wd), steps=2)
    native_muon = dict(learning_rate=lr, weight_decay=0.05, beta=0.9)
    cases = [
        ("from_torch(Adafactor)", lambda: optim.from_torch(torch.optim.Adafactor, lr=lr), adafactor_ref),
        ("from_torch(Muon) + from_torch(AdamW)", lambda: optim.chain(
            optim.masked(optim.from_torch(torch.optim.Muon, lr=lr, weight_decay=wd), _matrix),
            optim.masked(optim.from_torch(torch.optim.AdamW, lr=lr, eps=1e-7, weight_decay=0.0), _not_matrix)),
         muon_ref),
        ("adafactor", lambda: optim.adafactor(lr, min_dim_size_to_factor=1), adafactor_ref),
        ("muon as torch's", lambda: optim.muon(lr, eps=1e-7, weight_decay=wd, ns_dtype=torch.bfloat16,
                                               bias_correction=False), muon_ref),
        ("muon (optax's nesterov)", lambda: optim.muon(**native_muon),
         _one_process(optim.muon(**native_muon), steps=2)),
    ]
    failures, owners = [], {}
    # composed with clipping, accumulation, offload and bf16 (fp32 masters)
    clipped_ref = _torch_run(_clipped(lambda m: [torch.optim.Adafactor(m.parameters(), lr=lr)], 0.05), steps=2)
    for name, tx, options, tol in [
        ("clip + accumulate + offload", optim.from_torch(torch.optim.Adafactor, lr=lr),
         dict(clip_norm=0.05, accumulate=GLOBAL_ROWS // dist.get_world_size(), offload_optimizer="cpu"), "fp32"),
        ("clip + bf16", optim.chain(optim.clip_by_global_norm(0.05), optim.adafactor(lr, min_dim_size_to_factor=1)),
         dict(precision="bf16"), "bf16 vs fp32"),
    ]:
        got, _ = _fzero_run(tx, stages[-1], steps=2, **options)
        try:
            ft.assert_trees_close(got, clipped_ref, tol=tol, what=f"Adafactor, {name}, zero={stages[-1]}")
        except AssertionError as e:
            failures.append(str(e))
    for stage in stages:
        # At stage 3 the blocks gathered one at a time (max_reuse_distance=0), as a model larger
        # than the reuse window has them: their groups cut the hidden weight mid-row.
        units = {"max_reuse_distance": 0} if stage == 3 else {}
        for name, make, ref in cases:
            got, state = _fzero_run(make(), stage, steps=2, **units)
            if name == "from_torch(Adafactor)":
                adafactor_state = state
            try:
                ft.assert_trees_close(got, ref, tol="fp32", what=f"{name} zero={stage}")
            except AssertionError as e:
                failures.append(str(e))
        if stage == 3:
            state = adafactor_state
            held = state.opt_state.state["blocks.0.0.weight"]["row_var"].local.numel()
            owners["hidden weight's row_var elements here"] = held
            owners["mid-row boundary"] = _mid_row_boundary(state)
            owners["flat pieces differ"] = _adafactor_on_pieces_differs(state)
    return failures, owners


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_whole_tensor_optimizers_equal_one_process_at_zero_3(ranks, world):
    results = ranks(world).run(_whole_tensor_on_ranks, (1, 3) if world == 2 else (3,))
    failures = [f for fs, _ in results for f in fs]
    assert not failures, "\n".join(failures)
    found = [o for _, o in results]
    assert all(o["mid-row boundary"] for o in found), "the test's layout must cut the hidden weight mid-row"
    assert all(o["flat pieces differ"] for o in found), "Adafactor on flat pieces should differ from torch's"
    held = [o["hidden weight's row_var elements here"] for o in found]
    assert sorted(held) == [0] * (world - 1) + [WIDTH], f"the factored state lives on one owner, got {held}"


def _third_party(stage):
    try:
        got, _ = _fzero_run(optim.from_torch(ThirdParty, lr=0.05, momentum=0.9), stage)
    except ValueError as e:
        return str(e)
    ref = _torch_run(lambda m: [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)])
    ft.assert_trees_close(got, ref, tol="fp32", what="an undeclared optimizer at ZeRO 0")
    return "ran"


@pytest.mark.multirank
@pytest.mark.slow
def test_an_undeclared_optimizer_runs_at_zero_0_and_is_refused_above(ranks):
    pool = ranks(2)
    assert pool.run(_third_party, 0) == ["ran", "ran"]
    for stage in (1, 3):
        messages = pool.run(_third_party, stage)
        for m in messages:
            assert "ThirdParty" in m and "elementwise=True" in m and "elementwise=False" in m, m


def _resumable(name):
    if name == "RMSprop":  # element-wise: per-element pieces and a per-tensor `step` on every rank
        return optim.from_torch(torch.optim.RMSprop, lr=0.01, momentum=0.5)
    return optim.from_torch(torch.optim.Adafactor, lr=0.01)  # whole-tensor: each leaf's state on its owner


def _train_and_save(name, path, stage, steps, save_at=None):
    world, rank = dist.get_world_size(), dist.get_rank()
    tx = _resumable(name)
    apply, params = fzero.functionalize(_model())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=tx)
    step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), zero=stage)
    state = step.init(state)
    for i, b in enumerate(_batches()[:steps]):
        state, _ = step(state, ft.local_batch(b, world, rank))
        if save_at is not None and i + 1 == save_at:
            fzero.checkpoint.save(path, state)
    return fzero.gather(state.params)


def _resume(name, path, stage):
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    tx = _resumable(name)
    apply, params = fzero.functionalize(_model())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=tx)
    step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), zero=stage)
    state = fzero.checkpoint.load(path, like=step.init(state))
    assert isinstance(state.opt_state, optim.FromTorchState) and int(state.opt_state.count) == 2
    for b in _batches()[2:]:
        state, _ = step(state, ft.local_batch(b, world, rank))
    return fzero.gather(state.params)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("name", ["RMSprop", "Adafactor"])
def test_a_from_torch_state_saved_at_zero_2_on_2_ranks_resumes_at_zero_3_on_3_and_on_1(ranks, tmp_path, name):
    """Resharded onto 3 ranks (the world the whole-tensor test starts): other pieces, and
    other owners of the whole-tensor state (the output weight's moves from rank 1 to 2); and
    onto one process (this one), where every piece and every owner is rank 0."""
    path = str(tmp_path / "ckpt")
    whole = ranks(2).run(_train_and_save, name, path, 2, STEPS, 2)
    resumed = ranks(3).run(_resume, name, path, 3)
    for r, got in enumerate(resumed):
        ft.assert_trees_close(got, whole[0], tol="fp32", what=f"{name} resumed at ZeRO 3 on rank {r} of 3")
    ft.assert_trees_close(_resume(name, path, 3), whole[0], tol="fp32", what=f"{name} resumed at ZeRO 3 on 1 rank")


# --------------------------------------------------------------------------- DeepSpeed config types


def _config(optimizer, stage):
    return {"train_batch_size": GLOBAL_ROWS, "gradient_clipping": 0.0, "optimizer": optimizer,
            "zero_optimization": {"stage": stage}}


def _deepspeed_muon(stage):
    """A config's Muon against DeepSpeed's MuonWithAuxAdam written with torch's optimizers:
    torch.optim.Muon (the same momentum, scaling and decay; its Newton-Schulz in bf16) on the
    matrices, torch.optim.AdamW with DeepSpeed's Adam-group defaults on the rest."""
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = _config({"type": "Muon", "params": {"muon_lr": 0.03, "adam_lr": 0.01, "momentum": 0.9,
                                              "weight_decay": 0.1}}, stage)
    apply, params = fzero.functionalize(_model())
    state = fzero.TrainState.create(apply_fn=apply, params=params)
    step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), config=cfg)
    state = step.init(state)
    for b in _batches():
        state, _ = step(state, ft.local_batch(b, world, rank))
    got = fzero.gather(state.params)

    def make(m):
        named = list(m.named_parameters())
        return [torch.optim.Muon([p for _, p in named if p.ndim == 2], lr=0.03, momentum=0.9, weight_decay=0.1),
                torch.optim.AdamW([p for _, p in named if p.ndim != 2], lr=0.01, betas=(0.9, 0.95), eps=1e-10,
                                  weight_decay=0.1)]
    ref = _torch_run(make)
    return {k: float(((got[k] - ref[k]).abs().max() / ref[k].abs().max())) for k in ref}


@pytest.mark.multirank
@pytest.mark.slow
def test_a_deepspeed_muon_config_trains_as_deepspeed_muon(ranks):
    errors = ranks(2).run(_deepspeed_muon, 3)
    # fzero iterates Newton-Schulz in fp32 (as DeepSpeed does on a CPU), torch in bf16: measured,
    # fzero's own muon in bf16 and in fp32 differ by 1.1e-2 / 2.0e-2 on these two matrices (relative
    # to their largest element) after 3 steps, and by <= 1.3e-4 on the AdamW group.
    for k, err in errors[0].items():
        assert err < (5e-2 if k.endswith("weight") else 1e-3), (k, err, errors[0])
    assert errors[0] == errors[1]


def test_mup_types_without_infshapes_are_refused_naming_infshape():
    for kind in ("MuAdam", "MuAdamW", "MuSGD"):
        apply, params = fzero.functionalize(_model())
        state = fzero.TrainState.create(apply_fn=apply, params=params)
        step = fzero.compile(ft.mse_step, fzero.Mesh(dp=1), config=_config({"type": kind, "params": {"lr": 0.01}}, 0))
        with pytest.raises(ValueError, match=f"optimizer.type='{kind}'.*infshape.*mup.set_base_shapes"):
            step.init(state)


def test_public_names():
    for name in ("from_torch", "adafactor", "muon", "scale_by_muon", "FromTorchState", "WholeTensorState"):
        assert name in optim.__all__ and hasattr(optim, name), name


@pytest.mark.parametrize("module", ["fzero.optim.torch_optim", "fzero.optim.matrix", "fzero.optim._owners"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


def _tensor_parallel():
    """from_torch(Adam) on tp=2 slices against torch; a whole-tensor optimizer refused by name,
    and accepted where a mask keeps it off the split parameters."""
    plan = {"blocks.*.0": fzero.ColwiseParallel(), "out": fzero.RowwiseParallel()}
    out = []
    for tx in (optim.from_torch(torch.optim.Adam, lr=0.01), optim.adafactor(0.01, min_dim_size_to_factor=1),
               optim.chain(optim.masked(optim.adafactor(0.01, min_dim_size_to_factor=1),
                                        lambda p: {k: k == "inp.weight" for k in p}),
                           optim.masked(optim.from_torch(torch.optim.Adam, lr=0.01),
                                        lambda p: {k: k != "inp.weight" for k in p}))):
        apply, params = fzero.functionalize(_model())
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=tx)
        step = fzero.compile(ft.mse_step, fzero.Mesh(dp=1, tp=2), zero=1, tp=plan)
        try:
            state = step.init(state)
            for b in _batches():
                state, _ = step(state, b)
        except NotImplementedError as e:
            out.append(str(e))
            continue
        out.append(fzero.gather(state.params))
    ref = _torch_run(lambda m: [torch.optim.Adam(m.parameters(), lr=0.01)])
    mixed = _torch_run(lambda m: [torch.optim.Adafactor([m.inp.weight], lr=0.01),
                                  torch.optim.Adam([p for k, p in m.named_parameters() if k != "inp.weight"],
                                                   lr=0.01)])
    return out, ref, mixed


@pytest.mark.multirank
@pytest.mark.slow
def test_tensor_parallel_slices_take_elementwise_optimizers_and_refuse_whole_tensor_ones(ranks):
    (adam, whole, mixed, ref, mixed_ref), _ = [(*out, ref, mixed) for out, ref, mixed in ranks(2).run(_tensor_parallel)]
    ft.assert_trees_close(adam, ref, tol="fp32", what="from_torch(Adam) under tp=2")
    assert "whole-tensor optimizer" in whole and "'blocks.0.0.weight'" in whole and "'out.weight'" in whole, whole
    ft.assert_trees_close(mixed, mixed_ref, tol="fp32", what="adafactor on an unsplit weight beside tp slices")


class _InfShape:
    """The three methods of the ``mup`` package's ``InfShape`` that its optimizers read (mup is
    not installed here): the number of infinite dimensions, the width multiplier of the
    main (fan-in) one, and fan-in multiplier over fan-out multiplier."""

    def __init__(self, ninf: int, width_mult: float = 1.0, ratio: float = 1.0):
        self._ninf, self._width_mult, self._ratio = ninf, width_mult, ratio

    def ninf(self):
        return self._ninf

    def width_mult(self):
        return self._width_mult

    def fanin_fanout_mult_ratio(self):
        return self._ratio


def _mup_model():
    model = _model()
    for name, p in model.named_parameters():  # the hidden matrix is matrix-like, the rest vector-like
        p.infshape = _InfShape(2, 3.0, 1.5) if name == "blocks.0.0.weight" else _InfShape(1, 2.0)
    return model


@pytest.mark.parametrize("kind", ["MuAdam", "MuAdamW", "MuSGD"])
def test_mup_types_scale_each_parameters_learning_rate_by_its_infshape(kind):
    lr, wd = 0.01, 0.1
    params = {"lr": lr, "weight_decay": wd, **({"momentum": 0.9} if kind == "MuSGD" else {})}
    apply, p0 = fzero.functionalize(_mup_model())
    state = fzero.TrainState.create(apply_fn=apply, params=p0)
    step = fzero.compile(ft.mse_step, fzero.Mesh(dp=1), config=_config({"type": kind, "params": params}, 0))
    state = step.init(state)
    for b in _batches():
        state, _ = step(state, b)

    # mup's rules, written out: Adam scales a matrix-like parameter's lr by 1 / width_mult (its
    # coupled weight decay by width_mult); SGD a vector-like one's by width_mult (decay by its
    # inverse) and a matrix-like one's by 1 / (fan-in mult / fan-out mult) (decay by the ratio).
    def make(m):
        named = dict(m.named_parameters())
        hidden = [named.pop("blocks.0.0.weight")]
        if kind == "MuSGD":
            return [torch.optim.SGD([{"params": hidden, "lr": lr / 1.5, "weight_decay": wd * 1.5},
                                     {"params": list(named.values()), "lr": lr * 2.0, "weight_decay": wd / 2.0}],
                                    lr=lr, momentum=0.9)]
        cls = torch.optim.AdamW if kind == "MuAdamW" else torch.optim.Adam
        return [cls([{"params": hidden, "lr": lr / 3.0, "weight_decay": wd * 3.0},
                     {"params": list(named.values()), "lr": lr, "weight_decay": wd}])]

    ref = _torch_run(make)
    ft.assert_trees_close(dict(state.params), ref, tol="fp32", what=kind)


# --------------------------------------------------------------------------- pipeline


def _seq():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH),
                               torch.nn.Tanh(), torch.nn.Linear(WIDTH, D_OUT))


PIPELINED = [("RMSprop", dict(lr=0.01, momentum=0.5, centered=True)), ("Adafactor", dict(lr=0.02))]


def _pipelined(zero):
    """On 2 ranks, one stage each: from_torch's optimizers under a 2-stage pipeline (2
    micro-batches), each stage updating its own layers; the whole parameters, and the
    references (one process, the module, backward on each full batch, torch's optimizer)."""
    mesh = fzero.Mesh(pp=2, dp=1)
    out = []
    for name, kw in PIPELINED:
        cls = getattr(torch.optim, name)
        model = _seq()
        pipe = fzero.pipeline(fzero.transforms.pipeline.split(model, [2]), F.mse_loss, mesh, micro_batches=2)

        def train_step(state, batch):
            loss, grads = pipe(state.params, batch["x"], batch["y"])
            return state.apply_gradients(grads), {"loss": loss}

        step = fzero.compile(train_step, mesh, zero=zero, pipeline=pipe)
        apply, params = fzero.functionalize(model)
        state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.from_torch(cls, **kw)))
        for b in _batches():
            state, _ = step(state, b)
        ref_model = _seq()
        opt = cls(ref_model.parameters(), **kw)
        for b in _batches():
            opt.zero_grad()
            F.mse_loss(ref_model(b["x"]), b["y"]).backward()
            opt.step()
        out.append((name, pipe.gather(state.params), {k: v.detach() for k, v in ref_model.named_parameters()}))
    return out


@pytest.mark.multirank
@pytest.mark.slow
def test_from_torch_under_a_pipeline_equals_torch(ranks):
    pool = ranks(2)
    for zero in (0, 1):
        for results in pool.run(_pipelined, zero):
            for name, got, ref in results:
                ft.assert_trees_close(got, ref, tol="fp32", what=f"from_torch({name}) under pp=2, zero={zero}")
