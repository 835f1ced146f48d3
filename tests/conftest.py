import os

# Keep runs reproducible and light on the 2-core CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "2")
from conftest_multirank import ranks  # noqa: E402,F401  (the session-wide multi-rank fixture)
