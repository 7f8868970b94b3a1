"""Quantize-on-write: new K or V tokens [tokens, kv_heads, D] -> codes and scales written into paged slots.

One kernel, the scheme selected by constexprs; the bytes it writes equal ``kvqref.schemes``' oracle
bytes (the tests compare them as integers). Every rounding is either an integer bit operation or IEEE
float32 arithmetic whose result is then rounded once more where the oracle rounds (bfloat16/float16
arithmetic emulated in float32 is exact: 24 >= 2p + 2).

One program quantizes a tile ``[BLOCK_T tokens, BLOCK_H heads, D]``: with all heads of a token in one
program (the default), the rows it writes are consecutive in the cache (``[slot, head, ...]``), so small
per-row fields (block scales, KIVI scales) fill whole 32-byte sectors. KIVI keys (one scale per channel
over a group of G tokens) take ``BLOCK_T = G`` consecutive, G-aligned slots per program.

Division by a scale that many elements share (:func:`_div_by`) multiplies by the correctly rounded
reciprocal and corrects the quotient with fused multiply-adds (Markstein): the same float32 bits as the
IEEE division (``div_rn``), in 3 or 5 multiply-add-unit instructions instead of a division each.

Kinds (as the decode kernel): 0 BF16, 1 FP8, 2 MX block (E8M0 scales), 3 NVFP4, 4 INT value (KIVI,
per token over channel groups), 5 INT key (KIVI, per channel over a group of G tokens).

``ROTATE`` (a rotated scheme, docs/rotation.md): each (token, head) vector is rotated right after the load,
``z = f32(butterflies(x * signs) * C_D)`` (``codecs.hadamard_rows``), then rounded to an explicit model dtype
(``RDT``) and quantized as above; the host launches it without FP contraction. ``ROT_ROUTE``: the
butterflies' data movement (0 split/join, 1 sums over the pair axis, 2 partner by shuffle: ``hadamard_rows``'
``ROUTE``, with its ``LANE_H``, ``LANE_N`` and ``SHFL_ASM`` as ``ROT_LANE_H``, ``ROT_LANE_N``, ``ROT_SHFL``; on route 2
the signs are folded into the first stage). ``WORD_LOAD`` (rotated FP4 and KIVI writes of bfloat16 input): each pair
of elements loaded as one 32-bit word, ``[BLOCK_T, BLOCK_H, D / 2]``, the shape of a 4-bit code store, so that the
load takes the store's layout (the pair widens exactly: ``w << 16`` and ``w & 0xFFFF0000``).

``KIVI_X2`` (KIVI kinds, NVIDIA; docs/kernels.md, "KIVI writes by float16 pairs"): each pair of channels is one 32-bit
word of two float16 values, and the min/max, scales, codes and code bytes are computed by packed and conversion
instructions in inline PTX (``KIVI_X2_*``, :func:`kivi_x2_scale_ptx`, :func:`kivi_x2_codes_ptx`); the same bytes as
the portable branch. ``X2_WORDS``: the code bytes stored as 32-bit words of four.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvqref.kernels.codecs import (
    bf16_bits_to_f32,
    ceil_log2_f32,
    e2m1_pair_bytes,
    e4m3_normal_bits,
    encode_f32,
    f32_to_bf16_bits,
    floor_log2_f32,
    hadamard_rows,
    page_slot,
    pow2_f32,
    round_f16,
    round_f16_nonneg,
    round_f16_of_bf16,
)

#: the divisor range in which :func:`_div_by` is exact for every dividend whose quotient matters (below:
#: the remainder underflows for dividends whose quotient is still >= 2**-17; see _div_by)
DIV_LO = tl.constexpr(2.0**-80)
DIV_HI = tl.constexpr(2.0**80)
#: quotients are computed for |x| <= 2**20 * divisor; larger ones are clamped there (every format
#: saturates, overflows to Inf/NaN, or clips far below 2**20, and so does float16 after QDT rounding)
QUOT_MAX = tl.constexpr(2.0**20)
#: NVFP4: with the global scale in [2**-60, 2**60] every divisor is in [DIV_LO, DIV_HI] (block divisors
#: e4m3 * g lie in [2**-66, 2**69]) and, |x| capped at g * NV_CAP, every quotient within 2**20
NV_G_LO = tl.constexpr(2.0**-60)
NV_G_HI = tl.constexpr(2.0**60)
#: NVFP4: |x| is capped at g * NV_CAP (see the kernel)
NV_CAP = tl.constexpr(2.0**14)
#: RN32(amax / max finite) by reciprocal is exact for amax >= this (the remainder stays normal)
AMAX_LO = tl.constexpr(2.0**-100)


@triton.jit
def _div(a, b):
    """IEEE float32 division, round to nearest even (the default ``/`` is approximate on NVIDIA)."""
    return tl.math.div_rn(a, b)


@triton.jit
def _neg(x):
    """-x for float32, the sign bit flipped for zeros too (-(+0.0) = -0.0), on every Triton version: Triton <= 3.6
    compiles unary ``-x`` to ``0.0 - x`` (PTX ``sub.f32``), which gives +0.0 for x = +0.0; newer versions emit
    ``fneg``. A product with -1.0 is exact, and LLVM turns it into ``fneg`` (PTX ``neg.f32``)."""
    return x * -1.0


@triton.jit
def _div_by(a, b, r, STEPS: tl.constexpr):
    """a / b from ``r`` ~ 1 / b with fused multiply-adds: ``q = a r``, then STEPS times
    ``e = fma(q, b, -a)`` (exact), ``q = fma(-e, r, q)``. The signs are arranged so that -0.0 / b = -0.0, which
    needs a negation that flips the sign of +0.0 (:func:`_neg`: Triton 3.6's unary minus does not).

    With ``r = RN(1/b)`` (:func:`_div`) the result is the IEEE quotient RN(a / b) when no intermediate
    under/overflows: b in [DIV_LO, DIV_HI], |a / b| <= 2**20 and |a| >= 2**-100 (smaller dividends give
    |a / b| < 2**-20, a zero code in every format, and keep their sign). STEPS = 2 for any float32 ``a``
    (after one step q is faithful, and then Markstein's theorem: r within half an ulp of 1/b, q faithful =>
    the corrected quotient is RN(a/b));
    STEPS = 1 when ``a`` has at most 8 significant bits (bfloat16 values), checked exhaustively over all
    2**7 x 2**23 significand pairs (bench/proof_markstein.py).
    With any ``r`` within 2**-21 of 1/b and STEPS = 1, RN16(q) = RN16(a / b) when a and b are float16
    values (the KIVI divisions): q is within 2**-24 + 2**-40 of a/b, and a quotient of two 11-bit
    significands is either a float16 value or at least 2**-23 (relative) from every float16 midpoint.
    """
    q = a * r
    for _ in tl.static_range(STEPS):
        e = tl.fma(q, b, _neg(a))
        q = tl.fma(_neg(e), r, q)
    return q


@triton.jit
def _div_fast_ok(b_min, b_max):
    """Whether every divisor of the tile lies where :func:`_div_by` is exact (else the tile divides)."""
    return (b_min >= DIV_LO) & (b_max <= DIV_HI)


@triton.jit
def _quotient(x, s, STEPS: tl.constexpr, s_min, s_max):
    """RN32(x / s) for positive finite ``s`` broadcast over x, with |x / s| clamped to 2**20 (NaN stays NaN,
    +-Inf gives +-2**20): by reciprocal and correction where the tile's scales allow, by division otherwise."""
    if _div_fast_ok(s_min, s_max):
        lim = s * QUOT_MAX  # exact: a power-of-two multiple
        xc = tl.clamp(x, -lim, lim, propagate_nan=tl.PropagateNan.ALL)
        q = _div_by(xc, s, _div(tl.full(s.shape, 1.0, tl.float32), s), STEPS)
    else:
        q = tl.clamp(_div(x, s + tl.zeros_like(x)), -QUOT_MAX, QUOT_MAX, propagate_nan=tl.PropagateNan.ALL)
    return q


@triton.jit
def _e2m1_away(y):
    """SGLang's E2M1 rounding: magnitude = number of midpoints 0.25 .. 5 that are <= |y|; sign iff y < 0."""
    a = tl.abs(y)
    m = ((a >= 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a >= 1.25).to(tl.int32)
         + (a >= 1.75).to(tl.int32) + (a >= 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a >= 5.0).to(tl.int32))
    return m | tl.where(y < 0, 8, 0)


@triton.jit
def _runs(N: tl.constexpr, R: tl.constexpr):
    """0 .. N - 1 as ``k // R * R + k % R`` (R dividing N): the same values, which the compiler sees contiguous
    only in runs of R (its vectorization, hence a store's layout, follows); R = N: ``tl.arange`` itself."""
    k = tl.arange(0, N)
    if R < N:
        k = k // R * R + k % R
    return k


@triton.jit
def _pack_bits(codes, BITS: tl.constexpr, N: tl.constexpr, D: tl.constexpr):
    """[N, D] BITS-bit codes -> [N, D*BITS/8] bytes, LSB first along D (4 bits: element 2i in the low nibble)."""
    a, b = tl.split(tl.reshape(codes, (N, D // 2, 2)))        # a: even, b: odd elements
    if BITS == 4:
        return (a | (b << 4)).to(tl.uint8)
    else:
        a0, a1 = tl.split(tl.reshape(a, (N, D // 4, 2)))          # elements 4j, 4j+2
        b0, b1 = tl.split(tl.reshape(b, (N, D // 4, 2)))          # elements 4j+1, 4j+3
        return (a0 | (b0 << 2) | (a1 << 4) | (b1 << 6)).to(tl.uint8)


@triton.jit
def _round_dt(x, DT: tl.constexpr, F16_CVT: tl.constexpr):
    """Round float32 to the model dtype DT (0 float32: as is; 1 bfloat16; 2 float16), RNE, and back."""
    if DT == 1:
        return bf16_bits_to_f32(f32_to_bf16_bits(x))
    elif DT == 2:
        return round_f16(x, F16_CVT)
    else:
        return x


@triton.jit
def _total_order_key(x):
    """float32 -> int32 key with the floats' order and -0.0 < +0.0 (``u ^ ((u >> 31) & 0x7FFFFFFF)`` of the bits
    ``u``: negatives' magnitude bits inverted, -0.0 -> -1, +0.0 -> 0); an involution, so the same function
    maps a key back to the float's bits."""
    u = x.to(tl.int32, bitcast=True)
    return u ^ ((u >> 31) & 0x7FFFFFFF)


@triton.jit
def _min_max(a_lo, a_hi, b_lo, b_hi):
    return tl.minimum(a_lo, b_lo), tl.maximum(a_hi, b_hi)


@triton.jit
def _min_max3(a_umax, a_imin, a_imax, b_umax, b_imin, b_imax):
    return tl.maximum(a_umax, b_umax), tl.minimum(a_imin, b_imin), tl.maximum(a_imax, b_imax)


@triton.jit
def _signed_zero_min_max(x, mn_mask, AXIS: tl.constexpr, BITS3: tl.constexpr = False):
    """(min, max) of ``x`` (finite) over ``AXIS`` (rows where ``mn_mask`` is False left out, if given) with
    -0.0 < +0.0, as the oracle's ``kivi.signed_zero_min_max``: a zero minimum is -0.0 iff a -0.0 is present, a
    zero maximum +0.0 iff a +0.0 is present. One integer min/max reduction of :func:`_total_order_key`, whose
    order is exactly that one (a group with no row left gives NaN bits; its results are not stored).
    ``BITS3`` (KIVI values; H100 faster there, slower for keys): three integer reductions of the bits ``u``
    instead, no per-element key: a float with its sign bit set (negatives, -0.0) is, as an unsigned integer,
    2**31 + its magnitude, as a signed one below every float with the sign bit clear, whose order (+0.0 first)
    its signed integer keeps. So the unsigned maximum is the most negative element if any has the sign bit set
    (-0.0 if only -0.0s do), the signed maximum the largest element if any has it clear, and where all elements
    share a sign bit the signed minimum is the missing end (the smallest magnitude)."""
    if BITS3:
        u = x.to(tl.int32, bitcast=True)
        uu = u.to(tl.uint32, bitcast=True)
        if mn_mask is None:
            umax, imin, imax = tl.reduce((uu, u, u), AXIS, _min_max3)
        else:
            umax, imin, imax = tl.reduce((tl.where(mn_mask, uu, 0), tl.where(mn_mask, u, 0x7FFFFFFF),
                                          tl.where(mn_mask, u, -2147483648)), AXIS, _min_max3)
        any_neg = umax >= 0x80000000  # some element has its sign bit set
        kmn = tl.where(any_neg, umax.to(tl.int32, bitcast=True), imin)
        kmx = tl.where(imax >= 0, imax, imin)  # imax < 0: every element has its sign bit set
        return kmn.to(tl.float32, bitcast=True), kmx.to(tl.float32, bitcast=True)
    k = _total_order_key(x)
    if mn_mask is None:
        lo = k
        hi = k
    else:
        lo = tl.where(mn_mask, k, 0x7FFFFFFF)
        hi = tl.where(mn_mask, k, -2147483648)
    kmn, kmx = tl.reduce((lo, hi), AXIS, _min_max)
    return (_total_order_key(kmn.to(tl.float32, bitcast=True)).to(tl.float32, bitcast=True),
            _total_order_key(kmx.to(tl.float32, bitcast=True)).to(tl.float32, bitcast=True))


@triton.jit
def _kivi_quant(x16, mn, mx, MAXINT: tl.constexpr, F16_CVT: tl.constexpr, RCP: tl.constexpr = False):
    """KIVI in float16 on a group (x16 [..], mn / mx broadcastable): scale = f16(f16(mx - mn) / MAXINT);
    code = rint(min(f16(f16(x16 - mn) / scale), MAXINT)) (x16 - mn >= 0, so no lower clamp); a scale of
    0 (constant group) gives code 0. Returns (codes int32, scale). The divisions are :func:`_div_by`'s
    float16 case (an approximate reciprocal, one correction, then RN16), or with ``RCP`` (KIVI values; H100 faster
    there, slower for keys) one multiplication by the correctly rounded float32 reciprocal,
    RN16(RN32(a * RN32(1 / b))): the same scale for every float16 range and the same code for every pair of
    float16 operands, also where the compiler fuses the product into round_f16_nonneg's addition (checked
    exhaustively: bench/proof_kivi_quotient.py). The integer rounding adds 2**23 (one IEEE addition, ties to
    even) and reads the integer from the sum's low bits."""
    rng = round_f16_nonneg(mx - mn, F16_CVT)
    if RCP:
        scale = round_f16_nonneg(rng * (1.0 / MAXINT), F16_CVT)
        nz = scale != 0
        inv = tl.where(nz, _div(tl.full(scale.shape, 1.0, tl.float32), tl.where(nz, scale, 1.0)), 0.0)
        y = round_f16_nonneg(round_f16_nonneg(x16 - mn, F16_CVT) * inv, F16_CVT)
    else:
        scale = round_f16_nonneg(_div_by(rng, MAXINT * 1.0, 1.0 / MAXINT, 1), F16_CVT)
        inv = tl.where(scale == 0, 0.0, 1.0 / tl.where(scale == 0, 1.0, scale))  # any r within 2**-21 of 1/scale
        y = round_f16_nonneg(_div_by(round_f16_nonneg(x16 - mn, F16_CVT), scale, inv, 1), F16_CVT)
    q = tl.minimum((y + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000, MAXINT)
    return q, scale


#: KIVI by float16 pairs (``KIVI_X2``, NVIDIA): each 32-bit word holds the float16 bits of two elements (the lower
#: half the lower channel), and every per-element step is one packed or one conversion instruction (inline PTX).
#: bfloat16 pair -> float16 pair: the two halves widened exactly, then one RN16 conversion of both.
KIVI_X2_OF_BF16 = tl.constexpr("{ .reg .b32 lo, hi; shl.b32 lo, $1, 16; and.b32 hi, $1, 0xFFFF0000; "
                               "cvt.rn.f16x2.f32 $0, hi, lo; }")
#: float16 pair -> the pair of total-order keys (:func:`_total_order_key`'s rule on each 16-bit half, as signed
#: 16-bit integers: ``u ^ ((u >>s 15) & 0x7FFF)``; -0.0 -> -1 < +0.0 -> 0): ``prmt`` replicates each half's sign
#: bit over the half (selector 0xBB99: bytes 1, 1, 3, 3 in sign mode), ``lop3`` 0x78 is ``a ^ (b & c)``. An
#: involution: the same code maps keys back to the float16 bits.
KIVI_X2_ORDER_KEY = tl.constexpr("{ .reg .b32 m; prmt.b32 m, $1, 0, 0xBB99; lop3.b32 $0, $1, m, 0x7FFF7FFF, 0x78; }")
#: packed signed 16-bit min / max of two key pairs, and of the two halves of one pair (both halves then hold it)
KIVI_X2_MIN = tl.constexpr("min.s16x2 $0, $1, $2;")
KIVI_X2_MAX = tl.constexpr("max.s16x2 $0, $1, $2;")
KIVI_X2_HALVES_MIN = tl.constexpr("{ .reg .b32 t; prmt.b32 t, $1, 0, 0x1032; min.s16x2 $0, $1, t; }")
KIVI_X2_HALVES_MAX = tl.constexpr("{ .reg .b32 t; prmt.b32 t, $1, 0, 0x1032; max.s16x2 $0, $1, t; }")


@triton.constexpr_function
def kivi_x2_codes_ptx(maxint: int) -> str:
    """The codes of a float16 pair ``$1`` of a group with minimum pair ``$2`` and float32 reciprocal scales ``$3``
    (lower half), ``$4`` (upper half), as :func:`_kivi_quant`'s ``RCP`` rule: ``d = RN16(x - mn)`` (one packed
    float16 subtraction: the correctly rounded difference, which is also what RN16(RN32(x - mn)) gives),
    ``y = RN16(RN32(d * r))`` (two conversions, two float32 multiplications, one packed conversion back:
    bench/proof_kivi_quotient.py), then ``1024 + y`` rounded to float16, whose spacing is 1 on [1024, 2048): the
    integer nearest y, ties to even, in the low mantissa bits (y < 1024 always: y <= 2 MAXINT where the scale is
    not 0, else 0), and a signed 16-bit minimum with ``1024 + maxint``: the clamp. Result: the two codes in bytes
    0 and 2 (each half is 0x6400 + code)."""
    cap = 0x6400 + maxint
    return ("{ .reg .b32 d, y, k, c; .reg .b16 l, h; .reg .f32 a, b; "
            "sub.rn.f16x2 d, $1, $2; mov.b32 {l, h}, d; cvt.f32.f16 a, l; cvt.f32.f16 b, h; "
            "mul.rn.f32 a, a, $3; mul.rn.f32 b, b, $4; cvt.rn.f16x2.f32 y, b, a; "
            f"mov.b32 k, 0x64006400; add.rn.f16x2 y, y, k; mov.b32 c, {cap | cap << 16:#x}; min.s16x2 $0, y, c; }}")


@triton.constexpr_function
def kivi_x2_scale_ptx(maxint: int) -> str:
    """The scales and reciprocals of a pair of groups (one per half) from their float16 minima ``$3`` and maxima
    ``$4``: ``scale = RN16(RN32(RN16(mx - mn) * RN32(1 / maxint)))`` (= RN16(RN16(mx - mn) / maxint) for every
    float16 range: bench/proof_kivi_quotient.py), as a float16 pair ``$0``, and ``r = RN32(1 / scale)`` of each
    half, ``$1`` (lower) and ``$2``: ``rcp.approx`` then one Newton step ``r + r (1 - scale r)`` by two fused
    multiply-adds (correctly rounded for every float16 scale from any start within 2 ulp of 1 / scale:
    bench/proof_kivi_reciprocal.py; the approximation is within 1 ulp), and 0 where the scale is 0 or Inf (codes
    0, as :func:`_x2_scale`)."""
    c = {15: "0f3D888889", 3: "0f3EAAAAAB"}[maxint]  # RN32(1 / maxint)
    half = ("mov.b32 {{l, h}}, s; cvt.f32.f16 a, {0}; rcp.approx.f32 r, a; fma.rn.f32 e, a, r, 0fBF800000; "
            "neg.f32 e, e; fma.rn.f32 r, e, r, r; setp.gt.f32 p, a, 0f00000000; setp.lt.f32 q, a, 0f7F800000; "
            "and.pred p, p, q; selp.f32 {1}, r, 0f00000000, p; ")
    return ("{ .reg .b32 s; .reg .b16 l, h; .reg .f32 a, b, r, e; .reg .pred p, q; "
            "sub.rn.f16x2 s, $4, $3; mov.b32 {l, h}, s; cvt.f32.f16 a, l; cvt.f32.f16 b, h; "
            f"mul.rn.f32 a, a, {c}; mul.rn.f32 b, b, {c}; cvt.rn.f16x2.f32 s, b, a; mov.b32 $0, s; "
            + half.format("l", "$1") + half.format("h", "$2") + "}")


#: four code words of 4-bit codes (:func:`kivi_x2_codes_ptx`: channel pairs 0-3 of 8 channels) -> the 4 code bytes
#: of the 8 channels, LSB first (the lower channel of a pair in the low nibble): ``prmt`` 0x6240 gathers bytes 0
#: and 2 of two words ([pair 0 lower, pair 1 lower, pair 0 upper, pair 1 upper]), 0x5410 / 0x7632 the lower codes
#: and the upper codes of the four pairs, and ``lower + upper * 16`` joins them (no carries: codes < 16)
KIVI_X2_WORD4 = tl.constexpr("{ .reg .b32 a, b, l, h; prmt.b32 a, $1, $2, 0x6240; prmt.b32 b, $3, $4, 0x6240; "
                             "prmt.b32 l, a, b, 0x5410; prmt.b32 h, a, b, 0x7632; mad.lo.u32 $0, h, 16, l; }")
#: eight code words of 2-bit codes (channel pairs 0-7 of 16 channels) -> the 4 code bytes of the 16 channels, LSB
#: first: codes 4j + k gathered into register k's byte j, then ``P0 + 4 P1 + 16 P2 + 64 P3``
KIVI_X2_WORD2 = tl.constexpr("{ .reg .b32 a, b, c, d, p0, p1, p2, p3; "
                             "prmt.b32 a, $1, $3, 0x6240; prmt.b32 b, $5, $7, 0x6240; "
                             "prmt.b32 c, $2, $4, 0x6240; prmt.b32 d, $6, $8, 0x6240; "
                             "prmt.b32 p0, a, b, 0x5410; prmt.b32 p1, a, b, 0x7632; "
                             "prmt.b32 p2, c, d, 0x5410; prmt.b32 p3, c, d, 0x7632; "
                             "mad.lo.u32 p0, p1, 4, p0; mad.lo.u32 p0, p2, 16, p0; mad.lo.u32 $0, p3, 64, p0; }")


#: two 4-bit codes in bytes 0 and 2 of a code word -> their code byte (the lower code in the low nibble) in bits
#: 0-7: ``lop3`` 0xE4 is ``(a & c) | (b & ~c)``; bits 8-31 are left over (the caller truncates)
KIVI_X2_BYTE4 = tl.constexpr("{ .reg .b32 t; shr.b32 t, $1, 12; lop3.b32 $0, $1, t, 0xF, 0xE4; }")
#: four 2-bit codes, bytes 0 and 2 of ``$1`` (channels 4j, 4j+1) and of ``$2`` (4j+2, 4j+3) -> their code byte
#: (LSB first) in bits 0-7: ``prmt`` 0x6240 gathers [c0, c2, c1, c3], ``t | t >> 14`` puts c0 | c1 << 2 in byte 0
#: and c2 | c3 << 2 in byte 1, and the last ``lop3`` joins byte 0's low nibble with byte 1's moved to bits 4-7
KIVI_X2_BYTE2 = tl.constexpr("{ .reg .b32 t, u; prmt.b32 t, $1, $2, 0x6240; shr.b32 u, t, 14; or.b32 t, t, u; "
                             "shr.b32 u, t, 4; lop3.b32 $0, t, u, 0xF, 0xE4; }")


@triton.jit
def _asm1(asm: tl.constexpr, a):
    return tl.inline_asm_elementwise(asm, "=r,r", [a], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _asm2(asm: tl.constexpr, a, b):
    return tl.inline_asm_elementwise(asm, "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _x2_min_max(a_lo, a_hi, b_lo, b_hi):
    return _asm2(KIVI_X2_MIN, a_lo, b_lo), _asm2(KIVI_X2_MAX, a_hi, b_hi)


@triton.jit
def _x2_of_f32(lo, hi):
    """float32 pairs -> float16 pairs (RN16 each; ``lo`` the lower half)."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _x2_scale(mn_w, mx_w, MAXINT: tl.constexpr):
    """:func:`kivi_x2_scale_ptx`: (scale pairs, reciprocal of the lower halves, of the upper halves)."""
    return tl.inline_asm_elementwise(kivi_x2_scale_ptx(MAXINT), "=r,=f,=f,r,r", [mn_w, mx_w],
                                     dtype=(tl.int32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _x2_codes(w16, mn_w, inv_lo, inv_hi, MAXINT: tl.constexpr):
    """:func:`kivi_x2_codes_ptx` on broadcast operands."""
    z = tl.zeros_like(w16)
    return tl.inline_asm_elementwise(kivi_x2_codes_ptx(MAXINT), "=r,r,r,f,f",
                                     [w16, mn_w + z, inv_lo + z.to(tl.float32), inv_hi + z.to(tl.float32)],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _x2_code_words(q, BITS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, W2: tl.constexpr):
    """Code words [BLOCK_T, BLOCK_H, W2] (two codes each, :func:`kivi_x2_codes_ptx`) -> the code bytes as 32-bit
    words, [.., W2 / 4] (4 bits) or [.., W2 / 8] (2 bits), LSB first along the channels."""
    if BITS == 4:
        qe, qo = tl.split(tl.reshape(q, (BLOCK_T, BLOCK_H, W2 // 4, 2, 2)))  # pairs 4k + (0, 2), 4k + (1, 3)
        q0, q2 = tl.split(qe)
        q1, q3 = tl.split(qo)
        return tl.inline_asm_elementwise(KIVI_X2_WORD4, "=r,r,r,r,r", [q0, q1, q2, q3], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        x0, x1 = tl.split(tl.reshape(q, (BLOCK_T, BLOCK_H, W2 // 8, 2, 2, 2)))  # pair 8k + 4a + 2b + c: by c
        x00, x01 = tl.split(x0)  # by b
        x10, x11 = tl.split(x1)
        q0, q4 = tl.split(x00)  # by a
        q2, q6 = tl.split(x01)
        q1, q5 = tl.split(x10)
        q3, q7 = tl.split(x11)
        return tl.inline_asm_elementwise(KIVI_X2_WORD2, "=r,r,r,r,r,r,r,r,r", [q0, q1, q2, q3, q4, q5, q6, q7],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _x2_code_bytes(q, BITS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, W2: tl.constexpr):
    """Code words [BLOCK_T, BLOCK_H, W2] (two codes each) -> the code bytes, [.., W2] (4 bits) or [.., W2 / 2]
    (2 bits) uint8, LSB first along the channels."""
    if BITS == 4:
        return _asm1(KIVI_X2_BYTE4, q).to(tl.uint8)
    else:
        qa, qb = tl.split(tl.reshape(q, (BLOCK_T, BLOCK_H, W2 // 2, 2)))
        return _asm2(KIVI_X2_BYTE2, qa, qb).to(tl.uint8)


@triton.jit
def _pair_sign_words(x, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr):
    """The sign word of each element pair of ``x`` (float32, any shape holding [BLOCK_T, BLOCK_H, D] in row order) as
    :func:`codecs.e2m1_pair_bytes` takes it: int32 [BLOCK_T, BLOCK_H, D / 2], element 2i's sign at bit 15, element
    2i + 1's at bit 31, every other bit 0."""
    xe, xo = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_H, D // 2, 2)))
    return ((xe.to(tl.int32, bitcast=True) >> 16) & 0x8000) | (xo.to(tl.int32, bitcast=True) & -2147483648)


@triton.jit
def _e2m1_bytes(mag, sw, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr):
    """E2M1 code bytes [BLOCK_T, BLOCK_H, D / 2] (element 2i in the low nibble): the RNE codes of the float32
    magnitudes ``mag`` (in [0, 7): at most 6 after rounding; any shape holding [BLOCK_T, BLOCK_H, D] in row order),
    the signs from the pair sign words ``sw`` (:func:`_pair_sign_words`; -0.0 gives 0x8). Built as the unrotated
    whole-block NVFP4 write builds its bytes (:func:`codecs.e2m1_pair_bytes`): about 8 instructions per pair of
    elements against 20 for a code each and its packing (sm_90)."""
    me, mo = tl.split(tl.reshape(mag, (BLOCK_T, BLOCK_H, D // 2, 2)))
    return e2m1_pair_bytes(me, mo, sw)


@triton.jit
def _nv_half(v, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, HB: tl.constexpr):
    """One half block of NVFP4 input, ``v`` the loaded bfloat16 [A, B, C, HB], as element pairs: the
    magnitudes |x| of the even (low nibble) and odd elements as float32 [A, B, C, HB/2], and the pair's sign
    word (the even element's sign at bit 15, the odd's at bit 31, every other bit 0), all from the 32-bit
    register holding the pair (bfloat16 widens exactly by a shift)."""
    we, wo = tl.split(tl.reshape(v.to(tl.int16, bitcast=True), (A, B, C, HB // 2, 2)))
    w = (wo.to(tl.int32) << 16) | (we.to(tl.int32) & 0xFFFF)
    return ((w << 16) & 0x7FFF0000).to(tl.float32, bitcast=True), (w & 0x7FFF0000).to(tl.float32, bitcast=True), \
        w & -2147450880  # 0x80008000


@triton.jit
def _nv_quotient(a, lim, dv, r, FAST: tl.constexpr):
    """NVFP4 quotient of a magnitude ``a``: RN32(min(a, lim) / dv), ``lim`` = RN(6 dv) (so the quotient is below 7):
    by the reciprocal ``r`` = RN(1 / dv) and one correction when FAST (``a`` a bfloat16 value; a capped one's
    quotient is not exact but within 2**-21 of 6, code 7 either way), else by division (at most 6: NaN-free where
    dv under- or overflowed)."""
    a = tl.minimum(a, lim)
    if FAST:
        return _div_by(a, dv, r, 1)
    else:
        return tl.minimum(_div(a, dv + tl.zeros_like(a)), 6.0)


@triton.jit
def _nv_store_codes(pc, mask, e_l, o_l, sw_l, e_h, o_h, sw_h, lim, dv, r, FAST: tl.constexpr, HB: tl.constexpr):
    """Store the NVFP4 code bytes of whole blocks (``pc`` [..., HB]: each block's code bytes, low half first)."""
    b_l = e2m1_pair_bytes(_nv_quotient(e_l, lim, dv, r, FAST), _nv_quotient(o_l, lim, dv, r, FAST), sw_l)
    b_h = e2m1_pair_bytes(_nv_quotient(e_h, lim, dv, r, FAST), _nv_quotient(o_h, lim, dv, r, FAST), sw_h)
    tl.store(pc, tl.reshape(tl.permute(tl.join(b_l, b_h), (0, 1, 2, 4, 3)), pc.shape), mask=mask)


@triton.jit
def quantize_write_kernel(
    X, SLOT, F0, F1, F2, SC, n_tokens, n_heads,
    x_t, x_h, f0_s, f0_h, f1_s, f1_h, f2_s, f2_h,
    SIGNS, c_d,
    KIND: tl.constexpr, FMT: tl.constexpr, SGLANG: tl.constexpr, QDT: tl.constexpr, TOKEN_SCALE: tl.constexpr,
    SATURATE: tl.constexpr,
    QB: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr, HW_FP8: tl.constexpr, F16_CVT: tl.constexpr,
    ROTATE: tl.constexpr = False, RDT: tl.constexpr = 0, ROT_ROUTE: tl.constexpr = 0,
    ROT_LANE_H: tl.constexpr = 16, ROT_LANE_N: tl.constexpr = 8, ROT_SHFL: tl.constexpr = False,
    NV_BLOCKS: tl.constexpr = False, BLOCK_D: tl.constexpr = 0, STORE_AS_LOADED: tl.constexpr = False,
    PAGE: tl.constexpr = 1, PAGE_SLOTS: tl.constexpr = 1, WORD_LOAD: tl.constexpr = False,
    KIVI_X2: tl.constexpr = False, X2_WORDS: tl.constexpr = False, HEADS_FAST: tl.constexpr = False,
    X_EVICT: tl.constexpr = "",
):
    # W: the channels of a row this program holds: all D, or (KIVI keys, BLOCK_D) channels d0 .. d0 + W - 1 of
    # channel block program_id(2) (per-channel statistics: the blocks are independent)
    W: tl.constexpr = D if BLOCK_D == 0 else BLOCK_D
    tl.static_assert(W == D or (KIND == 5 and not ROTATE and D % W == 0 and W * BITS % 8 == 0),
                     "BLOCK_D < D: KIVI keys only, unrotated, dividing D, whole code bytes")
    # HEADS_FAST: the head blocks on the grid's fastest axis (grid (heads, tokens)), so that the programs running
    # together read whole token rows of x rather than one head's slice of many rows
    t = tl.program_id(1 if HEADS_FAST else 0) * BLOCK_T + tl.arange(0, BLOCK_T)
    hh = tl.program_id(0 if HEADS_FAST else 1) * BLOCK_H + tl.arange(0, BLOCK_H)
    if W == D:
        d0 = 0
        d = tl.arange(0, D)
    else:
        d0 = tl.program_id(2) * W
        d = d0 + tl.arange(0, W)
    tin = t < n_tokens
    slot = tl.load(SLOT + t, mask=tin, other=-1).to(tl.int64)
    tm = tin & (slot >= 0)
    if PAGE_SLOTS != PAGE:  # head-major fields: the slot mapping's page * PAGE + offset is row page_slot(page, offset)
        slot = tl.where(tm, page_slot(slot // PAGE, slot, PAGE, PAGE_SLOTS), -1)
    hm = hh < n_heads
    rm = tm[:, None] & hm[None, :]  # [BLOCK_T, BLOCK_H]: rows to write
    m3 = rm[:, :, None]
    t3 = t[:, None, None].to(tl.int64)
    h3 = hh[None, :, None]
    # loaded for every token in range, written where its slot is not -1, so that the load waits for no slot (rows
    # with slot -1 are left out of every reduction below: FP8 token scales' range by ``rm``), except for KIVI keys,
    # whose group min/max (rows with slot -1 left out by ``tm``) measured faster with the slot-masked load (H100: int4
    # keys 81 -> 85 us, the other kinds 1-4% faster; bench/results/history/ab-h100-session14-write-loads.log)
    xm = m3 if KIND == 5 else (tin[:, None] & hm[None, :])[:, :, None]
    if WORD_LOAD:  # bfloat16 pairs as 32-bit words [BLOCK_T, BLOCK_H, W / 2]: a 4-bit code store's shape
        i2 = d0 // 2 + tl.arange(0, W // 2)
        xw = tl.load(X.to(tl.pointer_type(tl.int32)) + ((t3 * x_t + h3 * x_h) // 2 + i2[None, None, :]), mask=xm,
                     other=0, eviction_policy=X_EVICT)
        x = tl.reshape(tl.join((xw << 16).to(tl.float32, bitcast=True), (xw & -65536).to(tl.float32, bitcast=True)),
                       (BLOCK_T, BLOCK_H, W))
    else:
        xr = tl.load(X + t3 * x_t + h3 * x_h + d[None, None, :], mask=xm, other=0.0, eviction_policy=X_EVICT)
        if X.dtype.element_ty == tl.bfloat16:  # widened from the bits: exact for subnormals (the interpreter
            # flushes them)
            x = bf16_bits_to_f32(xr.to(tl.int16, bitcast=True))
        else:
            x = xr.to(tl.float32)
    if ROTATE:  # docs/rotation.md: z = f32(butterflies(x * signs) * C_D), then (RDT) an explicit model dtype
        R: tl.constexpr = BLOCK_T * BLOCK_H
        sg = tl.load(SIGNS + d)
        if ROT_ROUTE == 2 and KIND != 5:  # signs folded into the first stage (sm_90: the same layouts, one multiply
            # per pair fewer; with split/join, or for KIVI keys, the fold changed the layouts: more conversions)
            xr2 = hadamard_rows(tl.reshape(x, (R, D)), R, D, ROT_ROUTE, ROT_LANE_H, ROT_LANE_N, ROT_SHFL, sg)
        else:
            xr2 = hadamard_rows(tl.reshape(x, (R, D)) * sg[None, :], R, D, ROT_ROUTE, ROT_LANE_H, ROT_LANE_N, ROT_SHFL)
        xr2 = xr2 * c_d
        x = tl.reshape(_round_dt(xr2, RDT, F16_CVT), (BLOCK_T, BLOCK_H, D))
    # x: [BLOCK_T, BLOCK_H, D] float32, one full head_dim row per (token, head). STEPS: correction steps of
    # a division of x (1 while x holds bfloat16 values; rotated values, or other inputs, need 2)
    STEPS: tl.constexpr = 1 if X.dtype.element_ty == tl.bfloat16 and not ROTATE else 2
    s3 = slot[:, None, None]
    if KIND == 0:
        bits = f32_to_bf16_bits(x).to(tl.int16)
        tl.store(F0 + s3 * f0_s + h3 * f0_h + d[None, None, :], bits.to(tl.bfloat16, bitcast=True), mask=m3)
    elif KIND == 1:
        MAXF: tl.constexpr = 448.0 if FMT == 0 else (57344.0 if FMT == 1 or FMT == 3 else 240.0)
        if TOKEN_SCALE:
            amax = tl.max(tl.abs(x), 2)
            if tl.min(tl.where(rm & (amax != 0), amax, 1.0)) >= AMAX_LO:  # RN32(amax / MAXF)
                s = _div_by(amax, MAXF, 1.0 / MAXF, STEPS)
            else:
                s = _div(amax, tl.full(amax.shape, MAXF, tl.float32))
            s = tl.where(amax == 0, 1.0, s)
            tl.store(F1 + slot[:, None] * f1_s + hh[None, :] * f1_h, s, mask=rm)
            s_all = tl.where(rm, s, 1.0)
            sc = s[:, :, None]
        else:
            s_all = tl.load(SC + hh, mask=hm, other=1.0)
            sc = s_all[None, :, None]
        # x holds the model dtype's values (exact in float32); QDT: the dtype x / s is rounded to before the
        # FP8 conversion (SGLang divides in the model dtype, vLLM's HIP kernel in a float16 model's _Float16)
        if SGLANG == 2:  # a Python-float scale: torch multiplies by its float32 reciprocal (given in SC)
            y = x * sc
        else:
            if SGLANG == 1:  # a float32 tensor scale, cast to the model dtype by torch's type promotion
                sc = _round_dt(sc, QDT, F16_CVT)
                s_all = _round_dt(s_all, QDT, F16_CVT)
            y = _quotient(x, sc, STEPS, tl.min(s_all), tl.max(s_all))
        y = _round_dt(y, QDT, F16_CVT)
        if HW_FP8 and (QDT != 0 or SGLANG == 2):  # the hardware conversion takes finite (or NaN) input
            y = tl.clamp(y, -QUOT_MAX, QUOT_MAX, propagate_nan=tl.PropagateNan.ALL)
        c = encode_f32(y, FMT, SATURATE, HW_FP8)
        tl.store(F0 + s3 * f0_s + h3 * f0_h + d[None, None, :], c.to(tl.uint8), mask=m3)
    elif KIND == 3 and NV_BLOCKS and X.dtype.element_ty == tl.bfloat16 and not ROTATE:
        # NVFP4, whole blocks per thread: each 16-element block loaded as two halves of 8 ([NB, BLOCK_T, BLOCK_H, 8]
        # each), so that one thread holds a whole block (the block maximum in registers, each block scale
        # computed once); magnitudes as float32 element pairs, the signs put back by the packing
        # (codecs.e2m1_pair_bytes)
        NB: tl.constexpr = D // QB
        HB: tl.constexpr = QB // 2
        # tiles [NB, BLOCK_T, BLOCK_H, ...]: the block axis first, so that Triton gives the block scales' store the
        # layout the block maxima come in (lanes along the blocks of a row), not one converted through shared memory
        nb = tl.arange(0, NB)[:, None, None]
        rows_x = (t[:, None].to(tl.int64) * x_t + hh[None, :] * x_h)[None, :, :]
        # loaded for every token in range, written where its slot is not -1 (the loads wait for no slot)
        mx4 = (tin[:, None] & hm[None, :])[None, :, :, None]
        px = X + (rows_x + nb * QB)[:, :, :, None] + tl.arange(0, HB)[None, None, None, :]
        e_l, o_l, sw_l = _nv_half(tl.load(px, mask=mx4, other=0.0, eviction_policy=X_EVICT), NB, BLOCK_T, BLOCK_H, HB)
        e_h, o_h, sw_h = _nv_half(tl.load(px + HB, mask=mx4, other=0.0, eviction_policy=X_EVICT), NB, BLOCK_T, BLOCK_H,
                                  HB)
        amax = tl.max(tl.maximum(tl.maximum(e_l, o_l), tl.maximum(e_h, o_h)), 3)
        g = tl.load(SC)
        fast = (g >= NV_G_LO) & (g <= NV_G_HI)
        if fast:  # amax capped at g * 2**14 (see below): RN(RN(amax / 6) / g) within _div_by's domain
            s = _div(_div_by(tl.minimum(amax, g * NV_CAP), 6.0, 1.0 / 6.0, 1), g + tl.zeros_like(amax))
        else:
            s = _div(_div(amax, tl.full(amax.shape, 6.0, tl.float32)), g + tl.zeros_like(amax))
        scode, sv = e4m3_normal_bits(tl.minimum(tl.maximum(s, 0.015625), 448.0))
        dv = (sv * g)[:, :, :, None]
        # |x| capped at lim = RN(6 dv): a capped element's quotient is 6 within 2**-22 (code 7, as its own quotient,
        # at least 6 (1 - 2**-24), gives), so every quotient is below 7 (e2m1_pair_bytes' domain)
        lim = dv * 6.0
        rows_c = (slot[:, None] * f0_s + hh[None, :] * f0_h)[None, :, :]
        pc = F0 + (rows_c + nb * HB)[:, :, :, None] + tl.arange(0, HB)[None, None, None, :]
        m4 = rm[None, :, :, None]
        if fast:  # the stores in each branch: no per-element tensor leaves it (a runtime branch's results get a
            # default layout and conversions through shared memory)
            _nv_store_codes(pc, m4, e_l, o_l, sw_l, e_h, o_h, sw_h, lim, dv,
                            _div(tl.full(dv.shape, 1.0, tl.float32), dv), True, HB)
        else:
            _nv_store_codes(pc, m4, e_l, o_l, sw_l, e_h, o_h, sw_h, lim, dv, dv, False, HB)
        rows_s = (slot[:, None] * f1_s + hh[None, :] * f1_h)[None, :, :]
        tl.store(F1 + rows_s + nb, scode.to(tl.uint8), mask=rm[None, :, :])
    elif KIND == 2 or KIND == 3:
        NB: tl.constexpr = D // QB
        xb = tl.reshape(x, (BLOCK_T, BLOCK_H, NB, QB))
        if KIND == 2:
            amax = tl.max(tl.abs(xb), 3)
            if SGLANG:
                v = tl.maximum(_div(amax, tl.full(amax.shape, 6.0, tl.float32)), 1e-10)
                e = tl.minimum(tl.maximum(ceil_log2_f32(v), -127), 127)
            else:
                e = tl.where(amax == 0, -127, tl.maximum(floor_log2_f32(amax) - 2, -127))
            y = xb * pow2_f32(-e)[:, :, :, None]  # float32 x / 2**e (SGLang's compiled arithmetic in every dtype)
            if SGLANG:
                packed = tl.reshape(_pack_bits(tl.reshape(_e2m1_away(y), (BLOCK_T * BLOCK_H, D)), 4, BLOCK_T * BLOCK_H,
                                               D), (BLOCK_T, BLOCK_H, D // 2))
            else:  # RNE E2M1 saturating at 6 (|y| < 8): every magnitude from 6 up rounds or saturates to 6
                packed = _e2m1_bytes(tl.minimum(tl.abs(y), 6.0), _pair_sign_words(y, BLOCK_T, BLOCK_H, D), BLOCK_T,
                                     BLOCK_H, D)
            scode = e + 127
        else:
            # magnitudes: the block maxima capped at g * 2**14 (a block holding a larger |x| has a scale above 2730
            # before the clamp to 448, so its elements beyond the cap give quotients beyond 6 either way: code 7);
            # every |x| capped at lim = RN(6 dv), as the whole-block write does: a capped element's quotient is 6
            # within 2**-23 (code 7, as its own quotient, at least 6 (1 - 2**-24), gives), so every quotient is below
            # 7 and within _div_by's domain without a tile-wide check of the block maxima; the signs come from x
            g = tl.load(SC)
            fast = (g >= NV_G_LO) & (g <= NV_G_HI)
            ax = tl.abs(xb)
            sw = _pair_sign_words(xb, BLOCK_T, BLOCK_H, D)  # (here, so that x's registers are free below)
            if fast:  # every quotient below stays finite and exact
                amax = tl.minimum(tl.max(ax, 3), g * NV_CAP)
                rg = _div(1.0, g)
                s = _div_by(_div_by(amax, 6.0, 1.0 / 6.0, STEPS), g, rg, 2)
            else:
                amax = tl.max(ax, 3)
                s = _div(_div(amax, tl.full(amax.shape, 6.0, tl.float32)), g + tl.zeros_like(amax))
            s = tl.minimum(tl.maximum(s, 0.015625), 448.0)
            # integer E4M3 rounding (see docs/kernels.md, NVFP4 on the H100), s being normal in E4M3
            scode, sv = e4m3_normal_bits(s)
            dv = sv * g
            if fast:
                ym = _div_by(tl.minimum(ax, (dv * 6.0)[:, :, :, None]), dv[:, :, :, None],
                             _div(tl.full(dv.shape, 1.0, tl.float32), dv)[:, :, :, None], STEPS)
            else:  # (a quotient from 6 up is code 7; NaN-free where dv under- or overflowed)
                ym = tl.minimum(_div(ax, dv[:, :, :, None] + tl.zeros_like(xb)), 6.0)
            packed = _e2m1_bytes(ym, sw, BLOCK_T, BLOCK_H, D)
        i = tl.arange(0, D // 2)
        tl.store(F0 + s3 * f0_s + h3 * f0_h + i[None, None, :], packed, mask=m3)
        nb = tl.arange(0, NB)
        tl.store(F1 + s3 * f1_s + h3 * f1_h + nb[None, None, :], scode.to(tl.uint8), mask=m3)
    elif KIVI_X2:  # KIVI by float16 pairs (inline PTX, NVIDIA): the same bytes as the branch below
        tl.static_assert(KIND == 4 or KIND == 5, "KIVI_X2: KIVI kinds only")
        MAXINT_X2: tl.constexpr = (1 << BITS) - 1
        W2: tl.constexpr = W // 2
        if WORD_LOAD and not ROTATE:
            w16 = _asm1(KIVI_X2_OF_BF16, xw)
        else:
            x_lo, x_hi = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_H, W2, 2)))
            w16 = _x2_of_f32(x_lo, x_hi)
        key = _asm1(KIVI_X2_ORDER_KEY, w16)
        if KIND == 4:  # per token over G channels: pairs [.., NG, G / 2], then the two halves of each group's pair
            NG: tl.constexpr = D // G
            kg = tl.reshape(key, (BLOCK_T, BLOCK_H, NG, G // 2))
            kmn, kmx = tl.reduce((kg, kg), 3, _x2_min_max)
            mn_w = _asm1(KIVI_X2_ORDER_KEY, _asm1(KIVI_X2_HALVES_MIN, kmn))  # [T, H, NG], both halves the minimum
            mx_w = _asm1(KIVI_X2_ORDER_KEY, _asm1(KIVI_X2_HALVES_MAX, kmx))
            scale_w, inv, _inv_hi = _x2_scale(mn_w, mx_w, MAXINT_X2)
            qg = _x2_codes(tl.reshape(w16, (BLOCK_T, BLOCK_H, NG, G // 2)), mn_w[:, :, :, None],
                           inv[:, :, :, None], inv[:, :, :, None], MAXINT_X2)
            q = tl.reshape(qg, (BLOCK_T, BLOCK_H, W2))
            ng = tl.arange(0, NG)
            tl.store(F1.to(tl.pointer_type(tl.int16)) + s3 * f1_s + h3 * f1_h + ng[None, None, :],
                     scale_w.to(tl.int16), mask=m3)
            tl.store(F2.to(tl.pointer_type(tl.int16)) + s3 * f2_s + h3 * f2_h + ng[None, None, :],
                     mn_w.to(tl.int16), mask=m3)
        else:  # per channel over the program's G tokens (rows not written left out)
            wm = tm[:, None, None]
            kmn, kmx = tl.reduce((tl.where(wm, key, 0x7FFF7FFF), tl.where(wm, key, -2147450880)), 0, _x2_min_max)
            mn_w = _asm1(KIVI_X2_ORDER_KEY, kmn)  # [BLOCK_H, W / 2] float16 pairs
            mx_w = _asm1(KIVI_X2_ORDER_KEY, kmx)
            scale_w, inv_lo, inv_hi = _x2_scale(mn_w, mx_w, MAXINT_X2)
            q = _x2_codes(w16, mn_w[None, :, :], inv_lo[None, :, :], inv_hi[None, :, :], MAXINT_X2)
            last = tl.max(tl.where(tm, slot, -1), 0)
            grp = last // G
            gm = hm[:, None] & ((tl.zeros((W2,), tl.int64) + last) >= 0)[None, :]
            j2 = d0 // 2 + tl.arange(0, W2)
            # scales and minima as float16 pairs, one 32-bit word per two channels (rows of D float16: even strides)
            tl.store(F1.to(tl.pointer_type(tl.int32)) + (grp * f1_s + hh[:, None] * f1_h) // 2 + j2[None, :],
                     scale_w, mask=gm)
            tl.store(F2.to(tl.pointer_type(tl.int32)) + (grp * f2_s + hh[:, None] * f2_h) // 2 + j2[None, :], mn_w,
                     mask=gm)
        if X2_WORDS:  # 4 code bytes per 32-bit store
            NWORDS: tl.constexpr = W * BITS // 32  # code words of the program's channels
            iw = d0 * BITS // 32 + tl.arange(0, NWORDS)
            tl.store(F0.to(tl.pointer_type(tl.int32)) + (s3 * f0_s + h3 * f0_h) // 4 + iw[None, None, :],
                     _x2_code_words(q, BITS, BLOCK_T, BLOCK_H, W2), mask=m3)
        else:
            ib = d0 * BITS // 8 + tl.arange(0, W * BITS // 8)
            tl.store(F0 + s3 * f0_s + h3 * f0_h + ib[None, None, :], _x2_code_bytes(q, BITS, BLOCK_T, BLOCK_H, W2),
                     mask=m3)
    else:
        MAXINT: tl.constexpr = (1 << BITS) - 1
        if X.dtype.element_ty == tl.bfloat16 and not ROTATE and not F16_CVT:  # x holds bfloat16 values
            x16 = round_f16_of_bf16(x)
        else:
            x16 = round_f16(x, F16_CVT)
        PACKW: tl.constexpr = W * BITS // 8  # code bytes of the program's W channels (contiguous in the row)
        # STORE_AS_LOADED (KIVI keys): the stores' offsets seen contiguous only in runs of one thread's channels
        # (its 16-byte load: VEC channels, VEC * BITS / 8 code bytes), so Triton gives the stores the load's layout
        VEC: tl.constexpr = min(128 // X.dtype.element_ty.primitive_bitwidth, W) if STORE_AS_LOADED else W
        i = d0 * BITS // 8 + _runs(PACKW, VEC * BITS // 8)
        if KIND == 4:
            NG: tl.constexpr = D // G
            xg = tl.reshape(x16, (BLOCK_T, BLOCK_H, NG, G))
            mn, mx = _signed_zero_min_max(xg, mn_mask=None, AXIS=3, BITS3=True)
            q, scale = _kivi_quant(xg, mn[:, :, :, None], mx[:, :, :, None], MAXINT, F16_CVT, RCP=True)
            ng = tl.arange(0, NG)
            sc16 = tl.reshape(scale, (BLOCK_T, BLOCK_H, NG)).to(tl.float16)
            tl.store(F1 + s3 * f1_s + h3 * f1_h + ng[None, None, :], sc16, mask=m3)
            tl.store(F2 + s3 * f2_s + h3 * f2_h + ng[None, None, :], mn.to(tl.float16), mask=m3)
        else:
            # one program = one whole group of G = BLOCK_T tokens in consecutive, G-aligned slots
            mn, mx = _signed_zero_min_max(x16, mn_mask=tm[:, None, None], AXIS=0)  # rows not written left out
            q, scale = _kivi_quant(x16, mn[None, :, :], mx[None, :, :], MAXINT, F16_CVT)
            # the group's slots are consecutive and G-aligned: any written one // G is the group (slot -1: not
            # written); one reduction gives both the group and whether anything is written
            last = tl.max(tl.where(tm, slot, -1), 0)
            grp = last // G
            gm = hm[:, None] & ((tl.zeros((W,), tl.int64) + last) >= 0)[None, :]
            ds = d0 + _runs(W, VEC)  # = d
            tl.store(F1 + grp * f1_s + hh[:, None] * f1_h + ds[None, :], tl.reshape(scale, (BLOCK_H, W)).to(tl.float16),
                     mask=gm)
            tl.store(F2 + grp * f2_s + hh[:, None] * f2_h + ds[None, :], mn.to(tl.float16), mask=gm)
        codes = tl.reshape(_pack_bits(tl.reshape(q, (BLOCK_T * BLOCK_H, W)), BITS, BLOCK_T * BLOCK_H, W),
                           (BLOCK_T, BLOCK_H, PACKW))
        tl.store(F0 + s3 * f0_s + h3 * f0_h + i[None, None, :], codes, mask=m3)
