"""Static K/V scales from collected activations: by amax, by a percentile of |x|, or by minimising the mean
squared quantization error (MSE) over candidate scales.

Input per layer: K and V arrays ``[tokens, kv_heads, head_dim]`` (what the cache holds: keys after RoPE).
Output: a :class:`ScaleSet`, one float32 scale per layer and side (granularity ``tensor``) or one per KV
head (``head``). Schemes and what the scale is:

* ``fp8_e4m3`` / ``fp8_e5m2``: the FP8 scale ``s`` (stored value = ``decode(code) * s``).
  ``amax``: ``f32(f32(amax) / max_finite)``, the rule of :meth:`kvqref.schemes.FP8Scheme.calibrate`;
  ``percentile``: the same with ``amax`` replaced by the ``P``-th percentile of ``|x|`` (NumPy's default
  linear interpolation) over the granularity's elements; ``mse``: see below. A zero statistic gives 1.0.
* ``nvfp4``: the float32 global scale ``g`` (``amax / 2688`` by :class:`kvqref.schemes.NVFP4Scheme`);
  percentile and MSE likewise. Granularity ``tensor`` only: NVFP4Scheme, FlashInfer's
  ``nvfp4_kv_quantize(input, global_scale[1])`` and kvqref's write kernel take one global scale per tensor.

MSE search: candidates are ``f32(s_amax * 2**e)`` for ``e`` on a coarse grid of quarter steps from +1/4 down
to -4, then eighth-of-a-quarter steps around the best coarse one (24 evaluations, ``s_amax`` among them,
so MSE never does worse than amax on the calibration data). The error of a candidate is
``sum((dequantize(quantize(x)) - x)**2)`` computed by the oracle scheme itself (the chosen engine
``profile``, e.g. SGLang's bfloat16 arithmetic and, without saturation, NaN on overflow, which makes the
error infinite). FP8 quantization is elementwise, so the error is summed over the distinct values of
``x`` weighted by their counts (exact; bfloat16 activations have few distinct values). Ties go to the
candidate nearest ``s_amax``, then to the larger (an all-zero tensor keeps 1.0). Per-head scales are
searched per head. NVFP4 is not elementwise (blocks of 16), so each candidate quantizes the tensor itself;
to keep that fast the search runs on every ``ceil(T / 512)``-th token and its coarse grid spans +1/4 to -1
only (12 evaluations): g scales every block's E4M3 scale alike, so beyond that range it only moves the
largest block's scale into the 448 clamp or small blocks' into the 2**-6 floor.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvqref import schemes
from kvqref.schemes import FP8Scheme, NVFP4Scheme, Scheme

METHODS = ("amax", "percentile", "mse")
SCHEMES = ("fp8_e4m3", "fp8_e5m2", "nvfp4")
GRANULARITIES = ("tensor", "head")
NVFP4_RANGE = 448.0 * 6.0  # E4M3 max * E2M1 max
COARSE_STEPS = np.arange(1, -17, -1) / 4.0  # exponents +1/4 .. -4 (18 candidates)
NVFP4_COARSE_STEPS = np.arange(1, -5, -1) / 4.0  # exponents +1/4 .. -1 (6 candidates)
FINE_STEPS = np.array([-3, -2, -1, 1, 2, 3]) / 32.0  # around the best coarse exponent (6 more)
NVFP4_MSE_TOKENS = 512  # the NVFP4 search quantizes every ceil(T / 512)-th token


@dataclass
class ScaleSet:
    """Calibrated scales of a model: ``k[layer]`` / ``v[layer]`` float32 scalar (tensor) or ``[kv_heads]``
    (head). ``meta`` records how they were made (method, percentile, profile, model, tokens, text hash)."""

    scheme: str
    granularity: str
    k: list[np.ndarray]
    v: list[np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"ScaleSet: scheme must be one of {SCHEMES}, got {self.scheme!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"ScaleSet: granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if len(self.k) != len(self.v):
            raise ValueError(f"ScaleSet: {len(self.k)} K scales but {len(self.v)} V scales")
        for side, arrs in (("k", self.k), ("v", self.v)):
            for i, a in enumerate(arrs):
                a = np.asarray(a, dtype=np.float32)
                if (self.granularity == "tensor") != (a.ndim == 0) or a.ndim > 1:
                    raise ValueError(f"ScaleSet: layer {i} {side}_scale has shape {a.shape}, which does not fit "
                                     f"granularity {self.granularity!r}")
                if not (np.isfinite(a).all() and (a > 0).all()):
                    raise ValueError(f"ScaleSet: layer {i} {side}_scale must be positive and finite, got {a}")
                arrs[i] = a

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def param_name(self) -> str:
        """The scheme param the scale is: ``scale`` (FP8) or ``global_scale`` (NVFP4)."""
        return "global_scale" if self.scheme == "nvfp4" else "scale"

    def params(self, layer: int, side: str) -> dict[str, Any]:
        """Tensor-level params for ``PagedKVCache(k_params=..., v_params=...)`` / ``scheme.quantize``."""
        s = self._side(side)[self._layer(layer)]
        return {self.param_name: s.copy() if s.ndim else np.float32(s)}

    def scheme_for(self, layer: int, side: str, **options: Any) -> Scheme:
        """The scheme with this layer's static scale (``options``: e.g. ``profile="sglang"``)."""
        s = self._side(side)[self._layer(layer)]
        if self.scheme == "nvfp4":
            return schemes.get("nvfp4", global_scale=float(s), **options)
        return schemes.get(self.scheme, granularity=self.granularity, scale=s, **options)

    def _side(self, side: str) -> list[np.ndarray]:
        if side not in ("k", "v"):
            raise ValueError(f"side must be 'k' or 'v', got {side!r}")
        return self.k if side == "k" else self.v

    def _layer(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range: the scales cover {self.num_layers} layers")
        return layer


def _range(scheme: str, profile: str) -> float:
    """The value a scale of 1 maps the largest code to: FP8 max finite (448 / 57344) or NVFP4's 2688."""
    if scheme == "nvfp4":
        return NVFP4_RANGE
    return float(_fp8(scheme, profile).codec.max_finite)


def _fp8(scheme: str, profile: str) -> FP8Scheme:
    if profile == "rocm":
        raise ValueError("calibrate the OCP scale (profile 'vllm'); vLLM and SGLang double it on ROCm FNUZ")
    return FP8Scheme(scheme, granularity="tensor", profile=profile)


def scale_from_stat(stat: np.ndarray, scheme: str, profile: str = "vllm") -> np.ndarray:
    """``f32(f32(stat) / range)``, 1.0 where ``stat == 0`` (float32, same shape as ``stat``)."""
    stat = np.asarray(stat, dtype=np.float32)
    s = (stat / np.float32(_range(scheme, profile))).astype(np.float32)
    return np.where(stat == 0, np.float32(1.0), s).astype(np.float32)


def _stat(x: np.ndarray, granularity: str, method: str, percentile: float) -> np.ndarray:
    a = np.abs(x.astype(np.float32))
    axis = None if granularity == "tensor" else (0, 2)
    if method == "percentile":
        return np.asarray(np.percentile(a, percentile, axis=axis), dtype=np.float32)
    return np.asarray(a.max(axis=axis, initial=0.0), dtype=np.float32)


def _sse_fp8(fp8: FP8Scheme, values: np.ndarray, counts: np.ndarray, s: np.float32) -> float:
    q = fp8.quantize(values.reshape(-1, 1, 1), params={"scale": np.float32(s)})
    err = fp8.dequantize(q).ravel() - values.astype(np.float64)
    e = float(np.sum(counts * err * err))
    return np.inf if not np.isfinite(e) else e


def _sse_nvfp4(x: np.ndarray, g: np.float32) -> float:
    nv = NVFP4Scheme(global_scale=float(g))
    try:
        err = nv.dequantize(nv.quantize(x)) - x.astype(np.float64)
    except ValueError:  # a global scale that makes a block divisor 0 or Inf in float32
        return np.inf
    return float(np.sum(err * err))


def mse_search(sse: Callable[[np.float32], float], s_amax: np.float32,
               coarse: np.ndarray = COARSE_STEPS) -> np.float32:
    """The candidate scale (see the module docstring) with the least ``sse``; ties to the one nearest
    ``s_amax``, then to the larger."""
    tried: dict[float, float] = {}

    def ev(e: float) -> float:
        if e not in tried:
            tried[e] = sse(np.float32(s_amax * np.float32(2.0**e)))
        return tried[e]

    def key(e: float) -> tuple[float, float, float]:  # least error; ties: nearest amax, then larger
        return (-ev(e), -abs(e), e)

    best = max((float(e) for e in coarse), key=key)
    for d in FINE_STEPS:
        ev(best + float(d))
    e_best = max(tried, key=key)
    return np.float32(s_amax * np.float32(2.0**e_best))


def calibrate_tensor(x: Any, scheme: str = "fp8_e4m3", method: str = "amax", granularity: str = "tensor", *,
                     percentile: float = 99.99, profile: str = "vllm", margin: float = 1.0) -> np.ndarray:
    """The static scale of one K or V tensor ``[tokens, kv_heads, head_dim]``: float32 scalar (tensor) or
    float32 ``[kv_heads]`` (head), times ``margin`` (``f32(s * f32(margin))``: headroom for activations
    larger than the calibration data's)."""
    s = _calibrate(x, scheme, method, granularity, percentile, profile)
    if not (np.isfinite(margin) and margin > 0):
        raise ValueError(f"calibrate: margin must be positive and finite, got {margin}")
    if margin == 1.0:
        return s
    out = (s * np.float32(margin)).astype(np.float32)
    return out if out.ndim else np.float32(out)


def _calibrate(x: Any, scheme: str, method: str, granularity: str, percentile: float,
               profile: str) -> np.ndarray:
    if scheme not in SCHEMES:
        raise ValueError(f"calibrate: scheme must be one of {SCHEMES}, got {scheme!r}")
    if method not in METHODS:
        raise ValueError(f"calibrate: method must be one of {METHODS}, got {method!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"calibrate: granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if scheme == "nvfp4" and granularity != "tensor":
        raise ValueError("calibrate: nvfp4 has one global scale per tensor (NVFP4Scheme, FlashInfer "
                         "nvfp4_kv_quantize, kvqref's write kernel); use --granularity tensor")
    if not 0 < percentile <= 100:
        raise ValueError(f"calibrate: percentile must be in (0, 100], got {percentile}")
    arr = np.asarray(x)
    if arr.ndim != 3 or 0 in arr.shape:
        raise ValueError(f"calibrate: expected a non-empty [tokens, kv_heads, head_dim] array, got {arr.shape}")
    arr = arr.astype(np.float32)
    if not np.isfinite(arr).all():
        raise ValueError("calibrate: the activations hold NaN or Inf")
    stat_method = "amax" if method == "mse" else method
    s0 = scale_from_stat(_stat(arr, granularity, stat_method, percentile), scheme, profile)
    if method != "mse":
        return s0
    if scheme == "nvfp4":
        sub = arr[:: -(-arr.shape[0] // NVFP4_MSE_TOKENS)]
        return mse_search(lambda g: _sse_nvfp4(sub, g), s0, NVFP4_COARSE_STEPS)
    fp8 = _fp8(scheme, profile)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sglang profile: overflow to NaN is expected for small candidates
        if granularity == "tensor":
            vals, counts = np.unique(arr, return_counts=True)
            return mse_search(lambda s: _sse_fp8(fp8, vals, counts, s), s0)
        out = np.empty(arr.shape[1], np.float32)
        for h in range(arr.shape[1]):
            vals, counts = np.unique(arr[:, h], return_counts=True)
            out[h] = mse_search(lambda s, v=vals, c=counts: _sse_fp8(fp8, v, c, s), s0[h])
        return out


def calibrate(kv: Sequence[tuple[Any, Any]], scheme: str = "fp8_e4m3", method: str = "amax",
              granularity: str = "tensor", *, percentile: float = 99.99, profile: str = "vllm", margin: float = 1.0,
              progress: Callable[[int, int], None] | None = None, meta: dict[str, Any] | None = None) -> ScaleSet:
    """Scales of every layer from ``kv[layer] = (K, V)``; ``progress(done, total)`` after each layer."""
    ks, vs = [], []
    opts = dict(percentile=percentile, profile=profile, margin=margin)
    for i, (k, v) in enumerate(kv):
        ks.append(calibrate_tensor(k, scheme, method, granularity, **opts))
        vs.append(calibrate_tensor(v, scheme, method, granularity, **opts))
        if progress:
            progress(i + 1, len(kv))
    info = {"method": method, "profile": profile, **({"percentile": percentile} if method == "percentile" else {}),
            **({"margin": margin} if margin != 1.0 else {})}
    return ScaleSet(scheme, granularity, ks, vs, {**info, **(meta or {})})
