"""Mesh in one process: a world of one, axis resolution and its errors."""

import pytest

import fzero
from fzero.distributed.mesh import Mesh


def test_world_of_one_when_not_launched(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    mesh = fzero.Mesh(dp=-1)
    assert (mesh.world_size, mesh.rank) == (1, 0)
    assert mesh.shape == {"pp": 1, "dp": 1, "sp": 1, "tp": 1}
    assert mesh.device_mesh is None and mesh.group("dp") is None
    assert "dp=1" in repr(mesh)


@pytest.mark.parametrize(
    "sizes, world, expected",
    [
        ({"pp": 1, "dp": -1, "tp": 1}, 4, {"pp": 1, "dp": 4, "sp": 1, "tp": 1}),
        ({"pp": 2, "dp": -1, "tp": 1}, 4, {"pp": 2, "dp": 2, "sp": 1, "tp": 1}),
        ({"pp": 3, "dp": 1, "tp": -1}, 6, {"pp": 3, "dp": 1, "sp": 1, "tp": 2}),
        ({"pp": 2, "dp": 2, "tp": 1}, 4, {"pp": 2, "dp": 2, "sp": 1, "tp": 1}),
        ({"pp": 1, "dp": -1, "sp": 2, "tp": 1}, 4, {"pp": 1, "dp": 2, "sp": 2, "tp": 1}),
    ],
)
def test_resolve(sizes, world, expected):
    assert Mesh._resolve(sizes, world) == expected


@pytest.mark.parametrize(
    "sizes, world, message",
    [
        ({"pp": 1, "dp": 3, "tp": 1}, 4, "pp=1, dp=3, tp=1 multiply to 3, but the world has 4 ranks"),
        ({"pp": 3, "dp": -1, "tp": 1}, 4, "4 is not divisible by 3"),
        ({"pp": -1, "dp": -1, "tp": 1}, 4, "only one axis may be -1"),
        ({"pp": 0, "dp": 1, "tp": 1}, 1, "pp=0 must be a positive int or -1"),
        ({"pp": 1, "dp": 1, "sp": 3, "tp": 1}, 4, "pp=1, dp=1, sp=3, tp=1 multiply to 3, but the world has 4 ranks"),
    ],
)
def test_resolve_errors(sizes, world, message):
    with pytest.raises(ValueError, match=message):
        Mesh._resolve(sizes, world)


def test_mesh_size_mismatch_in_one_process():
    with pytest.raises(ValueError, match="fzero.Mesh: pp=1, dp=2, tp=1 multiply to 2, but the world has 1 ranks"):
        fzero.Mesh(dp=2)


def test_at_exit_the_other_threads_are_let_run_until_none_is_runnable(tmp_path):
    """The exit hook's test of this process's threads (``/proc/self/task/*/stat``, the state
    after the parenthesised name, which may itself hold ``)``): runnable when another thread
    than this one is ``R``; not when that cannot be read."""
    from fzero.distributed.mesh import _let_threads_settle, _others_runnable

    def task(tid, state, name="python3"):
        (tmp_path / str(tid)).mkdir(exist_ok=True)
        (tmp_path / str(tid) / "stat").write_text(f"{tid} ({name}) {state} 1 2 3\n")

    task(10, "R")
    task(11, "S", name="gloo) R (worker")
    assert not _others_runnable(str(tmp_path), me=10)  # only this thread runs
    task(12, "R", name="pt_main_thread")
    assert _others_runnable(str(tmp_path), me=10)
    task(12, "D")
    assert not _others_runnable(str(tmp_path), me=10)
    assert not _others_runnable(str(tmp_path / "absent"), me=10)
    _let_threads_settle(timeout_s=0.05)  # here: returns, whatever the threads
