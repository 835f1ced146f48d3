"""``make gpu-check``: everything a lent GPU should run, in one command that ends inside its
time budget and always leaves ``benchmarks/results/gpu.json``.

Phases, each in processes of its own with its own time limit (a share of ``--budget``):

* ``env``: versions (Python, torch, CUDA, triton, optree, fzero), the device's name and memory;
* ``tests``: the GPU tests under pytest (``GPU_TESTS``), each test's outcome recorded as it
  ends by a small plugin; a per-test timeout (pytest-timeout), and a watch of its own: a test
  that hangs past it, or a pytest that dies, is recorded as failed and pytest is started
  again on the tests not yet run, until the phase's time is up (a test still running then is
  ``unfinished``);
* ``offload``: ``benchmarks/gpu_step.py --largest`` at 350M width, the deepest GPT trainable
  with and without ``offload_optimizer="cpu"`` (device memory capped at 8 GiB so that it
  takes seconds a try; one sequence of 1024 tokens a step and every block's activations
  checkpointed in both searches, so that the model's states, which offload moves, decide the
  depth rather than the activations, which it does not). It needs
  the GPU's memory but not its clock, so it runs beside ``tests``;
* ``bench_124m``, ``bench_350m``: ``benchmarks/gpu_step.py`` at each preset, contestants
  ``plain``, ``fzero``, ``fzero-jit``, ``compiled``, built alone on the GPU one after the other
  (fzero-jit before the compiled reference: a build still running when the phase's time is
  up is reported ``timeout``).

The JSON (``--out``) is rewritten after every phase, a failed or cut phase recorded in it,
and copied with the log and the rendered table to ``$OUT`` when that is set (the device
tool's folder of files that come back). Its keys: ``device``, ``versions``, ``bench``
(per preset, per contestant: ``step_ms``, ``tokens_per_s``, ``mfu``, ``peak_mem_bytes``,
``vs_plain``, ...), ``fzero_vs_plain_step`` (the worse of the two presets; each in
``fzero_vs_plain_step_by_preset``), ``fzero_vs_plain_memory`` (peak memory, likewise),
``mfu_350m`` (the better of ``fzero`` and ``fzero-jit``), ``offload_size_ratio``,
``tests_passed``, ``tests_failed``, ``tests_skipped``, ``tests_unfinished`` (cut by the
phase's time limit), ``tests`` (per test id: ``outcome``, ``seconds``, ``message``),
``phases`` (per phase: ``status``, ``seconds``, ``limit_s``, ...), ``targets``
(docs/performance.md's: fzero ≤ 1.00× plain in step time and in memory, MFU ≥ 50% at 350M,
offload ≥ 3×; none on a dry run).

``--device cpu --preset tiny`` is the dry run the suite runs (tests/test_gpu_check.py): the
GPU-only phases (tests, offload) are recorded as skipped and the contest runs at the tiny
preset with torch.compile's ``eager`` backend, in seconds. Its figures are not measurements.

``--phases`` runs some phases only, and ``--merge`` keeps the other phases' results from the
JSON already at ``--out`` (a rerun of what failed, on a warm machine).

The driver itself imports no torch: a broken torch or fzero is a failed phase in the JSON,
not a driver that never writes one. The procedure for a session with a GPU is in
docs/performance.md, section GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT / "tests")]  # gpu_table; the test harness

import gpu_table  # noqa: E402
from harness.commands import reap as reap_tagged  # noqa: E402  (stdlib only, like this driver)

SCHEMA = 1
# The quick ones first: test_gpu.py's launches of the example take minutes together, and a
# phase cut by its time limit should have cost the fewest outcomes.
GPU_TESTS = [
    "tests/test_kernels_compiled.py",
    "tests/test_fused_step.py::test_fused_step_compiled_on_the_gpu_without_host_sync",
    "tests/test_checkpoint.py::test_gpu_state_saves_async_and_loads_onto_the_gpu",
    "tests/test_gpu.py",
]
PHASES = ("env", "tests", "offload", "bench")  # "bench" is every preset's; "bench_124m" one of them
# Shares of --budget. tests and offload run side by side, so the wall time is
# env + max(tests, offload) + bench_124m + bench_350m + the driver's own = 0.97 of it.
SHARES = {"env": 0.05, "tests": 0.38, "offload": 0.32, "bench_124m": 0.23, "bench_350m": 0.31}
BUDGET_S = 360.0  # 6 minutes: a device call may take 10, the machine's start and the wheels' install outside it
# Floors under the shares: importing torch and fzero took 5 s on the development machine's
# CPU, and a first CUDA context takes seconds more.
MIN_S = {"env": 30.0}
PER_TEST_S = 150.0
GRACE_S = 15.0  # past a phase's limit before its processes are killed (they stop themselves first)

# What pytest loads (-p) to record each test's outcome the moment it is known, so that a
# pytest killed on a hang still leaves the outcomes of the tests before it.
_PLUGIN = '''
import json, os, time

_PATH = os.environ["FZERO_GPU_CHECK_RECORD"]


def _write(obj):
    with open(_PATH, "a") as f:
        f.write(json.dumps(obj) + "\\n")


def pytest_runtest_logstart(nodeid, location):
    _write({"event": "start", "nodeid": nodeid, "t": time.time()})


def pytest_runtest_logreport(report):
    message = None
    if report.failed or report.skipped:
        r = report.longrepr
        if isinstance(r, tuple):  # a skip: (path, line, reason)
            message = str(r[2])
        else:
            message = getattr(report, "longreprtext", str(r))[-1500:]
    _write({"event": "report", "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
            "duration": round(report.duration, 3), "message": message})


def pytest_collectreport(report):
    if report.failed:
        _write({"event": "report", "nodeid": report.nodeid or "<collection>", "when": "collect",
                "outcome": "failed", "duration": 0.0, "message": str(report.longrepr)[-1500:]})
'''


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Log:
    """The driver's log: its own lines (also printed) and every phase's output."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def line(self, text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        print(f"[gpu-check {stamp}] {text}", flush=True)
        with open(self.path, "a") as f:
            f.write(f"[gpu-check {stamp}] {text}\n")

    def append(self, title: str, path: Path) -> None:
        with open(self.path, "a") as f:
            f.write(f"\n===== {title} =====\n")
            try:
                f.write(path.read_text(errors="replace"))
            except OSError as e:
                f.write(f"(no output: {e})\n")
            f.write("\n")


