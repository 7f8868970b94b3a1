"""A small CPU emulator of the straight-line inline PTX the kernels use, so that CI (no GPU) checks what each snippet
computes bit for bit: integer ``b32`` operations, packed 16-bit integer min/max, ``prmt`` (default and sign-replicate
modes), and the float16/float32 arithmetic of the KIVI write (IEEE round-to-nearest-even by NumPy's correctly rounded
float16/float32 operations, fused multiply-adds in exact rational arithmetic). ``rcp.approx.f32`` is emulated as the
correctly rounded reciprocal moved by ``rcp_ulps`` float32 ulps (the hardware is within 1 ulp; callers try several).
"""

from __future__ import annotations

import re
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from proof_kivi_reciprocal import rn32  # noqa: E402  (exact float32 rounding of a rational, ties to even)

MASK = 0xFFFFFFFF
_SPLIT = re.compile(r"mov\.b32\s*\{\s*(\S+?)\s*,\s*(\S+?)\s*\}\s*,\s*(\S+)")


def f32_of(bits: int) -> np.float32:
    return np.array([bits & MASK], np.uint32).view(np.float32)[0]


def bits_of_f32(v) -> int:
    return int(np.array([v], np.float32).view(np.uint32)[0])


def f16_of(bits: int) -> np.float16:
    return np.array([bits & 0xFFFF], np.uint16).view(np.float16)[0]


def bits_of_f16(v) -> int:
    return int(np.array([v], np.float16).view(np.uint16)[0])


def _fma32(a: int, b: int, c: int) -> int:
    fa, fb, fc = (f32_of(x) for x in (a, b, c))
    if not all(np.isfinite([fa, fb, fc])):
        with np.errstate(all="ignore"):
            return bits_of_f32(np.float32(np.float64(fa) * np.float64(fb) + np.float64(fc)))
    exact = Fraction(float(fa)) * Fraction(float(fb)) + Fraction(float(fc))
    r = rn32(exact)
    if r == 0:  # an exact zero: -0 only where both addends are zeros of sign -, else +0 (round to nearest)
        product_neg = bool(np.signbit(fa) != np.signbit(fb))
        both_neg_zeros = fa * fb == 0 and fc == 0 and product_neg and bool(np.signbit(fc))
        return 0x80000000 if both_neg_zeros else 0
    return bits_of_f32(np.float32(float(r)))


def _f16x2(op, a: int, b: int) -> int:
    out = 0
    for i in range(2):
        x, y = f16_of(a >> 16 * i), f16_of(b >> 16 * i)
        with np.errstate(all="ignore"):
            out |= bits_of_f16(np.float16(op(x, y))) << 16 * i
    return out


def _s16x2(op, a: int, b: int) -> int:
    out = 0
    for i in range(2):
        x, y = ((a >> 16 * i) & 0xFFFF), ((b >> 16 * i) & 0xFFFF)
        x, y = x - (x >> 15 << 16), y - (y >> 15 << 16)  # signed
        out |= (op(x, y) & 0xFFFF) << 16 * i
    return out


def _prmt(a: int, b: int, sel: int) -> int:
    """``prmt.b32`` default mode: selector nibble i (low 3 bits) picks byte k of {b, a} for output byte i; its bit 3
    replicates that byte's sign bit over the output byte."""
    pool = [(a >> 8 * i) & 255 for i in range(4)] + [(b >> 8 * i) & 255 for i in range(4)]
    out = 0
    for i in range(4):
        nib = (sel >> 4 * i) & 15
        byte = pool[nib & 7]
        out |= (255 if byte & 128 else 0) << 8 * i if nib & 8 else byte << 8 * i
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for i in range(32):
        out |= ((lut >> (((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1))) & 1) << i
    return out


def _num(tok: str, regs: dict) -> int:
    tok = tok.strip()
    if tok in regs:
        return regs[tok]
    if tok.startswith("0f"):
        return int(tok[2:], 16)
    return int(tok, 0) & MASK


def run_ptx(asm: str, inputs: dict[str, int], rcp_ulps: int = 0) -> dict[str, int]:
    """Execute ``asm`` (braces and ``.reg`` declarations ignored) on ``inputs`` (register -> 32-bit pattern);
    returns every register (32-bit patterns; ``.b16`` halves as 16-bit patterns; predicates as bools)."""
    regs: dict = dict(inputs)
    for line in asm.strip().removeprefix("{").removesuffix("}").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        m = _SPLIT.fullmatch(line)
        if m:  # mov.b32 {lo, hi}, d
            v = _num(m.group(3), regs)
            regs[m.group(1)], regs[m.group(2)] = v & 0xFFFF, v >> 16
            continue
        op, rest = line.split(None, 1)
        d, *a = [t.strip() for t in rest.split(",")]
        if op == "selp.f32":
            regs[d] = _num(a[0], regs) if regs[a[2]] else _num(a[1], regs)
            continue
        if op == "and.pred":
            regs[d] = regs[a[0]] and regs[a[1]]
            continue
        x = [_num(t, regs) for t in a]
        if op == "mov.b32":
            r = x[0]
        elif op == "shl.b32":
            r = (x[0] << x[1]) & MASK
        elif op == "shr.b32":
            r = x[0] >> x[1]
        elif op == "and.b32":
            r = x[0] & x[1]
        elif op == "or.b32":
            r = x[0] | x[1]
        elif op == "prmt.b32":
            r = _prmt(x[0], x[1], x[2])
        elif op == "lop3.b32":
            r = _lop3(*x)
        elif op == "mad.lo.u32":
            r = (x[0] * x[1] + x[2]) & MASK
        elif op in ("min.s16x2", "max.s16x2"):
            r = _s16x2(min if op == "min.s16x2" else max, x[0], x[1])
        elif op in ("sub.rn.f16x2", "add.rn.f16x2"):
            r = _f16x2((lambda p, q: p - q) if op.startswith("sub") else (lambda p, q: p + q), x[0], x[1])
        elif op == "cvt.f32.f16":
            r = bits_of_f32(np.float32(f16_of(x[0])))
        elif op == "cvt.rn.f16x2.f32":  # d = {RN16(a) in the upper half, RN16(b) in the lower}
            with np.errstate(all="ignore"):
                r = bits_of_f16(np.float16(f32_of(x[0]))) << 16 | bits_of_f16(np.float16(f32_of(x[1])))
        elif op == "mul.rn.f32":
            with np.errstate(all="ignore"):
                r = bits_of_f32(f32_of(x[0]) * f32_of(x[1]))
        elif op == "fma.rn.f32":
            r = _fma32(*x)
        elif op == "neg.f32":
            r = x[0] ^ 0x80000000
        elif op == "rcp.approx.f32":
            with np.errstate(all="ignore"):
                r = bits_of_f32(np.float32(1) / f32_of(x[0]))
            if 0 < f32_of(r) < np.inf:
                r += rcp_ulps
        elif op in ("setp.gt.f32", "setp.lt.f32"):
            p, q = f32_of(x[0]), f32_of(x[1])
            regs[d] = bool(p > q) if op == "setp.gt.f32" else bool(p < q)
            continue
        else:
            raise AssertionError(f"instruction {op} not emulated")
        regs[d] = r
    return regs
