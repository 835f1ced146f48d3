"""fzero.checkpoint: round trips, resharding N -> M and stage s -> t on real ranks, atomic
commits under SIGKILL, checksums, pickle-freedom, export, deterministic resume, the CLI.

World-of-one parts run in this process (no process group); worlds of 2 and 3 run on the
session's ``ranks`` pools, or on one-shot worlds where a rank is killed.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import random
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fzero
import fzero.checkpoint as ckpt
import fzero.testing as ft
from fzero import optim, tree
from fzero.checkpoint.cli import main as cli_main
from fzero.transforms.shard_state import Shard, ShardInfo
from fzero.transforms.shard_state._layout import build_layout

MULTI = [pytest.mark.multirank, pytest.mark.slow]


# --------------------------------------------------------------------------- helpers


def _rank_world():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _on(ranks, n, fn, *args):
    """``fn(*args)`` on a world of ``n``: in this process for one, on a pool otherwise."""
    return [fn(*args)] if n == 1 else ranks(n).run(fn, *args)


def _equal(actual, expected, what):
    """Bitwise equality of two pytrees (dtypes included)."""
    tree.assert_same_structure(expected, actual, what=what, names=("expected", "actual"))
    for path, a, e in zip(tree.paths(expected), tree.leaves(actual), tree.leaves(expected)):
        k = tree.keystr(path)
        if isinstance(e, torch.Tensor):
            assert a.dtype == e.dtype and a.shape == e.shape, f"{what} {k}: {a.dtype}{tuple(a.shape)} vs {e.dtype}{tuple(e.shape)}"
            assert torch.equal(a.reshape(-1).view(torch.uint8), e.reshape(-1).view(torch.uint8)), \
                f"{what} {k}: values differ"
        else:
            assert a == e and type(a) is type(e), f"{what} {k}: {a!r} vs {e!r}"


def _partition(state, world, rank, stage, bucket_bytes):
    """A ZeRO-like layout of a generic state {"step", "params", "opt_state", "extra"}:
    stage 0 all replicated, 1-2 ``opt_state['mu']`` cut into Shards, 3 ``params`` too."""

    def cut(t):
        leaves, spec = tree.flatten(t)
        named = {f"{i:04d}": x for i, x in enumerate(leaves)}
        shards = build_layout(named, world=world, rank=rank, bucket_bytes=bucket_bytes).shard_params(named)
        return tree.unflatten(spec, [shards[k] for k in named])

    out = dict(state)
    if stage >= 1:
        out["opt_state"] = {**state["opt_state"], "mu": cut(state["opt_state"]["mu"])}
    if stage == 3:
        out["params"] = cut(state["params"])
    return out


def _zeros_like(state):
    return tree.map(lambda x: torch.zeros_like(x) if isinstance(x, torch.Tensor) else x, state)


_LEAF_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.bool)


@st.composite
def _states(draw):
    """Random generic states: nested dicts/lists/tuples of tensors of several dtypes and
    shapes (0-dim and empty included), Python scalars, and a step."""
    leaf = st.builds(
        lambda shape, dtype, seed: _tensor(shape, dtype, seed),
        ft.shapes(min_side=0, max_side=5), st.sampled_from(_LEAF_DTYPES), ft.seeds())
    params = draw(ft.pytrees(max_depth=2, max_children=3, leaf=leaf))
    mu = tree.map(lambda x: _tensor(tuple(x.shape), x.dtype, draw(ft.seeds())), params)
    return {
        "step": torch.tensor(draw(st.integers(0, 10**6)), dtype=torch.int64),
        "params": params,
        "opt_state": {"count": torch.tensor(3, dtype=torch.int32), "mu": mu},
        "extra": {"lr": draw(st.floats(-1e3, 1e3)), "name": draw(st.text(max_size=5)), "on": draw(st.booleans()),
                  "n": draw(st.integers(-5, 5))},
    }


def _tensor(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _save_generic(path, state, stage, bucket):
    r, n = _rank_world()
    ckpt.save(path, _partition(state, n, r, stage, bucket))


def _load_generic(path, state, stage, bucket):
    r, n = _rank_world()
    like = _partition(_zeros_like(state), n, r, stage, bucket)
    out = ckpt.load(path, like=like)
    # Shard metadata comes from like, untouched.
    for a, b in zip(tree.leaves(out, is_leaf=lambda x: isinstance(x, Shard)),
                    tree.leaves(like, is_leaf=lambda x: isinstance(x, Shard))):
        assert type(a) is type(b) and (not isinstance(a, Shard) or a.info == b.info)
    return fzero.gather(out)


# --------------------------------------------------------------------------- one process


@settings(max_examples=25, deadline=None)
@given(state=_states(), stage=st.sampled_from([0, 1, 3]), bucket=st.sampled_from([8, 2**20]))
def test_round_trip_is_bitwise_for_any_tree(tmp_path_factory, state, stage, bucket):
    path = str(tmp_path_factory.mktemp("rt") / "ck")
    _save_generic(path, state, stage, bucket)
    _equal(_load_generic(path, state, stage, bucket), state, "round trip")
    _equal(_load_generic(path, state, 0, bucket), state, "round trip to stage 0")
    assert ckpt.verify(path)["files"] == 1


def test_files_are_safetensors_and_the_manifest_says_what_is_where(tmp_path):
    from safetensors import safe_open

    state = _partition({"step": torch.tensor(7), "params": {"w": torch.randn(3, 4), "b": torch.randn(4)},
                        "opt_state": {"count": torch.tensor(1), "mu": {"w": torch.randn(3, 4), "b": torch.randn(4)}},
                        "extra": {}}, 1, 0, 1, 2**20)
    ckpt.save(tmp_path / "ck", state, metadata={"loader": {"epoch": 2, "index": 17}, "tags": ("a", "b")})
    man = ckpt.manifest(tmp_path / "ck")
    assert man["step"] == 7 and man["world_size"] == 1 and man["stages"] == [1, 2]
    assert man["fzero_version"] == fzero.__version__ and man["format"] == "fzero.checkpoint"
    assert ckpt.metadata(tmp_path / "ck") == {"loader": {"epoch": 2, "index": 17}, "tags": ["a", "b"]}
    leaves = {rec["path"]: rec for rec in man["leaves"]}
    assert set(leaves) == {"['step']", "['params']['b']", "['params']['w']", "['opt_state']['count']",
                           "['opt_state']['mu']['b']", "['opt_state']['mu']['w']"}
    rec = leaves["['opt_state']['mu']['w']"]
    assert rec["shape"] == [3, 4] and rec["dtype"] == "float32" and rec["sharding"]["world"] == 1
    assert [(p["start"], p["stop"]) for p in rec["pieces"]] == [(0, 12)]
    assert leaves["['params']['w']"]["sharding"] is None
    for name, info in man["files"].items():
        assert len(info["crc32"]) == 8 and info["bytes"] == os.path.getsize(tmp_path / "ck" / name)
        with safe_open(str(tmp_path / "ck" / name), framework="pt") as f:
            pieces = [p for r in man["leaves"] for p in r.get("pieces", ()) if p["file"] == name]
            assert set(f.keys()) == {p["name"] for p in pieces} | {"rng.torch"}
            for p in pieces:
                assert f.get_tensor(p["name"]).numel() == p["stop"] - p["start"]
            assert f.get_tensor("rng.torch").dtype == torch.uint8


def test_latest_retention_and_overwrite(tmp_path):
    assert ckpt.latest(tmp_path) is None and ckpt.latest(tmp_path / "nope") is None
    for s in (1, 3, 2):
        ckpt.save(tmp_path / f"step_{s}", {"step": torch.tensor(s), "w": torch.full((2,), float(s))})
    assert ckpt.latest(tmp_path) == str(tmp_path / "step_3")  # by step, not by name or time
    (tmp_path / "step_9").mkdir()  # uncommitted: no marker
    (tmp_path / "step_9" / "manifest.json").write_text("{}")
    (tmp_path / ".step_8.tmp-abc").mkdir()
    assert ckpt.latest(tmp_path) == str(tmp_path / "step_3")
    with pytest.raises(ckpt.CheckpointError, match="no COMMITTED marker"):
        ckpt.load(tmp_path / "step_9", like={"w": torch.zeros(2)})
    with pytest.raises(FileExistsError, match="overwrite=True"):
        ckpt.save(tmp_path / "step_3", {"step": torch.tensor(3), "w": torch.zeros(2)})
    ckpt.save(tmp_path / "step_3", {"step": torch.tensor(3), "w": torch.full((2,), 33.0)}, overwrite=True)
    assert ckpt.load(tmp_path / "step_3", like={"step": torch.tensor(0), "w": torch.zeros(2)})["w"].tolist() == [33.0] * 2
    ckpt.save(tmp_path / "step_4", {"step": torch.tensor(4), "w": torch.zeros(2)}, keep=2)
    committed = sorted(p.name for p in tmp_path.iterdir() if (p / "COMMITTED").exists())
    assert committed == ["step_3", "step_4"]
    assert not any(".del-" in p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match="keep=0"):
        ckpt.save(tmp_path / "x", {"w": torch.zeros(1)}, keep=0)


def test_async_save_snapshots_and_a_second_save_waits(tmp_path):
    w = torch.arange(1_000_000, dtype=torch.float32)
    h1 = ckpt.save(tmp_path / "a", {"step": torch.tensor(1), "w": w}, async_=True)
    w.add_(1.0)  # training goes on: the checkpoint holds the values at the call
    h2 = ckpt.save(tmp_path / "b", {"step": torch.tensor(2), "w": w}, async_=True)
    assert h1.done()  # the second save waited for the first
    assert h2.wait() == str(tmp_path / "b") and h1.wait() == str(tmp_path / "a")
    like = {"step": torch.tensor(0), "w": torch.zeros_like(w)}
    assert torch.equal(ckpt.load(tmp_path / "a", like)["w"], torch.arange(1_000_000, dtype=torch.float32))
    assert torch.equal(ckpt.load(tmp_path / "b", like)["w"], w)
    assert h2.stats.done_bytes >= 4_000_000 and h2.stats.bytes_per_s > 0
    bad = ckpt.save(tmp_path / "a", {"w": w}, async_=True)  # exists: fails in the background
    with pytest.raises(FileExistsError):
        bad.wait()
    ckpt.save(tmp_path / "c", {"w": w})  # an error already reported is not raised again


def test_metadata_must_be_json_and_leaves_storable(tmp_path):
    with pytest.raises(TypeError, match=r"metadata\['a'\]\[1\] is a set"):
        ckpt.save(tmp_path / "x", {"w": torch.zeros(1)}, metadata={"a": [1, {2}]})
    with pytest.raises(TypeError, match=r"leaf \[.f.\] is a builtin_function_or_method"):
        ckpt.save(tmp_path / "x", {"w": torch.zeros(1), "f": len})
    assert not (tmp_path / "x").exists()


def test_rng_states_are_restored_only_when_asked(tmp_path):
    import numpy as np

    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    ckpt.save(tmp_path / "ck", {"w": torch.zeros(1)})
    expected = (torch.rand(3), random.random(), np.random.rand())
    like = {"w": torch.zeros(1)}
    ckpt.load(tmp_path / "ck", like)  # leaves the generators alone
    assert not torch.equal(torch.rand(3), expected[0])
    ckpt.load(tmp_path / "ck", like, restore_rng=True)
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1] and np.random.rand() == expected[2]


def test_floating_leaves_cast_to_likes_dtype(tmp_path):
    w = torch.randn(5, 3)
    ckpt.save(tmp_path / "ck", {"w": w, "i": torch.arange(3)})
    out = ckpt.load(tmp_path / "ck", {"w": torch.zeros(5, 3, dtype=torch.bfloat16), "i": torch.zeros(3, dtype=torch.int64)})
    assert out["w"].dtype == torch.bfloat16 and torch.equal(out["w"], w.to(torch.bfloat16))
    ckpt.save(tmp_path / "bf", {"w": w.to(torch.bfloat16), "i": torch.arange(3)})
    out = ckpt.load(tmp_path / "bf", {"w": torch.zeros(5, 3), "i": torch.zeros(3, dtype=torch.int64)})
    assert out["w"].dtype == torch.float32 and torch.equal(out["w"], w.to(torch.bfloat16).float())
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"\['i'\]: checkpoint \(3,\) int64, like \(3,\) int32"):
        ckpt.load(tmp_path / "bf", {"w": torch.zeros(5, 3), "i": torch.zeros(3, dtype=torch.int32)})


def test_in_place_load_writes_into_like(tmp_path):
    w = torch.randn(4, 4)
    ckpt.save(tmp_path / "ck", {"w": w, "h": w.half()})
    like = {"w": torch.zeros(4, 4), "h": torch.zeros(4, 4, dtype=torch.half)}
    out = ckpt.load(tmp_path / "ck", like, in_place=True)
    assert out["w"] is like["w"] and torch.equal(like["w"], w) and torch.equal(like["h"], w.half())
    like2 = {"w": torch.zeros(4, 4), "h": torch.zeros(4, 4, dtype=torch.half)}
    out = ckpt.load(tmp_path / "ck", like2)
    assert torch.equal(like2["w"], torch.zeros(4, 4)) and torch.equal(out["w"], w)


def test_a_tree_that_does_not_match_lists_every_difference(tmp_path):
    ckpt.save(tmp_path / "ck", {"params": {"a": torch.zeros(2, 3), "b": torch.zeros(4), "c": torch.zeros(1)}, "n": 3})
    like = {"params": {"a": torch.zeros(3, 2), "b": torch.zeros(4), "d": torch.zeros(5)}, "n": 3}
    with pytest.raises(ckpt.CheckpointMismatchError) as e:
        ckpt.load(tmp_path / "ck", like)
    msg = str(e.value)
    assert msg.startswith("fzero.checkpoint.load: the checkpoint at")
    assert "['params']['d'] (5,) float32" in msg  # missing, with its shape
    assert "['params']['c'] (1,) float32" in msg  # extra
    assert "['params']['a']: checkpoint (2, 3) float32, like (3, 2) float32" in msg  # mismatched
    assert e.value.missing == ["['params']['d']"] and e.value.extra == ["['params']['c']"]
    assert e.value.mismatched == ["['params']['a']"]


# --------------------------------------------------------------------------- damage


def _two_file_checkpoint(root):
    """A small checkpoint and its like; written as one process."""
    state = {"step": torch.tensor(4), "params": {"w": torch.randn(300, 70), "b": torch.randn(70)}}
    ckpt.save(root / "ck", state)
    return root / "ck", _zeros_like(state)


def test_missing_and_truncated_files_are_named(tmp_path):
    path, like = _two_file_checkpoint(tmp_path)
    data = path / "rank00000.safetensors"
    blob = data.read_bytes()
    data.write_bytes(blob[:-10])
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"rank00000\.safetensors is truncated") as e:
        ckpt.load(path, like)
    assert e.value.file == str(data)
    data.unlink()
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"rank00000\.safetensors is missing"):
        ckpt.load(path, like)
    (path / "manifest.json").unlink()
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"manifest\.json is missing"):
        ckpt.load(path, like)


@pytest.mark.parametrize("trial", range(8))
def test_one_flipped_byte_is_caught_and_named(tmp_path, trial):
    path, like = _two_file_checkpoint(tmp_path)
    rng = random.Random(trial)
    name = rng.choice(["rank00000.safetensors"] * 3 + ["manifest.json"])
    f = path / name
    blob = bytearray(f.read_bytes())
    # Trial 0 hits the header, 1 the RNG state, the others anywhere.
    head = ckpt.manifest(path)["files"]["rank00000.safetensors"]["head_bytes"]
    i = {0: rng.randrange(8, head), 1: head + 10}.get(trial, rng.randrange(len(blob)))
    if trial < 2:
        f = path / "rank00000.safetensors"
        blob = bytearray(f.read_bytes())
    blob[i] ^= 1 << rng.randrange(8)
    f.write_bytes(bytes(blob))
    with pytest.raises(ckpt.CorruptCheckpointError, match=f"{f.name}.*corrupted") as e:
        ckpt.load(path, like)
    assert e.value.file == str(f)
    with pytest.raises(ckpt.CorruptCheckpointError, match=f.name):
        ckpt.verify(path)
    assert cli_main(["verify", str(path)]) == 1


def test_an_edited_manifest_is_caught_and_cannot_point_outside(tmp_path):
    path, like = _two_file_checkpoint(tmp_path)
    man = json.loads((path / "manifest.json").read_text())
    man["leaves"][0]["pieces"][0]["file"] = "../../etc/passwd"
    (path / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"checksum mismatch in .*manifest\.json"):
        ckpt.load(path, like)  # the COMMITTED marker holds the manifest's checksum
    with pytest.raises(ckpt.CorruptCheckpointError, match="not a valid manifest .*names no listed file"):
        ckpt.load(path, like, verify=False)


class _Plant:
    """Unpickling this would create the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("kind", ["pickle", "torch.save"])
