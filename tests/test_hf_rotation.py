"""kvqref.hf with rotated schemes (docs/rotation.md, docs/hf.md "Rotated caches") on the tiny random Llama of
tests/test_hf.py (float64 weights; head_dim 64).

Tolerances are test_hf.py's: the numpy backend attends in float64, so a one-shot forward and token-by-token
decoding differ by float64 rounding only (1e-9); the torch backend's float32 attention is compared on a
one-layer model (1e-4). The triton backend is left to the GPU/interpreter tests of the fused kernels: here it
must either refuse a rotated cache before the first token (kernels without rotation) or match the torch
backend (kernels with rotation), so the test passes before and after the fused kernels land.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_hf import KIVI, _assert_stored_is_oracle, _cache, _capture_kv, _ids, _model  # noqa: E402

import kvqref.hf as H  # noqa: E402
from kvqref import backends, schemes  # noqa: E402
from kvqref.schemes.rotation import HadamardRotation  # noqa: E402

ROT = {"rotation": "hadamard"}
#: every scheme name, rotated (KIVI with and without a residual window)
CASES = [("bf16", {}), ("fp8_e4m3", {}), ("fp8_e4m3", {"granularity": "head"}),
         ("fp8_e4m3", {"granularity": "token_head"}), ("fp8_e5m2", {}), ("fp4_e2m1", {}), ("mxfp4", {}),
         ("nvfp4", {}), ("int4_kivi", KIVI), ("int2_kivi", {"residual": 0})]
assert {c[0] for c in CASES} == set(schemes.names())
IDS = [f"{s}-{'-'.join(map(str, o.values()))}" for s, o in CASES]


def _rcache(model, scheme, opts, backend="torch", k_seed=3, v_seed=5, **kw):
    return H.QuantizedKVCache(model.config, scheme, backend=backend,
                              k_options={**opts, **ROT, "rotation_seed": k_seed},
                              v_options={**opts, **ROT, "rotation_seed": v_seed}, **kw)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("scheme,opts", CASES, ids=IDS)
def test_stored_bytes_are_the_rotated_schemes(scheme, opts, backend):
    """Every layer stores exactly rotated_scheme.quantize(K after RoPE) (and V): the inner scheme's fields of
    rotate(x), params frozen at the first chunk (computed on the rotated values); the residual window holds
    the rotated float32 values bit for bit. Batch of 2, prompt then two decode steps."""
    model = _model("sdpa")
    cache = _rcache(model, scheme, opts, backend, prefill="dequantized")
    assert cache.k_scheme.rotation == HadamardRotation(3) and cache.v_scheme.rotation == HadamardRotation(5)
    _assert_stored_is_oracle(model, cache)  # side.scheme.quantize is the rotated scheme's; residual rotate(x)
    side = cache.layers[0].k
    assert side.quantized(0).scheme == side.scheme.name  # a container of the rotated scheme


def test_residual_window_holds_rotated_values_bit_for_bit():
    model = _model("sdpa")
    cache = _rcache(model, "int4_kivi", KIVI, prefill="dequantized")
    seen = _capture_kv(cache)
    with torch.no_grad():
        model(_ids(40), **H.cache_kwargs(model, cache))
    for li, layer in enumerate(cache.layers):
        k = seen[li][0][0][0].transpose(0, 1).float().numpy()  # [T, H, D]
        n = int(layer.k.paged[0])
        want = layer.k.scheme.rotation.rotate(k[n:])
        got = layer.k.residual[0, : 40 - n].numpy()
        assert n < 40
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("scheme,opts", CASES, ids=IDS)
def test_bytes_held_unchanged_by_rotation(scheme, opts):
    model = _model()
    plain, rot = _cache(model, scheme, opts), _rcache(model, scheme, opts)
    with torch.no_grad():
        for c in (plain, rot):
            model(_ids(64, batch=2), **H.cache_kwargs(model, c))
    assert rot.nbytes(detail=True) == plain.nbytes(detail=True)
    assert rot.bits_per_element() == plain.bits_per_element()


EQUIV = [("int4_kivi", KIVI), ("int2_kivi", {"residual": 0}), ("fp8_e4m3", {"granularity": "token_head"}),
         ("fp8_e4m3", {"scale": 0.05}), ("nvfp4", {"global_scale": 0.002}), ("mxfp4", {}), ("fp4_e2m1", {})]


@pytest.mark.parametrize("scheme,opts", EQUIV, ids=[e[0] + str(i) for i, e in enumerate(EQUIV)])
def test_as_decoded_prefill_equals_token_by_token(scheme, opts):
    """Rotated: one teacher-forced forward with prefill="as_decoded" gives the logits of decoding the text token
    by token (numpy backend, float64), KIVI's residual window included; and they differ from the unrotated
    cache's (the rotation changes what is stored)."""
    model = _model()
    ids = _ids(70)
    with torch.no_grad():
        full = model(ids, **H.cache_kwargs(model, _rcache(model, scheme, opts, "numpy"))).logits[0]
        cache = _rcache(model, scheme, opts, "numpy")
        steps = torch.stack([model(ids[:, i:i + 1], **H.cache_kwargs(model, cache)).logits[0, 0] for i in range(70)])
        plain = model(ids, **H.cache_kwargs(model, _cache(model, scheme, opts, "numpy"))).logits[0]
    torch.testing.assert_close(full, steps, rtol=0, atol=1e-9)
    assert (full - plain).abs().max() > 1e-4


