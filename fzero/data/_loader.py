"""``DataLoader``: torch's ``DataLoader`` over a :class:`GlobalBatchSampler`, with a position.

The loading itself (workers, collation, pinning) is ``torch.utils.data.DataLoader``'s; this
class decides which indices each rank loads and remembers how many global batches it has
handed out, so a checkpoint can carry that position and a resumed run go on with exactly the
batches the uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.data

from fzero.data._sampler import GlobalBatchSampler, check_int

__all__ = ["DataLoader"]

WHERE = "fzero.data.DataLoader"

# torch.utils.data.DataLoader's arguments that this loader decides itself.
_OWNED = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "generator")

# What must be equal for a saved position to mean the same samples here.
_IDENTITY = ("seed", "global_batch_size", "dataset_length", "shuffle", "drop_last")
_POSITION = ("epoch", "batch")


class DataLoader:
    """A distributed, deterministic, resumable loader over a map-style dataset.

    Each step's *global batch* of ``B`` samples is the same whatever the world size: epoch
    ``e``'s order is ``torch.randperm(len(dataset))`` under a generator seeded with
    ``seed + e``, and the global batches are consecutive runs of ``B`` indices of it. Data-parallel
    rank ``r`` of ``N`` gets rows ``[r*B/N, (r+1)*B/N)`` of each global batch, so the
    ranks' local batches concatenated in rank order are the batch one process with the same
    ``B`` gets. Ranks of one ``dp`` coordinate (different ``tp`` or ``pp`` coordinates) get
    the same batch. See :class:`GlobalBatchSampler`.

    ``for batch in loader`` runs the rest of the current epoch; the next ``for`` starts the
    next epoch, reshuffled. A batch counts as consumed when it is handed out, so
    :meth:`state_dict`, taken after a step, is where a resumed run must go on.
    :meth:`load_state_dict` sets the position; the next iteration skips the consumed
    batches without loading them.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``).
        batch_size: the global batch size ``B`` (samples per step over all ``dp`` ranks);
            or give ``config``.
        config: DeepSpeed's ``training_data`` path: a config (dict, JSON path, or
            :class:`fzero.Config`) resolved for the mesh's ``dp`` size gives ``B``
            (``train_batch_size``) and the local batch (``micro * gradient_accumulation_steps``,
            the batch a compiled step takes); its ``dataloader_drop_last`` gives ``drop_last``.
        mesh: the :class:`fzero.Mesh` whose ``dp`` axis the batches are split over (default
            ``fzero.Mesh(dp=-1)``: every rank is a data-parallel rank).
        seed: the shuffle seed.
        shuffle: reshuffle every epoch; ``False`` keeps the dataset's order.
        drop_last: drop a short last global batch (default ``True``; with ``config``, its
            ``dataloader_drop_last`` if written). ``False`` keeps it when it splits evenly
            over the ``dp`` ranks and raises otherwise (a step whose ranks hold different
            numbers of samples would weight them unevenly).
        **kwargs: passed to ``torch.utils.data.DataLoader``: ``num_workers``,
            ``collate_fn``, ``pin_memory``, ``worker_init_fn``, ``prefetch_factor``,
            ``persistent_workers``, ``timeout``, ... The order never depends on them; workers' seeds come
            from a generator of the loader's own, seeded by ``(seed, epoch)``, so iterating never
            draws from torch's global RNG.

    Raises:
        TypeError: ``dataset`` has no length or is iterable-style; an option of the wrong type.
        ValueError: neither or contradicting ``batch_size`` and ``config``; a contradicting
            ``drop_last``; a keyword this loader decides itself (``sampler``, ``shuffle`` of
            torch's, ...); and :class:`GlobalBatchSampler`'s checks.

    Example:
        >>> import torch, fzero
        >>> from fzero.data import DataLoader
        >>> data = torch.utils.data.TensorDataset(torch.arange(10.0))
        >>> loader = DataLoader(data, batch_size=4, seed=0)
        >>> [b[0].tolist() for b in loader]
        [[4.0, 1.0, 7.0, 5.0], [3.0, 9.0, 0.0, 8.0]]
        >>> loader.state_dict()["epoch"], loader.state_dict()["batch"]
        (1, 0)
    """

    def __init__(self, dataset: Any, batch_size: int | None = None, *, config: Any = None, mesh: Any = None,
                 seed: int = 0, shuffle: bool = True, drop_last: bool | None = None, **kwargs):
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
            raise TypeError(f"{WHERE}: dataset must be map-style (with __getitem__ and __len__), got "
                            f"{type(dataset).__name__}")
        try:
            length = len(dataset)
        except TypeError:
            raise TypeError(f"{WHERE}: dataset must have a length (__len__), got {type(dataset).__name__}") from None
        owned = [k for k in _OWNED if k in kwargs]
        if owned:
            raise ValueError(f"{WHERE}: {', '.join(owned)} {'is' if len(owned) == 1 else 'are'} decided by "
                             "fzero's loader, not passed to torch's DataLoader; use batch_size= (the global "
                             "batch), shuffle=, seed=, drop_last=")
        if mesh is None:
            from fzero.distributed.mesh import Mesh

            mesh = Mesh(dp=-1)
        elif not (hasattr(mesh, "coords") and hasattr(mesh, "size")):
            raise TypeError(f"{WHERE}: mesh must be an fzero.Mesh, got {type(mesh).__name__}")
        dp_size, dp_rank = mesh.size("dp"), mesh.coords["dp"]
        batch_size, drop_last = _from_config(config, batch_size, drop_last, dp_size)
        self.sampler = GlobalBatchSampler(length, check_int(WHERE, "batch_size", batch_size, 1),
                                          dp_size=dp_size, dp_rank=dp_rank, seed=seed, shuffle=shuffle,
                                          drop_last=True if drop_last is None else drop_last)
        self.dataset = dataset
        self.mesh = mesh
        self._generator = torch.Generator()
        self._loader = torch.utils.data.DataLoader(dataset, batch_sampler=self.sampler, generator=self._generator,
                                                   **kwargs)
        self._epoch, self._batch = 0, 0
        self._iteration = 0  # which iterator is current: an older one stops

    # ------------------------------------------------------------------ sizes

    @property
    def global_batch_size(self) -> int:
        """Samples per step over all data-parallel ranks."""
        return self.sampler.global_batch_size

    @property
    def local_batch_size(self) -> int:
        """Samples per step on this rank: ``global_batch_size // dp size``."""
        return self.sampler.global_batch_size // self.sampler.dp_size

    @property
    def epoch(self) -> int:
        """The epoch being iterated (or next to be, between epochs)."""
        return self._epoch

    def __len__(self) -> int:
        """Global batches per epoch (every rank gets one local batch of each)."""
        return self.sampler.batches_per_epoch

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        """The rest of the current epoch's local batches; then the position moves to the next epoch.

        A new ``iter(loader)`` supersedes the previous one, which then raises ``RuntimeError``.
        """
        self._iteration += 1
        return self._run(self._iteration)

    def _run(self, iteration: int) -> Iterator[Any]:
        epoch, start = self._epoch, self._batch
        if start == len(self):  # positioned after an epoch's last batch: that epoch is over
            epoch, start = epoch + 1, 0
            self._epoch, self._batch = epoch, start
        self.sampler.set_epoch(epoch, start)
        # torch's DataLoader draws its workers' base seed from this generator when an
        # iterator is made; a fixed seed per epoch keeps it off torch's global RNG.
        self._generator.manual_seed((self.sampler.seed * 1_000_003 + epoch) % 2**63)
        for batch in self._loader:
            if iteration != self._iteration:
                raise RuntimeError(f"{WHERE}: this iterator was superseded by a newer iter(loader); "
                                   "iterate the newest one")
            self._batch += 1  # handed out = consumed: a state_dict taken now resumes after it
            yield batch
        if iteration == self._iteration:
            self._epoch, self._batch = epoch + 1, 0

    # ------------------------------------------------------------------ position

    def state_dict(self) -> dict[str, int | bool]:
        """The position, as plain ints and bools: JSON, ``fzero.checkpoint.save(metadata=)`` ready.

        ``epoch`` and ``batch`` (global batches of that epoch handed out) say where to go on;
        ``seed``, ``global_batch_size``, ``dataset_length``, ``shuffle`` and ``drop_last``
        say what the position means, and :meth:`load_state_dict` checks them. The world size
        is not part of it: a position counts global batches.
        """
        epoch, batch = self._epoch, self._batch
        if batch == len(self):
            epoch, batch = epoch + 1, 0
        s = self.sampler
        return {"epoch": epoch, "batch": batch, "seed": s.seed, "global_batch_size": s.global_batch_size,
                "dataset_length": s.dataset_length, "shuffle": s.shuffle, "drop_last": s.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Go on from a position :meth:`state_dict` returned (in this or another process, at any
        world size with the same global batch size).

        Raises:
            TypeError: ``state`` is not a dict, or a value has the wrong type (named).
            ValueError: keys missing or unknown, or a saved ``seed``, ``global_batch_size``,
                ``dataset_length``, ``shuffle`` or ``drop_last`` that differs from this
                loader's (every difference named, saved and current values), or a ``batch``
                past the epoch's end.
        """
        where = WHERE + ".load_state_dict"
        if not isinstance(state, dict):
            raise TypeError(f"{where}: expected the dict state_dict() returned, got {type(state).__name__}")
        expected = _POSITION + _IDENTITY
        missing = [k for k in expected if k not in state]
        unknown = sorted(str(k) for k in state if k not in expected)
        if missing or unknown:
            raise ValueError(f"{where}: the position's keys differ from state_dict()'s: "
                             + "; ".join(f"{what}: {', '.join(ks)}" for what, ks in
                                         (("missing", missing), ("unknown", unknown)) if ks))
        for k in ("shuffle", "drop_last"):
            if not isinstance(state[k], bool):
                raise TypeError(f"{where}: {k} must be a bool, got {type(state[k]).__name__} {state[k]!r}")
        for k in ("epoch", "batch", "seed", "global_batch_size", "dataset_length"):
            if k == "seed":
                if isinstance(state[k], bool) or not isinstance(state[k], int):
                    raise TypeError(f"{where}: seed must be an int, got {type(state[k]).__name__} {state[k]!r}")
            else:
                check_int(where, k, state[k], 0)
        mine = self.state_dict()
        differ = [f"{k}: saved {state[k]!r}, this loader {mine[k]!r}" for k in _IDENTITY if state[k] != mine[k]]
        if differ:
            raise ValueError(f"{where}: the saved position belongs to a different sequence of batches "
                             f"({'; '.join(differ)})")
        if state["batch"] > len(self):
            raise ValueError(f"{where}: batch={state['batch']} is past the epoch's {len(self)} global batches")
        self._epoch, self._batch = state["epoch"], state["batch"]
        self._iteration += 1  # an iterator made before this no longer matches the position

    def __repr__(self) -> str:
        s = self.sampler
        return (f"fzero.data.DataLoader(dataset of {s.dataset_length}, global_batch_size={s.global_batch_size}, "
                f"dp {s.dp_rank}/{s.dp_size}, epoch={self._epoch}, batch={self._batch}/{len(self)})")


def _from_config(config: Any, batch_size: int | None, drop_last: bool | None,
                 dp_size: int) -> tuple[int, bool | None]:
    """``(global batch size, drop_last)`` from the keywords and ``config``, which must agree."""
    if config is None:
        if batch_size is None:
            raise ValueError(f"{WHERE}: give batch_size= (the global batch size) or config= (a DeepSpeed config)")
        return batch_size, drop_last
    from fzero.config import Config

    cfg = Config.load(config, world_size=dp_size)
    clashes = []
    if batch_size is not None and batch_size != cfg.train_batch_size:
        clashes.append(f"batch_size={batch_size!r} but the config's train_batch_size is {cfg.train_batch_size}")
    written = cfg.dataloader_drop_last
    if drop_last is not None and written is not None and drop_last != written:
        clashes.append(f"drop_last={drop_last!r} but the config's dataloader_drop_last is {written}")
    if clashes:
        raise ValueError(f"{WHERE}: the keywords contradict the config: {'; '.join(clashes)}")
    return cfg.train_batch_size, drop_last if drop_last is not None else written
