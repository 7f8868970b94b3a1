"""The Triton kernels against the NumPy oracles: bytes written, and attention within the derived tolerance.

Without a GPU these run under ``TRITON_INTERPRET=1`` on CPU tensors (marker ``interpret``, small shapes);
on a GPU the same tests run on the device with larger shapes (marker ``gpu``).
"""

from __future__ import annotations

import warnings
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvqref import reference, schemes

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from kvqref import conformance  # noqa: E402
from kvqref.backends import triton_backend as tb  # noqa: E402
from kvqref.conformance import kv_tensor, triton_write_matches  # noqa: E402
from kvqref.kernels.decode import _row_sums_mma, default_value_rows  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
pytestmark = pytest.mark.gpu if GPU else pytest.mark.interpret

# (K scheme, K options, V scheme, V options)
PAIRS = [
    ("bf16", {}, "bf16", {}),
    ("fp8_e4m3", {}, "fp8_e4m3", {}),
    ("fp8_e4m3", {"granularity": "head"}, "fp8_e5m2", {"granularity": "token_head"}),
    ("fp8_e4m3", {"profile": "rocm"}, "fp8_e5m2", {"profile": "rocm"}),
    ("fp8_e4m3", {"profile": "sglang", "scale": 1.0}, "fp8_e4m3", {"profile": "sglang", "scale": 0.02}),
    ("fp4_e2m1", {}, "fp4_e2m1", {"profile": "sglang"}),
    ("mxfp4", {}, "nvfp4", {}),
    ("int4_kivi", {"role": "key", "group_size": 16, "residual": 32},
     "int4_kivi", {"role": "value", "group_size": 16, "residual": 32}),
    ("int2_kivi", {"role": "key", "group_size": 16, "residual": 16},
     "int2_kivi", {"role": "value", "group_size": 32, "residual": 16}),
    ("nvfp4", {}, "nvfp4", {}),
]
IDS = [f"{k}{'-' + '-'.join(f'{a}' for a in ko.values()) if ko else ''}/{v}" for k, ko, v, _ in PAIRS]

SMALL = dict(batch=3, kv_heads=2, q_heads=4, head_dim=64, page_size=16, lens=(1, 37, 70))
BIG = dict(batch=4, kv_heads=8, q_heads=32, head_dim=128, page_size=16, lens=(1, 300, 1000, 2500))


def build_cache(pair, shape, rng: np.random.Generator, chunks: int = 3):
    """kvqref.conformance.build_cache for a (K scheme, K options, V scheme, V options) pair: ragged appends in
    several chunks (crossing page and group boundaries), pages from a shuffled free list."""
    return conformance.build_cache(("", *pair), shape, rng, chunks)


def _run_decode(cache, q, **kw):
    dc = tb.DeviceCache.from_cache(cache, DEVICE)
    out, lse = tb.decode(q.to(DEVICE), dc, **kw)
    return out.cpu().numpy().astype(np.float64), lse.cpu().numpy().astype(np.float64), dc


def plan_for_cache(q, dc, **kw):
    """``plan_decode`` over the fields, block table, lengths and page size of device cache ``dc``."""
    from kvqref.kernels.decode import plan_decode

    return plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, dc.page_size, **kw)


def split_launch_of(launches):
    """The first split launch (``decode_split_kernel``) of a plan's launches."""
    from kvqref.kernels.decode import decode_split_kernel

    return next(la for la in launches if la.kernel is decode_split_kernel)


def _decode_without_and_with(dc, q, kw, option, constexpr):
    """``[(out, lse) without, (out, lse) with]`` plan option ``option`` (bool) of the decode of ``q`` over device cache
    ``dc``, checking that the split launch's ``constexpr`` follows it."""
    got = []
    for on in (False, True):
        launches, _, _ = plan_for_cache(q.to(DEVICE), dc, **kw, **{option: on})
        assert split_launch_of(launches).constexprs[constexpr] is on
        out, lse = tb.decode(q.to(DEVICE), dc, **kw, **{option: on})
        got.append((out.cpu().numpy(), lse.cpu().numpy()))
    return got


def _value_round(cache, Vs):
    """For KIVI values in fast mode (the group's scale folded into p), the magnitudes whose product with p is
    rounded: (V - Z) = s * code on the paged tokens (Z: the token's group zero), V on the residual tokens;
    None for other schemes."""
    if not isinstance(cache.v.scheme, schemes.KiviScheme):
        return None
    out = []
    for b, V in enumerate(Vs):
        z = np.repeat(cache.quantized(b, "v").fields["zero"].astype(np.float64), cache.v.scheme.group_size, axis=2)
        out.append(V - np.concatenate([z, np.zeros((V.shape[0] - z.shape[0], *V.shape[1:]))]))
    return out


def _oracle(cache, q64, precision="fast", qdtype="bfloat16", value_rows=None, key_rows=True):
    """Oracle attention and the tolerance of ``precision`` (docs/kernels.md, "Precision"); ``value_rows``: the
    kernel folds KIVI value scales into p (the fast default), so the bound is taken against ``V - Z``;
    ``key_rows``: KIVI keys by key rows (the fast default; False: key tiles or the folded q)."""
    Ks, Vs = zip(*(cache.dequantized(b) for b in range(cache.batch)), strict=True)
    out, lse = reference.attention(q64, Ks, Vs)
    fast = reference.fast_rounding(cache.k.scheme, cache.v.scheme, qdtype,
                                   kivi_key_rows=key_rows) if precision == "fast" else None
    if value_rows is None:  # the kernel's default layout for this cache and query shape
        v = cache.v.scheme
        k = cache.k.scheme
        k_group = k.group_size if isinstance(k, schemes.KiviScheme) and k.role == "key" else 0
        value_rows = isinstance(v, schemes.KiviScheme) and v.role == "value" and default_value_rows(
            precision, "int_v", q64.shape[1] // cache.kv_heads, cache.head_dim, v.group_size, k_group)
    vr = _value_round(cache, Vs) if precision == "fast" and value_rows else None
    tol_o, tol_l = reference.kernel_tolerance(q64, Ks, Vs, fast=fast, K_round=conformance.kivi_key_round(cache, Ks),
                                              V_round=vr, K_scale=conformance.kivi_key_scale(cache, Ks))
    return out, lse, tol_o, tol_l


@pytest.mark.parametrize("pair", PAIRS, ids=IDS)
@pytest.mark.parametrize("qdtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("precision", ["fast", "exact"])
def test_decode_matches_oracle(pair, qdtype, precision):
    # a seed that is the same in every process (``hash`` of a str is salted per process: a failure could not be
    # reproduced)
    rng = np.random.default_rng(zlib.crc32(f"{IDS[PAIRS.index(pair)]}/{qdtype}".encode()))
    shape = BIG if GPU else SMALL
    cache, _ = build_cache(pair, shape, rng)
    q = torch.from_numpy(rng.standard_normal((shape["batch"], shape["q_heads"], shape["head_dim"]))
                         .astype(np.float32)).to(getattr(torch, qdtype))
    q64 = q.float().numpy().astype(np.float64)
    out, lse, dc = _run_decode(cache, q, precision=precision)
    ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q64, precision, qdtype)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    err = np.abs(out - ref_out)
    bad = err > tol_o
    assert not bad.any(), (f"{bad.sum()} outputs beyond tolerance at {np.argwhere(bad)[:4].tolist()}: error "
                           f"{err[bad][:4]}, tolerance {tol_o[bad][:4]}, oracle {ref_out[bad][:4]}")
    assert (np.abs(lse - ref_lse) <= tol_l).all(), f"lse error {np.abs(lse - ref_lse).max():.3g}"


@pytest.mark.parametrize("precision", ["fast", "exact"])
@pytest.mark.parametrize("pair", [PAIRS[1], PAIRS[2], PAIRS[3]], ids=[IDS[1], IDS[2], IDS[3]])
def test_fp8_value_words_match_the_oracle(pair, precision):
    """``fp8_value_words``: FP8 value tiles read as 16-bit words of two channels (even and odd channels two
    products) give the oracle's attention within the precision's bound, and the byte tiles' outputs (the same
    products; each channel's sum over the tile's tokens in the same order); a token-scaled V refuses the option."""
    rng = np.random.default_rng(23)
    shape = BIG if GPU else SMALL
    cache, _ = build_cache(pair, shape, rng)
    q = torch.from_numpy(rng.standard_normal((shape["batch"], shape["q_heads"], shape["head_dim"]))
                         .astype(np.float32)).to(torch.bfloat16)
    q64 = q.float().numpy().astype(np.float64)
    token_scaled = pair[3].get("granularity") == "token_head"
    if token_scaled:
        with pytest.raises(ValueError, match="fp8_value_words"):
            _run_decode(cache, q, precision=precision, fp8_value_words=True)
        return
    words, wlse, _ = _run_decode(cache, q, precision=precision, fp8_value_words=True)
    ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q64, precision, "bfloat16")
    err = np.abs(words - ref_out)
    assert (err <= tol_o).all(), f"max error / tolerance {(err / tol_o).max():.3g}"
    assert (np.abs(wlse - ref_lse) <= tol_l).all()
    out, lse, dc = _run_decode(cache, q, precision=precision, fp8_value_words=False)
    np.testing.assert_allclose(words, out, rtol=0, atol=float(tol_o.max()) * 1e-3)
    np.testing.assert_array_equal(wlse, lse)
    # the default: words on NVIDIA GPUs (by PTX where the format converts in hardware), not elsewhere
    from kvqref.kernels.decode import hardware_fp8_formats

    launches, _, _ = plan_for_cache(q.to(DEVICE), dc, precision=precision)
    nvidia = GPU and not getattr(torch.version, "hip", None)
    fmt = dc.v.tiles().fmt  # (0, 1: the OCP formats)
    ptx = nvidia and fmt in (0, 1) and fmt in hardware_fp8_formats(torch.device(DEVICE))
    assert launches[0].constexprs["VW8"] == (2 if ptx else 1 if nvidia else 0), pair
    # an explicit ptx_unpack decides the halves' route (the ahead-of-time builds plan CUDA launches on the CPU)
    for want_ptx in ((False,) if getattr(torch.version, "hip", None) else (False, True)):
        launches, _, _ = plan_for_cache(q.to(DEVICE), dc, precision=precision, fp8_value_words=True,
                                        ptx_unpack=want_ptx, hw_formats={fmt})
        assert launches[0].constexprs["VW8"] == (2 if want_ptx and fmt in (0, 1) else 1), (pair, want_ptx)


@pytest.mark.parametrize("pair", PAIRS[7:9], ids=IDS[7:9])
def test_kivi_values_without_rows_by_group(pair):
    """``value_rows=False``: fast-mode KIVI values dequantized in float32 and split in two bfloat16 parts
    (the path before rows by group), within the bound taken against |V|; and the default (rows by group)
    agrees with it within the sum of both bounds."""
    rng = np.random.default_rng(21)
    cache, _ = build_cache(pair, SMALL, rng)
    q = torch.from_numpy(rng.standard_normal((3, 4, 64)).astype(np.float32)).to(torch.bfloat16)
    q64 = q.float().numpy().astype(np.float64)
    out, lse, _ = _run_decode(cache, q, precision="fast", value_rows=False)
    ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q64, "fast", value_rows=False)
    assert (np.abs(out - ref_out) <= tol_o).all() and (np.abs(lse - ref_lse) <= tol_l).all()
    rows, _, _ = _run_decode(cache, q, precision="fast")
    _, _, tol_rows, _ = _oracle(cache, q64, "fast")
    assert (np.abs(rows - out) <= tol_o + tol_rows).all()
    with pytest.raises(ValueError, match="value_rows"):
        _run_decode(cache, q, precision="exact", value_rows=True)


@pytest.mark.parametrize("pair", PAIRS[7:9], ids=IDS[7:9])
def test_kivi_keys_with_the_scale_folded_into_q(pair):
    """``key_tile=False``: fast-mode KIVI keys with the group's scale folded into a float32 q (q * s in two
    bfloat16 parts) and q . z reduced per tile (the path before the key tiles), within the fast bound; the
    default (key tiles c * s + z in two bfloat16 parts against the bfloat16 q) agrees with it within the sum
    of both bounds; exact mode refuses the option."""
    rng = np.random.default_rng(22)
    cache, _ = build_cache(pair, SMALL, rng)
    q = torch.from_numpy(rng.standard_normal((3, 4, 64)).astype(np.float32)).to(torch.bfloat16)
    q64 = q.float().numpy().astype(np.float64)
    ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q64, "fast", key_rows=False)
    folded, lse_f, _ = _run_decode(cache, q, precision="fast", key_tile=False, key_rows=False)
    assert (np.abs(folded - ref_out) <= tol_o).all() and (np.abs(lse_f - ref_lse) <= tol_l).all()
    tiles, lse_t, _ = _run_decode(cache, q, precision="fast", key_tile=True)
    assert (np.abs(tiles - ref_out) <= tol_o).all() and (np.abs(lse_t - ref_lse) <= tol_l).all()
    assert (np.abs(tiles - folded) <= 2 * tol_o).all()
    with pytest.raises(ValueError, match="key_tile"):
        _run_decode(cache, q, precision="exact", key_tile=True)


@pytest.mark.skipif(not GPU, reason="inline PTX runs on a CUDA device only (the interpreter takes the portable path)")
@pytest.mark.parametrize("pair", PAIRS[7:9], ids=IDS[7:9])
def test_kivi_key_rows_ptx_equals_the_portable_unpacking(pair):
    """KIVI key rows with the codes unpacked by inline PTX (``ptx_unpack=True``: :func:`_int_codes_ptx`, keys in
    float16 and values in bfloat16 through the magic numbers) give bit-identical outputs to the portable unpacking,
    within the oracle's bound."""
    if getattr(torch.version, "hip", None):
        pytest.skip("CUDA only")
    rng = np.random.default_rng(24)
    cache, _ = build_cache(pair, BIG, rng)
    q = torch.from_numpy(rng.standard_normal((BIG["batch"], BIG["q_heads"], BIG["head_dim"])).astype(np.float32))
    q = q.to(torch.bfloat16)
    cfg = dict(precision="fast", key_rows=True, value_rows=True, block_n=64, num_warps=4, num_stages=2)
    out_int, lse_int, _ = _run_decode(cache, q, ptx_unpack=False, **cfg)
    out_ptx, lse_ptx, _ = _run_decode(cache, q, ptx_unpack=True, **cfg)
    assert np.array_equal(out_ptx, out_int) and np.array_equal(lse_ptx, lse_int)
    ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q.float().numpy().astype(np.float64), "fast", value_rows=True)
    assert (np.abs(out_ptx - ref_out) <= tol_o).all() and (np.abs(lse_ptx - ref_lse) <= tol_l).all()


KEY_ROW_SHAPES = [  # (q_heads, kv_heads, head_dim, block_n): key rows (block_n / G_K) x heads, at least 16
    (4, 2, 64, None), (4, 2, 64, 16), (4, 2, 64, 32), (8, 2, 128, 64), (2, 2, 64, 128), (16, 2, 64, None)]


