"""fzero.config: DeepSpeed's JSON config format.

Expected values come from DeepSpeed's rules as read in its source (0.19.8:
``runtime/config.py`` ``_set_batch_related_parameters`` / ``_batch_assertion``,
``runtime/zero/config.py`` ``read_zero_config_deprecated``, ``runtime/engine.py``
``_configure_basic_optimizer``, ``csrc/lamb/fused_lamb_cuda_kernel.cu``), not from the code
under test.

Cross-check against real DeepSpeed, done once while writing this file (not run here: the
suite does not import deepspeed). DeepSpeed 0.19.8 from its sdist, CPU, gloo, world of 1,
with a stub ``mpu`` giving the data-parallel world size:

    PYTHONPATH=/tmp/dsdl/deepspeed-0.19.8 /tmp/dsvenv/bin/python /tmp/dscfg/check.py
    -> batch: 720/720 identical     (DeepSpeedConfig vs Config.load: every subset of
                                     train/micro/gas in {None, 1..16} x {None, 1..4} x
                                     {None, 1..3}, world sizes 1-4; same triple or both fail)
    -> "zero_optimization": true / false -> stage 1 / 0 in both
    -> gradient_clipping omitted / 0 / 0.5 -> DeepSpeed 1.0 / 0.0 / 0.5, clip_norm 1.0 / None / 0.5
    -> 5 updates through deepspeed.initialize (torch_adam, which DeepSpeed builds as
       torch.optim.Adam/AdamW) vs make_optimizer(): Adam, Adam+wd, Adam adam_w_mode=false,
       AdamW adam_w_mode=false, adamw with betas/eps, SGD nesterov+wd, SGD: all within 1.2e-7

FusedLamb and FusedLion are CUDA-only in DeepSpeed; LAMB is checked here against a reference
written from the CUDA kernel, Lion through its FusedSpec (the kernel's math is optax's).

Tolerances: a config optimizer against fzero.optim built directly, and the schedules, are
exact (the same chain, the same functions); DeepSpeed's Lamb against the kernel's formula and
on two shards against unsharded: the rows "lamb fp64 vs kernel formula" and "norm" of
``fzero.testing.TOLERANCES``.
"""

from __future__ import annotations

import dataclasses
import doctest
import json
import math
import re
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
import fzero.testing as ft
from fzero import optim, tree
from fzero import config as fconfig
from fzero.config import (
    BF16Config,
    Config,
    ConfigKeyError,
    FP16Config,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
    _config,
    _keys,
    _load,
    _sections,
    _values,
)
from fzero.optim import schedules
from fzero.core import installed

# The sample config of DeepSpeed's README ("Getting started"), unchanged.
README_SAMPLE = {
    "train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
    "fp16": {"enabled": True},
    "zero_optimization": True,
}

SETTINGS = settings(max_examples=60, deadline=None)


