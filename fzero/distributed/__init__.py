"""Distribution: the mesh, collectives with names (``comm``) and the checks around them,
and gathering of sharded state."""

import importlib
import importlib.util

from fzero.distributed.gather import gather
from fzero.distributed.mesh import Mesh

__all__ = ["Mesh", "gather"]


def __getattr__(name: str):
    """A submodule read as an attribute (``fzero.distributed.comm``) is imported then, as it
    was when ``import fzero`` imported the whole package."""
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'fzero.distributed' has no attribute {name!r}")
