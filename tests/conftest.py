import atexit
import os
import shutil
import tempfile

# Keep runs reproducible and light on the 2-core CI machine: the cores shared among the test
# processes (`make test` runs pytest-xdist's workers, which say how many there are).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, min(2, (os.cpu_count() or 1) // _WORKERS))))

# The processes tests start put their temporary files in one directory of this session,
# removed when it ends: torchrun makes a torchelastic_* directory for its workers' logs at
# every launch and never removes it. (This process keeps the system's.)
_SCRATCH = tempfile.mkdtemp(prefix="fzero-tests-")
os.environ["TMPDIR"] = _SCRATCH
atexit.register(shutil.rmtree, _SCRATCH, True)

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# Triton fixes interpreted-or-compiled at its first import, and tests/test_kernels.py runs the
# kernels interpreted; a torch.compile before it (tests/test_jit.py) would import triton
# compiled and skip them all. Without a GPU, import it interpreted first.
if not torch.cuda.is_available():
    from harness.interpreted import import_triton_interpreted

    import_triton_interpreted()

# CI replays the same examples every run (hypothesis' advice for CI: a red build then means
# a change broke something, not that a new random draw found an old corner); developers'
# runs keep drawing new examples, which is where new corners are found.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(scope="session")
def ranks():
    """Real multi-rank worlds, started once per test session: ``ranks(world_size, **options)``
    is a :class:`harness.ranks.RankPool` (``tests/harness/``). A test runs module-level functions on it::

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
    from harness.ranks import RankPools

    pools = RankPools(max_pools=2)
    yield pools
    pools.close()


# --------------------------------------------------------------------------- the multirank marker
# `make test-fast` runs `-m "not slow and not multirank"`: a test that starts ranks must carry
# @pytest.mark.multirank (and, as every one does, @pytest.mark.slow when it is long), or the fast
# suite would start worlds of processes. Checked twice: at collection, a test that asks for the
# `ranks` fixture; while a test runs, one that starts ranks another way (a RankPool or
# run_ranks, torchrun, `fzero launch` / `fzero autotune` in a subprocess).


def pytest_collection_modifyitems(config, items):
    unmarked = sorted({item.nodeid.split("[")[0] for item in items
                       if "ranks" in getattr(item, "fixturenames", ()) and item.get_closest_marker("multirank") is None})
    if unmarked:
        raise pytest.UsageError("these tests use the `ranks` fixture but are not marked @pytest.mark.multirank "
                                "(`make test-fast` leaves out multirank tests): " + ", ".join(unmarked))


def _starts_ranks(argv) -> bool:
    """Whether a command line launches ranks: torchrun, or fzero's launch or autotune."""
    words = argv.split() if isinstance(argv, str) else [str(a) for a in argv]
    if any(os.path.basename(w) == "torchrun" or "torch.distributed.run" in w for w in words):
        return True
    return any("fzero" in w for w in words) and bool({"launch", "autotune"} & set(words))


@pytest.fixture(autouse=True)
def _tests_that_start_ranks_are_marked_multirank(request):
    if request.node.get_closest_marker("multirank") is not None:
        yield
        return
    import subprocess

    from harness.ranks import RankPool

    started = []
    run, popen_init = RankPool.run, subprocess.Popen.__init__

    def watched_run(self, *args, **kwargs):
        started.append(f"a RankPool of {self.world_size}")
        return run(self, *args, **kwargs)

    def watched_popen(self, args, *rest, **kwargs):
        if _starts_ranks(args):
            started.append(repr(args if isinstance(args, str) else " ".join(map(str, args)))[:80])
        return popen_init(self, args, *rest, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RankPool, "run", watched_run)
        mp.setattr(subprocess.Popen, "__init__", watched_popen)
        yield
    if started:
        pytest.fail(f"{request.node.nodeid} starts ranks ({'; '.join(dict.fromkeys(started))}) but is not marked "
                    "@pytest.mark.multirank: `make test-fast` would run it (mark it multirank, and slow when long)",
                    pytrace=False)
