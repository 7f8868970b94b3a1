"""Element encode/decode as Triton inline functions built from integer bit operations.

Integer operations are exact on every device and in the interpreter (whose float8 casts are not),
and they let one source serve NVIDIA and AMD, FN and FNUZ. Each function is the Triton twin of
``kvqref.formats.MinifloatCodec`` for the spec selected by constexprs, and the tests compare their
bytes with that oracle.

Format ids (``FMT`` constexpr) and their specs:
    0 float8_e4m3fn   (E4 M3 bias 7,  NaN S.1111.111)
    1 float8_e5m2     (E5 M2 bias 15, IEEE Inf/NaN)
    2 float8_e4m3fnuz (E4 M3 bias 8,  NaN 0x80)
    3 float8_e5m2fnuz (E5 M2 bias 16, NaN 0x80)
    4 float4_e2m1fn   (E2 M1 bias 1,  no NaN/Inf)
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

FMT_IDS: dict[str, int] = {
    "float8_e4m3fn": 0,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 2,
    "float8_e5m2fnuz": 3,
    "float4_e2m1fn": 4,
}


@triton.jit
def encode_f32(x, FMT: tl.constexpr, SATURATE: tl.constexpr, HW: tl.constexpr = False):
    """float32 -> code (int32), round to nearest, ties to even.

    ``SATURATE``: finite overflow and +-Inf give +-max finite; otherwise Inf (E5M2) or the NaN code.
    NaN gives the format's canonical NaN (E4M3FN 0x7F|sign, E5M2 0x7E|sign, FNUZ 0x80); E2M1 always
    saturates (NaN input is rejected on the host). FP8 codes come from the bits of ``x`` (integer
    operations) unless ``HW``: NVIDIA sm_89+ conversion (``cvt.rn.satfinite``) for the OCP formats
    (FMT 0, 1), whose input must be finite or NaN (the caller clamps Inf away); its saturation and NaN
    are overridden to the rules above. E2M1 (FMT 4) uses :func:`encode_e2m1`.
    """
    if FMT == 4:
        return encode_e2m1(x, True)
    if HW:
        return _encode_fp8_hw(x, FMT, SATURATE)
    EBITS: tl.constexpr = 4 if FMT == 0 or FMT == 2 else (5 if FMT == 1 or FMT == 3 else 2)
    MBITS: tl.constexpr = 3 if FMT == 0 or FMT == 2 else (2 if FMT == 1 or FMT == 3 else 1)
    BIAS: tl.constexpr = 7 if FMT == 0 else (15 if FMT == 1 else (8 if FMT == 2 else (16 if FMT == 3 else 1)))
    SIGN: tl.constexpr = 1 << (EBITS + MBITS)
    ALL: tl.constexpr = SIGN - 1
    # largest finite magnitude code: E5M2 reserves the top exponent, E4M3FN the all-ones code
    MAXC: tl.constexpr = ALL - (1 << MBITS) if FMT == 1 else (ALL - 1 if FMT == 0 else ALL)
    EMIN: tl.constexpr = 1 - BIAS

    u = x.to(tl.uint32, bitcast=True)
    neg = (u >> 31) != 0
    a = (u & 0x7FFFFFFF).to(tl.int32)
    exp32 = a >> 23
    isnan = a > 0x7F800000
    isinf = a == 0x7F800000
    sig = (a & 0x7FFFFF) | tl.where(exp32 != 0, 0x800000, 0)
    e = tl.maximum(exp32, 1) - 127  # unbiased exponent; float32 subnormals share 2**-126
    ec = tl.maximum(e, EMIN)
    shift = tl.minimum(23 - MBITS + (ec - e), 31)
    q = sig >> shift
    rem = sig - (q << shift)
    half = 1 << (shift - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) != 0))
    q = q + up.to(tl.int32)
    mag = ((ec - EMIN) << MBITS) + q
    over = (mag > MAXC) | isinf
    if SATURATE:
        mag = tl.where(over, MAXC, mag)
    elif FMT == 1:
        mag = tl.where(over, ALL - ((1 << MBITS) - 1), mag)  # Inf: top exponent, mantissa 0
    elif FMT == 0:
        mag = tl.where(over, ALL, mag)
    else:
        mag = tl.where(over, SIGN, mag)  # FNUZ NaN 0x80
    if FMT == 2 or FMT == 3:
        code = tl.where(neg & (mag != 0), mag | SIGN, mag)  # no negative zero; 0x80|0x80 stays NaN
        code = tl.where(isnan, SIGN, code)
    else:
        code = tl.where(neg, mag | SIGN, mag)
        if FMT == 1:
            nan_code = ALL - ((1 << MBITS) - 1) + (1 << (MBITS - 1))
        else:
            nan_code = ALL
        code = tl.where(isnan, nan_code | tl.where(neg, SIGN, 0), code)
    return code


@triton.jit
def decode_f32(code, FMT: tl.constexpr):
    """code (any int type) -> exact float32 value, via the float16 bit layout.

    The code's exponent and mantissa bits are placed in a float16 so that its value is the code's
    value times 2**(bias - 15) (subnormals included), then widened and rescaled exactly. NaN codes
    give NaN, E5M2 Inf codes +-Inf.
    """
    MBITS: tl.constexpr = 3 if FMT == 0 or FMT == 2 else (2 if FMT == 1 or FMT == 3 else 1)
    EBITS: tl.constexpr = 4 if FMT == 0 or FMT == 2 else (5 if FMT == 1 or FMT == 3 else 2)
    BIAS: tl.constexpr = 7 if FMT == 0 else (15 if FMT == 1 else (8 if FMT == 2 else (16 if FMT == 3 else 1)))
    SIGN: tl.constexpr = 1 << (EBITS + MBITS)
    c = code.to(tl.int32) & (2 * SIGN - 1)
    mag = c & (SIGN - 1)
    if FMT == 3:
        # bias 16: the top exponent does not fit float16's finite range, so build float32 bits directly
        ef = mag >> MBITS
        bits = ((ef + (127 - BIAS)) << 23) | ((mag & ((1 << MBITS) - 1)) << (23 - MBITS))
        v = tl.where(ef == 0, (mag & ((1 << MBITS) - 1)).to(tl.float32) * (2.0 ** (1 - BIAS - MBITS)),
                     bits.to(tl.float32, bitcast=True))
        v = tl.where((c & SIGN) != 0, -v, v)
    else:
        h = (mag << (10 - MBITS)) | tl.where((c & SIGN) != 0, 0x8000, 0)
        v = h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    if FMT == 1:
        return v  # E5M2 is the top byte of a float16: Inf and NaN come out as they are
    else:
        if FMT != 3:
            v = v * (2.0 ** (15 - BIAS))  # exact: a power-of-two rescale into float32's normal range
        if FMT == 0:
            v = tl.where(mag == SIGN - 1, float("nan"), v)
        elif FMT == 2 or FMT == 3:
            v = tl.where(c == SIGN, float("nan"), v)
        return v


@triton.jit
def e8m0_to_f32(code, FLOAT_OPS: tl.constexpr = True, BARE: tl.constexpr = False):
    """E8M0 code -> 2**(code - 127) as float32 (code 0 gives 2**-127, a float32 subnormal; 0xFF NaN).

    The code goes into float32's exponent field (``c << 23``): 2**(c - 127) for codes 1..254, +0 for 0 and +inf
    for 255, which two rules mend, the same bits (``test_e8m0_decoding_equals_the_oracle_codec_on_every_code``):
    ``FLOAT_OPS`` (fast decode): the maximum with 2**-127 (maxNum: a float32 subnormal, kept) mends code 0 and
    fma(g, 0, g), g for every finite g and NaN for inf (inf * 0), code 255: a shift and two float operations
    (H100, batch 32 x 8,192: fp4_e2m1 188.2 -> 170.5 us); else on the code, the top mantissa bit where
    ``(c + 1) & 0xFE == 0`` (codes 0 and 255 only: 0x00400000 = 2**-127, 0x7FC00000 = NaN), a compare, a select
    and a shift-add on the integer pipe, which exact decode keeps: its float32 pipe carries the split products
    (fp4_e2m1 exact 426.6 -> 468.6 us with the float rule; bench/results/ANALYSIS.md, session 25). ``BARE``: the
    exponent field alone, for callers that have checked that no code is 0 or 255 (fast FP4 decode, per tile)."""
    c = code.to(tl.int32)
    if BARE:  # the caller knows every code lies in 1 .. 254
        return (c << 23).to(tl.float32, bitcast=True)
    elif FLOAT_OPS:
        g = tl.maximum((c << 23).to(tl.float32, bitcast=True),
                       tl.full((), 0x400000, tl.int32).to(tl.float32, bitcast=True))
        return tl.fma(g, 0.0, g)
    else:
        return ((c << 23) + tl.where(((c + 1) & 0xFE) == 0, 0x400000, 0)).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_words_rare(w):
    """Per word of ``w`` [N] (int32/int64 holding E8M0 codes as bytes), nonzero where a byte is 0x00 or 0xFF (the
    two codes whose float32 is not the bare exponent field, :func:`e8m0_to_f32`): the bit trick for a zero byte,
    ``(v - 0x01..01) & ~v & 0x80..80``, on the word and on its complement (exact: the lowest such byte always sets
    its top bit; a borrow only sets bits above it)."""
    ones = tl.full((), 0x0101010101010101, tl.int64).to(w.dtype)
    tops = ones << 7
    return (((w - ones) & ~w) | ((~w - ones) & w)) & tops


@triton.jit
def e8m0_words_outside(w, lo, width):
    """Per word of ``w`` [N] (int32/int64 holding E8M0 codes as bytes), nonzero where a byte lies outside ``lo`` ..
    ``lo + width`` (scalars, 0 <= width <= 127, lo + width <= 255): per byte d = (byte - lo) mod 256 by a subtraction
    without borrows between bytes, ``((w | H) - (L & ~H)) ^ ((w ^ ~L) & H)`` (H = 0x80..80, L = lo in every byte),
    then flagged where d >= 128 or ``(d & 0x7F) + (127 - width)`` carries into bit 7 (no carry leaves a byte)."""
    ones = tl.full((), 0x0101010101010101, tl.int64).to(w.dtype)
    tops = ones << 7
    L = lo.to(w.dtype)
    L = L | (L << 8)
    L = L | (L << 16)
    if w.dtype == tl.int64:
        L = L | (L << 32)
    d = ((w | tops) - (L & ~tops)) ^ ((w ^ ~L) & tops)
    return (d | ((d & ~tops) + (tl.full((), 127, w.dtype) - width) * ones)) & tops


@triton.jit
def floor_log2_f32(x):
    """floor(log2(|x|)) of a finite nonzero float32 from its exponent bits (subnormals give -127..-149
    clamped to -127, which is all an E8M0 scale can hold)."""
    a = (x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF).to(tl.int32)
    return tl.maximum(a >> 23, 0) - 127


@triton.jit
def pow2_f32(k):
    """2**k as float32 for integer k in [-126, 127] (exact)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(x):
    """float32 -> bfloat16 bits (int32), round to nearest even; overflow -> +-Inf; NaN -> 0x7FC0 | sign."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, ((u >> 16) & 0x8000) | 0x7FC0, r)
    return r.to(tl.int32)


@triton.jit
def bf16_bits_to_f32(b):
    return (b.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def ceil_log2_f32(x):
    """ceil(log2(x)) of a positive normal float32, exactly from its bits."""
    a = x.to(tl.int32, bitcast=True)
    return (a >> 23) - 127 + ((a & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def rint_small(y):
    """Round a float32 in [0, 2**22) to the nearest integer, ties to even (portable; no libdevice)."""
    r = tl.floor(y + 0.5)
    tie = (r - y) == 0.5
    half = r * 0.5
    odd = half != tl.floor(half)
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _ieee_add(a, b):
    """The combine of a pair sum: one IEEE addition, no identity element (``tl.sum`` in the interpreter starts
    from +0.0, which turns (-0.0) + (-0.0) into +0.0)."""
    return a + b


@triton.jit
def _lane_xor(x, M: tl.constexpr):
    """The value that lane ``laneid ^ M`` of the warp holds in the same register as ``x`` (CUDA
    ``shfl.sync.bfly``; all 32 lanes take part, as in Triton's straight-line code): a bit move, no rounding."""
    bits = tl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=r,r,r",
                                     [x.to(tl.int32, bitcast=True), tl.full(x.shape, M, tl.int32)],
                                     dtype=tl.int32, is_pure=True, pack=1)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def hadamard_rows(x, ROWS: tl.constexpr, D: tl.constexpr, ROUTE: tl.constexpr = 0, LANE_H: tl.constexpr = 16,
                  LANE_N: tl.constexpr = 8, SHFL_ASM: tl.constexpr = False, signs=None):
    """``x @ H`` for every row of a float32 ``[ROWS, D]`` tensor (``H`` the D x D Sylvester Hadamard matrix,
    D a power of two <= 2**15), by the butterfly stages of docs/rotation.md in their fixed order h = 1, 2, ...,
    D/2: for every ``j`` with ``j & h == 0``, ``(x[j], x[j + h]) <- (x[j] + x[j + h], x[j] - x[j + h])``, each an
    IEEE float32 add or subtract (no multiply is involved, so FP contraction cannot fuse them), bit-identical
    to :func:`kvqref.schemes.rotation.butterflies`. Stage ``h = 1 << s`` views a row as ``[D / 2h, 2, h]``:
    ``a = [:, 0, :]`` (elements j), ``b = [:, 1, :]`` (elements j + h).

    Three ways to move the data (``ROUTE``), the same values:

    - 0 (split/join): ``tl.split``/``tl.join`` of the pair axis (on sm_90 the stages whose pairs lie in other
      threads go through shared memory: 16 stores, 20 loads and 16 barriers per [32, 128] tile with 4 warps);
    - 1 (by sums): each stage as two sums over the pair axis, ``a + b = sum(a, b)`` and ``a - b = sum(a, -b)``,
      each one IEEE addition (``tl.reduce`` with a plain ``a + b`` combine; ``a + (-b)`` is IEEE's definition
      of ``a - b`` and addition is commutative, so whichever order the reduction takes gives the same bits),
      selected back into place: no layout conversion, pairs in other lanes meet by warp shuffles;
    - 2 (by partner): the stages ``LANE_H <= h < LANE_H * LANE_N`` (pairs in other lanes) as
      ``x[j] <- fma(s_j, x[j], x[j ^ h])``, ``s_j = +1`` if ``j & h == 0`` else ``-1``: the lower element gets
      ``a * 1 + b``, the upper ``b * -1 + a``; the product by +-1 is exact, so the fused multiply-add is the exact
      ``a + b`` or ``a + (-b)`` rounded once, which is IEEE's ``a + b`` and ``a - b`` (subtraction is defined as
      adding the negation; an exact zero sum is +0 unless both terms are -0, for fma as for add): the same bits,
      signed zeros and subnormals included; the other stages (pairs in one thread's registers) by split/join,
      which then moves no data. The partner ``x[j ^ h]`` comes from ``tl.gather`` along the row, or with
      ``SHFL_ASM`` (CUDA only) from one ``shfl.sync.bfly`` with lane mask ``h // LANE_H``: correct only where
      the tensor's layout puts column bit ``LANE_H << k`` on lane bit ``k`` (k < log2 LANE_N) of the same
      register, which ``triton_backend.settle_partner_lanes`` reads from the compiled kernel
      (``kernels/layout.py``).

    ``signs`` (a float32 ``[D]`` of +-1, optional): the rows are ``x * signs`` (exact), with the products folded into
    the first stage where it moves no data (ROUTE 0, or 2 with LANE_H > 1): ``a' = a s_a``, then ``fma(b, s_b, a')`` and
    ``fma(b, -s_b, a')``, each the exact ``a' + b s_b`` / ``a' - b s_b`` rounded once, which IEEE defines as the
    sum and difference of the products (signed zeros included): the same bits, one multiply per pair fewer."""
    if signs is not None and (ROUTE == 1 or (ROUTE == 2 and LANE_H == 1)):  # a first stage across lanes
        x = x * signs[None, :]
    for s in tl.static_range(15):  # stage sizes inline: compiled Triton rejects a constexpr reassigned here
        if (2 << s) <= D:
            if ROUTE == 1:
                x4 = tl.reshape(x, (ROWS, D // (2 << s), 2, 1 << s))
                first = tl.arange(0, 2)[None, None, :, None] == 0
                a_plus_b = tl.reduce(x4, 2, _ieee_add)
                a_minus_b = tl.reduce(tl.where(first, x4, x4 * -1.0), 2, _ieee_add)  # x * -1.0: not 0 - x (3.6)
                x = tl.reshape(tl.where(first, a_plus_b[:, :, None, :], a_minus_b[:, :, None, :]), (ROWS, D))
            elif ROUTE == 2 and (1 << s) >= LANE_H and (1 << s) < LANE_H * LANE_N:
                j = tl.arange(0, D)
                if SHFL_ASM:
                    partner = _lane_xor(x, (1 << s) // LANE_H)
                else:
                    partner = tl.gather(x, tl.broadcast_to((j ^ (1 << s))[None, :], (ROWS, D)), 1)
                x = tl.fma(tl.where((j & (1 << s)) == 0, 1.0, -1.0)[None, :], x, partner)
            elif s == 0 and signs is not None:  # (ROUTE 0, or 2 with the first stage in registers)
                a, b = tl.split(tl.reshape(x, (ROWS, D // 2, 2)))
                sa, sb = tl.split(tl.reshape(signs, (1, D // 2, 2)))
                a = a * sa
                x = tl.reshape(tl.join(tl.fma(b, sb, a), tl.fma(b, sb * -1.0, a)), (ROWS, D))
            else:
                x4 = tl.permute(tl.reshape(x, (ROWS, D // (2 << s), 2, 1 << s)), (0, 1, 3, 2))
                a, b = tl.split(x4)
                x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (ROWS, D))
    return x


@triton.jit
def encode_e2m1(x, CLAMP: tl.constexpr):
    """float32 -> E2M1 code (int32): round to nearest, ties to even, saturating to +-6, the sign bit from
    ``x`` (-0.0 gives 0x8). ``CLAMP``: any input (NaN -> +-6); without it |x| must be below 2**100.

    Float arithmetic: ``a = min(|x|, 8)``; ``M = 2**(max(floor(log2 a), 0) + 22)`` has ulp equal to the
    E2M1 spacing at ``a`` (0.5 below 2, 1 in [2, 4), 2 in [4, 8)), so ``t = a + M`` rounds ``a`` to the
    E2M1 grid (one IEEE addition, ties to even: the code's parity is the grid index's), ``t``'s bits hold
    ``M``'s exponent (2 E + 298 in bits 22+) and the grid index ``k`` (low bits); the code is
    ``k + 2 E``, capped at 7. Checked against the integer encoder on every float32 below 2**4 and random
    others (tests/test_write_arith.py).
    """
    a = tl.abs(x)
    if CLAMP:
        a = tl.minimum(a, 8.0)
    m = tl.maximum((a.to(tl.int32, bitcast=True) & 0x7F800000) + (22 << 23), 0x3F800000 + (22 << 23))
    t = (a + m.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
    code = tl.minimum(t - (t >> 22) * ((1 << 22) - 1) - 298, 7)
    return code | ((x.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _e2m1_grid_bits(q):
    """Bits of ``t = q + M`` for a float32 ``0 <= q < 7``: ``M = 2**(max(floor(log2 q), 0) + 22) + 214 ulp`` (bits
    ``(e + 149) << 23 | 214``), whose ulp is the E2M1 spacing at ``q``, so the one IEEE addition rounds ``q`` to
    the E2M1 grid, ties to even (214 is even: the result's parity is the grid index's), and ``t`` holds the
    exponent ``e + 149`` and ``214 + k`` (``k`` the grid index, code = ``k + 2 e``) in its low bits."""
    m = tl.maximum((q.to(tl.int32, bitcast=True) & 0x7F800000) + ((22 << 23) + 214), 0x3F800000 + (22 << 23) + 214)
    return (q + m.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)


@triton.jit
def e2m1_pair_bytes(qe, qo, sw):
    """Bytes of E2M1 pairs from magnitudes: RNE E2M1 codes of ``qe`` (even element, low nibble) and ``qo`` (odd,
    high nibble), float32 in [0, 7) (codes 0..7: no saturation is needed below 7), and the signs from ``sw``
    (int32: the even element's sign at bit 15, the odd's at bit 31, every other bit 0: a bfloat16 pair word
    ``& 0x80008000``). The byte is built in the top byte of ``B = te (2**24 + 4) + sw + to (2**28 + 2**6) +
    (sw << 12)`` (mod 2**32, ``te``/``to`` from :func:`_e2m1_grid_bits`): ``te << 24`` puts ``214 + k`` and
    ``te << 2`` the exponent byte ``2 e + 298 = 2 e + 42 (mod 256)`` into bits 24..31, which sum to ``256 + code``,
    i.e. the code (``te``'s other bits land below bit 24, as do sw's bit 15 and the odd part's; together below
    2**16, no carry); likewise ``to`` gives ``(6 + k) + (2 e + 10) = 16 + code`` in bits 28..31; ``sw`` puts the odd
    sign at bit 31, ``sw << 12`` the even sign at bit 27. Two multiply-adds and a shift-add per pair."""
    b = _e2m1_grid_bits(qe) * 0x1000004 + sw
    b = _e2m1_grid_bits(qo) * 0x10000040 + b
    return ((b + (sw << 12)) >> 24).to(tl.uint8)


@triton.jit
def _encode_fp8_hw(x, FMT: tl.constexpr, SATURATE: tl.constexpr):
    """OCP FP8 code of a finite-or-NaN float32 by the hardware conversion (RNE, saturating to max
    finite); non-saturating overflow moves the saturated code one step up (E4M3FN: 0x7E -> NaN 0x7F,
    E5M2: 0x7B -> Inf 0x7C, sign kept): overflow is |x| > 464 (E4M3FN) or |x| >= 61440 (E5M2), the first
    values that round past max finite; NaN gives the positive canonical NaN code of the integer encoder
    (GPU arithmetic returns NaN without its sign): E4M3FN's 0x7F is the conversion's own result, E5M2's 0x7E is
    selected (one select per element fewer for E4M3FN, which lets the packed conversion results go to the store
    as they are)."""
    if FMT == 0:
        c = x.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        c = x.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True).to(tl.int32)
    if not SATURATE:
        if FMT == 0:
            c = c + (tl.abs(x) > 464.0).to(tl.int32)
        else:
            c = c + (tl.abs(x) >= 61440.0).to(tl.int32)
    if FMT == 0:  # the conversion itself gives 0x7F for every positive NaN (all payloads: bench/ab_write.py's proofs)
        return c
    return tl.where(x != x, 0x7E, c)


@triton.jit
def round_f16(x, CVT: tl.constexpr = False):
    """float32 rounded to float16 (nearest, ties to even, subnormals included) and back, for finite |x| <
    65520 (what float16 holds: the callers' inputs are range-checked); -0.0 stays -0.0.

    ``CVT``: by the conversion instructions. Otherwise by float arithmetic: ``M = 2**(max(floor(log2|x|),
    -14) + 13)`` has ulp equal to float16's spacing at ``|x|``, so ``(|x| + M) - M`` is |x| rounded (ties
    to even) exactly; the sign bit is put back.
    """
    if CVT:
        return x.to(tl.float16).to(tl.float32)
    else:
        u = x.to(tl.int32, bitcast=True)
        a = tl.abs(x)
        m = tl.maximum((u & 0x7F800000) + (13 << 23), 0x38800000 + (13 << 23)).to(tl.float32, bitcast=True)
        r = (a + m) - m
        return (r.to(tl.int32, bitcast=True) | (u & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def round_f16_nonneg(x, CVT: tl.constexpr = False):
    """:func:`round_f16` for x >= 0 (+0.0 included): one integer operation fewer."""
    if CVT:
        return x.to(tl.float16).to(tl.float32)
    else:
        m = tl.maximum((x.to(tl.int32, bitcast=True) & 0x7F800000) + (13 << 23), 0x38800000 + (13 << 23))
        m = m.to(tl.float32, bitcast=True)
        return (x + m) - m


@triton.jit
def round_f16_of_bf16(x):
    """:func:`round_f16` of a bfloat16 value ``x`` (held in float32; |x| < 65520): ``(|x| + 0.5) - 0.5`` with
    the sign bit put back. The sum's ulp is 2**-24 for |x| < 0.5, float16's spacing below 2**-14, so the first
    addition rounds |x| to a multiple of 2**-24 (ties to even); every other bfloat16 value (8 significant bits,
    exponent >= -17) is already one, and then both operations are exact. Checked on all bfloat16 values
    (tests/test_write_arith.py)."""
    r = (tl.abs(x) + 0.5) - 0.5
    return (r.to(tl.int32, bitcast=True) | (x.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_normal_bits(s):
    """(E4M3FN code, the code's value as float32) of a float32 ``s`` in [2**-6, 448] (E4M3's normal range, as
    NVFP4's clamped block scales): round to nearest even at 3 mantissa bits on the bits, ``u + 0x7FFFF + bit20``
    (a carry moves into the exponent), then rebias 127 -> 7. The same codes as :func:`encode_f32` (FMT 0) there
    (tests/test_write_arith.py)."""
    u = s.to(tl.int32, bitcast=True)
    r = (u + 0x7FFFF + ((u >> 20) & 1)) >> 20
    return r - ((127 - 7) << 3), (r << 20).to(tl.float32, bitcast=True)


@triton.jit
def page_slot(page, t, PAGE: tl.constexpr, PAGE_SLOTS: tl.constexpr):
    """The field row (slot) of token ``t`` held in ``page``: ``page * PAGE_SLOTS + t % PAGE``. ``PAGE_SLOTS`` is
    PAGE where a page's rows are token-major (fields [slot, head, ...], NHD) and KV_HEADS * PAGE where they are
    head-major (fields [page, head, slot in page, ...], HND: each head's PAGE rows contiguous, the head stride
    spanning them); a group of G tokens (G dividing PAGE) is then in group row ``slot // G`` either way."""
    return page * PAGE_SLOTS + t % PAGE
