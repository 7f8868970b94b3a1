"""Quantize-on-write: new K or V tokens [tokens, kv_heads, D] -> codes and scales written into paged slots.

One kernel, the scheme selected by constexprs; the bytes it writes equal ``kvqref.schemes``' oracle
bytes (the tests compare them as integers). Every rounding is either an integer bit operation or one
IEEE-correct float32 operation (``div_rn``) whose result is then rounded once more where the oracle
rounds (bfloat16/float16 arithmetic emulated in float32 is exact: 24 >= 2p + 2).

Kinds (as the decode kernel): 0 BF16, 1 FP8, 2 MX block (E8M0 scales), 3 NVFP4, 4 INT value (KIVI,
per token over channel groups), 5 INT key (KIVI, per channel over a group of G tokens: one program
quantizes one whole token group, whose slots must be consecutive and G-aligned).

``ROTATE`` (a rotated scheme, docs/rotation.md): each (token, head) vector is rotated right after the load,
``z = f32(butterflies(x * signs) * C_D)`` (``codecs.hadamard_rows``), then rounded to an explicit model dtype
(``RDT``) and quantized as above; the host launches it without FP contraction.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvqref.kernels.codecs import (
    bf16_bits_to_f32,
    ceil_log2_f32,
    decode_f32,
    encode_f32,
    f32_to_bf16_bits,
    floor_log2_f32,
    hadamard_rows,
    pow2_f32,
    rint_small,
)


@triton.jit
def _div(a, b):
    """IEEE float32 division, round to nearest even (the default ``/`` is approximate on NVIDIA)."""
    return tl.math.div_rn(a, b)


@triton.jit
def _e2m1_away(y):
    """SGLang's E2M1 rounding: magnitude = number of midpoints 0.25 .. 5 that are <= |y|; sign iff y < 0."""
    a = tl.abs(y)
    m = ((a >= 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a >= 1.25).to(tl.int32)
         + (a >= 1.75).to(tl.int32) + (a >= 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a >= 5.0).to(tl.int32))
    return m | tl.where(y < 0, 8, 0)


