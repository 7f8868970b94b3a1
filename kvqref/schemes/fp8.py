"""``fp8_e4m3`` / ``fp8_e5m2``: one FP8 code per element times a float32 scale.

Dequantized value = ``decode(code) * scale`` (float64). The scale is per tensor (``params["scale"]``,
float32 scalar), per KV head (``params["scale"]``, float32[H]) or per (token, head) (field ``"scale"``,
float32). A computed scale is ``float32(amax) / float32(max_finite)`` in float32 (amax over the
granularity's elements); amax == 0 gives scale 1.0. Profiles (the arithmetic of ``q = x / scale``):

* ``vllm`` (default) and ``ocp``: ``x`` as float32 (float64 input rounded once, RNE), ``q = x / scale``
  as one IEEE float32 division, then RNE to FP8, saturating to +-max finite (Inf saturates too).
* ``sglang``: SGLang's ``cache_k.div_(k_scale)`` in the model dtype (bfloat16; ``x`` is rounded to bfloat16
  first), then ``.to(fp8)``. ``sglang_scale="tensor"`` (default; the checkpoint's ``k_scale`` Parameter, a
  float32 0-dim tensor): ``bf16(f32(x) / f32(bf16(scale)))``; ``sglang_scale="float"`` (a Python float, as
  ``--quantization-param-path`` sets it): ``bf16(f32(f32(x) * f32(1 / scale)))``. The cast is non-saturating
  (``saturate=False``, torch <= 2.11): overflow gives the NaN code (E4M3FN 0x7F/0xFF, E5M2 +-Inf) and a
  warning; ``saturate=True`` models torch >= 2.12, whose e4m3fn cast saturates. See docs/engines.md section 2.
* ``rocm``: as ``vllm`` in the FNUZ formats (E4M3FNUZ max 240). *Given* (static) scales are OCP
  checkpoint scales and are doubled (``scale_fnuz = 2 * scale_ocp``), as vLLM does on MI300, because the
  same bits mean half the value in FNUZ; computed scales use max 240 directly and are not doubled.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np

from kvqref import formats
from kvqref.schemes._num import round_bf16
from kvqref.schemes.base import FieldSpec, Quantized, Scheme

GRANULARITIES = ("tensor", "head", "token_head")
PROFILES = ("vllm", "sglang", "rocm", "ocp")


def load_sglang_scales(path: str | os.PathLike, rank: int, layer: int) -> float:
    """The KV scale of ``layer`` on TP ``rank`` from SGLang's ``--quantization-param-path`` JSON:
    ``{"kv_cache": {"dtype": ..., "scaling_factor": {rank: {layer: s}}}}`` (one scale for K and V).
    Reading and writing that file live in :mod:`kvqref.calibration.files`."""
    from kvqref.calibration.files import load_sglang_scales as load

    return load(path, rank, layer)


class FP8Scheme(Scheme):
    """FP8 codes ``{"codes": (D,) uint8}`` (+ ``{"scale": () float32}`` for ``token_head``)."""

    def __init__(self, name: str, *, granularity: str = "tensor", scale: Any = None, static: bool = False,
                 profile: str = "vllm", fnuz: bool | None = None, sglang_scale: str = "tensor",
                 saturate: bool | None = None) -> None:
        if name not in ("fp8_e4m3", "fp8_e5m2"):
            raise ValueError(f"FP8 scheme name must be fp8_e4m3 or fp8_e5m2, got {name!r}")
        if granularity not in GRANULARITIES:
            raise ValueError(f"{name}: granularity must be one of {GRANULARITIES}, got {granularity!r}")
        if profile not in PROFILES:
            raise ValueError(f"{name}: profile must be one of {PROFILES}, got {profile!r}")
        if sglang_scale not in ("tensor", "float"):
            raise ValueError(f"{name}: sglang_scale must be 'tensor' or 'float', got {sglang_scale!r}")
        self.sglang_scale = sglang_scale
        self.saturate = (profile != "sglang") if saturate is None else bool(saturate)
        self.name = name
        self.granularity = granularity
        self.profile = profile
        self.fnuz = (profile == "rocm") if fnuz is None else bool(fnuz)
        base = "float8_e4m3fn" if name == "fp8_e4m3" else "float8_e5m2"
        self.format = base + ("uz" if name == "fp8_e4m3" else "fnuz") if self.fnuz else base
        self.codec = formats.get(self.format)
        self.static = bool(static) or scale is not None
        if scale is None and static:
            warnings.warn(f"{name}: static scales requested but none given; using scale 1.0", stacklevel=2)
            scale = 1.0
        if scale is not None:
            if granularity == "token_head":
                raise ValueError(f"{name}: a static scale needs granularity 'tensor' or 'head', not 'token_head'")
            s = np.asarray(scale, dtype=np.float64)
            if s.ndim > 1 or (granularity == "tensor" and s.ndim != 0):
                raise ValueError(f"{name}: static {granularity} scale must be a scalar (tensor) or [kv_heads] "
                                 f"array (head), got shape {s.shape}")
            if not (np.all(np.isfinite(s)) and np.all(s > 0)):
                raise ValueError(f"{name}: scales must be positive and finite, got {scale!r}")
            s = s.astype(np.float32)
            if self.fnuz and profile == "rocm":
                s = (s * np.float32(2)).astype(np.float32)  # OCP checkpoint scale -> FNUZ (exact: power of 2)
            self._static = s
        else:
            self._static = None

    # -- layout -----------------------------------------------------------------------------
    def fields(self, kv_heads: int, head_dim: int) -> dict[str, FieldSpec]:
        f = {"codes": FieldSpec((head_dim,), np.dtype(np.uint8))}
        if self.granularity == "token_head":
            f["scale"] = FieldSpec((), np.dtype(np.float32))
        return f

    def bits_per_element(self, head_dim: int, kv_heads: int = 1) -> float:
        """8, plus 32 / head_dim for per-token-head scales (per-tensor/per-head scales are not per token)."""
        return 8.0 + (32.0 / head_dim if self.granularity == "token_head" else 0.0)

    # -- scales -----------------------------------------------------------------------------
    def _amax_scale(self, amax: np.ndarray) -> np.ndarray:
        s = (amax.astype(np.float32) / np.float32(self.codec.max_finite)).astype(np.float32)
        return np.where(amax == 0, np.float32(1.0), s).astype(np.float32)

    def calibrate(self, x: Any) -> dict[str, Any]:
        """``{"scale": float32 scalar}`` (tensor) or ``{"scale": float32[H]}`` (head); ``{}`` for token_head."""
        arr = self._checked(x)
        if self.granularity == "token_head":
            return {}
        if self._static is not None:
            s = self._static
            if self.granularity == "head" and s.ndim == 0:
                s = np.full(arr.shape[1], s, dtype=np.float32)
            if self.granularity == "head" and s.shape != (arr.shape[1],):
                raise ValueError(f"{self.name}: per-head scale has {s.shape[0]} entries for {arr.shape[1]} heads")
            return {"scale": s.copy() if s.ndim else np.float32(s)}
        a = np.abs(arr.astype(np.float32))
        if self.granularity == "tensor":
            return {"scale": np.float32(self._amax_scale(a.max(initial=0.0)))}
        return {"scale": self._amax_scale(a.max(axis=(0, 2), initial=0.0))}

    def _checked(self, x: Any) -> np.ndarray:
        arr = self.check_input(x)
        v = arr.astype(np.float64)
        if np.isnan(v).any():
            raise ValueError(f"{self.name}: input holds NaN")
        if self._static is None and np.isinf(v).any():
            raise ValueError(f"{self.name}: input holds Inf, so a computed (amax) scale is undefined")
        return arr

    # -- codec ------------------------------------------------------------------------------
    def quantize(self, x: Any, params: dict[str, Any] | None = None) -> Quantized:
        arr = self._checked(x)
        T, H, D = arr.shape
        fields: dict[str, np.ndarray] = {}
        if self.granularity == "token_head":
            s = self._amax_scale(np.abs(arr.astype(np.float32)).max(axis=2, initial=0.0))
            fields["scale"] = s
            sb = s[:, :, None]
            params = {}
        else:
            params = self.calibrate(arr) if params is None else params
            s = np.asarray(params["scale"], dtype=np.float32)
            if self.granularity == "head" and s.shape != (H,):
                raise ValueError(f"{self.name}: per-head scale shape {s.shape} does not match {H} kv heads")
            if self.granularity == "tensor" and s.ndim != 0:
                raise ValueError(f"{self.name}: per-tensor scale must be a scalar, got shape {s.shape}")
            sb = s[None, :, None] if s.ndim else s
        if self.profile == "sglang":
            xb = round_bf16(arr)  # float32
            if self.sglang_scale == "tensor":
                q = round_bf16((xb / round_bf16(sb)).astype(np.float32))
            else:
                inv = (1.0 / sb.astype(np.float64)).astype(np.float32)
                q = round_bf16((xb * inv).astype(np.float32))
        else:
            q = (arr.astype(np.float32) / sb.astype(np.float32)).astype(np.float32)
        codes = self.codec.encode(q, saturate=self.saturate)
        if not self.saturate:
            n = int(np.isnan(self.codec.decode(codes)).sum() + np.isinf(self.codec.decode(codes)).sum())
            if n:
                warnings.warn(f"{self.name} ({self.profile} profile, non-saturating): {n} element(s) overflowed "
                              "to NaN/Inf", stacklevel=2)
        fields = {"codes": codes, **fields}
        return Quantized(self.name, (T, H, D), fields, params)

    def dequantize(self, q: Quantized) -> np.ndarray:
        v = self.codec.decode(q.fields["codes"]).astype(np.float64)
        if self.granularity == "token_head":
            return v * q.fields["scale"].astype(np.float64)[:, :, None]
        s = np.asarray(q.params["scale"], dtype=np.float64)
        return v * (s[None, :, None] if s.ndim else s)

    def describe(self) -> dict[str, str]:
        arith = {"sglang": f"bf16 division ({self.sglang_scale} scale)",
                 "rocm": "x / scale in float32; static OCP scales doubled"}.get(self.profile, "x / scale in float32")
        return {"scheme": self.name, "format": self.format,
                "scale rule": f"{self.granularity}: amax / {self.codec.max_finite:g} or static; {arith}",
                "rounding": "RNE", "overflow": f"saturate to +-{self.codec.max_finite:g}" if self.saturate
                else "NaN code (E5M2: Inf), warning",
                "packing": "codes (D,) uint8" + ("; scale () float32" if self.granularity == "token_head" else "")}

    def __repr__(self) -> str:
        return f"<scheme {self.name} {self.format} {self.granularity} profile={self.profile}>"
