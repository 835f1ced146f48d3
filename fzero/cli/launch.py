"""``fzero launch``: torchrun underneath, DeepSpeed's hostfile, filters and env file on top.

One node::

    fzero launch --nproc 4 train.py --lr 3e-4

runs ``python -m torch.distributed.run --nproc-per-node 4 ... train.py --lr 3e-4`` with the
venv's own python, on a free master port. Several nodes, from a hostfile::

    fzero launch --hostfile hosts --include 'worker-0@worker-1:0,2' train.py        # prints
    fzero launch --hostfile hosts --ssh train.py                                    # runs

prints (or runs over ssh, concurrently) one torchrun command per host, each with its
``--node-rank`` and its own ``--nproc-per-node``. See docs/launcher.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from fzero.cli import _elastic, _signals
from fzero.cli._nodes import DEFAULT_MULTINODE_PORT, LaunchError, Node
from fzero.cli._nodes import default_nproc as _default_nproc
from fzero.cli._nodes import free_port as _free_port
from fzero.cli.hostfile import HostfileError, read_hostfile, select_slots

__all__ = [
    "LaunchError",
    "Node",
    "Plan",
    "add_parser",
    "find_env_file",
    "parse_env_file",
    "plan",
    "remote_command",
    "run",
    "torchrun_command",
]

ENV_FILE_NAME = ".fzero_env"
# Local variables a remote rank needs as much as a local one (DeepSpeed forwards similar ones).
FORWARDED_PREFIXES = ("NCCL_", "FZERO_")
FORWARDED_NAMES = ("PYTHONPATH",)
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# --------------------------------------------------------------------------- env file


def parse_env_file(text: str, *, source: str = ENV_FILE_NAME) -> dict[str, str]:
    """Parse ``KEY=VALUE`` lines (DeepSpeed's ``.deepspeed_env``) into a dict.

    Blank lines and ``#`` comment lines are skipped; ``export KEY=VALUE`` is accepted; a
    value wrapped in matching single or double quotes loses them. Everything else after
    the first ``=`` is the value, verbatim (``#`` inside a value is kept).

    Raises:
        LaunchError: a line with no ``=`` or a key that is not a shell identifier; the
            message names ``source`` and the 1-based line number.

    Example:
        >>> parse_env_file("# nccl\\nNCCL_DEBUG=INFO\\nexport NAME='a b'\\n\\nX=1=2\\n")
        {'NCCL_DEBUG': 'INFO', 'NAME': 'a b', 'X': '1=2'}
    """
    env: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export ") or line.startswith("export\t"):
            line = line[len("export"):].strip()
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not _ENV_KEY.fullmatch(key):
            raise LaunchError(f"env file {source} line {lineno}: expected KEY=VALUE, got {raw.strip()!r}")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key] = value
    return env


def find_env_file(cwd: str | Path | None = None, home: str | Path | None = None) -> Path | None:
    """The env file used when ``--env-file`` is not given: ``./.fzero_env``, else ``~/.fzero_env``."""
    for d in (Path(cwd or os.getcwd()), Path(home or Path.home())):
        f = d / ENV_FILE_NAME
        if f.is_file():
            return f
    return None


def _load_env(path: str | None) -> dict[str, str]:
    f = Path(path) if path else find_env_file()
    if f is None:
        return {}
    try:
        text = f.read_text()
    except OSError as e:
        raise LaunchError(f"env file {str(f)!r} cannot be read: {e.strerror or e}") from None
    return parse_env_file(text, source=str(f))


# --------------------------------------------------------------------------- commands


def torchrun_command(script: str, script_args=(), *, nproc: int, nnodes: int = 1, node_rank: int = 0,
                     master_addr: str = "127.0.0.1", master_port: int, max_restarts: int = 0,
                     python: str | None = None) -> list[str]:
    """The argv of one torchrun agent, ``python -m torch.distributed.run ... script args``.

    ``script_args`` follow the script untouched, options starting with ``--`` included.

    Example:
        >>> torchrun_command("t.py", ["--lr", "1"], nproc=2, master_port=1234, python="py")
        ... # doctest: +NORMALIZE_WHITESPACE
        ['py', '-m', 'torch.distributed.run', '--nproc-per-node', '2', '--nnodes', '1',
         '--node-rank', '0', '--master-addr', '127.0.0.1', '--master-port', '1234',
         '--max-restarts', '0', 't.py', '--lr', '1']
    """
    return [
        python or sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc),
        "--nnodes", str(nnodes),
        "--node-rank", str(node_rank),
        "--master-addr", str(master_addr),
        "--master-port", str(master_port),
        "--max-restarts", str(max_restarts),
        script, *script_args,
    ]


def remote_command(node: Node, *, cwd: str, forward: dict[str, str] | None = None) -> str:
    """The shell command ssh runs on ``node.host``: cd to ``cwd``, export the variables, exec torchrun."""
    env = {**(forward or {}), **node.env}
    argv = (["env", *(f"{k}={v}" for k, v in env.items())] if env else []) + node.argv
    return f"cd {shlex.quote(cwd)} && exec {shlex.join(argv)}"


def _ssh_argv(host: str, command: str, ssh_port: int | None) -> list[str]:
    return ["ssh", *(["-p", str(ssh_port)] if ssh_port else []), host, command]


def _visible(slots: list[int]) -> dict[str, str]:
    # Slots 0..k-1 are what LOCAL_RANK 0..k-1 use anyway; any other selection is made
    # visible explicitly, as DeepSpeed's launcher does, so local rank i gets slots[i].
    if slots == list(range(len(slots))):
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, slots))}


@dataclasses.dataclass
class Plan:
    """What ``fzero launch`` starts: one :class:`Node` per torchrun agent."""

    nodes: list[Node]
    multinode: bool  # several agents started from here (printed, or run over ssh)
    master_addr: str
    master_port: int

    @property
    def world_size(self) -> int:
        return sum(n.nproc for n in self.nodes)


def plan(args: argparse.Namespace, *, env: dict[str, str] | None = None) -> Plan:
    """Resolve parsed ``fzero launch`` arguments into the torchrun agents to start.

    Raises:
        LaunchError, HostfileError: inconsistent options, a malformed hostfile or filter.
    """
    env = dict(_load_env(args.env_file) if env is None else env)
    if _elastic.requested(args):
        return _elastic.plan(args, env)
    max_restarts = 0 if args.max_restarts is None else args.max_restarts
    for opt in ("nproc", "nnodes", "master_port"):
        v = getattr(args, opt)
        if v is not None and v < 1:
            raise LaunchError(f"--{opt.replace('_', '-')} must be a positive integer, got {v}")
    if max_restarts < 0:
        raise LaunchError(f"--max-restarts must be >= 0, got {max_restarts}")
    if not args.grace >= 0:  # (NaN too)
        raise LaunchError(f"--grace must be >= 0 seconds, got {args.grace}")
    if args.node_rank is not None and args.node_rank < 0:
        raise LaunchError(f"--node-rank must be >= 0, got {args.node_rank}")

    if args.hostfile:
        hosts = read_hostfile(args.hostfile)
        if args.nproc is not None:
            if args.include or args.exclude:
                raise LaunchError("--nproc cannot be combined with --include/--exclude; the filter picks the slots")
            for h, n in hosts.items():
                if args.nproc > n:
                    raise LaunchError(f"--nproc {args.nproc} exceeds the {n} slots of host {h!r} in the hostfile")
            selection = {h: list(range(args.nproc)) for h in hosts}
        else:
            selection = select_slots(hosts, include=args.include, exclude=args.exclude)
        if args.nnodes is not None:
            if args.nnodes > len(selection):
                raise LaunchError(
                    f"--nnodes {args.nnodes} but the hostfile selects only {len(selection)} host(s): "
                    f"{', '.join(selection)}"
                )
            selection = dict(list(selection.items())[: args.nnodes])
        nnodes = len(selection)
        master_addr = args.master_addr
    else:
        nproc = args.nproc if args.nproc is not None else _default_nproc()
        slots = select_slots({"localhost": nproc}, include=args.include, exclude=args.exclude)["localhost"] \
            if (args.include or args.exclude) else list(range(nproc))
        nnodes = args.nnodes or 1
        if args.ssh:
            raise LaunchError("--ssh needs --hostfile (the hosts to ssh into)")
        selection = {None: slots}
        master_addr = args.master_addr
        if nnodes > 1 and not master_addr:
            raise LaunchError(f"--nnodes {nnodes} needs --master-addr, the address of node 0 that every node can reach")
        master_addr = master_addr or "127.0.0.1"

    if args.node_rank is not None and args.node_rank >= nnodes:
        raise LaunchError(f"--node-rank {args.node_rank} is out of range for {nnodes} node(s) (0-{nnodes - 1})")
    multinode = args.node_rank is None and (nnodes > 1 or (args.hostfile is not None and args.ssh))
    if args.ssh and not multinode:
        raise LaunchError("--ssh cannot be combined with --node-rank (which runs this machine's node only)")
    if args.hostfile and not master_addr:
        # Node 0 is the first selected host, unless all of the job runs here.
        master_addr = next(iter(selection)) if (nnodes > 1 or multinode) else "127.0.0.1"
    # A free port is only known to be free here; other machines get torchrun's default.
    local_only = nnodes == 1 and not multinode
    master_port = args.master_port or (_free_port() if local_only else DEFAULT_MULTINODE_PORT)

    def node(host, rank, slots):
        argv = torchrun_command(args.script, args.script_args, nproc=len(slots), nnodes=nnodes, node_rank=rank,
                                master_addr=master_addr, master_port=master_port,
                                max_restarts=max_restarts)
        return Node(host=host, node_rank=rank, nproc=len(slots), env={**env, **_visible(slots)}, argv=argv)

    if args.hostfile:
        items = list(selection.items())
        if multinode:
            nodes = [node(h, r, s) for r, (h, s) in enumerate(items)]
        else:
            r = args.node_rank or 0
            nodes = [node(None, r, items[r][1])]
    elif multinode:  # no hostfile: the same command on each of nnodes machines
        nodes = [node(None, r, selection[None]) for r in range(nnodes)]
    else:
        nodes = [node(None, args.node_rank or 0, selection[None])]
    return Plan(nodes=nodes, multinode=multinode, master_addr=master_addr, master_port=master_port)


# --------------------------------------------------------------------------- running


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # killed by signal s -> 128+s, as a shell reports it


def _run_local(argv: list[str], env: dict[str, str], grace_s: float = _signals.DEFAULT_GRACE_S) -> int:
    # SIGTERM/SIGHUP reach the ranks with a grace period; stopped ranks are not waited for.
    return _signals.supervise(argv, env, grace_s=grace_s)


def _run_ssh(cmds: list[list[str]]) -> int:
    procs = [subprocess.Popen(c) for c in cmds]
    first_failure = 0
    try:
        while any(p.poll() is None for p in procs):
            for p in procs:
                rc = p.poll()
                if rc not in (None, 0) and not first_failure:
                    first_failure = _exit_code(rc)
                    # The others would wait on a rendezvous that can no longer complete.
                    for q in procs:
                        if q.poll() is None:
                            q.terminate()
            time.sleep(0.1)
    except KeyboardInterrupt:
        for q in procs:
            if q.poll() is None:
                q.terminate()
        raise
    for p in procs:
        if p.returncode and not first_failure:
            first_failure = _exit_code(p.returncode)
    return first_failure


def _forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES}


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Carry out ``fzero launch``; returns the exit code (torchrun's, or the first failing host's)."""
    try:
        p = plan(args)
    except (LaunchError, HostfileError) as e:
        parser.error(str(e))
    if isinstance(p, _elastic.ElasticPlan):
        return _elastic.run(p, args, parser)
    cwd = os.getcwd()
    if not p.multinode:
        (n,) = p.nodes
        if args.dry_run:
            print(n.shell())
            return 0
        if not Path(args.script).is_file():
            parser.error(f"script {args.script!r} does not exist (looked in {cwd})")
        return _run_local(n.argv, {**os.environ, **n.env}, args.grace)

    k = len(p.nodes)
    print(f"# fzero launch: {k} node{'s' if k != 1 else ''}, {p.world_size} ranks, "
          f"master {p.master_addr}:{p.master_port}", flush=True)
    if not args.ssh:
        for n in p.nodes:
            label = n.host or f"node {n.node_rank}"
            print(f"# {label}: node rank {n.node_rank}, {n.nproc} rank(s)")
            print(n.shell(cwd=cwd))
        if not args.dry_run:
            print("# run each line on its host, or pass --ssh to have fzero launch run them", file=sys.stderr)
        return 0
    forward = _forwarded_env()
    cmds = [_ssh_argv(n.host, remote_command(n, cwd=cwd, forward=forward), args.ssh_port) for n in p.nodes]
    if args.dry_run:
        for c in cmds:
            print(shlex.join(c))
        return 0
    return _run_ssh(cmds)


# --------------------------------------------------------------------------- parser


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "launch",
        help="run a training script on N ranks per node with torchrun (and over ssh for several nodes)",
        description="Launch SCRIPT on every rank with torchrun (python -m torch.distributed.run). "
                    "Everything after SCRIPT is passed to it untouched.",
        epilog="examples:\n"
               "  fzero launch --nproc 4 train.py --lr 3e-4\n"
               "  fzero launch --nnodes 2 --node-rank 0 --nproc 8 --master-addr 10.0.0.1 train.py\n"
               "  fzero launch --hostfile hosts --include 'worker-0@worker-1:0,2' --ssh train.py\n"
               "see docs/launcher.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="ranks per node (default: the visible GPUs, or 1 without GPUs); "
                        "with --hostfile, use slots 0..N-1 of every host")
    p.add_argument("--nnodes", type=_elastic.parse_nnodes, default=None, metavar="N|MIN:MAX",
                   help="number of nodes (default 1, or the hosts the hostfile selects); MIN:MAX: an elastic "
                        "job that goes on while at least MIN nodes are there (one fzero launch per host)")
    p.add_argument("--nproc-min", type=int, default=None, metavar="K",
                   help="an elastic job on this host: --nproc nodes of one rank each, going on (resharded) "
                        "while at least K of them are there")
    p.add_argument("--node-rank", type=int, default=None, metavar="R",
                   help="run only node R's agent here (start one per node yourself)")
    p.add_argument("--master-addr", default=None, metavar="ADDR",
                   help="address of node 0 (default 127.0.0.1 on one node, the first host with a hostfile)")
    p.add_argument("--master-port", type=int, default=None, metavar="PORT",
                   help=f"rendezvous port (default: a free port on one node, {DEFAULT_MULTINODE_PORT} on several)")
    p.add_argument("--hostfile", default=None, metavar="PATH", help="lines 'HOST slots=N'; '#' comments")
    p.add_argument("--include", default="", metavar="SPEC",
                   help="use only these slots: HOST[:SLOT,...][@HOST...], e.g. 'worker-2:0,1@worker-3'")
    p.add_argument("--exclude", default="", metavar="SPEC", help="use all slots but these (same syntax)")
    p.add_argument("--env-file", default=None, metavar="PATH",
                   help=f"KEY=VALUE lines set on every rank (default: ./{ENV_FILE_NAME}, else ~/{ENV_FILE_NAME})")
    p.add_argument("--max-restarts", type=int, default=None, metavar="K",
                   help="restart the worker group up to K times after a failure (torchrun's; default 0, "
                        f"or {_elastic.DEFAULT_MAX_RESTARTS} in an elastic job)")
    p.add_argument("--grace", type=float, default=_signals.DEFAULT_GRACE_S, metavar="S",
                   help="after a SIGTERM, the seconds the ranks get to save and stop before they are killed "
                        f"(default {_signals.DEFAULT_GRACE_S:g})")
    p.add_argument("--ssh", action="store_true", help="run each host's command over ssh (with --hostfile)")
    p.add_argument("--ssh-port", type=int, default=None, metavar="PORT", help="ssh port of the hosts")
    p.add_argument("--dry-run", action="store_true", help="print the command(s) instead of running them")
    p.add_argument("script", metavar="SCRIPT", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...", help="arguments of SCRIPT")
    p.set_defaults(func=run)
    return p
