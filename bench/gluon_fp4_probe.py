"""Probe: FP4 decode split kernels in Gluon (explicit layouts, CUDA sm_80+): mxfp4, and fp4_e2m1 / NVFP4 (blocks
of 16 channels, :func:`fp4_e8m0_b16_split_kernel`).

The Triton kernel's FP4 tile loops spend their time in the layout conversions Triton places between the code
loads and the tensor-core operands (bench/results/ANALYSIS.md 108, 152, 293). This probe states the layouts
itself so that the code bytes are loaded straight into registers that the ``mma.sync`` operands use:

* keys: thread (lane % 4 = t, lane // 4 = g) loads 16 contiguous code bytes (16 t .. 16 t + 15) of token g + 8 j
  (one 16-byte load). The product's K axis is any permutation of the channels as long as q's rows follow it, so
  the bytes are relabelled ``byte 16 t + 4 c + 2 h + e  ->  k = 16 c + 8 h + 2 t + e``, which is exactly the
  B-operand fragment of m16n8k16 (k = 2 t + e + 8 h inside chunk c): no data moves. q's rows are gathered in the
  same order once per program.
* rows are (block, head) as the Triton kernel's block rows: 4 heads x 4 blocks of 32 channels (mxfp4) fill the
  16 rows of the product; block b's partial dot is scaled by its E8M0 scale on the [16, N] score tile.
* values: each thread loads 8 contiguous bytes (8 g .. 8 g + 7) of its tokens 2 t + e + 8 h + 16 c; the output
  column order is relabelled ``n = g + 8 j  <->  byte 8 g + j``; the pairs of tokens the operand holds per
  register are made by register moves only.

Arithmetic (the Triton kernel's fast mode, ``docs/kernels.md``): q times 2**eq rounded once to float16 against the
exact float16 E2M1 * 2**-14 keys, float32 sums, times the block scale (E8M0 codes taken as the bare exponent field:
codes 0 and 255 are not handled by this probe); p times its value block's scale rounded once to bfloat16 against the
exact bfloat16 E2M1 values, or (``VF16``) to float16 against a running reference code, float32 accumulation. Split
outputs as ``decode_split_kernel`` writes them (``OP`` the normalised output, ``LP`` the base-2 log-sum-exp), merged
by the project's ``merge_kernel``.

Loads ahead (``PREFETCH``; without it nothing overlaps a tile's loads with the arithmetic before them): 1 reads the
next tile's code bytes as int32 words before this tile's arithmetic and carries them in registers (as bytes they took
a register each); k >= 2 copies them by ``cp.async`` k tiles ahead into a ring of k + 1 shared buffers, each thread
the bytes it reads back, so no other lane's copy is waited for (the scale words one tile ahead in registers).

On a GPU: ``python3 bench/gluon_fp4_probe.py [--scheme mxfp4|fp4_e2m1|nvfp4] [--check]``; without one: ``--static``
(sm_90 builds: registers, tile-loop instructions) and ``--compile-only``. Measured on the H100 (bench/results/
ANALYSIS.md 313): correct, and without loads ahead 23-78% slower than the Triton kernel (mxfp4 160.6 us at best
against 130.1); the loads ahead are not yet measured (315).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvqref.kernels.decode import (  # noqa: E402
    E2M1_PAIRS_BF16_PTX,
    E2M1_PAIRS_PTX,
    TWO_126,
    _e2m1_f16_bytes_lines,
)


def _token_pairs_ptx() -> str:
    """Two tokens' code words ($8: token A's bytes 0-3, $9: token B's) -> float16 E2M1 * 2**-14 of the same bytes of
    both tokens in each register: ``prmt`` interleaves the bytes (A0 B0 A1 B1 and A2 B2 A3 B3), then each word as
    :data:`E2M1_PAIRS_PTX`: $0, $1 the low nibbles of (A0, B0), (A1, B1); $2, $3 their high nibbles; $4 .. $7 the
    same of bytes 2 and 3. 24 instructions per 16 codes."""
    lines = [".reg .b32 x, y;", "prmt.b32 x, $8, $9, 0x5140;", "prmt.b32 y, $8, $9, 0x7362;"]
    body = [ln.replace("$4", "{w}") for ln in _e2m1_f16_bytes_lines()[1:]]
    out = [".reg .b32 a, s, h, l;"]
    for w, base in (("x", 0), ("y", 4)):
        out += [ln.format(w=w) for ln in body]
        out += [f"prmt.b32 ${base}, l, 0, 0x1404;", f"prmt.b32 ${base + 1}, l, 0, 0x3424;",
                f"prmt.b32 ${base + 2}, h, 0, 0x1404;", f"prmt.b32 ${base + 3}, h, 0, 0x3424;"]
    return "{\n" + "\n".join(lines + out) + "\n}"


TOKEN_PAIRS_PTX = gl.constexpr(_token_pairs_ptx())

MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
OP_A = gl.constexpr(gl.DotOperandLayout(0, MMA.value, 2))
OP_B = gl.constexpr(gl.DotOperandLayout(1, MMA.value, 2))
# key bytes [N = 32 tokens, 64 bytes]: 16 contiguous bytes per thread (lane % 4 along the bytes), 8 tokens per
# lane row, 4 tokens per thread
KEY_LOAD = gl.constexpr(gl.BlockedLayout([1, 16], [8, 4], [1, 1], [1, 0]))
#: cp.async into shared memory: ``async_load`` since triton 3.7, ``async_copy_global_to_shared`` before (3.6, the
#: device's)
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
#: the rings of shared code buffers ([STAGES, N, 64] here, the KIVI probe's keys too), unswizzled (each thread
#: reads back its own copies)
RING = gl.constexpr(gl.SwizzledSharedLayout(16, 1, 1, [1, 0]))


def pairs_layout(block_n: int) -> gl.DistributedLinearLayout:
    """[block_n / 2] token pairs i = t + 4 j (lane % 4 = t; every lane of a row holds its pairs), so that the pairs'
    two tokens joined are the score columns 2 t + e + 8 j of the mma layout."""
    regs = [[4 << i] for i in range((block_n // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[1], [2], [0], [0], [0]], warp_bases=[],
                                      block_bases=[], shape=[block_n // 2])


#: key code words [N, 16] (int32) for the carried loads (``PREFETCH``): KEY_LOAD's 16 bytes per thread as 4 words
KEY_WORDS = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [1, 1], [1, 0]))


def value_words_layout(block_n: int, b16: bool = False) -> gl.DistributedLinearLayout:
    """[block_n tokens, 16 words]: :func:`value_load_layout`'s 8 bytes per thread as 2 int32 words, or (``b16``)
    :func:`value_load_layout_b16`'s as words g' and g' + 2."""
    regs = [[0, 2 if b16 else 1], [1, 0]] + [[8 << i, 0] for i in range((block_n // 8).bit_length() - 1)]
    lanes = [[2, 0], [4, 0], [0, 1], [0, 4], [0, 8]] if b16 else [[2, 0], [4, 0], [0, 2], [0, 4], [0, 8]]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=[], block_bases=[],
                                      shape=[block_n, 16])


def value_load_layout(block_n: int) -> gl.DistributedLinearLayout:
    """[block_n tokens, 64 bytes]: 8 contiguous bytes of the tokens 2 t + e + 8 r (lane % 4 = t, lane // 4 = g)."""
    regs = [[0, 1], [0, 2], [0, 4], [1, 0]] + [[8 << i, 0] for i in range((block_n // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[2, 0], [4, 0], [0, 8], [0, 16], [0, 32]],
                                      warp_bases=[], block_bases=[], shape=[block_n, 64])


@gluon.jit
def _trivial(x, layout: gl.constexpr):
    """``x`` in ``layout`` where that is the same registers (asserted when compiling: the relabelling reshapes and
    permutes leave every element where the next operation wants it)."""
    return gl.convert_layout(x, layout, assert_trivial=True)


@gluon.jit
def _program_tokens(SL, tokens_per_split):
    """This program's sequence, KV head and split, and the tokens start .. end it reads."""
    b = gl.program_id(0).to(gl.int64)
    split = gl.program_id(2)
    start = split * tokens_per_split
    return b, gl.program_id(1), split, start, gl.minimum(start + tokens_per_split, gl.load(SL + b))


@gluon.jit
def _code_offsets(kvh, k0_s, k0_h, v0_s, v0_h, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, VAL_LOAD: gl.constexpr):
    """Loop-invariant: each token position i of a tile (in the key bytes' rows, the value bytes' rows and the score
    columns) and its code bytes' offsets inside its page (pages of 16: a tile of 32 is two pages, i // 16 selects
    the page id, so per tile only the page ids are read)."""
    gl.static_assert(PAGE == 16)
    ik = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, KEY_LOAD))
    koff = ((ik % PAGE) * k0_s + kvh * k0_h)[:, None] + gl.arange(0, 64, layout=gl.SliceLayout(0, KEY_LOAD))[None, :]
    iv = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, VAL_LOAD))
    voff = ((iv % PAGE) * v0_s + kvh * v0_h)[:, None] + gl.arange(0, 64, layout=gl.SliceLayout(0, VAL_LOAD))[None, :]
    return ik, koff, iv, voff, gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))


@gluon.jit
def _e8m0_fields(w, blk):
    """Block ``blk`` (0 .. 3, [16, 1]) of each 32-bit E8M0 scale word ``w`` ([1, N] or [16, N]) as the exponent field
    ``code << 23`` (int32; the float32 2**(code - 127) for codes 1 .. 254): one funnel shift and one mask."""
    return ((w.to(gl.int64) << 32) >> (8 * blk + 9).to(gl.int64)).to(gl.int32) & 0x7F800000