def load(d, **kw):
    """Config.load that fails on any warning (so tests see only the warnings they expect)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return Config.load(d, **kw)


def base(**kw):
    return {"train_batch_size": 8, **kw}


def triple(cfg):
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


# --------------------------------------------------------------------------- README sample


def test_readme_sample_works_unchanged():
    cfg = load(README_SAMPLE, world_size=1)
    assert triple(cfg) == (8, 8, 1)
    assert cfg.ignored == ()
    assert cfg.decided_options() == {
        "zero": 1,  # "zero_optimization": true is DeepSpeed's legacy form of stage 1
        "precision": "fp16",
        "loss_scale": "dynamic",  # fp16.loss_scale 0 (the default) is the dynamic scaler
        "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
        "consecutive_hysteresis": False, "min_loss_scale": 1.0,
        "check_grad_overflow": True,  # DeepSpeed always checks under fp16
        "accumulate": 1,
        "clip_norm": 1.0,  # DeepSpeed 0.19's default gradient_clipping
    }  # reduce_bucket_size not written: fzero's own default bucket
    assert cfg.compile_options() == fzero.CompileOptions(**cfg.decided_options())
    # DeepSpeed's "Adam" is FusedAdam in AdamW mode (adam_w_mode defaults to true), weight
    # decay 0 (FusedAdam's default, not torch.optim.AdamW's 0.01).
    assert optim.fused_spec_of(cfg.make_optimizer()) == optim.fused_spec_of(optim.adamw(0.00015, 0.9, 0.999, 1e-8, 0.0))
    assert cfg.local_batch_size == 8


@pytest.mark.parametrize("world, micro", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_readme_sample_on_more_ranks(world, micro):
    assert triple(load(README_SAMPLE, world_size=world)) == (8, micro, 1)


def test_readme_sample_from_a_json_file_and_json_text(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(README_SAMPLE, indent=2))
    expected = load(README_SAMPLE)
    for src in (path, str(path), json.dumps(README_SAMPLE)):
        cfg = load(src)
        assert cfg == expected  # ``source`` is not compared
    assert load(path).source == str(path)


# --------------------------------------------------------------------------- batch sizes


KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@SETTINGS
@given(micro=st.integers(1, 16), gas=st.integers(1, 8), world=st.sampled_from([1, 2, 3, 4, 8]),
       drop=st.sampled_from([None, 0, 1, 2]))
def test_any_two_batch_values_imply_the_third(micro, gas, world, drop):
    full = (micro * gas * world, micro, gas)
    given_ = {k: v for i, (k, v) in enumerate(zip(KEYS, full)) if i != drop}
    assert triple(load(given_, world_size=world)) == full


@SETTINGS
@given(train=st.integers(1, 64), world=st.sampled_from([1, 2, 4]))
def test_train_batch_size_alone_means_one_step(train, world):
    # DeepSpeed: gas = 1, micro = train // world, then the product must hold.
    if train % world == 0:
        assert triple(load({"train_batch_size": train}, world_size=world)) == (train, train // world, 1)
    else:
        with pytest.raises(ValueError, match=f"world size={world}"):
            load({"train_batch_size": train}, world_size=world)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_micro_batch_alone_means_one_step(world):
    assert triple(load({"train_micro_batch_size_per_gpu": 3}, world_size=world)) == (3 * world, 3, 1)


@SETTINGS
@given(train=st.integers(1, 64), micro=st.integers(1, 16), gas=st.integers(1, 8),
       world=st.sampled_from([1, 2, 4]))
def test_inconsistent_batch_sizes_show_all_three_and_the_world(train, micro, gas, world):
    if train == micro * gas * world:
        return
    with pytest.raises(ValueError) as e:
        load({"train_batch_size": train, "train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": gas}, world_size=world)
    msg = str(e.value)
    for part in (f"train_batch_size={train}", f"train_micro_batch_size_per_gpu={micro}",
                 f"gradient_accumulation_steps={gas}", f"world size={world}"):
        assert part in msg


@pytest.mark.parametrize("given_, world, derived", [
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3}, 1, "gradient_accumulation_steps=3 (derived)"),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 16}, 1, "gradient_accumulation_steps=0 (derived)"),
    ({"train_batch_size": 8, "gradient_accumulation_steps": 3}, 2, "train_micro_batch_size_per_gpu=1 (derived)"),
    ({"train_batch_size": 6}, 4, "train_micro_batch_size_per_gpu=1 (derived)"),
])
def test_a_derived_value_that_does_not_divide_is_an_error(given_, world, derived):
    # DeepSpeed derives by floor division, then its product check fails.
    with pytest.raises(ValueError, match=re.escape(derived)):
        load(given_, world_size=world)


@pytest.mark.parametrize("given_", [{}, {"gradient_accumulation_steps": 2}])
def test_train_or_micro_batch_size_is_required(given_):
    with pytest.raises(ValueError, match="train_batch_size or train_micro_batch_size_per_gpu is required"):
        load(given_)


@pytest.mark.parametrize("value, exc", [(0, ValueError), (-8, ValueError), (8.5, TypeError),
                                        (True, TypeError), ("8", TypeError)])
def test_batch_values_must_be_positive_integers(value, exc):
    with pytest.raises(exc, match="train_batch_size"):
        load({"train_batch_size": value})


def test_whole_floats_are_integers_and_world_defaults_to_one():
    cfg = load({"train_batch_size": 8.0})
    assert triple(cfg) == (8, 8, 1) and cfg.world_size == 1


def test_a_config_is_resolved_again_for_another_world_size():
    cfg = load({"train_batch_size": 16, "gradient_accumulation_steps": 2}, world_size=1)
    assert triple(cfg) == (16, 8, 2)
    assert load(cfg) is cfg and load(cfg, world_size=1) is cfg
    again = load(cfg, world_size=4)
    assert triple(again) == (16, 2, 2) and again.world_size == 4
    with pytest.raises(ValueError, match="world size=3"):
        load(cfg, world_size=3)


# --------------------------------------------------------------------------- optimizers


def _cfg_tx(opt, **extra):
    return load(base(optimizer=opt, **extra)).make_optimizer()


@pytest.mark.parametrize("opt, expected", [
    ({"type": "Adam"}, optim.adamw(1e-3, 0.9, 0.999, 1e-8, 0.0)),
    ({"type": "adam", "params": {"lr": 0.01, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}},
     optim.adamw(0.01, 0.8, 0.95, 1e-6, 0.1)),
    ({"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1, "adam_w_mode": False}},
     optim.adam(0.01, 0.9, 0.999, 1e-8, 0.1)),
    # "AdamW" forces AdamW whatever adam_w_mode says (effective = name == adamw or adam_w_mode)
    ({"type": "ADAMW", "params": {"lr": 0.01, "adam_w_mode": False}}, optim.adamw(0.01, weight_decay=0.0)),
    # torch_adam builds torch.optim.AdamW, whose default weight decay is 0.01
    ({"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}, optim.adamw(0.01, weight_decay=0.01)),
    ({"type": "Adam", "params": {"lr": 0.01, "torch_adam": True, "adam_w_mode": False}},
     optim.adam(0.01, weight_decay=0.0)),
    # FusedLion's defaults: betas (0.9, 0.999), weight decay 0 (optax's lion: 0.99, 1e-3)
    ({"type": "Lion"}, optim.lion(1e-3, 0.9, 0.999, 0.0)),
    ({"type": "lion", "params": {"lr": 1e-4, "betas": [0.95, 0.98], "weight_decay": 0.1}},
     optim.lion(1e-4, 0.95, 0.98, 0.1)),
    ({"type": "SGD", "params": {"lr": 0.1}}, optim.sgd(0.1)),
    ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4,
                                "dampening": 0, "foreach": True}},
     optim.sgd(0.1, 0.9, True, 1e-4)),
])
def test_each_optimizer_builds_the_fzero_optimizer_with_deepspeeds_hyperparameters(opt, expected):
    tx = _cfg_tx(opt)
    assert optim.fused_spec_of(tx) == optim.fused_spec_of(expected) is not None
    torch.manual_seed(0)
    params = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    grads = tree.map(torch.randn_like, params)
    state_a, state_b = tx.init(params), expected.init(params)
    for _ in range(2):  # one update of each, twice: bit-identical
        ua, state_a = tx.update(grads, state_a, params)
        ub, state_b = expected.update(grads, state_b, params)
        for k in params:
            assert torch.equal(ua[k], ub[k])


def test_optimizer_section_records_the_canonical_name_and_kind():
    o = OptimizerConfig(type="adamw", params={"lr": 0.1})
    assert (o.type, o.kind) == ("AdamW", "adamw")
    assert OptimizerConfig(type="ADAM", params={"adam_w_mode": False}).kind == "adam"
    assert OptimizerConfig(type="Lamb").hyperparameters() == {
        "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "max_coeff": 10.0,
        "min_coeff": 0.01, "bias_correction": True, "eps_inside_sqrt": False}
    with pytest.raises(TypeError):
        o.params["lr"] = 1.0  # frozen


def _lamb_reference(params, grads_seq, *, lr, b1, b2, eps, wd, max_coeff, min_coeff,
                    eps_inside_sqrt=False, bias_correction=True):
    """DeepSpeed's lamb_cuda_kernel_part1..3 and fused_lamb_cuda, one tensor at a time."""
    p = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v = {k: torch.zeros_like(x) for k, x in p.items()}
    for step, grads in enumerate(grads_seq, start=1):
        step_size = lr * math.sqrt(1 - b2**step) / (1 - b1**step) if bias_correction else lr
        for k in p:
            g = grads[k]
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g * g
            denom = torch.sqrt(v[k] + eps) if eps_inside_sqrt else torch.sqrt(v[k]) + eps
            update = m[k] / denom + wd * p[k]
            w_norm, u_norm = p[k].norm(), update.norm()
            coeff = 1.0
            if w_norm != 0 and u_norm != 0:
                coeff = float(w_norm / u_norm)
                coeff = min(coeff, max_coeff)
                coeff = max(coeff, min_coeff)
            p[k] = p[k] - step_size * coeff * update
    return p


