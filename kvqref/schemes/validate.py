"""Checks of user-given input and parameters, shared by the oracle, the paged cache and the backends.

Rules (docs/schemes.md, "Input and parameters"):

* K/V input must be real: float16, bfloat16, float32, float64 (and other ml_dtypes float formats), or
  integers, which are taken as the values they hold (exact when float64 holds them). Complex, boolean,
  string and object arrays raise ``TypeError``: a complex value would otherwise be cast to its real part.
* A tensor-level scale (an FP8 ``scale``, NVFP4's ``global_scale``) must be a real, finite number > 0;
  0, a negative value, NaN or Inf raises ``ValueError`` naming the parameter (and the entry of a per-head
  array at fault).
* Integer options (block and group sizes, residual windows, seeds) must be Python or NumPy integers, not
  floats or booleans.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

__all__ = ["check_integer_option", "check_real_input", "check_scale"]


def check_real_input(name: str, x: Any) -> np.ndarray:
    """``x`` as a NumPy array if its dtype is real (float or integer); TypeError otherwise."""
    arr = np.asarray(x)
    kind = arr.dtype.kind
    if kind in "fiu" or (kind == "V" and "float" in arr.dtype.name):  # ml_dtypes: bfloat16, float8_*, ...
        return arr
    what = {"c": "complex", "b": "boolean", "U": "string", "S": "bytes", "O": "object"}.get(kind, str(arr.dtype))
    raise TypeError(f"{name}: K/V input must be real (float or integer values), got a {what} array "
                    f"(dtype {arr.dtype})")


def check_scale(name: str, param: str, value: Any, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """``value`` as float32 after checking it is real, finite and > 0 everywhere (and of ``shape``).

    The float32 rounding is checked too: a positive value below float32's smallest subnormal or above its
    largest finite value would become 0 or Inf."""
    try:
        raw = np.asarray(value)
    except Exception as e:  # noqa: BLE001 (any object numpy cannot hold)
        raise TypeError(f"{name}: {param} must be a number or an array of numbers, got {value!r}") from e
    if raw.dtype.kind not in "fiu":
        raise TypeError(f"{name}: {param} must be real numbers, got dtype {raw.dtype} ({value!r})")
    if shape is not None and raw.shape != shape:
        want = "a scalar" if shape == () else f"shape {shape}"
        raise ValueError(f"{name}: {param} must be {want}, got shape {raw.shape}")
    v = raw.astype(np.float64)
    with np.errstate(over="ignore", under="ignore"):
        s = v.astype(np.float32)
    bad = ~(np.isfinite(v) & (v > 0) & np.isfinite(s) & (s > 0))
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        where = f"[{', '.join(map(str, idx))}] " if idx else ""
        got = float(v[idx])
        ok64 = bool(np.isfinite(got) and got > 0)
        why = "is not positive and finite in float32" if ok64 else "must be positive and finite"
        raise ValueError(f"{name}: {param} {where}{why}, got {got!r}")
    return s


def check_integer_option(name: str, option: str, value: Any, *, minimum: int) -> int:
    """``value`` as int if it is an integer (not a bool or float) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: {option} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name}: {option} must be >= {minimum}, got {value}")
    return int(value)
