"""Rotated caches (docs/rotation.md): the exact float32 rotation rule, its float64 inverse, seeds, every scheme
rotated through the paged cache and the numpy/torch backends, the oracle's rotated attention, and errors."""

from __future__ import annotations

import json
import math
import struct
from decimal import Decimal, getcontext
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvqref import backends, conformance, reference, rotation_vectors, schemes
from kvqref.paged import PagedKVCache
from kvqref.schemes.rotation import HadamardRotation, RotatedScheme, norm_f32, splitmix64, storage_scheme

GOLDEN = Path(__file__).parent / "golden" / "golden_vectors.json"
DIMS = (2, 4, 8, 16, 32, 64, 128, 256)


# -- the rule, written again from the definition (scalar Python, one operation at a time) -------------------
def f32(v: float) -> float:
    """RNE to float32 (struct's C cast). A float32 sum, difference or product computed in float64 and then
    rounded equals the float32 operation: 53 >= 2 * 24 + 2 makes the double rounding innocuous."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def scalar_rotate(x: list[float], seed: int) -> list[float]:
    D = len(x)
    signs = [-1.0 if u >> 63 else 1.0 for u in splitmix64(seed, D)]
    c = f32(1 / math.sqrt(D)) if (D.bit_length() - 1) % 2 == 0 else None
    if c is None:  # odd log2 D: the float32 nearest to 1 / sqrt(D), from 60 decimal digits
        getcontext().prec = 60
        c = f32(float(1 / Decimal(D).sqrt()))
    y = [f32(v * s) for v, s in zip(x, signs, strict=True)]
    h = 1
    while h < D:
        for j in range(D):
            if j & h == 0:
                a, b = y[j], y[j + h]
                y[j], y[j + h] = f32(a + b), f32(a - b)
        h *= 2
    return [f32(v * c) for v in y]


def bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def test_splitmix64_and_signs_are_the_documented_generator():
    # SplitMix64 seeded with 0 (Steele et al.; the reference outputs of Vigna's splitmix64.c)
    assert splitmix64(0, 3) == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    rot = HadamardRotation(0)
    assert rot.signs(4)[:3].tolist() == [-1.0, 1.0, 1.0]  # bit 63 of the outputs above
    assert np.array_equal(rot.signs(128)[:64], rot.signs(64))
    s = HadamardRotation(12345).signs(256)
    assert 96 < int((s < 0).sum()) < 160  # not all equal: a random sign vector, not the identity
    assert not np.array_equal(s, HadamardRotation(12346).signs(256))


@pytest.mark.parametrize("D", DIMS)
def test_norm_constant_is_the_nearest_float32_and_the_matrix_is_orthogonal(D):
    c = norm_f32(D)
    getcontext().prec = 60
    exact = 1 / Decimal(D).sqrt()
    for other in (np.nextafter(c, np.float32(0)), np.nextafter(c, np.float32(1))):
        assert abs(Decimal(float(c)) - exact) < abs(Decimal(float(other)) - exact)
    if (D.bit_length() - 1) % 2 == 0:
        assert float(c) == 1 / math.sqrt(D)  # a power of two: exact
    M = HadamardRotation(D).matrix(D)
    idx = np.arange(D)
    H = np.array([[(-1) ** bin(i & j).count("1") for j in idx] for i in idx], np.float64)
    assert np.array_equal(M, np.diag(HadamardRotation(D).signs(D).astype(np.float64)) @ H * float(c))
    gram = M @ M.T  # sums of D terms +-c^2: float64 rounding only
    np.testing.assert_allclose(gram, np.eye(D) * (D * float(c) ** 2), rtol=0, atol=D * 2.0**-52)
    assert abs(D * float(c) ** 2 - 1) <= 2.0**-23


BIG = float(np.float32(1e30))
FLOATS = st.floats(-BIG, BIG, width=32)  # normal and subnormal; D * 1e30 cannot overflow float32


@st.composite
def vectors(draw, count: int = 1):
    """``count`` float32 arrays [tokens, D] of one power-of-two D in [2, 256]."""
    shape = (draw(st.integers(1, 3)), 2 ** draw(st.integers(1, 8)))
    return [draw(hnp.arrays(np.float32, shape, elements=FLOATS)) for _ in range(count)]


@settings(max_examples=60, deadline=None)
@given(vectors(), st.integers(0, 2**64 - 1))
def test_rotation_is_the_exact_float32_rule(xs, seed):
    """Bit-exact against the scalar definition and against torch's float32 butterflies (a peer)."""
    (x,) = xs
    rot = HadamardRotation(seed)
    z = rot.rotate(x)
    assert z.dtype == np.float32
    want = np.array([scalar_rotate([float(v) for v in row], seed) for row in x], np.float32)
    assert np.array_equal(bits(z), bits(want))
    torch = pytest.importorskip("torch")
    from kvqref.backends.torch_backend import hadamard

    D = x.shape[-1]
    peer = hadamard(torch.from_numpy(x) * torch.from_numpy(rot.signs(D))) * torch.tensor(norm_f32(D))
    assert np.array_equal(bits(peer.numpy()), bits(z))


