"""``fzero launch``: hostfile and filter parsing (property tests), env files, the torchrun
command lines built, and real torchrun runs: one node with two ranks, two "nodes" on
localhost, two hosts over (a stand-in for) ssh, and a restart."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import stat
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fzero.cli import launch
from fzero.cli.hostfile import HostfileError, parse_filter, parse_hostfile, read_hostfile, select_slots
from fzero.cli.launch import LaunchError, find_env_file, parse_env_file
from fzero.cli.main import build_parser, main
from harness.commands import run_command


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """No ~/.fzero_env or ./.fzero_env of the developer's leaks into a test."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)


# --------------------------------------------------------------------------- hostfiles

hostnames = st.builds(str.__add__, st.sampled_from("abcdefghijklmnopqrstuvwxyz"),
                      st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789.-", max_size=12))
host_tables = st.dictionaries(hostnames, st.integers(1, 64), min_size=1, max_size=8)
spaces = st.sampled_from([" ", "\t", "  ", " \t "])
padding = st.sampled_from(["", " ", "\t", "  "])
comment_text = st.text(alphabet="abc XYZ 019=:@,#slots", max_size=20)


@st.composite
def noise_lines(draw):
    """Blank lines and comment lines, as people leave them in hostfiles."""
    kinds = draw(st.lists(st.sampled_from(["blank", "comment"]), max_size=2))
    return [draw(padding) if k == "blank" else draw(padding) + "#" + draw(comment_text) for k in kinds]


@st.composite
def rendered_hostfiles(draw):
    hosts = draw(host_tables)
    lines = []
    for host, n in hosts.items():
        lines += draw(noise_lines())
        tail = draw(st.one_of(st.just(""), comment_text.map(lambda c: " #" + c)))
        lines.append(f"{draw(padding)}{host}{draw(spaces)}slots={n}{draw(padding)}{tail}")
    lines += draw(noise_lines())
    return hosts, lines


@settings(max_examples=100, deadline=None)
@given(rendered_hostfiles())
def test_hostfile_round_trip(case):
    hosts, lines = case
    parsed = parse_hostfile("\n".join(lines))
    assert parsed == hosts
    assert list(parsed) == list(hosts)  # file order is node-rank order


BAD_LINES = [
    ("w9", "expected 'HOST slots=N'"),
    ("w9 slots=", "positive integer"),
    ("w9 slots=0", "positive integer"),
    ("w9 slots=-2", "positive integer"),
    ("w9 slots=two", "positive integer"),
    ("w9 slots=2 extra", "expected 'HOST slots=N'"),
    ("w9 slots = 2", "expected 'HOST slots=N'"),
    ("w9 gpus=2", "expected 'HOST slots=N'"),
    ("w@9 slots=2", "reserve"),
    ("w9:0 slots=2", "reserve"),
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rendered_hostfiles(), st.sampled_from(BAD_LINES), st.data())
def test_malformed_line_is_named(case, bad, data):
    _, lines = case
    at = data.draw(st.integers(0, len(lines)))
    lines = lines[:at] + [bad[0]] + lines[at:]
    with pytest.raises(HostfileError, match=rf"hosts\.txt line {at + 1}: .*{bad[1]}"):
        parse_hostfile("\n".join(lines), source="hosts.txt")


def test_hostfile_duplicates_and_empty(tmp_path):
    with pytest.raises(HostfileError, match=r"line 4: host 'w0' is listed twice \(first on line 2\)"):
        parse_hostfile("# x\nw0 slots=2\nw1 slots=2\nw0 slots=4\n")
    with pytest.raises(HostfileError, match="no hosts"):
        parse_hostfile("# only a comment\n\n")
    f = tmp_path / "hosts"
    f.write_text("w0 slots=2\nw1 slots=x\n")
    with pytest.raises(HostfileError, match=rf"hostfile '{f}' line 2: .*'w1'"):
        read_hostfile(f)
    with pytest.raises(HostfileError, match="cannot be read"):
        read_hostfile(tmp_path / "missing")


# --------------------------------------------------------------------------- filters


@st.composite
def selections(draw, hosts):
    """A subset of each host's slots: none, all, or some."""
    sel = {}
    for host, n in hosts.items():
        kind = draw(st.sampled_from(["none", "all", "some"]))
        if kind == "all":
            sel[host] = set(range(n))
        elif kind == "some":
            sel[host] = set(draw(st.lists(st.integers(0, n - 1), min_size=1, unique=True)))
        else:
            sel[host] = set()
    return sel


@st.composite
def render_filter(draw, hosts, sel):
    """DeepSpeed syntax for ``sel``: mentions in any order, a host possibly split over
    several mentions, a whole host sometimes written bare and sometimes slot by slot."""
    mentions = []
    for host, slots in sel.items():
        if not slots:
            continue
        if slots == set(range(hosts[host])) and draw(st.booleans()):
            mentions.append(host)
            if draw(st.booleans()):  # a bare mention plus a redundant partial one: still all
                mentions.append(f"{host}:{min(slots)}")
            continue
        ordered = draw(st.permutations(sorted(slots)))
        cuts = sorted(draw(st.sets(st.integers(1, max(1, len(ordered) - 1)), max_size=2)))
        chunks = [ordered[a:b] for a, b in zip([0, *cuts], [*cuts, len(ordered)]) if ordered[a:b]]
        mentions += [f"{host}:" + ",".join(map(str, c)) for c in chunks]
    return "@".join(draw(st.permutations(mentions)))


def _draw_selection(data):
    """A host table, a selection of its slots (at least one) and a filter string naming it."""
    hosts = data.draw(host_tables)
    sel = data.draw(selections(hosts))
    if not any(sel.values()):
        sel[next(iter(hosts))] = {0}
    return hosts, sel, data.draw(render_filter(hosts, sel))


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_include_selects_exactly(data):
    hosts, sel, spec = _draw_selection(data)
    got = select_slots(hosts, include=spec)
    assert got == {h: sorted(s) for h, s in sel.items() if s}
    assert list(got) == [h for h in hosts if sel[h]]  # hostfile order, not mention order


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_exclude_removes_exactly(data):
    hosts, sel, spec = _draw_selection(data)
    left = {h: [s for s in range(n) if s not in sel[h]] for h, n in hosts.items()}
    left = {h: s for h, s in left.items() if s}
    if not left:
        with pytest.raises(HostfileError, match="leaves no slot"):
            select_slots(hosts, exclude=spec)
    else:
        assert select_slots(hosts, exclude=spec) == left


@settings(max_examples=50, deadline=None)
@given(host_tables, hostnames, st.data())
def test_unknown_host_or_slot_is_named(hosts, stranger, data):
    option = data.draw(st.sampled_from(["include", "exclude"]))
    known = data.draw(st.sampled_from(sorted(hosts)))
    if stranger not in hosts:
        with pytest.raises(HostfileError, match=f"host '{stranger}' is not in the hostfile"):
            select_slots(hosts, **{option: f"{known}@{stranger}"})
    slot = hosts[known] + data.draw(st.integers(0, 5))
    with pytest.raises(HostfileError, match=f"host '{known}' has no slot {slot}"):
        select_slots(hosts, **{option: f"{known}:0,{slot}"})


@pytest.mark.parametrize("spec, msg", [
    ("w0@", "empty node spec"),
    ("@w0", "empty node spec"),
    ("w0@@w1", "empty node spec"),
    ("w0:", "slot '' of host 'w0'"),
    ("w0:0,,1", "slot '' of host 'w0'"),
    ("w0:a", "slot 'a' of host 'w0'"),
    ("w0:-1", "slot '-1' of host 'w0'"),
    (":0", "has no host name"),
])
def test_malformed_filter(spec, msg):
    with pytest.raises(HostfileError, match=msg):
        select_slots({"w0": 4, "w1": 4}, include=spec)


def test_filter_examples():
    hosts = {"worker-2": 4, "worker-3": 2, "worker-4": 2}
    assert select_slots(hosts, include="worker-2:0,1@worker-3") == {"worker-2": [0, 1], "worker-3": [0, 1]}
    assert select_slots(hosts, exclude="worker-2:0,1@worker-3") == {"worker-2": [2, 3], "worker-4": [0, 1]}
    assert select_slots(hosts) == {"worker-2": [0, 1, 2, 3], "worker-3": [0, 1], "worker-4": [0, 1]}
    assert parse_filter("a:1@a@b:2") == {"a": None, "b": {2}}
    with pytest.raises(HostfileError, match="mutually exclusive"):
        select_slots(hosts, include="worker-2", exclude="worker-3")


# --------------------------------------------------------------------------- env files


def test_env_file_parsing():
    text = "# comment\n\nNCCL_DEBUG=INFO\n  export  PATHISH=/a:/b  \nQ='a b'\nD=\"x#y\"\nEMPTY=\nEQ=a=b\n"
    assert parse_env_file(text) == {
        "NCCL_DEBUG": "INFO", "PATHISH": "/a:/b", "Q": "a b", "D": "x#y", "EMPTY": "", "EQ": "a=b",
    }
    for bad, line in [("A=1\nnot a pair\n", 2), ("\n\n1A=2", 3), ("A B=1", 1), ("=1", 1)]:
        with pytest.raises(LaunchError, match=rf"env file my\.env line {line}: expected KEY=VALUE"):
            parse_env_file(bad, source="my.env")


def test_env_file_search_order(tmp_path):
    home = Path(os.environ["HOME"])
    assert find_env_file() is None
    (home / ".fzero_env").write_text("WHERE=home\n")
    assert find_env_file() == home / ".fzero_env"
    (tmp_path / ".fzero_env").write_text("WHERE=cwd\n")
    assert find_env_file() == tmp_path / ".fzero_env"
    p = _plan("--nproc", "1", "t.py")
    assert p.nodes[0].env == {"WHERE": "cwd"}
    other = tmp_path / "other.env"
    other.write_text("WHERE=explicit\n")
    assert _plan("--nproc", "1", "--env-file", str(other), "t.py").nodes[0].env == {"WHERE": "explicit"}
    (tmp_path / ".fzero_env").write_text("WHERE=cwd\nbroken line\n")
    with pytest.raises(LaunchError, match=r"\.fzero_env line 2"):
        _plan("--nproc", "1", "t.py")


# --------------------------------------------------------------------------- command lines


def _args(*argv):
    return build_parser().parse_args(["launch", *argv])


def _plan(*argv, env=None):
    return launch.plan(_args(*argv), env=env)


def _opt(argv, name):
    return argv[argv.index(name) + 1]


def test_single_node_command():
    p = _plan("--nproc", "2", "--max-restarts", "3", "train.py", "--flag", "x", "--nproc", "7", "-h", env={})
    (n,) = p.nodes
    assert not p.multinode and n.host is None and n.env == {}
    assert n.argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert _opt(n.argv, "--nproc-per-node") == "2"
    assert _opt(n.argv, "--nnodes") == "1" and _opt(n.argv, "--node-rank") == "0"
    assert _opt(n.argv, "--master-addr") == "127.0.0.1"
    assert _opt(n.argv, "--max-restarts") == "3"
    port = int(_opt(n.argv, "--master-port"))
    assert 0 < port < 65536
    # everything after the script is the script's, launcher-looking options included
    assert n.argv[n.argv.index("train.py"):] == ["train.py", "--flag", "x", "--nproc", "7", "-h"]


def test_agent_of_one_node_among_several():
    p = _plan("--nnodes", "2", "--node-rank", "1", "--nproc", "4", "--master-addr", "10.1.2.3",
              "--master-port", "6000", "t.py", env={"A": "1"})
    (n,) = p.nodes
    assert not p.multinode
    assert [_opt(n.argv, o) for o in ("--nnodes", "--node-rank", "--nproc-per-node", "--master-addr",
                                      "--master-port")] == ["2", "1", "4", "10.1.2.3", "6000"]
    assert n.shell() == "env A=1 " + " ".join(n.argv)
    assert int(_opt(_plan("--nnodes", "2", "--node-rank", "0", "--nproc", "1", "--master-addr", "h",
                          "t.py", env={}).nodes[0].argv, "--master-port")) == launch.DEFAULT_MULTINODE_PORT


def test_include_on_one_node_sets_visible_devices():
    (n,) = _plan("--nproc", "4", "--include", "localhost:1,3", "t.py", env={}).nodes
    assert _opt(n.argv, "--nproc-per-node") == "2"
    assert n.env == {"CUDA_VISIBLE_DEVICES": "1,3"}
    (n,) = _plan("--nproc", "4", "--exclude", "localhost:3", "t.py", env={}).nodes
    assert _opt(n.argv, "--nproc-per-node") == "3" and n.env == {}  # slots 0-2: nothing to hide


def test_hostfile_multinode_commands(tmp_path):
    (tmp_path / "hosts").write_text("# cluster\nw0 slots=4\nw1 slots=4\nw2 slots=2  # small\n")
    p = _plan("--hostfile", "hosts", "--include", "w2@w1:0,2", "t.py", "--lr", "1", env={"K": "v"})
    assert p.multinode and p.world_size == 4 and p.master_addr == "w1"
    assert [n.host for n in p.nodes] == ["w1", "w2"]  # hostfile order
    for rank, n in enumerate(p.nodes):
        assert _opt(n.argv, "--node-rank") == str(rank)
        assert _opt(n.argv, "--nnodes") == "2"
        assert _opt(n.argv, "--master-addr") == "w1"
        assert _opt(n.argv, "--master-port") == str(launch.DEFAULT_MULTINODE_PORT)
        assert n.argv[-3:] == ["t.py", "--lr", "1"]
    assert _opt(p.nodes[0].argv, "--nproc-per-node") == "2"
    assert p.nodes[0].env == {"K": "v", "CUDA_VISIBLE_DEVICES": "0,2"}
    assert _opt(p.nodes[1].argv, "--nproc-per-node") == "2"
    assert p.nodes[1].env == {"K": "v"}

    p = _plan("--hostfile", "hosts", "--nproc", "2", "--nnodes", "2", "--master-addr", "10.0.0.9",
              "--master-port", "7000", "t.py", env={})
    assert [n.host for n in p.nodes] == ["w0", "w1"]
    assert {_opt(n.argv, "--nproc-per-node") for n in p.nodes} == {"2"}
    assert {_opt(n.argv, "--master-addr") for n in p.nodes} == {"10.0.0.9"}

    # a hostfile selecting one host runs here, as DeepSpeed does
    p = _plan("--hostfile", "hosts", "--include", "w2", "t.py", env={})
    assert not p.multinode and _opt(p.nodes[0].argv, "--nproc-per-node") == "2"
    assert _opt(p.nodes[0].argv, "--master-addr") == "127.0.0.1"
    # ... unless --ssh asks to run it on that host
    p = _plan("--hostfile", "hosts", "--include", "w2", "--ssh", "t.py", env={})
    assert p.multinode and p.nodes[0].host == "w2" and p.master_addr == "w2"
    assert p.master_port == launch.DEFAULT_MULTINODE_PORT
    # --node-rank with a hostfile: this machine is that host
    p = _plan("--hostfile", "hosts", "--node-rank", "2", "t.py", env={})
    (n,) = p.nodes
    assert not p.multinode and _opt(n.argv, "--node-rank") == "2" and _opt(n.argv, "--nproc-per-node") == "2"
    assert _opt(n.argv, "--master-addr") == "w0" and _opt(n.argv, "--nnodes") == "3"


def test_remote_command_quotes_and_exports(tmp_path):
    (tmp_path / "hosts").write_text("w0 slots=1\nw1 slots=1\n")
    p = _plan("--hostfile", "hosts", "--ssh", "t.py", "it's", env={"MSG": "a b"})
    cmd = launch.remote_command(p.nodes[1], cwd="/data/my run", forward={"NCCL_DEBUG": "INFO", "MSG": "old"})
    assert cmd.startswith("cd '/data/my run' && exec env NCCL_DEBUG=INFO 'MSG=a b' ")
    argv = shlex.split(cmd.split(" && ", 1)[1])
    assert argv[argv.index("t.py"):] == ["t.py", "it's"]
    assert _opt(argv, "--node-rank") == "1"


@pytest.mark.parametrize("argv, msg", [
    (["--ssh", "t.py"], "--ssh needs --hostfile"),
    (["--nnodes", "2", "t.py"], "--nnodes 2 needs --master-addr"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "t.py"], "--node-rank 2 is out of range"),
    (["--nproc", "0", "t.py"], "--nproc must be a positive integer"),
    (["--max-restarts", "-1", "t.py"], "--max-restarts must be >= 0"),
    (["--hostfile", "hosts", "--nproc", "2", "--include", "w0", "t.py"], "--nproc cannot be combined"),
    (["--hostfile", "hosts", "--nproc", "3", "t.py"], "--nproc 3 exceeds the 2 slots of host 'w1'"),
    (["--hostfile", "hosts", "--nnodes", "3", "t.py"], "--nnodes 3 but the hostfile selects only 2"),
    (["--hostfile", "hosts", "--include", "w7", "t.py"], "host 'w7' is not in the hostfile"),
    (["--hostfile", "hosts", "--exclude", "w1:2", "t.py"], "host 'w1' has no slot 2"),
    (["--hostfile", "nowhere", "t.py"], "hostfile 'nowhere' cannot be read"),
    (["--nproc", "1", "missing.py"], "script 'missing.py' does not exist"),
])
def test_cli_errors_exit_2(tmp_path, capsys, argv, msg):
    (tmp_path / "hosts").write_text("w0 slots=4\nw1 slots=2\n")
    with pytest.raises(SystemExit) as e:
        main(["launch", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert any(line.startswith("fzero launch: error: ") and msg in line for line in err.splitlines()), err


def test_dry_run_prints(tmp_path, capsys):
    (tmp_path / ".fzero_env").write_text("FZ=1\n")
    assert main(["launch", "--nproc", "2", "--dry-run", "t.py", "--flag", "x"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("env FZ=1 ") and "torch.distributed.run" in out and out.endswith("t.py --flag x")

    (tmp_path / "hosts").write_text("w0 slots=2\nw1 slots=2\n")
    assert main(["launch", "--hostfile", "hosts", "t.py"]) == 0  # several hosts, no --ssh: print
    cmds = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    assert len(cmds) == 2 and all(c.startswith(f"cd {tmp_path} && env FZ=1 ") for c in cmds)
    assert "--node-rank 0" in cmds[0] and "--node-rank 1" in cmds[1]

    assert main(["launch", "--hostfile", "hosts", "--ssh", "--ssh-port", "2222", "--dry-run", "t.py"]) == 0
    cmds = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    assert cmds[0].startswith("ssh -p 2222 w0 ") and cmds[1].startswith("ssh -p 2222 w1 ")

    assert main(["launch", "--nnodes", "3", "--master-addr", "n0", "--nproc", "1", "t.py"]) == 0
    cmds = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    assert [f"--node-rank {r}" in c for r, c in enumerate(cmds)] == [True] * 3


def test_local_run_returns_exit_code():
    assert launch._run_local(["sh", "-c", "exit 5"], dict(os.environ)) == 5
    assert launch._run_local(["sh", "-c", "kill -TERM $$"], dict(os.environ)) == 128 + signal.SIGTERM


def test_ssh_runs_propagate_first_failure():
    t0 = time.monotonic()
    assert launch._run_ssh([["sh", "-c", "sleep 60"], ["sh", "-c", "exit 3"]]) == 3
    assert time.monotonic() - t0 < 30  # the sleeper was stopped, not waited for
    assert launch._run_ssh([["true"], ["sh", "-c", "exit 0"]]) == 0


# --------------------------------------------------------------------------- real runs

SCRIPT = """
import json, os, sys

if os.environ.get("FAIL_FIRST") and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    sys.exit(3)  # the first attempt dies; torchrun restarts the group if allowed

import torch
import torch.distributed as dist
import fzero

mesh = fzero.Mesh(dp=-1)
t = torch.tensor([float(mesh.rank + 1)])
if dist.is_initialized():
    dist.all_reduce(t)
out = sys.argv[sys.argv.index("--out") + 1]
with open(os.path.join(out, f"rank{mesh.rank}.json"), "w") as f:
    json.dump({"rank": mesh.rank, "world": mesh.world_size, "sum": t.item(), "argv": sys.argv[1:],
               "var": os.environ.get("FZ_TEST_VAR"), "local_world": os.environ.get("LOCAL_WORLD_SIZE"),
               "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT")}, f)
if dist.is_initialized():
    dist.destroy_process_group()
"""


def _fzero() -> list[str]:
    exe = Path(sys.executable).with_name("fzero")  # the console script, when installed
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "fzero.cli.main"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_all(cmds, *, cwd, env=None, timeout=120):
    """Start every command at once; wait for all; kill each, and every rank it started
    (torchrun's ranks run in sessions of their own), when it ends or times out."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(cmds)) as pool:
        done = list(pool.map(lambda c: run_command(c, cwd=cwd, env=env, timeout_s=timeout), cmds))
    if any(d.timed_out for d in done):
        pytest.fail(f"fzero launch did not finish in {timeout} s\n" + "\n".join(d.output for d in done))
    return [(d.returncode, d.output) for d in done]


def _results(out: Path):
    return sorted((json.loads(f.read_text()) for f in out.glob("rank*.json")), key=lambda r: r["rank"])


@pytest.fixture
def job(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    (tmp_path / "out").mkdir()
    (tmp_path / "job.env").write_text("# for every rank\nexport FZ_TEST_VAR='from env file'\n")
    return tmp_path


@pytest.mark.slow
@pytest.mark.multirank
def test_real_single_node_two_ranks(job):
    [(rc, log)] = _run_all([_fzero() + ["launch", "--nproc", "2", "--env-file", "job.env",
                                        "job.py", "--out", "out", "--flag", "x"]], cwd=job)
    assert rc == 0, log
    res = _results(job / "out")
    assert [r["rank"] for r in res] == [0, 1]
    for r in res:
        assert r["world"] == 2 and r["sum"] == 3.0
        assert r["var"] == "from env file"
        assert r["argv"] == ["--out", "out", "--flag", "x"]


@pytest.mark.slow
@pytest.mark.multirank
def test_real_two_node_rendezvous_on_localhost(job):
    port = str(_free_port())
    cmds = [_fzero() + ["launch", "--nnodes", "2", "--node-rank", str(r), "--nproc", "1",
                        "--master-addr", "127.0.0.1", "--master-port", port, "--env-file", "job.env",
                        "job.py", "--out", "out"] for r in (0, 1)]
    runs = _run_all(cmds, cwd=job)
    assert [rc for rc, _ in runs] == [0, 0], "\n".join(log for _, log in runs)
    res = _results(job / "out")
    assert [(r["rank"], r["world"], r["sum"]) for r in res] == [(0, 2, 3.0), (1, 2, 3.0)]


@pytest.mark.slow
@pytest.mark.multirank
def test_real_ssh_launch_with_unequal_slots(job):
    """Two hosts over ssh, 2 + 1 slots: torchrun agents with different --nproc-per-node
    form one world of 3. ``ssh`` is a stand-in that runs the remote command here."""
    bin_dir = job / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text('#!/bin/sh\n# stand-in ssh: drop options and the host, run the command locally\n'
                   'while [ $# -gt 0 ]; do case "$1" in -p|-o) shift 2;; -*) shift;; *) break;; esac; done\n'
                   'shift\nexec /bin/sh -c "$*"\n')
    ssh.chmod(ssh.stat().st_mode | stat.S_IEXEC)
    (job / "hosts").write_text("# two 'machines'\nbox-a slots=4\nbox-b slots=1\n")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FZERO_TIMEOUT": "60"}
    [(rc, log)] = _run_all([_fzero() + ["launch", "--hostfile", "hosts", "--include", "box-a:0,1@box-b", "--ssh",
                                        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                                        "--env-file", "job.env", "job.py", "--out", "out"]], cwd=job, env=env)
    assert rc == 0, log
    res = _results(job / "out")
    assert [(r["rank"], r["world"], r["sum"]) for r in res] == [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]
    assert [r["local_world"] for r in res] == ["2", "2", "1"]
    assert {r["var"] for r in res} == {"from env file"}


@pytest.mark.slow
@pytest.mark.multirank
def test_real_restart_after_failure(job):
    env = {**os.environ, "FAIL_FIRST": "1"}
    [(rc, log)] = _run_all([_fzero() + ["launch", "--nproc", "1", "--max-restarts", "1", "job.py", "--out", "out"]],
                           cwd=job, env=env)
    assert rc == 0, log
    (r,) = _results(job / "out")
    assert r["restart"] == "1" and r["world"] == 1
