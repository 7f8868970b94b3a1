"""KV cache schemes: layouts, round-trip error bounds, engine profiles on hand-computed cases, bad input, and
planted bugs that the checks must catch. Reference computations here are independent of kvqref.schemes:
scalar Python from the definitions (math.frexp, exact float arithmetic, numpy float16 scalars)."""

from __future__ import annotations

import json
import math
import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqref import formats, schemes
from kvqref.schemes import Quantized

E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
SETTINGS = settings(max_examples=25, deadline=None)


# --------------------------------------------------------------------------------------------------
# Inputs: fresh random tensors, Gaussian with random magnitude and a few outlier channels.
# --------------------------------------------------------------------------------------------------
@st.composite
def kv_tensors(draw, tokens=(32, 64), dims=(32, 64)):
    seed = draw(st.integers(0, 2**32 - 1))
    T = draw(st.sampled_from(tokens))
    H = draw(st.integers(1, 3))
    D = draw(st.sampled_from(dims))
    mag = 10.0 ** draw(st.floats(-3, 3))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H, D)) * mag
    for c in rng.choice(D, size=draw(st.integers(0, 3)), replace=False):
        x[:, :, c] *= rng.uniform(10, 100)
    return x.astype(np.float32)


def e2m1_half_spacing(y: np.ndarray) -> np.ndarray:
    """Half the distance between neighbouring E2M1 values around |y| <= 6."""
    a = np.abs(y)
    return np.where(a < 2, 0.25, np.where(a < 4, 0.5, 1.0))


def e4m3_half_spacing(y: np.ndarray, emin: int = -6) -> np.ndarray:
    """Half-ulp of E4M3 (3 mantissa bits) at |y|, subnormal quantum below 2**emin."""
    a = np.abs(y).astype(np.float64)
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    e = np.maximum(np.where(a > 0, e, emin), emin)
    return 2.0 ** (e - 3 - 1)


# --------------------------------------------------------------------------------------------------
# Registry.
# --------------------------------------------------------------------------------------------------
def test_registry_names_and_aliases():
    assert set(schemes.names()) == {"bf16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "mxfp4", "nvfp4", "int4_kivi",
                                    "int2_kivi"}
    assert schemes.get("fp4_mx_block16").name == "fp4_e2m1"
    assert schemes.get("fp4_mx_block16").block == 16
    assert schemes.get("mxfp4").block == 32
    with pytest.raises(KeyError, match="known schemes: bf16"):
        schemes.get("fp3")


@pytest.mark.parametrize("name,opts,bits", [
    ("bf16", {}, 16), ("fp8_e4m3", {}, 8), ("fp8_e5m2", {}, 8), ("fp8_e4m3", {"granularity": "token_head"}, 8.25),
    ("fp4_e2m1", {}, 4.5), ("mxfp4", {}, 4.25), ("nvfp4", {}, 4.5), ("int4_kivi", {}, 5),
    ("int4_kivi", {"role": "key"}, 5), ("int2_kivi", {}, 3), ("int2_kivi", {"role": "key"}, 3)])
def test_bits_per_element(name, opts, bits):
    assert schemes.get(name, **opts).bits_per_element(128) == bits


def test_capacity_ratios_of_4_5_bits():
    fp4 = schemes.get("fp4_e2m1").bits_per_element(128)
    assert round(16 / fp4, 2) == 3.56 and round(8 / fp4, 2) == 1.78


ALL = [("bf16", {}), ("fp8_e4m3", {}), ("fp8_e4m3", {"granularity": "head"}),
       ("fp8_e4m3", {"granularity": "token_head"}), ("fp8_e5m2", {}), ("fp8_e4m3", {"profile": "rocm"}),
       ("fp8_e4m3", {"profile": "sglang"}), ("fp4_e2m1", {}), ("fp4_e2m1", {"profile": "sglang"}), ("mxfp4", {}),
       ("nvfp4", {}), ("int4_kivi", {}), ("int4_kivi", {"role": "key"}), ("int2_kivi", {}),
       ("int2_kivi", {"role": "key"})]


