"""The element codecs against their definitions, against ml_dtypes and torch, and against themselves."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqref import formats
from kvqref.formats import FormatSpec, MinifloatCodec

ELEMENT_FORMATS = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float4_e2m1fn"]
ALL_FORMATS = [*ELEMENT_FORMATS, "float8_e8m0fnu"]


def all_16bit(dtype) -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint16).view(dtype)


def finite_values(codec: MinifloatCodec) -> np.ndarray:
    """Every finite value of the format, sorted, one entry per distinct value (-0 folded into +0)."""
    v = codec.decode(np.arange(codec.num_codes, dtype=np.uint8)).astype(np.float64)
    return np.unique(v[np.isfinite(v)] + 0.0)


def encode_mismatches(codec: MinifloatCodec, x: np.ndarray, ml_name: str) -> np.ndarray:
    """Indices where ``codec`` (saturate=False) and ml_dtypes' cast give different codes."""
    ours = codec.encode(x, saturate=False)
    ref = x.astype(getattr(ml_dtypes, ml_name)).view(np.uint8)
    return np.flatnonzero(ours != ref)


# --------------------------------------------------------------------------------------------------
# The documented facts.
# --------------------------------------------------------------------------------------------------
FACTS = {  # name: (bits, bias, max finite, max code, min normal, min subnormal)
    "float8_e4m3fn": (8, 7, 448.0, 0x7E, 2.0**-6, 2.0**-9),
    "float8_e5m2": (8, 15, 57344.0, 0x7B, 2.0**-14, 2.0**-16),
    "float8_e4m3fnuz": (8, 8, 240.0, 0x7F, 2.0**-7, 2.0**-10),
    "float8_e5m2fnuz": (8, 16, 57344.0, 0x7F, 2.0**-15, 2.0**-17),
    "float4_e2m1fn": (4, 1, 6.0, 0x7, 1.0, 0.5),
    "float8_e8m0fnu": (8, 127, 2.0**127, 0xFE, 2.0**-127, 2.0**-127),
}


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_facts(name):
    c = formats.get(name)
    bits, bias, mx, mx_code, mn, sub = FACTS[name]
    assert (c.bits, c.bias, c.max_finite, c.spec.max_code, c.min_normal, c.min_subnormal) == (
        bits, bias, mx, mx_code, mn, sub)
    assert c.decode(np.array([mx_code], np.uint8))[0] == mx
    assert np.nanmax(np.where(np.isinf(c.decode(np.arange(c.num_codes))), np.nan,
                              c.decode(np.arange(c.num_codes)))) == mx


def test_e2m1_values():
    c = formats.get("float4_e2m1fn")
    np.testing.assert_array_equal(c.decode(np.arange(8)), [0, 0.5, 1, 1.5, 2, 3, 4, 6])
    np.testing.assert_array_equal(c.decode(np.arange(8, 16)), -np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6]))


def test_unknown_format_lists_known_names():
    with pytest.raises(KeyError, match="float8_e4m3fn"):
        formats.get("fp8")


# --------------------------------------------------------------------------------------------------
# Peer 1: ml_dtypes, exhaustively over every float16 and bfloat16 bit pattern and every code.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("src", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("name", ELEMENT_FORMATS)
def test_encode_matches_ml_dtypes_exhaustively(name, src):
    x = all_16bit(src)
    if name == "float4_e2m1fn":
        # ml_dtypes turns NaN into a signed zero (0x8 / 0x0): a silent wrong value. kvqref raises.
        nan = np.isnan(x.astype(np.float32))
        assert (x[nan].astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x7 == 0).all()
        with pytest.raises(ValueError, match="float4_e2m1fn has no NaN"):
            formats.get(name).encode(x, saturate=False)
        x = x[~nan]
    bad = encode_mismatches(formats.get(name), x, name)
    assert bad.size == 0, f"{bad.size} mismatches, first input {x[bad[:4]]!r}"


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_decode_matches_ml_dtypes_for_every_code(name):
    c = formats.get(name)
    codes = np.arange(c.num_codes, dtype=np.uint8)
    ours = c.decode(codes)
    ref = codes.view(getattr(ml_dtypes, name)).astype(np.float32)
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, ref)  # NaN positions must agree too
    finite = ~np.isnan(ref)
    np.testing.assert_array_equal(np.signbit(ours[finite]), np.signbit(ref[finite]))


