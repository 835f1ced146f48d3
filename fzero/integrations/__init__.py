"""fzero beside other libraries' training front ends.

``fzero.integrations.transformers``: :class:`FzeroTrainer`, Hugging Face's ``Trainer`` run
on a compiled fzero step (needs the ``transformers`` package: ``pip install fzero[transformers]``).
Nothing here is imported by ``import fzero``.
"""
