"""DeepSpeed configs as users have them: Hugging Face's ``"auto"`` values, every problem in
one error, keys DeepSpeed does not read, and ``fzero config check``.

The reference for ``"auto"`` is Hugging Face's own filler,
``transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig`` (``trainer_config_process``
then ``trainer_config_finalize``), run on the same files by ``benchmarks/record_hf_auto.py``
(it needs DeepSpeed and accelerate, so its output is recorded in
``tests/data/hf_auto_filled.json``): fzero must read a file with its ``"auto"`` values into
the same ``Config`` as the file Hugging Face filled.
"""

from __future__ import annotations

import copy
import json
import re
import types
import warnings
from pathlib import Path

import pytest
import torch

import fzero
from fzero import optim
from fzero.cli.main import main as cli
from fzero.config import Config, ConfigKeyError
from fzero.config import ConfigError

RECORDED = json.loads((Path(__file__).parent / "data" / "hf_auto_filled.json").read_text())["cases"]
HF_STYLE = RECORDED[0]["config"]  # the shape of the configs Hugging Face's examples ship


def hf_args(case):
    """A recorded case's TrainingArguments fields with the two values the filler took apart
    (the training steps and the model's hidden size), as fzero's ``auto=`` takes them."""
    return types.SimpleNamespace(**case["args"], max_steps=case["max_steps"], hidden_size=case["hidden_size"])


def quiet_load(src, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return Config.load(src, **kw)


@pytest.mark.parametrize("case", RECORDED, ids=lambda c: f"zero{c['config']['zero_optimization']['stage']}")
def test_auto_is_filled_as_hugging_face_fills_it(case):
    """The file with its "auto" values and Hugging Face's arguments reads into the same
    Config as the file Hugging Face filled (recorded by benchmarks/record_hf_auto.py)."""
    args = hf_args(case)
    world = case["args"]["world_size"]
    expected = quiet_load(case["filled"], world_size=world)
    got = quiet_load(case["config"], world_size=world, auto=args)
    assert got == expected
    assert got.pending == ()
    assert got.compile_options() == expected.compile_options()
    for count in (0, 5, 10, 50, case["max_steps"] - 1):
        assert got.make_schedule()(count) == expected.make_schedule()(count)
    assert got.auto["optimizer.params.lr"] == (case["args"]["learning_rate"], "auto=")


def test_auto_names_and_dotted_paths_mix():
    got = quiet_load(HF_STYLE, auto={"learning_rate": 1e-3, "per_device_train_batch_size": 8,
                                     "scheduler.params.total_num_steps": 50, "adam_beta1": 0.85,
                                     "optimizer.params.eps": 1e-7, "weight_decay": 0.0})
    assert got.optimizer.params == {"lr": 1e-3, "betas": [0.85, 0.999], "eps": 1e-7, "weight_decay": 0.0}
    assert (got.train_micro_batch_size_per_gpu, got.gradient_accumulation_steps, got.train_batch_size) == (8, 1, 8)
    assert got.scheduler.params["total_num_steps"] == 50
    # nothing says the hidden size until a state does: the bucket waits for step.init
    assert got.pending == ("zero_optimization.reduce_bucket_size",)


class _Model(torch.nn.Module):
    """A small model that says its hidden size the way Hugging Face models do."""

    def __init__(self, hidden=64):
        super().__init__()
        torch.manual_seed(0)
        self.config = types.SimpleNamespace(hidden_size=hidden)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


def _train_step(state, batch):
    x, y = batch
    loss, grads = fzero.value_and_grad(lambda p: (state.apply_fn(p, x) - y).pow(2).mean())(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def _run(config, steps=4, tx=None, **compile_kw):
    apply, params = fzero.functionalize(_Model())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=tx)  # the config's optimizer is installed
    step = fzero.compile(_train_step, config=config, **compile_kw)
    state = step.init(state)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        batch = (torch.randn(8, 6, generator=gen), torch.randn(8, 1, generator=gen))
        state, metrics = step(state, batch)
        losses.append(metrics["loss"].item())
    return step, losses, fzero.gather(state.params)


@pytest.mark.filterwarnings("ignore:fzero.Config. these keys have no effect")
def test_compile_fills_auto_from_its_keywords_the_model_and_the_first_batch(capsys):
    """The optimizer's values come from auto= (the Trainer's argument names), accumulation
    and clipping from compile's keywords, the bucket from the model's hidden size, the
    micro-batch from the first batch (8 samples / 2): the run, from a state created without
    an optimizer, is bit for bit the one with the config Hugging Face filled for the same
    arguments."""
    case = RECORDED[0]
    a = case["args"]
    names = ("learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "warmup_steps")
    step, losses, params = _run(case["config"], accumulate=a["gradient_accumulation_steps"],
                                clip_norm=a["max_grad_norm"],
                                auto={"max_steps": case["max_steps"], **{k: a[k] for k in names}})
    err = capsys.readouterr().err
    _, ref_losses, ref_params = _run(case["filled"])
    assert losses == ref_losses
    assert all(torch.equal(params[k], ref_params[k]) for k in params)
    cfg = step.config
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.train_batch_size) == (4, 2, 8)
    assert cfg.zero_optimization.reduce_bucket_size == 64 * 64
    assert cfg.pending == ()
    # every filled value is reported once: at init, then the batch sizes at the first call
    assert err.count("optimizer.params.lr = 0.0003: auto=") == 1
    assert err.count("train_micro_batch_size_per_gpu = 4: the first batch") == 1
    assert err.count("gradient_accumulation_steps = 2: fzero.compile's keyword") == 1
    assert err.count("zero_optimization.reduce_bucket_size = 4096: the model's hidden size 64") == 1


def test_without_a_hidden_size_the_bucket_is_fzeros_default():
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(6, 1)

        def forward(self, x):
            return self.net(x)

    apply, params = fzero.functionalize(Plain())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1, "reduce_bucket_size": "auto"}}
    step = fzero.compile(_train_step, config=config)
    step.init(state)
    assert step.config.zero_optimization.reduce_bucket_size is None
    assert "fzero's default bucket" in step.config.auto["zero_optimization.reduce_bucket_size"][1]


