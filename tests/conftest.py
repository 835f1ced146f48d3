import os

# Keep runs reproducible and light on the 2-core CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI replays the same examples every run (hypothesis' advice for CI: a red build then means
# a change broke something, not that a new random draw found an old corner); developers'
# runs keep drawing new examples, which is where new corners are found.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(scope="session")
def ranks():
    """Real multi-rank worlds, started once per test session: ``ranks(world_size, **options)``
    is a :class:`fzero.testing.multirank.RankPool`. A test runs module-level functions on it::

        def _sum_ranks():
            t = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(t)
            return t.item()

        @pytest.mark.multirank
        def test_sum(ranks):
            assert ranks(2).run(_sum_ranks) == [1.0, 1.0]

    Pools are cached by world size (and options); at most two run at once (a 2-core
    machine), the least recently used is stopped (and restarted if asked for again). A
    failed job restarts its pool.
    """
    # Imported here: collecting tests stays light.
    from fzero.testing.multirank import RankPools

    pools = RankPools(max_pools=2)
    yield pools
    pools.close()
