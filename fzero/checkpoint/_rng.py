"""Every rank's random number generator states, without pickle.

torch's CPU and CUDA states are uint8 tensors: they go into the rank's data file. Python's
``random`` state is a tuple of ints and numpy's legacy global state an array of uint32 and
a few numbers: both go into the manifest as JSON.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["capture", "restore"]


def capture() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, json_states)`` of this process's generators."""
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    version, internal, gauss = random.getstate()
    states: dict[str, Any] = {"python": {"version": version, "state": list(internal), "gauss_next": gauss}}
    try:
        import numpy as np
    except ImportError:  # numpy is optional at run time
        pass
    else:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        states["numpy"] = {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos),
                           "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return tensors, states


def restore(tensors: dict[str, torch.Tensor], states: dict[str, Any]) -> None:
    """Set this process's generators from :func:`capture`'s output (as saved)."""
    if "rng.torch" in tensors:
        torch.set_rng_state(tensors["rng.torch"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("rng.cuda.")),
                                       key=lambda k: int(k.rsplit(".", 1)[1]))]
    if cuda and torch.cuda.is_available():
        for i, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)
    py = states.get("python")
    if py is not None:
        random.setstate((py["version"], tuple(int(x) for x in py["state"]), py["gauss_next"]))
    npy = states.get("numpy")
    if npy is not None:
        try:
            import numpy as np
        except ImportError:
            return
        np.random.set_state((npy["kind"], np.asarray(npy["keys"], dtype=np.uint32), npy["pos"],
                             npy["has_gauss"], npy["cached_gaussian"]))
