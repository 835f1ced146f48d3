"""``FzeroTrainer`` against ``transformers.Trainer`` itself, with the same arguments.

The reference is Hugging Face's Trainer running the same script: on one process, and on two
real gloo ranks as DDP (accelerate wraps the model). Compared: the losses and learning rates
the Trainer logs at every update, the gradient norm before clipping, and the final weights
-- with gradient accumulation over micro-batches of different padded lengths (the loss
normalised by ``num_items_in_batch``), clipping, and a linear warm-up and decay. Both runs
use a tiny GPT-2 built from a config, without dropout (the Trainer draws its masks from
torch's generator, fzero from its own).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import fzero  # noqa: E402
import fzero.testing as ft  # noqa: E402
from fzero.integrations.transformers import FzeroTrainer, TrainingArguments  # noqa: E402

N_EMBD = 16
RECORDED = Path(__file__).parent / "data" / "hf_trainer_deepspeed.json"


def _rows(n=32, seed=0):
    """Token sequences of 4 to 11 tokens: micro-batches pad to different lengths."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 64, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()}
            for _ in range(n)]


def _collate(rows):
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        mask[i, :n] = 1
        labels[i, :n] = ids[i, :n]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _model():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=N_EMBD, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


ARGS = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-2, weight_decay=0.1,
            warmup_steps=2, max_steps=4, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
            max_grad_norm=0.5, seed=0, disable_tqdm=True)

# A config of Hugging Face's examples' shape, with DeepSpeed's optimizer and scheduler: what
# transformers.Trainer + DeepSpeed give with it is recorded by
# benchmarks/record_hf_trainer_deepspeed.py in tests/data/hf_trainer_deepspeed.json.
DEEPSPEED_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    # torch_adam: DeepSpeed's FusedAdam is a C++ extension built on first use (minutes on a
    # small CPU); torch's AdamW computes the same update.
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto",
                                              "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
}
DEEPSPEED_ARGS = {**ARGS, "max_steps": 6, "warmup_steps": 3, "use_cpu": False}


def _args(out, **kw):
    return TrainingArguments(out, **{**ARGS, "eval_strategy": "steps", "eval_steps": 2,
                                     "per_device_eval_batch_size": 4, **kw})


class Recorder(transformers.TrainerCallback):
    """The callbacks the Trainer calls, in order, with the step they saw."""

    def __init__(self, stop_at=None):
        self.events, self.stop_at = [], stop_at

    def __getattribute__(self, name):
        if name.startswith("on_"):
            def record(args, state, control, **kw):
                self.events.append((name, state.global_step))
                if name == "on_step_end" and state.global_step == self.stop_at:
                    control.should_training_stop = True
                return control
            return record
        return super().__getattribute__(name)


class HeldInEvaluation(transformers.TrainerCallback):
    """The most parameter bytes the model held (not ``meta``) when one of its blocks began a
    forward in evaluation (eval mode), and how many such forwards there were."""

    def __init__(self):
        self.most, self.forwards = 0, 0

    def on_train_begin(self, args, state, control, model=None, **kw):
        def look(block, inputs):
            if not block.training:
                held = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")
                self.most, self.forwards = max(self.most, held), self.forwards + 1

        for block in model.transformer.h:
            block.register_forward_pre_hook(look)


def _train(cls, out, *, resume=None, args=None, stop_at=None, callbacks=(), **kw):
    recorder = Recorder(stop_at)
    args = args or _args(out)
    evals = _rows(8, seed=1) if args.eval_strategy != "no" else None
    trainer = cls(model=_model(), args=args, train_dataset=_rows(), eval_dataset=evals,
                  data_collator=_collate, callbacks=[recorder, *callbacks], **kw)
    trainer.train(resume_from_checkpoint=resume)
    trainer.recorded = recorder.events
    return trainer


def _log(trainer):
    """(step, loss, learning rate, grad norm) as the Trainer logged them, then (step, eval
    loss) of each evaluation."""
    train = [(h["step"], h["loss"], h["learning_rate"], h["grad_norm"]) for h in trainer.state.log_history
             if "loss" in h]
    return train + [(h["step"], h["eval_loss"], 0.0, 0.0) for h in trainer.state.log_history if "eval_loss" in h]


def _weights(trainer):
    """The trained weights, without the keys' part of the attention bias: its gradient is zero
    in exact arithmetic (a bias added to every key shifts each query's scores by a constant,
    which softmax ignores), so what either run computes for it is rounding noise, and Adam
    scales noise of any size to a step of the learning rate."""
    return _drop_key_bias({k: v.detach().clone() for k, v in trainer.model.named_parameters()})


def _drop_key_bias(weights):
    return {k: torch.cat([v[:N_EMBD], v[2 * N_EMBD:]]) if k.endswith("attn.c_attn.bias") else v
            for k, v in weights.items()}


