import os

# Keep runs reproducible and light on the 2-core CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "2")
