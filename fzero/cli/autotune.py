"""``fzero autotune``: find the fastest stage × micro-batch × accumulation (× tp) that fits.

::

    fzero autotune --nproc 2 --memory 40 --config ds_config.json train.py --deepspeed_config ds_config.json

1. reads the base config and its ``autotuning`` section (DeepSpeed's keys);
2. builds the candidates (:func:`fzero.autotune.grid`);
3. learns Ψ, the parameter count (``autotuning.model_info.num_params``, or a first trial
   whose compiled step writes it at ``step.init``, with the largest block's count that sizes
   stage 3's units, and ends);
4. prunes every candidate whose ``fzero estimate`` total exceeds ``--memory``;
5. runs each other one as a short real trial: ``fzero launch`` of the script with the
   candidate's config (written to ``exps_dir/NAME/ds_config.json`` and passed in place of the
   script's ``--deepspeed_config``/``--config`` value, and as ``$FZERO_CONFIG``), whose
   ``autotuning`` section asks for the trial in DeepSpeed's keys (``enabled``,
   ``metric_path``, ``start_profile_step``, ``end_profile_step``); the compiled step it is
   passed to times its profile steps, writes ``exps_dir/NAME/metrics.json`` and ends the run
   (``fzero.compile``'s ``trial`` option, :mod:`fzero.autotune._profile`); a failed trial is
   recorded and the search goes on;
6. prints the table of trials and writes the best config (the base with the winning values)
   to ``--out`` and ``results_dir/ds_config_optimal.json``, the table to
   ``results_dir/summary.txt`` and every trial to ``results_dir/trials.json``.

See docs/autotune.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

from fzero.autotune import (AutotuningConfig, Candidate, OutOfMemoryError, TrialFailed, apply, estimate_bytes,
                            grid, search)
from fzero.autotune._search import _optimizer_kind

__all__ = ["add_parser", "run", "CONFIG_ENV", "CONFIG_FLAGS"]

CONFIG_ENV = "FZERO_CONFIG"
# The script flags whose value is the config path: DeepSpeed's (deepspeed.add_config_arguments) and the plain one.
CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed-config", "--config")


class AutotuneError(ValueError):
    """Bad ``fzero autotune`` input: reported as ``fzero autotune: error: ...``, exit code 2."""


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected non-negative integers such as 1,2,4")
    return values


def _set_flag(args: list[str], flag: str, value: str) -> bool:
    """Set ``flag``'s value in ``args`` (``--flag V`` or ``--flag=V``) in place; whether it was there."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            args[i + 1] = value
            return True
        if a.startswith(flag + "="):
            args[i] = f"{flag}={value}"
            return True
    return False


def _config_arg(script_args: list[str]) -> tuple[str, str] | None:
    """(flag, value) of the script's config flag, if it has one."""
    for i, a in enumerate(script_args):
        for flag in CONFIG_FLAGS:
            if a == flag and i + 1 < len(script_args):
                return flag, script_args[i + 1]
            if a.startswith(flag + "="):
                return flag, a[len(flag) + 1:]
    return None


def trial_args(script_args: list[str], config_path: str, values: dict, arg_mappings: dict | None) -> list[str]:
    """The script's arguments for one trial: its config flag's value replaced by
    ``config_path``, and each ``arg_mappings`` flag set to the candidate's value (appended
    when the script's arguments do not have it).

    Example:
        >>> trial_args(["--deepspeed_config", "ds.json", "--mbs", "1"], "t/ds.json",
        ...            {"train_micro_batch_size_per_gpu": 4}, {"train_micro_batch_size_per_gpu": "--mbs"})
        ['--deepspeed_config', 't/ds.json', '--mbs', '4']
    """
    args = list(script_args)
    found = _config_arg(args)
    if found is not None:
        _set_flag(args, found[0], config_path)
    for key, flag in (arg_mappings or {}).items():
        if key not in values:
            continue
        if not _set_flag(args, flag, str(values[key])):
            args += [flag, str(values[key])]
    return args


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


_EXC = re.compile(r"\b([A-Za-z_][\w.]*(?:Error|Exception|Interrupt))(?::\s*(.*))?$")


def _why(log: str) -> str:
    """The most telling line of a failed trial's output: the last exception a rank raised
    (torchrun's own ``ChildFailedError`` aside), else the signal that ended the first rank.

    Example:
        >>> _why("[rank1]: Traceback ...\\n[rank1]: ValueError: bad batch\\nChildFailedError:\\n")
        'ValueError: bad batch'
    """
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        m = _EXC.search(ln)
        if m and not m.group(1).endswith("ChildFailedError"):
            return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2) or ''}".rstrip(": ")
    for ln in lines:
        if ln.startswith("traceback :") and "Signal" in ln:
            return ln.split(":", 1)[1].strip()
    return lines[-1] if lines else "no output"


