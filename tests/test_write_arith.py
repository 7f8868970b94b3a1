"""The write kernel's arithmetic shortcuts against their definitions, value by value (interpreter or GPU):
the E2M1 encoder and float16 rounding by float arithmetic, and quotients by reciprocal and FMA correction.

The exhaustive proofs are elsewhere (bench/proof_markstein.py; on a GPU bench/ab_write.py also checks the
hardware FP8 conversion on every float32); these tests pin the Triton code itself on every bfloat16 bit
pattern plus random float32 values.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvqref import formats

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
tl = triton.language

from kvqref.kernels import write as w  # noqa: E402
from kvqref.kernels.codecs import (  # noqa: E402
    decode_f32,
    e2m1_pair_bytes,
    e4m3_normal_bits,
    e8m0_to_f32,
    e8m0_words_outside,
    e8m0_words_rare,
    encode_e2m1,
    encode_f32,
    round_f16,
    round_f16_nonneg,
    round_f16_of_bf16,
)

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
pytestmark = pytest.mark.gpu if GPU else pytest.mark.interpret


@triton.jit
def _unary_kernel(X, OUT, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(X + i, mask=m, other=0.0)
    if OP == 0:
        y = encode_e2m1(x, True)
    elif OP == 1:
        y = encode_e2m1(x, False)
    elif OP == 2:
        y = round_f16(x).to(tl.int32, bitcast=True)
    elif OP == 3:
        y = round_f16_nonneg(x).to(tl.int32, bitcast=True)
    elif OP == 5:
        y = round_f16_of_bf16(x).to(tl.int32, bitcast=True)
    elif OP == 6:
        c, v = e4m3_normal_bits(x)
        y = c | ((v == decode_f32(c, 0)).to(tl.int32) << 8)  # the code, and bit 8: its value is the decoded one
    elif OP == 7:
        y = encode_f32(x, 0, True)
    elif OP == 9:
        y = e8m0_to_f32(x.to(tl.int32)).to(tl.int32, bitcast=True)  # x: E8M0 codes as floats
    elif OP == 11:
        y = e8m0_to_f32(x.to(tl.int32), FLOAT_OPS=False).to(tl.int32, bitcast=True)  # the integer rule
    elif OP == 12:
        y = e8m0_to_f32(x.to(tl.int32), BARE=True).to(tl.int32, bitcast=True)  # the bare field (codes 1 .. 254)
    else:
        y = encode_f32(x, 4, True)
    tl.store(OUT + i, y, mask=m)


@triton.jit
def _div_kernel(A, B, OUT, n, STEPS: tl.constexpr, APPROX: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    a = tl.load(A + i, mask=m, other=1.0)
    b = tl.load(B + i, mask=m, other=1.0)
    if APPROX:
        r = 1.0 / b
    else:
        r = tl.math.div_rn(tl.full((BLOCK,), 1.0, tl.float32), b)
    tl.store(OUT + i, w._div_by(a, b, r, STEPS), mask=m)


@triton.jit
def _pair_bytes_kernel(QE, QO, S, OUT, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    qe = tl.load(QE + i, mask=m, other=0.0)
    qo = tl.load(QO + i, mask=m, other=0.0)
    s = tl.load(S + i, mask=m, other=0)  # bit 0: the even element's sign, bit 1: the odd's
    sw = ((s & 1) << 15) | ((s & 2) << 30)
    tl.store(OUT + i, e2m1_pair_bytes(qe, qo, sw).to(tl.int32), mask=m)


def _run(kernel, *arrays, **cx):
    n = arrays[0].size
    ins = [torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE) for a in arrays]
    out = torch.empty(n, dtype=torch.float32 if kernel is _div_kernel else torch.int32, device=DEVICE)
    block = 1 << 14
    kernel[(triton.cdiv(n, block),)](*ins, out, n, BLOCK=block, **cx)
    return out.cpu().numpy()


def _bf16_patterns() -> np.ndarray:
    """Every bfloat16 bit pattern as float32 (NaN and Inf included)."""
    return (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)


def _random_f32(rng, n: int, lo: int, hi: int) -> np.ndarray:
    """Random float32 with random significands and exponents in [lo, hi], both signs."""
    sig = rng.integers(0, 1 << 23, n, dtype=np.uint32)
    ex = rng.integers(lo + 127, hi + 128, n).astype(np.uint32)
    sign = rng.integers(0, 2, n, dtype=np.uint32) << 31
    return (sign | (ex << 23) | sig).view(np.float32)


def test_e2m1_encoder_equals_the_oracle_codec():
    """encode_e2m1 (float arithmetic) against the oracle's E2M1 encoding (saturating) on every bfloat16
    pattern, every float32 in [0, 8) with a 10-bit grid, the E2M1 ties, and random float32."""
    rng = np.random.default_rng(0)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0], np.float32)
    dense = (np.arange(8 << 10, dtype=np.float32) / (1 << 10))
    x = np.concatenate([_bf16_patterns(), dense, -dense, ties, -ties, np.nextafter(ties, 0), np.nextafter(ties, 9),
                        _random_f32(rng, 1 << 15, -30, 100), np.array([-0.0, 0.0], np.float32)])
    e2m1 = formats.get("float4_e2m1fn")
    finite = np.isfinite(x)
    want = e2m1.encode(np.where(finite, x, np.copysign(np.float32(6.0), x)), saturate=True).astype(np.int32)
    got = _run(_unary_kernel, x.astype(np.float32), OP=0)
    assert np.array_equal(got, want), x[got != want][:8]
    assert np.array_equal(_run(_unary_kernel, x, OP=4), want)  # encode_f32(FMT=4) is the same rule
    small = np.abs(x) < 2.0**100
    got_nc = _run(_unary_kernel, x[small], OP=1)  # no clamp: |x| < 2**100
    assert np.array_equal(got_nc, want[small])


def test_e2m1_pair_bytes_equal_the_oracle_codec():
    """e2m1_pair_bytes (NVFP4's fused E2M1 rounding and packing of magnitudes in [0, 7) with the pair's signs)
    against the oracle's E2M1 encoding of the signed values, even element in the low nibble: every float32 in
    [0, 7) on a 2**-12 grid, every bfloat16 value there, the E2M1 ties and their float32 neighbours, random
    float32 (subnormal to 7), +0.0 (-0.0 with the sign bit), each with every sign pair and a shuffled partner."""
    rng = np.random.default_rng(6)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.0, 2.0, 4.0], np.float32)
    b = _bf16_patterns()
    q = np.concatenate([np.arange(7 << 12, dtype=np.float32) / (1 << 12), b[np.isfinite(b) & (b >= 0) & (b < 7)],
                        ties, np.nextafter(ties, 0), np.nextafter(ties, 7), np.nextafter(np.float32(7), 0)[None],
                        np.abs(_random_f32(rng, 1 << 15, -126, 2)) % np.float32(7), np.zeros(4, np.float32),
                        rng.integers(1, 1 << 23, 1 << 10, dtype=np.uint32).view(np.float32)])  # subnormals
    q = np.abs(q).astype(np.float32)  # magnitudes: +0.0 (bfloat16 -0.0 passes the filter)
    qe = np.tile(q, 4)
    qo = np.tile(rng.permutation(q), 4)
    signs = np.repeat(np.arange(4, dtype=np.int32), q.size)
    e2m1 = formats.get("float4_e2m1fn")
    ce = e2m1.encode(np.where(signs & 1, -qe, qe), saturate=True).astype(np.int32)
    co = e2m1.encode(np.where(signs & 2, -qo, qo), saturate=True).astype(np.int32)
    want = ce | (co << 4)
    got = _run(_pair_bytes_kernel, qe, qo, signs)
    bad = got != want
    assert not bad.any(), np.stack([qe[bad], qo[bad], signs[bad], got[bad], want[bad]])[:, :4]


def test_float16_rounding_equals_numpy():
    """round_f16 / round_f16_nonneg (float arithmetic) against NumPy's float32 -> float16 cast (RNE,
    subnormals) on every bfloat16 pattern below 65520 and random float32 over float16's range."""
    rng = np.random.default_rng(1)
    x = np.concatenate([_bf16_patterns(), _random_f32(rng, 1 << 16, -30, 15), np.array([-0.0, 0.0], np.float32)])
    x = x[np.isfinite(x) & (np.abs(x) < 65520)].astype(np.float32)
    want = x.astype(np.float16).astype(np.float32).view(np.int32)
    got = _run(_unary_kernel, x, OP=2)
    assert np.array_equal(got, want), x[got != want][:8]
    pos = x[np.signbit(x) == 0]
    assert np.array_equal(_run(_unary_kernel, pos, OP=3), pos.astype(np.float16).astype(np.float32).view(np.int32))


