"""The ``ranks`` fixture: real multi-rank worlds, started once per test session.

``tests/conftest.py`` re-exports it (``from conftest_multirank import ranks  # noqa: F401``).
A test asks for a world by size and runs module-level functions on it::

    def _sum_ranks():
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    @pytest.mark.multirank
    def test_sum(ranks):
        assert ranks(2).run(_sum_ranks) == [1.0, 1.0]

Pools are cached by world size (and options); at most two run at once, the least recently
used is stopped (and restarted if asked for again). A failed job restarts its pool.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ranks():
    """Factory ``ranks(world_size, **options) -> fzero._multirank.RankPool``, session-wide."""
    from fzero._multirank import RankPools  # imported here: collecting tests stays light

    pools = RankPools(max_pools=2)
    yield pools
    pools.close()
