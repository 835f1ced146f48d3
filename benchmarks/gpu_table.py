"""The markdown of ``benchmarks/results/gpu.json`` (written by ``make gpu-check``) for
docs/performance.md's GPU section: the run's line (command, device, versions, commit), the step
table (per preset, per contestant), the offload search, the GPU tests and the targets.

It imports neither torch nor fzero: a report from a machine where they were broken renders
too, with its failed phases in it::

    python benchmarks/gpu_table.py benchmarks/results/gpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GIB = 2**30


def _f(value, fmt: str) -> str:
    """``value`` formatted, ``n/a`` where it was not measured."""
    return "n/a" if value is None else format(value, fmt)


def _run_line(report: dict) -> str:
    v = report.get("versions") or {}
    parts = [f"{name} {v[key]}" for key, name in (("torch", "torch"), ("cuda", "CUDA"), ("triton", "triton"))
             if v.get(key)]
    head = report.get("commit") or ""
    commit = (f"commit {head[:7]}" + (" with local changes" if head.endswith("+changes") else "")) if head \
        else "unknown commit"
    when = (report.get("finished") or report.get("started") or "")[:10]
    dry = "; a dry run on the CPU: not measurements" if report.get("dry_run") else ""
    return (f"`{report.get('command', 'benchmarks/gpu_check.py')}` — {report.get('device') or 'unknown device'}"
            f"{', ' + ', '.join(parts) if parts else ''}; {commit}{', ' + when if when else ''}{dry}")


def _bench_table(report: dict) -> list[str]:
    bench = report.get("bench") or {}
    if not bench:
        return ["No step was measured (no bench phase ran)."]
    lines = ["| preset | contestant | median step (ms) | × plain (paired) | tokens/s | MFU | peak memory (GiB) "
             "| × plain memory | status |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    notes = []
    for preset, result in bench.items():
        contestants = result.get("contestants") or {}
        if not contestants:
            lines.append(f"| {preset} | | | | | | | | {result.get('status', 'not run')} |")
            if result.get("error"):
                notes.append(f"{preset}: {result['error'][:300]}")
        for name, e in contestants.items():
            mem = e.get("peak_mem_bytes")
            lines.append(f"| {preset} | {name} | {_f(e.get('step_ms'), '.1f')} | {_f(e.get('vs_plain'), '.3f')} | "
                         f"{_f(e.get('tokens_per_s'), ',.0f')} | {_f(e.get('mfu'), '.1%')} | "
                         f"{_f(None if mem is None else mem / GIB, '.2f')} | {_f(e.get('mem_vs_plain'), '.3f')} | "
                         f"{e.get('status', 'n/a')} |")
            if e.get("status") not in ("ok", None) and e.get("error"):
                notes.append(f"{preset} {name}: {e['error'][:300]}")
    return lines + [f"* {n}" for n in notes]


def _offload_line(report: dict) -> str:
    off = report.get("offload") or {}
    if off.get("status") != "ok":
        why = off.get("reason") or ""
        return f"Offload search: {off.get('status', 'not run')}{': ' + why[:300] if why else ''}."
    a, b = off["fzero"], off["fzero-offload"]
    bound = " (a lower bound: the search stopped before a depth failed)" if off.get("ratio_is_lower_bound") else ""
    remat = {True: ", every block checkpointed", False: ", no activation checkpointing"}.get(off.get("remat"), "")
    return (f"Offload search, GPT of width {off['width']}, batch {off['batch']} × {off['block_size']}{remat}, device memory "
            f"capped at {off['device_memory_cap_bytes'] / GIB:.0f} GiB: `fzero` trains {a['depth']} blocks "
            f"({a['params'] / 1e6:,.0f}M parameters), `offload_optimizer=\"cpu\"` {b['depth']} blocks "
            f"({b['params'] / 1e6:,.0f}M): **{off['ratio']:.2f}×**{bound}.")


def _tests_line(report: dict) -> str:
    tests = report.get("tests") or {}
    phase = (report.get("phases") or {}).get("tests", {})
    if not tests:
        reason = f" ({phase['reason']})" if phase.get("reason") else ""
        return f"GPU tests: {phase.get('status', 'not run')}{reason}."
    bad = [n for n, t in tests.items() if t.get("outcome") not in ("passed", "skipped")]
    line = (f"GPU tests: {report.get('tests_passed', 0)} passed, {report.get('tests_failed', 0)} failed, "
            f"{report.get('tests_unfinished', 0)} cut by the time limit, {report.get('tests_skipped', 0)} skipped")
    return line + (": not passed " + ", ".join(f"`{n}` ({tests[n]['outcome']})" for n in bad) if bad else "") + "."


def _targets_line(report: dict) -> str:
    targets = report.get("targets") or {}
    if not targets:
        return ""
    parts = []
    for name, t in targets.items():
        verdict = {True: "met", False: "**not met**", None: "not measured"}[t.get("met")]
        parts.append(f"{name} {t['target']}: {_f(t.get('value'), '.3f')} ({verdict})")
    return "Targets: " + "; ".join(parts) + "."


def _phases_line(report: dict) -> str:
    phases = report.get("phases") or {}
    if not phases:
        return ""
    return "Phases: " + ", ".join(f"{n} {p.get('status')} ({_f(p.get('seconds'), '.0f')} of "
                                  f"{_f(p.get('limit_s'), '.0f')} s)" for n, p in phases.items()) + "."


def render(report: dict) -> str:
    """The markdown of one ``gpu.json`` report.

    Args:
        report: the JSON ``benchmarks/gpu_check.py`` wrote, read with ``json.load``; missing
            keys render as ``n/a`` or ``not run``.

    Returns:
        The run's line, the step table, then one line each for the offload search, the GPU
        tests, the targets and the phases, separated by blank lines.

    Example:
        >>> report = {"command": "benchmarks/gpu_check.py", "device": "cpu", "dry_run": True,
        ...           "bench": {"tiny": {"contestants": {"plain": {"status": "ok", "step_ms": 12.5,
        ...                                                        "vs_plain": 1.0}}}}}
        >>> print(render(report))  # doctest: +NORMALIZE_WHITESPACE
        `benchmarks/gpu_check.py` — cpu; unknown commit; a dry run on the CPU: not measurements
        <BLANKLINE>
        | preset | contestant | median step (ms) | × plain (paired) | tokens/s | MFU | peak memory (GiB) | × plain memory | status |
        | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |
        | tiny | plain | 12.5 | 1.000 | n/a | n/a | n/a | n/a | ok |
        <BLANKLINE>
        Offload search: not run.
        <BLANKLINE>
        GPU tests: not run.
    """
    blocks = [_run_line(report), "\n".join(_bench_table(report)), _offload_line(report), _tests_line(report),
              _targets_line(report), _phases_line(report)]
    return "\n\n".join(b for b in blocks if b)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", nargs="?", default=str(Path(__file__).resolve().parent / "results" / "gpu.json"),
                   help="the gpu.json to render (default: benchmarks/results/gpu.json)")
    args = p.parse_args(argv)
    try:
        report = json.loads(Path(args.report).read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"gpu_table: cannot read {args.report}: {e}", file=sys.stderr)
        return 2
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