# Every child gets a tag of its own in its environment, inherited by all it starts: the ranks
# that torchrun (under test_gpu.py's `fzero launch`) starts in sessions of their own are out
# of reach of a process-group kill, and would hold the GPU through the phases after (the
# same device as tests/harness/commands.py's reap).
TAG_VAR = "FZERO_GPU_CHECK_TAG"
_tags: dict[int, str] = {}  # child's pid -> its tag


def start(argv: list[str], log_path: Path, env: dict | None = None, cwd: Path | None = None) -> subprocess.Popen:
    """A child in a session of its own (so that its whole tree can be killed), output to a file."""
    tag = uuid.uuid4().hex
    out = open(log_path, "ab")
    try:
        proc = subprocess.Popen(argv, cwd=cwd or ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {}), TAG_VAR: tag}, start_new_session=True)
    finally:
        out.close()
    _tags[proc.pid] = tag
    return proc


def reap(proc: subprocess.Popen) -> list[int]:
    """SIGKILL every process left that carries ``proc``'s tag; their ids."""
    return reap_tagged(_tags[proc.pid], TAG_VAR)


def kill(proc: subprocess.Popen) -> None:
    """End the child's process group (SIGTERM, then SIGKILL after 5 s), then whatever it
    started elsewhere."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(5.0)
            break
        except subprocess.TimeoutExpired:
            continue
    reap(proc)
    proc.wait()


def wait(proc: subprocess.Popen, limit: float) -> tuple[int | None, bool]:
    """(returncode, timed_out), the child killed at ``limit`` seconds from now; what it left
    running is killed either way."""
    try:
        rc = proc.wait(max(0.0, limit))
    except subprocess.TimeoutExpired:
        kill(proc)
        return proc.returncode, True
    reap(proc)
    return rc, False


# --------------------------------------------------------------------------- phase: env

_ENV_SCRIPT = '''
import json, os, platform, sys
out = {"python": platform.python_version(), "executable": sys.executable}
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out["device"] = torch.cuda.get_device_name(0)
        out["device_memory_bytes"] = p.total_memory
        out["capability"] = f"{p.major}.{p.minor}"
        out["multiprocessors"] = p.multi_processor_count
        out["device_count"] = torch.cuda.device_count()
except Exception as e:
    out["torch_error"] = repr(e)
for name in ("triton", "optree", "pytest", "pytest_timeout", "hypothesis", "numpy", "fzero"):
    try:
        mod = __import__(name)
        out[name] = getattr(mod, "__version__", "present")
    except Exception as e:
        out[name] = None
        out[name + "_error"] = repr(e)[:300]
out["cpus"] = os.cpu_count()
out["host_memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
print("ENV " + json.dumps(out))
'''


def phase_env(py: str, limit: float, work: Path, log: Log) -> dict:
    path = work / "env.log"
    proc = start([py, "-c", _ENV_SCRIPT], path)
    rc, timed_out = wait(proc, limit)
    log.append("env", path)
    info = {}
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("ENV "):
            info = json.loads(line[4:])
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if smi.returncode == 0 and smi.stdout.strip():
            info["nvidia_smi"] = smi.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    status = "timeout" if timed_out else "ok" if rc == 0 and info else "failed"
    return {"status": status, "returncode": rc, "info": info}


# --------------------------------------------------------------------------- phase: tests


def _read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            continue
    return out


def _outcomes(records: list[dict]) -> tuple[dict, dict]:
    """Per test: {"outcome", "seconds", "message"} from the reports seen; and the tests started
    with no outcome yet (nodeid -> start time)."""
    tests, started = {}, {}
    for r in records:
        nid = r["nodeid"]
        if r["event"] == "start":
            started[nid] = r["t"]
            continue
        t = tests.setdefault(nid, {"outcome": None, "seconds": 0.0, "message": None})
        t["seconds"] = round(t["seconds"] + r["duration"], 3)
        when, outcome = r["when"], r["outcome"]
        if outcome == "failed":
            t["outcome"] = "failed" if when == "call" else "error"
            t["message"] = (f"[{when}] " + (r["message"] or ""))[-1500:]
        elif outcome == "skipped" and t["outcome"] is None:
            t["outcome"] = "skipped"
            t["message"] = r["message"]
        elif when == "call" and outcome == "passed" and t["outcome"] is None:
            t["outcome"] = "passed"
        if when in ("teardown", "collect"):
            started.pop(nid, None)
            if t["outcome"] is None:
                t["outcome"] = "error"
    return tests, {k: v for k, v in started.items() if k not in tests or tests[k]["outcome"] is None}


def run_tests(py: str, selection: list[str], limit: float, per_test: float, work: Path, log: Log,
              extra_args: list[str] | None = None, cwd: Path | None = None) -> dict:
    """Run ``selection`` under pytest inside ``limit`` seconds; a hang or crash fails that test
    and the others go on. Returns the phase's record with ``tests`` (nodeid -> outcome)."""
    t0 = time.monotonic()
    deadline = t0 + limit
    plugin_dir = work / "plugin"
    plugin_dir.mkdir(parents=True, exist_ok=True)
    (plugin_dir / "fzero_gpu_check_record.py").write_text(_PLUGIN)
    record = work / "tests.jsonl"
    record.unlink(missing_ok=True)
    have_timeout = subprocess.run([py, "-c", "import pytest_timeout"], capture_output=True).returncode == 0
    tests: dict[str, dict] = {}
    deselect: list[str] = []
    attempts, notes, timed_out = 0, [], False
    env = {"FZERO_GPU_CHECK_RECORD": str(record),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(plugin_dir), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    while True:
        left = deadline - time.monotonic()
        if left < 5:
            notes.append("the phase's time ran out")
            timed_out = True
            break
        attempts += 1
        # A file that does not import is an error of its own; the other files still run.
        argv = [py, "-m", "pytest", "-p", "fzero_gpu_check_record", "-p", "no:cacheprovider", "-q", "-rA",
                "--continue-on-collection-errors", *(extra_args or []), *selection]
        if have_timeout:
            argv += [f"--timeout={int(per_test)}"]
        for nid in deselect:
            argv += ["--deselect", nid]
        out = work / f"pytest_{attempts}.log"
        log.line(f"tests: pytest attempt {attempts}, {len(deselect)} deselected, {left:.0f} s left")
        known = len(tests)
        proc = start(argv, out, env=env, cwd=cwd)
        hung, cut = None, False
        while proc.poll() is None:
            time.sleep(0.5)
            _, started = _outcomes(_read_records(record))
            now_wall = time.time()
            over = [nid for nid, t in started.items() if now_wall - t > per_test + 30]
            if over:
                hung = over[0]
                notes.append(f"{hung}: no outcome {per_test + 30:.0f} s after it started; pytest killed")
                kill(proc)
                break
            if time.monotonic() > deadline:
                notes.append("pytest killed at the phase's time limit")
                cut = timed_out = True
                kill(proc)
                break
        proc.wait()
        reap(proc)  # what its tests left running
        log.append(f"tests: pytest attempt {attempts} (rc {proc.returncode})", out)
        tests, started = _outcomes(_read_records(record))
        for nid in started:  # started, never finished: the hang, the phase's end, or what a crash took down
            if cut:  # not the test's fault: the budget ran out while it ran
                tests[nid] = {"outcome": "unfinished", "seconds": round(time.time() - started[nid], 1),
                              "message": "still running when the phase's time limit came"}
                continue
            why = "hung" if nid == hung else f"pytest ended (rc {proc.returncode}) while it ran"
            tests[nid] = {"outcome": "failed", "seconds": round(time.time() - started[nid], 1),
                          "message": f"{why}: no outcome recorded"}
            with open(record, "a") as f:  # so that a later attempt's reading keeps it
                f.write(json.dumps({"event": "report", "nodeid": nid, "when": "call", "outcome": "failed",
                                    "duration": 0.0, "message": tests[nid]["message"]}) + "\n")
        if proc.returncode in (0, 1, 5) and hung is None and not started:
            break  # pytest ran to its end: all passed (0), some failed (1), none collected (5)
        if len(tests) == known:  # a crash before any test ended would repeat itself
            notes.append(f"pytest ended (rc {proc.returncode}) with no new outcome: see the log")
            break
        deselect = sorted(tests)
    counts = {k: sum(1 for t in tests.values() if t["outcome"] == k)
              for k in ("passed", "failed", "error", "skipped", "unfinished")}
    if counts["failed"] + counts["error"] or not (tests or timed_out):
        status = "failed"
    else:
        status = "timeout" if timed_out else "ok"
    return {"status": status, "attempts": attempts, "notes": notes, "tests": tests,
            "passed": counts["passed"], "failed": counts["failed"] + counts["error"], "skipped": counts["skipped"],
            "unfinished": counts["unfinished"],
            "per_test_timeout_s": per_test, "pytest_timeout_plugin": have_timeout}


# --------------------------------------------------------------------------- phases: bench, offload


def bench_argv(py: str, preset: str, device: str, limit: float, out: Path, dry: bool) -> list[str]:
    argv = [py, str(ROOT / "benchmarks" / "gpu_step.py"), "--device", device, "--preset", preset,
            "--json", str(out), "--time-limit", f"{limit:.0f}"]
    if dry:
        argv += ["--steps", "2", "--warmup", "1", "--build-steps", "1", "--compile-backend", "eager"]
    else:
        argv += ["--steps", "30", "--warmup", "3", "--build-steps", "3"]
    return argv


def offload_argv(py: str, limit: float, out: Path) -> list[str]:
    return [py, str(ROOT / "benchmarks" / "gpu_step.py"), "--device", "cuda", "--preset", "350m",
            "--contestants", "none", "--largest", "--largest-memory-gib", "8", "--largest-batch", "1",
            "--json", str(out),
            "--time-limit", f"{limit:.0f}"]


def finish_child(name: str, proc: subprocess.Popen, limit: float, t0: float, out: Path, log_path: Path,
                 log: Log) -> dict:
    rc, timed_out = wait(proc, limit - (time.monotonic() - t0) + GRACE_S)
    log.append(name, log_path)
    try:
        result = json.loads(out.read_text())
    except (OSError, json.JSONDecodeError) as e:
        result = {"status": "failed", "error": f"no JSON from gpu_step.py: {e!r}"}
    if timed_out:
        status = "timeout"
    elif rc != 0:
        status = "failed"
    else:
        status = "ok"
    if status != "ok" and result.get("status") in ("ok", "running"):
        result["status"] = status
    tail = log_path.read_text(errors="replace")[-1500:] if status != "ok" else None
    return {"status": status, "returncode": rc, "result": result, "output_tail": tail}


# --------------------------------------------------------------------------- the JSON


def summarize(report: dict) -> None:
    """The issue's scalar keys from the phases' results (so that a --merge recomputes them)."""
    bench = report.get("bench", {})

    def contestant(preset, name):
        return bench.get(preset, {}).get("contestants", {}).get(name, {})

    by_preset = {p: contestant(p, "fzero").get("vs_plain") for p in bench}
    measured = [v for v in by_preset.values() if v is not None]
    report["fzero_vs_plain_step_by_preset"] = by_preset
    report["fzero_vs_plain_step"] = max(measured) if measured else None
    mems = [contestant(p, "fzero").get("mem_vs_plain") for p in bench]
    mems = [v for v in mems if v is not None]
    report["fzero_vs_plain_memory"] = max(mems) if mems else None
    report["fzero_jit_vs_plain_step_by_preset"] = {p: contestant(p, "fzero-jit").get("vs_plain") for p in bench}
    report["compiled_vs_plain_step_by_preset"] = {p: contestant(p, "compiled").get("vs_plain") for p in bench}
    mfus = {n: contestant("350m", n).get("mfu") for n in ("fzero", "fzero-jit")}
    mfus = {n: v for n, v in mfus.items() if v is not None}
    best = max(mfus, key=mfus.get) if mfus else None
    report["mfu_350m"] = mfus[best] if best else None
    report["mfu_350m_contestant"] = best
    report["mfu_by_preset"] = {p: {n: e.get("mfu") for n, e in b.get("contestants", {}).items()}
                               for p, b in bench.items()}
    off = report.get("offload") or {}
    report["offload_size_ratio"] = off.get("ratio")
    tests = report.get("tests", {})
    report["tests_passed"] = sum(1 for t in tests.values() if t["outcome"] == "passed")
    report["tests_failed"] = sum(1 for t in tests.values() if t["outcome"] in ("failed", "error"))
    report["tests_skipped"] = sum(1 for t in tests.values() if t["outcome"] == "skipped")
    report["tests_unfinished"] = sum(1 for t in tests.values() if t["outcome"] == "unfinished")

    def target(value, op, bound):
        met = None if value is None else (value <= bound if op == "<=" else value >= bound)
        return {"value": value, "target": f"{op} {bound}", "met": met}

    if report.get("dry_run"):  # a dry run's figures are not measurements: no verdicts
        report["targets"] = {}
        return
    report["targets"] = {
        "fzero_vs_plain_step": target(report["fzero_vs_plain_step"], "<=", 1.00),
        "fzero_vs_plain_memory": target(report["fzero_vs_plain_memory"], "<=", 1.00),
        "mfu_350m": target(report["mfu_350m"], ">=", 0.50),
        "offload_size_ratio": target(report["offload_size_ratio"], ">=", 3.0),
    }


def write(report: dict, out: Path, log: Log, work: Path) -> None:
    summarize(report)
    report["finished"] = now_iso()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, out)
    table = work / "gpu_table.md"
    try:
        table.write_text(gpu_table.render(report) + "\n")
    except Exception as e:  # noqa: BLE001 - the table is a convenience; the JSON is the record
        table.write_text(f"gpu_table.render failed: {e!r}\n")
    dest = os.environ.get("OUT")
    if dest:
        try:
            Path(dest).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(out, Path(dest) / "gpu.json")
            shutil.copyfile(log.path, Path(dest) / "gpu_check.log")
            shutil.copyfile(table, Path(dest) / "gpu_table.md")
        except OSError as e:
            log.line(f"could not copy to $OUT: {e!r}")