def test_as_decoded_torch_backend_one_layer():
    """The same equivalence through the torch backend (float32 rotation and SDPA: precision="exact")."""
    model = _model(num_hidden_layers=1)
    ids = _ids(100)
    with torch.no_grad():
        full = model(ids, **H.cache_kwargs(model, _rcache(model, "int4_kivi", KIVI, precision="exact"))).logits[0]
        cache = _rcache(model, "int4_kivi", KIVI, precision="exact")
        steps = torch.stack([model(ids[:, i:i + 1], **H.cache_kwargs(model, cache)).logits[0, 0] for i in range(100)])
    torch.testing.assert_close(full, steps, rtol=0, atol=1e-4)


@pytest.mark.parametrize("scheme,opts", [("int4_kivi", KIVI), ("fp4_e2m1", {}), ("fp8_e4m3", {})])
def test_torch_and_numpy_backends_agree(scheme, opts):
    """A prompt and decode steps: the torch backend (float32 butterflies, SDPA) and the numpy one (float64
    oracle) read the same rotated cache alike (one layer, so no code flips between layers)."""
    model = _model(num_hidden_layers=1)
    ids = _ids(50)
    outs = []
    for backend in ("numpy", "torch"):
        cache = _rcache(model, scheme, opts, backend, precision="exact")
        with torch.no_grad():
            lo = [model(ids[:, :40], **H.cache_kwargs(model, cache)).logits[0, -1]]
            lo += [model(ids[:, i:i + 1], **H.cache_kwargs(model, cache)).logits[0, 0] for i in range(40, 50)]
        outs.append(torch.stack(lo))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-4)


def test_rotated_cache_matches_attention_over_the_dequantized_values():
    """prefill="dequantized" with the kvqref attention (rotated q, attention over the stored values, output
    un-rotated) equals sdpa over the un-rotated K/V update() returns (one layer, numpy backend)."""
    ids = _ids(100)
    logits = {}
    for attn in ("kvqref", "sdpa"):
        model = _model(attn, num_hidden_layers=1)
        for mode in ("full", "dequantized"):
            with torch.no_grad():
                logits[attn, mode] = model(ids, **H.cache_kwargs(model, _rcache(model, "int4_kivi", KIVI, "numpy",
                                                                                prefill=mode))).logits[0]
    for mode in ("full", "dequantized"):
        torch.testing.assert_close(logits["kvqref", mode], logits["sdpa", mode], rtol=0, atol=1e-9)


