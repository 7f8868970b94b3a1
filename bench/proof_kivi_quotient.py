"""Exhaustive check of the KIVI write's float16 quotients by one multiplication (kvqref.kernels.write._kivi_quant):
for every pair of non-negative finite float16 values ``d`` (dividend) and ``s > 0`` (divisor, the group's scale)

    code = rint(min(RN16(RN32(d * r)), MAXINT))   with r = RN32(1 / s)

equals the oracle's ``rint(min(RN16(d / s), MAXINT))`` for MAXINT = 15 and 3, and the scale
``RN16(RN32(rng * RN32(1 / MAXINT)))`` equals ``RN16(rng / MAXINT)`` for every float16 ``rng``. Both are also
checked with the multiplication contracted into the float-arithmetic rounding ``round_f16_nonneg``
(``(q + m) - m``, ``m = 2**(max(e(q), -14) + 13)``): ``RN32(d * r + m) - m`` with the exact product, which is what
an FMA gives where the compiler fuses them (ROCm, no F16_CVT). The quotient itself (RN16) differs only where
it is below float16's normal range (< 2**-14, code 0): those are counted and reported. NumPy, about 3 minutes:

    python3 bench/proof_kivi_quotient.py

Result: bench/results/proof_kivi_quotient.txt.
"""

from __future__ import annotations

import sys
import time
import warnings

import numpy as np

F16, F32, F64 = np.float16, np.float32, np.float64


def rn16_fused(d: np.ndarray, r: F32) -> np.ndarray:
    """``(RN32(d * r + m) - m)`` with the product exact (an FMA), m from RN32(d * r)'s exponent, as float16."""
    q = d.astype(F32) * r
    e = np.maximum((q.view(np.int32) & 0x7F800000) + (13 << 23), 0x38800000 + (13 << 23)).astype(np.int32)
    m = e.view(F32).astype(F64)
    s = (d.astype(F64) * F64(r) + m).astype(F32)  # exact in float64 (<= 48 significant bits), one rounding
    return (s.astype(F64) - m).astype(F16)  # exact difference, a float16 value


def main() -> int:
    warnings.simplefilter("ignore")  # quotients beyond float16's range cast to inf on both sides
    t0 = time.time()
    allpos = np.arange(0, 0x7C00, dtype=np.uint16).view(F16)  # +0.0 .. 65504
    d32, d64 = allpos.astype(F32), allpos.astype(F64)
    bad = 0
    for maxint in (15, 3):
        r = F32(1) / F32(maxint)
        exact = (d64 / maxint).astype(F16)
        for name, fast in (("mul", (d32 * r).astype(F16)), ("fused", rn16_fused(allpos, r))):
            n = int(np.sum(fast.view(np.uint16) != exact.view(np.uint16)))
            print(f"scale RN16(rng / {maxint}) by {name}: {allpos.size} rng values, {n} mismatches")
            bad += n
    code_bad = {"mul": 0, "fused": 0}
    q_sub = {"mul": 0, "fused": 0}
    q_other = 0
    for s in allpos[1:]:
        r = F32(1) / F32(s)
        exact = (d64 / F64(s)).astype(F16)
        ex = exact.astype(F64)
        for name, fast in (("mul", (d32 * r).astype(F16)), ("fused", rn16_fused(allpos, r))):
            fa = fast.astype(F64)
            for maxint in (15, 3):
                code_bad[name] += int(np.sum(np.rint(np.minimum(fa, maxint)) != np.rint(np.minimum(ex, maxint))))
            diff = fast.view(np.uint16) != exact.view(np.uint16)
            q_sub[name] += int(np.sum(diff & (ex < 2.0**-14)))
            q_other += int(np.sum(diff & ~(ex < 2.0**-14)))
    pairs = allpos.size * (allpos.size - 1)
    for name in ("mul", "fused"):
        print(f"codes by {name}: {pairs} (d, s) pairs x MAXINT 15, 3: {code_bad[name]} mismatches; quotients "
              f"differing below 2**-14 (code 0): {q_sub[name]}")
    print(f"quotients differing at or above 2**-14: {q_other}")
    bad += sum(code_bad.values()) + q_other
    print(f"{'PASS' if bad == 0 else 'FAIL'} ({time.time() - t0:.0f} s)")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
