"""The registry, and the torch (unfused) backend against the oracle."""

from __future__ import annotations

import numpy as np
import pytest

from kvqref import backends, reference, schemes
from kvqref.schemes import Quantized

torch = pytest.importorskip("torch")

from test_triton import DEVICE, PAIRS, SMALL, build_cache  # noqa: E402


def test_registry_lists_and_explains():
    assert set(backends.names()) == {"numpy", "torch", "triton"}
    av = backends.available()
    assert av["numpy"] is None
    with pytest.raises(KeyError, match="numpy"):
        backends.get("cuda-magic")
    assert backends.default().name in ("numpy", "triton")


def test_triton_unavailable_reason_is_actionable(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    why = backends.get("numpy") and backends.available()["triton"]
    assert why and "TRITON_INTERPRET=1" in why and "no GPU" in why
    with pytest.raises(RuntimeError, match="unavailable"):
        backends.get("triton")


@pytest.mark.parametrize("name", ["mxfp4", "fp4_e2m1"])
def test_e8m0_scale_ff_is_nan_in_the_oracle_and_the_torch_backend(name):
    """E8M0 0xFF is NaN (OCP MX; ``formats`` E8M0 codec): a block whose scale code is 0xFF dequantizes to NaN in the
    oracle and in the torch backend (exp2 alone would give +Inf), 0x00 to 2**-127 times the codes; other blocks
    keep their values."""
    from kvqref.backends.torch_backend import dequantize
    from kvqref.paged import PagedKVCache

    rng = np.random.default_rng(3)
    s = schemes.get(name)
    cache = PagedKVCache(s, s, 2, 16, 2, 64)
    cache.append(0, rng.standard_normal((5, 2, 64)), rng.standard_normal((5, 2, 64)))
    cache.k.storage["scales"][0, 1, 0, 0] = 0xFF
    cache.k.storage["scales"][0, 2, 0, 0] = 0x00
    K, _ = cache.dequantized(0)
    assert np.isnan(K[1, 0, :s.block]).all() and not np.isnan(K[1, 0, s.block:]).any()
    assert not np.isnan(np.delete(K, 1, axis=0)).any()
    codes = s.dequantize(Quantized(s.name, (1, 1, 64), {
        "codes": cache.k.storage["codes"][0, 2:3, 0:1], "scales": np.full((1, 1, 64 // s.block), 127, np.uint8)}))
    np.testing.assert_array_equal(K[2, 0, :s.block], codes[0, 0, :s.block] * 2.0**-127)
    dc = backends.get("torch").prepare(cache)
    k = dequantize(dc.k).cpu().numpy()
    np.testing.assert_array_equal(np.isnan(k[:5]), np.isnan(K))


@pytest.mark.parametrize("pair", PAIRS, ids=[p[0] + "/" + p[2] for p in PAIRS])
def test_torch_backend_dequantizes_like_the_oracle(pair):
    """The torch backend's dequantized cache (float32) equals the oracle's values exactly; its SDPA output
    is within bfloat16 accuracy of the oracle's attention."""
    rng = np.random.default_rng(2)
    cache, _ = build_cache(pair, SMALL, rng)
    b = backends.get("torch")
    dc = b.prepare(cache)
    from kvqref.backends.torch_backend import dequantize, gather

    k, v, valid = gather(dc, dequantize(dc.k), dequantize(dc.v))
    for s in range(cache.batch):
        K, V = cache.dequantized(s)
        T = K.shape[0]
        np.testing.assert_array_equal(k[s, :, :T].transpose(0, 1).cpu().numpy().astype(np.float64),
                                      np.float32(K).astype(np.float64))
        np.testing.assert_array_equal(v[s, :, :T].transpose(0, 1).cpu().numpy(), np.float32(V))
    q = rng.standard_normal((3, 4, 64)).astype(np.float32)
    out, _ = b.decode(torch.from_numpy(q).to(DEVICE), dc)
    ref, _ = reference.decode_attention(q, cache)
    scale = np.abs(ref).max()
    assert np.abs(out.cpu().numpy() - ref).max() <= 2e-2 * scale