@pytest.mark.parametrize("eps_inside_sqrt, bias_correction", [(False, True), (True, True), (False, False)])
def test_lamb_is_deepspeeds_fused_lamb(eps_inside_sqrt, bias_correction):
    torch.manual_seed(1)
    params = {
        "big": torch.randn(5, 3, dtype=torch.float64) * 50.0,   # ratio > max_coeff: clamped to 10
        "tiny": torch.randn(6, dtype=torch.float64) * 1e-5,     # ratio < min_coeff: clamped to 0.01
        "mid": torch.randn(4, 2, dtype=torch.float64),          # in range
        "zero": torch.zeros(3, dtype=torch.float64),            # ||p|| = 0: ratio 1
    }
    grads_seq = [tree.map(torch.randn_like, params) for _ in range(4)]
    hp = dict(lr=0.01, b1=0.8, b2=0.9, eps=1e-6, wd=0.1, max_coeff=10.0, min_coeff=0.01)
    tx = _cfg_tx({"type": "Lamb", "params": {
        "lr": hp["lr"], "betas": [hp["b1"], hp["b2"]], "eps": hp["eps"], "weight_decay": hp["wd"],
        "eps_inside_sqrt": eps_inside_sqrt, "bias_correction": bias_correction}})
    assert optim.fused_spec_of(tx) is None  # not optax's lamb: never fused
    p, state = dict(params), tx.init(params)
    for g in grads_seq:
        u, state = tx.update(g, state, p)
        p = optim.apply_updates(p, u)
    ref = _lamb_reference(params, grads_seq, eps_inside_sqrt=eps_inside_sqrt,
                          bias_correction=bias_correction, **hp)
    for k in params:
        torch.testing.assert_close(p[k], ref[k], **ft.tolerance("lamb fp64 vs kernel formula"))
    # and it is not optax's LAMB (fzero.optim.lamb): the clamp and the bias-correction factor
    ox = optim.lamb(hp["lr"], hp["b1"], hp["b2"], hp["eps"], weight_decay=hp["wd"])
    uo, _ = ox.update(grads_seq[0], ox.init(params), params)
    ud, _ = tx.update(grads_seq[0], tx.init(params), params)
    assert not torch.allclose(uo["big"], ud["big"])


def test_lamb_norms_are_exact_on_zero_shards():
    torch.manual_seed(2)
    params = {"a": torch.randn(6, 4) * 30, "b": torch.randn(10)}
    grads = tree.map(torch.randn_like, params)
    tx = _cfg_tx({"type": "Lamb", "params": {"lr": 0.1, "weight_decay": 0.01}})
    full, _ = tx.update(grads, tx.init(params), params)

    def half(t, i):
        return tree.map(lambda x: x.flatten().chunk(2)[i], t)

    (pa, pb), (ga, gb) = (half(params, 0), half(params, 1)), (half(grads, 0), half(grads, 1))
    rec = ft.RecordPsum()
    with installed(rec):
        tx.update(gb, tx.init(pb), pb)
    with installed(ft.AddOtherShard(rec.calls)):
        out_a, _ = tx.update(ga, tx.init(pa), pa)
    for k in params:
        torch.testing.assert_close(out_a[k], half(full, 0)[k], **ft.tolerance("norm"))


@pytest.mark.parametrize("opt, exc, match", [
    ({"type": "Adam", "params": {"max_grad_norm": 1.0}}, ValueError, "gradient_clipping"),
    ({"type": "Lamb", "params": {"max_grad_norm": 1.0}}, ValueError, "gradient_clipping"),
    ({"type": "Adam", "params": {"amsgrad": True}}, NotImplementedError, "optimizer.params.amsgrad"),
    ({"type": "Adam", "params": {"bias_correction": False, "torch_adam": True}}, ValueError,
     "optimizer.params.bias_correction=false with torch_adam=true"),
    ({"type": "SGD", "params": {"dampening": 0.1}}, NotImplementedError, "optimizer.params.dampening"),
    ({"type": "SGD", "params": {"maximize": True}}, NotImplementedError, "optimizer.params.maximize"),
    ({"type": "RMSprop", "params": {"alpah": 0.9}}, ValueError, "optimizer.params.alpah"),
    ({"type": "RMSprop", "params": {"alpha": -1}}, ValueError, "optimizer 'RMSprop'"),
    ({"type": "Adagrad", "params": {"lr_decay": -1}}, ValueError, "optimizer.params.lr_decay"),
    ({"type": "OneBitAdam", "params": {"freeze_step": 1.5}}, TypeError, "optimizer.params.freeze_step"),
    ({"type": "OneBitAdam", "params": {"amsgrad": True}}, NotImplementedError, "optimizer.params.amsgrad"),
    ({"type": "ZeroOneAdam", "params": {"var_update_scaler": 0}}, ValueError, "optimizer.params.var_update_scaler"),
    ({"type": "OneBitLamb", "params": {"freeze_stepp": 1}}, ConfigKeyError, "optimizer.params.freeze_stepp"),
    ({"type": "Adamm"}, ValueError, "did you mean 'Adam'"),
    ({"type": "sgd"}, ValueError, "did you mean 'SGD'"),
    ({"params": {"lr": 0.1}}, ValueError, "optimizer.type is required"),
    ({"type": "Adam", "params": {"betas": 0.9}}, TypeError, "optimizer.params.betas"),
    ({"type": "Adam", "params": {"betas": [0.9, 1.5]}}, ValueError, "optimizer 'Adam'"),
    ({"type": "Adam", "params": {"lr": -1.0}}, ValueError, "optimizer.params.lr"),
    ({"type": "SGD", "params": {"nesterov": True}}, ValueError, "nesterov"),
    ({"type": "Lamb", "params": {"min_coeff": 2.0, "max_coeff": 1.0}}, ValueError, "min_coeff"),
    ({"type": "Lion", "params": {"eps": 1e-8}}, ConfigKeyError, "optimizer.params.eps"),
])
def test_optimizer_errors_name_the_key(opt, exc, match):
    with pytest.raises(exc, match=re.escape(match)):
        load(base(optimizer=opt))


def test_no_optimizer_section():
    cfg = load(base())
    with pytest.raises(ValueError, match="no optimizer section"):
        cfg.make_optimizer()


# --------------------------------------------------------------------------- schedulers


