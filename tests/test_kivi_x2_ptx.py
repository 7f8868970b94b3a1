"""The inline PTX of KIVI writes by float16 pairs (kvqref.kernels.write, ``KIVI_X2``: NVIDIA's default), executed on
the CPU by tests/ptx_emulator.py in the kernel's order of steps (pairs -> total-order keys -> packed min/max ->
scales and reciprocals -> codes -> code bytes or words), against the oracle's bytes (``KiviScheme.quantize``): codes,
scales and zeros compared as integers. The GPU runs the kernel itself against the oracle in tests/test_triton.py
(``test_write_bytes_equal_oracle`` and the KIVI write tests, where this path is the default, and
``test_kivi_f16x2_write_equals_the_portable_one``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from ptx_emulator import run_ptx  # noqa: E402

from kvqref import schemes  # noqa: E402
from kvqref.kernels import write  # noqa: E402


def _asm(c) -> str:
    return c.value if hasattr(c, "value") else c


def _call(asm, rcp_ulps: int = 0, **regs) -> dict:
    return run_ptx(_asm(asm), {f"${k[1:]}": v & 0xFFFFFFFF for k, v in regs.items()}, rcp_ulps)


def _reduce(asm, words: list[int]) -> int:
    acc = words[0]
    for w in words[1:]:
        acc = _call(asm, r1=acc, r2=w)["$0"]
    return acc


def _scale_and_codes(pairs: list[int], mn_w: int, mx_w: int, maxint: int, rcp_ulps: int,
                     scale_ptx: str, codes_ptx: str) -> tuple[int, list[int]]:
    s = _call(scale_ptx, rcp_ulps, r3=mn_w, r4=mx_w)
    return s["$0"], [_call(codes_ptx, r1=w, r2=mn_w, r3=s["$1"], r4=s["$2"])["$0"] for w in pairs]


def _code_bytes(q: list[int], bits: int, as_words: bool) -> list[int]:
    """One row's code words (two codes each) -> its code bytes, by the word packing or the byte packing."""
    out = []
    if as_words:
        per = 4 if bits == 4 else 8
        for i in range(0, len(q), per):
            regs = {f"r{k + 1}": v for k, v in enumerate(q[i:i + per])}
            w = _call(write.KIVI_X2_WORD4 if bits == 4 else write.KIVI_X2_WORD2, **regs)["$0"]
            out += [(w >> 8 * k) & 255 for k in range(4)]
    elif bits == 4:
        out = [_call(write.KIVI_X2_BYTE4, r1=w)["$0"] & 255 for w in q]
    else:
        out = [_call(write.KIVI_X2_BYTE2, r1=a, r2=b)["$0"] & 255 for a, b in zip(q[::2], q[1::2], strict=True)]
    return out


