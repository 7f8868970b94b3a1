"""Paged cache: appends that cross page and group boundaries give the bytes of one-shot quantization (KIVI:
of its streaming rule), addressing, export, and clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqref import schemes
from kvqref.paged import OutOfPagesError, PagedKVCache

PAIRS = [("bf16", {}), ("fp8_e4m3", {}), ("fp8_e4m3", {"granularity": "head"}),
         ("fp8_e4m3", {"granularity": "token_head"}), ("fp8_e5m2", {"profile": "sglang", "scale": 0.5}),
         ("fp4_e2m1", {}), ("fp4_e2m1", {"profile": "sglang"}), ("mxfp4", {}), ("nvfp4", {}),
         ("int4_kivi", {}), ("int2_kivi", {"residual": 64})]


def build(name, opts, **kw):
    ks = schemes.get(name, **opts, **({"role": "key"} if name.endswith("kivi") else {}))
    vs = schemes.get(name, **opts)
    return PagedKVCache(ks, vs, kw.pop("num_pages", 24), kw.pop("page_size", 32), 2, 64, **kw)


def one_shot(scheme, x, n, params):
    return scheme.quantize(x[:n], params=params) if n else None


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(PAIRS))
def test_chunked_appends_equal_one_shot_bytes(seed, pair):
    name, opts = pair
    rng = np.random.default_rng(seed)
    T = int(rng.integers(150, 300))
    k = (rng.standard_normal((T, 2, 64)) * 3).astype(np.float32)
    v = rng.standard_normal((T, 2, 64)).astype(np.float32)
    k[:, :, 7] *= 40
    cache = build(name, opts, batch=2, free_pages=list(rng.permutation(24)))
    cuts = np.sort(rng.choice(np.arange(1, T), size=int(rng.integers(1, 12)), replace=False))
    for a, b in zip([0, *cuts], [*cuts, T], strict=True):  # sequence 1 interleaves with 0: pages get mixed
        cache.append(0, k[a:b], v[a:b])
        cache.append(1, v[a:b][:1], k[a:b][:1])
    sides = (("k", k, cache.k_scheme, cache.k_params), ("v", v, cache.v_scheme, cache.v_params))
    for which, x, scheme, params in sides:
        n = scheme.paged_tokens(T)
        got = cache.quantized(0, which)
        ref = one_shot(scheme, x, n, params)
        assert got.shape[0] == n
        for f in got.fields:
            assert np.array_equal(got.fields[f].view(np.uint8), ref.fields[f].view(np.uint8)), (which, f)
        res = cache.k.residual[0] if which == "k" else cache.v.residual[0]
        assert np.array_equal(res, x[n:])
    K, V = cache.dequantized(0)
    assert K.shape == V.shape == (T, 2, 64)
    assert np.array_equal(K[: cache.k_scheme.paged_tokens(T)],
                          cache.k_scheme.dequantize(one_shot(cache.k_scheme, k, cache.k_scheme.paged_tokens(T),
                                                             cache.k_params)))


def test_slots_follow_the_block_table_and_storage_holds_the_bytes():
    rng = np.random.default_rng(0)
    cache = PagedKVCache("fp4_e2m1", "fp4_e2m1", 8, 16, 2, 64, batch=2, free_pages=[5, 2, 7, 0, 1, 3, 4, 6])
    x = rng.standard_normal((40, 2, 64)).astype(np.float32)
    cache.append(1, x[:3], x[:3])
    cache.append(0, x, x)
    assert cache.pages_of(1).tolist() == [5] and cache.pages_of(0).tolist() == [2, 7, 0]
    slots = cache.slot_mapping(0, 14, 4)
    assert slots.tolist() == [2 * 16 + 14, 2 * 16 + 15, 7 * 16 + 0, 7 * 16 + 1]
    q = schemes.get("fp4_e2m1").quantize(x)
    codes = cache.k.storage["codes"].reshape(-1, 2, 32)
    assert np.array_equal(codes[slots], q.fields["codes"][14:18])
    ex = cache.export()
    assert ex["block_table"].dtype == np.int32 and ex["block_table"][0, :4].tolist() == [2, 7, 0, -1]
    assert ex["seq_lens"].tolist() == [40, 3] and ex["k_lens"].tolist() == [40, 3]
    assert ex["k_codes"].shape == (8, 16, 2, 32) and ex["k_scales"].shape == (8, 16, 2, 4)
    assert ex["k_residual_lens"].tolist() == [0, 0]


def test_kivi_group_fields_live_in_group_slots():
    rng = np.random.default_rng(1)
    cache = PagedKVCache("int4_kivi", "int4_kivi", 8, 64, 2, 64, free_pages=[3, 1, 0, 2, 4, 5, 6, 7])
    x = rng.standard_normal((300, 2, 64)).astype(np.float32)
    cache.append(0, x, x)
    ex = cache.export()
    assert ex["k_scale"].shape == (8, 2, 2, 64)  # [num_pages, page_size // G, kv_heads, D]
    ks = schemes.get("int4_kivi", role="key")
    q = ks.quantize(x[:256])
    # token group 3 (tokens 96..127) is on the block table's 2nd page (page 1), row (96 % 64) // 32 = 1
    assert np.array_equal(ex["k_scale"][1, 1], q.fields["scale"][3])
    assert ex["k_lens"].tolist() == [256] and ex["v_lens"].tolist() == [172]
    assert ex["k_residual_lens"].tolist() == [44] and ex["v_residual_lens"].tolist() == [128]
    assert ex["k_residual"].shape == (1, 128, 2, 64)


class KiviReference:
    """KIVI's LlamaAttention_KIVI.forward cache bookkeeping, transcribed: prefill then one token per step."""

    def __init__(self, R: int, G: int) -> None:
        self.R, self.G = R, G
        self.k_quant: list[np.ndarray] = []
        self.v_quant: list[np.ndarray] = []
        self.k_full = self.v_full = None

    def prefill(self, k, v):
        T, R = len(k), self.R
        if T % R != 0:
            if T < R:
                self.k_full = k
            else:
                self.k_quant.append(k[: T - T % R])
                self.k_full = k[T - T % R:]
        else:
            self.k_quant.append(k)
            self.k_full = None
        if T <= R:
            self.v_full = v
        else:
            self.v_quant.append(v[:-R])
            self.v_full = v[-R:]

    def decode(self, k, v):
        self.k_full = k if self.k_full is None else np.concatenate([self.k_full, k])
        if len(self.k_full) == self.R:
            self.k_quant.append(self.k_full)
            self.k_full = None
        self.v_full = np.concatenate([self.v_full, v])
        if len(self.v_full) > self.R:
            assert len(self.v_full) == self.R + 1
            self.v_quant.append(self.v_full[:1])
            self.v_full = self.v_full[1:]