@pytest.mark.parametrize("pair", PAIRS[7:9], ids=IDS[7:9])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_n", KEY_ROW_SHAPES)
def test_kivi_key_rows(pair, q_heads, kv_heads, head_dim, block_n):
    """``key_rows`` (fast-mode KIVI keys by (token group, head) rows: q * s rounded once to float16 per group row
    against the exact codes, tiles of one or several key groups) meets the oracle's bound for a bfloat16 and a
    float32 q; it is the default where the key rows fit 16 (at 8 query heads per KV head, with value rows of up to 32,
    at a shorter tile); it agrees with the folded path (``key_rows=False``)
    within the sum of both bounds; a planted key code step (+1 at the channel of the largest |q s| of the token
    the first head attends to most) moves the lse beyond the bound; bad combinations are refused."""
    rng = np.random.default_rng(q_heads * 7 + head_dim + (block_n or 0))
    shape = dict(SMALL, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim)
    cache, _ = build_cache(pair, shape, rng)
    q32 = torch.from_numpy(4 * rng.standard_normal((3, q_heads, head_dim)).astype(np.float32))
    kw = {} if block_n is None else {"block_n": block_n}
    for qdtype in ("bfloat16", "float32"):
        q = q32.to(getattr(torch, qdtype))
        q64 = q.float().numpy().astype(np.float64)
        ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q64, "fast", qdtype, value_rows=True)
        out, lse, _ = _run_decode(cache, q, precision="fast", key_rows=True, value_rows=True, **kw)
        assert (np.abs(out - ref_out) <= tol_o).all() and (np.abs(lse - ref_lse) <= tol_l).all(), qdtype
    dc = tb.DeviceCache.from_cache(cache, DEVICE)
    launches, _, _ = plan_for_cache(q.to(DEVICE), dc, **kw)
    split = next(launch for launch in launches if "KR" in launch.constexprs)
    cx = split.constexprs
    rows = max(1, cx["BLOCK_N"] // cache.k.scheme.group_size) * triton.next_power_of_2(q_heads // kv_heads)
    assert cx["KR"] is (cx["HV"] > 0 and rows <= 16)
    if q_heads // kv_heads == 8:  # value rows of up to 32 beside key rows of 16 at a shorter tile: the default there
        assert cx["KR"] and cx["HV"] == 8 and cx["BLOCK_N"] == 32, cx
    _, _, tol_f, tol_fl = _oracle(cache, q64, "fast", qdtype, value_rows=True, key_rows=False)
    folded, lse_f, _ = _run_decode(cache, q, precision="fast", key_rows=False, key_tile=False, value_rows=True, **kw)
    assert (np.abs(out - folded) <= tol_o + tol_f).all() and (np.abs(lse - lse_f) <= tol_l + tol_fl).all()
    # planted: one key code +1 (or -1 at the top code) in the channel of the largest |q_d s_d|
    b = 2
    K, _ = cache.dequantized(b)
    n = int(cache.k.paged[b])
    top = int(np.argmax(K[:n, 0, :] @ q64[b, 0]))
    s = cache.quantized(b, "k").fields["scale"].astype(np.float64)[top // cache.k.scheme.group_size, 0]
    d = int(np.argmax(np.abs(q64[b, 0] * s)))
    page, off = divmod(int(cache.slot_mapping(b, top, 1)[0]), cache.page_size)
    bits = cache.k.scheme.bits
    byte, shift = divmod(d * bits, 8)
    codes = cache.k.storage["codes"]
    code = (int(codes[page, off, 0, byte]) >> shift) & ((1 << bits) - 1)
    codes[page, off, 0, byte] = (int(codes[page, off, 0, byte]) & ~(((1 << bits) - 1) << shift)
                                 | ((code + (1 if code == 0 else -1)) << shift))
    _, lse_p, _ = _run_decode(cache, q, precision="fast", key_rows=True, value_rows=True, **kw)
    assert (np.abs(lse_p - ref_lse) > tol_l).any()
    with pytest.raises(ValueError, match="key_rows"):
        _run_decode(cache, q, precision="exact", key_rows=True)
    with pytest.raises(ValueError, match="key_rows"):
        _run_decode(cache, q, precision="fast", key_rows=True, value_rows=False)
    with pytest.raises(ValueError, match="key_rows"):
        _run_decode(build_cache(PAIRS[1], SMALL, rng)[0], q[:, :4, :64], key_rows=True)


KIVI_WORD_PAIRS = [  # KIVI key groups of 32 (a 128-token tile holds four), 4- and 2-bit codes
    ("int4_kivi", {"role": "key", "group_size": 32, "residual": 32},
     "int4_kivi", {"role": "value", "group_size": 32, "residual": 32}),
    ("int2_kivi", {"role": "key", "group_size": 32, "residual": 32},
     "int2_kivi", {"role": "value", "group_size": 64, "residual": 32}),
]


def _plant_code_step(cache, side: str, b: int, token: int, channel: int) -> None:
    """Code +1 (-1 at the top code) of ``token``'s channel ``channel`` in KV head 0 of sequence ``b``."""
    page, off = divmod(int(cache.slot_mapping(b, token, 1)[0]), cache.page_size)
    bits = getattr(cache, side).scheme.bits
    byte, shift = divmod(channel * bits, 8)
    codes = getattr(cache, side).storage["codes"]
    code = (int(codes[page, off, 0, byte]) >> shift) & ((1 << bits) - 1)
    codes[page, off, 0, byte] = (int(codes[page, off, 0, byte]) & ~(((1 << bits) - 1) << shift)
                                 | ((code + (1 if code == 0 else -1)) << shift))


@pytest.mark.parametrize("pair", KIVI_WORD_PAIRS, ids=["int4", "int2"])
@pytest.mark.parametrize("words,block_n", [(True, None), (False, 32), (True, 64)])
def test_kivi_pipeline_gives_the_same_bits(pair, words, block_n):
    """``kivi_pipeline`` (the key-rows loop computing the next tile's scores beside this tile's softmax and value
    products) does the same arithmetic per tile, so its outputs and lse equal the unpipelined loop's bit for bit:
    sequences of one token, of a partial last tile and of several tiles, and splits of the sequence (whose first
    tile is the prologue's). Without key rows it is refused; the default (off, page ids read ahead instead) is the
    measured choice. Planted bugs fail it: the prologue's tile advanced by one (the first tile's scores never used),
    this tile scored with the next tile's scores."""
    rng = np.random.default_rng(31 + (pair[0] == "int2_kivi"))
    shape = dict(SMALL, q_heads=8, kv_heads=2, head_dim=128, page_size=32, lens=(1, 150, 300))
    cache, _ = build_cache(pair, shape, rng)
    q = torch.from_numpy(4 * rng.standard_normal((3, 8, 128)).astype(np.float32)).to(torch.bfloat16)
    kw = dict(precision="fast", key_rows=True, value_rows=True, kivi_words=words,
              **({} if block_n is None else {"block_n": block_n}))
    for splits in ({}, {"num_splits": 3}):
        out, lse, _ = _run_decode(cache, q, kivi_pipeline=False, **kw, **splits)
        out_p, lse_p, _ = _run_decode(cache, q, kivi_pipeline=True, **kw, **splits)
        assert np.array_equal(out_p, out) and np.array_equal(lse_p, lse), splits
    with pytest.raises(ValueError, match="kivi_pipeline needs key_rows"):
        _run_decode(cache, q, precision="fast", key_rows=False, kivi_pipeline=True)
    # the default: 4-bit key words without a register cap are pipelined (session 18, H100), except with at least 2
    # query heads per KV head in head-major pages, where they read their page ids ahead instead (session 32, H200:
    # batch 32 x 8,192 232.3 -> 222.0 us), and in token-major pages with their value scales read as words (sessions
    # 33-34: 264.1 -> 250.9 at 4, 272.3 -> 243.9 at 2); 2-bit words without a cap read theirs ahead in token-major
    # pages at 2 and 4 (session 34: 192.1 -> 183.6 at 4); nothing else

    def split_constexprs(dc, qq, **extra):
        launches, _, _ = plan_for_cache(qq.to(DEVICE), dc, **kw, **extra)
        split = split_launch_of(launches)
        return split.constexprs, split.options.get("maxnreg")

    token_major = tb.DeviceCache.from_cache(cache, DEVICE)
    for dc, qq, head_major in ((token_major, q, False), (token_major.with_layout("HND"), q, True),
                               (token_major.with_layout("HND"), q[:, ::4], True),  # (and 1 query head per KV head)
                               (token_major, q[:, ::2], False),  # (2 and 1 in token-major pages)
                               (token_major, q[:, ::4], False)):
        cx, maxnreg = split_constexprs(dc, qq)
        words4 = pair[0] == "int4_kivi" and words and maxnreg is None
        ahead = (words and maxnreg is None and qq.shape[1] >= 4  # (2 kv heads)
                 and (words4 and head_major or cx["VSW"] and not head_major))
        assert cx["VSW"] is (not head_major), head_major  # (value groups of 32: 4 per token)
        assert cx["PIDS_AHEAD"] is ahead and cx["KPIPE"] is (words4 and not ahead), (pair[0], words, maxnreg)
        cx, _ = split_constexprs(dc, qq, kivi_pipeline=True)  # asked for: pipelined, page ids in the step
        assert cx["KPIPE"] is True and cx["PIDS_AHEAD"] is False


@pytest.mark.parametrize("pair", KIVI_WORD_PAIRS, ids=["int4", "int2"])
def test_kivi_value_scale_words_same_bits(pair):
    """``kivi_value_scale_words`` (each token's KIVI value scales and zeros, 4 float16 groups for int4 here and 2 for
    int2, read as one 64- or 32-bit word and split by shifts) loads the same values, so outputs and lse equal the
    element loads' bit for bit, in token-major and head-major pages and for the residual split; the default is on
    with key rows in token-major pages only; asked for without KIVI value rows it is refused. Planted bugs fail it:
    group g taken from bits 16 (g + 1), the word one element type too narrow (int4: 32 bits for 4 groups)."""
    from kvqref.kernels.decode import decode_split_kernel

    rng = np.random.default_rng(61 + (pair[0] == "int2_kivi"))
    shape = dict(SMALL, q_heads=8, kv_heads=2, head_dim=128, page_size=32, lens=(1, 150, 300))
    cache, _ = build_cache(pair, shape, rng)
    q = torch.from_numpy(4 * rng.standard_normal((3, 8, 128)).astype(np.float32)).to(torch.bfloat16).to(DEVICE)
    token_major = tb.DeviceCache.from_cache(cache, DEVICE)
    for dc in (token_major, token_major.with_layout("HND")):
        outs = {}
        for words in (False, True):
            out, lse = tb.decode(q, dc, precision="fast", kivi_value_scale_words=words)
            outs[words] = out.cpu().numpy(), lse.cpu().numpy()
        assert np.array_equal(outs[True][0], outs[False][0]) and np.array_equal(outs[True][1], outs[False][1])
        launches, _, _ = plan_for_cache(q, dc, precision="fast", residual=dc.residual)
        splits = [launch for launch in launches if launch.kernel is decode_split_kernel]
        assert all(split.constexprs["VSW"] is (not dc.k.head_major) for split in splits), dc.k.head_major
    with pytest.raises(ValueError, match="kivi_value_scale_words needs KIVI value rows"):
        tb.decode(q, token_major, precision="fast", value_rows=False, key_rows=False, kivi_value_scale_words=True)


def _kivi_words_case(pair, seed):
    """A KIVI word pair's cache (2 KV heads, 4 query heads per KV head, head_dim 128, pages of 32, sequences of 1,
    150 and 300 tokens), a bfloat16 q and the fast-mode oracle's outputs, lse and bounds with value rows."""
    rng = np.random.default_rng(seed + (pair[0] == "int2_kivi"))
    shape = dict(SMALL, q_heads=8, kv_heads=2, head_dim=128, page_size=32, lens=(1, 150, 300))
    cache, _ = build_cache(pair, shape, rng)
    q = torch.from_numpy(4 * rng.standard_normal((3, 8, 128)).astype(np.float32)).to(torch.bfloat16)
    ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q.float().numpy().astype(np.float64), "fast", "bfloat16",
                                             value_rows=True)
    return cache, q, ref_out, ref_lse, tol_o, tol_l


@pytest.mark.parametrize("pair", KIVI_WORD_PAIRS, ids=["int4", "int2"])
def test_kivi_value_chunks(pair):
    """``kivi_value_chunks`` (the key words' value products of a 128-token tile batched in 1, 2 or 4 chunks of its
    tokens, the chunks summed after the loop: the same products, summed in another order) meets the oracle's bound
    of the key rows each way, and the chunkings agree within two bounds. The default is one chunk per warp, chunks of
    at least 32 tokens (4 query heads per KV head: 2-bit words at 2 warps in 2 chunks, 4-bit words at 4 warps in 4;
    64-token tiles in 2; a 4-warp launch asked for 2-bit words: 4); bad counts are refused. Planted bugs fail it:
    the first chunk left out of the sum after the loop, the value rows' tokens interleaved across the chunks
    instead of split into runs (from 2 chunks on)."""
    cache, q, ref_out, ref_lse, tol_o, tol_l = _kivi_words_case(pair, 51)
    kw = dict(precision="fast", key_rows=True, value_rows=True, kivi_words=True)
    runs = {}
    for nch in (1, 2, 4):
        out, lse, _ = _run_decode(cache, q, kivi_value_chunks=nch, **kw)
        assert (np.abs(out - ref_out) <= tol_o).all() and (np.abs(lse - ref_lse) <= tol_l).all(), nch
        runs[nch] = out, lse
    for nch in (1, 2):
        assert (np.abs(runs[nch][0] - runs[4][0]) <= 2 * tol_o).all(), nch
        assert (np.abs(runs[nch][1] - runs[4][1]) <= 2 * tol_l).all(), nch
    dc = tb.DeviceCache.from_cache(cache, DEVICE)

    def split_cx(**extra):
        launches, _, _ = plan_for_cache(q.to(DEVICE), dc, precision="fast", **extra)
        split = split_launch_of(launches)
        return split.constexprs["NCH"], split.options["num_warps"], split.constexprs["BLOCK_N"]

    two_bit = pair[0] == "int2_kivi"
    assert split_cx() == ((2, 2, 128) if two_bit else (4, 4, 128))
    assert split_cx(block_n=64) == (2, 2 if two_bit else 4, 64)
    assert split_cx(num_warps=4) == (4, 4, 128)
    assert split_cx(kivi_words=False)[0] == 1  # (unused without words)
    for bad in ({"kivi_value_chunks": 3}, {"kivi_value_chunks": 16}, {"kivi_value_chunks": 2, "kivi_words": False}):
        with pytest.raises(ValueError, match="kivi_value_chunks must be a power of two"):
            _run_decode(cache, q, **{**kw, **bad})


@pytest.mark.parametrize("pair", KIVI_WORD_PAIRS, ids=["int4", "int2"])
def test_kivi_chunk_softmax(pair):
    """``kivi_chunk_softmax`` (a softmax state, max, sum and zero term, per value chunk of the key words' tile, the
    chunks' states merged after the loop; the chunks are runs of R tokens dealt round-robin, R = 8 by default so that
    each warp's columns of the key product are one chunk) meets the oracle's bound for runs of 1, 8 and 32 tokens,
    with the page ids read in the step, ahead, and with the pipelined key rows, on sequences of 1, 150 and 300 tokens
    (chunks that see no token, tiles cut short), and agrees with one state per tile within two bounds. The default:
    runs of 8 for 4-bit key words at 4 query heads per KV head in either layout (with subnormal key codes), off at 2
    query heads per KV head, for 2-bit words and without words; bad runs refused. Planted bugs fail it: the chunks'
    sums merged without their factor 2**(m_c - m), the values' tokens chunked in contiguous runs while the scores'
    are dealt in runs of 8."""
    cache, q, ref_out, ref_lse, tol_o, tol_l = _kivi_words_case(pair, 53)
    kw = dict(precision="fast", key_rows=True, value_rows=True, kivi_words=True)
    one, one_lse, _ = _run_decode(cache, q, kivi_chunk_softmax=0, **kw)
    for runs, extra in ((8, {}), (1, {}), (32, {}), (8, {"page_ids_ahead": True}), (8, {"kivi_pipeline": True})):
        out, lse, _ = _run_decode(cache, q, kivi_chunk_softmax=runs, **kw, **extra)
        assert (np.abs(out - ref_out) <= tol_o).all() and (np.abs(lse - ref_lse) <= tol_l).all(), (runs, extra)
        assert (np.abs(out - one) <= 2 * tol_o).all() and (np.abs(lse - one_lse) <= 2 * tol_l).all(), (runs, extra)

    def split_cx(qq, layout="HND", **extra):
        dc = tb.DeviceCache.from_cache(cache, DEVICE).with_layout(layout)
        launches, _, _ = plan_for_cache(qq.to(DEVICE), dc, precision="fast", **extra)
        split = split_launch_of(launches)
        return split.constexprs["CSM"], split.constexprs["KSUB"]

    four_bit = pair[0] == "int4_kivi"
    for layout in ("HND", "NHD"):
        assert split_cx(q, layout) == ((8, True) if four_bit else (0, True)), layout
    assert split_cx(q[:, :4])[0] == 0  # 2 query heads per KV head
    assert split_cx(q, kivi_words=False)[0] == 0
    for bad in ({"kivi_chunk_softmax": 3}, {"kivi_chunk_softmax": 128}, {"kivi_chunk_softmax": -8},
                {"kivi_chunk_softmax": 8, "kivi_words": False}):
        with pytest.raises(ValueError, match="kivi_chunk_softmax must be 0 or a power of two"):
            _run_decode(cache, q, **{**kw, **bad})


@triton.jit
def _row_sums_probe(X, O, B: tl.constexpr, M: tl.constexpr, K: tl.constexpr):
    """O [B, M, 16] = 0.25 + the row sums of X [B, M, K] by ``_row_sums_mma``."""
    i = tl.arange(0, B)[:, None, None] * M + tl.arange(0, M)[None, :, None]
    x = tl.load(X + i * K + tl.arange(0, K)[None, None, :])
    r = _row_sums_mma(x, tl.zeros((B, M, 16), tl.float32) + 0.25)
    tl.store(O + i * 16 + tl.arange(0, 16)[None, None, :], r)


@given(seed=st.integers(0, 2**32 - 1))
@settings(max_examples=4, deadline=None)
def test_row_sums_mma_are_exact_sums(seed):
    """``_row_sums_mma`` (chunk states' zero terms: row sums as x's three bfloat16 parts times ones on the tensor
    cores) gives the exact row sums, in every column, of float32 values n * 2**-20 with |n| < 2**19 (19 significant
    bits: hi and mid, rounded to nearest, hold 17 at most, so each part counts) over 16 columns plus 0.25: every
    partial sum of the parts, in any order, is a multiple of 2**-20 below 2**23 * 2**-20, so float32 holds it
    exactly (23 bits; the tensor cores' float32 accumulation keeps at least 24) and the result must equal the float64
    sum. Planted bugs fail it
    (interpreter): the last part (lo) or the last two left out."""
    rng = np.random.default_rng(seed)
    n = rng.integers(-(2**19) + 1, 2**19, size=(4, 16, 16))
    x = (n * 2.0**-20).astype(np.float32)
    out = torch.full((4, 16, 16), float("nan"), dtype=torch.float32, device=DEVICE)
    _row_sums_probe[(1,)](torch.from_numpy(x).to(DEVICE), out, B=4, M=16, K=16, num_warps=4)
    want = 0.25 + n.sum(2) * 2.0**-20
    assert np.array_equal(out.cpu().numpy(), np.broadcast_to(want[:, :, None], (4, 16, 16)).astype(np.float32))


@pytest.mark.parametrize("pair", KIVI_WORD_PAIRS, ids=["int4", "int2"])
def test_kivi_value_subnormal_codes_give_the_same_bits(pair):
    """``kivi_value_subnormal_codes`` (KIVI key words' value codes as bfloat16 subnormals code * 2**(k - 133) against
    bf16(p * 2**96 * s), each code position's sums times 2**(37 - k) after the loop) scales every product and partial
    sum by a power of two, so its outputs and lse equal the magic-number codes' bit for bit in the interpreter (on the
    GPU: both within the oracle's bound, the lse equal, the outputs within 2**-18 relative or 1/64 of the bound, as
    the tensor cores sum subnormal operands' products with fewer bits): 4 query heads per KV head
    (4-bit words: with a softmax state per value chunk) and 2 (without), both field layouts, one split and three,
    sequences of 1, 150 and 300 tokens, each token's values times 2**-22 .. 2**4. Refused without key words; the
    default is the measured one. Planted
    bugs fail it: the unscaling of code position 1 off by a factor 2, p not scaled (products below float32's range)."""
    from kvqref.paged import PagedKVCache

    rng = np.random.default_rng(37 + (pair[0] == "int2_kivi"))
    kname, kopt, vname, vopt = pair
    cache = PagedKVCache(schemes.get(kname, **kopt), schemes.get(vname, **vopt), 24, 32, 2, 128, batch=3,
                         max_pages=11, free_pages=[int(i) for i in rng.permutation(24)])
    for b, n in enumerate((1, 150, 300)):
        exps = rng.integers(-22, 5, size=(n, 2, 1)).astype(np.int32)
        cache.append(b, kv_tensor(rng, n, 2, 128, outliers=True), np.ldexp(kv_tensor(rng, n, 2, 128, False), exps))
    q = torch.from_numpy(4 * rng.standard_normal((3, 8, 128)).astype(np.float32)).to(torch.bfloat16)
    kw = dict(precision="fast", key_rows=True, value_rows=True, kivi_words=True)
    dense = tb.DeviceCache.from_cache(cache, DEVICE)
    for layout, qq, splits in (("NHD", q, {}), ("HND", q, {"num_splits": 3}), ("HND", q[:, ::2], {}),
                               ("NHD", q[:, ::2], {"num_splits": 3})):
        got = _decode_without_and_with(dense.with_layout(layout), qq, {**kw, **splits}, "kivi_value_subnormal_codes",
                                       "VSUB")
        (out0, lse0), (out1, lse1) = got
        assert np.isfinite(out0).all()
        if GPU:  # the tensor cores align products to their operands' exponent fields, so a subnormal code's products
            # keep fewer bits of the float32 sum (H200: a few units in the last place): the oracle's bound instead
            q64 = qq.float().numpy().astype(np.float64)
            ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q64, "fast", "bfloat16", value_rows=True)
            for out, lse in got:
                assert (np.abs(out - ref_out) <= tol_o).all() and (np.abs(lse - ref_lse) <= tol_l).all(), layout
            assert np.array_equal(lse1, lse0) and (np.abs(out1 - out0) <= 2**-18 * np.abs(out0) + tol_o / 64).all()
        else:
            assert np.array_equal(out1, out0) and np.array_equal(lse1, lse0), (layout, qq.shape, splits)
    # the default (H200, session 36): 2-bit value words at 3-4 query heads per KV head, 4-bit ones in token-major
    # pages with chunk states (there at 4 query heads per KV head); not 4-bit head-major (175.1 -> 188.9 us), nor
    # elsewhere
    for layout in ("NHD", "HND"):
        for qq in (q, q[:, ::2]):
            launches, _, _ = plan_for_cache(qq.to(DEVICE), dense.with_layout(layout), **kw)
            cx = split_launch_of(launches).constexprs
            want = qq.shape[1] == 8 and (pair[2] == "int2_kivi" or (layout == "NHD" and bool(cx["CSM"])))
            assert cx["VSUB"] is want, (layout, qq.shape)
    with pytest.raises(ValueError, match="kivi_value_subnormal_codes needs kivi_words"):
        plan_for_cache(q.to(DEVICE), dense, precision="fast", key_rows=True, value_rows=True, kivi_words=False,
                       kivi_value_subnormal_codes=True)


@pytest.mark.parametrize("pair", KIVI_WORD_PAIRS, ids=["int4", "int2"])
def test_kivi_scalar_page_ids_give_the_same_bits(pair):
    """``kivi_scalar_page_ids`` (a tile's page ids read one step ahead as four scalars, each tensor of tokens' cache
    rows made from them in its own layout) reads the same rows, so its outputs and lse equal the row vector's bit for
    bit, on the GPU too: token-major and head-major pages, 4 and 2 query heads per KV head, one split and three,
    sequences of 1, 150 and 300 tokens in pages from a shuffled free list (a tile spans 4 pages of 32), and pages of
    128 (a tile inside one page). Refused without page ids ahead or with the pipelined loop; the default is the
    measured one. Planted bugs fail it: the value words' rows dealt to the chunks in runs of 16 while the scores are
    dealt in runs of 8, the next tile's zeros read from this tile's pages. (The tile's page ids swapped for every
    consumer alike passes: attention does not depend on the tokens' order.)"""
    rng = np.random.default_rng(41 + (pair[0] == "int2_kivi"))
    kw = dict(precision="fast", key_rows=True, value_rows=True, kivi_words=True, page_ids_ahead=True,
              kivi_pipeline=False)
    for page in (32, 128):
        shape = dict(SMALL, q_heads=8, kv_heads=2, head_dim=128, page_size=page, lens=(1, 150, 300))
        cache, _ = build_cache(pair, shape, rng)
        q = torch.from_numpy(4 * rng.standard_normal((3, 8, 128)).astype(np.float32)).to(torch.bfloat16)
        dense = tb.DeviceCache.from_cache(cache, DEVICE)
        cases = ((("NHD", q, {}), ("HND", q, {"num_splits": 3}), ("HND", q[:, ::2], {}),
                  ("NHD", q[:, ::2], {"num_splits": 3})) if page == 32 else (("HND", q, {"num_splits": 2}),))
        for layout, qq, splits in cases:
            (out0, lse0), (out1, lse1) = _decode_without_and_with(dense.with_layout(layout), qq, {**kw, **splits},
                                                                  "kivi_scalar_page_ids", "SPG")
            assert np.isfinite(out0).all()
            assert np.array_equal(out1, out0) and np.array_equal(lse1, lse0), (page, layout, qq.shape, splits)
    # the default (H200, session 36): 4-bit words in token-major pages with chunk states (196.1 -> 190.7 us at batch
    # 32 x 8,192); head-major (174.8 -> 216.1) and 2-bit words (169.6 -> 181.8) lose
    cache, _ = build_cache(pair, dict(SMALL, q_heads=8, kv_heads=2, head_dim=128, page_size=32, lens=(1, 150, 300)),
                           rng)
    dense = tb.DeviceCache.from_cache(cache, DEVICE)
    for layout in ("NHD", "HND"):
        for qq in (q, q[:, ::2]):
            launches, _, _ = plan_for_cache(qq.to(DEVICE), dense.with_layout(layout), precision="fast",
                                            key_rows=True, value_rows=True)
            cx = split_launch_of(launches).constexprs
            assert cx["SPG"] is (pair[0] == "int4_kivi" and layout == "NHD" and qq.shape[1] == 8), (layout, qq.shape)
    with pytest.raises(ValueError, match="kivi_scalar_page_ids needs"):
        plan_for_cache(q.to(DEVICE), dense, **{**kw, "page_ids_ahead": False}, kivi_scalar_page_ids=True)
    with pytest.raises(ValueError, match="kivi_scalar_page_ids needs"):
        plan_for_cache(q.to(DEVICE), dense, **{**kw, "kivi_pipeline": True}, kivi_scalar_page_ids=True)


@pytest.mark.parametrize("pair", KIVI_WORD_PAIRS, ids=["int4", "int2"])
@pytest.mark.parametrize("q_heads,block_n,flip_chains", [(8, None, False), (8, 64, False), (4, 32, False),
                                                         (8, None, True), (16, None, False)])
def test_kivi_words(pair, q_heads, block_n, flip_chains):
    """``kivi_words`` (KIVI key rows with the codes read as words of eight codes, one product per code position; the
    values' products per chunk of 32 tokens; the key products in one accumulation chain or two, ``kivi_key_chains``:
    each width's default, and with ``flip_chains`` the other) meets the oracle's bound of the key rows for a
    bfloat16 and a float32 q, and agrees with the byte phases within the sum of both bounds. A planted key code step
    (the channel of the largest |q s| of the paged token a head attends to most) moves that head's lse beyond the
    bound; a planted value code step (a channel of the largest value scale of such a token, at a code position other
    than 0) changes that head's output in the planted channel only. Bad combinations are refused. Planted bugs fail
    it: key codes 1 and 2 swapped (6 of 6), the 4-bit value codes interleaved in the wrong order (the 3 int4 cases),
    one value accumulator not rescaled (6 of 6), the second of two key chains dropped (int4)."""
    rng = np.random.default_rng(q_heads * 11 + (block_n or 0) + (pair[0] == "int2_kivi"))
    shape = dict(SMALL, q_heads=q_heads, kv_heads=2, head_dim=128, page_size=32, lens=(1, 150, 300))
    cache, _ = build_cache(pair, shape, rng)
    q32 = torch.from_numpy(4 * rng.standard_normal((3, q_heads, 128)).astype(np.float32))
    kw = dict(precision="fast", key_rows=True, value_rows=True, **({} if block_n is None else {"block_n": block_n}))
    chains = {"kivi_key_chains": 1 if pair[0] == "int4_kivi" else 2} if flip_chains else {}
    for qdtype in ("bfloat16", "float32"):
        q = q32.to(getattr(torch, qdtype))
        q64 = q.float().numpy().astype(np.float64)
        ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q64, "fast", qdtype, value_rows=True)
        out, lse, _ = _run_decode(cache, q, kivi_words=True, **kw, **chains)
        assert (np.abs(out - ref_out) <= tol_o).all() and (np.abs(lse - ref_lse) <= tol_l).all(), qdtype
        byte, lse_b, _ = _run_decode(cache, q, kivi_words=False, **kw)
        assert (np.abs(out - byte) <= 2 * tol_o).all() and (np.abs(lse - lse_b) <= 2 * tol_l).all(), qdtype
    b = 2
    K, _ = cache.dequantized(b)

    def top_token(side):  # a query head of KV head 0 that attends most to a paged (quantized) token of ``side``
        return next((h, int(np.argmax(K[:, 0, :] @ q64[b, h]))) for h in range(q_heads // 2)
                    if np.argmax(K[:, 0, :] @ q64[b, h]) < int(getattr(cache, side).paged[b]))

    kh, top = top_token("k")
    s = cache.quantized(b, "k").fields["scale"].astype(np.float64)[top // cache.k.scheme.group_size, 0]
    key_ch = int(np.argmax(np.abs(q64[b, kh] * s)))
    vh, vtop = top_token("v")
    vs = np.repeat(cache.quantized(b, "v").fields["scale"].astype(np.float64)[vtop, 0], cache.v.scheme.group_size)
    vs[::8] = 0  # a channel 8c + p with p > 0: not the first code of its word
    val_ch = int(np.argmax(vs))
    for side, token, ch in (("k", top, key_ch), ("v", vtop, val_ch)):
        planted, _ = build_cache(pair, shape, np.random.default_rng(q_heads * 11 + (block_n or 0)
                                                                    + (pair[0] == "int2_kivi")))
        _plant_code_step(planted, side, b, token, ch)
        out_p, lse_p, _ = _run_decode(planted, q, kivi_words=True, **kw, **chains)
        if side == "k":
            assert np.abs(lse_p - ref_lse)[b, kh] > tol_l[b, kh], side
        else:  # the step shows in the planted channel of that head's output, and only there
            step = np.abs(out_p - out)[b, vh]
            assert step.argmax() == ch and np.delete(step, ch).max() < 1e-3 * step[ch], side
    with pytest.raises(ValueError, match="kivi_words"):
        _run_decode(cache, q, precision="fast", key_rows=False, kivi_words=True)
    for bad in ({"kivi_key_chains": 3}, {"kivi_key_chains": 2, "kivi_words": False}):
        with pytest.raises(ValueError, match="kivi_key_chains must be 1 or 2"):
            _run_decode(cache, q, **{"kivi_words": True, **kw, **bad})
    small, _ = build_cache(pair, dict(shape, head_dim=64), rng)
    with pytest.raises(ValueError, match="kivi_words needs.*head_dim >= 128"):
        _run_decode(small, q[:, :, :64], kivi_words=True, **kw)


@pytest.mark.parametrize("pair", KIVI_WORD_PAIRS, ids=["int4", "int2"])
@pytest.mark.parametrize("words,flip_chains", [(True, False), (True, True), (False, False)],
                         ids=["words", "words-other-chains", "bytes"])
def test_kivi_subnormal_codes(pair, words, flip_chains):
    """``kivi_subnormal_codes`` (the default with key rows: key codes unpacked into the float16 subnormals code *
    2**(K - 24), no magic number subtracted, the powers of two taken out of the float32 products and, where one chain
    holds codes at several bits K, 2**(KMIN - K) put into the operands) against exact codes (``False``): 4-bit words
    in their default two chains give the same bits in the interpreter (every scaling is an exact power of two on
    float32 sums; the H100's tensor cores round some of the scaled sums differently in the last bit); every path
    (words in one or two chains, byte phases; bfloat16 and float32 q) meets the oracle's bound and agrees with the
    exact codes within both bounds. The default: on for 2-bit keys by key rows (where it measured faster), and for
    4-bit keys in head-major pages and, token-major, as words with a softmax state per value chunk (4 query heads per
    KV head: the case here; token-major 4-bit bytes lost at 64 query heads). Refused without key rows.
    Planted bugs fail it: the odd chain's 2**-4
    dropped (the two-chain cases: int4 words, int2 words in two chains), the 2**24 dropped (every case)."""
    rng = np.random.default_rng(41 + (pair[0] == "int2_kivi"))
    shape = dict(SMALL, q_heads=8, kv_heads=2, head_dim=128, page_size=32, lens=(1, 150, 300))
    cache, _ = build_cache(pair, shape, rng)
    q32 = torch.from_numpy(4 * rng.standard_normal((3, 8, 128)).astype(np.float32))
    chains = {"kivi_key_chains": 1 if pair[0] == "int4_kivi" else 2} if flip_chains else {}
    kw = dict(precision="fast", key_rows=True, value_rows=True, kivi_words=words, **chains)
    for qdtype in ("bfloat16", "float32"):
        q = q32.to(getattr(torch, qdtype))
        ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q.float().numpy().astype(np.float64), "fast", qdtype,
                                                 value_rows=True)
        out, lse, _ = _run_decode(cache, q, kivi_subnormal_codes=True, **kw)
        exact, lse_x, _ = _run_decode(cache, q, kivi_subnormal_codes=False, **kw)
        assert (np.abs(out - ref_out) <= tol_o).all() and (np.abs(lse - ref_lse) <= tol_l).all(), qdtype
        if pair[0] == "int4_kivi" and words and not flip_chains and not GPU:
            assert np.array_equal(out, exact) and np.array_equal(lse, lse_x), qdtype
        else:
            assert (np.abs(out - exact) <= 2 * tol_o).all() and (np.abs(lse - lse_x) <= 2 * tol_l).all(), qdtype
    for layout in ("NHD", "HND"):
        dc = tb.DeviceCache.from_cache(cache, DEVICE).with_layout(layout)
        launches, _, _ = plan_for_cache(q.to(DEVICE), dc, **kw)
        assert split_launch_of(launches).constexprs["KSUB"] is (
            pair[0] == "int2_kivi" or layout == "HND" or words), layout
    with pytest.raises(ValueError, match="kivi_subnormal_codes needs key_rows"):
        _run_decode(cache, q, precision="fast", key_rows=False, kivi_subnormal_codes=True)


@pytest.mark.skipif(not GPU, reason="inline PTX runs on a CUDA device only (the interpreter takes the portable path)")
@pytest.mark.parametrize("precision", ["fast", "exact"])
@pytest.mark.parametrize("pair", [PAIRS[5], PAIRS[6], ("nvfp4", {}, "nvfp4", {})],
                         ids=[IDS[5], IDS[6], "nvfp4/nvfp4"])
def test_ptx_unpacking_equals_the_portable_one(pair, precision):
    """``ptx_unpack=True`` (FP4 nibbles unpacked by inline PTX) builds the same E2M1 values as the portable
    integer code, so with value tiles as bytes the outputs are bit-identical, and within the tolerance of the oracle.
    With value tiles as 16-bit words (the default by channel halves) both routes meet the oracle's bound; they need
    not be bit-identical: fp4_e2m1's two routes compile to different orders of the token products (the quads
    themselves are: ``test_e2m1_quads_ptx_equals_the_portable_one``; H100, triton 3.6: last-bit differences, max
    1e-6, session 12)."""
    if getattr(torch.version, "hip", None):
        pytest.skip("CUDA only")
    rng = np.random.default_rng(16)
    cache, _ = build_cache(pair, BIG, rng)
    q = torch.from_numpy(rng.standard_normal((BIG["batch"], BIG["q_heads"], BIG["head_dim"])).astype(np.float32))
    cfg = dict(precision=precision, block_n=64, num_warps=2, num_stages=2)  # one tiling: same summation order
    if precision == "fast":
        cfg["value_words"] = False
    out_int, lse_int, _ = _run_decode(cache, q, ptx_unpack=False, **cfg)
    out_ptx, lse_ptx, _ = _run_decode(cache, q, ptx_unpack=True, **cfg)
    assert np.array_equal(out_ptx, out_int) and np.array_equal(lse_ptx, lse_int)
    ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q.numpy().astype(np.float64), precision, "float32")
    assert (np.abs(out_ptx - ref_out) <= tol_o).all()
    for ptx in (True, False):  # the default launch (value words where they apply), each route
        out, lse, _ = _run_decode(cache, q, ptx_unpack=ptx, precision=precision)
        assert (np.abs(out - ref_out) <= tol_o).all() and (np.abs(lse - ref_lse) <= tol_l).all(), ptx


