"""compile() in one process: the same trajectory as the plain step, options, errors,
and the handler machinery every transform stands on."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
import fzero.testing as ft
from fzero import optim, tree
from fzero import core


def make(case, tx):
    apply, params = fzero.functionalize(case.make())
    return fzero.TrainState.create(apply_fn=apply, params=params, tx=tx)


TXS = {
    "sgd": lambda: optim.sgd(0.05, momentum=0.9),
    "adamw": lambda: optim.adamw(1e-2, weight_decay=0.1),
}


@settings(max_examples=15, deadline=None)
@given(ft.models(), st.sampled_from(sorted(TXS)), st.sampled_from([None, 0.5]))
def test_compiled_equals_plain(case, tx_name, clip):
    batches = [case.batch(6, i) for i in range(10)]
    tx = TXS[tx_name]()
    plain_tx = tx if clip is None else optim.chain(optim.clip_by_global_norm(clip), tx)
    ref_state, ref_losses = ft.run_steps(ft.mse_step, make(case, plain_tx), batches)
    step = fzero.compile(ft.mse_step, clip_norm=clip)
    state, losses = ft.run_steps(step, step.init(make(case, tx)), batches)
    ft.assert_trees_close(losses, ref_losses)
    ft.assert_trees_close(fzero.gather(state.params), ref_state.params)
    assert int(state.step) == 10


def test_grad_norm_metric_is_the_norm_before_clipping():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    batch = {"x": torch.randn(16, 4) * 10, "y": torch.randn(16, 2) * 10}
    model(batch["x"])
    loss = F.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    apply, params = fzero.functionalize(model)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
    step = fzero.compile(ft.mse_step, clip_norm=0.1)
    _, metrics = step(step.init(state), batch)
    torch.testing.assert_close(metrics["grad_norm"], ref_norm)


def test_unknown_option_names_it_and_the_nearest():
    with pytest.raises(TypeError, match=r"unknown option 'zeroo'; did you mean 'zero'\?"):
        fzero.compile(ft.mse_step, zeroo=2)


def test_overlap_comm_false_is_an_option_not_an_error():
    assert fzero.compile(ft.mse_step, overlap_comm=False).options.overlap_comm is False
    with pytest.raises(ValueError, match="overlap_comm='no' must be"):
        fzero.compile(ft.mse_step, overlap_comm="no")


def test_bad_option_values():
    with pytest.raises(ValueError, match="zero=5"):
        fzero.compile(ft.mse_step, zero=5)
    with pytest.raises(ValueError, match="precision='fp8'"):
        fzero.compile(ft.mse_step, precision="fp8")
    with pytest.raises(ValueError, match="clip_norm=-1"):
        fzero.compile(ft.mse_step, clip_norm=-1)


def test_comm_bytes_is_opt_in_and_adds_its_metrics_without_changing_the_step():
    """Off (the default), metrics are the user's and fzero's as before; on, two more keys. The
    multi-rank byte counts are in tests/test_comm.py."""
    torch.manual_seed(0)
    batches = [{"x": torch.randn(8, 4), "y": torch.randn(8, 2)} for _ in range(3)]
    runs = {}
    for on in (False, True):
        apply, params = fzero.functionalize(torch.nn.Linear(4, 2))
        params = {k: torch.full_like(v, 0.1) for k, v in params.items()}
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2))
        step = fzero.compile(ft.mse_step, clip_norm=1.0, comm_bytes=on)
        state = step.init(state)
        for b in batches:
            state, metrics = step(state, b)
        runs[on] = (state, metrics)
    assert sorted(runs[False][1]) == ["grad_norm", "loss", "skipped"]
    assert sorted(runs[True][1]) == ["comm_bytes", "comm_bytes_by_axis", "grad_norm", "loss", "skipped"]
    assert runs[True][1]["comm_bytes"]["total"] == 0
    assert runs[True][1]["comm_bytes_by_axis"] == {"pp": 0, "dp": 0, "sp": 0, "tp": 0, "other": 0}
    ft.assert_trees_close(runs[True][0].params, runs[False][0].params, tol="exact", what="params")
    with pytest.raises(ValueError, match=r"comm_bytes='yes' must be True or False"):
        fzero.compile(ft.mse_step, comm_bytes="yes")


def test_step_output_and_init_checked():
    step = fzero.compile(lambda s, b: s)
    with pytest.raises(TypeError, match=r"must return \(state, metrics\)"):
        step(None, None)
    with pytest.raises(TypeError, match="expects an fzero.TrainState"):
        step.init({"params": 1})


# --------------------------------------------------------------------------- handlers


class Recorder(core.Handler):
    def __init__(self, name, log):
        self.name, self.log = name, log

    def value_and_grad(self, fn, params, args, kwargs, *, next, **options):
        self.log.append(f"{self.name}:vg")
        (value, grads) = next(fn, params, args, kwargs, **options)
        return value, tree.map(lambda g: g * 2, grads)

    def apply_gradients(self, state, grads, *, next):
        self.log.append(f"{self.name}:apply")
        return next(state, grads)


def test_handlers_nest_innermost_first():
    log = []
    w = {"w": torch.ones(2)}
    with core.installed(Recorder("outer", log)), core.installed(Recorder("inner", log)):
        _, g = fzero.value_and_grad(lambda p: p["w"].sum())(w)
    assert log == ["inner:vg", "outer:vg"]
    assert g["w"].tolist() == [4.0, 4.0]  # each handler doubled the gradient once
    assert core.handlers() == ()


def test_handler_sees_apply_gradients_and_psum_is_identity():
    log = []
    apply, params = fzero.functionalize(torch.nn.Linear(1, 1))
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(1.0))
    with core.installed(Recorder("h", log)):
        state.apply_gradients(tree.map(torch.zeros_like, params))
    assert log == ["h:apply"]
    x = torch.tensor(3.0)
    assert core.psum(x) is x


@pytest.mark.parametrize("options", [{}, {"precision": "bf16", "clip_norm": 1.0, "accumulate": 2}])
def test_a_step_leaves_no_reference_cycle_for_the_garbage_collector(options):
    """Everything a step makes is freed by its reference count: nothing waits for the cyclic
    collector, whose full collections cost in proportion to everything the process holds
    (a compiled model's caches: tens of ms) and would stall steps at random. (The handlers'
    chain was a closure calling itself: a cycle at every primitive.)"""
    import gc

    case = ft.ModelCase((4, 6, 3), "gelu", True, True, 3)
    apply, params = fzero.functionalize(case.make())
    step = fzero.compile(ft.mse_step, **options)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2)))
    batch = case.batch(8, 0)
    for _ in range(3):
        state, _ = step(state, batch)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        state, _ = step(state, batch)
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert left == [], left[:20]


def test_emit_outside_a_step_is_dropped_inside_collected():
    core.emit_metric("x", 1)  # no collector: nothing happens
    with core.collecting_metrics() as m:
        core.emit_metric("x", 2)
    assert m == {"x": 2}


def test_options_are_one_typed_dataclass_with_the_contracts_spellings():
    step = fzero.compile(ft.mse_step, zero=1, precision="bf16", bucket_bytes=2**20)
    assert step.options == fzero.CompileOptions(zero=1, precision="bf16", bucket_bytes=2**20)
    # the transforms' own names, shard_state(stage=) and mixed_precision(dtype=), still set them
    with pytest.warns(DeprecationWarning) as caught:
        assert fzero.compile(ft.mse_step, stage=1, dtype="bf16").options == \
            fzero.CompileOptions(zero=1, precision="bf16")
    assert sorted(str(w.message).split(" (")[0] for w in caught) == [
        "fzero.compile: dtype= is now precision=", "fzero.compile: stage= is now zero="]
    with pytest.raises(TypeError, match="'stage' and 'zero' are one option"):
        fzero.compile(ft.mse_step, zero=1, stage=1)


def test_every_unknown_or_renamed_option_is_named_at_once():
    with pytest.raises(TypeError) as e:
        fzero.compile(ft.mse_step, bucket_size=1024, reduce_dtype="bf16", zeroo=2)
    msg = str(e.value)
    assert "'bucket_size' is now bucket_bytes" in msg and "'reduce_dtype' is now reduce_in" in msg
    assert "unknown option 'zeroo'; did you mean 'zero'?" in msg


def test_a_keyword_may_add_to_a_config_but_not_contradict_it():
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 1}}
    step = fzero.compile(ft.mse_step, config=config, buffer_sync="mean")  # the config says nothing of it
    assert step.options.zero == 1 and step.options.buffer_sync == "mean"
    with pytest.raises(ValueError, match=r"zero=2 contradicts the config's zero=1 \(zero_optimization.stage\)"):
        fzero.compile(ft.mse_step, config=config, zero=2)


def test_the_transforms_check_their_keywords_as_compile_does():
    with pytest.raises(ValueError, match=r"fzero.CompileOptions: buffer_sync='all' must be 'broadcast', 'mean' or 'local'"):
        fzero.CompileOptions(buffer_sync="all")
    with pytest.raises(ValueError, match=r"fzero.compile: accumulate=0 must be a positive int"):
        fzero.compile(ft.mse_step, accumulate=0)
    with pytest.raises(ValueError, match=r"fzero.accumulate: micro_batches=0 must be a positive int"):
        fzero.accumulate(ft.mse_step, 0)
    with pytest.raises(ValueError, match=r"fzero.mixed_precision: loss_scale_window=0 must be a positive int"):
        fzero.mixed_precision(ft.mse_step, "fp16", loss_scale_window=0)


# --------------------------------------------------------------------------- donation

DONATING_TXS = {
    "sgd": lambda: optim.sgd(0.05, momentum=0.9),
    "nesterov": lambda: optim.sgd(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: optim.adam(1e-2),
    "adamw": lambda: optim.adamw(1e-2, weight_decay=0.1),
    "lion": lambda: optim.lion(1e-3),
    "lamb": lambda: optim.lamb(1e-2, weight_decay=0.01),
    "masked": lambda: optim.adamw(1e-2, weight_decay=0.1, mask=lambda p: tree.map(lambda x: x.dim() > 1, p)),
}


def _storages(state):
    return [x.data_ptr() for x in tree.leaves((state.params, state.opt_state)) if x.numel() > 1]


@pytest.mark.parametrize("tx_name", sorted(DONATING_TXS))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_donated_step_writes_into_its_input_and_computes_the_same_bits(tx_name, precision):
    torch.manual_seed(0)
    make_model = lambda: torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))  # noqa: E731
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(6, 5, generator=g), "y": torch.randn(6, 3, generator=g)} for _ in range(4)]
    runs = {}
    for donate in (False, True):
        torch.manual_seed(0)
        apply, params = fzero.functionalize(make_model())
        step = fzero.compile(ft.mse_step, precision=precision, donate=donate)
        state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=DONATING_TXS[tx_name]()))
        first, losses = _storages(state), []
        for b in batches:
            state, m = step(state, b)
            losses.append(m["loss"])
        runs[donate] = (state, losses, first == _storages(state))
    (plain, plain_losses, _), (donated, donated_losses, in_place) = runs[False], runs[True]
    # The same arithmetic in place: the same bits, not merely close ones.
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, donated_losses))
    for a, b in zip(tree.leaves((plain.params, plain.opt_state, plain.extra)),
                    tree.leaves((donated.params, donated.opt_state, donated.extra))):
        assert torch.equal(a, b)
    assert in_place, "a donated step allocated new parameters or moments"
    assert not runs[False][2], "the undonated step is pure: it must not write into its input"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_undonated_step_leaves_every_tensor_of_its_input_intact_buffers_included(precision):
    """Called twice on one state, ``donate=False`` gives the same new state twice, and the
    input's parameters, optimizer state, masters and BatchNorm buffers keep their bits."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 3))
    apply, params = fzero.functionalize(model)
    step = fzero.compile(ft.mse_step, precision=precision, donate=False, accumulate=2)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2)))
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(6, 5, generator=g), "y": torch.randn(6, 3, generator=g)}
    leaves = lambda s: tree.leaves((s.step, s.params, s.opt_state, s.extra, s.buffers))  # noqa: E731
    before = [x.clone() for x in leaves(state)]
    first, _ = step(state, batch)
    second, _ = step(state, batch)
    assert all(torch.equal(a, b) for a, b in zip(leaves(state), before))
    assert all(torch.equal(a, b) for a, b in zip(leaves(first), leaves(second)))
    assert int(first.buffers["1.num_batches_tracked"]) == 2 and int(state.buffers["1.num_batches_tracked"]) == 0


