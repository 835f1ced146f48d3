"""What each fault gives on 2 real ranks, and how long it takes: the table of docs/reliability.md.

Each row is one ``fzero launch --nproc 2`` run of ``tests/harness/fault_job.py`` (a tiny MLP,
ZeRO at ``--zero``, an asynchronous checkpoint every 2 steps, resumed from ``latest()``), with
one fault injected. The columns: the job's exit code; the line of its output that says what
happened (the first match of the row's pattern); and the seconds from the fault (the time
the failing rank wrote just before failing) to the end of the ``fzero launch`` process, or
from the start of the launch where there is no fault. Rows with ``--max-restarts`` also say
whether the resumed run's losses equal the uninterrupted run's bit for bit; so do the
preemption rows marked to resume, where a second ``fzero launch`` (no fault) resumes from the
checkpoint the preempted one saved.

The last row is an elastic job (``tests/harness/elastic_job.py`` under ``fzero launch --nproc 4
--nproc-min 2``): two of its four nodes are lost, one is added; it says how long the job took
to resume at each new size, and whether every step's loss equals the one-process run's.

Run::

    .venv/bin/python benchmarks/faults.py --timeout 10

(``--timeout`` is ``$FZERO_TIMEOUT`` in the ranks: the collective timeout.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # fzero, and the test harness in tests/harness/

from harness import elastic_job, fault_job  # noqa: E402
from harness.commands import run_command  # noqa: E402



class Row(NamedTuple):
    label: str
    job: list[str]  # fault_job's arguments
    restarts: int  # --max-restarts
    pattern: str  # of the line of output to show
    launcher: tuple[str, ...] = ()  # fzero launch's own options
    resume: bool = False  # launch again without the fault, and compare the losses


TERM_LAUNCHER = "term:rank=0:at=backward:step=2:to=launcher"  # rank 0 signals fzero launch mid-step
ROWS = [
    Row("no fault", [], 0, r"fault_job: rank 0: done"),
    Row("SIGKILL rank 1 at init", ["--fault", "kill:rank=1:at=init"], 0, r"exitcode\s+: -9.*"),
    Row("SIGKILL rank 1 mid-backward", ["--fault", "kill:rank=1:at=backward:step=3"], 0, r"CollectiveError: .*"),
    Row("SIGKILL rank 1 mid-backward, --max-restarts 1", ["--fault", "kill:rank=1:at=backward:step=3"], 1,
        r"fault_job: rank 0: done \(attempt 1\)"),
    Row("SIGKILL rank 1 mid-save", ["--fault", "kill:rank=1:at=save:step=4"], 0, r"CollectiveError: .*"),
    Row("SIGKILL rank 1 mid-save, --max-restarts 1", ["--fault", "kill:rank=1:at=save:step=4"], 1,
        r"fault_job: rank 0: done \(attempt 1\)"),
    Row("SIGKILL rank 1 at exit", ["--fault", "kill:rank=1:at=exit"], 0, r"exitcode\s+: -9.*"),
    Row("SIGSTOP rank 1 mid-backward", ["--fault", "stop:rank=1:at=backward:step=3"], 0, r"CollectiveError: .*"),
    Row("rank 1's disk full from the save of step 4 (1 KiB file size limit)", ["--fault", "full:rank=1:at=save:step=4"],
        0, r"CheckpointError: fzero.checkpoint.save: the previous asynchronous save .*"),
    Row("newest checkpoint damaged (a flipped byte) before a restart, --max-restarts 1, latest(verify=True)",
        ["--fault", "kill:rank=1:at=backward:step=5", "--damage", "flip", "--verify-latest"], 1,
        r"fault_job: resuming from step_0002 \(attempt 1\)"),
    Row("rank 1 has one more layer", ["--tree-differs"], 0, r"rank 1 has .*"),
    Row("rank 1 compiled another ZeRO stage", ["--stage-differs"], 0, r"ZeRO stage: .*"),
    Row("rank 1 saves to another path", ["--path-differs"], 0, r"ValueError: .*"),
    Row("SIGTERM to fzero launch mid-backward, then a second launch", ["--fault", TERM_LAUNCHER], 0,
        r"fault_job: rank 0: preempted, saved .*", resume=True),
    Row("SIGTERM to rank 1 mid-backward", ["--fault", "term:rank=1:at=backward:step=2"], 0,
        r"fzero.preempted: SIGTERM on rank 1: .*"),
    Row("SIGTERM to fzero launch mid-backward, a second one while the ranks save",
        ["--fault", TERM_LAUNCHER + ":again=1"], 0,
        r"fzero.preempted: rank \d received a second SIGTERM: exiting at once.*"),
    Row("SIGTERM to fzero launch mid-backward, a save slower than --grace 2", ["--fault", TERM_LAUNCHER,
        "--slow-preempt-save", "120"], 0, r"fzero launch: the ranks did not stop within .*", launcher=("--grace", "2")),
]


# The elastic row: 4 nodes of one rank (--nproc 4 --nproc-min 2), 2 of them lost at step 2
# (each rank SIGKILLs its torchrun agent and itself), one added at step 5.
ELASTIC_STEPS = 8
ELASTIC_LABEL = ("SIGKILL of 2 of 4 nodes (agent and rank) at step 2, a node added at step 5; "
                 "--nproc 4 --nproc-min 2, ZeRO 3 / 2 / 3 on 4 / 2 / 3 ranks")


def _elastic_row(args, env) -> str:
    with tempfile.TemporaryDirectory(prefix="fzero-elastic-") as tmp:
        out = Path(tmp)
        argv = [sys.executable, "-m", "fzero.cli.main", "launch", "--nproc", "4", "--nproc-min", "2",
                elastic_job.__file__, str(out), "--zero", "4:3,2:2,3:3", "--steps", str(ELASTIC_STEPS),
                "--shrink-at", "2", "--grow-at", "5"]
        start = time.time()
        done = run_command(argv, env=env, timeout_s=600)
        if done.timed_out or not (out / "fault_time").exists():
            return f"| {ELASTIC_LABEL} | - | timed out | {done.output[-300:]!r} |"
        fault, grown = float((out / "fault_time").read_text()), float((out / "grown").read_text())
        log = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines()]
        starts = [r for r in log if "start" in r]
        on2 = next(r["t"] for r in starts if r["world"] == 2)
        on3 = next(r["t"] for r in starts if r["world"] == 3)
        ref, _ = elastic_job.reference(ELASTIC_STEPS)
        same = all(abs(float.fromhex(r["loss"]) - ref[r["step"]]) <= 1e-5 * abs(ref[r["step"]])
                   for r in log if "step" in r)
        last = next(ln for ln in done.output.splitlines() if "elastic_job: rank 0: done" in ln)
        said = (f"{last} — resumed on 2 ranks {on2 - fault:.1f} s after the kill, on 3 ranks {on3 - grown:.1f} s "
                f"after the node was added; every step's loss equals the uninterrupted one-process run's "
                f"(fp32, rel 1e-5): {same}")
        return f"| {ELASTIC_LABEL} | {done.returncode} | {start + done.seconds - fault:.1f} | {said} |"


def _curve(out: Path) -> dict:
    curve = {}
    for line in (out / "losses.jsonl").read_text().splitlines():
        rec = json.loads(line)
        curve[rec["step"]] = rec["loss"]
    return curve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timeout", type=float, default=10.0, help="FZERO_TIMEOUT in the ranks (s)")
    p.add_argument("--zero", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--only", default=None, help="run the rows whose label contains this text (or one of "
                   "several, separated by |)")
    args = p.parse_args()
    env = {**os.environ, "FZERO_TIMEOUT": f"{args.timeout:g}", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    reference = None
    print(f"2 ranks (gloo, CPU), ZeRO-{args.zero}, FZERO_TIMEOUT={args.timeout:g} s, {args.steps} steps")
    print(f"| fault | exit | seconds | what the job says |\n| --- | --- | --- | --- |")
    for row in ROWS:
        label, restarts = row.label, row.restarts
        if args.only and not any(part in label for part in args.only.split("|")):
            continue
        with tempfile.TemporaryDirectory(prefix="fzero-faults-") as tmp:
            out = Path(tmp)
            argv = [sys.executable, "-m", "fzero.cli.main", "launch", "--nproc", "2", "--max-restarts", str(restarts),
                    *row.launcher, fault_job.__file__, str(out), "--zero", str(args.zero), "--steps", str(args.steps)]
            start = time.time()
            done = run_command([*argv, *row.job], env=env, timeout_s=300)
            end = start + done.seconds
            fault = out / "fault_time"
            since = float(fault.read_text()) if fault.exists() else start
            seconds = "timed out" if done.timed_out else f"{end - since:.1f}"
            said = next((m.group(0) for ln in done.output.splitlines() if (m := re.search(row.pattern, ln))),
                        "(nothing)")
            said = re.sub(r"\s+", " ", said.replace(tmp, "OUT"))
            said = said.split(": [/")[0][:320]  # gloo's own text after the colon is long; ours comes first
            if label == "no fault":
                reference = _curve(out)
            elif row.resume:
                again = run_command(argv, env=env, timeout_s=300)  # the same job, no fault: it resumes
                said += f"; the second launch exits {again.returncode}"
            if (restarts or row.resume) and reference is not None and (out / "losses.jsonl").exists():
                said += f" — losses equal the uninterrupted run's bit for bit: {_curve(out) == reference}"
            code = "-" if done.timed_out else done.returncode
            print(f"| {label} | {code} | {seconds} | {said} |", flush=True)
    if not args.only or any(part in ELASTIC_LABEL for part in args.only.split("|")):
        print(_elastic_row(args, env), flush=True)


if __name__ == "__main__":
    main()