@pytest.mark.skipif(not GPU, reason="inline PTX runs on a CUDA device only (the interpreter takes the portable path)")
@pytest.mark.parametrize("bf16", [True, False], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("rows,cols,warps", [(32, 16, 1), (32, 16, 2), (32, 32, 4)])
def test_e2m1_quads_ptx_equals_the_portable_one(bf16, rows, cols, warps):
    """The value-word unpacking (``_e2m1_quads``) by inline PTX gives the portable route's bits for every one of the
    65,536 16-bit words, as float16 E2M1 * 2**-14 and as bfloat16 E2M1, in the tile shapes and warps the decode
    kernel uses."""
    if getattr(torch.version, "hip", None):
        pytest.skip("CUDA only")
    import triton
    import triton.language as tl

    from kvqref.kernels.decode import _e2m1_quads

    @triton.jit
    def quads(W, O, PTX: tl.constexpr, BF16: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
        at = (tl.program_id(0) * R + tl.arange(0, R)[:, None]) * C + tl.arange(0, C)[None, :]
        a, b, c, d = _e2m1_quads(tl.load(W + at), PTX, BF16)
        tl.store(O + at * 4, a.to(tl.float32))
        tl.store(O + at * 4 + 1, b.to(tl.float32))
        tl.store(O + at * 4 + 2, c.to(tl.float32))
        tl.store(O + at * 4 + 3, d.to(tl.float32))

    words = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).to(DEVICE)
    got = []
    for ptx in (True, False):
        out = torch.full((4 * 65536,), float("nan"), dtype=torch.float32, device=DEVICE)
        quads[(65536 // (rows * cols),)](words, out, PTX=ptx, BF16=bf16, R=rows, C=cols, num_warps=warps)
        got.append(out.cpu().numpy().view(np.int32))
    assert np.array_equal(got[0], got[1])
    nib = (np.arange(-32768, 32768)[:, None] >> (4 * np.arange(4))[None, :]) & 15  # channel 4c + k: nibble k
    e2m1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    np.float32)  # code s e1 e0 m (the definition), -0.0 for code 8
    want = e2m1[nib].reshape(-1) * np.float32(1.0 if bf16 else 2.0**-14)
    assert np.array_equal(got[1], want.view(np.int32))  # as bits: signed zeros included


@pytest.mark.skipif(not GPU, reason="inline PTX runs on a CUDA device only (the interpreter takes the portable path)")
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("f16", [True, False], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("rows,cols,warps", [(128, 16, 4), (32, 16, 1)])
def test_int_word_phases_ptx_equals_the_portable_one(bits, f16, rows, cols, warps):
    """The KIVI code-word unpacking (``_int_word_phases``) by inline PTX gives the portable route's bits and the
    codes themselves (code p at bit p * bits, exact in float16 and bfloat16) for 2**20 words: every 16-bit word
    (2-bit codes), random and all-ones / all-zeros / one-hot 32-bit words (4-bit codes)."""
    if getattr(torch.version, "hip", None):
        pytest.skip("CUDA only")
    import triton
    import triton.language as tl

    from kvqref.kernels.decode import _int_word_phases

    @triton.jit
    def phases(W, O, PTX: tl.constexpr, BITS: tl.constexpr, F16: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
        at = (tl.program_id(0) * R + tl.arange(0, R)[:, None]) * C + tl.arange(0, C)[None, :]
        c0, c1, c2, c3, c4, c5, c6, c7 = _int_word_phases(tl.load(W + at), BITS, F16, PTX)
        tl.store(O + at * 8, c0.to(tl.float32))
        tl.store(O + at * 8 + 1, c1.to(tl.float32))
        tl.store(O + at * 8 + 2, c2.to(tl.float32))
        tl.store(O + at * 8 + 3, c3.to(tl.float32))
        tl.store(O + at * 8 + 4, c4.to(tl.float32))
        tl.store(O + at * 8 + 5, c5.to(tl.float32))
        tl.store(O + at * 8 + 6, c6.to(tl.float32))
        tl.store(O + at * 8 + 7, c7.to(tl.float32))

    n = 1 << 20
    if bits == 2:
        w = np.resize(np.arange(-32768, 32768, dtype=np.int16), n)
    else:
        w = np.random.default_rng(5).integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)
        w[:34] = [0, -1] + [np.int32(np.uint32(1 << k).astype(np.int32)) for k in range(32)]
    words = torch.from_numpy(w).to(DEVICE)
    got = []
    for ptx in (True, False):
        out = torch.full((8 * n,), float("nan"), dtype=torch.float32, device=DEVICE)
        phases[(n // (rows * cols),)](words, out, PTX=ptx, BITS=bits, F16=f16, R=rows, C=cols, num_warps=warps)
        got.append(out.cpu().numpy())
    assert np.array_equal(got[0].view(np.int32), got[1].view(np.int32))
    u = w.astype(np.int64) & ((1 << (8 * w.itemsize)) - 1)
    want = (u[:, None] >> (bits * np.arange(8))[None, :]) & ((1 << bits) - 1)
    assert np.array_equal(got[0], want.reshape(-1).astype(np.float32))


@pytest.mark.skipif(not GPU, reason="inline PTX runs on a CUDA device only (the interpreter takes the portable path)")
@pytest.mark.parametrize("pair", [PAIRS[5], PAIRS[6]], ids=[IDS[5], IDS[6]])
def test_bf16_e8m0_tiles_are_exact_at_extreme_scale_codes(pair):
    """Fast-mode E8M0 tiles built in bfloat16 (PTX unpacking, power-of-two multiplies), by block rows and per
    element, equal the float32 route bit for bit where bfloat16 subnormals and large exponents occur: block scale
    codes 0, 1, 2 (E2M1 x 2**-127 ... : bfloat16 subnormal products) and 150 planted in K and V."""
    if getattr(torch.version, "hip", None):
        pytest.skip("CUDA only")
    rng = np.random.default_rng(23)
    cache, _ = build_cache(pair, BIG, rng)
    for side in (cache.k, cache.v):
        if side.scheme.name not in ("fp4_e2m1", "mxfp4"):  # E8M0 block scales only
            continue
        sc = side.storage["scales"]
        flat = sc.reshape(-1)
        idx = rng.choice(flat.size, size=min(flat.size, 4000), replace=False)
        flat[idx] = rng.choice(np.array([0, 1, 2, 150], dtype=flat.dtype), size=idx.size)
    q = torch.from_numpy(rng.standard_normal((BIG["batch"], BIG["q_heads"], BIG["head_dim"])).astype(np.float32))
    for blk in (None, False):  # block rows (the default here), and the per-element tiles (``_mx_tile_bf16``)
        cfg = dict(precision="fast", block_n=64, num_warps=2, num_stages=3, value_words=False,  # bytes: same order
                   block_rows=blk)
        out_int, lse_int, _ = _run_decode(cache, q, ptx_unpack=False, **cfg)
        out_ptx, lse_ptx, _ = _run_decode(cache, q, ptx_unpack=True, **cfg)
        assert np.isfinite(out_int).all()
        assert np.array_equal(out_ptx, out_int) and np.array_equal(lse_ptx, lse_int), blk
    ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q.numpy().astype(np.float64), "fast", "float32")
    for ptx in (True, False):  # the default launch (value words by channel halves for fp4_e2m1), each route
        out, lse, _ = _run_decode(cache, q, ptx_unpack=ptx)
        assert (np.abs(out - ref_out) <= tol_o).all() and (np.abs(lse - ref_lse) <= tol_l).all(), ptx


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")  # (the NaN rows' merge)
@pytest.mark.parametrize("code", [0, 255])
@pytest.mark.parametrize("pair", [PAIRS[5], PAIRS[6]], ids=[IDS[5], IDS[6]])
def test_e8m0_block_rows_at_the_rare_scale_codes(pair, code):
    """E8M0 scale codes no quantization writes but a cache may hold: a planted code 0 (2**-127) in one K and one V
    block of one token keeps the oracle's result within the bound in fast FP4 (block rows and per element); a
    planted 255 (NaN: the oracle refuses such a cache) gives NaN in exactly the query heads of that sequence and KV
    head, and finite outputs elsewhere (no silent number)."""
    rng = np.random.default_rng(24)
    cache, _ = build_cache(pair, SMALL, rng)
    b, kvh = 2, 1
    page, off = divmod(int(cache.slot_mapping(b, 7, 1)[0]), cache.page_size)
    for side in (cache.k, cache.v):
        if side.scheme.name in ("fp4_e2m1", "mxfp4"):
            side.storage["scales"][page, off, kvh, 0] = code
    q = torch.from_numpy(rng.standard_normal((3, 4, 64)).astype(np.float32))
    for blk in (None, False):  # block rows (the default here), and the per-element tiles
        out, lse, dc = _run_decode(cache, q, precision="fast", block_rows=blk)
        if code == 255:
            with pytest.raises(ValueError, match="NaN"):
                _oracle(cache, q.numpy().astype(np.float64), "fast", "float32")
            want = np.zeros(out.shape[:2], dtype=bool)
            want[b, 2 * kvh: 2 * kvh + 2] = True  # 4 query heads over 2 KV heads
            assert np.array_equal(np.isnan(out).any(-1), want) and np.array_equal(np.isnan(out).all(-1), want), blk
            assert np.isfinite(out[~want]).all()
            continue
        ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q.numpy().astype(np.float64), "fast", "float32")
        assert (np.abs(out - ref_out) <= tol_o).all() and (np.abs(lse - ref_lse) <= tol_l).all(), blk


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")  # (the NaN rows' merge)
@pytest.mark.filterwarnings("ignore:invalid value encountered in m:RuntimeWarning")  # (code 255's NaN, interpreter)
@pytest.mark.parametrize("plant", ["0", "255", "255-key"])
@pytest.mark.parametrize("pair", [PAIRS[5], PAIRS[6]], ids=[IDS[5], IDS[6]])
def test_e8m0_tile_check_takes_the_rule_for_codes_0_and_255(pair, plant):
    """``e8m0_tile_check`` (fast FP4 block rows read as bare exponent fields, then the split again with the rule for
    codes 0 and 255 where a tile held one): the same bits as the launch without it on a cache with every code in
    1 .. 254, and with a planted code in sequence 2's KV head 1: ``0`` / ``255`` in every V block and in one K block
    of one token; code 0 (2**-127) must then give nonzero outputs in those query heads (the bare field would give
    +0.0 there), code 255 NaN in them. ``255-key``: 255 only in that K block, whose codes are all -1.0 against a q
    of +1.0 there, so the block's partial dot is negative: the bare field (+inf) would give the token a score of
    -inf and drop it (finite outputs), the oracle's NaN scale gives NaN."""
    rng = np.random.default_rng(25)
    cache, _ = build_cache(pair, dict(SMALL, head_dim=128), rng)  # (4 or 8 blocks a token: scale words)
    q = torch.from_numpy(rng.standard_normal((3, 4, 128)).astype(np.float32))
    b, kvh, t_k = 2, 1, 7
    heads = slice(2 * kvh, 2 * kvh + 2)  # 4 query heads over 2 KV heads
    q[b, heads, :16] = 1.0
    cfg = dict(precision="fast", wide_scale_loads=True, e8m0_values_f16=False)  # (float16 values: the next test)
    base, base_lse, _ = _run_decode(cache, q, e8m0_tile_check=False, **cfg)
    out, lse, _ = _run_decode(cache, q, e8m0_tile_check=True, **cfg)
    assert np.array_equal(out, base) and np.array_equal(lse, base_lse)
    code = 0 if plant == "0" else 255
    for t in range(int(cache.seq_lens[b])):
        page, off = divmod(int(cache.slot_mapping(b, t, 1)[0]), cache.page_size)
        if cache.v.scheme.name in ("fp4_e2m1", "mxfp4") and plant != "255-key":
            cache.v.storage["scales"][page, off, kvh] = code
        if cache.k.scheme.name in ("fp4_e2m1", "mxfp4") and t == t_k:
            cache.k.storage["scales"][page, off, kvh, 0] = code
            if plant == "255-key":
                cache.k.storage["codes"][page, off, kvh, :8] = 0xAA  # E2M1 -1.0 in channels 0 .. 15
    base, base_lse, _ = _run_decode(cache, q, e8m0_tile_check=False, **cfg)
    out, lse, _ = _run_decode(cache, q, e8m0_tile_check=True, **cfg)
    assert np.array_equal(out, base, equal_nan=True) and np.array_equal(lse, base_lse, equal_nan=True)
    if code == 255:
        assert np.isnan(out[b, heads]).all() and np.isfinite(np.delete(out, b, axis=0)).all()
    elif cache.v.scheme.name in ("fp4_e2m1", "mxfp4"):
        assert (out[b, heads] != 0).any() and np.isfinite(out).all()


@triton.jit
def _e8m0_word_fields_one_bit_off(w, NB: tl.constexpr, FIRST: tl.constexpr):
    """A planted bug: ``decode._e8m0_word_fields`` shifting each byte one bit too far (8 j + 8)."""
    x = w if FIRST >= 4 else w.to(tl.int64) << 32
    j = tl.arange(0, NB).to(tl.int64) + FIRST % 4
    return ((x[None, :] >> (8 * j + 8)[:, None]).to(tl.int32) & 0x7F800000).to(tl.float32, bitcast=True)


E8F_CASES = [  # (pair, q heads over 2 KV heads): each product's blocks in one 32-bit half of the scale word
    (PAIRS[5], 8),  # fp4_e2m1 both sides, 8 blocks by channel halves (32 rows): 4 + 4
    (("mxfp4", {}, "mxfp4", {}), 4),  # both sides, 4 blocks
    (("mxfp4", {}, "mxfp4", {}), 16),  # both sides, 4 blocks by channel halves (32 rows): 2 + 2
    (PAIRS[6], 4),  # mxfp4 keys (4 blocks); NVFP4 values keep their codes
]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # (the planted bug's scales, interpreter)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("case", E8F_CASES, ids=["fp4_e2m1-halves", "mxfp4", "mxfp4-halves", "mxfp4/nvfp4"])
def test_e8m0_scale_fields_equal_the_bare_codes(case, layout, monkeypatch):
    """``e8m0_scale_fields`` (with the E8M0 tile check, each E8M0 side's scales as float32 exponent fields made
    straight from the scale words, ``decode._e8m0_word_fields``): the default where it applies, the same bits as
    the codes' bare rule (``e8m0_scale_fields=False``) on a cache whose every E8M0 scale code is redrawn in
    124 .. 135 (inside the float16 values' window, so no split reruns: each block's byte differs from its
    neighbours'), both layouts. In the interpreter a planted one-bit-off shift changes the output (the fields ran).
    Refused without the tile check."""
    from kvqref.kernels import decode as dec

    pair, q_heads = case
    rng = np.random.default_rng(44)
    cache, _ = build_cache(pair, dict(SMALL, q_heads=q_heads, head_dim=128), rng)
    for side in (cache.k, cache.v):
        if side.scheme.name in ("fp4_e2m1", "mxfp4"):
            sc = side.storage["scales"]
            sc[...] = rng.integers(124, 136, sc.shape, dtype=np.uint8)
    q = torch.from_numpy(rng.standard_normal((3, q_heads, 128)).astype(np.float32)).to(torch.bfloat16)
    cfg = dict(precision="fast", block_rows=True, wide_scale_loads=True, e8m0_tile_check=True)
    dc = tb.DeviceCache.from_cache(cache, DEVICE).with_layout(layout)
    split = split_launch_of(plan_for_cache(q.to(DEVICE), dc, **cfg)[0])
    assert split.constexprs["E8F_K"] and split.constexprs["E8M0_CHECK"]  # (every case's keys are E8M0)
    assert split.constexprs["E8F_V"] is (pair[2] in ("fp4_e2m1", "mxfp4"))
    (base, base_lse), (out, lse) = _decode_without_and_with(dc, q, cfg, "e8m0_scale_fields", "E8F_K")
    assert np.array_equal(out, base) and np.array_equal(lse, base_lse)
    if not GPU:  # (a compiled kernel would keep its cached dependency)
        monkeypatch.setattr(dec, "_e8m0_word_fields", _e8m0_word_fields_one_bit_off)
        bad, bad_lse = tb.decode(q.to(DEVICE), dc, **cfg)
        assert not np.array_equal(bad.cpu().numpy(), base)
    with pytest.raises(ValueError, match="e8m0_scale_fields needs e8m0_tile_check"):
        plan_for_cache(q.to(DEVICE), dc, precision="fast", block_rows=True, e8m0_tile_check=False,
                       e8m0_scale_fields=True)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # (``above``: the flagged pass)
@pytest.mark.parametrize("plant", ["none", "below", "window", "above", "mc143", "mc240", "mc13", "mc241"])
@pytest.mark.parametrize("pair", [PAIRS[5], ("nvfp4", {}, "mxfp4", {})], ids=[IDS[5], "nvfp4/mxfp4"])
def test_e8m0_values_f16_within_its_window(pair, plant):
    """``e8m0_values_f16`` (E8M0 value products in float16 against the split's reference code mc, its first tile's
    largest value scale code + 4, with ``e8m0_tile_check``): within the oracle's bound (a_p = 2**-23 for the float16
    subnormal step), not the bfloat16 route's bits (so the float16 route ran), and a code step at the most attended
    token's largest value element fails the bound. Sequence 2 (70 tokens, one split, its last tile partial at the
    plan's tile of 64 or fewer tokens) with a value scale code planted in block 0 of KV head 1: ``below`` mc - 17 at
    token 5, ``above`` mc + 1 at token 66 (a later tile): the split reruns the bfloat16 way, the same bits as without
    the option; ``window`` mc - 16 at token 5 and mc at token 66: no rerun. Every code of the sequence shifted so that
    mc is 143 (p * 2**(142 - mc) below p) or 240: no rerun; 13 or 241 (outside 16 .. 240, where p * 2**(142 - mc)
    could overflow or lose bits in float32's underflow): the split reruns."""
    rng = np.random.default_rng(31)
    cache, _ = build_cache(pair, dict(SMALL, head_dim=128), rng)  # (4 or 8 blocks a token: scale words)
    q = torch.from_numpy(rng.standard_normal((3, 4, 128)).astype(np.float32))
    b, kvh = 2, 1
    heads = slice(2 * kvh, 2 * kvh + 2)  # 4 query heads over 2 KV heads
    slots = [divmod(int(cache.slot_mapping(b, t, 1)[0]), cache.page_size) for t in range(int(cache.seq_lens[b]))]
    sc = cache.v.storage["scales"]
    cfg = dict(precision="fast", wide_scale_loads=True, e8m0_tile_check=True, num_splits=1)
    bn = split_launch_of(plan_for_cache(q.to(DEVICE), tb.DeviceCache.from_cache(cache, DEVICE), **cfg)[0])
    bn = bn.constexprs["BLOCK_N"]  # the tile: mc is its first one's largest code + 4
    assert bn <= 64 and int(cache.seq_lens[b]) % bn
    if plant.startswith("mc"):
        shift = int(plant[2:]) - 4 - max(int(sc[pg, off, kvh].max()) for pg, off in slots[:bn])
        for pg, off in slots:
            sc[pg, off, kvh] = np.clip(sc[pg, off, kvh].astype(np.int32) + shift, 1, 254)
    mc = max(int(sc[pg, off, kvh].max()) for pg, off in slots[:bn]) + 4
    if plant in ("below", "window"):
        sc[slots[5][0], slots[5][1], kvh, 0] = mc - (17 if plant == "below" else 16)
    if plant in ("above", "window"):
        sc[slots[66][0], slots[66][1], kvh, 0] = mc + (1 if plant == "above" else 0)
    base, base_lse, _ = _run_decode(cache, q, e8m0_values_f16=False, **cfg)
    out, lse, _ = _run_decode(cache, q, e8m0_values_f16=True, **cfg)
    ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q.numpy().astype(np.float64), "fast", "float32")
    assert (np.abs(out - ref_out) <= tol_o).all() and (np.abs(lse - ref_lse) <= tol_l).all()
    assert np.array_equal(lse, base_lse)  # (the scores do not change)
    assert np.array_equal(out[b, heads], base[b, heads]) == (plant in ("below", "above", "mc13", "mc241")), plant
    if plant == "none":  # planted: one code step (the lowest bit) at the most attended token's largest value element
        K, V = cache.dequantized(b)
        q64 = q.numpy().astype(np.float64)
        tt = int(np.argmax(K[:, kvh, :] @ q64[b, 2 * kvh]))
        d = int(np.argmax(np.abs(V[tt, kvh, :])))
        page, off = slots[tt]
        cache.v.storage["codes"][page, off, kvh, d // 2] ^= np.uint8(1 << (4 * (d % 2)))
        out, _, _ = _run_decode(cache, q, e8m0_values_f16=True, **cfg)
        assert (np.abs(out - ref_out) > tol_o).any()


@pytest.mark.parametrize("precision", ["fast", "exact"])
def test_tolerance_catches_a_planted_scale_exponent_off_by_one(precision):
    """An E8M0 block scale one power of two too large, in one block of one token: must fail the check."""
    rng = np.random.default_rng(7)
    pair = PAIRS[5]
    cache, _ = build_cache(pair, SMALL, rng)
    q = torch.from_numpy(rng.standard_normal((3, 4, 64)).astype(np.float32))
    q64 = q.numpy().astype(np.float64)
    ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q64, precision, "float32")
    b = 2
    K, _ = cache.dequantized(b)
    top = int(np.argmax(K[:, 0, :] @ q64[b, 0]))  # the token query head 0 attends to most
    page, off = divmod(int(cache.slot_mapping(b, top, 1)[0]), cache.page_size)
    cache.v.storage["scales"][page, off, 0, 1] += 1  # planted: one V block scale of that token, exponent + 1
    out, lse, _ = _run_decode(cache, q, precision=precision)
    assert (np.abs(out - ref_out) > tol_o).any()
    cache.v.storage["scales"][page, off, 0, 1] -= 1
    out, lse, _ = _run_decode(cache, q, precision=precision)
    assert (np.abs(out - ref_out) <= tol_o).all()  # restored: passes again
    cache.k.storage["scales"][page, off, 0, 2] += 1  # planted: one K block scale: changes the logits
    out, lse, _ = _run_decode(cache, q, precision=precision)
    assert (np.abs(lse - ref_lse) > tol_l).any()


@pytest.mark.parametrize("pair_index", [1, 5, 6, 7, 8, 9], ids=[IDS[i] for i in (1, 5, 6, 7, 8, 9)])
def test_fast_tolerance_catches_one_code_step(pair_index):
    """Fast mode's bound is tight enough to see one stored code off by one step (its lowest bit flipped:
    one FP8 ulp, the neighbouring E2M1 value, an integer code +-1) at the largest element of the token the
    first query head attends to most; the same run without the plant passes."""
    rng = np.random.default_rng(13)
    cache, _ = build_cache(PAIRS[pair_index], SMALL, rng)
    q = torch.from_numpy(rng.standard_normal((3, 4, 64)).astype(np.float32)).to(torch.bfloat16)
    q64 = q.float().numpy().astype(np.float64)
    ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q64, "fast")
    out, _, _ = _run_decode(cache, q, precision="fast")
    assert (np.abs(out - ref_out) <= tol_o).all()
    b = 2
    K, V = cache.dequantized(b)
    n = int(cache.v.paged[b])
    top = int(np.argmax(K[:n, 0, :] @ q64[b, 0]))
    d = int(np.argmax(np.abs(V[top, 0, :])))
    page, off = divmod(int(cache.slot_mapping(b, top, 1)[0]), cache.page_size)
    vs = cache.v.scheme
    bits = vs.bits if isinstance(vs, schemes.KiviScheme) else (8 if isinstance(vs, schemes.FP8Scheme) else 4)
    byte, shift = divmod(d * bits, 8)
    cache.v.storage["codes"][page, off, 0, byte] ^= np.uint8(1 << shift)  # planted: one code step
    out, _, _ = _run_decode(cache, q, precision="fast")
    assert (np.abs(out - ref_out) > tol_o).any()


@pytest.mark.parametrize("precision", ["fast", "exact"])
@pytest.mark.parametrize("pair", [PAIRS[5], PAIRS[6], ("nvfp4", {}, "nvfp4", {})],
                         ids=[IDS[5], IDS[6], "nvfp4/nvfp4"])
def test_fp4_keys_by_token(pair, precision):
    """``fp4_keys_by_token``: FP4 key tiles with tokens as rows (scores computed transposed) meet the oracle's
    bound as the default layout does, in both precisions; fast mode still sees one value code step; other
    key kinds refuse the option."""
    rng = np.random.default_rng(17)
    cache, _ = build_cache(pair, SMALL, rng)
    q = torch.from_numpy(rng.standard_normal((3, 4, 64)).astype(np.float32)).to(torch.bfloat16)
    q64 = q.float().numpy().astype(np.float64)
    ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q64, precision)
    for by_token in (False, True):
        out, lse, _ = _run_decode(cache, q, precision=precision, fp4_keys_by_token=by_token)
        assert (np.abs(out - ref_out) <= tol_o).all(), by_token
        assert (np.abs(lse - ref_lse) <= tol_l).all(), by_token
    if precision == "fast":  # planted: the lowest bit of the largest value code of the most attended token
        b = 2
        K, V = cache.dequantized(b)
        top = int(np.argmax(K[: int(cache.v.paged[b]), 0, :] @ q64[b, 0]))
        d = int(np.argmax(np.abs(V[top, 0, :])))
        page, off = divmod(int(cache.slot_mapping(b, top, 1)[0]), cache.page_size)
        cache.v.storage["codes"][page, off, 0, d // 2] ^= np.uint8(1 << (4 * (d % 2)))
        out, _, _ = _run_decode(cache, q, precision="fast", fp4_keys_by_token=True)
        assert (np.abs(out - ref_out) > tol_o).any()
    with pytest.raises(ValueError, match="fp4_keys_by_token"):
        _run_decode(build_cache(PAIRS[1], SMALL, rng)[0], q, fp4_keys_by_token=True)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_mxfp4_two_warp_rows_take_the_e8m0_check_at_168_registers(layout, monkeypatch):
    """Planned as on an NVIDIA GPU (``_nvidia_cuda`` patched): mxfp4's two-warp block rows (E8M0
    blocks of 32 on both sides, 4 query heads per KV head) take the E8M0 tile check with float16 value products at
    E8M0_TWO_WARP_MAXNREG (168) registers, and their split count follows the 6 programs per multiprocessor that cap
    allows (session 41, H100: batch 32 x 8,192 head-major 143.9 -> 137.6 us at 3 splits); the check asked off gives
    back TWO_WARP_MAXNREG (128); fp4_e2m1's two-warp rows (1 query head per KV head; blocks of 16) keep 128 without
    the check (147.3 -> 151.7 us with it)."""
    from kvqref.kernels import decode as dec

    monkeypatch.setattr(dec, "_nvidia_cuda", lambda t: True)
    monkeypatch.setattr(dec, "_multiprocessors", lambda device: 4)
    rng = np.random.default_rng(41)
    for name, q_heads in (("mxfp4", 8), ("fp4_e2m1", 2)):
        cache, _ = build_cache((name, {}, name, {}), dict(SMALL, q_heads=q_heads, kv_heads=2, head_dim=128), rng)
        dc = tb.DeviceCache.from_cache(cache, DEVICE).with_layout(layout)
        q = torch.zeros(SMALL["batch"], q_heads, 128, dtype=torch.bfloat16, device=DEVICE)
        split = split_launch_of(plan_for_cache(q, dc, max_seq_len=8192, hw_formats=())[0])
        assert split.constexprs["BLK"] and split.options["num_warps"] == 2 and split.constexprs["BLOCK_N"] == 64
        mx = name == "mxfp4"
        assert split.constexprs["E8M0_CHECK"] is mx and split.constexprs["EV16"] is mx, name
        assert split.options["maxnreg"] == (dec.E8M0_TWO_WARP_MAXNREG if mx else dec.TWO_WARP_MAXNREG), name
        if mx:
            assert dec.E8M0_TWO_WARP_MAXNREG == 168 and dec.two_warp_resident(168) == 6
            off = split_launch_of(plan_for_cache(q, dc, max_seq_len=8192, hw_formats=(), e8m0_tile_check=False)[0])
            assert not off.constexprs["E8M0_CHECK"] and off.options["maxnreg"] == dec.TWO_WARP_MAXNREG
            # the split counts of 6 and 8 resident programs on 4 multiprocessors (as a CPU plans; patched on a GPU,
            # where 132 of them give this small batch the most splits either way)
            fill = {r: dec.choose_splits(SMALL["batch"], 2, 8192, 64, 4, r)[0] for r in (6, 8)}
            want = {r: min(dec.choose_splits(SMALL["batch"], 2, 8192, 64, 4)[0], fill[r]) for r in (6, 8)}
            assert (split.grid[2], off.grid[2]) == (want[6], want[8]) and want[6] != want[8], want

BLOCK_ROW_SHAPES = [  # (q_heads, kv_heads, head_dim): rows (head_dim / block) x heads per KV head, padded to 16
    (4, 2, 64), (2, 2, 128), (16, 2, 64), (8, 1, 128)]
BLOCK_ROW_PAIRS = [PAIRS[9], PAIRS[5], PAIRS[6], ("mxfp4", {}, "mxfp4", {})]


@pytest.mark.parametrize("pair", BLOCK_ROW_PAIRS, ids=["nvfp4", "fp4_e2m1", "mxfp4/nvfp4", "mxfp4"])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", BLOCK_ROW_SHAPES)
def test_fp4_block_rows(pair, q_heads, kv_heads, head_dim):
    """Fast FP4 by block rows (per-block partial dots, block scales on the score and probability rows; NVFP4 and
    E8M0 tiles, either side) meets the oracle's bound with and without the layout; it is the default where the
    rows fit 32; a planted K block scale (exponent + 1) moves the lse and a planted V block scale the output beyond
    the bound, by channel halves and in one product; other schemes and exact mode refuse it."""
    rng = np.random.default_rng(q_heads * 131 + head_dim)
    shape = dict(SMALL, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim)
    cache, _ = build_cache(pair, shape, rng)
    q = torch.from_numpy(rng.standard_normal((3, q_heads, head_dim)).astype(np.float32)).to(torch.bfloat16)
    q64 = q.float().numpy().astype(np.float64)
    ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q64, "fast")
    dc = tb.DeviceCache.from_cache(cache, DEVICE)
    launches, _, _ = plan_for_cache(q.to(DEVICE), dc)
    blocks = [head_dim // t.block for t in (dc.k.tiles(), dc.v.tiles())]
    rows = max(blocks) * max(triton.next_power_of_2(q_heads // kv_heads), 16 // min(blocks))
    split = next(launch for launch in launches if "BLK" in launch.constexprs)
    assert split.constexprs["BLK"] is (rows <= 32)
    v_rows = blocks[1] * max(triton.next_power_of_2(q_heads // kv_heads), 16 // min(blocks))
    k_rows = blocks[0] * max(triton.next_power_of_2(q_heads // kv_heads), 16 // min(blocks))
    # channel halves: a side of >= 32 rows (an even number of blocks)
    halves = (k_rows >= 32 and blocks[0] % 2 == 0, v_rows >= 32 and blocks[1] % 2 == 0)
    # value words: where the value rows are fewer than D / 4 or split into halves (at most 32 value rows)
    words = rows <= 32 and (v_rows < head_dim // 4 or halves[1])
    if rows <= 32:
        assert (split.constexprs["HALF_K"], split.constexprs["HALF_V"]) == halves
        # the measured launch: value words by halves 32-token tiles / 1 warp (session 12; 3 stages for E8M0 blocks
        # of 16 on both sides, session 25, and with their page ids read ahead at page size 1 too, and for NVFP4 with
        # its page ids read ahead in pages of more than one token, session 32), else 16 rows per product 64-token
        # tiles / 2 warps (3 stages for E8M0 pairs without channel halves, session 32), 32 rows 128 / 4 (ANALYSIS.md,
        # sessions 8 and 11)
        prod = max(k_rows // (1 + halves[0]), v_rows // (1 + halves[1]))
        sides = (dc.k.tiles(), dc.v.tiles())
        e8m0_16 = all(t.kind == "mxfp4" and t.block == 16 for t in sides)  # (page ids ahead at page size 1 too)
        nvfp4_ahead = all(t.kind == "nvfp4" for t in sides) and dc.page_size > 1
        mx_rows = all(t.kind == "mxfp4" for t in sides) and not any(halves)
        want = ((32, 1, 3 if e8m0_16 or nvfp4_ahead else 2) if words and halves[1] else
                (64, 2, 3 if mx_rows else 2) if prod <= 16 else (128, 4, 2))
        assert (split.constexprs["BLOCK_N"], split.options["num_warps"], split.options["num_stages"]) == want
    assert split.constexprs["VW"] is words  # value words: the measured default
    if rows > 32 and pair[0] == pair[2] == "nvfp4" and not getattr(torch.version, "hip", None):
        # NVFP4 per element, unpacked by PTX: 128-token tiles, 2 warps, 2 stages (the measured launch, ANALYSIS.md
        # session 27; planned for CUDA on any machine)
        launches, _, _ = plan_for_cache(q.to(DEVICE), dc, ptx_unpack=True)
        split_ptx = next(launch for launch in launches if "BLK" in launch.constexprs)
        assert not split_ptx.constexprs["BLK"] and split_ptx.constexprs["PTX"]
        assert (split_ptx.constexprs["BLOCK_N"], split_ptx.options["num_warps"], split_ptx.options["num_stages"]) == (
            128, 2, 2)
    # the E8M0 tile check: by default with value words by channel halves, and (session 41) for mxfp4's block rows
    # without channel halves (E8M0 blocks of 32 on both sides), where every E8M0 side's scales are words; the float16
    # value products wherever it is on with E8M0 values
    e8m0 = [split.constexprs[w] for t, w in ((dc.k.tiles(), "WSC_K"), (dc.v.tiles(), "WSC_V")) if t.kind == "mxfp4"]
    sides = (dc.k.tiles(), dc.v.tiles())
    mx32_rows = all(t.kind == "mxfp4" and t.block == 32 for t in sides) and not any(halves)
    want_check = rows <= 32 and (words and halves[1] or mx32_rows) and bool(e8m0) and all(e8m0)
    assert split.constexprs["E8M0_CHECK"] is want_check, (pair[0], q_heads, head_dim)
    assert split.constexprs["EV16"] is (want_check and dc.v.tiles().kind == "mxfp4"), (pair[0], q_heads, head_dim)
    if v_rows > 32:
        with pytest.raises(ValueError, match="at most 32 value rows"):
            _run_decode(cache, q, block_rows=True, value_words=True)
    # value tiles as bytes / 16-bit words, by channel halves where they apply or in one product
    for blk, words, ch in ((True, False, None), (True, v_rows <= 32, None), (True, False, False),
                           (True, v_rows <= 32, False), (False, None, None)):
        out, lse, _ = _run_decode(cache, q, block_rows=blk, value_words=words, channel_halves=ch)
        assert (np.abs(out - ref_out) <= tol_o).all(), (blk, words, ch, np.abs(out - ref_out).max())
        assert (np.abs(lse - ref_lse) <= tol_l).all(), (blk, words, ch, np.abs(lse - ref_lse).max())
    # the key products transposed (``key_products_transposed``): the default for two-warp block rows (64-token
    # tiles) and NVFP4 keys' one-warp value words by channel halves (session 42), not for E8M0 keys' value words by
    # halves nor 4-warp rows; the loop above ran the default, this one the other setting, by halves or in one product
    tile = (split.constexprs["BLOCK_N"], split.options["num_warps"])
    two_warp = split.constexprs["BLK"] and tile == (64, 2)
    nvfp4_halves = split.constexprs["BLK"] and tile == (32, 1) and dc.k.tiles().kind == "nvfp4"
    assert split.constexprs["KPT"] is (two_warp or nvfp4_halves), (pair[0], q_heads, head_dim)
    kpt_other = not split_launch_of(plan_for_cache(q.to(DEVICE), dc, block_rows=True)[0]).constexprs["KPT"]
    for ch in (None, False):
        out, lse, _ = _run_decode(cache, q, block_rows=True, channel_halves=ch, key_products_transposed=kpt_other)
        assert (np.abs(out - ref_out) <= tol_o).all() and (np.abs(lse - ref_lse) <= tol_l).all(), (ch, kpt_other)
    # q's block rows read transposed for E8M0 value words by halves without transposed keys, contiguously for NVFP4
    # keys' value words by halves in pages of more than one token, at a stride of 2 elsewhere (``q_rows_load``,
    # sessions 43-44); the same values, so the other two loads meet the same bound
    qld = {0: "strided", 1: "transposed", 2: "contiguous"}[split.constexprs["QLD"]]
    words_halves = split.constexprs["BLK"] and split.constexprs["VW"] and split.constexprs["HALF_V"]
    nvfp4_words_halves = words_halves and dc.k.tiles().kind == "nvfp4" and dc.page_size > 1
    e8m0_words_halves = words_halves and not split.constexprs["KPT"]
    assert qld == ("contiguous" if nvfp4_words_halves else "transposed" if e8m0_words_halves else "strided"), qld
    for other in {"strided", "transposed", "contiguous"} - {qld}:
        out, lse, _ = _run_decode(cache, q, block_rows=True, q_rows_load=other)
        assert (np.abs(out - ref_out) <= tol_o).all() and (np.abs(lse - ref_lse) <= tol_l).all(), other
    b = 2
    K, _ = cache.dequantized(b)
    top = int(np.argmax(K[:, 0, :] @ q64[b, 0]))
    page, off = divmod(int(cache.slot_mapping(b, top, 1)[0]), cache.page_size)
    for side, check in (("v", lambda o, lse_: (np.abs(o - ref_out) > tol_o).any()),
                        ("k", lambda o, lse_: (np.abs(lse_ - ref_lse) > tol_l).any())):
        e4m3 = isinstance(getattr(cache, side).scheme, schemes.NVFP4Scheme)
        step, top_code = (8, 0x7E) if e4m3 else (1, 0xFE)  # exponent + 1; the largest finite code (E4M3 0x7F: NaN)
        scales = getattr(cache, side).storage["scales"]
        codes = scales[page, off, 0].astype(np.int64)  # the token's largest block scale that stays finite
        blk_ = int(np.argmax(np.where(codes + step <= top_code, codes, -1)))
        scales[page, off, 0, blk_] += step
        for words, ch in ((False, None), (v_rows <= 32, None), (False, False), (v_rows <= 32, False)):
            out, lse, _ = _run_decode(cache, q, block_rows=True, value_words=words, channel_halves=ch)
            assert check(out, lse), (side, words, ch)
        out, lse, _ = _run_decode(cache, q, block_rows=True, key_products_transposed=kpt_other)  # (the loop above:
        assert check(out, lse), (side, "key_products_transposed", kpt_other)  # the default)
        scales[page, off, 0, blk_] -= step
    with pytest.raises(ValueError, match="block_rows"):
        _run_decode(cache, q, block_rows=True, precision="exact")
    with pytest.raises(ValueError, match="block_rows"):
        _run_decode(build_cache(PAIRS[1], SMALL, rng)[0], q[:, :4, :64], block_rows=True)
    with pytest.raises(ValueError, match="value_words needs block_rows"):
        _run_decode(cache, q, block_rows=False, value_words=True)
    with pytest.raises(ValueError, match="channel_halves needs block_rows"):
        _run_decode(cache, q, block_rows=False, channel_halves=True)
    with pytest.raises(ValueError, match="key_products_transposed needs block_rows"):
        _run_decode(cache, q, block_rows=False, key_products_transposed=True)
    if rows <= 32 and not halves[0] and not (v_rows >= 32 and blocks[1] % 2 == 0):  # no side could split
        with pytest.raises(ValueError, match="channel_halves needs a side of >= 32 block rows"):
            _run_decode(cache, q, block_rows=True, channel_halves=True)


@pytest.mark.parametrize("page_size,want", [(16, (128, 4, 2)), (1, (64, 2, 2))])
def test_fp4_halves_tiles_by_page_size(page_size, want):
    """FP4 by channel halves (4 query heads per KV head, D 128: 32 rows per side) reads its value tiles as words by
    default, in 32-token tiles with one warp at every page size (H100, session 12: fp4_e2m1 261 -> 235 us at page 16,
    294 -> 248 at page 1; NVFP4 194 -> 183), fp4_e2m1 with 3 stages in pages of 16 (session 25: 170.3 -> 167.2 us; at
    page 1 184.3 against 184.9, so 2 there; session 32, H200, with its page ids read ahead 3 at both: 157.5 -> 151.7 us,
    page 1 168.7 -> 160.5), NVFP4 with 3 stages and its page ids read ahead in pages of 16 (session 32, H200: 152.7 ->
    145.6 us), and since session 38 both at 2 stages without the page ids ahead in pages of 1 (H100, the KV heads on the
    grid's fastest axis there: fp4_e2m1 182.1 -> 171.4 us); with value bytes (``value_words=False``) fp4_e2m1 takes the
    tiles measured for its page size: 128 tokens / 4 warps in pages of 16 (261 us against 275 at 64 / 2), 64 / 2 in
    pages of 1 (290 us against 316; bench/results/ANALYSIS.md, session 11), and NVFP4 64 / 2 with 3 stages."""
    rng = np.random.default_rng(5)
    for pair, bytes_launch in ((PAIRS[5], want), (PAIRS[9], (64, 2, 3))):
        shape = dict(SMALL, q_heads=8, kv_heads=2, head_dim=128, page_size=page_size)
        cache, _ = build_cache(pair, shape, rng)
        dc = tb.DeviceCache.from_cache(cache, DEVICE)
        q = torch.zeros(3, 8, 128, dtype=torch.bfloat16, device=DEVICE)
        # (page ids read ahead at 3 stages in pages of more than one token: NVFP4 since session 32, fp4_e2m1 since 38)
        words_launch = (32, 1, 3 if page_size > 1 else 2)
        for words, expect in ((None, words_launch), (False, bytes_launch)):
            launches, _, _ = plan_for_cache(q, dc, value_words=words)
            split = next(launch for launch in launches if "BLK" in launch.constexprs)
            assert split.constexprs["HALF_K"] and split.constexprs["HALF_V"]
            assert split.constexprs["VW"] is (words is None)
            got = (split.constexprs["BLOCK_N"], split.options["num_warps"], split.options["num_stages"])
            assert got == expect, (pair[0], page_size, words, got)


def test_splits_and_page_size_one_agree():
    rng = np.random.default_rng(11)
    shape = dict(SMALL, page_size=1)
    cache, _ = build_cache(PAIRS[1], shape, rng)
    q = torch.from_numpy(rng.standard_normal((3, 4, 64)).astype(np.float32)).to(torch.bfloat16)
    q64 = q.float().numpy().astype(np.float64)
    ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q64)
    for splits in (1, 2, 5):
        out, lse, _ = _run_decode(cache, q, num_splits=splits, block_n=16)
        assert (np.abs(out - ref_out) <= tol_o).all(), splits
        assert (np.abs(lse - ref_lse) <= tol_l).all(), splits


WRITE_CASES = [
    ("bf16", {}), ("fp8_e4m3", {}), ("fp8_e5m2", {"granularity": "head"}),
    ("fp8_e4m3", {"granularity": "token_head"}), ("fp8_e4m3", {"profile": "rocm", "scale": 0.03}),
    ("fp8_e4m3", {"profile": "sglang", "scale": 0.3, "sglang_scale": "float"}),
    ("fp8_e5m2", {"profile": "sglang", "scale": 0.003, "saturate": True}),
    ("fp8_e5m2", {"profile": "rocm"}), ("fp8_e4m3", {"profile": "sglang", "scale": 0.004}),
    ("fp4_e2m1", {}), ("fp4_e2m1", {"profile": "sglang"}), ("mxfp4", {}), ("nvfp4", {}),
    ("int4_kivi", {"role": "value", "group_size": 32}), ("int2_kivi", {"role": "value", "group_size": 16}),
    ("int4_kivi", {"role": "key", "group_size": 16}), ("int2_kivi", {"role": "key", "group_size": 32}),
]


def _write_and_compare(name: str, opts: dict, x: np.ndarray, page_size: int, rng: np.random.Generator):
    """Quantize ``x`` [T, H, D] into a shuffled paged cache with the oracle and with the kernel; compare
    every stored byte (kvqref.conformance.triton_write_matches)."""
    ok, detail = triton_write_matches(name, opts, x, page_size, rng)
    assert ok, f"{name} {opts}: {detail}"


WRITE_IDS = [f"{n}-{'-'.join(map(str, o.values()))}" for n, o in WRITE_CASES]


@pytest.mark.parametrize("name,opts", WRITE_CASES, ids=WRITE_IDS)
def test_write_bytes_equal_oracle(name, opts):
    rng = np.random.default_rng(5)
    T = 256 if GPU else 64
    x = kv_tensor(rng, T, 2, 64, outliers=True)
    x[3, 0] = 0.0  # an all-zero token: zero blocks, constant groups
    x[7, 1, :16] = np.array([2.5, -5.0, 0.25, 0.75, 1.25, 1.75, 3.5, 5.0] * 2) * 2.0**3  # E2M1 ties
    x[9, 0, 4] = 1e-30  # deep underflow
    _write_and_compare(name, opts, x, page_size=max(16, opts.get("group_size", 1)), rng=rng)


KIVI_CASES = [c for c in WRITE_CASES if "kivi" in c[0]]


@pytest.mark.parametrize("name,opts", KIVI_CASES, ids=[f"{n}-{'-'.join(map(str, o.values()))}" for n, o in KIVI_CASES])
def test_kivi_write_of_bfloat16_signed_zeros(name, opts):
    """KIVI from bfloat16 input (the kernel's bfloat16 float16 rounding and its integer-key min/max): groups of
    -0.0 only, of both zeros, of negatives with +0.0 and of positives with -0.0 (the stored min/max follow
    -0.0 < +0.0), and bfloat16 values in float16's subnormal range (rounded to multiples of 2**-24, ties)."""
    rng = np.random.default_rng(11)
    G = opts["group_size"]
    x = _signed_zero_input(rng, G)
    ok, detail = triton_write_matches(name, {**opts, "residual": 0}, x, G, rng, dtype="bfloat16")
    assert ok, f"{name} {opts}: {detail}"


def _signed_zero_input(rng: np.random.Generator, G: int, tokens: int | None = None) -> np.ndarray:
    """bfloat16 values [tokens (default 2 G), 2, 128] for the KIVI signed-zero checks: groups / key columns of
    -0.0 only, of both zeros, negatives with +0.0, positives with -0.0, float16-subnormal-range values, and
    (keys) constant columns, whose scale is 0 and codes 0."""
    from kvqref.conformance import to_dtype_values

    x = kv_tensor(rng, tokens or 2 * G, 2, 128, outliers=False)
    n = x.shape[0]
    x[:, 0, :G] = -0.0                                   # value groups / key columns of -0.0 only
    x[:, 1, :G] = np.where(rng.random((n, G)) < 0.5, -0.0, 0.0)  # both zeros
    x[:, 0, G:2 * G] = -np.abs(x[:, 0, G:2 * G])
    x[::3, 0, G:2 * G] = 0.0                             # negatives and +0.0: the max is +0.0
    x[:, 1, G:2 * G] = np.abs(x[:, 1, G:2 * G])
    x[::3, 1, G:2 * G] = -0.0                            # positives and -0.0: the min is -0.0
    tiny = np.array([2.0**-25, 3 * 2.0**-26, 2.0**-20 + 2.0**-27, -(2.0**-24) * 1.5, 2.0**-17 * 1.25, -(2.0**-30)])
    x[5, :, 2 * G:2 * G + tiny.size] = tiny
    x[:, :, 120:124] = np.array([1.5, -3.0, 0.0, 2.0**-20])  # constant key columns (scale 0)
    # ranges of 2**-20: the scale RN16(2**-20 / MAXINT) is float16-subnormal, 2**-24 for int4 (1/16 below the exact
    # quotient), so the largest quotient rounds to 16, which min(., MAXINT) brings back to 15 (a value group of
    # token 6; key columns 126, 127 with one such token per group)
    x[6, :, 2 * G:3 * G] = 0.0
    x[6, :, 2 * G] = 2.0**-20
    x[:, :, 126:128] = 0.0
    x[1::G, :, 126:128] = 2.0**-20
    return to_dtype_values(x, "bfloat16").astype(np.float32)


KIVI_KEY_CASES = [c for c in KIVI_CASES if c[1]["role"] == "key"]
#: KIVI key write layouts (plan_write's block_d, num_warps, store_as_loaded): the same bytes
KEY_LAYOUTS = [{"block_d": 64}, {"block_d": 32, "num_warps": 1}, {"block_d": 16, "store_as_loaded": True},
               {"store_as_loaded": True}, {"block_d": 64, "num_warps": 1, "store_as_loaded": True}]
KEY_LAYOUT_IDS = ["-".join(f"{k}={v}" for k, v in o.items()) for o in KEY_LAYOUTS]


@pytest.mark.parametrize("launch", KEY_LAYOUTS, ids=KEY_LAYOUT_IDS)
@pytest.mark.parametrize("name,opts", KIVI_KEY_CASES, ids=[f"{n}-{o['group_size']}" for n, o in KIVI_KEY_CASES])
def test_kivi_key_write_layouts_equal_oracle(name, opts, launch):
    """KIVI keys by channel blocks, one warp, and stores in the load's layout: the oracle's bytes on the
    signed-zero / constant-column input (each program's channels, codes, scales and zeros are its own slice)."""
    rng = np.random.default_rng(17)
    G = opts["group_size"]
    ok, detail = triton_write_matches(name, {**opts, "residual": 0}, _signed_zero_input(rng, G), G, rng,
                                      dtype="bfloat16", launch=launch)
    assert ok, f"{name} {opts} {launch}: {detail}"


@pytest.mark.parametrize("launch", [{}, *KEY_LAYOUTS], ids=["default", *KEY_LAYOUT_IDS])
def test_kivi_key_write_leaves_slot_minus_one_rows_out(launch):
    """Rows with slot -1 in a group are not written and left out of its min/max (the oracle of the written
    rows: the same scheme with the group size of those rows); a group of -1 rows only writes nothing. An
    outlier in a skipped row would change every scale of its head if it counted."""
    from kvqref.paged import PagedKVCache

    rng = np.random.default_rng(19)
    G, H, D = 16, 2, 128
    x = _signed_zero_input(rng, G, tokens=2 * G)
    skipped = [1, 6, G - 1]
    x[6, :, :] = 30000.0
    k = schemes.get("int4_kivi", role="key", group_size=G, residual=0)
    dc = tb.DeviceCache.from_cache(PagedKVCache(k, schemes.get("bf16"), 4, 2 * G, H, D), DEVICE)
    side = dc.k
    for t in side.fields.values():
        t.view(torch.uint8).fill_(0xA5)  # sentinel: bytes never written stay 0xA5
    slots = torch.arange(G, 3 * G, dtype=torch.int64)  # groups 1 and 2 of the slots
    slots[skipped] = -1
    slots[G:] = -1  # the second group: nothing written
    tb.quantize_write(side, torch.from_numpy(x).to(torch.bfloat16).to(DEVICE), slots.to(DEVICE), **launch)
    kept = [i for i in range(G) if i not in skipped]
    want = schemes.get("int4_kivi", role="key", group_size=len(kept), residual=0).quantize(x[kept]).fields
    got = {f: t.cpu() for f, t in side.fields.items()}
    assert np.array_equal(got["codes"][[G + i for i in kept]].numpy(), want["codes"]), launch
    for f in ("scale", "zero"):
        assert np.array_equal(got[f][1].numpy().view(np.uint16), want[f][0].view(np.uint16)), (f, launch)
        untouched = [g for g in range(got[f].shape[0]) if g != 1]  # group 2 (all -1) and the unused ones
        assert (got[f][untouched].view(torch.uint8) == 0xA5).all(), (f, launch)
    untouched_rows = [i for i in range(got["codes"].shape[0]) if not G <= i < 2 * G or i - G in skipped]
    assert (got["codes"][untouched_rows] == 0xA5).all(), launch


X2_CASES = [("int4_kivi", {"role": "key", "group_size": 32}), ("int2_kivi", {"role": "key", "group_size": 16}),
            ("int4_kivi", {"role": "value", "group_size": 32}), ("int2_kivi", {"role": "value", "group_size": 16}),
            ("int4_kivi", {"role": "value", "group_size": 2}),
            ("int4_kivi", {"role": "key", "group_size": 32, "rotation": "hadamard", "rotation_seed": 2}),
            ("int2_kivi", {"role": "value", "group_size": 32, "rotation": "hadamard", "rotation_seed": 4})]


@pytest.mark.skipif(not GPU, reason="KIVI by float16 pairs is inline PTX: NVIDIA GPUs only")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("name,opts", X2_CASES, ids=[f"{n}-{'-'.join(map(str, o.values()))}" for n, o in X2_CASES])
def test_kivi_f16x2_write_equals_the_portable_one(name, opts, dtype):
    """``kivi_f16x2`` (KIVI by float16 pairs in inline PTX, the default on NVIDIA GPUs) and the portable write give
    the oracle's bytes: bfloat16 (loaded as words), float16 and float32 input, keys by channel blocks and whole
    heads, rotated schemes, token-major and head-major pages, on the signed-zero / constant / subnormal-range input
    and a random one with outliers."""
    from kvqref.conformance import to_dtype_values

    rng = np.random.default_rng(23)
    G = opts["group_size"]
    tokens = 2 * max(G, 16)
    x = _signed_zero_input(rng, max(G, 16), tokens=tokens) if G >= 16 else kv_tensor(rng, tokens, 2, 128, False)
    noisy = kv_tensor(rng, tokens, 2, 128, outliers=True) * 2.0**-3
    for inp in (x, noisy):
        inp = to_dtype_values(inp, dtype).astype(np.float32)
        launches = [{"kivi_f16x2": True}, {"kivi_f16x2": False}]
        if opts["role"] == "key" and "rotation" not in opts:
            launches += [{"kivi_f16x2": True, "block_d": 64, "num_warps": 1}, {"kivi_f16x2": True, "block_d": 32}]
        for launch in launches:
            for layout in ("NHD", "HND"):
                ok, detail = triton_write_matches(name, {**opts, "residual": 0}, inp, max(G, 16), rng, dtype=dtype,
                                                  launch=launch, layout=layout)
                assert ok, f"{name} {opts} {dtype} {launch} {layout}: {detail}"


@pytest.mark.parametrize("rotated", [False, True])
def test_kivi_write_rejects_what_overflows_float16(rotated):
    """KIVI computes in float16: a value that rounds beyond its range, or a group whose max - min does, raises the
    oracle's ValueError instead of writing the codes of an infinite range; values near the limit in other groups, and
    (keys) an overflowing range only through a row of slot -1, which is not written, do not; the same decisions as the
    oracle. Rotated schemes are checked on their rotated values (rows of random signs at growing scales)."""
    from kvqref.paged import PagedKVCache

    rot = {"rotation": "hadamard", "rotation_seed": 3} if rotated else {}
    k = schemes.get("int4_kivi", role="key", group_size=16, residual=0, **rot)
    v = schemes.get("int4_kivi", role="value", group_size=32, residual=0, **rot)
    dc = tb.DeviceCache.from_cache(PagedKVCache(k, v, 4, 16, 2, 128), DEVICE)
    slots = torch.arange(32, device=DEVICE)
    rng = np.random.default_rng(29)
    inputs = []
    if rotated:  # whole rows of +-s: rotated values up to about s * sqrt(128) / a few
        for scale in (1000.0, 12000.0, 15000.0, 18000.0, 21000.0, 30000.0):
            x = np.zeros((32, 2, 128), np.float32)
            x[:2] = rng.choice([-scale, scale], (2, 2, 128))
            inputs.append((x, slots))
    else:
        for (a, va), (b, vb) in (
                (((0, 0, 5), 40000.0), ((1, 0, 5), -40000.0)),    # a key column's range; two channels of a value group
                (((0, 0, 5), 40000.0), ((17, 0, 5), -40000.0)),   # two key groups; two value groups of two tokens
                (((0, 0, 5), 40000.0), ((0, 0, 6), -40000.0)),    # two key columns; one value group's range
                (((3, 1, 0), 70000.0), ((3, 1, 1), 0.0)),         # beyond float16
                (((0, 0, 5), 32768.0), ((1, 0, 5), -32752.0)),    # a key range of 65520: RN16 ties to Inf (values: ok)
                (((0, 0, 5), 32768.0), ((0, 0, 6), -32752.0)),    # a value range of 65520 (keys: ok)
                (((0, 0, 5), 32768.0), ((0, 0, 6), -32736.0))):   # 65504: finite

            x = np.zeros((32, 2, 128), np.float32)
            x[a], x[b] = va, vb
            inputs.append((x, slots))
    kinds = set()
    for side, scheme in ((dc.k, k), (dc.v, v)):
        for x, sl in inputs:
            try:
                scheme.quantize(x)
                want = None
            except ValueError as e:
                want = str(e)
            xt = torch.from_numpy(x).to(DEVICE)
            if want is None:
                tb.quantize_write(side, xt, sl)
            else:
                with pytest.raises(ValueError) as got:
                    tb.quantize_write(side, xt, sl)
                assert str(got.value) == want, side is dc.k
            kinds.add("ok" if want is None else "range" if "range max - min" in want else "float16")
    assert kinds == {"ok", "range", "float16"}, kinds  # every outcome reached
    x = np.zeros((32, 2, 128), np.float32)  # keys: the overflowing row not written, so no error
    x[0, 0, :] = 40000.0
    x[1, 0, :] = -40000.0
    skip = slots.clone()
    skip[1] = -1
    if not rotated:
        tb.quantize_write(dc.k, torch.from_numpy(x).to(DEVICE), skip)
        with pytest.raises(ValueError, match="range max - min"):
            tb.quantize_write(dc.k, torch.from_numpy(x).to(DEVICE), slots)


def test_kivi_f16x2_is_checked():
    """``kivi_f16x2=True``: KIVI schemes only, and inline PTX, so not in the interpreter nor on ROCm; its default is
    on for KIVI writes on NVIDIA GPUs (where KIVI_X2 is then set) and off elsewhere."""
    from kvqref.paged import PagedKVCache

    k = schemes.get("int4_kivi", role="key", group_size=16, residual=0)
    dc = tb.DeviceCache.from_cache(PagedKVCache(k, schemes.get("fp8_e4m3"), 2, 16, 2, 128), DEVICE)
    x, slots = torch.zeros(16, 2, 128, device=DEVICE, dtype=torch.bfloat16), torch.arange(16, device=DEVICE)
    assert tb.plan_write(dc.k, x, slots).constexprs["KIVI_X2"] is GPU
    assert tb.plan_write(dc.k, x, slots, kivi_f16x2=False).constexprs["KIVI_X2"] is False
    if GPU:
        with pytest.raises(ValueError, match="KIVI schemes only"):
            tb.plan_write(dc.v, x, slots, kivi_f16x2=True)
    else:
        with pytest.raises(ValueError, match="not in the interpreter"):
            tb.plan_write(dc.k, x, slots, kivi_f16x2=True)


def test_kivi_key_block_d_is_checked_and_adds_a_grid_axis():
    """plan_write's block_d: KIVI keys without rotation only, a power of two dividing head_dim into whole code
    bytes; the grid gains head_dim // block_d channel blocks (its third axis, with either grid order:
    ``heads_fast``); block_d = head_dim is the default launch."""
    from kvqref.paged import PagedKVCache

    k = schemes.get("int2_kivi", role="key", group_size=16, residual=0)
    v = schemes.get("int4_kivi", role="value", group_size=32, residual=0)
    dc = tb.DeviceCache.from_cache(PagedKVCache(k, v, 2, 16, 2, 128), DEVICE)
    x, slots = torch.zeros(16, 2, 128, device=DEVICE), torch.full((16,), -1, device=DEVICE)
    launch = tb.plan_write(dc.k, x, slots, block_d=32, heads_fast=False)
    assert launch.grid == (1, 2, 4) and launch.constexprs["BLOCK_D"] == 32
    assert tb.plan_write(dc.k, x, slots, block_d=32, heads_fast=True).grid == (2, 1, 4)
    default = tb.plan_write(dc.k, x, slots, heads_fast=False)
    assert default.grid == tb.plan_write(dc.k, x, slots, block_d=128, heads_fast=False).grid == (1, 2)
    assert default.constexprs["BLOCK_D"] == 0 and default.constexprs["STORE_AS_LOADED"] is False
    for bad in (48, 256, 2, 0):
        with pytest.raises(ValueError, match="power of two"):
            tb.plan_write(dc.k, x, slots, block_d=bad)
    with pytest.raises(ValueError, match="KIVI keys without rotation"):
        tb.plan_write(dc.v, x, slots, block_d=64)
    rk = schemes.get("int4_kivi", role="key", group_size=16, residual=0, rotation="hadamard", rotation_seed=3)
    rdc = tb.DeviceCache.from_cache(PagedKVCache(rk, v, 2, 16, 2, 128), DEVICE)
    with pytest.raises(ValueError, match="KIVI keys without rotation"):
        tb.plan_write(rdc.k, x, slots, block_d=64)


@pytest.mark.parametrize("blocks", [False, True])
@pytest.mark.parametrize("g", [2.0**-20, 6.0 / 2688.0, 2.0**-70])
def test_nvfp4_write_with_saturating_blocks(g, blocks):
    """NVFP4 with a given global scale g: |x| beyond g * 2**14 (clamped in the kernel's fast path; such blocks'
    scales saturate at 448 and their codes at +-6), 1e30 and ties in bfloat16 input, and g = 2**-70 outside the
    fast path's range (divisions); by rows and with whole blocks per thread (``nvfp4_blocks``)."""
    from kvqref.conformance import to_dtype_values

    rng = np.random.default_rng(13)
    x = kv_tensor(rng, 32, 2, 64, outliers=True)
    x[2, 0, :16] = np.linspace(-3.0, 3.0, 16) * g * 2.0**14 * 448 * 6 / 2730  # around the clamp
    x[5, 1, 3] = 1e30
    x[5, 1, 4] = -1e30
    x[6, 0, :16] = np.array([2.5, -5.0, 0.25, 0.75, 1.25, 1.75, 3.5, 5.0] * 2) * g
    x[7] = 0.0
    x[8, :, ::2] = -0.0
    x = to_dtype_values(x, "bfloat16").astype(np.float32)
    ok, detail = triton_write_matches("nvfp4", {"global_scale": g}, x, 16, rng, dtype="bfloat16",
                                      launch={"nvfp4_blocks": blocks})
    assert ok, detail


@settings(max_examples=6 if not GPU else 40, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31), scale_exp=st.integers(-30, 30), tile=st.sampled_from([None, (1, 2), (4, 8)]))
def test_nvfp4_blocks_write_fuzz(seed, scale_exp, tile):
    """NVFP4 from bfloat16 input with whole blocks per thread (``nvfp4_blocks``): random magnitudes, E2M1 ties
    and their bfloat16 neighbours at the block's scale, blocks with one huge element, signed zeros; 3 heads (a
    partial head tile) and a token count that does not fill the last tile."""
    from kvqref.conformance import to_dtype_values

    rng = np.random.default_rng(seed)
    x = kv_tensor(rng, 21, 3, 64, outliers=bool(seed & 1)) * 2.0**scale_exp
    x[1, 0, :8] = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]) * 2.0**scale_exp
    x[1, 0, 8:16] = -x[1, 0, :8]
    x[2, 1, :16] = np.nextafter(x[1, 0, :16].astype(np.float32), np.float32(0))
    x[3, 2, 5] = 1e4 * 2.0**scale_exp
    x[4, :, 16:32] = np.where(rng.random((3, 16)) < 0.5, -0.0, 0.0)
    x = to_dtype_values(x, "bfloat16").astype(np.float32)
    launch = {"nvfp4_blocks": True} | ({} if tile is None else {"block_t": tile[0], "block_h": tile[1]})
    ok, detail = triton_write_matches("nvfp4", {}, x, rng.choice([1, 16]), rng, dtype="bfloat16", launch=launch)
    assert ok, detail


@pytest.mark.parametrize("blocks", [False, True])
def test_nvfp4_write_skips_slots_of_minus_one(blocks):
    """Tokens whose slot is -1 are not written (the whole-block path loads them and masks their stores)."""
    from kvqref.conformance import to_dtype_values
    from kvqref.paged import PagedKVCache

    rng = np.random.default_rng(17)
    cache = PagedKVCache(schemes.get("nvfp4"), schemes.get("nvfp4"), 2, 16, 8, 128)
    dc = tb.DeviceCache.from_cache(cache, DEVICE)
    x = to_dtype_values(kv_tensor(rng, 6, 8, 128, outliers=True), "bfloat16")
    slots = torch.tensor([3, -1, 4, -1, -1, 20], device=DEVICE)
    full = {}
    for name, f in dc.k.fields.items():  # each field a view from row 1 of a larger buffer: row -1 is row 0 there
        full[name] = torch.full((f.shape[0] + 1, *f.shape[1:]), 0xAB, dtype=f.dtype, device=DEVICE)
        dc.k.fields[name] = full[name][1:]
    tb.quantize_write(dc.k, torch.from_numpy(x).to(torch.bfloat16).to(DEVICE), slots, nvfp4_blocks=blocks)
    written = [1 + s for s in (3, 4, 20)]
    for name, f in full.items():
        rows = f.reshape(f.shape[0], -1).cpu()
        untouched = [r for r in range(rows.shape[0]) if r not in written]
        assert (rows[untouched] == 0xAB).all() and not (rows[written] == 0xAB).all(), name


def test_write_register_cap():
    """``plan_write(maxnreg=...)`` (a register cap per thread, for tuning): on an NVIDIA GPU the capped launch writes
    the oracle's bytes; anywhere else, and a cap that is not an int >= 16, is refused before launch; 0 takes any cap
    off (KIVI keys: their default cap on NVIDIA GPUs) on every device."""
    from kvqref.conformance import to_dtype_values

    rng = np.random.default_rng(23)
    x = to_dtype_values(kv_tensor(rng, 16, 2, 64, outliers=True), "bfloat16")
    side = tb.DeviceCache.from_cache(build_cache(("nvfp4", {}, "nvfp4", {}), SMALL, rng)[0], DEVICE).k
    xt = torch.from_numpy(x).to(torch.bfloat16).to(DEVICE)
    slots = torch.arange(16, dtype=torch.int64, device=DEVICE)
    nvidia = GPU and not getattr(torch.version, "hip", None)
    for bad in ([8, True, 64.0] if nvidia else [64]):
        with pytest.raises(ValueError, match="maxnreg"):
            tb.quantize_write(side, xt, slots, maxnreg=bad)
    if nvidia:
        ok, detail = triton_write_matches("nvfp4", {}, x, 16, rng, dtype="bfloat16",
                                          launch={"maxnreg": 40, "nvfp4_blocks": False})
        assert ok, detail
    kside = tb.DeviceCache.from_cache(build_cache(PAIRS[7], SMALL, rng)[0], DEVICE).k  # int4 KIVI keys (capped)
    kx = torch.from_numpy(to_dtype_values(kv_tensor(rng, 16, 2, 64, True), "bfloat16")).to(torch.bfloat16).to(DEVICE)
    assert ("maxnreg" in tb.plan_write(kside, kx, slots).options) == nvidia
    assert "maxnreg" not in tb.plan_write(kside, kx, slots, maxnreg=0).options
    # int2 KIVI keys by float16 pairs have no default cap (session 41); an explicit one still applies on NVIDIA
    k2side = tb.DeviceCache.from_cache(build_cache(PAIRS[8], SMALL, rng)[0], DEVICE).k
    assert "maxnreg" not in tb.plan_write(k2side, kx, slots).options
    if nvidia:
        assert tb.plan_write(k2side, kx, slots, maxnreg=80).options["maxnreg"] == 80


@settings(max_examples=6 if not GPU else 40, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31), case=st.sampled_from(WRITE_CASES[:13]),
       scale_exp=st.integers(-20, 20), page=st.sampled_from([1, 16, 32]))  # no KIVI keys: pages % G
def test_write_fuzz(seed, case, scale_exp, page):
    """Differential fuzzing of the write path: random magnitudes (incl. subnormal-range and huge), pages."""
    rng = np.random.default_rng(seed)
    x = (kv_tensor(rng, 48, 2, 64, outliers=bool(seed & 1)) * 2.0**scale_exp).astype(np.float32)
    _write_and_compare(*case, x, page_size=page, rng=rng)


def test_bad_input_is_rejected_before_launch():
    rng = np.random.default_rng(3)
    cache, _ = build_cache(PAIRS[1], SMALL, rng)
    dc = tb.DeviceCache.from_cache(cache, DEVICE)
    with pytest.raises(ValueError, match="q must be"):
        tb.decode(torch.zeros(3, 4, device=DEVICE), dc)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        tb.decode(torch.zeros(3, 3, 64, device=DEVICE), dc)
    with pytest.raises(ValueError, match="batch"):
        tb.decode(torch.zeros(2, 4, 64, device=DEVICE), dc)
    with pytest.raises(ValueError, match="precision"):
        tb.decode(torch.zeros(3, 4, 64, device=DEVICE), dc, precision="half")
    dc.block_table[1, 0] = 10_000
    with pytest.raises(ValueError, match="page indices"):
        tb.decode(torch.zeros(3, 4, 64, device=DEVICE), dc)
    with pytest.raises(ValueError, match="slot_mapping"):
        tb.quantize_write(dc.k, torch.zeros(4, 2, 64, device=DEVICE), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="NaN"):
        side = tb.DeviceCache.from_cache(build_cache(PAIRS[5], SMALL, rng)[0], DEVICE).k
        tb.quantize_write(side, torch.full((2, 2, 64), float("nan"), device=DEVICE),
                          torch.zeros(2, dtype=torch.int64, device=DEVICE))


SHAPE_CASES = [  # (name, shape overrides, pair index): head_dim 256 and 64, MQA, pages of 256 and 1
    ("head_dim_256", dict(head_dim=256), 1),
    ("head_dim_256_fp4", dict(head_dim=256), 6),
    ("mqa", dict(kv_heads=1, q_heads=8), 1),
    ("mqa_kivi", dict(kv_heads=1, q_heads=8), 7),
    ("page_256", dict(page_size=256), 5),
    ("page_1_nvfp4", dict(page_size=1), 6),
]


@pytest.mark.parametrize("name,over,pair", SHAPE_CASES, ids=[c[0] for c in SHAPE_CASES])
def test_decode_shapes(name, over, pair):
    rng = np.random.default_rng(len(name))
    shape = dict(BIG if GPU else SMALL, **over)
    cache, _ = build_cache(PAIRS[pair], shape, rng)
    q = torch.from_numpy(rng.standard_normal((shape["batch"], shape["q_heads"], shape["head_dim"]))
                         .astype(np.float32)).to(torch.bfloat16)
    out, lse, _ = _run_decode(cache, q)
    ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q.float().numpy().astype(np.float64))
    assert (np.abs(out - ref_out) <= tol_o).all(), np.abs(out - ref_out).max()
    assert (np.abs(lse - ref_lse) <= tol_l).all(), np.abs(lse - ref_lse).max()


@pytest.mark.skipif(not GPU, reason="needs a GPU: a cache of more than 2**31 elements, 131,072 tokens")
@pytest.mark.parametrize("scheme", ["fp8_e4m3", "fp4_e2m1"])
def test_long_context_with_offsets_beyond_2_31(scheme):
    """Batch 1 at 131,072 tokens whose pages lie beyond element 2**31 of a 2.2 G-element cache: 64-bit
    offsets, split-KV, bytes written by the kernel equal the oracle's, attention within tolerance."""
    kvh, d, page, T = 8, 128, 16, 131072
    s = schemes.get(scheme)
    params = {"scale": np.float32(0.05)} if scheme.startswith("fp8") else {}
    num_pages = (2**31 + 2**27) // (page * kvh * d) + T // page
    first = num_pages - T // page  # the sequence's pages are the last ones: offsets > 2**31 elements
    bt = torch.arange(first, num_pages, dtype=torch.int32)[None, :]
    sl = torch.tensor([T], dtype=torch.int32)
    dc = tb.empty_device_cache(s, s, num_pages, page, kvh, d, bt, sl, k_params=params, v_params=params)
    rng = np.random.default_rng(0)
    k = kv_tensor(rng, T, kvh, d, outliers=True)
    v = kv_tensor(rng, T, kvh, d, outliers=False)
    slots = (bt[0].long()[:, None] * page + torch.arange(page)[None, :]).reshape(-1).cuda()
    tb.quantize_write(dc.k, torch.from_numpy(k).cuda(), slots)
    tb.quantize_write(dc.v, torch.from_numpy(v).cuda(), slots)
    qk, qv = s.quantize(k, params=params or None), s.quantize(v, params=params or None)
    lo = first * page
    for side, qz in ((dc.k, qk), (dc.v, qv)):
        for f, want in qz.fields.items():
            got = side.fields[f][lo:lo + T].cpu().numpy()
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f
    q = torch.from_numpy(rng.standard_normal((1, 32, d)).astype(np.float32)).to(torch.bfloat16)
    out, lse = tb.decode(q.cuda(), dc)
    K, V = s.dequantize(qk), s.dequantize(qv)
    q64 = q.float().numpy().astype(np.float64)
    ref_out, ref_lse = reference.attention(q64, [K], [V])
    tol_o, tol_l = reference.kernel_tolerance(q64, [K], [V], fast=reference.fast_rounding(s, s, "bfloat16"))
    assert (np.abs(out.cpu().numpy() - ref_out) <= tol_o).all()
    assert (np.abs(lse.cpu().numpy() - ref_lse) <= tol_l).all()


DTYPE_WRITE_CASES = [("fp4_e2m1", {"profile": "sglang"}), ("fp4_e2m1", {}),
                     ("fp8_e4m3", {"profile": "sglang", "scale": 0.37}),
                     ("fp8_e4m3", {"profile": "sglang", "scale": 0.0123, "sglang_scale": "float"}),
                     ("fp8_e5m2", {"profile": "sglang", "scale": 1.7, "saturate": True}),
                     ("fp8_e4m3", {"profile": "rocm", "scale": 0.37}), ("fp8_e4m3", {"scale": 0.37})]


def _write_model_dtype(name: str, opts: dict, x32: np.ndarray, dtype: str, rng: np.random.Generator):
    """Quantize ``x32`` (values representable in ``dtype``) as a ``dtype`` array with the oracle and as a torch
    ``dtype`` tensor with the write kernel into shuffled slots; every field compared as integers."""
    import warnings

    import ml_dtypes

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sglang's non-saturating overflow warns
        scheme = schemes.get(name, **opts)
        want = scheme.quantize(x32.astype({"bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
                                           "float32": np.float32}[dtype]))
    T, H, D = x32.shape
    pages = -(-T // 16) + 1
    table = torch.zeros(1, pages, dtype=torch.int32)
    dc = tb.empty_device_cache(scheme, scheme, pages, 16, H, D, table, torch.zeros(1, dtype=torch.int32),
                               k_params=want.params, device=DEVICE)
    slots = torch.from_numpy(rng.permutation(pages * 16)[:T].astype(np.int64)).to(DEVICE)
    tb.quantize_write(dc.k, torch.from_numpy(x32).to(getattr(torch, dtype)).to(DEVICE), slots)
    for f, arr in want.fields.items():
        got = dc.k.fields[f][slots].cpu().contiguous().view(torch.uint8).numpy()
        assert np.array_equal(got, arr.view(np.uint8).reshape(got.shape)), (f, int((got != arr.view(np.uint8)
                                                                                    .reshape(got.shape)).sum()))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("name,opts", DTYPE_WRITE_CASES, ids=[f"{n}-{'-'.join(map(str, o.values()))}"
                                                              for n, o in DTYPE_WRITE_CASES])
def test_write_model_dtypes_binade_edges(name, opts, dtype):
    """The write kernel computes as the oracle for each input tensor dtype: FP4 blocks at binade edges (amax / 6
    at 2**k and one dtype step either side); FP8 values of that dtype over the whole range, overflow included;
    bytes equal as integers."""
    from kvqref.conformance import binade_edge_blocks, to_dtype_values

    rng = np.random.default_rng(len(name) + len(dtype))
    if name.startswith("fp8"):  # spread over the FP8 range and beyond it (overflow), 64 wide
        x = rng.uniform(-1, 1, (64, 1, 64)) * 400 * opts["scale"] * 2.0 ** rng.integers(-8, 1, (64, 1, 1))
        x[0, 0, :4] = np.array([500.0, -500.0, 1e4, -1e4]) * opts["scale"]
    else:
        x, _ = binade_edge_blocks(dtype, rng)
        x = np.concatenate([x, rng.standard_normal((12, 1, 16)) * 3])
    x = to_dtype_values(x, dtype)
    _write_model_dtype(name, opts, x.astype(np.float32), dtype, rng)


def test_write_rejects_a_contradicting_model_dtype():
    s = schemes.get("fp8_e4m3", profile="sglang", scale=0.5, model_dtype="bfloat16")
    dc = tb.empty_device_cache(s, s, 2, 16, 1, 16, torch.zeros(1, 2, dtype=torch.int32),
                               torch.zeros(1, dtype=torch.int32), k_params={"scale": np.float32(0.5)}, device=DEVICE)
    with pytest.raises(ValueError, match="float16 array but model_dtype='bfloat16'"):
        tb.quantize_write(dc.k, torch.ones(1, 1, 16, dtype=torch.float16, device=DEVICE),
                          torch.zeros(1, dtype=torch.int64, device=DEVICE))
    s16 = schemes.get("fp8_e4m3", profile="sglang", scale=1e-9)
    dc = tb.empty_device_cache(s16, s16, 2, 16, 1, 16, torch.zeros(1, 2, dtype=torch.int32),
                               torch.zeros(1, dtype=torch.int32), k_params={"scale": np.float32(1e-9)}, device=DEVICE)
    with pytest.raises(ValueError, match="0 or Inf in float16"):
        tb.quantize_write(dc.k, torch.ones(1, 1, 16, dtype=torch.float16, device=DEVICE),
                          torch.zeros(1, dtype=torch.int64, device=DEVICE))


def test_launch_defaults_are_the_measured_choices():
    """The defaults the H100 A/Bs chose (bench/results/ANALYSIS.md, sessions 5 and 9): fast-mode KIVI key rows
    where they fit 16 rows (session 9: int4 625 -> 352 us, int2 524 -> 308), else key tiles for 2-bit keys only
    (int2 628 -> 517 us, int4 616 -> 627), FP4 keys never laid out by token (nvfp4 314 -> 346 us),
    KIVI key writes with 2 warps, float16 roundings by conversion instructions on NVIDIA GPUs only, KIVI value
    writes capped at 64 registers on NVIDIA GPUs (session 6)."""
    rng = np.random.default_rng(3)
    for pair, ktile in ((PAIRS[7], False), (PAIRS[8], True), (PAIRS[6], False)):
        cache, _ = build_cache(pair, SMALL, rng)
        dc = tb.DeviceCache.from_cache(cache, DEVICE)
        q = torch.zeros(SMALL["batch"], SMALL["q_heads"], SMALL["head_dim"], device=DEVICE)
        kivi = pair[0].endswith("kivi")
        for precision in ("fast", "exact"):
            launches, _, _ = plan_for_cache(q, dc, precision=precision)
            split = next(launch for launch in launches if "KTILE" in launch.constexprs)
            assert split.constexprs["KR"] is (kivi and precision == "fast"), (pair[0], precision)
            assert split.constexprs["KTILE"] is False, (pair[0], precision)
            assert split.constexprs["KT4"] is False
            if kivi:  # where key rows are off by default (no value rows here): key tiles for 2-bit keys only
                launches, _, _ = plan_for_cache(q, dc, precision=precision, value_rows=False)
                split = next(launch for launch in launches if "KTILE" in launch.constexprs)
                assert split.constexprs["KR"] is False
                assert split.constexprs["KTILE"] is (ktile and precision == "fast"), (pair[0], precision)
        x = torch.zeros(16, SMALL["kv_heads"], SMALL["head_dim"], device=DEVICE)
        launch = tb.plan_write(dc.k, x, torch.full((16,), -1, device=DEVICE))
        nvidia = GPU and not getattr(torch.version, "hip", None)
        assert launch.constexprs["F16_CVT"] is nvidia
        assert launch.options["num_warps"] == (2 if pair[0].endswith("kivi") else tb.WRITE_WARPS)
        # KIVI keys of whole heads (head_dim 64 here), by float16 pairs: capped registers on NVIDIA GPUs
        kivi_nv = nvidia and pair[0].endswith("kivi")
        assert launch.constexprs["KIVI_X2"] is kivi_nv
        key_cap = tb.WRITE_MAXNREG_KIVI_X2_INT2_KEYS if pair[0] == "int2_kivi" else tb.WRITE_MAXNREG_KIVI_X2_KEYS
        assert launch.options.get("maxnreg") == (key_cap if kivi_nv else None), pair[0]
        vlaunch = tb.plan_write(dc.v, x, torch.full((16,), -1, device=DEVICE))  # KIVI values: capped registers
        assert vlaunch.options.get("maxnreg") == (tb.WRITE_MAXNREG_KIVI_X2_VALUES if kivi_nv else None), pair[0]


def test_every_launch_names_fp_fusion():
    """Every planned launch names ``enable_fp_fusion``, so Triton 3.10 (default off) compiles what was measured and
    tested (the default on, up to 3.9); rotated writes keep it off (docs/rotation.md)."""
    from kvqref.paged import PagedKVCache

    rng = np.random.default_rng(5)
    for pair in (PAIRS[1], PAIRS[6], PAIRS[7]):
        cache, _ = build_cache(pair, SMALL, rng)
        dc = tb.DeviceCache.from_cache(cache, DEVICE)
        q = torch.zeros(SMALL["batch"], SMALL["q_heads"], SMALL["head_dim"], device=DEVICE)
        residual = dc.residual
        launches, _, _ = plan_for_cache(q, dc, residual=residual, num_splits=2)  # (2 splits: the merge launch too)
        assert len(launches) >= 2 and all(la.options["enable_fp_fusion"] is True for la in launches), pair[0]
    slots = torch.arange(16, device=DEVICE)
    x = torch.zeros(16, 2, 64, device=DEVICE)
    for rotation, fused in (({}, True), ({"rotation": "hadamard", "rotation_seed": 1}, False)):
        k = schemes.get("fp8_e4m3", **rotation)
        dc = tb.DeviceCache.from_cache(PagedKVCache(k, k, 2, 16, 2, 64), DEVICE)
        assert tb.plan_write(dc.k, x, slots).options["enable_fp_fusion"] is fused


def test_merge_warps_are_the_measured_choice():
    """The merge launch takes 1 warp per program up to 4,096 float32 elements of partials per (sequence, head)
    (H100, session 15: 1.5-2 us faster than 4 warps at 4-16 splits, 47-55 us slower at 196-256), else 4; an
    explicit ``merge_warps`` wins; the merged output is the same either way within the oracle's bound."""
    from kvqref.kernels.decode import merge_kernel, merge_warps_default

    assert merge_warps_default(32, 128) == 1 and merge_warps_default(64, 128) == 4
    assert merge_warps_default(64, 64) == 1 and merge_warps_default(16, 256) == 1 and merge_warps_default(2, 4096) == 4
    rng = np.random.default_rng(51)
    cache, _ = build_cache(PAIRS[1], SMALL, rng)
    dc = tb.DeviceCache.from_cache(cache, DEVICE)
    q = torch.from_numpy(rng.standard_normal((3, 4, 64)).astype(np.float32)).to(torch.bfloat16)
    ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q.float().numpy().astype(np.float64))
    for splits, warps, expect in ((3, None, 1), (100, None, 4), (3, 4, 4)):  # whole rows (64 channels)
        launches, _, _ = plan_for_cache(q.to(DEVICE), dc, num_splits=splits, block_n=16, merge_warps=warps,
                                        merge_channels=64)
        merge = next(la for la in launches if la.kernel is merge_kernel)
        assert merge.options["num_warps"] == expect, (splits, warps)
    for warps in (1, 4):
        out, lse, _ = _run_decode(cache, q, num_splits=5, block_n=16, merge_warps=warps)
        assert (np.abs(out - ref_out) <= tol_o).all() and (np.abs(lse - ref_lse) <= tol_l).all(), warps


def test_merge_channel_blocks_agree_with_the_whole_row_merge():
    """The merge by channel blocks (``merge_channels``: head_dim / blocks programs per (sequence, head), the first
    writing the LSE) against the whole-row merge: within the oracle's bounds of each other (each channel's arithmetic
    is the same, but on the GPU the sums over splits may be reduced in another order) and of the oracle; the
    default halves head_dim only where the rows are fewer than twice the multiprocessors and V
    is not rotated; bad block sizes and a rotated V with blocks raise."""
    from kvqref.kernels.decode import merge_channels_default, merge_kernel

    assert merge_channels_default(32, 132, 128, False) == 64 and merge_channels_default(256, 132, 128, False) == 64
    assert merge_channels_default(1024, 132, 128, False) == 128 and merge_channels_default(32, 132, 128, True) == 128
    rng = np.random.default_rng(52)
    cache, _ = build_cache(PAIRS[6], SMALL, rng)
    dc = tb.DeviceCache.from_cache(cache, DEVICE)
    q = torch.from_numpy(rng.standard_normal((3, 4, 64)).astype(np.float32)).to(torch.bfloat16)
    ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q.float().numpy().astype(np.float64))
    whole, whole_lse, _ = _run_decode(cache, q, num_splits=5, block_n=16, merge_channels=64)
    for mdb in (32, 16):
        out, lse, _ = _run_decode(cache, q, num_splits=5, block_n=16, merge_channels=mdb)
        assert (np.abs(out - ref_out) <= tol_o).all() and (np.abs(lse - ref_lse) <= tol_l).all(), mdb
        assert (np.abs(out - whole) <= 2 * tol_o).all() and (np.abs(lse - whole_lse) <= 2 * tol_l).all(), mdb
        launches, _, _ = plan_for_cache(q.to(DEVICE), dc, num_splits=5, merge_channels=mdb)
        merge = next(la for la in launches if la.kernel is merge_kernel)
        assert merge.grid == (3, 4, 64 // mdb) and merge.constexprs["DB"] == mdb
    for bad in (0, 48, 128):
        with pytest.raises(ValueError, match="merge_channels"):
            plan_for_cache(q.to(DEVICE), dc, merge_channels=bad)
    rot = ("fp8_e4m3", {}, "fp8_e4m3", {"rotation": "hadamard", "rotation_seed": 3})
    rc = tb.DeviceCache.from_cache(build_cache(rot, SMALL, rng)[0], DEVICE)
    with pytest.raises(ValueError, match="merge_channels"):
        plan_for_cache(q.to(DEVICE), rc, merge_channels=32)


def test_direct_output_is_the_merge_of_one_split():
    """One split and nothing to merge (``direct_output``, the default there): no merge launch, and the split kernel's
    output and natural-log LSE have the merged launch's values (the merge weighs one split by exactly 1), within the
    oracle's bound, an empty sequence included (out 0, LSE -inf); ``direct_output=True`` with two splits or a residual
    window raises; a rotated V with one split is un-rotated by the split kernel (``ROT_V``; its values:
    tests/test_triton_rotation.py)."""
    from kvqref.kernels.decode import merge_kernel

    rng = np.random.default_rng(57)
    for pair in (PAIRS[0], PAIRS[2], PAIRS[6]):
        cache, _ = build_cache(pair, SMALL, rng)
        dc = tb.DeviceCache.from_cache(cache, DEVICE)
        q = torch.from_numpy(rng.standard_normal((3, 4, 64)).astype(np.float32)).to(torch.bfloat16)
        ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q.float().numpy().astype(np.float64))
        launches, _, _ = plan_for_cache(q.to(DEVICE), dc, num_splits=1, block_n=16)
        assert not any(la.kernel is merge_kernel for la in launches), pair
        assert launches[-1].constexprs["DIRECT"], pair
        out, lse, _ = _run_decode(cache, q, num_splits=1, block_n=16)
        merged, merged_lse, _ = _run_decode(cache, q, num_splits=1, block_n=16, direct_output=False)
        assert np.array_equal(out, merged) and np.array_equal(lse, merged_lse), pair
        assert (np.abs(out - ref_out) <= tol_o).all() and (np.abs(lse - ref_lse) <= tol_l).all(), pair
        # an empty sequence: the split reads nothing
        lens = dc.seq_lens.clone()
        dc.seq_lens[1] = 0
        out0, lse0 = tb.decode(q.to(DEVICE), dc, num_splits=1, block_n=16)
        dc.seq_lens.copy_(lens)
        assert (out0[1] == 0).all() and torch.isneginf(lse0[1]).all(), pair
        assert np.array_equal(out0[0].cpu().numpy(), out[0]) and np.array_equal(lse0[2].cpu().numpy(), lse[2])
        with pytest.raises(ValueError, match="direct_output needs one split"):
            plan_for_cache(q.to(DEVICE), dc, num_splits=2, direct_output=True)
    kivi, _ = build_cache(PAIRS[7], SMALL, rng)
    with pytest.raises(ValueError, match="direct_output needs one split"):
        _run_decode(kivi, torch.zeros(3, 4, 64, dtype=torch.bfloat16), num_splits=1, direct_output=True)
    rot = ("fp8_e4m3", {}, "fp8_e4m3", {"rotation": "hadamard", "rotation_seed": 3})
    rc = tb.DeviceCache.from_cache(build_cache(rot, SMALL, rng)[0], DEVICE)
    qz = torch.zeros(3, 4, 64, dtype=torch.bfloat16, device=DEVICE)
    launches, _, _ = plan_for_cache(qz, rc, num_splits=1)
    assert launches[-1].constexprs["DIRECT"] and launches[-1].constexprs["ROT_V"]
    assert not any(la.kernel is merge_kernel for la in launches)
    launches, _, _ = plan_for_cache(qz, rc, num_splits=1, direct_output=False)
    assert launches[-1].kernel is merge_kernel and launches[-1].constexprs["ROT_V"]
    assert not launches[-2].constexprs["ROT_V"]


def test_fast_fp8_launch_is_the_measured_choice(monkeypatch):
    """Fast FP8 on an H200 reads 64-token tiles (session 28, head-major: batch 32 x 8,192 149.2 -> 143.2 us, 128 x
    4,096 276.2 -> 261.5, 64 q / 8 KV heads x 16,384 549.6 -> 511.7; token-major and page size 1 faster too); the
    H100 (64 lost there in session 15), other devices and exact mode keep 32 (planned on the CPU as for a GPU)."""
    from kvqref.kernels import decode

    rng = np.random.default_rng(59)
    for pair in (PAIRS[1], PAIRS[3]):  # OCP E4M3 pages; the ROCm FNUZ formats on an NVIDIA GPU (software)
        cache, _ = build_cache(pair, SMALL, rng)
        dc = tb.DeviceCache.from_cache(cache, "cpu")
        q = torch.zeros(3, 4, 64, dtype=torch.bfloat16)

        def block_n(q=q, dc=dc, **kw):
            launches, _, _ = plan_for_cache(q, dc, **kw)
            return split_launch_of(launches).constexprs["BLOCK_N"]

        assert block_n() == 32  # not an NVIDIA GPU
        with monkeypatch.context() as m:
            m.setattr(decode, "_nvidia_cuda", lambda t: True)
            m.setattr(decode, "_device_name", lambda d: "NVIDIA H200")
            assert block_n() == 64, pair[0]
            assert block_n(precision="exact") == 32
            assert block_n(block_n=32) == 32
            m.setattr(decode, "_device_name", lambda d: "NVIDIA H100 80GB HBM3")
            assert block_n() == 32, pair[0]


def test_two_axis_fp4_tiles_default(monkeypatch):
    """Per-element FP4 tiles built on two axes (``fp4_tiles_2d``): the default for fast E8M0 tiles unpacked by PTX
    (fp4_e2m1 without block rows: the default at 8 query heads per KV head; session 29, H200: 64 q / 8 KV heads x
    16,384 1,019.6 -> 902.1 us, the same bits), planned on the CPU as for a GPU; off in exact mode, for NVFP4 sides
    (they lose: session 30, H200, 948 -> 1,045 us) and for the portable unpacking (not measured); refused with block
    rows. On the GPU every per-element E8M0 test (extreme and rare scale codes) runs it by default."""
    from kvqref.kernels import decode
    from kvqref.kernels.aot import _hw_formats

    rng = np.random.default_rng(61)
    shape = dict(SMALL, head_dim=128)  # 8 blocks x 8 heads: more rows than block rows take
    q = torch.zeros(3, 16, 128, dtype=torch.bfloat16)  # 8 query heads per KV head

    def plan(pair, **kw):
        cache, _ = build_cache(pair, shape, rng)
        dc = tb.DeviceCache.from_cache(cache, "cpu")
        launches, _, _ = plan_for_cache(q, dc, hw_formats=_hw_formats("cuda:90"), **kw)
        return split_launch_of(launches).constexprs

    with monkeypatch.context() as m:
        m.setattr(decode, "_nvidia_cuda", lambda t: True)
        cx = plan(PAIRS[5], ptx_unpack=True)
        assert not cx["BLK"] and cx["T2D"]
        assert not plan(PAIRS[5], ptx_unpack=True, fp4_tiles_2d=False)["T2D"]
        assert not plan(PAIRS[5], ptx_unpack=True, precision="exact")["T2D"]
        assert not plan(PAIRS[9], ptx_unpack=True)["T2D"]  # NVFP4: measured, loses
        assert plan(PAIRS[9], ptx_unpack=True, fp4_tiles_2d=True)["T2D"]
        with pytest.raises(ValueError, match="fp4_tiles_2d needs"):
            plan(PAIRS[5], ptx_unpack=True, block_rows=True, fp4_tiles_2d=True)
    assert not plan(PAIRS[5])["T2D"]  # the portable unpacking (not an NVIDIA GPU)
    with pytest.raises(ValueError, match="fp4_tiles_2d needs"):
        plan(PAIRS[1], fp4_tiles_2d=True)  # no FP4 side


def test_merge_as_programmatic_dependent_launch(monkeypatch):
    """``pdl``: on NVIDIA GPUs of compute capability 9.0+ the merge launch is a programmatic dependent launch of the
    last split launch (``launch_pdl``; the merge waits in ``griddepcontrol.wait`` before any load, the split programs
    let it start, constexpr ``GDC``), planned by default there and nowhere else; ``pdl=True`` elsewhere raises; one
    split writing the outputs itself has no merge to depend on. On such a GPU the outputs are the same bits as with
    ``pdl=False`` (fp8, KIVI with its residual split as its own launch, nvfp4); elsewhere planned as for one."""
    from kvqref.kernels import decode
    from kvqref.kernels.decode import merge_kernel, pdl_supported

    rng = np.random.default_rng(71)
    q = torch.from_numpy(rng.standard_normal((3, 4, 64)).astype(np.float32)).to(torch.bfloat16)
    for pair in (PAIRS[1], PAIRS[7], PAIRS[9]):
        cache, _ = build_cache(pair, SMALL, rng)
        dc = tb.DeviceCache.from_cache(cache, DEVICE)
        residual = dc.residual

        def plan(dc=dc, residual=residual, **kw):
            launches, _, _ = plan_for_cache(q.to(DEVICE), dc, residual=residual, **{"num_splits": 2, **kw})
            splits = [la for la in launches if la.kernel is decode.decode_split_kernel]
            merges = [la for la in launches if la.kernel is merge_kernel]
            return ([bool(la.constexprs["GDC"]) for la in splits],
                    [(bool(la.constexprs["GDC"]), la.options.get("launch_pdl", False)) for la in merges])

        def check_planned(pair=pair, plan=plan, residual=residual):
            gdc, merges = plan()
            assert gdc[-1] and not any(gdc[:-1]) and merges == [(True, True)], (pair, gdc, merges)
            gdc, merges = plan(pdl=False)
            assert not any(gdc) and merges == [(False, False)], pair
            if residual is None:  # one split, no merge
                assert plan(num_splits=1) == ([False], []), pair

        if GPU and pdl_supported(q.to(DEVICE)):
            check_planned()
            out, lse, _ = _run_decode(cache, q, num_splits=2)
            out0, lse0, _ = _run_decode(cache, q, num_splits=2, pdl=False)
            assert np.array_equal(out, out0) and np.array_equal(lse, lse0), pair
        else:
            gdc, merges = plan()
            assert not any(gdc) and merges == [(False, False)], pair
            with pytest.raises(ValueError, match="pdl .programmatic dependent launch. needs"):
                plan(pdl=True)
            with monkeypatch.context() as m:  # planned as on such a GPU
                m.setattr(decode, "pdl_supported", lambda t: True)
                check_planned()


@pytest.mark.parametrize("case", ["bf16", "fp8", "kivi", "nvfp4", "nvfp4-blocks", "mxfp4-blocks"])
def test_page_ids_ahead_same_bits(case):
    """``page_ids_ahead``: the per-tile and block-rows loops reading each next tile's page ids one step ahead (a
    loop-carried value) compute the same bits as reading them in the step (bf16, FP8, KIVI through the per-tile loop
    with its residual split, NVFP4 per element; NVFP4 and mxfp4/nvfp4 by block rows, 3 stages), with 2 splits (so
    that a split starts inside a sequence), ragged lengths (a sequence of 1 token included) and pages from a shuffled
    free list (KIVI key rows: :func:`test_kivi_key_rows_page_ids_ahead_same_bits`)."""
    pair = {"bf16": PAIRS[0], "fp8": PAIRS[1], "kivi": PAIRS[7], "nvfp4": PAIRS[9], "nvfp4-blocks": PAIRS[9],
            "mxfp4-blocks": PAIRS[6]}[case]
    rng = np.random.default_rng(73)
    cache, _ = build_cache(pair, SMALL, rng)
    q = torch.from_numpy(rng.standard_normal((3, 4, 64)).astype(np.float32)).to(torch.bfloat16)
    kw = dict(num_splits=2, block_n=16)
    if case == "kivi":  # the per-tile loop (not key rows)
        kw.update(key_rows=False)
    elif case == "nvfp4":  # per element (not block rows)
        kw.update(block_rows=False)
    elif case.endswith("-blocks"):  # block rows, at 3 stages (where the loop's tiles are double-buffered)
        kw.update(block_rows=True, num_stages=3)
    out, lse, _ = _run_decode(cache, q, **kw)
    out1, lse1, _ = _run_decode(cache, q, page_ids_ahead=True, **kw)
    assert np.array_equal(out, out1) and np.array_equal(lse, lse1), case


@pytest.mark.parametrize("pair", [PAIRS[1], PAIRS[5], PAIRS[9]], ids=[IDS[1], IDS[5], IDS[9]])
def test_heads_fast_is_the_default_at_page_size_one(pair):
    """With pages of one token the decode grid puts the KV heads on its fastest axis (``heads_fast``: H100, session
    38, fp4_e2m1 188.4 -> 182.3 us, NVFP4 180.6 -> 169.4, FP8 210.6 -> 204.8), elsewhere the sequences; the other
    order asked for is kept, and both orders give the same bits (2 splits, ragged lengths, pages from a shuffled free
    list)."""
    rng = np.random.default_rng(75)
    q = torch.from_numpy(rng.standard_normal((3, 4, 64)).astype(np.float32)).to(torch.bfloat16)
    for page_size in (1, 16):
        cache, _ = build_cache(pair, dict(SMALL, page_size=page_size), rng)
        dc = tb.DeviceCache.from_cache(cache, "cpu")
        grids = {hf: split_launch_of(plan_for_cache(q, dc, num_splits=2, heads_fast=hf)[0]).grid
                 for hf in (None, True, False)}
        assert grids[True][:2] == (2, 3) and grids[False][:2] == (3, 2), grids
        assert grids[None] == grids[page_size == 1], (page_size, grids)
        if page_size == 1:
            out, lse, _ = _run_decode(cache, q, num_splits=2, heads_fast=True)
            out1, lse1, _ = _run_decode(cache, q, num_splits=2, heads_fast=False)
            assert np.array_equal(out, out1) and np.array_equal(lse, lse1), pair[0]


def test_nvfp4_q_rows_load_by_page_size():
    """NVFP4 by value words and channel halves (4 query heads per KV head, head_dim 128) reads q's block rows
    contiguously in pages of more than one token and at a stride of 2 in pages of one (H100, session 44: at page
    size 1 the contiguous load lost, 160.4 -> 168.5 us; ANALYSIS 288); fp4_e2m1's transposed load is the same at
    both page sizes. Planned on the CPU: the launch's constexpr ``QLD``."""
    rng = np.random.default_rng(77)
    q = torch.from_numpy(rng.standard_normal((3, 8, 128)).astype(np.float32)).to(torch.bfloat16)
    for kind, want in (("nvfp4", {1: 0, 16: 2}), ("fp4_e2m1", {1: 1, 16: 1})):
        for page_size in (1, 16):
            cache, _ = build_cache((kind, {}, kind, {}), dict(SMALL, head_dim=128, q_heads=8, page_size=page_size),
                                   rng)
            dc = tb.DeviceCache.from_cache(cache, "cpu")
            split = split_launch_of(plan_for_cache(q, dc)[0])
            assert split.constexprs["BLK"] and split.constexprs["VW"] and split.constexprs["HALF_V"], kind
            assert split.constexprs["QLD"] == want[page_size], (kind, page_size, split.constexprs["QLD"])


@pytest.mark.parametrize("code", [None, 0])
def test_page_ids_ahead_with_the_e8m0_check_same_bits(code):
    """fp4_e2m1 by value words and channel halves (4 query heads per KV head, head_dim 128), whose default reads the
    page ids ahead in the loop over bare E8M0 exponent fields and in the step in the rerun that a scale code 0 or 255
    triggers (``e8m0_tile_check``): the same bits as the page ids read in the step throughout, with every code in
    1 .. 254 and with code 0 (2**-127) planted in every V block of sequence 2's KV head 1, whose splits then rerun:
    their query heads' outputs are nonzero (the bare field, +0.0, would give zeros there). Planted bugs fail it: each
    next tile's rows read for the current tile again (no code 0 appears, so no rerun hides it); the rerun skipped."""
    rng = np.random.default_rng(76)
    cache, _ = build_cache(("fp4_e2m1", {}, "fp4_e2m1", {}), dict(SMALL, head_dim=128, q_heads=8), rng)
    q = torch.from_numpy(rng.standard_normal((3, 8, 128)).astype(np.float32)).to(torch.bfloat16)
    b, kvh = 2, 1
    if code is not None:
        for t in range(int(cache.seq_lens[b])):
            page, off = divmod(int(cache.slot_mapping(b, t, 1)[0]), cache.page_size)
            cache.v.storage["scales"][page, off, kvh] = code
    kw = dict(num_splits=2, num_stages=3, e8m0_tile_check=True, wide_scale_loads=True)
    for layout in ("NHD", "HND"):
        dc = tb.DeviceCache.from_cache(cache, DEVICE).with_layout(layout)
        out, lse = (x.cpu().numpy() for x in tb.decode(q.to(DEVICE), dc, page_ids_ahead=False, **kw))
        out1, lse1 = (x.cpu().numpy() for x in tb.decode(q.to(DEVICE), dc, page_ids_ahead=True, **kw))
        assert np.array_equal(out, out1) and np.array_equal(lse, lse1), layout
    assert np.isfinite(out1).all()
    if code is not None:  # the rerun's rule for code 0
        assert (out1[b, 4 * kvh: 4 * kvh + 4] != 0).any(axis=-1).all()


@pytest.mark.parametrize("pair", KIVI_WORD_PAIRS, ids=["int4", "int2"])
@pytest.mark.parametrize("pipe", [False, True], ids=["step", "pipelined"])
def test_kivi_key_rows_page_ids_ahead_same_bits(pair, pipe):
    """``page_ids_ahead`` in the KIVI key-rows loop: the tiles' rows and their key groups' rows read from the block
    table one step ahead (with ``kivi_pipeline`` the keys' two tiles ahead of the values) give the same bits as the
    rows read in the step: 32-token tiles inside 32-token pages from a shuffled free list, sequences of one token,
    of a partial last tile and of several tiles, 3 splits (a split's first tile inside a sequence) and code words,
    token-major pages (value scales and zeros as words) and head-major ones (as elements). Without
    ``kivi_pipeline`` each next tile's value zeros are loaded a step ahead too. Planted bugs fail it: the carried next
    rows read one tile too far, the values' rows taken from the keys' tile, this tile's zero term from the next
    tile's zeros (words and elements)."""
    rng = np.random.default_rng(75 + (pair[0] == "int2_kivi"))
    shape = dict(SMALL, q_heads=8, kv_heads=2, head_dim=128, page_size=32, lens=(1, 150, 300))
    cache, _ = build_cache(pair, shape, rng)
    q = torch.from_numpy(4 * rng.standard_normal((3, 8, 128)).astype(np.float32)).to(torch.bfloat16)
    kw = dict(precision="fast", key_rows=True, value_rows=True, kivi_words=True, block_n=32, kivi_pipeline=pipe,
              num_splits=3)
    for layout in ("NHD", "HND"):
        dc = tb.DeviceCache.from_cache(cache, DEVICE).with_layout(layout)
        out, lse = (x.cpu().numpy() for x in tb.decode(q.to(DEVICE), dc, page_ids_ahead=False, **kw))
        out1, lse1 = (x.cpu().numpy() for x in tb.decode(q.to(DEVICE), dc, page_ids_ahead=True, **kw))
        assert np.array_equal(out, out1) and np.array_equal(lse, lse1), layout


def test_fp4_block_rows_pipelines_are_the_measured_choice(monkeypatch):
    """FP4 by block rows, 4 query heads per KV head at head_dim 128, planned on the CPU as for an H200 (session 32):
    NVFP4 by value words and channel halves reads each next tile's page ids one step ahead at 3 stages (batch 32 x
    8,192 152.7 -> 145.6 us), except with pages of one token (166.4 -> 168.7) or where 2 stages are asked for;
    fp4_e2m1's same launch too (157.5 -> 151.7), since session 38 not at page size 1, where the KV heads now sit on
    the grid's fastest axis (H100: 182.1 -> 171.4 us without them; on the H200 without heads_fast they had won,
    168.7 -> 160.5); mxfp4's two-warp block rows at 64-token tiles take 3 stages (149.2 -> 147.0), still with the
    in-step page ids."""
    from kvqref.kernels import decode
    from kvqref.kernels.aot import _hw_formats

    rng = np.random.default_rng(74)
    q = torch.zeros(3, 8, 128, dtype=torch.bfloat16)  # 4 query heads per KV head

    def plan(pair, page_size=16, **kw):
        cache, _ = build_cache(pair, dict(SMALL, head_dim=128, q_heads=8, page_size=page_size), rng)
        dc = tb.DeviceCache.from_cache(cache, "cpu")
        launches, _, _ = plan_for_cache(q, dc, hw_formats=_hw_formats("cuda:90"), **kw)
        split = split_launch_of(launches)
        cx = split.constexprs
        assert cx["BLK"], pair[0]
        return cx["PIDS_AHEAD"], split.options["num_stages"], split.options["num_warps"], cx["BLOCK_N"]

    fp4 = ("fp4_e2m1", {}, "fp4_e2m1", {})
    mx = ("mxfp4", {}, "mxfp4", {})
    with monkeypatch.context() as m:
        m.setattr(decode, "_nvidia_cuda", lambda t: True)
        assert plan(PAIRS[9]) == (True, 3, 1, 32)
        assert plan(PAIRS[9], page_size=1) == (False, 2, 1, 32)
        assert plan(PAIRS[9], num_stages=2) == (False, 2, 1, 32)
        assert plan(PAIRS[9], page_ids_ahead=False) == (False, 2, 1, 32)
        assert plan(fp4) == (True, 3, 1, 32)
        assert plan(fp4, page_size=1) == (False, 2, 1, 32)
        assert plan(fp4, num_stages=2) == (False, 2, 1, 32)
        assert plan(mx) == (False, 3, 2, 64)
        assert plan(mx, page_ids_ahead=True) == (True, 3, 2, 64)


@pytest.mark.parametrize("precision", ["fast", "exact"])
@pytest.mark.parametrize("pair", [PAIRS[5], PAIRS[6], PAIRS[9]], ids=[IDS[5], IDS[6], IDS[9]])
def test_two_axis_fp4_tiles_equal_the_reshaped_ones(pair, precision):
    """``fp4_tiles_2d=True`` (each code byte's block scale code shifted out of its token's scale word, tiles
    [bytes, tokens] / [tokens, bytes]) gives the same bits as the reshaped [blocks, bytes, tokens] tiles, per element
    (no block rows), E8M0 and E4M3 scales, head_dim 128 (8-byte words) and 64 (4-byte words), ragged lengths (masked
    tails), both precisions, and meets the oracle's bound. A planted wrong block index (byte j // (bytes per
    block * 2)) fails it."""
    rng = np.random.default_rng(62)
    for hd in (128, 64) if pair[0] != "mxfp4" else (128,):  # (mxfp4's blocks of 32: 2 scale bytes at 64, no word)
        cache, _ = build_cache(pair, dict(SMALL, head_dim=hd), rng)
        q = torch.from_numpy(rng.standard_normal((3, 4, hd)).astype(np.float32))
        kw = dict(precision=precision, block_rows=False, wide_scale_loads=True)
        out2, lse2, _ = _run_decode(cache, q, fp4_tiles_2d=True, **kw)
        out3, lse3, _ = _run_decode(cache, q, fp4_tiles_2d=False, **kw)
        assert np.array_equal(out2, out3) and np.array_equal(lse2, lse3), hd
        ref_out, ref_lse, tol_o, tol_l = _oracle(cache, q.numpy().astype(np.float64), precision, "float32")
        assert (np.abs(out2 - ref_out) <= tol_o).all() and (np.abs(lse2 - ref_lse) <= tol_l).all(), hd


def test_bf16_launch_is_the_measured_choice(monkeypatch):
    """Fast bf16 on NVIDIA GPUs: 128-token tiles, 4 warps, 3 stages and the fewest splits that fill whole waves of 2
    programs (H100, session 19: batch 32 x 8,192 375.8 -> 370.3 us at one split, which writes the output itself;
    48 x 8,192 at 2 splits, batch 1 x 131,072 at 32); in exact mode and off NVIDIA the 64-token, 2-warp launch
    (planned on the CPU as for a GPU of 4 multiprocessors)."""
    from kvqref.kernels import decode
    from kvqref.kernels.decode import BF16_WIDE

    rng = np.random.default_rng(58)
    cache, _ = build_cache(PAIRS[0], SMALL, rng)  # 3 sequences x 2 KV heads: 6 pairs
    dc = tb.DeviceCache.from_cache(cache, "cpu")
    q = torch.zeros(3, 4, 64, dtype=torch.bfloat16)

    def split_launch(**kw):
        launches, _, _ = plan_for_cache(q, dc, **kw)
        sp = split_launch_of(launches)
        return (sp.constexprs["BLOCK_N"], sp.options["num_warps"], sp.options["num_stages"]), sp.grid[2], len(launches)

    assert split_launch()[0] == (64, 2, 2)  # not an NVIDIA GPU
    monkeypatch.setattr(decode, "_nvidia_cuda", lambda t: True)
    assert split_launch() == (BF16_WIDE, 1, 1)  # 6 programs in a wave of 8: one split, no merge launch
    assert split_launch(max_seq_len=3000)[1:] == (4, 2)  # 1-3 splits fill 75% of their last wave, 4 splits 100%
    assert split_launch(precision="exact")[0] != BF16_WIDE
    one, _ = build_cache(PAIRS[0], dict(SMALL, batch=1, lens=(37,)), rng)  # 2 pairs in a wave of 8: 4 splits
    d1 = tb.DeviceCache.from_cache(one, "cpu")
    launches, _, _ = plan_for_cache(q[:1], d1, max_seq_len=4 * 4 * 128)
    assert launches[0].constexprs["BLOCK_N"] == 128 and launches[0].grid[2] == 4


@given(batch=st.integers(1, 32), kv_heads=st.sampled_from([1, 2, 4, 8]), tokens=st.integers(1, 300_000),
       block_n=st.sampled_from([32, 64, 128]), waves_of=st.integers(1, 16), sms=st.sampled_from([4, 78, 132]))
@settings(max_examples=200, deadline=None)
def test_wave_tiles_split_count_is_the_fewest_tile_steps(batch, kv_heads, tokens, block_n, waves_of, sms):
    """``choose_splits(wave_tiles=True)`` (one candidate per wave count, for a planner called per decode step) takes
    the split count that a search over every count from 1 to the default's would: the fewest tile steps
    ``ceil(programs / wave) * ceil(tokens per split / block_n)``, the fewest splits among equals."""
    from kvqref.kernels.decode import choose_splits, whole_tile_splits

    pairs, wave = batch * kv_heads, waves_of * sms
    cap = min(max(1, -(-16 * sms // pairs)), max(1, -(-tokens // (4 * block_n))))

    def tile_steps(split):  # of a (splits, tokens per split) pair
        return -(-(split[0] * pairs) // wave) * -(-split[1] // block_n)

    def steps(splits):  # the search's key: tile steps, then splits
        split = whole_tile_splits(tokens, splits, block_n)
        return tile_steps(split), split[0]

    best = whole_tile_splits(tokens, min(range(1, cap + 1), key=steps), block_n)
    got = choose_splits(batch, kv_heads, tokens, block_n, sms, waves_of=waves_of, wave_tiles=True)
    assert tile_steps(got) == tile_steps(best) and got[0] <= best[0], (got, best)


def test_split_counts_are_the_measured_choices():
    """About 16 programs per multiprocessor by default; one wave of programs for the KIVI key-rows kernel, which
    holds 2 per multiprocessor (session 10, H100: batch 32 x 8,192 1 split 321 us against 353 us for 8; batch 1
    x 131,072 32 splits 172 us against 236 us for 256; bench/results/history/ab-h100-session10-hnd-splits.log)."""
    from kvqref.kernels.decode import (
        BF16_TWO_WARP_RESIDENT,
        BF16_WIDE,
        BF16_WIDE_RESIDENT,
        E8M0_TWO_WARP_MAXNREG,
        KEY_ROWS_RESIDENT,
        KIVI_KEY_ROWS_MAXNREG,
        TWO_WARP_MAXNREG,
        TWO_WARP_RESIDENT,
        WORDS_HALVES_RESIDENT,
        choose_splits,
        key_rows_resident,
        two_warp_resident,
    )

    assert choose_splits(32, 8, 8192, 128, 132) == (8, 1024)  # 9 wanted, whole tiles per split
    assert choose_splits(1, 8, 131072, 128, 132) == (256, 512)  # at least 4 tiles per split
    assert KEY_ROWS_RESIDENT == 2
    assert choose_splits(32, 8, 8192, 128, 132, resident=2) == (1, 8192)
    assert choose_splits(1, 8, 131072, 128, 132, resident=2) == (32, 4096)
    assert choose_splits(64, 8, 16384, 128, 132, resident=2) == (1, 16384)  # more programs than a wave: 1 split
    # 3 resident (2-bit KIVI words at 168 registers, session 14, H100: batch 32 3 splits 215 us against 233 / 267 /
    # 233 for 1 / 2 / 4; batch 1 49 splits 114.5 us against 137 / 151 for 33 / 66): the fewest splits whose last
    # wave of 396 programs is at least 95% full
    assert choose_splits(32, 8, 8192, 128, 132, resident=3) == (3, 2816)  # 768 programs: 1.94 waves
    assert choose_splits(1, 8, 131072, 128, 132, resident=3) == (49, 2688)  # 48 wanted gives 47 by whole tiles
    assert choose_splits(8, 8, 32768, 128, 132, resident=3) == (6, 5504)
    assert key_rows_resident(4, None) == 2 and key_rows_resident(4, KIVI_KEY_ROWS_MAXNREG) == 3
    assert key_rows_resident(4, 255) == 2
    # 2-bit KIVI words at 8 query heads per KV head: 2 warps, twice the programs resident (session 27, H200: 8 x
    # 32,768 344 -> 242 us at 8 splits, 1 x 131,072 188 -> 139 at 64, 64 x 16,384 1,300 -> 874 at 1)
    assert key_rows_resident(2, None) == 4
    assert choose_splits(8, 8, 32768, 64, 132, resident=4) == (8, 4096)
    assert choose_splits(1, 8, 131072, 64, 132, resident=4) == (63, 2112)
    assert choose_splits(64, 8, 16384, 64, 132, resident=4) == (1, 16384)
    # one-warp FP4 value words by halves: the default's programs rounded to whole waves of 12 per multiprocessor
    # (session 12, H100: batch 1 x 131,072 nvfp4 114 -> 94 us, batch 32 x 8,192 184 -> 170)
    assert choose_splits(1, 8, 131072, 32, 132, waves_of=12) == (196, 672)  # 2,112 programs -> 1 wave: 198 wanted
    assert choose_splits(32, 8, 8192, 32, 132, waves_of=12) == (6, 1376)  # 2,304 -> 1 wave (1,584): 6
    assert choose_splits(128, 8, 4096, 32, 132, waves_of=12) == (3, 1376)  # 3,072 -> 2 waves: 3, as the default
    assert choose_splits(1, 8, 131072, 32, 132) == (256, 512)
    # FP8 and mxfp4 at 2 warps with fewer KV pairs than multiprocessors: whole waves of 6, rounded down (batch 1 x
    # 131,072 fp8 132 -> 121 us; rounded to the nearest, 3 waves, 297 splits: 172)
    assert choose_splits(1, 8, 131072, 32, 132, waves_of=6, down=True) == (196, 672)  # 2,112 programs -> 2 waves
    assert choose_splits(1, 8, 131072, 32, 132, waves_of=6) == (293, 448)  # -> 3 waves, the measured loss
    assert choose_splits(8, 8, 32768, 32, 132, waves_of=6, down=True) == (24, 1376)
    # the planner's rule for them since session 44 (``wave_tiles``): the fewest tile steps, whole waves times tiles per
    # split, the fewest splits among equals (H100: mxfp4, 6 resident, 64-token tiles, batch 1 x 131,072 83.0 -> 76.6
    # us at 98 splits, 8 x 32,768 141.1 -> 134.7 at 12, 16 x 8,192 82.2 -> 78.0 at 6; FP8, 8 resident, 32-token
    # tiles, batch 1 114.8 -> 110.0 at 128, 8 x 32,768 203.8 -> 200.4 at 16)
    assert choose_splits(1, 8, 131072, 64, 132, waves_of=6, down=True, wave_tiles=True) == (98, 1344)  # 1 wave x 21
    assert choose_splits(1, 8, 131072, 64, 132, waves_of=6, down=True) == (187, 704)  # 2 waves x 11: the loss
    assert choose_splits(8, 8, 32768, 64, 132, waves_of=6, down=True, wave_tiles=True) == (12, 2752)
    assert choose_splits(16, 8, 8192, 64, 132, waves_of=6, down=True, wave_tiles=True) == (6, 1408)
    assert choose_splits(1, 8, 131072, 32, 132, waves_of=8, down=True, wave_tiles=True) == (128, 1024)
    assert choose_splits(8, 8, 32768, 32, 132, waves_of=8, down=True, wave_tiles=True) == (16, 2048)
    # mxfp4 by block rows at 2 warps (64-token tiles, 8 resident at TWO_WARP_MAXNREG) with at least as many KV pairs
    # as multiprocessors: the fewest splits that fill whole waves, where that is fewer than the default (session 22,
    # H100: batch 32 x 8,192 169.1 -> 163.1 us at 4 splits instead of 9, 64 x 8,192 321.7 -> 312.5 at 2 instead of
    # 5, 128 x 4,096 327.4 -> 315.0 at 1 instead of 3)
    assert two_warp_resident(TWO_WARP_MAXNREG) == 8
    assert choose_splits(32, 8, 8192, 64, 132) == (9, 960)
    assert choose_splits(32, 8, 8192, 64, 132, resident=8) == (4, 2048)  # 1,024 programs: 0.97 waves
    assert choose_splits(64, 8, 8192, 64, 132, resident=8) == (2, 4096)
    assert choose_splits(128, 8, 4096, 64, 132, resident=8) == (1, 4096)
    rng = np.random.default_rng(4)
    cache, _ = build_cache(PAIRS[7], SMALL, rng)  # fast KIVI: key rows by default
    dc = tb.DeviceCache.from_cache(cache, DEVICE)
    q = torch.zeros(SMALL["batch"], SMALL["q_heads"], SMALL["head_dim"], device=DEVICE)

    launches, _, _ = plan_for_cache(q, dc, max_seq_len=65536, residual=dc.residual)
    split = next(launch for launch in launches if "KR" in launch.constexprs)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count if GPU else 4
    bn, shape = split.constexprs["BLOCK_N"], (SMALL["batch"], SMALL["kv_heads"], 65536)
    want = choose_splits(*shape, bn, sms, resident=2)[0]
    assert want != choose_splits(*shape, bn, sms)[0]
    # the paged splits; the residual window's split has its own launch with key rows (``residual_launch``)
    assert split.constexprs["KR"] and split.constexprs["PART"] == 1 and split.grid[2] == want
    # 2-bit KIVI code words at 2 query heads per KV head: 2 warps uncapped (session 33, H200, with the value products
    # one chunk per warp: 205.8 -> 184.7 us at batch 32 x 8,192 against 4 warps capped at 168 registers); an explicit
    # 4 warps keeps the cap on NVIDIA GPUs (3 programs per multiprocessor), not elsewhere
    cache, _ = build_cache(PAIRS[8], dict(SMALL, head_dim=128), rng)
    dc = tb.DeviceCache.from_cache(cache, DEVICE)
    q = torch.zeros(SMALL["batch"], SMALL["q_heads"], 128, dtype=torch.bfloat16, device=DEVICE)
    nvidia = GPU and not getattr(torch.version, "hip", None)
    for warps, cap, resident in ((None, None, key_rows_resident(2, None)),
                                 (4, KIVI_KEY_ROWS_MAXNREG if nvidia else None, 3 if nvidia else 2)):
        launches, _, _ = plan_for_cache(q, dc, max_seq_len=65536, residual=dc.residual, num_warps=warps)
        split = next(launch for launch in launches if "KR" in launch.constexprs)
        assert split.constexprs["KW"] and split.options.get("maxnreg") == cap, warps
        assert split.options["num_warps"] == (warps or 2)
        assert split.grid[2] == choose_splits(SMALL["batch"], SMALL["kv_heads"], 65536, split.constexprs["BLOCK_N"],
                                              sms, resident=resident)[0], warps
    # ... at 1 query head per KV head: 2 warps in head-major pages (216.7 -> 194.4 us), 4 capped in token-major ones
    # (2 warps lost there: 292.9 -> 311.6; session 33)
    q1 = q[:, ::2]
    for layout, warps in (("NHD", 4), ("HND", 2)):
        lc = dc.with_layout(layout)
        launches, _, _ = plan_for_cache(q1, lc, max_seq_len=65536, residual=lc.residual)
        split = next(launch for launch in launches if "KR" in launch.constexprs)
        assert split.constexprs["KW"] and split.options["num_warps"] == warps, layout
        assert split.options.get("maxnreg") == (KIVI_KEY_ROWS_MAXNREG if nvidia and warps == 4 else None), layout
    # ... at 4 query heads per KV head: 2 warps, no cap, 4 programs per multiprocessor (session 28, H200: batch 32 x
    # 8,192 205.4 -> 193.8 us, 128 x 4,096 442.8 -> 382.9); 4-bit words keep 4 warps (237.2 -> 278.7 at 2)
    for pair, warps in ((KIVI_WORD_PAIRS[1], 2), (KIVI_WORD_PAIRS[0], 4)):
        cache, _ = build_cache(pair, dict(SMALL, q_heads=8, head_dim=128, page_size=32), rng)
        dc = tb.DeviceCache.from_cache(cache, DEVICE)
        q = torch.zeros(SMALL["batch"], 8, 128, dtype=torch.bfloat16, device=DEVICE)
        launches, _, _ = plan_for_cache(q, dc, max_seq_len=65536, residual=dc.residual)
        split = next(launch for launch in launches if "KR" in launch.constexprs)
        assert split.constexprs["KW"] and split.constexprs["BLOCK_H"] == 16, pair[0]
        assert (split.options["num_warps"], split.options.get("maxnreg")) == (warps, None), pair[0]
        assert split.grid[2] == choose_splits(SMALL["batch"], SMALL["kv_heads"], 65536, split.constexprs["BLOCK_N"],
                                              sms, resident=key_rows_resident(warps, None))[0], pair[0]
    # 8 query heads per KV head (KIVI groups of 32, head_dim 128): value rows of 32 beside key rows at 64-token
    # tiles; 4-bit codes as bytes, 2-bit as words, both at 2 warps uncapped, 4 programs per multiprocessor (session
    # 17, H100, 64 q / 8 KV heads x 16,384: int4 2,379 -> 1,047-1,070 us, int2 1,914 -> 1,274; session 27, H200, 2
    # warps instead of 4: int2 1,315 -> 883, int4 1,038 -> 941); an explicit 4 warps keeps int4's register cap
    g32 = {"group_size": 32, "residual": 32}
    int2_g32 = ("int2_kivi", {"role": "key", **g32}, "int2_kivi", {"role": "value", **g32})
    for pair, words, cap, warps in ((KIVI_WORD_PAIRS[0], False, None, 2), (int2_g32, True, None, 2),
                                    (KIVI_WORD_PAIRS[0], False, KIVI_KEY_ROWS_MAXNREG, 4)):
        cache, _ = build_cache(pair, dict(SMALL, q_heads=16, kv_heads=2, head_dim=128, page_size=32), rng)
        dc = tb.DeviceCache.from_cache(cache, DEVICE)
        q = torch.zeros(SMALL["batch"], 16, 128, dtype=torch.bfloat16, device=DEVICE)
        launches, _, _ = plan_for_cache(q, dc, max_seq_len=65536, num_warps=None if warps == 2 else warps)
        cx = next(launch for launch in launches if "KR" in launch.constexprs)
        assert (cx.constexprs["KR"], cx.constexprs["HV"], cx.constexprs["BLOCK_H"], cx.constexprs["BLOCK_N"]) == (
            True, 8, 32, 64) and cx.constexprs["KW"] is words, pair[0]
        assert cx.options.get("maxnreg") == (cap if nvidia else None), pair[0]
        assert cx.options["num_warps"] == warps, pair[0]
        resident = key_rows_resident(warps, cap if nvidia else None)
        assert cx.grid[2] == choose_splits(SMALL["batch"], 2, 65536, 64, sms, resident=resident)[0], pair[0]
    cache, _ = build_cache(PAIRS[9], dict(SMALL, q_heads=8, kv_heads=2, head_dim=128), rng)  # NVFP4 value words
    dc = tb.DeviceCache.from_cache(cache, DEVICE)  # by halves: whole waves
    q = torch.zeros(SMALL["batch"], 8, 128, dtype=torch.bfloat16, device=DEVICE)
    launches, _, _ = plan_for_cache(q, dc, max_seq_len=65536)
    split = next(launch for launch in launches if "BLK" in launch.constexprs)
    assert split.constexprs["VW"] and split.constexprs["HALF_V"] and split.options["num_warps"] == 1
    want = choose_splits(SMALL["batch"], 2, 65536, 32, sms, waves_of=WORDS_HALVES_RESIDENT)[0]
    assert WORDS_HALVES_RESIDENT == 12 and want != choose_splits(SMALL["batch"], 2, 65536, 32, sms)[0]
    assert split.grid[2] == want
    # FP8 and bf16 at 2 warps with at least as many KV pairs as multiprocessors: the fewest splits that fill whole
    # waves of 6 (FP8) or 5 (bf16) per multiprocessor, where fewer than the default (session 15, H100: fp8 batch 32
    # 220.7 -> 214.3 us, 64 x 8,192 452.2 -> 409.9; bf16 batch 32 385.0 -> 376.5; bf16 batch 128 kept at 3)
    assert BF16_TWO_WARP_RESIDENT == 5
    assert choose_splits(32, 8, 8192, 32, 132, resident=6) == (3, 2752)  # the default: 9
    assert choose_splits(64, 8, 8192, 32, 132, resident=6) == (3, 2752)  # the default: 5
    assert choose_splits(32, 8, 8192, 64, 132, resident=5) == (5, 1664)  # the default: 9
    assert choose_splits(128, 8, 4096, 64, 132, resident=5)[0] == 5 > choose_splits(128, 8, 4096, 64, 132)[0] == 3
    # FP8 and mxfp4 block rows at 2 warps on NVIDIA GPUs: registers capped at 128, 8 programs per multiprocessor
    # (session 16, H100: fp8 batch 32 213.7 -> 206.9 us at 4 splits, 128 x 4,096 417.1 -> 395.6 at 1, 64 x 8,192
    # 409.3 -> 391.5 at 2; mxfp4 batch 32 167.6 -> 161.2 at the default 9)
    assert TWO_WARP_MAXNREG == 128 and two_warp_resident(TWO_WARP_MAXNREG) == 8
    assert two_warp_resident(None) == TWO_WARP_RESIDENT == 6 and two_warp_resident(168) == 6
    assert choose_splits(32, 8, 8192, 32, 132, resident=8) == (4, 2048)  # 1,024 programs: 0.97 of a wave of 1,056
    assert choose_splits(64, 8, 8192, 32, 132, resident=8) == (2, 4096)
    assert choose_splits(128, 8, 4096, 32, 132, resident=8) == (1, 4096)
    assert choose_splits(1, 8, 131072, 32, 132, waves_of=8, down=True) == (256, 512)  # 2,112 programs -> 2 waves
    for batch, pair in ((1, PAIRS[1]), (4, PAIRS[1]), (64, PAIRS[1]), (128, PAIRS[1]), (128, PAIRS[0]),
                        (1, ("mxfp4", {}, "mxfp4", {}))):
        cache, _ = build_cache(pair, dict(SMALL, batch=batch, lens=(5,) * batch, q_heads=8, kv_heads=2, head_dim=128),
                               rng)
        dc = tb.DeviceCache.from_cache(cache, DEVICE)
        q = torch.zeros(batch, 8, 128, dtype=torch.bfloat16, device=DEVICE)
        long = 262144  # long enough that no split count is capped by the 4 tiles per split (132 multiprocessors)
        launches, _, _ = plan_for_cache(q, dc, max_seq_len=long)
        split = next(launch for launch in launches if "BLK" in launch.constexprs)
        if nvidia and pair[0] == "bf16":  # the 4-warp launch and its waves of 2 (session 19)
            assert (split.constexprs["BLOCK_N"], split.options["num_warps"], split.options["num_stages"]) == BF16_WIDE
            assert split.grid[2] == choose_splits(batch, 2, long, BF16_WIDE[0], sms, BF16_WIDE_RESIDENT)[0]
            continue
        assert split.options["num_warps"] == 2
        cap = TWO_WARP_MAXNREG if nvidia and pair[0] != "bf16" else None  # (bf16 lost at 128 and 144 registers)
        if nvidia and pair[0] == "mxfp4":  # with the E8M0 tile check (session 41): 168 registers, 6 resident
            assert split.constexprs["E8M0_CHECK"] and split.constexprs["EV16"]
            cap = E8M0_TWO_WARP_MAXNREG
        assert split.options.get("maxnreg") == cap, (batch, pair[0])
        few = batch * 2 < sms  # fewer KV pairs than multiprocessors: the fewest tile steps by whole waves
        bn = split.constexprs["BLOCK_N"]
        rule = dict(waves_of=two_warp_resident(cap), down=True, wave_tiles=True) if few and pair[0] != "bf16" else {}
        want = choose_splits(batch, 2, long, bn, sms, **rule)[0]
        if not few:  # whole waves of resident programs, where fewer splits
            fill = choose_splits(batch, 2, long, bn, sms, two_warp_resident(cap) if pair[0] != "bf16" else
                                 BF16_TWO_WARP_RESIDENT)[0]
            assert fill < want or not GPU or batch < 128, (batch, pair[0])  # 256 pairs on a GPU: fewer splits
            want = min(want, fill)
        assert split.grid[2] == want, (batch, pair[0])
        if few and cap is None:  # (8 resident: the default's 16 per multiprocessor are whole waves already)
            assert split.grid[2] != choose_splits(batch, 2, long, bn, sms)[0]
    # FP4 without block rows (8 query heads per KV head: 64 rows) at 2 warps: the same rule with 6 resident (session 15,
    # H100: nvfp4 at 64 query heads x 16,384 1021.1 -> 982.0 us, 32 x 64 heads x 8,192 280.1 -> 261.3)
    cache, _ = build_cache(PAIRS[9], dict(SMALL, batch=128, lens=(5,) * 128, q_heads=16, kv_heads=2, head_dim=128), rng)
    dc = tb.DeviceCache.from_cache(cache, DEVICE)
    q = torch.zeros(128, 16, 128, dtype=torch.bfloat16, device=DEVICE)
    launches, _, _ = plan_for_cache(q, dc, max_seq_len=262144)
    split = next(launch for launch in launches if "BLK" in launch.constexprs)
    assert not split.constexprs["BLK"] and split.options["num_warps"] == 2
    bn = split.constexprs["BLOCK_N"]
    fill = choose_splits(128, 2, 262144, bn, sms, TWO_WARP_RESIDENT)[0]
    assert split.grid[2] == min(fill, choose_splits(128, 2, 262144, bn, sms)[0])
    assert fill < choose_splits(128, 2, 262144, bn, sms)[0] or not GPU
    assert split.options.get("maxnreg") is None  # (the cap is for FP8 and mxfp4 block rows)


@pytest.mark.parametrize("nvidia", [False, True])
def test_write_layout_defaults_are_the_measured_choices(nvidia, monkeypatch):
    """Write layouts the H100 A/Bs of session 7 chose (bench/results/ANALYSIS.md): on NVIDIA GPUs NVFP4 writes of
    bfloat16 input with whole blocks per thread (85.3 -> 70.8 us), 4-bit KIVI keys of head_dim 128 by 64-channel
    blocks, one warp, stores as loaded (92.6 -> 82.4 us); 2-bit keys (no gain) and head_dim 64 keep whole heads;
    elsewhere neither; session 14: NVFP4 whole blocks at 2 warps (74.1 -> 70.1 us), whole-head keys at <= 96
    registers. Session 23: KIVI by float16 pairs (NVIDIA's default) takes whole heads at 2 warps and
    WRITE_MAXNREG_KIVI_X2_KEYS registers (int4 keys 81.6 -> 71.1 us); session 41: int2 keys by pairs uncapped
    (WRITE_MAXNREG_KIVI_X2_INT2_KEYS, 65.2 -> 62.3 us); the layouts above are those of ``kivi_f16x2=False``.
    Planned only (``_nvidia_gpu`` stands in for the device, FP8 encoding by integers); an explicit choice wins."""
    from kvqref.paged import PagedKVCache

    monkeypatch.setattr(tb, "_nvidia_gpu", lambda device: nvidia)
    slots = torch.full((16,), -1, device=DEVICE)
    for name, head_dim, chosen in (("int4_kivi", 128, (64, 1, True)), ("int4_kivi", 64, None),
                                   ("int2_kivi", 128, None)):
        k, v = (schemes.get(name, role=r, group_size=16, residual=0) for r in ("key", "value"))
        dc = tb.DeviceCache.from_cache(PagedKVCache(k, v, 2, 16, 8, head_dim), DEVICE)
        x = torch.zeros(16, 8, head_dim, device=DEVICE)
        x2 = tb.plan_write(dc.k, x, slots, hw_fp8=False)
        assert x2.constexprs["KIVI_X2"] is nvidia and x2.constexprs["BLOCK_D"] == 0, (name, head_dim)
        assert x2.options["num_warps"] == tb.WRITE_WARPS_KIVI_KEYS, (name, head_dim)
        key_cap = tb.WRITE_MAXNREG_KIVI_X2_INT2_KEYS if name == "int2_kivi" else tb.WRITE_MAXNREG_KIVI_X2_KEYS
        assert x2.options.get("maxnreg") == (key_cap if nvidia else None), (name, head_dim)
        want = chosen if nvidia else None
        launch = tb.plan_write(dc.k, x, slots, hw_fp8=False, kivi_f16x2=False)
        assert launch.constexprs["BLOCK_D"] == (want[0] if want else 0), (name, head_dim)
        assert launch.options["num_warps"] == (want[1] if want else tb.WRITE_WARPS_KIVI_KEYS), (name, head_dim)
        assert launch.constexprs["STORE_AS_LOADED"] is (want is not None), (name, head_dim)
        # whole heads capped at WRITE_MAXNREG_KIVI_KEYS registers (session 14: int2 keys 86.2 -> 82.8 us)
        cap = tb.WRITE_MAXNREG_KIVI_KEYS if nvidia and chosen is None else None
        assert launch.options.get("maxnreg") == cap, (name, head_dim)
        whole = tb.plan_write(dc.k, x, slots, block_d=head_dim, store_as_loaded=False, hw_fp8=False, kivi_f16x2=False)
        assert whole.constexprs["BLOCK_D"] == 0 and whole.constexprs["STORE_AS_LOADED"] is False
        assert whole.options["num_warps"] == tb.WRITE_WARPS_KIVI_KEYS
        assert tb.plan_write(dc.v, x, slots, hw_fp8=False).constexprs["BLOCK_D"] == 0  # values: per-token statistics
    s = schemes.get("nvfp4")
    dc = tb.DeviceCache.from_cache(PagedKVCache(s, s, 2, 16, 8, 128), DEVICE)
    x = torch.zeros(16, 8, 128, dtype=torch.bfloat16, device=DEVICE)
    launch = tb.plan_write(dc.k, x, slots, hw_fp8=False)
    assert launch.constexprs["NV_BLOCKS"] is nvidia
    assert launch.constexprs["BLOCK_T"] == (tb.NVFP4_BLOCKS_TILE_ELEMS // (8 * 128) if nvidia else 4)
    assert launch.options["num_warps"] == (tb.NVFP4_BLOCKS_WARPS if nvidia else tb.WRITE_WARPS)
    hnd = dc.with_layout("HND")  # head-major pages: 4 tokens x 4 heads
    launch = tb.plan_write(hnd.k, x, slots, hw_fp8=False)
    assert (launch.constexprs["BLOCK_T"], launch.constexprs["BLOCK_H"]) == ((4, 4) if nvidia else (4, 8))
    assert tb.plan_write(dc.k, x, slots, nvfp4_blocks=False, hw_fp8=False).constexprs["NV_BLOCKS"] is False


@pytest.mark.parametrize("nvidia", [False, True])
def test_write_heads_fast_is_the_measured_choice(nvidia, monkeypatch):
    """The head blocks on the write grid's fastest axis (``heads_fast``) by default for unrotated KIVI keys on NVIDIA
    GPUs only (H100, session 24: int4 keys 71.1 -> 69.0 us, int2 68.2 -> 66.8; KIVI values, rotated writes and the
    other kinds unchanged); the grid is then (head blocks, token blocks). More than 65,535 token blocks: off by default,
    ValueError if asked for. Planned only."""
    from kvqref.paged import PagedKVCache

    monkeypatch.setattr(tb, "_nvidia_gpu", lambda device: nvidia)
    x = torch.zeros(64, 8, 128, device=DEVICE)
    slots = torch.full((64,), -1, device=DEVICE)
    k, v = (schemes.get("int2_kivi", role=r, group_size=32, residual=0) for r in ("key", "value"))
    dc = tb.DeviceCache.from_cache(PagedKVCache(k, v, 2, 32, 8, 128), DEVICE)
    keys = tb.plan_write(dc.k, x, slots, hw_fp8=False)
    assert keys.constexprs["HEADS_FAST"] is nvidia
    assert keys.grid[:2] == ((8, 2) if nvidia else (2, 8))
    assert tb.plan_write(dc.v, x, slots, hw_fp8=False).constexprs["HEADS_FAST"] is False
    assert tb.plan_write(dc.k, x, slots, hw_fp8=False, heads_fast=False).grid[:2] == (2, 8)
    rk = schemes.get("int2_kivi", role="key", group_size=32, residual=0, rotation="hadamard")
    rdc = tb.DeviceCache.from_cache(PagedKVCache(rk, v, 2, 32, 8, 128), DEVICE)
    assert tb.plan_write(rdc.k, x, slots, hw_fp8=False, rotation_route="gather").constexprs["HEADS_FAST"] is False
    f = schemes.get("fp8_e4m3")
    fdc = tb.DeviceCache.from_cache(PagedKVCache(f, f, 2, 16, 8, 128), DEVICE)
    assert tb.plan_write(fdc.k, x, slots, hw_fp8=False).constexprs["HEADS_FAST"] is False
    big = torch.zeros(65536 * 32 + 32, 1, 16, device=DEVICE)  # 65,537 key groups of 32 tokens
    bdc = tb.DeviceCache.from_cache(PagedKVCache(k, schemes.get("bf16"), 2, 32, 1, 16), DEVICE)
    bslots = torch.full((big.shape[0],), -1, device=DEVICE)
    assert tb.plan_write(bdc.k, big, bslots, hw_fp8=False).constexprs["HEADS_FAST"] is False
    with pytest.raises(ValueError, match="heads_fast"):
        tb.plan_write(bdc.k, big, bslots, hw_fp8=False, heads_fast=True)


@pytest.mark.parametrize("nvidia", [False, True])
def test_write_evict_first_is_the_measured_choice(nvidia, monkeypatch):
    """x loaded with ``evict_first`` by default on NVIDIA GPUs for every write but the unrotated bf16, FP8 and 4-bit
    KIVI value writes (H100, session 24: those measured 0.6-1.2% slower, the others 0.2-3.4% faster); never
    elsewhere; an explicit choice wins. Planned only."""
    from kvqref.paged import PagedKVCache

    monkeypatch.setattr(tb, "_nvidia_gpu", lambda device: nvidia)
    x = torch.zeros(32, 8, 128, device=DEVICE)
    slots = torch.full((32,), -1, device=DEVICE)
    value, key, rot = {"role": "value", "group_size": 32}, {"role": "key", "group_size": 32}, {"rotation": "hadamard"}
    cases = [("bf16", {}, False), ("fp8_e4m3", {}, False), ("fp4_e2m1", {}, True), ("mxfp4", {}, True),
             ("nvfp4", {}, True), ("int4_kivi", value, False), ("int2_kivi", value, True), ("int4_kivi", key, True),
             ("int2_kivi", key, True), ("fp8_e4m3", rot, True), ("int4_kivi", {**value, **rot}, True)]
    for name, opts, want in cases:
        s = schemes.get(name, **opts)
        on_v = opts.get("role") == "value"
        dc = tb.DeviceCache.from_cache(PagedKVCache(schemes.get("bf16") if on_v else s,
                                                    s if on_v else schemes.get("bf16"), 2, 32, 8, 128), DEVICE)
        side = dc.v if on_v else dc.k
        kw = {"rotation_route": "gather"} if "rotation" in opts else {}
        launch = tb.plan_write(side, x, slots, hw_fp8=False, **kw)
        assert launch.constexprs["X_EVICT"] == ("evict_first" if want and nvidia else ""), (name, opts)
        assert tb.plan_write(side, x, slots, hw_fp8=False, x_evict_first=False, **kw).constexprs["X_EVICT"] == ""


@pytest.mark.parametrize("name", ["fp8_e4m3", "int4_kivi", "int2_kivi", "fp4_e2m1"])
def test_write_heads_fast_bytes_equal(name):
    """``heads_fast`` writes the same bytes as the default grid order (KIVI keys one head per program; FP8 and
    rotated FP4 in tiles of heads), ragged tokens and skipped slots included."""
    from kvqref.paged import PagedKVCache

    rng = np.random.default_rng(5)
    opts = {"role": "key", "group_size": 16, "residual": 0} if "kivi" in name else (
        {"rotation": "hadamard", "rotation_seed": 4} if name == "fp4_e2m1" else {})
    s = schemes.get(name, **opts)
    n = 48
    x = torch.from_numpy(rng.standard_normal((n, 4, 64)).astype(np.float32)).to(torch.bfloat16).to(DEVICE)
    slots = torch.from_numpy(rng.permutation(64)[:n].astype(np.int64))
    if "kivi" in name:  # keys: whole groups in consecutive, group-aligned slots, one group skipped
        slots = torch.arange(n, dtype=torch.int64) + 16
        slots[16:32] = -1
    slots = slots.to(DEVICE)
    got = []
    for hf in (False, True):
        dc = tb.DeviceCache.from_cache(PagedKVCache(s, schemes.get("bf16"), 8, 16, 4, 64), DEVICE)
        launch = tb.plan_write(dc.k, x, slots, block_h=1 if "kivi" in name else None, heads_fast=hf)
        assert launch.constexprs["HEADS_FAST"] is hf
        launch()
        got.append([t.clone().view(torch.uint8) if t.element_size() == 1 else t.clone() for t in dc.k.fields.values()])
    assert all(torch.equal(a, b) for a, b in zip(*got, strict=True))
    assert any(t.any() for t in got[0])  # something was written


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp4_e2m1", "mxfp4", "nvfp4", "int4_kivi", "bf16"])
def test_rotated_write_butterfly_default_is_the_measured_choice(name):
    """Rotated writes' butterfly route by default (H100, session 6, rotated / unrotated write time by split/join,
    sums, warp shuffles: fp8 1.44 / 1.42 / 1.22, fp4_e2m1 2.25 / 1.61 / 1.29, nvfp4 2.23 / 1.66 / 1.39, KIVI keys
    1.39 / 2.04 / 1.49; session 20, int4 KIVI values 5.99 / 1.65 / 1.34): warp shuffles for FP8, the FP4 kinds and
    KIVI values on an NVIDIA GPU, and for KIVI keys there too, which are quantized by float16 pairs
    (``ROTATED_KIVI_X2_KEYS_ROUTE``, session 23); elsewhere sums for the FP4 kinds and KIVI values, split/join for the
    rest; an unrotated write has no butterflies."""
    from kvqref.paged import PagedKVCache

    fp4, shuffled = name in ("fp4_e2m1", "mxfp4", "nvfp4"), name.startswith(("fp8", "fp4", "mx", "nv"))
    nvidia = GPU and not getattr(torch.version, "hip", None)
    want = "shfl" if (shuffled or name.endswith("kivi")) and nvidia else "sums" if fp4 else "split"
    # KIVI values (session 20: split/join 5.99 x the unrotated write, sums 1.65, shuffles 1.34): shuffles on NVIDIA,
    # sums elsewhere
    want_v = "shfl" if nvidia else "sums" if name.endswith("kivi") else want
    kivi = {"group_size": 16, "residual": 0} if name.endswith("kivi") else {}
    for rotated in (False, True):
        rot = {"rotation": "hadamard", "rotation_seed": 3} if rotated else {}
        k, v = (schemes.get(name, **kivi, **rot, **({"role": r} if kivi else {})) for r in ("key", "value"))
        dc = tb.DeviceCache.from_cache(PagedKVCache(k, v, 2, 16, 8, 128), DEVICE)
        x = torch.zeros(16, 8, 128, device=DEVICE)
        for side, side_want in ((dc.k, want), (dc.v, want_v if name.endswith("kivi") else want)):
            launch = tb.plan_write(side, x, torch.full((16,), -1, device=DEVICE))
            route = side_want if rotated else "split"
            assert launch.constexprs["ROT_ROUTE"] == tb.ROTATION_ROUTES[route], (name, rotated, side is dc.v)
            assert launch.constexprs["ROT_SHFL"] is (route == "shfl"), (name, rotated, side is dc.v)


@pytest.mark.parametrize("nvidia", [False, True])
def test_rotated_word_load_default_is_the_measured_choice(nvidia, monkeypatch):
    """Rotated writes load element pairs as 32-bit words by default for NVFP4, 4-bit KIVI keys and values and (session
    21, with tiles of 8,192 elements: 8 tokens x 8 heads here, unless block_t is given) the OCP E8M0 kinds on NVIDIA
    GPUs only (H100, session 20: nvfp4 121.0 -> 110.8 us, int4 keys 127.0 -> 115.5, int4 values 95.0 -> 89.2; session
    21: fp4_e2m1 86.0 -> 82.7, mxfp4 85.9 -> 80.5; 2-bit KIVI lost), only for bfloat16 input at a 4-byte aligned
    address; an explicit choice wins where it applies (FP4 and KIVI kinds), and nothing else takes it. KIVI keys by
    float16 pairs (NVIDIA's default since session 23) load no words unless asked. Planned only
    (``_nvidia_gpu`` stands in for the device; the portable butterflies, so no shuffle lanes are settled)."""
    from kvqref.paged import PagedKVCache

    monkeypatch.setattr(tb, "_nvidia_gpu", lambda device: nvidia)
    slots = torch.full((16,), -1, device=DEVICE)
    buf = torch.zeros(16 * 8 * 128 + 1, dtype=torch.bfloat16, device=DEVICE)
    cases = [("nvfp4", "k", nvidia), ("fp4_e2m1", "k", nvidia), ("mxfp4", "k", nvidia), ("fp8_e4m3", "k", False),
             ("int4_kivi", "k", False), ("int4_kivi", "v", nvidia), ("int2_kivi", "k", False),
             ("int2_kivi", "v", False)]
    for name, side_name, want in cases:
        kivi = {"group_size": 16, "residual": 0} if name.endswith("kivi") else {}
        k, v = (schemes.get(name, rotation="hadamard", rotation_seed=3, **kivi, **({"role": r} if kivi else {}))
                for r in ("key", "value"))
        dc = tb.DeviceCache.from_cache(PagedKVCache(k, v, 2, 16, 8, 128), DEVICE)
        side = dc.k if side_name == "k" else dc.v
        x = buf[:-1].view(16, 8, 128)
        launch = tb.plan_write(side, x, slots, hw_fp8=False, rotation_route="sums")
        assert launch.constexprs["WORD_LOAD"] is want, (name, side_name)
        e8m0_words = want and name in ("fp4_e2m1", "mxfp4")
        cfg = tb.kernel_config(side.scheme)
        assert launch.constexprs["BLOCK_T"] == (8 if e8m0_words else tb.write_tile(cfg["kind"], 8, 128,
                                                                                    cfg.get("group", 1))[0])
        if e8m0_words:  # a given tile wins
            assert tb.plan_write(side, x, slots, hw_fp8=False, rotation_route="sums",
                                 block_t=2).constexprs["BLOCK_T"] == 2
        explicit = tb.plan_write(side, x, slots, hw_fp8=False, rotation_route="sums", word_load=True)
        assert explicit.constexprs["WORD_LOAD"] is (name != "fp8_e4m3"), (name, side_name)
        odd = buf[1:].view(16, 8, 128)  # 2 bytes past a 4-byte boundary: no 32-bit words
        assert tb.plan_write(side, odd, slots, hw_fp8=False, rotation_route="sums",
                             word_load=True).constexprs["WORD_LOAD"] is False, (name, side_name)
        assert tb.plan_write(side, x.float(), slots, hw_fp8=False, rotation_route="sums",
                             word_load=True).constexprs["WORD_LOAD"] is False, (name, side_name)
    s = schemes.get("nvfp4")
    dc = tb.DeviceCache.from_cache(PagedKVCache(s, s, 2, 16, 8, 128), DEVICE)
    assert tb.plan_write(dc.k, buf[:-1].view(16, 8, 128), slots, hw_fp8=False, nvfp4_blocks=False,
                         word_load=True).constexprs["WORD_LOAD"] is False  # unrotated: no butterflies to feed


def test_default_shuffle_route_falls_back_when_the_layout_does_not_fit(monkeypatch):
    """Where the warp-shuffle lanes do not settle against the compiled layout, a defaulted route warns and writes
    by the portable default (the same bytes); an explicit ``rotation_route="shfl"`` raises."""
    from kvqref.paged import PagedKVCache

    calls = []

    def no_fit(*_):  # the first attempt fails, later ones report the cached failure (said once)
        calls.append(1)
        raise tb.LanesUnsettled("planted: no lane run fits", cached=len(calls) > 1)

    import kvqref.kernels.codecs as codecs

    monkeypatch.setattr(tb, "_nvidia_gpu", lambda device: True)
    monkeypatch.setattr(codecs, "INTERPRET", False)  # planned only, never launched
    monkeypatch.setattr(tb, "settle_partner_lanes", no_fit)
    s = schemes.get("fp8_e4m3", rotation="hadamard", rotation_seed=3)
    dc = tb.DeviceCache.from_cache(PagedKVCache(s, s, 2, 16, 8, 128), DEVICE)
    x, slots = torch.zeros(16, 8, 128, device=DEVICE), torch.full((16,), -1, device=DEVICE)
    with pytest.warns(RuntimeWarning, match="rotation_route='split'"):
        launch = tb.plan_write(dc.k, x, slots, hw_fp8=False, f16_cvt=False)
    assert launch.constexprs["ROT_ROUTE"] == tb.ROTATION_ROUTES["split"] and not launch.constexprs["ROT_SHFL"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the cached failure falls back without a second warning
        again = tb.plan_write(dc.k, x, slots, hw_fp8=False, f16_cvt=False)
    assert again.constexprs["ROT_ROUTE"] == tb.ROTATION_ROUTES["split"]
    with pytest.raises(RuntimeError, match="planted"):
        tb.plan_write(dc.k, x, slots, hw_fp8=False, f16_cvt=False, rotation_route="shfl")
