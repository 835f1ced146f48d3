"""``fzero launch --nproc-min K`` and ``--nnodes MIN:MAX``: a job that outlives its nodes.

torchrun's elastic agents underneath: every agent ("node") joins a c10d rendezvous and the
job runs on the nodes that are there. When a node is lost for good (its agent killed, its
host gone), the surviving workers fail at their next collective, their agents restart them
(one of ``--max-restarts``), and the survivors rendezvous again without it, at the smaller
size, as long as at least the minimum remain. A node that arrives later waits in the
rendezvous; the running agents see it (``num_nodes_waiting``) and restart their workers at
the larger size, which costs no restart. Each new worker group starts from scratch; the
training script resumes from ``fzero.checkpoint.latest()``, resharded onto the new size.

One host, ``--nproc-min K --nproc N``: ``fzero launch`` starts N agents of one rank each, so
one rank is one node and can be lost alone; it hosts the rendezvous store in its own
process, which outlives any agent. Several hosts, ``--nnodes MIN:MAX``: one ``fzero launch``
per host, each one agent of ``--nproc`` ranks; the launcher on the ``--master-addr`` host
hosts the store. See docs/launcher.md, "Elastic jobs".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from fzero.cli import _signals
from fzero.cli._nodes import DEFAULT_MULTINODE_PORT, LaunchError, Node, free_port
from fzero.cli._nodes import default_nproc as _default_nproc

__all__ = ["DEFAULT_MAX_RESTARTS", "ElasticPlan", "JOIN_VAR", "RDZV_CONF", "elastic_torchrun_command", "exit_code",
           "parse_nnodes", "plan", "requested", "run"]

#: The rendezvous settings fzero's elastic agents use (torchrun's ``--rdzv-conf``). Once the
#: minimum of nodes is there, the rendezvous waits 2 s more for others before it completes
#: (torchrun's default: 30 s). A node whose agent has not renewed its keep-alive for 5 s x 3
#: is dead and is dropped from the rendezvous: torchrun's default, kept, because the drop
#: also rewrites a completed round, and agents that read the round before and after it
#: disagree on the world (on 2 loaded cores, 1 s x 5 dropped live agents that way and the
#: job failed). ``is_host=false``: an agent never hosts the store, the launcher does.
RDZV_CONF = {"keep_alive_interval": 5, "keep_alive_max_attempt": 3, "last_call_timeout": 2}

#: Set in every agent's environment: the command that adds one node to this job from this
#: machine (a shell line). A worker inherits it.
JOIN_VAR = "FZERO_ELASTIC_JOIN"

DEFAULT_MAX_RESTARTS = 3


def parse_nnodes(text: str) -> int | tuple[int, int]:
    """``--nnodes``: ``N`` (a fixed number of nodes) or ``MIN:MAX`` (an elastic job).

    Example:
        >>> parse_nnodes("2"), parse_nnodes("2:4")
        (2, (2, 4))
    """
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            return int(text)
        a, b = int(lo), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX (integers), got {text!r}") from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"MIN:MAX needs 1 <= MIN <= MAX, got {text!r}")
    return a, b


def requested(args: argparse.Namespace) -> bool:
    """Whether the parsed ``fzero launch`` arguments ask for an elastic job."""
    return getattr(args, "nproc_min", None) is not None or isinstance(args.nnodes, tuple)


def elastic_torchrun_command(script: str, script_args=(), *, nproc: int, min_nodes: int, max_nodes: int,
                             endpoint: str, run_id: str, max_restarts: int, is_host: bool,
                             local_addr: str | None = None, python: str | None = None) -> list[str]:
    """The argv of one elastic torchrun agent (c10d rendezvous at ``endpoint``).

    Example:
        >>> elastic_torchrun_command("t.py", ["--lr", "1"], nproc=1, min_nodes=2, max_nodes=4,
        ...     endpoint="127.0.0.1:1234", run_id="fzero-1234", max_restarts=3, is_host=False,
        ...     python="py")  # doctest: +NORMALIZE_WHITESPACE
        ['py', '-m', 'torch.distributed.run', '--nproc-per-node', '1', '--nnodes', '2:4',
         '--rdzv-backend', 'c10d', '--rdzv-endpoint', '127.0.0.1:1234', '--rdzv-id', 'fzero-1234',
         '--rdzv-conf', 'is_host=false,keep_alive_interval=5,keep_alive_max_attempt=3,last_call_timeout=2',
         '--max-restarts', '3', 't.py', '--lr', '1']
    """
    conf = ",".join([f"is_host={'true' if is_host else 'false'}", *(f"{k}={v}" for k, v in RDZV_CONF.items())])
    return [
        python or sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc),
        "--nnodes", f"{min_nodes}:{max_nodes}",
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", endpoint,
        "--rdzv-id", run_id,
        "--rdzv-conf", conf,
        "--max-restarts", str(max_restarts),
        *(["--local-addr", local_addr] if local_addr else []),
        script, *script_args,
    ]


@dataclasses.dataclass
class ElasticPlan:
    """What an elastic ``fzero launch`` starts here: agents (``_nodes.Node``), and the store."""

    nodes: list  # of fzero.cli._nodes.Node
    min_nodes: int
    max_nodes: int
    master_addr: str
    master_port: int
    host_store: bool  # this launcher hosts the rendezvous store (if the port is free)
    join: list[str]  # the argv that adds one node from this machine

    @property
    def world_size(self) -> int:
        return sum(n.nproc for n in self.nodes)


def _matches_this_machine(addr: str) -> bool:
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return _matches_machine_hostname(addr)


def plan(args: argparse.Namespace, env: dict[str, str]) -> ElasticPlan:
    """Resolve an elastic ``fzero launch`` (``--nproc-min`` or ``--nnodes MIN:MAX``).

    Raises:
        LaunchError: contradicting options, each named.
    """

    problems = []
    if args.hostfile or args.ssh:
        problems.append("--hostfile/--ssh: an elastic job runs one fzero launch per host (see docs/launcher.md)")
    if args.node_rank is not None:
        problems.append("--node-rank: the rendezvous numbers the nodes of an elastic job")
    if args.include or args.exclude:
        problems.append("--include/--exclude: an elastic job uses slots 0..N-1")
    if args.max_restarts is not None and args.max_restarts < 1:
        problems.append(f"--max-restarts {args.max_restarts}: the survivors of a lost node need at least 1 restart")
    if args.master_port is not None and args.master_port < 1:
        problems.append(f"--master-port must be a positive integer, got {args.master_port}")
    restarts = DEFAULT_MAX_RESTARTS if args.max_restarts is None else args.max_restarts

    if args.nproc_min is not None:  # one host, one rank per node
        if args.nnodes is not None:
            problems.append(f"--nproc-min cannot be combined with --nnodes ({args.nnodes}); across hosts use "
                            "--nnodes MIN:MAX")
        n = args.nproc if args.nproc is not None else _default_nproc()
        if not 1 <= args.nproc_min <= n:
            problems.append(f"--nproc-min {args.nproc_min} must be between 1 and --nproc {n}")
        if problems:
            raise LaunchError("; ".join(problems))
        addr = args.master_addr or "127.0.0.1"
        min_nodes, max_nodes, per_node, count = args.nproc_min, n, 1, n
        host_store = True
    else:
        min_nodes, max_nodes = args.nnodes
        per_node = args.nproc if args.nproc is not None else _default_nproc()
        if per_node < 1:
            problems.append(f"--nproc must be a positive integer, got {per_node}")
        if not args.master_addr:
            problems.append(f"--nnodes {min_nodes}:{max_nodes} needs --master-addr, the address of the host whose "
                            "fzero launch hosts the rendezvous, which every node can reach")
        if problems:
            raise LaunchError("; ".join(problems))
        addr, count = args.master_addr, 1
        host_store = _matches_this_machine(addr)
    port = args.master_port or (free_port() if args.nproc_min is not None else DEFAULT_MULTINODE_PORT)
    run_id = f"fzero-{port}"
    local = "127.0.0.1" if addr in ("127.0.0.1", "localhost") else None
    argv = elastic_torchrun_command(args.script, args.script_args, nproc=per_node, min_nodes=min_nodes,
                                    max_nodes=max_nodes, endpoint=f"{addr}:{port}", run_id=run_id,
                                    max_restarts=restarts, is_host=False, local_addr=local)
    join = [sys.executable, "-m", "fzero.cli", "launch", "--nnodes", f"{min_nodes}:{max_nodes}",
            "--nproc", str(per_node), "--master-addr", addr, "--master-port", str(port),
            "--max-restarts", str(restarts), *(["--env-file", args.env_file] if args.env_file else []),
            args.script, *args.script_args]
    node_env = {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", JOIN_VAR: shlex.join(join)}
    devices = _devices(count) if count > 1 else [{}]
    nodes = [Node(host=None, node_rank=i, nproc=per_node, env={**node_env, **devices[i]}, argv=argv)
             for i in range(count)]
    return ElasticPlan(nodes=nodes, min_nodes=min_nodes, max_nodes=max_nodes, master_addr=addr, master_port=port,
                       host_store=host_store, join=join)


def _devices(count: int) -> list[dict[str, str]]:
    # One host, one rank per agent: every worker has LOCAL_RANK 0, so agent i is shown its own
    # GPU, the i-th visible one. (A node added later picks its GPU by CUDA_VISIBLE_DEVICES.)
    import torch


    if not torch.cuda.is_available():
        return [{} for _ in range(count)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(d) for d in range(torch.cuda.device_count())]
    if count > len(ids):
        raise LaunchError(f"--nproc {count} exceeds the {len(ids)} visible GPU(s) ({','.join(ids)}): one node per GPU")
    return [{"CUDA_VISIBLE_DEVICES": ids[i]} for i in range(count)]


# --------------------------------------------------------------------------- running


def _host_store(addr: str, port: int):
    """The rendezvous store, in this process; ``None`` when another process has the port
    (this launcher then only adds its agents to that job)."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        return dist.TCPStore(addr, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                             timeout=timedelta(seconds=60))
    except (RuntimeError, ValueError, OSError):
        return None


