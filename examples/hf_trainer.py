"""Fine-tune a tiny GPT-2 with Hugging Face's Trainer API, run by fzero.

A plain Trainer script with one line changed: the import (see docs/huggingface.md). The
model is built from a config and the text is generated here, so nothing is downloaded.

    python examples/hf_trainer.py --output_dir out/hf --max_steps 120
    fzero launch --nproc 2 examples/hf_trainer.py --output_dir out/hf --deepspeed ds.json

Any TrainingArguments flag works (``--gradient_accumulation_steps 2 --max_grad_norm 1.0
--warmup_steps 5 --eval_strategy steps --eval_steps 10 --save_steps 20``); ``--deepspeed``
takes a DeepSpeed config, read by fzero (its ZeRO stage, ``"auto"`` values from these flags).
"""

from __future__ import annotations

import random

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser

from fzero.integrations.transformers import FzeroTrainer as Trainer, TrainingArguments

BLOCK = 32  # bytes per training sequence

WORDS = {"who": ["the cat", "a dog", "my aunt", "the robot", "a small bird"],
         "did": ["sat on", "looked at", "jumped over", "painted", "sang to"],
         "what": ["the mat", "a red box", "the moon", "an old tree", "the river"]}


def make_text(n: int, seed: int) -> list[str]:
    """``n`` short sentences of a toy grammar: enough structure for a model to learn."""
    rng = random.Random(seed)
    return [f"{rng.choice(WORDS['who'])} {rng.choice(WORDS['did'])} {rng.choice(WORDS['what'])}." for _ in range(n)]


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def make_dataset(n: int, seed: int) -> list[dict[str, list[int]]]:
    """Sentences as byte sequences of up to BLOCK bytes (their lengths differ: the collator pads)."""
    return [{"input_ids": encode(s)[:BLOCK]} for s in make_text(n, seed)]


def collate(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Pad to the longest row; padding is masked out of attention and of the loss (-100)."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, :len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main(argv=None) -> GPT2LMHeadModel:
    parser = HfArgumentParser(TrainingArguments)
    parser.set_defaults(output_dir="out/hf_trainer", max_steps=120, per_device_train_batch_size=8,
                        learning_rate=5e-3, warmup_steps=10, logging_steps=20, save_strategy="no",
                        report_to="none", use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=256, n_positions=BLOCK, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = GPT2LMHeadModel(config)

    trainer = Trainer(model=model, args=args, train_dataset=make_dataset(512, seed=0),
                      eval_dataset=make_dataset(64, seed=1), data_collator=collate)
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(args.output_dir)

    if trainer.is_world_process_zero():
        print(f"eval_loss {metrics['eval_loss']:.4f}")
        back = GPT2LMHeadModel.from_pretrained(args.output_dir)
        prompt = torch.tensor([encode("the cat ")])
        out = back.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
        print("sample:", repr(decode(out[0])))
    return trainer.model


if __name__ == "__main__":
    main()
