"""Exhaustive check of the KIVI write's codes by float16 arithmetic (kvqref.kernels.write._kivi_codes_f16): for
every pair of non-negative finite float16 values ``d`` (dividend: ``RN16(x16 - mn)``) and divisor ``s > 0`` (the
group's scale) with ``s >= S_MIN`` and ``d <= QUOT_MAX * s`` (every pair a group can hold),

    r  = RN16(RN32(1 / s))            (once per group: the float32 reciprocal converted to float16)
    q0 = RN16(d * r)                  (float16 multiply)
    e  = RN16(d - q0 * s)             (float16 fused multiply-add)
    q1 = RN16(q0 + e * r)             (float16 fused multiply-add)
    code = RN16(min(q1, MAXINT) + 1024) - 1024   (float16 add: rint, ties to even, below 1024)

equals the oracle's ``rint(min(RN16(d / s), MAXINT))`` (``kvqref.schemes.kivi``) for MAXINT = 15 and 3. Every
float16 operation is emulated exactly: the products of two 11-bit significands are exact in float64 and so are
the sums here (their terms are within 2**40 of each other or one of them is zero), then rounded to float16 once
(NumPy's float64 -> float16 conversion rounds to nearest even, subnormals included). It also reports, per divisor
binade, where the route fails, which is how ``S_MIN`` below was chosen. NumPy, about 2 minutes:

    python3 bench/proof_kivi_f16.py

Result: bench/results/proof_kivi_f16.txt.
"""

from __future__ import annotations

import sys
import time
import warnings

import numpy as np

F16, F32, F64 = np.float16, np.float32, np.float64
#: the smallest scale the float16 route takes (kvqref.kernels.write.KIVI_F16_S_MIN); smaller scales divide in float32
S_MIN = 2.0**-14
#: the dividends checked: d <= QUOT_MAX * s. A group's d = RN16(x16 - mn) <= rng = RN16(mx - mn) and its scale
#: s = RN16(rng / MAXINT) >= rng / MAXINT * (1 - 2**-11), so d / s <= MAXINT (1 + 2**-10) < 16 < QUOT_MAX
QUOT_MAX = 32.0
#: scales are brought into the binade [2**BINADE, 2**(BINADE + 1)) by a power of two within 2**-15 .. 2**15
BINADE = int(sys.argv[1]) if len(sys.argv) > 1 else -3


def prescale(s: F16) -> F64:
    """The power of two ``p`` the kernel multiplies a group's dividends and scale by (KIVI_F16_BINADE)."""
    e = int(np.floor(np.log2(F64(s))))
    return F64(2.0) ** min(max(BINADE - e, -15), 15)


def codes_f16(d: np.ndarray, s: F16, maxint: int) -> np.ndarray:
    """The float16 route's codes for dividends ``d`` (float16 array) and one divisor ``s``: both scaled by
    :func:`prescale` first (d' = RN16(d p): what the kernel's RN16((x16 - mn) p) is wherever the code can be
    nonzero), then the float16 division by the reciprocal and one correction."""
    p = prescale(s)
    d = (d.astype(F64) * p).astype(F16)
    s = F16(F64(s) * p)
    r = F16(F32(1) / F32(s))
    r64, s64, d64 = F64(r), F64(s), d.astype(F64)
    q0 = (d64 * r64).astype(F16).astype(F64)
    e = (d64 - q0 * s64).astype(F16).astype(F64)
    q1 = (q0 + e * r64).astype(F16).astype(F64)
    return ((np.minimum(q1, maxint) + 1024.0).astype(F16).astype(F64) - 1024.0)


def main() -> int:
    warnings.simplefilter("ignore")
    t0 = time.time()
    allpos = np.arange(0, 0x7C00, dtype=np.uint16).view(F16)  # +0.0 .. 65504
    d64 = allpos.astype(F64)
    bad_above = 0
    fail_binades: dict[int, int] = {}
    for s in allpos[1:]:
        s64 = F64(s)
        exact = (d64 / s64).astype(F16).astype(F64)
        for maxint in (15, 3):
            want = np.rint(np.minimum(exact, maxint))
            got = codes_f16(allpos, s, maxint)
            n = int(np.sum((got != want) & (d64 <= QUOT_MAX * s64)))
            if n:
                if s64 >= S_MIN:
                    bad_above += n
                b = int(np.floor(np.log2(s64)))
                fail_binades[b] = fail_binades.get(b, 0) + n
    pairs = allpos.size * (allpos.size - 1)
    print(f"{pairs} (d, s) pairs x MAXINT 15, 3")
    print("mismatches by divisor binade (floor log2 s): "
          + (", ".join(f"2**{b}: {n}" for b, n in sorted(fail_binades.items())) or "none"))
    print(f"mismatches with s >= 2**{int(np.log2(S_MIN))}: {bad_above}")
    print(f"{'PASS' if bad_above == 0 else 'FAIL'} ({time.time() - t0:.0f} s)")
    return 0 if bad_above == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
