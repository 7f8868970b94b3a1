"""Backend registry: ``get(name)``, ``available()``, ``default()``.

* ``numpy``: the oracle (schemes + float64 reference attention); always available.
* ``torch``: dequantize the cache to bfloat16, then SDPA (the unfused baseline).
* ``triton``: fused quantize-on-write and decode attention; CUDA and ROCm, or the CPU interpreter
  (``TRITON_INTERPRET=1``).

A backend that cannot run here says why (``unavailable_reason``); ``get`` raises with that reason.

Rotated caches (docs/rotation.md): a backend reads one only if it rotates queries and un-rotates outputs
(``rotates_queries``: numpy, torch and triton, whose kernels rotate q and un-rotate the output). Any other
would refuse a rotated cache in ``prepare`` and ``decode`` with ValueError: rotated keys must never meet an
unrotated query.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any


def _gpu() -> tuple[str | None, str]:
    """("cuda" | "rocm" | None, description)."""
    if importlib.util.find_spec("torch") is None:
        return None, "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return None, "no CUDA or ROCm GPU is visible to torch"
    kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return kind, torch.cuda.get_device_name(0)


class Backend:
    name = ""
    description = ""
    #: whether ``decode`` rotates q by a rotated cache's K rotation and un-rotates the output by V's
    rotates_queries = False

    def unavailable_reason(self) -> str | None:
        return None

    def device(self) -> str:
        return "cpu"

    def prepare(self, cache: Any) -> Any:
        """Move a :class:`kvqref.paged.PagedKVCache` to where this backend computes."""
        from kvqref.backends.triton_backend import DeviceCache

        self.check_rotation(cache)
        return DeviceCache.from_cache(cache, self.device())

    def check_rotation(self, state: Any) -> None:
        """ValueError if ``state`` (a paged cache, a device cache or a rotated device cache) is rotated and this
        backend cannot rotate queries."""
        from kvqref.backends.torch_backend import RotatedDeviceCache
        from kvqref.schemes.rotation import rotation_of

        if isinstance(state, RotatedDeviceCache):
            rotations = {"K": state.k_rotation, "V": state.v_rotation}
        else:
            rotations = {"K": rotation_of(state.k.scheme), "V": rotation_of(state.v.scheme)}
        rotated = [f"{side}: {rot}" for side, rot in rotations.items() if rot is not None]
        if rotated and not self.rotates_queries:
            raise ValueError(f"backend {self.name!r} cannot read a rotated cache ({', '.join(rotated)}): it cannot "
                             "rotate queries; use the numpy, torch or triton backend")

    def decode(self, q: Any, state: Any, sm_scale: float | None = None) -> tuple[Any, Any]:
        raise NotImplementedError


class NumpyBackend(Backend):
    name = "numpy"
    description = "NumPy oracle: float64 attention over the dequantized cache"
    rotates_queries = True

    def prepare(self, cache: Any) -> Any:
        return cache

    def decode(self, q: Any, state: Any, sm_scale: float | None = None) -> tuple[Any, Any]:
        from kvqref.reference import decode_attention

        return decode_attention(q, state, sm_scale)


class TorchBackend(Backend):
    name = "torch"
    description = "unfused: dequantize to bfloat16, then torch SDPA"
    rotates_queries = True

    def unavailable_reason(self) -> str | None:
        return None if importlib.util.find_spec("torch") else "torch is not installed"

    def device(self) -> str:
        return "cuda" if _gpu()[0] else "cpu"

    def prepare(self, cache: Any) -> Any:
        from kvqref.backends.torch_backend import prepare

        return prepare(cache, self.device())

    def decode(self, q: Any, state: Any, sm_scale: float | None = None) -> tuple[Any, Any]:
        from kvqref.backends.torch_backend import decode

        return decode(q, state, sm_scale)


class TritonBackend(Backend):
    name = "triton"
    description = "fused Triton kernels (quantize-on-write, split-KV paged decode)"
    rotates_queries = True

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install triton)"
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed"
        if _gpu()[0] is None and os.environ.get("TRITON_INTERPRET") != "1":
            return ("no GPU (" + _gpu()[1] + "); set TRITON_INTERPRET=1 before starting Python to run the "
                    "kernels in Triton's CPU interpreter")
        return None

    def device(self) -> str:
        return "cuda" if _gpu()[0] else "cpu"

    def decode(self, q: Any, state: Any, sm_scale: float | None = None, **kw: Any) -> tuple[Any, Any]:
        from kvqref.backends.torch_backend import RotatedDeviceCache
        from kvqref.backends.triton_backend import decode

        if isinstance(state, RotatedDeviceCache):
            raise ValueError("backend 'triton' got a torch-backend RotatedDeviceCache; prepare the cache with the "
                             "triton backend (its device cache keeps the rotated schemes, so the kernels rotate)")
        self.check_rotation(state)
        return decode(q, state, sm_scale, **kw)


_BACKENDS: dict[str, Backend] = {b.name: b for b in (NumpyBackend(), TorchBackend(), TritonBackend())}


def names() -> list[str]:
    return list(_BACKENDS)


def available() -> dict[str, str | None]:
    """{name: None if it runs here, else the reason it does not}."""
    return {n: b.unavailable_reason() for n, b in _BACKENDS.items()}


def get(name: str) -> Backend:
    """The backend ``name``; KeyError lists the known ones, RuntimeError says why one cannot run here."""
    if name not in _BACKENDS:
        raise KeyError(f"unknown backend {name!r}; known backends: {', '.join(_BACKENDS)}")
    b = _BACKENDS[name]
    why = b.unavailable_reason()
    if why:
        raise RuntimeError(f"backend {name!r} is unavailable: {why}")
    return b


def default() -> Backend:
    """``triton`` on a CUDA or ROCm GPU, else ``numpy``."""
    return _BACKENDS["triton"] if _gpu()[0] else _BACKENDS["numpy"]


__all__ = ["Backend", "available", "default", "get", "names"]
