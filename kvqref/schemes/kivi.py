"""``int4_kivi`` / ``int2_kivi``: KIVI's asymmetric min/max integer quantization (Liu et al. 2024).

Arithmetic (KIVI's code, ``quant/new_pack.py``, on a float16 model): the input is rounded to float16, then
per group ``mn = min``, ``mx = max``, ``scale = f16(f16(mx - mn) / (2**bits - 1))``,
``q = rint(clamp(f16(f16(x - mn) / scale), 0, 2**bits - 1))`` (clamp, then round half to even: torch's
``clamp_().round_()``). Every step is one correctly rounded float16 operation. A group whose scale is 0
(constant group, or a range that underflows float16) gets codes 0, so its value is ``mn`` (exact for
float16 input); KIVI itself computes 0/0 there. A range that overflows float16 raises ValueError.
Value = ``q * scale + zero`` in float64 from the stored float16 ``scale`` and ``zero`` (= mn).

Grouping: values (``role="value"``) per token over G consecutive channels; keys (``role="key"``) per
channel over G consecutive tokens (token groups aligned at multiples of G). Codes of one token are packed
LSB first along channels (:func:`kvqref.schemes._num.pack_bits`).

Residual window (``residual``, R, default 128; float32 in kvqref, float16 in KIVI) and streaming, as
KIVI's ``LlamaAttention_KIVI.forward``: keys: a prefill of T tokens quantizes the first ``T - T % R``;
each decoded token is appended to the residual and, when it holds R tokens, all R are quantized (R / G
groups) and the residual empties, so after any append ``T - (T // R) * R`` keys are full precision.
Values: a prefill keeps the last ``min(T, R)`` tokens full precision; each decoded token beyond R pushes
the oldest one into the quantized part. :meth:`KiviScheme.paged_tokens` gives those counts.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvqref.formats import as_exact_float
from kvqref.schemes._num import f16, pack_bits, unpack_bits
from kvqref.schemes.base import FieldSpec, Quantized, Scheme
from kvqref.schemes.validate import check_integer_option


def signed_zero_min_max(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(min, max) over ``axis`` (keepdims) with -0.0 < +0.0: a minimum of zero is -0.0 if the group holds a
    -0.0, else +0.0; a maximum of zero is +0.0 if it holds a +0.0, else -0.0. (IEEE comparison leaves the sign
    of a zero min/max to the implementation: NumPy's and the kernels' reductions may pick either.)"""
    mn = x.min(axis=axis, keepdims=True)
    mx = x.max(axis=axis, keepdims=True)
    zero = x == 0
    neg0 = np.any(zero & np.signbit(x), axis=axis, keepdims=True)
    pos0 = np.any(zero & ~np.signbit(x), axis=axis, keepdims=True)
    mn = np.where(mn == 0, np.where(neg0, -0.0, 0.0), mn).astype(x.dtype)
    mx = np.where(mx == 0, np.where(pos0, 0.0, -0.0), mx).astype(x.dtype)
    return mn, mx