@gluon.jit
def _pow2_fields(a, b, bias: gl.constexpr):
    """2**((a - b) / 2**23 + bias - 127) as float32 for exponent fields ``a``, ``b`` (``code << 23``); 0.0 where the
    exponent would fall below the float32 normals."""
    return gl.maximum(a - b + (bias << 23), 0).to(gl.float32, bitcast=True)


@gluon.jit
def _q_rows(Q, b, kvh, stride_qb, stride_qh, K0: gl.constexpr, KW: gl.constexpr, QB: gl.constexpr,
            X: gl.constexpr, HALF: gl.constexpr, QPK: gl.constexpr):
    """q's rows (float32, OP_A layout of [16, KW]) for the key product over k = K0 .. K0 + KW - 1: row 4 b' + h
    holds q[h, 2 byte(k) + HALF] (byte(k) the code byte relabelled to k, :func:`_key_relabel`) where that channel
    lies in block (32 / QB) b' + X (QB channels per block), else 0."""
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, OP_A))
    k = K0 + gl.arange(0, KW, layout=gl.SliceLayout(0, OP_A))
    byte = 16 * ((k // 2) % 4) + 4 * (k // 16) + 2 * ((k // 8) % 2) + k % 2
    h = r % 4
    m = (h < QPK)[:, None] & (((2 * byte) // QB)[None, :] == ((32 // QB) * (r // 4) + X)[:, None])
    qrow = Q + b * stride_qb + (kvh * QPK + h).to(gl.int64)[:, None] * stride_qh
    return gl.load(qrow + (2 * byte + HALF)[None, :], mask=m, other=0.0).to(gl.float32)


@gluon.jit
def _q_exponent(qmax):
    """The power of two e that puts q into float16's range: max|q| 2**e in [2**14, 2**15) (e <= 126; 0 for q = 0)."""
    return gl.where(qmax > 0, gl.minimum(14 - ((qmax.to(gl.int32, bitcast=True) >> 23) - 127), 126), 0)


@gluon.jit
def _tile_pages(BT, b, stride_btb, t0, end, PAGE: gl.constexpr, BLOCK_N: gl.constexpr):
    """The page ids (int64 scalars) of the tile at ``t0``'s pages (2, or 4 for tiles of 64), 0 past ``end``; a tile of
    two pages repeats its second id in the last two."""
    bt = BT + b * stride_btb + t0 // PAGE
    p0 = gl.load(bt, mask=t0 < end, other=0).to(gl.int64)
    p1 = gl.load(bt + 1, mask=t0 + PAGE < end, other=0).to(gl.int64)
    p2 = p1
    p3 = p1
    if BLOCK_N == 64:
        p2 = gl.load(bt + 2, mask=t0 + 2 * PAGE < end, other=0).to(gl.int64)
        p3 = gl.load(bt + 3, mask=t0 + 3 * PAGE < end, other=0).to(gl.int64)
    return p0, p1, p2, p3


@gluon.jit
def _pow2(e):
    """2**e as float32 for integer e in -126 .. 127 (the exponent field)."""
    return ((e + 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _page_rows(i, base, p0, p1, p2, p3, step, PAGE: gl.constexpr):
    """The page of each token position ``i`` of a tile (page ids p0 .. p3 of its pages): ``base + p * step``."""
    return gl.where(i < PAGE, base + p0 * step,
                    gl.where(i < 2 * PAGE, base + p1 * step,
                             gl.where(i < 3 * PAGE, base + p2 * step, base + p3 * step)))


@gluon.jit
def _code_loads(BT, b, stride_btb, t0, end, K0, V0, ik, iv, koff, voff, kstep, vstep, PAGE: gl.constexpr,
                BLOCK_N: gl.constexpr):
    """The tile at ``t0``'s key and value code bytes (or words, as the offsets and pointers are), unmasked."""
    p0, p1, p2, p3 = _tile_pages(BT, b, stride_btb, t0, end, PAGE, BLOCK_N)
    kb = gl.load(_page_rows(ik, K0, p0, p1, p2, p3, kstep, PAGE)[:, None] + koff)
    vb = gl.load(_page_rows(iv, V0, p0, p1, p2, p3, vstep, PAGE)[:, None] + voff)
    return kb, vb


@gluon.jit
def _tile_loads(BT, b, stride_btb, t0, end, K0, K1, V0, V1, ik, iv, tpos, koff, voff, k1off, v1off, kstep, vstep,
                k1step, v1step, PAGE: gl.constexpr, BLOCK_N: gl.constexpr):
    """The tile at ``t0``'s key and value code bytes (or words) and its scale words (:func:`_scale_loads`).
    The code bytes are read unmasked: a token past ``end`` reads a row of its page (page 0 past the table's end or
    for a tile wholly past it), finite E2M1 codes whose score the mask sets to -inf and whose value weight is 0 (its
    scale word is masked to 0, so no scale turns them into inf or NaN)."""
    kb, vb = _code_loads(BT, b, stride_btb, t0, end, K0, V0, ik, iv, koff, voff, kstep, vstep, PAGE, BLOCK_N)
    kw, vw = _scale_loads(BT, b, stride_btb, t0, end, K1, V1, tpos, k1off, v1off, k1step, v1step, PAGE, BLOCK_N)
    return kb, vb, kw, vw


@gluon.jit
def _tile_copies(kdst, vdst, BT, b, stride_btb, t0, end, K0, V0, ik, iv, koff, voff, kstep, vstep,
                 PAGE: gl.constexpr, BLOCK_N: gl.constexpr):
    """The tile at ``t0``'s key and value code bytes copied asynchronously (``cp.async``) into the shared buffers
    ``kdst``, ``vdst`` [N, 64], each thread the bytes it reads back (KEY_LOAD, ``VAL_LOAD``: no other lane's copy is
    waited for), unmasked as :func:`_tile_loads`' code bytes."""
    p0, p1, p2, p3 = _tile_pages(BT, b, stride_btb, t0, end, PAGE, BLOCK_N)
    kp = _page_rows(ik, K0, p0, p1, p2, p3, kstep, PAGE)[:, None] + koff
    vp = _page_rows(iv, V0, p0, p1, p2, p3, vstep, PAGE)[:, None] + voff
    # the rows' 16 (keys) and 8 (values) bytes per thread are contiguous and aligned (triton >= 3.7 does not find
    # it by itself and refuses the copy)
    _async_load(kdst, gl.max_contiguous(gl.multiple_of(kp, [1, 16]), [1, 16]))
    _async_load(vdst, gl.max_contiguous(gl.multiple_of(vp, [1, 8]), [1, 8]))
    async_copy.commit_group()


@gluon.jit
def _ring_start(BT, b, stride_btb, start, end, K0, V0, ik, iv, koff, voff, kstep, vstep, STAGES: gl.constexpr,
                PAGE: gl.constexpr, BLOCK_N: gl.constexpr):
    """``PREFETCH`` >= 2's ring: STAGES shared buffers for each side's code bytes [STAGES, N, 64], the first
    STAGES - 1 tiles' copies issued."""
    ksm = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 64], RING)
    vsm = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 64], RING)
    for i in gl.static_range(STAGES - 1):
        _tile_copies(ksm.index(i), vsm.index(i), BT, b, stride_btb, start + i * BLOCK_N, end, K0, V0, ik, iv, koff,
                     voff, kstep, vstep, PAGE, BLOCK_N)
    return ksm, vsm


@gluon.jit
def _ring_step(ksm, vsm, BT, b, stride_btb, t0, start, end, K0, V0, ik, iv, koff, voff, kstep, vstep,
               VAL_LOAD: gl.constexpr, STAGES: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr):
    """The tile at ``t0`` from the ring: the copies of the tile STAGES - 1 ahead issued into the buffer the last tile
    freed, then this tile's code bytes read back (KEY_LOAD, ``VAL_LOAD``) once their copies are done."""
    it = (t0 - start) // BLOCK_N
    nxt = (it + STAGES - 1) % STAGES
    _tile_copies(ksm.index(nxt), vsm.index(nxt), BT, b, stride_btb, t0 + (STAGES - 1) * BLOCK_N, end, K0, V0, ik,
                 iv, koff, voff, kstep, vstep, PAGE, BLOCK_N)
    async_copy.wait_group(STAGES - 1)
    return ksm.index(it % STAGES).load(KEY_LOAD), vsm.index(it % STAGES).load(VAL_LOAD)


@gluon.jit
def _word_pointers(K0, V0, kvh, k0_s, k0_h, v0_s, v0_h, kstep, vstep, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                   VAL_WORDS: gl.constexpr):
    """``PREFETCH`` 1: the code fields as int32 words, the words' offsets (:func:`_word_offsets`) and the page
    steps in words."""
    ikw, koffw, ivw, voffw = _word_offsets(kvh, k0_s, k0_h, v0_s, v0_h, PAGE, BLOCK_N, VAL_WORDS)
    return (K0.to(gl.pointer_type(gl.int32)), V0.to(gl.pointer_type(gl.int32)), ikw, koffw, ivw, voffw, kstep // 4,
            vstep // 4)


@gluon.jit
def _scale_loads(BT, b, stride_btb, t0, end, K1, V1, tpos, k1off, v1off, k1step, v1step, PAGE: gl.constexpr,
                 BLOCK_N: gl.constexpr):
    """The tile at ``t0``'s int64 scale words, ``tpos`` the token of each word in the tile (the first of a token pair
    for E8M0 blocks of 32, the token itself for blocks of 16), 0 past ``end``."""
    p0, p1, p2, p3 = _tile_pages(BT, b, stride_btb, t0, end, PAGE, BLOCK_N)
    m = (t0 + tpos) < end
    kw = gl.load(_page_rows(tpos, K1, p0, p1, p2, p3, k1step, PAGE) + k1off, mask=m, other=0)
    vw = gl.load(_page_rows(tpos, V1, p0, p1, p2, p3, v1step, PAGE) + v1off, mask=m, other=0)
    return kw, vw


@gluon.jit
def _word_offsets(kvh, k0_s, k0_h, v0_s, v0_h, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, VAL_WORDS: gl.constexpr):
    """:func:`_code_offsets` in int32 words (row strides in bytes, multiples of 16): the key and value words'
    offsets inside their pages [N, 16] (KEY_WORDS, ``VAL_WORDS``) and their token positions."""
    ik = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, KEY_WORDS))
    koff = (((ik % PAGE) * k0_s + kvh * k0_h) // 4)[:, None] + gl.arange(0, 16, layout=gl.SliceLayout(0, KEY_WORDS))[
        None, :]
    iv = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, VAL_WORDS))
    voff = (((iv % PAGE) * v0_s + kvh * v0_h) // 4)[:, None] + gl.arange(0, 16, layout=gl.SliceLayout(0, VAL_WORDS))[
        None, :]
    return ik, koff, iv, voff