SCHEDULES = [
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.5, "warmup_num_steps": 4,
                  "warmup_type": "linear"},
     lambda p: schedules.WarmupLR(**p)),
    ("WarmupLR", {"warmup_num_steps": 8},  # warmup_max_lr missing: the optimizer's lr
     lambda p: schedules.WarmupLR(0.25, **p)),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_max_lr": 1.0, "warmup_num_steps": 4},
     lambda p: schedules.WarmupDecayLR(**p)),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 4, "warmup_min_ratio": 0.2},
     lambda p: schedules.WarmupCosineLR(0.25, **p)),  # scales the optimizer's lr
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 0.5, "cycle_first_step_size": 4,
                  "cycle_first_stair_count": 2, "decay_lr_rate": 0.5, "decay_step_size": 2,
                  "cycle_momentum": False},
     lambda p: schedules.OneCycle(**p)),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 3,
                     "lr_range_test_step_rate": 2.0}, lambda p: schedules.LRRangeTest(**p)),
]


@pytest.mark.parametrize("kind, params, direct", SCHEDULES)
def test_each_scheduler_is_fzeros_deepspeed_schedule(kind, params, direct):
    cfg = load(base(optimizer={"type": "AdamW", "params": {"lr": 0.25}},
                    scheduler={"type": kind, "params": params}))
    sched, expected = cfg.make_schedule(), direct(params)
    assert [sched(k) for k in range(40)] == [expected(k) for k in range(40)]
    spec = optim.fused_spec_of(cfg.make_optimizer())  # the schedule is the optimizer's learning rate
    assert spec.kind == "adamw"
    assert [spec.learning_rate(k) for k in range(40)] == [expected(k) for k in range(40)]


def test_scheduler_parameter_names_are_the_schedules_own():
    # fzero.config's table of DeepSpeed's names must agree with fzero.optim.schedules.
    required = {"WarmupDecayLR": {"total_num_steps": 10}, "WarmupCosineLR": {"total_num_steps": 10},
                "OneCycle": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0}}
    for kind, names in _keys._SCHEDULERS.items():
        fn = getattr(schedules, kind)
        for name in names:
            args = (1.0,) if kind == "WarmupCosineLR" else ()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    fn(*args, **{**required.get(kind, {}), name: -1 if name == "last_batch_iteration" else 1})
            except (TypeError, ValueError) as e:
                assert "unknown parameter" not in str(e), (kind, name)


def test_warmup_cosine_without_an_optimizer_needs_a_base_lr():
    cfg = load(base(scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": 10,
                                                                     "warmup_num_steps": 2}}))
    with pytest.raises(ValueError, match="base_lr"):
        cfg.make_schedule()
    assert cfg.make_schedule(base_lr=2.0)(10) == schedules.WarmupCosineLR(
        2.0, total_num_steps=10, warmup_num_steps=2)(10)


def test_one_cycle_momentum_warns_once_when_read():
    with pytest.warns(UserWarning, match="cycle_momentum"):
        cfg = Config.load(base(scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 0.1,
                                                                          "cycle_max_lr": 1.0}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg.make_schedule()


@pytest.mark.parametrize("sched, exc, match", [
    ({"type": "StepLR", "params": {"step_size": 10}}, NotImplementedError, "torch.optim.lr_scheduler.StepLR"),
    ({"type": "CosineAnnealingLR"}, NotImplementedError, "CosineAnnealingLR"),
    ({"type": "warmuplr"}, ValueError, "did you mean 'WarmupLR'"),
    ({"type": "WarmupCosinLR"}, ValueError, "did you mean 'WarmupCosineLR'"),
    ({"params": {}}, ValueError, "scheduler.type is required"),
    ({"type": "WarmupLR", "params": {"warmup_max_lrr": 0.1}}, ConfigKeyError,
     "did you mean 'scheduler.params.warmup_max_lr'"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, ValueError, "scheduler 'WarmupLR'"),
    ({"type": "WarmupDecayLR", "params": {}}, TypeError, "total_num_steps"),
])
def test_scheduler_errors_name_the_key(sched, exc, match):
    with pytest.raises(exc, match=re.escape(match)):
        load(base(scheduler=sched))


# --------------------------------------------------------------------------- keys


@pytest.mark.parametrize("d, path, nearest", [
    ({"train_batch_sise": 8}, "train_batch_sise", "train_batch_size"),
    (base(gradient_clipings=1.0), "gradient_clipings", "gradient_clipping"),
    (base(zero_optimization={"stag": 2}), "zero_optimization.stag", "zero_optimization.stage"),
    (base(zero_optimization={"stage": 2, "reduce_bucket_sise": 1}), "zero_optimization.reduce_bucket_sise",
     "zero_optimization.reduce_bucket_size"),
    (base(fp16={"enabled": True, "loss_scale_windw": 10}), "fp16.loss_scale_windw", "fp16.loss_scale_window"),
    (base(bf16={"enable": True}), "bf16.enable", "bf16.enabled"),
    # an old name in DeepSpeed's constants.py that DeepSpeedBF16Config (extra="forbid") refuses
    (base(bf16={"enabled": True, "check_overflow": False}), "bf16.check_overflow", "bf16.check_grad_overflow"),
    (base(optimizer={"typ": "Adam"}), "optimizer.typ", "optimizer.type"),
    (base(optimizer={"type": "Adam", "params": {"betas1": 0.9}}), "optimizer.params.betas1",
     "optimizer.params.betas"),
    (base(scheduler={"type": "WarmupLR", "parms": {}}), "scheduler.parms", "scheduler.params"),
])
def test_unknown_keys_name_the_key_and_the_nearest_valid_one(d, path, nearest):
    with pytest.raises(ConfigKeyError) as e:
        load(d)
    assert isinstance(e.value, KeyError) and isinstance(e.value, ValueError)
    msg = str(e.value)
    assert f"unknown key {path!r}" in msg and f"did you mean {nearest!r}?" in msg


@pytest.mark.parametrize("d, key", [
    (base(amp={"enabled": True, "opt_level": "O1"}), "amp"),
    (base(torch_autocast={"enabled": True, "dtype": "float16"}), "torch_autocast.dtype"),
    (base(elasticity={"enabled": True}), "elasticity"),
    (base(data_efficiency={"enabled": True}), "data_efficiency"),
    (base(sparse_attention={"mode": "fixed"}), "sparse_attention"),
    (base(compression_training={"weight_quantization": {}}), "compression_training"),
    (base(data_types={"grad_accum_dtype": "bf16"}), "data_types"),
    (base(gradient_allreduce_op="sum"), "gradient_allreduce_op"),
    (base(zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}}),
     "zero_optimization.offload_param.device"),
    (base(zero_optimization={"stage": 2, "offload_optimizer": {"device": "nvme"}}),
     "zero_optimization.offload_optimizer.device"),
    (base(zero_optimization={"stage": 2, "cpu_offload": True}), "zero_optimization.cpu_offload"),
    (base(zero_optimization={"stage": 3, "zero_quantized_gradients": True}),
     "zero_optimization.zero_quantized_gradients"),
    (base(zero_optimization={"stage": 3, "zero_hpz_partition_size": 8}), "zero_optimization.zero_hpz_partition_size"),
    (base(fp16={"enabled": True, "fp16_master_weights_and_grads": True}), "fp16.fp16_master_weights_and_grads"),
])
def test_deepspeed_features_fzero_does_not_implement_are_named(d, key):
    with pytest.raises(NotImplementedError, match=re.escape(f"{key}=")):
        load(d)