@pytest.mark.parametrize("prefill", [5, 64, 96, 130])
def test_kivi_streaming_rule(prefill):
    R, G = 64, 32
    rng = np.random.default_rng(prefill)
    T = prefill + 150
    k = rng.standard_normal((T, 1, 32)).astype(np.float32)
    v = rng.standard_normal((T, 1, 32)).astype(np.float32)
    ks = schemes.get("int4_kivi", role="key", residual=R, group_size=G)
    vs = schemes.get("int4_kivi", residual=R, group_size=G)
    cache = PagedKVCache(ks, vs, 16, 64, 1, 32)
    ref = KiviReference(R, G)
    cache.append(0, k[:prefill], v[:prefill])
    ref.prefill(k[:prefill], v[:prefill])
    for t in range(prefill, T):
        if t % 7 == 0 or t == T - 1:
            nk = sum(len(a) for a in ref.k_quant)
            nv = sum(len(a) for a in ref.v_quant)
            assert (int(cache.k.paged[0]), int(cache.v.paged[0])) == (nk, nv), t
            assert np.array_equal(cache.k.residual[0], ref.k_full if ref.k_full is not None else k[:0])
            assert np.array_equal(cache.v.residual[0], ref.v_full)
        cache.append(0, k[t:t + 1], v[t:t + 1])
        ref.decode(k[t:t + 1], v[t:t + 1])
    # the bytes: KIVI quantizes each flushed chunk separately; groups never straddle chunks
    kq = [ks.quantize(c) for c in ref.k_quant]
    got = cache.quantized(0, "k")
    assert np.array_equal(got.fields["codes"], np.concatenate([q.fields["codes"] for q in kq]))
    assert np.array_equal(got.fields["scale"], np.concatenate([q.fields["scale"] for q in kq]))
    vq = [vs.quantize(c) for c in ref.v_quant]
    assert np.array_equal(cache.quantized(0, "v").fields["zero"], np.concatenate([q.fields["zero"] for q in vq]))