def kivi_x2(x16: np.ndarray, role: str, bits: int, group: int, rcp_ulps: int = 0, as_words: bool = True,
            codes_ptx: str | None = None) -> dict[str, np.ndarray]:
    """The KIVI_X2 write of float16 ``x16`` [T, D] (one head) by the emulated PTX: {codes, scale, zero} as the
    oracle's fields (uint8 codes, float16 bits)."""
    maxint = (1 << bits) - 1
    scale_ptx = write.kivi_x2_scale_ptx(maxint)
    codes_ptx = codes_ptx or write.kivi_x2_codes_ptx(maxint)
    u = x16.view(np.uint16).astype(np.int64)
    T, D = u.shape
    words = [[int(u[t, 2 * j] | u[t, 2 * j + 1] << 16) for j in range(D // 2)] for t in range(T)]
    keys = [[_call(write.KIVI_X2_ORDER_KEY, r1=w)["$0"] for w in row] for row in words]
    q = [[0] * (D // 2) for _ in range(T)]
    if role == "value":  # per token over groups of G channels: G / 2 pairs, then the two halves
        scale = np.zeros((T, D // group), np.uint16)
        zero = np.zeros((T, D // group), np.uint16)
        for t in range(T):
            for g in range(D // group):
                js = range(g * group // 2, (g + 1) * group // 2)
                kmn = _call(write.KIVI_X2_HALVES_MIN, r1=_reduce(write.KIVI_X2_MIN, [keys[t][j] for j in js]))["$0"]
                kmx = _call(write.KIVI_X2_HALVES_MAX, r1=_reduce(write.KIVI_X2_MAX, [keys[t][j] for j in js]))["$0"]
                mn_w = _call(write.KIVI_X2_ORDER_KEY, r1=kmn)["$0"]
                mx_w = _call(write.KIVI_X2_ORDER_KEY, r1=kmx)["$0"]
                sw, qs = _scale_and_codes([words[t][j] for j in js], mn_w, mx_w, maxint, rcp_ulps, scale_ptx,
                                          codes_ptx)
                for j, v in zip(js, qs, strict=True):
                    q[t][j] = v
                scale[t, g], zero[t, g] = sw & 0xFFFF, mn_w & 0xFFFF
    else:  # per channel pair over groups of G tokens
        scale = np.zeros((T // group, D), np.uint16)
        zero = np.zeros((T // group, D), np.uint16)
        for g in range(T // group):
            ts = range(g * group, (g + 1) * group)
            for j in range(D // 2):
                mn_w = _call(write.KIVI_X2_ORDER_KEY, r1=_reduce(write.KIVI_X2_MIN, [keys[t][j] for t in ts]))["$0"]
                mx_w = _call(write.KIVI_X2_ORDER_KEY, r1=_reduce(write.KIVI_X2_MAX, [keys[t][j] for t in ts]))["$0"]
                sw, qs = _scale_and_codes([words[t][j] for t in ts], mn_w, mx_w, maxint, rcp_ulps, scale_ptx,
                                          codes_ptx)
                for t, v in zip(ts, qs, strict=True):
                    q[t][j] = v
                scale[g, 2 * j], scale[g, 2 * j + 1] = sw & 0xFFFF, sw >> 16
                zero[g, 2 * j], zero[g, 2 * j + 1] = mn_w & 0xFFFF, mn_w >> 16
    codes = np.array([_code_bytes(row, bits, as_words) for row in q], np.uint8)
    return {"codes": codes, "scale": scale, "zero": zero}


def _oracle(x16: np.ndarray, name: str, role: str, group: int) -> dict[str, np.ndarray]:
    scheme = schemes.get(name, role=role, group_size=group, residual=0)
    f = scheme.quantize(x16.astype(np.float32)[:, None, :]).fields
    return {"codes": f["codes"][:, 0], "scale": f["scale"][:, 0].view(np.uint16),
            "zero": f["zero"][:, 0].view(np.uint16)}


def _input(rng: np.random.Generator, T: int, D: int, scale_exp: int) -> np.ndarray:
    """float16 [T, D]: normal values around 2**scale_exp with outliers, signed zeros, subnormals, constant and
    tiny-range columns and groups."""
    x = rng.standard_normal((T, D)) * 2.0**scale_exp
    x[:, 0] = 0.0                                               # a constant column: scale 0, codes 0
    x[:, 1] = np.where(rng.random(T) < 0.5, -0.0, 0.0)          # both zeros
    x[:, 2] = -np.abs(x[:, 2])
    x[::3, 2] = 0.0                                             # negatives and +0.0
    x[:, 3] = np.abs(x[:, 3])
    x[::3, 3] = -0.0                                            # positives and -0.0
    x[:, 4] = rng.integers(-3, 4, T) * 2.0**-24                 # float16 subnormals
    x[:, 5] = 0.0
    x[1, 5] = 2.0**-20                                          # a range whose scale is subnormal (code 16 -> 15)
    x[0, 6:14] = [-0.0, 0.0, -0.0, -0.0, 0.0, 0.0, -0.0, 0.0]   # value groups of zeros
    x[2, 16:48] = 1.5                                           # a constant value group
    x[rng.integers(0, T), rng.integers(0, D)] = 3000.0 * np.sign(rng.standard_normal())  # an outlier
    return np.clip(x, -30000, 30000).astype(np.float16)


CASES = [("int4_kivi", "key", 4, 8), ("int2_kivi", "key", 2, 8), ("int4_kivi", "value", 4, 32),
         ("int2_kivi", "value", 2, 16), ("int4_kivi", "value", 4, 2)]


@pytest.mark.parametrize("name,role,bits,group", CASES, ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in CASES])
@pytest.mark.parametrize("as_words", [True, False], ids=["words", "bytes"])
def test_kivi_x2_ptx_gives_the_oracle_bytes(name, role, bits, group, as_words):
    rng = np.random.default_rng(bits * 7 + group)
    x16 = _input(rng, 16, 64, -3)
    got, want = kivi_x2(x16, role, bits, group, as_words=as_words), _oracle(x16, name, role, group)
    for f in ("codes", "scale", "zero"):
        assert np.array_equal(got[f], want[f]), (f, np.argwhere(got[f] != want[f])[:5])


@pytest.mark.parametrize("rcp_ulps", [-2, -1, 1, 2])
def test_kivi_x2_codes_do_not_depend_on_the_approximate_reciprocal(rcp_ulps):
    """``rcp.approx.f32`` (within 1 ulp on the hardware) started 2 ulps either side: the Newton step gives the same
    reciprocal (bench/proof_kivi_reciprocal.py: every float16 scale), so the same bytes."""
    rng = np.random.default_rng(3)
    x16 = _input(rng, 8, 64, 2)
    got, want = kivi_x2(x16, "key", 4, 8, rcp_ulps=rcp_ulps), _oracle(x16, "int4_kivi", "key", 8)
    for f in ("codes", "scale", "zero"):
        assert np.array_equal(got[f], want[f]), f


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31), scale_exp=st.integers(-20, 12), case=st.sampled_from(CASES[:4]))
def test_kivi_x2_ptx_fuzz(seed, scale_exp, case):
    name, role, bits, group = case
    x16 = _input(np.random.default_rng(seed), 8 if role == "key" else 4, 64, scale_exp)
    got, want = kivi_x2(x16, role, bits, group), _oracle(x16, name, role, group)
    for f in ("codes", "scale", "zero"):
        assert np.array_equal(got[f], want[f]), f


def test_order_key_is_the_total_order_on_every_float16():
    """KIVI_X2_ORDER_KEY on every float16 bit pattern in each half: signed keys in the floats' order with
    -0.0 < +0.0 (NaNs left out), and the map is an involution."""
    u = np.arange(0x10000, dtype=np.int64)
    keys = np.array([_call(write.KIVI_X2_ORDER_KEY, r1=int(v) | int(v ^ 0x8000) << 16)["$0"] for v in u])
    lo = keys & 0xFFFF
    lo = lo - (lo >> 15 << 16)
    hi = keys >> 16
    hi = hi - (hi >> 15 << 16)
    vals = u.astype(np.uint16).view(np.float16).astype(np.float64)
    ok = ~np.isnan(vals)
    order = np.lexsort((~np.signbit(vals[ok]), vals[ok]))  # by value, -0.0 before +0.0
    assert (np.diff(lo[ok][order]) > 0).all()
    back = np.array([_call(write.KIVI_X2_ORDER_KEY, r1=int(k))["$0"] for k in keys[:4096]])
    assert (back & 0xFFFF == u[:4096]).all() and (back >> 16 == u[:4096] ^ 0x8000).all()
    assert (hi[:4096] == np.array([_call(write.KIVI_X2_ORDER_KEY, r1=int(v ^ 0x8000))["$0"] & 0xFFFF
                                   for v in u[:4096]]) - 0x10000 * ((u[:4096] ^ 0x8000) >= 0x8000)).all()


def test_a_planted_error_is_caught():
    """The oracle comparison fails when the clamp is off by one (MAXINT - 1): the test can fail."""
    rng = np.random.default_rng(5)
    x16 = _input(rng, 8, 64, 0)
    planted = write.kivi_x2_codes_ptx(14)  # clamps 4-bit codes at 14
    got = kivi_x2(x16, "key", 4, 8, codes_ptx=planted)
    assert not np.array_equal(got["codes"], _oracle(x16, "int4_kivi", "key", 8)["codes"])