@triton.jit
def _pack_pairs(codes, N: tl.constexpr, D: tl.constexpr):
    """[N, D] 4-bit codes -> [N, D/2] bytes, element 2i in the low nibble."""
    lo, hi = tl.split(tl.reshape(codes, (N, D // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def _pack_bits(codes, BITS: tl.constexpr, N: tl.constexpr, D: tl.constexpr):
    """[N, D] BITS-bit codes -> [N, D*BITS/8] bytes, LSB first along D."""
    if BITS == 4:
        return _pack_pairs(codes, N, D)
    else:
        a, b = tl.split(tl.reshape(codes, (N, D // 2, 2)))        # a: even, b: odd elements
        a0, a1 = tl.split(tl.reshape(a, (N, D // 4, 2)))          # elements 4j, 4j+2
        b0, b1 = tl.split(tl.reshape(b, (N, D // 4, 2)))          # elements 4j+1, 4j+3
        return (a0 | (b0 << 2) | (a1 << 4) | (b1 << 6)).to(tl.uint8)


@triton.jit
def _f16(x):
    """Round float32 to float16 (nearest even) and back."""
    return x.to(tl.float16).to(tl.float32)


@triton.jit
def _round_dt(x, DT: tl.constexpr):
    """Round float32 to the model dtype DT (0 float32: as is; 1 bfloat16; 2 float16), RNE, and back."""
    if DT == 1:
        return bf16_bits_to_f32(f32_to_bf16_bits(x))
    elif DT == 2:
        return _f16(x)
    else:
        return x


@triton.jit
def _signed_zero_min_max(x, mn_mask, AXIS: tl.constexpr):
    """(min, max) of ``x`` over ``AXIS`` (rows where ``mn_mask`` is False left out, if given) with -0.0 < +0.0,
    as the oracle's ``kivi.signed_zero_min_max``: a zero minimum is -0.0 iff a -0.0 is present, a zero maximum
    +0.0 iff a +0.0 is present."""
    big = 65504.0 * 4
    neg = x.to(tl.int32, bitcast=True) < 0
    zero = x == 0
    if mn_mask is None:
        mn = tl.min(x, AXIS)
        mx = tl.max(x, AXIS)
    else:
        mn = tl.min(tl.where(mn_mask, x, big), AXIS)
        mx = tl.max(tl.where(mn_mask, x, -big), AXIS)
        zero = zero & mn_mask
    neg0 = tl.max((zero & neg).to(tl.int32), AXIS)
    pos0 = tl.max((zero & (neg == 0)).to(tl.int32), AXIS)
    mn = tl.where(mn == 0, (neg0 << 31).to(tl.float32, bitcast=True), mn)
    mx = tl.where(mx == 0, ((1 - pos0) << 31).to(tl.float32, bitcast=True), mx)
    return mn, mx


@triton.jit
def _kivi_quant(x16, mn, mx, MAXINT: tl.constexpr):
    """KIVI in float16: scale = f16(f16(mx - mn) / MAXINT); q = rint(clamp(f16(f16(x - mn) / scale)));
    scale 0 (constant group) gives code 0."""
    rng = _f16(mx - mn)
    scale = _f16(_div(rng, tl.full(rng.shape, MAXINT, tl.float32)))
    safe = tl.where(scale == 0, 1.0, scale)
    y = _f16(_div(_f16(x16 - mn), safe))
    q = rint_small(tl.minimum(tl.maximum(y, 0.0), MAXINT * 1.0))
    q = tl.where(scale == 0, 0.0, q)
    return q.to(tl.int32), scale


@triton.jit
def quantize_write_kernel(
    X, SLOT, F0, F1, F2, SC, n_tokens,
    x_t, x_h, f0_s, f0_h, f1_s, f1_h, f2_s, f2_h,
    SIGNS, c_d,
    KIND: tl.constexpr, FMT: tl.constexpr, SGLANG: tl.constexpr, QDT: tl.constexpr, TOKEN_SCALE: tl.constexpr,
    SATURATE: tl.constexpr,
    QB: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
    ROTATE: tl.constexpr = False, RDT: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, D)
    tin = t < n_tokens
    slot = tl.load(SLOT + t, mask=tin, other=-1).to(tl.int64)
    tm = tin & (slot >= 0)
    m2 = tm[:, None]
    xr = tl.load(X + t[:, None].to(tl.int64) * x_t + h * x_h + d[None, :], mask=m2, other=0.0)
    if X.dtype.element_ty == tl.bfloat16:  # widen from the bits: exact for subnormals (the interpreter flushes them)
        x = bf16_bits_to_f32(xr.to(tl.int16, bitcast=True))
    else:
        x = xr.to(tl.float32)
    if ROTATE:  # docs/rotation.md: z = f32(butterflies(x * signs) * C_D), then (RDT) an explicit model dtype
        x = _round_dt(hadamard_rows(x * tl.load(SIGNS + d)[None, :], BLOCK_T, D) * c_d, RDT)
    if KIND == 0:
        bits = f32_to_bf16_bits(x).to(tl.int16)
        tl.store(F0 + slot[:, None] * f0_s + h * f0_h + d[None, :], bits.to(tl.bfloat16, bitcast=True), mask=m2)
    elif KIND == 1:
        MAXF: tl.constexpr = 448.0 if FMT == 0 else (57344.0 if FMT == 1 or FMT == 3 else 240.0)
        if TOKEN_SCALE:
            amax = tl.max(tl.abs(x), 1)
            s = tl.where(amax == 0, 1.0, _div(amax, tl.full(amax.shape, MAXF, tl.float32)))
            tl.store(F1 + slot * f1_s + h * f1_h, s, mask=tm)
            s2 = s[:, None]
        else:
            s2 = tl.load(SC + h)
        # x holds the model dtype's values (exact in float32); QDT: the dtype x / s is rounded to before the
        # FP8 conversion (SGLang divides in the model dtype, vLLM's HIP kernel in a float16 model's _Float16)
        if SGLANG == 2:  # a Python-float scale: torch multiplies by its float32 reciprocal (given in SC)
            y = x * s2
        else:
            sd = s2 + tl.zeros_like(x)
            if SGLANG == 1:  # a float32 tensor scale, cast to the model dtype by torch's type promotion
                sd = _round_dt(sd, QDT)
            y = _div(x, sd)
        c = encode_f32(_round_dt(y, QDT), FMT, SATURATE)
        tl.store(F0 + slot[:, None] * f0_s + h * f0_h + d[None, :], c.to(tl.uint8), mask=m2)
    elif KIND == 2 or KIND == 3:
        NB: tl.constexpr = D // QB
        xb = tl.reshape(x, (BLOCK_T, NB, QB))
        amax = tl.max(tl.abs(xb), 2)
        if KIND == 2:
            if SGLANG:
                v = tl.maximum(_div(amax, tl.full(amax.shape, 6.0, tl.float32)), 1e-10)
                e = tl.minimum(tl.maximum(ceil_log2_f32(v), -127), 127)
            else:
                e = tl.where(amax == 0, -127, tl.maximum(floor_log2_f32(amax) - 2, -127))
            y = xb * pow2_f32(-e)[:, :, None]  # float32 x / 2**e (SGLang's compiled arithmetic in every dtype)
            if SGLANG:
                c = _e2m1_away(y)
            else:
                c = encode_f32(y, 4, True)
            scode = e + 127
        else:
            g = tl.load(SC)
            s = _div(_div(amax, tl.full(amax.shape, 6.0, tl.float32)), g + tl.zeros_like(amax))
            s = tl.minimum(tl.maximum(s, 0.015625), 448.0)
            scode = encode_f32(s, 0, True)
            dv = decode_f32(scode, 0) * g
            c = encode_f32(_div(xb, dv[:, :, None] + tl.zeros_like(xb)), 4, True)
        i = tl.arange(0, D // 2)
        packed = _pack_pairs(tl.reshape(c, (BLOCK_T, D)), BLOCK_T, D)
        tl.store(F0 + slot[:, None] * f0_s + h * f0_h + i[None, :], packed, mask=m2)
        nb = tl.arange(0, NB)
        tl.store(F1 + slot[:, None] * f1_s + h * f1_h + nb[None, :], scode.to(tl.uint8), mask=m2)
    else:
        MAXINT: tl.constexpr = (1 << BITS) - 1
        x16 = _f16(x)
        PACKD: tl.constexpr = D * BITS // 8
        i = tl.arange(0, PACKD)
        if KIND == 4:
            NG: tl.constexpr = D // G
            xg = tl.reshape(x16, (BLOCK_T, NG, G))
            mn, mx = _signed_zero_min_max(xg, mn_mask=None, AXIS=2)
            q, scale = _kivi_quant(xg, mn[:, :, None], mx[:, :, None], MAXINT)
            codes = tl.reshape(q, (BLOCK_T, D))
            ng = tl.arange(0, NG)
            sc16 = tl.reshape(scale, (BLOCK_T, NG)).to(tl.float16)
            tl.store(F1 + slot[:, None] * f1_s + h * f1_h + ng[None, :], sc16, mask=m2)
            tl.store(F2 + slot[:, None] * f2_s + h * f2_h + ng[None, :], mn.to(tl.float16), mask=m2)
        else:
            # one program = one whole group of G = BLOCK_T tokens in consecutive, G-aligned slots
            mn, mx = _signed_zero_min_max(x16, mn_mask=m2, AXIS=0)
            q, scale = _kivi_quant(x16, mn[None, :], mx[None, :], MAXINT)
            codes = q
            grp = tl.min(tl.where(tm, slot, 2**62), 0) // G
            dm = (tl.zeros((D,), tl.int32) + tl.max(tm.to(tl.int32), 0)) > 0
            tl.store(F1 + grp * f1_s + h * f1_h + d, tl.reshape(scale, (D,)).to(tl.float16), mask=dm)
            tl.store(F2 + grp * f2_s + h * f2_h + d, mn.to(tl.float16), mask=dm)
        tl.store(F0 + slot[:, None] * f0_s + h * f0_h + i[None, :], _pack_bits(codes, BITS, BLOCK_T, D), mask=m2)