def test_params_frozen_at_first_append_or_given():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((10, 2, 64)).astype(np.float32)
    b = 50 * rng.standard_normal((10, 2, 64)).astype(np.float32)
    cache = PagedKVCache("fp8_e4m3", "nvfp4", 4, 16, 2, 64)
    cache.append(0, a, a)
    first = float(cache.k_params["scale"])
    cache.append(0, b, b)
    assert float(cache.k_params["scale"]) == first == float(np.float32(np.abs(a).max()) / np.float32(448))
    assert float(cache.v_params["global_scale"]) == float(np.float32(np.abs(a).max() / np.float32(2688)))
    given_ = PagedKVCache("fp8_e4m3", "fp8_e4m3", 4, 16, 2, 64, k_params={"scale": np.float32(0.25)})
    given_.append(0, b, b)
    assert float(given_.k_params["scale"]) == 0.25


def test_errors():
    c = PagedKVCache("fp8_e4m3", "fp8_e4m3", 2, 16, 2, 64, batch=2, max_pages=2)
    x = np.zeros((4, 2, 64), np.float32)
    with pytest.raises(ValueError, match=r"k must be \[tokens, 2, 64\]"):
        c.append(0, np.zeros((4, 3, 64)), x)
    with pytest.raises(ValueError, match=r"v must be \[tokens, 2, 64\]"):
        c.append(0, x, np.zeros((4, 64)))
    with pytest.raises(ValueError, match="k has 4 tokens and v has 3"):
        c.append(0, x, x[:3])
    with pytest.raises(ValueError, match="seq_id"):
        c.append(2, x, x)
    with pytest.raises(ValueError, match="max_pages is 2"):
        c.append(0, np.zeros((40, 2, 64)), np.zeros((40, 2, 64)))
    c.append(0, np.ones((32, 2, 64)), np.ones((32, 2, 64)))
    with pytest.raises(OutOfPagesError, match="needs 1 more pages, 0 free"):
        c.append(1, x, x)
    assert c.seq_lens.tolist() == [32, 0]  # failed appends change nothing
    with pytest.raises(ValueError, match="not all allocated"):
        c.slot_mapping(1, 0, 1)
    with pytest.raises(ValueError, match="not a multiple of int4_kivi's token group 32"):
        PagedKVCache("int4_kivi", "int4_kivi", 4, 16, 2, 64)
    with pytest.raises(ValueError, match="role='key'"):
        PagedKVCache(schemes.get("int4_kivi"), "int4_kivi", 4, 32, 2, 64)
    with pytest.raises(ValueError, match="permutation"):
        PagedKVCache("bf16", "bf16", 4, 16, 2, 64, free_pages=[0, 0, 1, 2])
    with pytest.raises(ValueError, match="page_size"):
        PagedKVCache("bf16", "bf16", 4, 0, 2, 64)
    with pytest.raises(ValueError, match="head_dim 40 is not divisible"):
        PagedKVCache("fp4_e2m1", "fp4_e2m1", 4, 16, 2, 40)


def test_planted_slot_bug_is_caught():
    """A cache that writes token t to slot t + 1 must fail the one-shot comparison."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((20, 2, 64)).astype(np.float32)
    cache = PagedKVCache("fp4_e2m1", "fp4_e2m1", 4, 16, 2, 64)
    original = cache.slot_mapping
    cache.slot_mapping = lambda b, s, n: original(b, s, n) + (1 if n == 20 and s == 0 and not hasattr(cache, "_r")
                                                              else 0)
    cache.append(0, x, x)
    cache._r = True
    q = schemes.get("fp4_e2m1").quantize(x)
    assert not np.array_equal(cache.quantized(0, "k").fields["codes"], q.fields["codes"])