def test_standard_attention_reads_the_original_domain():
    """update() with a standard attention returns un-rotated values: the rotated scheme's dequantize (and
    the un-rotated residual), so rotated bf16 K/V are within bf16 rounding of the input."""
    model = _model("sdpa")
    cache = _rcache(model, "bf16", {}, "numpy", prefill="dequantized")
    seen = _capture_kv(cache)
    returned = {}
    update = cache.update

    def spy(k, v, layer_idx, *a, **kw):
        out = update(k, v, layer_idx, *a, **kw)
        returned[layer_idx] = out
        return out

    cache.update = spy
    with torch.no_grad():
        model(_ids(30), **H.cache_kwargs(model, cache))
    k_in = seen[0][0][0]
    k_out = returned[0][0]
    # bf16 rounds each rotated element (relative 2^-9); un-rotating is orthonormal, so per (token, head) vector
    # ||k_out - k_in|| <= 2^-9 ||k_in|| (+ float32 rounding): the error is spread, not elementwise relative
    err = (k_out - k_in).norm(dim=-1)
    assert bool((err <= 2**-9 * 1.01 * k_in.norm(dim=-1) + 1e-12).all()), float((err / k_in.norm(dim=-1)).max())
    layer = cache.layers[0]
    want = layer.k.scheme.dequantize(layer.k.quantized(0))  # [T, H, D] original domain, float64
    np.testing.assert_array_equal(k_out[0].transpose(0, 1).numpy(), want)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_given_static_scales_apply_to_the_rotated_values(backend):
    """k_params/v_params of a rotated FP8 cache scale rotate(x): stored codes = rotated_scheme.quantize(x,
    params) = the inner scheme's codes of rotate(x) with those params; they differ from the unrotated ones."""
    model = _model("sdpa")
    params = {"scale": np.float32(0.01)}
    cache = _rcache(model, "fp8_e4m3", {}, backend, k_params=params, v_params=params, prefill="dequantized")
    seen = _capture_kv(cache)
    with torch.no_grad():
        model(_ids(20), **H.cache_kwargs(model, cache))
    layer = cache.layers[1]
    x = seen[1][0][0][0].transpose(0, 1).float().numpy()
    got = layer.k.quantized(0)
    assert float(got.params["scale"]) == pytest.approx(0.01)
    inner = layer.k.scheme.inner.quantize(layer.k.scheme.rotation.rotate(x), params=params)
    np.testing.assert_array_equal(got.fields["codes"], inner.fields["codes"])
    plain = layer.k.scheme.inner.quantize(x, params=params)
    assert not np.array_equal(got.fields["codes"], plain.fields["codes"])


def test_rotation_argument_scheme_objects_and_per_side_options():
    cfg = H.tiny_config()
    a = H.QuantizedKVCache(cfg, "nvfp4", rotation="hadamard", rotation_seed=9)
    assert a.k_scheme.name == a.v_scheme.name == "nvfp4+hadamard(seed=9)"
    b = H.QuantizedKVCache(cfg, "int4_kivi", rotation="hadamard")
    assert b.k_scheme.role == "key" and b.v_scheme.role == "value" and b.k_scheme.rotation.seed == 0
    c = H.QuantizedKVCache(cfg, "fp8_e4m3", k_options={"rotation": "hadamard"})  # K only
    assert c.k_scheme.rotation is not None and getattr(c.v_scheme, "rotation", None) is None
    ks = schemes.get("int2_kivi", role="key", rotation="hadamard", rotation_seed=4)
    d = H.QuantizedKVCache(cfg, (ks, schemes.get("int2_kivi", role="value")))
    assert d.k_scheme is ks
    assert "hadamard(seed=9)" in repr(a)


def test_rotated_k_only_as_decoded_equals_token_by_token():
    """One side rotated: q is rotated for K, the output is not un-rotated (V plain)."""
    model = _model()
    ids = _ids(50)
    opts = {"k_options": {**KIVI, **ROT, "rotation_seed": 1}, "v_options": KIVI}
    with torch.no_grad():
        full = model(ids, **H.cache_kwargs(model, H.QuantizedKVCache(model.config, "int4_kivi", backend="numpy",
                                                                     **opts))).logits[0]
        cache = H.QuantizedKVCache(model.config, "int4_kivi", backend="numpy", **opts)
        steps = torch.stack([model(ids[:, i:i + 1], **H.cache_kwargs(model, cache)).logits[0, 0] for i in range(50)])
    torch.testing.assert_close(full, steps, rtol=0, atol=1e-9)


def test_generate_and_beam_search_with_a_rotated_cache():
    model = _model()
    ids = _ids(12, batch=2)
    with torch.no_grad():
        out = model.generate(ids, **H.cache_kwargs(model, _rcache(model, "int4_kivi", {"residual": 0})),
                             max_new_tokens=4, do_sample=False, num_beams=2, attention_mask=torch.ones_like(ids))
    assert out.shape == (2, 16)


def test_errors_before_the_first_token():
    cfg = H.tiny_config()
    with pytest.raises(ValueError, match="power of two"):
        H.QuantizedKVCache(H.tiny_config(head_dim=48), "fp8_e4m3", rotation="hadamard")
    with pytest.raises(TypeError, match="rotation_seed must be an integer"):
        H.QuantizedKVCache(cfg, "fp8_e4m3", rotation="hadamard", rotation_seed=1.5)
    with pytest.raises(TypeError, match="rotation_seed must be an integer"):
        H.QuantizedKVCache(cfg, "fp8_e4m3", rotation="hadamard", rotation_seed="7")
    with pytest.raises(ValueError, match=r"\[0, 2\*\*64\)"):
        H.QuantizedKVCache(cfg, "fp8_e4m3", rotation="hadamard", rotation_seed=-1)
    with pytest.raises(ValueError, match="without rotation='hadamard'"):
        H.QuantizedKVCache(cfg, "fp8_e4m3", rotation_seed=3)
    with pytest.raises(ValueError, match="rotation must be None or one of"):
        H.QuantizedKVCache(cfg, "fp8_e4m3", rotation="walsh")
    with pytest.raises(ValueError, match="rotation given both"):
        H.QuantizedKVCache(cfg, "fp8_e4m3", rotation="hadamard", k_options={"rotation": "hadamard"})
    with pytest.raises(ValueError, match="not to Scheme objects"):
        H.QuantizedKVCache(cfg, (schemes.get("fp8_e4m3"), schemes.get("fp8_e4m3")), rotation="hadamard")


