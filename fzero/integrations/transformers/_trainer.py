"""``FzeroTrainer``: Hugging Face's ``Trainer`` whose update is one compiled fzero step.

What stays Hugging Face's: the data loader (its sampler, sharding over ranks and skipping
on resume), ``TrainerState`` and ``trainer_state.json``, callbacks, logging and reporting,
evaluation and prediction, ``checkpoint-N`` folders and their rotation.

What fzero does instead (one ``trainer.fzero_step`` call per update):

* the update's micro-batches (``gradient_accumulation_steps`` of them) are stacked into one
  local batch, which ``fzero.accumulate`` splits again;
* the loss is the model's (``outputs.loss``). Where the Trainer passes ``num_items_in_batch``
  (a model that takes loss keywords), the step asks the model for the summed loss of a
  micro-batch and divides it by the count of labelled items over the whole update, every
  rank and micro-batch, with ``fzero.global_mean``: the Trainer's loss and gradient;
* the optimizer and schedule the Trainer would build (:mod:`._optim`), or the config's
  sections, installed by ``step.init`` as ``deepspeed.initialize`` builds them;
* ZeRO stage, precision, clipping and accumulation from ``args.deepspeed`` (read as
  fzero's config, ``"auto"`` filled from ``args``) or from ``args``.

The module is only code while the state trains (``step.init`` releases its weights to
``meta``); saving and the end of ``train()`` write the trained weights back with
``fzero.load_into`` first, so HF's code there sees a normal module; so does evaluation,
except at ZeRO-3, where the module runs with the partitioned state's weights bound a unit
at a time (``fzero.transforms.shard_state.evaluating``), so no rank holds the whole model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers

import fzero
from fzero.functional import _Bound, _slots
from fzero.integrations.transformers._optim import hf_optimizer, hf_schedule
from fzero.transforms.shard_state import evaluating, release_parameters, units_of

__all__ = ["FzeroTrainer"]

WHERE = "FzeroTrainer"
STATE_DIR = "fzero_state"  # inside checkpoint-N: the fzero checkpoint of the training state
ARGS_NAME = "training_args.json"  # the arguments, as JSON (the plain Trainer pickles them)

logger = logging.getLogger(__name__)

# Pad values when an update's micro-batches differ in length (each collated on its own).
_PAD = {"labels": -100, "attention_mask": 0, "token_type_ids": 0, "position_ids": 0}


class FzeroTrainer(transformers.Trainer):
    """Hugging Face's ``Trainer`` on a compiled fzero step: used as ``Trainer`` is.

    Args:
        model, args, data_collator, train_dataset, eval_dataset, processing_class,
        compute_metrics, callbacks, ...: as ``transformers.Trainer``. ``args.deepspeed``
            (a path or dict, set at construction with
            :class:`fzero.integrations.transformers.TrainingArguments` or afterwards on
            Hugging Face's own) is fzero's config, its ``"auto"`` values filled from ``args``
            as the Trainer fills them.
        fzero: ``fzero.compile``'s keyword options (``{"zero": 2, "jit": True}``), joined
            with ``args.fzero``; the keywords win. Without a config, ZeRO 0 (what DDP does).
        mesh: the ``fzero.Mesh`` to run on (default: every rank on the ``dp`` axis).

    After ``train()``, ``trainer.model`` is the trained module and ``trainer.fzero_step`` the
    compiled step that trained it (``trainer.fzero_step.options.zero`` is its stage);
    ``trainer.fzero_state`` is the training state.

    Raises:
        NotImplementedError: what the Trainer does and fzero does not here, named: an
            optimizer or scheduler fzero has no exact counterpart of, a ``compute_loss_func``
            or label smoothing, ``optimizers=`` built over the module's parameters.
    """

    def __init__(self, model=None, args=None, *rest, fzero: Mapping[str, Any] | None = None,
                 mesh: Any = None, **kwargs):
        if args is None:
            from fzero.integrations.transformers._args import TrainingArguments
            args = TrainingArguments(output_dir="trainer_output")
        config = getattr(args, "deepspeed", None)
        self.fzero_options = {**(getattr(args, "fzero", None) or {}), **dict(fzero or {})}
        self.fzero_config = _read_config(config)
        self.fzero_step = None
        self.fzero_state = None
        self._mesh = mesh
        self._module_current = True  # the module holds the newest weights (none trained yet)
        self._lr = None
        problems = []
        if getattr(args, "deepspeed_plugin", None) is not None:
            problems.append("args carries DeepSpeed's plugin (transformers.TrainingArguments(deepspeed=) with the "
                            "deepspeed package installed): use fzero.integrations.transformers.TrainingArguments, "
                            "or set args.deepspeed after constructing the arguments")
        if getattr(args, "label_smoothing_factor", 0.0):
            problems.append(f"label_smoothing_factor={args.label_smoothing_factor}: the step's loss is the model's "
                            "own; label smoothing is not carried over")
        if kwargs.get("compute_loss_func") is not None:
            problems.append("compute_loss_func: the step's loss is the model's own (outputs.loss)")
        optimizers = kwargs.get("optimizers", (None, None))
        if optimizers is not None and any(o is not None for o in optimizers):
            problems.append("optimizers=: a torch optimizer over the module's parameters cannot drive fzero's "
                            "state; set args.optim or an optimizer section in args.deepspeed")
        if getattr(args, "push_to_hub", False) and _offline():
            problems.append("push_to_hub=True while offline (HF_HUB_OFFLINE): nothing could be uploaded")
        if problems:
            raise NotImplementedError(f"{WHERE}: " + "; ".join(problems))
        args.deepspeed = None  # Hugging Face would set DeepSpeed up from it; fzero reads it instead
        try:
            super().__init__(model, args, *rest, **kwargs)
        finally:
            args.deepspeed = config

    # ------------------------------------------------------------------ the step

    def _build_step(self, max_steps: int) -> None:
        """The training state and compiled step for a run of ``max_steps`` updates."""
        args, model = self.args, self.model
        model.train()
        cfg = self.fzero_config
        options = dict(self.fzero_options)
        tx = None
        self._schedule = None
        if cfg is None or "optimizer" not in cfg:
            if cfg is not None and "scheduler" in cfg:
                raise NotImplementedError(
                    f"{WHERE}: args.deepspeed has a scheduler section but no optimizer section; fzero puts a "
                    "config's schedule only into the config's optimizer: add an optimizer section, or drop the "
                    "scheduler section to use the Trainer's (args.lr_scheduler_type)")
            self._schedule = hf_schedule(args, max_steps)
        elif "scheduler" not in cfg:
            raise NotImplementedError(
                f"{WHERE}: args.deepspeed has an optimizer section but no scheduler section; the Trainer would wrap "
                "DeepSpeed's optimizer in its own scheduler, which fzero does not: add a scheduler section, or "
                "drop the optimizer section to use the Trainer's (args.optim)")
        apply, params = fzero.functionalize(model)
        if self._schedule is not None:
            tx = hf_optimizer(args, set(self.get_decay_parameter_names(model)), params, self._schedule)
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=tx, seed=args.seed)
        mesh = self._mesh if self._mesh is not None else fzero.Mesh(dp=-1)
        gas = args.gradient_accumulation_steps
        if cfg is None:
            options.setdefault("zero", 0)
            if gas > 1:
                options.setdefault("accumulate", gas)
            # The Trainer logs the gradient norm with or without clipping; a bound of inf
            # measures it and leaves the gradients as they are.
            clip = args.max_grad_norm if args.max_grad_norm is not None and args.max_grad_norm > 0 else float("inf")
            options.setdefault("clip_norm", float(clip))
            if args.bf16 or args.fp16:
                options.setdefault("precision", "bf16" if args.bf16 else "fp16")
            step = fzero.compile(self._train_step_fn(), mesh, **options)
        else:
            auto = {
                "per_device_train_batch_size": args.per_device_train_batch_size,
                "gradient_accumulation_steps": gas,
                "max_grad_norm": args.max_grad_norm,
                "learning_rate": args.learning_rate,
                "adam_beta1": args.adam_beta1, "adam_beta2": args.adam_beta2,
                "adam_epsilon": args.adam_epsilon,
                "weight_decay": args.weight_decay,
                "warmup_steps": args.get_warmup_steps(max_steps),
                "max_steps": max_steps,
                "fp16": bool(args.fp16), "bf16": bool(args.bf16),
            }
            step = fzero.compile(self._train_step_fn(), mesh, config=cfg, auto=auto, **options)
        self.fzero_state = step.init(state)
        self.fzero_step = step
        # The rate the Trainer logs for an update: its own LambdaLR is read before it steps
        # (the rate the update used); DeepSpeed steps its scheduler inside engine.step(), so
        # the Trainer + DeepSpeed log the rate the next update will use.
        self._logged_ahead = 0
        if self._schedule is None:
            self._schedule = step.config.make_schedule()
            self._logged_ahead = 1
        self._module_current = False

    def _train_step_fn(self):
        counts = bool(self.model_accepts_loss_kwargs)
        shifts = bool(getattr(self, "_loss_shifts_labels", False))

        def train_step(state, batch):
            def loss_fn(p):
                if counts and "labels" in batch:
                    out = state.apply_fn(p, **batch, num_items_in_batch=1)  # the micro-batch's summed loss
                    total = _loss_of(out)
                    where = _counted(batch, shifts)
                    n = where.sum().clamp(min=1).to(total.dtype)
                    # Spread the sum over the counted items: their global mean is the sum over the
                    # whole update (every rank, every micro-batch) divided by the whole count --
                    # the Trainer's loss with num_items_in_batch.
                    return fzero.global_mean((total / n).expand(where.shape), where=where)
                return _loss_of(state.apply_fn(p, **batch))

            loss, grads = fzero.value_and_grad(loss_fn)(state.params)
            return state.apply_gradients(grads), {"loss": loss}

        train_step.__name__ = "hf_train_step"
        return train_step

    def _stack(self, batches: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        """One local batch from an update's micro-batches: each key concatenated on the
        leading dim, shorter sequences padded on the right (labels with -100, masks with 0)."""
        keys = list(batches[0])
        out = {}
        for k in keys:
            parts = [self._prepare_input(b[k]) for b in batches]
            if not all(isinstance(x, torch.Tensor) for x in parts):
                raise TypeError(f"{WHERE}: batch key {k!r} holds a {type(parts[0]).__name__}; the step takes "
                                "tensors only (drop the column, or collate it into a tensor)")
            if len(batches) == 1:
                out[k] = parts[0]
                continue
            if parts[0].dim() > 1 and len({x.shape[1] for x in parts}) > 1:
                width = max(x.shape[1] for x in parts)
                pad = _PAD.get(k, getattr(getattr(self.model, "config", None), "pad_token_id", None) or 0)
                parts = [torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, width - x.shape[1]), value=pad)
                         for x in parts]
            out[k] = torch.cat(parts)
        return out

    # ------------------------------------------------------------------ the Trainer's loop

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        self._build_step(max_steps)
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        self.model_wrapped = self.model
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model, train_dataloader

    def _run_epoch(self, model, epoch, train_dataloader, steps_in_epoch, num_update_steps_per_epoch, trial,
                   ignore_keys_for_eval, start_time, resume_from_checkpoint, epochs_trained,
                   steps_trained_in_current_epoch):
        from accelerate import skip_first_batches

        args = self.args
        gas = args.gradient_accumulation_steps
        step, grad_norm, learning_rate = -1, None, None
        updates_done = 0
        if (epoch == epochs_trained and resume_from_checkpoint is not None and steps_trained_in_current_epoch > 0
                and not args.ignore_data_skip):
            train_dataloader = skip_first_batches(train_dataloader, steps_trained_in_current_epoch)
            step = steps_trained_in_current_epoch - 1
            updates_done = steps_trained_in_current_epoch // gas
        if hasattr(train_dataloader, "set_epoch"):
            train_dataloader.set_epoch(epoch)
        inner = getattr(getattr(train_dataloader, "batch_sampler", None), "batch_sampler", None)
        if hasattr(inner, "set_epoch"):
            inner.set_epoch(epoch)
        batches = iter(train_dataloader)
        for update in range(updates_done, num_update_steps_per_epoch):
            micro = []
            for _ in range(gas):
                try:
                    micro.append(next(batches))
                except StopIteration:
                    break
            if not micro:
                break
            if len(micro) != gas:
                raise NotImplementedError(
                    f"{WHERE}: update {self.state.global_step + 1} has {len(micro)} micro-batches, the others "
                    f"gradient_accumulation_steps={gas}: an epoch of {steps_in_epoch} batches does not split into "
                    "whole updates, and a compiled step accumulates a fixed number; choose a dataset size, batch "
                    "size or dataloader_drop_last so that it does")
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            for _ in micro[:-1]:
                self.control = self.callback_handler.on_substep_end(args, self.state, self.control)
            batch = self._stack(micro)
            if self._module_current and self.fzero_state is not None:
                release_parameters(self.model)  # the state holds the weights while it trains
            self._module_current = False
            self.model.train()
            count = int(self.fzero_state.step)
            self.fzero_state, metrics = self.fzero_step(self.fzero_state, batch)
            step += len(micro)
            loss = metrics["loss"].detach().to(self._tr_loss.device, self._tr_loss.dtype)
            if args.logging_nan_inf_filter and not torch.isfinite(loss):
                self._tr_loss += self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
            else:
                self._tr_loss += loss
            for inputs in micro:
                self.current_flos += float(self.floating_point_ops(inputs))
                self._track_num_input_tokens(inputs)
            grad_norm = metrics.get("grad_norm")
            learning_rate = self._lr = float(self._schedule(count + self._logged_ahead))
            self.control = self.callback_handler.on_pre_optimizer_step(args, self.state, self.control)
            self.control = self.callback_handler.on_optimizer_step(args, self.state, self.control)
            self.state.global_step += 1
            self.state.epoch = epoch + (step + 1) / steps_in_epoch
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            self._maybe_log_save_evaluate(self._tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval,
                                          start_time, learning_rate=learning_rate)
            if self.control.should_epoch_stop or self.control.should_training_stop:
                break
        if step < 0:
            logger.warning("%s: no batch in this epoch; stopping at step %d", WHERE, self.state.global_step)
            self.control.should_training_stop = True
        self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
        self._maybe_log_save_evaluate(self._tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval,
                                      start_time, learning_rate=learning_rate)

    def _finalize_training(self, trial, num_train_samples, start_time):
        self._sync_module()
        return super()._finalize_training(trial, num_train_samples, start_time)

    def _get_learning_rate(self) -> float:
        if self._lr is None:
            raise RuntimeError(f"{WHERE}: no update has run yet, so there is no learning rate to report")
        return self._lr

    # ------------------------------------------------------------------ the module's weights

    def _sync_module(self) -> None:
        """Write the state's trained weights into ``self.model`` (a collective: every rank)."""
        if self.fzero_state is not None and not self._module_current:
            fzero.load_into(self.model, self.fzero_state)
            self._module_current = True

    @contextlib.contextmanager
    def _trained_weights(self):
        """The module computing with the trained weights for an evaluation: at ZeRO-3 bound
        from the partitioned state a unit at a time (``shard_state``'s ``evaluating``: no rank
        holds the whole model); else written in (``fzero.load_into``)."""
        units = None if self._module_current else units_of(self.fzero_step)
        state = self.fzero_state
        if units is None or state.tensor_parallel is not None or state.pipeline is not None:
            self._sync_module()
            yield
            return
        with evaluating(self.model, state, units):
            self._prepare_for_evaluation()
            yield

    def _prepare_for_evaluation(self) -> None:
        """What the Trainer's evaluation loop does to an unprepared module (accelerate's
        ``prepare_model(evaluation_mode=True)``: moves it to the device, wraps its forward for
        mixed precision), done here once, before its first evaluation at ZeRO-3: there the
        units' weights are ``meta`` outside their forwards and cannot be moved, so each stands
        in as one element on the device, broadcast to its shape, while accelerate looks."""
        if len(self.accelerator._models) != 0:  # the Trainer's own test before it prepares
            return
        slots = {name: places for name, places in _slots(self.model).items()
                 if places[0][0][places[0][1]].device.type == "meta"}
        device = self.args.device
        stand_ins = {}
        for name, places in slots.items():
            t = places[0][0][places[0][1]]
            stand_ins[name] = torch.empty((), dtype=t.dtype, device=device).expand(t.shape)
        with _Bound(slots, stand_ins):
            self.accelerator.prepare_model(self.model, evaluation_mode=True)

    def evaluate(self, *args, **kwargs):
        with self._trained_weights():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with self._trained_weights():
            return super().predict(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the trained model with ``save_pretrained`` (call it on every rank: the
        weights are gathered from the state first)."""
        self._sync_module()
        super().save_model(output_dir, _internal_call=_internal_call)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        if isinstance(self.model, transformers.PreTrainedModel):
            self.model.save_pretrained(output_dir, state_dict=state_dict)
        else:
            import safetensors.torch
            safetensors.torch.save_model(self.model, os.path.join(output_dir, transformers.utils.SAFE_WEIGHTS_NAME))
        tokenizer = self.processing_class or getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        # The arguments as JSON: fzero's checkpoints hold no pickle.
        Path(output_dir, ARGS_NAME).write_text(self.args.to_json_string())

    def push_to_hub(self, *args, **kwargs):
        """Hugging Face's ``push_to_hub``, after the trained weights are in the module;
        refused while offline."""
        if _offline():
            raise RuntimeError(f"{WHERE}.push_to_hub: the Hub is offline here (HF_HUB_OFFLINE is set), so nothing "
                               "can be uploaded; trainer.save_model(dir) writes the model to disk")
        self._sync_module()
        return super().push_to_hub(*args, **kwargs)

    # ------------------------------------------------------------------ checkpoints

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # The whole training state (parameters, optimizer state, schedule count), every rank
        # its own part, pickle-free; the schedule is a function of the state's count.
        fzero.checkpoint.save(os.path.join(output_dir, STATE_DIR), self.fzero_state, overwrite=True)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, STATE_DIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{WHERE}: resume_from_checkpoint={checkpoint!r} has no {STATE_DIR}/ (the "
                                    "training state FzeroTrainer saves); a plain Trainer's optimizer.pt is a "
                                    "pickle and is not read")
        self.fzero_state = fzero.checkpoint.load(path, like=self.fzero_state)
        self._module_current = False

    def _save_scaler(self, output_dir: str) -> None:
        """Nothing: fp16's loss scale is part of the fzero state."""

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Nothing: fp16's loss scale is part of the fzero state."""

    def _save_rng_state(self, output_dir: str) -> None:
        """Nothing: fzero's dropout draws from a counter-based generator keyed by the state's
        seed and update, so a resumed run needs no saved generator (and no pickle)."""


def _read_config(config: Any) -> dict | None:
    if config is None:
        return None
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        try:
            return json.loads(Path(config).read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{WHERE}: args.deepspeed={str(config)!r}: no such file") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{WHERE}: args.deepspeed={str(config)!r} is not JSON: {e}") from None
    raise TypeError(f"{WHERE}: args.deepspeed must be a path or a dict, got {type(config).__name__}")


def _loss_of(out: Any) -> torch.Tensor:
    loss = out.get("loss") if isinstance(out, Mapping) else out[0]
    if loss is None:
        raise ValueError(f"{WHERE}: the model returned no loss; pass labels in the batch (the data collator's "
                         "'labels'), as the Trainer needs them too")
    return loss


def _counted(batch: Mapping[str, torch.Tensor], shifts: bool) -> torch.Tensor:
    """The items the Trainer counts for ``num_items_in_batch``: labelled positions, after the
    shift for a causal LM's loss."""
    if "shift_labels" in batch:
        labels = batch["shift_labels"]
    elif shifts:
        labels = batch["labels"][..., 1:]
    else:
        labels = batch["labels"]
    return labels.ne(-100)


def _offline() -> bool:
    try:
        from huggingface_hub import constants
        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:
        return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