class KiviScheme(Scheme):
    """Fields (value role): ``{"codes": (D*bits//8,) uint8, "scale": (D//G,) float16, "zero": (D//G,) float16}``
    per token. Key role: ``codes`` per token, ``scale``/``zero`` ``(D,) float16`` per group of G tokens."""

    profile = "kivi"

    def __init__(self, name: str, *, role: str = "value", group_size: int = 32, residual: int = 128,
                 profile: str = "kivi") -> None:
        bits = {"int4_kivi": 4, "int2_kivi": 2}.get(name)
        if bits is None:
            raise ValueError(f"KIVI scheme name must be int4_kivi or int2_kivi, got {name!r}")
        if role not in ("key", "value"):
            raise ValueError(f"{name}: role must be 'key' or 'value', got {role!r}")
        if profile != "kivi":
            raise ValueError(f"{name}: the only profile is 'kivi', got {profile!r}")
        group_size = check_integer_option(name, "group_size", group_size, minimum=1)
        residual = check_integer_option(name, "residual", residual, minimum=0)
        if role == "key" and residual % group_size:
            raise ValueError(f"{name}: residual window {residual} must be a multiple of the group size {group_size}")
        self.name, self.bits, self.role = name, bits, role
        self.group_size, self.residual_window = group_size, residual
        self.token_group = group_size if role == "key" else 1
        self.maxint = (1 << bits) - 1

    # -- layout -----------------------------------------------------------------------------
    def fields(self, kv_heads: int, head_dim: int) -> dict[str, FieldSpec]:
        if (head_dim * self.bits) % 8:
            raise ValueError(f"{self.name}: head_dim {head_dim} does not fill whole bytes at {self.bits} bits")
        codes = FieldSpec((head_dim * self.bits // 8,), np.dtype(np.uint8))
        if self.role == "value":
            if head_dim % self.group_size:
                raise ValueError(f"{self.name}: head_dim {head_dim} is not divisible by the group size "
                                 f"{self.group_size}")
            g = (head_dim // self.group_size,)
            return {"codes": codes, "scale": FieldSpec(g, np.dtype(np.float16)),
                    "zero": FieldSpec(g, np.dtype(np.float16))}
        return {"codes": codes, "scale": FieldSpec((head_dim,), np.dtype(np.float16), per="group"),
                "zero": FieldSpec((head_dim,), np.dtype(np.float16), per="group")}

    def bits_per_element(self, head_dim: int, kv_heads: int = 1) -> float:
        """bits + 2 * 16 / G (a float16 scale and min per G elements): int4 G=32: 5; int2: 3."""
        return self.bits + 32.0 / self.group_size

    def paged_tokens(self, total: int) -> int:
        """Quantized tokens of a ``total``-token sequence (KIVI's rule; see the module docstring)."""
        if self.role == "value":
            return max(total - self.residual_window, 0)
        w = self.residual_window or self.group_size
        return (total // w) * w

    # -- codec ------------------------------------------------------------------------------
    def _quant_groups(self, x16: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Quantize float16 ``x16`` with min/max over ``axis``; returns (q uint8, scale f16, mn f16). Zeros are
        ordered -0.0 < +0.0 (:func:`signed_zero_min_max`), so the stored min of a group of zeros is defined."""
        mn, mx = signed_zero_min_max(x16, axis)
        rng = f16(mx.astype(np.float64) - mn.astype(np.float64))
        if np.isinf(rng).any():
            raise ValueError(f"{self.name}: a group's range max - min overflows float16")
        scale = f16(rng.astype(np.float64) / self.maxint)
        d = f16(x16.astype(np.float64) - mn.astype(np.float64))
        safe = np.where(scale == 0, np.float16(1), scale)
        y = f16(d.astype(np.float64) / safe.astype(np.float64)).astype(np.float64)
        q = np.rint(np.clip(y, 0, self.maxint))
        q = np.where(scale == 0, 0, q).astype(np.uint8)
        return q, np.squeeze(scale, axis), np.squeeze(mn, axis)

    def _input16(self, x: Any) -> np.ndarray:
        arr = self.check_input(x)
        v = as_exact_float(arr)
        if not np.isfinite(v).all():
            raise ValueError(f"{self.name}: input holds NaN or Inf")
        x16 = f16(v)
        if not np.isfinite(x16).all():
            raise ValueError(f"{self.name}: input exceeds the float16 range (KIVI computes in float16)")
        return x16

    def quantize(self, x: Any, params: dict[str, Any] | None = None) -> Quantized:
        self.check_params(params)
        x16 = self._input16(x)
        T, H, D = x16.shape
        G = self.group_size
        self.fields(H, D)
        if self.role == "value":
            q, scale, mn = self._quant_groups(x16.reshape(T, H, D // G, G), axis=3)
            q = q.reshape(T, H, D)
        else:
            if T % G:
                raise ValueError(f"{self.name} (key): {T} tokens is not a multiple of the group size {G}; "
                                 "keys are quantized in whole groups of tokens")
            q, scale, mn = self._quant_groups(x16.reshape(T // G, G, H, D), axis=1)
            q = q.reshape(T, H, D)
        return Quantized(self.name, (T, H, D), {"codes": pack_bits(q, self.bits), "scale": scale, "zero": mn}, {})

    def codes(self, q: Quantized) -> np.ndarray:
        """Unpacked integer codes [T, H, D]."""
        return unpack_bits(q.fields["codes"], self.bits)

    def dequantize(self, q: Quantized) -> np.ndarray:
        T, H, D = q.shape
        c = self.codes(q).astype(np.float64)
        s, z = q.fields["scale"].astype(np.float64), q.fields["zero"].astype(np.float64)
        G = self.group_size
        if self.role == "value":
            c = c.reshape(T, H, D // G, G)
            return (c * s[..., None] + z[..., None]).reshape(T, H, D)
        c = c.reshape(T // G, G, H, D)
        return (c * s[:, None] + z[:, None]).reshape(T, H, D)

    def describe(self) -> dict[str, str]:
        grp = (f"per token, {self.group_size} channels" if self.role == "value"
               else f"per channel, {self.group_size} tokens")
        return {"scheme": f"{self.name} ({self.role})", "format": f"uint{self.bits} asymmetric",
                "scale rule": f"(max-min)/{self.maxint} in fp16, {grp}; residual {self.residual_window}",
                "rounding": "fp16 (x-min)/scale, clamp, round half even", "overflow": f"clamp [0, {self.maxint}]",
                "packing": f"codes LSB-first {self.bits}-bit along channels; scale/zero f16"}

    def __repr__(self) -> str:
        return f"<scheme {self.name} role={self.role} G={self.group_size} R={self.residual_window}>"


def to_kivi_layout(scheme: KiviScheme, q: Quantized) -> dict[str, np.ndarray]:
    """The container in KIVI's own layout (batch 1), as ``triton_quantize_and_pack_along_last_dim`` returns:
    codes packed LSB first into int32 words of ``32 // bits`` codes along the last axis.

    Keys (quantized transposed, ``[nh, D, T]``): ``code`` int32 [H, D, T*bits/32], ``scale``/``mn`` float16
    [H, D, T/G]. Values (``[nh, T, D]``): ``code`` int32 [H, T, D*bits/32], ``scale``/``mn`` float16 [H, T, D/G].
    """
    T, H, D = q.shape
    c = scheme.codes(q).astype(np.uint32)
    per = 32 // scheme.bits
    if scheme.role == "key":
        c = c.transpose(1, 2, 0)  # [H, D, T]
        scale, mn = q.fields["scale"].transpose(1, 2, 0), q.fields["zero"].transpose(1, 2, 0)
    else:
        c = c.transpose(1, 0, 2)  # [H, T, D]
        scale, mn = q.fields["scale"].transpose(1, 0, 2), q.fields["zero"].transpose(1, 0, 2)
    if c.shape[-1] % per:
        raise ValueError(f"{scheme.name}: KIVI packs {per} codes per int32; axis of {c.shape[-1]} does not divide")
    c = c.reshape(*c.shape[:-1], c.shape[-1] // per, per)
    words = np.zeros(c.shape[:-1], dtype=np.uint32)
    for j in range(per):
        words |= c[..., j] << np.uint32(j * scheme.bits)
    return {"code": words.view(np.int32), "scale": np.ascontiguousarray(scale), "mn": np.ascontiguousarray(mn)}
