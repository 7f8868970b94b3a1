"""Exhaustive check of the KIVI write's float32 reciprocal of a float16 scale (kvqref.kernels.write.kivi_x2_scale_ptx):
for every positive finite float16 ``s`` (subnormals included; as float32 all are normal) and every start ``r0``
within ``SPAN`` float32 ulps of ``1 / s`` (the hardware's ``rcp.approx.f32`` is within 1 ulp), one Newton step

    e = RN32(1 - s * r0)          (fma.rn.f32 of s, r0 and -1, negated: exact product, one rounding)
    r = RN32(r0 + e * r0)         (fma.rn.f32)

gives ``RN32(1 / s)``, the reciprocal that bench/proof_kivi_quotient.py's code rule multiplies by. Exact rational
arithmetic (fractions), about half a minute:

    python3 bench/proof_kivi_reciprocal.py [--span 2]

Result: bench/results/proof_kivi_reciprocal.txt.
"""

from __future__ import annotations

import argparse
import sys
import time
from fractions import Fraction

import numpy as np


def rn32(v: Fraction) -> Fraction:
    """``v`` rounded to the nearest float32 (ties to even), for normal-range results and zero (also the rounding of
    tests/ptx_emulator.py's fused multiply-adds)."""
    if v == 0:
        return Fraction(0)
    sign = -1 if v < 0 else 1
    a = abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    # a in [2**e, 2**(e + 1)): 24 significant bits, ulp 2**(e - 23)
    scaled = a / Fraction(2) ** (e - 23)
    q, r = divmod(scaled.numerator, scaled.denominator)
    twice = 2 * r
    if twice > scaled.denominator or (twice == scaled.denominator and q & 1):
        q += 1
    return sign * Fraction(q) * Fraction(2) ** (e - 23)


def f32_neighbours(x: Fraction, span: int) -> list[Fraction]:
    """The float32 values within ``span`` ulps of the float32 ``x`` (positive, normal)."""
    bits = int(np.array([float(x)], np.float32).view(np.uint32)[0])
    vals = np.arange(bits - span, bits + span + 1, dtype=np.uint32).view(np.float32)
    return [Fraction(float(v)) for v in vals]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--span", type=int, default=2, help="float32 ulps around RN32(1 / s) tried as the start")
    args = ap.parse_args(argv)
    t0 = time.time()
    scales = np.arange(1, 0x7C00, dtype=np.uint16).view(np.float16)  # every positive finite float16
    bad = 0
    for s16 in scales:
        s = Fraction(float(s16))
        want = rn32(1 / s)
        for r0 in f32_neighbours(want, args.span):
            e = rn32(1 - s * r0)
            if rn32(r0 + e * r0) != want:
                bad += 1
                if bad <= 10:
                    print(f"MISMATCH s={float(s16)!r} r0={float(r0)!r}")
    n = scales.size * (2 * args.span + 1)
    print(f"{scales.size} float16 scales x {2 * args.span + 1} starts = {n} cases, {bad} mismatches "
          f"({time.time() - t0:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
