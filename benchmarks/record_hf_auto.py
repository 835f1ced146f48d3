"""Record how Hugging Face fills a DeepSpeed config's ``"auto"`` values, for
``tests/data/hf_auto_filled.json``.

fzero fills ``"auto"`` as Hugging Face's Trainer does (docs/config.md). The tests check
that promise against configs filled here by Hugging Face's own code,
``transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig`` (``trainer_config_process``
then ``trainer_config_finalize``), never against a transcription of fzero's rule. It needs
accelerate and DeepSpeed, which are no dependencies of fzero: run it in a scratch
environment outside the repository::

    python3 -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install torch==2.13.0          # the CPU wheel; plain torch pulls CUDA
    DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install deepspeed==0.19.8 transformers==5.23.0 accelerate
    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python benchmarks/record_hf_auto.py --out tests/data/hf_auto_filled.json

Each case is a config with ``"auto"`` values, the ``TrainingArguments`` fields the filler
reads (a namespace: a real ``TrainingArguments`` sets up devices), the number of training
steps and the model's hidden size; the file keeps all four with the filled config.
"""

from __future__ import annotations

import argparse
import copy
import json
import types

AUTO_CONFIG = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

ARGS = dict(world_size=1, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=0.5,
            learning_rate=3e-4, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.05,
            warmup_steps=10, save_on_each_node=False, fp16=False, fp16_full_eval=False, bf16=False,
            bf16_full_eval=False)

CASES = [  # (zero stage, argument changes, training steps, hidden size)
    (3, {}, 100, 64),
    (2, {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "bf16": True, "warmup_steps": 0}, 50, 48),
    (1, {"fp16": True, "max_grad_norm": 0.0, "weight_decay": 0.0, "world_size": 2}, 30, 32),
    (3, {"learning_rate": 1e-4, "adam_beta2": 0.999, "world_size": 4, "gradient_accumulation_steps": 4}, 1000, 1024),
]


def fill(config, args, steps, hidden):
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    ns = types.SimpleNamespace(**args)
    ns.get_warmup_steps = lambda n: ns.warmup_steps
    filler = HfTrainerDeepSpeedConfig(copy.deepcopy(config))
    filler.trainer_config_process(ns)
    model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=hidden))
    filler.trainer_config_finalize(ns, model, steps)
    return filler.config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    out = parser.parse_args().out
    import transformers

    cases = []
    for stage, changes, steps, hidden in CASES:
        config = copy.deepcopy(AUTO_CONFIG)
        config["zero_optimization"]["stage"] = stage
        args = {**ARGS, **changes}
        cases.append({"config": config, "args": args, "max_steps": steps, "hidden_size": hidden,
                      "filled": fill(config, args, steps, hidden)})
    with open(out, "w") as f:
        json.dump({"transformers": transformers.__version__, "cases": cases}, f, indent=1)
        f.write("\n")
    print(f"{len(cases)} cases written to {out}")


if __name__ == "__main__":
    main()
