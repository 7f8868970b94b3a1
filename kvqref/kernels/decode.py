"""Split-KV (flash-decoding) attention over a quantized paged KV cache: one kernel for every scheme.

Stage 1 (``decode_split_kernel``): one program per (sequence, KV head, split) reads its range of the
paged cache in its stored form (codes + scales), dequantizes in registers with a constexpr-selected
inline function (``KIND``), and keeps an online softmax for the query heads of that KV head (GQA/MQA).
A last split per sequence attends KIVI's full-precision residual window in the same launch.
Stage 2 (``merge_kernel``) merges the splits by their log-sum-exp; with one split and nothing to merge
(``direct_output``), stage 1 writes the output and the LSE itself.

Cache tile kinds (``KIND_K``/``KIND_V``) and the fields they read (leading axes [slot, head]):
    0 BF16     F0 bf16 [D]
    1 FP8      F0 uint8 codes [D] (format ``FMT``); F1 float32 per-token scale [] when ``TOKEN_SCALE``
    2 MXFP4    F0 uint8 [D/2] (element 2i low nibble); F1 uint8 E8M0 [D/QB]
    3 NVFP4    F0 uint8 [D/2]; F1 uint8 E4M3FN [D/16] (global scale folded into the tensor scale)
    4 INT-V    F0 uint8 [D*BITS/8] LSB-first; F1 fp16 scale, F2 fp16 zero [D/G] (per token, channel groups)
    5 INT-K    F0 as 4; F1 fp16 scale, F2 fp16 zero [D] per group of G slots (per channel, token groups)
Tensor-level scales (FP8 per-tensor/per-head, NVFP4 global) are folded: K's into the softmax scale,
V's into the output. Per-token FP8 scales multiply score columns and probabilities, never the
elements, so dequantized FP8 tiles are exact in float16 and FP4 tiles exact in bfloat16 (NVFP4 also in
float16) and go to the tensor cores as they are. KIVI keys fold the group's per-channel scale and zero
into q (exact mode, or fast with ``key_tile=False``; fast mode by default splits the dequantized key tile in
two bfloat16 parts), so their integer codes go to the tensor cores exactly. Operands that are not exact in 16 bits
(q in float32, the probabilities, KIVI q x s and value tiles, the residual): ``precision="exact"`` splits
them into two or three 16-bit parts whose sum is the float32 value (products of float32 operands);
``precision="fast"`` (the default, constexpr ``FAST``) rounds q and p once to 16 bits and splits KIVI and
residual tiles in two bfloat16 parts (docs/kernels.md, "Precision", derives both error bounds).
"""

from __future__ import annotations

import functools
import inspect
import itertools
from typing import Any, NamedTuple

import triton
import triton.language as tl

from kvqref.kernels.codecs import (
    INTERPRET,
    bf16_bits_to_f32,
    decode_f32,
    e8m0_to_f32,
    e8m0_words_outside,
    e8m0_words_rare,
    f32_to_bf16_bits,
    floor_log2_f32,
    hadamard_rows,
    page_slot,
    pow2_f32,
)
from kvqref.kernels.kept_plans import KeptPlans


