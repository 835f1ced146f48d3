"""Fuzzed bad input: DeepSpeed configs, batches given to a compiled step, and checkpoint
manifests, drawn by hypothesis (:mod:`fzero.testing.fuzz`).

Every case ends in a named error (a ``ValueError``/``TypeError``/``NotImplementedError``
naming the key path, fzero's error naming the leaf, a ``CheckpointError`` naming the file),
in the error the user's own step raised, passed through as it was, or in a correct run:
never an ``AttributeError``/``KeyError``/``IndexError`` from fzero's inside, never a value
accepted that the key does not take, never a read outside the checkpoint's directory.

A correct run is checked against plain PyTorch (a module, ``mse_loss``, ``backward`` and
``torch.optim.SGD``); a non-finite batch against the state before it (the update skipped).
The bigger run, with counts of each outcome, is ``benchmarks/fuzz.py``.
"""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import fzero
import fzero.checkpoint as ckpt
import fzero.testing as ft
from fzero import optim
from fzero.testing import fuzz

SETTINGS = settings(max_examples=40, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ----------------------------------------------------------------------------------- configs


@SETTINGS
@given(fuzz.bad_values())
@example(("compile.backend", 0))  # a disabled compile section's values were not checked
@example(("compile.kwargs", []))
@example(("torch_autocast.dtype", "float8"))
@example(("optimizer.params", 0))  # `params or {}` took a 0 for an empty section
@example(("scheduler.params", ""))
def test_a_value_a_key_does_not_take_is_refused_naming_the_key(case):
    fuzz.config_value_case(*case)


@SETTINGS
@given(fuzz.config_mutations(), st.sampled_from([1, 2, 3]))
def test_any_change_to_a_config_gives_a_config_or_an_error_naming_a_changed_key(case, world_size):
    fuzz.config_change_case(*case, world_size)


@settings(SETTINGS, max_examples=30)
@given(fuzz.config_texts())
@example('{"train_micro_batch_size_per_gpu": 2, "fzero": ' + '{"a": ' * 200_000 + "1" + "}" * 200_001)  # RecursionError
def test_a_damaged_json_config_gives_a_config_or_an_error_saying_where(text):
    fuzz.config_text_case(text)


@pytest.mark.parametrize("what, config, keys", fuzz.CONTRADICTIONS, ids=[c[0] for c in fuzz.CONTRADICTIONS])
def test_a_config_that_contradicts_itself_is_refused_naming_both_sides(what, config, keys):
    fuzz.contradiction_case(config, keys)


@settings(SETTINGS, max_examples=12)
@given(fuzz.valid_configs(), ft.seeds())
def test_a_valid_config_builds_and_runs_one_step_with_plain_pytorchs_loss(d, seed):
    fuzz.valid_config_case(d, seed)


# ----------------------------------------------------------------------------------- batches


def _given(kx, ky, rows=3, tree="dict"):
    return {"rows": rows, "x": kx, "y": ky, "tree": tree,
            "batch": {"x": fuzz.make_leaf(kx, rows, 4, 0), "y": fuzz.make_leaf(ky, rows, 2, 1)}}


@SETTINGS
@given(fuzz.batches(), st.sampled_from([1, 2, 3]), st.sampled_from(["fp32", "bf16", "fp16"]))
@example(_given("nan", "good"), 1, "fp32")
@example(_given("good", "inf"), 2, "bf16")
@example(_given("empty", "empty"), 1, "fp32")
@example({**_given("good", "good"), "tree": "extra",  # a NaN in a leaf the step does not read: a correct step
          "batch": {**_given("good", "good")["batch"], "z": fuzz.make_leaf("nan", 3, 3, 2)}}, 1, "bf16")
@example(_given("good", "good", rows=3), 2, "fp32")
def test_a_bad_batch_is_a_named_error_the_steps_own_error_or_a_correct_step(case, accumulate, precision):
    fuzz.batch_case(case, accumulate, precision)


def _linear():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def _rank_cases():
    """Each rank's outcome of a few bad batches, in one launch: the same bad batch on both
    ranks, a NaN on rank 1 only, a key rank 0 has not, and different row counts. An error
    must end the step on both ranks alike (never one rank raising while the other waits)."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    mine = {"x": x[rank * 4:(rank + 1) * 4], "y": y[rank * 4:(rank + 1) * 4]}
    cases = {
        "rows not divisible by accumulate": (2, {"x": mine["x"][:3], "y": mine["y"][:3]}),
        "NaN on rank 1": (1, {"x": mine["x"].clone().fill_(math.nan) if rank == 1 else mine["x"], "y": mine["y"]}),
        "an extra key on rank 1": (1, {**mine, **({"z": torch.zeros(4, 3)} if rank == 1 else {})}),
        "3 rows on rank 1, 4 on rank 0": (1, {"x": mine["x"][:3 + (rank == 0)], "y": mine["y"][:3 + (rank == 0)]}),
    }
    out = {}
    for name, (accumulate, batch) in cases.items():
        for zero in (0, 2):
            apply, params = fzero.functionalize(_linear())
            state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
            step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), zero=zero, accumulate=accumulate, donate=False)
            state = step.init(state)
            before = {k: v.clone() for k, v in fzero.gather(state.params).items()}
            try:
                new, _ = step(state, batch)
            except (ValueError, TypeError, RuntimeError) as e:
                out[name, zero] = ("named" if str(e).startswith("fzero") else "other", type(e).__name__, str(e)[:300])
                continue
            after = fzero.gather(new.params)
            out[name, zero] = ("ran", int(new.step), all(torch.equal(after[k], before[k]) for k in before),
                               {k: v.clone() for k, v in after.items()})
    return out


@pytest.mark.multirank
def test_bad_batches_on_two_ranks_end_alike_on_both(ranks):
    r0, r1 = ranks(2, timeout_s=120.0, collective_timeout_s=30.0).run(_rank_cases)
    for zero in (0, 2):
        a, b = r0["rows not divisible by accumulate", zero], r1["rows not divisible by accumulate", zero]
        assert a[0] == b[0] == "named" and "divide" in a[2], (a, b)
        a, b = r0["3 rows on rank 1, 4 on rank 0", zero], r1["3 rows on rank 1, 4 on rank 0", zero]
        assert a[0] == b[0] == "named" and "rank 0: 4, rank 1: 3" in a[2], (a, b)
        assert "batch['x'], shape (4, 4)" in a[2] and "batch['x'], shape (3, 4)" in b[2], (a, b)  # the leaf named
        a, b = r0["NaN on rank 1", zero], r1["NaN on rank 1", zero]
        assert a[:3] == b[:3] == ("ran", 0, True), (a[:3], b[:3])  # skipped on both: the state unchanged
        for name in ("an extra key on rank 1",):
            a, b = r0[name, zero], r1[name, zero]
            assert a[0] in ("ran", "named") and a[0] == b[0], (name, zero, a[:3], b[:3])
            if a[0] == "ran":  # the replicas agree after the step
                assert a[1] == b[1] == 1 and all(torch.equal(a[3][k], b[3][k]) for k in a[3]), name


# -------------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return fuzz.save_checkpoint(str(tmp_path_factory.mktemp("fuzz_checkpoint")))


@SETTINGS
@given(st.data(), st.sampled_from(fuzz.READS))
def test_a_mutated_manifest_is_a_checkpoint_error_and_reads_nothing_outside_the_directory(saved, data, how):
    fuzz.manifest_case(saved, data.draw(fuzz.manifest_mutations(saved.nodes)), how)


# Manifest edits the fuzz found, each once a TypeError, KeyError, IndexError or a huge
# allocation: (where, value) set, or (where, DELETE) removed. Leaves 0 and 4 are the tensors
# ['b'] and ['w'], 1-3 the values ['flag'], ['lr'], ['n'].
DELETE = object()
_FOUND = [
    (("leaves", 4, "pieces", 0, "file"), [1, 2], "load"),  # unhashable file name
    (("leaves", 4, "dtype"), [], "load"),  # unhashable dtype
    (("leaves", 3, "type"), {}, "load"),  # unhashable value type
    (("leaves", 2, "value"), "int", "load"),  # a float leaf whose text is not a number
    (("files", "rank00000.safetensors", "crc32"), DELETE, "verify"),
    (("files", "rank00000.safetensors", "rank"), DELETE, "load"),
    (("files", "rank00000.safetensors", "head_bytes"), 2**62, "load"),  # a 4 EiB header allocated
    (("rng", 0, "tensors", "rng.torch", "nbytes"), 2**62, "load, restore_rng=True"),  # a 4 EiB RNG state
    (("leaves", 4, "shape"), [2**40], "export"),  # a shape its pieces cannot hold
    (("leaves", 4, "pieces", 0, "start"), 13, "load"),  # start after stop
    (("rng", 0, "python", "gauss_next"), DELETE, "load, restore_rng=True"),
    (("rng", 0, "python", "version"), "x", "load, restore_rng=True"),  # random.setstate's ValueError
    (("rng", 0, "numpy", "keys"), [1, 2], "load, restore_rng=True"),  # numpy's IndexError
    (("rng", 0, "numpy", "keys", 0), None, "load, restore_rng=True"),
    (("rng", 0, "numpy", "kind"), DELETE, "load, restore_rng=True"),
    (("leaves", 4, "entries"), [0, 0], "export"),  # 'int' object is not subscriptable
    (("leaves", 4, "sharding"), True, "inspect"),  # inspect: 'bool' object is not subscriptable
    (("stages",), 3, "inspect"),  # 'int' object is not iterable
    (("fzero_version",), DELETE, "inspect"),  # KeyError
]


@pytest.mark.parametrize("where, value, how", _FOUND, ids=[f"{'.'.join(map(str, w))}-{h}" for w, _, h in _FOUND])
def test_each_manifest_edit_the_fuzz_found_is_named(saved, where, value, how):
    change = (where, "del", None) if value is DELETE else (where, "set", value)
    # inspect shows a descriptive field (step, stages, versions) as written, or "?"
    expect = "ran" if how == "inspect" and where[0] != "leaves" else "named"
    fuzz.manifest_case(saved, [change], how, expect=expect)


@pytest.mark.parametrize("damaged", ["manifest.json", "COMMITTED"])
def test_a_manifest_or_marker_nested_too_deeply_to_parse_is_named(saved, tmp_path, damaged):
    path = str(tmp_path / "deep")
    shutil.copytree(saved.path, path)
    with open(os.path.join(path, damaged), "w") as f:
        f.write("[" * 200_000 + "]" * 200_000)  # json recurses once per level: a RecursionError, once
    if damaged == "COMMITTED":  # a marker that does not parse: not a committed checkpoint
        assert ckpt.latest(str(tmp_path)) is None
    with pytest.raises(ckpt.CheckpointError, match=f"{damaged}.*not valid JSON"):
        ckpt.load(path, like=fuzz.SAVED_STATE, verify=False)


def test_the_manifest_case_fails_on_a_read_outside_the_checkpoint(saved, monkeypatch):
    """The audit hook is what holds the reads to the checkpoint's directory: a read of the
    saved original beside it (where a `../` name would lead) fails the case."""
    import os

    def read_the_sibling(path, how):
        with open(os.path.join(saved.path, "manifest.json"), "rb") as f:
            return f.read()

    monkeypatch.setattr(fuzz._manifests, "_read", read_the_sibling)
    with pytest.raises(AssertionError, match="src/manifest.json"):
        fuzz.manifest_case(saved, [], "load")
