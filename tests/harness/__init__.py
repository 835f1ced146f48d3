"""The suite's harness for real multi-rank runs (test support, not installed with fzero).

- :mod:`harness.ranks`: ``RankPool``, ``RankPools``, ``run_ranks``, ``current``: run a
  module-level function on N gloo ranks started once (the ``ranks`` fixture of
  ``tests/conftest.py``), every failure named by rank;
- :mod:`harness.commands`: ``run_command``, ``reap``: run ``fzero launch`` / torchrun to its
  end or a timeout and kill whatever it left behind;
- :mod:`harness.marks`: ``BackwardReached``: a mark in backward (what ran before it);
- ``harness/fault_job.py``: a small training job that resumes from its checkpoints and fails
  on demand, run under ``fzero launch`` by ``tests/test_faults.py`` and ``benchmarks/faults.py``.

pytest puts ``tests/`` on ``sys.path``, so tests import ``harness.ranks``; a script outside
``tests/`` puts it there first (as ``benchmarks/faults.py`` does).
"""