def test_float16_rounding_of_bfloat16_equals_numpy():
    """round_f16_of_bf16 against NumPy's float32 -> float16 cast on every bfloat16 pattern below 65520 (both
    zeros, subnormals, the float16 subnormal range where it rounds); a float32 input that is not a bfloat16
    value is outside its contract and does differ (the check can fail)."""
    x = _bf16_patterns()
    x = x[np.isfinite(x) & (np.abs(x) < 65520)].astype(np.float32)
    want = x.astype(np.float16).astype(np.float32).view(np.int32)
    got = _run(_unary_kernel, x, OP=5)
    assert np.array_equal(got, want), x[got != want][:8]
    not_bf16 = np.array([1.0 + 2.0**-20], np.float32)
    assert _run(_unary_kernel, not_bf16, OP=5)[0] != not_bf16.astype(np.float16).astype(np.float32).view(np.int32)[0]


def test_e4m3_normal_bits_equal_the_oracle_codec():
    """e4m3_normal_bits (NVFP4's block scales in [2**-6, 448]): codes as the oracle's E4M3FN encoding and
    encode_f32, values as decode_f32, on every bfloat16 value in the range, every code's midpoint and its
    neighbours (+-1 ulp), and random float32 there."""
    rng = np.random.default_rng(4)
    b = _bf16_patterns()
    codes = np.arange(8, 0x7F)
    mids = ((codes.astype(np.int64) + 960) << 20) + (1 << 19)  # float32 bits of the midpoint above each code
    ties = np.concatenate([mids - 1, mids, mids + 1]).astype(np.int32).view(np.float32)
    x = np.concatenate([b, ties, rng.uniform(2.0**-6, 448.0, 1 << 16).astype(np.float32),
                        np.array([2.0**-6, 448.0], np.float32)])
    x = x[np.isfinite(x) & (x >= 2.0**-6) & (x <= 448.0)].astype(np.float32)
    got = _run(_unary_kernel, x, OP=6)
    want = formats.get("float8_e4m3fn").encode(x, saturate=True).astype(np.int32)
    assert np.array_equal(got, want | 256), x[got != (want | 256)][:8]
    assert np.array_equal(_run(_unary_kernel, x, OP=7), want)  # encode_f32, the general encoder


