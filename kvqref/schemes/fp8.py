"""``fp8_e4m3`` / ``fp8_e5m2``: one FP8 code per element times a float32 scale.

Dequantized value = ``decode(code) * scale`` (float64). The scale is per tensor (``params["scale"]``,
float32 scalar), per KV head (``params["scale"]``, float32[H]) or per (token, head) (field ``"scale"``,
float32). A computed scale is ``float32(amax) / float32(max_finite)`` in float32 (amax over the
granularity's elements); amax == 0 gives scale 1.0. Profiles (the arithmetic of ``q = x / scale``):

* ``vllm`` (default) and ``ocp``: ``x`` as float32 (float64 input rounded once, RNE), ``q = x / scale``
  as one IEEE float32 division, then RNE to FP8, saturating to +-max finite (Inf saturates too). vLLM's
  ``reshape_and_cache_flash`` widens bfloat16, float16 and float32 K/V exactly to float32 before dividing,
  so the model dtype changes nothing but the input values.
* ``sglang``: SGLang's ``cache_k.div_(k_scale)`` in the model dtype ``m`` (bfloat16, float16 or float32),
  then ``.to(fp8)``. ``sglang_scale="tensor"`` (default; the checkpoint's ``k_scale`` Parameter, a float32
  0-dim tensor, cast to ``m`` by torch's type promotion): ``m(f32(x) / f32(m(scale)))``;
  ``sglang_scale="float"`` (a Python float, as ``--quantization-param-path`` sets it: torch multiplies by
  the float32 reciprocal of the scale converted to float32, ``opmath_t(1.0) / iter.scalar_value<opmath_t>(2)``):
  ``m(f32(x) * f32(1 / f32(scale)))``. In a float32 model ``m`` is the identity. The
  cast is non-saturating (``saturate=False``, torch <= 2.11): overflow gives the NaN code (E4M3FN
  0x7F/0xFF, E5M2 +-Inf) and a warning; ``saturate=True`` models torch >= 2.12, whose e4m3fn cast
  saturates. A tensor scale that is 0 or Inf in a float16 model raises ValueError (SGLang would write
  NaN/Inf). See docs/engines.md section 2.
* ``rocm``: as ``vllm`` in the FNUZ formats (E4M3FNUZ max 240). *Given* (static) scales are OCP
  checkpoint scales and are doubled (``scale_fnuz = 2 * scale_ocp``), as vLLM does on MI300, because the
  same bits mean half the value in FNUZ; computed scales use max 240 directly and are not doubled. In a
  float16 model vLLM's HIP kernel divides in place in the ``_Float16`` input (``tmp.data /= scale``), so
  the quotient is rounded to float16 before the FP8 conversion: ``f16(f32(x) / scale)``.

The model dtype is the input array's (float16; bfloat16 as an ml_dtypes array; float32 or float64 input
means a float32 model) unless the ``model_dtype`` option names one, in which case float32/float64 input is
rounded to it first (as the model's projection would have stored it). Every profile accepts bfloat16,
float16 and float32 models (``ENGINE_DTYPES``).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np

from kvqref import formats
from kvqref.schemes._num import MODEL_DTYPES, model_dtype_of, model_values, round_to
from kvqref.schemes.base import FieldSpec, Quantized, Scheme
from kvqref.schemes.validate import check_scale

GRANULARITIES = ("tensor", "head", "token_head")
PROFILES = ("vllm", "sglang", "rocm", "ocp")
#: profile -> (the engine path it reproduces, the model dtypes that path accepts for K/V)
ENGINE_DTYPES: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm": ("vLLM reshape_and_cache_flash", MODEL_DTYPES),
    "sglang": ("SGLang MHATokenToKVPool.set_kv_buffer", MODEL_DTYPES),
    "rocm": ("vLLM reshape_and_cache_flash (HIP)", MODEL_DTYPES),
    "ocp": ("the OCP FP8 definition", MODEL_DTYPES),
}


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
                 saturate: bool | None = None, model_dtype: str | None = None) -> None:
        if name not in ("fp8_e4m3", "fp8_e5m2"):
            raise ValueError(f"FP8 scheme name must be fp8_e4m3 or fp8_e5m2, got {name!r}")
        if granularity not in GRANULARITIES:
            raise ValueError(f"{name}: granularity must be one of {GRANULARITIES}, got {granularity!r}")
        if profile not in PROFILES:
            raise ValueError(f"{name}: profile must be one of {PROFILES}, got {profile!r}")
        if sglang_scale not in ("tensor", "float"):
            raise ValueError(f"{name}: sglang_scale must be 'tensor' or 'float', got {sglang_scale!r}")
        self.sglang_scale = sglang_scale
        self.engine, self.accepts = ENGINE_DTYPES[profile]
        self.model_dtype = model_dtype
        model_dtype_of(name, self.engine, "float32", model_dtype, self.accepts)  # validates the option
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
            s = np.asarray(scale)
            if s.ndim > 1 or (granularity == "tensor" and s.ndim != 0):
                raise ValueError(f"{name}: static {granularity} scale must be a scalar (tensor) or [kv_heads] "
                                 f"array (head), got shape {s.shape}")
            s = check_scale(name, "scale", s)
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
        v, _ = self._checked(x)
        if self.granularity == "token_head":
            return {}
        if self._static is not None:
            s = self._static
            if self.granularity == "head" and s.ndim == 0:
                s = np.full(v.shape[1], s, dtype=np.float32)
            if self.granularity == "head" and s.shape != (v.shape[1],):
                raise ValueError(f"{self.name}: per-head scale has {s.shape[0]} entries for {v.shape[1]} heads")
            return {"scale": s.copy() if s.ndim else np.float32(s)}
        a = np.abs(v)
        if self.granularity == "tensor":
            return {"scale": np.float32(self._amax_scale(a.max(initial=0.0)))}
        return {"scale": self._amax_scale(a.max(axis=(0, 2), initial=0.0))}

    def check_params(self, params: dict[str, Any] | None, kv_heads: int | None = None) -> dict[str, Any]:
        """``{"scale": s}``: a float32 scalar (granularity ``tensor``) or float32[kv_heads] (``head``), each
        finite and > 0; per-token-head scales are computed per token, so that granularity takes no params."""
        if self.granularity == "token_head":
            return super().check_params(params, kv_heads)
        if not isinstance(params, dict) or set(params) != {"scale"}:
            got = sorted(params) if isinstance(params, dict) else type(params).__name__
            raise ValueError(f"{self.name}: params must be {{'scale': ...}} for {self.granularity} scales, got {got}")
        if self.granularity == "tensor":
            return {"scale": np.float32(check_scale(self.name, "params['scale']", params["scale"], ()))}
        s = np.asarray(params["scale"])
        if kv_heads is None and s.ndim != 1:
            raise ValueError(f"{self.name}: params['scale'] must be a [kv_heads] array, got shape {s.shape}")
        shape = (kv_heads,) if kv_heads is not None else s.shape
        return {"scale": check_scale(self.name, "params['scale'] (one per kv head)", s, shape)}

    def resolve_model_dtype(self, input_dtype: str) -> str:
        """The model dtype quantizing an array of dtype ``input_dtype`` reproduces (ValueError if the engine
        does not accept it)."""
        return model_dtype_of(f"{self.name} ({self.profile} profile)", self.engine, input_dtype, self.model_dtype,
                              self.accepts)

    def quotient_dtype(self, md: str) -> str:
        """The dtype ``x / scale`` is rounded to before the FP8 conversion, in a ``md`` model (the sglang
        profile also rounds a tensor scale to it)."""
        if self.profile == "sglang" or (self.profile == "rocm" and md == "float16"):
            return md
        return "float32"

    def _checked(self, x: Any) -> tuple[np.ndarray, str]:
        """(the input values as the model holds them, float32; the model dtype)."""
        arr = self.check_input(x)
        md = self.resolve_model_dtype(arr.dtype.name)
        if np.isnan(arr.astype(np.float64)).any():
            raise ValueError(f"{self.name}: input holds NaN")
        v = model_values(self.name, arr, md)
        if self._static is None and np.isinf(v).any():
            raise ValueError(f"{self.name}: input holds Inf, so a computed (amax) scale is undefined")
        return v, md

    # -- codec ------------------------------------------------------------------------------
    def quantize(self, x: Any, params: dict[str, Any] | None = None) -> Quantized:
        v, md = self._checked(x)
        T, H, D = v.shape
        fields: dict[str, np.ndarray] = {}
        if self.granularity == "token_head":
            self.check_params(params, H)
            s = self._amax_scale(np.abs(v).max(axis=2, initial=0.0))
            fields["scale"] = s
            sb = s[:, :, None]
            params = {}
        else:
            params = self.calibrate(v) if params is None else self.check_params(params, H)
            s = np.asarray(params["scale"], dtype=np.float32)
            sb = s[None, :, None] if s.ndim else s
        qd = self.quotient_dtype(md)
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            if self.profile == "sglang" and self.sglang_scale == "float":
                inv = (1.0 / np.asarray(sb, np.float64)).astype(np.float32)
                q = round_to((v * inv).astype(np.float32), qd)
            else:
                if self.profile == "sglang":
                    sb = round_to(sb, qd)
                    if not (np.isfinite(sb).all() and (sb > 0).all()):
                        raise ValueError(f"{self.name}: a scale is 0 or Inf in {qd}, which SGLang's division "
                                         f"in the model dtype turns into NaN/Inf (scales {np.unique(s)})")
                q = round_to((v / np.asarray(sb, np.float32)).astype(np.float32), qd)
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
        arith = {"sglang": f"division in the model dtype ({self.sglang_scale} scale)",
                 "rocm": "x / scale in float32 (float16 model: quotient rounded to float16); static OCP scales "
                         "doubled"}.get(self.profile, "x / scale in float32")
        return {"scheme": self.name, "format": self.format,
                "scale rule": f"{self.granularity}: amax / {self.codec.max_finite:g} or static; {arith}",
                "rounding": "RNE", "overflow": f"saturate to +-{self.codec.max_finite:g}" if self.saturate
                else "NaN code (E5M2: Inf), warning",
                "packing": "codes (D,) uint8" + ("; scale () float32" if self.granularity == "token_head" else "")}

    def __repr__(self) -> str:
        return f"<scheme {self.name} {self.format} {self.granularity} profile={self.profile}>"
