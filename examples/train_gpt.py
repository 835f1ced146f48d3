"""Train a byte-level GPT on the Python standard library's own source, with fzero.

No download: the data is the ``.py`` files of the Python running this script. The program is
fzero's model of a training loop -- one pure, single-device ``train_step(state, batch)`` --
and the same file runs on one process or many::

    python examples/train_gpt.py                                  # one process
    fzero launch --nproc 2 examples/train_gpt.py --zero 2         # 2 ranks, ZeRO-2 (make demo)

What it prints at the end: the final train loss, the validation loss, and a sample.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import sys
import sysconfig

import torch
import torch.nn.functional as F
from tqdm import tqdm

import fzero
from fzero import optim
from fzero.transforms import tp_plans
from gpt import GPT, GPTConfig, generate

SEPARATOR = b"\n\n"  # between files; the model learns that a file ends with blank lines
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def load_stdlib(max_bytes: int) -> tuple[torch.Tensor, int]:
    """The stdlib's ``.py`` files as one uint8 tensor (at most ``max_bytes``), and the file count.

    Paths are sorted so every run on the same Python sees the same bytes in the same order.
    Installed packages and test suites are skipped: we want the library, not its fixtures.
    """
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]  # prune, don't descend
        paths += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    chunks, total = [], 0
    for path in sorted(paths):
        with open(path, "rb") as f:
            chunks.append(f.read() + SEPARATOR)
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    data = b"".join(chunks)[:max_bytes]
    if len(data) < min(max_bytes, 1_000_000):
        raise RuntimeError(f"train_gpt: found only {len(data)} bytes of .py files under {root}")
    # frombuffer shares the bytes object's memory; clone so the tensor owns (and may write) it.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone(), len(chunks)


def get_batch(data: torch.Tensor, batch_size: int, block_size: int, g: torch.Generator) -> dict:
    """``batch_size`` random windows of ``block_size`` bytes; ``y`` is ``x`` shifted by one."""
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=g)
    x = torch.stack([data[i : i + block_size] for i in ix.tolist()])
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix.tolist()])
    return {"x": x.long(), "y": y.long()}  # cross_entropy wants int64 targets


def decay_mask(params: dict[str, torch.Tensor]) -> dict[str, bool]:
    """True where AdamW should decay: the weight matrices of Linear layers.

    Biases and LayerNorm gains only shift or scale activations, and pulling embeddings
    towards zero shrinks rare tokens' vectors; none of them gain from decay (as in
    nanoGPT's ``configure_optimizers``, which decays only the >= 2-D tensors).
    """
    no_decay = (".bias", "ln_1.weight", "ln_2.weight", "ln_f.weight", "wte.weight", "wpe.weight")
    return {name: not name.endswith(no_decay) for name in params}


def train_step(state: fzero.TrainState, batch: dict) -> tuple[fzero.TrainState, dict]:
    """One update: the next-byte loss, its gradients, the optimizer's step. Pure and
    single-device; ``fzero.compile`` adds the ranks, ZeRO and the precision around it."""
    def loss_fn(p):
        logits = state.apply_fn(p, batch["x"])
        return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())

    loss, grads = fzero.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150, help="optimizer updates")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per update, per rank")
    p.add_argument("--block-size", type=int, default=128, help="bytes of context")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, help="linear warmup updates, then cosine to lr/10 (default: steps // 10)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--threads", type=int, help="torch CPU threads per rank (default: cores / ranks)")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage over the ranks")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: attention heads and MLPs split over this many ranks")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--ckpt", metavar="DIR", help="save a checkpoint under DIR/step_N at the end")
    p.add_argument("--sample-len", type=int, default=200, help="bytes to generate at the end")
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="cap on the training text")
    p.add_argument("--log-losses", metavar="PATH", help="write the per-step train losses as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Train, evaluate and sample; returns ``{"losses", "val_loss", "sample"}`` (for tests)."""
    args = parse_args(argv)
    if args.warmup is None:
        args.warmup = args.steps // 10
    mesh = fzero.Mesh(dp=-1, tp=args.tp)
    # Ranks share the machine's cores: one thread each per core, not each rank all of them.
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) // mesh.world_size))
    torch.manual_seed(args.seed)  # the model's init: identical on every rank

    data, n_files = load_stdlib(args.max_bytes)
    n_val = len(data) // 10  # the last 10% of the (sorted) text: a fixed held-out set
    train_data, val_data = data[:-n_val], data[-n_val:]
    # Each data-parallel rank draws its own batches, so N ranks see N different batches; the
    # tensor-parallel ranks of one dp coordinate compute one batch together, so they draw the same.
    g = torch.Generator().manual_seed(args.seed + mesh.coords["dp"])

    cfg = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(cfg)
    apply, params = fzero.functionalize(model)
    tx = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.adamw(
            optim.schedules.warmup_cosine(args.lr, warmup=args.warmup, total=args.steps, end=args.lr / 10),
            weight_decay=0.1,
            mask=decay_mask(params),
        ),
    )
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=tx)
    # flops/memory: each step's metrics carry its FLOP/s, tokens/s, MFU (on a GPU) and this
    # rank's memory, for the progress bar (docs/monitoring.md).
    step = fzero.compile(train_step, mesh, zero=args.zero, precision=args.precision,
                         tp=tp_plans.gpt(model) if args.tp > 1 else None, flops=True, memory=True)
    state = step.init(state)

    rank0 = mesh.rank == 0
    if rank0:
        n_params = sum(p.numel() for p in params.values())
        print(f"data: {len(data) / 1e6:.1f} MB from {n_files} stdlib files | "
              f"model: {n_params / 1e6:.2f}M params | {mesh}", file=sys.stderr)

    losses = []
    bar = tqdm(range(args.steps), disable=args.no_progress or not rank0, file=sys.stderr, dynamic_ncols=True)
    for i in bar:
        state, metrics = step(state, get_batch(train_data, args.batch_size, args.block_size, g))
        losses.append(metrics["loss"].item())  # .item() syncs; on a GPU, log less often
        # Step 0 pays one-off costs (allocation, warm caches, counting its FLOPs): shown from step 1.
        if i > 0 and not bar.disable:
            bar.set_postfix_str(progress(metrics, losses[-1], mesh.size("dp")))

    if args.ckpt:
        # Every rank writes the pieces it owns; the checkpoint loads onto any world size.
        path = os.path.join(args.ckpt, f"step_{int(state.step)}")
        fzero.checkpoint.save(path, state, metadata={"args": vars(args)}, overwrite=True)
        if rank0:
            print(f"checkpoint: {path}", file=sys.stderr)
    # Full (unsharded over dp) fp32 parameters for evaluation and sampling, whatever the
    # step's partitioning and precision. Under tensor parallelism each rank keeps its slice of
    # the split layers, whose forwards now exchange activations: every rank evaluates and
    # samples in step, the same tokens.
    params = fzero.gather(state.master if state.master is not None else state.params)
    val_loss = evaluate(apply, params, val_data, args)
    ctx = torch.tensor([list(b"import ")], dtype=torch.long)
    out = generate(apply, params, ctx, args.sample_len, temperature=0.8, top_k=50,
                   generator=torch.Generator().manual_seed(args.seed))
    sample = bytes(out[0].tolist())

    if args.log_losses and rank0:
        argv = sys.argv[1:] if argv is None else list(argv)
        log = {
            "command": shlex.join(["python", "examples/train_gpt.py", *argv]),
            "config": vars(args),
            "python": platform.python_version(),
            "torch": torch.__version__,
            # The data is this Python's stdlib: if its bytes differ, so will the losses.
            "data_bytes": len(data),
            "data_sha256": hashlib.sha256(data.numpy().tobytes()).hexdigest(),
            "losses": losses,
        }
        with open(args.log_losses, "w") as f:
            json.dump(log, f, indent=1)
    if rank0:
        print(f"step {len(losses)}: train loss {losses[-1]:.4f}, val loss {val_loss:.4f}")
        print("-" * 40 + " sample " + "-" * 40)
        print(sample.decode("utf-8", errors="replace"))
    return {"losses": losses, "val_loss": val_loss, "sample": sample}


def progress(metrics: dict, loss: float, dp: int) -> str:
    """The progress bar's text: the loss, tokens/s over every dp rank, MFU on a GPU whose peak
    fzero knows (else this rank's FLOP/s) and this rank's peak memory."""
    speed = f"mfu={metrics['mfu']:.1%}" if "mfu" in metrics else f"{metrics['flops_per_s'] / 1e9:,.1f} GFLOP/s"
    mem = metrics["memory"]
    peak = mem.get("cuda_peak_bytes", mem["peak_rss_bytes"])
    return f"loss={loss:.3f}, tok/s={metrics['tokens_per_s'] * dp:,.0f}, {speed}, mem={peak / 2**20:,.0f} MiB"


@torch.no_grad()
def evaluate(apply, params, data: torch.Tensor, args, n_batches: int = 8) -> float:
    """Mean loss on ``n_batches`` fixed batches of held-out text (same batches every run)."""
    g = torch.Generator().manual_seed(0)
    total = 0.0
    for _ in range(n_batches):
        batch = get_batch(data, args.batch_size, args.block_size, g)
        logits = apply(params, batch["x"])
        total += F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten()).item()
    return total / n_batches


if __name__ == "__main__":
    main()
