"""Storage faults: a save into a full disk, checkpoints damaged after their commit, and
retention among damaged checkpoints.

A full disk is made two ways: in one process, the checkpoint's writes fail with ENOSPC
after N bytes (the write function is wrapped); on two real ranks, one rank's process gets a
file size limit (``RLIMIT_FSIZE``, no root needed), so the kernel itself refuses its write
(EFBIG). Damage is done to the files on disk after the commit: a flipped byte inside a
tensor, a truncated shard, a damaged manifest.
"""

from __future__ import annotations

import errno
import os
import re
import resource
import signal
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fzero.checkpoint as ckpt
from fzero.checkpoint import _format


def _state(step: int, n: int = 4096) -> dict:
    return {"step": torch.tensor(step), "w": torch.full((n,), float(step)), "b": torch.arange(7.0) + step}


def _fail_writes_after(monkeypatch, limit: int, err: int = errno.ENOSPC) -> None:
    """Make the checkpoint's file writes fail with ``err`` once ``limit`` bytes went through."""
    real = _format._write_all
    written = [0]

    def write_all(f, mv):
        mv = mv.cast("B") if mv.format != "B" else mv
        if written[0] + len(mv) > limit:
            real(f, mv[: max(0, limit - written[0])])
            written[0] = limit
            raise OSError(err, os.strerror(err))
        written[0] += len(mv)
        real(f, mv)

    monkeypatch.setattr(_format, "_write_all", write_all)


def _debris(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("async_", [False, True])
def test_a_save_into_a_full_disk_is_a_named_error_and_latest_stays_on_the_last_good_one(tmp_path, monkeypatch, async_):
    ckpt.save(tmp_path / "step_1", _state(1))
    _fail_writes_after(monkeypatch, 5000)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.save(tmp_path / "step_2", _state(2), async_=async_).wait()
    said = str(info.value)
    assert said.startswith(f"fzero.checkpoint.save: nothing was committed to {tmp_path}/step_2: writing failed on "
                           "rank 0: the disk is full (ENOSPC: No space left on device) writing "), said
    assert re.search(r"/\.step_2\.tmp-\w+/rank00000\.safetensors, after \d+ of \d+ tensor bytes;", said), said
    assert said.endswith(f"the newest committed checkpoint in {tmp_path} is unchanged: step_1"), said
    assert ckpt.latest(tmp_path) == str(tmp_path / "step_1")
    assert ckpt.latest(tmp_path, verify=True) == str(tmp_path / "step_1")
    assert _debris(tmp_path) == []  # the partial files are gone: the space is given back
    monkeypatch.undo()
    ckpt.save(tmp_path / "step_2", _state(2))  # the disk has room again: the same path saves
    assert ckpt.latest(tmp_path, verify=True) == str(tmp_path / "step_2")


def test_a_failed_asynchronous_save_nobody_waited_for_is_raised_by_the_next_save(tmp_path, monkeypatch):
    ckpt.save(tmp_path / "step_1", _state(1))
    _fail_writes_after(monkeypatch, 5000)
    handle = ckpt.save(tmp_path / "step_2", _state(2), async_=True)  # nobody waits for it
    while not handle.done():
        handle._done.wait(0.1)
    monkeypatch.undo()
    with pytest.raises(ckpt.CheckpointError, match=rf"the previous asynchronous save to {tmp_path}/step_2 failed: "
                                                   r".*the disk is full \(ENOSPC"):
        ckpt.save(tmp_path / "step_3", _state(3))
    assert ckpt.latest(tmp_path) == str(tmp_path / "step_1")
    ckpt.save(tmp_path / "step_3", _state(3))  # reported once: the next save goes ahead
    assert ckpt.latest(tmp_path) == str(tmp_path / "step_3")


def test_a_full_disk_while_the_manifest_is_written_commits_nothing(tmp_path, monkeypatch):
    ckpt.save(tmp_path / "step_1", _state(1))
    real = _format.write_json

    def write_json(path, obj, **kw):
        if os.path.basename(path) == _format.MANIFEST:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(path, obj, **kw)

    monkeypatch.setattr(_format, "write_json", write_json)
    with pytest.raises(ckpt.CheckpointError, match=r"nothing was committed to .*step_2: OSError: \[Errno 28\] No space "
                                                   r"left on device: .*manifest.json.*is unchanged: step_1"):
        ckpt.save(tmp_path / "step_2", _state(2), keep=1)
    assert [p.name for p in tmp_path.iterdir()] == ["step_1"]  # retention did not run either


def _size_limited_save(root: str) -> str:
    """Rank 1's process may not write files past 1 KiB (its file holds its RNG state: 5 KiB)."""
    ckpt.save(os.path.join(root, "step_1"), _state(1))
    rank = dist.get_rank()
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of a signal
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, old_limit[1]))
    try:
        ckpt.save(os.path.join(root, "step_2"), _state(2), timeout_s=30)
    except ckpt.CheckpointError as e:
        said = str(e)
    else:
        said = "no error"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    return f"{said}\nlatest: {ckpt.latest(root, verify=True)}"


