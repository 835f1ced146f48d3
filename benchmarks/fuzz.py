"""The bigger run of the bad-input fuzz: many more drawn cases than ``tests/test_fuzz.py``
runs, counted by outcome.

Each family draws its cases from :mod:`fzero.testing.fuzz` and runs them through the same
case functions the tests call, on one process: a value a config key does not take, any
change to a config (known or unknown keys at any depth, any value), configs that contradict
themselves, valid configs (each built and run one step against plain PyTorch's loss), bad
batches given to a compiled step, and mutated checkpoint manifests read six ways. A case
ends as a correct run, a named error, the step's own error (raised by the user's code and
passed through), or a bug (anything else, or a check that failed), which is printed.

Run::

    .venv/bin/python benchmarks/fuzz.py --examples 2000 --seed 0

prints a markdown table (the one in docs/reliability.md) and exits 1 if any case was a bug.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..")]

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fzero.testing as ft  # noqa: E402
from fzero.testing import fuzz  # noqa: E402

COLUMNS = ("ran", "named", "user", "bug")


def families(saved: fuzz.SavedCheckpoint) -> dict:
    """``{name: (strategy of argument tuples, case function, share of --examples)}``."""
    return {
        "config: a value its key does not take": (fuzz.bad_values(), fuzz.config_value_case, 1.0),
        "config: 1-4 keys (known or not, any depth) set to any value": (
            st.tuples(fuzz.config_mutations(), st.sampled_from([1, 2, 3])).map(lambda a: (*a[0], a[1])),
            fuzz.config_change_case, 1.0),
        "config: JSON text cut, with characters put in or taken out, a key twice, nested deep": (
            fuzz.config_texts().map(lambda t: (t,)), fuzz.config_text_case, 0.25),
        "config: contradictions (batch triple, fp16+bf16, offload without its stage, ...)": (
            st.sampled_from(fuzz.CONTRADICTIONS).map(lambda c: (c[1], c[2])), fuzz.contradiction_case, 0.05),
        "config: valid, built and run one step (plain PyTorch's loss)": (
            st.tuples(fuzz.valid_configs(), ft.seeds()), fuzz.valid_config_case, 0.1),
        "batch: bad leaves and trees, accumulate 1-3, fp32/bf16/fp16": (
            st.tuples(fuzz.batches(), st.sampled_from([1, 2, 3]), st.sampled_from(["fp32", "bf16", "fp16"])),
            fuzz.batch_case, 1.0),
        "checkpoint manifest: 1-3 fields removed, retyped or renamed, read 6 ways": (
            st.tuples(st.just(saved), fuzz.manifest_mutations(saved.nodes), st.sampled_from(fuzz.READS)),
            fuzz.manifest_case, 1.0),
    }


def run_family(strategy, case, examples: int, seed: int) -> tuple[collections.Counter, list[str]]:
    counts: collections.Counter = collections.Counter()
    bugs: list[str] = []

    @hypothesis_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def body(args):
        try:
            counts[case(*args)] += 1
        except Exception as e:  # noqa: BLE001  (a failed check or an unexpected error: counted, printed)
            counts["bug"] += 1
            bugs.append(f"{type(e).__name__}: {str(e)[:400]}")

    body()
    return counts, bugs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=500, help="cases per family (fewer for the slow ones)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="run only the families whose name contains this")
    args = parser.parse_args()
    rows = []
    all_bugs = []
    with tempfile.TemporaryDirectory() as root:
        saved = fuzz.save_checkpoint(root)
        for name, (strategy, case, share) in families(saved).items():
            if args.only not in name:
                continue
            n = max(1, int(args.examples * share))
            t0 = time.perf_counter()
            counts, bugs = run_family(strategy, case, n, args.seed)
            rows.append((name, sum(counts.values()), counts, time.perf_counter() - t0))
            all_bugs += [f"{name}: {b}" for b in bugs]
            print(f"{name}: {dict(counts)} in {rows[-1][3]:.1f} s", file=sys.stderr, flush=True)
    print("| input | cases | correct run | named error | the step's own error | bug |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, total, counts, _ in rows:
        print(f"| {name} | {total} | " + " | ".join(str(counts.get(c, 0)) for c in COLUMNS) + " |")
    for b in all_bugs:
        print(b)
    return 1 if all_bugs else 0


if __name__ == "__main__":
    sys.exit(main())
