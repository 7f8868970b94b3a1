"""Exhaustive check of the write kernel's one-step quotient (kvqref.kernels.write._div_by, STEPS=1) for
bfloat16 dividends: for every pair of significands (2**7 bfloat16 x 2**23 float32 divisors, both in [1, 2)),
``q = RN(x * r)``, ``e = RN(q * s - x)`` (an FMA), ``q' = RN(q - e * r)`` (an FMA) with ``r = RN(1 / s)``
equals ``RN(x / s)``. Exponents only shift these values while no intermediate under/overflows, so the
pairs cover every normal-range case. NumPy only (float64 products are exact; the FMA's single rounding
is emulated with TwoSum), about 4 minutes on one core:

    python3 bench/proof_markstein.py [--bits 7] [--steps 1]

``--bits 10`` checks float16 dividends (2**33 pairs, about 35 minutes). Result: bench/results/proof_markstein_bf16.txt.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

F32, F64 = np.float32, np.float64


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """RN32(a * b + c) for float32 arrays (a * b exact in float64; the sum's float64 rounding error is
    recovered with TwoSum and decides float32 midpoints)."""
    p = a.astype(F64) * b.astype(F64)
    cc = c.astype(F64)
    s = p + cc
    bb = s - p
    err = (p - (s - bb)) + (cc - bb)
    r = s.astype(F32)
    rd = r.astype(F64)
    lo = np.nextafter(r, F32(-np.inf)).astype(F64)
    hi = np.nextafter(r, F32(np.inf)).astype(F64)
    down = (s == (rd + lo) / 2) & (err < 0) & (rd > s)  # s is the midpoint below r, the exact sum below it
    up = (s == (rd + hi) / 2) & (err > 0) & (rd < s)
    r = np.where(down, np.nextafter(r, F32(-np.inf)), r)
    return np.where(up, np.nextafter(r, F32(np.inf)), r)


def check(bits: int, steps: int, chunk: int = 1 << 22) -> int:
    xs = (1 + np.arange(1 << bits) / (1 << bits)).astype(F32)
    divisors = np.arange(1 << 23, dtype=np.uint32) | np.uint32(0x3F800000)
    bad = 0
    t0 = time.time()
    for i in range(0, 1 << 23, chunk):
        s = divisors[i:i + chunk].view(F32)
        r = (1.0 / s.astype(F64)).astype(F32)  # RN32(1/s): no float64 midpoint ties (1/s is not a 25-bit number)
        for x in xs:
            xv = np.full_like(s, x)
            want = (F64(x) / s.astype(F64)).astype(F32)  # x/s is never within 2**-53 of a float32 midpoint
            q = (xv.astype(F64) * r.astype(F64)).astype(F32)
            for _ in range(steps):
                e = fma32(q, s, -xv)
                q = fma32(-e, r, q)
            n = int((q != want).sum())
            if n:
                j = int(np.nonzero(q != want)[0][0])
                print(f"mismatch: x={x!r} s={s[j]!r} got {q[j]!r} want {want[j]!r}", flush=True)
            bad += n
        print(f"divisors {i + len(s)}/{1 << 23}: {bad} mismatches, {time.time() - t0:.0f} s", flush=True)
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, default=7, help="dividend fraction bits (7: bfloat16, 10: float16)")
    ap.add_argument("--steps", type=int, default=1)
    args = ap.parse_args()
    bad = check(args.bits, args.steps)
    print(f"{(1 << args.bits) * (1 << 23)} pairs, {bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
