"""The fast-mode error bound (kvqref.reference.fast_rounding + kernel_tolerance(fast=...)) on its own, with
a NumPy model of the fast kernel's arithmetic: q and the probabilities rounded once to bfloat16 (RNE from
the definition, kvqref.schemes._num.round_bf16), everything else in float64. The bound must hold on fresh
random inputs with outlier channels, must be larger than the float32 bound, and must miss neither the
rounding it models (a model that rounds p twice as coarsely fails) nor a one-code-step change of V.
The kernels themselves are checked against the same bound in tests/test_triton.py.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqref import reference, schemes
from kvqref.schemes._num import round_bf16


def _fast_model(q, K, V, sm, p_bits: int = 8):
    """Attention of one sequence as the fast kernel computes it for a bfloat16-tile scheme: q rounded to
    bfloat16, p = exp(s - max) rounded to ``p_bits`` significant bits (8: bfloat16), normalised by the
    sum of the unrounded p."""
    Hq, Hkv = q.shape[0], K.shape[1]
    kv_of = np.arange(Hq) // (Hq // Hkv)
    qr = round_bf16(q).astype(np.float64)
    s = sm * np.einsum("hd,thd->ht", qr, K[:, kv_of, :])
    p = np.exp(s - s.max(axis=1, keepdims=True))
    l = p.sum(axis=1, keepdims=True)
    if p_bits == 8:
        pr = round_bf16(p).astype(np.float64)
    else:
        m, e = np.frexp(p)
        pr = np.ldexp(np.round(np.ldexp(m, p_bits)), e - p_bits)
    return np.einsum("ht,thd->hd", pr / l, V[:, kv_of, :])


def _case(seed: int, T: int):
    rng = np.random.default_rng(seed)
    H, Hq, D = 2, 8, 64
    K = rng.standard_normal((T, H, D))
    K[:, :, ::13] *= 20.0  # outlier channels
    V = rng.standard_normal((T, H, D))
    q = rng.standard_normal((1, Hq, D)).astype(np.float32)  # float32 q: the kernel rounds it to bfloat16
    return q, K, V, 1.0 / math.sqrt(D)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), T=st.integers(1, 300))
def test_fast_model_is_within_the_fast_bound_and_beyond_the_float32_one(seed, T):
    q, K, V, sm = _case(seed, T)
    bf = schemes.get("bf16")
    fast = reference.fast_rounding(bf, bf, "float32")
    assert fast.u_q == reference.U_BF16 and fast.u_p == reference.U_BF16
    ref, _ = reference.attention(q.astype(np.float64), [K], [V], sm)
    tol_fast, lse_fast = reference.kernel_tolerance(q, [K], [V], sm, fast=fast)
    tol_exact, lse_exact = reference.kernel_tolerance(q, [K], [V], sm)
    out = _fast_model(q[0].astype(np.float64), K, V, sm)
    assert (np.abs(out - ref[0]) <= tol_fast[0]).all()
    assert (tol_fast >= tol_exact).all() and (lse_fast >= lse_exact).all()
    if T > 1:  # one token gives p = 1, exact in any format
        assert (np.abs(out - ref[0]) > tol_exact[0]).any()  # the float32 bound does not cover fast mode


def test_fast_bound_sees_a_coarser_rounding_and_one_code_step():
    """p rounded to 6 bits instead of 8 (bfloat16 q) exceeds the bound on some seed; one FP4 code step of V (the
    neighbouring E2M1 value at the largest element of the most-attended token) exceeds it too."""
    bf = schemes.get("bf16")
    fast = reference.fast_rounding(bf, bf, "bfloat16")
    coarse_fails = False
    for seed in range(8):
        q, K, V, sm = _case(seed, 40)
        q = round_bf16(q)  # a bfloat16 q: no logit rounding, the bound is the probabilities' (u_p = 2**-8)
        ref, _ = reference.attention(q.astype(np.float64), [K], [V], sm)
        tol, _ = reference.kernel_tolerance(q, [K], [V], sm, fast=fast)
        out = _fast_model(q[0].astype(np.float64), K, V, sm, p_bits=6)
        coarse_fails |= bool((np.abs(out - ref[0]) > tol[0]).any())
    assert coarse_fails
    fp4 = schemes.get("fp4_e2m1")
    q, K, V, sm = _case(3, 40)
    qz = fp4.quantize(V)
    Vq = fp4.dequantize(qz)
    ref, _ = reference.attention(q.astype(np.float64), [K], [Vq], sm)
    tol, _ = reference.kernel_tolerance(q, [K], [Vq], sm, fast=reference.fast_rounding(fp4, fp4, "float32"))
    top = int(np.argmax(K[:, 0, :] @ q[0, 0]))
    d = int(np.argmax(np.abs(Vq[top, 0, :])))
    scale = 2.0 ** (int(qz.fields["scales"][top, 0, d // fp4.block]) - 127)
    ladder = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    i = ladder.index(abs(Vq[top, 0, d]) / scale)
    step = Vq.copy()
    step[top, 0, d] = np.sign(Vq[top, 0, d]) * ladder[i - 1] * scale  # one E2M1 code lower
    out = _fast_model(q[0].astype(np.float64), K, step, sm)
    assert (np.abs(out - ref[0]) > tol[0]).any()


def test_fast_rounding_constants():
    """The unit roundoffs per scheme pair (docs/kernels.md, "Precision")."""
    f8 = schemes.get("fp8_e4m3")
    nv = schemes.get("nvfp4")
    mx = schemes.get("mxfp4")
    kk = schemes.get("int4_kivi", role="key")
    kv = schemes.get("int4_kivi", role="value")
    r = reference.fast_rounding(f8, f8, "bfloat16")
    assert (r.u_q, r.a_q, r.u_p, r.a_p) == (0.0, 2.0**-39, reference.U_F16, 2.0**-39)
    r = reference.fast_rounding(nv, nv, "float32")
    assert (r.u_q, r.u_p, r.a_p) == (reference.U_F16, reference.U_F16, 2.0**-23)  # NVFP4 block rows: p * s * 2**7
    r = reference.fast_rounding(mx, mx, "bfloat16")  # E8M0 keys: float16 q by block rows, bfloat16 q otherwise
    # (a_p: E8M0 values in float16 against the split's reference code, e8m0_values_f16: 2**-24 + 2**-36)
    assert (r.u_q, r.a_q, r.u_p, r.a_p) == (0.0, 2.0**-39, reference.U_BF16, 2.0**-23)
    assert reference.fast_rounding(mx, mx, "float32").u_q == reference.U_BF16
    r = reference.fast_rounding(kk, kv, "bfloat16")  # key rows: q * s rounded once to float16 (and, with the key
    # codes as float16 subnormals, multiplied by 2**-4 once more for the high nibble's chain)
    assert (r.u_q, r.u_qs, r.a_qs, r.u_k, r.u_p, r.u_v) == (0.0, reference.U_F16, 2.0**-39 * 17, 0.0,
                                                            reference.U_BF16, 2.0**-16)
    k2 = schemes.get("int2_kivi", role="key")
    assert reference.fast_rounding(k2, kv, "bfloat16").a_qs == 2.0**-39 * 257  # 2-bit codes: up to 2**-8
    r = reference.fast_rounding(kk, kv, "float32")  # the float32 product q * s first; the residual's bfloat16 q
    assert (r.u_q, r.u_qs) == (reference.U_BF16, reference.U_F16 + 2.0**-24 * (1 + reference.U_F16))
    r = reference.fast_rounding(kk, kv, "bfloat16", kivi_key_rows=False)  # key tiles / q * s in two parts
    assert (r.u_q, r.u_qs, r.a_qs, r.u_k, r.u_p, r.u_v) == (0.0, 2.0**-16, 0.0, 2.0**-16, reference.U_BF16, 2.0**-16)


def test_torch_backend_precision_picks_the_dtype_and_rejects_others():
    """The unfused torch backend reflects the choice: bfloat16 SDPA for "fast", float32 for "exact"."""
    import pytest

    torch = pytest.importorskip("torch")
    from kvqref.backends import torch_backend, triton_backend
    from kvqref.paged import PagedKVCache

    rng = np.random.default_rng(0)
    cache = PagedKVCache(schemes.get("fp8_e4m3"), schemes.get("fp8_e4m3"), 4, 16, 2, 64, batch=1)
    cache.append(0, rng.standard_normal((20, 2, 64)), rng.standard_normal((20, 2, 64)))
    dc = triton_backend.DeviceCache.from_cache(cache, "cpu")
    q = torch.from_numpy(rng.standard_normal((1, 4, 64)).astype(np.float32))
    ref, _ = reference.decode_attention(q.numpy().astype(np.float64), cache)
    err = {p: np.abs(torch_backend.decode(q, dc, precision=p)[0].numpy() - ref).max() for p in ("fast", "exact")}
    assert err["exact"] < 1e-5 < err["fast"]  # float32 SDPA vs bfloat16 SDPA
    with pytest.raises(ValueError, match="precision"):
        torch_backend.decode(q, dc, precision="half")
