"""``fzero.autotune``: search ZeRO stage × micro-batch × accumulation (× tp) for the fastest
configuration that fits a memory budget, as DeepSpeed's autotuner does.

:func:`search` is the loop: prune by :func:`estimate_bytes` (``fzero estimate``'s total),
run the rest with a ``run_trial`` function, keep the best by the metric. ``fzero autotune``
(:mod:`fzero.cli.autotune`) runs it with trials that launch the user's script, whose
compiled step measures itself when its config asks for a trial
(``fzero.compile(trial=TrialSpec(...))``, :mod:`fzero.autotune._profile`). See docs/autotune.md.
"""

from fzero.autotune._config import AutotuningConfig
from fzero.autotune._profile import TrialDone, TrialProfiler, TrialSpec
from fzero.autotune._search import (Candidate, OutOfMemoryError, SearchResult, Trial, TrialFailed, apply, estimate_bytes,
                                   grid, search)

__all__ = ["AutotuningConfig", "Candidate", "OutOfMemoryError", "SearchResult", "Trial", "TrialDone",
           "TrialFailed", "TrialProfiler", "TrialSpec", "apply", "estimate_bytes", "grid", "search"]