#: ml_dtypes before 0.7 rounded float64 input through float32 and E8M0 from the float32 bit pattern
_ML_DTYPES_BEFORE_0_7 = tuple(int(v) for v in ml_dtypes.__version__.split(".")[:2]) < (0, 7)


@pytest.mark.parametrize("src", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_e8m0_nearest_matches_ml_dtypes(src):
    """E8M0 'nearest' = ml_dtypes' cast for every positive 16-bit input, except one documented range.

    ml_dtypes (and torch) round the float32 bit pattern, so a float32 *subnormal* input in
    (2**-127, 1.5 * 2**-127) goes up to 2**-126, although 2**-127 is nearer; kvqref rounds the
    significand. Zero: ml_dtypes gives NaN 0xFF, as kvqref with saturate=False.
    """
    c = formats.get("float8_e8m0fnu")
    x = all_16bit(src).astype(np.float32)
    x = x[(x >= 0) | np.isnan(x)]
    ours = c.encode(x, saturate=False, rounding="nearest")
    ref = x.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
    differ = ours != ref
    expected_diff = (x > 2.0**-127) & (x < 1.5 * 2.0**-127) if _ML_DTYPES_BEFORE_0_7 else np.zeros_like(differ)
    np.testing.assert_array_equal(differ, expected_diff)
    assert (ours[expected_diff] == 0).all() and (ref[expected_diff] == 1).all()


def test_float64_input_is_rounded_once():
    """1.0625 + 2**-40 rounds once to 1.125 (ml_dtypes < 0.7 rounded float64 -> float32 -> fp8: 1.0 there; 0.7
    rounds once, as kvqref)."""
    x = np.array([1.0625 + 2.0**-40, -(1.0625 + 2.0**-40), 1.0625 - 2.0**-40, 1.0625], np.float64)
    c = formats.get("float8_e4m3fn")
    np.testing.assert_array_equal(c.round(x, saturate=True), [1.125, -1.125, 1.0, 1.0])
    peer = x[:1].astype(ml_dtypes.float8_e4m3fn).astype(np.float32)[0]
    assert peer == (1.0 if _ML_DTYPES_BEFORE_0_7 else 1.125)  # the old peer double-rounds


# --------------------------------------------------------------------------------------------------
# Peer 2: torch's float8 casts (exhaustive over every float16 bit pattern, widened to float32).
# --------------------------------------------------------------------------------------------------
torch = pytest.importorskip("torch")
TORCH_DTYPES = {n: getattr(torch, n) for n in ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                "float8_e5m2fnuz"] if hasattr(torch, n)}


def torch_encode(x: np.ndarray, name: str) -> np.ndarray:
    return torch.from_numpy(x).to(TORCH_DTYPES[name]).view(torch.uint8).numpy()


@pytest.mark.parametrize("name", list(TORCH_DTYPES))
def test_encode_matches_torch_exhaustively(name):
    """torch's CPU casts agree bit for bit on every finite input within range.

    Where torch differs it is by policy, which the test reads off torch rather than assumes:
    * overflow: torch 2.13's CPU cast to float8_e4m3fn saturates to +-448 (also +-Inf), whereas
      torch 2.11's CUDA cast (and ml_dtypes) give NaN; the test compares with kvqref's matching
      ``saturate`` policy.
    * NaN payload: torch writes E5M2 NaN as 0x7F/0xFF; kvqref and ml_dtypes write the quiet NaN
      0x7E/0xFE. Both are NaN codes; for NaN input only NaN-ness is compared.
    """
    c = formats.get(name)
    x = all_16bit(np.float16).astype(np.float32)
    got = torch_encode(x, name)
    probe = torch_encode(np.array([1e30], np.float32), name)[0]
    saturates = probe == c.spec.max_code
    ours = c.encode(x, saturate=bool(saturates))
    nan_in = np.isnan(x)
    assert np.isnan(c.decode(got[nan_in])).all()
    assert np.isnan(c.decode(ours[nan_in])).all()
    bad = np.flatnonzero((ours != got) & ~nan_in)
    assert bad.size == 0, f"{name}: {bad.size} mismatches at {x[bad[:4]]}"


