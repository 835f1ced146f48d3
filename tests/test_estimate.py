"""``fzero.memory.model_state_bytes`` against the ZeRO paper's figures, and ``fzero estimate``."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fzero.cli.estimate import format_bytes, parse_count
from fzero.cli.main import main
from fzero.memory import coefficients, model_state_bytes, optimizer_state_bytes, rank_share, reduce_buffer_bytes

PSI = 1_000_000

# Rajbhandari et al. 2020, figure 1 / section 5: per-rank bytes of (params, grads, optimizer
# state) as (coefficient of Ψ, coefficient of Ψ/N); K = 12 under mixed precision (fp32
# master weights + two Adam moments), K = 8 for fp32 Adam.
PAPER = {
    "fp32": {0: ((4, 0), (4, 0), (8, 0)), 1: ((4, 0), (4, 0), (0, 8)),
             2: ((4, 0), (0, 4), (0, 8)), 3: ((0, 4), (0, 4), (0, 8))},
    "mixed": {0: ((2, 0), (2, 0), (12, 0)), 1: ((2, 0), (2, 0), (0, 12)),
              2: ((2, 0), (0, 2), (0, 12)), 3: ((0, 2), (0, 2), (0, 12))},
}
TOTALS = {  # the headline figures, written as the paper writes them
    "fp32": ["16Ψ", "8Ψ + 8Ψ/N", "4Ψ + 12Ψ/N", "16Ψ/N"],
    "mixed": ["16Ψ", "4Ψ + 12Ψ/N", "2Ψ + 14Ψ/N", "16Ψ/N"],
}


def _paper(coef, n, *, padded):
    a, b = coef
    shard = -(-PSI // n) if padded else Fraction(PSI, n)
    return a * PSI + b * shard


@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_matches_zero_paper(precision, stage, n):
    table = PAPER["fp32" if precision == "fp32" else "mixed"][stage]
    got = model_state_bytes(PSI, world_size=n, stage=stage, precision=precision)
    for part, coef in zip(("params", "grads", "optimizer"), table):
        assert got[part] == _paper(coef, n, padded=True), part
        # padding to a multiple of N adds less than one element per partitioned buffer
        extra = got[part] - _paper(coef, n, padded=False)
        assert extra == 0 or 0 < extra < coef[1]
    assert got["total"] == got["params"] + got["grads"] + got["optimizer"]
    if PSI % n == 0:  # no padding: the paper's figure exactly
        a, b = coefficients(stage=stage, precision=precision)
        assert got["total"] == a * PSI + b * PSI // n
        assert f"{a}Ψ + {b}Ψ/N".replace("0Ψ + ", "").replace(" + 0Ψ/N", "") == TOTALS[
            "fp32" if precision == "fp32" else "mixed"][stage]


@pytest.mark.parametrize("optimizer, states", [("adam", 2), ("adamw", 2), ("lamb", 2), ("lion", 1),
                                               ("sgd-momentum", 1), ("sgd_momentum", 1), ("sgd", 0)])
def test_optimizer_state_counts(optimizer, states):
    fp32 = model_state_bytes(PSI, world_size=1, stage=0, optimizer=optimizer)
    assert fp32["optimizer"] == 4 * states * PSI
    mixed = model_state_bytes(PSI, world_size=4, stage=1, precision="bf16", optimizer=optimizer)
    assert mixed["optimizer"] == (4 * states + 4) * PSI // 4  # + fp32 master weights


def test_padding():
    # 10 parameters over 4 ranks: each shard is padded to 3 elements
    got = model_state_bytes(10, world_size=4, stage=3)
    assert got == {"params": 12, "grads": 12, "optimizer": 24, "total": 48}
    assert model_state_bytes(10, world_size=4, stage=0)["total"] == 160


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_params=0, world_size=1, stage=0), "num_params"),
    (dict(num_params=10, world_size=0, stage=0), "world_size"),
    (dict(num_params=10, world_size=1, stage=5), "stage"),
    (dict(num_params=10, world_size=1, stage=1, precision="fp8"), "precision"),
    (dict(num_params=10, world_size=1, stage=1, optimizer="adafactor"), "optimizer"),
    (dict(num_params=10, world_size=1, stage=1, optimizer_bytes=-1.0), "optimizer_bytes"),
])
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=f"model_state_bytes: {name}"):
        model_state_bytes(kwargs.pop("num_params"), **kwargs)


def test_parse_count():
    assert parse_count("1.3B") == 1_300_000_000
    assert parse_count("125M") == parse_count("125m") == 125_000_000
    assert parse_count("7e9") == parse_count("7G") == 7_000_000_000
    assert parse_count("350K") == 350_000 and parse_count("2T") == 2 * 10**12
    assert parse_count("12345") == 12345 and parse_count("1_000") == 1000
    for bad, msg in [("1.3X", "not a parameter count"), ("B", "not a parameter count"),
                     ("1.5", "whole number"), ("0", "positive"), ("-1M", "positive"), ("inf", "whole number")]:
        with pytest.raises(ValueError, match=msg):
            parse_count(bad)


def test_format_bytes():
    assert format_bytes(2**30) == "1.00 GiB"
    assert format_bytes(3 * 2**20 // 2) == "1.50 MiB"
    assert format_bytes(1000) == "1000 B"


def test_cli_table(capsys):
    assert main(["estimate", "--params", "1.3B", "--world-size", "8", "--stage", "2", "--precision", "bf16",
                 "--optimizer", "adamw"]) == 0
    out = capsys.readouterr().out
    b = model_state_bytes(1_300_000_000, world_size=8, stage=2, precision="bf16", optimizer="adamw")
    row = next(line for line in out.splitlines() if line.strip().startswith("2 "))
    for part in ("params", "grads", "optimizer", "total"):
        assert format_bytes(b[part]) in row
    assert "4.54 GiB" in row and "2Ψ + 14Ψ/N" in row
    assert "activations" in out.lower() and "not counted" in out.lower()
    assert "1,300,000,000" in out and "N = 8" in out
    assert not any(line.strip().startswith(("0 ", "1 ", "3 ")) for line in out.splitlines())


def test_cli_all_stages_in_bytes(capsys):
    assert main(["estimate", "--params", "1M", "-N", "8", "--bytes"]) == 0
    out = capsys.readouterr().out
    rows = [r for r in map(str.split, out.splitlines()) if len(r) >= 6 and r[0] in {"0", "1", "2", "3"}]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    totals = [int(r[4].replace(",", "")) for r in rows]
    assert totals == [16 * PSI, 8 * PSI + PSI, 4 * PSI + 12 * PSI // 8, 2 * PSI]


@pytest.mark.parametrize("argv, name", [
    (["--params", "1.3X"], "argument --params"),
    (["--params", "1M", "--stage", "5"], "argument --stage"),
    (["--params", "1M", "--world-size", "0"], "argument --world-size"),
    (["--params", "1M", "--precision", "fp8"], "argument --precision"),
    (["--params", "1M", "--optimizer", "adafactor"], "argument --optimizer"),
        (["--params", "1M", "--optimizer-bytes", "nan"], "argument --optimizer-bytes"),
    (["--world-size", "8"], "--params"),
])
def test_cli_bad_input(capsys, argv, name):
    with pytest.raises(SystemExit) as e:
        main(["estimate", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "fzero estimate: error:" in err and name in err


def test_checkpoint_command_on_a_missing_path_names_it(capsys, tmp_path):
    missing = str(tmp_path / "no_such_checkpoint")
    assert main(["checkpoint", "verify", missing]) == 2
    assert "no such file or directory" in capsys.readouterr().err


# --------------------------------------------------------------------------- tensor and pipeline parallelism

_DEGREES = st.sampled_from([1, 2, 3, 4, 8])


@given(psi=st.integers(1, 10**12), stage=st.sampled_from([0, 1, 2, 3]),
       precision=st.sampled_from(["fp32", "bf16", "fp16"]), tp=_DEGREES, pp=_DEGREES, dp=_DEGREES)
def test_tp_and_pp_are_the_zero_formula_at_psi_over_tp_pp_and_n_dp(psi, stage, precision, tp, pp, dp):
    """A rank of a pp × dp × tp world holds Ψ/(tp·pp) parameters (rounded up), which ZeRO
    partitions over dp: the tp = pp = 1 formula at Ψ' and N = dp, buffers included."""
    world, local = pp * dp * tp, -(-psi // (tp * pp))
    assert rank_share(psi, world_size=world, tp=tp, pp=pp) == (local, dp)
    got = model_state_bytes(psi, world_size=world, stage=stage, precision=precision, tp=tp, pp=pp)
    assert got == model_state_bytes(local, world_size=dp, stage=stage, precision=precision)
    assert (reduce_buffer_bytes(psi, world_size=world, stage=stage, precision=precision, tp=tp, pp=pp)
            == reduce_buffer_bytes(local, world_size=dp, stage=stage, precision=precision))


@given(per_rank=st.integers(1, 10**6), stage=st.sampled_from([0, 1, 2, 3]),
       precision=st.sampled_from(["fp32", "bf16", "fp16"]), tp=_DEGREES, pp=_DEGREES, dp=_DEGREES)
def test_tp_and_pp_give_the_zero_paper_figure_when_every_split_is_even(per_rank, stage, precision, tp, pp, dp):
    psi = per_rank * dp * tp * pp  # Ψ' = Ψ/(tp·pp) and Ψ'/dp are whole: no rounding anywhere
    table = PAPER["fp32" if precision == "fp32" else "mixed"][stage]
    got = model_state_bytes(psi, world_size=pp * dp * tp, stage=stage, precision=precision, tp=tp, pp=pp)
    for part, (a, b) in zip(("params", "grads", "optimizer"), table):
        assert got[part] == a * psi // (tp * pp) + b * psi // (tp * pp * dp), part


def test_cli_prints_the_degrees_and_the_split_formula(capsys):
    assert main(["estimate", "--params", "13B", "--world-size", "64", "--tp", "4", "--pp", "2", "--stage", "2",
                 "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "64 ranks = pp 2 × dp 8 × tp 4" in out
    assert "Ψ' = Ψ/(tp·pp) = 1.625B parameters (1,625,000,000)" in out and "N = dp = 8" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("2 "))
    # by hand: Ψ' = 1.625e9; params 2Ψ' = 3.25e9 B, grads 2Ψ'/8, optimizer 12Ψ'/8
    for n in (3_250_000_000, 406_250_000, 2_437_500_000, 3_250_000_000 + 14 * 1_625_000_000 // 8):
        assert format_bytes(n) in row
    assert "2Ψ' + 14Ψ'/N" in row
    assert "evenly" in out and "LayerNorm" in out


def test_cli_with_tp_and_pp_one_is_the_plain_table(capsys):
    main(["estimate", "--params", "1M", "-N", "8", "--bytes"])
    plain = capsys.readouterr().out
    main(["estimate", "--params", "1M", "-N", "8", "--tp", "1", "--pp", "1", "--bytes"])
    assert capsys.readouterr().out == plain


@pytest.mark.parametrize("world, tp, pp, what", [(6, 4, 1, "not a multiple of"), (12, 1, 8, "not a multiple of"),
                                                 (2, 2, 2, "smaller than"), (1, 2, 1, "smaller than")])
def test_degrees_that_do_not_fit_the_world_are_named(capsys, world, tp, pp, what):
    with pytest.raises(SystemExit) as e:
        main(["estimate", "--params", "1M", "--world-size", str(world), "--tp", str(tp), "--pp", str(pp)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"fzero estimate: error: --world-size {world} is {what} --tp {tp} × --pp {pp} = {tp * pp}" in err
    for fn in (model_state_bytes, reduce_buffer_bytes):
        expected = f"{fn.__name__}: world_size={world} is {what} tp={tp} × pp={pp} = {tp * pp}"
        with pytest.raises(ValueError, match=expected):
            fn(10**6, world_size=world, stage=1, tp=tp, pp=pp)


@pytest.mark.parametrize("tp, pp, name", [(0, 1, "tp"), (1, -2, "pp"), (True, 1, "tp"), (1, 1.5, "pp")])
def test_degrees_must_be_positive_ints(tp, pp, name):
    with pytest.raises(ValueError, match=f"model_state_bytes: {name} must be a positive int"):
        model_state_bytes(10**6, world_size=4, stage=1, tp=tp, pp=pp)


@pytest.mark.parametrize("argv", [["--tp", "0"], ["--pp", "-1"], ["--tp", "x"]])
def test_cli_degrees_must_be_positive_integers(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(["estimate", "--params", "1M", *argv])
    assert e.value.code == 2 and f"argument {argv[0]}" in capsys.readouterr().err


# --------------------------------------------------------------------------- the estimate against the process


def _process_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process (views count once): a
    census of the process, not of the state pytree, so a dead copy anywhere shows."""
    import gc

    import torch

    import fzero.testing as ft

    gc.collect()
    return ft.storage_bytes([o for o in gc.get_objects() if isinstance(o, torch.Tensor)])


def _census(stage, precision, blocks=True, **options):
    import functools

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import fzero
    from fzero import optim

    from fzero.transforms.shard_state._reduce import ReduceSink

    before = _process_tensor_bytes()
    seen = {"peak": 0}
    finish = ReduceSink.finish

    def census_then_finish(sink):  # every gradient is in a reduce buffer: the stages' peak
        seen["peak"] = max(seen["peak"], _process_tensor_bytes() - before)
        return finish(sink)

    torch.manual_seed(0)
    # Twelve blocks in a ModuleList: ZeRO-3 gathers them one by one (the units). Without
    # ``blocks`` they stay a Sequential: no blocks for ZeRO-3 to find.
    model = nn.Sequential(nn.Linear(8, 128), nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh())
                                                             for _ in range(12)]), nn.Linear(128, 8))
    if blocks:
        model[1] = nn.ModuleList(model[1])
        model.forward = lambda x: model[2](functools.reduce(lambda h, b: b(h), model[1], model[0](x)))
    apply, params = fzero.functionalize(model)
    psi = sum(p.numel() for p in params.values())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-3))
    del params

    def train_step(state, batch):
        loss, g = fzero.value_and_grad(lambda p: F.mse_loss(state.apply_fn(p, batch["x"]), batch["y"]))(state.params)
        seen["peak"] = max(seen["peak"], _process_tensor_bytes() - before)
        return state.apply_gradients(g), {"loss": loss}

    step = fzero.compile(train_step, fzero.Mesh(dp=-1), zero=stage, precision=precision, **options)
    state = step.init(state)
    ReduceSink.finish = census_then_finish
    try:
        for _ in range(2):
            state, _ = step(state, {"x": torch.randn(4, 8), "y": torch.randn(4, 8)})
    finally:
        ReduceSink.finish = finish
    return psi, seen["peak"]


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_estimate_is_within_ten_percent_of_every_tensor_byte_the_process_holds(ranks, stage, precision):
    """At the model-state peak (every gradient in its reduce buffer, or just returned:
    parameters, gradients, optimizer state, masters and reduce buffers all alive), the bytes
    of every tensor in each rank's process against what ``fzero estimate`` prints as the
    total (``model_state_bytes`` + ``reduce_buffer_bytes`` at compile's default bucket). At
    stage 3 twice: this model, within the default reuse window, is gathered whole for the
    step; with ``max_reuse_distance=0`` its twelve blocks are units, gathered one by one; with
    a window of three and a half blocks they are four units of three, which the estimate
    works out from a block's size and the window; with a bucket of 256 KiB given it is
    gathered whole still, reduced in stage 2's buckets of that size. And the same layers
    with no ModuleList, above that window: no blocks to gather one by one, so gathered whole,
    which the estimate is told by ``block_params=0`` (what an autotuning trial measures);
    blocks of 1/32 of the model, the estimate's guess when it knows nothing, would miss."""
    runs = [({}, {})]
    if stage == 3:
        block = 128 * 128 + 128
        unit = block * (4 if precision == "fp32" else 2)  # stage 3's bucket: one block
        runs.append(({"max_reuse_distance": 0}, {"bucket_bytes": unit, "max_reuse_distance": 0}))
        window = block * 7 // 2
        runs.append(({"max_reuse_distance": window}, {"block_params": block, "max_reuse_distance": window}))
        runs.append(({"bucket_bytes": 2**18}, {"bucket_bytes": 2**18}))
        runs.append(({"max_reuse_distance": window, "blocks": False}, {"block_params": 0, "max_reuse_distance": window}))
    for options, bucket in runs:
        results = ranks(2).run(_census, stage, precision, **options)
        _check_census(results, stage, precision, bucket)
        if options.get("blocks") is False:  # the case tells the two apart
            guess = {**bucket, "block_params": None}
            with pytest.raises(AssertionError):
                _check_census(results, stage, precision, guess)


def _check_census(results, stage, precision, bucket):
    for psi, held in results:
        est = model_state_bytes(psi, world_size=2, stage=stage, precision=precision, optimizer="adamw")["total"]
        est += reduce_buffer_bytes(psi, world_size=2, stage=stage, precision=precision, **bucket)
        if stage == 1:
            # Stage 1 is estimated under accumulation (the whole gradient sum held); one
            # micro-batch, as here, reduces bucket by bucket and holds stage 2's bytes.
            low = model_state_bytes(psi, world_size=2, stage=2, precision=precision, optimizer="adamw")["total"]
            low += reduce_buffer_bytes(psi, world_size=2, stage=2, precision=precision)
            assert 0.90 * low <= held <= 1.10 * est, (stage, precision, psi, held, low, est)
            continue
        assert abs(held - est) <= 0.10 * est, (stage, precision, psi, held, est, held / est)


@pytest.mark.parametrize("kept, k", [
    ({"master_weights": "bf16"}, 10),  # bf16 masters + 2 fp32 moments
    ({"master_weights": "bf16", "optimizer_states": "bf16"}, 6),  # bf16 masters + 2 bf16 moments
    ({"master_weights": "bf16", "rounding": "kahan"}, 12),  # + a bf16 compensation
    ({"master_weights": "bf16", "optimizer_states": "bf16", "rounding": "kahan"}, 8),
])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_masters_and_states_are_the_formula_with_their_k(kept, k, stage):
    n = 8
    b = model_state_bytes(8 * PSI, world_size=n, stage=stage, precision="bf16", **kept)
    per_param = {0: 4 + k, 1: 4 + k / n, 2: 2 + (2 + k) / n, 3: (4 + k) / n}[stage]
    assert b["total"] == per_param * 8 * PSI


def test_cli_bf16_masters_and_states(capsys):
    assert main(["estimate", "--params", "1M", "-N", "8", "--bytes", "--precision", "bf16", "--master-weights", "bf16",
                 "--optimizer-states", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "bf16 master weights" in out and "2 bf16 states" in out
    rows = {r[0]: r for r in map(str.split, out.splitlines()) if len(r) >= 6 and r[0] in {"0", "1", "2", "3"}}
    assert int(rows["2"][4].replace(",", "")) == 2 * PSI + 8 * PSI // 8 and "2Ψ + 8Ψ/N" in " ".join(rows["2"])


@pytest.mark.parametrize("shape, block", [([], None), (["--layers", "12", "--hidden", "512"], 12 * 512**2 + 13 * 512),
                                          (["--layers", "3", "--hidden", "1024"], 12 * 1024**2 + 13 * 1024)])
def test_cli_stage_3_buffers_are_two_units_as_shard_state_cuts_them(capsys, shape, block):
    """Stage 3's buffers, 40M fp32 parameters on 8 ranks (a model above the 25 MiB window):
    two units gathered and two units' fp32 reduce buffers, a unit being as many blocks as
    fit in 25 MiB of parameters (6,553,600 fp32 elements), or one block larger than that.
    Blocks of 1/32 of the model unless --layers and --hidden give a GPT's."""
    assert main(["estimate", "--params", "40M", "-N", "8", "--stage", "3", "--bytes", *shape]) == 0
    out = capsys.readouterr().out
    row = next(r for r in map(str.split, out.splitlines()) if r[:1] == ["3"])
    window = 25 * 2**20 // 4
    block = block or 40_000_000 // 32
    unit = block * max(1, window // block)  # 1/32: 5 blocks of 1.25M; width 512: 2 of 3.15M; 1024: one of 12.6M
    assert int(row[5].replace(",", "")) == 4 * min(40_000_000, 2 * unit) * 2, (row, unit)


@pytest.mark.parametrize("argv, says", [
    (["--master-weights", "bf16"], "--master-weights bf16 needs --precision bf16"),
    (["--precision", "bf16", "--optimizer-states", "bf16"], "--optimizer-states bf16 needs --master-weights bf16"),
    (["--precision", "bf16", "--rounding", "kahan"], "--rounding kahan needs --master-weights bf16"),
])
def test_cli_bf16_kept_dtypes_that_contradict_are_named(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        main(["estimate", "--params", "1M", *argv])
    assert e.value.code == 2 and says in capsys.readouterr().err


# --------------------------------------------------------------------------- measured optimizer state


def _optimizers():
    import torch

    from fzero import optim

    matrices = lambda p: {k: v.ndim == 2 for k, v in p.items()}  # noqa: E731
    rest = lambda p: {k: v.ndim != 2 for k, v in p.items()}  # noqa: E731
    txs = {name: optim.from_torch(getattr(torch.optim, name), lr=0.01, **kw) for name, kw in [
        ("SGD", {"momentum": 0.9}), ("Adam", {"amsgrad": True}), ("AdamW", {}), ("Adamax", {}), ("NAdam", {}),
        ("RAdam", {}), ("RMSprop", {"momentum": 0.5, "centered": True}), ("Adagrad", {}), ("Adadelta", {}),
        ("ASGD", {}), ("Rprop", {}), ("Adafactor", {})]}
    txs["Muon + AdamW"] = optim.chain(optim.masked(optim.from_torch(torch.optim.Muon, lr=0.01), matrices),
                                      optim.masked(optim.from_torch(torch.optim.AdamW, lr=0.01), rest))
    txs.update(adamw=optim.adamw(1e-3), sgd=optim.sgd(0.1, momentum=0.9), lion=optim.lion(1e-4),
               lamb=optim.lamb(1e-3), adafactor=optim.adafactor(0.01, min_dim_size_to_factor=4),
               muon=optim.muon(0.01))
    return txs


def _live_bytes(state) -> int:
    import torch

    import fzero

    return sum(t.numel() * t.element_size() for t in fzero.tree.leaves(state) if isinstance(t, torch.Tensor))


def test_optimizer_state_bytes_measured_on_meta_equal_a_real_states_bytes():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5))
    model[2].bias.requires_grad_(False)  # frozen: no state
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    for name, tx in _optimizers().items():
        live = _live_bytes(tx.init(params))
        assert optimizer_state_bytes(tx, model) == live, name
        with torch.device("meta"):  # a model built without memory counts the same
            meta = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5))
        meta[2].bias.requires_grad_(False)
        assert optimizer_state_bytes(tx, meta) == live, name


def test_the_optimizer_table_is_what_the_optimizers_keep():
    """Each named row of OPTIMIZER_STATES against torch's own optimizer measured on a large
    matrix (the per-tensor scalars vanish in the bytes per element)."""
    import torch

    from fzero import optim
    from fzero.memory import OPTIMIZER_STATES

    params = {"w": torch.empty(1000, 1000, device="meta")}
    torch_of = {"adam": ("Adam", {}), "adamw": ("AdamW", {}), "adadelta": ("Adadelta", {}), "rprop": ("Rprop", {}),
                "sgd-momentum": ("SGD", {"momentum": 0.9}), "muon": ("Muon", {}), "adagrad": ("Adagrad", {}),
                "rmsprop": ("RMSprop", {}), "sgd": ("SGD", {})}
    native = {"lamb": optim.lamb(1e-3), "lion": optim.lion(1e-4)}
    assert set(torch_of) | set(native) == set(OPTIMIZER_STATES)
    for name, states in OPTIMIZER_STATES.items():
        if name in native:
            tx = native[name]
        else:
            cls, kw = torch_of[name]
            tx = optim.from_torch(getattr(torch.optim, cls), lr=0.01, **kw)
        per_param = optimizer_state_bytes(tx, params) / 1e6
        assert abs(per_param - 4 * states) < 1e-4, (name, per_param)
        got = model_state_bytes(10**6, world_size=4, stage=1, optimizer_bytes=per_param)["optimizer"]
        assert got == math.ceil(per_param * 250_000), name


def test_measured_bytes_per_parameter_drive_the_estimate(capsys):
    assert model_state_bytes(PSI, world_size=4, stage=1, optimizer_bytes=8) == \
        model_state_bytes(PSI, world_size=4, stage=1, optimizer="adam")
    got = model_state_bytes(PSI, world_size=4, stage=2, precision="bf16", optimizer_bytes=0.5)
    assert got["optimizer"] == 4.5 * PSI // 4  # + the fp32 masters
    assert coefficients(stage=2, precision="bf16", optimizer_bytes=0.5) == (2, 6.5)
    assert main(["estimate", "--params", "1M", "-N", "4", "--stage", "2", "--precision", "bf16",
                 "--optimizer-bytes", "0.5", "--bytes"]) == 0
    out = capsys.readouterr().out
    assert "0.5 bytes of state per parameter" in out and "2Ψ + 6.5Ψ/N" in out and "1,125,000" in out, out


def _state_bytes_on_ranks():
    """Each optimizer under ZeRO 1 and 3 on 2 ranks: this rank's live bytes of optimizer
    state, and what optimizer_state_bytes measures for the busiest rank."""
    import torch

    import fzero
    import fzero.testing as ft

    out = []
    for stage in (1, 3):
        for name, tx in _optimizers().items():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5))
            apply, params = fzero.functionalize(model)
            step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), zero=stage)
            state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=tx))
            out.append((f"{name} zero={stage}", _live_bytes(state.opt_state),
                        optimizer_state_bytes(tx, model, world_size=2)))
    return out


@pytest.mark.multirank
@pytest.mark.slow
def test_optimizer_state_bytes_per_rank_are_the_busiest_ranks_live_bytes(ranks):
    r0, r1 = ranks(2).run(_state_bytes_on_ranks)
    wrong = [(name, a, b, est) for (name, a, est), (_, b, _) in zip(r0, r1) if max(a, b) != est]
    assert not wrong, wrong