def test_a_planted_pickle_never_runs(tmp_path, kind):
    path, like = _two_file_checkpoint(tmp_path)
    marker = tmp_path / "PWNED"
    data = path / "rank00000.safetensors"
    if kind == "pickle":
        data.write_bytes(pickle.dumps(_Plant(str(marker))))
    else:
        torch.save({"w": _Plant(str(marker))}, data)
    assert not marker.exists()
    for verify in (True, False):
        with pytest.raises(ckpt.CorruptCheckpointError, match="rank00000.safetensors"):
            ckpt.load(path, like, verify=verify)
    with pytest.raises(ckpt.CorruptCheckpointError):
        ckpt.verify(path)
    with pytest.raises(ckpt.CorruptCheckpointError):
        ckpt.export(path, tmp_path / "out.safetensors")
    assert cli_main(["verify", str(path)]) == 1 and cli_main(["inspect", str(path)]) == 0
    assert not marker.exists()


def test_a_planted_pickle_of_the_right_size_is_caught_by_checksum(tmp_path):
    path, like = _two_file_checkpoint(tmp_path)
    marker = tmp_path / "PWNED"
    data = path / "rank00000.safetensors"
    size = data.stat().st_size
    payload = pickle.dumps(_Plant(str(marker)))
    data.write_bytes(payload + b"\0" * (size - len(payload)))
    with pytest.raises(ckpt.CorruptCheckpointError, match="rank00000.safetensors.*corrupted"):
        ckpt.load(path, like)
    assert not marker.exists()


