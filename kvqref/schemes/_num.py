"""Exact rounding helpers shared by the schemes, written from the IEEE definitions.

* :func:`round_bf16_bits`: bfloat16 (8 exponent bits, 7 mantissa bits, bias 127, IEEE Inf/NaN) bit
  pattern of a float32/float64 value, round to nearest, ties to even, in one rounding from the exact input.
* :func:`f16`: IEEE binary16 rounding (NumPy's float16 conversion rounds to nearest even, in one rounding
  from float64 and float32). An arithmetic result computed exactly or in float64 and then rounded to
  float16 is the correctly rounded float16 result of the operation, because 53 >= 2 * 11 + 2 makes the
  double rounding innocuous for +, -, *, / (Figueroa 1995); the same holds for bfloat16 (p = 8).
* :func:`pack_bits` / :func:`unpack_bits`: LSB-first packing of ``bits``-bit codes along the last axis.
* :func:`model_dtype_of` / :func:`model_values`: the model dtype an engine profile computes in, and the
  input values as the model holds them (see "Model dtypes" in docs/engines.md).
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


#: the model dtypes (of K/V handed to an engine's cache write) kvqref reproduces, by NumPy dtype name
MODEL_DTYPES = ("bfloat16", "float16", "float32")


def model_dtype_of(label: str, engine: str, input_dtype: str, model_dtype: str | None,
                   accepts: tuple[str, ...]) -> str:
    """The model dtype whose arithmetic a profile reproduces, for an input array of dtype ``input_dtype``.

    ``model_dtype`` (a scheme option) wins; otherwise a float16 array means a float16 model, a bfloat16
    (ml_dtypes) array a bfloat16 model, and float32 (or float64, integer) input a float32 model. A 16-bit
    input whose dtype contradicts ``model_dtype``, or a model dtype the engine does not accept, raises
    ValueError naming the engine and the dtypes it accepts.
    """
    if model_dtype is not None and model_dtype not in accepts:
        raise ValueError(f"{label}: {engine} accepts K/V in {', '.join(accepts)}; got model_dtype={model_dtype!r}")
    if model_dtype is not None and input_dtype in ("bfloat16", "float16") and input_dtype != model_dtype:
        raise ValueError(f"{label}: the input is a {input_dtype} array but model_dtype={model_dtype!r}; a model "
                         "has one dtype (pass float32 values to have them rounded to model_dtype)")
    md = model_dtype or (input_dtype if input_dtype in ("bfloat16", "float16") else "float32")
    if md not in accepts:
        raise ValueError(f"{label}: {engine} accepts K/V in {', '.join(accepts)}, not {md}")
    return md


def round_to(x: Any, dtype: str) -> np.ndarray:
    """``x`` rounded once (RNE) to ``dtype`` ("bfloat16", "float16" or "float32"), returned as float32."""
    if dtype == "bfloat16":
        return round_bf16(x)
    v = as_exact_float(x)
    with np.errstate(over="ignore"):
        return (f16(v) if dtype == "float16" else v).astype(np.float32)


def model_values(label: str, x: np.ndarray, md: str) -> np.ndarray:
    """The values of ``x`` as a ``md`` model holds them (float32 array): 16-bit input as it is, float32/float64
    input rounded once to ``md``. A finite value that overflows ``md`` raises ValueError."""
    v = as_exact_float(x)
    out = round_to(v, md)
    over = np.isinf(out) & np.isfinite(v)
    if over.any():
        raise ValueError(f"{label}: {int(over.sum())} input value(s) overflow {md} (e.g. {v[over].flat[0]:g})")
    return out


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
