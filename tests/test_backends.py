"""The registry, and the torch (unfused) backend against the oracle."""

from __future__ import annotations

import numpy as np
import pytest

from kvqref import backends, reference

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