def test_an_auto_nothing_can_fill_names_its_path_and_how_to_fill_it():
    with pytest.raises(ValueError, match=re.escape('scheduler.params.total_num_steps is "auto"')) as e:
        quiet_load(HF_STYLE)
    assert "max_steps" in str(e.value)
    config = {"train_batch_size": 8, "zero_optimization": {"stage": "auto"}}
    with pytest.raises(ValueError, match=re.escape("auto={'zero_optimization.stage': value}")):
        quiet_load(config)
    assert quiet_load(config, options={"stage": 2}).zero_optimization.stage == 2


def test_optimizer_autos_take_the_trainers_defaults_not_the_placeholder_optimizer(capsys):
    """What Hugging Face's Trainer fills with no arguments given: TrainingArguments' own
    defaults (weight decay 0.0), not the values of the optimizer handed to
    TrainState.create (adamw's weight decay is torch's 0.01), which the config's replaces."""
    import dataclasses

    transformers = pytest.importorskip("transformers")
    # the defaults of its fields (an instance wants accelerate, which is not a test dependency)
    hf = types.SimpleNamespace(**{f.name: f.default for f in dataclasses.fields(transformers.TrainingArguments)})
    apply, params = fzero.functionalize(_Model())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-3))
    config = {"train_micro_batch_size_per_gpu": 8,
              "optimizer": {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": 1}}}
    step = fzero.compile(_train_step, config=config)
    state = step.init(state)
    assert step.config.optimizer.params == {"lr": hf.learning_rate, "betas": [hf.adam_beta1, hf.adam_beta2],
                                            "eps": hf.adam_epsilon, "weight_decay": hf.weight_decay}
    assert step.config.scheduler.params["warmup_max_lr"] == hf.learning_rate
    spec = optim.fused_spec_of(state.tx)
    assert (spec.weight_decay, spec.b1, spec.b2, spec.eps) == (0.0, 0.9, 0.999, 1e-8)
    assert "optimizer.params.weight_decay = 0.0: Hugging Face's default weight_decay" in capsys.readouterr().err
    # auto= names it: that wins
    step = fzero.compile(_train_step, config=config, auto={"weight_decay": 0.1, "learning_rate": 2e-4})
    step.init(fzero.TrainState.create(apply_fn=apply, params=params))
    assert (step.config.optimizer.params["weight_decay"], step.config.optimizer.params["lr"]) == (0.1, 2e-4)
    assert step.config.scheduler.params["warmup_max_lr"] == 2e-4


def test_a_state_without_an_optimizer_needs_a_config_that_has_one():
    apply, params = fzero.functionalize(_Model())
    state = fzero.TrainState.create(apply_fn=apply, params=params)
    assert state.tx is None and state.opt_state is None
    with pytest.raises(RuntimeError, match="fzero.compile: step.init: the state has no optimizer: TrainState.create "
                                           "was given no tx= and no config installed one"):
        fzero.compile(_train_step).init(state)
    with pytest.raises(RuntimeError, match="fzero.compile: step.init: the state has no optimizer"):
        fzero.compile(_train_step, config={"train_batch_size": 8}).init(state)
    with pytest.raises(RuntimeError, match="fzero.mixed_precision: step.init: the state has no optimizer"):
        fzero.mixed_precision(_train_step).init(state)
    with pytest.raises(RuntimeError, match="fzero.TrainState.apply_gradients: the state has no optimizer"):
        _train_step(state, (torch.randn(2, 6), torch.randn(2, 1)))


def test_pending_auto_values_block_building_the_optimizer_until_filled():
    cfg = quiet_load(HF_STYLE, auto={"max_steps": 10})
    assert not [p for p in cfg.pending if p.startswith(("optimizer.", "scheduler."))]
    assert optim.fused_spec_of(cfg.make_optimizer()).weight_decay == 0.0  # Hugging Face's defaults: nothing waits
    with pytest.raises(ValueError, match="micro-batch size is \"auto\""):
        cfg.local_batch_size


def test_every_problem_of_a_file_is_in_one_error(tmp_path):
    bad = {"train_batch_size": 8,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "amsgrad": True, "lrr": 2}},
           "zero_optimization": {"stage": 2, "zero_quantized_gradients": True,
                                 "offload_param": {"device": "cpu", "pin_memory": True, "buffer_count": 5}},
           "fp16": {"enabled": True, "loss_scale_windw": 100},
           "amp": {"enabled": True, "opt_level": "O1"}, "sequence_parallel_size": 0, "gradient_clipping": "x"}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ConfigError) as e:
        quiet_load(str(path))
    paths = [p for p, _ in e.value.problems]
    assert sorted(paths) == sorted(["optimizer.params.amsgrad", "optimizer.params.lrr", "fp16.loss_scale_windw",
                                    "zero_optimization.zero_quantized_gradients", "zero_optimization.offload_param",
                                    "amp", "sequence_parallel_size", "gradient_clipping"])
    text = str(e.value)
    assert text.startswith(f"fzero.Config: {path}: 8 problems")
    assert "did you mean 'fp16.loss_scale_window'" in text
    assert "{'" not in text and "'device'" not in text  # no section pasted into the message
    # it is every kind a single problem raises, so existing handlers still catch it
    for kind in (ConfigKeyError, KeyError, ValueError, NotImplementedError, TypeError):
        assert isinstance(e.value, kind)
    # one problem keeps its own kind and message
    with pytest.raises(NotImplementedError, match=r"^fzero.Config: amp=\{\.\.\.\}: a DeepSpeed option"):
        quiet_load({"train_batch_size": 8, "amp": {"enabled": True}})


