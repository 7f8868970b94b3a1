"""FP4 E2M1 block schemes: ``fp4_e2m1`` (alias ``fp4_mx_block16``, block 16), ``mxfp4`` (block 32), ``nvfp4``.

Blocks are ``B`` consecutive head_dim elements of one (token, head): never crossing a head.
Two codes per byte: element ``2i`` in the LOW nibble, ``2i + 1`` in the high nibble.

E8M0-scaled blocks (``fp4_e2m1``, ``mxfp4``): value = ``e2m1(code) * 2**(scale_code - 127)`` (the E8M0 codec's
values: scale code 0xFF, which no quantization writes, is NaN and makes the block NaN).

* ``ocp`` profile (default; ``scale_rule="floor"``, ``rounding="even"``): shared exponent
  ``e = floor(log2(block amax)) - 2``, clamped to [-127, 127]; an all-zero block gets e = -127 (code 0x00);
  elements ``x / 2**e`` (exact) rounded to nearest, ties to even, saturating to +-6. -0.0 gives 0x8.
* ``sglang`` profile (block 16; ``scale_rule="ceil"``, ``rounding="away"``), SGLang's
  ``FP4MXBlock16KVQuantizeUtil.batched_quantize`` as run under ``torch.compile``, which computes in float32
  on the input values whatever the model dtype (bfloat16, float16 or float32: nothing is rounded to the
  model dtype on the way): ``e = ceil(log2(max(float32(amax / 6), 1e-10)))`` (an all-zero block gets
  e = -33, code 94), stored as ``e + 127``; elements ``y = float32(x / 2**e)`` get magnitude code = number
  of midpoints 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 that are <= |y| (ties away from zero), sign bit iff
  y < 0 (so -0.0, and a negative x whose y underflows float32 to -0.0, give 0x0). kvqref takes
  ``ceil(log2(v))`` exactly from v's bits; SGLang's float32 ``log2`` may round a v within ~2**-20
  (relative) above a power of two down to it, and then picks the exponent one lower.

The model dtype is the input array's (float16; bfloat16 as an ml_dtypes array; float32 input means a
float32 model) unless the ``model_dtype`` option names one, in which case float32/float64 input is
rounded to it first; without ``model_dtype`` the ``sglang`` profile rounds float64 input once to float32
(the precision it computes in) and the ``ocp`` profile uses float64 input exactly.

NaN or Inf input raises ValueError (E2M1 has neither).

NVFP4 (blocks of 16, E4M3FN block scale times a float32 global scale, all in float32 as TensorRT-LLM):
``g = float32(amax / 2688)`` over the whole tensor (2688 = 448 * 6; amax == 0 gives g = 1.0) unless given;
block scale ``s = float32(float32(block_amax / 6) / g)`` clamped to [2**-6, 448] and encoded RNE to
E4M3FN; element divisor ``d = float32(e4m3(s) * g)``; ``y = float32(x / d)`` clamped to +-6 and RNE to E2M1.
Value = ``e2m1(code) * e4m3(scale) * g`` (float64).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvqref import formats
from kvqref.formats import as_exact_float
from kvqref.schemes._num import MODEL_DTYPES, model_dtype_of, model_values, pack_bits, unpack_bits
from kvqref.schemes.base import FieldSpec, Quantized, Scheme
from kvqref.schemes.validate import check_scale

E2M1 = formats.get("float4_e2m1fn")
E8M0 = formats.get("float8_e8m0fnu")
E4M3 = formats.get("float8_e4m3fn")
E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def e2m1_encode_away(y: np.ndarray) -> np.ndarray:
    """SGLang's E2M1 rounding: magnitude = #midpoints <= |y| (ties away from zero, saturating at 6);
    sign bit iff y < 0."""
    mag = (np.abs(y)[..., None] >= E2M1_MIDPOINTS).sum(axis=-1)
    return (mag + 8 * (y < 0)).astype(np.uint8)


def _finite_input(name: str, x: Any, check) -> np.ndarray:
    arr = check(x)
    v = as_exact_float(arr)
    if not np.isfinite(v).all():
        n_nan, n_inf = int(np.isnan(v).sum()), int(np.isinf(v).sum())
        raise ValueError(f"{name}: E2M1 has no NaN/Inf; input holds {n_nan} NaN and {n_inf} Inf value(s)")
    return v


def _blocks(name: str, v: np.ndarray, block: int) -> np.ndarray:
    T, H, D = v.shape
    if D % block:
        raise ValueError(f"{name}: head_dim {D} is not divisible by the block size {block}")
    return v.reshape(T, H, D // block, block)


class E8M0BlockScheme(Scheme):
    """E2M1 codes with one E8M0 scale byte per block of ``block`` head_dim elements.

    Fields: ``{"codes": (D//2,) uint8, "scales": (D//block,) uint8}``; no params.
    """

    def __init__(self, name: str, block: int, *, profile: str = "ocp", scale_rule: str | None = None,
                 rounding: str | None = None, model_dtype: str | None = None) -> None:
        if profile not in ("ocp", "sglang"):
            raise ValueError(f"{name}: profile must be 'ocp' or 'sglang', got {profile!r}")
        if profile == "sglang" and block != 16:
            raise ValueError(f"{name}: the sglang profile uses blocks of 16, not {block}")
        self.name, self.block, self.profile = name, block, profile
        self.scale_rule = scale_rule or ("ceil" if profile == "sglang" else "floor")
        self.rounding = rounding or ("away" if profile == "sglang" else "even")
        if self.scale_rule not in ("floor", "ceil"):
            raise ValueError(f"{name}: scale_rule must be 'floor' (OCP) or 'ceil' (SGLang), got {scale_rule!r}")
        if self.rounding not in ("even", "away"):
            raise ValueError(f"{name}: rounding must be 'even' or 'away', got {rounding!r}")
        self.engine = ("SGLang FP4MXBlock16KVQuantizeUtil.batched_quantize" if profile == "sglang"
                       else "the OCP MX definition")
        self.accepts = MODEL_DTYPES
        self.model_dtype = model_dtype
        model_dtype_of(name, self.engine, "float32", model_dtype, self.accepts)  # validates the option

    def resolve_model_dtype(self, input_dtype: str) -> str:
        """The model dtype quantizing an array of dtype ``input_dtype`` reproduces (ValueError if the engine
        does not accept it). The arithmetic is float32 (sglang) or exact (ocp) for every model dtype."""
        return model_dtype_of(f"{self.name} ({self.profile} profile)", self.engine, input_dtype, self.model_dtype,
                              self.accepts)

    def fields(self, kv_heads: int, head_dim: int) -> dict[str, FieldSpec]:
        if head_dim % self.block:
            raise ValueError(f"{self.name}: head_dim {head_dim} is not divisible by the block size {self.block}")
        return {"codes": FieldSpec((head_dim // 2,), np.dtype(np.uint8)),
                "scales": FieldSpec((head_dim // self.block,), np.dtype(np.uint8))}

    def bits_per_element(self, head_dim: int, kv_heads: int = 1) -> float:
        """4 + 8 / block: 4.5 for blocks of 16, 4.25 for blocks of 32."""
        return 4.0 + 8.0 / self.block

    def block_exponents(self, xb: np.ndarray) -> np.ndarray:
        """The shared exponent e of each block (``xb``: [..., block] values after input rounding)."""
        amax = np.abs(xb).max(axis=-1)
        if self.scale_rule == "floor":
            _, e1 = np.frexp(amax)  # amax = m * 2**e1, m in [0.5, 1): floor(log2 amax) = e1 - 1
            e = e1.astype(np.int64) - 1 - 2
            e = np.where(amax == 0, -127, e)
        else:
            v = np.maximum((amax.astype(np.float32) / np.float32(6.0)).astype(np.float32), np.float32(1e-10))
            m, e1 = np.frexp(v.astype(np.float64))
            e = e1.astype(np.int64) - (m == 0.5)  # ceil(log2 v), exact
        return np.clip(e, -127, 127)

    def quantize(self, x: Any, params: dict[str, Any] | None = None) -> Quantized:
        self.check_params(params)
        arr = self.check_input(x)
        md = self.resolve_model_dtype(arr.dtype.name)
        v = _finite_input(self.name, arr, self.check_input)
        if self.model_dtype is not None or self.profile == "sglang":
            v = model_values(self.name, v, md)  # no-op for 16-bit input; float32 (sglang) or model_dtype
        xb = _blocks(self.name, v.astype(np.float64), self.block)
        e = self.block_exponents(xb)
        y = np.ldexp(xb, -e[..., None])
        if self.profile == "sglang":
            y = y.astype(np.float32)  # SGLang's float32 quotient (exact unless it underflows float32)
        codes = e2m1_encode_away(y) if self.rounding == "away" else E2M1.encode(y, saturate=True)
        T, H, D = v.shape
        return Quantized(self.name, (T, H, D), {"codes": pack_bits(codes.reshape(T, H, D), 4),
                                                 "scales": (e + 127).astype(np.uint8)}, {})

    def dequantize(self, q: Quantized) -> np.ndarray:
        T, H, D = q.shape
        el = E2M1.decode(unpack_bits(q.fields["codes"], 4)).astype(np.float64).reshape(T, H, -1, self.block)
        scale = E8M0.decode(q.fields["scales"]).astype(np.float64)  # 2**(c - 127); 0xFF: NaN
        return (el * scale[..., None]).reshape(T, H, D)

    def describe(self) -> dict[str, str]:
        rule = ("floor(log2 amax) - 2, clamp [-127,127]; zero block 0x00" if self.scale_rule == "floor"
                else "ceil(log2(max(amax/6, 1e-10))) + 127")
        return {"scheme": self.name, "format": f"E2M1 x E8M0, block {self.block}", "scale rule": rule,
                "rounding": "RNE" if self.rounding == "even" else "ties away (|y| >= midpoints)",
                "overflow": "saturate +-6", "packing": f"codes (D/2,) u8 even=low nibble; scales (D/{self.block},) u8"}

    def __repr__(self) -> str:
        return f"<scheme {self.name} block={self.block} profile={self.profile}>"


def to_sglang_layout(q: Quantized) -> tuple[np.ndarray, np.ndarray]:
    """SGLang's FP4 pool layout of a block-16 E8M0 container: per token, codes ``[heads, head_dim/2]``
    uint8 and scales ``[heads * head_dim / 16]`` uint8 (returned for all tokens: [T, H, D/2], [T, H*D/16])."""
    T, H, D = q.shape
    return q.fields["codes"].copy(), q.fields["scales"].reshape(T, H * D // 16).copy()


def from_sglang_layout(codes: np.ndarray, scales: np.ndarray, scheme: str = "fp4_e2m1") -> Quantized:
    """Inverse of :func:`to_sglang_layout`."""
    T, H, half = codes.shape
    return Quantized(scheme, (T, H, 2 * half), {"codes": codes.copy(), "scales": scales.reshape(T, H, -1).copy()})


class NVFP4Scheme(Scheme):
    """E2M1 codes, E4M3FN scale per 16 elements, float32 global scale.

    Fields ``{"codes": (D//2,) uint8, "scales": (D//16,) uint8 E4M3FN}``; params ``{"global_scale": float32}``.
    """

    name = "nvfp4"
    block = 16

    def __init__(self, *, global_scale: float | None = None, profile: str = "ocp") -> None:
        if profile not in ("ocp", "trtllm"):
            raise ValueError(f"nvfp4: profile must be 'ocp' or 'trtllm' (the same arithmetic), got {profile!r}")
        self.profile = profile
        self.global_scale = None if global_scale is None else np.float32(check_scale("nvfp4", "global_scale",
                                                                                      global_scale, ()))

    def fields(self, kv_heads: int, head_dim: int) -> dict[str, FieldSpec]:
        if head_dim % 16:
            raise ValueError(f"nvfp4: head_dim {head_dim} is not divisible by the block size 16")
        return {"codes": FieldSpec((head_dim // 2,), np.dtype(np.uint8)),
                "scales": FieldSpec((head_dim // 16,), np.dtype(np.uint8))}

    def bits_per_element(self, head_dim: int, kv_heads: int = 1) -> float:
        """4 + 8/16 = 4.5 (the one float32 global scale per tensor is not per token)."""
        return 4.5

    def check_params(self, params: dict[str, Any] | None, kv_heads: int | None = None) -> dict[str, Any]:
        """``{"global_scale": g}``, g a float32 scalar, finite and > 0."""
        if not isinstance(params, dict) or set(params) != {"global_scale"}:
            got = sorted(params) if isinstance(params, dict) else type(params).__name__
            raise ValueError(f"nvfp4: params must be {{'global_scale': ...}}, got {got}")
        return {"global_scale": np.float32(check_scale("nvfp4", "params['global_scale']",
                                                       params["global_scale"], ()))}

    def calibrate(self, x: Any) -> dict[str, Any]:
        """``{"global_scale": float32(amax / 2688)}`` (1.0 for an all-zero tensor), or the given one."""
        if self.global_scale is not None:
            return {"global_scale": self.global_scale}
        v = _finite_input(self.name, x, self.check_input).astype(np.float32)
        amax = np.float32(np.abs(v).max(initial=0.0))
        g = np.float32(amax / np.float32(448.0 * 6.0)) if amax > 0 else np.float32(1.0)
        return {"global_scale": g}

    def quantize(self, x: Any, params: dict[str, Any] | None = None) -> Quantized:
        v = _finite_input(self.name, x, self.check_input).astype(np.float32)
        xb = _blocks(self.name, v, 16)
        params = self.calibrate(v) if params is None else self.check_params(params)
        g = np.float32(params["global_scale"])
        bamax = np.abs(xb).max(axis=-1)
        s = ((bamax / np.float32(6.0)).astype(np.float32) / g).astype(np.float32)
        s = np.clip(s, np.float32(2.0**-6), np.float32(448.0))
        scodes = E4M3.encode(s, saturate=True)
        d = (E4M3.decode(scodes) * g).astype(np.float32)
        if (d == 0).any() or not np.isfinite(d).all():
            raise ValueError(f"nvfp4: global_scale {g} makes a block divisor 0 or Inf in float32")
        y = np.clip((xb / d[..., None]).astype(np.float32), np.float32(-6), np.float32(6))
        codes = E2M1.encode(y, saturate=True).reshape(v.shape)
        return Quantized(self.name, v.shape, {"codes": pack_bits(codes, 4), "scales": scodes},
                         {"global_scale": g})

    def dequantize(self, q: Quantized) -> np.ndarray:
        T, H, D = q.shape
        el = E2M1.decode(unpack_bits(q.fields["codes"], 4)).astype(np.float64).reshape(T, H, -1, 16)
        s = E4M3.decode(q.fields["scales"]).astype(np.float64)
        return (el * s[..., None] * np.float64(q.params["global_scale"])).reshape(T, H, D)

    def describe(self) -> dict[str, str]:
        return {"scheme": self.name, "format": "E2M1 x E4M3FN (block 16) x float32 global",
                "scale rule": "g = amax/2688; s = clamp(bamax/6/g, 2^-6, 448) -> E4M3 RNE",
                "rounding": "x / (e4m3(s) * g) in float32, RNE", "overflow": "clamp +-6",
                "packing": "codes (D/2,) u8 even=low nibble; scales (D/16,) u8 E4M3; params global_scale f32"}
