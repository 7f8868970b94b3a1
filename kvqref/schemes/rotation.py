"""Rotated caches: a randomized Hadamard transform of every K/V head vector before a scheme quantizes it.

``schemes.get(name, rotation="hadamard", rotation_seed=s)`` wraps scheme ``name`` in a :class:`RotatedScheme`.
The stored fields are the inner scheme's fields of ``z = rotate(x)``, per (token, head) vector, with

    M = diag(signs) @ H @ C_D,   z = x @ M   (row vectors),

``H`` the D x D Sylvester Hadamard matrix (``H[i, j] = (-1)**popcount(i & j)``, entries +-1, ``H @ H = D I``),
``signs`` the seed's sign vector and ``C_D = f32(1 / sqrt(D))``. ``M`` is orthonormal up to ``C_D``'s
rounding: ``M @ M.T = D * C_D**2 * I`` with ``|D * C_D**2 - 1| <= 2**-23`` (exactly 1 when log2 D is even).

**Exact float32 rule** (what a write kernel must reproduce bit for bit), per vector of D = 2**n elements:

1. ``x`` is rounded to float32 once (RNE from the exact input; float32/bfloat16/float16 input is exact);
   non-finite input raises ValueError (a rotation would spread a NaN or Inf over the whole head).
2. ``y = x * signs`` (a sign flip: exact).
3. n butterfly stages, ``h = 1, 2, 4, ..., D/2`` in that order: for every ``j`` with ``j & h == 0``,
   ``(y[j], y[j + h]) <- (f32(y[j] + y[j + h]), f32(y[j] - y[j + h]))`` (IEEE float32 add and subtract,
   RNE, no fused operations). After the last stage ``y = (x * signs) @ H`` up to these roundings.
4. ``z = f32(y * C_D)``: one float32 multiply. ``C_D = 2**(-n/2)`` for even n (exact); for odd n,
   ``C_D = 2**(-(n+1)/2) * f32(sqrt 2)`` with ``f32(sqrt 2) = 0x3FB504F3`` (D = 128: ``0x3DB504F3``).
   A result that overflows float32 raises ValueError.

**Signs** (platform independent, no NumPy RNG): ``signs[i] = -1`` if bit 63 of ``splitmix64(seed)[i]`` is
set, else ``+1``, where ``splitmix64(seed)[i]`` is the i-th (0-based) output of SplitMix64 seeded with
``seed`` (Steele, Lea & Flood 2014: state ``+= 0x9E3779B97F4A7C15``, then
``z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9``, ``z = (z ^ z >> 27) * 0x94D049BB133111EB``, ``z ^ z >> 31``,
all modulo 2**64). The signs for head_dim D are the first D outputs. ``seed`` is an int in [0, 2**64).

**Other directions** (float64, the oracle's attention; exact inverses of the matrix actually applied):
``unrotate(z) = z @ M^-1 = ((z @ H) * signs) / (D * C_D)`` (the values ``dequantize`` returns) and
``rotate_query(q) = q @ M^-T = ((q * signs) @ H) / (D * C_D)``, so ``rotate_query(q) . (k @ M) = q . k``
and attention over a rotated cache, un-rotated at the output, equals attention over the unrotated one.
"""

from __future__ import annotations

import dataclasses
import numbers
from functools import lru_cache
from typing import Any

import numpy as np

from kvqref.formats import as_exact_float
from kvqref.schemes.base import FieldSpec, Quantized, Scheme

ROTATIONS = ("hadamard",)
_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
SQRT2_F32_BITS = 0x3FB504F3  # f32(sqrt 2) = 1.41421353816986083984375, the float32 nearest to sqrt 2


def splitmix64(seed: int, n: int) -> list[int]:
    """The first ``n`` outputs of SplitMix64 seeded with ``seed`` (Python ints in [0, 2**64))."""
    state, out = seed & _MASK64, []
    for _ in range(n):
        state = (state + _GAMMA) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        out.append(z ^ (z >> 31))
    return out