def exit_code(codes: list[int]) -> int:
    """The launcher's exit code from its agents' (``Popen`` return codes, negative for a signal).

    0 when some agent finished its workers (0) and every other either did too or was lost
    (killed by a signal: the job went on without it); otherwise the first agent's failure
    (its exit code, or 128 + the signal when every failure was a kill).

    Example:
        >>> exit_code([0, -9, 0]), exit_code([1, 0, -9]), exit_code([-9, -9]), exit_code([0, 0])
        (0, 1, 137, 0)
    """
    if 0 in codes and all(c <= 0 for c in codes):
        return 0
    failed = [c for c in codes if c > 0]
    if failed:
        return failed[0]
    return 128 - next(c for c in codes if c < 0)


def _say(text: str) -> None:
    print(f"fzero launch: {text}", file=sys.stderr, flush=True)


def run(p: ElasticPlan, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Start the plan's agents (and, where it falls to this launcher, the rendezvous store),
    wait for all of them, and return :func:`exit_code` of theirs (128 + SIGTERM when ranks
    were killed past ``--grace``)."""
    import subprocess

    if args.dry_run:
        for n in p.nodes:
            print(n.shell())
        return 0
    if not Path(args.script).is_file():
        parser.error(f"script {args.script!r} does not exist (looked in {os.getcwd()})")
    store = _host_store(p.master_addr, p.master_port) if p.host_store else None
    k = len(p.nodes)
    _say(f"elastic job, {k} node{'s' if k != 1 else ''} of {p.nodes[0].nproc} rank(s) here, between {p.min_nodes} "
         f"and {p.max_nodes} nodes in all; rendezvous {p.master_addr}:{p.master_port}"
         f"{' (hosted here)' if store is not None else ''}; add a node with: {shlex.join(p.join)}")
    procs = [subprocess.Popen(n.argv, env=_signals.agent_env({**os.environ, **n.env}, args.grace)) for n in p.nodes]
    # Each agent as fzero launch runs a single one (_signals.py): a SIGTERM reaches the ranks,
    # which get --grace seconds to save and stop before they are killed; a stopped rank is
    # killed at once.
    watched = [_signals.Supervisor(q, args.grace) for q in procs]

    def forward(signum, frame):
        for w in watched:
            if w.proc.poll() is None:
                w.on_signal(signum, frame)

    old = {}
    for s in (signal.SIGTERM, signal.SIGHUP):
        try:
            old[s] = signal.signal(s, forward)
        except ValueError:  # not the main thread
            pass
    reported: set[int] = set()
    try:
        while True:
            try:
                for i, q in enumerate(procs):
                    rc = q.poll()
                    if rc is not None and rc < 0 and i not in reported:
                        reported.add(i)
                        name = signal.Signals(-rc).name if -rc in signal.valid_signals() else str(-rc)
                        _say(f"node {i} (agent pid {q.pid}) was lost ({name}); the job goes on if at least "
                             f"{p.min_nodes} node(s) remain or arrive")
                if all(q.poll() is not None for q in procs):
                    break
                for w in watched:
                    if w.proc.poll() is None:
                        w.poll()
                time.sleep(_signals.POLL_S)
            except KeyboardInterrupt:
                for q in procs:
                    if q.poll() is None:
                        q.send_signal(signal.SIGINT)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        del store  # the rendezvous ends with the launcher's last agent
    if any(w.killed for w in watched):
        return 128 + signal.SIGTERM
    return exit_code([q.returncode for q in procs])
