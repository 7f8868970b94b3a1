"""Probe: KIVI (int2 / int4) decode split kernel in Gluon (explicit layouts, CUDA sm_80+).

The Triton kernel's KIVI tile loops run at 1.6-2.6x their bytes floor with issue floors below it (bench/results/
ANALYSIS.md 294): what they lose is overlap, with layout conversions through shared memory between the code loads and
the tensor-core operands. As :mod:`gluon_fp4_probe` does for FP4, this kernel states the layouts so that the code
bytes land in the registers the ``mma.sync`` operands use, with the fast mode's arithmetic (docs/kernels.md):

* one warp per (sequence, KV head, split), tiles of 32 tokens = one head-major page = one key group; 4 query heads
  per KV head, head_dim 128, value groups of 32 channels;
* keys: thread (lane % 4 = t) reads the 32 channels 32 t .. 32 t + 31 of its tokens (8 bytes for 2-bit codes,
  16 for 4-bit); each code goes to the B operand as a float16 subnormal ``code * 4**pos * 2**-24`` (``pos`` where
  the mask finds it in its half-word: :func:`key_codes_ptx`), the product's K axis relabelled to m16n8k16's B
  fragment; the key rows ``q_d s_d 2**E 4**-pos`` rounded once to float16 per (head, group), E putting the row's
  largest in [2**14, 2**15), as the Triton kernel's key rows; the zero term ``sum_d q_d z_d`` in float32;
* rows of both products are (value group, head): 4 x 4 = 16, so the key rows repeat each head's q 4 times (the score
  tile arrives with the rows the value product wants) and the value rows are ``p s_v`` of their group, rounded once
  to bfloat16 against the codes as bfloat16 subnormals ``code * 4**pos * 2**-133``; the value zero term ``p z_v``
  accumulates in float32;
* values: thread (lane // 4 = g) reads channels 16 g .. 16 g + 15 of its tokens 2 t + e + 8 h + 16 c; the two
  tokens of an operand register are interleaved by ``prmt`` before the masks (:func:`value_codes_ptx`);
* FlashAttention 4's conditional rescale (threshold 8), so ``p <= 2**8``;
* ``PREFETCH`` k: the code bytes copied by ``cp.async`` k tiles ahead into a ring of shared buffers (each thread its
  own bytes), the scales and zeros one tile ahead in registers.

Split outputs as ``decode_split_kernel`` writes them, merged by the project's ``merge_kernel``. On a GPU:
``python3 bench/gluon_kivi_probe.py --check`` and ``python3 bench/gluon_kivi_probe.py --scheme int2_kivi --out F``;
without one: ``--static`` (sm_90 builds: registers, tile-loop instructions) and ``--compile-only``. Status (bench/
results/ANALYSIS.md 312, 314): on the H100 its int2 output was wrong (NaN on empty splits, mended since without a
GPU; 103% off on full splits, cause not found); its code PTX and operand relabelling pass their CPU replays. The
check now reports the merged lse's error beside the outputs' (a wrong score shows in both, a wrong value path only in
the outputs) and runs COMPACT 0 (no key-row exchange) beside 1; ``--bisect`` compares each variant with the Triton
plan with one part of the arithmetic switched off at a time (:func:`bisect_rows`): the next GPU run (316, 317).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gluon_fp4_probe import (  # noqa: E402
    MMA,
    OP_A,
    OP_B,
    RING,
    _async_load,
    _pow2,
    _program_tokens,
    _q_exponent,
    _trivial,
    aot_sm90,
    check_row,
    random_block_table,
)

D = 128  # head_dim
PAGE = 32  # tokens per page = per tile = per key group


def key_codes_ptx(bits: int) -> str:
    """One 32-bit word of key codes ($in: 32 / bits codes, LSB first; low half-word channels c .. c + 16 / bits - 1,
    high half-word the next 16 / bits) -> output registers R_i = (low code i, high code i) as float16 subnormals
    ``code * 2**(bits * pos_i) * 2**-24`` (the mask leaves the code where it lies, below float16's exponent field;
    codes above it are shifted down first). 2-bit: i = 0 .. 7, pos = i (i < 5) or i - 5 (after a shift by 10); 4-bit:
    i = 0 .. 3, pos = i % 2 (after a shift by 8 for i >= 2). Output o_m holds (R_2m, R_2m+1)."""
    n = 16 // bits  # codes per half-word
    fit = 10 // bits  # codes below the float16 exponent field (bit 10)
    src = f"${n}"
    lines = [".reg .b32 s;", f"shr.b32 s, {src}, {fit * bits};"]
    for i in range(n):
        mask = ((1 << bits) - 1) << (bits * key_pos(bits, i))
        lines.append(f"and.b32 ${i}, {src if i < fit else 's'}, 0x{mask | mask << 16:08x};")
    return "{\n" + "\n".join(lines) + "\n}"


def value_codes_ptx(bits: int) -> str:
    """Two tokens' words of value codes ($A, $B: 32 / bits codes each, the same channels) -> registers (A's code,
    B's code) of each channel as bfloat16 subnormals ``code * 2**(bits * pos) * 2**-133``: ``prmt`` makes the word of
    both tokens' low half-words and the word of their high half-words, then each as :func:`key_codes_ptx` with
    bfloat16's 7-bit mantissa (2-bit: pos 0, 1, 2 per shift by 0, 6, 12; 4-bit: pos 0, shifts 0, 4, 8, 12)."""
    n = 16 // bits
    fit = 7 // bits
    a, b = f"${2 * n}", f"${2 * n + 1}"
    lines = [".reg .b32 x, s;"]
    for w, sel in enumerate(("0x5410", "0x7632")):
        lines.append(f"prmt.b32 x, {a}, {b}, {sel};")
        for i in range(n):
            sh = bits * fit * (i // fit)
            if i % fit == 0 and sh:
                lines.append(f"shr.b32 s, x, {sh};")
            mask = ((1 << bits) - 1) << (bits * value_pos(bits, i))
            lines.append(f"and.b32 ${w * n + i}, {'s' if sh else 'x'}, 0x{mask | mask << 16:08x};")
    return "{\n" + "\n".join(lines) + "\n}"


def key_pos(bits: int, i: int) -> int:
    """pos of key register i (:func:`key_codes_ptx`)."""
    fit = 10 // bits
    return i if i < fit else i - fit


def value_pos(bits: int, i: int) -> int:
    """pos of value register i of a half-word (:func:`value_codes_ptx`)."""
    return i % (7 // bits)


def q_layout() -> gl.DistributedLinearLayout:
    """[4 value groups, 4 heads, 128] whose reshape to [16, 128] (row 4 group + head) is the A operand's layout
    (m16n8k16, 1 warp): the key rows are built once per head in its slice over the groups (lane bit 4 and the
    row + 8 register repeat them) and broadcast."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [2, 0, 0], [0, 0, 8], [0, 0, 16], [0, 0, 32], [0, 0, 64]],
        lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [1, 0, 0]], warp_bases=[], block_bases=[],
        shape=[4, 4, 128])


def channel_layout(compact: bool = False) -> gl.DistributedLinearLayout:
    """[128] channels of a key group's scale or zero row: thread lane % 4 = t holds 32 t .. 32 t + 31 (4 16-byte
    loads), every lane // 4 the same; ``compact``: lane bit 4 = x holds 32 t + 16 x .. 32 t + 16 x + 15."""
    if compact:
        return gl.DistributedLinearLayout(reg_bases=[[1], [2], [4], [8]], lane_bases=[[32], [64], [0], [0], [16]],
                                          warp_bases=[], block_bases=[], shape=[128])
    return gl.DistributedLinearLayout(reg_bases=[[1], [2], [4], [8], [16]], lane_bases=[[32], [64], [0], [0], [0]],
                                      warp_bases=[], block_bases=[], shape=[128])


def q_compact_layout() -> gl.DistributedLinearLayout:
    """[4 heads, 128 k]: :func:`q_layout`'s slice with k + 64 on lane bit 4 instead of a register, so that each
    (head, k) is computed by one lane (16 per thread), then exchanged (``COMPACT``)."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 8], [0, 16], [0, 32]],
                                      lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [0, 64]], warp_bases=[],
                                      block_bases=[], shape=[4, 128])


def key_load_layout(db: int) -> gl.BlockedLayout:
    """[32 tokens, db code bytes]: thread (t, g) reads bytes db / 4 * t .. of the tokens g + 8 j."""
    return gl.BlockedLayout([1, db // 4], [8, 4], [1, 1], [1, 0])


def value_load_layout(db: int) -> gl.DistributedLinearLayout:
    """[16 token pairs, 2, db code bytes]: thread (t, g) reads bytes db / 8 * g .. (channels 16 g .. 16 g + 15) of
    the tokens 2 t + e + 8 h + 16 c (pair t + 4 h + 8 c, e)."""
    nb = (db // 8).bit_length() - 1
    regs = [[0, 0, 1 << i] for i in range(nb)] + [[0, 1, 0], [4, 0, 0], [8, 0, 0]]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[1, 0, 0], [2, 0, 0]] + [
        [0, 0, (db // 8) << i] for i in range(3)], warp_bases=[], block_bases=[], shape=[16, 2, db])


def value_word_layout() -> gl.DistributedLinearLayout:
    """[32 tokens, 2 (x), 2 (half)] float16 value scales or zeros, group 2 x + half: thread (t, g) reads the groups
    2 x and 2 x + 1 (x = lane bit 4, one 4-byte load per token) of the score columns' tokens 2 t + e + 8 j."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [1, 0, 0], [8, 0, 0], [16, 0, 0]],
                                      lane_bases=[[2, 0, 0], [4, 0, 0], [0, 0, 0], [0, 0, 0], [0, 1, 0]],
                                      warp_bases=[], block_bases=[], shape=[32, 2, 2])