@settings(max_examples=60, deadline=None)
@given(vectors(count=2), st.integers(0, 2**64 - 1))
def test_inverse_and_query_rotation_in_float64(xk, seed):
    """unrotate(rotate(x)) = x and rotate_query(q) . rotate(k) = q . k, within the float32 rounding of the
    n + 1 rounding steps of rotate (relative 2**-24 each, growing the 2-norm by at most that) plus the
    absolute error of subnormal results (2**-150 per element and step)."""
    x, k = xk
    rot = HadamardRotation(seed)
    D = x.shape[-1]
    n = D.bit_length() - 1
    rel = (n + 3) * 2.0**-24
    sub = (n + 3) * math.sqrt(D) * 2.0**-149
    x64 = x.astype(np.float64)
    back = rot.unrotate(rot.rotate(x))
    err = np.linalg.norm(back - x64, axis=-1)
    assert (err <= rel * np.linalg.norm(x64, axis=-1) + sub).all()
    q = x64
    s = np.sum(rot.rotate_query(q) * rot.rotate(k), axis=-1)
    exact = np.sum(q * k.astype(np.float64), axis=-1)
    bound = np.linalg.norm(q, axis=-1) * (rel * np.linalg.norm(k.astype(np.float64), axis=-1) + sub)
    assert (np.abs(s - exact) <= bound * 1.0001 + 1e-300).all()


def test_seed_and_option_validation():
    for bad in (1.0, "1", True, 2.5, [1]):
        with pytest.raises(TypeError, match="integer"):
            schemes.get("fp8_e4m3", rotation="hadamard", rotation_seed=bad)
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match=r"\[0, 2\*\*64\)"):
            schemes.get("fp8_e4m3", rotation="hadamard", rotation_seed=bad)
    with pytest.raises(ValueError, match="without rotation"):
        schemes.get("fp8_e4m3", rotation_seed=3)
    with pytest.raises(ValueError, match="hadamard"):
        schemes.get("fp8_e4m3", rotation="walsh")
    a = schemes.get("bf16", rotation="hadamard", rotation_seed=np.int64(9))
    assert a.rotation == HadamardRotation(9) and a.name == "bf16+hadamard(seed=9)"
    assert schemes.get("bf16", rotation="hadamard").rotation.seed == 0  # documented default
    assert not isinstance(schemes.get("bf16", rotation=None), RotatedScheme)
    with pytest.raises(ValueError, match="already rotated"):
        RotatedScheme(a, HadamardRotation(1))


@pytest.mark.parametrize("D", [96, 1, 48])
def test_head_dim_must_be_a_power_of_two(D):
    s = schemes.get("bf16", rotation="hadamard", rotation_seed=1)
    with pytest.raises(ValueError, match="power of two"):
        s.quantize(np.ones((2, 1, D), np.float32))
    with pytest.raises(ValueError, match="power of two"):
        PagedKVCache(s, "bf16", 4, 16, 1, D)


@pytest.mark.parametrize("name", ["fp8_e4m3", "bf16", "int4_kivi"])
def test_nonfinite_and_overflowing_input_raise(name):
    s = schemes.get(name, rotation="hadamard", rotation_seed=1, **({"scale": 1.0} if name == "fp8_e4m3" else {}))
    x = np.random.default_rng(0).standard_normal((2, 1, 64)).astype(np.float32)
    for bad in (np.nan, np.inf):
        y = x.copy()
        y[1, 0, 3] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            s.quantize(y)
    y = np.full((1, 1, 64), 3e38, np.float32)
    with pytest.raises(ValueError, match="overflow float32"):
        s.quantize(y)