def git_commit() -> str | None:
    """HEAD, with "+changes" when tracked files differ from it: a device machine's copy of the
    working tree may carry a .git whose HEAD is older than the files it runs."""
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if r.returncode != 0 or not r.stdout.strip():
            return None
        d = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True, timeout=30)
        return r.stdout.strip() + ("+changes" if d.returncode == 0 and d.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--preset", default=None, help="comma-separated bench presets (default: 124m,350m on cuda, "
                                                   "tiny on cpu)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for the whole check (default {BUDGET_S:.0f} on cuda, 90 on cpu)")
    p.add_argument("--per-test", type=float, default=PER_TEST_S, help="seconds a test may take")
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"comma-separated, of {', '.join(PHASES)}, bench_<preset> (default: all)")
    p.add_argument("--merge", action="store_true", help="keep the results of phases not run from the JSON at --out")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu.json"))
    p.add_argument("--python", default=sys.executable, help="the interpreter for the phases (default: this one)")
    p.add_argument("--tests", nargs="*", default=None, help=f"pytest selection (default: {' '.join(GPU_TESTS)})")
    p.add_argument("--work", default=None, metavar="DIR",
                   help="where the phases' logs go, kept for reading (default: a new fzero-gpu-check-* directory "
                        "in the system's temporary directory)")
    args = p.parse_args(argv)

    dry = args.device == "cpu"
    budget = args.budget or (90.0 if dry else BUDGET_S)
    presets = (args.preset or ("tiny" if dry else "124m,350m")).split(",")
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    unknown = set(phases) - set(PHASES) - {"bench"} - {f"bench_{pr}" for pr in presets}
    if unknown:
        p.error(f"unknown phases: {', '.join(sorted(unknown))}")
    out = Path(args.out).resolve()
    if args.work is not None:
        work = Path(args.work).resolve()
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="fzero-gpu-check-"))
    log = Log(work / "gpu_check.log")
    t_start = time.monotonic()
    deadline = t_start + budget

    def limit(share_of: str) -> float:
        # a dry run's only real phase is its one small contest
        share = (0.8 if dry and share_of.startswith("bench_") else SHARES.get(share_of, SHARES["bench_350m"])) * budget
        share = max(share, MIN_S.get(share_of, 0.0))
        return max(1.0, min(share, deadline - time.monotonic() - 2.0))

    report: dict = {}
    if args.merge and out.exists():
        try:
            report = json.loads(out.read_text())
        except json.JSONDecodeError:
            report = {}
    report.update({"schema": SCHEMA, "dry_run": dry, "budget_s": budget, "started": now_iso(),
                   "command": "benchmarks/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                   "commit": git_commit() or report.get("commit")})
    report.setdefault("device", None)
    report.setdefault("versions", {})
    report.setdefault("phases", {})
    report.setdefault("bench", {})
    report.setdefault("tests", {})
    report.setdefault("offload", None)
    bench_phases = [f"bench_{pr}" for pr in presets]
    selected = [ph for ph in ("env", "tests", "offload") if ph in phases]
    selected += [ph for ph in bench_phases if ph in phases or "bench" in phases]
    log.line(f"{'dry run on the CPU' if dry else 'GPU check'}: phases {', '.join(selected)}; budget {budget:.0f} s; "
             f"out {out}; log {log.path}")

    def record(name: str, entry: dict, seconds: float, lim: float) -> None:
        report["phases"][name] = {**entry, "seconds": round(seconds, 1), "limit_s": round(lim, 1)}
        write(report, out, log, work)
        log.line(f"{name}: {entry['status']} in {seconds:.0f} s (limit {lim:.0f} s)")

    if "env" in selected:
        t0, lim = time.monotonic(), limit("env")
        env = phase_env(args.python, lim, work, log)
        info = env["info"]
        report["versions"] = {k: info.get(k) for k in ("python", "torch", "cuda", "triton", "optree", "pytest",
                                                      "pytest_timeout", "hypothesis", "numpy", "fzero")}
        report["versions"]["driver"] = info.get("nvidia_smi")
        report["device"] = info.get("device") or ("cpu" if dry else None)
        report["host"] = {"cpus": info.get("cpus"), "memory_bytes": info.get("host_memory_bytes")}
        if info.get("device_memory_bytes"):
            report["host"]["device_memory_bytes"] = info["device_memory_bytes"]
        entry = {"status": env["status"]}
        errors = {k: v for k, v in info.items() if k.endswith("_error")}
        if errors:
            entry["errors"] = errors
        if not dry and not info.get("cuda_available"):
            entry.update(status="failed", error="torch sees no CUDA device: the GPU phases will fail")
        record("env", entry, time.monotonic() - t0, lim)

    # tests and offload, side by side
    offload = None
    if "offload" in selected:
        if dry:
            report["offload"] = {"status": "skipped", "reason": "GPU only (the dry run is on the CPU)"}
            record("offload", {"status": "skipped", "reason": "GPU only"}, 0.0, 0.0)
        else:
            lim = limit("offload")
            path, js = work / "offload.log", work / "offload.json"
            offload = (start(offload_argv(args.python, lim, js), path), time.monotonic(), lim, path, js)
            log.line(f"offload: started beside the tests (limit {lim:.0f} s)")
    if "tests" in selected:
        if dry:
            report["tests"] = {}
            record("tests", {"status": "skipped", "reason": "GPU only (the dry run is on the CPU)"}, 0.0, 0.0)
        else:
            t0, lim = time.monotonic(), limit("tests")
            res = run_tests(args.python, args.tests or GPU_TESTS, lim, min(args.per_test, lim), work, log)
            report["tests"] = res.pop("tests")
            record("tests", res, time.monotonic() - t0, lim)
    if offload is not None:
        proc, t0, lim, path, js = offload
        res = finish_child("offload", proc, lim, t0, js, path, log)
        report["offload"] = res["result"].get("largest") or {"status": res["status"],
                                                            "reason": res["result"].get("error")}
        record("offload", {k: v for k, v in res.items() if k != "result"}, time.monotonic() - t0, lim)

    for ph in bench_phases:
        if ph not in selected:
            continue
        preset = ph[len("bench_"):]
        t0, lim = time.monotonic(), limit(ph)
        path, js = work / f"{ph}.log", work / f"{ph}.json"
        proc = start(bench_argv(args.python, preset, args.device, lim, js, dry), path)
        res = finish_child(ph, proc, lim, t0, js, path, log)
        report["bench"][preset] = res["result"]
        record(ph, {k: v for k, v in res.items() if k != "result"}, time.monotonic() - t0, lim)

    report["seconds"] = round(time.monotonic() - t_start, 1)
    write(report, out, log, work)
    log.line(f"done in {report['seconds']:.0f} s: {out}")
    print(gpu_table.render(report), flush=True)
    if os.environ.get("OUT"):
        log.line(f"copied gpu.json, gpu_check.log and gpu_table.md to {os.environ['OUT']}")
    failed = [n for n, ph in report["phases"].items() if ph["status"] not in ("ok", "skipped")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
