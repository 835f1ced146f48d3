"""Tests of the multi-rank harness itself (``tests/harness/``, the ``ranks`` fixture).

The jobs are module-level functions: the ranks import them from this module by name.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from harness.ranks import RankError, RankPool, RankPools, RankTimeout, current, run_ranks

pytestmark = pytest.mark.multirank


# ----------------------------------------------------------------------------- jobs


def _whoami():
    info = current()
    return (info.rank, info.world_size, dist.get_rank(), dist.get_world_size(),
            os.environ["RANK"], os.environ["OMP_NUM_THREADS"], torch.get_num_threads(), os.getpid())


def _all_reduce_rank_plus_one():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def _tensors(x):
    r = dist.get_rank()
    base = torch.arange(12.0).reshape(3, 4) * (r + 1)
    return {
        "view": base[:, 1:3],  # a non-contiguous view of a larger storage
        "bf16": base.to(torch.bfloat16),
        "int": torch.tensor([r, -r], dtype=torch.int64),
        "empty": torch.empty(0, 5),
        "arg_doubled": [x * 2, (x.sum(),)],
    }


def _raise_on(bad_rank, message):
    if dist.get_rank() == bad_rank:
        raise ValueError(message)
    t = torch.ones(1)
    dist.all_reduce(t)  # never completes: the failing rank does not join it
    return t.item()


def _sleep_on(slow_rank, seconds):
    if current().rank == slow_rank:
        time.sleep(seconds)
    return current().rank


def _exit_on(bad_rank, code):
    if current().rank == bad_rank:
        os._exit(code)
    return current().rank


def _unpicklable_result():
    return lambda: None


def _init_from_torchrun_env():
    dist.init_process_group("gloo")  # from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


# ----------------------------------------------------------------------------- tests


def test_results_come_back_in_rank_order(ranks):
    out = ranks(2).run(_whoami)
    assert [o[:5] for o in out] == [(0, 2, 0, 2, "0"), (1, 2, 1, 2, "1")]
    assert all(o[5] == "1" and o[6] == 1 for o in out)  # one thread per rank
    pids = {o[7] for o in out}
    assert len(pids) == 2 and os.getpid() not in pids


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_all_reduce_sums_over_real_ranks(ranks, world_size):
    expected = world_size * (world_size + 1) / 2
    assert ranks(world_size).run(_all_reduce_rank_plus_one) == [expected] * world_size


def test_tensors_round_trip(ranks):
    x = torch.randn(4, 3)
    out = ranks(2).run(_tensors, x)
    for r, got in enumerate(out):
        base = torch.arange(12.0).reshape(3, 4) * (r + 1)
        assert torch.equal(got["view"], base[:, 1:3])
        assert got["bf16"].dtype == torch.bfloat16 and torch.equal(got["bf16"], base.to(torch.bfloat16))
        assert torch.equal(got["int"], torch.tensor([r, -r]))
        assert got["empty"].shape == (0, 5)
        assert torch.equal(got["arg_doubled"][0], x * 2) and torch.equal(got["arg_doubled"][1][0], x.sum())


def test_a_raising_rank_is_reported_with_its_traceback(ranks):
    pool = ranks(2)
    starts = pool.starts
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        pool.run(_raise_on, 1, "boom from rank 1")
    err = info.value
    assert not isinstance(err, RankTimeout)
    assert time.monotonic() - t0 < 30  # the stuck rank 0 is given up on after the grace period
    assert set(err.failures) == {1} and err.hung == [0] and err.answered == [1]
    msg = str(err)
    assert "rank 1 raised" in msg
    assert "rank 1: ValueError: boom from rank 1" in msg
    assert "in _raise_on" in err.failures[1]  # the traceback, not just the message
    assert "all_reduce" in err.stacks[0] and "rank 0: did not answer" in msg  # where rank 0 is stuck
    # The pool restarts and works again.
    assert pool.run(_all_reduce_rank_plus_one) == [3.0, 3.0]
    assert pool.starts == starts + 1


@pytest.mark.slow
def test_a_hung_rank_times_out_naming_it(ranks):
    pool = ranks(2)
    t0 = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        pool.run(_sleep_on, 1, 1000, timeout_s=3)
    err = info.value
    assert 3 <= time.monotonic() - t0 < 30
    assert err.hung == [1] and err.answered == [0] and err.results[0] == 0
    assert "answered: 0; hung: 1" in str(err)
    assert "in _sleep_on" in err.stacks[1]  # the hung rank's stack, taken while it sleeps
    assert pool.run(_sleep_on, 1, 0) == [0, 1]


def test_a_dying_rank_is_reported_with_its_exit_code():
    with pytest.raises(RankError) as info:
        run_ranks(2, _exit_on, 1, 3, timeout_s=60)
    assert info.value.exit_codes == {1: 3}
    assert "rank 1: process died, exit code 3" in str(info.value)


def test_an_unpicklable_result_is_a_rank_error(ranks):
    with pytest.raises(RankError, match="could not be pickled"):
        ranks(2).run(_unpicklable_result)


def test_a_non_importable_fn_is_refused_before_sending(ranks):
    pool = ranks(2)
    starts = pool.starts
    with pytest.raises(TypeError, match="RankPool.run: fn .* must be picklable"):
        pool.run(lambda: 0)
    assert pool.starts == starts and pool.running  # nothing was sent: no restart needed


def test_many_small_jobs_share_one_pool(ranks):
    pool = ranks(2)
    pool.run(_all_reduce_rank_plus_one)  # started (or restarted) before timing
    t0 = time.monotonic()
    for _ in range(50):
        assert pool.run(_all_reduce_rank_plus_one) == [3.0, 3.0]
    per_job = (time.monotonic() - t0) / 50
    print(f"multirank per-job overhead: {per_job * 1e3:.1f} ms (pool start {pool.start_s:.2f} s)")
    assert per_job < 0.25  # ~3 ms measured; loose for a loaded 2-core machine


def test_torchrun_environment_without_a_process_group():
    with RankPool(2, init_process_group=False, timeout_s=60) as pool:
        assert pool.run(_init_from_torchrun_env) == [1.0, 1.0]
        assert pool.run(_init_from_torchrun_env) == [1.0, 1.0]  # the same ranks, again


def test_pools_are_cached_and_the_least_recently_used_is_stopped():
    pools = RankPools(max_pools=1, timeout_s=60)
    try:
        one = pools(1)
        assert pools(1) is one
        two = pools(2)
        assert two.running and not one.running
        assert one.run(_all_reduce_rank_plus_one) == [1.0]  # restarts, stopping the other
        assert one.running and not two.running
    finally:
        pools.close()
    assert not one.running and not two.running


def test_current_outside_a_rank_raises():
    with pytest.raises(RuntimeError, match="not running on a RankPool rank"):
        current()


def test_bad_world_size_is_a_value_error():
    with pytest.raises(ValueError, match="RankPool: world_size must be a positive int, got 0"):
        RankPool(0)