def test_keys_deepspeed_does_not_read_are_accepted_with_one_warning():
    config = {"train_batch_size": 8, "_comment": "x", "cuda_visible_devices": "0,1", "comms_config": {"a": 1},
              "monitor_config": {"enabled": True}, "sequence_parallel_size": 1, "steps_per_print": 10}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = Config.load(config)
    assert len(caught) == 1
    message = str(caught[0].message)
    for key in ("cuda_visible_devices", "comms_config", "monitor_config", "steps_per_print"):
        assert key in message
    assert "_comment" not in message
    assert cfg.train_batch_size == 8
    # a key close to a real one is still a typo
    with pytest.raises(ConfigKeyError, match="did you mean 'train_batch_size'"):
        quiet_load({"train_batch_sise": 8})


def test_speed_knobs_are_never_refused():
    cfg = quiet_load({"train_batch_size": 8, "zero_optimization": {
        "stage": 2, "overlap_comm": False, "sub_group_size": "auto", "allgather_bucket_size": "auto",
        "reduce_scatter": False, "stage3_max_live_parameters": 5, "round_robin_gradients": True}})
    assert cfg.compile_options().overlap_comm is False
    assert cfg.auto["zero_optimization.sub_group_size"] == (None, "no effect in fzero")


def test_config_check_says_what_fzero_does_with_each_key(tmp_path, capsys):
    good = tmp_path / "hf.json"
    good.write_text(json.dumps({"_comment": "a Hugging Face example", **HF_STYLE}))
    assert cli(["config", "check", str(good), "--auto", "max_steps=100", "--accumulate", "4"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[1:] if line.startswith("  ")}
    assert re.search(r"auto\s+100 \(auto=\)", lines["scheduler.params.total_num_steps"])
    assert re.search(r"auto\s+4 \(fzero.compile's keyword\)", lines["gradient_accumulation_steps"])
    assert re.search(r"used\s+3 -> the ZeRO stage", lines["zero_optimization.stage"])
    assert re.search(r"no effect\s+configures DeepSpeed's save_16bit_model",
                     lines["zero_optimization.stage3_gather_16bit_weights_on_model_save"])
    assert re.search(r"not read\s+a comment", lines["_comment"])
    assert re.search(r"auto\s+5e-05 \(Hugging Face's default learning_rate\)", lines["optimizer.params.lr"])
    assert out.rstrip().endswith("fzero.compile take this file")
    # the keys come in the file's order, once each
    keys = [line.split()[0] for line in out.splitlines()[1:-1]]
    assert len(keys) == len(set(keys)) and keys[:3] == ["_comment", "fp16.enabled", "fp16.loss_scale"]
    # without max_steps: exit 1 and the problem by its path
    assert cli(["config", "check", str(good)]) == 1
    out = capsys.readouterr().out
    assert "1 problem:" in out and 'scheduler.params.total_num_steps is "auto"' in out


CONFIGS = sorted((Path(__file__).parent / "data" / "ds_configs").glob("*.json"))


@pytest.mark.filterwarnings("ignore:fzero.Config. these keys have no effect")
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_configs_in_the_shapes_projects_ship_train_as_written(path, capsys):
    """Configs written in the shapes public projects ship (DeepSpeed's examples, Megatron,
    Hugging Face's Trainer and Accelerate, launcher extras): `fzero config check` accepts
    each as written and a compiled step trains with it."""
    assert cli(["config", "check", str(path)]) == 0, capsys.readouterr().out
    apply, params = fzero.functionalize(_Model())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-3, weight_decay=0.01))
    step = fzero.compile(_train_step, config=str(path))
    state = step.init(state)
    gen = torch.Generator().manual_seed(0)
    skipped = 0
    for _ in range(3):
        state, metrics = step(state, (torch.randn(16, 6, generator=gen), torch.randn(16, 1, generator=gen)))
        assert torch.isfinite(metrics["loss"])
        skipped += int(bool(metrics["skipped"]))
    assert step.config.pending == ()
    assert int(state.step) == 3 - skipped  # every update applied but those skipped (fp16's first scales)
    assert skipped < 3