@pytest.mark.parametrize("op", [9, 11], ids=["float-ops", "integer-ops"])
def test_e8m0_decoding_equals_the_oracle_codec_on_every_code(op):
    """e8m0_to_f32 (the kernels' E8M0 block scales), both rules, on all 256 codes: the float32 bits of the oracle's
    E8M0 codec (2**-127 a subnormal for 0x00), NaN for 0xFF."""
    codes = np.arange(256, dtype=np.float32)
    got = _run(_unary_kernel, codes, OP=op)
    want = formats.get("float8_e8m0fnu").decode(np.arange(256)).astype(np.float32)
    assert np.isnan(got.view(np.float32)[255]) and np.isnan(want[255])
    assert np.array_equal(got[:255], want[:255].view(np.int32)), np.nonzero(got[:255] != want[:255].view(np.int32))
    bare = _run(_unary_kernel, codes[1:255], OP=12)  # BARE: the callers' codes lie in 1 .. 254
    assert np.array_equal(bare, want[1:255].view(np.int32))


@triton.jit
def _words_rare_kernel(W, OUT, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(OUT + i, (e8m0_words_rare(tl.load(W + i, mask=m, other=1)) != 0).to(tl.int32), mask=m)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_e8m0_words_rare_flags_exactly_the_words_holding_code_0_or_255(dtype):
    """e8m0_words_rare (the fast FP4 decode's check per tile): nonzero exactly for the 32/64-bit words with a byte
    0x00 or 0xFF, on every byte value at every position among bytes drawn from 1 .. 254 and from the rare codes'
    neighbours (0x01, 0xFE, 0x80, 0x7F), pairs of rare bytes, and random words."""
    rng = np.random.default_rng(8)
    nb = np.dtype(dtype).itemsize
    fill = rng.choice(np.array([1, 2, 0x7F, 0x80, 0xFE, 0xFD], np.uint8), size=(256 * nb * 4, nb))
    fill[::2] = rng.integers(1, 255, size=fill[::2].shape, dtype=np.uint8)
    k = np.arange(fill.shape[0])
    fill[k, (k // 4) % nb] = (k // (4 * nb)) % 256  # every byte value at every position
    pairs = rng.integers(1, 255, size=(4096, nb), dtype=np.uint8)
    pairs[:, 0] = rng.choice(np.array([0, 255, 1, 254], np.uint8), 4096)
    pairs[np.arange(4096), rng.integers(1, nb, 4096)] = rng.choice(np.array([0, 255, 1, 254], np.uint8), 4096)
    words = np.concatenate([fill, pairs, rng.integers(0, 256, size=(1 << 14, nb), dtype=np.uint8)])
    want = ((words == 0) | (words == 255)).any(1).astype(np.int32)
    x = torch.from_numpy(np.ascontiguousarray(words).view(dtype).reshape(-1).copy()).to(DEVICE)
    got = torch.empty(x.numel(), dtype=torch.int32, device=DEVICE)
    _words_rare_kernel[(triton.cdiv(x.numel(), 1024),)](x, got, x.numel(), BLOCK=1024)
    assert np.array_equal(got.cpu().numpy(), want), words[got.cpu().numpy() != want][:4]


@triton.jit
def _words_outside_kernel(W, OUT, n, lo, width, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    lo_t = tl.full((), 0, tl.int32) + lo  # (a tensor even where Triton specializes lo = 1 as a constant)
    out = e8m0_words_outside(tl.load(W + i, mask=m, other=0), lo_t, tl.full((), 0, tl.int32) + width)
    tl.store(OUT + i, (out != 0).to(tl.int32), mask=m)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("lo, width", [(1, 16), (100, 16), (239, 15), (238, 16), (0, 0), (128, 127), (40, 5)])
def test_e8m0_words_outside_flags_exactly_the_words_with_a_byte_outside_the_window(dtype, lo, width):
    """e8m0_words_outside (the window check of ``e8m0_values_f16``): nonzero exactly for the words with a byte
    outside lo .. lo + width: every byte value at every position among bytes inside the window, the window's edges
    and their neighbours at random positions, and random words."""
    rng = np.random.default_rng(lo * 131 + width)
    nb = np.dtype(dtype).itemsize
    inside = np.arange(lo, lo + width + 1)
    fill = rng.choice(inside, size=(256 * nb * 2, nb)).astype(np.uint8)
    k = np.arange(fill.shape[0])
    fill[k, (k // 2) % nb] = (k // (2 * nb)) % 256  # every byte value at every position
    edges = np.array([lo - 1, lo, lo + 1, lo + width - 1, lo + width, lo + width + 1]) % 256
    near = rng.choice(inside, size=(4096, nb)).astype(np.uint8)
    near[np.arange(4096), rng.integers(0, nb, 4096)] = rng.choice(edges, 4096)
    words = np.concatenate([fill, near, rng.integers(0, 256, size=(1 << 12, nb), dtype=np.uint8)])
    want = ((words < lo) | (words > lo + width)).any(1).astype(np.int32)
    assert 0 < want.sum() < len(want) or width == 127
    x = torch.from_numpy(np.ascontiguousarray(words).view(dtype).reshape(-1).copy()).to(DEVICE)
    got = torch.empty(x.numel(), dtype=torch.int32, device=DEVICE)
    _words_outside_kernel[(triton.cdiv(x.numel(), 1024),)](x, got, x.numel(), lo, width, BLOCK=1024)
    assert np.array_equal(got.cpu().numpy(), want), words[got.cpu().numpy() != want][:4]


def _exact_quotient(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """RN32(a / b): the float64 quotient is never within 2**-53 of a float32 midpoint (a / b is not a 25-bit
    number), so rounding it to float32 rounds the exact quotient."""
    return (a.astype(np.float64) / b.astype(np.float64)).astype(np.float32)


def test_quotient_by_reciprocal_equals_ieee_division():
    """_div_by: one step for bfloat16 dividends (every bfloat16 value against random divisors), two steps for
    float32 dividends; quotients within the kernel's domain (|a / b| <= 2**20, normal)."""
    rng = np.random.default_rng(2)
    xb = _bf16_patterns()
    xb = xb[np.isfinite(xb)]
    a = np.tile(xb, 4)
    b = _random_f32(rng, a.size, -60, 60)
    b = np.abs(b)
    want = _exact_quotient(a, b)
    # dividends >= 2**-100 (the remainder stays normal): bit-exact; smaller ones (quotient < 2**-20 for
    # divisors >= 2**-80, a zero code in every format): the sign and the magnitude class are kept
    inside = (np.abs(want) <= 2.0**20) & (np.abs(want) >= 2.0**-126) & (np.abs(a) >= 2.0**-100) | (a == 0)
    got = _run(_div_kernel, a, b, STEPS=1, APPROX=False)
    assert np.array_equal(got[inside].view(np.int32), want[inside].view(np.int32))
    tiny = np.abs(a) < 2.0**-100
    assert (np.signbit(got[tiny]) == np.signbit(want[tiny])).all() and (np.abs(got[tiny]) < 2.0**-20).all()
    a32 = _random_f32(rng, 1 << 17, -40, 40)
    b32 = np.abs(_random_f32(rng, 1 << 17, -40, 40))
    want = _exact_quotient(a32, b32)
    inside = (np.abs(want) <= 2.0**20) & (np.abs(want) >= 2.0**-126) & (np.abs(a32) >= 2.0**-100)
    got = _run(_div_kernel, a32, b32, STEPS=2, APPROX=False)
    assert np.array_equal(got[inside].view(np.int32), want[inside].view(np.int32))


def test_float16_quotient_with_approximate_reciprocal():
    """The KIVI division: RN16(_div_by(d, s, ~1/s, 1)) == RN16(d / s) for float16 d >= 0 and s > 0 (every
    positive float16 d against random float16 divisors; the reciprocal perturbed by up to 2**-21)."""
    rng = np.random.default_rng(3)
    d = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)  # 0 .. 65504
    d = np.tile(d, 4)
    s = np.abs(rng.standard_normal(d.size) * 2.0 ** rng.integers(-20, 8, d.size)).astype(np.float16)
    s = np.where(s == 0, np.float16(1), s).astype(np.float32)
    want = (d.astype(np.float64) / s.astype(np.float64)).astype(np.float16)
    ok = np.isfinite(want)
    got = _run(_div_kernel, d, s, STEPS=1, APPROX=True).astype(np.float16)
    assert np.array_equal(got[ok].view(np.uint16), want[ok].view(np.uint16))


def _zero_minus_x(self, arg):
    """Unary minus as Triton <= 3.6 compiles it: ``0.0 - x`` (so -(+0.0) = +0.0)."""
    from triton.runtime.interpreter import TensorHandle

    return TensorHandle(np.zeros_like(arg.data) - arg.data, arg.dtype.scalar)


def test_quotient_keeps_the_sign_of_zero_and_tiny_dividends(monkeypatch):
    """-0.0 / s = -0.0 (and tiny dividends keep their sign) whatever unary minus does with zeros: Triton 3.6
    compiles ``-x`` to ``0.0 - x`` (PTX ``sub.f32``), which lost the sign of -0.0 quotients on the H100 (FP8
    bytes 0x80 written as 0x00). In the interpreter, unary minus is patched to that rule."""
    from triton.runtime import interpreter

    if not GPU and hasattr(interpreter.InterpreterBuilder, "create_fneg"):
        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fneg", _zero_minus_x)
    a = np.array([-0.0, 0.0, -2.0**-120, 2.0**-120, -1.5, 1.5] * 8, np.float32)
    b = np.full(a.size, 3.0, np.float32)
    for steps in (1, 2):
        got = _run(_div_kernel, a, b, STEPS=steps, APPROX=False)
        assert (np.signbit(got) == np.signbit(a)).all(), (steps, got[:6])
