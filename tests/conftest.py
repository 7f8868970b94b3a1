"""Test-session setup.

Without a GPU, Triton kernels run in the interpreter: ``TRITON_INTERPRET`` must be set before any kernel
module is imported (``@triton.jit`` reads it at decoration time), so it is set here, at collection.
AOT compilation cannot run in an interpreting process; the ``aot`` tests compile in a subprocess.
"""

from __future__ import annotations

import os
import sys

import pytest


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


HAS_GPU = _has_gpu()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    """Each test plans its decode and write launches afresh: the kept plans (``plan_decode``, ``plan_write``) hold
    what their choices read when they were made, and tests patch the device's facts and the tuning constants."""
    for name, clear in (("kvqref.kernels.decode", "clear_plan_cache"),
                        ("kvqref.backends.triton_backend", "clear_write_plan_cache")):
        module = sys.modules.get(name)
        if module is not None:
            getattr(module, clear)()
    yield