@dataclasses.dataclass
class Runner:
    """Runs trials as ``fzero launch`` subprocesses of ``script`` (see the module docstring)."""

    script: str
    script_args: list[str]
    nproc: int
    base: dict
    tuning: AutotuningConfig
    timeout: float | None = None
    pp: int = 1

    def _section(self, mode: str, metrics: Path) -> dict:
        """The ``autotuning`` section of a trial's config: DeepSpeed's keys that ask the step
        to measure itself (``Config.trial``) and write ``metrics``."""
        if mode == "model_info":
            return {"enabled": True, "model_info": {"profile": True}, "model_info_path": str(metrics.resolve())}
        return {"enabled": True, "metric_path": str(metrics.resolve()),
                "start_profile_step": self.tuning.start_profile_step, "end_profile_step": self.tuning.end_profile_step}

    def _launch(self, name: str, config: dict, mode: str) -> dict:
        exp = Path(self.tuning.exps_dir) / name
        exp.mkdir(parents=True, exist_ok=True)
        metrics = exp / "metrics.json"
        if not self.tuning.overwrite and metrics.is_file():
            return json.loads(metrics.read_text())
        metrics.unlink(missing_ok=True)
        cfg_path = exp / "ds_config.json"
        # The trial rides in the config the script passes to fzero.compile, as DeepSpeed's
        # autotuner writes each experiment's: its autotuning section asks the step to measure.
        config = {**config, "autotuning": self._section(mode, metrics)}
        cfg_path.write_text(json.dumps(config, indent=1))
        flat = {k: v for k, v in config.items() if not isinstance(v, dict)}
        args = trial_args(self.script_args, str(cfg_path), flat, self.tuning.arg_mappings)
        argv = [sys.executable, "-c", "import sys; from fzero.cli.main import main; sys.exit(main())",
                "launch", "--nproc", str(self.nproc), self.script, *args]
        env = {**os.environ, CONFIG_ENV: str(cfg_path.resolve())}
        (exp / "cmd.txt").write_text(" ".join(argv) + "\n")
        with open(exp / "stdout.log", "w") as out, open(exp / "stderr.log", "w") as err:
            proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, start_new_session=True)
            try:
                rc = proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks: the whole session
                proc.wait()
                raise TrialFailed(f"no result in {self.timeout:g} s (killed)") from None
            except BaseException:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
        if rc == 0 and metrics.is_file():
            return json.loads(metrics.read_text())
        log = _read(exp / "stdout.log") + "\n" + _read(exp / "stderr.log")
        if "out of memory" in log.lower() or "OutOfMemoryError" in log:
            raise OutOfMemoryError(_why(log))
        if rc == 0:
            until = "step.init" if mode == "model_info" else f"step {self.tuning.end_profile_step}"
            raise TrialFailed(f"the script ended before {until} without a metric file: "
                              "does it pass its config to fzero.compile and call the step that often?")
        raise TrialFailed(f"exit code {rc}: {_why(log)}")

    def trial(self, c: Candidate) -> dict:
        """Profile one candidate; its measurement (``throughput``, ``latency``, ...). A
        candidate whose config does not load fails here, without a launch; the loader's
        error is its ``stderr.log``, as a launched trial's would be."""
        config = apply(self.base, c)
        if (why := _load_error(config, self.nproc // (c.tp * self.pp))) is not None:
            exp = Path(self.tuning.exps_dir) / c.name
            exp.mkdir(parents=True, exist_ok=True)
            (exp / "stderr.log").write_text(why + "\n")
            raise TrialFailed(why)
        return self._launch(c.name, config, "profile")

    def model_info(self, c: Candidate) -> tuple[int, int | None]:
        """Ψ and the largest block's parameters (``0``: none; ``None``: not known), measured
        by a run that ends at ``step.init``."""
        info = self._launch("model_info", apply(self.base, c), "model_info")
        block = info.get("block_params")
        return int(info["num_params"]), (None if block is None else int(block))


def _load_base(path: str | None) -> tuple[dict, str | None]:
    if path is None:
        return {}, None
    from fzero.config import _load

    try:
        d, _ = _load.read(path)
    except (OSError, ValueError, TypeError) as e:
        raise AutotuneError(str(e)) from None
    return dict(d), path


def _load_error(config: dict, world_size: int) -> str | None:
    """Why ``config`` does not load at ``world_size`` data-parallel ranks (the loader's
    message), or None."""
    from fzero.config import Config

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            Config.load(config, world_size=world_size)
    except (ValueError, TypeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _loads(base: dict, c: Candidate, nproc: int, pp: int) -> bool:
    return _load_error(apply(base, c), nproc // (c.tp * pp)) is None


def _is_set(v) -> bool:
    return v is not None and v != "auto"


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Carry out ``fzero autotune``; 0 when a best config was written, 1 when no trial succeeded."""
    from fzero.cli.launch import _default_nproc
    from fzero.config import Config

    try:
        script_args = list(args.script_args)
        config_path = args.config
        if config_path is None and _config_arg(script_args) is not None:
            config_path = _config_arg(script_args)[1]
        base, _ = _load_base(config_path)
        tuning = AutotuningConfig.from_dict(base.get("autotuning"))
        if args.steps is not None:
            if args.steps < 1:
                raise AutotuneError(f"--steps must be a positive integer, got {args.steps}")
            tuning = dataclasses.replace(tuning, end_profile_step=tuning.start_profile_step + args.steps - 1)
        if tuning.ignored:
            print("fzero autotune: accepted without effect: " + "; ".join(tuning.ignored), file=sys.stderr)
        nproc = args.nproc or _default_nproc()
        for opt, values in (("--nproc", [nproc]), ("--tp", args.tp or [1]), ("--micro-batches", args.micro_batches or [1])):
            if min(values) < 1:
                raise AutotuneError(f"{opt} must be positive, got {','.join(map(str, values))}")
        pipe = base.get("pipeline")
        pp = pipe.get("stages", 1) if isinstance(pipe, dict) else 1
        pp = pp if isinstance(pp, int) else 1
        tp = args.tp or [((base.get("tensor_parallel") or {}).get("autotp_size") or tuning.mp_size)]
        zero = base.get("zero_optimization")
        offload = isinstance(zero, dict) and str((zero.get("offload_optimizer") or {}).get("device", "none")) != "none"
        # compile refuses offload at stage 0 (offload moves the partitioned optimizer state).
        stages = args.stages or ([1, 2, 3] if offload else [0, 1, 2, 3])
        bad = [s for s in stages if s > 3] + ([0] if offload and 0 in stages else [])
        if bad:
            raise AutotuneError(f"--stages {','.join(map(str, stages))}: stage {bad[0]} is not possible"
                                + (" with offload_optimizer" if offload and bad[0] == 0 else " (0-3)"))
        train = base.get("train_batch_size")
        gas = base.get("gradient_accumulation_steps")
        candidates = grid(world_size=nproc, stages=stages, tp=tp, pp=pp,
                          train_batch_size=train if _is_set(train) else None, micro_batches=args.micro_batches,
                          accumulation=gas if _is_set(gas) and not _is_set(train) else 1,
                          min_micro_batch=tuning.min_train_micro_batch_size_per_gpu,
                          max_micro_batch=tuning.max_train_micro_batch_size_per_gpu,
                          num_micro_batches=tuning.num_tuning_micro_batch_sizes,
                          min_train_batch_size=tuning.min_train_batch_size,
                          max_train_batch_size=tuning.max_train_batch_size)
        if not candidates:
            raise AutotuneError(f"no candidate: no micro-batch size in [{tuning.min_train_micro_batch_size_per_gpu}, "
                                f"{tuning.max_train_micro_batch_size_per_gpu}] gives train_batch_size={train} on "
                                f"{nproc} ranks (tp {tp}); list sizes with --micro-batches")
        # The base config must load (a typo fails here once, not in every trial).
        first = candidates[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            cfg = Config.load(apply(base, dataclasses.replace(first, micro_batch=1, accumulation=1,
                                                              train_batch_size=nproc // (first.tp * pp))),
                              world_size=nproc // (first.tp * pp))
    except (AutotuneError, ValueError, TypeError, NotImplementedError, argparse.ArgumentTypeError) as e:
        parser.error(str(e))
    if not Path(args.script).is_file():
        parser.error(f"script {args.script!r} does not exist (looked in {os.getcwd()})")

    runner = Runner(args.script, script_args, nproc, base, tuning, timeout=args.trial_timeout, pp=pp)
    budget = None if args.memory is None else int(args.memory * 2**30)
    if budget is None:
        try:
            import torch

            if torch.cuda.is_available():
                budget = torch.cuda.get_device_properties(0).total_memory
        except Exception:  # noqa: BLE001 - no device: no budget
            budget = None
    num_params, block_params = tuning.num_params, tuning.block_params
    if num_params is None:
        # The smallest candidate by memory whose config loads: stage 3 and the least
        # micro-batch, as DeepSpeed profiles its model info.
        loadable = [c for c in candidates if _loads(base, c, nproc, pp)]
        if not loadable:
            parser.error("no candidate's config loads (see the batch sizes); list sizes with --micro-batches")
        smallest = min(loadable, key=lambda c: (-c.stage, -c.tp, c.micro_batch))
        print(f"fzero autotune: measuring the parameter count ({smallest.name}) ...", flush=True)
        try:
            num_params, block_params = runner.model_info(smallest)
        except TrialFailed as e:
            print(f"fzero autotune: error: the parameter count could not be measured: {e}", file=sys.stderr)
            return 1
    precision = cfg.precision
    options = cfg.compile_options()
    estimate = functools.partial(estimate_bytes, num_params=num_params, world_size=nproc, precision=precision,
                                 optimizer=_optimizer_kind(base), bucket_bytes=options.bucket_bytes, pp=pp,
                                 max_reuse_distance=options.max_reuse_distance, block_params=block_params)
    from fzero.memory import format_bytes

    print(f"fzero autotune: {len(candidates)} candidates on {nproc} ranks, Ψ = {num_params:,} parameters, "
          f"{precision}, budget {format_bytes(budget) + ' per rank' if budget else 'none'}, metric {tuning.metric}, "
          f"profiling steps {tuning.start_profile_step}-{tuning.end_profile_step}", flush=True)

    def progress(t):
        detail = f"{t.value:.4g}" if t.value is not None else (t.error or "")
        print(f"  {t.candidate.name}: {t.status} {detail}".rstrip(), flush=True)

    if args.dry_run:
        result = search(candidates, runner.trial, budget, estimate=estimate, metric=tuning.metric, num_trials=0)
        print(result.table())
        return 0
    result = search(candidates, runner.trial, budget, estimate=estimate, metric=tuning.metric,
                    early_stopping=tuning.tuner_early_stopping, num_trials=tuning.tuner_num_trials,
                    order=tuning.tuner_type, on_trial=progress)
    table = result.table()
    print(table)
    results = Path(tuning.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    (results / "summary.txt").write_text(table + "\n")
    (results / "trials.json").write_text(json.dumps(
        [{"name": t.candidate.name, **dataclasses.asdict(t)} for t in result.trials], indent=1))
    if any(t.status in ("failed", "oom") for t in result.trials):
        print(f"fzero autotune: a failed trial's output is in {tuning.exps_dir}/TRIAL/stderr.log", file=sys.stderr)
    if result.best is None:
        print("fzero autotune: no trial succeeded", file=sys.stderr)
        return 1
    best = apply(base, result.best.candidate)
    text = json.dumps(best, indent=2) + "\n"
    out = Path(args.out) if args.out else results / "ds_config_optimal.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    (results / "ds_config_optimal.json").write_text(text)
    print(f"fzero autotune: best {result.best.candidate.name} ({tuning.metric} {result.best.value:.4g}); "
          f"config written to {out}")
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "autotune",
        help="search ZeRO stage × micro-batch × accumulation (× tp) for the fastest config that fits",
        description="Run SCRIPT as short real trials, one per candidate config that fits the memory budget "
                    "by fzero estimate, and write the fastest config. The script must pass the config it is "
                    "given (its --deepspeed_config/--config value, or $FZERO_CONFIG) to fzero.compile.",
        epilog="example: fzero autotune --nproc 2 --memory 40 --config ds.json train.py --deepspeed_config ds.json\n"
               "see docs/autotune.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="ranks per trial (default: the visible GPUs, or 1 without GPUs)")
    p.add_argument("--memory", type=float, default=None, metavar="GiB",
                   help="per-rank memory budget in GiB for the estimate (default: the GPU's memory; none on CPU)")
    p.add_argument("--config", default=None, metavar="PATH",
                   help="the base DeepSpeed config (default: the script's --deepspeed_config/--config value)")
    p.add_argument("--steps", type=int, default=None, metavar="K",
                   help="profiled steps per trial, after start_profile_step - 1 warm-up steps "
                        "(default: autotuning.end_profile_step - start_profile_step + 1 = 3)")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="where to write the best config (default: RESULTS_DIR/ds_config_optimal.json)")
    p.add_argument("--stages", type=_ints, default=None, metavar="LIST", help="ZeRO stages to try (default 0,1,2,3)")
    p.add_argument("--micro-batches", type=_ints, default=None, metavar="LIST",
                   help="micro-batch sizes per rank to try (default: powers of two within the autotuning bounds)")
    p.add_argument("--tp", type=_ints, default=None, metavar="LIST",
                   help="tensor-parallel sizes to try, set as tensor_parallel.autotp_size; only for scripts that build "
                        "their Mesh(tp=) from it (default: the config's autotp_size, else autotuning.mp_size)")
    p.add_argument("--trial-timeout", type=float, default=600.0, metavar="S",
                   help="seconds before a trial is killed and recorded failed (default 600)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the candidates and their estimates; run no profiling trial (only the parameter "
                        "count's, unless autotuning.model_info.num_params is given)")
    p.add_argument("script", metavar="SCRIPT", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...", help="arguments of SCRIPT")
    p.set_defaults(func=run)
    return p
