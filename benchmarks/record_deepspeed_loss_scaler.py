"""Record what the real DeepSpeed does on overflow, for ``tests/data/deepspeed_loss_scaler.json``.

fzero's fp16 loss scaler and its bf16 overflow check promise DeepSpeed's behaviour
(docs/transforms.md). The tests check that promise against sequences recorded here from
DeepSpeed itself, never against a transcription of fzero's own rule. This script is not
part of the suite (nothing imports it, and DeepSpeed is no dependency of fzero); run it
again only to re-record, in a scratch environment outside the repository::

    python3 -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install torch==2.13.0          # the CPU wheel; plain torch pulls CUDA
    DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install deepspeed==0.19.8
    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python benchmarks/record_deepspeed_loss_scaler.py \
        --out tests/data/deepspeed_loss_scaler.json

What runs: ``deepspeed.initialize`` builds a real engine (world of one, gloo) around a
``Linear(4, 2)`` with fp16 (or bf16) and ZeRO stage 1, 2 and 3; each update runs
``engine.backward`` / ``engine.step`` on a batch whose input is finite, or holds an inf at
the updates listed in ``overflow_at``. The loss is ``1e-6 * sum(outputs)`` so that no
gradient overflows by itself, even at the largest scale a case reaches: the only
overflows are the injected ones. Per update it records the scale the loss was multiplied
by (``optimizer.loss_scale`` before the step), whether the step was skipped
(``not engine.was_step_applied()``), and the scaler's ``cur_hysteresis`` after it; and the
update at which DeepSpeed raised (an overflow at the minimum scale), if it did. The three
ZeRO stages must agree (the script stops otherwise) and so must DeepSpeed's
``DynamicLossScaler`` driven alone with the same overflow pattern; one sequence is stored
per case, with the stages it was checked on.

The CPU accelerator reports fp16 as unsupported, which only stops ``deepspeed.initialize``
at a sanity check: the loss scaler and the ZeRO optimizers' overflow handling are plain
Python and torch, the same on every device, so the check is bypassed here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

def _fp16(*, initial_scale_power: int, loss_scale_window: int, hysteresis: int,
          consecutive_hysteresis: bool = False, min_loss_scale: float = 1) -> dict:
    """A DeepSpeed ``fp16`` section (beside ``"enabled": true``), its keys in the order recorded."""
    return dict(initial_scale_power=initial_scale_power, loss_scale_window=loss_scale_window,
                hysteresis=hysteresis, consecutive_hysteresis=consecutive_hysteresis, min_loss_scale=min_loss_scale)


# The overflow_at lists that several window-5 cases share (70 and 60 updates long).
OVERFLOW_AT_70 = [12, 19, 20, 32, 33, 34, 42, 44, 46, 48, 50, 52]
OVERFLOW_AT_60 = [0, 1, 6, 7, 8, 14, 20, 21, 22, 23, 24, 40, 42]

CASES_FP16 = [
    # name, fp16 section (beside "enabled": true), updates, overflow_at, gradient_accumulation_steps
    ("window5_hysteresis2", _fp16(initial_scale_power=16, loss_scale_window=5, hysteresis=2), 70, OVERFLOW_AT_70, 1),
    ("window5_hysteresis1", _fp16(initial_scale_power=16, loss_scale_window=5, hysteresis=1), 70, OVERFLOW_AT_70, 1),
    ("window5_hysteresis2_consecutive",
     _fp16(initial_scale_power=16, loss_scale_window=5, hysteresis=2, consecutive_hysteresis=True), 70, OVERFLOW_AT_70, 1),
    ("window5_hysteresis3", _fp16(initial_scale_power=16, loss_scale_window=5, hysteresis=3), 60, OVERFLOW_AT_60, 1),
    ("window5_hysteresis3_consecutive",
     _fp16(initial_scale_power=16, loss_scale_window=5, hysteresis=3, consecutive_hysteresis=True), 60, OVERFLOW_AT_60, 1),
    # DeepSpeed's defaults over more than two windows: the scale rises at updates 1000
    # and 2202 (1001 clean updates after the overflow at 1201), not one update earlier.
    ("window1000_defaults_long", _fp16(initial_scale_power=16, loss_scale_window=1000, hysteresis=2),
     2600, [1201, 2300, 2301, 2450], 1),
    ("window1000_hysteresis1_long", _fp16(initial_scale_power=16, loss_scale_window=1000, hysteresis=1),
     2100, [0, 999, 1000, 1500], 1),
    ("window1000_hysteresis2_consecutive_long",
     _fp16(initial_scale_power=16, loss_scale_window=1000, hysteresis=2, consecutive_hysteresis=True),
     2100, [3, 5, 1004, 1005, 1006], 1),
    # down to the minimum scale, up again, down again, then an overflow there: DeepSpeed raises.
    ("min_scale_reached_then_raises", _fp16(initial_scale_power=3, loss_scale_window=5, hysteresis=1),
     24, [0, 1, 2, 15, 16, 17, 18], 1),
    # a minimum that is not a power of two: 16 -> 8 -> 4 -> 3, up to 6, down to 3, the error.
    ("min_scale_not_a_power_of_two",
     _fp16(initial_scale_power=4, loss_scale_window=5, hysteresis=1, min_loss_scale=3),
     16, [2, 3, 4, 12, 13, 14], 1),
    # consecutive hysteresis at the minimum: each clean update refills it, so alternating
    # overflows there only spend it and never raise.
    ("min_scale_consecutive_hysteresis_alternating",
     _fp16(initial_scale_power=2, loss_scale_window=5, hysteresis=2, consecutive_hysteresis=True),
     30, [0, 1, 2, 4, 6, 8, 10, 12, 14, 16, 18], 1),
    # DeepSpeed's defaults, overflowing every update: one overflow spends the hysteresis,
    # sixteen halve 2^16 down to 1, the next raises.
    ("defaults_overflow_burst_until_error", _fp16(initial_scale_power=16, loss_scale_window=1000, hysteresis=2),
     25, list(range(3, 25)), 1),
    # two micro-batches per update, the inf in the second: the verdict is for the update.
    ("accumulation_2_window5", _fp16(initial_scale_power=16, loss_scale_window=5, hysteresis=2),
     30, [4, 11, 12, 20], 2),
]

CASES_BF16 = [
    # name, bf16 section (beside "enabled": true), updates, overflow_at
    ("check_grad_overflow_default", {}, 8, [2, 5, 6]),
    ("check_grad_overflow_false", {"check_grad_overflow": False}, 8, [2, 5, 6]),
]

MICRO = 2  # samples per micro-batch


def _setup():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29631")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    deepspeed.init_distributed(dist_backend="gloo")
    type(get_accelerator()).is_fp16_supported = lambda self: True  # see the module docstring


def _engine(section: str, settings: dict, stage: int, gas: int):
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 0.0,
           "steps_per_print": 10 ** 9, section: {"enabled": True, **settings}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine, optimizer


def _batch(update: int, micro: int, bad: bool, dtype):
    import torch

    g = torch.Generator().manual_seed(1000 * update + micro)
    x = torch.randn(MICRO, 4, generator=g)
    if bad:
        x[0, 0] = float("inf")
    return x.to(dtype)


def _run_fp16(settings: dict, updates: int, overflow_at: list[int], gas: int, stage: int) -> dict:
    import torch

    engine, optimizer = _engine("fp16", settings, stage, gas)
    bad_updates = set(overflow_at)
    scales, skipped, hysteresis, raises_at, error = [], [], [], None, None
    for u in range(updates):
        scale = float(optimizer.loss_scale)
        try:
            for m in range(gas):
                # the inf goes into the last micro-batch of an overflowing update
                x = _batch(u, m, u in bad_updates and m == gas - 1, torch.float16)
                engine.backward(1e-6 * engine(x).float().sum())
                engine.step()
        except Exception as e:  # DeepSpeed raises a bare Exception at the minimum scale
            raises_at, error = u, str(e)
            break
        scales.append(scale)
        skipped.append(not engine.was_step_applied())
        hysteresis.append(int(optimizer.loss_scaler.cur_hysteresis))
    s = optimizer.loss_scaler
    final = {"cur_scale": float(s.cur_scale), "cur_iter": int(s.cur_iter),
             "last_overflow_iter": int(s.last_overflow_iter), "cur_hysteresis": int(s.cur_hysteresis)}
    return {"loss_scale": scales, "skipped": skipped, "hysteresis": hysteresis, "raises_at": raises_at,
            "error": error, "final": final}


def _scaler_alone(settings: dict, updates: int, overflow_at: list[int]) -> dict:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    s = DynamicLossScaler(init_scale=2 ** settings["initial_scale_power"],
                          scale_window=settings["loss_scale_window"], min_scale=settings["min_loss_scale"],
                          delayed_shift=settings["hysteresis"],
                          consecutive_hysteresis=settings["consecutive_hysteresis"])
    scales, skipped, hysteresis, raises_at = [], [], [], None
    for u in range(updates):
        scale = float(s.cur_scale)
        try:
            s.update_scale(u in overflow_at)
        except Exception:
            raises_at = u
            break
        scales.append(scale)
        skipped.append(u in overflow_at)
        hysteresis.append(int(s.cur_hysteresis))
    return {"loss_scale": scales, "skipped": skipped, "hysteresis": hysteresis, "raises_at": raises_at}


def _run_bf16(settings: dict, updates: int, overflow_at: list[int], stage: int) -> dict:
    import torch

    engine, _ = _engine("bf16", settings, stage, 1)
    skipped, finite = [], []
    for u in range(updates):
        engine.backward(1e-6 * engine(_batch(u, 0, u in overflow_at, torch.bfloat16)).float().sum())
        engine.step()
        skipped.append(not engine.was_step_applied())
        finite.append(all(bool(torch.isfinite(p).all()) for p in engine.module.parameters()))
    return {"skipped": skipped, "params_finite": finite}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tests/data/deepspeed_loss_scaler.json")
    ap.add_argument("--stages", default="1,2,3", help="ZeRO stages to run every case on (they must agree)")
    args = ap.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    _setup()
    import deepspeed
    import torch

    fp16 = []
    for name, settings, updates, overflow_at, gas in CASES_FP16:
        runs = {st: _run_fp16(settings, updates, overflow_at, gas, st) for st in stages}
        first = runs[stages[0]]
        for st, r in runs.items():
            if r != first:
                sys.exit(f"{name}: ZeRO stage {st} differs from stage {stages[0]}")
        alone = _scaler_alone(settings, updates, overflow_at)
        if any(alone[k] != first[k] for k in alone):
            sys.exit(f"{name}: DynamicLossScaler alone differs from the engine")
        print(f"{name}: {len(first['loss_scale'])} updates, raises_at={first['raises_at']}, final={first['final']}")
        fp16.append({"name": name, "zero_stages": stages, "fp16": settings, "gradient_accumulation_steps": gas,
                     "updates": updates, "overflow_at": overflow_at, **first})
    bf16 = []
    for name, settings, updates, overflow_at in CASES_BF16:
        runs = {st: _run_bf16(settings, updates, overflow_at, st) for st in stages}
        by_stage = {str(st): r for st, r in runs.items()}
        print(f"{name}: {by_stage}")
        bf16.append({"name": name, "bf16": settings, "updates": updates, "overflow_at": overflow_at,
                     "by_zero_stage": by_stage})
    out = {
        "recorded_with": {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                          "python": platform.python_version(),
                          "command": "DS_ACCELERATOR=cpu python benchmarks/record_deepspeed_loss_scaler.py"},
        "about": "Per update of a real DeepSpeed engine (Linear(4, 2), SGD, world of one): loss_scale is "
                 "the scale the loss was multiplied by, skipped whether the step was discarded, hysteresis "
                 "the scaler's cur_hysteresis after the update; raises_at the update at which DeepSpeed "
                 "raised (overflow at the minimum scale), null if none; the lists stop there. Overflows "
                 "are injected (an inf in the input) at the updates in overflow_at, in the last "
                 "micro-batch of the update. See benchmarks/record_deepspeed_loss_scaler.py.",
        "fp16": fp16,
        "bf16": bf16,
    }
    with open(args.out, "w") as f:
        f.write(_dumps(out))


def _dumps(out: dict) -> str:
    """JSON with one key of a case per line and each list on one line: readable, and a
    diff of a re-recording shows which case and which field changed."""
    lines = ["{"]
    for i, (key, value) in enumerate(out.items()):
        end = "," if i < len(out) - 1 else ""
        if isinstance(value, list):
            lines.append(f" {json.dumps(key)}: [")
            for j, case in enumerate(value):
                fields = ",\n".join(f"   {json.dumps(k)}: {json.dumps(v)}" for k, v in case.items())
                lines.append("  {\n" + fields + "\n  }" + ("," if j < len(value) - 1 else ""))
            lines.append(" ]" + end)
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}{end}")
    lines.append("}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
