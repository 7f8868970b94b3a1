"""transformers' own quantized KV caches (``transformers.QuantizedCache``), for the side-by-side comparison in
:mod:`kvqref.eval.builtin_caches`. Only the transformers-touching part lives here.

Backends: ``"fp8"`` (E4M3, one scale per layer for K and one for V: ``amax / 448`` over the first update,
every head and sequence, then frozen; later states cast with that scale), ``"quanto"`` (optimum-quanto) and
``"hqq"`` (HQQ): integer formats in groups, with a full-precision residual window that, when full, is
re-quantized together with the dequantized old states.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import transformers
import transformers.cache_utils
from transformers import DynamicCache, QuantizedCache

from kvqref.hf.model import cache_kwargs

#: what each backend needs besides transformers (module to look for, package to install)
BACKEND_PACKAGES = {"fp8": None, "quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}


def version() -> str:
    return transformers.__version__


def unavailable_reason(backend: str) -> str | None:
    """None when ``QuantizedCache(backend, ...)`` can be built here, else why not."""
    if backend not in BACKEND_PACKAGES:
        return f"unknown backend {backend!r}; known: {', '.join(BACKEND_PACKAGES)}"
    need = BACKEND_PACKAGES[backend]
    if need is not None:
        try:
            found = importlib.util.find_spec(need[0]) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"{backend}: pip install {need[1]}"
    if backend == "fp8" and not hasattr(transformers.cache_utils, "Fp8QuantizedLayer"):
        return f"fp8: transformers {transformers.__version__}'s QuantizedCache has no fp8 backend"
    return None


def quantized_cache(config: Any, backend: str, **options: Any) -> Any:
    """``transformers.QuantizedCache(backend, config, **options)`` (group-wise options: nbits, axis_key,
    axis_value, q_group_size, residual_length; none for fp8)."""
    why = unavailable_reason(backend)
    if why:
        raise RuntimeError(why)
    return QuantizedCache(backend, config, **options)


def fp8_scales(cache: Any) -> list[tuple[float, float]]:
    """(K scale, V scale) of every layer of a ``QuantizedCache("fp8", ...)`` after its first update."""
    out = []
    for layer in cache.layers:
        k, v = layer._quantized_keys, layer._quantized_values
        if k is None:
            raise ValueError("the fp8 cache has not been updated yet")
        out.append((float(k[1]), float(v[1])))
    return out


@torch.no_grad()
def reference_states(model: Any, ids: torch.Tensor, keep: int = 1) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                                                           torch.Tensor]:
    """Full-precision (K, V) ``[B, kv_heads, T, head_dim]`` of every layer for ``ids`` (one forward into a
    ``DynamicCache`` with the model's current attention), and the logits of the last ``keep`` positions."""
    cache = DynamicCache()
    out = model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=keep)
    return [(layer.keys, layer.values) for layer in cache.layers], out.logits