@pytest.mark.parametrize("name,opts", ALL)
def test_fields_match_layout(name, opts):
    s = schemes.get(name, **opts)
    x = np.random.default_rng(1).standard_normal((64, 2, 64)).astype(np.float32)
    q = s.quantize(x)
    specs = s.fields(2, 64)
    assert set(q.fields) == set(specs)
    for f, spec in specs.items():
        lead = (64, 2) if spec.per == "token" else (64 // s.token_group, 2)
        assert q.fields[f].shape == (*lead, *spec.shape), f
        assert q.fields[f].dtype == spec.dtype, f
    assert s.dequantize(q).shape == x.shape
    assert s.dequantize(q).dtype == np.float64


# --------------------------------------------------------------------------------------------------
# bf16.
# --------------------------------------------------------------------------------------------------
@SETTINGS
@given(kv_tensors())
def test_bf16_equals_rne_cast(x):
    q = schemes.get("bf16").quantize(x)
    assert np.array_equal(q.fields["data"], x.astype(ml_dtypes.bfloat16).view(np.uint16))
    assert np.all(np.abs(schemes.get("bf16").dequantize(q) - x) <= 2.0**-8 * np.abs(x))


# --------------------------------------------------------------------------------------------------
# FP8.
# --------------------------------------------------------------------------------------------------
def fp8_reference_scale(x: np.ndarray, granularity: str, max_finite: float) -> np.ndarray:
    """Scale broadcastable to x, from the definition: float32(amax) / max_finite, 1.0 where amax == 0."""
    a = np.abs(x.astype(np.float64))
    axis = {"tensor": None, "head": (0, 2), "token_head": (2,)}[granularity]
    amax = a.max(axis=axis, keepdims=True)
    return np.where(amax == 0, 1.0, np.float32(amax) / np.float32(max_finite)).astype(np.float32)


@SETTINGS
@given(kv_tensors(), st.sampled_from(["tensor", "head", "token_head"]), st.sampled_from(["fp8_e4m3", "fp8_e5m2"]),
       st.sampled_from(["vllm", "sglang", "rocm"]))
def test_fp8_round_trip_bound(x, granularity, name, profile):
    s = schemes.get(name, granularity=granularity, profile=profile)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # computed scales never overflow, so sglang never writes NaN here
        deq = s.dequantize(s.quantize(x))
    check_fp8(x, deq, s, granularity, profile)


def check_fp8(x, deq, s, granularity, profile):
    """Assert |deq - x| <= half an FP8 ulp of x / scale (scale from the definition), times the scale."""
    scale = fp8_reference_scale(x, granularity, s.codec.max_finite).astype(np.float64)
    y = x / scale
    mbits = s.codec.spec.mbits
    a = np.abs(y)
    e = np.maximum(np.floor(np.log2(np.where(a > 0, a, 1.0))), s.codec.spec.emin)
    bf16_steps = 3 * 2.0**-8 if profile == "sglang" else 0.0  # x, scale and quotient rounded to bf16
    bound = scale * 2.0 ** (e - mbits - 1) * (1 + 2.0**-20 + bf16_steps) + (2.0**-22 + bf16_steps) * np.abs(x)
    assert np.all(np.abs(deq - x) <= bound), f"max excess {np.max(np.abs(deq - x) - bound)}"


def test_planted_fp8_scale_bugs_are_caught():
    x = np.random.default_rng(4).standard_normal((16, 2, 32)).astype(np.float32)
    s = schemes.get("fp8_e4m3", granularity="head")
    q = s.quantize(x)
    check_fp8(x, s.dequantize(q), s, "head", "vllm")
    for factor in (2.0, 0.5, 1.0 + 2.0**-10):
        bad = Quantized(q.scheme, q.shape, q.fields, {"scale": q.params["scale"] * np.float32([1.0, factor])})
        with pytest.raises(AssertionError):
            check_fp8(x, s.dequantize(bad), s, "head", "vllm")


def test_fp8_vllm_hand_cases():
    s = schemes.get("fp8_e4m3", scale=1.0)
    x = np.array([[[500.0, 464.0, 464.01, 1.0625, -0.0, 1.0625 + 2**-10, -1e9]]])
    assert s.quantize(x).fields["codes"].ravel().tolist() == [0x7E, 0x7E, 0x7E, 0x38, 0x80, 0x39, 0xFE]
    # x / scale is ONE float32 division: float32(27.6) / float32(0.3) = 92.0 (0x6C) in float32; the exact
    # quotient 91.99999... rounds to 88 (0x6B) in E4M3
    s2 = schemes.get("fp8_e4m3", scale=0.3)
    assert s2.quantize(np.array([[[27.6]]], dtype=np.float32)).fields["codes"].item() == 108
    assert formats.get("float8_e4m3fn").encode(np.float64(np.float32(27.6)) / np.float64(np.float32(0.3)),
                                               saturate=True) == 107
    assert schemes.get("fp8_e5m2", scale=1.0).quantize(np.array([[[1e6, -np.inf]]])).fields["codes"].ravel().tolist() \
        == [0x7B, 0xFB]


def test_fp8_sglang_hand_cases():
    s = schemes.get("fp8_e4m3", scale=1.0, profile="sglang", model_dtype="bfloat16")
    x = np.array([[[500.0, -500.0, 464.0, 1.0625 + 2**-10]]])
    with pytest.warns(UserWarning, match="2 element"):
        codes = s.quantize(x).fields["codes"].ravel().tolist()
    # overflow -> NaN with sign; bf16 first: 1.0625 + 2**-10 -> 1.0625 (bf16), a tie -> 1.0 (even)
    assert codes == [0x7F, 0xFF, 0x7E, 0x38]
    sat = schemes.get("fp8_e4m3", scale=1.0, profile="sglang", saturate=True, model_dtype="bfloat16")
    assert sat.quantize(x).fields["codes"].ravel().tolist() == [0x7E, 0xFE, 0x7E, 0x38]
    # tensor scale: bf16(20.5 / bf16(0.3)) = 68.0; float scale: bf16(f32(20.5 * f32(1/0.3))) = 68.5
    x = np.array([[[20.5]]], dtype=ml_dtypes.bfloat16)
    t = schemes.get("fp8_e4m3", scale=0.3, profile="sglang").quantize(x)
    f = schemes.get("fp8_e4m3", scale=0.3, profile="sglang", sglang_scale="float").quantize(x)
    assert (t.fields["codes"].item(), f.fields["codes"].item()) == (104, 105)
    # float16 model: f16(20.5 / f16(0.3)) = f16(68.350...) = 68.375 -> 72 (0x69); float32 model: 68.33 -> 72;
    # only bfloat16's rounding lands on the tie 68 (-> 64, even)
    t16 = schemes.get("fp8_e4m3", scale=0.3, profile="sglang").quantize(x.astype(np.float16))
    t32 = schemes.get("fp8_e4m3", scale=0.3, profile="sglang").quantize(x.astype(np.float32))
    assert (t16.fields["codes"].item(), t32.fields["codes"].item()) == (0x69, 0x69)


def test_fp8_rocm_doubles_static_ocp_scales_and_uses_fnuz():
    s = schemes.get("fp8_e4m3", profile="rocm", scale=0.5)
    assert s.format == "float8_e4m3fnuz"
    q = s.quantize(np.array([[[240.0, 300.0, -1.0, 0.0]]]))
    assert float(q.params["scale"]) == 1.0
    assert q.fields["codes"].ravel().tolist() == [0x7F, 0x7F, 0xC0, 0x00]
    # the same bits as OCP's code of x / 0.5 (except at overflow)
    ocp = schemes.get("fp8_e4m3", scale=0.5).quantize(np.array([[[-1.0, 3.0]]]))
    fnuz = s.quantize(np.array([[[-1.0, 3.0]]]))
    assert ocp.fields["codes"].ravel().tolist() == fnuz.fields["codes"].ravel().tolist()
    computed = schemes.get("fp8_e4m3", profile="rocm").calibrate(np.array([[[480.0]]]))
    assert float(computed["scale"]) == 2.0  # amax / 240, not doubled
    assert schemes.get("fp8_e5m2", profile="rocm").format == "float8_e5m2fnuz"


def test_fp8_zero_amax_and_missing_static_scale():
    s = schemes.get("fp8_e4m3", granularity="head")
    x = np.zeros((4, 2, 8))
    x[:, 1] = np.random.default_rng(0).standard_normal((4, 8))
    q = s.quantize(x)
    assert q.params["scale"][0] == 1.0 and not np.isnan(s.dequantize(q)).any()
    with pytest.warns(UserWarning, match="using scale 1.0"):
        st_ = schemes.get("fp8_e4m3", static=True)
    assert float(st_.calibrate(x)["scale"]) == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schemes.get("fp8_e4m3", scale=2.0)  # a given scale: no warning


def test_fp8_head_scales_static_array():
    s = schemes.get("fp8_e4m3", granularity="head", scale=[1.0, 2.0])
    q = s.quantize(np.array([[[2.0], [2.0]]]))
    assert q.fields["codes"].ravel().tolist() == [0x40, 0x38]
    with pytest.raises(ValueError, match="2 entries for 3 heads"):
        s.quantize(np.ones((1, 3, 1)))


def test_load_sglang_scales(tmp_path):
    p = tmp_path / "kv.json"
    p.write_text(json.dumps({"model_type": "llama", "kv_cache": {
        "dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 0.25, "1": 0.5}, "1": {"0": 2.0, "1": 4.0}}}}))
    assert schemes.load_sglang_scales(p, 1, 0) == 2.0
    assert schemes.load_sglang_scales(p, 0, 1) == 0.5
    with pytest.raises(ValueError, match="TP rank 2"):
        schemes.load_sglang_scales(p, 2, 0)
    with pytest.raises(ValueError, match="layer 7"):
        schemes.load_sglang_scales(p, 0, 7)
    p.write_text(json.dumps({"kv": {}}))
    with pytest.raises(ValueError, match="scaling_factor"):
        schemes.load_sglang_scales(p, 0, 0)


# --------------------------------------------------------------------------------------------------
# FP4 with E8M0 block scales: an independent scalar reference.
# --------------------------------------------------------------------------------------------------
def ref_fp4_e8m0(x: np.ndarray, block: int, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """Scalar-Python OCP (rule='ocp') or SGLang (rule='sglang') quantization: (codes [T,H,D], scales)."""
    T, H, D = x.shape
    codes = np.zeros((T, H, D), np.uint8)
    scales = np.zeros((T, H, D // block), np.uint8)
    if rule == "sglang":  # SGLang's compiled quantizer computes in float32 on the input values
        x = x.astype(np.float32)
    for t in range(T):
        for h in range(H):
            for j in range(D // block):
                blk = [float(v) for v in x[t, h, j * block:(j + 1) * block]]
                amax = max(abs(v) for v in blk)
                if rule == "ocp":
                    e = -127 if amax == 0 else min(max(math.frexp(amax)[1] - 1 - 2, -127), 127)
                else:
                    v = max(float(np.float32(np.float32(amax) / np.float32(6))), float(np.float32(1e-10)))
                    m, k = math.frexp(v)
                    e = k - 1 if m == 0.5 else k
                scales[t, h, j] = e + 127
                for i, xv in enumerate(blk):
                    y = xv / 2.0**e if rule == "ocp" else float(np.float32(xv / 2.0**e))
                    a = abs(y)
                    if rule == "ocp":  # nearest value, ties to the even code; saturate at 6
                        best = min(range(8), key=lambda c: (abs(E2M1_VALUES[c] - min(a, 6.0)), c % 2))
                        sign = math.copysign(1, y) < 0
                    else:
                        best = sum(a >= b for b in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0))
                        sign = y < 0
                    codes[t, h, j * block + i] = best + 8 * sign
    return codes, scales


def independent_unpack(packed: np.ndarray) -> np.ndarray:
    """Element 2i from the low nibble, 2i + 1 from the high nibble."""
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
    out[..., 0::2] = packed & 0xF
    out[..., 1::2] = packed >> 4
    return out


def check_fp4_e8m0(x: np.ndarray, fields: dict, block: int, rule: str) -> None:
    """Assert the fields decode (independently) to within the definition's error bound of x."""
    codes = independent_unpack(fields["codes"]).astype(np.int64)
    mag = np.array(E2M1_VALUES)[codes & 7] * np.where(codes & 8, -1, 1)
    T, H, D = x.shape
    deq = (mag.reshape(T, H, -1, block) * 2.0 ** (fields["scales"].astype(np.int64) - 127)[..., None]).reshape(x.shape)
    xb = x.astype(np.float64).reshape(T, H, -1, block)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        if rule == "ocp":
            e = np.clip(np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -127, 127)
        else:
            e = np.ceil(np.log2(np.maximum(amax / 6, 1e-10)))
    y = xb / 2.0**e
    bound = np.where(np.abs(y) > 6, np.abs(y) - 6, e2m1_half_spacing(y)) * 2.0**e
    bound = bound * (1 + 2.0**-20)
    err = np.abs(deq.reshape(xb.shape) - xb)
    assert np.all(err <= bound), f"max excess {np.max(err - bound)}"


@SETTINGS
@given(kv_tensors(), st.sampled_from([("fp4_e2m1", 16, "ocp"), ("mxfp4", 32, "ocp"), ("fp4_e2m1", 16, "sglang")]))
def test_fp4_e8m0_round_trip_bound(x, case):
    name, block, rule = case
    s = schemes.get(name, profile=rule)
    q = s.quantize(x)
    check_fp4_e8m0(x, q.fields, block, rule)
    assert np.array_equal(s.dequantize(q), s.dequantize(Quantized(name, x.shape, dict(q.fields))))


@settings(max_examples=10, deadline=None)
@given(kv_tensors(tokens=(2,), dims=(32,)), st.sampled_from([("fp4_e2m1", 16, "ocp"), ("mxfp4", 32, "ocp"),
                                                              ("fp4_e2m1", 16, "sglang")]),
       st.sampled_from(["bfloat16", "float16", "float32"]))
def test_fp4_e8m0_bytes_equal_scalar_reference(x, case, dtype):
    """Every model dtype (the input array's): the same float32 / exact arithmetic on its values."""
    from kvqref.conformance import to_dtype_values

    name, block, rule = case
    x = to_dtype_values(np.clip(x, -60000, 60000), dtype)
    q = schemes.get(name, profile=rule).quantize(x.astype({"bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
                                                           "float32": np.float32}[dtype]))
    codes, scales = ref_fp4_e8m0(x, block, rule)
    assert np.array_equal(independent_unpack(q.fields["codes"]), codes)
    assert np.array_equal(q.fields["scales"], scales)


def test_fp4_sglang_ties_away_vs_ocp_ties_even():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x = np.zeros((1, 1, 16))
    x[0, 0, :7] = ties
    x[0, 0, 7] = 6.0  # block amax 6: both rules give exponent 0 (scale code 127)
    x[0, 0, 8:15] = np.negative(ties)
    ocp = schemes.get("fp4_e2m1").quantize(x)
    sgl = schemes.get("fp4_e2m1", profile="sglang").quantize(x)
    assert ocp.fields["scales"].item() == sgl.fields["scales"].item() == 127
    co, cs = independent_unpack(ocp.fields["codes"])[0, 0], independent_unpack(sgl.fields["codes"])[0, 0]
    #           0.25  0.75  1.25  1.75  2.5  3.5  5.0  6.0
    assert co[:8].tolist() == [0, 2, 2, 4, 4, 6, 6, 7]   # to even: 0, 1, 1, 2, 2, 4, 4, 6
    assert cs[:8].tolist() == [1, 2, 3, 4, 5, 6, 7, 7]   # away:    0.5, 1, 1.5, 2, 3, 4, 6, 6
    differ = [t for t, a, b in zip(ties, co[:7], cs[:7], strict=True) if a != b]
    assert differ == [0.25, 1.25, 2.5, 5.0]
    assert (co[8:15] == co[:7] + 8).all() and (cs[8:15] == cs[:7] + 8).all()
    # the packed bytes: element 0 in the low nibble
    assert ocp.fields["codes"][0, 0, 0] == (co[1] << 4) | co[0]


def test_fp4_scale_rules_hand_cases():
    x = np.zeros((1, 3, 16))
    x[0, 1, 0] = 7.5        # OCP: e = floor(log2 7.5) - 2 = 0 -> saturates to 6; SGLang: e = ceil(log2 1.25) = 1
    x[0, 2, 0] = -0.0
    ocp = schemes.get("fp4_e2m1").quantize(x)
    sgl = schemes.get("fp4_e2m1", profile="sglang").quantize(x)
    assert ocp.fields["scales"][0, :, 0].tolist() == [0, 127, 0]     # all-zero block: smallest scale 0x00
    assert sgl.fields["scales"][0, :, 0].tolist() == [94, 128, 94]   # ceil(log2 1e-10) = -33
    assert independent_unpack(ocp.fields["codes"])[0, 1, 0] == 7
    assert independent_unpack(sgl.fields["codes"])[0, 1, 0] == 6
    assert independent_unpack(ocp.fields["codes"])[0, 2, 0] == 8      # -0.0 keeps its sign under RNE
    assert independent_unpack(sgl.fields["codes"])[0, 2, 0] == 0      # SGLang: sign iff y < 0
    assert not independent_unpack(ocp.fields["codes"])[0, 0].any()


def test_sglang_layout():
    x = np.random.default_rng(3).standard_normal((5, 4, 64)).astype(np.float32)
    q = schemes.get("fp4_e2m1", profile="sglang").quantize(x)
    codes, scales = schemes.to_sglang_layout(q)
    assert codes.shape == (5, 4, 32) and scales.shape == (5, 4 * 64 // 16)
    assert scales[2, 1 * 4 + 3] == q.fields["scales"][2, 1, 3]  # head-major: block h * (D/16) + j
    back = schemes.from_sglang_layout(codes, scales)
    assert np.array_equal(back.fields["scales"], q.fields["scales"])


# --------------------------------------------------------------------------------------------------
# NVFP4.
# --------------------------------------------------------------------------------------------------
@SETTINGS
@given(kv_tensors())
def test_nvfp4_round_trip_bound(x):
    s = schemes.get("nvfp4")
    deq = s.dequantize(s.quantize(x))
    e4m3 = formats.get("float8_e4m3fn")
    T, H, D = x.shape
    g = np.abs(x).max().astype(np.float64) / 2688
    xb = x.astype(np.float64).reshape(T, H, -1, 16)
    sblk = np.clip(np.abs(xb).max(axis=-1) / 6 / g, 2.0**-6, 448)
    d = e4m3.round(sblk, saturate=True).astype(np.float64) * g
    y = xb / d[..., None]
    bound = np.where(np.abs(y) > 6, np.abs(y) - 6, e2m1_half_spacing(y)) * d[..., None] + 2.0**-20 * np.abs(xb)
    assert np.all(np.abs(deq.reshape(xb.shape) - xb) <= bound)


def ref_nvfp4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """Scalar reference of the nvfp4 rule with numpy float32 scalars (IEEE float32 arithmetic)."""
    f32 = np.float32
    g = f32(f32(np.abs(x).max()) / f32(2688))
    e4m3 = formats.get("float8_e4m3fn")
    T, H, D = x.shape
    codes = np.zeros((T, H, D), np.uint8)
    scales = np.zeros((T, H, D // 16), np.uint8)
    for t in range(T):
        for h in range(H):
            for j in range(D // 16):
                blk = x[t, h, 16 * j:16 * j + 16]
                sb = min(max(f32(f32(f32(np.abs(blk).max()) / f32(6)) / g), f32(2.0**-6)), f32(448))
                scales[t, h, j] = e4m3.encode(np.float32(sb), saturate=True)
                d = f32(e4m3.decode(scales[t, h, j]) * g)
                for i, v in enumerate(blk):
                    y = float(min(max(f32(f32(v) / d), f32(-6)), f32(6)))
                    best = min(range(8), key=lambda c: (abs(E2M1_VALUES[c] - abs(y)), c % 2))
                    codes[t, h, 16 * j + i] = best + 8 * (math.copysign(1, y) < 0)
    return codes, scales, g


@settings(max_examples=10, deadline=None)
@given(kv_tensors(tokens=(2,), dims=(32,)))
def test_nvfp4_bytes_equal_scalar_reference(x):
    q = schemes.get("nvfp4").quantize(x)
    codes, scales, g = ref_nvfp4(x)
    assert q.params["global_scale"] == g
    assert np.array_equal(q.fields["scales"], scales)
    assert np.array_equal(independent_unpack(q.fields["codes"]), codes)


def test_nvfp4_hand_case():
    x = np.zeros((1, 1, 32), np.float32)
    x[0, 0, 0] = 2688.0     # tensor amax 2688 -> global scale 1.0; block scale 448 (0x7E); 2688 / 448 = 6
    x[0, 0, 1] = -1120.0    # / 448 = -2.5 -> tie to even: -2 (0xC)
    x[0, 0, 16] = 0.001     # block scale 0.001/6 < 2**-6 -> clamped to 2**-6 (0x08); 0.064 -> 0
    q = schemes.get("nvfp4").quantize(x)
    assert float(q.params["global_scale"]) == 1.0
    assert q.fields["scales"][0, 0].tolist() == [0x7E, 0x08]
    assert independent_unpack(q.fields["codes"])[0, 0, :2].tolist() == [0x7, 0xC]
    assert q.fields["codes"][0, 0, 8] == 0
    z = schemes.get("nvfp4").quantize(np.zeros((1, 1, 16)))
    assert float(z.params["global_scale"]) == 1.0 and not np.isnan(schemes.get("nvfp4").dequantize(z)).any()


# --------------------------------------------------------------------------------------------------
# KIVI.
# --------------------------------------------------------------------------------------------------
def ref_kivi_group(vals: list[float], bits: int) -> tuple[list[int], np.float16, np.float16]:
    """KIVI's float16 arithmetic on one group, scalar by scalar with numpy float16 (IEEE binary16) ops."""
    v16 = [np.float16(v) for v in vals]
    mn, mx = min(v16), max(v16)
    m = np.float16(2**bits - 1)
    scale = np.float16(np.float16(mx - mn) / m)
    codes = []
    for v in v16:
        if scale == 0:
            codes.append(0)
            continue
        y = float(np.float16(np.float16(v - mn) / scale))
        codes.append(round(min(max(y, 0.0), 2**bits - 1)))  # Python round: half to even
    return codes, scale, mn


def check_kivi_bound(x: np.ndarray, deq: np.ndarray, role: str, bits: int, G: int) -> None:
    T, H, D = x.shape
    xd = x.astype(np.float64)
    grouped = xd.reshape(T, H, D // G, G) if role == "value" else xd.reshape(T // G, G, H, D)
    axis = 3 if role == "value" else 1
    rng = grouped.max(axis=axis, keepdims=True) - grouped.min(axis=axis, keepdims=True)
    s = rng / (2**bits - 1)
    bound = 0.5 * s * (1 + 2.0**-9) + 2.0**-9 * rng + 2.0**-10 * np.abs(grouped) + 2.0**-23
    err = np.abs(deq.reshape(grouped.shape) - grouped)
    assert np.all(err <= bound), f"max excess {np.max(err - bound)}"


@SETTINGS
@given(kv_tensors(), st.sampled_from(["int4_kivi", "int2_kivi"]), st.sampled_from(["key", "value"]))
def test_kivi_round_trip_bound(x, name, role):
    x = x / max(1.0, float(np.abs(x).max()) / 1e4)  # KIVI computes in float16
    s = schemes.get(name, role=role)
    check_kivi_bound(x, s.dequantize(s.quantize(x)), role, s.bits, 32)


@settings(max_examples=10, deadline=None)
@given(kv_tensors(tokens=(32,), dims=(32,)), st.sampled_from([("int4_kivi", 4), ("int2_kivi", 2)]))
def test_kivi_bytes_equal_scalar_reference(x, case):
    name, bits = case
    x = x / max(1.0, float(np.abs(x).max()) / 1e4)  # KIVI computes in float16
    for role in ("value", "key"):
        s = schemes.get(name, role=role)
        q = s.quantize(x)
        codes = s.codes(q)
        for h in range(x.shape[1]):
            for i in (0, 17, 31):
                grp = x[i, h, :] if role == "value" else x[:, h, i]
                ref_codes, ref_scale, ref_mn = ref_kivi_group(list(grp), bits)
                got = codes[i, h, :] if role == "value" else codes[:, h, i]
                assert got.tolist() == ref_codes
                sc = q.fields["scale"][i, h, 0] if role == "value" else q.fields["scale"][0, h, i]
                zr = q.fields["zero"][i, h, 0] if role == "value" else q.fields["zero"][0, h, i]
                assert sc.view(np.uint16) == ref_scale.view(np.uint16) and zr.view(np.uint16) == ref_mn.view(np.uint16)


def test_kivi_hand_case_ties_and_packing():
    x = np.zeros((1, 1, 32))
    x[0, 0, :6] = [0.0, 15.0, 2.5, 3.5, 0.5, 1.5]   # min 0, max 15: scale 1; ties to even: 2.5 -> 2, 3.5 -> 4
    s = schemes.get("int4_kivi")
    q = s.quantize(x)
    assert s.codes(q)[0, 0, :6].tolist() == [0, 15, 2, 4, 0, 2]
    assert q.fields["codes"][0, 0, :3].tolist() == [0xF0, 0x42, 0x20]  # channel 2i in the low nibble
    s2 = schemes.get("int2_kivi")
    x2 = np.zeros((1, 1, 32))
    x2[0, 0, :4] = [3.0, 0.0, 1.0, 2.0]  # min 0 max 3: codes 3, 0, 1, 2 -> bits 00 10 01 00 11 ... LSB first
    assert s2.quantize(x2).fields["codes"][0, 0, 0] == 0b10_01_00_11


def test_kivi_constant_group_is_exact_and_nan_free():
    s = schemes.get("int4_kivi", role="key")
    x = np.full((32, 1, 32), 0.3, dtype=np.float16).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = s.quantize(x)
    assert not s.codes(q).any() and not q.fields["scale"].any()
    assert np.array_equal(s.dequantize(q), x.astype(np.float64))


def kivi_pack_tensor(data: np.ndarray, bits: int, pack_dim: int) -> np.ndarray:
    """A transcription of KIVI's quant/new_pack.py pack_tensor loop (int32 words, LSB first)."""
    shape = data.shape
    fpi = 32 // bits
    code = np.zeros(shape[:pack_dim] + (shape[pack_dim] // fpi,) + shape[pack_dim + 1:], dtype=np.int64)
    i = row = 0
    ui, pi = [slice(None)] * data.ndim, [slice(None)] * data.ndim
    while row < code.shape[pack_dim]:
        pi[pack_dim] = row
        for j in range(i, i + fpi):
            ui[pack_dim] = j
            code[tuple(pi)] |= data[tuple(ui)].astype(np.int64) << (bits * (j - i))
        i += fpi
        row += 1
    return code.astype(np.uint32).view(np.int32)


@pytest.mark.parametrize("name,bits", [("int4_kivi", 4), ("int2_kivi", 2)])
def test_kivi_export_matches_kivi_packing(name, bits):
    x = np.random.default_rng(5).standard_normal((64, 2, 32)).astype(np.float32)
    for role in ("key", "value"):
        s = schemes.get(name, role=role)
        q = s.quantize(x)
        out = schemes.to_kivi_layout(s, q)
        c = s.codes(q)
        data = c.transpose(1, 2, 0) if role == "key" else c.transpose(1, 0, 2)  # [H, D, T] / [H, T, D]
        assert np.array_equal(out["code"], kivi_pack_tensor(data, bits, 2))
        assert out["scale"].dtype == np.float16
        assert out["scale"].shape == ((2, 32, 2) if role == "key" else (2, 64, 1))


def test_kivi_paged_tokens_rule():
    k = schemes.get("int4_kivi", role="key", residual=128)
    v = schemes.get("int4_kivi", residual=128)
    assert [k.paged_tokens(t) for t in (0, 100, 127, 128, 129, 255, 256, 300)] == [0, 0, 0, 128, 128, 128, 256, 256]
    assert [v.paged_tokens(t) for t in (0, 100, 128, 129, 300)] == [0, 0, 0, 1, 172]
    k0 = schemes.get("int4_kivi", role="key", residual=0)
    assert k0.paged_tokens(70) == 64


# --------------------------------------------------------------------------------------------------
# Bad input.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,D", [("fp4_e2m1", 24), ("mxfp4", 48), ("nvfp4", 40)])
def test_head_dim_not_divisible_by_block(name, D):
    with pytest.raises(ValueError, match=f"head_dim {D} is not divisible"):
        schemes.get(name).quantize(np.ones((2, 1, D)))


@pytest.mark.parametrize("name,opts", ALL)
def test_wrong_rank(name, opts):
    with pytest.raises(ValueError, match=r"expected \[tokens, kv_heads, head_dim\]"):
        schemes.get(name, **opts).quantize(np.ones((4, 64)))


@pytest.mark.parametrize("name,opts", [("fp4_e2m1", {}), ("fp4_e2m1", {"profile": "sglang"}), ("mxfp4", {}),
                                       ("nvfp4", {})])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_inf_in_e2m1_schemes(name, opts, bad):
    x = np.ones((1, 1, 32))
    x[0, 0, 5] = bad
    with pytest.raises(ValueError, match=f"{name}: E2M1 has no NaN/Inf"):
        schemes.get(name, **opts).quantize(x)


@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3", "int4_kivi"])
def test_nan_rejected_elsewhere(name):
    x = np.ones((32, 1, 32))
    x[3, 0, 5] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        schemes.get(name).quantize(x)


def test_bad_options():
    with pytest.raises(ValueError, match="granularity"):
        schemes.get("fp8_e4m3", granularity="channel")
    with pytest.raises(ValueError, match="profile"):
        schemes.get("fp8_e4m3", profile="trt")
    with pytest.raises(ValueError, match="positive and finite"):
        schemes.get("fp8_e4m3", scale=0.0)
    with pytest.raises(ValueError, match="blocks of 16"):
        schemes.get("mxfp4", profile="sglang")
    with pytest.raises(ValueError, match="role"):
        schemes.get("int4_kivi", role="query")
    with pytest.raises(ValueError, match="multiple of the group size"):
        schemes.get("int4_kivi", role="key", residual=40)
    with pytest.raises(ValueError, match="not a multiple of the group size 32"):
        schemes.get("int4_kivi", role="key").quantize(np.ones((40, 1, 32)))
    with pytest.raises(ValueError, match="float16 range"):
        schemes.get("int4_kivi").quantize(np.full((1, 1, 32), 1e5))
    with pytest.raises(TypeError):
        schemes.get("fp4_e2m1").quantize(np.array([[["a"] * 16]]))


# --------------------------------------------------------------------------------------------------
# Planted bugs: the checks above must fail on each.
# --------------------------------------------------------------------------------------------------
def _fp4_case():
    x = np.random.default_rng(11).standard_normal((4, 2, 64)).astype(np.float32)
    x[:, :, 5] *= 30
    return x, schemes.get("fp4_e2m1").quantize(x)


def test_planted_wrong_scale_exponent_is_caught():
    x, q = _fp4_case()
    check_fp4_e8m0(x, q.fields, 16, "ocp")
    bad = dict(q.fields, scales=q.fields["scales"].copy())
    bad["scales"][1, 0, 2] += 1
    with pytest.raises(AssertionError):
        check_fp4_e8m0(x, bad, 16, "ocp")
    bad["scales"][1, 0, 2] -= 2
    with pytest.raises(AssertionError):
        check_fp4_e8m0(x, bad, 16, "ocp")


def test_planted_swapped_nibbles_are_caught():
    x, q = _fp4_case()
    c = q.fields["codes"]
    swapped = dict(q.fields, codes=((c << 4) | (c >> 4)).astype(np.uint8))
    with pytest.raises(AssertionError):
        check_fp4_e8m0(x, swapped, 16, "ocp")
    codes, _ = ref_fp4_e8m0(x[:1], 16, "ocp")
    assert not np.array_equal(independent_unpack(swapped["codes"][:1]), codes)


def test_planted_off_by_one_block_is_caught():
    x, q = _fp4_case()
    shifted = dict(q.fields, scales=np.roll(q.fields["scales"], 1, axis=-1))
    with pytest.raises(AssertionError):
        check_fp4_e8m0(x, shifted, 16, "ocp")
    # blocks of 16 read as if they were blocks of 32 (mxfp4's layout) are caught too
    with pytest.raises(AssertionError):
        check_fp4_e8m0(x, dict(q.fields, scales=q.fields["scales"][..., ::2]), 32, "ocp")


def test_planted_kivi_bugs_are_caught():
    x = np.random.default_rng(2).standard_normal((32, 1, 32)).astype(np.float32)
    s = schemes.get("int4_kivi", role="key")
    q = s.quantize(x)
    check_kivi_bound(x, s.dequantize(q), "key", 4, 32)
    c = q.fields["codes"]
    swapped = Quantized(q.scheme, q.shape, dict(q.fields, codes=((c << 4) | (c >> 4)).astype(np.uint8)))
    with pytest.raises(AssertionError):
        check_kivi_bound(x, s.dequantize(swapped), "key", 4, 32)
    # key grouping applied along channels instead of tokens
    with pytest.raises(AssertionError):
        check_kivi_bound(x, schemes.get("int4_kivi").dequantize(schemes.get("int4_kivi").quantize(x)), "key", 4, 32)


def test_error_table_runs_and_orders():
    rows = {(r["scheme"], r["options"]): r["rel_rms"] for r in schemes.error_table(tokens=64, heads=2)}
    assert rows[("bf16", "")] < rows[("fp8_e4m3", "")] < rows[("fp4_e2m1", "")]
    assert rows[("int2_kivi", "role=value")] > rows[("int4_kivi", "role=value")]


# --------------------------------------------------------------------------------------------------
# Model dtypes: each engine profile computes as the engine does for the model's dtype (docs/engines.md,
# "Model dtypes"). Expected bytes come from the documented arithmetic in scalar NumPy/Python, with
# ml_dtypes' casts as the independent peer for the bfloat16 and FP8 roundings.
# --------------------------------------------------------------------------------------------------
NP_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_fp4_sglang_binade_edges_per_model_dtype(dtype):
    """Blocks whose amax / 6 is 2**k, one dtype step below and one above: SGLang's compiled float32 arithmetic
    gives e = k, k, k + 1 (clamped at -33), whatever the dtype; bytes equal the scalar reference."""
    from kvqref.conformance import binade_edge_blocks

    x32, tags = binade_edge_blocks(dtype, np.random.default_rng(len(dtype)))
    q = schemes.get("fp4_e2m1", profile="sglang").quantize(x32.astype(NP_DTYPES[dtype]))
    codes, scales = ref_fp4_e8m0(x32, 16, "sglang")
    assert np.array_equal(q.fields["scales"], scales)
    assert np.array_equal(independent_unpack(q.fields["codes"]), codes)
    k, step = tags[:, 0], tags[:, 1]
    e = np.maximum(k + (step == 1), -33)
    assert q.fields["scales"][:, 0, 0].tolist() == (e + 127).tolist()
    top = independent_unpack(q.fields["codes"])[:, 0, 0] & 7
    unclamped = k >= -33
    # amax / 2**e: 3 + tiny (code 5, value 3) one step above the binade; 6 or 6 - tiny (code 7) otherwise
    assert (top[unclamped & (step == 1)] == 5).all() and (top[unclamped & (step != 1)] == 7).all()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_fp4_sglang_bf16_rounding_is_caught(dtype):
    """The planted bug of issue 15 (rounding the input to bfloat16 first) changes the scale of blocks one
    dtype step above a binade: the reference must tell."""
    from kvqref.conformance import binade_edge_blocks, to_dtype_values

    x32, tags = binade_edge_blocks(dtype, np.random.default_rng(1))
    _, scales = ref_fp4_e8m0(x32, 16, "sglang")
    wrong = schemes.get("fp4_e2m1", profile="sglang").quantize(x32.astype(ml_dtypes.bfloat16))
    amax = np.abs(x32[:, 0, 0])
    in_bf16 = to_dtype_values(amax, "bfloat16") == amax  # float16 subnormals have few bits: bfloat16 holds them
    above = (tags[:, 1] == 1) & (tags[:, 0] > -33) & ~in_bf16
    assert above.sum() >= 5
    assert (wrong.fields["scales"][above] != scales[above]).all()


def ref_fp8_engine(x32: np.ndarray, scale: float, md: str, profile: str, sglang_scale: str = "tensor") -> np.ndarray:
    """FP8 E4M3 codes of ``x32`` (values of a ``md`` model) by the engines' documented arithmetic, with
    NumPy float32 division and ml_dtypes' casts: sglang: md(x / md(s)) or md(x * f32(1/f32(s))) (torch's
    ``div_true_kernel_cuda`` converts the Python-float scale to float32 first, then takes its float32
    reciprocal), then a non-saturating E4M3FN cast; rocm: x / (2s) in float32, rounded to float16 in a float16
    model, then a saturating E4M3FNUZ cast; vllm: x / s in float32, saturating E4M3FN."""
    def rnd(v):
        return np.asarray(v, np.float32).astype(NP_DTYPES[md]).astype(np.float32)

    if profile == "sglang":
        if sglang_scale == "tensor":
            q = rnd(x32 / rnd(np.float32(scale)))
        else:
            q = rnd(x32 * (np.float32(1.0) / np.float32(scale)))  # float32 division: f32(1 / f32(s))
        return q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    if profile == "rocm":
        q = (x32 / np.float32(2 * scale)).astype(np.float32)
        if md == "float16":
            q = rnd(q)
        return np.clip(q, -240, 240).astype(ml_dtypes.float8_e4m3fnuz).view(np.uint8)
    return np.clip(x32 / np.float32(scale), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


FP8_DTYPE_CASES = [("sglang", "tensor"), ("sglang", "float"), ("rocm", "tensor"), ("vllm", "tensor")]


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([0.3, 0.0123, 1.7, 2.0**-5]) | st.floats(1e-3, 1e3))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("profile,sglang_scale", FP8_DTYPE_CASES)
def test_fp8_profiles_per_model_dtype(dtype, profile, sglang_scale, seed, scale):
    """Random K/V of each model dtype and random static scales: bytes equal the engine arithmetic."""
    from kvqref.conformance import to_dtype_values

    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (64, 2, 32)) * 400 * scale * 2.0 ** rng.integers(-8, 1, (64, 2, 1))
    x32 = to_dtype_values(np.clip(x, -60000, 60000), dtype)  # within float16's range
    s = schemes.get("fp8_e4m3", profile=profile, scale=scale, sglang_scale=sglang_scale)
    q = s.quantize(x32.astype(NP_DTYPES[dtype]))
    assert np.array_equal(q.fields["codes"], ref_fp8_engine(x32, scale, dtype, profile, sglang_scale))


def test_fp8_dtype_arithmetic_differs_where_documented():
    """The model dtype matters (so the tests above can fail): SGLang's float16 division and vLLM-ROCm's float16
    quotient give other codes than float32 arithmetic on some of the same float16 inputs."""
    from kvqref.conformance import to_dtype_values

    x32 = to_dtype_values(np.random.default_rng(2).uniform(-100, 100, (256, 1, 32)), "float16")
    for profile in ("sglang", "rocm"):
        s = schemes.get("fp8_e4m3", profile=profile, scale=0.37)
        c16 = s.quantize(x32.astype(np.float16)).fields["codes"]
        c32 = s.quantize(x32).fields["codes"]
        assert np.array_equal(c16, ref_fp8_engine(x32, 0.37, "float16", profile))
        assert (c16 != c32).sum() > 0, profile
    # vLLM's CUDA kernel widens every dtype to float32 first: the dtype changes nothing
    v = schemes.get("fp8_e4m3", scale=0.37)
    assert np.array_equal(v.quantize(x32.astype(np.float16)).fields["codes"], v.quantize(x32).fields["codes"])


def test_model_dtype_option_and_errors():
    x = np.array([[[1.0 + 2.0**-9, 70000.0]]], np.float32)
    with pytest.raises(ValueError, match=r"SGLang MHATokenToKVPool.set_kv_buffer accepts K/V in bfloat16, float16, "
                                         r"float32; got model_dtype='float64'"):
        schemes.get("fp8_e4m3", profile="sglang", model_dtype="float64")
    with pytest.raises(ValueError, match="FP4MXBlock16KVQuantizeUtil.batched_quantize accepts K/V in"):
        schemes.get("fp4_e2m1", profile="sglang", model_dtype="int8")
    with pytest.raises(ValueError, match="float16 array but model_dtype='bfloat16'"):
        schemes.get("fp4_e2m1", profile="sglang", model_dtype="bfloat16").quantize(np.zeros((1, 1, 16), np.float16))
    with pytest.raises(ValueError, match="1 input value.*overflow float16"):
        schemes.get("fp8_e4m3", scale=1000.0, profile="sglang", model_dtype="float16").quantize(x)
    # model_dtype rounds float32 input once, then computes as for an array of that dtype
    s = schemes.get("fp4_e2m1", profile="sglang", model_dtype="bfloat16")
    x16 = np.random.default_rng(0).standard_normal((4, 2, 32)).astype(np.float32)
    want = schemes.get("fp4_e2m1", profile="sglang").quantize(x16.astype(ml_dtypes.bfloat16))
    got = s.quantize(x16)
    assert all(np.array_equal(got.fields[f], want.fields[f]) for f in want.fields)
    # a tensor scale that float16 cannot hold: SGLang would divide by 0
    with pytest.raises(ValueError, match="0 or Inf in float16"):
        schemes.get("fp8_e4m3", scale=1e-9, profile="sglang").quantize(np.ones((1, 1, 4), np.float16))


def test_paged_cache_keeps_the_model_dtype():
    from kvqref.paged import PagedKVCache

    s = schemes.get("fp8_e4m3", profile="sglang", scale=0.37)
    x32 = np.random.default_rng(5).uniform(-100, 100, (20, 2, 32)).astype(np.float16)
    cache = PagedKVCache(s, s, 4, 16, 2, 32)
    cache.append(0, x32[:7], x32[:7])
    cache.append(0, x32[7:], x32[7:])
    want = s.quantize(x32).fields["codes"]
    got = cache.k.storage["codes"].reshape(-1, 2, 32)[cache.slot_mapping(0, 0, 20)]
    assert np.array_equal(got, want)
    assert not np.array_equal(want, s.quantize(x32.astype(np.float32)).fields["codes"])
    with pytest.raises(ValueError, match="a model has one dtype"):
        cache.append(0, x32[:1].astype(ml_dtypes.bfloat16), x32[:1].astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("role", ["key", "value"])
def test_kivi_stored_min_of_signed_zeros_is_defined(role):
    """A group of +-0 stores min -0.0 if it holds a -0.0 (ordering -0.0 < +0.0), whatever the order of its
    elements, and a zero scale of +0.0; a group of +0.0 only stores +0.0."""
    s = schemes.get("int4_kivi", role=role, group_size=32, residual=0)
    for order in range(3):
        x = np.zeros((32, 1, 32), np.float32)
        g = x[:, 0, :] if role == "key" else x[0, 0, :]
        g.reshape(-1)[order::3] = -0.0  # -0.0 at different positions
        if role == "key":
            x[:, 0, 1:] = 1.0  # other channels nonzero
        else:
            x[1:] = 1.0
        q = s.quantize(x)
        zero = q.fields["zero"].reshape(-1)[0]
        scale = q.fields["scale"].reshape(-1)[0]
        assert zero == 0 and np.signbit(zero) and scale == 0 and not np.signbit(scale), order
    q = s.quantize(np.zeros((32, 1, 32), np.float32))
    assert not np.signbit(q.fields["zero"]).any() and not np.signbit(q.fields["scale"]).any()