def test_torch_e8m0_agrees_with_nearest():
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("this torch has no float8_e8m0fnu")
    c = formats.get("float8_e8m0fnu")
    x = all_16bit(np.float16).astype(np.float32)
    x = x[(x > 0) & np.isfinite(x)]
    got = torch.from_numpy(x).to(torch.float8_e8m0fnu).view(torch.uint8).numpy()
    np.testing.assert_array_equal(c.encode(x, saturate=True, rounding="nearest"), got)


# --------------------------------------------------------------------------------------------------
# Hand-computed edge cases, each format, both policies.
# --------------------------------------------------------------------------------------------------
INF, NAN = np.inf, np.nan
EDGES = {
    # input: (code with saturate=True, code with saturate=False); +0.0 -> 0x00 is in test_positive_zero
    # (a dict cannot hold both 0.0 and -0.0 as keys)
    "float8_e4m3fn": {-0.0: (0x80, 0x80), 2.0**-9: (0x01, 0x01), 2.0**-10: (0x00, 0x00),
                      -(2.0**-10): (0x80, 0x80), 1.5 * 2.0**-9: (0x02, 0x02), 2.0**-10 + 2.0**-30: (0x01, 0x01),
                      1.0: (0x38, 0x38), 1.0625: (0x38, 0x38), 1.1875: (0x3A, 0x3A),
                      448.0: (0x7E, 0x7E), 464.0: (0x7E, 0x7E), 464.5: (0x7E, 0x7F), 1e6: (0x7E, 0x7F),
                      -1e6: (0xFE, 0xFF), INF: (0x7E, 0x7F), -INF: (0xFE, 0xFF), NAN: (0x7F, 0x7F),
                      -NAN: (0xFF, 0xFF)},
    "float8_e5m2": {-0.0: (0x80, 0x80), 2.0**-16: (0x01, 0x01), 2.0**-17: (0x00, 0x00), 57344.0: (0x7B, 0x7B),
                    61440.0: (0x7B, 0x7C), 61439.0: (0x7B, 0x7B), INF: (0x7B, 0x7C), -INF: (0xFB, 0xFC),
                    NAN: (0x7E, 0x7E), -NAN: (0xFE, 0xFE)},
    "float8_e4m3fnuz": {-0.0: (0x00, 0x00), -(2.0**-11): (0x00, 0x00), 2.0**-10: (0x01, 0x01),
                        240.0: (0x7F, 0x7F), 247.9: (0x7F, 0x7F), 248.0: (0x7F, 0x80), -248.0: (0xFF, 0x80),
                        INF: (0x7F, 0x80), -INF: (0xFF, 0x80), NAN: (0x80, 0x80), -NAN: (0x80, 0x80)},
    "float8_e5m2fnuz": {-0.0: (0x00, 0x00), 2.0**-17: (0x01, 0x01), 57344.0: (0x7F, 0x7F),
                        61440.0: (0x7F, 0x80), INF: (0x7F, 0x80), NAN: (0x80, 0x80)},
    "float4_e2m1fn": {0.25: (0x0, 0x0), 0.2501: (0x1, 0x1), 0.75: (0x2, 0x2), 1.25: (0x2, 0x2),
                      1.75: (0x4, 0x4), 2.5: (0x4, 0x4), 3.5: (0x6, 0x6), 5.0: (0x6, 0x6),
                      -5.0: (0xE, 0xE), 5.0001: (0x7, 0x7), 7.0: (0x7, 0x7), 1e9: (0x7, 0x7),
                      INF: (0x7, 0x7), -INF: (0xF, 0xF), -0.0: (0x8, 0x8), -0.1: (0x8, 0x8)},
}