@pytest.mark.parametrize("d", [
    base(amp={"enabled": False}),
    base(torch_autocast={"enabled": False}),
    base(elasticity={"enabled": False}),
    base(data_types={"grad_accum_dtype": "fp32"}),
    base(gradient_allreduce_op="mean"),
    base(zero_optimization={"stage": 2, "offload_optimizer": {"device": "none"}}),
    base(tensorboard={"enabled": False, "output_path": "x"}),
    base(bf16={"enabled": True, "check_grad_overflow": False, "immediate_grad_update": False}),
    base(zero_optimization={"stage": 3, "contiguous_gradients": True, "stage3_max_live_parameters": 1e9,
                            "stage3_prefetch_bucket_size": 5e7, "allgather_bucket_size": 5e8}),
    base(wall_clock_breakdown=False, zero_allow_untested_optimizer=True, vocabulary_size=50304),
])
def test_inactive_or_default_valued_deepspeed_keys_are_accepted_quietly(d):
    assert load(d).ignored == ()


def test_keys_without_effect_are_listed_and_warned_about_once():
    d = base(steps_per_print=100, dump_state=True, comet={"enabled": True},
             zero_optimization={"stage": 2, "allgather_bucket_size": 2e8, "contiguous_gradients": True,
                                "overlap_comm": True},
             fp16={"enabled": True, "auto_cast": True})
    with pytest.warns(UserWarning) as rec:
        cfg = Config.load(d)
    assert len(rec) == 1
    paths = [entry.split(" (")[0] for entry in cfg.ignored]
    assert paths == ["steps_per_print", "dump_state", "comet",
                     "fp16.auto_cast", "zero_optimization.allgather_bucket_size"]
    for p in paths:
        assert p in str(rec[0].message)


def test_an_auto_nothing_fills_is_named_with_how_to_fill_it():
    # Hugging Face's "auto" values are filled (tests/test_config_auto.py); one that nothing
    # fills names its path.
    with pytest.raises(ValueError, match=re.escape("zero_optimization.stage is \"auto\"")):
        load(base(zero_optimization={"stage": "auto"}))


# --------------------------------------------------------------------------- other sections


def test_fp16_settings_reach_the_compile_options():
    cfg = load(base(fp16={"enabled": True, "loss_scale": 128, "initial_scale_power": 12,
                          "loss_scale_window": 500, "hysteresis": 1, "consecutive_hysteresis": True,
                          "min_loss_scale": 0.5}))
    opts = cfg.compile_options()
    assert opts.precision == "fp16" and opts.loss_scale == 128.0
    assert opts.scaler() == {"initial_scale_power": 12, "loss_scale_window": 500,
                             "hysteresis": 1, "consecutive_hysteresis": True,
                             "min_loss_scale": 0.5}
    # the names are fzero.mixed_precision's keyword arguments
    import inspect
    assert set(opts.scaler()) <= set(inspect.signature(fzero.mixed_precision).parameters)


@pytest.mark.parametrize("d, check", [
    (base(bf16={"enabled": True}), True),  # DeepSpeedBF16Config.check_grad_overflow defaults to true
    (base(bf16={"enabled": True, "check_grad_overflow": True}), True),
    (base(bf16={"enabled": True, "check_grad_overflow": False}), False),
    (base(bfloat16={"enabled": True, "check_grad_overflow": False}), False),
    # read under bf16 only: DeepSpeed always checks under fp16 and never under fp32
    (base(fp16={"enabled": True}, bf16={"enabled": False, "check_grad_overflow": False}), True),
])
def test_bf16_check_grad_overflow_reaches_the_compile_options(d, check):
    assert load(d).compile_options().check_grad_overflow is check


def test_bf16_check_grad_overflow_must_be_a_bool():
    with pytest.raises(TypeError, match=re.escape("bf16.check_grad_overflow must be true or false, got 'no'")):
        load(base(bf16={"enabled": True, "check_grad_overflow": "no"}))


@pytest.mark.parametrize("d, precision", [
    (base(), "fp32"),
    (base(fp16={"enabled": False}), "fp32"),
    (base(bf16={"enabled": True}), "bf16"),
    (base(bfloat16={"enabled": True}), "bf16"),  # DeepSpeed's older name
])
def test_precision(d, precision):
    assert load(d).compile_options().precision == precision


@pytest.mark.parametrize("d, match", [
    (base(fp16={"enabled": True}, bf16={"enabled": True}), "both enabled"),
    (base(bf16={"enabled": True}, bfloat16={"enabled": True}), "bfloat16"),
    (base(fp16={"enabled": True, "loss_scale": -1}), "fp16.loss_scale"),
    (base(fp16={"enabled": True, "hysteresis": 0}), "fp16.hysteresis"),
    (base(fp16={"enabled": True, "min_loss_scale": 0}), "fp16.min_loss_scale"),
    (base(fp16={"enabled": "yes"}), "fp16.enabled"),
    (base(fp16=True), "fp16 must be a JSON object"),
    (base(zero_optimization={"stage": 4}), "zero_optimization.stage"),
    (base(zero_optimization={"stage": 2, "reduce_bucket_size": 0}), "zero_optimization.reduce_bucket_size"),
    (base(gradient_clipping=-1.0), "gradient_clipping"),
    (base(communication_data_type="int8"), "communication_data_type"),
])
def test_bad_values_name_the_key(d, match):
    with pytest.raises((ValueError, TypeError), match=re.escape(match)):
        load(d)


@pytest.mark.parametrize("zero, stage", [(True, 1), (False, 0), ({"stage": 3}, 3), ({}, 0)])
def test_zero_stage(zero, stage):
    assert load(base(zero_optimization=zero)).compile_options().zero == stage