# --------------------------------------------------------------------------- export


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.norm = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.head(self.norm(h.transpose(1, 2)).transpose(1, 2))


def _lm_step(state, batch):
    def loss_fn(p):
        return F.cross_entropy(state.apply_fn(p, batch["x"]).flatten(0, 1), batch["y"].flatten())

    loss, grads = fzero.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def _train_tied(path, stage):
    r, n = _rank_world()
    torch.manual_seed(0)
    apply, params = fzero.functionalize(_Tied())
    step = fzero.compile(_lm_step, fzero.Mesh(dp=-1), zero=stage)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2)))
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, 11, (6, 5), generator=g)
        state, _ = step(state, {"x": x.chunk(n)[r], "y": x.roll(1, 1).chunk(n)[r]})
    ckpt.save(path, state)
    return fzero.gather(state.params)


@pytest.mark.multirank
@pytest.mark.slow
def test_export_of_a_sharded_tied_model_loads_strictly(ranks, tmp_path):
    path = str(tmp_path / "ck")
    full = ranks(2).run(_train_tied, path, 3)[0]
    with pytest.raises(ckpt.CheckpointError, match="in the module, not in the checkpoint: weight, bias"):
        ckpt.export(path, tmp_path / "m.safetensors", module=nn.Linear(6, 11))
    names = ckpt.export(path, tmp_path / "p.safetensors")  # parameters only, first names
    assert set(names) == set(full) and "head.weight" not in names
    model = _Tied()
    names = ckpt.export(path, tmp_path / "m.safetensors", module=model)
    assert "head.weight" in names and "norm.running_mean" in names
    from safetensors.torch import load_file

    sd = load_file(str(tmp_path / "m.safetensors"))
    model.load_state_dict(sd, strict=True)
    for k, v in full.items():
        assert torch.equal(dict(model.named_parameters())[k].detach(), v), k
    assert model.head.weight is model.emb.weight
    # ZeRO-3 units on 2 ranks -> ZeRO-1 on 3 ranks.
    for x in ranks(3).run(_load_tied, path, 1):
        _equal(x, full, "tied model (2, 3) -> (3, 1)")


def _load_tied(path, stage):
    torch.manual_seed(1)  # other initial values: all must come from the checkpoint
    apply, params = fzero.functionalize(_Tied())
    step = fzero.compile(_lm_step, fzero.Mesh(dp=-1), zero=stage)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2)))
    return fzero.gather(ckpt.load(path, like=state).params)


def _export_and_load_into(path, out_file, stage, precision):
    """Train the tied BatchNorm model in ``precision`` at ``stage``, save, export with the
    module; return what export wrote and the state_dict of a module ``load_into`` filled."""
    r, n = _rank_world()
    torch.manual_seed(0)
    model = _Tied()
    apply, params = fzero.functionalize(model)
    step = fzero.compile(_lm_step, fzero.Mesh(dp=-1), zero=stage, precision=precision)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2)))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, 11, (6, 5), generator=g)
        state, _ = step(state, {"x": x.chunk(n)[r], "y": x.roll(1, 1).chunk(n)[r]})
    ckpt.save(path, state)
    fzero.load_into(model, state)
    loaded = {k: v.detach().clone() for k, v in model.state_dict().items()}
    low = {k: v.clone() for k, v in fzero.gather(state.params).items()}
    if r == 0:
        ckpt.export(path, out_file, module=_Tied())
        ckpt.export(path, out_file + ".low", dtype=torch.bfloat16 if precision == "bf16" else None)
    if n > 1:
        dist.barrier()
    from safetensors.torch import load_file

    return load_file(out_file), loaded, load_file(out_file + ".low"), low


