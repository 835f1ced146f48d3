"""Distribution: the mesh, collectives with names (``comm``) and the checks around them,
and gathering of sharded state."""

from fzero.distributed.gather import gather
from fzero.distributed.mesh import Mesh

__all__ = ["Mesh", "gather"]
