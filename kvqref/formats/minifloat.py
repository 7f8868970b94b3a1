"""One minifloat codec, written once from the bit-field definition and parameterized by a FormatSpec.

Encoding rule (every format): the input is read exactly (float16, bfloat16 and float32 widen to float32
or float64 without loss), its exponent ``e = floor(log2|x|)`` is taken from its bit pattern
(``np.frexp``), clamped below at the format's smallest normal exponent, and ``|x| / 2**(e - mbits)`` is
rounded to an integer with ``np.rint``, which is IEEE round-to-nearest, ties-to-even on an exactly
scaled value: one rounding, also for float64 input. The integer is the code's magnitude once the
exponent field is added. Values whose rounded magnitude exceeds the largest finite code overflow.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvqref.formats.spec import FormatSpec


def as_exact_float(x: Any) -> np.ndarray:
    """Return ``x`` as float32 or float64 without changing any value.

    float16, bfloat16 (ml_dtypes) and float32 become float32; float64 stays float64. bfloat16 is
    widened from its bit pattern so ml_dtypes is not needed at run time. Integers are accepted when
    float64 holds them exactly. Anything else raises TypeError.
    """
    arr = np.asarray(x)
    dt = arr.dtype
    if dt == np.float64:
        return arr
    if dt in (np.float32, np.float16):
        return arr.astype(np.float32)
    if dt.name == "bfloat16":
        return (arr.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dt.kind in "iub":
        out = arr.astype(np.float64)
        if dt.kind != "b" and not np.array_equal(out.astype(dt), arr):
            raise ValueError("integer input is not exactly representable as float64")
        return out
    if dt.kind == "V" and dt.name.startswith("float"):  # other ml_dtypes formats widen exactly
        return arr.astype(np.float64)
    raise TypeError(f"expected a float16, bfloat16, float32 or float64 array, got dtype {dt}")


class MinifloatCodec:
    """Bit-exact encoder/decoder for one :class:`FormatSpec` (codes are uint8, one per element)."""

    def __init__(self, spec: FormatSpec) -> None:
        self.spec = spec
        self._table = self._decode_table()

    # -- facts ---------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def bits(self) -> int:
        return self.spec.bits

    @property
    def bias(self) -> int:
        return self.spec.bias

    @property
    def max_finite(self) -> float:
        return self.spec.max_finite

    @property
    def min_normal(self) -> float:
        return self.spec.min_normal

    @property
    def min_subnormal(self) -> float:
        return self.spec.min_subnormal

    @property
    def num_codes(self) -> int:
        return 1 << self.spec.bits

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    def describe(self) -> dict[str, str]:
        """What encode does at every edge, in words (used by the docs table and `kvqref formats`)."""
        s = self.spec
        mx = f"+-{self.max_finite:g}"
        if s.nan == "ieee":
            ovf, inf, nan = "+-Inf", "+-Inf", f"NaN 0x{s.nan_code:02X}/0x{s.nan_code | s.sign_bit:02X}"
        elif s.nan == "all_ones":
            ovf = inf = nan = f"NaN 0x{s.nan_code:02X}/0x{s.nan_code | s.sign_bit:02X} (sign kept)"
        elif s.nan == "negative_zero":
            ovf = inf = nan = f"NaN 0x{s.nan_code:02X}"
        else:
            ovf, inf, nan = mx, mx, "ValueError (no NaN code)"
        return {
            "overflow, saturate=True": mx,
            "overflow, saturate=False": ovf,
            "+-Inf, saturate=True": mx,
            "+-Inf, saturate=False": inf,
            "NaN": nan,
            "-0": f"-0 (0x{s.sign_bit:02X})" if s.has_negative_zero else "+0 (0x00): no negative zero",
            "underflow": "signed zero" if s.has_negative_zero else "+0 (0x00), also for negative inputs",
        }

    # -- decode --------------------------------------------------------------------------------
    def _decode_table(self) -> np.ndarray:
        s = self.spec
        codes = np.arange(1 << s.bits, dtype=np.int64)
        mag = codes & ((1 << (s.ebits + s.mbits)) - 1)
        efield = mag >> s.mbits
        mant = (mag & ((1 << s.mbits) - 1)).astype(np.float64)
        if s.subnormals:
            value = np.where(
                efield == 0,
                np.ldexp(mant, s.emin - s.mbits),
                np.ldexp(1.0 + mant / (1 << s.mbits), efield - s.bias),
            )
        else:
            value = np.ldexp(1.0 + mant / (1 << s.mbits), efield - s.bias)
        negative = (codes & s.sign_bit) != 0 if s.signed else np.zeros_like(codes, dtype=bool)
        value = np.where(negative, -value, value)
        if s.nan == "ieee":
            top = efield == (1 << s.ebits) - 1
            value = np.where(top & (mant == 0), np.copysign(np.inf, value), value)
            value = np.where(top & (mant != 0), np.nan, value)
        elif s.nan == "all_ones":
            value = np.where(mag == (1 << (s.ebits + s.mbits)) - 1, np.nan, value)
        elif s.nan == "negative_zero":
            value = np.where(codes == s.sign_bit, np.nan, value)
        return value.astype(np.float32)

    def decode(self, codes: Any) -> np.ndarray:
        """Exact float32 value of every code (NaN codes decode to NaN, Inf codes to +-Inf)."""
        c = np.asarray(codes)
        if c.dtype.kind not in "iu":
            raise TypeError(f"{self.name}.decode expects integer codes, got dtype {c.dtype}")
        if c.size and (c.min() < 0 or c.max() >= self.num_codes):
            raise ValueError(f"{self.name} codes must lie in [0, {self.num_codes}), got [{c.min()}, {c.max()}]")
        return self._table[c.astype(np.intp)]

    # -- encode --------------------------------------------------------------------------------
    def encode(self, x: Any, *, saturate: bool) -> np.ndarray:
        """Round to nearest, ties to even; return uint8 codes of the same shape as ``x``.

        ``saturate=True``: finite overflow and +-Inf give +-max finite; NaN gives the NaN code.
        ``saturate=False``: overflow and +-Inf give Inf where the format has it, else its NaN code
        (the behaviour of ml_dtypes' casts). Formats without NaN (E2M1) always saturate and raise
        ValueError on NaN input. See :meth:`describe`.
        """
        s = self.spec
        v = as_exact_float(x)
        negative = np.signbit(v)
        a = np.abs(v)
        isnan = np.isnan(a)
        isinf = np.isinf(a)
        if isnan.any() and not s.has_nan:
            raise ValueError(f"{self.name} has no NaN code; input holds {int(isnan.sum())} NaN value(s)")
        finite_a = np.where(isnan | isinf, 0, a)
        _, e_plus_1 = np.frexp(finite_a)  # zero gives 0, clamped to emin below like any tiny value
        e = np.maximum(e_plus_1.astype(np.int32) - 1, s.emin)
        e = np.where(finite_a == 0, s.emin, e)
        q = np.rint(np.ldexp(finite_a, s.mbits - e))
        mag = q.astype(np.int32) + ((e - s.emin) << s.mbits)

        over = (mag > s.max_code) | isinf
        if saturate or s.nan == "none":
            over_code = s.max_code
        elif s.nan == "ieee":
            over_code = s.inf_code
        else:
            over_code = s.nan_code
        mag = np.where(over, over_code, mag)
        keeps_sign = negative & (mag != 0) if not s.has_negative_zero else negative
        code = np.where(keeps_sign, mag | s.sign_bit, mag)
        if s.has_nan:
            nan_sign = negative * s.sign_bit if s.nan != "negative_zero" else 0
            code = np.where(isnan, s.nan_code | nan_sign, code)
        return code.astype(np.uint8)

    def round(self, x: Any, *, saturate: bool) -> np.ndarray:
        """``decode(encode(x))``: the value the format stores for ``x`` (float32)."""
        return self.decode(self.encode(x, saturate=saturate))