def test_scale_set_for_unrotated_values_is_refused():
    from kvqref.calibration.scales import ScaleSet

    cfg = H.tiny_config()
    n = cfg.num_hidden_layers
    ss = ScaleSet("fp8_e4m3", "tensor", [np.float32(0.01)] * n, [np.float32(0.01)] * n)
    with pytest.raises(ValueError, match="rotated values"):
        H.QuantizedKVCache(cfg, "fp8_e4m3", rotation="hadamard", k_params=ss)
    H.QuantizedKVCache(cfg, "fp8_e4m3", rotation="hadamard", k_params=[ss.params(i, "k") for i in range(n)])


def test_nan_input_is_refused():
    model = _model("sdpa", dtype=torch.float32)
    cache = _rcache(model, "fp8_e4m3", {"granularity": "token_head"})
    layer = cache.layers[0]
    k = torch.randn(1, cfg_heads(model), 4, 64)
    k[0, 0, 1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        layer.update(k, torch.randn_like(k))


def cfg_heads(model) -> int:
    return model.config.num_key_value_heads


@pytest.mark.interpret
def test_triton_backend_refuses_or_matches_torch():
    """Until the Triton kernels rotate (``rotates_queries``), a rotated cache with backend="triton" is refused
    before the first token, with the reason; once they do, it matches the torch backend (precision="exact")."""
    triton = backends.get("triton")
    model = _model(num_hidden_layers=1)
    if not triton.rotates_queries:
        with pytest.raises(ValueError, match="cannot read a rotated cache"):
            _rcache(model, "fp8_e4m3", {"granularity": "token_head"}, "triton")
        return
    dev = triton.device()
    model = model.to(dev)
    ids = _ids(40).to(dev)
    outs = []
    for backend in ("torch", "triton"):
        cache = _rcache(model, "fp8_e4m3", {"granularity": "token_head"}, backend, precision="exact")
        with torch.no_grad():
            model(ids, **H.cache_kwargs(model, cache))
            outs.append(model(ids[:, :1], **H.cache_kwargs(model, cache)).logits)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-5)


def test_container_of_another_seed_is_refused():
    """The store's containers carry the rotated scheme's name: dequantizing with another seed raises."""
    model = _model("sdpa")
    cache = _rcache(model, "fp4_e2m1", {}, prefill="dequantized")
    with torch.no_grad():
        model(_ids(10), **H.cache_kwargs(model, cache))
    q = cache.layers[0].k.quantized(0)
    with pytest.raises(ValueError, match="mixed up"):
        schemes.get("fp4_e2m1", rotation="hadamard", rotation_seed=4).dequantize(q)
    stored = cache.layers[0].k.quantized(0, stored=True)  # the codec's container: the rotated values
    assert stored.scheme == "fp4_e2m1" and stored.shape == q.shape
    for f in q.fields:
        np.testing.assert_array_equal(stored.fields[f], q.fields[f])


@pytest.mark.parametrize("D", [2, 16, 32, 64, 128, 256])
def test_torch_rotate_is_the_oracles_bit_for_bit(D):
    """torch_backend.rotate (what the cache stores) = HadamardRotation.rotate bit for bit: exponents spread
    over 2^-150 .. 2^40 (subnormal inputs and results included), both signs, zeros."""
    from kvqref.backends import torch_backend

    rng = np.random.default_rng(D)
    x = (rng.standard_normal((64, 3, D)) * np.exp2(rng.integers(-150, 40, (64, 3, D)))).astype(np.float32)
    x[0, 0, :2] = [0.0, -0.0]
    assert (np.abs(x) < np.finfo(np.float32).tiny).any()
    for seed in (0, 7, 2**64 - 1):
        rot = HadamardRotation(seed)
        got = torch_backend.rotate(torch.from_numpy(x), rot).numpy()
        np.testing.assert_array_equal(got.view(np.uint32), rot.rotate(x).view(np.uint32))
