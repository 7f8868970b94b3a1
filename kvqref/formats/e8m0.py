"""E8M0: the unsigned power-of-two scale of OCP MX blocks (``float8_e8m0fnu`` in ml_dtypes).

Code ``c`` in 0..254 is ``2**(c - 127)``; 0xFF is NaN; there is no zero, no sign, no Inf.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from kvqref.formats.minifloat import MinifloatCodec, as_exact_float

Rounding = Literal["floor", "ceil", "nearest"]
ROUNDINGS: tuple[str, ...] = ("floor", "ceil", "nearest")


class E8M0Codec(MinifloatCodec):
    """Power-of-two scale codec with an explicit rounding of the exponent."""

    def describe(self) -> dict[str, str]:
        return {
            "overflow, saturate=True": "0xFE (2**127)",
            "overflow, saturate=False": "NaN 0xFF",
            "+-Inf, saturate=True": "+Inf: 0xFE; -Inf: ValueError",
            "+-Inf, saturate=False": "+Inf: NaN 0xFF; -Inf: ValueError",
            "NaN": "NaN 0xFF",
            "-0": "as +0: 0x00 (2**-127) if saturate else NaN 0xFF (no zero)",
            "underflow": "0x00 (2**-127): there is no zero",
        }

    def encode(self, x: Any, *, saturate: bool, rounding: Rounding | None = None) -> np.ndarray:
        """Encode positive values as ``2**k`` with ``k`` chosen by ``rounding``.

        ``floor``: largest power of two <= x (OCP MX shared exponent); ``ceil``: smallest power of two
        >= x (cuBLAS, SGLang); ``nearest``: the significand rounded to nearest, ties to even (so
        1.5 * 2**k goes up to 2**(k+1)), as ml_dtypes' cast. Below 2**-127 gives 0x00 (no zero exists).
        Above 2**127 and +Inf give 0xFE with ``saturate`` and NaN 0xFF without. Zero gives 0x00 with
        ``saturate`` and 0xFF without. NaN gives 0xFF. Negative input raises ValueError.
        """
        if rounding not in ROUNDINGS:
            raise ValueError(f"{self.name}.encode needs rounding= one of {ROUNDINGS}, got {rounding!r}")
        v = as_exact_float(x)
        isnan = np.isnan(v)
        if np.any(v[~isnan] < 0):
            raise ValueError(f"{self.name} is unsigned: negative input cannot be encoded")
        isinf = np.isinf(v)
        iszero = v == 0
        finite = np.where(isnan | isinf | iszero, 1.0, v)
        m, e_plus_1 = np.frexp(finite)  # finite = m * 2**e_plus_1, m in [0.5, 1)
        k = e_plus_1.astype(np.int64) - 1
        if rounding == "ceil":
            k = k + (m != 0.5)
        elif rounding == "nearest":
            k = k + (np.rint(2 * m) == 2)  # 2m in [1, 2): rint ties to even, so 1.5 rounds up
        code = np.maximum(k + self.spec.bias, 0)
        top = self.spec.max_code
        code = np.where(code > top, top if saturate else 0xFF, code)
        code = np.where(isinf, top if saturate else 0xFF, code)
        code = np.where(iszero, 0 if saturate else 0xFF, code)
        code = np.where(isnan, 0xFF, code)
        return code.astype(np.uint8)