def _export_is_load_into(results, precision):
    exported, loaded, exported_low, low = results
    _equal(exported, loaded, f"export against load_into's state_dict ({precision})")
    assert exported["emb.weight"].dtype == torch.float32 and int(exported["norm.num_batches_tracked"]) == 3
    if precision == "bf16":  # the low-precision copies are the masters rounded: dtype=bf16 gives them
        _equal(exported_low, low, "export(dtype=bfloat16) against the bf16 parameters")


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_export_writes_what_load_into_writes_the_masters_under_mixed_precision(tmp_path, precision):
    path, out = str(tmp_path / "ck"), str(tmp_path / "m.safetensors")
    _export_is_load_into(_export_and_load_into(path, out, 0, precision), precision)


@pytest.mark.multirank
@pytest.mark.slow
def test_export_of_partitioned_masters_writes_what_load_into_writes(ranks, tmp_path):
    path, out = str(tmp_path / "ck"), str(tmp_path / "m.safetensors")
    for results in ranks(2).run(_export_and_load_into, path, out, 3, "bf16"):
        _export_is_load_into(results, "bf16")


# --------------------------------------------------------------------------- resharding on real ranks


def _trained(case, stage, bucket, steps, path):
    """Train ``steps`` steps of ``case`` at ``stage`` on this world; save to ``path``."""
    r, n = _rank_world()
    apply, params = fzero.functionalize(case.make())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2, weight_decay=0.1))
    step = fzero.shard_state(ft.mse_step, fzero.Mesh(dp=-1), stage, bucket_bytes=bucket)
    state = step.init(state)
    for i in range(steps):
        b = case.batch(6, i)
        state, _ = step(state, ft.local_batch(b, n, r))
    ckpt.save(path, state)
    return fzero.gather({"step": state.step, "params": state.params, "opt_state": state.opt_state})


def _restored(case, stage, bucket, path):
    apply, params = fzero.functionalize(case.make())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2, weight_decay=0.1))
    step = fzero.shard_state(ft.mse_step, fzero.Mesh(dp=-1), stage, bucket_bytes=bucket)
    state = ckpt.load(path, like=step.init(state))
    r, n = _rank_world()
    b = case.batch(6, 99)
    step(state, ft.local_batch(b, n, r))  # it can step at once
    return fzero.gather({"step": state.step, "params": state.params, "opt_state": state.opt_state})


_LAYOUTS = st.tuples(st.sampled_from([1, 2, 3]), st.sampled_from([0, 1, 2, 3]))


@pytest.mark.multirank
@pytest.mark.slow
@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=ft.models(max_layers=2, max_width=9), save_at=_LAYOUTS, load_at=_LAYOUTS,
       buckets=st.tuples(st.sampled_from([4, 64, 2**20]), st.sampled_from([4, 64, 2**20])))
def test_model_states_reshard_between_any_world_and_stage(ranks, tmp_path_factory, case, save_at, load_at, buckets):
    path = str(tmp_path_factory.mktemp("reshard") / "ck")
    (n, s), (m, t) = save_at, load_at
    saved = _on(ranks, n, _trained, case, s, buckets[0], 2, path)[0]
    loaded = _on(ranks, m, _restored, case, t, buckets[1], path)
    for x in loaded:
        _equal(x, saved, f"({n}, {s}) -> ({m}, {t})")


@pytest.mark.multirank
@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=_states(), save_at=_LAYOUTS, load_at=_LAYOUTS, buckets=st.tuples(st.sampled_from([4, 64, 2**20]),
                                                                              st.sampled_from([4, 64, 2**20])))
def test_any_tree_reshards_between_any_world_and_stage(ranks, tmp_path_factory, state, save_at, load_at, buckets):
    path = str(tmp_path_factory.mktemp("reshard") / "ck")
    (n, s), (m, t) = save_at, load_at
    _on(ranks, n, _save_generic, path, state, s, buckets[0])
    for x in _on(ranks, m, _load_generic, path, state, t, buckets[1]):
        _equal(x, state, f"({n}, {s}) -> ({m}, {t})")


def _load_expecting_failure(path, like_state):
    r, n = _rank_world()
    like = _partition(_zeros_like(like_state), n, r, 3, 4)
    try:
        ckpt.load(path, like)
    except ckpt.CheckpointError as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.multirank
@pytest.mark.slow
def test_corruption_seen_by_one_rank_fails_every_rank(ranks, tmp_path):
    state = {"step": torch.tensor(1), "params": {"w": torch.randn(64, 64)}, "opt_state": {"count": torch.tensor(0),
             "mu": {"w": torch.randn(64, 64)}}, "extra": {}}
    path = str(tmp_path / "ck")
    ranks(2).run(_save_generic, path, state, 3, 4)
    man = ckpt.manifest(path)
    rec = next(r for r in man["leaves"] if r["path"] == "['params']['w']")
    last = rec["pieces"][-1]  # the end of w: only rank 1 of a 2-rank load reads it
    f = os.path.join(path, last["file"])
    blob = bytearray(open(f, "rb").read())
    blob[last["offset"] + last["nbytes"] - 1] ^= 0xFF
    open(f, "wb").write(bytes(blob))
    out = ranks(2).run(_load_expecting_failure, path, state)
    assert out[1][0] == "CorruptCheckpointError" and last["file"] in out[1][1]
    assert out[0][0] == "CheckpointError" and "failed on rank 1" in out[0][1] and last["file"] in out[0][1]


# --------------------------------------------------------------------------- deterministic resume


def _batches(case, k, n, r):
    b = case.batch(12, k)
    return ft.local_batch(b, n, r)


def _resume_run(case, stage, tx_name, phase, root):
    r, n = _rank_world()
    apply, params = fzero.functionalize(case.make())
    tx = optim.adamw(1e-2, weight_decay=0.1) if tx_name == "adamw" else optim.sgd(0.05, momentum=0.9)
    step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), zero=stage)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=tx))
    if phase == "resume":
        path = ckpt.latest(root)
        state = ckpt.load(path, like=state, restore_rng=ckpt.manifest(path)["world_size"] == n)
    start = int(state.step)
    stop = 3 if phase == "first" else 6
    losses = []
    for k in range(start, stop):
        state, m = step(state, _batches(case, k, n, r))
        losses.append(m["loss"].item())
    if phase == "first":
        ckpt.save(f"{root}/step_{int(state.step)}", state, metadata={"next_batch": stop})
    return losses


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("stage,tx_name", [(0, "sgd"), (1, "adamw"), (2, "sgd"), (3, "adamw")])
def test_resume_continues_the_same_loss_curve(ranks, tmp_path, stage, tx_name):
    case = ft.ModelCase((5, 8, 8, 3), "tanh", True, True, seed=11)
    straight = ranks(2).run(_resume_run, case, stage, tx_name, "straight", str(tmp_path))[0]
    first = ranks(2).run(_resume_run, case, stage, tx_name, "first", str(tmp_path))[0]
    assert ckpt.metadata(ckpt.latest(tmp_path)) == {"next_batch": 3}
    second = ranks(2).run(_resume_run, case, stage, tx_name, "resume", str(tmp_path))  # fresh state, same world
    assert first + second[0] == straight  # bitwise
    for m, t in ((3, (stage + 1) % 4), (1, stage)):  # another world size (and stage)
        other = _on(ranks, m, _resume_run, case, t, tx_name, "resume", str(tmp_path))[0]
        ft.assert_trees_close(torch.tensor(other), torch.tensor(straight[3:]), tol="fp32 small values",
                              what=f"losses after resuming on {m} ranks")


