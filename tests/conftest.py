"""Test-session setup.

Without a GPU, Triton kernels run in the interpreter: ``TRITON_INTERPRET`` must be set before any kernel
module is imported (``@triton.jit`` reads it at decoration time), so it is set here, at collection.
AOT compilation cannot run in an interpreting process; the ``aot`` tests compile in a subprocess.
"""

from __future__ import annotations

import os


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


HAS_GPU = _has_gpu()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