@pytest.mark.parametrize("name", list(EDGES))
def test_edge_cases(name):
    c = formats.get(name)
    for value, (sat, nosat) in EDGES[name].items():
        x = np.array([value], np.float64)  # -NAN keeps its sign bit
        for policy, want in ((True, sat), (False, nosat)):
            got = int(c.encode(x, saturate=policy)[0])
            assert got == want, f"{name} encode({value!r}, saturate={policy}) = {got:#x}, want {want:#x}"


@pytest.mark.parametrize("name", ELEMENT_FORMATS)
def test_positive_zero(name):
    for sat in (True, False):
        assert int(formats.get(name).encode(np.array([0.0]), saturate=sat)[0]) == 0


def test_negative_nan_keeps_its_sign_where_the_format_has_one():
    x = np.array([np.nan, -np.nan], np.float32)
    assert list(formats.get("float8_e4m3fn").encode(x, saturate=True)) == [0x7F, 0xFF]
    assert list(formats.get("float8_e5m2").encode(x, saturate=False)) == [0x7E, 0xFE]
    assert list(formats.get("float8_e4m3fnuz").encode(x, saturate=False)) == [0x80, 0x80]


def test_e2m1_nan_is_an_error():
    with pytest.raises(ValueError, match="float4_e2m1fn"):
        formats.get("float4_e2m1fn").encode(np.array([1.0, np.nan]), saturate=True)


E8M0_CASES = [  # x, floor, ceil, nearest
    (1.0, 0x7F, 0x7F, 0x7F), (1.5, 0x7F, 0x80, 0x80), (1.49, 0x7F, 0x80, 0x7F), (3.0, 0x80, 0x81, 0x81),
    (0.75, 0x7E, 0x7F, 0x7F), (6.0, 0x81, 0x82, 0x82), (2.0**127, 0xFE, 0xFE, 0xFE), (2.0**-127, 0, 0, 0),
    (2.0**-130, 0, 0, 0), (2.0**127 * 1.25, 0xFE, 0xFE, 0xFE), (2.0**127 * 1.75, 0xFE, 0xFE, 0xFE),
]


@pytest.mark.parametrize("x,floor,ceil,nearest", E8M0_CASES)
def test_e8m0_roundings(x, floor, ceil, nearest):
    c = formats.get("float8_e8m0fnu")
    for mode, want in (("floor", floor), ("ceil", ceil), ("nearest", nearest)):
        assert int(c.encode(np.array([x]), saturate=True, rounding=mode)[0]) == want, mode


def test_e8m0_overflow_zero_nan_negative():
    c = formats.get("float8_e8m0fnu")
    big = np.array([2.0**128, np.inf])
    assert list(c.encode(big, saturate=True, rounding="ceil")) == [0xFE, 0xFE]
    assert list(c.encode(big, saturate=False, rounding="ceil")) == [0xFF, 0xFF]
    assert int(c.encode(np.array([2.0**127 * 1.5]), saturate=False, rounding="ceil")[0]) == 0xFF
    assert list(c.encode(np.array([0.0, -0.0]), saturate=True, rounding="floor")) == [0x00, 0x00]
    assert list(c.encode(np.array([0.0]), saturate=False, rounding="floor")) == [0xFF]
    assert list(c.encode(np.array([np.nan]), saturate=True, rounding="floor")) == [0xFF]
    with pytest.raises(ValueError, match="unsigned"):
        c.encode(np.array([-1.0]), saturate=True, rounding="floor")
    with pytest.raises(ValueError, match="rounding"):
        c.encode(np.array([1.0]), saturate=True)


def test_bad_inputs_raise_clear_errors():
    c = formats.get("float8_e4m3fn")
    with pytest.raises(TypeError, match="dtype"):
        c.encode(np.array(["a"]), saturate=True)
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        formats.get("float4_e2m1fn").decode(np.array([16]))
    with pytest.raises(TypeError, match="integer codes"):
        c.decode(np.array([1.0]))
    with pytest.raises(TypeError):
        c.encode(np.array([1.0]))  # the overflow policy must be named
    assert c.encode(np.array([[1, 2], [3, 4]], np.int64), saturate=True).shape == (2, 2)


# --------------------------------------------------------------------------------------------------
# Properties (hypothesis): fresh random inputs every run.
# --------------------------------------------------------------------------------------------------
floats64 = st.floats(allow_nan=False, allow_infinity=False, width=64)