# --------------------------------------------------------------------------- ranks holding different trees


def _by_key(state):
    """``{key path: leaf}`` of a (gathered) state."""
    return {tree.keystr(p): x for p, x in zip(tree.paths(state), tree.leaves(state))}


def _union(trees, what):
    """One ``{key path: leaf}`` of several ranks' trees; a key on several ranks must be the
    same leaf there (the reference for what a checkpoint of different trees holds)."""
    out = {}
    for t in trees:
        for k, v in _by_key(t).items():
            if k in out:
                _equal(v, out[k], f"{what}: {k} on two ranks")
            out[k] = v
    return out


def test_the_plan_spreads_writes_over_the_ranks_holding_each_leaf():
    """Two parts (ranks 0-1 and 2-3, as two pipeline stages of dp=2): a leaf both hold is
    written once, each piece by the lowest rank holding it; a part's own leaves by its ranks."""
    from fzero.checkpoint._plan import _build

    def t(name, shape, sharding=None):
        return {"path": f".{name}", "entries": [["attr", name]], "kind": "tensor", "dtype": "float32",
                "shape": list(shape), "sharding": sharding}

    n3 = {"path": ".n", "entries": [["attr", "n"]], "kind": "value", "type": "int", "value": 3}
    half = {"world": 2, "offset": 0, "chunk": 4}  # 8 elements over 2 ranks: [0, 4) and [4, 8)
    part0 = [t("step", ()), t("a", (8,), half), t("w", (100,)), n3]
    part1 = [t("step", ()), t("a", (8,), {"world": 2, "offset": 2, "chunk": 5}), t("b", (8,), half), n3]
    parts = [(0, [0, 1], part0, "s0"), (1, [2, 3], part1, "s1")]
    positions = [0, 1, 0, 1]
    local = {".step": torch.zeros(()), ".a": torch.zeros(4), ".w": torch.zeros(100), ".b": torch.zeros(4)}
    plans = [_build(parts, positions, local, me) for me in range(4)]
    recs = {r["path"]: r for r in plans[0].records}
    assert list(recs) == [".step", ".a", ".w", ".n", ".b"]  # part 0's order, then part 1's new keys
    assert recs[".a"]["sharding"] == half and recs[".a"]["parts"] == [0, 1]  # the first part's layout
    assert [(p["rank"], p["start"], p["stop"]) for p in recs[".a"]["pieces"]] == [(0, 0, 4), (1, 4, 8)]
    assert [(p["rank"], p["start"], p["stop"]) for p in recs[".b"]["pieces"]] == [(2, 0, 4), (3, 4, 8)]
    assert [p["rank"] for p in recs[".w"]["pieces"]] in ([0], [1])  # only part 0 holds it
    assert recs[".step"]["parts"] == [0, 1] and recs[".n"]["value"] == 3 and "pieces" not in recs[".n"]
    # Every rank plans the same; each writes what the plan gives it, nothing twice.
    assert len({pl.fingerprint for pl in plans}) == 1
    written = [name for pl in plans for name, _ in pl.mine]
    expected = [p["name"] for r in plans[0].records for p in r.get("pieces", ())]
    assert sorted(written) == sorted(expected) and len(set(written)) == len(written)
    assert [x["ranks"] for x in plans[0].parts] == [[0, 1], [2, 3]]

    bad = [(0, [0, 1], part0, "s0"), (1, [2, 3], [{**n3, "value": 4}], "")]
    with pytest.raises(ckpt.CheckpointError, match=r"leaf \.n is the int 3 on rank\(s\) 0, 1 but the int 4 on "
                                                   r"rank\(s\) 2, 3"):
        _build(bad, positions, local, 0)
    with pytest.raises(ckpt.CheckpointError, match=r"leaf \.a is partitioned over 2 ranks, but none of the ranks "
                                                   r"holding it \(0, 1\) holds piece 1 \(elements \[4, 8\)\)"):
        _build(parts[:1], [0, 0, 0, 0], local, 0)


def _save_different_trees(path, trees):
    ckpt.save(path, trees[_rank_world()[0]])


def _load_different_trees(path, likes):
    like = likes[_rank_world()[0]]
    try:
        return "ok", fzero.gather(ckpt.load(path, like))
    except ckpt.CheckpointError as e:
        return type(e).__name__, str(e)


@pytest.mark.multirank
@pytest.mark.slow
def test_ranks_with_different_trees_save_their_union(ranks, tmp_path):
    g = torch.Generator().manual_seed(0)
    a, b, w = torch.randn(5, generator=g), torch.randn(3, 2, generator=g), torch.randn(7, generator=g)
    trees = [{"step": torch.tensor(4), "params": {"a": a, "w": w}, "n": 2},
             {"step": torch.tensor(4), "params": {"b": b, "w": w}, "n": 2}]
    path = str(tmp_path / "ck")
    ranks(2).run(_save_different_trees, path, trees)
    man = ckpt.manifest(path)
    assert [p["ranks"] for p in man["parts"]] == [[0], [1]]
    assert {r["path"]: r["parts"] for r in man["leaves"]} == {
        "['step']": [0, 1], "['params']['a']": [0], "['params']['w']": [0, 1], "['n']": [0, 1],
        "['params']['b']": [1]}
    union = _union(trees, "saved")
    # One process reads it all back (a world of one), each rank its own tree, or the other's.
    whole = _zeros_like({"step": torch.tensor(0), "params": {"a": a, "b": b, "w": w}, "n": 0})
    _equal(_by_key(ckpt.load(path, whole)), union, "loaded by one process")
    swapped = [_zeros_like(trees[1]), _zeros_like(trees[0])]
    for r, (status, got) in enumerate(ranks(2).run(_load_different_trees, path, swapped)):
        assert status == "ok", got
        _equal(got, trees[1 - r], f"rank {r}")
    # A leaf no rank loads is an extra leaf, named on every rank.
    only_a = [_zeros_like({"step": torch.tensor(0), "params": {"a": a, "w": w}, "n": 0})] * 2
    for status, msg in ranks(2).run(_load_different_trees, path, only_a):
        assert status == "CheckpointMismatchError", msg
        assert "extra in the checkpoint (in no rank's like): 1" in msg and "['params']['b'] (3, 2) float32" in msg
    # Ranks that disagree on a shared key path save nothing, and say which.
    clash = [trees[0], {**trees[1], "step": torch.tensor(5.0)}]
    with pytest.raises(Exception, match=r"leaf \['step'\] is a tensor of int64, shape \(\) on rank\(s\) 0 but a "
                                        r"tensor of float32, shape \(\) on rank\(s\) 1"):
        ranks(2).run(_save_different_trees, str(tmp_path / "clash"), clash)
    assert not (tmp_path / "clash").exists()


# A pipeline of two stages (pp=2): an embedding and a hidden layer, then the head; the head
# may be the embedding's weight (tied), so that both stages hold one key path.


def _lm(tied, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(7, 6), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 7, bias=not tied))
    if tied:
        model[3].weight = model[0].weight
    return model


