"""What the launcher and the ranks agree on about signals, in a module that imports nothing:
the launcher (``fzero launch``, :mod:`fzero.cli._signals`) imports no torch."""

__all__ = ["REPEAT_S"]

#: Signals this close to the first (seconds) are the same request, not a second one.
REPEAT_S = 1.0
