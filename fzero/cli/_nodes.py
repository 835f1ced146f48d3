"""What ``fzero launch`` and its elastic jobs share: the error, a torchrun agent to start
(:class:`Node`), and the defaults of where it runs."""

from __future__ import annotations

import dataclasses
import shlex
import socket

__all__ = ["DEFAULT_MULTINODE_PORT", "LaunchError", "Node", "default_nproc", "free_port"]

DEFAULT_MULTINODE_PORT = 29500  # torchrun's own default; a free local port means nothing remotely


class LaunchError(ValueError):
    """Bad ``fzero launch`` input; reported as ``fzero launch: error: ...``, exit code 2."""


@dataclasses.dataclass
class Node:
    """One torchrun agent: where it runs, the variables it adds, its argv."""

    host: str | None  # None: this machine
    node_rank: int
    nproc: int
    env: dict[str, str]  # added to the environment (env file, CUDA_VISIBLE_DEVICES)
    argv: list[str]

    def shell(self, *, cwd: str | None = None) -> str:
        """This node's command as one shell line: ``[cd CWD &&] [env K=V ...] python -m ...``."""
        env = ["env", *(f"{k}={v}" for k, v in self.env.items())] if self.env else []
        line = shlex.join(env + self.argv)
        return f"cd {shlex.quote(cwd)} && {line}" if cwd else line


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_nproc() -> int:
    """Ranks per node when none is given: one per visible GPU, else one."""
    import torch

    return torch.cuda.device_count() or 1