def _lm_batch(k, n):
    g = torch.Generator().manual_seed(100 + k)
    return {"x": torch.randint(7, (n,), generator=g), "y": torch.randint(7, (n,), generator=g)}


def _pipelined(pp, dp, zero, tied, seed=0, tx=None):
    """``(step, state, pipe)`` of the pipeline (pp=2) or the plain step (pp=1) on ``Mesh(pp, dp)``."""
    from fzero.transforms.pipeline import pipeline, split

    mesh = fzero.Mesh(pp=pp, dp=dp)
    model = _lm(tied, seed)
    apply, params = fzero.functionalize(model)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=tx or optim.adamw(1e-2, weight_decay=0.1))
    if pp == 1:
        def plain(state, batch):
            loss, g = fzero.value_and_grad(lambda p: F.cross_entropy(state.apply_fn(p, batch["x"]), batch["y"]))(
                state.params)
            return state.apply_gradients(g), {"loss": loss}
        step = fzero.shard_state(plain, mesh, zero)
        return step, step.init(state), None
    pipe = pipeline(split(model, [2]), F.cross_entropy, mesh, micro_batches=2)

    def train_step(state, batch):
        loss, grads = pipe(state.params, batch["x"], batch["y"])
        return state.apply_gradients(grads), {"loss": loss}

    inner = train_step if zero is None else fzero.shard_state(train_step, mesh, zero, bucket_bytes=64)
    step = pipe.transform(inner)
    return step, step.init(state), pipe


def _pipelined_resume(pp, dp, zero, phase, root):
    step, state, _ = _pipelined(pp, dp, zero, tied=False, tx=optim.sgd(0.1, momentum=0.9))
    j = fzero.Mesh(pp=pp, dp=dp).coords["dp"]
    if phase == "resume":
        state = ckpt.load(ckpt.latest(root), like=state)
    losses = []
    for k in range(int(state.step), 3 if phase == "first" else 6):
        b = _lm_batch(k, 4 * dp)
        state, m = step(state, ft.local_batch(b, dp, j))
        losses.append(m["loss"].item())
    if phase == "first":
        ckpt.save(f"{root}/step_{int(state.step)}", state)
    return losses


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("pp,dp,zero", [(2, 1, None), (2, 2, 1)])
def test_a_pipelined_run_resumes_on_the_same_loss_curve(ranks, tmp_path, pp, dp, zero):
    pool = ranks(pp * dp)
    straight = pool.run(_pipelined_resume, pp, dp, zero, "straight", str(tmp_path))
    first = pool.run(_pipelined_resume, pp, dp, zero, "first", str(tmp_path))
    second = pool.run(_pipelined_resume, pp, dp, zero, "resume", str(tmp_path))
    for r in range(pp * dp):
        assert first[r] + second[r] == straight[r], r  # bitwise, on every rank
    assert len(ckpt.manifest(ckpt.latest(tmp_path))["parts"]) == pp


def _pipelined_save(path):
    """pp=2 x dp=2 at ZeRO-1, tied head: 2 steps, then a checkpoint."""
    step, state, pipe = _pipelined(2, 2, 1, tied=True)
    j = fzero.Mesh(pp=2, dp=2).coords["dp"]
    for k in range(2):
        state, _ = step(state, {key: v.chunk(2)[j] for key, v in _lm_batch(k, 8).items()})
    ckpt.save(path, state)
    return pipe.gather(state.params), fzero.gather({"step": state.step, "params": state.params,
                                                     "opt_state": state.opt_state})


def _pipelined_load(path, pp, dp, zero, resave=None):
    step, like, pipe = _pipelined(pp, dp, zero, tied=True, seed=1)  # other values: all must come from the file
    state = ckpt.load(path, like=like)
    if resave is not None:
        ckpt.save(resave, state)
    j = fzero.Mesh(pp=pp, dp=dp).coords["dp"]
    out = fzero.gather({"step": state.step, "params": state.params, "opt_state": state.opt_state})
    step(state, {key: v.chunk(dp)[j] for key, v in _lm_batch(9, 4 * dp).items()})  # it can step at once
    return out


@pytest.mark.multirank
@pytest.mark.slow
def test_a_pipelined_checkpoint_reshards_per_stage_loads_unpipelined_and_exports(ranks, tmp_path, capsys):
    path = str(tmp_path / "ck")
    saved = ranks(4).run(_pipelined_save, path)
    full = saved[0][0]
    stages = [saved[0][1], saved[2][1]]  # what stage 0 (ranks 0-1) and stage 1 (ranks 2-3) hold
    for r in range(4):
        _equal(saved[r][1], stages[r // 2], f"rank {r} against its stage's first rank")
    man = ckpt.manifest(path)
    assert [p["ranks"] for p in man["parts"]] == [[0, 1], [2, 3]] and man["stages"] == [1, 2]
    held = {rec["path"]: rec["parts"] for rec in man["leaves"]}
    assert held[".params['1.weight']"] == [0] and held[".params['0.weight']"] == [0, 1]  # tied: both stages
    assert held[".step"] == [0, 1]
    # pp=2 x dp=1 at ZeRO-3: each stage's ranks load what that stage saved.
    for s, got in enumerate(ranks(2).run(_pipelined_load, path, 2, 1, 3)):
        _equal(got, stages[s], f"stage {s}: (pp=2, dp=2, ZeRO-1) -> (pp=2, dp=1, ZeRO-3)")
    # pp=1: the plain state of the whole model, in one process, at ZeRO-2; saved again, it
    # loads back into the pipeline.
    whole = _pipelined_load(path, 1, 1, 2, resave=str(tmp_path / "whole"))
    _equal(_by_key(whole), _union(stages, "stages"), "(pp=2, dp=2, ZeRO-1) -> (pp=1, ZeRO-2)")
    assert len(ckpt.manifest(tmp_path / "whole")["parts"]) == 1
    for s, got in enumerate(ranks(2).run(_pipelined_load, str(tmp_path / "whole"), 2, 1, 0)):
        _equal(got, stages[s], f"stage {s}: (pp=1, ZeRO-2) -> (pp=2, dp=1, ZeRO-0)")
    # Export: every stage's parameters, under their named_parameters() names, once.
    from safetensors.torch import load_file

    names = ckpt.export(path, tmp_path / "model.safetensors")
    assert set(names) == set(full) == {"0.weight", "1.weight", "1.bias"}
    _equal(load_file(str(tmp_path / "model.safetensors")), full, "export against pipe.gather")
    model = _lm(True, 2)
    ckpt.export(path, tmp_path / "strict.safetensors", module=model)
    model.load_state_dict(load_file(str(tmp_path / "strict.safetensors")), strict=True)
    assert torch.equal(model[3].weight.detach(), full["0.weight"]) and model[3].weight is model[0].weight
    assert cli_main(["export", path, str(tmp_path / "cli.safetensors")]) == 0
    _equal(load_file(str(tmp_path / "cli.safetensors")), full, "fzero checkpoint export")
    capsys.readouterr()
    assert cli_main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "parts: 2" in out and "part 0: ranks 0, 1" in out and "part 1: ranks 2, 3" in out, out
    assert ".params['1.bias']" in out and "[part 0]" in out and "[parts 0, 1]" in out, out


# --------------------------------------------------------------------------- tensor parallelism
#
# A state split over tp (fzero.tensor_parallel: Megatron's column/row split of the MLPs'
# Linear layers) saved at one tp x dp x ZeRO layout, resumed at another, and checked against
# the plain single-process run on the same global batches.

from test_tensor_parallel import PLAN as TP_PLAN  # noqa: E402
from test_tensor_parallel import Net as TPNet  # noqa: E402


def _tp_state():
    torch.manual_seed(3)
    apply, params = fzero.functionalize(TPNet())  # blocks.*.fc: (16, 8) split on dim 0; proj: (8, 16) on dim 1
    return fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2))