def check_seed(seed: Any) -> int:
    """``seed`` as an int in [0, 2**64): TypeError if it is not an integer (bool included), ValueError if out
    of range."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"rotation_seed must be an integer, got {seed!r} ({type(seed).__name__})")
    s = int(seed)
    if not 0 <= s <= _MASK64:
        raise ValueError(f"rotation_seed must be in [0, 2**64), got {s}")
    return s


def check_head_dim(head_dim: int, who: str = "hadamard rotation") -> int:
    """``head_dim`` if it is a power of two >= 2, else ValueError."""
    d = int(head_dim)
    if d < 2 or d & (d - 1):
        raise ValueError(f"{who}: head_dim must be a power of two >= 2 for a Hadamard rotation, got {head_dim}")
    return d


def norm_f32(head_dim: int) -> np.float32:
    """``C_D = f32(1 / sqrt(D))``, computed exactly (see the module docstring)."""
    n = check_head_dim(head_dim).bit_length() - 1
    if n % 2 == 0:
        return np.float32(2.0 ** (-n // 2))
    sqrt2 = np.array([SQRT2_F32_BITS], np.uint32).view(np.float32)[0]
    return np.float32(sqrt2 * np.float32(2.0 ** (-(n + 1) // 2)))


def butterflies(y: np.ndarray) -> np.ndarray:
    """``y @ H`` along the last axis by the butterfly stages ``h = 1, 2, ..., D/2`` in the dtype of ``y``
    (float32: each add and subtract rounds RNE in float32, the exact rule of step 3)."""
    D = y.shape[-1]
    lead = y.shape[:-1]
    h = 1
    while h < D:
        v = y.reshape(*lead, D // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        y = np.stack((a + b, a - b), axis=-2).reshape(*lead, D)
        h *= 2
    return y


@dataclasses.dataclass(frozen=True)
class HadamardRotation:
    """The randomized Hadamard rotation of one seed (the same matrix for every head, token and layer that
    uses the seed)."""

    seed: int = 0
    kind: str = "hadamard"

    def __post_init__(self) -> None:
        object.__setattr__(self, "seed", check_seed(self.seed))

    def signs(self, head_dim: int) -> np.ndarray:
        """float32 [D] of +-1 (module docstring, "Signs")."""
        return _signs(self.seed, check_head_dim(head_dim)).copy()

    def matrix(self, head_dim: int) -> np.ndarray:
        """float64 ``M = diag(signs) @ H * C_D`` [D, D] (for tests and documentation)."""
        D = check_head_dim(head_dim)
        return butterflies(np.diag(self.signs(D).astype(np.float64))) * float(norm_f32(D))

    def rotate(self, x: Any) -> np.ndarray:
        """float32 ``x @ M`` along the last axis by the exact float32 rule (steps 1-4)."""
        arr = np.asarray(x)
        D = check_head_dim(arr.shape[-1])
        v = as_exact_float(arr)
        if not np.isfinite(v).all():
            raise ValueError("hadamard rotation: input holds NaN or Inf, which a rotation spreads over the head")
        with np.errstate(over="ignore", invalid="ignore"):
            x32 = v.astype(np.float32)
            z = butterflies(x32 * _signs(self.seed, D)) * norm_f32(D)
        if not np.isfinite(z).all():
            raise ValueError("hadamard rotation: the input or its rotated values overflow float32")
        return z.astype(np.float32, copy=False)

    def unrotate(self, z: Any) -> np.ndarray:
        """float64 ``z @ M^-1``: the original-domain values of rotated ones."""
        zz = np.asarray(z, dtype=np.float64)
        D = check_head_dim(zz.shape[-1])
        return butterflies(zz) * _signs(self.seed, D) / (D * float(norm_f32(D)))

    def rotate_query(self, q: Any) -> np.ndarray:
        """float64 ``q @ M^-T``, so that ``rotate_query(q) . rotate(k) = q . k`` (up to rotate's rounding)."""
        qq = np.asarray(q, dtype=np.float64)
        D = check_head_dim(qq.shape[-1])
        return butterflies(qq * _signs(self.seed, D)) / (D * float(norm_f32(D)))

    def __str__(self) -> str:
        return f"hadamard(seed={self.seed})"


@lru_cache(maxsize=64)
def _signs(seed: int, head_dim: int) -> np.ndarray:
    s = np.array([-1.0 if u >> 63 else 1.0 for u in splitmix64(seed, head_dim)], np.float32)
    s.flags.writeable = False
    return s


class RotatedScheme(Scheme):
    """A scheme applied to ``rotation.rotate(x)``: the inner scheme's fields, bits and layout;
    ``dequantize`` returns original-domain values (``rotation.unrotate`` of the inner scheme's values).
    Other attributes (``role``, ``bits``, ``granularity``, ...) are the inner scheme's."""

    def __init__(self, inner: Scheme, rotation: HadamardRotation) -> None:
        if isinstance(inner, RotatedScheme):
            raise ValueError(f"{inner.name} is already rotated")
        self.inner, self.rotation = inner, rotation
        self.name = f"{inner.name}+{rotation}"
        self.token_group, self.residual_window, self.profile = (inner.token_group, inner.residual_window,
                                                                inner.profile)

    def __getattr__(self, attr: str) -> Any:
        if attr == "inner":  # not set yet (copying, unpickling)
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def fields(self, kv_heads: int, head_dim: int) -> dict[str, FieldSpec]:
        check_head_dim(head_dim, self.name)
        return self.inner.fields(kv_heads, head_dim)

    def check_params(self, params: dict[str, Any] | None, kv_heads: int | None = None) -> dict[str, Any]:
        """The inner scheme's check: given tensor-level params (a static FP8 scale, NVFP4's global scale) are
        the inner scheme's, applied to the rotated values."""
        return self.inner.check_params(params, kv_heads)

    def rotate_input(self, x: Any) -> np.ndarray:
        """The float32 values the inner scheme stores: ``rotation.rotate(x)`` of ``[tokens, kv_heads, D]``."""
        arr = self.check_input(x)
        check_head_dim(arr.shape[2], self.name)
        try:
            return self.rotation.rotate(arr)
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None

    def quantize(self, x: Any, params: dict[str, Any] | None = None) -> Quantized:
        q = self.inner.quantize(self.rotate_input(x), params)
        return dataclasses.replace(q, scheme=self.name)

    def calibrate(self, x: Any) -> dict[str, Any]:
        """The inner scheme's params of the rotated ``x`` (a static FP8 scale applies to rotated values)."""
        return self.inner.calibrate(self.rotate_input(x))

    def paged_tokens(self, total: int) -> int:
        return self.inner.paged_tokens(total)

    def dequantize(self, q: Quantized) -> np.ndarray:
        """float64 original-domain values; ValueError for a container another scheme (or seed) produced."""
        if q.scheme != self.name:
            raise ValueError(f"{self.name}: cannot dequantize a container of {q.scheme!r}: the rotation (or its "
                             "absence) of the stored values would be mixed up")
        return self.rotation.unrotate(self.inner.dequantize(q))

    def bits_per_element(self, head_dim: int, kv_heads: int = 1) -> float:
        """The inner scheme's: the signs are derived from the seed, not stored."""
        return self.inner.bits_per_element(head_dim, kv_heads)

    def describe(self) -> dict[str, str]:
        d = dict(self.inner.describe())
        d["scheme"] = f"{d.get('scheme', self.inner.name)} + {self.rotation}"
        d["rounding"] = "x @ M in float32 butterflies (docs/rotation.md), then " + d.get("rounding", "")
        return d

    def __repr__(self) -> str:
        return f"<rotated {self.rotation} {self.inner!r}>"


def rotation_of(scheme: Scheme) -> HadamardRotation | None:
    """The rotation of ``scheme`` (None for an unrotated one)."""
    return scheme.rotation if isinstance(scheme, RotatedScheme) else None


def storage_scheme(scheme: Scheme) -> Scheme:
    """The scheme that encodes the stored values (the inner scheme of a rotated one)."""
    return scheme.inner if isinstance(scheme, RotatedScheme) else scheme


def with_rotation(scheme: Scheme, rotation: Any = None, rotation_seed: Any = None) -> Scheme:
    """``scheme`` rotated as the options say: ``rotation`` None (no rotation; then ``rotation_seed`` must be
    None too) or ``"hadamard"`` (``rotation_seed`` an int, default 0)."""
    if rotation is None:
        if rotation_seed is not None:
            raise ValueError(f"{scheme.name}: rotation_seed={rotation_seed!r} given without rotation='hadamard'")
        return scheme
    if rotation not in ROTATIONS:
        raise ValueError(f"{scheme.name}: rotation must be None or one of {ROTATIONS}, got {rotation!r}")
    return RotatedScheme(scheme, HadamardRotation(0 if rotation_seed is None else check_seed(rotation_seed)))
