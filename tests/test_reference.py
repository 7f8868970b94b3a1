"""Reference decode attention: against a scalar definition, GQA mapping, the paged cache, and the derived
kernel tolerance (a float32 kernel passes it; a planted one-power-of-two scale error in one block fails it)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqref import schemes
from kvqref.paged import PagedKVCache
from kvqref.reference import attention, decode_attention, kernel_tolerance


def scalar_attention(q, K, V, sm):
    """One (query head, KV head) pair, straight from the definition with math.fsum."""
    s = [sm * math.fsum(float(a) * float(b) for a, b in zip(q, k, strict=True)) for k in K]
    m = max(s)
    w = [math.exp(x - m) for x in s]
    l = math.fsum(w)
    out = [math.fsum(wi * float(v[d]) for wi, v in zip(w, V, strict=True)) / l for d in range(len(q))]
    return out, m + math.log(l)


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([(4, 1), (4, 2), (4, 4), (6, 3)]), st.integers(1, 20))
def test_attention_matches_scalar_definition_and_gqa(seed, heads, T):
    Hq, Hkv = heads
    rng = np.random.default_rng(seed)
    D = 8
    q = rng.standard_normal((1, Hq, D)) * 2
    K = rng.standard_normal((T, Hkv, D))
    V = rng.standard_normal((T, Hkv, D))
    out, lse = attention(q, [K], [V], sm_scale=0.7)
    for h in range(Hq):
        kvh = h // (Hq // Hkv)
        ro, rl = scalar_attention(q[0, h], K[:, kvh], V[:, kvh], 0.7)
        np.testing.assert_allclose(out[0, h], ro, rtol=1e-12, atol=1e-12)
        assert abs(lse[0, h] - rl) <= 1e-12 * max(1.0, abs(rl))


def test_default_scale_single_token_and_empty():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 2, 16))
    K = [rng.standard_normal((1, 1, 16)), np.zeros((0, 1, 16))]
    V = [rng.standard_normal((1, 1, 16)), np.zeros((0, 1, 16))]
    out, lse = attention(q, K, V)
    np.testing.assert_array_equal(out[0, 0], V[0][0, 0])
    assert lse[0, 1] == pytest.approx(q[0, 1] @ K[0][0, 0] / 4.0, abs=1e-14)
    assert np.all(out[1] == 0) and np.all(lse[1] == -np.inf)


def test_decode_attention_over_paged_cache_with_residual():
    rng = np.random.default_rng(1)
    cache = PagedKVCache("int4_kivi", "int4_kivi", 16, 32, 2, 32, batch=2)
    xs = [rng.standard_normal((n, 2, 32)).astype(np.float32) for n in (200, 70)]
    for b, x in enumerate(xs):
        cache.append(b, x, -x)
    q = rng.standard_normal((2, 8, 32))
    out, lse = decode_attention(q, cache)
    Ks, Vs = zip(*(cache.dequantized(b) for b in range(2)), strict=True)
    ro, rl = attention(q, Ks, Vs)
    np.testing.assert_array_equal(out, ro)
    np.testing.assert_array_equal(lse, rl)
    # the residual is in there: tokens past k_lens are exact
    assert cache.k.paged[0] == 128 and np.array_equal(Ks[0][128:], xs[0][128:].astype(np.float64))


def test_errors():
    K = [np.zeros((3, 2, 8))]
    with pytest.raises(ValueError, match="q must be"):
        attention(np.zeros((2, 8)), K, K)
    with pytest.raises(ValueError, match="q_heads 3 is not a multiple of kv_heads 2"):
        attention(np.zeros((1, 3, 8)), K, K)
    with pytest.raises(ValueError, match="need 2 K and V"):
        attention(np.zeros((2, 2, 8)), K, K)
    bad = np.zeros((3, 2, 8))
    bad[1, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        attention(np.zeros((1, 2, 8)), [bad], K)
    cache = PagedKVCache("bf16", "bf16", 2, 16, 2, 8)
    with pytest.raises(ValueError, match="does not match the cache"):
        decode_attention(np.zeros((2, 2, 8)), cache)


# --------------------------------------------------------------------------------------------------
# Tolerance for kernels.
# --------------------------------------------------------------------------------------------------
def float32_kernel(q, K, V, sm):
    """A float32-accumulating decode attention (what a kernel does), on the same dequantized values."""
    Hq, Hkv = q.shape[1], K.shape[1]
    kv_of = np.arange(Hq) // (Hq // Hkv)
    q32, K32, V32 = q[0].astype(np.float32), K[:, kv_of].astype(np.float32), V[:, kv_of].astype(np.float32)
    s = np.einsum("hd,thd->ht", q32, K32).astype(np.float32) * np.float32(sm)
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m).astype(np.float32)
    l = p.sum(axis=1, keepdims=True, dtype=np.float32)
    out = (np.einsum("ht,thd->hd", p, V32).astype(np.float32) / l).astype(np.float32)
    return out[None], (m + np.log(l))[:, 0][None]


def fp4_case(seed, T=512, H=2, D=128, Hq=8):
    rng = np.random.default_rng(seed)
    s = schemes.get("fp4_e2m1")
    xk = rng.standard_normal((T, H, D)).astype(np.float32)
    xv = rng.standard_normal((T, H, D)).astype(np.float32)
    xk[:, :, 3] *= 20
    qk, qv = s.quantize(xk), s.quantize(xv)
    q = rng.standard_normal((1, Hq, D)) * 2
    return s, q, qk, qv


@pytest.mark.parametrize("seed", range(4))
def test_float32_kernel_within_tolerance(seed):
    s, q, qk, qv = fp4_case(seed)
    K, V = s.dequantize(qk), s.dequantize(qv)
    sm = 1 / math.sqrt(128)
    ref_out, ref_lse = attention(q, [K], [V], sm)
    out32, lse32 = float32_kernel(q, K, V, sm)
    out_tol, lse_tol = kernel_tolerance(q, [K], [V], sm)
    assert np.all(np.abs(out32 - ref_out) <= out_tol)
    assert np.all(np.abs(lse32 - ref_lse) <= lse_tol)
    assert np.max(out_tol) < 1e-3 * np.max(np.abs(V))  # the tolerance is not vacuous


def _perturbed(s, qx, token, block):
    """The same container with one block's E8M0 scale one power of two too large."""
    fields = {k: v.copy() for k, v in qx.fields.items()}
    fields["scales"][token, 0, block] += 1
    return s.dequantize(schemes.Quantized(qx.scheme, qx.shape, fields))