def test_rotated_codes_differ_and_containers_do_not_mix():
    x = schemes.outlier_tensor(32, 2, 128, seed=1)
    plain, rot = schemes.get("fp4_e2m1"), schemes.get("fp4_e2m1", rotation="hadamard", rotation_seed=5)
    qp, qr = plain.quantize(x), rot.quantize(x)
    assert not np.array_equal(qp.fields["codes"], qr.fields["codes"])  # no silent identity rotation
    assert np.array_equal(qr.fields["codes"], plain.quantize(rot.rotation.rotate(x)).fields["codes"])
    assert qr.scheme == rot.name and rot.bits_per_element(128) == plain.bits_per_element(128)
    assert np.abs(rot.dequantize(qr) - x).max() < np.abs(x).max() / 4  # the original domain
    with pytest.raises(ValueError, match="mixed up"):
        rot.dequantize(qp)
    with pytest.raises(ValueError, match="mixed up"):
        schemes.get("fp4_e2m1", rotation="hadamard", rotation_seed=6).dequantize(qr)


# -- every scheme rotated, through the paged cache and the backends -----------------------------------------
ROT_K, ROT_V = {"rotation": "hadamard", "rotation_seed": 11}, {"rotation": "hadamard", "rotation_seed": 2**63 + 5}
PAIRS = [
    ("bf16", {}, "bf16", {}),
    ("fp8_e4m3", {}, "fp8_e4m3", {"granularity": "head"}),
    ("fp8_e4m3", {"granularity": "token_head"}, "fp8_e5m2", {}),
    ("fp8_e4m3", {"profile": "sglang", "scale": 0.5, "saturate": True}, "fp8_e5m2", {"profile": "rocm"}),
    ("fp4_e2m1", {}, "fp4_e2m1", {"profile": "sglang"}),
    ("mxfp4", {}, "nvfp4", {}),
    *[(f"int{b}_kivi", {"role": "key", "group_size": 16, "residual": r},
       f"int{b}_kivi", {"role": "value", "group_size": gv, "residual": r}) for b, gv, r in ((4, 16, 32), (2, 32, 16))],
]
SHAPE = dict(batch=3, kv_heads=2, q_heads=4, head_dim=64, page_size=16, lens=(1, 37, 70))


def _rotated_cache(pair, seed=0):
    kname, kopt, vname, vopt = pair
    return conformance.build_cache(("", kname, {**kopt, **ROT_K}, vname, {**vopt, **ROT_V}), SHAPE,
                                   np.random.default_rng(seed))


def test_every_scheme_name_is_covered():
    assert {p[0] for p in PAIRS} | {p[2] for p in PAIRS} == set(schemes.names())


@pytest.mark.parametrize("pair", PAIRS, ids=[p[0] + "/" + p[2] for p in PAIRS])
def test_rotated_paged_cache_stores_the_rotated_domain(pair):
    """Pages hold the bytes of one-shot rotated quantization, the residual holds the exact float32 rotation,
    ``dequantized`` is the original domain, and the oracle's rotated decode equals attention over it."""
    cache, whole = _rotated_cache(pair)
    assert cache.bytes_per_page() == PagedKVCache(storage_scheme(cache.k_scheme), storage_scheme(cache.v_scheme),
                                                  1, SHAPE["page_size"], SHAPE["kv_heads"],
                                                  SHAPE["head_dim"]).bytes_per_page()
    stored = cache.storage_view()
    for b, (k, v) in enumerate(whole):
        T = len(k)
        for which, x, side in (("k", k, cache.k), ("v", v, cache.v)):
            n = side.scheme.paged_tokens(T)
            got = cache.quantized(b, which)
            if n:
                ref = side.scheme.quantize(x[:n], params=side.params)
                for f in got.fields:
                    assert np.array_equal(got.fields[f].view(np.uint8), ref.fields[f].view(np.uint8)), (b, which, f)
            assert np.array_equal(bits(side.residual[b]), bits(side.rotation.rotate(x[n:])))
        K, V = cache.dequantized(b)
        Ks, Vs = stored.dequantized(b)
        np.testing.assert_allclose(K, cache.k.rotation.unrotate(Ks), rtol=0, atol=1e-12 * np.abs(K).max())
        np.testing.assert_allclose(V, cache.v.rotation.unrotate(Vs), rtol=0, atol=1e-12 * np.abs(V).max())
        assert np.abs(K - k).max() <= 0.5 * np.abs(k).max()  # original domain, not rotated
    q = np.random.default_rng(1).standard_normal((3, 4, 64))
    out, lse = backends.get("numpy").decode(q, backends.get("numpy").prepare(cache))
    Ks, Vs = zip(*(cache.dequantized(b) for b in range(cache.batch)), strict=True)
    ref_out, ref_lse = reference.attention(q, Ks, Vs)
    scale = max(np.abs(V).max() for V in Vs)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-12 * scale)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=1e-12 * np.abs(ref_lse[np.isfinite(ref_lse)]).max())
    # the negative control: rotated keys read by an unrotated query give different attention
    bad, _ = reference.attention(q, *zip(*(cache.storage_view().dequantized(b) for b in range(3)), strict=True))
    assert np.abs(bad - ref_out).max() > 1e-3 * scale


