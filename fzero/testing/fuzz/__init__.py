"""Hypothesis strategies for bad input, the checks each drawn case is held to, and
:func:`outcome`, which sorts what a call did.

Three kinds of input a user hands fzero are drawn here: DeepSpeed configs (every key fzero
knows, with values outside what the key takes, contradictions, unknown keys, sections of
the wrong shape), batches given to a compiled step (wrong dtypes, ranks, shapes, empty
tensors, NaN and inf, sizes that do not split, trees that change), and mutations of a
checkpoint's ``manifest.json`` (fields removed, wrong types, shapes that do not match the
pieces, offsets past the end, unknown dtypes, paths that leave the directory, huge sizes).

What a key takes (:data:`KEY_DOMAINS`) is written here from DeepSpeed's documentation and
docs/config.md, not read from fzero's own tables, so a value fzero wrongly accepts shows.
Each ``*_case`` function runs one drawn case and returns how it ended (``"ran"``,
``"named"``, ``"user"``), or fails an assertion saying what went wrong: ``tests/test_fuzz.py``
calls them under ``@given``, ``benchmarks/fuzz.py`` counts them (docs/reliability.md).

Example:
    >>> from hypothesis import find
    >>> path, value = find(bad_values(), lambda pv: pv[0] == "fp16.enabled")
    >>> path, value
    ('fp16.enabled', 0)

The package: ``_configs`` (configs), ``_batches`` (batches), ``_manifests`` (checkpoint
manifests), ``_outcome`` (how a case ended).
"""

from fzero.testing.fuzz._batches import LEAF_KINDS, batch_case, batches, linear, make_leaf
from fzero.testing.fuzz._configs import (BAD_BASE, BASE_CONFIG, CONFIG_ERRORS, CONTRADICTIONS, KEY_DOMAINS, bad_values,
                                         config_change_case, config_mutations, config_text_case, config_texts,
                                         config_value_case, contradiction_case, set_path, valid_config_case,
                                         valid_configs)
from fzero.testing.fuzz._manifests import (READS, SAVED_STATE, SavedCheckpoint, apply_mutations, manifest_case,
                                           manifest_mutations, manifest_nodes, save_checkpoint, write_manifest)
from fzero.testing.fuzz._outcome import Outcome, describe, mentions_any, outcome, section_paths

__all__ = ["BAD_BASE", "BASE_CONFIG", "CONFIG_ERRORS", "CONTRADICTIONS", "KEY_DOMAINS", "LEAF_KINDS", "READS",
           "SAVED_STATE", "Outcome", "SavedCheckpoint", "apply_mutations", "bad_values", "batch_case", "batches",
           "config_change_case", "config_mutations", "config_text_case", "config_texts", "config_value_case",
           "contradiction_case", "describe", "linear", "make_leaf", "manifest_case", "manifest_mutations",
           "manifest_nodes", "mentions_any", "outcome", "save_checkpoint", "section_paths", "set_path",
           "valid_config_case", "valid_configs", "write_manifest"]