@pytest.mark.multirank
def test_a_rank_whose_writes_the_kernel_refuses_fails_the_save_on_every_rank_naming_it(ranks, tmp_path):
    said = ranks(2).run(_size_limited_save, str(tmp_path))
    assert said[0] == said[1], said
    assert ("writing failed on rank 1: the file size limit was reached (EFBIG: File too large) writing "
            f"{tmp_path}/.step_2.tmp-") in said[0], said[0]
    assert "rank00001.safetensors, after " in said[0] and "is unchanged: step_1" in said[0], said[0]
    assert said[0].endswith(f"latest: {tmp_path}/step_1"), said[0]
    assert _debris(tmp_path) == [] and not (tmp_path / "step_2").exists()


def _flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _tensor_offset(ck: Path, key: str = "['w']") -> int:
    rec = next(r for r in ckpt.manifest(ck)["leaves"] if r["path"] == key)
    return rec["pieces"][0]["offset"] + 100


def test_latest_with_verify_skips_damaged_checkpoints_saying_which_and_why(tmp_path):
    for s in (1, 2, 3, 4):
        ckpt.save(tmp_path / f"step_{s}", _state(s))
    shard = tmp_path / "step_4" / "rank00000.safetensors"
    _flip_byte(shard, _tensor_offset(tmp_path / "step_4"))  # a flipped bit inside w
    (tmp_path / "step_3" / "rank00000.safetensors").write_bytes(
        (tmp_path / "step_3" / "rank00000.safetensors").read_bytes()[:-10])  # a truncated shard
    _flip_byte(tmp_path / "step_2" / "manifest.json", 40)  # a damaged manifest
    assert ckpt.latest(tmp_path) == str(tmp_path / "step_4")  # without verify: by the markers alone
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ckpt.latest(tmp_path, verify=True) == str(tmp_path / "step_1")
    skipped = [w.message for w in caught if issubclass(w.category, ckpt.CorruptCheckpointWarning)]
    assert [w.path for w in skipped] == [str(tmp_path / f"step_{s}") for s in (4, 3, 2)]
    assert all(isinstance(w.error, ckpt.CorruptCheckpointError) for w in skipped)
    a = _tensor_offset(tmp_path / "step_4") - 100
    assert str(skipped[0]) == (f"fzero.checkpoint.latest: skipped the damaged checkpoint {tmp_path}/step_4: checksum "
                               f"mismatch in {shard}, bytes [{a}, {a + 4096 * 4}) (['w']): the file is corrupted")
    assert f"skipped the damaged checkpoint {tmp_path}/step_3: checkpoint file " in str(skipped[1])
    assert "rank00000.safetensors is truncated: the manifest says" in str(skipped[1])
    assert f"step_2/manifest.json (the COMMITTED marker records another): the manifest is corrupted" in str(skipped[2])
    like = _state(0)
    assert ckpt.load(tmp_path / "step_1", like=like)["w"][0].item() == 1.0
    for s in (1,):  # nothing intact: None, after a warning for each
        (tmp_path / f"step_{s}" / "rank00000.safetensors").unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ckpt.latest(tmp_path, verify=True) is None
    assert len([w for w in caught if issubclass(w.category, ckpt.CorruptCheckpointWarning)]) == 4
    assert "rank00000.safetensors is missing" in str(caught[-1].message)


def test_retention_counts_only_intact_checkpoints_and_never_deletes_the_only_intact_one(tmp_path):
    ckpt.save(tmp_path / "step_1", _state(1))
    for s in (2, 3):
        ckpt.save(tmp_path / f"step_{s}", _state(s))
        f = tmp_path / f"step_{s}" / "rank00000.safetensors"
        f.write_bytes(f.read_bytes()[:100])  # damaged after commit
    ckpt.save(tmp_path / "step_4", _state(4), keep=2)
    # step_4 is one intact checkpoint; the next intact one is step_1, past two damaged ones.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_2", "step_3", "step_4"]
    ckpt.save(tmp_path / "step_5", _state(5), keep=2)  # two intact newer than step_1 and the damaged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4", "step_5"]
    # A damaged checkpoint among the newest does not count: step_4 stays as the second intact one.
    (tmp_path / "step_5" / "manifest.json").write_text("{}")
    ckpt.save(tmp_path / "step_6", _state(6), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4", "step_5", "step_6"]
    assert ckpt.latest(tmp_path, verify=True) == str(tmp_path / "step_6")
