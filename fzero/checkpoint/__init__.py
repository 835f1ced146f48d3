"""``fzero.checkpoint``: sharded, pickle-free, atomic checkpoints that load at any world size.

* :func:`save` -- every rank writes what it owns, in parallel (safetensors + a JSON
  manifest); one atomic commit; optionally asynchronous; retention with ``keep=``.
* :func:`load` -- onto the current mesh, whatever world size, ZeRO stage, pipeline and
  ``tp`` split it was saved with (ranks may hold different trees: each pipeline stage its
  own parameters; a tensor-parallel rank its slices); checksums verified; no code ever runs
  on load.
* :func:`latest` -- the newest committed checkpoint in a directory (with ``verify=True``, the
  newest intact one: damaged ones are passed over with a :class:`CorruptCheckpointWarning`).
* :func:`export` -- the parameters, whole, in one safetensors file for ``load_state_dict``.
* :func:`verify`, :func:`metadata`, :func:`manifest` -- read-only helpers (and the
  ``fzero checkpoint inspect|verify|export PATH`` command).

See docs/checkpoints.md for the format and the guarantees.

Example:
    >>> import tempfile, torch, fzero, fzero.checkpoint as ckpt
    >>> apply, params = fzero.functionalize(torch.nn.Linear(2, 1))
    >>> state = fzero.TrainState.create(apply_fn=apply, params=params, tx=fzero.optim.adam(1e-3))
    >>> tmp = tempfile.TemporaryDirectory(); root = tmp.name
    >>> _ = ckpt.save(f"{root}/step_0", state, metadata={"loader": {"epoch": 0, "index": 0}})
    >>> restored = ckpt.load(ckpt.latest(root), like=state)
    >>> torch.equal(restored.params["weight"], state.params["weight"])
    True
"""

from fzero.checkpoint._export import export
from fzero.checkpoint._format import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    CorruptCheckpointWarning,
    Progress,
)
from fzero.checkpoint._load import load, manifest, metadata, verify
from fzero.checkpoint._save import SaveHandle, latest, save

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "CorruptCheckpointWarning",
    "Progress",
    "SaveHandle",
    "export",
    "latest",
    "load",
    "manifest",
    "metadata",
    "save",
    "verify",
]
