"""The GPT example: a stored loss curve (torchtitan's loss-parity check) and the sampler.

``tests/data/gpt_loss_curve.json`` holds the first 20 losses of a small fixed config, and
the exact command that wrote it (its "command" field); run that command from the repository
root to regenerate the file after a change that is meant to change the numbers.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shlex
import sys
from pathlib import Path

import pytest
import torch

import fzero
import fzero.testing as ft

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # the example imports its model as `gpt`

import train_gpt  # noqa: E402
from gpt import GPT, GPTConfig, generate  # noqa: E402

CURVE = json.loads((ROOT / "tests" / "data" / "gpt_loss_curve.json").read_text())

# Same program, same seed, same thread count: every step is the same sequence of kernels.
# rtol 1e-5 (SPEC's reduction-order bound). Repeated runs on the recording machine are
# bit-identical, even with other jobs competing for its 2 cores: with a fixed thread count
# each matmul splits its reduction the same way. The slack is for a CPU whose kernels use
# another vector width (a different summation order); a change in the math moves the
# losses by far more than 1e-5 within a few steps.
RTOL, ATOL, _ = ft.TOLERANCES["recorded losses"]


def _argv(tmp_path: Path) -> list[str]:
    """The stored command's arguments, with the log written to ``tmp_path``."""
    argv = shlex.split(CURVE["command"])[2:]  # drop "python examples/train_gpt.py"
    i = argv.index("--log-losses")
    argv[i + 1] = str(tmp_path / "losses.json")
    return argv


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt")
    threads = torch.get_num_threads()
    try:
        out = train_gpt.main(_argv(tmp))
    finally:
        torch.set_num_threads(threads)  # main() sets it; leave the session as we found it
    return out, json.loads((tmp / "losses.json").read_text())


def test_loss_curve_matches_stored(run):
    out, log = run
    data, _ = train_gpt.load_stdlib(CURVE["config"]["max_bytes"])
    if hashlib.sha256(data.numpy().tobytes()).hexdigest() != CURVE["data_sha256"]:
        pytest.skip(f"this Python's stdlib ({platform.python_version()}) is not the one the curve was "
                    f"recorded on ({CURVE['python']}); regenerate with: {CURVE['command']}")
    if torch.__version__.split("+")[0] != CURVE["torch"].split("+")[0]:
        pytest.skip(f"torch {torch.__version__} differs from the recorded {CURVE['torch']}; "
                    f"regenerate with: {CURVE['command']}")
    assert log["losses"] == out["losses"]
    got, want = torch.tensor(out["losses"], dtype=torch.float64), torch.tensor(CURVE["losses"], dtype=torch.float64)
    assert got.shape == want.shape
    bad = [(i, g, w) for i, (g, w) in enumerate(zip(got.tolist(), want.tolist()))
           if abs(g - w) > ATOL + RTOL * abs(w)]
    assert not bad, f"steps whose loss left the stored curve (step, got, stored): {bad}"


def test_loss_falls(run):
    losses = run[0]["losses"]
    assert len(losses) == 20
    # Byte-level: an untrained model is near uniform, ln(256) = 5.55 (a little under: the tied
    # head favours repeating the input byte, and code repeats spaces). 20 small steps must
    # take a good part of that off.
    assert 5.0 < losses[0] < 5.7, losses[0]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    assert run[0]["val_loss"] < losses[0] - 1.0


def test_generate_returns_requested_length():
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=16)
    apply, params = fzero.functionalize(GPT(cfg))
    idx = torch.tensor([list(b"abc"), list(b"xyz")])
    # 20 > block_size: the sampler must crop its context, not fail on the position table.
    out = generate(apply, params, idx, 20, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 3 + 20)
    assert torch.equal(out[:, :3], idx)
    assert 0 <= int(out.min()) and int(out.max()) < 256
    again = generate(apply, params, idx, 20, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    assert len(bytes(out[0].tolist())) == 23

def test_remat_blocks_give_the_plain_modules_gradients():
    """``GPTConfig(remat=True)`` (the GPU offload search's setting) checkpoints each block:
    the same loss and gradients as the module without it, in plain PyTorch with dropout (the
    recomputation draws the same masks) and under fzero's bf16 step; and the forward keeps
    fewer tensors for backward."""
    cfg = dict(block_size=16, n_layer=3, n_head=2, n_embd=32)
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))

    def loss_of(model, p=None):
        logits = model(x[:, :-1]) if p is None else model(p, x[:, :-1])
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())

    def saved_by_forward(model):
        count = [0]

        def pack(t):
            count[0] += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_of(model)
        return count[0]

    torch.manual_seed(1)
    plain = GPT(GPTConfig(**cfg, dropout=0.1))
    remat = GPT(GPTConfig(**cfg, dropout=0.1, remat=True))
    remat.load_state_dict(plain.state_dict())
    grads = []
    for model in (plain, remat):
        torch.manual_seed(2)
        loss = loss_of(model)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert torch.equal(grads[0][0], grads[1][0])
    for n, g in grads[0][1].items():
        assert torch.equal(g, grads[1][1][n]), n
    assert saved_by_forward(remat) < saved_by_forward(plain) // 2

    # Inside fzero's bf16 step (NormWeight leaves, seen again by the recomputation in
    # backward): two steps with the blocks checkpointed equal two without, bit for bit.
    def train(remat):
        torch.manual_seed(1)
        apply, params = fzero.functionalize(GPT(GPTConfig(**cfg, remat=remat)))
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=fzero.optim.adamw(1e-3))

        def train_step(state, batch):
            loss, g = fzero.value_and_grad(lambda p: loss_of(state.apply_fn, p))(state.params)
            return state.apply_gradients(g), {"loss": loss}

        step = fzero.compile(train_step, fzero.Mesh(dp=1), precision="bf16")
        state = step.init(state)
        losses = []
        for _ in range(2):
            state, metrics = step(state, {})
            losses.append(metrics["loss"])
        return torch.stack(losses), state.params

    (l0, p0), (l1, p1) = train(False), train(True)
    assert torch.equal(l0, l1)
    for n in p0:
        assert torch.equal(p0[n], p1[n]), n


def _train_at_tp2(argv):
    threads = torch.get_num_threads()
    try:
        out = train_gpt.main(argv + ["--tp", "2", "--no-progress"])
    finally:
        torch.set_num_threads(threads)  # main() sets it; the rank pool's processes serve later tests
    return out["losses"], out["sample"]


@pytest.mark.slow
@pytest.mark.multirank
def test_the_example_at_tp2_trains_as_one_process(run, ranks, tmp_path):
    """``--tp 2`` (the example GPT's heads and MLPs split over 2 ranks, one batch) gives the one-process
    losses and the same sample."""
    results = ranks(2).run(_train_at_tp2, _argv(tmp_path))
    for losses, sample in results:
        ft.assert_trees_close(torch.tensor(losses), torch.tensor(run[0]["losses"]), tol="fp32", what="losses")
        assert sample == run[0]["sample"]
