"""KV cache schemes: ``get(name, **options)`` returns a :class:`Scheme`; names follow ``--kv-cache-dtype``.

Layouts, rules and the engine-profile table: docs/schemes.md. Every scheme takes ``rotation="hadamard"``
(+ ``rotation_seed``): a randomized Hadamard rotation before quantizing (docs/rotation.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvqref.schemes.base import FieldSpec, Quantized, Scheme
from kvqref.schemes.bf16 import BF16Scheme
from kvqref.schemes.fp4 import E8M0BlockScheme, NVFP4Scheme, from_sglang_layout, to_sglang_layout
from kvqref.schemes.fp8 import FP8Scheme, load_sglang_scales
from kvqref.schemes.kivi import KiviScheme, to_kivi_layout
from kvqref.schemes.rotation import HadamardRotation, RotatedScheme, with_rotation

_FACTORIES: dict[str, Callable[..., Scheme]] = {
    "bf16": lambda **o: BF16Scheme(**o),
    "fp8_e4m3": lambda **o: FP8Scheme("fp8_e4m3", **o),
    "fp8_e5m2": lambda **o: FP8Scheme("fp8_e5m2", **o),
    "fp4_e2m1": lambda **o: E8M0BlockScheme("fp4_e2m1", 16, **o),
    "mxfp4": lambda **o: E8M0BlockScheme("mxfp4", 32, **o),
    "nvfp4": lambda **o: NVFP4Scheme(**o),
    "int4_kivi": lambda **o: KiviScheme("int4_kivi", **o),
    "int2_kivi": lambda **o: KiviScheme("int2_kivi", **o),
}
ALIASES = {"fp4_mx_block16": "fp4_e2m1", "fp8": "fp8_e4m3"}


def names() -> list[str]:
    """Every scheme name (aliases excluded: see ``ALIASES``)."""
    return list(_FACTORIES)


def get(name: str, **options: Any) -> Scheme:
    """The scheme ``name`` built with ``options``; KeyError lists the known names. ``rotation="hadamard"``
    (and ``rotation_seed``, an int, default 0) wrap it in a :class:`RotatedScheme`."""
    key = ALIASES.get(name, name)
    if key not in _FACTORIES:
        known = ", ".join([*_FACTORIES, *ALIASES])
        raise KeyError(f"unknown KV cache scheme {name!r}; known schemes: {known}")
    rotation, seed = options.pop("rotation", None), options.pop("rotation_seed", None)
    return with_rotation(_FACTORIES[key](**options), rotation, seed)


def outlier_tensor(tokens: int = 1024, heads: int = 8, head_dim: int = 128, *, seed: int = 0,
                   outliers: tuple[tuple[int, float], ...] = ((3, 10.0), (37, 30.0), (80, 100.0))) -> np.ndarray:
    """Standard-normal float32 ``[tokens, heads, head_dim]`` with channels ``c`` scaled by ``f`` (every head)."""
    x = np.random.default_rng(seed).standard_normal((tokens, heads, head_dim))
    for c, f in outliers:
        x[:, :, c] *= f
    return x.astype(np.float32)


def relative_rms(scheme: Scheme, x: np.ndarray) -> float:
    """sqrt(sum((dequant - x)**2) / sum(x**2)), quantizing all of ``x`` (no residual window)."""
    deq = scheme.dequantize(scheme.quantize(x))
    xd = x.astype(np.float64)
    return float(np.sqrt(np.sum((deq - xd) ** 2) / np.sum(xd**2)))


ERROR_TABLE_SCHEMES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("bf16", {}),
    ("fp8_e4m3", {}), ("fp8_e4m3", {"granularity": "head"}), ("fp8_e4m3", {"granularity": "token_head"}),
    ("fp8_e4m3", {"profile": "sglang"}), ("fp8_e4m3", {"profile": "rocm"}),
    ("fp8_e5m2", {}),
    ("fp4_e2m1", {}), ("fp4_e2m1", {"profile": "sglang"}), ("mxfp4", {}), ("nvfp4", {}),
    ("int4_kivi", {"role": "key"}), ("int4_kivi", {"role": "value"}),
    ("int2_kivi", {"role": "key"}), ("int2_kivi", {"role": "value"}),
)


def error_table(tokens: int = 1024, heads: int = 8, head_dim: int = 128, seed: int = 0) -> list[dict[str, Any]]:
    """Relative RMS error of every scheme on :func:`outlier_tensor` (rows: scheme, options, bits, rel_rms)."""
    x = outlier_tensor(tokens, heads, head_dim, seed=seed)
    rows = []
    for name, opts in ERROR_TABLE_SCHEMES:
        s = get(name, **opts)
        rows.append({"scheme": name, "options": ", ".join(f"{k}={v}" for k, v in opts.items()),
                     "bits": s.bits_per_element(head_dim, heads), "rel_rms": relative_rms(s, x)})
    return rows


def error_table_markdown(**kw: Any) -> str:
    """:func:`error_table` as a markdown table."""
    lines = ["| scheme | options | bits/elem | relative RMS |", "|---|---|---|---|"]
    for r in error_table(**kw):
        lines.append(f"| `{r['scheme']}` | {r['options'] or 'default'} | {r['bits']:g} | {r['rel_rms']:.3e} |")
    return "\n".join(lines)


__all__ = ["ALIASES", "BF16Scheme", "E8M0BlockScheme", "FP8Scheme", "FieldSpec", "HadamardRotation", "KiviScheme",
           "NVFP4Scheme", "Quantized", "RotatedScheme", "Scheme", "error_table", "error_table_markdown",
           "from_sglang_layout", "get", "load_sglang_scales", "names", "outlier_tensor", "relative_rms",
           "to_kivi_layout", "to_sglang_layout"]