@pytest.mark.parametrize("seed", range(4))
def test_tolerance_catches_one_block_scale_off_by_one_exponent(seed):
    s, q, qk, qv = fp4_case(seed)
    K, V = s.dequantize(qk), s.dequantize(qv)
    sm = 1 / math.sqrt(128)
    ref_out, ref_lse = attention(q, [K], [V], sm)
    out_tol, lse_tol = kernel_tolerance(q, [K], [V], sm)
    logits = np.einsum("d,td->t", q[0, 0], K[:, 0]) * sm
    rng = np.random.default_rng(seed)
    # a token with at least the median attention weight of query head 0, and a random block of it
    token = int(rng.choice(np.flatnonzero(logits >= np.median(logits))))
    block = int(rng.integers(0, 8))
    bad_out, _ = attention(q, [K], [_perturbed(s, qv, token, block)], sm)
    assert np.any(np.abs(bad_out - ref_out) > out_tol)
    bad_out, bad_lse = attention(q, [_perturbed(s, qk, token, block)], [V], sm)
    assert np.any(np.abs(bad_lse - ref_lse) > lse_tol)
    assert np.any(np.abs(bad_out - ref_out) > out_tol)


def test_worst_case_model_is_looser():
    s, q, qk, qv = fp4_case(0, T=64)
    K, V = s.dequantize(qk), s.dequantize(qv)
    prob, _ = kernel_tolerance(q, [K], [V])
    worst, _ = kernel_tolerance(q, [K], [V], model="worst")
    assert np.all(worst >= prob)
    with pytest.raises(ValueError, match="model"):
        kernel_tolerance(q, [K], [V], model="tight")