def value_rows_layout() -> gl.DistributedLinearLayout:
    """[2 (half), 2 (x), 4 heads, 32 tokens] whose reshape to [16, 32] (row 8 half + 4 x + head) is the mma layout:
    row r's value group is 2 x + half (:func:`_row_groups`), so a thread's two rows (r and r + 8) read the two
    float16 halves of one word."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 0, 0, 1], [1, 0, 0, 0], [0, 0, 0, 8], [0, 0, 0, 16]],
                                      lane_bases=[[0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 1, 0], [0, 0, 2, 0],
                                                  [0, 1, 0, 0]], warp_bases=[], block_bases=[], shape=[2, 2, 4, 32])


@gluon.jit
def _k_digits(k, BITS: gl.constexpr):
    """The channel (relative to nothing: 0 .. 127) and pos of the key product's K index k = 16 (M w + m) + 8 a +
    2 t + b (M = 8 / BITS outputs of a word's PTX, w the thread's word, m the output, a, b its register and half)."""
    M: gl.constexpr = 8 // BITS
    N: gl.constexpr = 16 // BITS  # codes per half-word
    FIT: gl.constexpr = 10 // BITS
    b = k % 2
    t = (k // 2) % 4
    a = (k // 8) % 2
    m = (k // 16) % M
    w = k // (16 * M)
    i = 2 * m + a
    ch = 32 * t + 2 * N * w + N * b + i
    pos = gl.where(i < FIT, i, i - FIT)
    return ch, pos


@gluon.jit
def _channel_relabel(x, BITS: gl.constexpr, L1: gl.constexpr):
    """A [128] row loaded by channels (:func:`channel_layout`) -> the same values by K index k (:func:`_k_digits`),
    in layout ``L1``."""
    M: gl.constexpr = 8 // BITS
    W: gl.constexpr = BITS  # words per thread: 32 channels of 32 / BITS per word
    x = gl.reshape(x, (4, W, 2, M, 2))  # (t, w, b, m, a): ch = 32 t + 2 N w + N b + 2 m + a
    x = gl.permute(x, (1, 3, 4, 0, 2))  # (w, m, a, t, b)
    return _trivial(gl.reshape(x, (128,)), L1)


#: the relabelling of the unpacked codes to the operands (tests/test_gluon_probe.py replays it on the PTX emulator's
#: output): keys (token, t, w, a, b, m) -> (w, m, a, t, b, token), values (pair, g, Y, e_hi, e_lo, m) -> (pair, e_lo,
#: Y, m, e_hi, g)
KEY_ORDER = gl.constexpr((2, 5, 3, 1, 4, 0))
VALUE_ORDER = gl.constexpr((0, 4, 2, 5, 3, 1))
KEY2_PTX = gl.constexpr(key_codes_ptx(2))
KEY4_PTX = gl.constexpr(key_codes_ptx(4))
VAL2_PTX = gl.constexpr(value_codes_ptx(2))
VAL4_PTX = gl.constexpr(value_codes_ptx(4))
#: the probabilities carry 2**96 (p <= 2**104 with the conditional rescale): p s_v in bfloat16's range and the
#: products with the codes' 2**-133 above float32's normals down to p s_v = 2**-89
P_SHIFT = gl.constexpr(96)
P_UNSHIFT = gl.constexpr(2.0**-96)


@gluon.jit
def _stack4(a, b, c, d):
    """[..., 4]: index i holds the i-th argument."""
    x = gl.join(gl.join(a, c), gl.join(b, d))
    return gl.reshape(x, x.shape[:-2] + [4])


@gluon.jit
def _stack8(a, b, c, d, e, f, g, h):
    x = gl.join(_stack4(a, c, e, g), _stack4(b, d, f, h))
    return gl.reshape(x, x.shape[:-2] + [8])


@gluon.jit
def _key_operand(kb, BITS: gl.constexpr, N: gl.constexpr):
    """Code bytes [N tokens, DB] (:func:`key_load_layout`) -> the B operand [128, N] of float16 subnormals
    ``code * 2**(BITS pos) * 2**-24`` by K index k (:func:`_k_digits`)."""
    W: gl.constexpr = BITS
    if BITS == 2:
        o0, o1, o2, o3 = gl.inline_asm_elementwise(KEY2_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [kb],
                                                   dtype=(gl.float16,) * 4, is_pure=True, pack=4)
        x = _stack4(o0, o1, o2, o3)
        M: gl.constexpr = 4
    else:
        o0, o1 = gl.inline_asm_elementwise(KEY4_PTX, "=r,=r,=r,=r,r", [kb], dtype=(gl.float16,) * 2,
                                           is_pure=True, pack=4)
        x = gl.join(o0, o1)
        M: gl.constexpr = 2
    x = gl.reshape(x, (N, 4, W, 2, 2, M))  # (token, t, w, a, b, m): byte DB / 4 t + 4 w + 2 a + b, output m
    x = gl.permute(x, KEY_ORDER.value)  # (w, m, a, t, b, token)
    return _trivial(gl.reshape(x, (128, N)), OP_B)


@gluon.jit
def _value_operand(vb, BITS: gl.constexpr):
    """Code bytes [16 token pairs, 2, DB] (:func:`value_load_layout`) -> the B operand [32 tokens, 128 columns] of
    bfloat16 subnormals ``code * 2**(BITS pos) * 2**-133``, column c holding channel 16 (c % 8) + c // 8."""
    YN: gl.constexpr = BITS // 2  # 4-byte words per thread per token
    a, b = gl.split(gl.permute(vb, (0, 2, 1)))  # the even and the odd tokens [16, DB]
    if BITS == 2:
        o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
            VAL2_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,=r,r,r", [a, b], dtype=(gl.bfloat16,) * 8,
            is_pure=True, pack=4)
        x = _stack8(o0, o1, o2, o3, o4, o5, o6, o7)
        NO: gl.constexpr = 8
    else:
        o0, o1, o2, o3 = gl.inline_asm_elementwise(VAL4_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [a, b],
                                                   dtype=(gl.bfloat16,) * 4, is_pure=True, pack=4)
        x = _stack4(o0, o1, o2, o3)
        NO: gl.constexpr = 4
    x = gl.reshape(x, (16, 8, YN, 2, 2, NO))  # (pair, g, Y, e_hi, e_lo, m): byte DB / 8 g + 4 Y + 2 e_hi + e_lo
    x = gl.permute(x, VALUE_ORDER.value)  # (pair, e_lo, Y, m, e_hi, g)
    return _trivial(gl.reshape(x, (32, 128)), OP_B)


