"""Rotation fused into the Triton kernels (docs/rotation.md): the butterfly helper and the write kernel bit for
bit against the oracle's float32 rule, decode of rotated caches within the derived bound, and the errors.

Without a GPU these run under ``TRITON_INTERPRET=1`` on CPU tensors (marker ``interpret``, small shapes); on a
GPU the same tests run on the device (marker ``gpu``): ``pytest tests/test_triton_rotation.py``.
"""

from __future__ import annotations

import json
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest

from kvqref import backends, conformance, reference, schemes
from kvqref.paged import PagedKVCache
from kvqref.schemes.rotation import HadamardRotation, norm_f32

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from kvqref.backends import triton_backend as tb  # noqa: E402
from kvqref.kernels.codecs import INTERPRET, hadamard_rows  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
pytestmark = pytest.mark.gpu if GPU else pytest.mark.interpret
GOLDEN = Path(__file__).parent / "golden" / "golden_vectors.json"


def rot(seed: int) -> dict:
    return {"rotation": "hadamard", "rotation_seed": seed}


# -- the butterfly helper ----------------------------------------------------------------------------------
@triton.jit
def _reversed_butterflies(x, ROWS: tl.constexpr, D: tl.constexpr):
    """A planted bug: the stages in the wrong order (h = D/2, ..., 1): the same matrix, other roundings."""
    for s in tl.static_range(15):
        if (2 << (14 - s)) <= D:
            x4 = tl.permute(tl.reshape(x, (ROWS, D // (2 << (14 - s)), 2, 1 << (14 - s))), (0, 1, 3, 2))
            a, b = tl.split(x4)
            x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (ROWS, D))
    return x


@triton.jit
def _rotate_rows_kernel(X, Y, SIGNS, c, n, ROWS: tl.constexpr, D: tl.constexpr, REVERSED: tl.constexpr,
                        ROUTE: tl.constexpr, LANE_H: tl.constexpr, LANE_N: tl.constexpr, SHFL_ASM: tl.constexpr,
                        FOLD: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, D)
    m = (r < n)[:, None]
    x = tl.load(X + r[:, None] * D + d[None, :], mask=m, other=0.0)
    if REVERSED:
        y = _reversed_butterflies(x * tl.load(SIGNS + d)[None, :], ROWS, D)
    elif FOLD:  # the signs given to the helper: folded into the first stage (routes 0 and 2)
        y = hadamard_rows(x, ROWS, D, ROUTE, LANE_H, LANE_N, SHFL_ASM, tl.load(SIGNS + d))
    else:
        y = hadamard_rows(x * tl.load(SIGNS + d)[None, :], ROWS, D, ROUTE, LANE_H, LANE_N, SHFL_ASM)
    tl.store(Y + r[:, None] * D + d[None, :], y * c, mask=m)


#: hadamard_rows' routes under test: (ROUTE, LANE_H, LANE_N): split/join, sums, and the partner route by
#: tl.gather (what the interpreter and ROCm run) with lanes from column 16 or 8, and every stage up to 16 by partner
ROUTES = {"split-join": (0, 16, 8), "by-sums": (1, 16, 8), "partner-16": (2, 16, 8), "partner-8": (2, 8, 16),
          "partner-1": (2, 1, 32)}


def _kernel_rotate(x: np.ndarray, seed: int, reversed_order: bool = False, route: str = "split-join",
                   shfl_asm: bool = False, fold: bool = False) -> np.ndarray:
    n, D = x.shape
    xt = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(DEVICE)
    yt = torch.empty_like(xt)
    st = torch.from_numpy(HadamardRotation(seed).signs(D)).to(DEVICE)
    _rotate_rows_kernel[(triton.cdiv(n, 4),)](xt, yt, st, float(norm_f32(D)), n, ROWS=4, D=D,
                                              REVERSED=reversed_order, ROUTE=ROUTES[route][0],
                                              LANE_H=ROUTES[route][1], LANE_N=ROUTES[route][2], SHFL_ASM=shfl_asm,
                                              FOLD=fold)
    return yt.cpu().numpy()


@pytest.mark.parametrize("fold", [False, True], ids=["signs-first", "signs-folded"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_butterfly_helper_is_the_oracle_rule_bit_for_bit(route, fold):
    """``hadamard_rows`` (then ``* C_D``), with every data movement (``ROUTES``), the signs multiplied first or given
    to the helper (folded into the first stage as fused multiply-adds), reproduces the golden float32
    rotations (D = 2 ... 256, two seeds each, subnormal inputs included) and ``HadamardRotation.rotate`` on random rows
    with spread exponents and signed zeros, as integers; the stages in the reverse order (a planted bug) do
    not."""
    doc = json.loads(GOLDEN.read_text())["rotations"]
    for case in doc["cases"]:
        D = case["head_dim"]
        x = np.array([int(h, 16) for h in case["inputs"].split()], np.uint32).view(np.float32).reshape(-1, D)
        want = np.array([int(h, 16) for h in case["outputs"].split()], np.uint32)
        got = _kernel_rotate(x, int(case["seed"]), route=route, fold=fold).view(np.uint32).ravel()
        assert np.array_equal(got, want), (D, case["seed"], int((got != want).sum()))
    rng = np.random.default_rng(0)
    for D in (16, 128):
        x = (rng.standard_normal((64, D)) * np.exp2(rng.integers(-30, 30, (64, D)))).astype(np.float32)
        x[:8] = (x[:8].astype(np.float64) * 2.0**-120).astype(np.float32)  # subnormal results
        x[8:10] = 0.0
        x[9, ::3] = -0.0  # rows of signed zeros: a - b and a + (-b) must agree on every zero's sign
        x[10] = -0.0  # (-0) + (-0) = -0 but (-0) - (-0) = +0: fma(-1, -0, -0) must give +0 too
        want = HadamardRotation(11).rotate(x).view(np.uint32)
        assert np.array_equal(_kernel_rotate(x, 11, route=route, fold=fold).view(np.uint32), want), D
        planted = _kernel_rotate(x, 11, reversed_order=True).view(np.uint32)
        assert (planted != want).sum() > 0.05 * want.size, D  # the order is part of the rule: it is seen


# -- the write kernel --------------------------------------------------------------------------------------
#: every scheme kind and engine profile, rotated (KIVI: no residual window, so every token is written)
WRITE_CASES = [
    ("bf16", {}), ("fp8_e4m3", {}), ("fp8_e5m2", {"granularity": "head"}),
    ("fp8_e4m3", {"granularity": "token_head"}), ("fp8_e4m3", {"profile": "rocm", "scale": 0.03}),
    ("fp8_e5m2", {"profile": "rocm"}), ("fp8_e4m3", {"profile": "sglang", "scale": 0.004}),
    ("fp8_e4m3", {"profile": "sglang", "scale": 0.3, "sglang_scale": "float"}),
    ("fp8_e5m2", {"profile": "sglang", "scale": 0.003, "saturate": True}),
    ("fp8_e4m3", {"profile": "sglang", "scale": 0.05, "model_dtype": "float16"}),
    ("fp8_e4m3", {"profile": "rocm", "scale": 0.05, "model_dtype": "float16"}),
    ("fp4_e2m1", {}), ("fp4_e2m1", {"profile": "sglang"}),
    ("fp4_e2m1", {"profile": "sglang", "model_dtype": "bfloat16"}),
    ("mxfp4", {}), ("nvfp4", {}),
    ("int4_kivi", {"role": "value", "group_size": 32, "residual": 0}),
    ("int2_kivi", {"role": "value", "group_size": 16, "residual": 0}),
    ("int4_kivi", {"role": "key", "group_size": 16, "residual": 0}),
    ("int2_kivi", {"role": "key", "group_size": 32, "residual": 0}),
]
WRITE_IDS = [f"{n}-{'-'.join(map(str, o.values()))}" for n, o in WRITE_CASES]


def _write_input(rng: np.random.Generator, tokens: int, subnormal: bool = True) -> np.ndarray:
    """Write-check tokens (an all-zero token, E2M1 ties, deep underflow) plus a token with a 1e4 outlier and
    (``subnormal``) one whose rotated values are float32 subnormals (for KIVI a float16 group of mixed +-0, whose
    stored min is defined by ordering -0.0 < +0.0: ``kivi.signed_zero_min_max``)."""
    x = conformance.write_input(rng, tokens)
    if subnormal:
        x[11, 1] = (x[11, 1].astype(np.float64) * 2.0**-128).astype(np.float32)
    x[12, 0, 7] = 1e4
    return x


def _seed(label: str) -> int:
    return zlib.crc32(label.encode())


@pytest.mark.parametrize("name,opts", WRITE_CASES, ids=WRITE_IDS)
def test_rotated_write_bytes_equal_oracle(name, opts):
    """The write kernel's bytes equal ``RotatedScheme.quantize`` (through the paged cache) for every scheme,
    float32 input, compared as integers."""
    rng = np.random.default_rng(_seed(WRITE_IDS[WRITE_CASES.index((name, opts))]))
    x = _write_input(rng, 256 if GPU else 64)
    ok, detail = conformance.triton_write_matches(name, {**opts, **rot(5)}, x, max(16, opts.get("group_size", 1)),
                                                  rng)
    assert ok, f"{name} {opts}: {detail}"


#: the routes a rotated write can take besides its default: portable ones everywhere, warp shuffles on CUDA GPUs
OTHER_ROUTES = ["split", "sums", "gather"] + (["shfl"] if tb._nvidia_gpu(torch.device(DEVICE)) else [])


@pytest.mark.parametrize("route", OTHER_ROUTES)
@pytest.mark.parametrize("name,opts", [WRITE_CASES[i] for i in (1, 3, 11, 15, 16, 19)],
                         ids=[WRITE_IDS[i] for i in (1, 3, 11, 15, 16, 19)])
def test_rotated_write_other_butterfly_bytes_equal_oracle(name, opts, route):
    """Every butterfly route (``rotation_route``: split/join, sums over the pair axis, the partner by
    ``tl.gather``, and on a CUDA GPU by warp shuffles whose lanes are read from the compiled layout) writes the
    oracle's bytes, bfloat16 input."""
    from kvqref.conformance import to_dtype_values

    if route == tb.rotation_route_default(tb.kernel_config(schemes.get(name, **opts))["kind"], torch.device(DEVICE)):
        pytest.skip("the default route: the other write tests")
    rng = np.random.default_rng(_seed("sums " + name))
    x = to_dtype_values(_write_input(rng, 64 if GPU else 32), "bfloat16").astype(np.float32)
    ok, detail = conformance.triton_write_matches(name, {**opts, **rot(7)}, x, max(16, opts.get("group_size", 1)),
                                                  rng, dtype="bfloat16", launch={"rotation_route": route})
    assert ok, f"{name} {opts} rotation_route={route}: {detail}"


WORD_CASES = [c for c in WRITE_CASES if c[0] in ("fp4_e2m1", "mxfp4", "nvfp4") or "kivi" in c[0]]


@pytest.mark.parametrize("route", ["split", "sums", "gather"] + OTHER_ROUTES[3:])
@pytest.mark.parametrize("name,opts", WORD_CASES, ids=[f"{n}-{'-'.join(map(str, o.values()))}"
                                                        for n, o in WORD_CASES])
def test_rotated_write_by_word_loads_bytes_equal_oracle(name, opts, route):
    """Rotated FP4 and KIVI writes of bfloat16 input loading each pair of elements as one 32-bit word
    (``plan_write(word_load=True)``: the load then has the shape of a 4-bit code store, and Triton gives both the same
    layout) write the oracle's bytes by every butterfly route."""
    from kvqref.conformance import to_dtype_values

    rng = np.random.default_rng(_seed("words " + name))
    x = to_dtype_values(_write_input(rng, 64 if GPU else 32), "bfloat16").astype(np.float32)
    ok, detail = conformance.triton_write_matches(name, {**opts, **rot(13)}, x, max(16, opts.get("group_size", 1)),
                                                  rng, dtype="bfloat16",
                                                  launch={"rotation_route": route, "word_load": True})
    assert ok, f"{name} {opts} rotation_route={route}: {detail}"


def test_rotation_route_is_checked():
    """``rotation_route`` on an unrotated side, or an unknown one, is refused, not ignored; so are warp shuffles
    where they cannot run (the interpreter, ROCm)."""
    from kvqref.backends import triton_backend as tb

    cache = PagedKVCache(schemes.get("fp8_e4m3"), schemes.get("fp8_e4m3", **rot(3)), 2, 16, 2, 64)
    dc = tb.DeviceCache.from_cache(cache, DEVICE)
    x = torch.zeros(4, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="rotation_route needs a rotated scheme"):
        tb.plan_write(dc.k, x, torch.arange(4, device=DEVICE), rotation_route="sums")
    with pytest.raises(ValueError, match="rotation_route must be one of"):
        tb.plan_write(dc.v, x, torch.arange(4, device=DEVICE), rotation_route="butterfly")
    if bool(INTERPRET):
        with pytest.raises(ValueError, match="not in the interpreter"):
            tb.plan_write(dc.v, x, torch.arange(4, device=DEVICE), rotation_route="shfl")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name,opts", [WRITE_CASES[i] for i in (1, 3, 6, 11, 12, 15, 16)],
                         ids=[WRITE_IDS[i] for i in (1, 3, 6, 11, 12, 15, 16)])
def test_rotated_write_of_16_bit_inputs(name, opts, dtype):
    """16-bit input tensors: the kernel widens them exactly, rotates in float32 and quantizes the float32 rotated
    values as ``RotatedScheme.quantize`` does (the model dtype does not round rotated values)."""
    from kvqref.conformance import to_dtype_values

    rng = np.random.default_rng(len(name) + len(dtype))
    x = to_dtype_values(_write_input(rng, 64 if GPU else 32), dtype).astype(np.float32)
    ok, detail = conformance.triton_write_matches(name, {**opts, **rot(6)}, x, max(16, opts.get("group_size", 1)),
                                                  rng, dtype=dtype)
    assert ok, f"{name} {opts} {dtype}: {detail}"


WRITE_TILES = [(2, 2, 1), (1, 2, 1), (4, 2, 2), (1, 8, 1)]  # (block_t, block_h, num_warps)


@pytest.mark.parametrize("tile", WRITE_TILES, ids=["x".join(map(str, t)) for t in WRITE_TILES])
@pytest.mark.parametrize("name,opts", [WRITE_CASES[i] for i in (1, 11, 15)], ids=[WRITE_IDS[i] for i in (1, 11, 15)])
def test_rotated_write_tiles_of_bfloat16_input(name, opts, tile):
    """Rotated writes of bfloat16 input at tiles other than the default, by the default route: the oracle's bytes.
    (H100, triton 3.6: the warp-shuffle butterflies at 2 tokens x 2 heads per program and 1 warp fit the compiled
    layout by their lane bases and still wrote wrong FP4 code bytes; the probe of ``settle_partner_lanes`` now sends
    such a launch to the portable route, with a RuntimeWarning.)"""
    from kvqref.conformance import to_dtype_values

    rng = np.random.default_rng(sum(tile) + len(name))
    x = to_dtype_values(_write_input(rng, 256 if GPU else 32, subnormal=False), "bfloat16").astype(np.float32)
    launch = dict(zip(("block_t", "block_h", "num_warps"), tile, strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a fallback to the portable route says so
        ok, detail = conformance.triton_write_matches(name, {**opts, **rot(9)}, x, 32, rng, dtype="bfloat16",
                                                      launch=launch)
    assert ok, f"{name} {opts} {tile}: {detail}"


@pytest.mark.parametrize("name,opts,layout", [("fp8_e4m3", {}, "NHD"), ("nvfp4", {}, "HND"),
                                              ("int4_kivi", {"role": "key", "group_size": 32}, "HND")],
                         ids=["fp8-NHD", "nvfp4-HND", "int4_kivi-key-HND"])
def test_write_launch_probe_compares_bytes(name, opts, layout):
    """``write_launches_agree``: two routes of the same butterflies agree on the probe input; a launch that rounds
    the rotated values to bfloat16 (``RDT``) or encodes another FP8 format does not (a probe that can fail)."""
    params = {"fp8_e4m3": {"scale": np.float32(0.05)}, "nvfp4": {"global_scale": np.float32(0.01)}}.get(name)
    s = schemes.get(name, **opts, **rot(2))
    dc = tb.empty_device_cache(s, s, 8, 32, 2, 64, torch.zeros(1, 8, dtype=torch.int32, device=DEVICE),
                               torch.tensor([256], dtype=torch.int32, device=DEVICE), device=DEVICE, layout=layout,
                               k_params=params, v_params=params)
    x = torch.randn(64, 2, 64, device=DEVICE).to(torch.bfloat16)
    launch = tb.plan_write(dc.k, x, torch.arange(64, device=DEVICE), rotation_route="gather")
    assert tb.write_launches_agree(launch, {"ROT_ROUTE": 0}, torch.device(DEVICE))  # split/join
    other = {"FMT": 1} if name.startswith("fp8") else {"RDT": 1}
    assert not tb.write_launches_agree(launch, other, torch.device(DEVICE))


def test_rotated_write_golden_scheme_vectors():
    """The golden ``rotations.schemes`` fields (12 rotated scheme cases) written by the kernel, as integers."""
    doc = json.loads(GOLDEN.read_text())["rotations"]
    for case in doc["schemes"]:
        T, H, D = case["shape"]
        s = schemes.get(case["scheme"], **case["options"], **rot(case["rotation_seed"]))
        x = np.array([int(h, 16) for h in case["inputs"].split()], np.uint32).view(np.float32).reshape(T, H, D)
        params = {p: np.array([int(h, 16) for h in v.split()], np.uint32).view(np.float32).reshape(())
                  for p, v in case["params"].items()}
        dc = tb.empty_device_cache(s, s, 2, 16, H, D, torch.zeros(1, 2, dtype=torch.int32),
                                   torch.zeros(1, dtype=torch.int32), k_params=params, device=DEVICE)
        key = getattr(s, "role", None) == "key"  # KIVI keys: one whole group in consecutive slots
        slots = torch.arange(4, 4 + T, dtype=torch.int64) if key else torch.tensor([9, 2, 30, 17])
        tb.quantize_write(dc.k, torch.from_numpy(x).to(DEVICE), slots.to(DEVICE))
        specs = s.fields(H, D)
        for f, hexes in case["fields"].items():
            rows = slots if specs[f].per == "token" else (slots // s.token_group).unique()
            got = dc.k.fields[f][rows.to(DEVICE)].cpu().contiguous().view(torch.uint8).numpy()
            want = np.array([int(h, 16) for h in hexes.split()], {2: np.uint8, 4: np.uint16, 8: np.uint32}[
                len(hexes.split()[0])]).view(np.uint8)
            assert np.array_equal(got.ravel(), want), (case["scheme"], case["options"], f)


def test_planted_dropped_sign_fails_the_write_check(monkeypatch):
    """Negative control: one sign of the rotation dropped (forced to +1) on the kernel side only: the bytes
    differ from the oracle's for every scheme kind tried."""
    real = tb.rotation_signs

    def dropped(rotation, head_dim, device):
        s = real(rotation, head_dim, device).clone()
        s[int(torch.nonzero(s < 0)[0])] = 1.0
        return s

    monkeypatch.setattr(tb, "rotation_signs", dropped)
    rng = np.random.default_rng(8)
    x = _write_input(rng, 32, subnormal=False)
    for name, opts in (WRITE_CASES[1], WRITE_CASES[11], WRITE_CASES[16]):
        ok, detail = conformance.triton_write_matches(name, {**opts, **rot(5)}, x, 16, rng)
        assert not ok, (name, detail)


def test_rotated_write_rejects_what_the_oracle_rejects():
    """NaN/Inf input, rotated values beyond float32, beyond an explicit float16 model dtype: ValueError, as
    ``RotatedScheme.quantize``; values near the limit that do not overflow are written."""
    bt, sl = torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    slots = torch.arange(2, dtype=torch.int64, device=DEVICE)
    bf = schemes.get("bf16", **rot(1))
    dc = tb.empty_device_cache(bf, bf, 2, 16, 1, 16, bt, sl, device=DEVICE)
    for bad, match in ((float("nan"), "NaN or Inf"), (float("inf"), "NaN or Inf"), (3e38, "overflow float32")):
        x = np.ones((2, 1, 16), np.float32)
        x[1, 0, 3] = bad
        x[1, 0, 4] = bad
        with pytest.raises(ValueError, match="NaN or Inf|overflow"):
            bf.quantize(x)
        with pytest.raises(ValueError, match=match):
            tb.quantize_write(dc.k, torch.from_numpy(x).to(DEVICE), slots)
    x = np.ones((2, 1, 16), np.float32)  # near the limit, but every butterfly sum stays below 3.4e38: written
    x[:, 0, 0] = 1e38
    tb.quantize_write(dc.k, torch.from_numpy(x).to(DEVICE), slots)
    want = bf.quantize(x).fields["data"]
    assert np.array_equal(dc.k.fields["data"][:2].cpu().view(torch.int16).numpy().view(np.uint16), want)
    f16 = schemes.get("fp8_e4m3", profile="sglang", scale=1.0, model_dtype="float16", **rot(1))
    dc = tb.empty_device_cache(f16, f16, 2, 16, 1, 16, bt, sl, k_params={"scale": 1.0}, device=DEVICE)
    x = np.zeros((2, 1, 16), np.float32)
    x[1, 0, :] = 20000.0 * HadamardRotation(1).signs(16)  # z[0] = 16 * 20000 * C_16 = 80000 > float16's max
    with pytest.raises(ValueError, match="overflow"):
        f16.quantize(x, params={"scale": 1.0})
    with pytest.raises(ValueError, match="overflow float16"):
        tb.quantize_write(dc.k, torch.from_numpy(x).to(DEVICE), slots)


# -- decode ------------------------------------------------------------------------------------------------
SMALL = dict(batch=3, kv_heads=2, q_heads=4, head_dim=64, page_size=16, lens=(1, 37, 70))
BIG = dict(batch=4, kv_heads=8, q_heads=32, head_dim=128, page_size=16, lens=(1, 300, 1000, 2500))
#: (label, K scheme, K options, V scheme, V options): both sides (different seeds), K only, V only, every kind
PAIRS = [
    ("bf16 K1/V2", "bf16", rot(1), "bf16", rot(2)),
    ("fp8 K only", "fp8_e4m3", rot(3), "fp8_e4m3", {}),
    ("fp8 V only, token scales", "fp8_e4m3", {"granularity": "head"}, "fp8_e5m2",
     {"granularity": "token_head", **rot(4)}),
    ("fp4_e2m1 K1/V1", "fp4_e2m1", rot(1), "fp4_e2m1", {"profile": "sglang", **rot(1)}),
    ("mxfp4/nvfp4 K5/V6", "mxfp4", rot(5), "nvfp4", rot(6)),
    ("nvfp4 K only", "nvfp4", rot(2), "nvfp4", {}),
    ("int4_kivi K7/V8 + residual", "int4_kivi", {"role": "key", "group_size": 16, "residual": 32, **rot(7)},
     "int4_kivi", {"role": "value", "group_size": 16, "residual": 32, **rot(8)}),
    ("int2_kivi V only + residual", "int2_kivi", {"role": "key", "group_size": 16, "residual": 16},
     "int2_kivi", {"role": "value", "group_size": 32, "residual": 16, **rot(9)}),
]
IDS = [p[0].replace(" ", "_").replace(",", "") for p in PAIRS]


def _rotated_decode(pair, precision: str, qdtype: str, seed: int, shape=None, plant=None, outputs=None, **kw):
    """(max over rows of |err| / bound for out, the same for lse) of the triton decode of a rotated cache (``kw``:
    plan_decode's options; ``outputs``: a list that gets the (out, lse) tensors)."""
    shape = shape or (BIG if GPU else SMALL)
    rng = np.random.default_rng(seed)
    cache, _ = conformance.build_cache(pair, shape, rng)
    q = torch.from_numpy(rng.standard_normal((shape["batch"], shape["q_heads"], shape["head_dim"]))
                         .astype(np.float32)).to(getattr(torch, qdtype))
    q64 = q.float().numpy().astype(np.float64)
    stored = cache.storage_view()
    Ks = [stored.dequantized(b)[0] for b in range(cache.batch)]
    fast = None
    if precision == "fast":  # the kernel's q is float32 once rotated
        fast = reference.fast_rounding(cache.k.scheme, cache.v.scheme,
                                       "float32" if cache.k.rotation is not None else qdtype)
    ref, ref_lse, tol_o, tol_l = reference.rotated_kernel_tolerance(
        q64, cache, fast=fast, K_round=conformance.kivi_key_round(cache, Ks),
        K_scale=conformance.kivi_key_scale(cache, Ks))
    be = backends.get("triton")
    dc = be.prepare(cache)
    if plant is not None:
        plant(dc)
    out, lse = be.decode(q.to(dc.block_table.device), dc, precision=precision, **kw)
    out, lse = out.cpu().numpy().astype(np.float64), lse.cpu().numpy().astype(np.float64)
    if outputs is not None:
        outputs.append((out, lse))
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    err = np.linalg.norm(out - ref, axis=-1)
    return (err / tol_o).max(), (np.abs(lse - ref_lse) / tol_l).max()


@pytest.mark.parametrize("precision", ["fast", "exact"])
@pytest.mark.parametrize("i", range(len(PAIRS)), ids=IDS)
def test_rotated_decode_matches_oracle(i, precision):
    """Decode of a rotated cache (q rotated by a launch before the split kernel, the output un-rotated in the merge
    kernel) against the oracle's rotated attention, within ``reference.rotated_kernel_tolerance``; q in bfloat16
    and float32 (alternating over the cases)."""
    r_out, r_lse = _rotated_decode(("", *PAIRS[i][1:]), precision, "bfloat16" if i % 2 else "float32", seed=i)
    assert r_out <= 1 and r_lse <= 1, (r_out, r_lse)


@pytest.mark.parametrize("precision", ["fast", "exact"])
def test_rotated_decode_planted_bugs_are_seen(precision):
    """Negative controls, kernel side only: the K (or V) rotation of the device cache replaced by another seed's
    (q rotated wrongly / the output un-rotated wrongly), must fail the bound."""
    pair = ("", "fp8_e4m3", rot(1), "fp8_e4m3", rot(2))
    assert max(_rotated_decode(pair, precision, "float32", seed=3)) <= 1

    def swap(side_name):
        def plant(dc):
            side = getattr(dc, side_name)
            side.scheme = schemes.get("fp8_e4m3", **rot(99))
        return plant

    r_out, r_lse = _rotated_decode(pair, precision, "float32", seed=3, plant=swap("k"))
    assert r_out > 1 and r_lse > 1
    r_out, r_lse = _rotated_decode(pair, precision, "float32", seed=3, plant=swap("v"))
    assert r_out > 1 and r_lse <= 1


#: rotated V read by every value path of the split kernel: one product (bf16), FP8 (value words on NVIDIA), FP4 block
#: rows, KIVI value rows of 4-bit (two phases) and 2-bit codes (four), without a residual window (one split)
ONE_SPLIT_PAIRS = [
    ("", "bf16", rot(1), "bf16", rot(2)),
    ("", "fp8_e4m3", {}, "fp8_e4m3", rot(3)),
    ("", "mxfp4", rot(5), "nvfp4", rot(6)),
    ("", "int4_kivi", {"role": "key", "group_size": 16, "residual": 0, **rot(7)},
     "int4_kivi", {"role": "value", "group_size": 16, "residual": 0, **rot(8)}),
    ("", "int2_kivi", {"role": "key", "group_size": 16, "residual": 0},
     "int2_kivi", {"role": "value", "group_size": 32, "residual": 0, **rot(9)}),
]


@pytest.mark.parametrize("precision", ["fast", "exact"])
@pytest.mark.parametrize("i", range(len(ONE_SPLIT_PAIRS)))
def test_rotated_decode_of_one_split_unrotates_in_the_split_kernel(i, precision):
    """One split and no residual window (``direct_output``): the split kernel un-rotates a rotated V itself (``ROT_V``)
    and no merge launch follows; the output and LSE equal those of the merged launch (``direct_output=False``, the
    merge kernel un-rotating) and lie within the oracle's bound; V's rotation replaced by another seed's fails it."""
    from kvqref.kernels.decode import merge_kernel, plan_decode

    pair = ONE_SPLIT_PAIRS[i]

    # whole KIVI key groups: with residual 0 every token then lies in pages, so the device cache needs no residual
    # split (as the benchmarks' caches)
    shape = dict(BIG, lens=(32, 320, 1024, 2496)) if GPU else dict(SMALL, lens=(32, 64, 96))

    def no_window(dc):
        assert torch.equal(dc.k_lens, dc.seq_lens) and torch.equal(dc.v_lens, dc.seq_lens)
        dc.has_residual = False

    got, merged = [], []
    r_out, r_lse = _rotated_decode(pair, precision, "bfloat16", seed=40 + i, shape=shape, plant=no_window, outputs=got,
                                   num_splits=1, direct_output=True)
    assert r_out <= 1 and r_lse <= 1, (r_out, r_lse)
    _rotated_decode(pair, precision, "bfloat16", seed=40 + i, shape=shape, plant=no_window, outputs=merged,
                    num_splits=1, direct_output=False)
    assert np.array_equal(got[0][0], merged[0][0]) and np.array_equal(got[0][1], merged[0][1])
    cache, _ = conformance.build_cache(pair, SMALL, np.random.default_rng(0))
    dc = backends.get("triton").prepare(cache)
    q = torch.zeros(SMALL["batch"], SMALL["q_heads"], SMALL["head_dim"], dtype=torch.bfloat16,
                    device=dc.block_table.device)
    launches, _, _ = plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, dc.page_size,
                                 num_splits=1, precision=precision)
    assert launches[-1].constexprs["DIRECT"] and launches[-1].constexprs["ROT_V"]
    assert not any(la.kernel is merge_kernel for la in launches)

    def swap_v(dc):
        no_window(dc)
        dc.v.scheme = schemes.get(pair[3], **{**pair[4], **rot(99)})

    r_out, _ = _rotated_decode(pair, precision, "bfloat16", seed=40 + i, shape=shape, plant=swap_v, num_splits=1,
                               direct_output=True)
    assert r_out > 1


def test_rotated_q_in_bfloat16_where_the_keys_meet_q_in_bfloat16():
    """Fast mode with bf16 or KIVI keys: the rotation's launch hands the split kernel q' rounded once to bfloat16 (to
    nearest even: torch's rounding of its float32 q', bit for bit, for q with huge, tiny and signed-zero components);
    exact mode and FP8 / FP4 keys (which meet q in float16) take the float32 q'."""
    from kvqref.kernels.decode import plan_decode, rotate_q_kernel

    rng = np.random.default_rng(11)
    q = torch.from_numpy(rng.standard_normal((3, 4, 64)).astype(np.float32))
    q[0, 0, :8] = torch.tensor([1e-39, -3e-40, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 3.0e38, -0.0, 0.0, 2.0**-126])
    qs = {}
    for label, pair in (("kivi", ONE_SPLIT_PAIRS[3]), ("fp8", ("", "fp8_e4m3", rot(3), "fp8_e4m3", {}))):
        cache, _ = conformance.build_cache(pair, SMALL, np.random.default_rng(0))
        dc = backends.get("triton").prepare(cache)
        for precision in ("fast", "exact"):
            launches, _, _ = plan_decode(q.to(DEVICE), dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens,
                                         dc.page_size, precision=precision)
            rq = launches[0]
            assert rq.kernel is rotate_q_kernel
            rq()
            qs[label, precision] = rq.args[2].cpu()
    assert qs["kivi", "fast"].dtype == torch.bfloat16
    assert all(qs[key].dtype == torch.float32 for key in (("kivi", "exact"), ("fp8", "fast"), ("fp8", "exact")))
    want = qs["kivi", "exact"].to(torch.bfloat16)  # the same K rotation and q
    got = qs["kivi", "fast"]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_rotated_decode_head_dim_256_and_mqa():
    for over in (dict(head_dim=256), dict(kv_heads=1, q_heads=8)):
        shape = dict(BIG if GPU else SMALL, **over)
        r_out, r_lse = _rotated_decode(("", "fp4_e2m1", rot(1), "nvfp4", rot(2)), "fast", "bfloat16", 4, shape)
        assert r_out <= 1 and r_lse <= 1, over


def test_rotated_decode_errors():
    """A torch-backend cache (stored values + rotations) is not a triton device cache: ValueError; head_dim must
    be a power of two; ``kernel_config`` of a rotated scheme is the inner one's plus the rotation."""
    cache = PagedKVCache("bf16", schemes.get("bf16", **rot(1)), 4, 16, 1, 64)
    cache.append(0, np.ones((3, 1, 64), np.float32), np.ones((3, 1, 64), np.float32))
    q = torch.zeros(1, 1, 64)
    with pytest.raises(ValueError, match="RotatedDeviceCache"):
        backends.get("triton").decode(q, backends.get("torch").prepare(cache))
    with pytest.raises(ValueError, match="power of two"):
        tb.empty_device_cache(schemes.get("bf16", **rot(1)), schemes.get("bf16"), 2, 16, 1, 48,
                              torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), device=DEVICE)
    cfg = tb.kernel_config(schemes.get("nvfp4", **rot(3)))
    assert cfg["kind"] == "nvfp4" and cfg["rotation"] == HadamardRotation(3)