def test_a_donated_adamw_step_is_torch_adamw():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    ref = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    apply, params = fzero.functionalize(model)
    step = fzero.compile(ft.mse_step, donate=True)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2, weight_decay=0.1)))
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        b = {"x": torch.randn(6, 5, generator=g), "y": torch.randn(6, 3, generator=g)}
        state, m = step(state, b)
        opt.zero_grad()
        loss = F.mse_loss(ref(b["x"]), b["y"])
        loss.backward()
        opt.step()
        torch.testing.assert_close(m["loss"], loss.detach())
    ft.assert_trees_close(state.params, dict(ref.named_parameters()), what="params")


def test_a_donated_state_cannot_be_used_again():
    apply, params = fzero.functionalize(torch.nn.Linear(3, 2))
    step = fzero.compile(ft.mse_step, donate=True)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1)))
    batch = {"x": torch.ones(4, 3), "y": torch.zeros(4, 2)}
    new, _ = step(state, batch)
    with pytest.raises(RuntimeError, match=r"donated to the step \(donate=True\) that returned the state at step 1"):
        step(state, batch)
    with pytest.raises(RuntimeError, match="params was donated"):
        state.params["weight"]
    assert new.buffers == {}  # a model without buffers: nothing of them to mark
    with pytest.raises(TypeError, match=r"leaf .params is a Donated \(<donated to the step that returned step 1>\)"):
        fzero.checkpoint.save("/nonexistent/never-written", state)
    new, _ = step(new, batch)  # the returned state goes on
    assert int(new.step) == 2