@pytest.mark.parametrize("extra, bucket, reduce_in", [
    ({}, 5 * 10**8 * 4, None),                                  # fp32 gradients: 4 bytes each
    ({"communication_data_type": "fp32"}, 5 * 10**8 * 4, None),
    ({"communication_data_type": "fp16"}, 5 * 10**8 * 2, "fp16"),
    ({"communication_data_type": "bfp16"}, 5 * 10**8 * 2, "bf16"),  # DeepSpeed's spelling
])
def test_reduce_bucket_size_is_converted_from_elements_to_bytes(extra, bucket, reduce_in):
    opts = load(base(zero_optimization={"stage": 2, "reduce_bucket_size": 5e8}, **extra)).decided_options()
    assert opts["bucket_bytes"] == bucket
    assert opts.get("reduce_in") == reduce_in
    assert "overlap_comm" not in opts  # only when the config writes it


def test_overlap_comm_is_passed_only_when_written():
    assert load(base(zero_optimization={"stage": 2, "overlap_comm": False})).decided_options()["overlap_comm"] is False


@pytest.mark.parametrize("clip, clip_norm", [(None, 1.0), (0, None), (0.0, None), (0.5, 0.5)])
def test_gradient_clipping(clip, clip_norm):
    d = base() if clip is None else base(gradient_clipping=clip)
    assert load(d).compile_options().clip_norm == clip_norm


def test_accumulate_is_gradient_accumulation_steps_and_splits_the_local_batch():
    cfg = load({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert cfg.compile_options().accumulate == 8 and cfg.local_batch_size == 32


# --------------------------------------------------------------------------- files


def test_malformed_json_names_the_file_line_and_column(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,}\n}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:3:")):
        Config.load(path)


def test_duplicate_keys_not_an_object_and_missing_files(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ValueError, match="duplicate key 'train_batch_size'"):
        Config.load(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must be a JSON object"):
        Config.load(path)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        Config.load(tmp_path / "nope.json")
    with pytest.raises(TypeError, match="fzero.Config.load"):
        Config.load(42)


def test_errors_in_a_file_name_the_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(base(zero_optimization={"stag": 1})))
    with pytest.raises(ConfigKeyError, match=re.escape(f"{path}: unknown key 'zero_optimization.stag'")):
        Config.load(path)


# --------------------------------------------------------------------------- the API


def _state():
    apply, params = fzero.functionalize(torch.nn.Linear(2, 1))
    return fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))


def test_install_puts_the_config_optimizer_into_the_state():
    state = _state()
    cfg = load(base(optimizer={"type": "AdamW", "params": {"lr": 0.01}},
                    scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10}}))
    new = cfg.install(state)
    spec = optim.fused_spec_of(new.tx)
    assert spec.kind == "adamw" and callable(spec.learning_rate)
    assert int(new.opt_state[0].count) == 0  # a fresh ScaleByAdamState
    assert load(base()).install(state) is state
    with pytest.raises(NotImplementedError, match="scheduler section without an optimizer"):
        load(base(scheduler={"type": "WarmupLR"})).install(state)


def test_sections_are_keyword_only_frozen_and_checked_on_construction():
    cfg = Config(train_batch_size=8, optimizer=OptimizerConfig(type="lion"),
                 zero_optimization=ZeroConfig(stage=2), bf16=BF16Config(enabled=True))
    assert cfg.optimizer.type == "Lion" and cfg.precision == "bf16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.gradient_clipping = 0.0
    with pytest.raises(TypeError):
        FP16Config(True)  # keyword-only
    with pytest.raises(ValueError, match="zero_optimization.stage"):
        ZeroConfig(stage=5)
    with pytest.raises(TypeError, match="optimizer must be a OptimizerConfig"):
        Config(train_batch_size=8, optimizer={"type": "Adam"})
    with pytest.raises(NotImplementedError):
        SchedulerConfig(type="StepLR")
    for cls in (Config, OptimizerConfig, SchedulerConfig, FP16Config, BF16Config, ZeroConfig):
        assert cls.__doc__


def test_doctests():
    tried = 0
    for module in (fconfig, _config, _keys, _load, _sections, _values):
        failures, n = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert failures == 0, module.__name__
        tried += n
    assert tried > 0



def test_configs_pickle_for_spawned_ranks():
    import pickle

    cfg = load(base(optimizer={"type": "Adam", "params": {"betas": [0.9, 0.95]}},
                    scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 5}}), world_size=2)
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and again.optimizer.params == {"betas": [0.9, 0.95]}
    assert triple(load(again, world_size=4)) == (8, 2, 1)  # the given values travel too


def test_deepspeed_readme_sample_runs_through_compile():
    """DeepSpeed's README config, unchanged, drives a real compiled step."""
    torch.manual_seed(0)
    apply, params = fzero.functionalize(torch.nn.Linear(4, 2))
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=fzero.optim.sgd(1.0))

    step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), config=README_SAMPLE)
    assert step.options.zero == 1 and step.options.precision == "fp16"
    state = step.init(state)
    assert state.params["weight"].dtype == torch.float16
    state, metrics = step(state, {"x": torch.randn(8, 4), "y": torch.randn(8, 2)})
    assert {"loss", "loss_scale", "skipped"} <= set(metrics)
    assert float(metrics["loss_scale"]) == 2.0 ** 16


@pytest.mark.parametrize("check", [None, True, False])
def test_bf16_check_grad_overflow_drives_the_compiled_step(check):
    """bf16.check_grad_overflow (DeepSpeed's default: true) decides whether a compiled bf16
    step skips an update whose gradients are not finite."""
    section = {"enabled": True} if check is None else {"enabled": True, "check_grad_overflow": check}
    torch.manual_seed(0)
    apply, params = fzero.functionalize(torch.nn.Linear(4, 2))
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=fzero.optim.sgd(0.1))

    step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), config=base(bf16=section))
    state = step.init(state)
    x = torch.randn(8, 4)
    x[0, 0] = float("inf")
    state, metrics = step(state, {"x": x, "y": torch.randn(8, 2)})
    assert "loss_scale" not in metrics
    master_finite = all(bool(torch.isfinite(m).all()) for m in state.master.values())
    if check is False:
        assert "skipped" not in metrics and not master_finite and int(state.step) == 1
    else:
        assert bool(metrics["skipped"]) and master_finite and int(state.step) == 0


