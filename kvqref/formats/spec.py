"""Format specs: the handful of numbers that define a minifloat element format.

Every element format of kvqref is one :class:`FormatSpec`; the codec in
:mod:`kvqref.formats.minifloat` is written once against these fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

NanEncoding = Literal["ieee", "all_ones", "negative_zero", "none"]


@dataclass(frozen=True)
class FormatSpec:
    """A binary minifloat: ``sign? | exponent (ebits) | mantissa (mbits)``.

    ``nan`` says where NaN lives:

    * ``"ieee"``: the top exponent is reserved, mantissa 0 is +-Inf, any other mantissa is NaN
      (E5M2, as IEEE 754).
    * ``"all_ones"``: only ``S.111..1.11..1`` is NaN, there is no Inf, the top exponent otherwise
      holds finite values (E4M3FN: 0x7F and 0xFF).
    * ``"negative_zero"``: the single code 0x80 (sign set, everything else zero) is NaN, so there is
      no negative zero and no Inf (the FNUZ formats of AMD MI300).
    * ``"none"``: every code is a finite number (E2M1).
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    nan: NanEncoding
    signed: bool = True
    subnormals: bool = True
    description: str = ""

    @property
    def bits(self) -> int:
        return int(self.signed) + self.ebits + self.mbits

    @property
    def has_inf(self) -> bool:
        return self.nan == "ieee"

    @property
    def has_nan(self) -> bool:
        return self.nan != "none"

    @property
    def has_negative_zero(self) -> bool:
        return self.signed and self.nan != "negative_zero"

    @property
    def sign_bit(self) -> int:
        """The sign bit as an integer mask of a code (0 for unsigned formats)."""
        return (1 << (self.ebits + self.mbits)) if self.signed else 0

    @property
    def max_code(self) -> int:
        """The magnitude code (sign bit clear) of the largest finite value."""
        all_ones = (1 << (self.ebits + self.mbits)) - 1
        if self.nan == "ieee":
            return all_ones - (1 << self.mbits)  # top exponent reserved for Inf/NaN
        if self.nan == "all_ones":
            return all_ones - 1
        return all_ones

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal number."""
        return 1 - self.bias if self.subnormals else -self.bias

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite number."""
        return (self.max_code >> self.mbits) - self.bias

    @property
    def max_finite(self) -> float:
        frac = 1.0 + ((self.max_code & ((1 << self.mbits) - 1)) / (1 << self.mbits))
        return float(frac * 2.0**self.emax)

    @property
    def min_normal(self) -> float:
        return float(2.0**self.emin)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value (the smallest normal where there are no subnormals)."""
        if not self.subnormals:
            return self.min_normal
        return float(2.0 ** (self.emin - self.mbits))

    @property
    def inf_code(self) -> int | None:
        return ((1 << self.ebits) - 1) << self.mbits if self.has_inf else None

    @property
    def nan_code(self) -> int | None:
        """The canonical NaN code that :func:`encode` writes for a positive NaN."""
        if self.nan == "ieee":
            # quiet NaN: top mantissa bit set, as a float32 quiet NaN keeps it (E5M2 0x7E).
            return (((1 << self.ebits) - 1) << self.mbits) | (1 << (self.mbits - 1))
        if self.nan == "all_ones":
            return (1 << (self.ebits + self.mbits)) - 1
        if self.nan == "negative_zero":
            return 1 << (self.ebits + self.mbits)
        return None
