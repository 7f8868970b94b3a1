"""Exact rounding helpers shared by the schemes, written from the IEEE definitions.

* :func:`round_bf16_bits`: bfloat16 (8 exponent bits, 7 mantissa bits, bias 127, IEEE Inf/NaN) bit
  pattern of a float32/float64 value, round to nearest, ties to even, in one rounding from the exact input.
* :func:`f16`: IEEE binary16 rounding (NumPy's float16 conversion rounds to nearest even, in one rounding
  from float64 and float32). An arithmetic result computed exactly or in float64 and then rounded to
  float16 is the correctly rounded float16 result of the operation, because 53 >= 2 * 11 + 2 makes the
  double rounding innocuous for +, -, *, / (Figueroa 1995); the same holds for bfloat16 (p = 8).
* :func:`pack_bits` / :func:`unpack_bits`: LSB-first packing of ``bits``-bit codes along the last axis.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvqref.formats import as_exact_float


def round_bf16_bits(x: Any) -> np.ndarray:
    """uint16 bfloat16 bit patterns of ``x``: RNE from the exact value; overflow -> +-Inf; NaN -> 0x7FC0|sign."""
    v = as_exact_float(x).astype(np.float64)
    neg = np.signbit(v)
    a = np.abs(v)
    isnan = np.isnan(a)
    isinf = np.isinf(a)
    fin = np.where(isnan | isinf, 0.0, a)
    _, e1 = np.frexp(fin)
    emin, mbits = -126, 7
    e = np.where(fin == 0, emin, np.maximum(e1.astype(np.int64) - 1, emin))
    q = np.rint(np.ldexp(fin, (mbits - e).astype(np.int64)))
    mag = q.astype(np.int64) + ((e - emin) << mbits)
    mag = np.where((mag > 0x7F7F) | isinf, 0x7F80, mag)
    mag = np.where(isnan, 0x7FC0, mag)
    return (mag | (neg.astype(np.int64) << 15)).astype(np.uint16)


def bf16_value(bits: np.ndarray) -> np.ndarray:
    """float32 value of bfloat16 bit patterns (exact widening)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_bf16(x: Any) -> np.ndarray:
    """``x`` rounded to bfloat16 (RNE), returned as float32."""
    return bf16_value(round_bf16_bits(x))


def f16(x: Any) -> np.ndarray:
    """``x`` rounded to IEEE float16 (RNE, one rounding; overflow gives +-Inf, which callers check)."""
    with np.errstate(over="ignore"):
        return np.asarray(x).astype(np.float16)


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack integer codes (< 2**bits) along the last axis, LSB first: element c occupies bits
    ``[(c*bits) % 8, +bits)`` of byte ``(c*bits) // 8``. The last axis length * bits must be a multiple of 8."""
    c = np.asarray(codes).astype(np.uint8)
    per = 8 // bits
    if c.shape[-1] % per:
        raise ValueError(f"cannot pack {c.shape[-1]} {bits}-bit codes into whole bytes")
    c = c.reshape(*c.shape[:-1], c.shape[-1] // per, per)
    out = np.zeros(c.shape[:-1], dtype=np.uint8)
    for j in range(per):
        out |= (c[..., j] << (j * bits)).astype(np.uint8)
    return out


def unpack_bits(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: uint8 codes, last axis ``8 // bits`` times longer."""
    p = np.asarray(packed, dtype=np.uint8)
    per = 8 // bits
    mask = (1 << bits) - 1
    parts = [(p >> (j * bits)) & mask for j in range(per)]
    return np.stack(parts, axis=-1).reshape(*p.shape[:-1], p.shape[-1] * per).astype(np.uint8)