@gluon.jit
def _word_bytes(w, layout: gl.constexpr):
    """int32 words [N, 16] -> their bytes [N, 64] (uint8, byte 4 j + i = bits 8 i .. 8 i + 7 of word j) in
    ``layout`` (the byte loads' layout: the same registers)."""
    b0 = (w & 0xFF).to(gl.uint8)
    b1 = ((w >> 8) & 0xFF).to(gl.uint8)
    b2 = ((w >> 16) & 0xFF).to(gl.uint8)
    b3 = ((w >> 24) & 0xFF).to(gl.uint8)
    x = gl.join(gl.join(b0, b2), gl.join(b1, b3))  # [N, 16, m, k]: byte 2 m + k
    return _trivial(gl.reshape(x, (w.shape[0], 64)), layout)


@gluon.jit
def _pair_words(w, m, N: gl.constexpr):
    """int64 words of token pairs [N / 2] (PAIRS_N) -> each token's int32 word [N] (the score columns' layout),
    0 where ``m`` is false."""
    x = gl.reshape(gl.join(w.to(gl.int32), (w >> 32).to(gl.int32)), (N,))
    return gl.where(m, _trivial(x, gl.SliceLayout(0, MMA)), 0)


@gluon.jit
def _key_operands(kb, N: gl.constexpr):
    """Code bytes [N, 64] (KEY_LOAD) -> the low / high nibbles as float16 E2M1 * 2**-14 B operands [64, N],
    k = 16 c + 8 h + 2 t + e for byte 16 t + 4 c + 2 h + e."""
    lo, hi = gl.inline_asm_elementwise(E2M1_PAIRS_PTX, "=r,=r,=r,=r,r", [kb], dtype=(gl.float16, gl.float16),
                                       is_pure=True, pack=4)
    return _key_relabel(lo, N), _key_relabel(hi, N)


@gluon.jit
def _key_relabel(x, N: gl.constexpr):
    x = gl.permute(x, (1, 0))  # [64 bytes, N tokens]
    x = gl.reshape(x, (4, 4, 2, 2, N))  # (t, c, h, e, n)
    x = gl.permute(x, (1, 2, 0, 3, 4))  # (c, h, t, e, n)
    return _trivial(gl.reshape(x, (64, N)), OP_B)


