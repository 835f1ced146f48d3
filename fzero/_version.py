"""The package version, in a module of its own so that fzero's modules can read it without
importing the package root (``fzero/__init__.py`` imports them)."""

__version__ = "0.1.0"