@triton.jit
def _bf16_rn(x):
    """float32 ``x`` rounded to bfloat16 (to nearest, ties to even), as float32, with integer operations
    (the interpreter's bfloat16 cast truncates); finite ``x`` only."""
    return (f32_to_bf16_bits(x) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _split(x, THREE: tl.constexpr, FAST: tl.constexpr = False):
    """float32 -> bfloat16 parts whose sum is ``x``: (hi, lo, lo), hi + lo = x to about 16 bits, or with
    ``THREE`` (hi, mid, lo), exact for float32. ``FAST``: ``x`` rounded once to bfloat16 (only ``hi`` is
    used). Interpreter: (r, r, r) with r the float32 value the parts sum to (x itself with ``THREE``)."""
    if INTERPRET:
        if FAST:
            r = _bf16_rn(x)
        elif THREE:
            r = x
        else:
            r = _bf16_rn(x) + _bf16_rn(x - _bf16_rn(x))
        return r, r, r
    else:
        hi = x.to(tl.bfloat16)
        if FAST:
            return hi, hi, hi
        else:
            r = x - hi.to(tl.float32)
            mid = r.to(tl.bfloat16)
            if THREE:
                lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
            else:
                lo = mid
            return hi, mid, lo


@triton.jit
def _mm(a_hi, a_mid, a_lo, b, A_PARTS: tl.constexpr, B_SPLIT: tl.constexpr):
    """(a_hi + a_mid + a_lo) [M, K] @ b [K, N], float32 accumulation on bfloat16 tensor cores; ``A_PARTS``
    of ``a`` are used (1: ``a`` is exact in bfloat16, or rounded to it in fast mode; 3: float32). ``b`` is
    used as bfloat16 (``B_SPLIT`` 0: exact in bfloat16), or split in two (2: about 16 bits, fast mode) or
    three (3: exact) bfloat16 parts. Interpreter: one exact float32 dot (``b``'s two-part split emulated)."""
    if INTERPRET:
        bq = b.to(tl.float32)
        if B_SPLIT == 2:
            bq, _, _ = _split(bq, False)
        return tl.dot(a_hi, bq, input_precision="ieee")
    else:
        if B_SPLIT != 0:
            b_hi, b_mid, b_lo = _split(b.to(tl.float32), B_SPLIT == 3)
        else:
            b_hi = b.to(tl.bfloat16)
        acc = tl.dot(a_hi, b_hi)
        if A_PARTS >= 2:
            acc += tl.dot(a_mid, b_hi)
        if A_PARTS >= 3:
            acc += tl.dot(a_lo, b_hi)
        if B_SPLIT != 0:
            acc += tl.dot(a_hi, b_mid)
            if A_PARTS >= 2:
                acc += tl.dot(a_mid, b_mid)
        if B_SPLIT == 3:
            acc += tl.dot(a_hi, b_lo)
        return acc


@triton.jit
def _split16(x, FAST: tl.constexpr = False):
    """float32 -> (hi, lo) float16 parts, hi + lo = x to 22 bits (the caller scales x into float16's range);
    ``FAST``: ``x`` rounded once to float16 (only ``hi`` is used). Interpreter: float32 values."""
    if INTERPRET:
        if FAST:
            r = x.to(tl.float16).to(tl.float32)
            return r, r
        else:
            return x, x
    else:
        hi = x.to(tl.float16)
        if FAST:
            return hi, hi
        else:
            return hi, (x - hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _mm16(a_hi, a_lo, b, A_PARTS: tl.constexpr):
    """(a_hi + a_lo) @ b on float16 tensor cores (``b`` exact in float16: FP8 values), float32 accumulation."""
    if INTERPRET:
        return tl.dot(a_hi, b.to(tl.float32), input_precision="ieee")
    else:
        acc = tl.dot(a_hi, b)
        if A_PARTS >= 2:
            acc += tl.dot(a_lo, b)
        return acc


@triton.jit
def _mm_t(a, b_hi, b_mid, b_lo, B_PARTS: tl.constexpr, F16: tl.constexpr):
    """a [M, K] (exact in float16 if ``F16``, else in bfloat16) @ (b_hi + b_mid + b_lo) [K, N]."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b_hi, input_precision="ieee")
    else:
        if F16:
            a2 = a.to(tl.float16)
        else:
            a2 = a.to(tl.bfloat16)
        acc = tl.dot(a2, b_hi)
        if B_PARTS >= 2:
            acc += tl.dot(a2, b_mid)
        if B_PARTS >= 3:
            acc += tl.dot(a2, b_lo)
        return acc


@triton.jit
def _e2m1_f16(nib):
    """E2M1 code (low 4 bits of an int32) -> its value * 2**-14 as float16, exact (the code's exponent and
    mantissa bits placed in float16's; E2M1 0.5 becomes the float16 subnormal 2**-15)."""
    h = ((nib & 7) << 9) | ((nib & 8) << 12)
    return h.to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _nvfp4_tile16(byte, scale_code, FMT: tl.constexpr, PTX: tl.constexpr):
    """Fast-mode NVFP4 tile elements of the low and high nibbles of ``byte`` (uint8), as float16
    E2M1 * scale * 2**-14 (``scale_code``: E4M3, broadcast): multiples of 2**-24 below 0.17 with at most 6
    significant bits, so exact in float16 (subnormals included); the caller owes a factor 2**14.
    ``FMT`` >= 8: E4M3FN converted in hardware; ``PTX``: see :func:`_e2m1_nibbles_f16`."""
    lo, hi, f = _nvfp4_tile16_parts(byte, scale_code, FMT, PTX)
    return lo * f, hi * f


@triton.jit
def _nvfp4_tile16_parts(byte, scale_code, FMT: tl.constexpr, PTX: tl.constexpr):
    """:func:`_nvfp4_tile16` before its two multiplies: the low and high nibbles' E2M1 * 2**-14 (float16) and the
    E4M3 block scale as float16 (exact: E4M3 values are float16 values; ``FMT`` >= 8: converted in hardware), for a
    caller that scales each half right before its own product (one shared-memory buffer then serves both halves'
    layout conversions)."""
    if FMT >= 8 and not INTERPRET:
        f = scale_code.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        f = decode_f32(scale_code, 0).to(tl.float16)
    lo, hi = _e2m1_nibbles_f16(byte, PTX)
    return lo, hi, f


@triton.jit
def _e2m1_nibbles_f16(byte, PTX: tl.constexpr):
    """The E2M1 codes of the low and high nibbles of ``byte`` (uint8) as float16 value * 2**-14 (exact):
    with inline PTX (:func:`_e2m1_pairs`) if ``PTX`` (CUDA), else with :func:`_e2m1_f16`."""
    if PTX and not INTERPRET:
        return _e2m1_pairs(byte, False)
    else:
        b = byte.to(tl.int32)
        return _e2m1_f16(b & 15), _e2m1_f16(b >> 4)


def _e2m1_code_lines(out: str, src: str, field_shift: int, sign_shift: int, pos: int) -> list[str]:
    """PTX lines of one output register of :func:`_e2m1_pairs_ptx` / :func:`_e2m1_quads_ptx`: two 16-bit floats with
    the E2M1 codes' exponent and mantissa bits (``src`` shifted left by ``field_shift``, right if negative) in the
    field at ``pos`` .. ``pos + 2`` of each half and their signs (``src`` shifted left by ``sign_shift``) at bits 15
    and 31: ``(t & field) | (v & 0x80008000)`` by one ``lop3`` after the shifts and the sign's ``and``."""
    field = 7 << pos

    def shift(dst: str, by: int) -> str:
        return f"shl.b32 {dst}, {src}, {by};" if by > 0 else f"shr.b32 {dst}, {src}, {-by};"

    lines = [shift("t", field_shift)]
    if sign_shift:
        lines += [shift("v", sign_shift), "and.b32 v, v, 0x80008000;"]
    else:
        lines.append(f"and.b32 v, {src}, 0x80008000;")
    return lines + [f"lop3.b32 {out}, t, v, 0x{field:04X}{field:04X}, 0xEC;"]  # (t & field) | v


def _e2m1_pairs_ptx(pos: int) -> str:
    """The 16-bit-domain PTX of :func:`_e2m1_pairs` (``pos`` 6: bfloat16, the one in use; 9 would be float16, which
    :func:`_e2m1_f16_ptx` builds in the byte domain instead): input $4 (bytes 0-3), outputs
    $0, $1 (low nibbles of bytes 0,1 and 2,3) and $2, $3 (high nibbles). The 16-bit float's bits are the code's sign
    at bit 15 and its exponent and mantissa bits at ``pos`` .. ``pos + 2`` (the float's lowest exponent bits and
    highest mantissa bit). Per pair of bytes, ``prmt`` puts them in the high bytes of the halves of y: the high
    nibble's sign is then already at bit 15, its other bits move right by ``12 - pos``; the low nibble's sign moves
    left by 4, its other bits by ``8 - pos`` (:func:`_e2m1_code_lines`; what lands in the low bytes is masked off):
    16 instructions per 8 codes."""
    lines = [".reg .b32 y, t, v;"]
    for sel, lo_out, hi_out in (("0x1000", 0, 2), ("0x3020", 1, 3)):  # y = [-, byte a, -, byte b]
        lines.append(f"prmt.b32 y, $4, $4, {sel};")
        lines += _e2m1_code_lines(f"${hi_out}", "y", pos - 12, 0, pos)
        lines += _e2m1_code_lines(f"${lo_out}", "y", pos - 8, 4, pos)
    return "{\n" + "\n".join(lines) + "\n}"


def _e2m1_quads_ptx(pos: int) -> str:
    """The 16-bit-domain PTX of :func:`_e2m1_quads` (``pos`` as :func:`_e2m1_pairs_ptx`): input $4, two 16-bit
    words (bytes 0, 1 and 2, 3); output k holds nibble k of each word in the word's half. Bytes 1 and 3 already lie
    in the high bytes of the halves (as ``prmt`` arranges them for :func:`_e2m1_pairs_ptx`), and bytes 0 and 2 are
    there after a shift by 8, folded into the shifts that follow: no ``prmt``, 15 instructions per 8 codes."""
    lines = [".reg .b32 t, v;"]
    lines += _e2m1_code_lines("$3", "$4", pos - 12, 0, pos)  # nibble 3: high nibbles of bytes 1, 3
    lines += _e2m1_code_lines("$2", "$4", pos - 8, 4, pos)  # nibble 2: low nibbles of bytes 1, 3
    lines += _e2m1_code_lines("$1", "$4", pos - 4, 8, pos)  # nibble 1: high nibbles of bytes 0, 2
    lines += _e2m1_code_lines("$0", "$4", pos, 12, pos)  # nibble 0: low nibbles of bytes 0, 2
    return "{\n" + "\n".join(lines) + "\n}"


def _e2m1_f16_bytes_lines() -> list[str]:
    """PTX lines that turn the eight E2M1 codes of $4 into the high bytes of their float16 values * 2**-14, four codes
    per 32-bit operation: ``h`` byte i from the high nibble of byte i, ``l`` byte i from its low nibble, each byte
    ``sign << 7 | (exponent and mantissa bits) << 1`` (the float16's top byte, as :func:`_e2m1_f16`'s bits >> 8).
    High nibble: its sign is already bit 7, the other bits move right by 3; low nibble: sign left by 4, the other
    bits left by 1; what crosses into a neighbouring byte is masked off. 7 instructions per 8 codes; a ``prmt`` per
    two codes then places two bytes in the high bytes of a register's halves (:func:`_e2m1_f16_ptx`)."""
    return [".reg .b32 a, s, h, l;",
            "shr.b32 a, $4, 3;", "and.b32 s, $4, 0x80808080;", "lop3.b32 h, a, s, 0x0E0E0E0E, 0xEC;",  # (a & c) | s
            "shl.b32 a, $4, 4;", "and.b32 s, a, 0x80808080;", "shl.b32 a, $4, 1;",
            "lop3.b32 l, a, s, 0x0E0E0E0E, 0xEC;"]


def _e2m1_f16_ptx(outputs: tuple[tuple[str, str], ...]) -> str:
    """The float16 PTX of :func:`_e2m1_pairs` and :func:`_e2m1_quads`: the code bytes of :func:`_e2m1_f16_bytes_lines`,
    then for output register $k one ``prmt`` of ``outputs[k]`` = (``l`` or ``h``, selector) putting two of those bytes
    in the high bytes of the halves over zero low bytes: 11 instructions per 8 codes (the 16-bit route: 16 for
    pairs, 15 for quads)."""
    lines = _e2m1_f16_bytes_lines()
    lines += [f"prmt.b32 ${k}, {src}, 0, {sel};" for k, (src, sel) in enumerate(outputs)]
    return "{\n" + "\n".join(lines) + "\n}"


#: :func:`_e2m1_pairs`' outputs (as :func:`_e2m1_pairs_ptx`'s): $0, $1 the low nibbles of bytes 0, 1 and 2, 3; $2, $3
#: their high nibbles (selector nibbles per output byte: 4 = zero, i = byte i)
E2M1_PAIRS_PTX = tl.constexpr(_e2m1_f16_ptx((("l", "0x1404"), ("l", "0x3424"), ("h", "0x1404"), ("h", "0x3424"))))
E2M1_PAIRS_BF16_PTX = tl.constexpr(_e2m1_pairs_ptx(6))
#: 2**126, from the bfloat16 PTX unpacking's E2M1 * 2**-126 to E2M1 (a constexpr: the products stay bfloat16)
TWO_126 = tl.constexpr(8.507059173023462e37)
#: E8M0 value products in float16 (``e8m0_values_f16``): a split runs them only while every value scale code lies in
#: mc - window .. mc, mc its first tile's largest value code plus the headroom; the float16 subnormal step then costs
#: a token's weight at most 2**(window - 40) (docs/kernels.md)
E8M0_V16_WINDOW = tl.constexpr(16)
E8M0_V16_HEADROOM = tl.constexpr(4)
#: :func:`_e2m1_quads`' outputs: $k nibble k of each of the two words (bytes 0, 1 and 2, 3): the low / high nibbles of
#: bytes 0 and 2 (k = 0, 1), of bytes 1 and 3 (k = 2, 3)
E2M1_QUADS_PTX = tl.constexpr(_e2m1_f16_ptx((("l", "0x2404"), ("h", "0x2404"), ("l", "0x3414"), ("h", "0x3414"))))
E2M1_QUADS_BF16_PTX = tl.constexpr(_e2m1_quads_ptx(6))


@triton.jit
def _e2m1_quads(word, PTX: tl.constexpr, BF16: tl.constexpr):
    """The four E2M1 codes of each 16-bit ``word`` (int16: two code bytes; channel 4c + k is nibble k) as four
    tensors: float16 value * 2**-14, or with ``BF16`` the exact values in bfloat16 (float32 in the interpreter, which
    cannot bitcast to bfloat16). CUDA (``PTX``): two words per 32-bit register, ``E2M1_QUADS_PTX`` (float16,
    :func:`_e2m1_f16_ptx`) or :func:`_e2m1_quads_ptx` (bfloat16: value * 2**-126 times 2**126, one packed multiply,
    exact); elsewhere nibble by nibble."""
    if PTX and not INTERPRET:
        if BF16:
            a, b, c, d = tl.inline_asm_elementwise(E2M1_QUADS_BF16_PTX, "=r,=r,=r,=r,r", [word],
                                                   dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                                                   is_pure=True, pack=2)
            return a * TWO_126, b * TWO_126, c * TWO_126, d * TWO_126
        else:
            return tl.inline_asm_elementwise(E2M1_QUADS_PTX, "=r,=r,=r,=r,r", [word],
                                             dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True,
                                             pack=2)
    else:
        w = word.to(tl.int32)
        return (_e2m1_nibble(w & 15, BF16), _e2m1_nibble((w >> 4) & 15, BF16), _e2m1_nibble((w >> 8) & 15, BF16),
                _e2m1_nibble((w >> 12) & 15, BF16))


@triton.jit
def _e2m1_nibble(nib, BF16: tl.constexpr):
    """One E2M1 code (int32 in 0..15): float16 value * 2**-14 (:func:`_e2m1_f16`), or with ``BF16`` the value in
    bfloat16 (float32 in the interpreter)."""
    if BF16:
        v = decode_f32(nib, 4)
        if INTERPRET:
            return v
        else:
            return v.to(tl.bfloat16)
    else:
        return _e2m1_f16(nib)


@triton.jit
def _e2m1_pairs(byte, BF16: tl.constexpr):
    """CUDA: the E2M1 codes of the low and high nibbles of ``byte`` (uint8) as float16 value * 2**-14, exactly
    as :func:`_e2m1_f16`, or with ``BF16`` as bfloat16 value * 2**-126 (exact: E2M1 0.5 becomes the bfloat16
    subnormal 2**-127), with packed 32-bit operations on 4 bytes per register: float16 in the byte domain (1.375
    instructions per element, :func:`_e2m1_f16_ptx`), bfloat16 two 16-bit floats at a time (2 per element,
    :func:`_e2m1_pairs_ptx`). Element i of a call is byte i of the input register and half i % 2 of output
    register i // 2."""
    if BF16:
        return tl.inline_asm_elementwise(E2M1_PAIRS_BF16_PTX, "=r,=r,=r,=r,r", [byte],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(E2M1_PAIRS_PTX, "=r,=r,=r,=r,r", [byte],
                                         dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def _mx_tile_bf16(byte, code):
    """CUDA, fast mode: MXFP4 tile elements of the low and high nibbles of ``byte`` (uint8) times their E8M0
    block scale ``code`` (broadcast), as bfloat16, with no float32 step: the PTX unpacking gives E2M1 * 2**-126,
    one packed bfloat16 multiply by 2**126 the E2M1 value and one by the scale 2**(code - 127) as bfloat16 bits
    ``code << 7`` (code 0: the subnormal 2**-127, bits 0x0040; code 0xFF: NaN 0x7FC0; both by or-ing 0x40 into the
    bits where ``(code + 1) & 255 < 2``): exact wherever the float32 route is finite (bfloat16 has float32's
    exponent range; subnormal results included)."""
    c = code.to(tl.int32)
    fc = ((c << 7) | tl.where(((c + 1) & 255) < 2, 0x40, 0)).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    lo, hi = _e2m1_pairs(byte, True)
    return lo * TWO_126 * fc, hi * TWO_126 * fc


@triton.jit
def _block_scales(F1, slot, kvh, f1_s, f1_h, m, NB: tl.constexpr, WIDE: tl.constexpr, TOKENS_LAST: tl.constexpr):
    """The NB block-scale codes of each token in ``slot`` [N] (mask ``m``), as int32 [NB, N] if ``TOKENS_LAST``
    else [N, NB]. ``WIDE``: the NB bytes of a (slot, head) are contiguous and NB-aligned (NB 4 or 8), so they
    are read as one 32/64-bit word per token (little-endian: block b is byte b), which the compiler can
    prefetch with the code tiles (one-byte loads are not pipelined and stall every tile: ANALYSIS.md)."""
    b = tl.arange(0, NB)
    if WIDE:
        return _scale_word_bytes(_block_scale_words(F1, slot, kvh, f1_s, f1_h, m, NB), NB, TOKENS_LAST)
    else:
        if TOKENS_LAST:
            return tl.load(F1 + slot[None, :] * f1_s + kvh * f1_h + b[:, None], mask=m[None, :], other=0)
        else:
            return tl.load(F1 + slot[:, None] * f1_s + kvh * f1_h + b[None, :], mask=m[:, None], other=0)


@triton.jit
def _block_scale_words(F1, slot, kvh, f1_s, f1_h, m, NB: tl.constexpr):
    """The NB (4 or 8) block-scale codes of each token in ``slot`` [N] (mask ``m``) as one little-endian 32/64-bit
    word per token (:func:`_block_scales`' ``WIDE`` layout)."""
    WT: tl.constexpr = tl.int64 if NB == 8 else tl.int32
    return tl.load((F1 + slot * f1_s + kvh * f1_h).to(tl.pointer_type(WT)), mask=m, other=0)


@triton.jit
def _word_byte(w, b):
    """Byte ``b`` of the scale word ``w`` (block b's code; broadcast), in w's integer type: ``(w >> 8 b) & 0xFF``."""
    return (w >> (8 * b).to(w.dtype)) & 0xFF


@triton.jit
def _e8m0_word_fields(w, NB: tl.constexpr, FIRST: tl.constexpr):
    """Blocks FIRST .. FIRST + NB - 1 (within one 32-bit half: 0 .. 3 of an int32 or int64 word, or 4 .. 7 of an
    int64 word) of each token's E8M0 scale word ``w`` [N] as float32 [NB, N]: :func:`e8m0_to_f32`'s ``BARE`` rule
    (code c as the exponent field, 2**(c - 127) for c in 1 .. 254, which the caller's tile check ensures), the code's
    byte moved straight into the field: x holds that half's 32 bits in the high half of a 64-bit integer, and its
    byte j is bits 23 .. 30 of ``x >> (8 j + 9)`` (one funnel shift and one mask, ``& 0x7F800000``, per element
    instead of a shift out of the word, a shift into the field and a mask)."""
    if FIRST >= 4:  # (the int64 word's high half is already there)
        x = w
        j = tl.arange(0, NB).to(tl.int64) + (FIRST - 4)
    else:
        x = w.to(tl.int64) << 32
        j = tl.arange(0, NB).to(tl.int64) + FIRST
    f = (x[None, :] >> (8 * j + 9)[:, None]).to(tl.int32) & 0x7F800000
    return f.to(tl.float32, bitcast=True)


@triton.jit
def _scale_word_bytes(w, NB: tl.constexpr, TOKENS_LAST: tl.constexpr):
    """Byte b of each word of ``w`` [N] (block b's code) as uint8 [NB, N] if ``TOKENS_LAST`` else [N, NB]."""
    b = tl.arange(0, NB)
    if TOKENS_LAST:
        return _word_byte(w[None, :], b[:, None]).to(tl.uint8)
    else:
        return _word_byte(w[:, None], b[None, :]).to(tl.uint8)


@triton.jit
def _fp4_bytes_codes(F0, F1, slot, m, kvh, f0_s, f0_h, f1_s, f1_h, NB: tl.constexpr, BYTES: tl.constexpr,
                     TOKENS_LAST: tl.constexpr):
    """Two-axis per-element FP4 tiles (``fp4_tiles_2d``): the code bytes of the tokens ``slot`` [N] (mask ``m``) as
    [BYTES, N] if ``TOKENS_LAST`` (keys) else [N, BYTES] (values), and each byte's block scale code (uint8, the same
    shape) shifted out of its token's NB-byte scale word
    (:func:`_block_scale_words`): byte j's block is j // (BYTES / NB), as :func:`_scale_word_bytes` reads block b
    from byte b of the word."""
    j = tl.arange(0, BYTES)
    PER: tl.constexpr = BYTES // NB
    if TOKENS_LAST:
        b = tl.load(F0 + slot[None, :] * f0_s + kvh * f0_h + j[:, None], mask=m[None, :], other=0)
    else:
        b = tl.load(F0 + slot[:, None] * f0_s + kvh * f0_h + j[None, :], mask=m[:, None], other=0)
    w = _block_scale_words(F1, slot, kvh, f1_s, f1_h, m, NB)
    if TOKENS_LAST:
        c = _word_byte(w[None, :], j[:, None] // PER)
    else:
        c = _word_byte(w[:, None], j[None, :] // PER)
    return b, c.to(tl.uint8)


@triton.jit
def _fp4_tile_elements(byte, code, KIND: tl.constexpr, MXB: tl.constexpr, FAST: tl.constexpr, PTX: tl.constexpr):
    """Per-element FP4 tile values of the low and high nibbles of ``byte`` times their block scale ``code`` (broadcast
    to ``byte``'s shape): bfloat16 E8M0 tiles by PTX (``MXB``, :func:`_mx_tile_bf16`), else float32 E2M1 x scale
    (exact)."""
    if MXB:
        return _mx_tile_bf16(byte, code)
    else:
        sc = _fp4_scale(code, KIND, FLOAT_OPS=FAST)
        lo16, hi16 = _e2m1_nibbles_f16(byte, PTX)
        return lo16.to(tl.float32) * 16384.0 * sc, hi16.to(tl.float32) * 16384.0 * sc


@triton.jit
def _fp4_scale(code, KIND: tl.constexpr, FMT: tl.constexpr = 0, FLOAT_OPS: tl.constexpr = True,
               BARE: tl.constexpr = False):
    """Block scale code -> float32 (exact): E8M0 (KIND 2) by its bits (``FLOAT_OPS``: :func:`e8m0_to_f32`'s rule
    for fast decode, else its integer one), or E4M3FN (KIND 3, NVFP4) in hardware where ``FMT`` >= 8, else with
    integer operations (the per-element paths pass no ``FMT``: the hardware E4M3 conversion measured 11% slower
    there in exact mode on the H100: bench/results/ANALYSIS.md). ``BARE``: E8M0 codes known to lie in 1 .. 254."""
    if KIND == 2:
        return e8m0_to_f32(code, FLOAT_OPS, BARE)
    elif FMT >= 8 and not INTERPRET:
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return decode_f32(code, 0)


@triton.jit
def _fp8_f16(byte, FMT: tl.constexpr):
    """FP8 codes (uint8) -> their values as float16, exact (every FP8 value is a float16 value; float32 in the
    interpreter): ``FMT`` >= 8 converted in hardware (``FMT - 8`` is the format), else decoded (:func:`decode_f32`)."""
    if FMT >= 8 and not INTERPRET:
        if FMT == 8:
            return byte.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        elif FMT == 9:
            return byte.to(tl.float8e5, bitcast=True).to(tl.float16)
        elif FMT == 10:
            return byte.to(tl.float8e4b8, bitcast=True).to(tl.float16)
        else:
            return byte.to(tl.float8e5b16, bitcast=True).to(tl.float16)
    else:
        v = decode_f32(byte, FMT % 8)
        if INTERPRET:
            return v
        else:
            return v.to(tl.float16)


def _fp8_words_ptx(name: str) -> str:
    """The PTX of :func:`_fp8_word_halves` for FP8 format ``name`` (``e4m3``, ``e5m2``): two 16-bit words per call
    (``$2``: word a in the low half, word b in the high half); ``prmt`` gathers the low bytes of a and b into the
    low half and their high bytes into the high half, then one ``cvt.rn.f16x2`` per half (its low byte into the low
    float16): ``$0`` holds the low channels of a and b, ``$1`` the high ones."""
    return "\n".join(["{", ".reg .b32 t;", ".reg .b16 lo, hi;", "prmt.b32 t, $2, 0, 0x3120;", "mov.b32 {lo, hi}, t;",
                      f"cvt.rn.f16x2.{name}x2 $0, lo;", f"cvt.rn.f16x2.{name}x2 $1, hi;", "}"])


FP8_WORDS_E4M3_PTX = tl.constexpr(_fp8_words_ptx("e4m3"))
FP8_WORDS_E5M2_PTX = tl.constexpr(_fp8_words_ptx("e5m2"))


@triton.jit
def _fp8_word_halves(word, FMT: tl.constexpr, PTX: tl.constexpr):
    """The FP8 codes of the low and high bytes of each 16-bit ``word`` (int16; channels 2c and 2c + 1 of a row) as
    float16 values (exact; float32 in the interpreter), two tensors. ``PTX`` (CUDA, OCP formats converted in
    hardware, ``FMT`` 8 or 9): one ``prmt`` and two ``cvt.rn.f16x2`` per two words (:func:`_fp8_words_ptx`);
    elsewhere byte by byte (:func:`_fp8_f16`)."""
    if PTX and (FMT == 8 or FMT == 9) and not INTERPRET:
        return tl.inline_asm_elementwise(FP8_WORDS_E4M3_PTX if FMT == 8 else FP8_WORDS_E5M2_PTX, "=r,=r,r", [word],
                                         dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        w = word.to(tl.int32)
        return _fp8_f16((w & 0xFF).to(tl.uint8), FMT), _fp8_f16(((w >> 8) & 0xFF).to(tl.uint8), FMT)


@triton.jit
def _phase(
    byte,
    slot,
    e,
    m,
    kvh,
    F1,
    F2,
    f1_s,
    f1_h,
    f2_s,
    f2_h,
    P: tl.constexpr,
    KIND: tl.constexpr,
    FMT: tl.constexpr,
    QB: tl.constexpr,
    G: tl.constexpr,
    BITS: tl.constexpr,
):
    """Dequantize the elements of phase ``P`` (element ``e = i * PACK + P``) from the loaded field-0 values
    ``byte``; ``slot``, ``e`` and ``m`` broadcast to ``byte``'s shape. Exact kinds stay exact in bfloat16."""
    if KIND == 0:
        return byte
    elif KIND == 1:
        return _fp8_f16(byte, FMT)
    elif KIND == 2 or KIND == 3:
        nib = (byte.to(tl.int32) >> (4 * P)) & 0xF
        sc = tl.load(F1 + slot * f1_s + kvh * f1_h + e // QB, mask=m, other=0)
        return decode_f32(nib, 4) * _fp4_scale(sc, KIND, FLOAT_OPS=False)
    else:
        f = ((byte.to(tl.int32) >> (P * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
        if KIND == 4:
            so = slot * f1_s + kvh * f1_h + e // G
            zo = slot * f2_s + kvh * f2_h + e // G
        else:
            so = (slot // G) * f1_s + kvh * f1_h + e
            zo = (slot // G) * f2_s + kvh * f2_h + e
        sc = tl.load(F1 + so, mask=m, other=0.0).to(tl.float32)
        z = tl.load(F2 + zo, mask=m, other=0.0).to(tl.float32)
        return f * sc + z


@triton.jit
def _res_mm(
    a_hi, a_mid, a_lo, A_PARTS: tl.constexpr, byte, slot, e0, m, paged, kvh, F1, F2, f1_s, f1_h, f2_s, f2_h, R, roff,
    P: tl.constexpr, KIND: tl.constexpr, FMT: tl.constexpr, QB: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
    BS: tl.constexpr, CODES: tl.constexpr = False,
):
    """Residual-window tiles: ``a @ x`` where ``x`` is phase ``P`` (elements ``e0 + P``) dequantized as in
    :func:`_phase` where ``paged`` (``CODES``, KIVI values: the integer codes alone), else the float32
    residual at ``R + roff + e0 + P``; ``x`` is split in ``BS`` bfloat16 parts (:func:`_mm`)."""
    e = e0 + P
    if KIND == 4 and CODES:  # KIVI values with rows by group: scale and zero are applied to p
        x = ((byte.to(tl.int32) >> (P * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
    else:
        x = _phase(byte, slot, e, paged, kvh, F1, F2, f1_s, f1_h, f2_s, f2_h, P, KIND, FMT, QB, G, BITS)
    r = tl.load(R + roff + e, mask=m & (paged == 0), other=0.0)
    return _mm(a_hi, a_mid, a_lo, tl.where(paged, x.to(tl.float32), r), A_PARTS, BS)


@triton.jit
def _load_q(Q, base, hmask, P: tl.constexpr, PACK: tl.constexpr, DP: tl.constexpr, FAST: tl.constexpr):
    """Phase ``P`` of q as three bfloat16 parts (exact), or rounded once to bfloat16 (``FAST``)."""
    return _split(_load_qf(Q, base, hmask, P, PACK, DP), True, FAST)


@triton.jit
def _load_qf(Q, base, hmask, P: tl.constexpr, PACK: tl.constexpr, DP: tl.constexpr):
    i = tl.arange(0, DP)
    return tl.load(Q + base + (i * PACK + P)[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)


@triton.jit
def _int_codes16(byte, P: tl.constexpr, BITS: tl.constexpr, F16: tl.constexpr = False):
    """The ``BITS``-bit integer codes at bit ``P * BITS`` of ``byte`` as bfloat16, or float16 with ``F16`` (exact:
    small integers), through the magic number: bits ``0x4300 | c`` are 128 + c in bfloat16 (``0x6400 | c``: 1024 + c
    in float16), minus 128 (1024), exact, so no int-to-float conversion instruction; the interpreter (which cannot
    bitcast to bfloat16) gets the bfloat16 path's values in float32."""
    c = (byte.to(tl.int32) >> (P * BITS)) & ((1 << BITS) - 1)
    if F16:
        return (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    elif INTERPRET:
        return c.to(tl.float32)
    else:
        return (c | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 128.0


@triton.jit
def _dot_acc(a, b, acc):
    """``acc + a @ b`` with 16-bit operands whose products are exact, float32 accumulation (the tensor cores'
    own accumulator); interpreter: one float32 dot of the same values."""
    if INTERPRET:
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _word_f16(w, sh):
    """The float16 in bits ``sh`` .. ``sh`` + 15 of the integer word(s) ``w`` (little-endian halves), as float32
    (exact)."""
    return ((w >> sh) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_of_word(F, off, ik, P: tl.constexpr, PK: tl.constexpr):
    """float16 elements ``ik * PK + P`` of the row at ``F + off`` (float16, PK-aligned: plan_decode checks), as
    float32, read as one 32/64-bit word per ``ik`` holding the PK phases (the same addresses in every phase, so
    the compiler loads each word once per tile; little-endian: phase P is bits 16P..16P+15)."""
    WT: tl.constexpr = tl.int64 if PK == 4 else tl.int32
    w = tl.load((F + off).to(tl.pointer_type(WT)) + ik)
    return _word_f16(w, 16 * P)


@triton.jit
def _kivi_key_phase(
    qf, kb, K1, K2, grp, kvh, k1_s, k1_h, k2_s, k2_h, ik, acc, P: tl.constexpr, PK: tl.constexpr,
    BITS: tl.constexpr, FAST: tl.constexpr, KEY_TILE: tl.constexpr = False,
):
    """KIVI keys, one byte phase, for a tile inside one token group. ``FAST`` and ``KEY_TILE``: the tile
    c * s + z (float32, one rounding) split in two bfloat16 parts against the bfloat16 q (``qf``, rounded once),
    the group's s, z per channel broadcast over the tokens (2-bit codes: read as words, :func:`_f16_of_word`).
    Otherwise scores q . (code * s + z) computed as
    (q * s) . code + q . z, with the per-channel s, z of the group folded into q (codes are exact);
    ``FAST``: q is the bfloat16 q (rounded once), q * s (exact in float32) split in two bfloat16 parts
    (about 16 bits; keys have outlier channels, so one rounding would hide a code step) and the codes built
    by :func:`_int_codes16`; else q * s in three parts (exact).
    Returns ``acc`` plus the phase's (q * s) . code, and the elementwise q * z of the phase (the caller sums
    the phases' products, then reduces once)."""
    e = ik * PK + P
    if FAST and KEY_TILE and PK == 4:  # int2: one 64-bit word per 4 channels (measured fewer loads, statically)
        sc = _f16_of_word(K1, grp * k1_s + kvh * k1_h, ik, P, PK)
        z = _f16_of_word(K2, grp * k2_s + kvh * k2_h, ik, P, PK)
    else:
        sc = tl.load(K1 + grp * k1_s + kvh * k1_h + e).to(tl.float32)
        z = tl.load(K2 + grp * k2_s + kvh * k2_h + e).to(tl.float32)
    if FAST and KEY_TILE:
        # the key tile dequantized, c * s + z (c * s exact in float32, so one rounding with or without FMA), in two
        # bfloat16 parts against the bfloat16 q: no float32 q and no reduction in the loop
        c = ((kb.to(tl.int32) >> (P * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
        kh, km, _ = _split(c * sc[:, None] + z[:, None], False)
        if INTERPRET:  # the interpreter's parts each hold their sum (``_split``)
            return _dot_acc(qf, kh, acc), qf.to(tl.float32)  # (the caller drops q . z here)
        else:
            return tl.dot(qf, km, tl.dot(qf, kh, acc)), qf.to(tl.float32)
    qf = qf.to(tl.float32)
    qh, qm, ql = _split(qf * sc[None, :], not FAST)
    if FAST:
        codes = _int_codes16(kb, P, BITS)
        if INTERPRET:  # the interpreter's parts each hold their sum (``_split``)
            acc = _dot_acc(qh, codes, acc)
        else:
            acc = tl.dot(qh, codes, tl.dot(qm, codes, acc))
    else:
        codes = ((kb.to(tl.int32) >> (P * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
        acc += _mm(qh, qm, ql, codes, 3, 0)
    return acc, qf * z[None, :]


@triton.jit
def _group_rows(x, GR: tl.constexpr, HV: tl.constexpr, N: tl.constexpr):
    """Rows ``g * HV + h`` (h < HV) of the result [GR * HV, N] are row g of ``x`` [GR, N]."""
    return tl.reshape(tl.broadcast_to(x[:, None, :], (GR, HV, N)), (GR * HV, N))


@triton.jit
def _kivi_value_field(F, slot, m, kvh, f_s, f_h, GR: tl.constexpr, NG: tl.constexpr, WORDS: tl.constexpr = False):
    """A KIVI value-row field (scales ``V1`` or zeros ``V2``) of the tokens ``slot`` as loaded: ``WORDS``, one 16-,
    32- or 64-bit word per token holding its NG (1, 2 or 4) float16 groups [N]; else the float16 groups [GR, N]
    (groups g >= NG and tokens where ``m`` is false load nothing). :func:`_kivi_value_field_rows` makes the rows."""
    if WORDS:
        WT: tl.constexpr = tl.int64 if NG == 4 else (tl.int32 if NG == 2 else tl.int16)
        return tl.load((F + slot * f_s + kvh * f_h).to(tl.pointer_type(WT)), mask=m, other=0)
    else:
        g = tl.arange(0, GR)
        return tl.load(F + slot[None, :] * f_s + kvh * f_h + g[:, None], mask=m[None, :] & (g < NG)[:, None],
                       other=0.0)


@triton.jit
def _kivi_value_field_rows(x, m, HV: tl.constexpr, M: tl.constexpr, NG: tl.constexpr, WORDS: tl.constexpr = False):
    """Rows by group of a loaded value-row field ``x`` (:func:`_kivi_value_field`): row ``r`` of the float32 [M, N]
    result holds channel group ``r // HV``'s value of each token (0 where ``m`` is false or the group does not
    exist); a word's group g is its bits 16 g .. 16 g + 15 (little-endian: the same values)."""
    GR: tl.constexpr = M // HV
    g = tl.arange(0, GR)
    N: tl.constexpr = m.shape[0]
    if WORDS:
        mm = m[None, :] & (g < NG)[:, None]
        if NG < GR:  # (rows of groups g >= NG are masked: their shifts stay inside the word)
            sh = (16 * (g % NG))[:, None].to(x.dtype)
        else:
            sh = (16 * g)[:, None].to(x.dtype)
        xg = tl.where(mm, _word_f16(x[None, :], sh), 0.0)
    else:
        xg = x.to(tl.float32)
    return _group_rows(xg, GR, HV, N)


@triton.jit
def _kivi_value_rows(V1, V2, slot, m, kvh, v1_s, v1_h, v2_s, v2_h, HV: tl.constexpr, M: tl.constexpr,
                     NG: tl.constexpr, WORDS: tl.constexpr = False):
    """KIVI values with rows by group (``HV`` > 0): the scale and zero of channel group ``r // HV`` of token j,
    as float32 [M, N] tiles in the layout of the scores (0 where ``m[j]`` is false or the group does not exist). Each
    (group, token) is loaded once (a token's groups are contiguous) and broadcast over the HV rows of its group.
    ``WORDS``: a token's NG (1, 2 or 4) float16 scales (zeros) loaded as one 16-, 32- or 64-bit word and group g taken
    from its bits 16 g .. 16 g + 15 (little-endian: the same values; needs every row start aligned to the word)."""
    GR: tl.constexpr = M // HV
    if WORDS:  # (both loads first: the order measured)
        ws = _kivi_value_field(V1, slot, m, kvh, v1_s, v1_h, GR, NG, WORDS)
        wz = _kivi_value_field(V2, slot, m, kvh, v2_s, v2_h, GR, NG, WORDS)
        return _kivi_value_field_rows(ws, m, HV, M, NG, WORDS), _kivi_value_field_rows(wz, m, HV, M, NG, WORDS)
    else:
        srow = _kivi_value_field_rows(_kivi_value_field(V1, slot, m, kvh, v1_s, v1_h, GR, NG), m, HV, M, NG)
        return srow, _kivi_value_field_rows(_kivi_value_field(V2, slot, m, kvh, v2_s, v2_h, GR, NG), m, HV, M, NG)


@triton.jit
def _value_rows_to_heads(x, zs, P: tl.constexpr, PV: tl.constexpr, G: tl.constexpr, HV: tl.constexpr,
                         M: tl.constexpr, DV: tl.constexpr):
    """Rows by group -> rows by head: column i of phase ``P`` (element i * PV + P) of head h is row
    ``g * HV + h`` of ``x`` [M, DV] plus ``zs[g * HV + h]`` (the zero-point term), g = (i * PV + P) // G."""
    GR: tl.constexpr = M // HV
    x3 = tl.reshape(x + zs[:, None], (GR, HV, DV))
    sel = tl.arange(0, GR)[:, None, None] == ((tl.arange(0, DV) * PV + P) // G)[None, None, :]
    return tl.sum(tl.where(sel, x3, 0.0), 0)


@triton.jit
def _row_group0(x, HV: tl.constexpr, M: tl.constexpr):
    """Rows by group -> rows by head for a per-row value equal in every group (m, l): group 0's."""
    GR: tl.constexpr = M // HV
    x2 = tl.reshape(x, (GR, HV))
    return tl.sum(tl.where(tl.arange(0, GR)[:, None] == 0, x2, 0.0), 0)


@triton.jit
def _softmax_step(s, tmask, m_i, l_i):
    """:func:`_softmax_update` of the scores [rows, tokens] with the tokens where ``tmask`` is false at -inf."""
    return _softmax_update(tl.where(tmask[None, :], s, float("-inf")), m_i, l_i, 1)


@triton.jit
def _softmax_update(s, m_i, l_i, AX: tl.constexpr):
    """One online-softmax step (base 2) over axis ``AX`` (the last) of the masked scores ``s``: the new running max
    m, the rescale alpha = 2**(m_i - m) of the old sums, p = 2**(s - m) and l = l_i * alpha + sum(p) (a row with
    no token yet keeps m = -inf and takes 0 in its place, so p and alpha stay 0 and 1)."""
    m_new = tl.maximum(m_i, tl.max(s, AX))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - tl.expand_dims(m_use, AX))
    l_i = l_i * alpha + tl.sum(p, AX)
    return p, alpha, m_new, l_i


@triton.jit
def _f16_exponent(qmax):
    """The power of two e that puts q into float16's range: max|q| * 2**e in [2**14, 2**15) (e <= 126; 0 for q = 0)."""
    return tl.where(qmax > 0, tl.minimum(14 - floor_log2_f32(qmax), 126), 0)


@triton.jit
def _block_rows_q(Q, b, kvh, stride_qb, stride_qh, QPK: tl.constexpr, H: tl.constexpr, R: tl.constexpr,
                  C: tl.constexpr, QB: tl.constexpr, C0: tl.constexpr, QLD: tl.constexpr = 0):
    """q's even and odd channels (float32 [R, C]) as block rows over code bytes C0 .. C0 + C - 1: row r is (block
    2 C0 / QB + r // H, head r % H), zero outside its block's channels and for padding heads (h >= QPK). ``QLD``
    (``q_rows_load``), how q is read (the same values): 0 even and odd channels as two [R, C] loads at a stride of
    2; 1 each as a [C, R] load transposed; 2 one [R, 2 C] load of contiguous channels split into even and odd.
    (The load's layout decides the layout of q's shared-memory copy and so the register moves before each
    product; bench/results/ANALYSIS.md 285-286.)"""
    r = tl.arange(0, R)
    base = b * stride_qb + (kvh * QPK + r % H).to(tl.int64) * stride_qh
    if QLD == 2:
        jc = 2 * C0 + tl.arange(0, 2 * C)
        m = (r % H < QPK)[:, None] & ((jc // QB)[None, :] == (2 * C0 // QB + r // H)[:, None])
        x = tl.load(Q + base[:, None] + jc[None, :], mask=m, other=0.0).to(tl.float32)
        qe, qo = tl.split(tl.reshape(x, (R, C, 2)))
    else:
        jb = C0 + tl.arange(0, C)
        m = (r % H < QPK)[:, None] & (((2 * jb) // QB)[None, :] == (2 * C0 // QB + r // H)[:, None])
        if QLD == 1:
            mt = tl.trans(m)
            qe = tl.trans(tl.load(Q + base[None, :] + (2 * jb)[:, None], mask=mt, other=0.0).to(tl.float32))
            qo = tl.trans(tl.load(Q + base[None, :] + (2 * jb + 1)[:, None], mask=mt, other=0.0).to(tl.float32))
        else:
            qe = tl.load(Q + base[:, None] + (2 * jb)[None, :], mask=m, other=0.0).to(tl.float32)
            qo = tl.load(Q + base[:, None] + (2 * jb + 1)[None, :], mask=m, other=0.0).to(tl.float32)
    return qe, qo


@triton.jit
def _block_rows_scores(qe16, qo16, kb, ksc, NB: tl.constexpr, H: tl.constexpr, N: tl.constexpr, KIND: tl.constexpr,
                       FMT: tl.constexpr, PTX: tl.constexpr, BARE: tl.constexpr, KPT: tl.constexpr = False,
                       FIELDS: tl.constexpr = False):
    """Scores [H, N] (without the softmax scale) of NB blocks: q's block rows (float16 [NB * H, C], even / odd
    channels) against the code bytes ``kb`` [C, N] as float16 E2M1 * 2**-14, each block's partial dot times its
    scale (codes ``ksc`` [NB, N], :func:`_fp4_scale`; ``BARE`` as there), summed over the blocks. ``KPT``: the
    product transposed, [N, C] codes @ [C, NB * H] q (the same exact products and float32 sums, the tensor cores'
    first operand the fresh code tile instead of q: the compiler otherwise copies q's fragments into each zero-start
    product's destination registers, bench/results/ANALYSIS.md 276), then transposed back. ``FIELDS``: ``ksc`` holds
    the scales themselves (float32, :func:`_e8m0_word_fields`)."""
    klo, khi = _e2m1_nibbles_f16(kb, PTX)
    if KPT:
        s2 = tl.trans(_dot_acc(tl.trans(khi), tl.trans(qo16),
                               _dot_acc(tl.trans(klo), tl.trans(qe16), tl.zeros((N, NB * H), tl.float32))))
    else:
        s2 = _dot_acc(qo16, khi, _dot_acc(qe16, klo, tl.zeros((NB * H, N), tl.float32)))
    scale = ksc if FIELDS else _fp4_scale(ksc, KIND, FMT, BARE=BARE)
    return tl.sum(tl.reshape(s2, (NB, H, N)) * scale[:, None, :], 0)


@triton.jit
def _block_rows_p(p, vsc, NB: tl.constexpr, H: tl.constexpr, N: tl.constexpr, KIND_V: tl.constexpr,
                  FMT_V: tl.constexpr, BARE: tl.constexpr, EV16: tl.constexpr = False, mc=0,
                  FIELDS: tl.constexpr = False):
    """The value product's rows (block, head): p [H, N] times the block scale (codes ``vsc`` [NB, N]), rounded
    once: NVFP4 ``fl16(p * s * 2**7)``, E8M0 ``bf16(p * 2**(c - 127))`` (``BARE``: :func:`e8m0_to_f32`'s), or with
    ``EV16`` (bare E8M0 codes in mc - ``E8M0_V16_WINDOW`` .. mc, mc the split's reference code in 16 .. 240, as the
    caller checks) ``fl16((p * 2**(142 - mc)) * 2**(c - 127))``: p * 2**(c - mc + 15), at most 2**15 (float16's
    range), the power of two of mc applied to p [H, N] once, the code's as its bare exponent field (a masked token's
    code 0 gives 0.0). ``FIELDS`` (E8M0): ``vsc`` holds the scales themselves (float32, :func:`_e8m0_word_fields`)."""
    if EV16:
        pk = p * pow2_f32(142 - mc)
        sv = vsc if FIELDS else e8m0_to_f32(vsc, BARE=True)
        return tl.reshape(pk[None, :, :] * sv[:, None, :], (NB * H, N)).to(tl.float16)
    elif KIND_V == 3:
        return _split16(tl.reshape(p[None, :, :] * (_fp4_scale(vsc, 3, FMT_V) * 128.0)[:, None, :], (NB * H, N)),
                        True)[0]
    else:
        sv = vsc if FIELDS else e8m0_to_f32(vsc, BARE=BARE)
        return _split(tl.reshape(p[None, :, :] * sv[:, None, :], (NB * H, N)), True, True)[0]


@triton.jit
def _block_rows_values(p, vsc, vb, alpha, acc_lo, acc_hi, NB: tl.constexpr, H: tl.constexpr, N: tl.constexpr,
                       KIND_V: tl.constexpr, FMT_V: tl.constexpr, PTX: tl.constexpr, BARE: tl.constexpr,
                       EV16: tl.constexpr = False, mc=0, FIELDS: tl.constexpr = False):
    """The accumulators of NB blocks' value rows (even / odd channels of the code bytes ``vb`` [N, C]), rescaled by
    ``alpha`` [H], plus :func:`_block_rows_p` times the codes (NVFP4 and ``EV16``: float16 E2M1 * 2**-14; E8M0:
    exact bfloat16)."""
    ar = tl.reshape(tl.broadcast_to(alpha[None, :], (NB, H)), (NB * H,))
    pr = _block_rows_p(p, vsc, NB, H, N, KIND_V, FMT_V, BARE, EV16, mc, FIELDS)
    if KIND_V == 3 or EV16:
        v0, v1 = _e2m1_nibbles_f16(vb, PTX)
    else:
        v0, v1 = _e2m1_values_bf16(vb, PTX)
    return _dot_acc(pr, v0, acc_lo * ar[:, None]), _dot_acc(pr, v1, acc_hi * ar[:, None])


@triton.jit
def _block_rows_value_words(p, vsc, vw, alpha, a0, a1, a2, a3, NB: tl.constexpr, H: tl.constexpr, N: tl.constexpr,
                            KIND_V: tl.constexpr, FMT_V: tl.constexpr, PTX: tl.constexpr, BARE: tl.constexpr,
                            EV16: tl.constexpr = False, mc=0, FIELDS: tl.constexpr = False):
    """The four accumulators of NB blocks' value rows against the code words ``vw`` [N, C] (int16; nibble k of word c
    is channel 4c + k, :func:`_e2m1_quads`), each rescaled by ``alpha`` [H], plus :func:`_block_rows_p` times its
    quad of channels (E8M0 without ``EV16``: the codes in bfloat16; else float16 E2M1 * 2**-14)."""
    ar = tl.reshape(tl.broadcast_to(alpha[None, :], (NB, H)), (NB * H,))
    pr = _block_rows_p(p, vsc, NB, H, N, KIND_V, FMT_V, BARE, EV16, mc, FIELDS)
    v0, v1, v2, v3 = _e2m1_quads(vw, PTX, KIND_V == 2 and not EV16)
    return (_dot_acc(pr, v0, a0 * ar[:, None]), _dot_acc(pr, v1, a1 * ar[:, None]), _dot_acc(pr, v2, a2 * ar[:, None]),
            _dot_acc(pr, v3, a3 * ar[:, None]))


@triton.jit
def _word_channels(a0, a1, a2, a3, NB: tl.constexpr, H: tl.constexpr, C: tl.constexpr, QB: tl.constexpr):
    """Block rows of the word accumulators (column c of ``ak`` [NB * H, C]: channel 4c + k) -> the even and the odd
    channels [H, 2C] of the heads, in channel order (even: 4c, 4c + 2; odd: 4c + 1, 4c + 3)."""
    blk = 4 * tl.arange(0, C) // QB
    o0 = _block_row_select(a0, NB, H, C, blk)
    o1 = _block_row_select(a1, NB, H, C, blk)
    o2 = _block_row_select(a2, NB, H, C, blk)
    o3 = _block_row_select(a3, NB, H, C, blk)
    return tl.reshape(tl.join(o0, o2), (H, 2 * C)), tl.reshape(tl.join(o1, o3), (H, 2 * C))


@triton.jit
def _row_halves(x, R: tl.constexpr, N: tl.constexpr):
    """Rows 0 .. R/2 - 1 and R/2 .. R - 1 of ``x`` [R, N]."""
    return tl.split(tl.permute(tl.reshape(x, (2, R // 2, N)), (1, 2, 0)))


@triton.jit
def _columns_cat(a, b, H: tl.constexpr, C: tl.constexpr):
    """[a | b]: the columns of ``a`` [H, C], then those of ``b``."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (H, 2 * C))


@triton.jit
def _fp4_block_rows_step(qe16, qo16, qe16_b, qo16_b, sc_k, kb, kb_b, ksc, ksc_b, vb, vb_b, vsc, vsc_b, tmask, m_i,
                         l_i, acc0, acc1,
                         acc2, acc3, acc4, acc5, acc6, acc7, H: tl.constexpr, BLOCK_N: tl.constexpr, NBK: tl.constexpr,
                         NBV: tl.constexpr, KIND_K: tl.constexpr, FMT_K: tl.constexpr, KIND_V: tl.constexpr,
                         FMT_V: tl.constexpr, PTX: tl.constexpr, VW: tl.constexpr, HALF_K: tl.constexpr,
                         HALF_V: tl.constexpr, BARE: tl.constexpr, EV16: tl.constexpr = False, mc=0,
                         KPT: tl.constexpr = False, FK: tl.constexpr = False, FV: tl.constexpr = False):
    """One tile of :func:`_fp4_block_rows` after its loads: the scores, the softmax step and the value products
    (``BARE``: the tile's E8M0 codes all lie in 1 .. 254, :func:`e8m0_to_f32`; ``EV16``: E8M0 value products in
    float16 against the split's reference code ``mc``; ``KPT``: the key products transposed,
    :func:`_block_rows_scores`); ``FK`` / ``FV``: ``ksc`` / ``vsc`` (and with channel halves ``ksc_b`` / ``vsc_b``,
    the second half's) hold the E8M0 scales themselves (float32, :func:`_e8m0_word_fields`) instead of codes. Returns
    the softmax state and the eight accumulators (those the layout does not use pass through)."""
    if HALF_K:
        if FK:
            ks_a, ks_b = ksc, ksc_b
        else:
            ks_a, ks_b = _row_halves(ksc, NBK, BLOCK_N)
        s = _block_rows_scores(qe16, qo16, kb, ks_a, NBK // 2, H, BLOCK_N, KIND_K, FMT_K, PTX, BARE, KPT, FK)
        s += _block_rows_scores(qe16_b, qo16_b, kb_b, ks_b, NBK // 2, H, BLOCK_N, KIND_K, FMT_K, PTX, BARE, KPT, FK)
        s = s * sc_k
    else:
        s = _block_rows_scores(qe16, qo16, kb, ksc, NBK, H, BLOCK_N, KIND_K, FMT_K, PTX, BARE, KPT, FK) * sc_k
    p, alpha, m_i, l_i = _softmax_step(s, tmask, m_i, l_i)
    if HALF_V:
        if FV:
            vs_a, vs_b = vsc, vsc_b
        else:
            vs_a, vs_b = _row_halves(vsc, NBV, BLOCK_N)
    if VW and HALF_V:
        acc0, acc1, acc2, acc3 = _block_rows_value_words(p, vs_a, vb, alpha, acc0, acc1, acc2, acc3, NBV // 2, H,
                                                         BLOCK_N, KIND_V, FMT_V, PTX, BARE, EV16, mc, FV)
        acc4, acc5, acc6, acc7 = _block_rows_value_words(p, vs_b, vb_b, alpha, acc4, acc5, acc6, acc7, NBV // 2,
                                                         H, BLOCK_N, KIND_V, FMT_V, PTX, BARE, EV16, mc, FV)
    elif HALF_V:
        acc0, acc1 = _block_rows_values(p, vs_a, vb, alpha, acc0, acc1, NBV // 2, H, BLOCK_N, KIND_V, FMT_V, PTX,
                                        BARE, EV16, mc, FV)
        acc2, acc3 = _block_rows_values(p, vs_b, vb_b, alpha, acc2, acc3, NBV // 2, H, BLOCK_N, KIND_V, FMT_V, PTX,
                                        BARE, EV16, mc, FV)
    elif VW:
        acc0, acc1, acc2, acc3 = _block_rows_value_words(p, vsc, vb, alpha, acc0, acc1, acc2, acc3, NBV, H, BLOCK_N,
                                                         KIND_V, FMT_V, PTX, BARE, EV16, mc, FV)
    else:
        acc0, acc1 = _block_rows_values(p, vsc, vb, alpha, acc0, acc1, NBV, H, BLOCK_N, KIND_V, FMT_V, PTX, BARE,
                                        EV16, mc, FV)
    return m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit
def _fp4_block_rows_loop(
    qe16, qo16, qe16_b, qo16_b, sc_k, BT, K0, K1, V0, V1, b, kvh, start, end, stride_btb, k0_s, k0_h, k1_s, k1_h, v0_s,
    v0_h, v1_s, v1_h, H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, PAGE_SLOTS: tl.constexpr,
    BLOCK_N: tl.constexpr, KIND_K: tl.constexpr, QB_K: tl.constexpr, FMT_K: tl.constexpr, KIND_V: tl.constexpr,
    QB_V: tl.constexpr, FMT_V: tl.constexpr, PTX: tl.constexpr, WSC_K: tl.constexpr, WSC_V: tl.constexpr,
    VW: tl.constexpr, HALF_K: tl.constexpr, HALF_V: tl.constexpr, BARE: tl.constexpr,
    PIDS_AHEAD: tl.constexpr = False, EV16: tl.constexpr = False, KPT: tl.constexpr = False,
    FIELDS_K: tl.constexpr = False, FIELDS_V: tl.constexpr = False,
):
    """The tile loop of :func:`_fp4_block_rows` over tokens ``start`` .. ``end`` from a fresh softmax state. ``BARE``:
    every E8M0 code taken as the bare exponent field (:func:`e8m0_to_f32`), valid where none is 0 or 255, and per
    token position of a tile a flag of whether any E8M0 code of those tokens was 0 or 255 (int32, nonzero if so; the
    caller reruns the loop without ``BARE`` if one was). ``EV16`` (with ``BARE``, E8M0 values): the value products
    in float16 against the split's reference code mc, the first tile's largest value scale code plus
    ``E8M0_V16_HEADROOM`` (:func:`_block_rows_p`: the accumulators hold sum p v 2**(128 - mc)), the flag set for a
    value code outside mc - ``E8M0_V16_WINDOW`` .. mc instead of 0 / 255 (:func:`e8m0_words_outside`), and for the
    whole split where mc lies outside 16 .. 240 (so the window lies inside 1 .. 254). ``PIDS_AHEAD``: each next
    tile's page ids read one step ahead (``page_ids_ahead``). ``KPT``: the key products transposed
    (:func:`_block_rows_scores`). ``FIELDS_K`` / ``FIELDS_V`` (with ``BARE``; planned for an E8M0 side of 4 blocks,
    or of 4 or 8 by channel halves, each product's blocks in one 32-bit half of the scale word): that side reads its
    scales as exponent fields straight from the words (:func:`_e8m0_word_fields`). Returns m, l, the eight
    accumulators, that flag and mc (128 without ``EV16``)."""
    NBK: tl.constexpr = D // QB_K
    NBV: tl.constexpr = D // QB_V
    FK: tl.constexpr = FIELDS_K and BARE and KIND_K == 2
    FV: tl.constexpr = FIELDS_V and BARE and KIND_V == 2
    PK: tl.constexpr = NBK // 2 if HALF_K else NBK  # (blocks per product)
    PV: tl.constexpr = NBV // 2 if HALF_V else NBV
    RV: tl.constexpr = NBV * H
    DH: tl.constexpr = D // 2
    DKP: tl.constexpr = DH // 2 if HALF_K else DH
    jk = tl.arange(0, DKP)
    m_i = tl.full((H,), float("-inf"), tl.float32)
    l_i = tl.zeros((H,), tl.float32)
    # value accumulator rows and columns: channel words of a half (VW and HALF_V: acc0 .. acc3 the first half's
    # quads, acc4 .. acc7 the second's), channel words (VW), channel pairs of a half (HALF_V: acc0 / acc1 the first
    # half's even / odd channels, acc2 / acc3 the second's), or channel pairs
    RVP: tl.constexpr = RV // 2 if HALF_V else RV
    DV: tl.constexpr = (D // 8 if HALF_V else D // 4) if VW else (D // 4 if HALF_V else D // 2)
    jv = tl.arange(0, DV)
    acc0 = tl.zeros((RVP, DV), tl.float32)
    acc1 = tl.zeros((RVP, DV), tl.float32)
    acc2 = tl.zeros((RVP, DV), tl.float32)
    acc3 = tl.zeros((RVP, DV), tl.float32)
    acc4 = tl.zeros((RVP, DV), tl.float32)  # (VW and HALF_V only)
    acc5 = tl.zeros((RVP, DV), tl.float32)
    acc6 = tl.zeros((RVP, DV), tl.float32)
    acc7 = tl.zeros((RVP, DV), tl.float32)
    sticky = tl.zeros((BLOCK_N,), tl.int32)
    bad_prev = tl.zeros((BLOCK_N,), tl.int32)
    if EV16:  # the split's reference code: the first tile's largest value scale code + the headroom
        fslot, fmask = _tile_slots(start, end, BT, b, stride_btb, PAGE, PAGE_SLOTS, BLOCK_N)
        fcodes = _scale_word_bytes(_block_scale_words(V1, fslot, kvh, v1_s, v1_h, fmask, NBV), NBV, True)
        mc = tl.max(tl.max(fcodes.to(tl.int32), 1), 0) + E8M0_V16_HEADROOM
        lo = mc - E8M0_V16_WINDOW
        sticky = sticky + ((mc < 16) | (mc > 240)).to(tl.int32)  # (outside: the split reruns)
    else:  # (a tensor, as the rerun's mc replaces the first loop's)
        mc = tl.full((), 128, tl.int32)
    if PIDS_AHEAD:
        nslot, nmask = _tile_slots(start, end, BT, b, stride_btb, PAGE, PAGE_SLOTS, BLOCK_N)
    for t0 in range(start, end, BLOCK_N):
        if PIDS_AHEAD:
            slot, tmask = nslot, nmask
            nslot, nmask = _tile_slots(t0 + BLOCK_N, end, BT, b, stride_btb, PAGE, PAGE_SLOTS, BLOCK_N)
        else:
            slot, tmask = _tile_slots(t0, end, BT, b, stride_btb, PAGE, PAGE_SLOTS, BLOCK_N)
        # every load first (the order measured: 165 registers against 227 with the value loads after the softmax)
        krow = K0 + slot[None, :] * k0_s + kvh * k0_h
        kb = tl.load(krow + jk[:, None], mask=tmask[None, :], other=0)
        kb_b = kb  # (HALF_K only)
        if HALF_K:
            kb_b = tl.load(krow + (DKP + jk)[:, None], mask=tmask[None, :], other=0)
        if BARE and KIND_K == 2:
            kw = _block_scale_words(K1, slot, kvh, k1_s, k1_h, tmask, NBK)
            if FK:  # (by channel halves: the first half's blocks, then the second's)
                ksc = _e8m0_word_fields(kw, PK, 0)
                ksc_b = _e8m0_word_fields(kw, PK, PK) if HALF_K else ksc
            else:
                ksc = _scale_word_bytes(kw, NBK, True)
                ksc_b = ksc
        else:
            ksc = _block_scales(K1, slot, kvh, k1_s, k1_h, tmask, NBK, WSC_K, True)
            ksc_b = ksc
        vrow = V0 + slot[:, None] * v0_s + kvh * v0_h
        vb_b = 0  # (HALF_V only)
        if VW:
            vb = tl.load(vrow.to(tl.pointer_type(tl.int16)) + jv[None, :], mask=tmask[:, None], other=0)
            if HALF_V:
                vb_b = tl.load(vrow.to(tl.pointer_type(tl.int16)) + (DV + jv)[None, :], mask=tmask[:, None], other=0)
        else:
            vb = tl.load(vrow + jv[None, :], mask=tmask[:, None], other=0)
            if HALF_V:
                vb_b = tl.load(vrow + (DV + jv)[None, :], mask=tmask[:, None], other=0)
        if BARE and KIND_V == 2:
            vws = _block_scale_words(V1, slot, kvh, v1_s, v1_h, tmask, NBV)
            if FV:
                vsc = _e8m0_word_fields(vws, PV, 0)
                vsc_b = _e8m0_word_fields(vws, PV, PV) if HALF_V else vsc
            else:
                vsc = _scale_word_bytes(vws, NBV, True)
                vsc_b = vsc
        else:
            vsc = _block_scales(V1, slot, kvh, v1_s, v1_h, tmask, NBV, WSC_V, True)
            vsc_b = vsc
        if BARE:  # codes 0 and 255 of the tile's E8M0 scales, for the caller's one check after the loop
            bad = tl.zeros((BLOCK_N,), tl.int32)
            if KIND_K == 2:
                bad = bad | (e8m0_words_rare(kw) != 0).to(tl.int32)
            if EV16:  # every value code in the window lo .. mc (which excludes 0 and 255)
                bad = bad | (e8m0_words_outside(vws, lo, E8M0_V16_WINDOW) != 0).to(tl.int32)
            elif KIND_V == 2:
                bad = bad | (e8m0_words_rare(vws) != 0).to(tl.int32)
            # a tile's flags join the sticky ones one tile later, and the last tile's after the loop, masked there:
            # only a split's last tile can be partial, and its masked tokens read word 0, which must not count (or
            # every split that ends inside a tile reruns: H100, 8,190 tokens, 226 against 157 us), while a mask on
            # every tile's flags costs 25-37 instructions per tile
            sticky = sticky | bad_prev
            bad_prev = bad
        m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _fp4_block_rows_step(
            qe16, qo16, qe16_b, qo16_b, sc_k, kb, kb_b, ksc, ksc_b, vb, vb_b, vsc, vsc_b, tmask, m_i, l_i, acc0, acc1,
            acc2, acc3, acc4, acc5, acc6, acc7, H, BLOCK_N, NBK, NBV, KIND_K, FMT_K, KIND_V, FMT_V, PTX, VW, HALF_K,
            HALF_V, BARE, EV16, mc, KPT, FK, FV)
    if BARE:  # the last tile's flags, its masked tokens left out
        t_last = start + tl.maximum(end - start - 1, 0) // BLOCK_N * BLOCK_N
        sticky = sticky | (bad_prev & (t_last + tl.arange(0, BLOCK_N) < end).to(tl.int32))
    return m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, sticky, mc


@triton.jit
def _fp4_block_rows(
    Q, BT, K0, K1, V0, V1, b, kvh, start, end, stride_qb, stride_qh, stride_btb, k0_s, k0_h, k1_s, k1_h, v0_s, v0_h,
    v1_s, v1_h, qk_scale, QPK: tl.constexpr, H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    PAGE_SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, KIND_K: tl.constexpr, QB_K: tl.constexpr, FMT_K: tl.constexpr,
    KIND_V: tl.constexpr, QB_V: tl.constexpr, FMT_V: tl.constexpr, PTX: tl.constexpr, WSC_K: tl.constexpr,
    WSC_V: tl.constexpr, VW: tl.constexpr = False, HALF_K: tl.constexpr = False, HALF_V: tl.constexpr = False,
    E8M0_CHECK: tl.constexpr = False, PIDS_AHEAD: tl.constexpr = False, EV16: tl.constexpr = False,
    KPT: tl.constexpr = False, FIELDS_K: tl.constexpr = False, FIELDS_V: tl.constexpr = False,
    QLD: tl.constexpr = 0,
):
    """Fast-mode FP4 keys and values by block rows (``block_rows``): no block scale touches a tile element.

    Rows are (block b, head h), ``(D / QB) * H`` per side. Keys: q's even / odd channels (float16, scaled by a power
    of two as the FP8 path does), zero outside block b, against the low / high nibbles as float16 E2M1 * 2**-14 (bit
    placement, exact): row (b, h) of the [rows, N] product is block b's partial dot, exact products summed in
    float32; times the block scale (float32: E4M3 or E8M0, exact) and summed over b: the scores [H, N]. Values: the
    same rows hold the probability times the token's block scale, rounded once: NVFP4 ``fl16(p * s * 2**7)`` (s <=
    448, so below 448 * 2**7 < 65504) against the float16 E2M1 * 2**-14 tile; E8M0 ``bf16(p * 2**(c - 127))``
    (bfloat16 has float32's exponent range) against the exact E2M1 values in bfloat16, or with ``EV16`` (and
    ``E8M0_CHECK``) ``fl16(p * 2**(c - mc + 15))`` against the float16 E2M1 * 2**-14 tile, mc the split's reference
    code (:func:`_fp4_block_rows_loop`; the accumulators times 2**(mc - 128) after the loop; a split with a value code
    outside its window reruns as for codes 0 and 255). Output channel d of head h
    is row (block of d, h). ``VW``: value tiles read as 16-bit words, four channels each (:func:`_e2m1_quads`), four
    value products of [rows, D/4]: the tensor cores' operand holds two tokens per register, which 16-bit words get
    from transposed matrix loads where bytes take one shared load each. ``HALF_K``, ``HALF_V`` (``channel_halves``):
    row (b, h) meets only block b's channels, so a side's products split into the two channel halves, each with the
    rows of its blocks: two [rows / 2, D / 2] products instead of one [rows, D] whose every row is zero outside its
    block (the same nonzero products, so the same sums; half the tensor-core work and value accumulators); with
    ``VW`` each half's value words make four products of [rows / 2, D / 8].
    Returns (even channels, odd channels) [H, D/2] = sum p v, and the softmax state m, l [H] (base 2), as the main
    loop leaves them."""
    NBK: tl.constexpr = D // QB_K
    NBV: tl.constexpr = D // QB_V
    RK: tl.constexpr = NBK * H
    DH: tl.constexpr = D // 2
    j = tl.arange(0, DH)
    RKP: tl.constexpr = RK // 2 if HALF_K else RK  # rows and code bytes of one key product
    DKP: tl.constexpr = DH // 2 if HALF_K else DH
    qe, qo = _block_rows_q(Q, b, kvh, stride_qb, stride_qh, QPK, H, RKP, DKP, QB_K, 0, QLD)
    qmax = tl.max(tl.max(tl.maximum(tl.abs(qe), tl.abs(qo)), 1), 0)
    if HALF_K:  # the second half's rows: blocks NBK / 2 .. NBK - 1 against code bytes DH / 2 .. DH - 1
        qe_b, qo_b = _block_rows_q(Q, b, kvh, stride_qb, stride_qh, QPK, H, RKP, DKP, QB_K, DKP, QLD)
        qmax = tl.maximum(qmax, tl.max(tl.max(tl.maximum(tl.abs(qe_b), tl.abs(qo_b)), 1), 0))
    eq = _f16_exponent(qmax)
    qe16 = _split16(qe * pow2_f32(eq), True)[0]  # (no ``_`` targets here: triton 3.6 carries them through the loop)
    qo16 = _split16(qo * pow2_f32(eq), True)[0]
    if HALF_K:
        qe16_b = _split16(qe_b * pow2_f32(eq), True)[0]
        qo16_b = _split16(qo_b * pow2_f32(eq), True)[0]
    else:  # (unused)
        qe16_b = qe16
        qo16_b = qo16
    sc_k = qk_scale * pow2_f32(-eq) * 16384.0  # the key tiles hold E2M1 * 2**-14
    EV: tl.constexpr = EV16 and E8M0_CHECK and KIND_V == 2
    m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, rare, mc = _fp4_block_rows_loop(
        qe16, qo16, qe16_b, qo16_b, sc_k, BT, K0, K1, V0, V1, b, kvh, start, end, stride_btb, k0_s, k0_h, k1_s,
        k1_h, v0_s, v0_h, v1_s, v1_h, H, D, PAGE, PAGE_SLOTS, BLOCK_N, KIND_K, QB_K, FMT_K, KIND_V, QB_V, FMT_V, PTX,
        WSC_K, WSC_V, VW, HALF_K, HALF_V, E8M0_CHECK, PIDS_AHEAD, EV, KPT, FIELDS_K, FIELDS_V)
    if E8M0_CHECK:  # a code 0 or 255 among the E8M0 scales (``EV``: or value codes spread too far): the split again,
        # with the rule for them and bfloat16 value products (its page ids read in the step: the rerun is rare, and
        # carried page ids in both loops spill fp4_e2m1's 168 registers)
        if tl.max(rare, 0) != 0:
            m_i, l_i, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, rare, mc = _fp4_block_rows_loop(
                qe16, qo16, qe16_b, qo16_b, sc_k, BT, K0, K1, V0, V1, b, kvh, start, end, stride_btb, k0_s, k0_h, k1_s,
                k1_h, v0_s, v0_h, v1_s, v1_h, H, D, PAGE, PAGE_SLOTS, BLOCK_N, KIND_K, QB_K, FMT_K, KIND_V, QB_V, FMT_V,
                PTX, WSC_K, WSC_V, VW, HALF_K, HALF_V, False, False, False, KPT)
    DV: tl.constexpr = (D // 8 if HALF_V else D // 4) if VW else (D // 4 if HALF_V else D // 2)
    jv = tl.arange(0, DV)
    if EV:  # the accumulators hold sum p v 2**(128 - mc) (mc in 16 .. 240, or 128 after a rerun)
        f = pow2_f32(mc - 128)
    else:
        f = 2.0**14 / 128.0 if KIND_V == 3 else 1.0
    if VW and HALF_V:  # the channels of the first half's words, then of the second's
        lo_a, hi_a = _word_channels(acc0, acc1, acc2, acc3, NBV // 2, H, DV, QB_V)
        lo_b, hi_b = _word_channels(acc4, acc5, acc6, acc7, NBV // 2, H, DV, QB_V)
        return _columns_cat(lo_a, lo_b, H, 2 * DV) * f, _columns_cat(hi_a, hi_b, H, 2 * DV) * f, m_i, l_i
    elif HALF_V:  # channel pairs of the first half, then of the second
        lo_a = _block_row_select(acc0, NBV // 2, H, DV, 2 * jv // QB_V)
        hi_a = _block_row_select(acc1, NBV // 2, H, DV, 2 * jv // QB_V)
        lo_b = _block_row_select(acc2, NBV // 2, H, DV, 2 * jv // QB_V)
        hi_b = _block_row_select(acc3, NBV // 2, H, DV, 2 * jv // QB_V)
        return _columns_cat(lo_a, lo_b, H, DV) * f, _columns_cat(hi_a, hi_b, H, DV) * f, m_i, l_i
    elif VW:
        lo, hi = _word_channels(acc0, acc1, acc2, acc3, NBV, H, DV, QB_V)
        return lo * f, hi * f, m_i, l_i
    else:
        lo = _block_row_select(acc0, NBV, H, DV, 2 * j // QB_V) * f
        hi = _block_row_select(acc1, NBV, H, DV, 2 * j // QB_V) * f
        return lo, hi, m_i, l_i


def _int_codes_ptx(bits: int, f16: bool, magic_number: bool = True) -> str:
    """The PTX of :func:`_int_phases`: input ``$(2 * 8 / bits)`` (bytes 0-3), outputs ``$(2P)``, ``$(2P + 1)`` for
    phase P (the codes at bit P * bits of bytes 0, 1 and 2, 3, one per 16-bit half): ``prmt`` spreads two bytes into
    the halves of y, then per phase one ``lop3`` ``(y & field) | magic`` puts the code in the mantissa of the magic
    number (float16 0x6400 = 1024, bfloat16 0x4300 = 128) at bit ``k`` (the code's own bit, or lower by a ``shr``
    where it would reach the exponent): the half is magic + code * 2**k, which the caller maps back to the code.
    Without ``magic_number`` (float16 only) the exponent field stays 0: the half is the float16 subnormal
    code * 2**(k - 24), exact, which needs no subtraction (:func:`_int_codes_sub`)."""
    magic = (0x6400 if f16 else 0x4300) if magic_number else 0
    phases = 8 // bits
    lines = [".reg .b32 z, y, t;", "mov.b32 z, 0;"]
    for half, sel in enumerate(("0x4140", "0x4342")):
        lines.append(f"prmt.b32 y, ${2 * phases}, z, {sel};")
        for p in range(phases):
            k = int_code_bit(bits, p, f16)
            field = ((1 << bits) - 1) << k
            src = "y"
            if k < p * bits:
                lines.append(f"shr.b32 t, y, {p * bits - k};")
                src = "t"
            lines.append(f"lop3.b32 ${2 * p + half}, {src}, 0x{field:04X}{field:04X}, 0x{magic:04X}{magic:04X}, 0xEA;")
    return "{\n" + "\n".join(lines) + "\n}"


@triton.constexpr_function
def int_code_bit(bits: int, phase: int, f16: bool) -> int:
    """The bit ``k`` at which :func:`_int_codes_ptx` places the code of ``phase`` (half = magic + code * 2**k): its
    own bit ``phase * bits``, lowered where the code would reach past the mantissa (10 bits in float16, 7 in
    bfloat16) into the exponent. A constexpr function: the PTX generators, :func:`_from_magic`,
    :func:`_int_codes_sub` and :func:`_sub_operand` all take the bit from here."""
    return phase * bits - max(0, phase * bits + bits - (10 if f16 else 7))


INT4_F16_PTX = tl.constexpr(_int_codes_ptx(4, True))
INT4_BF16_PTX = tl.constexpr(_int_codes_ptx(4, False))
INT2_F16_PTX = tl.constexpr(_int_codes_ptx(2, True))
INT2_BF16_PTX = tl.constexpr(_int_codes_ptx(2, False))
INT4_F16_SUB_PTX = tl.constexpr(_int_codes_ptx(4, True, False))
INT2_F16_SUB_PTX = tl.constexpr(_int_codes_ptx(2, True, False))


@triton.jit
def _int_codes_sub(x, P: tl.constexpr, BITS: tl.constexpr, PH: tl.constexpr, F16: tl.constexpr = True):
    """The ``BITS``-bit integer codes at bit ``P * BITS`` of ``x`` as the float16 subnormals ``code * 2**(K - 24)``
    (or with ``F16`` false the bfloat16 subnormals ``code * 2**(K - 133)``; exponent field 0, the code at mantissa
    bit K of phase ``PH``, :func:`int_code_bit`'s rule): a bit placement, exact, the values of the PTX unpacking
    without a magic number (:func:`_int_codes_ptx`, :func:`_int_words_ptx`); the caller takes the power of two out
    of its float32 products (:func:`_kivi_rows_scores`, :func:`_kivi_key_rows`). The interpreter, which can neither
    bitcast to bfloat16 nor convert float32 to bfloat16 subnormals, returns the value code * 2**(K - 133) as float32
    (exact; its products, :func:`_dot_acc`, are float32 anyway)."""
    K: tl.constexpr = int_code_bit(BITS, PH, F16)
    c = (x.to(tl.int32) >> (P * BITS)) & ((1 << BITS) - 1)
    if F16:
        return (c << K).to(tl.int16).to(tl.float16, bitcast=True)
    elif INTERPRET:
        return (c << K).to(tl.float32) * 2.0**-133
    else:
        return (c << K).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _from_magic(x, P: tl.constexpr, BITS: tl.constexpr, F16: tl.constexpr):
    """magic + code * 2**K (float16 magic 1024, or bfloat16 128) -> code, exact: x * 2**-K - magic * 2**-K, with K
    the bit of phase ``P``'s code (:func:`int_code_bit`'s rule)."""
    M: tl.constexpr = 1024.0 if F16 else 128.0
    K: tl.constexpr = int_code_bit(BITS, P, F16)
    if K == 0:
        return x - M
    else:  # (x * 2**-K is exact, so fused or not the same value)
        return tl.fma(x, tl.cast(1.0 / (1 << K), x.dtype), tl.cast(-M / (1 << K), x.dtype))


@triton.jit
def _int_phases(byte, BITS: tl.constexpr, F16: tl.constexpr, PTX: tl.constexpr, SUB: tl.constexpr = False):
    """The integer codes of every phase of ``byte`` (uint8; phase P at bit P * BITS) as exact float16 (``F16``) or
    bfloat16 values, four tensors (4-bit codes: phases 0, 1, 0, 1). CUDA (``PTX``): :func:`_int_codes_ptx`, two
    elements per instruction; elsewhere :func:`_int_codes16` per phase. ``SUB`` (float16): the float16 subnormals
    ``code * 2**(K_P - 24)`` instead (:func:`_int_codes_sub`; no subtraction of a magic number)."""
    if SUB:
        tl.static_assert(F16, "subnormal codes are float16")
        if PTX and not INTERPRET:
            if BITS == 4:
                a, b = tl.inline_asm_elementwise(INT4_F16_SUB_PTX, "=r,=r,=r,=r,r", [byte],
                                                 dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
                return a, b, a, b
            else:
                return tl.inline_asm_elementwise(INT2_F16_SUB_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [byte],
                                                 dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                 is_pure=True, pack=4)
        else:
            PHS: tl.constexpr = 8 // BITS
            return (_int_codes_sub(byte, 0, BITS, 0), _int_codes_sub(byte, 1, BITS, 1),
                    _int_codes_sub(byte, 2 % PHS, BITS, 2 % PHS), _int_codes_sub(byte, 3 % PHS, BITS, 3 % PHS))
    if PTX and not INTERPRET:
        if BITS == 4 and F16:
            a, b = tl.inline_asm_elementwise(INT4_F16_PTX, "=r,=r,=r,=r,r", [byte], dtype=(tl.float16, tl.float16),
                                             is_pure=True, pack=4)
        elif BITS == 4:
            a, b = tl.inline_asm_elementwise(INT4_BF16_PTX, "=r,=r,=r,=r,r", [byte],
                                             dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        elif F16:
            a, b, c, d = tl.inline_asm_elementwise(INT2_F16_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [byte],
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                   is_pure=True, pack=4)
        else:
            a, b, c, d = tl.inline_asm_elementwise(INT2_BF16_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [byte],
                                                   dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                                                   is_pure=True, pack=4)
        if BITS == 4:
            a = _from_magic(a, 0, BITS, F16)
            b = _from_magic(b, 1, BITS, F16)
            return a, b, a, b
        else:
            return (_from_magic(a, 0, BITS, F16), _from_magic(b, 1, BITS, F16), _from_magic(c, 2, BITS, F16),
                    _from_magic(d, 3, BITS, F16))
    else:
        PH: tl.constexpr = 8 // BITS
        return (_int_codes16(byte, 0, BITS, F16), _int_codes16(byte, 1, BITS, F16),
                _int_codes16(byte, 2 % PH, BITS, F16), _int_codes16(byte, 3 % PH, BITS, F16))


def _int_words_ptx(bits: int, f16: bool, magic_number: bool = True) -> str:
    """The PTX of :func:`_int_word_phases`: outputs ``$p`` (p = 0..7), inputs ``$8`` (4-bit codes: ``$8``, ``$9``, two
    32-bit words; 2-bit codes: ``$8``, two 16-bit words in its halves). Output p holds code p of the first word in its
    low half and of the second in its high half as magic + code * 2**k (float16 magic 0x6400 = 1024, bfloat16 0x4300 =
    128; k as :func:`int_code_bit`). 4-bit codes: per byte j a ``prmt`` spreads byte j of both words into the low
    bytes of the halves, then one ``lop3`` ``(y & field) | magic`` per code (bfloat16's high nibble after a ``shr`` by
    1); 2-bit codes: the halves are the words, one ``lop3`` per code (after a ``shr`` where the code would reach the
    exponent). Without ``magic_number``: the subnormals code * 2**(k - 24) (float16) or code * 2**(k - 133)
    (bfloat16), as :func:`_int_codes_ptx`."""
    magic = (0x6400 if f16 else 0x4300) if magic_number else 0
    lines = [".reg .b32 y, t;"]

    def code(out: int, src_bit: int, phase: int) -> None:
        k = int_code_bit(bits, phase, f16)
        field = ((1 << bits) - 1) << k
        src = "y"
        if k < src_bit:
            lines.append(f"shr.b32 t, y, {src_bit - k};")
            src = "t"
        lines.append(f"lop3.b32 ${out}, {src}, 0x{field:04X}{field:04X}, 0x{magic:04X}{magic:04X}, 0xEA;")

    if bits == 4:
        for j in range(4):
            lines.append(f"prmt.b32 y, $8, $9, 0x{((j + 4) << 8) | j:04X};")
            code(2 * j, 0, 0)
            code(2 * j + 1, 4, 1)
    else:
        lines.append("mov.b32 y, $8;")
        for p in range(8):
            code(p, 2 * p, p)
    return "{\n" + "\n".join(lines) + "\n}"


INT4_WORDS_F16_PTX = tl.constexpr(_int_words_ptx(4, True))
INT4_WORDS_BF16_PTX = tl.constexpr(_int_words_ptx(4, False))
INT2_WORDS_F16_PTX = tl.constexpr(_int_words_ptx(2, True))
INT2_WORDS_BF16_PTX = tl.constexpr(_int_words_ptx(2, False))
INT4_WORDS_F16_SUB_PTX = tl.constexpr(_int_words_ptx(4, True, False))
INT2_WORDS_F16_SUB_PTX = tl.constexpr(_int_words_ptx(2, True, False))
INT4_WORDS_BF16_SUB_PTX = tl.constexpr(_int_words_ptx(4, False, False))
INT2_WORDS_BF16_SUB_PTX = tl.constexpr(_int_words_ptx(2, False, False))


@triton.constexpr_function
def int_word_code_bit(bits: int, p: int, f16: bool) -> int:
    """The bit ``k`` of code ``p`` (0..7) of a code word as :func:`_int_word_phases` unpacks it: the bit of its
    phase, ``p % 2`` for 4-bit codes (two codes per byte), ``p`` for 2-bit codes (:func:`int_code_bit`)."""
    return int_code_bit(bits, p % (2 if bits == 4 else 8), f16)


# KIVI value codes as bfloat16 subnormals (``kivi_value_subnormal_codes``): p * s is scaled by 2**VALUE_SUB_SHIFT
# before its rounding to bfloat16, so that its products with code * 2**(k - 133) stay normal float32 (p * s * code
# at least 2**(7 - 96 - k)); the accumulators are taken back by 2**(133 - k - VALUE_SUB_SHIFT) after the loop. With
# |s| < 2**16 (float16 scales) p * s * 2**96 < 2**112 stays inside bfloat16. Exact scalings by powers of two.
VALUE_SUB_SHIFT = 96
VALUE_SUB_SCALE = tl.constexpr(2.0**VALUE_SUB_SHIFT)


@triton.constexpr_function
def value_sub_unscale(bits: int, p: int) -> float:
    """2**(133 - k - VALUE_SUB_SHIFT) for code ``p`` of a word of ``bits``-bit value codes as bfloat16 subnormals
    (:func:`int_word_code_bit`): what takes its accumulator back to p * s * code."""
    return 2.0 ** (133 - int_word_code_bit(bits, p, False) - VALUE_SUB_SHIFT)


@triton.jit
def _int_word_phases(w, BITS: tl.constexpr, F16: tl.constexpr, PTX: tl.constexpr, SUB: tl.constexpr = False):
    """The eight integer codes of each code word ``w`` (int32 of 4-bit codes, int16 of 2-bit codes; code p at bit
    ``p * BITS``: channel 8c + p of word c) as exact float16 (``F16``) or bfloat16 values, eight tensors in code order.
    CUDA (``PTX``): :func:`_int_words_ptx`, two words per call, 0.75 (4-bit) or 0.6 (2-bit) integer instructions per
    code, then :func:`_from_magic` (one packed 16-bit operation per two codes); elsewhere :func:`_int_codes16` per
    code. ``SUB``: the subnormals ``code * 2**(K - 24)`` (float16) or ``code * 2**(K - 133)`` (bfloat16) instead,
    K the bit of the code (:func:`int_word_code_bit`; :func:`_int_codes_sub`: no magic number to subtract)."""
    if SUB:
        QS: tl.constexpr = 2 if BITS == 4 else 8  # the phase of code p is p % QS (see _int_words_ptx)
        if PTX and not INTERPRET:
            if F16:
                sdt = tl.float16
            else:
                sdt = tl.bfloat16
            return tl.inline_asm_elementwise(
                (INT4_WORDS_F16_SUB_PTX if BITS == 4 else INT2_WORDS_F16_SUB_PTX) if F16 else
                (INT4_WORDS_BF16_SUB_PTX if BITS == 4 else INT2_WORDS_BF16_SUB_PTX),
                "=r,=r,=r,=r,=r,=r,=r,=r,r,r" if BITS == 4 else "=r,=r,=r,=r,=r,=r,=r,=r,r", [w],
                dtype=(sdt, sdt, sdt, sdt, sdt, sdt, sdt, sdt), is_pure=True, pack=2)
        else:
            return (_int_codes_sub(w, 0, BITS, 0, F16), _int_codes_sub(w, 1, BITS, 1 % QS, F16),
                    _int_codes_sub(w, 2, BITS, 2 % QS, F16), _int_codes_sub(w, 3, BITS, 3 % QS, F16),
                    _int_codes_sub(w, 4, BITS, 4 % QS, F16), _int_codes_sub(w, 5, BITS, 5 % QS, F16),
                    _int_codes_sub(w, 6, BITS, 6 % QS, F16), _int_codes_sub(w, 7, BITS, 7 % QS, F16))
    if PTX and not INTERPRET:
        if F16:
            dt = tl.float16
        else:
            dt = tl.bfloat16
        Q: tl.constexpr = 2 if BITS == 4 else 8  # codes per 16-bit half of the input (byte of 4-bit codes, word)
        c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
            (INT4_WORDS_F16_PTX if F16 else INT4_WORDS_BF16_PTX) if BITS == 4 else
            (INT2_WORDS_F16_PTX if F16 else INT2_WORDS_BF16_PTX),
            "=r,=r,=r,=r,=r,=r,=r,=r,r,r" if BITS == 4 else "=r,=r,=r,=r,=r,=r,=r,=r,r", [w],
            dtype=(dt, dt, dt, dt, dt, dt, dt, dt), is_pure=True, pack=2)
        return (_from_magic(c0, 0, BITS, F16), _from_magic(c1, 1 % Q, BITS, F16), _from_magic(c2, 2 % Q, BITS, F16),
                _from_magic(c3, 3 % Q, BITS, F16), _from_magic(c4, 4 % Q, BITS, F16),
                _from_magic(c5, 5 % Q, BITS, F16), _from_magic(c6, 6 % Q, BITS, F16),
                _from_magic(c7, 7 % Q, BITS, F16))
    else:
        return (_int_codes16(w, 0, BITS, F16), _int_codes16(w, 1, BITS, F16), _int_codes16(w, 2, BITS, F16),
                _int_codes16(w, 3, BITS, F16), _int_codes16(w, 4, BITS, F16), _int_codes16(w, 5, BITS, F16),
                _int_codes16(w, 6, BITS, F16), _int_codes16(w, 7, BITS, F16))


@triton.jit
def _eighths(x, R: tl.constexpr, C: tl.constexpr):
    """Columns 8c + p of ``x`` [R, 8C] as eight [R, C] tensors, p = 0..7."""
    e, o = tl.split(tl.reshape(x, (R, C, 2, 2, 2)))  # bit 0 of p
    e0, e1 = tl.split(e)  # bit 1
    o0, o1 = tl.split(o)
    x0, x4 = tl.split(e0)  # bit 2
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _quarters_interleaved(a, b, c, d, R: tl.constexpr, C: tl.constexpr):
    """[R, 4C] with column 4c + k taken from the k-th of ``a``, ``b``, ``c``, ``d`` [R, C]."""
    return tl.reshape(tl.join(tl.join(a, c), tl.join(b, d)), (R, 4 * C))


@triton.jit
def _tile_slots(t0, end, BT, b, stride_btb, PAGE: tl.constexpr, PAGE_SLOTS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The cache rows (``page_slot``) of tokens t0 .. t0 + BLOCK_N - 1 of sequence ``b`` through its block table, and
    which of them lie before ``end`` (the others read page 0 and are masked)."""
    t = t0 + tl.arange(0, BLOCK_N)
    tmask = t < end
    page = tl.load(BT + b * stride_btb + t // PAGE, mask=tmask, other=0).to(tl.int64)
    return page_slot(page, t, PAGE, PAGE_SLOTS), tmask


@triton.jit
def _kivi_group_slots(t0, end, BT, b, stride_btb, HV: tl.constexpr, PAGE: tl.constexpr, PAGE_SLOTS: tl.constexpr,
                      BLOCK_N: tl.constexpr, G_K: tl.constexpr):
    """The cache rows (``page_slot``) of the first token of each KIVI key group of the tile at ``t0`` through the
    block table ([RK / HV] with :func:`_kivi_key_rows`' RK), and which groups hold tokens before ``end`` (the others
    read page 0 and are masked)."""
    NGK: tl.constexpr = BLOCK_N // G_K if BLOCK_N > G_K else 1
    RK: tl.constexpr = NGK * HV if NGK * HV > 16 else 16
    kg = tl.arange(0, RK // HV)
    tg = t0 + kg * G_K  # the first token of each key group of the tile
    gmask = (kg < NGK) & (tg < end)
    gslot = page_slot(tl.load(BT + b * stride_btb + tg // PAGE, mask=gmask, other=0).to(tl.int64), tg, PAGE,
                      PAGE_SLOTS)
    return gslot, gmask


@triton.jit
def _tile_page_ids(t0, end, BT, b, stride_btb, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The page ids of the tile at ``t0`` (a multiple of BLOCK_N) as four scalars: page i of the tile (at most four:
    BLOCK_N <= 4 * PAGE) from sequence ``b``'s block table, 0 where it starts at or past ``end``; where the tile has
    fewer pages (one when PAGE >= BLOCK_N, two when BLOCK_N = 2 * PAGE) the rest repeat page 0's id, which
    :func:`_paged_slots` never selects. Scalars: no layout, so every tensor of tokens can take its rows from them
    where it is (:func:`_paged_slots`), without moving a row vector between layouts."""
    NP: tl.constexpr = BLOCK_N // PAGE if BLOCK_N > PAGE else 1
    row = BT + b * stride_btb + t0 // PAGE
    a0 = tl.load(row, mask=t0 < end, other=0)
    a1 = a0
    a2 = a0
    a3 = a0
    if NP > 1:
        a1 = tl.load(row + 1, mask=t0 + PAGE < end, other=0)
    if NP > 2:
        a2 = tl.load(row + 2, mask=t0 + 2 * PAGE < end, other=0)
        a3 = tl.load(row + 3, mask=t0 + 3 * PAGE < end, other=0)
    return a0, a1, a2, a3


@triton.jit
def _paged_slots(t, t0, end, a0, a1, a2, a3, PAGE: tl.constexpr, PAGE_SLOTS: tl.constexpr):
    """The cache rows (``page_slot``) of tokens ``t`` (any shape, inside the tile at ``t0`` whose page ids are
    ``a0`` .. ``a3``, :func:`_tile_page_ids`) and which lie before ``end``: page ``t // PAGE - t0 // PAGE`` of the
    tile, selected from the scalars."""
    j = t // PAGE - t0 // PAGE
    page = tl.where(j == 0, a0, tl.where(j == 1, a1, tl.where(j == 2, a2, a3))).to(tl.int64)
    return page_slot(page, t, PAGE, PAGE_SLOTS), t < end


@triton.jit
def _chunked_tokens(NCH: tl.constexpr, CN: tl.constexpr, IL: tl.constexpr):
    """[NCH, CN] token offsets in a tile, chunk c holding the offsets ``j`` with ``(j // IL) % NCH == c`` in order
    (:func:`_token_chunks1` of ``arange(NCH * CN)``, built where it is used)."""
    c = tl.arange(0, NCH)[:, None]
    i = tl.arange(0, CN)[None, :]
    return ((i // IL) * NCH + c) * IL + i % IL


@triton.jit
def _kivi_rows_key_loads(slot, tmask, gslot, gmask, K0, K1, K2, kvh, k0_s, k0_h, k1_s, k1_h, k2_s, k2_h,
                         HV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, G_K: tl.constexpr,
                         BITS_K: tl.constexpr, KW: tl.constexpr):
    """:func:`_kivi_key_rows`' key loads of a tile (its tokens' ``slot`` and ``tmask`` from :func:`_tile_slots`, its
    key groups' ``gslot`` and ``gmask`` from :func:`_kivi_group_slots`): the codes (``KW``: words [BLOCK_N, D / 8],
    else bytes [D / PK, BLOCK_N]) and the groups' scales and zeros broadcast over the key rows (float32 [rows, D]);
    tokens and groups masked out load nothing."""
    PK: tl.constexpr = 8 // BITS_K
    NGK: tl.constexpr = BLOCK_N // G_K if BLOCK_N > G_K else 1
    RK: tl.constexpr = NGK * HV if NGK * HV > 16 else 16
    WTK: tl.constexpr = tl.int32 if BITS_K == 4 else tl.int16
    KWB: tl.constexpr = BITS_K  # bytes per code word: 4 (4-bit codes), 2 (2-bit)
    d = tl.arange(0, D)
    grp = gslot // G_K
    if KW:  # (strides in words, so the rows' alignment is known to the compiler: vector loads)
        kc = tl.load(K0.to(tl.pointer_type(WTK)) + slot[:, None] * (k0_s // KWB) + kvh * (k0_h // KWB)
                     + tl.arange(0, D // 8)[None, :], mask=tmask[:, None], other=0)
    else:
        kc = tl.load(K0 + slot[None, :] * k0_s + kvh * k0_h + tl.arange(0, D // PK)[:, None], mask=tmask[None, :],
                     other=0)
    # the groups' scales and zeros, loaded once per group and broadcast over its rows (j, h)
    ks = tl.load(K1 + grp[:, None] * k1_s + kvh * k1_h + d[None, :], mask=gmask[:, None], other=0.0)
    kz = tl.load(K2 + grp[:, None] * k2_s + kvh * k2_h + d[None, :], mask=gmask[:, None], other=0.0)
    return kc, _group_rows(ks.to(tl.float32), RK // HV, HV, D), _group_rows(kz.to(tl.float32), RK // HV, HV, D)


@triton.jit
def _sub_operand(a, PH: tl.constexpr, BITS: tl.constexpr, KMIN: tl.constexpr, SUB: tl.constexpr):
    """The key rows' float16 operand ``a`` of the codes of phase ``PH`` in a chain whose smallest code bit is ``KMIN``:
    with subnormal codes (``SUB``, :func:`_int_codes_sub`: code * 2**(K - 24)) times 2**(KMIN - K), so that every
    product of the chain carries the same 2**(KMIN - 24): one float16 multiplication by a power of two, exact except
    where the product falls below float16's normal range (then rounded once more, to a multiple of 2**-24); ``a``
    itself without ``SUB`` or where K is the chain's KMIN."""
    K: tl.constexpr = int_code_bit(BITS, PH, True)
    if not SUB or K == KMIN:
        return a
    else:
        return a * tl.cast(1.0 / (1 << (K - KMIN)), tl.float16)


@triton.jit
def _kivi_rows_scores(kc, ks, kz, qk, sel, qk_scale, HV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                      BITS_K: tl.constexpr, PTX: tl.constexpr, KW: tl.constexpr, KCH: tl.constexpr,
                      SUB: tl.constexpr = False, JOIN: tl.constexpr = False):
    """:func:`_kivi_key_rows`' scores [HV, BLOCK_N] (times ``qk_scale``) of one tile from its key loads
    (:func:`_kivi_rows_key_loads`): the key rows ``fl16(q_h * s_j * 2**e)`` against the codes, times 2**-e, plus the
    zero term ``q_h . z_j``, each token's row selected by ``sel``. ``SUB``: the codes as float16 subnormals
    ``code * 2**(K - 24)`` (:func:`_int_codes_sub`: no magic number subtracted per pair of codes); a chain of products
    whose codes sit at different bits K takes 2**(KMIN - K) into the operands of its larger K
    (:func:`_sub_operand`), and the chains' sum is multiplied by 2**24 (and the odd chain's, at KMIN_odd, by
    2**-KMIN_odd on the way: one fused multiply-add), all exact: where no operand falls below float16's normal range
    the same bits as with exact codes (4-bit words in two chains: every operand as without ``SUB``). ``JOIN``: the
    row terms 2**-e and q . z_j joined into one tensor before they meet the product's layout (the same values)."""
    RK: tl.constexpr = qk.shape[0]
    PK: tl.constexpr = 8 // BITS_K
    DK: tl.constexpr = D // PK
    DW: tl.constexpr = D // 8
    QS: tl.constexpr = 2 if BITS_K == 4 else 8  # KW: the phase of code position p is p % QS (_int_words_ptx)
    qs = qk * ks
    e = _f16_exponent(tl.max(tl.abs(qs), 1))
    a = _split16(qs * pow2_f32(e)[:, None], True)[0]
    bias = tl.sum(qk * kz, 1)
    if KW:
        c0, c1, c2, c3, c4, c5, c6, c7 = _int_word_phases(tl.trans(kc), BITS_K, True, PTX, SUB)
        # SUB: each chain's smallest code bit (KCH 2: the even positions' is phase 0's, the odd ones' phase 1's)
        KMO: tl.constexpr = int_code_bit(BITS_K, 1, True) if KCH == 2 else 0
        a0, a1, a2, a3, a4, a5, a6, a7 = _eighths(a, RK, DW)
        a0 = _sub_operand(a0, 0, BITS_K, 0, SUB)
        a1 = _sub_operand(a1, 1 % QS, BITS_K, KMO, SUB)
        a2 = _sub_operand(a2, 2 % QS, BITS_K, 0, SUB)
        a3 = _sub_operand(a3, 3 % QS, BITS_K, KMO, SUB)
        a4 = _sub_operand(a4, 4 % QS, BITS_K, 0, SUB)
        a5 = _sub_operand(a5, 5 % QS, BITS_K, KMO, SUB)
        a6 = _sub_operand(a6, 6 % QS, BITS_K, 0, SUB)
        a7 = _sub_operand(a7, 7 % QS, BITS_K, KMO, SUB)
        if KCH == 2:  # two independent accumulation chains (even and odd code positions), summed once
            s2 = _dot_acc(a0, c0, tl.zeros((RK, BLOCK_N), tl.float32))
            s2b = _dot_acc(a1, c1, tl.zeros((RK, BLOCK_N), tl.float32))
            s2 = _dot_acc(a6, c6, _dot_acc(a4, c4, _dot_acc(a2, c2, s2)))
            s2b = _dot_acc(a7, c7, _dot_acc(a5, c5, _dot_acc(a3, c3, s2b)))
            if SUB:  # even chain: 2**-24 of its sum; odd chain: 2**(KMO - 24)
                s2 = tl.fma(s2b, 1.0 / (1 << KMO), s2)
            else:
                s2 = s2 + s2b
        else:
            s2 = _dot_acc(a0, c0, tl.zeros((RK, BLOCK_N), tl.float32))
            s2 = _dot_acc(a7, c7, _dot_acc(a6, c6, _dot_acc(a5, c5, _dot_acc(a4, c4, s2))))
            s2 = _dot_acc(a3, c3, _dot_acc(a2, c2, _dot_acc(a1, c1, s2)))
    elif PK == 2:
        k0, k1, k2, k3 = _int_phases(kc, BITS_K, True, PTX, SUB)
        a0, a1 = tl.split(tl.reshape(a, (RK, DK, 2)))
        a1 = _sub_operand(a1, 1, BITS_K, 0, SUB)
        s2 = _dot_acc(a1, k1, _dot_acc(a0, k0, tl.zeros((RK, BLOCK_N), tl.float32)))
    else:
        k0, k1, k2, k3 = _int_phases(kc, BITS_K, True, PTX, SUB)
        a02, a13 = tl.split(tl.reshape(a, (RK, DK, 2, 2)))
        a0, a2 = tl.split(a02)
        a1, a3 = tl.split(a13)
        a1 = _sub_operand(a1, 1, BITS_K, 0, SUB)
        a2 = _sub_operand(a2, 2, BITS_K, 0, SUB)
        a3 = _sub_operand(a3, 3, BITS_K, 0, SUB)
        s2 = _dot_acc(a3, k3, _dot_acc(a2, k2, _dot_acc(a1, k1, _dot_acc(a0, k0, tl.zeros((RK, BLOCK_N),
                                                                                         tl.float32)))))
    if SUB:  # every chain's sum now carries 2**-24 (exact)
        s2 = s2 * 16777216.0
    if JOIN:  # one [rows, 2] tensor: Triton moves the two row terms into the product's layout together
        sc, bi = tl.split(tl.join(pow2_f32(-e), bias)[:, None, :])
        s2 = s2 * sc + bi
    else:
        s2 = s2 * pow2_f32(-e)[:, None] + bias[:, None]
    s = tl.sum(tl.where(sel, tl.reshape(s2, (RK // HV, HV, BLOCK_N)), 0.0), 0) * qk_scale
    return s


@triton.jit
def _row_sums_mma(x, acc):
    """``acc`` [B, M, 16] plus the row sums of float32 ``x`` [B, M, K], in every column: x's three bfloat16 parts
    (hi = bf16(x), mid = bf16(x - hi), lo = x - hi - mid, exact) times ones on the tensor cores, float32
    accumulation; a reduction with no exchange of the rows between threads (the interpreter: the same parts as
    float32, float32 products)."""
    if INTERPRET:
        hi = _bf16_rn(x)
        mid = _bf16_rn(x - hi)
        lo = x - hi - mid
        ones = tl.full((x.shape[0], x.shape[2], 16), 1.0, tl.float32)
    else:
        hi, mid, lo = _split(x, True)
        ones = tl.full((x.shape[0], x.shape[2], 16), 1.0, tl.bfloat16)
    return _dot_acc(lo, ones, _dot_acc(mid, ones, _dot_acc(hi, ones, acc)))


@triton.jit
def _token_chunks(x, NCH: tl.constexpr, IL: tl.constexpr):
    """[R, N] -> [NCH, R, N / NCH]: chunk c holds the columns j with ``(j // IL) % NCH == c``, in order."""
    R: tl.constexpr = x.shape[0]
    N: tl.constexpr = x.shape[1]
    y = tl.permute(tl.reshape(x, (R, N // (IL * NCH), NCH, IL)), (2, 0, 1, 3))
    return tl.reshape(y, (NCH, R, N // NCH))


@triton.jit
def _token_chunks1(x, NCH: tl.constexpr, IL: tl.constexpr):
    """[N] -> [NCH, N / NCH] as :func:`_token_chunks`."""
    N: tl.constexpr = x.shape[0]
    return tl.reshape(tl.permute(tl.reshape(x, (N // (IL * NCH), NCH, IL)), (1, 0, 2)), (NCH, N // NCH))


@triton.jit
def _kivi_key_rows(
    Q, BT, K0, K1, K2, V0, V1, V2, b, kvh, start, end, stride_qb, stride_qh, stride_btb, k0_s, k0_h, k1_s, k1_h,
    k2_s, k2_h, v0_s, v0_h, v1_s, v1_h, v2_s, v2_h, qk_scale, QPK: tl.constexpr, HV: tl.constexpr,
    BLOCK_H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, PAGE_SLOTS: tl.constexpr, BLOCK_N: tl.constexpr,
    G_K: tl.constexpr,
    BITS_K: tl.constexpr, G_V: tl.constexpr, BITS_V: tl.constexpr, RN: tl.constexpr, PTX: tl.constexpr,
    KW: tl.constexpr = False, KCH: tl.constexpr = 1, PIPE: tl.constexpr = False, KSUB: tl.constexpr = False,
    PIDS_AHEAD: tl.constexpr = False, NCH: tl.constexpr = 1, VSW: tl.constexpr = False, CSM: tl.constexpr = 0,
    RJOIN: tl.constexpr = False, VSUB: tl.constexpr = False, SPG: tl.constexpr = False,
):
    """Fast-mode KIVI keys by token-group rows (``key_rows``), values by channel-group rows (``value_rows``).

    Key rows are (token group j of the tile, head h), ``max(16, (BLOCK_N / G_K) * HV)``: row (j, h) holds
    ``fl16(q_h * s_j * 2**e)`` (s_j: group j's per-channel scales; the product in float32, one rounding to float16
    after a power of two 2**e per row puts its largest element in [2**14, 2**15)) against the exact integer codes
    in float16, so one MMA per byte phase; its [rows, tokens] product times 2**-e plus the group's zero term
    ``q_h . z_j`` (float32) is the score of the tokens of group j, selected per token. Values as
    :func:`_kivi_value_rows` (``p * s`` rounded once to bfloat16 against the exact codes, ``p * z`` summed in
    float32 per (row, token)). Returns the value accumulators [BLOCK_H, D / PV] per phase, the zero term in the
    residual tiles' accumulator shape [BLOCK_H, RN] (each row's sum in column 0) and m, l [BLOCK_H] (base 2) in the
    value rows, as the main loop leaves them.

    ``KW`` (code words): key and value codes read as words of eight codes (int32 of 4-bit codes, int16 of 2-bit
    codes; channel 8c + p is code p of word c) and unpacked by :func:`_int_word_phases`, one product per code p on
    each side. Keys: the key rows' columns 8c + p [rows, D / 8] against the words' codes p [D / 8, tokens]; values:
    per chunk of BLOCK_N / ``NCH`` tokens (a batched product, so the warps split the tokens instead of repeating a
    [rows, D / 8] product; Triton gives each chunk its own warps, or a warp several chunks and their accumulators),
    the value rows [NCH, rows, BLOCK_N / NCH] against the codes p [NCH, BLOCK_N / NCH, D / 8], the chunks summed
    after the loop. The same nonzero products as the byte phases, summed in another order. ``KCH`` 2: the key
    words' eight products in two independent accumulation chains (even and odd p), summed once. ``PIPE``: each step
    computes the next tile's scores (its key loads and products) beside this tile's softmax and value products, the
    first tile's before the loop, so that the two dependency chains of a step are independent; the same arithmetic per
    tile, so the same bits. ``KSUB``: the key codes as float16 subnormals (:func:`_kivi_rows_scores`' ``SUB``).
    ``PIDS_AHEAD`` (``page_ids_ahead``): the tiles' cache rows and key groups' rows read from the block table one step
    ahead of their loads and carried through the loop (with ``PIPE`` two tiles ahead of the values); without ``PIPE``
    each next tile's value zeros are loaded in the step too (Triton's pipeliner staged the scales, which feed a
    product, but not the zeros, which feed a row sum: loaded in their own step, the warps waited on them). ``VSW``: each
    token's value scales and zeros read as one word (:func:`_kivi_value_rows`' ``WORDS``). ``CSM`` (with ``KW``): a
    softmax state per value chunk, the chunks taking the tile's tokens in runs of ``CSM`` dealt round-robin
    (:func:`_token_chunks`; the value words loaded in the same order), merged after the loop: m = max_c m_c, each
    chunk's l, zero term and value accumulators times 2**(m_c - m) (0 for a chunk that saw no token) and summed; the
    chunk's zero term (the row sums of p * z) is summed on the tensor cores (:func:`_row_sums_mma`), in the value
    accumulators' layout.
    ``RJOIN``: :func:`_kivi_rows_scores`' ``JOIN``. ``VSUB`` (with ``KW``): the value codes as bfloat16 subnormals
    ``code * 2**(k - 133)`` (:func:`_int_word_phases`' ``SUB``: no magic number to subtract) against
    ``bf16(p * 2**VALUE_SUB_SHIFT * s)``, each code position's accumulator times
    2**(133 - k - VALUE_SUB_SHIFT) after the loop (:func:`value_sub_unscale`): the same products scaled by powers of
    two, so the same rounding of p * s and, in IEEE float32, the same sums as the magic number's codes (the H200's
    tensor cores align a product to its operands' exponent fields, so a subnormal code's products keep a few bits
    fewer: outputs within a few units in the last place). ``SPG`` (with ``PIDS_AHEAD``, not ``PIPE``): the tiles'
    page ids read as four scalars (:func:`_tile_page_ids`, one step ahead as before) and every tensor of tokens
    takes its cache rows from them in its own layout (:func:`_paged_slots`), instead of one row vector converted into
    each consumer's layout through shared memory; the same rows, so the same bits."""
    PV: tl.constexpr = 8 // BITS_V
    DV: tl.constexpr = D // PV
    NGK: tl.constexpr = BLOCK_N // G_K if BLOCK_N > G_K else 1
    RK: tl.constexpr = NGK * HV if NGK * HV > 16 else 16
    GRV: tl.constexpr = BLOCK_H // HV
    rk = tl.arange(0, RK)
    rh = rk % HV
    rg = rk // HV
    rmask = (rh < QPK) & (rg < NGK)
    d = tl.arange(0, D)
    iv = tl.arange(0, DV)
    qbase = b * stride_qb + (kvh * QPK + rh).to(tl.int64) * stride_qh
    qk = tl.load(Q + qbase[:, None] + d[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    sel = tl.arange(0, RK // HV)[:, None, None] == (tl.arange(0, BLOCK_N) // G_K)[None, None, :]
    m_i = tl.full((HV,), float("-inf"), tl.float32)
    l_i = tl.zeros((HV,), tl.float32)
    acc0 = tl.zeros((BLOCK_H, DV), tl.float32)
    acc1 = tl.zeros((BLOCK_H, DV), tl.float32)
    acc2 = tl.zeros((BLOCK_H, DV), tl.float32)
    acc3 = tl.zeros((BLOCK_H, DV), tl.float32)
    zacc = tl.zeros((BLOCK_H,), tl.float32)
    DW: tl.constexpr = D // 8  # code words per token (KW)
    WTV: tl.constexpr = tl.int32 if BITS_V == 4 else tl.int16
    VWB: tl.constexpr = BITS_V
    iw = tl.arange(0, DW)
    if KW:
        w0 = tl.zeros((NCH, BLOCK_H, DW), tl.float32)
        w1 = tl.zeros((NCH, BLOCK_H, DW), tl.float32)
        w2 = tl.zeros((NCH, BLOCK_H, DW), tl.float32)
        w3 = tl.zeros((NCH, BLOCK_H, DW), tl.float32)
        w4 = tl.zeros((NCH, BLOCK_H, DW), tl.float32)
        w5 = tl.zeros((NCH, BLOCK_H, DW), tl.float32)
        w6 = tl.zeros((NCH, BLOCK_H, DW), tl.float32)
        w7 = tl.zeros((NCH, BLOCK_H, DW), tl.float32)
    CN: tl.constexpr = BLOCK_N // NCH
    if CSM:  # a softmax state per token chunk
        m_c = tl.full((NCH, HV), float("-inf"), tl.float32)
        l_c = tl.zeros((NCH, HV), tl.float32)
        zacc_c = tl.zeros((NCH, BLOCK_H, 16), tl.float32)
    if SPG:  # the first tile's page ids before the loop, carried into it as scalars
        a0, a1, a2, a3 = _tile_page_ids(start, end, BT, b, stride_btb, PAGE, BLOCK_N)
        vslot, vmask = _paged_slots(start + tl.arange(0, BLOCK_N), start, end, a0, a1, a2, a3, PAGE, PAGE_SLOTS)
    elif PIDS_AHEAD or PIPE:  # the first tile's rows before the loop (with PIDS_AHEAD carried into it)
        vslot, vmask = _tile_slots(start, end, BT, b, stride_btb, PAGE, PAGE_SLOTS, BLOCK_N)
        vgslot, vgmask = _kivi_group_slots(start, end, BT, b, stride_btb, HV, PAGE, PAGE_SLOTS, BLOCK_N, G_K)
    NGV: tl.constexpr = D // G_V
    ZAHEAD: tl.constexpr = PIDS_AHEAD and not PIPE  # each next tile's value zeros read a step ahead
    if ZAHEAD:  # the first tile's value zeros
        zfield = _kivi_value_field(V2, vslot, vmask, kvh, v2_s, v2_h, GRV, NGV, VSW)
    if PIPE:  # the first tile's scores before the loop; each step then computes the next tile's
        if PIDS_AHEAD:  # (and the second tile's rows, carried into the loop)
            nslot, nmask = _tile_slots(start + BLOCK_N, end, BT, b, stride_btb, PAGE, PAGE_SLOTS, BLOCK_N)
            ngslot, ngmask = _kivi_group_slots(start + BLOCK_N, end, BT, b, stride_btb, HV, PAGE, PAGE_SLOTS,
                                               BLOCK_N, G_K)
        kc, ks, kz = _kivi_rows_key_loads(vslot, vmask, vgslot, vgmask, K0, K1, K2, kvh, k0_s, k0_h, k1_s, k1_h,
                                          k2_s, k2_h, HV, D, BLOCK_N, G_K, BITS_K, KW)
        s_next = _kivi_rows_scores(kc, ks, kz, qk, sel, qk_scale, HV, D, BLOCK_N, BITS_K, PTX, KW, KCH, KSUB,
                                   RJOIN)
    for t0 in range(start, end, BLOCK_N):
        if SPG:  # this tile's page ids and value zeros, the next tile's read now; rows made where they are used
            c0, c1, c2, c3, zcur = a0, a1, a2, a3, zfield
            a0, a1, a2, a3 = _tile_page_ids(t0 + BLOCK_N, end, BT, b, stride_btb, PAGE, BLOCK_N)
            vslot, vmask = _paged_slots(t0 + BLOCK_N + tl.arange(0, BLOCK_N), t0 + BLOCK_N, end, a0, a1, a2, a3,
                                        PAGE, PAGE_SLOTS)
            zfield = _kivi_value_field(V2, vslot, vmask, kvh, v2_s, v2_h, GRV, NGV, VSW)
            slot, tmask = _paged_slots(t0 + tl.arange(0, BLOCK_N), t0, end, c0, c1, c2, c3, PAGE, PAGE_SLOTS)
            kg = tl.arange(0, RK // HV)
            gslot, gmask = _paged_slots(t0 + kg * G_K, t0, end, c0, c1, c2, c3, PAGE, PAGE_SLOTS)
            gmask = gmask & (kg < NGK)
        elif PIDS_AHEAD and PIPE:  # this tile's rows (values), the next tile's (keys), the tile after it's read now
            slot, tmask = vslot, vmask
            kslot, ktmask, kgslot, kgmask = nslot, nmask, ngslot, ngmask
            vslot, vmask = nslot, nmask
            nslot, nmask = _tile_slots(t0 + 2 * BLOCK_N, end, BT, b, stride_btb, PAGE, PAGE_SLOTS, BLOCK_N)
            ngslot, ngmask = _kivi_group_slots(t0 + 2 * BLOCK_N, end, BT, b, stride_btb, HV, PAGE, PAGE_SLOTS,
                                               BLOCK_N, G_K)
        elif PIDS_AHEAD:  # this tile's rows and value zeros, the next tile's read now
            slot, tmask, gslot, gmask, zcur = vslot, vmask, vgslot, vgmask, zfield
            vslot, vmask = _tile_slots(t0 + BLOCK_N, end, BT, b, stride_btb, PAGE, PAGE_SLOTS, BLOCK_N)
            vgslot, vgmask = _kivi_group_slots(t0 + BLOCK_N, end, BT, b, stride_btb, HV, PAGE, PAGE_SLOTS, BLOCK_N,
                                               G_K)
            zfield = _kivi_value_field(V2, vslot, vmask, kvh, v2_s, v2_h, GRV, NGV, VSW)
        else:
            slot, tmask = _tile_slots(t0, end, BT, b, stride_btb, PAGE, PAGE_SLOTS, BLOCK_N)
        if PIPE:  # the next tile's keys
            if not PIDS_AHEAD:
                kslot, ktmask = _tile_slots(t0 + BLOCK_N, end, BT, b, stride_btb, PAGE, PAGE_SLOTS, BLOCK_N)
                kgslot, kgmask = _kivi_group_slots(t0 + BLOCK_N, end, BT, b, stride_btb, HV, PAGE, PAGE_SLOTS,
                                                   BLOCK_N, G_K)
            kc, ks, kz = _kivi_rows_key_loads(kslot, ktmask, kgslot, kgmask, K0, K1, K2, kvh, k0_s, k0_h, k1_s, k1_h,
                                              k2_s, k2_h, HV, D, BLOCK_N, G_K, BITS_K, KW)
        else:
            if not PIDS_AHEAD:
                gslot, gmask = _kivi_group_slots(t0, end, BT, b, stride_btb, HV, PAGE, PAGE_SLOTS, BLOCK_N, G_K)
            kc, ks, kz = _kivi_rows_key_loads(slot, tmask, gslot, gmask, K0, K1, K2, kvh, k0_s, k0_h, k1_s, k1_h,
                                              k2_s, k2_h, HV, D, BLOCK_N, G_K, BITS_K, KW)
        if KW:  # (strides in words, so the rows' alignment is known to the compiler: vector loads)
            if SPG:  # (the chunks' rows from the page ids, in the chunks' layout)
                slot3, tmask3 = _paged_slots(t0 + _chunked_tokens(NCH, CN, CSM if CSM else CN), t0, end, c0, c1, c2,
                                             c3, PAGE, PAGE_SLOTS)
                slot3 = slot3[:, :, None]
            elif CSM:
                slot3 = _token_chunks1(slot, NCH, CSM)[:, :, None]
                tmask3 = _token_chunks1(tmask, NCH, CSM)
            else:
                slot3 = tl.reshape(slot, (NCH, BLOCK_N // NCH))[:, :, None]  # (loaded in the product's chunks)
                tmask3 = tl.reshape(tmask, (NCH, BLOCK_N // NCH))
            vw = tl.load(V0.to(tl.pointer_type(WTV)) + slot3 * (v0_s // VWB) + kvh * (v0_h // VWB)
                         + iw[None, None, :], mask=tmask3[:, :, None], other=0)
        else:
            vb = tl.load(V0 + slot[:, None] * v0_s + kvh * v0_h + iv[None, :], mask=tmask[:, None], other=0)
        if ZAHEAD:
            srow = _kivi_value_field_rows(_kivi_value_field(V1, slot, tmask, kvh, v1_s, v1_h, GRV, NGV, VSW), tmask,
                                          HV, BLOCK_H, NGV, VSW)
            zrow = _kivi_value_field_rows(zcur, tmask, HV, BLOCK_H, NGV, VSW)
        else:
            srow, zrow = _kivi_value_rows(V1, V2, slot, tmask, kvh, v1_s, v1_h, v2_s, v2_h, HV, BLOCK_H, NGV, VSW)
        if PIPE:  # this tile's scores (computed one step earlier) and the next tile's, independent of each other
            s = s_next
            s_next = _kivi_rows_scores(kc, ks, kz, qk, sel, qk_scale, HV, D, BLOCK_N, BITS_K, PTX, KW, KCH, KSUB,
                                       RJOIN)
        else:
            s = _kivi_rows_scores(kc, ks, kz, qk, sel, qk_scale, HV, D, BLOCK_N, BITS_K, PTX, KW, KCH, KSUB,
                                  RJOIN)
        if CSM:  # a softmax state per chunk: [NCH, HV, BLOCK_N / NCH]
            s3 = tl.where(tmask3[:, None, :], _token_chunks(s, NCH, CSM), float("-inf"))
            p3, alpha3, m_c, l_c = _softmax_update(s3, m_c, l_c, 2)
            pr3 = tl.reshape(tl.broadcast_to(p3[:, None, :, :], (NCH, GRV, HV, CN)), (NCH, BLOCK_H, CN))
            ar3c = tl.reshape(tl.broadcast_to(alpha3[:, None, :], (NCH, GRV, HV)), (NCH, BLOCK_H))
            if VSUB:  # (p * 2**VALUE_SUB_SHIFT: the subnormal codes' products stay normal)
                pa3 = _split(pr3 * _token_chunks(srow, NCH, CSM) * VALUE_SUB_SCALE, True, True)[0]
            else:
                pa3 = _split(pr3 * _token_chunks(srow, NCH, CSM), True, True)[0]
            ar3 = ar3c[:, :, None]
            zacc_c = _row_sums_mma(pr3 * _token_chunks(zrow, NCH, CSM), zacc_c * ar3)
        else:
            p, alpha, m_i, l_i = _softmax_step(s, tmask, m_i, l_i)
            pr = tl.reshape(tl.broadcast_to(p[None, :, :], (GRV, HV, BLOCK_N)), (BLOCK_H, BLOCK_N))
            ar = tl.reshape(tl.broadcast_to(alpha[None, :], (GRV, HV)), (BLOCK_H,))
            if VSUB:  # (as above; p scaled before its broadcast over the groups)
                pv = p * VALUE_SUB_SCALE
                pa = _split(tl.reshape(tl.broadcast_to(pv[None, :, :], (GRV, HV, BLOCK_N)), (BLOCK_H, BLOCK_N)) * srow,
                            True, True)[0]
            else:
                pa = _split(pr * srow, True, True)[0]
            zacc = zacc * ar + tl.sum(pr * zrow, 1)
            if KW:  # the chunks as runs of BLOCK_N / NCH tokens
                pa3 = tl.permute(tl.reshape(pa, (BLOCK_H, NCH, BLOCK_N // NCH)), (1, 0, 2))
                ar3 = ar[None, :, None]
        if KW:  # per chunk of BLOCK_N / NCH tokens: [NCH, rows, BLOCK_N / NCH] x [NCH, BLOCK_N / NCH, D / 8] per code p
            v0, v1, v2, v3, v4, v5, v6, v7 = _int_word_phases(vw, BITS_V, False, PTX, VSUB)
            w0 = _dot_acc(pa3, v0, w0 * ar3)
            w1 = _dot_acc(pa3, v1, w1 * ar3)
            w2 = _dot_acc(pa3, v2, w2 * ar3)
            w3 = _dot_acc(pa3, v3, w3 * ar3)
            w4 = _dot_acc(pa3, v4, w4 * ar3)
            w5 = _dot_acc(pa3, v5, w5 * ar3)
            w6 = _dot_acc(pa3, v6, w6 * ar3)
            w7 = _dot_acc(pa3, v7, w7 * ar3)
        else:
            v0, v1, v2, v3 = _int_phases(vb, BITS_V, False, PTX)
            acc0 = _dot_acc(pa, v0, acc0 * ar[:, None])
            acc1 = _dot_acc(pa, v1, acc1 * ar[:, None])
            if PV == 4:
                acc2 = _dot_acc(pa, v2, acc2 * ar[:, None])
                acc3 = _dot_acc(pa, v3, acc3 * ar[:, None])
    if CSM:  # the chunks' states merged: each chunk's sums times 2**(m_c - m)
        m_i = tl.max(m_c, 0)
        f = tl.exp2(m_c - tl.where(m_i == float("-inf"), 0.0, m_i)[None, :])
        l_i = tl.sum(l_c * f, 0)
        fr = tl.reshape(tl.broadcast_to(f[:, None, :], (NCH, GRV, HV)), (NCH, BLOCK_H))
        fr3 = fr[:, :, None]
        zacc = tl.sum(tl.sum(tl.where(tl.arange(0, 16)[None, None, :] == 0, zacc_c * fr3, 0.0), 2), 0)
        w0, w1, w2, w3, w4, w5, w6, w7 = w0 * fr3, w1 * fr3, w2 * fr3, w3 * fr3, w4 * fr3, w5 * fr3, w6 * fr3, w7 * fr3
    if KW:  # chunks summed; code p of word c is channel 8c + p = element i * PV + P of accumulator P
        o0, o1, o2, o3 = tl.sum(w0, 0), tl.sum(w1, 0), tl.sum(w2, 0), tl.sum(w3, 0)
        o4, o5, o6, o7 = tl.sum(w4, 0), tl.sum(w5, 0), tl.sum(w6, 0), tl.sum(w7, 0)
        if VSUB:  # each code position's powers of two taken out (exact)
            o0, o1 = o0 * value_sub_unscale(BITS_V, 0), o1 * value_sub_unscale(BITS_V, 1)
            o2, o3 = o2 * value_sub_unscale(BITS_V, 2), o3 * value_sub_unscale(BITS_V, 3)
            o4, o5 = o4 * value_sub_unscale(BITS_V, 4), o5 * value_sub_unscale(BITS_V, 5)
            o6, o7 = o6 * value_sub_unscale(BITS_V, 6), o7 * value_sub_unscale(BITS_V, 7)
        if PV == 2:
            acc0 = _quarters_interleaved(o0, o2, o4, o6, BLOCK_H, DW)
            acc1 = _quarters_interleaved(o1, o3, o5, o7, BLOCK_H, DW)
        else:
            acc0 = tl.reshape(tl.join(o0, o4), (BLOCK_H, DV))
            acc1 = tl.reshape(tl.join(o1, o5), (BLOCK_H, DV))
            acc2 = tl.reshape(tl.join(o2, o6), (BLOCK_H, DV))
            acc3 = tl.reshape(tl.join(o3, o7), (BLOCK_H, DV))
    m_r = tl.reshape(tl.broadcast_to(m_i[None, :], (GRV, HV)), (BLOCK_H,))
    l_r = tl.reshape(tl.broadcast_to(l_i[None, :], (GRV, HV)), (BLOCK_H,))
    zs = tl.where(tl.arange(0, RN)[None, :] == 0, zacc[:, None], 0.0)
    return acc0, acc1, acc2, acc3, zs, m_r, l_r


@triton.jit
def _block_row_select(acc, NB: tl.constexpr, H: tl.constexpr, N: tl.constexpr, blk):
    """Block rows -> heads: column i of head h is row (blk[i], h) of ``acc`` [NB * H, N] (a selection, exact)."""
    sel = tl.arange(0, NB)[:, None, None] == blk[None, None, :]
    return tl.sum(tl.where(sel, tl.reshape(acc, (NB, H, N)), 0.0), 0)


@triton.jit
def _e2m1_values_bf16(byte, PTX: tl.constexpr):
    """The E2M1 values of the low and high nibbles of ``byte`` (uint8), exact, as bfloat16: on CUDA the PTX
    unpacking's E2M1 * 2**-126 times 2**126 (one packed bfloat16 multiply, exact); elsewhere from the float32
    decoding (float32 in the interpreter, which cannot bitcast to bfloat16)."""
    if PTX and not INTERPRET:
        lo, hi = _e2m1_pairs(byte, True)
        return lo * TWO_126, hi * TWO_126
    else:
        b = byte.to(tl.int32)
        return _e2m1_nibble(b & 15, True), _e2m1_nibble(b >> 4, True)



@triton.jit
def decode_split_kernel(
    Q,
    BT,
    SL,
    KL,
    VL,
    K0,
    K1,
    K2,
    V0,
    V1,
    V2,
    RK,
    RV,
    KS,
    VS,
    OP,
    LP,
    sm_scale,
    num_splits,
    tokens_per_split,
    stride_qb,
    stride_qh,
    stride_btb,
    k0_s,
    k0_h,
    k1_s,
    k1_h,
    k2_s,
    k2_h,
    v0_s,
    v0_h,
    v1_s,
    v1_h,
    v2_s,
    v2_h,
    r_b,
    r_t,
    r_h,
    op_b,
    op_h,
    op_s,
    lp_b,
    lp_h,
    VSQ,
    QPK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    PAGE_SLOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KIND_K: tl.constexpr,
    FMT_K: tl.constexpr,
    TSC_K: tl.constexpr,
    QB_K: tl.constexpr,
    G_K: tl.constexpr,
    BITS_K: tl.constexpr,
    KIND_V: tl.constexpr,
    FMT_V: tl.constexpr,
    TSC_V: tl.constexpr,
    QB_V: tl.constexpr,
    G_V: tl.constexpr,
    BITS_V: tl.constexpr,
    HAS_RES: tl.constexpr,
    Q_SPLIT: tl.constexpr,
    KT: tl.constexpr = True,
    FAST: tl.constexpr = False,
    PTX: tl.constexpr = False,
    WSC_K: tl.constexpr = False,
    WSC_V: tl.constexpr = False,
    HV: tl.constexpr = 0,
    KT4: tl.constexpr = False,
    KTILE: tl.constexpr = False,
    HF: tl.constexpr = False,
    BLK: tl.constexpr = False,
    VW: tl.constexpr = False,
    KR: tl.constexpr = False,
    KW: tl.constexpr = False,
    KCH: tl.constexpr = 1,
    NCH: tl.constexpr = 1,
    CSM: tl.constexpr = 0,
    RJOIN: tl.constexpr = False,
    VSUB: tl.constexpr = False,
    SPG: tl.constexpr = False,
    VSW: tl.constexpr = False,
    KPIPE: tl.constexpr = False,
    KSUB: tl.constexpr = False,
    HALF_K: tl.constexpr = False,
    HALF_V: tl.constexpr = False,
    E8M0_CHECK: tl.constexpr = False,
    EV16: tl.constexpr = False,
    KPT: tl.constexpr = False,
    E8F_K: tl.constexpr = False,
    E8F_V: tl.constexpr = False,
    QLD: tl.constexpr = 0,
    BLOCK_R: tl.constexpr = 0,
    PART: tl.constexpr = 0,
    VW8: tl.constexpr = 0,
    DIRECT: tl.constexpr = False,
    ROT_V: tl.constexpr = False,
    T2D: tl.constexpr = False,
    GDC: tl.constexpr = False,
    PIDS_AHEAD: tl.constexpr = False,
):
    """One (sequence, KV head, split): K tiles are read transposed [D/PACK, N] per phase (the elements
    sharing a byte position), V tiles [N, D/PACK]; no register transposes or interleaves. ``VW8`` (FP8 values
    without token scales, ``fp8_value_words``): V read as 16-bit words of two channels [N, D/2], the even and
    the odd channels two products (acc0, acc1: PV = 2), 1 portable, 2 by inline PTX (:func:`_fp8_word_halves`).
    ``DIRECT`` (one split, nothing to merge: ``direct_output``): ``OP`` / ``LP`` are the outputs [B, Hq, D] and
    [B, Hq], and the LSE is stored in natural log (:func:`_lse_natural`), as the merge of one split would; with
    ``ROT_V`` (V stored rotated) the output is un-rotated here as the merge kernel does it (``butterflies(out) * VSQ``,
    ``VSQ`` float32 [D]), on the same float32 values (the merge weighs one split by exactly 1), read back from
    ``OP`` after a barrier. ``GDC`` (the merge launch depends on this one programmatically, ``pdl``): each program
    lets the merge launch start at once (``griddepcontrol.launch_dependents``, a scheduling hint; the merge's
    ``griddepcontrol.wait`` still waits for every program of this launch and its stores). ``PIDS_AHEAD``
    (``page_ids_ahead``): the per-tile, block-rows and KIVI key-rows loops read each next tile's page ids one step
    ahead (a loop-carried value), so that the software pipeliner multi-buffers the tiles' loads instead of giving the
    page-table load a stage."""
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    PK: tl.constexpr = 1 if KIND_K <= 1 else (2 if KIND_K <= 3 else 8 // BITS_K)
    PV: tl.constexpr = 2 if VW8 > 0 else (1 if KIND_V <= 1 else (2 if KIND_V <= 3 else 8 // BITS_V))
    DK: tl.constexpr = D // PK
    DV: tl.constexpr = D // PV
    # operand parts (docs/kernels.md, "Precision"): exact mode splits what is not exact in 16 bits into
    # parts whose sum is the float32 value; fast mode rounds q and p once to 16 bits and splits the tiles
    # that are not exact in 16 bits (KIVI, the residual) in two bfloat16 parts
    QP: tl.constexpr = 3 if Q_SPLIT and not FAST else 1  # a bfloat16 q is exact in one part
    PP: tl.constexpr = 1 if FAST else 3
    PP16: tl.constexpr = 1 if FAST else 2
    RBS: tl.constexpr = 2 if FAST else 3
    b = tl.program_id(1 if HF else 0).to(tl.int64)
    kvh = tl.program_id(0 if HF else 1)
    split = tl.program_id(2) + (num_splits if PART == 2 else 0)
    hh = tl.arange(0, BLOCK_H)
    hmask = hh < QPK
    if HV > 0:  # fast KIVI values: row r is query head r % HV for value channel group r // HV (rows replicate q)
        hmask = (hh % HV < QPK) & (hh < (D // G_V) * HV)
        hh = hh % HV
    qh = kvh * QPK + hh
    qbase = b * stride_qb + qh[:, None].to(tl.int64) * stride_qh
    q0h, q0m, q0l = _load_q(Q, qbase, hmask, 0, PK, DK, FAST)
    q1h, q1m, q1l = _load_q(Q, qbase, hmask, 1 % PK, PK, DK, FAST)
    q2h, q2m, q2l = _load_q(Q, qbase, hmask, 2 % PK, PK, DK, FAST)
    q3h, q3m, q3l = _load_q(Q, qbase, hmask, 3 % PK, PK, DK, FAST)
    if KIND_K == 5 and FAST:  # KIVI keys, fast: q rounded once to bfloat16, so q * s is exact in float32
        qf0, qf1, qf2, qf3 = q0h, q1h, q2h, q3h
    elif KIND_K == 5:
        qf0 = _load_qf(Q, qbase, hmask, 0, PK, DK)
        qf1 = _load_qf(Q, qbase, hmask, 1 % PK, PK, DK)
        qf2 = _load_qf(Q, qbase, hmask, 2 % PK, PK, DK)
        qf3 = _load_qf(Q, qbase, hmask, 3 % PK, PK, DK)
    qk_scale = sm_scale * tl.load(KS + kvh) * 1.4426950408889634
    # FP8 tiles are exact in float16: q goes to float16 tensor cores, scaled by a power of two into range;
    # in fast mode NVFP4 tiles are built in float16 too (``_nvfp4_tile16``), and so are the probabilities.
    # (E8M0 tiles in float16, relative to the largest block scale of the token or tile, measured slower on
    # the H100 than the bfloat16 tiles: bench/results/ANALYSIS.md)
    F4K: tl.constexpr = FAST and KIND_K == 3
    MXB_K: tl.constexpr = FAST and KIND_K == 2 and PTX and not INTERPRET
    MXB_V: tl.constexpr = FAST and KIND_V == 2 and PTX and not INTERPRET
    F4V: tl.constexpr = FAST and KIND_V == 3
    F16K: tl.constexpr = KIND_K == 1
    F16V: tl.constexpr = (KIND_V == 1 and not TSC_V) or F4V
    QP16: tl.constexpr = 2 if Q_SPLIT and not FAST else 1
    if F16K or F4K:
        qf = tl.load(Q + qbase + tl.arange(0, D)[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
        qmax = tl.max(tl.max(tl.abs(qf), 1), 0)
        eq = _f16_exponent(qmax)
        sc_k = qk_scale * pow2_f32(-eq)
        if F16K:
            q16h, q16l = _split16(qf * pow2_f32(eq), FAST)
        else:
            q4a, _ = _split16(_load_qf(Q, qbase, hmask, 0, 2, DK) * pow2_f32(eq), True)
            q4b, _ = _split16(_load_qf(Q, qbase, hmask, 1, 2, DK) * pow2_f32(eq), True)
            sc_k = sc_k * 16384.0  # NVFP4 tiles hold E2M1 * scale * 2**-14
    else:
        sc_k = qk_scale
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc0 = tl.zeros((BLOCK_H, DV), tl.float32)
    acc1 = tl.zeros((BLOCK_H, DV), tl.float32)
    acc2 = tl.zeros((BLOCK_H, DV), tl.float32)
    acc3 = tl.zeros((BLOCK_H, DV), tl.float32)
    RN: tl.constexpr = BLOCK_R if BLOCK_R > 0 else BLOCK_N  # residual tiles
    if HV > 0:
        zacc = tl.zeros((BLOCK_H, RN), tl.float32)  # KIVI values' zero term p * z per (row, token)
    ik = tl.arange(0, DK)
    iv = tl.arange(0, DV)
    K_T: tl.constexpr = KT and PK == 1 and KIND_K <= 1
    QPT: tl.constexpr = QP16 if F16K else QP
    if KT4 and F4K:
        q4aT = tl.trans(q4a)
        q4bT = tl.trans(q4b)
    elif KT4:
        q0Th, q0Tm, q0Tl = tl.trans(q0h), tl.trans(q0m), tl.trans(q0l)
        q1Th, q1Tm, q1Tl = tl.trans(q1h), tl.trans(q1m), tl.trans(q1l)
    if K_T:
        if F16K:
            qTh = tl.trans(q16h)
            qTm = tl.trans(q16l)
            qTl = qTm
        else:
            qTh = tl.trans(q0h)
            qTm = tl.trans(q0m)
            qTl = tl.trans(q0l)
    if PART != 2 and split < num_splits:
        if HAS_RES:
            paged_len = tl.minimum(tl.load(KL + b), tl.load(VL + b))
        else:
            paged_len = tl.load(SL + b)
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, paged_len)
        if KR:  # fast KIVI by token-group key rows and channel-group value rows (``_kivi_key_rows``)
            acc0, acc1, acc2, acc3, zacc, m_i, l_i = _kivi_key_rows(
                Q, BT, K0, K1, K2, V0, V1, V2, b, kvh, start, end, stride_qb, stride_qh, stride_btb, k0_s, k0_h,
                k1_s, k1_h, k2_s, k2_h, v0_s, v0_h, v1_s, v1_h, v2_s, v2_h, qk_scale, QPK, HV, BLOCK_H, D, PAGE,
                PAGE_SLOTS, BLOCK_N, G_K, BITS_K, G_V, BITS_V, RN, PTX, KW, KCH, KPIPE, KSUB, PIDS_AHEAD, NCH,
                VSW, CSM, RJOIN, VSUB, SPG)
        elif BLK:  # fast FP4 by block rows (``_fp4_block_rows``)
            acc0, acc1, m_i, l_i = _fp4_block_rows(
                Q, BT, K0, K1, V0, V1, b, kvh, start, end, stride_qb, stride_qh, stride_btb, k0_s, k0_h, k1_s, k1_h,
                v0_s, v0_h, v1_s, v1_h, qk_scale, QPK, BLOCK_H, D, PAGE, PAGE_SLOTS, BLOCK_N, KIND_K, QB_K, FMT_K,
                KIND_V, QB_V, FMT_V, PTX, WSC_K, WSC_V, VW, HALF_K, HALF_V, E8M0_CHECK, PIDS_AHEAD, EV16, KPT, E8F_K,
                E8F_V, QLD)
        else:
            if PIDS_AHEAD:  # the first tile's cache rows before the loop, each next tile's one step ahead
                nslot, nmask = _tile_slots(start, end, BT, b, stride_btb, PAGE, PAGE_SLOTS, BLOCK_N)
            for t0 in range(start, end, BLOCK_N):
                if PIDS_AHEAD:
                    slot, tmask = nslot, nmask
                    nslot, nmask = _tile_slots(t0 + BLOCK_N, end, BT, b, stride_btb, PAGE, PAGE_SLOTS, BLOCK_N)
                else:
                    slot, tmask = _tile_slots(t0, end, BT, b, stride_btb, PAGE, PAGE_SLOTS, BLOCK_N)
                # K: [DK, N] per phase
                sk = slot[None, :]
                mk = tmask[None, :]
                if KIND_K == 5:
                    # KIVI keys: the tile lies inside one token group (BLOCK_N divides G, G divides PAGE), the group
                    # of its first token t0 (always in range)
                    grp = page_slot(tl.load(BT + b * stride_btb + t0 // PAGE).to(tl.int64), t0, PAGE, PAGE_SLOTS) // G_K
                    kb = tl.load(K0 + slot[None, :] * k0_s + kvh * k0_h + ik[:, None], mask=tmask[None, :], other=0)
                    s = tl.zeros((BLOCK_H, BLOCK_N), tl.float32)
                    s, qz = _kivi_key_phase(qf0, kb, K1, K2, grp, kvh, k1_s, k1_h, k2_s, k2_h, ik, s, 0, PK, BITS_K,
                                            FAST, KTILE)
                    s, qz_1 = _kivi_key_phase(qf1, kb, K1, K2, grp, kvh, k1_s, k1_h, k2_s, k2_h, ik, s, 1, PK, BITS_K,
                                              FAST, KTILE)
                    if PK == 4:
                        s, qz_2 = _kivi_key_phase(qf2, kb, K1, K2, grp, kvh, k1_s, k1_h, k2_s, k2_h, ik, s, 2, PK,
                                                  BITS_K, FAST, KTILE)
                        s, qz_3 = _kivi_key_phase(qf3, kb, K1, K2, grp, kvh, k1_s, k1_h, k2_s, k2_h, ik, s, 3, PK,
                                                  BITS_K, FAST, KTILE)
                    if not KTILE:  # q . z: the phases' products summed, then one reduction
                        qz += qz_1
                        if PK == 4:
                            qz += qz_2 + qz_3
                        s += tl.sum(qz, 1)[:, None]
                elif F4K:
                    # fast NVFP4 keys: float16 tiles (``_nvfp4_tile16``), q in float16
                    NBK4: tl.constexpr = D // QB_K
                    bk4 = tl.arange(0, NBK4)
                    jk4 = tl.arange(0, QB_K // 2)
                    koff4 = (bk4[:, None] * (QB_K // 2) + jk4[None, :])[:, :, None]
                    if KT4:  # tokens as rows (the left operand), as the value tiles: scores come out transposed
                        kbt = tl.load(K0 + slot[:, None] * k0_s + kvh * k0_h + ik[None, :], mask=tmask[:, None],
                                      other=0)
                        ksct = _block_scales(K1, slot, kvh, k1_s, k1_h, tmask, NBK4, WSC_K, False)
                        kbt = tl.reshape(kbt, (BLOCK_N, NBK4, QB_K // 2))
                        k4lo, k4hi = _nvfp4_tile16(kbt, ksct[:, :, None], FMT_K, PTX)
                        s = tl.trans(_mm_t(tl.reshape(k4lo, (BLOCK_N, DK)), q4aT, q4aT, q4aT, 1, True)
                                     + _mm_t(tl.reshape(k4hi, (BLOCK_N, DK)), q4bT, q4bT, q4bT, 1, True))
                    elif T2D:  # two-axis tiles [bytes, N] (``fp4_tiles_2d``)
                        kb2, kc2 = _fp4_bytes_codes(K0, K1, slot, tmask, kvh, k0_s, k0_h, k1_s, k1_h, NBK4, DK, True)
                        k4lo, k4hi, kf2 = _nvfp4_tile16_parts(kb2, kc2, FMT_K, PTX)  # each half scaled right
                        # before its product
                        s = _mm16(q4a, q4a, k4lo * kf2, 1)
                        s += _mm16(q4b, q4b, k4hi * kf2, 1)
                    else:
                        kb4 = tl.load(K0 + slot[None, None, :] * k0_s + kvh * k0_h + koff4, mask=tmask[None, None, :],
                                      other=0)
                        ksc4 = _block_scales(K1, slot, kvh, k1_s, k1_h, tmask, NBK4, WSC_K, True)
                        k4lo, k4hi = _nvfp4_tile16(kb4, ksc4[:, None, :], FMT_K, PTX)
                        s = _mm16(q4a, q4a, tl.reshape(k4lo, (DK, BLOCK_N)), 1)
                        s += _mm16(q4b, q4b, tl.reshape(k4hi, (DK, BLOCK_N)), 1)
                elif KIND_K == 2 or KIND_K == 3:
                    NBK: tl.constexpr = D // QB_K
                    if T2D and not KT4:  # two-axis tiles [bytes, N] (``fp4_tiles_2d``): no reshape before the
                        # product, so the 16-bit tile reaches shared memory in wide stores (sm_90, fp4_e2m1 at 8 query
                        # heads per KV head: 274 -> 172 shared-memory instructions per tile)
                        kb2, kc2 = _fp4_bytes_codes(K0, K1, slot, tmask, kvh, k0_s, k0_h, k1_s, k1_h, NBK, DK, True)
                        k_lo, k_hi = _fp4_tile_elements(kb2, kc2, KIND_K, MXB_K, FAST, PTX)
                    else:  # FP4 blocks: bytes as [blocks, QB/2, N], one scale per (block, token) broadcast
                        if KT4:  # tokens as rows: bytes as [N, blocks, QB/2], scores come out transposed
                            kb3 = tl.load(K0 + slot[:, None] * k0_s + kvh * k0_h + ik[None, :], mask=tmask[:, None],
                                          other=0)
                            kb3 = tl.reshape(kb3, (BLOCK_N, NBK, QB_K // 2))
                            ksc = _block_scales(K1, slot, kvh, k1_s, k1_h, tmask, NBK, WSC_K, False)[:, :, None]
                            KSH: tl.constexpr = (BLOCK_N, DK)
                        else:
                            bk = tl.arange(0, NBK)
                            jk = tl.arange(0, QB_K // 2)
                            koff = (bk[:, None] * (QB_K // 2) + jk[None, :])[:, :, None]
                            kb3 = tl.load(K0 + slot[None, None, :] * k0_s + kvh * k0_h + koff,
                                          mask=tmask[None, None, :], other=0)
                            ksc = _block_scales(K1, slot, kvh, k1_s, k1_h, tmask, NBK, WSC_K, True)[:, None, :]
                            KSH: tl.constexpr = (DK, BLOCK_N)
                        k_lo, k_hi = _fp4_tile_elements(kb3, ksc, KIND_K, MXB_K, FAST, PTX)
                        k_lo = tl.reshape(k_lo, KSH)
                        k_hi = tl.reshape(k_hi, KSH)
                    if KT4:
                        s = tl.trans(_mm_t(k_lo, q0Th, q0Tm, q0Tl, QP, False)
                                     + _mm_t(k_hi, q1Th, q1Tm, q1Tl, QP, False))
                    else:
                        s = _mm(q0h, q0m, q0l, k_lo, QP, 0) + _mm(q1h, q1m, q1l, k_hi, QP, 0)
                elif K_T:
                    # K as the left operand [N, D], loaded in its memory order (lets the compiler keep the
                    # dequantized tile in registers in the dot-operand layout); scores come out transposed
                    kn = tl.load(K0 + slot[:, None] * k0_s + kvh * k0_h + ik[None, :], mask=tmask[:, None], other=0)
                    kt = _phase(kn, slot[:, None], ik[None, :], tmask[:, None], kvh, K1, K2, k1_s, k1_h, k2_s, k2_h, 0,
                                KIND_K, FMT_K, QB_K, G_K, BITS_K)
                    s = tl.trans(_mm_t(kt, qTh, qTm, qTl, QPT, F16K))
                else:
                    # one byte per element (bf16/FP8 with KT=False): packed kinds have their own branches above
                    tl.static_assert(PK == 1)
                    kb = tl.load(K0 + sk * k0_s + kvh * k0_h + ik[:, None], mask=mk, other=0)
                    k0t = _phase(kb, sk, ik[:, None] * PK, mk, kvh, K1, K2, k1_s, k1_h, k2_s, k2_h, 0, KIND_K, FMT_K,
                                 QB_K, G_K, BITS_K)
                    if F16K:
                        s = _mm16(q16h, q16l, k0t, QP16)
                    else:
                        s = _mm(q0h, q0m, q0l, k0t, QP, 0)
                if KIND_K == 1 and TSC_K:
                    s = s * (tl.load(K1 + slot * k1_s + kvh * k1_h, mask=tmask, other=0.0) * sc_k)[None, :]
                else:
                    s = s * sc_k
                p, alpha, m_i, l_i = _softmax_step(s, tmask, m_i, l_i)
                if KIND_V == 1 and TSC_V:
                    p = p * tl.load(V1 + slot * v1_s + kvh * v1_h, mask=tmask, other=0.0)[None, :]
                if F16V:
                    p16h, p16l = _split16(p * 16384.0, FAST)  # p <= 1: scaled into float16's normal range
                else:
                    ph, pm, pl = _split(p, True, FAST)
                if KIND_V == 4 and HV > 0:
                    # fast KIVI values, rows by group (row r: query head r % HV, channel group r // HV): the group's
                    # scale folded into p (p * s rounded once to bfloat16) against the exact integer codes, the zero
                    # term p * z summed in float32 per (row, token) and reduced once after the loop
                    vbq = tl.load(V0 + slot[:, None] * v0_s + kvh * v0_h + iv[None, :], mask=tmask[:, None], other=0)
                    srow, zrow = _kivi_value_rows(V1, V2, slot, tmask, kvh, v1_s, v1_h, v2_s, v2_h, HV, BLOCK_H,
                                                  D // G_V, VSW)
                    pa, _, _ = _split(p * srow, True, True)
                    zacc = zacc * alpha[:, None] + p * zrow
                    v0, v1, v2, v3 = _int_phases(vbq, BITS_V, False, False)
                    acc0 = _dot_acc(pa, v0, acc0 * alpha[:, None])
                    acc1 = _dot_acc(pa, v1, acc1 * alpha[:, None])
                    if PV == 4:
                        acc2 = _dot_acc(pa, v2, acc2 * alpha[:, None])
                        acc3 = _dot_acc(pa, v3, acc3 * alpha[:, None])
                elif KIND_V == 4:
                    # KIVI values: bytes as [N, groups, G/PACK], one scale and zero per (token, group)
                    NGV: tl.constexpr = D // G_V
                    gv = tl.arange(0, NGV)
                    jg = tl.arange(0, G_V // PV)
                    goff = (gv[:, None] * (G_V // PV) + jg[None, :])[None, :, :]
                    vb3 = tl.load(V0 + slot[:, None, None] * v0_s + kvh * v0_h + goff, mask=tmask[:, None, None],
                                  other=0)
                    vb3 = vb3.to(tl.int32)
                    vsc = tl.load(V1 + slot[:, None] * v1_s + kvh * v1_h + gv[None, :], mask=tmask[:, None], other=0.0)
                    vz = tl.load(V2 + slot[:, None] * v2_s + kvh * v2_h + gv[None, :], mask=tmask[:, None], other=0.0)
                    vs3 = vsc.to(tl.float32)[:, :, None]
                    vz3 = vz.to(tl.float32)[:, :, None]
                    MASKV: tl.constexpr = (1 << BITS_V) - 1
                    v_0 = tl.reshape((vb3 & MASKV).to(tl.float32) * vs3 + vz3, (BLOCK_N, DV))
                    acc0 = acc0 * alpha[:, None] + _mm(ph, pm, pl, v_0, PP, RBS)
                    v_1 = tl.reshape(((vb3 >> BITS_V) & MASKV).to(tl.float32) * vs3 + vz3, (BLOCK_N, DV))
                    acc1 = acc1 * alpha[:, None] + _mm(ph, pm, pl, v_1, PP, RBS)
                    if PV == 4:
                        v_2 = tl.reshape(((vb3 >> 4) & MASKV).to(tl.float32) * vs3 + vz3, (BLOCK_N, DV))
                        acc2 = acc2 * alpha[:, None] + _mm(ph, pm, pl, v_2, PP, RBS)
                        v_3 = tl.reshape(((vb3 >> 6) & MASKV).to(tl.float32) * vs3 + vz3, (BLOCK_N, DV))
                        acc3 = acc3 * alpha[:, None] + _mm(ph, pm, pl, v_3, PP, RBS)
                elif F4V:
                    # fast NVFP4 values: float16 tiles, p * 2**14 in float16: the factors 2**14 cancel
                    NBV4: tl.constexpr = D // QB_V
                    bv4 = tl.arange(0, NBV4)
                    jv4 = tl.arange(0, QB_V // 2)
                    voff4 = (bv4[:, None] * (QB_V // 2) + jv4[None, :])[None, :, :]
                    if T2D:  # two-axis tiles [N, bytes] (``fp4_tiles_2d``)
                        vb2, vc2 = _fp4_bytes_codes(V0, V1, slot, tmask, kvh, v0_s, v0_h, v1_s, v1_h, NBV4, DV, False)
                        v4lo, v4hi, vf2 = _nvfp4_tile16_parts(vb2, vc2, FMT_V, PTX)  # each half scaled right
                        # before its product
                        acc0 = acc0 * alpha[:, None] + _mm16(p16h, p16l, v4lo * vf2, 1)
                        acc1 = acc1 * alpha[:, None] + _mm16(p16h, p16l, v4hi * vf2, 1)
                    else:
                        vb4 = tl.load(V0 + slot[:, None, None] * v0_s + kvh * v0_h + voff4, mask=tmask[:, None, None],
                                      other=0)
                        vsc4 = _block_scales(V1, slot, kvh, v1_s, v1_h, tmask, NBV4, WSC_V, False)
                        v4lo, v4hi = _nvfp4_tile16(vb4, vsc4[:, :, None], FMT_V, PTX)
                        # each half reshaped right before its product: both reshaped first keep both halves' shared-
                        # memory conversions live (sm_90, NVFP4 at 8 query heads per KV head: 42 -> 58 KB per program;
                        # H200, 64 q / 8 KV heads x 16,384: 945 -> 1,115 us; bench/results/ANALYSIS.md, session 30)
                        acc0 = acc0 * alpha[:, None] + _mm16(p16h, p16l, tl.reshape(v4lo, (BLOCK_N, DV)), 1)
                        acc1 = acc1 * alpha[:, None] + _mm16(p16h, p16l, tl.reshape(v4hi, (BLOCK_N, DV)), 1)
                elif KIND_V == 2 or KIND_V == 3:
                    NBV: tl.constexpr = D // QB_V
                    if T2D:  # two-axis tiles [N, bytes] (``fp4_tiles_2d``), as the keys
                        vb2, vc2 = _fp4_bytes_codes(V0, V1, slot, tmask, kvh, v0_s, v0_h, v1_s, v1_h, NBV, DV, False)
                        v_lo, v_hi = _fp4_tile_elements(vb2, vc2, KIND_V, MXB_V, FAST, PTX)
                    else:  # bytes as [N, blocks, QB/2], one scale per (token, block) broadcast
                        bv = tl.arange(0, NBV)
                        jv = tl.arange(0, QB_V // 2)
                        voff = (bv[:, None] * (QB_V // 2) + jv[None, :])[None, :, :]
                        vb3 = tl.load(V0 + slot[:, None, None] * v0_s + kvh * v0_h + voff, mask=tmask[:, None, None],
                                      other=0)
                        vsc = _block_scales(V1, slot, kvh, v1_s, v1_h, tmask, NBV, WSC_V, False)
                        v_lo, v_hi = _fp4_tile_elements(vb3, vsc[:, :, None], KIND_V, MXB_V, FAST, PTX)
                        v_lo = tl.reshape(v_lo, (BLOCK_N, DV))
                        v_hi = tl.reshape(v_hi, (BLOCK_N, DV))
                    acc0 = acc0 * alpha[:, None] + _mm(ph, pm, pl, v_lo, PP, 0)
                    acc1 = acc1 * alpha[:, None] + _mm(ph, pm, pl, v_hi, PP, 0)
                elif VW8 > 0:
                    # FP8 values as 16-bit words [N, D/2] (two channels each: transposed 16-bit matrix loads feed
                    # the products, not one-byte shared loads); even channels into acc0, odd into acc1
                    tl.static_assert(F16V and not HAS_RES)
                    vw = tl.load(V0.to(tl.pointer_type(tl.int16)) + slot[:, None] * (v0_s // 2) + kvh * (v0_h // 2)
                                 + iv[None, :], mask=tmask[:, None], other=0)
                    v_even, v_odd = _fp8_word_halves(vw, FMT_V, VW8 == 2)
                    acc0 = acc0 * alpha[:, None] + _mm16(p16h, p16l, v_even, PP16)
                    acc1 = acc1 * alpha[:, None] + _mm16(p16h, p16l, v_odd, PP16)
                else:
                    # V: [N, D], one byte per element (bf16/FP8): packed kinds have their own branches above
                    tl.static_assert(PV == 1)
                    sv = slot[:, None]
                    mv = tmask[:, None]
                    vb = tl.load(V0 + sv * v0_s + kvh * v0_h + iv[None, :], mask=mv, other=0)
                    v0t = _phase(vb, sv, iv[None, :] * PV, mv, kvh, V1, V2, v1_s, v1_h, v2_s, v2_h, 0, KIND_V,
                                 FMT_V, QB_V, G_V, BITS_V)
                    if F16V:
                        acc0 = acc0 * alpha[:, None] + _mm16(p16h, p16l, v0t, PP16)
                    else:
                        acc0 = acc0 * alpha[:, None] + _mm(ph, pm, pl, v0t, PP, 0)
    if HAS_RES and PART != 1 and split >= num_splits:
        # the tail [min(k_len, v_len), seq_len): KIVI keeps the newest keys and values in full precision
        # (float32 residuals [batch, W, kv_heads, D]); K and V switch to their residual at their own length
        kl = tl.load(KL + b)
        vl = tl.load(VL + b)
        seq_len = tl.load(SL + b)
        for t0 in range(tl.minimum(kl, vl), seq_len, RN):
            t = t0 + tl.arange(0, RN)
            tmask = t < seq_len
            page = tl.load(BT + b * stride_btb + t // PAGE, mask=tmask & (t < tl.maximum(kl, vl)), other=0)
            slot = page_slot(page.to(tl.int64), t, PAGE, PAGE_SLOTS)
            sk = slot[None, :]
            mk = tmask[None, :]
            pk = mk & (t < kl)[None, :]
            rko = b * r_b + (t - kl)[None, :].to(tl.int64) * r_t + kvh * r_h
            kb = tl.load(K0 + sk * k0_s + kvh * k0_h + ik[:, None], mask=pk, other=0)
            ek = ik[:, None] * PK
            s = _res_mm(q0h, q0m, q0l, QP, kb, sk, ek, mk, pk, kvh, K1, K2, k1_s, k1_h, k2_s, k2_h, RK, rko,
                        0, KIND_K, FMT_K, QB_K, G_K, BITS_K, RBS)
            if PK >= 2:
                s += _res_mm(q1h, q1m, q1l, QP, kb, sk, ek, mk, pk, kvh, K1, K2, k1_s, k1_h, k2_s, k2_h, RK, rko,
                             1, KIND_K, FMT_K, QB_K, G_K, BITS_K, RBS)
            if PK == 4:
                s += _res_mm(q2h, q2m, q2l, QP, kb, sk, ek, mk, pk, kvh, K1, K2, k1_s, k1_h, k2_s, k2_h, RK, rko,
                             2, KIND_K, FMT_K, QB_K, G_K, BITS_K, RBS)
                s += _res_mm(q3h, q3m, q3l, QP, kb, sk, ek, mk, pk, kvh, K1, K2, k1_s, k1_h, k2_s, k2_h, RK, rko,
                             3, KIND_K, FMT_K, QB_K, G_K, BITS_K, RBS)
            p, alpha, m_i, l_i = _softmax_step(s * qk_scale, tmask, m_i, l_i)
            ph, pm, pl = _split(p, True, FAST)
            sv = slot[:, None]
            mv = tmask[:, None]
            pv = mv & (t < vl)[:, None]
            rvo = b * r_b + (t - vl)[:, None].to(tl.int64) * r_t + kvh * r_h
            vb = tl.load(V0 + sv * v0_s + kvh * v0_h + iv[None, :], mask=pv, other=0)
            ev = iv[None, :] * PV
            if KIND_V == 4 and HV > 0:
                # rows by group, as in the paged loop: paged tokens p * s against exact codes (+ the zero term),
                # residual tokens p (rounded once) against the residual split in two bfloat16 parts
                pvt = tmask & (t < vl)
                srow, zrow = _kivi_value_rows(V1, V2, slot, pvt, kvh, v1_s, v1_h, v2_s, v2_h, HV, BLOCK_H, D // G_V,
                                              VSW)
                pa, _, _ = _split(p * tl.where(pvt[None, :], srow, 1.0), True, True)
                zacc = zacc * alpha[:, None] + p * zrow
                ph, pm, pl = pa, pa, pa
            acc0 = acc0 * alpha[:, None] + _res_mm(ph, pm, pl, PP, vb, sv, ev, mv, pv, kvh, V1, V2, v1_s, v1_h, v2_s,
                                                   v2_h, RV, rvo, 0, KIND_V, FMT_V, QB_V, G_V, BITS_V, RBS, HV > 0)
            if PV >= 2:
                acc1 = acc1 * alpha[:, None] + _res_mm(ph, pm, pl, PP, vb, sv, ev, mv, pv, kvh, V1, V2, v1_s, v1_h,
                                                       v2_s, v2_h, RV, rvo, 1, KIND_V, FMT_V, QB_V, G_V, BITS_V, RBS,
                                                       HV > 0)
            if PV == 4:
                acc2 = acc2 * alpha[:, None] + _res_mm(ph, pm, pl, PP, vb, sv, ev, mv, pv, kvh, V1, V2, v1_s, v1_h,
                                                       v2_s, v2_h, RV, rvo, 2, KIND_V, FMT_V, QB_V, G_V, BITS_V, RBS,
                                                       HV > 0)
                acc3 = acc3 * alpha[:, None] + _res_mm(ph, pm, pl, PP, vb, sv, ev, mv, pv, kvh, V1, V2, v1_s, v1_h,
                                                       v2_s, v2_h, RV, rvo, 3, KIND_V, FMT_V, QB_V, G_V, BITS_V, RBS,
                                                       HV > 0)
    if HV > 0:  # rows by group -> rows by head, the zero term added (``_value_rows_to_heads``)
        zs = tl.sum(zacc, 1)
        acc0 = _value_rows_to_heads(acc0, zs, 0, PV, G_V, HV, BLOCK_H, DV)
        acc1 = _value_rows_to_heads(acc1, zs, 1 % PV, PV, G_V, HV, BLOCK_H, DV)
        acc2 = _value_rows_to_heads(acc2, zs, 2 % PV, PV, G_V, HV, BLOCK_H, DV)
        acc3 = _value_rows_to_heads(acc3, zs, 3 % PV, PV, G_V, HV, BLOCK_H, DV)
        m_i = _row_group0(m_i, HV, BLOCK_H)
        l_i = _row_group0(l_i, HV, BLOCK_H)
        qh = kvh * QPK + tl.arange(0, HV)
        hmask = tl.arange(0, HV) < QPK
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    if KIND_V == 1 and F16V:
        acc0 = acc0 * (1.0 / 16384.0)
        if VW8 > 0:
            acc1 = acc1 * (1.0 / 16384.0)
    vs = tl.load(VS + kvh)
    lse2 = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
    base = b * op_b + qh[:, None].to(tl.int64) * op_h + split * op_s
    tl.store(OP + base + (iv * PV)[None, :], acc0 / safe_l[:, None] * vs, mask=hmask[:, None])
    if PV >= 2:
        tl.store(OP + base + (iv * PV + 1)[None, :], acc1 / safe_l[:, None] * vs, mask=hmask[:, None])
    if PV == 4:
        tl.store(OP + base + (iv * PV + 2)[None, :], acc2 / safe_l[:, None] * vs, mask=hmask[:, None])
        tl.store(OP + base + (iv * PV + 3)[None, :], acc3 / safe_l[:, None] * vs, mask=hmask[:, None])
    if DIRECT and ROT_V:  # the program's output rows read back whole (the program's own stores, after a barrier: as
        # the merge reads them, so that no multiply above is contracted into the butterflies) and un-rotated
        tl.debug_barrier()
        dd = tl.arange(0, D)
        RO: tl.constexpr = HV if HV > 0 else BLOCK_H
        o = tl.load(OP + base + dd[None, :], mask=hmask[:, None], other=0.0)
        tl.store(OP + base + dd[None, :], hadamard_rows(o, RO, D) * tl.load(VSQ + dd)[None, :], mask=hmask[:, None])
    if DIRECT:
        lse2 = _lse_natural(lse2)
    tl.store(LP + b * lp_b + qh.to(tl.int64) * lp_h + split, lse2, mask=hmask)


@triton.jit
def rotate_q_kernel(Q, SIGNS, QR, q_heads, stride_qb, stride_qh, D: tl.constexpr, ROWS: tl.constexpr):
    """Rotated queries of a rotated K (docs/rotation.md): ``QR[b, h] = butterflies(q[b, h] * signs)`` in float32
    (``QR`` contiguous [B, Hq, D]; a bfloat16 ``QR`` gets them rounded once to bfloat16, to nearest even); the factor
    ``1 / (D * C_D)`` is folded into the softmax scale. One program: ``ROWS`` query heads of one sequence."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, D)
    m = (h < q_heads)[:, None]
    qr = tl.load(Q + b * stride_qb + h[:, None].to(tl.int64) * stride_qh + d[None, :], mask=m, other=0.0)
    if Q.dtype.element_ty == tl.bfloat16:  # widen from the bits (the interpreter flushes bf16 subnormals)
        q = bf16_bits_to_f32(qr.to(tl.int16, bitcast=True))
    else:
        q = qr.to(tl.float32)
    q = hadamard_rows(q * tl.load(SIGNS + d)[None, :], ROWS, D)
    if QR.dtype.element_ty == tl.bfloat16:  # by the bits (the interpreter's bfloat16 cast truncates)
        tl.store(QR.to(tl.pointer_type(tl.int16)) + (b * q_heads + h[:, None]) * D + d[None, :],
                 f32_to_bf16_bits(q).to(tl.int16), mask=m)
    else:
        tl.store(QR + (b * q_heads + h[:, None]) * D + d[None, :], q, mask=m)


@triton.jit
def _lse_natural(lse2):
    """A base-2 log-sum-exp in natural log: ``lse2 * f32(ln 2)`` (one float32 multiply; -inf stays -inf)."""
    return lse2 * 0.6931471805599453


@triton.jit
def merge_kernel(
    OP, LP, O, LSE, n_splits, op_b, op_h, op_s, lp_b, lp_h, o_b, o_h, lse_b, VSQ, D: tl.constexpr,
    S_PAD: tl.constexpr, DB: tl.constexpr, ROT_V: tl.constexpr = False, GDC: tl.constexpr = False,
):
    """Merge split outputs by log-sum-exp; writes out [D] and the natural-log LSE of one (seq, head).
    ``DB``: the channels ``program_id(2) * DB ..`` this program merges (D: all; the weights are the same for every
    channel block, the first block writes the LSE), so more programs may share a merge of many splits.
    ``ROT_V``: V is stored rotated: ``out = butterflies(out) * VSQ`` (``VSQ = v_signs / (D * C_D)``, float32
    [D]), the float32 form of ``HadamardRotation.unrotate``. ``GDC``: launched as a programmatic dependent of the
    split launch (``pdl``): ``griddepcontrol.wait`` first, before any load, which returns once every split program
    has finished and its stores are visible."""
    if GDC:
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, S_PAD)
    d = tl.program_id(2) * DB + tl.arange(0, DB)
    smask = s < n_splits
    lse = tl.load(LP + b * lp_b + h * lp_h + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_use)
    o = tl.load(OP + b * op_b + h * op_h + s[:, None] * op_s + d[None, :], mask=smask[:, None], other=0.0)
    wsum = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(wsum > 0, wsum, 1.0)
    if ROT_V:
        out = tl.reshape(hadamard_rows(tl.reshape(out, (1, D)), 1, D), (D,)) * tl.load(VSQ + d)
    tl.store(O + b * o_b + h * o_h + d, out)
    lse_nat = tl.where(wsum > 0, _lse_natural(m_use + tl.log2(wsum)), float("-inf"))
    if tl.program_id(2) == 0:
        tl.store(LSE + b * lse_b + h, lse_nat)


#: decode arithmetic: "fast" (16-bit tensor-core operands, q and p rounded once) or "exact" (float32 products)
PRECISIONS = ("fast", "exact")

KIND_IDS = {"bf16": 0, "fp8": 1, "mxfp4": 2, "nvfp4": 3, "int_v": 4, "int_k": 5}


def channel_halves_apply(head_dim: int, k_block: int, v_block: int, rows_per_block: int) -> tuple[bool, bool]:
    """Whether the block-rows products of keys and of values split into channel halves: a side of (head_dim / block)
    x ``rows_per_block`` >= 32 rows with an even number of blocks and >= 16 code bytes per half (the tensor cores'
    16-wide reduction); never a side of block 0 (no block rows)."""

    def half(block: int) -> bool:
        blocks = head_dim // block if block else 0
        return bool(block) and blocks % 2 == 0 and blocks * rows_per_block >= 32 and head_dim // 4 >= 16

    return half(k_block), half(v_block)


@functools.lru_cache(maxsize=16)
def _unused_residual(device: str):
    """The residual arguments of a launch without a residual window (``HAS_RES`` off: never read), made once
    per device instead of one allocation and fill per decode call."""
    import torch

    return torch.empty(1, 1, 1, 1, dtype=torch.float32, device=device)


def _nvidia_cuda(t) -> bool:
    """Whether tensor ``t`` is on a CUDA device of an NVIDIA build (not ROCm): inline PTX and ``maxnreg`` apply."""
    import torch

    return t.is_cuda and not getattr(torch.version, "hip", None)


@functools.lru_cache(maxsize=16)
def _multiprocessors(device: str) -> int:
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=16)
def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(device)


#: tokens per tile of fast FP8 decode on NVIDIA GPUs, by a substring of the device's name (first match), as measured:
#: the H200 gains with 64-token tiles at every bench shape (batch 32 x 8,192 149.2 -> 143.2 us, 128 x 4,096 276.2 ->
#: 261.5, 64 q / 8 KV heads x 16,384 549.6 -> 511.7; bench/results/ANALYSIS.md, session 28, 180); the H100 measured
#: 64-token tiles slower (session 15, 73: 214.3 -> 219.3-269.1 us; not re-measured since FP8 value words), so every
#: other device keeps 32
FP8_FAST_BLOCK_N = (("H200", 64),)


def fast_fp8_block_n(device: str) -> int:
    """Fast FP8 decode's default tile on the NVIDIA device ``device`` (:data:`FP8_FAST_BLOCK_N`; 32 where no entry
    names it)."""
    name = _device_name(device)
    return next((n for key, n in FP8_FAST_BLOCK_N if key in name), 32)


def pdl_supported(t) -> bool:
    """Whether launches on tensor ``t``'s device may be programmatic dependent launches (``pdl``): an NVIDIA GPU of
    compute capability 9.0 or newer (Hopper's ``griddepcontrol``), outside the interpreter."""
    import torch

    return (t.is_cuda and not getattr(torch.version, "hip", None) and not INTERPRET
            and torch.cuda.get_device_capability(t.device) >= (9, 0))


def hardware_fp8_formats(device) -> set[int]:
    """FP8 format ids the device converts to float16 in hardware (exactly): OCP E4M3FN/E5M2 on NVIDIA
    sm_89+ and AMD gfx950, the FNUZ formats on AMD gfx942; none in the interpreter."""
    import torch

    if not (hasattr(device, "type") and device.type == "cuda"):
        return set()
    if getattr(torch.version, "hip", None):
        arch = torch.cuda.get_device_properties(device).gcnArchName
        return {2, 3} if "gfx942" in arch else ({0, 1} if "gfx950" in arch else set())
    return {0, 1} if torch.cuda.get_device_capability(device) >= (8, 9) else set()


#: launch a cached plan's kernels through their compiled handles (:class:`LaunchHandle`) after a plan's first call
DIRECT_LAUNCH = True


class LaunchHandle:
    """The compiled kernel of one launch of a cached decode plan, kept from the plan's first call so that later
    calls launch it directly: ``CompiledKernel.run`` with the kernel's arguments in its parameter order (the call's
    positional arguments, then the constexprs and defaults, fixed per plan), as ``JITFunction.run`` calls it after
    its argument binding, specialization and cache lookup, which this skips (on the device tool's H100 host an eager
    call of 1-3 launches issued 14-245 us sooner, ``bench/host_overhead.py``'s ``call_jit_us`` against ``call_us``).

    Sound because a plan is served only to calls of equal :func:`decode_plan_key`: the same shapes, strides,
    dtypes, 16-byte alignment of every input, options and device, and its scalar arguments come from those alone
    (``bind_decode_plan``), so Triton would specialize every call of the plan as the first and find the same
    compiled kernel. Taken only where the current device is the one of the first call and Triton's compiled kernel
    has the launcher this calls (not the interpreter); otherwise the launch goes through ``kernel[grid]``. After
    changing a Triton knob that enters its cache key (``TRITON_DEBUG``, instrumentation), :func:`clear_plan_cache`."""

    __slots__ = ("compiled", "device", "tail")

    def __init__(self) -> None:
        self.compiled = None
        self.device = None
        self.tail: tuple = ()

    def capture(self, kernel, compiled, args: list, constexprs: dict) -> None:
        """Keep ``compiled`` (what ``kernel[grid](*args, **constexprs, ...)`` returned) and the values of the
        kernel's parameters after ``args``: the constexprs, else the parameters' defaults."""
        if INTERPRET or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata",
                                                                 "launch_metadata")):
            return
        sig = getattr(kernel, "signature", None) or inspect.signature(kernel.fn)  # (JITFunction's own)
        params = list(sig.parameters.values())[len(args):]
        if any(p.name not in constexprs and p.default is p.empty for p in params):
            return  # (a parameter without a value: leave it to Triton's binding)
        self.tail = tuple(constexprs.get(p.name, p.default) for p in params)
        self.device = triton.runtime.driver.active.get_current_device()
        self.compiled = compiled

    def launch(self, grid, args: list) -> bool:
        """Launch the kept kernel over ``args`` on the current stream; False (nothing launched) where there is none
        or the current device is not the first call's."""
        c = self.compiled
        if c is None:
            return False
        drv = triton.runtime.driver.active
        device = drv.get_current_device()
        if device != self.device:
            return False
        stream = drv.get_current_stream(device)
        values = (*args, *self.tail)
        g = (*grid, 1, 1)
        hooks = triton.knobs.runtime
        c.run(g[0], g[1], g[2], stream, c.function, c.packed_metadata, c.launch_metadata(grid, stream, *values),
              hooks.launch_enter_hook, hooks.launch_exit_hook, *values)
        return True


class Launch:
    """One kernel launch: ``kernel[grid](*args, **constexprs, **options)``; AOT compiles the same record.

    ``options`` always name ``enable_fp_fusion`` (default True: floating-point contraction, Triton's default up to
    3.9, with which every kernel was measured and tested on GPUs; Triton 3.10 turns the default off, and 3.9 warns
    where it is not named). Rotated writes pass False (docs/rotation.md). ``handle``: the :class:`LaunchHandle` of
    this launch in a cached plan (launched directly once it holds the compiled kernel, :data:`DIRECT_LAUNCH`)."""

    def __init__(self, kernel, grid, args: list, constexprs: dict, options: dict,
                 handle: LaunchHandle | None = None) -> None:
        self.kernel, self.grid, self.args, self.constexprs = kernel, grid, args, constexprs
        self.options = {"enable_fp_fusion": True, **options}
        self.handle = handle

    def __call__(self) -> None:
        h = self.handle
        if h is not None and DIRECT_LAUNCH and h.launch(self.grid, self.args):
            return
        compiled = self.kernel[self.grid](*self.args, **self.constexprs, **self.options)
        if h is not None and DIRECT_LAUNCH and h.compiled is None:
            h.capture(self.kernel, compiled, self.args, self.constexprs)


class CacheTiles:
    """How one of K or V is stored, as the kernel reads it: kind, constexprs, field tensors, scales.

    ``fields`` are up to three tensors, token-major (``head_major=False``, NHD: axes [slot (or slot group),
    kv_head, ...], as :class:`kvqref.paged.PagedKVCache` stores them, flattened over pages) or head-major
    (``head_major=True``, HND: axes [page, kv_head, slot (or slot group) in the page, ...], each head's rows of a
    page contiguous, as FlashInfer's HND layout); the same bytes per (token, head) either way.
    ``tensor_scale`` is a float32 [kv_heads] tensor folded into the softmax scale (K) or the output (V);
    ``rotation``: the ``HadamardRotation`` of stored values (None: unrotated), which :func:`plan_decode` applies
    to q (K's) and undoes on the output (V's).
    """

    def __init__(
        self,
        kind: str,
        fields: list,
        tensor_scale,
        *,
        fmt: int = 0,
        token_scale: bool = False,
        block: int = 16,
        group: int = 1,
        bits: int = 8,
        rotation=None,
        head_major: bool = False,
    ) -> None:
        if kind not in KIND_IDS:
            raise ValueError(f"unknown tile kind {kind!r}; known: {sorted(KIND_IDS)}")
        self.kind, self.fields, self.tensor_scale = kind, list(fields), tensor_scale
        self.fmt, self.token_scale, self.block, self.group, self.bits = fmt, token_scale, block, group, bits
        self.rotation = rotation  # a kvqref.schemes.rotation.HadamardRotation: the tiles hold rotated values
        self.head_major = bool(head_major)
        lead = 3 if head_major else 2
        if any(f.dim() < lead for f in self.fields):
            raise ValueError(f"{'head-major' if head_major else 'token-major'} fields need at least {lead} axes, got "
                             f"{[tuple(f.shape) for f in self.fields]}")
        for f in self.fields if head_major else ():  # page_slot: page p's rows start at row p * kv_heads * rows
            if f.stride(0) != f.shape[1] * f.shape[2] * f.stride(2):
                raise ValueError(f"head-major field of shape {tuple(f.shape)} has strides {f.stride()}: the page "
                                 "stride must be kv_heads x rows x the row stride")

    @property
    def kv_heads(self) -> int:
        return self.fields[0].shape[1]

    def page_slots(self, page_size: int) -> int:
        """The kernels' PAGE_SLOTS (``codecs.page_slot``): the slot step from one page to the next."""
        return page_size * self.kv_heads if self.head_major else page_size

    def row_strides(self, t) -> tuple[int, int]:
        """(slot stride, head stride) of field ``t``, in elements."""
        return (t.stride(2), t.stride(1)) if self.head_major else (t.stride(0), t.stride(1))

    def row_shape(self, t) -> tuple[int, ...]:
        """The axes of one (slot, head) row of field ``t``."""
        return tuple(t.shape[3:] if self.head_major else t.shape[2:])

    def plan_key(self) -> tuple:
        """What a decode plan reads of these tiles (:func:`decode_plan_key`): every attribute, and each tensor's
        shape, strides, dtype and alignment."""
        return (self.kind, self.fmt, self.token_scale, self.block, self.group, self.bits, self.rotation,
                self.head_major, tuple(_tensor_key(f) for f in self.fields), _tensor_key(self.tensor_scale))

    def field_args(self) -> list:
        f = self.fields + [self.fields[0]] * (3 - len(self.fields))  # unused slots get a valid pointer
        return f

    def stride_args(self) -> list[int]:
        out: list[int] = []
        for t in self.field_args():
            out += list(self.row_strides(t))
        return out


def wide_scales(t: CacheTiles) -> bool:
    """Whether an FP4 side's block scales can be read as one 32- or 64-bit word per (slot, head): D / block of
    4 or 8 one-byte codes, contiguous per (slot, head), every row start aligned to the word."""
    if t.kind not in ("mxfp4", "nvfp4"):
        return False
    f1 = t.fields[1]
    nb = t.row_shape(f1)[0] if len(t.row_shape(f1)) == 1 else 0
    return (nb in (4, 8) and f1.element_size() == 1 and f1.stride(-1) == 1
            and all(st % nb == 0 for st in t.row_strides(f1)) and f1.data_ptr() % nb == 0)


def _kivi_f16_rows_in_words(t: CacheTiles, n: int) -> bool:
    """Whether a KIVI side's scale and zero fields (``fields[1:3]``) hold float16 rows, contiguous, that can be read
    as words of ``n`` elements: every row start aligned to ``n`` elements."""
    return all(len(t.row_shape(f)) == 1 and f.element_size() == 2 and f.stride(-1) == 1
               and all(st % n == 0 for st in t.row_strides(f)) and f.data_ptr() % (2 * n) == 0 for f in t.fields[1:3])


def kivi_value_scale_words_ok(t: CacheTiles, head_dim: int) -> bool:
    """Whether KIVI values' per-token group scales and zeros can be read as one word per (slot, head)
    (:func:`_kivi_value_rows`' ``WORDS``): 1, 2 or 4 float16 groups per token, contiguous, every row start aligned
    to the word."""
    if t.kind != "int_v":
        return False
    ng = head_dim // t.group
    return ng in (1, 2, 4) and all(t.row_shape(f) == (ng,) for f in t.fields[1:3]) and _kivi_f16_rows_in_words(t, ng)


def kivi_key_words(t: CacheTiles) -> bool:
    """Whether fast-mode KIVI keys can take the key-tile path (``key_tile``): 4-bit codes always; 2-bit codes read
    each channel's scale and zero for the 4 phases as one 64-bit word, so their float16 rows must be contiguous
    and every row start aligned to 4 elements."""
    if t.kind != "int_k" or t.bits != 2:
        return t.kind == "int_k"
    return _kivi_f16_rows_in_words(t, 4)


@functools.lru_cache(maxsize=256)
def _rotation_vectors(seed: int, head_dim: int, device: str):
    import numpy as np
    import torch

    from kvqref.schemes.rotation import HadamardRotation, check_head_dim, norm_f32

    D = check_head_dim(head_dim, "decode of a rotated cache")
    signs = HadamardRotation(seed).signs(D)
    inv = 1.0 / (D * float(norm_f32(D)))
    return (torch.from_numpy(signs).to(device), torch.from_numpy(signs * np.float32(inv)).to(device), inv)


def rotation_vectors(seed: int, head_dim: int, device):
    """The rotation of ``seed`` as the kernels take it, made once per (seed, D, device): (signs float32 [D],
    signs / (D C_D) rounded once to float32 [D] (the merge kernel's un-rotation), 1 / (D C_D) as a float
    (float64; folded into the softmax scale, rounded to float32 once with it))."""
    return _rotation_vectors(int(seed), int(head_dim), str(device))


#: query heads per KV head (rows per value group) at which fast KIVI takes value rows of up to 32 and key rows at the
#: longest tile whose rows fit 16 (:func:`kivi_key_rows_tile`), the only grouping where that was measured
#: (bench/results/ANALYSIS.md, session 17, 94); elsewhere key rows keep 128-token tiles
KIVI_SHORT_TILE_HEADS = 8


def kivi_key_rows_tile(rows_per_group: int, key_group: int) -> int | None:
    """The tokens of a fast KIVI key-rows tile: the largest of 128, 64 and 32 that holds whole key groups (or lies
    inside one) and whose key rows, (tile / group, at least 1) x ``rows_per_group`` query heads, fit the 16 MMA rows;
    None where none does."""
    for tile in (128, 64, 32):
        if (tile % key_group == 0 or key_group % tile == 0) and max(1, tile // key_group) * rows_per_group <= 16:
            return tile
    return None


def default_value_rows(precision: str, v_kind: str, q_per_kv: int, head_dim: int, v_group: int,
                       k_group: int = 0) -> bool:
    """Whether decode lays the score rows out by (KIVI value group, query head) by default (``value_rows``):
    fast-mode KIVI values whose rows (groups x query heads per KV head) fit the 16 MMA rows, where it measured
    faster (H100, 32 q / 8 KV heads, G 32: int4 784 -> 635 us); with 32 rows only at 8 query heads per KV head beside
    KIVI keys of group ``k_group`` (0: other keys) whose key rows fit a tile (:func:`kivi_key_rows_tile`: 64 tokens
    at groups of 32), the layout of the key-rows kernel (H100, 64 q / 8 KV heads x 16,384, with plan_decode's
    launch choices there: int4 2,392 -> 1,050 us, int2 1,920 -> 1,281; bench/results/ANALYSIS.md, session 17).
    Without key rows 32 value rows lost for int4 (56%, session 4); 32 rows at 4 query heads per KV head (value groups
    of 16) are not measured, so they keep the head rows."""
    rows_per_group = triton.next_power_of_2(q_per_kv)
    rows = rows_per_group * (head_dim // max(v_group, 1))
    return precision == "fast" and v_kind == "int_v" and (
        rows <= 16 or (rows <= 32 and rows_per_group == KIVI_SHORT_TILE_HEADS and k_group > 0
                       and kivi_key_rows_tile(rows_per_group, k_group) is not None))


#: programs of the KIVI key-rows kernel resident per multiprocessor (about 250 registers per thread at 4 warps)
KEY_ROWS_RESIDENT = 2
#: KIVI key rows on NVIDIA GPUs: registers capped at this many per thread (Triton's ``maxnreg``), so that 3 programs
#: of 4 warps fit a multiprocessor (:func:`key_rows_resident`), for 2-bit code words with 16 value rows at 4 warps
#: (since session 33 only at 1 query head per KV head in token-major pages, or 4 warps asked for: elsewhere they take
#: 2 warps uncapped; H100,
#: int2_kivi: batch 32 x 8,192 224 -> 215 us with 3 splits, batch 1 x 131,072 128 -> 114.5 us with 49; 4-bit words
#: lost at 168: 255 -> 262 us; bench/results/history/ab-h100-session13-kivi-words-2.log,
#: ab-h100-session14-int2-registers.log) and 4-bit byte phases with 32 (8 query heads per KV head; 64 q / 8 KV heads
#: x 16,384: 1,306 -> 1,047-1,070 us at 1-6 splits; 2-bit words there lost at it: 1,274 -> 1,686 us; session 17)
KIVI_KEY_ROWS_MAXNREG = 168
#: ``choose_splits(resident=...)``: the fewest splits whose programs fill their last wave to at least this fraction
WAVE_FILL = 0.95


def _capped_resident(measured: int, num_warps: int, maxnreg: int | None) -> int:
    """Programs one multiprocessor holds: ``measured`` (as the H100 measures the launch), or with registers capped at
    ``maxnreg`` per thread what a 65,536-register file holds of programs of ``num_warps`` warps, if more."""
    return max(measured, 65536 // (32 * num_warps * maxnreg) if maxnreg else 0)


def key_rows_resident(num_warps: int, maxnreg: int | None) -> int:
    """Programs of the KIVI key-rows kernel one multiprocessor holds (:func:`_capped_resident` of KEY_ROWS_RESIDENT
    programs of 4 warps, or as many warps in programs of ``num_warps``; 168 registers at 4 warps: 3)."""
    return _capped_resident(max(1, KEY_ROWS_RESIDENT * 4 // num_warps), num_warps, maxnreg)


#: one-warp programs of FP4 value words by channel halves resident per multiprocessor (<= 168 registers per thread)
WORDS_HALVES_RESIDENT = 12
#: their register cap where a second copy of the tile loop (``e8m0_tile_check``) would take more
WORDS_HALVES_MAXNREG = 168
#: two-warp programs of fast FP8 and of mxfp4 block rows resident per multiprocessor, as the H100's split counts
#: measure it (whole waves of 6 per multiprocessor are fast, of 7 are not: history/ab-h100-session12-splits-2warp.log)
TWO_WARP_RESIDENT = 6
#: two-warp fast FP8 and mxfp4-block-rows launches on NVIDIA GPUs: registers capped at this many per thread, so that 8
#: programs fit a multiprocessor instead of 5-6 (H100, batch 32 x 8,192: fp8_e4m3 213.8 -> 207.2 us with 4 splits,
#: mxfp4 167.4 -> 159.5 us; caps of 136 and 144 lost, 120 tied; bf16 lost at 128 and 144: 375.8 -> 400 us;
#: bench/results/ANALYSIS.md, session 16)
TWO_WARP_MAXNREG = 128
#: mxfp4's two-warp block rows (E8M0 blocks of 32 on both sides) with the E8M0 tile check, which carries the float16
#: value products: registers per thread (6 programs per multiprocessor). At TWO_WARP_MAXNREG the check's second loop
#: spills and loses at 4 of 7 shapes; at 168 it wins or ties at every one (H100, head-major batch 32 x 8,192 143.9 ->
#: 137.6 us, token-major 159.3 -> 151.3, page size 1 163.7 -> 145.3, 128 x 4,096 265.9 -> 263.5, 8 x 32,768 145.4 ->
#: 143.4, 1 x 131,072 84.1 -> 83.4, 1 query head per KV head 143.5 -> 143.3; bench/results/ANALYSIS.md, session 41)
E8M0_TWO_WARP_MAXNREG = 168


def two_warp_resident(maxnreg: int | None) -> int:
    """Two-warp FP8 / mxfp4 programs one multiprocessor holds (:func:`_capped_resident` of TWO_WARP_RESIDENT; 128
    registers: 8)."""
    return _capped_resident(TWO_WARP_RESIDENT, 2, maxnreg)


#: two-warp programs of the bf16 kernel resident per multiprocessor (its 64-token tiles take 39 KB of shared memory:
#: 5 fit the H100's 228 KB)
BF16_TWO_WARP_RESIDENT = 5
#: fast bf16 on NVIDIA GPUs: 128-token tiles, 4 warps, 3 stages (107 KB of shared memory: 2 programs per
#: multiprocessor), the fewest splits that fill whole waves of 2 (one split writes the output itself). H100 against
#: 64 / 2 / 2 (at its wave rule of 5 or 16 programs per multiprocessor): batch 32 x 8,192 375.8 -> 370.3 us (1 split),
#: 48 x 8,192 552.4 -> 549.5 (2), 128 x 4,096 733.6 -> 724.3 (1), 64 query heads x 16,384 1,445.0 -> 1,425.6 (1),
#: 16 x 16,384 378.8 -> 372.7 (2), 8 x 32,768 378.2 -> 372.8 (4), 1 x 131,072 200.7 -> 196.5 (32); page 1 378.5 ->
#: 373.9 (bench/results/ANALYSIS.md, session 19)
BF16_WIDE = (128, 4, 3)
BF16_WIDE_RESIDENT = 2


def whole_tile_splits(max_len: int, splits: int, block_n: int) -> tuple[int, int]:
    """(splits, tokens per split) for about ``splits`` splits of ``max_len`` tokens: tokens per split
    ``ceil(max_len / splits)`` rounded up to whole tiles of ``block_n``, then the splits that many tokens need."""
    per = -(-max(max_len, 1) // splits)
    per = -(-per // block_n) * block_n
    return -(-max(max_len, 1) // per), per


def choose_splits(batch: int, kv_heads: int, max_len: int, block_n: int, num_sms: int,
                  resident: int | None = None, waves_of: int | None = None, down: bool = False,
                  wave_tiles: bool = False) -> tuple[int, int]:
    """(splits, tokens per split), each split a whole number of tiles and at least 4 tiles long. Default: about
    16 programs per multiprocessor (measured best on the H100 for batch x kv_heads = 256). ``resident``: the
    programs one multiprocessor holds at once, for a kernel that few fit: the fewest splits whose programs fill
    whole waves of ``resident * num_sms``, the last one to at least WAVE_FILL (else one wave's worth,
    ``max(1, resident * num_sms // (batch * kv_heads))``). KIVI key rows, 2 resident, H100: batch 32 x 8,192,
    1 split 321 us against 353 us for 8; batch 1 x 131,072, 32 splits 172 us against 236 us for 256 and 282 us
    for 16 (bench/results/history/ab-h100-session10-hnd-splits.log); 2-bit code words, 3 resident: batch 32, 3
    splits (1.94 waves) 215 us against 233 / 267 / 233 for 1 / 2 / 4; batch 1, 49 splits (0.99 waves) 114.5 us
    against 137 / 151 for 33 / 66 (history/ab-h100-session14-int2-registers.log). ``waves_of``: the programs one
    multiprocessor holds at once, for a kernel whose last partial wave costs (one-warp programs): the default's
    programs rounded to whole waves, ``max(1, round(default / wave)) * wave // (batch * kv_heads)`` splits (FP4 value
    words by halves, 12 resident, H100: batch 1 x 131,072 nvfp4 114 -> 94 us at 196 splits against 256,
    history/ab-h100-session12-waves.log); ``down``: rounded down instead, ``max(1, default // wave)``
    waves (the planner's rule until session 44, which ``wave_tiles`` replaced: FP8 and mxfp4 at 2 warps, 6
    resident, with fewer KV pairs than multiprocessors: batch 1 x 131,072 fp8 132 -> 121 us at 198 splits, where 297,
    the nearest, took 172; history/ab-h100-session12-splits-2warp.log).
    ``wave_tiles`` (with ``waves_of``): the split count of at most the default's that takes the fewest tile steps,
    whole waves times tiles per split (``ceil(programs / wave) * ceil(tokens per split / block_n)``), the fewest
    splits among equals (FP8 and mxfp4 at 2 warps with fewer KV pairs than multiprocessors, H100: mxfp4 (6 resident)
    batch 1 x 131,072 83.0 -> 76.6 us at 98 splits, one wave of 21 tiles, against the rounded-down 187, two waves of
    11; 8 x 32,768 141.1 -> 134.7 at 12 against 24; 16 x 8,192 82.2 -> 78.0 at 6 against 12; FP8 (8 resident) batch
    1 114.8 -> 110.0 at 128 against 256, 8 x 32,768 203.8 -> 200.4 at 16 against 32; bench/results/ANALYSIS.md 290)."""
    pairs = max(1, batch * kv_heads)
    want = max(1, -(-16 * num_sms // pairs))  # the default
    most = max(1, -(-max_len // (4 * block_n)))

    def tiled(splits: int) -> tuple[int, int]:
        return whole_tile_splits(max_len, splits, block_n)

    if resident is not None:
        wave = resident * num_sms

        def fills(splits: int) -> bool:  # the last wave of the programs at least WAVE_FILL full
            programs = tiled(splits)[0] * pairs
            return programs >= WAVE_FILL * -(-programs // wave) * wave

        want = next((s for s in range(1, most + 1) if fills(s)), max(1, wave // pairs))
    elif waves_of is not None and wave_tiles:
        wave, cap = waves_of * num_sms, min(want, most)

        def steps(splits: int) -> tuple[int, int]:
            n, per = tiled(splits)
            return -(-(n * pairs) // wave) * -(-per // block_n), n

        # within w waves the most splits take the fewest tiles each: one candidate per wave count
        want = min((max(1, min(cap, w * wave // pairs)) for w in range(1, -(-(cap * pairs) // wave) + 1)), key=steps)
    elif waves_of is not None:
        wave, programs = waves_of * num_sms, want * pairs
        want = max(1, max(1, programs // wave if down else round(programs / wave)) * wave // pairs)
    return tiled(min(want, most))


#: the merge launch takes one warp per program while its [splits, head_dim] float32 tile is at most this many
#: elements (128 per thread), else Triton's default of 4
MERGE_ONE_WARP_ELEMENTS = 4096


def merge_warps_default(s_pad: int, head_dim: int) -> int:
    """Warps per program of the merge launch: 1 where the padded split count times head_dim is at most
    MERGE_ONE_WARP_ELEMENTS, else 4. H100, against 4 warps: batch 32 x 8,192 (4-16 splits) 1.5-2.0 us faster for
    every scheme but int4_kivi (-0.2), batch 8 x 32,768 (24 splits) about 1 us; at batch 1 x 131,072 (49-256
    splits) 1 warp is 47-55 us slower, 2 warps 26-30, 8 and 16 warps 0.5-2 (bench/results/ANALYSIS.md, session
    15)."""
    return 1 if s_pad * head_dim <= MERGE_ONE_WARP_ELEMENTS else 4


def merge_channels_default(rows: int, num_sms: int, head_dim: int, rotated_v: bool) -> int:
    """Channels per merge program: half of head_dim where the merge has fewer (sequence, query head) rows than
    twice the multiprocessors (and V is not rotated), else all of them. H100, batch 1 x 131,072 (32 rows, 49-256
    splits): 0.6-1.2 us faster for every scheme at 64 channels of 128; batch 8 x 32,768 (256 rows) 0.3-0.9; batch
    32 (1,024 rows) -0.2 .. +0.7 (bench/results/ANALYSIS.md, session 15)."""
    return head_dim // 2 if rows < 2 * num_sms and head_dim >= 32 and not rotated_v else head_dim


class DecodePlan(NamedTuple):
    """What :func:`choose_decode_plan` decided, without tensors: ``rotate_q`` (None, or the rotation launch's
    (query heads per program, q' in bfloat16)), the softmax scale (a rotated K's 1 / (D C_D) folded in), the split
    count, tokens per split, the splits in all (a residual split included), the split launches as (grid, constexprs,
    options) and the merge launch likewise (None where the split kernel writes the output)."""

    rotate_q: tuple[int, bool] | None
    sm_scale: float
    num_splits: int
    per: int
    total: int
    splits: tuple
    merge: tuple | None
    handles: tuple = ()  # a cached plan's LaunchHandle per launch (rotation, splits, merge): :func:`plan_decode`


def choose_decode_plan(
    q,
    k: CacheTiles,
    v: CacheTiles,
    page_size: int,
    *,
    has_residual: bool,
    max_seq_len: int,
    sm_scale: float | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    hw_formats: set[int] | None = None,
    k_transposed: bool = True,
    precision: str = "fast",
    maxnreg: int | None = None,
    ptx_unpack: bool | None = None,
    wide_scale_loads: bool | None = None,
    value_rows: bool | None = None,
    fp4_keys_by_token: bool | None = None,
    key_tile: bool | None = None,
    heads_fast: bool | None = None,
    block_rows: bool | None = None,
    value_words: bool | None = None,
    key_rows: bool | None = None,
    kivi_words: bool | None = None,
    residual_launch: bool | None = None,
    channel_halves: bool | None = None,
    merge_warps: int | None = None,
    merge_channels: int | None = None,
    fp8_value_words: bool | None = None,
    kivi_key_chains: int | None = None,
    kivi_value_chunks: int | None = None,
    kivi_chunk_softmax: int | None = None,
    kivi_joined_row_terms: bool | None = None,
    kivi_value_subnormal_codes: bool | None = None,
    kivi_scalar_page_ids: bool | None = None,
    kivi_value_scale_words: bool | None = None,
    kivi_pipeline: bool | None = None,
    direct_output: bool | None = None,
    kivi_subnormal_codes: bool | None = None,
    e8m0_tile_check: bool | None = None,
    e8m0_values_f16: bool | None = None,
    fp4_tiles_2d: bool | None = None,
    pdl: bool | None = None,
    page_ids_ahead: bool | None = None,
    key_products_transposed: bool | None = None,
    e8m0_scale_fields: bool | None = None,
    q_rows_load: str | None = None,
) -> DecodePlan:
    """What decode attention launches (see :func:`plan_decode`), chosen from the shapes, strides, dtypes and device
    of ``q`` and the tiles alone (no tensor is read or made): the same inputs give the same plan.
    ``hw_formats``: FP8 format ids converted in hardware (default: what ``q``'s device has); ``maxnreg``:
    a register cap per thread (CUDA only; for tuning occupancy; default on NVIDIA GPUs: ``TWO_WARP_MAXNREG`` for
    two-warp fast FP8 and mxfp4 block rows (``E8M0_TWO_WARP_MAXNREG`` for mxfp4's with the E8M0 tile check),
    ``KIVI_KEY_ROWS_MAXNREG`` for KIVI key rows at 4 warps: 2-bit words with 16 value rows (1 query head per KV head
    in token-major pages, or 4 warps asked for; elsewhere they take 2 warps uncapped) and 4-bit byte phases with 32,
    else none);
    ``ptx_unpack``: FP4 nibbles (and, with
    ``key_rows``, KIVI codes; with ``fp8_value_words``, the FP8 words' halves in the OCP formats the device converts)
    unpacked with inline PTX (CUDA only); default (None): where it measured faster on the H100, fast-mode E8M0
    (MXFP4, fp4_e2m1) and NVFP4 keys, KIVI key rows and FP8 value words on CUDA (bench/results/ANALYSIS.md);
    ``wide_scale_loads``: FP4 block
    scales read as one word per token where the layout allows (:func:`wide_scales`); default (None): where it
    measured faster (NVFP4; E8M0 blocks of 32, or of any size with PTX unpacking); False: bytewise;
    ``value_rows``: fast-mode KIVI values with the score rows laid out by (channel group, query head) so the
    group's scale folds into p (default: on for fast-mode KIVI values; docs/kernels.md, "Precision");
    ``fp4_keys_by_token``: FP4 key tiles laid out [tokens, D/2] and multiplied as the left operand (scores come
    out transposed), as the value tiles are, instead of [D/2, tokens]; the same products, summed in another
    order (default False: the layout cut the static sm_90 loop count of NVFP4 and fp4_e2m1 by 4-8% but timed slower
    on the H100, nvfp4 314 -> 346 us, fp4_e2m1 320 -> 326, mxfp4 258 -> 278; bench/results/ANALYSIS.md, session 5).
    ``key_tile``: fast-mode KIVI keys dequantized into a tile, c * s + z in two bfloat16 parts, against the bfloat16
    q (False: the group's scale folded into a float32 q, and q . z reduced per tile); default: on for fast-mode
    2-bit KIVI keys where :func:`kivi_key_words` allows (H100: int2 628 -> 517 us; int4 lost, 616 -> 627, so
    4-bit keys keep the folded path; bench/results/ANALYSIS.md, session 5; docs/kernels.md, "Precision").
    ``block_rows``: fast-mode FP4 keys and values (NVFP4 and E8M0 tiles) with score rows laid out by (block, query
    head), so no block scale multiplies a tile element (:func:`_fp4_block_rows`; docs/kernels.md, "Precision");
    default: on where the rows, (head_dim / block) x the query heads per KV head rounded up to a power of two, are
    at most 32 on both sides (H100, batch 32 x 8,192: nvfp4 324 -> 243 us; bench/results/ANALYSIS.md, session 8).
    ``value_words``: with ``block_rows``, value code tiles read as 16-bit words of four channels (transposed matrix
    loads instead of one-byte shared loads; :func:`_fp4_block_rows`); default: on where the value rows are fewer
    than head_dim / 4 (mxfp4 at 4 query heads per KV head, D 128: 193 -> 176 us on the H100); refused above 32
    value rows.
    ``key_rows``: fast-mode KIVI keys by (token group, query head) rows with values by (channel group, query head)
    rows (:func:`_kivi_key_rows`): each group's scales fold into a float16 q (one rounding per q x s, relative to a
    power of two per row), one MMA per byte phase against the exact codes, the zero term q . z once per group row;
    tiles may span several key groups. Needs ``value_rows``; default: on where ``value_rows`` is and the key rows fit
    16, with 128-token tiles, 4 warps, 2 stages and (CUDA) the codes unpacked by inline PTX (H100, batch 32 x
    8,192: int4 618 -> 339 us, int2 519 -> 295; bench/results/ANALYSIS.md, session 9); at 8 query heads per KV head
    with the longest tile whose key rows fit 16 (:func:`kivi_key_rows_tile`; session 17).
    ``kivi_words``: with ``key_rows``, the key and value codes read as words of eight codes (int32 / int16) and
    unpacked two words per PTX call, one product per code position (:func:`_kivi_key_rows`, constexpr ``KW``; the
    same nonzero products, summed in another order); needs head_dim >= 128, tiles of at least 32 tokens and code rows
    aligned to their word; default: where it applies, with 3 stages. ``kivi_key_chains`` (1 or 2): the key words'
    eight products of a tile accumulated in one chain or in two independent ones (even and odd code positions,
    summed once: the same products, summed in another order); default 2 for 4-bit keys, 1 for 2-bit.
    ``kivi_value_chunks``: with ``kivi_words``, the value products of a tile as this many batched chunks of its
    tokens (constexpr ``NCH``, a power of two; chunks of at least 16 tokens; the same products, summed in another
    order); default: one per warp, chunks of at least 32 tokens (``min(num_warps, block_n // 32)``).
    ``kivi_chunk_softmax``: with ``kivi_words``, a softmax state (running max, sum and zero term) per value chunk
    instead of per tile, the chunks' states merged once after the loop (each chunk's sums times 2**(m_c - m), as the
    merge launch joins splits), so that a tile's max and sums need no exchange between warps; the chunks take the
    tile's tokens in runs of this many dealt round-robin (constexpr ``CSM``, a power of two; 0: one state per tile).
    Default 8 (each warp's columns of the key product: runs of 8 tokens) for 4-bit key words at 3-4 query heads per
    KV head, else 0.
    ``kivi_joined_row_terms``: with ``key_rows``, the key rows' two per-row terms (the power of two 2**-e and the
    zero term q . z) joined into one [rows, 2] tensor before they meet the product (constexpr ``RJOIN``; the same
    values); default with ``kivi_chunk_softmax`` and for 2-bit key words in token-major pages at 3-4 query heads per
    KV head.
    ``kivi_value_subnormal_codes``: with ``kivi_words``, the value codes unpacked into bfloat16 subnormals
    ``code * 2**(k - 133)`` instead of the magic number 128 + code * 2**k and its subtraction, against
    ``bf16(p * 2**96 * s)`` (constexpr ``VSUB``, :func:`_kivi_key_rows`; exact scalings by powers of two: the same
    roundings and sums; on NVIDIA GPUs the tensor cores keep a few bits fewer of a subnormal operand's products in
    their float32 sums). Default: 2-bit value words, and 4-bit ones in token-major pages with
    ``kivi_chunk_softmax``, at 3-4 query heads per KV head.
    ``kivi_scalar_page_ids``: with ``kivi_words`` and ``page_ids_ahead`` (not ``kivi_pipeline``), a tile's page ids
    (at most four: the tile within 4 pages) read as scalars and each tensor of tokens' cache rows made from them in
    its own layout (constexpr ``SPG``, :func:`_tile_page_ids`, :func:`_paged_slots`; the same rows). Default: 4-bit
    words in token-major pages with ``kivi_chunk_softmax`` at 3-4 query heads per KV head.
    ``kivi_value_scale_words``: with ``value_rows``, each token's KIVI value scales and zeros read as one 16/32/64-bit
    word (constexpr ``VSW``, :func:`kivi_value_scale_words_ok`; the same values); default: with ``key_rows`` in
    token-major pages.
    ``kivi_pipeline``: with ``key_rows``, each step of the tile loop computes the next tile's scores beside this
    tile's softmax and value products (constexpr ``KPIPE``; the same arithmetic per tile, the same bits); default:
    4-bit key words without a register cap (where it measured faster) unless they read their page ids ahead
    (``page_ids_ahead``, which replaces it there).
    ``kivi_subnormal_codes``: with ``key_rows``, the key codes unpacked into float16 subnormals ``code * 2**(K - 24)``
    (no magic number, so no packed subtraction per two codes), the 2**-24 and the code bits K taken out of the
    float32 products (:func:`_kivi_rows_scores`, constexpr ``KSUB``; exact scalings by powers of two: the same bits
    wherever no key-row operand falls below float16's normal range, in the interpreter; the H100's tensor cores
    round some float32 sums of the scaled products differently in the last bit); default: 2-bit keys by key rows
    (H100: int2 at batch 32 x 8,192 244.1 -> 233.4 us), and 4-bit keys by key rows in head-major pages (H200: int4
    237.9 -> 234.0 us, 938.1 -> 903.2 at 64 query heads; token-major pages lost there, 1,084.6 -> 1,119.0).
    ``e8m0_tile_check``: with ``block_rows``, one check per tile that every E8M0 block-scale code of the tile lies
    in 1 .. 254, then the bare exponent field as each code's float32 instead of :func:`e8m0_to_f32`'s rule for codes
    0 and 255 (constexpr ``E8M0_CHECK``); if a tile held code 0 or 255, one uniform branch after the loop reruns the
    split with that rule: the same bits either way; needs every E8M0 side's scales as words (``wide_scale_loads``);
    default: with value words by channel halves (one warp: ``value_words`` and ``channel_halves``), and for mxfp4's
    two-warp block rows (E8M0 blocks of 32 on both sides) at ``E8M0_TWO_WARP_MAXNREG`` registers on NVIDIA GPUs.
    ``e8m0_values_f16``: with ``e8m0_tile_check`` and E8M0 values, the value products in float16 (the byte-domain
    E2M1 unpacking, no 2**126 multiply) against ``fl16(p * 2**(c - mc + 15))``, mc the split's reference code (its
    first tile's largest value scale code + ``E8M0_V16_HEADROOM``), instead of ``bf16(p * 2**(c - 127))`` against
    bfloat16 codes (constexpr ``EV16``); a split with a value code outside mc - ``E8M0_V16_WINDOW`` .. mc, or mc
    outside 16 .. 240, reruns the bfloat16 way (as for codes 0 and 255). Not the same bits: float16 rounds p more
    finely (2**-11) and adds an absolute error below 2**-23 per token's weight (docs/kernels.md); default: wherever
    ``e8m0_tile_check`` is on with E8M0 values (H100, batch 32 x 8,192 head-major: fp4_e2m1 153.7 -> 149.6 us,
    mxfp4 with the check 143.9 -> 137.6 at 168 registers: bench/results/ANALYSIS.md, sessions 40-41).
    ``key_products_transposed``: with ``block_rows``, each key product as [tokens, code bytes] @ [code bytes, rows],
    the fresh code tile as the tensor cores' first operand instead of q, then transposed back (constexpr ``KPT``; the
    same exact products and float32 sums). Static, sm_90, triton 3.6, 4 query heads per KV head: the default loops
    fp4_e2m1 1,174 -> 1,109 instructions, nvfp4 1,204 -> 1,090, mxfp4 998 -> 960, without spills in the loop
    (bench/results/ANALYSIS.md, 277). Default: two-warp block rows (64-token tiles) and NVFP4's value words by
    channel halves (H100, batch 32 x 8,192 head-major: mxfp4 at 4 query heads per KV head 135.6 -> 132.3 us, at 1
    142.7 -> 133.4, fp4_e2m1 at 1 146.4 -> 141.1, nvfp4 at 4 147.9 -> 144.7; as fast or faster at four more shapes);
    off for E8M0 value words by halves (fp4_e2m1 at 4: 148.2 -> 149.2, mxfp4 at 8: 85.9 -> 86.4) and 4-warp rows (not
    measured; ANALYSIS 278).
    ``e8m0_scale_fields``: with ``e8m0_tile_check``, each E8M0 side of 4 blocks, or of 4 or 8 by channel halves
    (each product's blocks in one 32-bit half of its scale word), has its scales made straight from the words as float32
    exponent fields, a funnel shift and a mask per element (constexprs ``E8F_K``, ``E8F_V``; the same bits as the
    codes' bare rule).
    Static sm_90 loop at 4 query heads per KV head: fp4_e2m1 1,174 -> 1,105 instructions, mxfp4 960 -> 945. Default:
    wherever it applies (H200, batch 32 x 8,192 head-major: fp4_e2m1 139.9 -> 137.6 us, page size 1 153.8 -> 148.3,
    128 x 4,096 261.9 -> 255.8; mxfp4 128.6 -> 127.4; as fast or faster at every shape timed: ANALYSIS 283).
    ``q_rows_load``: with ``block_rows``, how q's block rows are read before the loop (constexpr ``QLD``; the same
    values): ``"strided"`` (even and odd channels as two loads at a stride of 2), ``"transposed"`` (each as a
    [channels, rows] load, transposed) or ``"contiguous"`` (one load of contiguous channels split into even and odd).
    The load's layout becomes the layout of q's shared-memory copy, and with it how many register moves ptxas puts
    before each key product. Default: ``"transposed"`` for E8M0 value words by channel halves without transposed key
    products (fp4_e2m1 at 4 query heads per KV head), ``"contiguous"`` for NVFP4 keys' value words by channel halves
    in pages of more than one token, ``"strided"`` elsewhere (H100, batch 32 x 8,192 head-major: fp4_e2m1 147.1 ->
    145.1 us, nvfp4 147.9 -> 146.1; nvfp4 at page size 1 strided 160.4, contiguous 168.5; bench/results/ANALYSIS.md
    286, 288).
    ``fp4_tiles_2d``: per-element FP4 tiles (no block rows; block scales read as words) built as [code bytes, tokens]
    (keys) and [tokens, code bytes] (values), each byte's block scale code shifted out of its token's scale word
    (:func:`_fp4_bytes_codes`), instead of [blocks, bytes, tokens] tiles times a broadcast scale, reshaped (constexpr
    ``T2D``; the same values); default: fast E8M0 tiles built by PTX (the shared-memory round trip of the 16-bit tiles
    bounds this path, and the two-axis tiles make it with fewer, wider stores: H200, fp4_e2m1 at 8 query heads per
    KV head 12% faster); NVFP4's lose (H200: 64 q / 8 KV heads 948 -> 1,045 us) and the float32 routes are
    not measured: an option there.
    ``pdl``: the merge launch as a programmatic dependent launch of the (last) split launch (NVIDIA sm_90+: CUDA's
    programmatic stream serialization; constexpr ``GDC``): it is scheduled while the splits run and waits for them
    (``griddepcontrol.wait``) instead of launching after they end; the same arithmetic, the same bits; default: where
    the device supports it (:func:`pdl_supported`); ``True`` elsewhere raises.
    ``page_ids_ahead``: the per-tile, block-rows and KIVI key-rows loops read each next tile's page ids from the block
    table one step ahead, carried through the loop (constexpr ``PIDS_AHEAD``; the same loads and arithmetic, the same
    bits; key rows with ``kivi_pipeline`` read the keys' two tiles ahead of the values): Triton's pipeliner then gives
    the page-table load no stage of its own and double-buffers the code tiles at 3 stages (sm_90, triton 3.6: fast FP8
    at 64-token tiles one buffer per side, 22,848 B per program -> two, 38,976 B; without it more stages do not add
    buffers). Default: NVFP4 and fp4_e2m1 by value words and channel halves in pages of more than one token (both then
    at 3 stages; the E8M0 check's rerun reads its page ids in the step), and KIVI key words without a register cap at
    2-4 query heads per KV head: 4-bit ones in head-major pages (instead of ``kivi_pipeline``), both widths in
    token-major pages with their value scales read as words, where it measured 1-11% faster on the H200; FP8, mxfp4,
    2-bit KIVI in head-major pages, NVFP4 at page size 1 and KIVI at 1 query head per KV head lost
    (bench/results/ANALYSIS.md, sessions 32-34), and fp4_e2m1 at page size 1 on the H100 with the KV heads first
    (session 38).
    ``residual_launch``: the residual window's split as its own launch (constexpr ``PART``), so the paged splits
    do not carry the residual path's registers; default: with ``key_rows`` and a residual window.
    ``channel_halves``: with ``block_rows``, a side of at least 32 rows multiplies each channel half by the rows of
    its blocks only, two [rows / 2, D / 2] products instead of one [rows, D] (:func:`_fp4_block_rows`; the same
    nonzero products; values read as words split too, into four word products per half); default: on where it
    applies (:func:`channel_halves_apply`); ``True`` where no side applies raises.
    ``heads_fast``: the KV heads on the grid's fastest axis, so the programs reading one token's rows run together
    (default: at page size 1 only, where one page's scale rows of all heads share 32-byte sectors: 3-7% faster on the
    H100 for FP8 and FP4, bf16 the same; at pages of 2-16 tokens within 1%). ``merge_warps``: warps per program of
    the merge launch (default: :func:`merge_warps_default`); ``merge_channels``: channels per merge program (a power
    of two dividing head_dim; the merge's grid gains head_dim / merge_channels programs per (sequence, head); not
    with a rotated V, whose un-rotation needs the whole row; each channel's arithmetic is the same, the sum over
    splits may be reduced in another order; default: :func:`merge_channels_default`). ``fp8_value_words``: FP8 value
    tiles read as 16-bit words of two channels, the even and odd channels two products, so the products' operands
    come from transposed 16-bit matrix loads instead of one-byte shared loads (:func:`_fp8_word_halves`; the same
    products, each channel's sum in the same order);
    needs FP8 values without token scales and rows aligned to 2 bytes; default: on NVIDIA GPUs where it applies
    (H100, fp8_e4m3 at batch 32 x 8,192: 207.1 -> 200.6 us; static sm_90: 679 -> 481 loop instructions per thread,
    177 -> 117 registers).
    ``direct_output``: with one split and no residual window, the split kernel writes the output and the natural-log
    LSE itself and no merge launch follows (constexpr ``DIRECT``; the merge of one split weighs it by exactly 1, so
    the same values; a -0.0 output element stays -0.0 where the merge's sum gives +0.0); a rotated V is un-rotated
    by the split kernel then (constexpr ``ROT_V``, the merge kernel's butterflies and ``VSQ`` multiply on the same
    values); default: wherever it applies; ``True`` where it does not raises."""
    import torch

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if ptx_unpack and getattr(torch.version, "hip", None):
        raise ValueError("ptx_unpack=True needs CUDA (inline PTX); ROCm uses the portable unpacking")
    ptx_auto = ptx_unpack is None
    if ptx_unpack is None:
        ptx_unpack = _nvidia_cuda(q) and precision == "fast" and k.kind in ("mxfp4", "nvfp4")

    batch, q_heads, head_dim = q.shape
    kv_heads = k.kv_heads
    if k.head_major != v.head_major or v.kv_heads != kv_heads:
        raise ValueError(f"K and V must share one layout and kv_heads: K {'HND' if k.head_major else 'NHD'} "
                         f"{kv_heads} heads, V {'HND' if v.head_major else 'NHD'} {v.kv_heads}")
    qpk = q_heads // kv_heads
    block_h = max(16, triton.next_power_of_2(qpk))
    kivi_pair = precision == "fast" and k.kind == "int_k" and v.kind == "int_v"
    if value_rows is None:
        value_rows = default_value_rows(precision, v.kind, qpk, head_dim, v.group, k.group if kivi_pair else 0)
    if value_rows and (precision != "fast" or v.kind != "int_v"):
        raise ValueError("value_rows needs KIVI values (int_v) and precision='fast'")
    hv = triton.next_power_of_2(qpk) if value_rows else 0  # rows per value group (0: rows are query heads)
    # the key-rows tile: 128 tokens (session 9), at 8 query heads per KV head the longest whose key rows fit 16
    # (session 17: 64 tokens at groups of 32)
    kr_tile = block_n or (kivi_key_rows_tile(hv, k.group) if hv == KIVI_SHORT_TILE_HEADS else 128)
    if key_rows is None:  # (an explicit key_tile=True keeps the key tiles)
        key_rows = (kivi_pair and bool(value_rows) and not key_tile and kr_tile is not None
                    and max(1, kr_tile // k.group) * hv <= 16)
    elif key_rows and not (kivi_pair and value_rows and not key_tile):
        raise ValueError("key_rows needs KIVI keys and values (int_k/int_v), precision='fast', value_rows and "
                         "key_tile off")
    if key_tile is None:  # where key rows are off
        key_tile = (precision == "fast" and k.kind == "int_k" and k.bits == 2 and kivi_key_words(k)
                    and not key_rows)
    if key_tile and (precision != "fast" or k.kind != "int_k" or not kivi_key_words(k)):
        raise ValueError("key_tile needs KIVI keys (int_k), precision='fast' and, for 2-bit codes, scale and zero "
                         "rows of contiguous float16 aligned to 4 elements")
    if key_rows and ptx_auto:  # KIVI codes by inline PTX on CUDA (H100: int4 358 -> 339 us, int2 315 -> 295)
        ptx_unpack = _nvidia_cuda(q)
    if value_rows:
        block_h = max(16, hv * (head_dim // v.group))
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    # FP4 block scales as one word per token (pipelined with the code tiles) where it measured faster:
    # NVFP4 -7%, MXFP4 with 64/2/3 tiles -12% (H200, bench/results/history/ab-h200-fp4-wide.log); E8M0 blocks
    # of 16 lost 9% without the PTX/bfloat16 tiles and won 26% with them (H100, history/ab-h100-mx-bf16.log)
    def wide(t: CacheTiles) -> bool:
        if wide_scale_loads is None:
            return wide_scales(t) and (t.kind == "nvfp4" or t.block == 32 or bool(ptx_unpack))
        return bool(wide_scale_loads) and wide_scales(t)

    wide_k, wide_v = wide(k), wide(v)
    if fp4_keys_by_token and k.kind not in ("mxfp4", "nvfp4"):
        raise ValueError("fp4_keys_by_token needs FP4 keys (mxfp4 or nvfp4 tiles)")
    kt4 = bool(fp4_keys_by_token)
    rotate_q = None
    q_dtype = q.dtype  # the split kernel's q: a rotated K's q' (float32, or bfloat16 where the keys meet it so)
    if k.rotation is not None:  # q' = butterflies(q * signs) in float32; 1 / (D C_D) goes into the softmax scale
        # fast mode, keys that meet q in bfloat16 (bf16 and KIVI keys): q' rounded once to bfloat16 by the rotation's
        # launch, which the split kernel's bfloat16 rounding of q then leaves as it is; KIVI key rows take q' * s from
        # that bfloat16 q' (the bound of a float32 q covers it: docs/rotation.md), as for an unrotated bfloat16 q.
        # H100: a float32 q costs the int4 key-rows loop 80 instructions per tile (+6%) and 3% of its time
        # (bench/results/ANALYSIS.md, session 24)
        q16 = precision == "fast" and k.kind in ("bf16", "int_k")
        rotate_q = (min(8, triton.next_power_of_2(q_heads)), q16)
        q_dtype = torch.bfloat16 if q16 else torch.float32
        sm_scale = sm_scale * rotation_vectors(k.rotation.seed, head_dim, q.device)[2]
    # defaults tuned on the H100 (bench/tune_decode.py; logs in bench/results/history/tune-h100-*.log): the
    # kernel's occupancy is limited by registers, so small programs (2 warps, 32-token tiles) win, except in
    # fast mode for bf16 (64-token tiles), E8M0 FP4 (64-token tiles, 4 warps; with PTX-unpacked bfloat16 tiles
    # and word-wide scales: 2 warps, 3 stages, history/ab-h100-mx-bf16.log), NVFP4 unpacked by PTX (64-token
    # tiles: bench/results/history/tune-h100-fp4-ptx.log) and FP8 on the H200 (64-token tiles, FP8_FAST_BLOCK_N)
    fast_e8m0 = precision == "fast" and k.kind == "mxfp4"
    fast_mx_ptx = fast_e8m0 and wide_k and bool(ptx_unpack)
    fast_nvfp4_ptx = precision == "fast" and k.kind == "nvfp4" and ptx_unpack
    # fast FP4 by block rows (``_fp4_block_rows``): rows (block, head) of each side must fill the 16 MMA rows and
    # stay <= 32 (the tensor cores' work grows with them: H100, bench/results/ANALYSIS.md, session 8)
    fp4_pair = precision == "fast" and k.kind in ("mxfp4", "nvfp4") and v.kind in ("mxfp4", "nvfp4")
    blocks = max(1, min(head_dim // k.block, head_dim // v.block)) if fp4_pair else 1
    blk_h = max(triton.next_power_of_2(qpk), 16 // blocks)
    blk_rows = max(head_dim // k.block, head_dim // v.block) * blk_h if fp4_pair else 0  # the larger side's rows
    if block_rows is None:
        block_rows = fp4_pair and not kt4 and blk_rows <= 32
    elif block_rows and (not fp4_pair or kt4):
        raise ValueError("block_rows needs FP4 keys and values (mxfp4/nvfp4 tiles), precision='fast' and "
                         "fp4_keys_by_token off")
    if block_rows:
        block_h = blk_h
    half_k, half_v = channel_halves_apply(head_dim, k.block if block_rows else 0, v.block if block_rows else 0,
                                          blk_h)
    if channel_halves and not block_rows:
        raise ValueError("channel_halves needs block_rows (FP4 keys and values in fast mode)")
    if channel_halves and not (half_k or half_v):
        raise ValueError("channel_halves needs a side of >= 32 block rows with an even number of blocks (here keys "
                         f"{(head_dim // k.block) * blk_h}, values {(head_dim // v.block) * blk_h} rows)")
    if channel_halves is False:
        half_k = half_v = False
    # value tiles as 16-bit words: only with block rows, value rows <= 32 (64 rows, 8 query heads per KV head with
    # NVFP4 at D 128, gave wrong results and an illegal address on the H100, not diagnosed), 2-byte aligned rows;
    # default where the value rows are fewer than D / 4 (the four value products then keep the warps along the
    # channels; mxfp4 at D 128: 193 -> 176 us on the H100, bench/results/history/ab-h100-session8-value-words.log)
    # or split into channel halves (with 32-token tiles and one warp: NVFP4 191 -> 184 us, fp4_e2m1 253 -> 237;
    # history/ab-h100-session12-value-words-halves.log)
    v_rows = (head_dim // v.block) * blk_h if block_rows else 0
    words_ok = (bool(block_rows) and v_rows <= 32
                and not (any(st % 2 for st in v.row_strides(v.fields[0])) or v.fields[0].data_ptr() % 2))
    if value_words is None:
        value_words = words_ok and (v_rows < head_dim // 4 or half_v)
    elif value_words and not words_ok:
        raise ValueError("value_words needs block_rows (FP4 keys and values in fast mode), at most 32 value rows "
                         f"(here {v_rows}) and value code rows aligned to 2 bytes")
    # block rows: 16 rows per product measured best with 64-token tiles and 2 warps (mxfp4 at 4 query heads per KV
    # head; NVFP4 by channel halves, 3 stages: 235 -> 195 us; mxfp4 at 8 by halves: 903 -> 774), 32 (one product)
    # and E8M0 blocks of 16 by halves (fp4_e2m1: 286 -> 261 us; 275 at 64 / 2) with 128-token tiles and 4 warps
    # (H100: bench/results/history/ab-h100-session8-fp4.log, ab-h100-session11-channel-halves-2.log)
    prod_rows = max((head_dim // k.block) * blk_h // (2 if half_k else 1),
                    (head_dim // v.block) * blk_h // (2 if half_v else 1)) if block_rows else 0
    # (at page size 1 fp4_e2m1 by halves measured 316 us at 128 / 4 and 290 at 64 / 2: ab-h100-session11-page1.log)
    e8m0_16_halves = half_v and v.kind == "mxfp4" and v.block == 16 and page_size > 1
    words_halves = bool(value_words) and half_v  # one warp, 32-token tiles (the value word products' layout
    # replicates them across the warps of a larger program: sm_90 SASS of 2 warps issues the 1-warp loop's MMAs)
    nvfp4_halves = half_k and half_v and k.kind == v.kind == "nvfp4" and not words_halves
    blk_wide = block_rows and (prod_rows > 16 or e8m0_16_halves) and not words_halves
    sms = _multiprocessors(str(q.device)) if q.is_cuda else 4  # the split count's and the merge's defaults
    # (NVIDIA only: 107 KB of shared memory per program, more than a ROCm compute unit has)
    bf16_wide = precision == "fast" and k.kind == v.kind == "bf16" and _nvidia_cuda(q)
    if block_n is None:
        if key_rows:
            block_n = kr_tile or 128
        elif bf16_wide:
            block_n = BF16_WIDE[0]
        elif words_halves:
            block_n = 32
        elif block_rows:
            block_n = 128 if blk_wide else 64
        elif fast_nvfp4_ptx and fp4_pair and k.kind == v.kind == "nvfp4":  # NVFP4 per element (rows over 32: 8
            # query heads per KV head at D 128): 128-token tiles (H200, head-major, 2 warps, 2 stages: 64 q / 8 KV
            # heads x 16,384 1,003.6 -> 945.9 us, 8 x 32,768 278.9 -> 264.4, 1 x 131,072 154.5 -> 149.3;
            # bench/results/ANALYSIS.md, session 27)
            block_n = 128
        elif precision == "fast" and k.kind == v.kind == "fp8" and _nvidia_cuda(q):  # per device (64 on the H200)
            block_n = fast_fp8_block_n(str(q.device))
        else:
            block_n = 64 if precision == "fast" and (fast_e8m0 or fast_nvfp4_ptx or k.kind == "bf16") else 32
    if key_rows:  # a tile holds whole KIVI token groups, or lies inside one
        if block_n % k.group and k.group % block_n:
            raise ValueError(f"with key_rows, block_n {block_n} must divide or be a multiple of the KIVI key group "
                             f"size {k.group}")
    elif k.kind == "int_k":  # a tile must lie inside one KIVI token group
        block_n = min(block_n, k.group)
        if k.group % block_n:
            raise ValueError(f"block_n {block_n} must divide the KIVI key group size {k.group}")
    kivi_words_ok = key_rows and head_dim >= 128 and block_n >= 32 and all(
        not (any(st % t.bits for st in t.row_strides(t.fields[0])) or t.fields[0].data_ptr() % t.bits)
        for t in (k, v))  # a word of eight codes is ``bits`` bytes
    if kivi_words is None:  # (H100, batch 32 x 8,192, with 3 stages: int4 264 -> 254 us, int2 226 -> 220); 4-bit
        # codes with 32 value rows (8 query heads per KV head) as bytes (64 q / 8 KV heads x 16,384: words 1,469 us,
        # bytes 1,294; int2 words 1,699, bytes 2,887)
        kivi_words = kivi_words_ok and not (k.bits == 4 and block_h > 16)
    if kivi_words:
        if not kivi_words_ok:
            raise ValueError("kivi_words needs key_rows, head_dim >= 128 (here "
                             f"{head_dim}), tiles of at least 32 tokens (here {block_n}) and code rows aligned to "
                             "their word (4 bytes for 4-bit codes, 2 for 2-bit)")
    two_bit_words = kivi_words and k.bits == v.bits == 2
    # KIVI key rows at 2 warps without a register cap, twice the resident programs and so about twice the splits:
    # with more than 16 head rows (8 query heads per KV head; H200, head-major: int2 words 64 q / 8 KV heads x 16,384
    # 1,315 -> 883 us, 8 x 32,768 347 -> 243, 1 x 131,072 189 -> 143; int4 bytes 1,038 -> 941, 278 -> 251, 151 -> 138;
    # session 27) and for 2-bit words (H200: at 4 query heads per KV head batch 32 x 8,192 205.4 -> 193.8 us, 128 x
    # 4,096 442.8 -> 382.9, 8 x 32,768 195.1 -> 190.5, 1 x 131,072 111.4 -> 108.2, session 28; at 2 and 1 query heads
    # per KV head, once their value products took one chunk per warp, 205.8 -> 184.7 and 216.7 -> 194.4 head-major,
    # token-major 234.4 -> 214.3 at 2 but 292.9 -> 311.6 at 1, against the 4-warp launch capped at 168 registers,
    # session 33; 4-bit words at 4 lost, 237.2 -> 278.7, session 28, and 222.0 -> 239.3 with a chunk per warp,
    # session 33; bench/results/ANALYSIS.md)
    kivi_two_warps = key_rows and (block_h > 16 or (two_bit_words and (qpk >= 2 or k.head_major)))
    if num_warps is None:
        num_warps = (1 if words_halves else BF16_WIDE[1] if bf16_wide else
                     4 if ((fast_e8m0 and not fast_mx_ptx and not block_rows) or blk_wide
                           or (key_rows and not kivi_two_warps)) else 2)
    if maxnreg is None and key_rows and _nvidia_cuda(q) and num_warps == 4 and (
            (two_bit_words and block_h <= 16) or (not kivi_words and k.bits == 4 and block_h > 16)):
        maxnreg = KIVI_KEY_ROWS_MAXNREG
    # KIVI key words' eight products per tile as two independent accumulation chains (even and odd code positions)
    # for 4-bit keys (H100, batch 32 x 8,192: int4 255.9 -> 249.6 us; int2 at its 168-register cap 211.3 -> 216.8:
    # one chain; bench/results/ANALYSIS.md, session 17)
    kch = (2 if kivi_words and k.bits == 4 else 1) if kivi_key_chains is None else int(kivi_key_chains)
    if kch not in (1, 2) or (kch == 2 and not kivi_words):
        raise ValueError(f"kivi_key_chains must be 1 or 2 (2 needs kivi_words), got {kivi_key_chains!r}")
    # the key words' value products batched in one chunk of tokens per warp: a warp holding two chunks holds two sets
    # of eight value accumulators (2-bit words at 2 warps and 128-token tiles, 4 chunks: 51 local stores at 255
    # registers, sm_90, triton 3.6; 2 chunks: none; bench/results/ANALYSIS.md, session 33)
    nch = ((min(num_warps, block_n // 32) if kivi_words else 1) if kivi_value_chunks is None
           else int(kivi_value_chunks))
    if kivi_value_chunks is not None and (not kivi_words or nch < 1 or nch & (nch - 1) or block_n // nch < 16
                                          or block_n % nch):
        raise ValueError(f"kivi_value_chunks must be a power of two leaving chunks of at least 16 tokens of the "
                         f"{block_n}-token tile, with kivi_words; got {kivi_value_chunks!r}")
    # a softmax state per value chunk (runs of 8 tokens, each warp's columns of the key product) for 4-bit key words
    # at 3-4 query heads per KV head (H200, session 35, with the joined row terms below: int4 at batch 32 x 8,192
    # head-major 215.6 -> 205.2 us, token-major 235.7 -> 209.9; 1 x 131,072 121.5 -> 115.3, 128 x 4,096 447.0 ->
    # 436.2; then the zero terms summed on the tensor cores: 205.2 -> 175.0, 210.2 -> 200.0, 114.2 -> 98.8; at 2
    # query heads per KV head 225.2 -> 236.7 and at 1 229.1 -> 247.6, 2-bit words 168.9 -> 182.3, runs of 1 or 32
    # tokens 232.4 / 232.9, all before that step: off; bench/results/ANALYSIS.md)
    csm_default = bool(kivi_words and key_rows) and k.bits == 4 and hv == 4 and nch > 1 and block_n % (8 * nch) == 0
    csm = (8 if csm_default else 0) if kivi_chunk_softmax is None else int(kivi_chunk_softmax)
    if csm and (not kivi_words or csm < 0 or csm & (csm - 1) or block_n % (csm * nch)):
        raise ValueError(f"kivi_chunk_softmax must be 0 or a power of two run of tokens dividing the tile into "
                         f"kivi_value_chunks runs, with kivi_words; got {kivi_chunk_softmax!r}")
    # the key rows' two row terms (2**-e, q . z) moved into the product's layout as one tensor: with a softmax state
    # per chunk (H200, session 35: int4 at batch 32 x 8,192 206.9 -> 205.2 us head-major, 211.0 -> 209.9
    # token-major) and for 2-bit key words in token-major pages at 4 query heads per KV head (183.9 -> 175.9: 7 -> 2
    # local stores); 2-bit words head-major lose (169.1 -> 177.1 us, 1 x 131,072 96.0 -> 99.8): off there, and not
    # measured elsewhere; bench/results/ANALYSIS.md
    rjoin = ((bool(csm) or (bool(kivi_words and key_rows) and k.bits == 2 and not k.head_major and hv == 4))
             if kivi_joined_row_terms is None else bool(kivi_joined_row_terms))
    if rjoin and not key_rows:
        raise ValueError("kivi_joined_row_terms needs key_rows (fast KIVI by token-group key rows)")
    # the key words' value codes as bfloat16 subnormals, where that measured faster (H200, session 36, 3 rounds, 4
    # query heads per KV head, batch 32 x 8,192): 2-bit words 169.2 -> 166.9 us head-major, 175.2 -> 170.5 token-major
    # (1 x 131,072: 96.3 -> 96.2, 101.4 -> 98.4); 4-bit words token-major (chunk states) 199.8 -> 196.6 (107.5 ->
    # 106.6); 4-bit words head-major lose, 175.1 -> 188.9 (99.4 -> 101.4): off, as everywhere not measured
    vsub = (bool(kivi_words) and hv == 4 and (v.bits == 2 or (bool(csm) and not k.head_major))
            if kivi_value_subnormal_codes is None else bool(kivi_value_subnormal_codes))
    if vsub and not kivi_words:
        raise ValueError("kivi_value_subnormal_codes needs kivi_words (KIVI codes read as words)")
    # KIVI value rows' per-token scales and zeros as one word per (slot, head) in token-major pages: there Triton
    # loads them two bytes at a time, outside the pipeline (sm_90, triton 3.6: int4 at 4 q heads per KV head, 8
    # LDG.E.U16 per tile; bench/results/ANALYSIS.md, session 33); head-major pages get vector loads without it
    vsw_ok = bool(value_rows) and kivi_value_scale_words_ok(v, head_dim)
    if kivi_value_scale_words and not vsw_ok:
        raise ValueError("kivi_value_scale_words needs KIVI value rows (value_rows) whose scales and zeros are 1, 2 "
                         "or 4 float16 groups per token, rows aligned to the word")
    vsw = ((vsw_ok and bool(key_rows) and not v.head_major) if kivi_value_scale_words is None
           else bool(kivi_value_scale_words))
    # each next tile's page ids read one step ahead (``page_ids_ahead``), so that Triton's pipeliner double-buffers
    # the code tiles at 3 stages (bench/results/ANALYSIS.md, session 32, H200, head-major unless said):
    # - NVFP4 by value words and channel halves (one warp, 32-token tiles), pages of more than one token, at 3
    #   stages: batch 32 x 8,192 152.7 -> 145.6 us, 8 x 32,768 152.7 -> 144.5, 1 x 131,072 83.5 -> 79.1, 128 x
    #   4,096 290.0 -> 273.1, token-major batch 32 159.8 -> 154.8; at page size 1 166.4 -> 168.7: off;
    # - the same launch of E8M0 blocks of 16 (fp4_e2m1) at 3 stages, every page size, with the E8M0 check's rerun
    #   reading its page ids in the step (with them ahead in both loops it spilled: 157.6 -> 161.2): batch 32 157.5
    #   -> 151.7, 1 x 131,072 85.6 -> 82.1, 128 x 4,096 301.8 -> 286.8, token-major 165.4 -> 163.0, page size 1
    #   168.7 -> 160.5;
    # - 4-bit KIVI key words without a register cap in head-major pages, at least 2 query heads per KV head, instead of
    #   ``kivi_pipeline`` (with which the pipeliner keeps no buffer: 289.9 us): batch 32 x 8,192 232.3 -> 222.0, 1 x
    #   131,072 129.8 -> 126.9, 8 x 32,768 229.6 -> 226.4, 128 x 4,096 484.1 -> 459.2, 2 query heads per KV head
    #   241.6 -> 235.4; 1 query head per KV head 230.3 -> 270.8, 2-bit words (spilling at 255 registers) 191.4 ->
    #   205.4: off. Token-major pages lost (265.7 -> 284.1) while their value scales were read two bytes at a time;
    #   with them as words (``kivi_value_scale_words``, session 33) they win at 4 query heads per KV head: batch 32 x
    #   8,192 264.1 -> 250.9, 1 x 131,072 144.4 -> 138.8; session 34: at 2 query heads per KV head 272.3 -> 243.9
    #   (1 x 131,072 147.0 -> 138.7), at 1 247.5 -> 268.4 (off);
    # - 2-bit KIVI key words (2 warps, uncapped) in token-major pages with their value scales as words, 2 or 4 query
    #   heads per KV head (session 34, batch 32 x 8,192: 192.1 -> 183.6 us at 4, 182.5 -> 181.3 at 2; 1 x 131,072
    #   at 4 109.6 -> 104.9; head-major pages lost at 4, 169.0 -> 172.2, session 33).
    # FP8 (fewer programs fit: 143.0 -> 156.3) and mxfp4 lost.
    kivi_words_uncapped = bool(key_rows and kivi_words) and maxnreg is None
    kivi_words4 = kivi_words_uncapped and k.bits == 4
    kivi_ahead = (kivi_words_uncapped and qpk >= 2 and block_h <= 16
                  and ((kivi_words4 and k.head_major) or (vsw and not k.head_major)))
    # the FP4 pairs whose value-word halves launch can read its page ids ahead: NVFP4, and E8M0 blocks of 16
    # (fp4_e2m1)
    words_ahead_pair = k.kind == v.kind == "nvfp4" or (k.kind == v.kind == "mxfp4" and k.block == v.block == 16)
    # (H100, session 38, batch 32 x 8,192 head-major, the KV heads on the grid's fastest axis: fp4_e2m1 at page size 1
    # 182.1 -> 171.4 us without them, as NVFP4 there; bench/results/ANALYSIS.md 262)
    if page_ids_ahead is None:
        page_ids_ahead = ((words_halves and words_ahead_pair and num_stages in (None, 3) and page_size > 1)
                          or (kivi_ahead and not kivi_pipeline))
    words_ahead = bool(page_ids_ahead) and words_halves and words_ahead_pair
    # the key-rows loop pipelined by one tile for 4-bit key words without a register cap (H100: int4 at batch 32 x
    # 8,192 248.7 -> 238.1 us, batch 1 x 131,072 136.7 -> 134.8; 2-bit words at their 168-register cap 212.6 -> 234.5,
    # 4-bit bytes at 8 query heads per KV head (capped) 1,060 -> 1,265: off; bench/results/ANALYSIS.md, session 18);
    # since session 32 their page ids read ahead instead where that measured faster (above)
    kpipe = (kivi_words4 and not page_ids_ahead) if kivi_pipeline is None else bool(kivi_pipeline)
    if kpipe and not key_rows:
        raise ValueError("kivi_pipeline needs key_rows (fast KIVI by token-group key rows)")
    spg_ok = (bool(kivi_words) and bool(page_ids_ahead) and not kpipe and block_n <= 4 * page_size
              and (block_n % page_size == 0 or page_size % block_n == 0))
    # (H200, session 36, 3 rounds, batch 32 x 8,192 at 4 query heads per KV head: 4-bit words in token-major pages,
    # with chunk states, 196.1 -> 190.7 us; head-major 174.8 -> 216.1 and 2-bit words token-major 169.6 -> 181.8
    # lose: their loops gain more selecting instructions than they lose barriers; elsewhere not measured)
    spg = ((spg_ok and k.bits == 4 and not k.head_major and bool(csm) and hv == 4) if kivi_scalar_page_ids is None
           else bool(kivi_scalar_page_ids))
    if spg and not spg_ok:
        raise ValueError("kivi_scalar_page_ids needs kivi_words and page_ids_ahead without kivi_pipeline, and tiles "
                         f"within 4 pages, whole or inside one (tile {block_n}, page {page_size})")
    # key codes as float16 subnormals for 2-bit keys (H100, 3 rounds: int2 at batch 32 x 8,192 244.1 -> 233.4 us, 128 x
    # 4,096 535.1 -> 519.4; int4 unchanged there, 275.5 -> 275.7, and 1,297 -> 1,329 at 64 query heads; session 21)
    # and for 4-bit keys in head-major pages (H200, session 29, today's kernels: int4 at batch 32 x 8,192 237.9 ->
    # 234.0 us, 1 x 131,072 131.7 -> 130.5, 128 x 4,096 491.3 -> 484.2, 64 q / 8 KV heads 938.1 -> 903.2; token-major
    # 266.3 -> 265.2 at batch 32 but 1,084.6 -> 1,119.0 at 64 query heads: off; bench/results/ANALYSIS.md)
    # and for 4-bit keys with a softmax state per value chunk in token-major pages (H200, session 35: batch 32 x 8,192
    # 219.6 -> 214.1 us, 1 x 131,072 121.0 -> 120.0; without the chunks' states 234.2 -> 232.2 and 126.8 -> 120.7,
    # at 2 query heads per KV head 232.8 -> 234.7)
    ksub = (bool(key_rows and (k.bits == 2 or (k.bits == 4 and (k.head_major or csm))))
            if kivi_subnormal_codes is None else bool(kivi_subnormal_codes))
    e8m0_sides = [t for t in (k, v) if t.kind == "mxfp4"]
    e8m0_check_ok = bool(block_rows) and bool(e8m0_sides) and all(wide(t) for t in e8m0_sides)
    if e8m0_tile_check and not e8m0_check_ok:
        raise ValueError("e8m0_tile_check needs block_rows with E8M0 (mxfp4) scales read as words (wide_scale_loads)")
    # default: one-warp value words by channel halves (H200, session 26: fp4_e2m1 162.5 -> 157.5 us at batch 32 x
    # 8,192, mxfp4 at 64 query heads 299.5 -> 270.8), and since session 41 mxfp4's two-warp block rows (blocks of 32
    # on both sides, no channel halves) at E8M0_TWO_WARP_MAXNREG registers, where the check carries the float16 value
    # products (at 128 registers the check spills its second loop: session 26 measured 0.5-2% slower, session 41 4 of
    # 7 shapes slower; fp4_e2m1's such launch, 1 query head per KV head, 147.3 -> 151.7 us at 168: off there)
    mx_rows = bool(block_rows) and k.kind == v.kind == "mxfp4" and not (words_halves or blk_wide or half_k or half_v)
    mx32_rows = mx_rows and k.block == v.block == 32
    e8m0_check = ((e8m0_check_ok and (words_halves or mx32_rows)) if e8m0_tile_check is None
                  else bool(e8m0_tile_check))
    ev16_ok = e8m0_check and v.kind == "mxfp4"
    if e8m0_values_f16 and not ev16_ok:
        raise ValueError("e8m0_values_f16 needs e8m0_tile_check (block_rows, E8M0 scales as words) and E8M0 values")
    ev16 = ev16_ok if e8m0_values_f16 is None else bool(e8m0_values_f16)
    if key_products_transposed and not block_rows:
        raise ValueError("key_products_transposed needs block_rows (fast FP4 keys and values by block rows)")
    # default: two-warp block rows (64-token tiles, no value words by halves) and NVFP4 keys' one-warp value words by
    # channel halves (H100, session 42, head-major, bench/results/ANALYSIS.md 278). Two-warp rows: mxfp4 at 4 query
    # heads per KV head, batch 32 x 8,192 135.6 -> 132.3 us (token-major 151.4 -> 144.6; page size 1 143.5 -> 142.6;
    # 128 x 4,096 259.5 -> 257.8; 1 x 131,072 82.0 -> 82.0), at 1 query head per KV head mxfp4 142.7 -> 133.4,
    # fp4_e2m1 146.4 -> 141.1, nvfp4 146.3 -> 146.6. NVFP4 by halves (4 per KV head): 147.9 -> 144.7 (page size 1
    # 168.2 -> 160.2; 128 x 4,096 267.7 -> 263.2; 1 x 131,072 85.4 -> 84.6). E8M0 by halves lose: fp4_e2m1 at 4 per
    # KV head 148.2 -> 149.2 (slower at 5 of 6 shapes), mxfp4 at 8 85.9 -> 86.4; 4-warp rows not measured: off
    two_warp_rows = bool(block_rows) and not (words_halves or blk_wide)
    kpt_default = two_warp_rows or (words_halves and k.kind == "nvfp4")
    kpt = kpt_default if key_products_transposed is None else bool(key_products_transposed)
    # E8M0 scales as exponent fields straight from the scale words (``E8F_K``, ``E8F_V``): with the tile check, on
    # each E8M0 side of 4 blocks, or of 4 or 8 by channel halves (each product's blocks in one 32-bit half of the
    # word); default there
    # (H200, session 42: faster or the same at 6 shapes for fp4_e2m1 and mxfp4; bench/results/ANALYSIS.md 283)
    e8f_k, e8f_v = (e8m0_check and t.kind == "mxfp4" and head_dim // t.block in ((4, 8) if half else (4,))
                    for t, half in ((k, half_k), (v, half_v)))
    if e8m0_scale_fields and not (e8f_k or e8f_v):
        raise ValueError("e8m0_scale_fields needs e8m0_tile_check and an E8M0 side of 4 blocks, or of 4 or 8 by "
                         "channel halves (each product's blocks in one 32-bit half of its scale word)")
    if e8m0_scale_fields is False:
        e8f_k = e8f_v = False
    # q's block rows read so that ptxas moves fewer registers before the key products (``QLD``; H100, session 43:
    # bench/results/ANALYSIS.md 286). Transposed loads for E8M0 value words by halves (fp4_e2m1 at 4 query heads per
    # KV head 147.1 -> 145.1 us), contiguous ones for NVFP4's (147.9 -> 146.1) in pages of more than one token (at
    # page size 1 they lost, 160.4 -> 168.5 us: ANALYSIS 288); elsewhere they lose or tie
    q_loads = {"strided": 0, "transposed": 1, "contiguous": 2}
    if q_rows_load is not None and (q_rows_load not in q_loads or not block_rows):
        raise ValueError(f"q_rows_load must be one of {sorted(q_loads)} and needs block_rows (fast FP4 keys and values "
                         f"by block rows); got {q_rows_load!r}")
    qld_default = ("contiguous" if words_halves and k.kind == "nvfp4" and page_size > 1 else
                   "transposed" if words_halves and not kpt else "strided")
    qld = q_loads[q_rows_load or qld_default] if block_rows else 0
    # per-element FP4 tiles as [bytes, tokens] with each byte's scale code from its token's scale word (``T2D``): no
    # reshape of [blocks, bytes, tokens] tiles before the product, so fewer, wider shared-memory stores. Default for
    # E8M0 tiles built by PTX (H200, fp4_e2m1 at 64 q / 8 KV heads, head-major: 64 x 16,384 1,019.6 -> 902.1 us, 8 x
    # 32,768 281.1 -> 247.5, 1 x 131,072 156.1 -> 137.1; token-major 1,198.0 -> 930.0; the same bits:
    # bench/results/ANALYSIS.md, session 29); NVFP4's lose (H200, head-major: 64 x 16,384 947.9 -> 1,045.0 us, 8 x
    # 32,768 264.5 -> 284.8, 1 x 131,072 149.2 -> 158.0; session 30) and the float32 routes are not measured: off
    fp4_sides = [t for t in (k, v) if t.kind in ("mxfp4", "nvfp4")]
    t2d_ok = not block_rows and not key_rows and bool(fp4_sides) and all(wide(t) for t in fp4_sides)
    if fp4_tiles_2d and not t2d_ok:
        raise ValueError("fp4_tiles_2d needs per-element FP4 tiles (no block_rows or key_rows) with their block scales "
                         "read as words (wide_scale_loads)")
    t2d = (t2d_ok and precision == "fast" and bool(ptx_unpack) and all(t.kind == "mxfp4" for t in fp4_sides)
           if fp4_tiles_2d is None else bool(fp4_tiles_2d))
    if ksub and not key_rows:
        raise ValueError("kivi_subnormal_codes needs key_rows (fast KIVI by token-group key rows)")
    # fp4_e2m1 (E8M0 blocks of 16) by value words and channel halves, pages of more than one token: 3 stages (H100,
    # batch 32 x 8,192: head-major 170.3 -> 167.2 us, token-major 183.7 -> 178.6; batch 1 x 131,072 93.7 -> 92.3;
    # NVFP4 the same launch 159.6 -> 160.2: 2 stay; bench/results/ANALYSIS.md, session 25)
    e8m0_16_words = e8m0_16_halves and words_halves and k.kind == "mxfp4" and k.block == 16
    # mxfp4 by block rows at 2 warps and 64-token tiles: 3 stages (H200, head-major: batch 32 x 8,192 149.2 ->
    # 147.0 us, 8 x 32,768 148.8 -> 147.4, 128 x 4,096 283.7 -> 276.4, 1 x 131,072 83.3 -> 82.6, page size 1 157.3
    # -> 156.0; token-major batch 32 153.1 -> 150.4; fp4_e2m1's such launch at 1 query head per KV head, 32 x 8,192:
    # 152.3 -> 150.4, mxfp4 150.1 -> 148.2; one buffer per code tile still; session 32; the same launch at other
    # head dims not measured)
    if num_stages is None:
        wide_stages = nvfp4_halves or kivi_words or bf16_wide or e8m0_16_words or words_ahead or mx_rows
        num_stages = 3 if wide_stages else 2 if block_rows or key_rows else (
            3 if k.kind in ("fp8", "int_k") or fast_mx_ptx or (precision == "fast" and k.kind == "nvfp4"
                                                                and not ptx_unpack) else 2)
    hw = hardware_fp8_formats(q.device) if hw_formats is None else hw_formats
    # fast FP8 (formats converted in hardware) and mxfp4 by block rows at 2 warps on NVIDIA: 8 programs per
    # multiprocessor (TWO_WARP_MAXNREG)
    two_warp_capped = (num_warps == 2 and precision == "fast" and _nvidia_cuda(q) and (
        (k.kind == v.kind == "fp8" and k.fmt in hw and v.fmt in hw)
        or (bool(block_rows) and k.kind == v.kind == "mxfp4" and block_n == 64 and not words_halves)))
    if maxnreg is None and two_warp_capped:
        maxnreg = E8M0_TWO_WARP_MAXNREG if e8m0_check and mx32_rows else TWO_WARP_MAXNREG
    elif maxnreg is None and e8m0_check and words_halves and _nvidia_cuda(q):
        maxnreg = WORDS_HALVES_MAXNREG  # (triton 3.6, sm_90: fp4_e2m1 242 registers uncapped, 168 without spills)
    has_res = has_residual
    # FP8 values as 16-bit words of two channels (``VW8``): transposed 16-bit matrix loads instead of one-byte shared
    # loads for the value products (:func:`_fp8_word_halves`)
    fp8_words_ok = (v.kind == "fp8" and not v.token_scale and not has_res and head_dim % 2 == 0
                    and not (any(st % 2 for st in v.row_strides(v.fields[0])) or v.fields[0].data_ptr() % 2))
    if fp8_value_words is None:  # where measured (H100, batch 32 x 8,192: fp8_e4m3 207.1 -> 200.6 us, exact mode
        # 237.1 -> 228.3, token-major 215.7 -> 210.8; bench/results/ANALYSIS.md, session 16)
        fp8_value_words = fp8_words_ok and _nvidia_cuda(q)
    elif fp8_value_words and not fp8_words_ok:
        raise ValueError("fp8_value_words needs FP8 values without token scales (no residual window), an even "
                         "head_dim and value code rows aligned to 2 bytes")
    # their halves by inline PTX (VW8 = 2) on CUDA by default, or as ``ptx_unpack`` says where it is given
    ptx_words = _nvidia_cuda(q) if ptx_auto else bool(ptx_unpack)
    vw8 = (2 if ptx_words and v.fmt in hw and v.fmt in (0, 1) else 1) if fp8_value_words else 0
    if num_splits is None:
        # FP8 and mxfp4 at 2 warps with fewer KV pairs than multiprocessors (long contexts, few sequences): the
        # split count with the fewest tile steps, whole waves times tiles per split (session 44: one wave of long
        # splits beat two of half as long; with more pairs the split count is too coarse to hit them: ANALYSIS.md,
        # session 12)
        two_warp_waves = (num_warps == 2 and precision == "fast" and batch * kv_heads < sms
                          and (k.kind == v.kind == "fp8" or (bool(block_rows) and k.kind == v.kind == "mxfp4")))
        # the KIVI key rows and the fast bf16 launch (``BF16_WIDE``): whole waves of the programs resident at once
        bf16_waves = bf16_wide and (block_n, num_warps, num_stages) == BF16_WIDE
        num_splits, per = choose_splits(batch, kv_heads, max_seq_len, block_n, sms,
                                        key_rows_resident(num_warps, maxnreg) if key_rows else
                                        BF16_WIDE_RESIDENT if bf16_waves else None,
                                        WORDS_HALVES_RESIDENT if words_halves else
                                        two_warp_resident(maxnreg) if two_warp_waves else None,
                                        wave_tiles=two_warp_waves)
        # FP8, bf16 and FP4 without block rows at 2 warps with at least as many KV pairs as multiprocessors: the
        # fewest splits that fill whole waves, where that is fewer than the default (H100, fp8: batch 32 x 8,192
        # 220.7 -> 214.3 us at 3 splits, 64 x 8,192 452.2 -> 409.9, 64 x 64 heads x 16,384 875.8 -> 798.9; bf16 batch
        # 32 385.0 -> 376.5 at 5; at batch 128, 5 splits instead of 3 lost 2.5 us; nvfp4 at 64 heads 1030.6 -> 983.6
        # at 3, fp4_e2m1 1064.8 -> 1050.9: bench/results/ANALYSIS.md, session 15); mxfp4 by block rows too (8 resident
        # at TWO_WARP_MAXNREG: batch 32 x 8,192 169.1 -> 163.1 us at 4 splits instead of 9, 64 x 8,192 321.7 -> 312.5
        # at 2 instead of 5, 128 x 4,096 327.4 -> 315.0 at 1 instead of 3: ANALYSIS.md, session 22)
        if num_warps == 2 and precision == "fast" and batch * kv_heads >= sms and not key_rows:
            fill = (two_warp_resident(maxnreg) if k.kind == v.kind == "fp8" or k.kind == v.kind == "mxfp4" or (
                        k.kind == v.kind == "nvfp4" and not block_rows) else
                    BF16_TWO_WARP_RESIDENT if k.kind == v.kind == "bf16" else None)
            if fill is not None:
                num_splits, per = min((num_splits, per),
                                      choose_splits(batch, kv_heads, max_seq_len, block_n, sms, fill))
    else:
        per = -(-max(max_seq_len, 1) // num_splits)
        per = -(-per // block_n) * block_n
    total = num_splits + int(has_res)
    direct_ok = total == 1
    if direct_output and not direct_ok:
        raise ValueError(f"direct_output needs one split and no residual window (here {num_splits} splits, "
                         f"residual {has_res})")
    direct = direct_ok if direct_output is None else bool(direct_output)
    pdl_ok = pdl_supported(q)
    if pdl and not pdl_ok:
        raise ValueError("pdl (programmatic dependent launch) needs an NVIDIA GPU of compute capability 9.0 or newer")
    gdc = not direct and (pdl_ok if pdl is None else bool(pdl))
    pids_ahead = bool(page_ids_ahead)
    # one token per page: the KV heads' programs of one (sequence, split) side by side read each page's scale rows
    # (8 bytes per head for fp4_e2m1, 32-byte sectors) while they are in L2 (H100, session 38, batch 32 x 8,192
    # head-major: fp4_e2m1 188.4 -> 182.3 us, NVFP4 180.6 -> 169.4, mxfp4 175.8 -> 163.8, fp8 210.6 -> 204.8, bf16
    # 375.7 -> 375.5; pages of 2, 4, 8 tokens within 1%; bench/results/ANALYSIS.md 262)
    heads_fast = page_size == 1 if heads_fast is None else bool(heads_fast)
    grid = (kv_heads, batch, total) if heads_fast else (batch, kv_heads, total)
    split_cx = dict(
        QPK=qpk,
        BLOCK_H=block_h,
        D=head_dim,
        PAGE=page_size,
        PAGE_SLOTS=k.page_slots(page_size),
        BLOCK_N=block_n,
        KIND_K=KIND_IDS[k.kind],
        FMT_K=k.fmt + 8 * (k.kind in ("fp8", "nvfp4") and k.fmt in hw),
        TSC_K=k.token_scale,
        QB_K=k.block,
        G_K=k.group,
        BITS_K=k.bits,
        KIND_V=KIND_IDS[v.kind],
        FMT_V=v.fmt + 8 * (v.kind in ("fp8", "nvfp4") and v.fmt in hw),
        TSC_V=v.token_scale,
        QB_V=v.block,
        G_V=v.group,
        BITS_V=v.bits,
        HAS_RES=has_res,
        Q_SPLIT=q_dtype != torch.bfloat16,
        KT=k_transposed,
        FAST=precision == "fast",
        PTX=ptx_unpack,
        WSC_K=wide_k,
        WSC_V=wide_v,
        HV=hv,
        KT4=kt4,
        KTILE=bool(key_tile),
        HF=heads_fast,
        BLK=bool(block_rows),
        VW=bool(value_words),
        KR=bool(key_rows),
        KW=bool(kivi_words),
        KCH=kch,
        NCH=nch,
        CSM=csm,
        RJOIN=rjoin,
        VSUB=vsub,
        SPG=spg,
        VSW=vsw,
        KPIPE=kpipe,
        KSUB=ksub,
        HALF_K=half_k,
        HALF_V=half_v,
        E8M0_CHECK=e8m0_check,
        EV16=ev16,
        KPT=kpt,
        E8F_K=e8f_k,
        E8F_V=e8f_v,
        QLD=qld,
        PART=0,  # 0: the paged and residual splits in one launch (``residual_launch`` makes 1 and 2)
        BLOCK_R=min(block_n, 32) if key_rows else 0,  # residual tiles: 32 tokens (128 measured 188 KB of shared memory)
        VW8=vw8,
        DIRECT=direct,
        ROT_V=direct and v.rotation is not None,
        T2D=t2d,
        GDC=False,  # set on the last split launch where the merge depends on it (``pdl``)
        PIDS_AHEAD=pids_ahead,
    )
    merge_cx = dict(D=head_dim, S_PAD=max(2, triton.next_power_of_2(total)), ROT_V=v.rotation is not None)
    opts = {"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    if residual_launch is None:
        residual_launch = bool(key_rows) and has_res
    elif residual_launch and not has_res:
        raise ValueError("residual_launch needs a residual window")
    if residual_launch:  # the paged splits without the residual path's registers; the residual split on its own
        res_grid = (kv_heads, batch, 1) if heads_fast else (batch, kv_heads, 1)
        splits = (((*grid[:2], num_splits), {**split_cx, "PART": 1}, opts),
                  (res_grid, {**split_cx, "PART": 2, "GDC": gdc}, {**opts, "num_warps": 2, "num_stages": 3}))
    else:  # (the merge depends on the last split launch only: stream order covers the one before it)
        splits = ((grid, {**split_cx, "GDC": gdc}, opts),)
    if merge_channels is None:
        mdb = merge_channels_default(batch * q_heads, sms, head_dim, v.rotation is not None)
    else:
        mdb = int(merge_channels)
    if mdb <= 0 or head_dim % mdb or mdb & (mdb - 1) or (mdb < head_dim and v.rotation is not None):
        raise ValueError(f"merge_channels must be a power of two dividing head_dim {head_dim} (all of it with a "
                         f"rotated V), got {merge_channels!r}")
    merge_cx["DB"] = mdb
    merge_opts = {"num_warps": int(merge_warps) if merge_warps else merge_warps_default(merge_cx["S_PAD"], mdb),
                  **({"launch_pdl": True} if gdc else {})}
    merge_cx["GDC"] = gdc
    merge = None if direct else ((batch, q_heads, head_dim // mdb), merge_cx, merge_opts)
    return DecodePlan(rotate_q, float(sm_scale), num_splits, per, total, splits, merge)


def bind_decode_plan(plan: DecodePlan, q, k: CacheTiles, v: CacheTiles, block_table, seq_lens, residual=None):
    """The launches of ``plan`` (made by :func:`choose_decode_plan` for these tensors' shapes, strides, dtypes and
    device) over these tensors, with the output tensors they write: (launches, out, lse)."""
    import torch

    batch, q_heads, head_dim = q.shape
    handles = iter(plan.handles) if plan.handles else itertools.repeat(None)  # in launch order
    rotate_q = []
    if plan.rotate_q is not None:  # q' = butterflies(q * signs), then q' is the split kernel's q
        rows, q16 = plan.rotate_q
        signs = rotation_vectors(k.rotation.seed, head_dim, q.device)[0]
        qr = torch.empty(batch, q_heads, head_dim, dtype=torch.bfloat16 if q16 else torch.float32, device=q.device)
        rotate_q.append(Launch(rotate_q_kernel, (batch, triton.cdiv(q_heads, rows)),
                               [q, signs, qr, q_heads, q.stride(0), q.stride(1)], dict(D=head_dim, ROWS=rows), {},
                               next(handles)))
        q = qr
    if residual is not None:
        rk, rv, kl, vl = residual
    else:
        rk = rv = _unused_residual(str(q.device))  # a pointer the kernel never reads without HAS_RES
        kl = vl = seq_lens
    sm_scale, num_splits, per, total = plan.sm_scale, plan.num_splits, plan.per, plan.total
    out = torch.empty(batch, q_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, q_heads, dtype=torch.float32, device=q.device)
    if plan.merge is None:  # the split kernel writes out and lse: [B, Hq, 1, D] and [B, Hq, 1] views (the split
        op, lp = out.unsqueeze(2), lse.unsqueeze(2)  # axis unused)
    else:
        op = torch.empty(batch, q_heads, total, head_dim, dtype=torch.float32, device=q.device)
        lp = torch.empty(batch, q_heads, total, dtype=torch.float32, device=q.device)
    # V's un-rotation (the merge kernel's, or with one split the split kernel's): v_signs / (D C_D); unread otherwise
    vsq = lp if v.rotation is None else rotation_vectors(v.rotation.seed, head_dim, q.device)[1]
    split_args = [
        q,
        block_table,
        seq_lens,
        kl,
        vl,
        *k.field_args(),
        *v.field_args(),
        rk,
        rv,
        k.tensor_scale,
        v.tensor_scale,
        op,
        lp,
        float(sm_scale),
        num_splits,
        per,
        q.stride(0),
        q.stride(1),
        block_table.stride(0),
        *k.stride_args(),
        *v.stride_args(),
        rk.stride(0),
        rk.stride(1),
        rk.stride(2),
        op.stride(0),
        op.stride(1),
        op.stride(2),
        lp.stride(0),
        lp.stride(1),
        vsq,
    ]
    merge_args = [
        op,
        lp,
        out,
        lse,
        total,
        op.stride(0),
        op.stride(1),
        op.stride(2),
        lp.stride(0),
        lp.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        vsq,
    ]
    splits = [Launch(decode_split_kernel, grid, split_args, dict(cx), dict(opts), next(handles))
              for grid, cx, opts in plan.splits]
    merge = [] if plan.merge is None else [Launch(merge_kernel, plan.merge[0], merge_args, dict(plan.merge[1]),
                                                  dict(plan.merge[2]), next(handles))]
    return [*rotate_q, *splits, *merge], out, lse


#: decode plans by :func:`decode_plan_key` (:func:`plan_decode`)
_PLANS = KeptPlans()
#: how many plans :func:`plan_decode` keeps (one per model shape and batch composition in a serving loop)
PLAN_CACHE_SIZE = 256


def clear_plan_cache() -> None:
    """Forget every cached decode plan (:func:`plan_decode`)."""
    _PLANS.forget()


def _tensor_key(t) -> tuple:
    """What a plan may read of tensor ``t``: shape, strides, dtype, and its address modulo 16 (alignment)."""
    return tuple(t.shape), t.stride(), t.dtype, t.data_ptr() % 16


def decode_plan_key(q, k: CacheTiles, v: CacheTiles, block_table, seq_lens, page_size: int, residual,
                    max_seq_len: int, options: dict) -> tuple:
    """The key of a decode plan: everything :func:`choose_decode_plan` reads, the tensors' shapes, strides, dtypes
    and alignment, the options, and the device's facts it asks for (NVIDIA or not, multiprocessors, FP8 tiles by the
    device's name, programmatic dependent launch, FP8 formats in hardware); raises TypeError for an option that
    cannot be a key (a list)."""
    device = str(q.device)
    nvidia = _nvidia_cuda(q)
    fp8_tile = (fast_fp8_block_n(device) if nvidia and k.kind == v.kind == "fp8" and options.get("block_n") is None
                and options.get("precision", "fast") == "fast" else 0)  # (the device's name, where asked for)
    env = (device, nvidia, _multiprocessors(device) if q.is_cuda else 4, fp8_tile, pdl_supported(q),
           frozenset(hardware_fp8_formats(q.device)), INTERPRET)
    res = None if residual is None else tuple(_tensor_key(t) for t in residual)
    opts = tuple(sorted((n, frozenset(o) if isinstance(o, set) else o) for n, o in options.items()))
    key = (env, _tensor_key(q), k.plan_key(), v.plan_key(), _tensor_key(block_table), _tensor_key(seq_lens),
           int(page_size), res, int(max_seq_len), opts)
    hash(key)
    return key


def plan_decode(q, k: CacheTiles, v: CacheTiles, block_table, seq_lens, page_size: int, *, residual=None,
                max_seq_len: int | None = None, cache: bool = True, **options: Any):
    """The launches of decode attention (see :func:`paged_decode`), with their output tensors: (launches, out,
    lse). ``options`` are :func:`choose_decode_plan`'s (``sm_scale``, ``block_n``, ``num_splits``, ...).

    The plan depends only on shapes, strides, dtypes, alignment, the device and the options (plus ``max_seq_len``,
    the longest sequence, taken from ``seq_lens`` by a device sync where not given), so with ``cache`` (default) it
    is made once per :func:`decode_plan_key` and kept (the last :data:`PLAN_CACHE_SIZE`), as FlashInfer's ``plan``
    serves every ``run`` of a batch: an eager decode call then spends its host time on the launches, not on
    choosing them (``bench/host_overhead.py``). The tuning constants of this module are read when a plan is made:
    :func:`clear_plan_cache` after changing one."""
    if max_seq_len is None:  # (a device sync: callers in a hot loop pass it)
        max_seq_len = int(seq_lens.max().item()) if seq_lens.numel() else 0
    key = (KeptPlans.key_of(decode_plan_key, q, k, v, block_table, seq_lens, page_size, residual, max_seq_len,
                            options) if cache else None)
    plan = _PLANS.serve(key)
    if plan is None:
        plan = choose_decode_plan(q, k, v, page_size, has_residual=residual is not None, max_seq_len=max_seq_len,
                                  **options)
        if key is not None:  # a kept plan launches its compiled kernels directly after its first call
            launches = (plan.rotate_q is not None) + len(plan.splits) + (plan.merge is not None)
            plan = plan._replace(handles=tuple(LaunchHandle() for _ in range(launches)))
            _PLANS.keep(key, plan, PLAN_CACHE_SIZE)
    return bind_decode_plan(plan, q, k, v, block_table, seq_lens, residual)


def paged_decode(q, k: CacheTiles, v: CacheTiles, block_table, seq_lens, page_size: int, **kw):
    """Decode attention for q [batch, q_heads, D] over a paged cache; returns (out [B, Hq, D] float32,
    lse [B, Hq] float32, natural log).

    ``residual``: KIVI's full-precision tail, ``(k_res [B, W, Hkv, D] f32, v_res, k_lens [B], v_lens [B])``:
    token t of K is read from the pages while t < k_lens[b], else from ``k_res[b, t - k_lens[b]]`` (same
    for V); tensor scales must then be 1. ``precision``: ``"fast"`` (default; q and the probabilities
    rounded once to 16 bits, KIVI and residual tiles to about 16 bits) or ``"exact"`` (float32 products);
    docs/kernels.md derives each one's error bound. Other keywords: ``sm_scale``, ``block_n``,
    ``num_splits``, ``max_seq_len``, ``num_warps``, ``num_stages`` (see :func:`plan_decode`).
    """
    launches, out, lse = plan_decode(q, k, v, block_table, seq_lens, page_size, **kw)
    for launch in launches:
        launch()
    return out, lse
