"""Bad input through the public API: every user-given tensor-level parameter is checked in one place
(kvqref.schemes.validate via ``Scheme.check_params``) that the oracle, the paged cache and the triton
backend share; non-real K/V input is a TypeError."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqref import schemes
from kvqref.paged import PagedKVCache

BAD_SCALES = [0.0, -0.0, -1.0, -1e-3, np.nan, np.inf, -np.inf, 1e-50, 1e50]
X = np.random.default_rng(0).standard_normal((4, 2, 32)).astype(np.float32)


@pytest.mark.parametrize("bad", BAD_SCALES)
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_tensor_scale_rejected_by_the_oracle(name, bad):
    s = schemes.get(name)
    with pytest.raises(ValueError, match=r"params\['scale'\]"):
        s.quantize(X, params={"scale": bad})
    with pytest.raises(ValueError, match="scale"):
        schemes.get(name, scale=bad)


@pytest.mark.parametrize("bad", BAD_SCALES)
def test_fp8_head_scale_names_the_head_at_fault(bad):
    s = schemes.get("fp8_e4m3", granularity="head")
    with pytest.raises(ValueError, match=r"params\['scale'\] \(one per kv head\) \[1\]"):
        s.quantize(X, params={"scale": np.array([0.5, bad])})


def test_fp8_scale_shape_key_and_type_errors():
    with pytest.raises(ValueError, match="shape"):
        schemes.get("fp8_e4m3", granularity="head").quantize(X, params={"scale": np.ones(3)})
    with pytest.raises(ValueError, match="scalar"):
        schemes.get("fp8_e4m3").quantize(X, params={"scale": np.ones(2)})
    with pytest.raises(ValueError, match="'scale'"):
        schemes.get("fp8_e4m3").quantize(X, params={"k_scale": 1.0})
    with pytest.raises(TypeError, match="real numbers"):
        schemes.get("fp8_e4m3").quantize(X, params={"scale": 1 + 0j})
    with pytest.raises(ValueError, match="no tensor-level params"):
        schemes.get("fp8_e4m3", granularity="token_head").quantize(X, params={"scale": 1.0})


@pytest.mark.parametrize("bad", BAD_SCALES)
def test_nvfp4_global_scale_rejected(bad):
    with pytest.raises(ValueError, match=r"params\['global_scale'\]"):
        schemes.get("nvfp4").quantize(X, params={"global_scale": bad})
    with pytest.raises(ValueError, match="global_scale"):
        schemes.get("nvfp4", global_scale=bad)


@pytest.mark.parametrize("name", ["bf16", "fp4_e2m1", "mxfp4", "int4_kivi"])
def test_schemes_without_params_refuse_them(name):
    with pytest.raises(ValueError, match="no tensor-level params"):
        schemes.get(name).quantize(X, params={"scale": 1.0})


@pytest.mark.parametrize("bad", [0.0, np.nan, -2.0, np.inf])
@pytest.mark.parametrize("side", ["k_params", "v_params"])
def test_paged_cache_rejects_bad_scales_before_any_token(side, bad):
    with pytest.raises(ValueError, match="scale"):
        PagedKVCache("fp8_e4m3", "fp8_e4m3", 4, 16, 2, 32, **{side: {"scale": bad}})
    per_head = schemes.get("fp8_e4m3", granularity="head")
    with pytest.raises(ValueError, match=r"one per kv head\) \[1\]"):
        PagedKVCache(per_head, per_head, 4, 16, 2, 32, **{side: {"scale": [1.0, bad]}})


@pytest.mark.parametrize("option,value,err", [
    ("group_size", 32.0, TypeError), ("group_size", True, TypeError), ("group_size", "32", TypeError),
    ("group_size", 0, ValueError), ("residual", -32, ValueError), ("residual", 128.5, TypeError),
])
def test_kivi_options_checked(option, value, err):
    with pytest.raises(err, match=option):
        schemes.get("int4_kivi", **{option: value})


@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3", "fp4_e2m1", "nvfp4", "int4_kivi"])
@pytest.mark.parametrize("dtype", [np.complex64, np.complex128, np.bool_, object, np.str_])
def test_non_real_input_is_a_type_error(name, dtype):
    x = X.astype(dtype) if dtype is not np.str_ else X.astype(str)
    with pytest.raises(TypeError, match="real"):
        schemes.get(name).quantize(x)
    cache = PagedKVCache(name, name, 4, 32, 2, 32)
    with pytest.raises(TypeError, match="real"):
        cache.append(0, x, x)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(-1000, 1000), min_size=64, max_size=64).filter(lambda v: any(v)))
def test_integer_input_is_taken_as_its_values(vals):
    """Documented rule: integers are the values they hold (here all exact in float32 and float16)."""
    xi = np.array(vals, np.int32).reshape(2, 1, 32)
    for name in ("fp8_e4m3", "fp4_e2m1", "nvfp4", "int4_kivi", "bf16"):
        s = schemes.get(name)
        a, b = s.quantize(xi), s.quantize(xi.astype(np.float32))
        for f in a.fields:
            assert a.fields[f].tobytes() == b.fields[f].tobytes(), (name, f)


@given(st.floats(min_value=1e-30, max_value=1e30, allow_nan=False))
@settings(max_examples=25, deadline=None)
def test_good_scales_pass_unchanged(s):
    """The check returns the scale rounded to float32 once, which is what quantize divides by."""
    p = schemes.get("fp8_e4m3").check_params({"scale": s})
    assert p["scale"] == np.float32(s) and p["scale"].dtype == np.float32


@pytest.mark.interpret
@pytest.mark.parametrize("bad", [0.0, np.nan, -1.0])
def test_triton_backend_checks_scales_before_launch(bad, monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from kvqref.backends import triton_backend as tb

    fp8 = schemes.get("fp8_e4m3")
    bt = torch.zeros(1, 4, dtype=torch.int32)
    sl = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"params\['scale'\]"):
        tb.empty_device_cache(fp8, fp8, 4, 16, 2, 32, bt, sl, k_params={"scale": bad}, device="cpu")
    dc = tb.empty_device_cache(fp8, fp8, 4, 16, 2, 32, bt, sl, k_params={"scale": 0.5}, device="cpu")
    dc.k.params["scale"] = bad  # changed after the cache was made: the write wrapper checks again
    called = []
    monkeypatch.setattr(tb, "plan_write", lambda *a, **k: called.append(1))
    with pytest.raises(ValueError, match=r"params\['scale'\]"):
        tb.quantize_write(dc.k, torch.zeros(2, 2, 32), torch.zeros(2, dtype=torch.int64))
    assert not called