@gluon.jit
def _rows16(x, R4: gl.constexpr):
    """A per-head [4] vector (layout ``R4``, the heads of :func:`q_layout`'s slice) -> the score rows [16]
    (4 group + head) in the mma layout."""
    x = gl.convert_layout(x, R4, assert_trivial=True)
    x2 = gl.broadcast(gl.expand_dims(x, 0), gl.full([4, 4], 0, x.dtype, layout=gl.SliceLayout(2, Q3)))[0]
    return _trivial(gl.reshape(x2, (16,)), gl.SliceLayout(1, MMA))


Q3 = gl.constexpr(q_layout())


@gluon.jit
def _row_groups(rows):
    """The value group of each score row r = 8 half + 4 x + head: 2 x + half."""
    return 2 * ((rows // 4) % 2) + rows // 8


@gluon.jit
def _value_rows(x):
    """Value scales or zeros [32 tokens, 2 (x), 2 (half)] (:func:`value_word_layout`) -> [16, 32] float32 in the mma
    layout, row r holding its group's (:func:`_row_groups`)."""
    x = _trivial(gl.permute(x, (2, 1, 0)), gl.SliceLayout(2, VROWS))  # [half, x, token]
    x = gl.broadcast(gl.expand_dims(x, 2), gl.full([2, 2, 4, 32], 0, x.dtype, layout=VROWS))[0]
    return _trivial(gl.reshape(x, (16, 32)), MMA).to(gl.float32)


@gluon.jit
def _page_id(bt, t0, end, N: gl.constexpr):
    """The page of the tile at ``t0`` (int64; page 0 past ``end``: rows whose scores the mask drops)."""
    return gl.load(bt + t0 // N, mask=t0 < end, other=0).to(gl.int64)


@gluon.jit
def _page_copies(kdst, vdst, pg, KC, VC, kc_p, vc_p, koff, voff):
    """Page ``pg``'s key and value code bytes copied by ``cp.async`` into ``kdst``, ``vdst``."""
    DB: gl.constexpr = koff.shape[1]  # code bytes per token: DB / 4 per thread of a key row, DB / 8 of a value row
    # contiguous and aligned (stated: triton >= 3.7 does not find it by itself and refuses the copy)
    _async_load(kdst, gl.max_contiguous(gl.multiple_of(KC + pg * kc_p + koff, [1, DB // 4]), [1, DB // 4]))
    _async_load(vdst, gl.max_contiguous(gl.multiple_of(VC + pg * vc_p + voff, [1, 1, DB // 8]), [1, 1, DB // 8]))
    async_copy.commit_group()


@gluon.jit
def _page_scales(pg, KS, KZ, VS, VZ, ks_p, vs_p, choff, woff):
    """Page ``pg``'s key scales and zeros (per channel) and value scales and zeros (per token and group)."""
    return (gl.load(KS + pg * ks_p + choff), gl.load(KZ + pg * ks_p + choff), gl.load(VS + pg * vs_p + woff),
            gl.load(VZ + pg * vs_p + woff))


#: ``PREFETCH``'s ring of shared value code buffers [STAGES, 16, 2, DB], unswizzled as the key ring's (the FP4
#: probe's ``RING``)
VRING = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
VROWS = gl.constexpr(value_rows_layout())
QC = gl.constexpr(q_compact_layout())


@gluon.jit
def kivi_split_kernel(
    Q, BT, SL, KC, KS, KZ, VC, VS, VZ, OP, LP, qk_scale, tokens_per_split,
    stride_qb, stride_qh, stride_btb, kc_p, kc_h, ks_p, ks_h, vc_p, vc_h, vs_p, vs_h, op_b, op_h, op_s, lp_b, lp_h,
    BITS: gl.constexpr, QPK: gl.constexpr, KEY_LOAD: gl.constexpr, VAL_LOAD: gl.constexpr, CH: gl.constexpr,
    VW: gl.constexpr, COMPACT: gl.constexpr = True, PREFETCH: gl.constexpr = 0,
):
    """KIVI keys and values (``BITS`` 2 or 4), head-major pages of 32 tokens, 4 query heads per KV head, head_dim
    128, value groups of 32 channels: one split's normalised output and base-2 log-sum-exp."""
    gl.static_assert(QPK == 4)
    DB: gl.constexpr = 128 * BITS // 8
    N: gl.constexpr = 32
    QS: gl.constexpr = gl.SliceLayout(0, Q3)  # [4 heads, 128 k]
    QW: gl.constexpr = QC if COMPACT else QS  # where the key rows are computed
    K1: gl.constexpr = gl.SliceLayout(0, QW)
    H1: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, Q3))  # the heads, as _rows16 takes them
    b, kvh, split, start, end = _program_tokens(SL, tokens_per_split)

    k = gl.arange(0, 128, layout=K1)
    ch, pos = _k_digits(k, BITS)
    h = gl.arange(0, 4, layout=gl.SliceLayout(1, QW))
    qrow = Q + b * stride_qb + (kvh * QPK + h).to(gl.int64)[:, None] * stride_qh
    qx = gl.load(qrow + ch[None, :]).to(gl.float32)
    down = _pow2(-BITS * pos).to(gl.float16)[None, :]  # 2**(-BITS pos): the codes' place in their half-word

    # loop-invariant offsets inside a page
    tk = gl.arange(0, N, layout=gl.SliceLayout(1, KEY_LOAD))
    koff = (tk * DB)[:, None] + gl.arange(0, DB, layout=gl.SliceLayout(0, KEY_LOAD))[None, :] + kvh * kc_h
    choff = gl.arange(0, 128, layout=CH) + kvh * ks_h
    VP: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, VAL_LOAD))
    VE: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, VAL_LOAD))
    VB: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, VAL_LOAD))
    vtok = 2 * gl.arange(0, 16, layout=VP)[:, None, None] + gl.arange(0, 2, layout=VE)[None, :, None]
    voff = vtok * DB + gl.arange(0, DB, layout=VB)[None, None, :] + kvh * vc_h
    VW1: gl.constexpr = gl.SliceLayout(2, VW)
    woff = (gl.arange(0, N, layout=gl.SliceLayout(1, VW1)) * 4)[:, None, None] + kvh * vs_h + (
        2 * gl.arange(0, 2, layout=gl.SliceLayout(0, VW1))[None, :, None]
        + gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, VW)))[None, None, :])
    isc = gl.arange(0, N, layout=gl.SliceLayout(0, MMA))
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))

    m_i = gl.full([16], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
    l_i = gl.zeros([16], gl.float32, layout=gl.SliceLayout(1, MMA))
    acc = gl.zeros([16, 128], gl.float32, layout=MMA)
    acc_z = gl.zeros([16, N], gl.float32, layout=MMA)
    bt = BT + b * stride_btb
    STAGES: gl.constexpr = PREFETCH + 1
    if PREFETCH > 0:  # code bytes by cp.async PREFETCH tiles ahead into a ring of shared buffers (each thread its
        # own bytes), the scales and zeros one tile ahead in registers
        ksm = gl.allocate_shared_memory(gl.uint8, [STAGES, N, DB], RING)
        vsm = gl.allocate_shared_memory(gl.uint8, [STAGES, 16, 2, DB], VRING)
        for i in gl.static_range(STAGES - 1):
            _page_copies(ksm.index(i), vsm.index(i), _page_id(bt, start + i * N, end, N), KC, VC, kc_p, vc_p, koff,
                         voff)
        sk_n, zk_n, sv_n, zv_n = _page_scales(_page_id(bt, start, end, N), KS, KZ, VS, VZ, ks_p, vs_p, choff, woff)
    for t0 in range(start, end, N):
        if PREFETCH > 0:
            it = (t0 - start) // N
            nxt = (it + STAGES - 1) % STAGES
            _page_copies(ksm.index(nxt), vsm.index(nxt), _page_id(bt, t0 + (STAGES - 1) * N, end, N), KC, VC, kc_p,
                         vc_p, koff, voff)
            async_copy.wait_group(STAGES - 1)
            kb = ksm.index(it % STAGES).load(KEY_LOAD)
            vb = vsm.index(it % STAGES).load(VAL_LOAD)
            sk, zk, sv, zv = sk_n, zk_n, sv_n, zv_n
            sk_n, zk_n, sv_n, zv_n = _page_scales(_page_id(bt, t0 + N, end, N), KS, KZ, VS, VZ, ks_p, vs_p, choff,
                                                  woff)
        else:
            pg = gl.load(bt + t0 // N).to(gl.int64)
            kb = gl.load(KC + pg * kc_p + koff)
            vb = gl.load(VC + pg * vc_p + voff)
            sk, zk, sv, zv = _page_scales(pg, KS, KZ, VS, VZ, ks_p, vs_p, choff, woff)

        # key rows: q s 2**E rounded once to float16 (E per head puts the largest in [2**14, 2**15)), then times
        # 2**(-BITS pos) in float16 (a second rounding below float16's normals, as the Triton kernel's subnormal
        # codes); the zero term q . z in float32
        qs = qx * _channel_relabel(sk, BITS, K1).to(gl.float32)[None, :]
        e = _q_exponent(gl.max(gl.abs(qs), 1))
        q16 = (qs * _pow2(e)[:, None]).to(gl.float16) * down
        if COMPACT:
            q16 = gl.convert_layout(q16, QS)
        qz = gl.sum(qx * _channel_relabel(zk, BITS, K1).to(gl.float32)[None, :], 1)
        a16 = gl.broadcast(gl.expand_dims(q16, 0), gl.full([4, 4, 128], 0, gl.float16, layout=Q3))[0]
        a16 = _trivial(gl.reshape(a16, (16, 128)), OP_A)
        dot = mma_v2(a16, _key_operand(kb, BITS, N), gl.zeros([16, N], gl.float32, layout=MMA))
        cs = _rows16(qk_scale * _pow2(24 - e), H1)
        cz = _rows16(qk_scale * qz, H1)
        s = dot * cs[:, None] + cz[:, None]
        s = gl.where(((t0 + isc) < end)[None, :], s, float("-inf"))

        # FlashAttention 4's conditional rescale: the running max moves only by more than 8
        mt = gl.max(s, 1)
        if gl.max((mt > m_i + 8.0).to(gl.int32), 0) != 0:
            m_new = gl.maximum(m_i, mt)
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
            acc_z = acc_z * alpha[:, None]
            m_i = m_new
        p = gl.exp2(s - (m_i - P_SHIFT)[:, None])  # p 2**96
        l_i = l_i + gl.sum(p, 1)
        acc_z = acc_z + p * _value_rows(zv)
        pv = _trivial((p * _value_rows(sv)).to(gl.bfloat16), OP_A)
        acc = mma_v2(pv, _value_operand(vb, BITS), acc)

    if PREFETCH > 0:  # the copies issued past the last page, drained before the program ends
        async_copy.wait_group(0)
    # column c holds channel 16 (c % 8) + c // 8 times 2**(BITS pos) 2**-133
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, MMA))
    chv = 16 * (c % 8) + c // 8
    NH: gl.constexpr = 16 // BITS
    FV: gl.constexpr = 7 // BITS
    vpos = ((c // 8) % NH) % FV
    # a row that saw a token has l >= 2**96 (its largest p): out = acc 2**(133 - BITS pos) / l + sum p z / l
    # (a row of an empty split, l = 0, has acc = 0: its divisor 1 keeps f finite, so out = 0, not 0 * inf)
    safe_l = gl.where(l_i > 0, l_i, 1.0)
    f = _pow2(133 - P_SHIFT - BITS * vpos)[None, :] / gl.where(l_i > 0, l_i * P_UNSHIFT, 1.0)[:, None]
    out = acc * f + (gl.sum(acc_z, 1) / safe_l)[:, None]
    hh = rows % 4
    om = (hh < QPK)[:, None] & ((chv // 32)[None, :] == _row_groups(rows)[:, None])
    obase = OP + b * op_b + (kvh * QPK + hh).to(gl.int64)[:, None] * op_h + split * op_s
    gl.store(obase + chv[None, :], out, mask=om)
    lse2 = gl.where(l_i > 0, m_i + gl.log2(safe_l) - P_SHIFT, float("-inf"))
    gl.store(LP + b * lp_b + (kvh * QPK + hh).to(gl.int64) * lp_h + split, lse2, mask=(hh < QPK) & (rows < 4))


def kernel_constexprs(bits: int, compact: bool = True, prefetch: int = 0) -> dict:
    """:func:`kivi_split_kernel`'s constexprs for ``bits``-bit codes (the layouts its loads use)."""
    db = D * bits // 8
    return {"BITS": bits, "QPK": 4, "KEY_LOAD": key_load_layout(db), "VAL_LOAD": value_load_layout(db),
            "CH": channel_layout(compact), "VW": value_word_layout(), "COMPACT": compact, "PREFETCH": prefetch}


def compile_sm90(bits: int = 2, maxnreg: int | None = None, compact: bool = True, prefetch: int = 0):
    """Ahead-of-time compile for sm_90 (no GPU needed): the compiled kernel, for its SASS and resource usage."""
    sig = {name: "i32" for name in ("tokens_per_split", "stride_qb", "stride_qh", "stride_btb", "kc_p", "kc_h",
                                    "ks_p", "ks_h", "vc_p", "vc_h", "vs_p", "vs_h", "op_b", "op_h", "op_s", "lp_b",
                                    "lp_h")}
    sig.update({"Q": "*bf16", "BT": "*i32", "SL": "*i32", "KC": "*u8", "KS": "*fp16", "KZ": "*fp16", "VC": "*u8",
                "VS": "*fp16", "VZ": "*fp16", "OP": "*fp32", "LP": "*fp32", "qk_scale": "fp32"})
    return aot_sm90(kivi_split_kernel, sig, kernel_constexprs(bits, compact, prefetch),
                    ("Q", "BT", "SL", "KC", "KS", "KZ", "VC", "VS", "VZ", "OP", "LP", "stride_qb", "stride_qh", "kc_p",
                     "kc_h", "ks_p", "ks_h", "vc_p", "vc_h", "vs_p", "vs_h", "op_b", "op_h", "op_s"), maxnreg=maxnreg)


def gluon_decode(q, dc, splits: int, maxnreg: int = 0, compact: bool = True, prefetch: int = 0):
    """The probe's decode over ``dc`` (a KIVI device cache, head-major pages of 32, every token in pages, as
    bench/decode_bench.py makes it): returns the call (out [B, Hq, D] float32 after the project's merge kernel)."""
    from gluon_fp4_probe import SplitOutputs

    kt, vt = dc.k.tiles(), dc.v.tiles()
    assert kt.head_major and vt.head_major and dc.page_size == PAGE, "head-major pages of 32"
    assert kt.kind == "int_k" and vt.kind == "int_v" and kt.bits == vt.bits and kt.group == vt.group == 32
    assert bool((dc.k_lens == dc.seq_lens).all()) and bool((dc.v_lens == dc.seq_lens).all()), "no residual"
    bits = kt.bits
    batch, q_heads, d = q.shape
    kvh = kt.kv_heads
    assert d == D and q_heads == 4 * kvh
    kc, ks, kz = kt.fields
    vc, vs, vz = vt.fields
    assert ks.stride() == kz.stride() and vs.stride() == vz.stride()
    so = SplitOutputs(q, dc, splits, PAGE)
    bt = dc.block_table
    consts = kernel_constexprs(bits, compact, prefetch) | ({"maxnreg": maxnreg} if maxnreg else {})

    def run():
        kivi_split_kernel[(batch, kvh, splits)](
            q, bt, so.seq_lens, kc, ks, kz, vc, vs, vz, so.op, so.lp, so.qk_scale, so.tokens_per_split, q.stride(0),
            q.stride(1), bt.stride(0), kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1), vc.stride(0),
            vc.stride(1), vs.stride(0), vs.stride(1), *so.strides(), num_warps=1, **consts)
        return so.merge()

    run.outputs = so  # the split plan and its buffers (the merged lse among them)
    return run


def oracle_check(variants, scheme: str = "int2_kivi", splits: int = 4, seed: int = 0,
                 device: str = "cuda") -> list[dict]:
    """Each variant (COMPACT, MAXNREG) against the float64 oracle (``kvqref.reference.attention`` on the scheme's
    dequantized values) with the fast mode's tolerance (``kernel_tolerance`` with ``fast_rounding`` and the KIVI
    magnitudes the fast kernel rounds: ``K - Z``, ``V - Z``, the key scales): 3 sequences of 2,048, 992 and 96
    tokens (whole key groups; splits ending inside a tile and empty splits), 32 query and 8 KV heads, head-major
    pages of 32 dealt at random; keys with outlier channels. Returns per variant the largest |error| / tolerance
    (``device="cpu"`` with no variants: the production kernel alone, under the interpreter, to check the harness)."""
    import numpy as np
    import torch

    from kvqref import reference, schemes
    from kvqref.backends import triton_backend as tb

    rng = np.random.default_rng(seed)
    ksch = schemes.get(scheme, role="key", residual=0)
    vsch = schemes.get(scheme, role="value", residual=0)
    lens, kvh, d = [2048, 992, 96], 8, D
    pages, bt = random_block_table(rng, lens, PAGE)
    dc = tb.empty_device_cache(ksch, vsch, sum(pages), PAGE, kvh, d, bt.to(device),
                               torch.tensor(lens, dtype=torch.int32), layout="HND", device=device)
    Ks, Vs, Kr, Vr, Kscale = [], [], [], [], []
    for b, n in enumerate(lens):
        k = rng.standard_normal((n, kvh, d)).astype(np.float32)
        k[:, :, ::37] *= 20.0
        v = rng.standard_normal((n, kvh, d)).astype(np.float32)
        slots = (bt[b].long()[torch.arange(n) // PAGE] * PAGE + torch.arange(n) % PAGE).to(device)
        tb.quantize_write(dc.k, torch.from_numpy(k).to(device), slots)
        tb.quantize_write(dc.v, torch.from_numpy(v).to(device), slots)
        qk, qv = ksch.quantize(k), vsch.quantize(v)
        Ks.append(ksch.dequantize(qk))
        Vs.append(vsch.dequantize(qv))
        zk = np.repeat(qk.fields["zero"].astype(np.float64), 32, axis=0)
        sk = np.repeat(qk.fields["scale"].astype(np.float64), 32, axis=0)
        Kr.append(Ks[-1] - zk)
        Kscale.append(sk)
        Vr.append(Vs[-1] - np.repeat(qv.fields["zero"].astype(np.float64), 32, axis=2))
    q = torch.from_numpy(rng.standard_normal((len(lens), 4 * kvh, d)).astype(np.float32)).to(torch.bfloat16)
    q = q.to(device)
    q64 = q.float().cpu().numpy().astype(np.float64)
    want, want_lse = reference.attention(q64, Ks, Vs)
    tol, _ = reference.kernel_tolerance(q64, Ks, Vs, fast=reference.fast_rounding(ksch, vsch, "bfloat16"),
                                        K_round=Kr, V_round=Vr, K_scale=Kscale)
    rows = [check_row("triton (default plan)", lambda: tb.decode(q, dc), want, want_lse, tol)]
    for compact, nreg, pf in variants:
        run = gluon_decode(q, dc, splits, maxnreg=nreg, compact=bool(compact), prefetch=pf)
        rows.append(check_row(f"gluon COMPACT {compact} MAXNREG {nreg} PREFETCH {pf}",
                              lambda run=run: (run(), run.outputs.lse), want, want_lse, tol))
    return rows


def bisect_rows(variants, scheme: str = "int2_kivi", splits: int = 4) -> list[dict]:
    """Where a variant's output goes wrong: the bench's cache (batch 4 x 1,024 tokens, head-major pages of 32) with
    one part of the arithmetic switched off at a time by overwriting fields, each against the Triton plan on the same
    cache (largest output difference relative to the plan's largest output, largest lse difference). Cases: as
    written; value scales 0 (the output is the value zero term ``sum p z_v / l`` alone); value zeros 0 (the value
    codes' products alone); key zeros 0 (the scores without ``q . z``); key scales 0 (scores ``q . z`` alone: the key
    codes' products switched off); value codes 0 and key codes 0 (the codes' unpacking switched off)."""
    import decode_bench as db
    import torch

    from kvqref.backends import triton_backend as tb

    shape = (4, 32, 8, D, 1024)
    dc, _, _ = db.make_cache(scheme, shape, PAGE, layout="HND")
    q = torch.randn(shape[0], shape[1], D, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    q = q.to(torch.bfloat16)
    kc, ks, kz = dc.k.tiles().fields
    vc, vs, vz = dc.v.tiles().fields
    fields = {"key codes": kc, "key scales": ks, "key zeros": kz, "value codes": vc, "value scales": vs,
              "value zeros": vz}
    kept = {name: f.clone() for name, f in fields.items()}
    cases = [("as written", ()), ("value scales 0", ("value scales",)), ("value zeros 0", ("value zeros",)),
             ("key zeros 0", ("key zeros",)), ("key scales 0", ("key scales",)), ("value codes 0", ("value codes",)),
             ("key codes 0", ("key codes",))]
    rows = []
    for label, zeroed in cases:
        for name, f in fields.items():
            f.copy_(kept[name])
            if name in zeroed:
                f.zero_()
        want, want_lse = (x.clone() for x in tb.decode(q, dc)[:2])
        for compact, nreg, pf in variants:
            run = gluon_decode(q, dc, splits, maxnreg=nreg, compact=bool(compact), prefetch=pf)
            got = run()
            rows.append({"case": label, "kernel": f"gluon COMPACT {compact} MAXNREG {nreg} PREFETCH {pf}",
                         "max_rel_diff": ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item(),
                         "max_lse_diff": (run.outputs.lse - want_lse).abs().max().item(),
                         "finite": bool(torch.isfinite(got).all())})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", default="int2_kivi", choices=("int2_kivi", "int4_kivi"))
    ap.add_argument("--shape", default="32,32,8,128,8192", help="batch,q_heads,kv_heads,head_dim,tokens")
    ap.add_argument("--splits", default="3,4,6,8")
    ap.add_argument("--variants", default="1,0;1,168;0,0",
                    help="COMPACT,MAXNREG[,PREFETCH] (COMPACT: the key rows computed once per lane and exchanged; "
                         "MAXNREG 0: no register cap; PREFETCH k: the code bytes by cp.async k tiles ahead)")
    ap.add_argument("--out", help="JSON file for the results")
    ap.add_argument("--check", action="store_true", help="only the float64-oracle check of every variant")
    ap.add_argument("--bisect", action="store_true",
                    help="each variant against the Triton plan with one part of the arithmetic switched off at a time")
    ap.add_argument("--static", action="store_true", help="sm_90 builds: registers, shared memory, tile-loop "
                    "instructions (this machine's triton, no GPU)")
    ap.add_argument("--compile-only", action="store_true", help="AOT-compile for sm_90 and print the resources")
    args = ap.parse_args(argv)
    variants = [(tuple(int(x) for x in v.split(",")) + (0,))[:3] for v in args.variants.split(";")]
    if args.static:
        from gluon_fp4_probe import sm90_loop_counts

        for bits in (2, 4):
            for compact, cap, pf in variants:
                counts = sm90_loop_counts(compile_sm90(bits, cap or None, bool(compact), pf))
                print(json.dumps({"bits": bits, "compact": compact, "maxnreg": cap, "prefetch": pf, **counts,
                                  "per_element": round(counts["loop_common_path"] * 32 / (2 * PAGE * D), 2)}),
                      flush=True)
        return 0
    if args.compile_only:
        for bits, pf in ((2, 0), (4, 0), (2, 2)):  # and int2 with a cp.async ring two tiles ahead
            ck = compile_sm90(bits, prefetch=pf)
            print(json.dumps({"build": f"int{bits}_kivi" + ("-ring" if pf else ""), "shared": ck.metadata.shared,
                              "num_warps": ck.metadata.num_warps, "prefetch": pf}), flush=True)
        return 0
    if args.check:
        for r in oracle_check(variants, scheme=args.scheme):
            print(json.dumps(r), flush=True)
        return 0
    if args.bisect:
        for r in bisect_rows(variants, scheme=args.scheme):
            print(json.dumps(r), flush=True)
        return 0
    from gluon_fp4_probe import time_probe

    cases = []
    for compact, cap, pf in variants:
        for s in (int(x) for x in args.splits.split(",")):
            row = {"kernel": f"gluon KIVI probe, COMPACT {compact}, MAXNREG {cap}, PREFETCH {pf}, {s} splits",
                   "compact": compact, "maxnreg": cap, "prefetch": pf, "splits": s}
            cases.append((row, lambda q, dc, s=s, cap=cap, compact=compact, pf=pf: gluon_decode(
                q, dc, s, maxnreg=cap, compact=bool(compact), prefetch=pf)))
    time_probe(args.scheme, tuple(int(x) for x in args.shape.split(",")), PAGE, cases,
               "python3 bench/gluon_kivi_probe.py " + " ".join(argv or sys.argv[1:]), args.out)
    return 0

if __name__ == "__main__":
    sys.exit(main())