@pytest.mark.parametrize("pair", PAIRS, ids=[p[0] + "/" + p[2] for p in PAIRS])
def test_torch_backend_reads_rotated_caches(pair):
    torch = pytest.importorskip("torch")
    from kvqref.backends.torch_backend import RotatedDeviceCache, dequantize, gather
    from kvqref.backends.torch_backend import decode as torch_decode

    cache, _ = _rotated_cache(pair, seed=3)
    tb = backends.get("torch")
    dc = tb.prepare(cache)
    assert isinstance(dc, RotatedDeviceCache)
    k, v, _ = gather(dc.storage, dequantize(dc.storage.k), dequantize(dc.storage.v))
    stored = cache.storage_view()
    Ks, Vs = zip(*(stored.dequantized(b) for b in range(cache.batch)), strict=True)
    for b in range(cache.batch):  # stored values: the oracle's, up to torch's float32 scale products (2 ulp)
        T = Ks[b].shape[0]
        np.testing.assert_allclose(k[b, :, :T].transpose(0, 1).cpu().numpy(), Ks[b], rtol=2.0**-22, atol=0)
        np.testing.assert_allclose(v[b, :, :T].transpose(0, 1).cpu().numpy(), Vs[b], rtol=2.0**-22, atol=0)
    q = np.random.default_rng(4).standard_normal((3, 4, 64)).astype(np.float32)
    ref, _ = reference.decode_attention(q, cache)
    # float32: kernel_tolerance of the stored-domain attention, plus the float32 rotation of q (relative error
    # r = (n + 2) 2**-24 in 2-norm: scores move by e_q = sm_scale r ||q'|| max||k||) and of the output
    out32, _ = torch_decode(torch.from_numpy(q).to(tb.device()), dc, dtype=torch.float32)
    qs = cache.k.rotation.rotate_query(q)
    tol, _ = reference.kernel_tolerance(qs, Ks, Vs)
    r = (6 + 2) * 2.0**-24
    kmax = np.array([np.linalg.norm(K, axis=-1).max() for K in Ks])[:, None]
    vmax = np.array([np.linalg.norm(V, axis=-1).max() for V in Vs])[:, None]
    e_q = r * np.linalg.norm(qs, axis=-1) * kmax / 8
    bound = np.linalg.norm(tol, axis=-1) + np.expm1(2 * e_q) * vmax + r * np.linalg.norm(ref, axis=-1)
    err = np.linalg.norm(out32.cpu().numpy() - ref, axis=-1)
    assert (err <= bound).all(), (err / bound).max()
    out, _ = tb.decode(torch.from_numpy(q).to(tb.device()), dc)  # bfloat16 SDPA: a smoke bound
    assert np.abs(out.cpu().numpy() - ref).max() <= 5e-2 * np.abs(ref).max()


def test_one_rotated_side_is_enough_to_be_refused():
    """A backend that cannot rotate queries refuses a cache with one rotated side (every registered backend
    rotates: the triton kernels too, tests/test_triton_rotation.py)."""

    class NoRotation(backends.Backend):
        name = "plain"

    cache = PagedKVCache("bf16", schemes.get("bf16", rotation="hadamard", rotation_seed=1), 4, 16, 1, 64)
    with pytest.raises(ValueError, match=r"V: hadamard\(seed=1\).*cannot rotate queries"):
        NoRotation().prepare(cache)
    assert all(backends.get(n).rotates_queries for n in ("numpy", "torch"))
    assert backends.TritonBackend.rotates_queries


