import os

# Keep runs reproducible and light on the 2-core CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "2")

from hypothesis import settings  # noqa: E402

# CI replays the same examples every run (hypothesis' advice for CI: a red build then means
# a change broke something, not that a new random draw found an old corner); developers'
# runs keep drawing new examples, which is where new corners are found.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
from conftest_multirank import ranks  # noqa: E402,F401  (the session-wide multi-rank fixture)