def _assert_same_run(got, ref, *, from_step=1):
    g = [x for x in _log(got) if x[0] >= from_step]
    r = [x for x in _log(ref) if x[0] >= from_step]
    assert [x[0] for x in g] == [x[0] for x in r] and g
    ft.assert_trees_close(torch.tensor([x[1:] for x in g]), torch.tensor([x[1:] for x in r]), tol="fp32",
                          what="logged loss, learning_rate, grad_norm")
    ft.assert_trees_close(_weights(got), _weights(ref), tol="fp32", what="final weights")


def _zero2_config():
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}


def _two_ranks(tmp):
    """On each of 2 gloo ranks: the Trainer (DDP) and FzeroTrainer at ZeRO 0, 1, 3 (fzero=) and
    ZeRO 2 (from a DeepSpeed config with "auto" values), then a resume from checkpoint-2."""
    import torch.distributed as dist

    rank = dist.get_rank()
    ref = _train(transformers.Trainer, f"{tmp}/ref")
    assert ref.args.parallel_mode == transformers.training_args.ParallelMode.DISTRIBUTED
    assert isinstance(ref.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    z0 = _train(FzeroTrainer, f"{tmp}/z0")
    assert z0.fzero_step.options.zero == 0 and z0.fzero_step.mesh.size("dp") == 2
    _assert_same_run(z0, ref)
    assert z0.recorded == ref.recorded  # every callback, in the Trainer's order
    whole = sum(p.numel() * p.element_size() for p in _model().parameters())
    for stage in (1, 3):
        held = HeldInEvaluation()
        # Stage 3 frees every block after its forward (the default window would keep this
        # small model gathered whole for a step).
        options = {"zero": stage, **({"max_reuse_distance": 0} if stage == 3 else {})}
        got = _train(FzeroTrainer, f"{tmp}/z{stage}", fzero=options, callbacks=[held])
        assert got.fzero_step.options.zero == stage
        _assert_same_run(got, ref)  # the evaluation losses too
        if stage == 3:
            # Evaluated a unit (GPT-2 block) at a time: never the whole model on a rank.
            assert held.forwards > 0 and held.most < whole, (held.forwards, held.most, whole)
    # ZeRO 2 from args.deepspeed set after the arguments were made; checkpoint-2 on the way.
    args = _args(f"{tmp}/z2", save_strategy="steps", save_steps=2)
    args.deepspeed = _zero2_config()
    z2 = _train(FzeroTrainer, f"{tmp}/z2", args=args)
    assert z2.fzero_step.options.zero == 2
    _assert_same_run(z2, ref)
    ckpt = f"{tmp}/z2/checkpoint-2"
    assert sorted(os.listdir(f"{tmp}/z2")) == ["checkpoint-2", "checkpoint-4"]
    state = json.loads(open(f"{ckpt}/trainer_state.json").read())
    # two updates, one evaluation
    assert state["global_step"] == 2 and [h["step"] for h in state["log_history"]] == [1, 2, 2]
    assert {"model.safetensors", "trainer_state.json", "training_args.json", "fzero_state"} <= set(os.listdir(ckpt))
    assert not [f for f in os.listdir(ckpt) if f.endswith((".bin", ".pt", ".pth"))]  # no pickle
    # Resumed mid-run: the same later losses and the same final weights as the whole run.
    args = _args(f"{tmp}/z2", save_strategy="no")
    args.deepspeed = _zero2_config()
    resumed = _train(FzeroTrainer, f"{tmp}/z2", args=args, resume=ckpt)
    _assert_same_run(resumed, ref, from_step=3)
    _assert_same_run(resumed, z2)
    # The saved model loads with from_pretrained and generates the reference's tokens.
    z2.save_model(f"{tmp}/z2/final")
    dist.barrier()
    back = transformers.GPT2LMHeadModel.from_pretrained(f"{tmp}/z2/final")
    prompt = torch.tensor([[5, 9, 3]])
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(back.generate(prompt, **kw), ref.model.generate(prompt, **kw))
    return rank


@pytest.mark.multirank
@pytest.mark.slow
def test_two_ranks_equal_the_trainer_with_ddp_at_zero_0_to_3_and_after_a_resume(ranks, tmp_path):
    assert ranks(2).run(_two_ranks, str(tmp_path), timeout_s=400) == [0, 1]


@pytest.mark.slow
def test_one_process_equals_the_trainer(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    # No clipping here (the two-rank test clips): the Trainer logs the gradient norm anyway.
    ref = _train(transformers.Trainer, tmp_path / "ref", args=_args(tmp_path / "ref", max_grad_norm=0.0))
    got = _train(FzeroTrainer, tmp_path / "got", fzero={"zero": 3},
                 args=_args(tmp_path / "got", report_to="tensorboard", max_grad_norm=0.0))
    assert got.fzero_step.options.zero == 3
    _assert_same_run(got, ref)
    assert got.recorded == ref.recorded
    # After train() the module is a normal trained module, not meta tensors.
    assert not any(p.is_meta for p in got.model.parameters())
    assert got.model.lm_head.weight is got.model.transformer.wte.weight
    # predict() on the trained module: the reference's logits.
    test = _rows(4, seed=2)
    ft.assert_trees_close(torch.as_tensor(got.predict(test).predictions[0]),
                          torch.as_tensor(ref.predict(test).predictions[0]), tol="fp32")
    # report_to="tensorboard": Hugging Face's own writer saw every logged loss.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    ft.assert_trees_close(torch.tensor([e.value for e in events.Scalars("train/loss")]),
                          torch.tensor([x[1] for x in _log(ref)[:4]]), tol="fp32")
    # A config with DeepSpeed's optimizer and scheduler: what Trainer + DeepSpeed 0.19.8 gave
    # with it (recorded on one process): its WarmupDecayLR log warm-up, each rate one update
    # late, weight decay on every parameter.
    rec = json.loads(RECORDED.read_text())
    assert (rec["world_size"], rec["config"], rec["args"]) == (1, DEEPSPEED_CONFIG, DEEPSPEED_ARGS)
    args = TrainingArguments(tmp_path / "ds", **{**DEEPSPEED_ARGS, "use_cpu": True})
    args.deepspeed = DEEPSPEED_CONFIG
    ds = _train(FzeroTrainer, tmp_path / "ds", args=args)
    ft.assert_trees_close(torch.tensor(_log(ds)), torch.tensor(rec["log"]), tol="fp32",
                          what="step, loss, learning_rate, grad_norm against Trainer + DeepSpeed")
    digest = {k: [v.sum().item(), v.norm().item()] for k, v in _weights(ds).items()}
    ft.assert_trees_close(torch.tensor(list(digest.values())), torch.tensor(list(rec["weights"].values())),
                          tol="fp32", what="final weights' sums and norms against Trainer + DeepSpeed")
    assert list(digest) == list(rec["weights"])
    # A callback's should_training_stop ends training after that update, as in the Trainer.
    stopped = _train(FzeroTrainer, tmp_path / "stop", stop_at=2,
                     args=_args(tmp_path / "stop", eval_strategy="no", max_grad_norm=0.0))
    assert stopped.state.global_step == 2
    ft.assert_trees_close(torch.tensor([x[1:] for x in _log(stopped)]), torch.tensor([x[1:] for x in _log(ref)[:2]]),
                          tol="fp32")


def test_training_arguments_take_deepspeed_without_the_package(tmp_path):
    args = TrainingArguments(str(tmp_path), deepspeed={"zero_optimization": {"stage": 1}}, report_to="none",
                             use_cpu=True)
    assert args.deepspeed == {"zero_optimization": {"stage": 1}} and args.deepspeed_plugin is None
    with pytest.raises(ImportError, match="DeepSpeed|deepspeed"):
        transformers.TrainingArguments(str(tmp_path), deepspeed={"zero_optimization": {"stage": 1}})


def test_push_to_hub_is_refused_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    trainer = FzeroTrainer(model=_model(), args=_args(str(tmp_path), eval_strategy="no"), data_collator=_collate)
    with pytest.raises(RuntimeError, match=r"push_to_hub: the Hub is offline"):
        trainer.push_to_hub()
    with pytest.raises(NotImplementedError, match=r"push_to_hub=True while offline"):
        FzeroTrainer(model=_model(), args=_args(str(tmp_path), eval_strategy="no", push_to_hub=True))


def test_what_fzero_does_not_carry_over_is_refused_by_name(tmp_path):
    with pytest.raises(NotImplementedError, match=r"label_smoothing_factor=0.1[\s\S]*compute_loss_func"):
        FzeroTrainer(model=_model(), args=_args(str(tmp_path), eval_strategy="no", label_smoothing_factor=0.1),
                     compute_loss_func=lambda *a, **k: 0)
    # Hugging Face's Adafactor keeps a Python int per parameter: not a tensor, so not kept.
    trainer = FzeroTrainer(model=_model(), args=_args(str(tmp_path), eval_strategy="no", optim="adafactor"),
                           train_dataset=_rows(), data_collator=_collate)
    with pytest.raises(TypeError, match=r"Adafactor keeps non-tensor state \['step'\]"):
        trainer.train()


def test_the_trainers_other_torch_optimizers_run_as_themselves(tmp_path):
    """optim="sgd" builds torch.optim.SGD: it runs through fzero.optim.from_torch with the
    Trainer's two groups (decay, and none on biases and norms). (RMSprop and Adagrad run the
    same way; their division by a near-zero running square turns the two runs' gradient
    rounding into differences above the fp32 row, so they are not compared here.)"""
    name = "sgd"

    def args(sub):
        return _args(tmp_path / sub, optim=name, eval_strategy="no", max_grad_norm=0.0, weight_decay=0.1)

    ref = _train(transformers.Trainer, tmp_path / "ref", args=args("ref"))
    got = _train(FzeroTrainer, tmp_path / "got", args=args("got"))
    _assert_same_run(got, ref)


@pytest.mark.multirank
@pytest.mark.slow
def test_the_example_script_runs_under_fzero_launch_with_a_deepspeed_config(tmp_path):
    """examples/hf_trainer.py, a plain Trainer script but for its import, on 2 ranks with
    `--deepspeed ds.json` (ZeRO 3, "auto" values): it trains, evaluates, saves a model that
    loads with from_pretrained."""
    import sys
    from pathlib import Path

    from harness.commands import run_command

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "ds.json").write_text(json.dumps(
        {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "gradient_clipping": "auto", "zero_optimization": {"stage": 3}}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    done = run_command([sys.executable, "-m", "fzero.cli.main", "launch", "--nproc", "2",
                        str(root / "examples" / "hf_trainer.py"), "--output_dir", str(tmp_path / "out"),
                        "--deepspeed", str(tmp_path / "ds.json"), "--max_steps", "2", "--logging_steps", "1"],
                       cwd=tmp_path, env=env, timeout_s=240)
    assert done.returncode == 0, done.output
    # Rank 0 logs each of the 2 updates, the "auto" values it filled, and the evaluation.
    assert done.output.count("'loss'") == 2 and "eval_loss" in done.output, done.output
    assert "train_micro_batch_size_per_gpu = 8" in done.output, done.output
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    assert not any(p.is_meta for p in back.parameters())


def test_an_epoch_that_does_not_split_into_whole_updates_is_refused(tmp_path):
    # 6 rows in micro-batches of 2: 3 batches, not whole updates of 2 micro-batches.
    trainer = FzeroTrainer(model=_model(), args=_args(str(tmp_path), eval_strategy="no", max_steps=-1,
                                                      num_train_epochs=1),
                           train_dataset=_rows(6), data_collator=_collate)
    with pytest.raises(NotImplementedError, match=r"update 2 has 1 micro-batches.*gradient_accumulation_steps=2"):
        trainer.train()


def test_a_config_scheduler_without_its_optimizer_is_refused(tmp_path):
    args = _args(str(tmp_path), eval_strategy="no")
    args.deepspeed = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}
    trainer = FzeroTrainer(model=_model(), args=args, train_dataset=_rows(), data_collator=_collate)
    with pytest.raises(NotImplementedError, match="scheduler section but no optimizer section"):
        trainer.train()


@pytest.mark.slow
def test_bf16_is_close_to_the_trainers_bf16(tmp_path):
    """bf16=True: the Trainer autocasts each op, fzero computes in bf16 with fp32 masters; the
    roundings differ, so the runs agree loosely (the "bf16" row: a few units in the last place
    of bf16's 8-bit mantissa)."""
    ref = _train(transformers.Trainer, tmp_path / "ref", args=_args(tmp_path / "ref", bf16=True, eval_strategy="no"))
    got = _train(FzeroTrainer, tmp_path / "got", args=_args(tmp_path / "got", bf16=True, eval_strategy="no"))
    assert got.fzero_step.options.precision == "bf16"
    ft.assert_trees_close(torch.tensor(_log(got)), torch.tensor(_log(ref)), tol="bf16", what="logged values")
    ft.assert_trees_close(_weights(got), _weights(ref), tol="bf16", what="final weights")


def test_save_total_limit_keeps_the_newest_checkpoints_as_the_trainer_does(tmp_path):
    """save_steps=1 with save_total_limit=2 over 4 updates: Hugging Face's rotation leaves the
    two newest checkpoint-N directories, each a complete fzero checkpoint."""
    got = _train(FzeroTrainer, tmp_path, args=_args(tmp_path, eval_strategy="no", save_strategy="steps", save_steps=1,
                                                    save_total_limit=2))
    kept = sorted(p.name for p in Path(tmp_path).glob("checkpoint-*"))
    assert kept == ["checkpoint-3", "checkpoint-4"], kept
    for name in kept:
        assert (Path(tmp_path) / name / "trainer_state.json").is_file()
        assert (Path(tmp_path) / name / "model.safetensors").is_file()
        fzero.checkpoint.verify(str(Path(tmp_path) / name / "fzero_state"))  # committed, every byte intact
    assert got.state.global_step == 4