# -- rotated attention == unrotated attention up to quantization error --------------------------------------
def _pair_caches(name, opts_k, opts_v, k, v):
    caches = []
    for rot in ({}, {"rotation": "hadamard"}):
        c = PagedKVCache(schemes.get(name, **opts_k, **rot, **({"rotation_seed": 3} if rot else {})),
                         schemes.get(name, **opts_v, **rot, **({"rotation_seed": 4} if rot else {})),
                         16, 32, k.shape[1], k.shape[2])
        c.append(0, k, v)
        caches.append(c)
    return caches


def test_bf16_rotated_attention_equals_unrotated_within_the_derived_bound():
    """Each cache's bf16 values are within u' = 2**-8 + (n + 3) 2**-23 (bf16 RNE plus the float32 rotation and
    float64 unrotation) of the exact ones in 2-norm per token, so every score of either is within
    E = sm_scale ||q|| u' max||k|| of the exact score, the two softmaxes differ by a factor within e**(+-4E)
    and ||out_rot - out|| <= ((e**(4E) - 1)(1 + u') + 2u') max||v|| (+ float64 slack)."""
    rng = np.random.default_rng(7)
    T, H, D = 48, 2, 128
    k = schemes.outlier_tensor(T, H, D, seed=7, outliers=((3, 2.0), (80, 4.0)))
    v = rng.standard_normal((T, H, D)).astype(np.float32)
    # each query head points at one key (token 5 + h), so attention is peaked and a wrong q path is visible
    kk = k.astype(np.float64)[5 + np.arange(4), np.arange(4) // 2]
    q = (3 * kk / np.linalg.norm(kk, axis=-1, keepdims=True) + 0.05 * rng.standard_normal((4, D)))[None]
    plain, rot = _pair_caches("bf16", {}, {}, k, v)
    out_u, lse_u = reference.decode_attention(q, plain)
    out_r, lse_r = reference.decode_attention(q, rot)
    n = D.bit_length() - 1
    u = 2.0**-8 + (n + 3) * 2.0**-23
    kmax = np.linalg.norm(k.astype(np.float64), axis=-1).max()
    vmax = np.linalg.norm(v.astype(np.float64), axis=-1).max()
    E = np.linalg.norm(q, axis=-1) / math.sqrt(D) * u * kmax  # [1, Hq]
    bound = ((np.exp(4 * E) - 1) * (1 + u) + 2 * u) * vmax + 1e-12 * vmax
    diff = np.linalg.norm(out_r - out_u, axis=-1)
    assert (diff <= bound).all() and (diff > 0).all()
    assert (np.abs(lse_r - lse_u) <= 2 * E + 1e-12).all()
    # negative control: the same stored keys read without rotating q break the bound
    stored = rot.storage_view()
    wrong, _ = reference.attention(q, *[[a] for a in stored.dequantized(0)])
    assert (np.linalg.norm(rot.v.rotation.unrotate(wrong) - out_u, axis=-1) > 2 * bound).all()


@pytest.mark.parametrize("name,ok,ov", [("fp8_e4m3", {}, {}), ("fp4_e2m1", {}, {}), ("nvfp4", {}, {}),
                                         ("int4_kivi", {"role": "key", "residual": 0}, {"residual": 0})])
def test_quantized_rotated_attention_error_is_of_the_same_order(name, ok, ov):
    """On Gaussian K and V (no outliers: nothing for a rotation to spread) the rotated cache's attention
    error is within a factor 3 of the unrotated one's, both measured against the float64 attention."""
    rng = np.random.default_rng(11)
    T, H, D = 256, 2, 64
    k, v = (rng.standard_normal((T, H, D)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((1, 8, D))
    exact, _ = reference.attention(q, [k], [v])
    errs = []
    for c in _pair_caches(name, ok, ov, k, v):
        out, _ = reference.decode_attention(q, c)
        errs.append(np.linalg.norm(out - exact) / np.linalg.norm(exact))
    assert 0 < errs[1] < 3 * errs[0] and errs[0] < 3 * errs[1], errs


def test_rotation_spreads_outlier_channels_for_power_of_two_blocks_and_integer_groups():
    """Measured in docs/rotation.md: E8M0 blocks and KIVI's per-token groups gain from the rotation on the outlier
    tensor; per-channel KIVI keys (each outlier channel has its own scale already) do not."""
    x = schemes.outlier_tensor(256, 2, 128, seed=3)

    def ratio(name, **o):
        return (schemes.relative_rms(schemes.get(name, rotation="hadamard", rotation_seed=1, **o), x)
                / schemes.relative_rms(schemes.get(name, **o), x))

    for name in ("fp4_e2m1", "mxfp4", "int4_kivi"):
        assert ratio(name) < 0.85, name
    assert 0.9 < ratio("int4_kivi", role="key") < 1.1


# -- golden vectors -------------------------------------------------------------------------------------------
def test_golden_rotation_vectors_follow_the_scalar_definition():
    doc = json.loads(GOLDEN.read_text())["rotations"]
    assert {c["head_dim"] for c in doc["cases"]} == set(DIMS)
    for case in doc["cases"]:
        D, seed = case["head_dim"], int(case["seed"])
        x = np.array([int(h, 16) for h in case["inputs"].split()], np.uint32).view(np.float32).reshape(-1, D)
        z = np.array([int(h, 16) for h in case["outputs"].split()], np.uint32)
        want = np.array([scalar_rotate([float(a) for a in row], seed) for row in x], np.float32)
        assert np.array_equal(z, bits(want).ravel()), (D, seed)
        assert case["signs"] == "".join("-" if u >> 63 else "+" for u in splitmix64(seed, D))
        assert (x[2] != 0).any() and (np.abs(x[2]) < np.finfo(np.float32).tiny).any()  # subnormals
    assert {(c["scheme"], c["options"].get("role", "")) for c in doc["schemes"]} >= {
        (n, "") for n in ("bf16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "mxfp4", "nvfp4")}
    x = rotation_vectors.spread_inputs(1, 4)
    assert x.dtype == np.float32 and len(set(x.tolist())) == 4


def test_rotation_study_rows_and_table():
    from kvqref.eval import rotation as rotation_study
    from kvqref.eval import study

    configs = study.configs_named(["fp4_e2m1", "int4_kivi"])
    rows = rotation_study.run(["gaussian", "outlier"], configs, tokens=64, kv_heads=2, head_dim=128, q_heads=4,
                              queries=2, seeds=(0,))
    assert len(rows) == 2 * 2 * 2
    assert {(r["cache"], r["base"], r["rotated"]) for r in rows} == {
        (k, c.label, rot) for k in ("gaussian", "outlier") for c in configs for rot in (False, True)}
    rot = next(r for r in rows if r["rotated"] and r["base"] == "int4_kivi")
    assert rot["k_scheme"].endswith("rotation=hadamard, rotation_seed=1)") and rot["config"] == "int4_kivi +H"
    assert all(0 < r["attn_rel_err"] < 2 for r in rows)
    md = rotation_study.markdown(rows)
    assert md.count("| fp4_e2m1 |") == 2 and "**outlier** caches" in md and "+H / plain" in md
    with pytest.raises(ValueError, match="cache kind"):
        rotation_study.make_caches("uniform")


def test_input_is_read_exactly_and_rounded_to_float32_once():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rot = HadamardRotation(3)
    x64 = np.random.default_rng(5).standard_normal((4, 32)) * 3
    assert np.array_equal(bits(rot.rotate(x64)), bits(rot.rotate(x64.astype(np.float32))))
    for dt in (ml_dtypes.bfloat16, np.float16):
        xn = x64.astype(dt)
        assert np.array_equal(bits(rot.rotate(xn)), bits(rot.rotate(xn.astype(np.float32))))


@pytest.mark.parametrize("name,opts", [("fp8_e4m3", {"profile": "sglang", "scale": 0.05}), ("fp4_e2m1", {}),
                                       ("int4_kivi", {"role": "value", "residual": 0})])
def test_paged_cache_of_16_bit_input_stores_rotated_float32_values(name, opts):
    """A 16-bit model's tokens: the cache quantizes the float32 rotated values (not rounded back to the model
    dtype), so its bytes equal ``RotatedScheme.quantize`` of the same array, as for float32 input."""
    import ml_dtypes

    s = schemes.get(name, rotation="hadamard", rotation_seed=2, **opts)
    x = np.random.default_rng(0).standard_normal((32, 2, 64)).astype(ml_dtypes.bfloat16)
    c = PagedKVCache("bf16", s, 4, 16, 2, 64)
    c.append(0, x[:13], x[:13])
    c.append(0, x[13:], x[13:])
    want = s.quantize(x, params=c.v_params)
    got = c.quantized(0, "v")
    for f in want.fields:
        assert np.array_equal(got.fields[f].view(np.uint8), want.fields[f].view(np.uint8)), f


def test_static_params_of_a_rotated_scheme_are_the_inner_schemes():
    """``check_params`` of a rotated scheme is its inner scheme's (a static FP8 scale applies to rotated values),
    so a paged cache takes them at creation."""
    s = schemes.get("fp8_e4m3", rotation="hadamard", rotation_seed=1)
    assert s.check_params({"scale": 0.5}, 2) == {"scale": np.float32(0.5)}
    with pytest.raises(ValueError, match="params"):
        s.check_params({"bogus": 1.0}, 2)
    c = PagedKVCache(s, s, 4, 16, 2, 64, k_params={"scale": 0.5}, v_params={"scale": 0.25})
    x = np.random.default_rng(1).standard_normal((5, 2, 64)).astype(np.float32)
    c.append(0, x, x)
    assert np.array_equal(c.quantized(0, "k").fields["codes"], s.quantize(x, params={"scale": 0.5}).fields["codes"])


def test_given_params_are_the_inner_schemes_applied_to_rotated_values():
    """A rotated scheme checks given tensor-level params as its inner scheme does (a static FP8 scale, NVFP4's
    global scale) and applies them to rotate(x): the paged cache stores the inner scheme's bytes of rotate(x)."""
    from kvqref.paged import PagedKVCache

    x = schemes.outlier_tensor(40, 2, 64, seed=3, outliers=((3, 10.0), (37, 30.0)))
    for name, params in (("fp8_e4m3", {"scale": 0.05}), ("nvfp4", {"global_scale": 0.002})):
        s = schemes.get(name, rotation="hadamard", rotation_seed=11)
        assert s.check_params(params, 2) == s.inner.check_params(params, 2)
        with pytest.raises(ValueError):
            s.check_params({"scale": -1.0, "global_scale": -1.0}, 2)
        cache = PagedKVCache(s, s, num_pages=2, page_size=32, kv_heads=2, head_dim=64, k_params=params,
                             v_params=params)
        cache.append(0, x[:25], x[:25])
        cache.append(0, x[25:], x[25:])
        want = s.inner.quantize(s.rotation.rotate(x), params=params)
        got = cache.quantized(0, "k")
        for f in want.fields:
            np.testing.assert_array_equal(got.fields[f], want.fields[f])
    with pytest.raises(ValueError, match="no tensor-level params"):
        schemes.get("mxfp4", rotation="hadamard").check_params({"scale": 1.0})


def test_rotation_study_covers_every_scheme_with_and_without():
    """The synthetic study (issue 13, item 4) pairs every configuration with its rotated twin, and its
    configurations cover every scheme name (K and V)."""
    from kvqref.eval import rotation as rotation_study
    from kvqref.eval import study

    assert {c.k[0] for c in study.CONFIGS} == {c.v[0] for c in study.CONFIGS} == set(schemes.names())
    for c in study.CONFIGS:
        r = rotation_study.rotated(c)
        assert r.label == c.label + " +H"
        assert r.k[1]["rotation"] == r.v[1]["rotation"] == "hadamard"
        assert (r.k[1]["rotation_seed"], r.v[1]["rotation_seed"]) == (rotation_study.K_SEED, rotation_study.V_SEED)
        assert {k: v for k, v in r.k[1].items() if not k.startswith("rotation")} == c.k[1]


def test_channel_structure_statistics():
    """kvqref.eval.channels on KIVI-structured synthetic keys: the rotation flattens the channel ranges
    (range_spread falls to near 1) but keeps the energy in per-channel means (an orthogonal map of the mean
    vector), and per-channel KIVI keys stay better than per-token ones either way."""
    from kvqref.eval import channels, study

    k = study.kivi_synthetic(256, 2, 64, 4, 2, seed=0).k
    rows = channels.measure([k[:, :1], k[:, 1:]], seed=3)
    assert len(rows) == 2 * 1 * 2 and {r["rotated"] for r in rows} == {False, True}
    plain, rot = channels.summary(rows)
    assert plain["range_spread median"] > 3 and rot["range_spread median"] < 0.5 * plain["range_spread median"]
    assert rot["offset_share median"] == pytest.approx(plain["offset_share median"], rel=1e-5)
    for s in (plain, rot):
        assert s["int4 per-channel rel RMS"] < s["int4 per-token rel RMS"]
    assert "| keys |" in channels.markdown(rows)