def test_autotp_size_asks_compile_for_the_automatic_plan():
    cfg = load(base(tensor_parallel={"autotp_size": 2}))
    assert cfg.autotp_size == 2 and cfg.decided_options()["tp"] == "auto"
    assert "tp" not in load(base(tensor_parallel={"autotp_size": 1})).decided_options()
    with pytest.raises(ConfigKeyError, match=r"tensor_parallel.tp_size: fzero reads only tensor_parallel.autotp_size"):
        load(base(tensor_parallel={"autotp_size": 2, "tp_size": 2}))
    # the mesh of this process has no tp axis: compile names both sizes
    with pytest.raises(ValueError, match=r"autotp_size=2 but Mesh\(pp=1, dp=1, tp=1.*has tp=1"):
        fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), config=base(tensor_parallel={"autotp_size": 2}))


def test_sequence_parallel_size_is_read_and_checked_against_the_mesh_sp_axis():
    assert load(base(sequence_parallel_size=2)).sequence_parallel_size == 2
    assert load(base()).sequence_parallel_size == 1
    with pytest.raises(ValueError, match=r"sequence_parallel_size.*at least 1|sequence_parallel_size.*>= 1"):
        load(base(sequence_parallel_size=0))
    # the mesh of this process has no sp axis: compile names both sizes
    with pytest.raises(ValueError, match=r"sequence_parallel_size=2 but Mesh\(pp=1, dp=1, tp=1.*has sp=1"):
        fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), config=base(sequence_parallel_size=2))
    fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), config=base(sequence_parallel_size=1))


def test_the_pipeline_section_is_read_and_checked_against_the_mesh():
    with pytest.warns(UserWarning, match="pipeline.partition"):
        cfg = Config.load(base(pipeline={"stages": 2, "partition": "uniform", "activation_checkpoint_interval": 1}))
    assert cfg.pipeline_stages == 2
    assert [e.split(" (")[0] for e in cfg.ignored] == ["pipeline.partition", "pipeline.activation_checkpoint_interval"]
    assert load(base(pipeline={"stages": "auto"})).pipeline_stages == 0
    assert load(base()).pipeline_stages is None
    with pytest.raises(ConfigKeyError, match=r"unknown key 'pipeline.stage'; did you mean 'pipeline.stages'\?"):
        load(base(pipeline={"stage": 2}))
    with pytest.raises(ValueError, match=r"the config has a pipeline section: pass pipeline=fzero.pipeline"):
        fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), config=base(pipeline={"stages": 2}))


def test_comms_logger_enabled_is_compile_comm_bytes():
    """DeepSpeed's comms_logger.enabled asks each step's metrics for the bytes this rank sent
    (compile(comm_bytes=)); its printing knobs are accepted with no effect."""
    cfg = load(base(comms_logger={"enabled": True}))
    assert cfg.comms_logger is True and cfg.compile_options().comm_bytes is True
    assert cfg.decided_options()["comm_bytes"] is True
    assert load(base(comms_logger={"enabled": False})).decided_options()["comm_bytes"] is False
    assert load(base(comms_logger={})).compile_options().comm_bytes is False  # DeepSpeed's default
    assert load(base()).comms_logger is None and "comm_bytes" not in load(base()).decided_options()
    # DeepSpeed's defaults of the other keys are quiet; other values are listed, as every no-op key
    assert load(base(comms_logger={"enabled": True, "verbose": False, "prof_all": True, "prof_ops": [],
                                   "debug": False})).ignored == ()
    with pytest.warns(UserWarning, match="comms_logger.verbose"):
        cfg = Config.load(base(comms_logger={"enabled": True, "verbose": True, "prof_all": False,
                                             "prof_ops": ["all_reduce"], "debug": True}))
    assert [e.split(" (")[0] for e in cfg.ignored] == [
        "comms_logger.verbose", "comms_logger.prof_all", "comms_logger.prof_ops", "comms_logger.debug"]
    with pytest.raises(ConfigKeyError, match=r"unknown key 'comms_logger.enable'; did you mean 'comms_logger.enabled'"):
        load(base(comms_logger={"enable": True}))
    with pytest.raises(TypeError, match=r"comms_logger.enabled must be true or false, got 1"):
        load(base(comms_logger={"enabled": 1}))
    with pytest.raises(TypeError, match=r"comms_logger must be a JSON object"):
        load(base(comms_logger=True))


def test_comms_logger_reaches_the_compiled_step_and_a_keyword_may_not_contradict_it():
    apply, params = fzero.functionalize(torch.nn.Linear(4, 2))
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=fzero.optim.sgd(0.1))
    step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), config=base(comms_logger={"enabled": True}))
    assert step.options.comm_bytes is True
    _, metrics = step(step.init(state), {"x": torch.randn(8, 4), "y": torch.randn(8, 2)})
    assert list(metrics["comm_bytes"]) == ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send",
                                         "total"]
    assert metrics["comm_bytes"]["total"] == 0  # one process sends nothing
    assert fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), config=base(), comm_bytes=True).options.comm_bytes
    with pytest.raises(ValueError, match=r"comm_bytes=False contradicts the config's comm_bytes=True"):
        fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), config=base(comms_logger={"enabled": True}), comm_bytes=False)


def test_offload_optimizer_to_the_cpu_is_compile_offload_optimizer():
    """zero_optimization.offload_optimizer {"device": "cpu", "pin_memory": ...} decides
    compile(offload_optimizer="cpu", pin_memory=...); "none" or no section offloads nothing."""
    cfg = load(base(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}))
    assert cfg.decided_options()["offload_optimizer"] == "cpu" and cfg.decided_options()["pin_memory"] is True
    assert cfg.compile_options().offload_optimizer == "cpu" and cfg.compile_options().pin_memory is True
    off = load(base(zero_optimization={"stage": 1, "offload_optimizer": {"device": "none"}})).compile_options()
    assert off.offload_optimizer == "none"
    assert "offload_optimizer" not in load(base(zero_optimization={"stage": 1})).decided_options()


@pytest.mark.parametrize("offload, error, message", [
    ({"device": "nvme", "nvme_path": "/local"}, NotImplementedError,
     r"zero_optimization\.offload_optimizer\.device='nvme': NVMe offload is not supported"),
    ({"device": "gpu"}, ValueError, r"zero_optimization\.offload_optimizer\.device must be"),
    ({"device": "cpu", "ratio": 0.5}, NotImplementedError, r"zero_optimization\.offload_optimizer\.ratio=0\.5"),
    ({"device": "cpu", "pin_memroy": True}, ConfigKeyError,
     r"did you mean 'zero_optimization\.offload_optimizer\.pin_memory'"),
])
def test_offload_optimizer_settings_fzero_does_not_run_are_named_by_key_path(offload, error, message):
    with pytest.raises(error, match=message):
        load(base(zero_optimization={"stage": 2, "offload_optimizer": offload}))