@pytest.mark.parametrize("name", ELEMENT_FORMATS)
@given(data=st.data())
@settings(max_examples=60, deadline=None)
def test_roundtrip_every_non_nan_code(name, data):
    c = formats.get(name)
    codes = data.draw(st.lists(st.integers(0, c.num_codes - 1), min_size=1, max_size=64))
    codes = np.array(codes, np.uint8)
    values = c.decode(codes)
    keep = ~np.isnan(values)
    for sat in (True, False):
        back = c.encode(values[keep], saturate=sat)
        want = codes[keep]
        if sat and c.spec.has_inf:
            want = np.where(np.isinf(values[keep]), c.encode(values[keep], saturate=True), want)
        np.testing.assert_array_equal(back, want)


@pytest.mark.parametrize("name", ELEMENT_FORMATS)
@given(xs=st.lists(floats64, min_size=2, max_size=64))
@settings(max_examples=80, deadline=None)
def test_monotone_and_within_half_ulp(name, xs):
    c = formats.get(name)
    x = np.sort(np.array(xs, np.float64))
    y = c.round(x, saturate=True).astype(np.float64)
    assert (np.diff(y) >= 0).all(), "encode is not monotone"
    assert np.isfinite(y).all(), "saturate=True gave NaN/Inf from finite input"
    inside = np.abs(x) <= c.max_finite
    vals = finite_values(c)
    idx = np.clip(np.searchsorted(vals, x[inside]), 1, len(vals) - 1)
    ulp = vals[idx] - vals[idx - 1]
    assert (np.abs(x[inside] - y[inside]) <= ulp / 2).all()


@pytest.mark.parametrize("name", ELEMENT_FORMATS)
@given(data=st.data())
@settings(max_examples=60, deadline=None)
def test_ties_go_to_even(name, data):
    c = formats.get(name)
    vals = finite_values(c)
    i = data.draw(st.integers(0, len(vals) - 2))
    lo, hi = vals[i], vals[i + 1]
    mid = (lo + hi) / 2
    code = int(c.encode(np.array([mid]), saturate=True)[0])
    assert code & 1 == 0, f"tie {mid} went to odd code {code:#x}"
    assert c.decode(np.array([code]))[0] in (lo, hi)


@pytest.mark.parametrize("name", ELEMENT_FORMATS)
@given(x=st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64))
@settings(max_examples=60, deadline=None)
def test_saturate_never_gives_nan_or_inf(name, x):
    c = formats.get(name)
    assert np.isfinite(c.round(np.array(x, np.float32), saturate=True)).all()


# --------------------------------------------------------------------------------------------------
# The tests can fail: planted bugs are caught by the exhaustive peer comparison.
# --------------------------------------------------------------------------------------------------
class TiesAwayCodec(MinifloatCodec):
    """A planted bug: rounds ties away from zero."""

    def encode(self, x, *, saturate):
        x = np.asarray(x, np.float64)
        with np.errstate(invalid="ignore"):
            up = np.nextafter(x, np.copysign(np.inf, x))
        return super().encode(up, saturate=saturate)


@pytest.mark.parametrize("planted", ["bias+1", "mbits-1", "ties-away", "no-subnormals"])
def test_planted_bugs_are_caught(planted):
    spec = formats.SPECS["float8_e4m3fn"]
    if planted == "bias+1":
        bad = MinifloatCodec(dataclasses.replace(spec, bias=spec.bias + 1))
    elif planted == "mbits-1":
        bad = MinifloatCodec(dataclasses.replace(spec, ebits=5, mbits=2))
    elif planted == "no-subnormals":
        bad = MinifloatCodec(dataclasses.replace(spec, subnormals=False))
    else:
        bad = TiesAwayCodec(spec)
    x = all_16bit(np.float16)
    assert encode_mismatches(bad, x, "float8_e4m3fn").size > 0


def test_spec_without_nan_and_with_ieee_are_distinct():
    s = FormatSpec("toy", 3, 2, 3, "ieee")
    assert s.max_code == 0b11011 and s.inf_code == 0b11100 and s.nan_code == 0b11110