@gluon.jit
def _value_operands(vb, N: gl.constexpr):
    """Code bytes [N tokens, 64 bytes] (:func:`value_load_layout`) -> the low / high nibbles as exact bfloat16 B
    operands [N tokens, 64 columns], column g + 8 j for byte 8 g + j."""
    lo, hi = gl.inline_asm_elementwise(E2M1_PAIRS_BF16_PTX, "=r,=r,=r,=r,r", [vb],
                                       dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
    return _value_relabel(lo * TWO_126, N), _value_relabel(hi * TWO_126, N)


@gluon.jit
def _value_operands_f16(vb, N: gl.constexpr):
    """Code bytes [N tokens, 64 bytes] (:func:`value_load_layout`) -> the low / high nibbles as float16
    E2M1 * 2**-14 B operands [N tokens, 64 columns] (column g + 8 j for byte 8 g + j), the two tokens of a register
    interleaved before the unpacking (:func:`_token_pairs_ptx`)."""
    a, b = gl.split(gl.permute(gl.reshape(vb, (N // 2, 2, 64)), (0, 2, 1)))  # tokens 2 r and 2 r + 1
    lo01, hi01, lo23, hi23 = gl.inline_asm_elementwise(
        TOKEN_PAIRS_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [a, b],
        dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=4)
    return _pairs_relabel(lo01, lo23, N), _pairs_relabel(hi01, hi23, N)


@gluon.jit
def _pairs_relabel(x01, x23, N: gl.constexpr):
    """:func:`_value_operands_f16`'s outputs as [N tokens, 64 columns]: element (r, 4 q + 2 j + e) of ``x01`` holds
    token 2 r + e's byte 4 q + j, of ``x23`` its byte 4 q + 2 + j."""
    x = gl.reshape(gl.join(x01, x23), (N // 2, 16, 2, 2, 2))  # (r, q, j, e, k): byte 4 q + 2 k + j of 2 r + e
    x = gl.reshape(gl.permute(x, (0, 3, 1, 4, 2)), (N, 64))  # [token, byte]
    return _value_relabel(x, N)


@gluon.jit
def _value_relabel(x, N: gl.constexpr):
    x = gl.reshape(x, (N, 8, 8))  # (token, g, j)
    x = gl.permute(x, (0, 2, 1))  # (token, j, g)
    return _trivial(gl.reshape(x, (N, 64)), OP_B)


@gluon.jit
def fp4_e8m0_split_kernel(
    Q, BT, SL, K0, K1, V0, V1, OP, LP, qk_scale, tokens_per_split,
    stride_qb, stride_qh, stride_btb, k0_s, k0_h, k1_s, k1_h, v0_s, v0_h, v1_s, v1_h, op_b, op_h, op_s, lp_b, lp_h,
    QPK: gl.constexpr, PAGE: gl.constexpr, PAGE_SLOTS: gl.constexpr, QB: gl.constexpr, BLOCK_N: gl.constexpr,
    VAL_LOAD: gl.constexpr, PAIRS_N: gl.constexpr, VF16: gl.constexpr = False, LAZY: gl.constexpr = False,
    PREFETCH: gl.constexpr = 0, VAL_WORDS: gl.constexpr = None,
):
    gl.static_assert(VF16 or not LAZY)
    VH: gl.constexpr = 7 if LAZY else 15  # float16 headroom of the value weights p 2**(c - mc): p <= 2**8 if LAZY
    gl.static_assert(QB == 32)  # 4 blocks of 32 channels: rows (block, head) = 16 (mxfp4)
    b, kvh, split, start, end = _program_tokens(SL, tokens_per_split)

    # q's rows: (block, head) x permuted channels, both nibble halves; one power of two puts them in float16
    qe = _q_rows(Q, b, kvh, stride_qb, stride_qh, 0, 64, QB, 0, 0, QPK)
    qo = _q_rows(Q, b, kvh, stride_qb, stride_qh, 0, 64, QB, 0, 1, QPK)
    eq = _q_exponent(gl.max(gl.max(gl.maximum(gl.abs(qe), gl.abs(qo)), 1), 0))
    qe16 = (qe * _pow2(eq)).to(gl.float16)
    qo16 = (qo * _pow2(eq)).to(gl.float16)
    sc_k = qk_scale * _pow2(-eq) * 16384.0

    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    blk = (rows // 4)[:, None]  # the block of row (block, head)
    m_i = gl.full([16], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
    l_i = gl.zeros([16], gl.float32, layout=gl.SliceLayout(1, MMA))
    acc_lo = gl.zeros([16, 64], gl.float32, layout=MMA)
    acc_hi = gl.zeros([16, 64], gl.float32, layout=MMA)
    mc_i = gl.zeros([16], gl.int32, layout=gl.SliceLayout(1, MMA))  # VF16: each row's largest value code so far << 23
    ik, koff, iv, voff, isc = _code_offsets(kvh, k0_s, k0_h, v0_s, v0_h, PAGE, BLOCK_N, VAL_LOAD)
    # scale words read two tokens at a time (the int64 fields K1, V1: tokens 2 i and 2 i + 1 of a page), in the
    # layout whose join gives the score columns' (PAIRS_N)
    ip = gl.arange(0, BLOCK_N // 2, layout=PAIRS_N)
    tp = 2 * ip  # the first token of each pair
    k1off = (ip % (PAGE // 2)) * k1_s + kvh * k1_h
    v1off = (ip % (PAGE // 2)) * v1_s + kvh * v1_h
    kstep = PAGE_SLOTS * k0_s
    vstep = PAGE_SLOTS * v0_s
    k1step = (PAGE_SLOTS // 2) * k1_s
    v1step = (PAGE_SLOTS // 2) * v1_s
    STAGES: gl.constexpr = PREFETCH + 1
    if PREFETCH >= 2:  # code bytes through a ring of PREFETCH + 1 shared buffers by cp.async, PREFETCH tiles
        # ahead; the scale words one tile ahead in registers
        ksm, vsm = _ring_start(BT, b, stride_btb, start, end, K0, V0, ik, iv, koff, voff, kstep, vstep, STAGES, PAGE,
                               BLOCK_N)
        kw2, vw2 = _scale_loads(BT, b, stride_btb, start, end, K1, V1, tp, k1off, v1off, k1step, v1step, PAGE,
                                BLOCK_N)
    elif PREFETCH:  # the first tile's words; each next tile's are read before this tile's arithmetic and carried
        # in registers as int32 words (carried as bytes they took a register each: 255 registers and spills)
        K0w, V0w, ikw, koffw, ivw, voffw, kstepw, vstepw = _word_pointers(K0, V0, kvh, k0_s, k0_h, v0_s, v0_h, kstep,
                                                                          vstep, PAGE, BLOCK_N, VAL_WORDS)
        kww, vww, kw2, vw2 = _tile_loads(BT, b, stride_btb, start, end, K0w, K1, V0w, V1, ikw, ivw, tp, koffw, voffw,
                                         k1off, v1off, kstepw, vstepw, k1step, v1step, PAGE, BLOCK_N)
    for t0 in range(start, end, BLOCK_N):
        if PREFETCH >= 2:
            kb_c, vb_c = _ring_step(ksm, vsm, BT, b, stride_btb, t0, start, end, K0, V0, ik, iv, koff, voff, kstep,
                                    vstep, VAL_LOAD, STAGES, PAGE, BLOCK_N)
            kw2_c, vw2_c = kw2, vw2
            kw2, vw2 = _scale_loads(BT, b, stride_btb, t0 + BLOCK_N, end, K1, V1, tp, k1off, v1off, k1step, v1step,
                                    PAGE, BLOCK_N)
        elif PREFETCH:
            kb_c = _word_bytes(kww, KEY_LOAD)
            vb_c = _word_bytes(vww, VAL_LOAD)
            kw2_c, vw2_c = kw2, vw2
            kww, vww, kw2, vw2 = _tile_loads(BT, b, stride_btb, t0 + BLOCK_N, end, K0w, K1, V0w, V1, ikw, ivw, tp,
                                             koffw, voffw, k1off, v1off, kstepw, vstepw, k1step, v1step, PAGE,
                                             BLOCK_N)
        else:
            kb_c, vb_c, kw2_c, vw2_c = _tile_loads(BT, b, stride_btb, t0, end, K0, K1, V0, V1, ik, iv, tp, koff,
                                                   voff, k1off, v1off, kstep, vstep, k1step, v1step, PAGE, BLOCK_N)
        ms = (t0 + isc) < end
        kw = _pair_words(kw2_c, ms, BLOCK_N)
        vw = _pair_words(vw2_c, ms, BLOCK_N)

        klo, khi = _key_operands(kb_c, BLOCK_N)
        s2 = mma_v2(qe16, klo, gl.zeros([16, BLOCK_N], gl.float32, layout=MMA))
        s2 = mma_v2(qo16, khi, s2)
        ksc = _e8m0_fields(kw[None, :], blk).to(gl.float32, bitcast=True)
        s3 = gl.reshape(s2 * ksc, (4, 4, BLOCK_N))
        s = gl.sum(s3, 0)  # [4 heads, N], before the softmax scale sc_k
        s16 = _trivial(gl.reshape(gl.broadcast(gl.expand_dims(s, 0), s3)[0], (16, BLOCK_N)), MMA)
        s16 = gl.where(ms[None, :], s16, float("-inf"))
        vfield = _e8m0_fields(vw[None, :], blk)  # code << 23
        if LAZY:
            # FlashAttention 4's conditional rescale: the running max moves (and the accumulators are rescaled)
            # only where a row's tile max exceeds it by more than 8 (so p <= 2**8), or a value code exceeds mc
            mt = gl.max(s16, 1) * sc_k
            mct = gl.max(vfield, 1)
            if gl.max(((mt > m_i + 8.0) | (mct > mc_i)).to(gl.int32), 0) != 0:
                m_new = gl.maximum(m_i, mt)
                mc_new = gl.maximum(mc_i, mct)
                alpha = gl.exp2(m_i - m_new)
                l_i = l_i * alpha
                alpha = alpha * _pow2_fields(mc_i, mc_new, 127)
                acc_lo = acc_lo * alpha[:, None]
                acc_hi = acc_hi * alpha[:, None]
                m_i = m_new
                mc_i = mc_new
            p = gl.exp2(s16 * sc_k - m_i[:, None])
            l_i = l_i + gl.sum(p, 1)
            pv = _trivial((p * _pow2_fields(vfield, mc_i[:, None], 127 + VH)).to(gl.float16), OP_A)
            vlo, vhi = _value_operands_f16(vb_c, BLOCK_N)
        else:
            m_new = gl.maximum(m_i, gl.max(s16, 1) * sc_k)
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s16 * sc_k - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            if VF16:
                # p 2**(c - mc + VH) in float16 (at most 2**15) against E2M1 * 2**-14, mc the row's largest value
                # code so far: the accumulators hold sum p v 2**(113 + VH - mc), rescaled with alpha where mc grows
                mc_new = gl.maximum(mc_i, gl.max(vfield, 1))
                alpha = alpha * _pow2_fields(mc_i, mc_new, 127)
                mc_i = mc_new
                pv = _trivial((p * _pow2_fields(vfield, mc_new[:, None], 127 + VH)).to(gl.float16), OP_A)
                vlo, vhi = _value_operands_f16(vb_c, BLOCK_N)
            else:
                pv = _trivial((p * vfield.to(gl.float32, bitcast=True)).to(gl.bfloat16), OP_A)
                vlo, vhi = _value_operands(vb_c, BLOCK_N)
        if LAZY:
            acc_lo = mma_v2(pv, vlo, acc_lo)
            acc_hi = mma_v2(pv, vhi, acc_hi)
        else:
            acc_lo = mma_v2(pv, vlo, acc_lo * alpha[:, None])
            acc_hi = mma_v2(pv, vhi, acc_hi * alpha[:, None])

    if PREFETCH >= 2:  # the copies issued past the last tile, drained before the program ends
        async_copy.wait_group(0)
    # row (blk, h) column n holds channel 2 byte + half for byte 8 (n % 8) + n // 8; keep the block's own
    safe_l = gl.where(l_i > 0, l_i, 1.0)
    den = safe_l
    if VF16:
        # the accumulators hold sum p v 2**(113 + VH - mc): out = acc / (l 2**(113 + VH - mc)) (a row that saw no
        # value code, mc = 0, has acc = 0)
        den = safe_l * (((240 + VH) << 23) - mc_i).to(gl.float32, bitcast=True)
    hh = rows % 4
    n = gl.arange(0, 64, layout=gl.SliceLayout(0, MMA))
    vbyte = 8 * (n % 8) + n // 8
    om = (hh < QPK)[:, None] & ((vbyte // (QB // 2))[None, :] == (rows // 4)[:, None])
    obase = OP + b * op_b + (kvh * QPK + hh).to(gl.int64)[:, None] * op_h + split * op_s
    gl.store(obase + (2 * vbyte)[None, :], acc_lo / den[:, None], mask=om)
    gl.store(obase + (2 * vbyte + 1)[None, :], acc_hi / den[:, None], mask=om)
    lse2 = gl.where(l_i > 0, m_i + gl.log2(safe_l), float("-inf"))
    gl.store(LP + b * lp_b + (kvh * QPK + hh).to(gl.int64) * lp_h + split, lse2, mask=(hh < QPK) & (rows < 4))


def value_load_layout_b16(block_n: int) -> gl.DistributedLinearLayout:
    """[block_n tokens, 64 bytes] for blocks of 16 channels (8 bytes): lane g (lane // 4) reads 4 contiguous bytes of
    the even block 2 (g // 2) and the same 4 of the odd block after it, 16 (g // 2) + 4 (g % 2) + {0 .. 3} and + 8,
    of the tokens 2 t + e + 8 r."""
    regs = [[0, 1], [0, 2], [0, 8], [1, 0]] + [[8 << i, 0] for i in range((block_n // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[2, 0], [4, 0], [0, 4], [0, 16], [0, 32]],
                                      warp_bases=[], block_bases=[], shape=[block_n, 64])


def word_pairs_layout(block_n: int) -> gl.DistributedLinearLayout:
    """[block_n / 2, 2] scale words of token pairs (i = t + 4 j, e): the two tokens of a pair in one thread's
    consecutive registers (one vector load), joined they are the score columns 2 t + e + 8 j."""
    regs = [[0, 1]] + [[4 << i, 0] for i in range((block_n // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[1, 0], [2, 0], [0, 0], [0, 0], [0, 0]],
                                      warp_bases=[], block_bases=[], shape=[block_n // 2, 2])


@gluon.jit
def _key_halves(x, N: gl.constexpr):
    """The [64, N] key operand before its conversion (:func:`_key_relabel`'s k) split into k < 32 (chunks c = 0, 1:
    the even block 2 t of byte 16 t + ...) and k >= 32 (the odd block 2 t + 1), each a [32, N] B operand."""
    x = gl.permute(x, (1, 0))
    x = gl.reshape(x, (4, 4, 2, 2, N))
    x = gl.reshape(gl.permute(x, (1, 2, 0, 3, 4)), (2, 32, N))
    a, b = gl.split(gl.permute(x, (1, 2, 0)))
    return _trivial(a, OP_B), _trivial(b, OP_B)


@gluon.jit
def _b16_value_operands(vb, N: gl.constexpr):
    """Code bytes [N, 64] (:func:`value_load_layout_b16`) -> float16 E2M1 * 2**-14 B operands [N, 32] of the even
    blocks and of the odd blocks, low and high nibbles: column g + 8 j of the even (odd) operands is byte
    16 (g // 2) + 4 (g % 2) + j (+ 8)."""
    a, b = gl.split(gl.permute(gl.reshape(vb, (N // 2, 2, 64)), (0, 2, 1)))
    lo01, hi01, lo23, hi23 = gl.inline_asm_elementwise(
        TOKEN_PAIRS_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [a, b],
        dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=4)
    lo_e, lo_o = _b16_columns(lo01, lo23, N)
    hi_e, hi_o = _b16_columns(hi01, hi23, N)
    return lo_e, lo_o, hi_e, hi_o


@gluon.jit
def _b16_columns(x01, x23, N: gl.constexpr):
    x = gl.reshape(gl.join(x01, x23), (N // 2, 16, 2, 2, 2))
    x = gl.reshape(gl.permute(x, (0, 3, 1, 4, 2)), (N, 4, 2, 2, 4))  # [token, byte = 16 G + 8 eo + 4 g0 + j]
    x = gl.reshape(gl.permute(x, (0, 2, 4, 1, 3)), (N, 2, 32))  # [token, eo, column 8 j + 2 G + g0]
    e, o = gl.split(gl.permute(x, (0, 2, 1)))
    return _trivial(e, OP_B), _trivial(o, OP_B)


@gluon.jit
def _b16_fields(wsel, X: gl.constexpr, rows):
    """The E8M0 scales (exponent fields, int32 [16, N]) of rows (b', h) for block 2 (b' % 2) + X of the 32-bit half
    ``wsel`` holds (rows 0-7: blocks 0-3, rows 8-15: blocks 4-7)."""
    return _e8m0_fields(wsel, (2 * ((rows // 4) % 2) + X)[:, None])


@gluon.jit
def _b16_scales(wsel, X: gl.constexpr, rows, NV: gl.constexpr):
    """NVFP4 (``NV``): the E4M3 block scales of :func:`_b16_fields`' rows and blocks, as float32 (converted in
    hardware); E8M0: the exponent fields as float32 2**(c - 127)."""
    if NV:
        sh = 8 * (2 * ((rows // 4) % 2) + X)
        return ((wsel >> sh[:, None]) & 0xFF).to(gl.uint8).to(gl.float8e4nv, bitcast=True).to(gl.float32)
    else:
        return _b16_fields(wsel, X, rows).to(gl.float32, bitcast=True)


@gluon.jit
def fp4_e8m0_b16_split_kernel(
    Q, BT, SL, K0, K1, V0, V1, KS, VS, OP, LP, qk_scale, tokens_per_split,
    stride_qb, stride_qh, stride_btb, k0_s, k0_h, k1_s, k1_h, v0_s, v0_h, v1_s, v1_h, op_b, op_h, op_s, lp_b, lp_h,
    QPK: gl.constexpr, PAGE: gl.constexpr, PAGE_SLOTS: gl.constexpr, BLOCK_N: gl.constexpr,
    VAL_LOAD: gl.constexpr, WORDS: gl.constexpr, NV: gl.constexpr = False, PREFETCH: gl.constexpr = 0,
    VAL_WORDS: gl.constexpr = None,
):
    """fp4_e2m1 (E8M0 blocks of 16 channels) with :func:`fp4_e8m0_split_kernel`'s VF16 and LAZY arithmetic. Key
    products by halves of k: k < 32 meets each thread's even block, k >= 32 its odd one, so q's rows (b', h) are
    block 2 b' + X of product X; values by the even and the odd blocks' bytes, two products of [16, N] x [N, 32]
    whose rows (b', h) are block 2 b' and 2 b' + 1. ``K1``, ``V1``: the 8 scale codes of a (token, head) as int64.
    ``NV``: NVFP4 (E4M3 block scales, ``KS`` / ``VS`` the per-head tensor scales): no value reference code, the value
    weights p s / 2 in float16 (at most 2**8 x 448 / 2 < 65504 with the conditional rescale's p <= 2**8)."""
    VH: gl.constexpr = 7
    b, kvh, split, start, end = _program_tokens(SL, tokens_per_split)

    qe0 = _q_rows(Q, b, kvh, stride_qb, stride_qh, 0, 32, 16, 0, 0, QPK)
    qo0 = _q_rows(Q, b, kvh, stride_qb, stride_qh, 0, 32, 16, 0, 1, QPK)
    qe1 = _q_rows(Q, b, kvh, stride_qb, stride_qh, 32, 32, 16, 1, 0, QPK)
    qo1 = _q_rows(Q, b, kvh, stride_qb, stride_qh, 32, 32, 16, 1, 1, QPK)
    eq = _q_exponent(gl.maximum(gl.max(gl.max(gl.maximum(gl.abs(qe0), gl.abs(qo0)), 1), 0),
                                gl.max(gl.max(gl.maximum(gl.abs(qe1), gl.abs(qo1)), 1), 0)))
    qe0 = (qe0 * _pow2(eq)).to(gl.float16)
    qo0 = (qo0 * _pow2(eq)).to(gl.float16)
    qe1 = (qe1 * _pow2(eq)).to(gl.float16)
    qo1 = (qo1 * _pow2(eq)).to(gl.float16)
    sc_k = qk_scale * gl.load(KS + kvh) * _pow2(-eq) * 16384.0

    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    m_i = gl.full([16], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
    l_i = gl.zeros([16], gl.float32, layout=gl.SliceLayout(1, MMA))
    acc_e_lo = gl.zeros([16, 32], gl.float32, layout=MMA)
    acc_e_hi = gl.zeros([16, 32], gl.float32, layout=MMA)
    acc_o_lo = gl.zeros([16, 32], gl.float32, layout=MMA)
    acc_o_hi = gl.zeros([16, 32], gl.float32, layout=MMA)
    mc_e = gl.zeros([16], gl.int32, layout=gl.SliceLayout(1, MMA))
    mc_o = gl.zeros([16], gl.int32, layout=gl.SliceLayout(1, MMA))
    ik, koff, iv, voff, isc = _code_offsets(kvh, k0_s, k0_h, v0_s, v0_h, PAGE, BLOCK_N, VAL_LOAD)
    iw = gl.arange(0, BLOCK_N // 2, layout=gl.SliceLayout(1, WORDS))
    ew = gl.arange(0, 2, layout=gl.SliceLayout(0, WORDS))
    tw = (2 * iw)[:, None] + ew[None, :]  # token of each word
    k1off = (tw % PAGE) * k1_s + kvh * k1_h
    v1off = (tw % PAGE) * v1_s + kvh * v1_h
    kstep = PAGE_SLOTS * k0_s
    vstep = PAGE_SLOTS * v0_s
    k1step = PAGE_SLOTS * k1_s
    v1step = PAGE_SLOTS * v1_s
    low_rows = (rows < 8)[:, None]
    STAGES: gl.constexpr = PREFETCH + 1
    if PREFETCH >= 2:  # as fp4_e8m0_split_kernel's: cp.async PREFETCH tiles ahead, scale words one in registers
        ksm, vsm = _ring_start(BT, b, stride_btb, start, end, K0, V0, ik, iv, koff, voff, kstep, vstep, STAGES, PAGE,
                               BLOCK_N)
        kwn, vwn = _scale_loads(BT, b, stride_btb, start, end, K1, V1, tw, k1off, v1off, k1step, v1step, PAGE,
                                    BLOCK_N)
    elif PREFETCH:  # as fp4_e8m0_split_kernel's: the next tile's code words carried in registers
        K0w, V0w, ikw, koffw, ivw, voffw, kstepw, vstepw = _word_pointers(K0, V0, kvh, k0_s, k0_h, v0_s, v0_h, kstep,
                                                                          vstep, PAGE, BLOCK_N, VAL_WORDS)
        kww, vww, kwn, vwn = _tile_loads(BT, b, stride_btb, start, end, K0w, K1, V0w, V1, ikw, ivw, tw, koffw,
                                             voffw, k1off, v1off, kstepw, vstepw, k1step, v1step, PAGE,
                                             BLOCK_N)
    for t0 in range(start, end, BLOCK_N):
        if PREFETCH >= 2:
            kb, vb = _ring_step(ksm, vsm, BT, b, stride_btb, t0, start, end, K0, V0, ik, iv, koff, voff, kstep, vstep,
                                VAL_LOAD, STAGES, PAGE, BLOCK_N)
            kw, vw = kwn, vwn
            kwn, vwn = _scale_loads(BT, b, stride_btb, t0 + BLOCK_N, end, K1, V1, tw, k1off, v1off, k1step,
                                        v1step, PAGE, BLOCK_N)
        elif PREFETCH:
            kb = _word_bytes(kww, KEY_LOAD)
            vb = _word_bytes(vww, VAL_LOAD)
            kw, vw = kwn, vwn
            kww, vww, kwn, vwn = _tile_loads(BT, b, stride_btb, t0 + BLOCK_N, end, K0w, K1, V0w, V1, ikw, ivw,
                                                 tw, koffw, voffw, k1off, v1off, kstepw, vstepw, k1step,
                                                 v1step, PAGE, BLOCK_N)
        else:
            kb, vb, kw, vw = _tile_loads(BT, b, stride_btb, t0, end, K0, K1, V0, V1, ik, iv, tw, koff, voff,
                                             k1off, v1off, kstep, vstep, k1step, v1step, PAGE, BLOCK_N)
        kw = _trivial(gl.reshape(kw, (BLOCK_N,)), gl.SliceLayout(0, MMA))
        vw = _trivial(gl.reshape(vw, (BLOCK_N,)), gl.SliceLayout(0, MMA))
        ms = (t0 + isc) < end

        # keys: the even and the odd blocks' products, each block's partial dot times its scale
        klo, khi = gl.inline_asm_elementwise(E2M1_PAIRS_PTX, "=r,=r,=r,=r,r", [kb], dtype=(gl.float16, gl.float16),
                                             is_pure=True, pack=4)
        klo0, klo1 = _key_halves(klo, BLOCK_N)
        khi0, khi1 = _key_halves(khi, BLOCK_N)
        zero = gl.zeros([16, BLOCK_N], gl.float32, layout=MMA)
        s_e = mma_v2(qo0, khi0, mma_v2(qe0, klo0, zero))
        s_o = mma_v2(qo1, khi1, mma_v2(qe1, klo1, zero))
        kws = gl.where(low_rows, kw.to(gl.int32)[None, :], (kw >> 32).to(gl.int32)[None, :])
        s2 = s_e * _b16_scales(kws, 0, rows, NV) + s_o * _b16_scales(kws, 1, rows, NV)
        s3 = gl.reshape(s2, (4, 4, BLOCK_N))
        s = gl.sum(s3, 0)
        s16 = _trivial(gl.reshape(gl.broadcast(gl.expand_dims(s, 0), s3)[0], (16, BLOCK_N)), MMA)
        s16 = gl.where(ms[None, :], s16, float("-inf"))
        vws = gl.where(low_rows, vw.to(gl.int32)[None, :], (vw >> 32).to(gl.int32)[None, :])
        mt = gl.max(s16, 1) * sc_k
        if NV:
            vws = gl.where(ms[None, :], vws, 0)
            grow = mt > m_i + 8.0
        else:
            vf_e = gl.where(ms[None, :], _b16_fields(vws, 0, rows), 0)
            vf_o = gl.where(ms[None, :], _b16_fields(vws, 1, rows), 0)
            mct_e = gl.max(vf_e, 1)
            mct_o = gl.max(vf_o, 1)
            grow = (mt > m_i + 8.0) | (mct_e > mc_e) | (mct_o > mc_o)
        if gl.max(grow.to(gl.int32), 0) != 0:
            m_new = gl.maximum(m_i, mt)
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha
            if NV:
                me_new = mc_e
                mo_new = mc_o
                a_e = alpha
                a_o = alpha
            else:
                me_new = gl.maximum(mc_e, mct_e)
                mo_new = gl.maximum(mc_o, mct_o)
                a_e = alpha * _pow2_fields(mc_e, me_new, 127)
                a_o = alpha * _pow2_fields(mc_o, mo_new, 127)
            acc_e_lo = acc_e_lo * a_e[:, None]
            acc_e_hi = acc_e_hi * a_e[:, None]
            acc_o_lo = acc_o_lo * a_o[:, None]
            acc_o_hi = acc_o_hi * a_o[:, None]
            m_i = m_new
            mc_e = me_new
            mc_o = mo_new
        p = gl.exp2(s16 * sc_k - m_i[:, None])
        l_i = l_i + gl.sum(p, 1)
        if NV:
            f_e = _b16_scales(vws, 0, rows, True) * 0.5
            f_o = _b16_scales(vws, 1, rows, True) * 0.5
        else:
            f_e = _pow2_fields(vf_e, mc_e[:, None], 127 + VH)
            f_o = _pow2_fields(vf_o, mc_o[:, None], 127 + VH)
        pv_e = _trivial((p * f_e).to(gl.float16), OP_A)
        pv_o = _trivial((p * f_o).to(gl.float16), OP_A)
        vlo_e, vlo_o, vhi_e, vhi_o = _b16_value_operands(vb, BLOCK_N)
        acc_e_lo = mma_v2(pv_e, vlo_e, acc_e_lo)
        acc_e_hi = mma_v2(pv_e, vhi_e, acc_e_hi)
        acc_o_lo = mma_v2(pv_o, vlo_o, acc_o_lo)
        acc_o_hi = mma_v2(pv_o, vhi_o, acc_o_hi)

    if PREFETCH >= 2:  # the copies issued past the last tile, drained before the program ends
        async_copy.wait_group(0)
    safe_l = gl.where(l_i > 0, l_i, 1.0)
    vs = gl.load(VS + kvh)
    if NV:  # the accumulators hold sum p s v 2**-15
        den_e = safe_l * (2.0**-15) / vs
        den_o = den_e
    else:
        den_e = safe_l * (((240 + VH) << 23) - mc_e).to(gl.float32, bitcast=True) / vs
        den_o = safe_l * (((240 + VH) << 23) - mc_o).to(gl.float32, bitcast=True) / vs
    hh = rows % 4
    n = gl.arange(0, 32, layout=gl.SliceLayout(0, MMA))
    g = n % 8
    ebyte = 16 * (g // 2) + 4 * (g % 2) + n // 8  # the even operands' byte of column n (block 2 (g // 2))
    om = (hh < QPK)[:, None] & ((g // 2)[None, :] == (rows // 4)[:, None])
    obase = OP + b * op_b + (kvh * QPK + hh).to(gl.int64)[:, None] * op_h + split * op_s
    gl.store(obase + (2 * ebyte)[None, :], acc_e_lo / den_e[:, None], mask=om)
    gl.store(obase + (2 * ebyte + 1)[None, :], acc_e_hi / den_e[:, None], mask=om)
    gl.store(obase + (2 * ebyte + 16)[None, :], acc_o_lo / den_o[:, None], mask=om)
    gl.store(obase + (2 * ebyte + 17)[None, :], acc_o_hi / den_o[:, None], mask=om)
    lse2 = gl.where(l_i > 0, m_i + gl.log2(safe_l), float("-inf"))
    gl.store(LP + b * lp_b + (kvh * QPK + hh).to(gl.int64) * lp_h + split, lse2, mask=(hh < QPK) & (rows < 4))


#: the kernels ``--compile-only`` builds for sm_90: mxfp4 with float16 values and the conditional rescale, mxfp4 with
#: bfloat16 values, fp4_e2m1, nvfp4; the first and third with the next tile's code words in registers (PREFETCH 1)
#: and with a cp.async ring two tiles ahead (PREFETCH 2: 3 x 2 x 32 x 64 bytes of shared memory)
BUILDS = {"mxfp4-vf16-lazy": {"vf16": True, "lazy": True}, "mxfp4-bf16": {}, "fp4_e2m1": {"b16": True},
          "nvfp4": {"b16": True, "nv": True},
          "mxfp4-vf16-lazy-words": {"vf16": True, "lazy": True, "prefetch": 1},
          "mxfp4-vf16-lazy-ring": {"vf16": True, "lazy": True, "prefetch": 2},
          "fp4_e2m1-words": {"b16": True, "prefetch": 1}, "fp4_e2m1-ring": {"b16": True, "prefetch": 2}}


def compile_sm90(num_warps: int = 1, block_n: int = 32, vf16: bool = False, lazy: bool = False,
                 prefetch: int = 0, b16: bool = False, maxnreg: int | None = None, nv: bool = False):
    """Ahead-of-time compile for sm_90 (no GPU needed): the compiled kernel, for its SASS and resource usage."""
    sig = {name: "i32" for name in ("tokens_per_split", "stride_qb", "stride_qh", "stride_btb", "k0_s", "k0_h",
                                    "k1_s", "k1_h", "v0_s", "v0_h", "v1_s", "v1_h", "op_b", "op_h", "op_s", "lp_b",
                                    "lp_h")}
    sig.update({"Q": "*bf16", "BT": "*i32", "SL": "*i32", "K0": "*u8", "K1": "*i64", "V0": "*u8", "V1": "*i64",
                "OP": "*fp32", "LP": "*fp32", "qk_scale": "fp32"})
    if b16:
        fn = fp4_e8m0_b16_split_kernel
        consts = {"QPK": 4, "PAGE": 16, "PAGE_SLOTS": 128, "BLOCK_N": block_n,
                  "VAL_LOAD": value_load_layout_b16(block_n), "WORDS": word_pairs_layout(block_n), "NV": nv,
                  "PREFETCH": prefetch, "VAL_WORDS": value_words_layout(block_n, True),
                  "k1_s": 1, "v1_s": 1}
        sig.update({"KS": "*fp32", "VS": "*fp32"})
    else:
        fn = fp4_e8m0_split_kernel
        consts = {"QPK": 4, "PAGE": 16, "PAGE_SLOTS": 128, "QB": 32, "BLOCK_N": block_n,
                  "VAL_LOAD": value_load_layout(block_n), "PAIRS_N": pairs_layout(block_n), "VF16": vf16,
                  "LAZY": lazy, "PREFETCH": prefetch, "VAL_WORDS": value_words_layout(block_n), "k1_s": 1,
                  "v1_s": 1}
    return aot_sm90(fn, sig, consts, ("Q", "BT", "SL", "K0", "K1", "V0", "V1", "OP", "LP", "stride_qb", "stride_qh",
                                      "k0_s", "k0_h", "v0_s", "v0_h", "op_b", "op_h", "op_s"), num_warps, maxnreg)


def aot_sm90(fn, sig: dict, consts: dict, divisible: tuple, num_warps: int = 1, maxnreg: int | None = None):
    """``fn`` (a Gluon kernel) compiled ahead of time for sm_90 (no GPU needed) with signature ``sig`` (the
    constexprs ``consts`` added), the arguments ``divisible`` marked 16-divisible as on the device."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = sig | {k: "constexpr" for k in consts}
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(fn.arg_names) if k in divisible}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": num_warps} | ({"maxnreg": maxnreg} if maxnreg else {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


class SplitOutputs:
    """A probe's split plan over ``dc`` and its buffers, as ``decode_split_kernel`` and ``merge_kernel`` use them:
    ``tokens_per_split`` (a multiple of ``tile``), ``op`` [B, Hq, S, D] and ``lp`` [B, Hq, S] (the splits'
    normalised outputs and base-2 log-sum-exp), ``out`` [B, Hq, D] and ``lse`` [B, Hq] (merged), float32."""

    def __init__(self, q, dc, splits: int, tile: int) -> None:
        import torch

        batch, q_heads, d = q.shape
        tps = -(-int(dc.seq_lens.max()) // splits)
        self.splits, self.tokens_per_split = splits, -(-tps // tile) * tile
        self.op = torch.empty(batch, q_heads, splits, d, device=q.device, dtype=torch.float32)
        self.lp = torch.empty(batch, q_heads, splits, device=q.device, dtype=torch.float32)
        self.out = torch.empty(batch, q_heads, d, device=q.device, dtype=torch.float32)
        self.lse = torch.empty(batch, q_heads, device=q.device, dtype=torch.float32)
        self.seq_lens = dc.seq_lens.to(device=q.device, dtype=torch.int32)
        self.qk_scale = d ** -0.5 * 1.4426950408889634

    def strides(self) -> tuple:
        """op's (b, h, split) strides and lp's (b, h), in the split kernels' argument order."""
        return (*self.op.stride()[:3], *self.lp.stride()[:2])

    def merge(self):
        """The project's merge kernel over the splits: returns ``out``."""
        from kvqref.kernels.decode import merge_kernel

        op, lp, out, lse = self.op, self.lp, self.out, self.lse
        batch, q_heads, d = out.shape
        merge_kernel[(batch, q_heads, 1)](op, lp, out, lse, self.splits, op.stride(0), op.stride(1), op.stride(2),
                                          lp.stride(0), lp.stride(1), out.stride(0), out.stride(1), lse.stride(0),
                                          out, D=d, S_PAD=triton.next_power_of_2(self.splits), DB=d)
        return out


def gluon_decode(q, dc, splits: int, num_warps: int = 1, block_n: int = 32, vf16: bool = False,
                 lazy: bool = False, prefetch: int = 0, maxnreg: int = 0):
    """The probe's decode over ``dc`` (an mxfp4 device cache, head-major, as bench/decode_bench.py makes it):
    returns the call (out [B, Hq, D] float32 after the project's merge kernel)."""
    import torch

    kt, vt = dc.k.tiles(), dc.v.tiles()
    assert kt.head_major and vt.head_major and dc.page_size == 16
    assert (kt.kind, kt.block) in (("mxfp4", 16), ("mxfp4", 32), ("nvfp4", 16)), (kt.kind, kt.block)
    b16 = kt.block == 16
    nv = kt.kind == "nvfp4"
    ks, vs = (t.tensor_scale if t.tensor_scale is not None else torch.ones(t.kv_heads, device=q.device)
              for t in (kt, vt))
    batch, q_heads, d = q.shape
    kvh = kt.kv_heads
    qpk = q_heads // kvh
    so = SplitOutputs(q, dc, splits, block_n)
    k0, v0 = kt.fields[0], vt.fields[0]
    if b16:  # 8 scale codes per (token, head): one int64 each
        k1, v1 = kt.fields[1].view(torch.int64), vt.fields[1].view(torch.int64)
    else:  # 4 E8M0 codes per (token, head), read as int64 pairs of a page's consecutive tokens
        k1, v1 = (f.view(f.shape[0], f.shape[1], -1).view(torch.int64) for f in (kt.fields[1], vt.fields[1]))
    bt = dc.block_table
    opts = {"maxnreg": maxnreg} if maxnreg else {}

    def run():
        if b16:
            fp4_e8m0_b16_split_kernel[(batch, kvh, splits)](
                q, bt, so.seq_lens, k0, k1, v0, v1, ks, vs, so.op, so.lp, so.qk_scale, so.tokens_per_split,
                q.stride(0), q.stride(1), bt.stride(0), *kt.row_strides(k0), 1, k1.stride(1), *vt.row_strides(v0), 1,
                v1.stride(1), *so.strides(),
                QPK=qpk, PAGE=dc.page_size, PAGE_SLOTS=kt.page_slots(dc.page_size), BLOCK_N=block_n,
                VAL_LOAD=value_load_layout_b16(block_n), WORDS=word_pairs_layout(block_n), NV=nv,
                PREFETCH=prefetch, VAL_WORDS=value_words_layout(block_n, True),
                num_warps=num_warps, **opts)
        else:
            fp4_e8m0_split_kernel[(batch, kvh, splits)](
                q, bt, so.seq_lens, k0, k1, v0, v1, so.op, so.lp, so.qk_scale, so.tokens_per_split, q.stride(0),
                q.stride(1), bt.stride(0), *kt.row_strides(k0), 1, k1.stride(1), *vt.row_strides(v0), 1,
                v1.stride(1), *so.strides(),
                QPK=qpk, PAGE=dc.page_size, PAGE_SLOTS=kt.page_slots(dc.page_size), QB=32, BLOCK_N=block_n,
                VAL_LOAD=value_load_layout(block_n), PAIRS_N=pairs_layout(block_n), VF16=vf16, LAZY=lazy,
                PREFETCH=prefetch, VAL_WORDS=value_words_layout(block_n), num_warps=num_warps, **opts)
        return so.merge()

    run.outputs = so  # the split plan and its buffers (the merged lse among them)
    return run


def random_block_table(rng, lens: list[int], page: int):
    """(pages per sequence, an int32 block table) dealing the pool's pages to sequences of ``lens`` tokens in a
    random permutation, as the bench's caches."""
    import numpy as np
    import torch

    pages = [-(-n // page) for n in lens]
    perm = torch.from_numpy(rng.permutation(sum(pages)).astype(np.int32))
    bt = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    o = 0
    for b, n in enumerate(pages):
        bt[b, :n] = perm[o:o + n]
        o += n
    return pages, bt


def oracle_check(variants, splits: int = 4, seed: int = 0, scheme: str = "mxfp4") -> list[dict]:
    """Each variant against the float64 oracle (``kvqref.reference.attention`` on the scheme's dequantized values)
    with the fast mode's tolerance (``kernel_tolerance`` with ``fast_rounding``): 3 sequences of 2,048, 1,000 and 77
    tokens (partial tiles, splits ending inside a tile and empty splits), 32 query and 8 KV heads, head-major pages
    of 16 dealt at random; keys with outlier channels. Returns per variant the largest |error| / tolerance."""
    import numpy as np
    import torch

    from kvqref import reference, schemes
    from kvqref.backends import triton_backend as tb

    rng = np.random.default_rng(seed)
    s = schemes.get(scheme)
    lens, kvh, d, page = [2048, 1000, 77], 8, 128, 16
    pages, bt = random_block_table(rng, lens, page)
    params = {"global_scale": np.float32(6.0 / 2688.0)} if scheme == "nvfp4" else {}
    dc = tb.empty_device_cache(s, s, sum(pages), page, kvh, d, bt.cuda(), torch.tensor(lens, dtype=torch.int32),
                               layout="HND", k_params=params, v_params=params)
    Ks, Vs = [], []
    for b, n in enumerate(lens):
        k = rng.standard_normal((n, kvh, d)).astype(np.float32)
        k[:, :, ::37] *= 20.0
        v = rng.standard_normal((n, kvh, d)).astype(np.float32)
        slots = (bt[b].long()[torch.arange(n) // page] * page + torch.arange(n) % page).cuda()
        tb.quantize_write(dc.k, torch.from_numpy(k).cuda(), slots)
        tb.quantize_write(dc.v, torch.from_numpy(v).cuda(), slots)
        Ks.append(s.dequantize(s.quantize(k, params=params or None)))
        Vs.append(s.dequantize(s.quantize(v, params=params or None)))
    q = torch.from_numpy(rng.standard_normal((len(lens), 32, d)).astype(np.float32)).to(torch.bfloat16).cuda()
    q64 = q.float().cpu().numpy().astype(np.float64)
    want, want_lse = reference.attention(q64, Ks, Vs)
    tol, _ = reference.kernel_tolerance(q64, Ks, Vs, fast=reference.fast_rounding(s, s, "bfloat16"))
    rows = [check_row("triton (default plan)", lambda: tb.decode(q, dc), want, want_lse, tol)]
    for bn, vf, lz, pf, nreg in variants:
        run = gluon_decode(q, dc, splits, block_n=bn, vf16=bool(vf), lazy=bool(lz), prefetch=pf, maxnreg=nreg)
        rows.append(check_row(f"gluon BLOCK_N {bn} VF16 {vf} LAZY {lz} PREFETCH {pf} MAXNREG {nreg}",
                              lambda run=run: (run(), run.outputs.lse), want, want_lse, tol))
    return rows


def check_row(label: str, call, want, want_lse, tol) -> dict:
    """One decode (``call()`` returns out [B, Hq, D] and the natural-log lse [B, Hq]) against the float64 oracle's
    ``want`` and ``want_lse``: its largest |error| / ``tol``, whether every output is finite, and the lse's largest
    |error| over the sequences' heads (the scores alone: a wrong key path shows there, a wrong value path does not)."""
    import numpy as np

    out, lse = call()
    got, got_lse = out.cpu().numpy(), lse.cpu().numpy()
    return {"kernel": label, "max_err_over_tol": float((np.abs(got - want) / tol).max()),
            "finite": bool(np.isfinite(got).all()), "max_lse_err": float(np.abs(got_lse - want_lse).max())}


def static_rows(variants) -> list[dict]:
    """Per variant, its sm_90 build (this machine's triton; no GPU): registers, shared memory, resident warps per
    multiprocessor, and the tile loop's instructions per thread (:func:`sm90_loop_counts`); per cache element as
    ``sass_budget`` counts it (one warp: loop x 32 / (2 x BLOCK_N x 128))."""
    rows = []
    for bn, vf, lz, pf, b16, nreg, nv in variants:
        ck = compile_sm90(block_n=bn, vf16=bool(vf), lazy=bool(lz), prefetch=pf, b16=bool(b16),
                          maxnreg=nreg or None, nv=bool(nv))
        counts = sm90_loop_counts(ck)
        rows.append({"variant": {"block_n": bn, "vf16": vf, "lazy": lz, "prefetch": pf, "blocks_of_16": b16,
                                 "maxnreg": nreg, "nvfp4": nv}, **counts,
                     "per_element": round(counts["loop_common_path"] * 32 / (2 * bn * 128), 2)})
    return rows


def sm90_loop_counts(ck) -> dict:
    """A one-warp sm_90 build's registers, shared memory, resident warps per multiprocessor, and its tile loop's
    instructions per thread (``sass_lines.loop_body``), with those of the conditional rescale (the loop's forward
    branch) apart: ``loop_common_path`` is the loop without them."""
    from sass_lines import cubin_tool_text, loop_body
    from sass_write import resident_warps

    text = cubin_tool_text(ck.asm["cubin"], "nvdisasm", "-c")
    body, _ = loop_body(text)
    regs = _cubin_regs(ck.asm["cubin"])
    labels = {}
    pending = []
    for line in text.splitlines():  # label -> address, as sass_lines.loop_body reads them
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            pending.append(m.group(1))
        elif m := re.search(r"/\*([0-9a-f]{4,})\*/", line):
            labels.update((lab, int(m.group(1), 16)) for lab in pending)
            pending = []
    skipped = 0
    for addr, op, _w, args in body:  # the rescale block: a forward branch inside the loop
        m = re.search(r"(\.L_x_\d+)", args) if op == "BRA" else None
        tgt = labels.get(m.group(1)) if m else None
        if tgt is not None and addr < tgt <= body[-1][0]:
            skipped = max(skipped, sum(1 for r in body if addr < r[0] < tgt))
    return {"registers": regs, "shared_bytes": ck.metadata.shared,
            "resident_warps": resident_warps(regs, 1, ck.metadata.shared),
            "loop": len(body), "loop_common_path": len(body) - skipped,
            "stack_ops": sum(1 for r in body if r[1] in ("LDL", "STL")),
            "shared_ops": sum(1 for r in body if r[1] in ("LDS", "STS", "BAR"))}


def _cubin_regs(cubin: bytes) -> int:
    """Registers per thread of the cubin's kernel (``cuobjdump --dump-resource-usage``)."""
    from sass_lines import cubin_tool_text

    return int(re.search(r"REG:(\d+)", cubin_tool_text(cubin, "cuobjdump", "--dump-resource-usage")).group(1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true", help="AOT-compile for sm_90 and print the resources")
    ap.add_argument("--shape", default="32,32,8,128,8192", help="batch,q_heads,kv_heads,head_dim,tokens")
    ap.add_argument("--splits", default="3,4,6,8")
    ap.add_argument("--variants", default="32,0,0,0,0;32,0,0,0,168;32,1,1,0,0;32,1,1,0,168;64,1,1,0,0",
                    help="BLOCK_N,VF16,LAZY,PREFETCH,MAXNREG (0: none) separated by ';'; PREFETCH 1: the next "
                         "tile's code words carried in registers, k >= 2: cp.async k tiles ahead")
    ap.add_argument("--out", help="JSON file for the results")
    ap.add_argument("--check", action="store_true", help="only the float64-oracle check of every variant")
    ap.add_argument("--static", action="store_true",
                    help="sm_90 builds on this machine: registers, shared memory, tile-loop instructions")
    ap.add_argument("--scheme", default="mxfp4", choices=("mxfp4", "fp4_e2m1", "nvfp4"),
                    help="fp4_e2m1 and nvfp4 (blocks of 16) run their one kernel, with and without maxnreg 168")
    args = ap.parse_args(argv)
    variants = [tuple(int(x) for x in v.split(",")) for v in args.variants.split(";")]
    if args.scheme in ("fp4_e2m1", "nvfp4"):  # their one kernel: float16 values, conditional rescale, tiles of 32;
        # the variants' PREFETCH and MAXNREG apply
        variants = list(dict.fromkeys((32, 1, 1, pf, nreg) for _, _, _, pf, nreg in variants))
    if args.static:
        rows = static_rows([v[:4] + (0, v[4], 0) for v in variants]
                           + [(32, 1, 1, 0, 1, 0, 0), (32, 1, 1, 0, 1, 168, 0), (32, 1, 1, 0, 1, 0, 1),
                              (32, 1, 1, 0, 1, 168, 1), (32, 1, 1, 1, 0, 0, 0), (32, 1, 1, 1, 1, 0, 0),
                              (32, 1, 1, 1, 1, 0, 1)])
        for r in rows:
            print(json.dumps(r), flush=True)
        return 0
    if args.check:
        for r in oracle_check(variants, scheme=args.scheme):
            print(json.dumps(r), flush=True)
        return 0
    if args.compile_only:  # one JSON line per kernel built (tests/test_gluon_probe.py)
        for name, kw in BUILDS.items():
            ck = compile_sm90(block_n=32, **kw)
            print(json.dumps({"build": name, "shared": ck.metadata.shared, "num_warps": ck.metadata.num_warps,
                              "prefetch": kw.get("prefetch", 0)}), flush=True)
        return 0
    cases = []
    for bn, vf, lz, pf, nreg in variants:
        for s in (int(x) for x in args.splits.split(",")):
            row = {"kernel": f"gluon probe, BLOCK_N {bn}, VF16 {vf}, LAZY {lz}, PREFETCH {pf}, MAXNREG {nreg}, "
                             f"{s} splits", "block_n": bn, "vf16": vf, "lazy": lz, "prefetch": pf, "maxnreg": nreg,
                   "splits": s}
            cases.append((row, lambda q, dc, s=s, bn=bn, vf=vf, lz=lz, pf=pf, nreg=nreg: gluon_decode(
                q, dc, s, block_n=bn, vf16=bool(vf), lazy=bool(lz), prefetch=pf, maxnreg=nreg)))
    time_probe(args.scheme, tuple(int(x) for x in args.shape.split(",")), 16, cases,
               "python3 bench/gluon_fp4_probe.py " + " ".join(argv or sys.argv[1:]), args.out)
    return 0


def time_probe(scheme: str, shape: tuple, page_size: int, cases, command: str, out: str | None) -> list[dict]:
    """Each case ``(row, make)`` (``make(q, dc)`` returns a probe's call) timed by bench/decode_bench.py's
    ``timed`` (graph replay, L2 flushed) on its head-major cache of ``scheme`` at ``shape`` (batch, q_heads,
    kv_heads, head_dim, tokens), against the default Triton plan and SDPA over bfloat16 in the same process, with
    its largest difference to the plan's output; a case that fails reports its error. Writes ``out`` (JSON)."""
    import decode_bench as db
    import torch

    from kvqref.backends import triton_backend as tb

    batch, q_heads, kv_heads, head_dim, tokens = shape
    dc, ks, vs = db.make_cache(scheme, shape, page_size, layout="HND")
    q = torch.randn(batch, q_heads, head_dim, device="cuda").to(torch.bfloat16)
    tb.validate_decode(q, dc)

    def ref():
        return tb.decode(q, dc, validate=False, max_seq_len=tokens)

    want, want_lse = (x.clone() for x in ref()[:2])
    per_tok = db.side_bytes_per_token(ks, kv_heads, head_dim) + db.side_bytes_per_token(vs, kv_heads, head_dim)
    nbytes = batch * tokens * per_tok + 2 * q.numel() * 2
    rows = [{"kernel": "triton (default plan)", **db.timed(ref, {"bytes": nbytes})}]
    sdpa = db.sdpa_case(shape)["time_us"]
    rows[0]["ratio_to_sdpa"] = sdpa / rows[0]["time_us"]
    print(json.dumps(rows[0]), flush=True)
    for row, make in cases:
        row = dict(row)
        try:
            fn = make(q, dc)
            got = fn().clone()
            err = (got - want).abs().max().item()
            row.update({"max_abs_diff": err, "max_rel_diff": err / want.abs().max().item(),
                        "finite": bool(torch.isfinite(got).all()),
                        "max_lse_diff": (fn.outputs.lse - want_lse).abs().max().item()})
            row.update(db.timed(fn, {"bytes": nbytes}))
            row["ratio_to_sdpa"] = sdpa / row["time_us"]
        except Exception as e:  # a probe: report and go on
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if out:
        Path(out).write_text(json.dumps({"command": command, "shape": shape, "environment": db.environment(),
                                         "sdpa_bf16_us": sdpa, "rows": rows}, indent=1))
    return rows

if __name__ == "__main__":
    sys.exit(main())