# --------------------------------------------------------------------------- the order


def _doc_table(path: Path, heading: str) -> list[list[str]]:
    """The rows of the first table after ``heading`` in a docs page, cells stripped."""
    text = path.read_text()
    lines = text[text.index(heading):].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip().strip("|").split(" | ")])
    return rows


def test_the_order_is_one_table_and_the_docs_show_it():
    from fzero._compile import ORDER

    rows = _doc_table(Path(__file__).parents[1] / "docs" / "transforms.md", "### The order")
    assert [(int(r[0]), r[1], r[3]) for r in rows] == [(i, f"`{layer.name}`", layer.why)
                                                     for i, layer in enumerate(ORDER, 1)]


def test_compile_wraps_the_transforms_in_the_tables_order():
    """Every option at once, one process: the compiled step's chain of inner steps is ORDER's
    rows that apply, outermost last."""
    from fzero._compile import ORDER

    step = fzero.compile(ft.mse_step, zero=1, precision="bf16", accumulate=2, clip_norm=1.0, nonfinite="raise",
                         offload_optimizer="cpu")
    names, s = [], step.inner
    while s.inner is not None:
        names.append(s.__name__.split("(")[0])
        s = s.inner
    # torch_autocast excludes precision="bf16" (fp32 weights under autocast): not in this chain;
    # ulysses needs an sp axis, tensor_parallel and pipeline theirs.
    assert names[::-1] == [layer.name for layer in ORDER
                           if layer.name not in ("tensor_parallel", "pipeline", "torch_autocast", "ulysses")]
