"""Import triton in its CPU interpreter's mode, if nothing has imported it yet.

Triton fixes interpreted-or-compiled at its first import (``TRITON_INTERPRET`` at that
moment). ``tests/test_kernels.py`` runs the kernels under the interpreter, so it calls this
before anything else; ``tests/conftest.py`` calls it first on a machine without CUDA, since
any ``torch.compile`` (``tests/test_jit.py``) imports triton, compiled, on its way. The
environment is given back: other tests run the torch references on CPU tensors.
"""

from __future__ import annotations

import os
import sys

__all__ = ["import_triton_interpreted"]


def import_triton_interpreted() -> None:
    if "triton" in sys.modules:
        return
    prior = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:  # the references alone are tested
        pass
    finally:
        if prior is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = prior