def _tp_batches():
    g = torch.Generator().manual_seed(11)
    return [{"x": torch.randn(8, 5, generator=g), "y": torch.randn(8, 3, generator=g)} for _ in range(4)]


def _tp_plain():
    """The uninterrupted plain run: 4 steps in one process, and its parameters after 2."""
    half, _ = ft.run_steps(ft.mse_step, _tp_state(), _tp_batches()[:2])
    whole, losses = ft.run_steps(ft.mse_step, _tp_state(), _tp_batches())
    return dict(half.params), dict(whole.params), losses


def _tp_run(tp, dp, zero, phase, path):
    """On every rank of a tp x dp world (ZeRO stage ``zero``, ``None``: no shard_state): a
    fresh state, then ``"save"``: steps 0-1 and a save; ``"resume"``: a load and steps 2-3.
    Returns the losses and the whole parameters."""
    if dist.is_available() and dist.is_initialized():
        mesh = fzero.Mesh(dp=dp, tp=tp)
        inner = ft.mse_step if zero is None else fzero.shard_state(ft.mse_step, mesh, zero)
        step = fzero.tensor_parallel(inner, mesh, TP_PLAN) if tp > 1 else fzero.transforms.as_step(inner)
        rows = lambda b: ft.local_batch(b, dp, mesh.coords["dp"])  # noqa: E731
    else:  # one process: the plain step
        step, rows = fzero.transforms.as_step(ft.mse_step), lambda b: b
    state = step.init(_tp_state())
    batches = _tp_batches()[:2] if phase == "save" else _tp_batches()[2:]
    if phase == "resume":
        state = ckpt.load(path, like=state)
    state, losses = ft.run_steps(step, state, [rows(b) for b in batches])
    if phase == "save":
        ckpt.save(path, state)
    gathered = fzero.gather(state.params)
    return losses, {k: v.clone() for k, v in gathered.items()}


def _tp_check(results, plain, phase, what):
    """Every rank's losses and parameters are the plain run's (fp32 reduction-order error)."""
    half, whole, losses = plain
    for r, (got, params) in enumerate(results):
        ref = losses[:2] if phase == "save" else losses[2:]
        ft.assert_trees_close(got, ref, tol="fp32", what=f"{what}, rank {r}: losses")
        ft.assert_trees_close(params, half if phase == "save" else whole, tol="fp32",
                              what=f"{what}, rank {r}: parameters")


@pytest.mark.multirank
def test_a_tp2_checkpoint_records_the_split_resumes_at_tp1_and_exports_whole(ranks, tmp_path, capsys):
    plain = _tp_plain()
    path = str(tmp_path / "tp2")
    _tp_check(ranks(2).run(_tp_run, 2, 1, None, "save", path), plain, "save", "saved at tp=2")
    # The manifest says how each leaf is split and which tp slice each piece is.
    man = ckpt.manifest(path)
    assert man["version"] == 2 and man["tp"] == 2 and man["stages"] == [0]
    assert ckpt.verify(path)["files"] == 2  # every byte accounted for and intact
    recs = {r["path"]: r for r in man["leaves"]}
    for key, dim, shape in [(".params['blocks.0.fc.weight']", 0, [16, 8]), (".params['blocks.0.fc.bias']", 0, [16]),
                            (".params['blocks.1.proj.weight']", 1, [8, 16]),
                            (".opt_state[0].mu['blocks.1.proj.weight']", 1, [8, 16]),  # Adam's moments too
                            (".opt_state[0].nu['blocks.0.fc.weight']", 0, [16, 8])]:
        rec = recs[key]
        half = math.prod(shape) // 2
        assert rec["shape"] == shape and rec["tp"] == {"dim": dim, "size": 2}, (key, rec)
        assert [(p["tp"], p["rank"], p["start"], p["stop"]) for p in rec["pieces"]] == \
            [(0, 0, 0, half), (1, 1, half, 2 * half)], (key, rec["pieces"])
    for key in (".params['blocks.0.proj.bias']", ".params['inp.weight']", ".opt_state[0].count"):
        assert "tp" not in recs[key] and len(recs[key]["pieces"]) == 1, key  # whole on every tp rank
    # tp=2 -> tp=1 in this process: the plain run's curve goes on.
    _tp_check([_tp_run(1, 1, None, "resume", path)], plain, "resume", "tp=2 resumed at tp=1")
    # Export and inspect give whole tensors under named_parameters() names.
    out_file = str(tmp_path / "model.safetensors")
    assert ckpt.export(path, out_file)["blocks.1.proj.weight"] == (8, 16)
    from safetensors.torch import load_file

    exported = load_file(out_file)
    ft.assert_trees_close(exported, plain[0], tol="fp32", what="export")
    TPNet().load_state_dict(exported, strict=True)
    assert cli_main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "tp 2" in out and "(16, 8)" in out and "dim 0 split over tp=2" in out, out
    # A like that splits blocks.0.fc.weight (16, 8) over tp=3 cannot be cut from it.
    from fzero.transforms.tensor_parallel import TensorParallelLayout, _Split

    three = TensorParallelLayout(3, 0, (("blocks.0.fc.weight", _Split(0, (16, 8))),))
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load(path, like=_tp_state().replace(extra={"tensor_parallel": three}))
    msg = str(e.value)
    assert "cannot split .params['blocks.0.fc.weight']" in msg and "(16, 8) float32 (dim 0 split over tp=2)" in msg
    assert "over tp=3 as like does: dim 0 of parameter 'blocks.0.fc.weight' has 16 elements, which do not divide " \
           "by 3" in msg, msg


@pytest.mark.multirank
def test_a_tp1_checkpoint_resumes_at_tp2(ranks, tmp_path):
    plain = _tp_plain()
    path = str(tmp_path / "tp1")
    _tp_check([_tp_run(1, 1, None, "save", path)], plain, "save", "saved at tp=1")
    assert ckpt.manifest(path)["version"] == 1 and "tp" not in ckpt.manifest(path)["leaves"][1]
    _tp_check(ranks(2).run(_tp_run, 2, 1, None, "resume", path), plain, "resume", "tp=1 resumed at tp=2")


