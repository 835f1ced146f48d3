"""Record what ``transformers.Trainer`` + DeepSpeed give for a config with optimizer and
scheduler sections, for ``tests/data/hf_trainer_deepspeed.json``.

``tests/test_hf_trainer.py`` checks ``FzeroTrainer`` with the same config against this
recording: the losses, learning rates and gradient norms the Trainer logs at every update,
and a digest of the final weights (each parameter's sum and L2 norm). The run is the test's
own (its data, collator, tiny GPT-2 and arguments, imported from the test module). It needs
DeepSpeed and accelerate, which are no dependencies of fzero: run it in a scratch
environment, for instance with DeepSpeed's wheel installed without dependencies beside the
repository's torch::

    pip install --target /tmp/dsdeps --no-deps deepspeed==0.19.8 hjson py-cpuinfo msgpack einops ninja
    DS_ACCELERATOR=cpu PYTHONPATH=$PWD:/tmp/dsdeps torchrun --nproc 1 \\
        benchmarks/record_hf_trainer_deepspeed.py --out tests/data/hf_trainer_deepspeed.json

One process: on two CPU ranks (DS_ACCELERATOR=cpu, accelerate 1.15) the Trainer + DeepSpeed
run logged exactly the one-process numbers -- every rank was handed the same batches -- so a
two-rank recording would not be the two-rank run it claims to be.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import transformers  # noqa: E402

import test_hf_trainer as T  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()
    import deepspeed

    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.TrainingArguments(tmp, deepspeed=T.DEEPSPEED_CONFIG, **T.DEEPSPEED_ARGS)
        trainer = transformers.Trainer(model=T._model(), args=args, train_dataset=T._rows(),
                                       data_collator=T._collate)
        trainer.train()
        weights = {k: v.detach().float() for k, v in trainer.model.named_parameters()}
        # ZeRO 3 leaves the module's parameters partitioned: gather them for the digest.
        params = list(trainer.model_wrapped.module.parameters())
        if getattr(params[0], "ds_id", None) is not None:
            with deepspeed.zero.GatheredParameters(params):
                weights = {k: v.detach().float().clone() for k, v in trainer.model_wrapped.module.named_parameters()}
        log = T._log(trainer)
    if dist.get_rank() == 0:
        record = {
            "what": "transformers.Trainer + DeepSpeed: logged (step, loss, learning_rate, grad_norm) and final "
                    "weights' (sum, L2 norm) per parameter, the keys' slice of the attention bias left out",
            "versions": {"deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
                         "torch": torch.__version__},
            "world_size": dist.get_world_size(),
            "config": T.DEEPSPEED_CONFIG, "args": T.DEEPSPEED_ARGS,
            "log": log,
            "weights": {k: [v.sum().item(), v.norm().item()] for k, v in T._drop_key_bias(weights).items()},
        }
        Path(opts.out).write_text(json.dumps(record, indent=1) + "\n")
        print(json.dumps(log))


if __name__ == "__main__":
    main()
