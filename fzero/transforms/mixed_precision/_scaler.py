"""DeepSpeed's dynamic loss scaler, as ``mixed_precision`` drives it under fp16: its state
(:class:`LossScaler`, kept in ``state.loss_scaler`` and checkpointed with it) and one update
of it (:func:`update_scaler`)."""

from __future__ import annotations

import torch

from fzero import tree

__all__ = ["LossScaler", "update_scaler"]

WHERE = "fzero.mixed_precision"


@tree.dataclass
class LossScaler:
    """DeepSpeed's dynamic loss scaler state (``deepspeed.runtime.fp16.loss_scaler``), as
    0-dim CPU tensors so it is saved with the state.

    Attributes:
        scale: the current scale (float64).
        iter: updates seen, skipped ones included (DeepSpeed's ``cur_iter``).
        last_overflow: ``iter`` of the last overflow, -1 if none.
        hysteresis: overflows still tolerated before the scale drops (``cur_hysteresis``).
    """

    scale: torch.Tensor
    iter: torch.Tensor
    last_overflow: torch.Tensor
    hysteresis: torch.Tensor

    @classmethod
    def create(cls, initial_scale_power: int = 16, hysteresis: int = 2) -> "LossScaler":
        return cls(torch.tensor(2.0 ** initial_scale_power, dtype=torch.float64),
                   torch.tensor(0), torch.tensor(-1), torch.tensor(hysteresis))


def update_scaler(s: LossScaler, overflow: bool, *, window: int, hysteresis: int, consecutive: bool,
                  min_scale: float) -> LossScaler:
    """One step of DeepSpeed 0.19.8's ``DynamicLossScaler.update_scale``, as its ZeRO
    optimizers (stages 1-3) call it once per update, skipped ones included.

    On overflow: with ``hysteresis == 1``, or once the hysteresis left is 1, the scale
    halves (never below ``min_scale``); otherwise one unit of hysteresis is spent. On a
    clean update: ``consecutive`` refills the hysteresis at once; the scale doubles when
    ``iter - last_overflow - 1`` is positive and a multiple of ``window`` (and, without
    ``consecutive``, the hysteresis refills then).

    Raises:
        FloatingPointError: an overflow at the minimum scale (DeepSpeed's
            ``raise_error_at_min_scale``), rather than skipping forever.
    """
    scale, it, last, hyst = float(s.scale), int(s.iter), int(s.last_overflow), int(s.hysteresis)
    if overflow:
        if hysteresis == 1 or hyst == 1:
            if scale == min_scale:
                raise FloatingPointError(
                    f"{WHERE}: gradients overflowed at the minimum loss scale {min_scale:g} "
                    f"(update {it}): the loss or gradients are not finite at any scale")
            scale = max(scale / 2.0, min_scale)
        else:
            hyst -= 1
        last = it
    else:
        if consecutive:
            hyst = hysteresis
        # it - last - 1 updates lie strictly between the last overflow and this one, all
        # clean: DeepSpeed 0.19.8's stable_interval. ``(it - last) % window`` would double
        # one update early.
        stable_interval = it - last - 1
        if stable_interval > 0 and stable_interval % window == 0:
            if not consecutive:
                hyst = hysteresis
            scale *= 2.0
    return LossScaler(torch.tensor(scale, dtype=torch.float64), torch.tensor(it + 1), torch.tensor(last),
                      torch.tensor(hyst))