@pytest.mark.multirank
@pytest.mark.slow
def test_a_tp2_by_dp2_zero2_checkpoint_resumes_at_other_tp_dp_and_stages(ranks, tmp_path):
    plain = _tp_plain()
    path = str(tmp_path / "tp2dp2")
    _tp_check(ranks(4).run(_tp_run, 2, 2, 2, "save", path), plain, "save", "saved at tp=2 x dp=2, ZeRO-2")
    man = ckpt.manifest(path)
    rec = {r["path"]: r for r in man["leaves"]}[".opt_state[0].nu['blocks.0.proj.weight']"]
    # each tp slice (64 elements) cut in two ZeRO pieces, by the ranks at (tp, dp) = (t, q)
    assert man["stages"] == [1, 2] and rec["tp"] == {"dim": 1, "size": 2} and rec["sharding"]["world"] == 2
    assert [(p["tp"], p["start"] // 64) for p in rec["pieces"]] == [(0, 0), (0, 0), (1, 1), (1, 1)]
    assert len({p["rank"] for p in rec["pieces"]}) == 4
    for tp, dp, zero in [(2, 2, 2), (2, 1, 3), (1, 2, 1), (2, 1, None)]:
        world = tp * dp
        _tp_check(ranks(world).run(_tp_run, tp, dp, zero, "resume", path), plain, "resume",
                  f"tp=2 x dp=2 ZeRO-2 resumed at tp={tp} x dp={dp} ZeRO-{zero}")
    _tp_check([_tp_run(1, 1, None, "resume", path)], plain, "resume", "tp=2 x dp=2 ZeRO-2 resumed in one process")


def _save_split(path, w, dim):
    from fzero.transforms.tensor_parallel import TensorParallelLayout, _Split

    r = dist.get_rank()
    layout = TensorParallelLayout(2, r, (("w", _Split(dim, tuple(w.shape))),))
    ckpt.save(path, {"params": {"w": w.chunk(2, dim)[r].clone(), "b": torch.ones(3)}, "tp": layout})


@pytest.mark.multirank
def test_a_split_leaf_reslices_onto_any_tp_dim_and_zero_piece(ranks, tmp_path):
    """A (4, 6) leaf saved as two (4, 3) slices loads as slice r of any tp, on either dim,
    whole or as any ZeRO piece of that slice (one process may load any rank's target)."""
    from fzero.transforms.tensor_parallel import TensorParallelLayout, _Split

    w = torch.arange(24.0).view(4, 6)
    path = str(tmp_path / "split")
    ranks(2).run(_save_split, path, w, 1)
    for size, dim in [(1, 0), (2, 1), (3, 1), (6, 1), (2, 0), (4, 0)]:  # same split, across slices, another dim
        for r in range(size):
            want = w.chunk(size, dim)[r]
            layout = TensorParallelLayout(size, r, (("w", _Split(dim, (4, 6))),))
            like = {"params": {"w": torch.zeros(want.shape), "b": torch.zeros(3)}, "tp": layout}
            got = ckpt.load(path, like)["params"]["w"]
            assert torch.equal(got, want), (size, dim, r)
            info = ShardInfo(tuple(want.shape), 1, 3, 2, 1)  # ZeRO piece 1 of the slice: elements [2, n)
            a, b = info.piece()
            like["params"]["w"] = Shard(torch.zeros(b - a), info)
            got = ckpt.load(path, like, in_place=True)["params"]["w"]
            assert torch.equal(got.local, want.reshape(-1)[a:b]), (size, dim, r, "piece")


def test_a_save_holds_every_tp_slice_and_only_slices_under_split_names(tmp_path):
    from fzero.transforms.tensor_parallel import TensorParallelLayout, _Split

    state = _tp_state()
    # One process claiming slice 0 of 2 is refused: the tp ranks save together.
    two = TensorParallelLayout(2, 0, (("blocks.0.fc.weight", _Split(0, (16, 8))),))
    half = state.replace(params={**state.params, "blocks.0.fc.weight": state.params["blocks.0.fc.weight"][:8]},
                         opt_state=state.tx.init({**state.params, "blocks.0.fc.weight": torch.zeros(8, 8)}),
                         extra={"tensor_parallel": two})
    with pytest.raises(ckpt.CheckpointError, match=r"leaf \.params\['blocks\.0\.fc\.weight'\] is split over tp=2, "
                                                   r"but none of the ranks holding it \(0\) holds slice 1"):
        ckpt.save(str(tmp_path / "half"), half)
    wrong = half.replace(opt_state=state.opt_state)  # moments of the whole (16, 8) under a split name
    with pytest.raises(ckpt.CheckpointError, match=r"under the split parameter 'blocks\.0\.fc\.weight' .* slices of "
                                                   r"\(8, 8\)\) but has shape \(16, 8\)"):
        ckpt.save(str(tmp_path / "wrong"), wrong)


# --------------------------------------------------------------------------- CLI and progress


def test_cli_inspect_verify_export(tmp_path, capsys):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    apply, params = fzero.functionalize(model)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adam(1e-3))
    ckpt.save(tmp_path / "run" / "step_0", state, metadata={"epoch": 0})
    path = str(tmp_path / "run" / "step_0")
    assert cli_main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "step 0" in out and ".params['0.weight']" in out and "(4, 3)" in out and "epoch" in out
    assert cli_main(["inspect", str(tmp_path / "run")]) == 0  # a directory of checkpoints
    assert "step_0" in capsys.readouterr().out
    assert cli_main(["inspect", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 0
    assert cli_main(["verify", path]) == 0
    assert "OK" in capsys.readouterr().out
    out_file = tmp_path / "model.safetensors"
    assert cli_main(["export", path, str(out_file)]) == 0
    from safetensors.torch import load_file

    fresh = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    fresh.load_state_dict(load_file(str(out_file)), strict=True)
    assert torch.equal(fresh[0].weight, model[0].weight)
    assert cli_main(["verify", str(tmp_path / "nothing")]) == 2
    assert cli_main(["export", path]) == 2  # OUT missing: a usage error
    capsys.readouterr()


def test_progress_reports_bytes_per_second(tmp_path):
    seen = []
    big = {"w": torch.zeros(3_000_000)}
    h = ckpt.save(tmp_path / "ck", big, progress=seen.append)
    assert seen and seen[-1].done_bytes == seen[-1].total_bytes >= 12_000_000 and seen[-1].what == "save"
    assert h.stats.bytes_per_s > 0 and "MiB/s" in str(h.stats)
    seen.clear()
    ckpt.load(tmp_path / "ck", big, progress=seen.append)
    assert seen[-1].what == "load" and seen[-1].done_bytes == 12_000_000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_state_saves_async_and_loads_onto_the_gpu(tmp_path):
    torch.cuda.manual_seed(3)
    w = torch.randn(1000, 300, device="cuda")
    expected = w.cpu()
    state = {"w": w, "h": w.to(torch.bfloat16), "piece": Shard(w.view(-1)[:1000].clone(), ShardInfo((1000,), 0, 1000, 1, 0))}
    h = ckpt.save(tmp_path / "a", state, async_=True)
    w.add_(1.0)  # after the call: not in the checkpoint
    h.wait()
    after_save = torch.rand(4, device="cuda")
    like = {"w": torch.zeros_like(w), "h": torch.zeros_like(state["h"]),
            "piece": Shard(torch.zeros(1000, device="cuda"), ShardInfo((1000,), 0, 1000, 1, 0))}
    out = ckpt.load(tmp_path / "a", like, restore_rng=True)
    assert out["w"].device.type == "cuda" and torch.equal(out["w"].cpu(), expected)
    assert torch.equal(out["h"].cpu(), expected.to(torch.bfloat16))
    assert torch.equal(out["piece"].local.cpu(), expected.view(-1)[:1000])
    assert torch.equal(torch.rand(4, device="cuda"), after_save)  # the CUDA generator was restored
    ckpt.save(tmp_path / "b", {"w": w})  # synchronous, from the GPU
    assert torch.equal(ckpt.load(tmp_path / "b", {"w": torch.zeros(1000, 300)})["w"], w.cpu())
    into = {"w": torch.zeros_like(w)}
    ckpt.load(tmp_path / "b", into, in_place=True)
    assert torch.equal(into["w"], w)