def test_offload_optimizer_needs_a_zero_stage():
    with pytest.raises(ValueError, match=r"offload_optimizer\.device=\"cpu\" needs zero_optimization\.stage 1, 2 "
                                         r"or 3.*got stage 0"):
        load(base(zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu"}}))
    with pytest.raises(ValueError, match=r"fzero\.compile: offload_optimizer='cpu' needs ZeRO stage 1, 2 or 3"):
        fzero.compile(lambda s, b: (s, {}), offload_optimizer="cpu")
    with pytest.raises(ValueError, match=r"offload_optimizer='disk' must be 'none' or 'cpu'"):
        fzero.compile(lambda s, b: (s, {}), zero=1, offload_optimizer="disk")


def test_one_table_maps_deepspeed_keys_to_compiles_options_and_the_docs_show_it():
    """docs/config.md's table is fzero/config/_options.py's: the same fields, the same keys,
    in the same order; and every field it names is a CompileOptions field."""
    import dataclasses
    from pathlib import Path

    from fzero.config._options import OPTIONS

    text = (Path(__file__).parents[1] / "docs" / "config.md").read_text()
    lines = text[text.index("### The one table"):].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| field"))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        field, keys = [c.strip() for c in ln.strip().strip("|").split(" | ")][:2]
        rows.append((field.strip("`"), tuple(k.strip().strip("`") for k in keys.split(","))))
    assert rows == [(row.field, row.keys) for row in OPTIONS]
    fields = {f.name for f in dataclasses.fields(fzero.CompileOptions)}
    assert {row.field for row in OPTIONS} <= fields
    # every decided field comes from the table, by that name
    cfg = load({"train_batch_size": 8, "fp16": {"enabled": True}, "communication_data_type": "bf16",
                "zero_optimization": {"stage": 2, "reduce_bucket_size": 100, "overlap_comm": False,
                                      "offload_optimizer": {"device": "cpu", "pin_memory": True}},
                "comms_logger": {"enabled": True}, "wall_clock_breakdown": True})
    assert set(cfg.decided_options()) <= {row.field for row in OPTIONS}
    assert cfg.decided_options()["bucket_bytes"] == 200 and cfg.decided_options()["reduce_in"] == "bf16"


def test_a_torch_optim_name_is_built_as_deepspeed_builds_it_and_gated_under_zero_as_deepspeed_gates_it():
    """DeepSpeed: torch.optim.<type>(params, **optimizer.params); under ZeRO a class outside
    its tested list needs zero_allow_untested_optimizer."""
    torch.manual_seed(2)
    model = ft.Blocks(3, 5, 1, 2)
    hp = {"lr": 0.02, "alpha": 0.9, "momentum": 0.5, "centered": True}
    g = torch.Generator().manual_seed(3)
    batches = [{"x": torch.randn(4, 3, generator=g), "y": torch.randn(4, 2, generator=g)} for _ in range(4)]
    expected = ft.torch_mse_steps(model, lambda ps: torch.optim.RMSprop(ps, **hp), batches)
    apply, params = fzero.functionalize(model)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "optimizer": {"type": "RMSprop", "params": hp},
           "zero_optimization": {"stage": 2}}
    with pytest.raises(ValueError, match=r"optimizer.type='RMSprop'.*zero_optimization.stage 2.*"
                                         r"\"zero_allow_untested_optimizer\": true"):
        load(cfg)
    step = fzero.compile(ft.mse_step, config={**cfg, "zero_allow_untested_optimizer": True})
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.0)))
    state, _ = ft.run_steps(step, state, batches)
    ft.assert_trees_close(fzero.gather(state.params), expected, rtol=1e-5, atol=1e-7)
    assert step.config.optimizer.kind == "torch" and step.config.optimizer.hyperparameters()["eps"] == 1e-8
    assert load({**cfg, "zero_optimization": {"stage": 0}}).optimizer.type == "RMSprop"  # stage 0: no gate


def test_zero_allow_untested_optimizer_is_read_and_a_client_tx_needs_no_permission():
    """A client tx (fzero's own or from_torch) runs exactly at every stage: it trains the same
    with and without the key."""
    assert load(base(zero_allow_untested_optimizer=True)).zero_allow_untested_optimizer is True
    assert load(base()).zero_allow_untested_optimizer is False
    with pytest.raises(TypeError, match="zero_allow_untested_optimizer must be true or false"):
        load(base(zero_allow_untested_optimizer="yes"))
    losses = []
    for allow in (True, False):
        torch.manual_seed(0)
        apply, params = fzero.functionalize(ft.Blocks(3, 4, 1, 2))
        tx = optim.chain(optim.scale_by_lion(), optim.scale(-1e-2))  # a chain of one's own
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=tx)
        step = fzero.compile(ft.mse_step, config={"train_micro_batch_size_per_gpu": 4, "zero_allow_untested_optimizer":
                                                  allow, "zero_optimization": {"stage": 2}})
        state = step.init(state)
        state, m = step(state, {"x": torch.ones(4, 3), "y": torch.zeros(4, 2)})
        losses.append(float(m["loss"]))
    assert losses[0] == losses[1]


def test_stage3_max_reuse_distance_decides_compiles_max_reuse_distance_under_either_name():
    """DeepSpeed's stage3_max_reuse_distance (or max_reuse_distance) is compile's
    max_reuse_distance, as written; not written, fzero's default stays; the two names at
    once must agree; a negative one is refused, naming the key."""
    zero = {"train_micro_batch_size_per_gpu": 1}
    for written, want in (({"stage3_max_reuse_distance": 1e9}, 1e9), ({"max_reuse_distance": 0}, 0.0),
                          ({"stage3_max_reuse_distance": 7, "max_reuse_distance": 7}, 7.0)):
        cfg = load({**zero, "zero_optimization": {"stage": 3, **written}}, world_size=1)
        assert cfg.decided_options()["max_reuse_distance"] == want and cfg.compile_options().max_reuse_distance == want
    assert "max_reuse_distance" not in load({**zero, "zero_optimization": {"stage": 3}}, world_size=1).decided_options()
    with pytest.raises(ValueError, match=r"stage3_max_reuse_distance=5 and max_reuse_distance=6 are one setting"):
        load({**zero, "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 5, "max_reuse_distance": 6}},
             world_size=1)
    with pytest.raises(ValueError, match=r"zero_optimization\.stage3_max_reuse_distance must be a finite number >= 0"):
        load({**zero, "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": -5}}, world_size=1)
