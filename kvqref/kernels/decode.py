"""Split-KV (flash-decoding) attention over a quantized paged KV cache: one kernel for every scheme.

Stage 1 (``decode_split_kernel``): one program per (sequence, KV head, split) reads its range of the
paged cache in its stored form (codes + scales), dequantizes in registers with a constexpr-selected
inline function (``KIND``), and keeps an online softmax for the query heads of that KV head (GQA/MQA).
A last split per sequence attends KIVI's full-precision residual window in the same launch.
Stage 2 (``merge_kernel``) merges the splits by their log-sum-exp.

Cache tile kinds (``KIND_K``/``KIND_V``) and the fields they read (leading axes [slot, head]):
    0 BF16     F0 bf16 [D]
    1 FP8      F0 uint8 codes [D] (format ``FMT``); F1 float32 per-token scale [] when ``TOKEN_SCALE``
    2 MXFP4    F0 uint8 [D/2] (element 2i low nibble); F1 uint8 E8M0 [D/QB]
    3 NVFP4    F0 uint8 [D/2]; F1 uint8 E4M3FN [D/16] (global scale folded into the tensor scale)
    4 INT-V    F0 uint8 [D*BITS/8] LSB-first; F1 fp16 scale, F2 fp16 zero [D/G] (per token, channel groups)
    5 INT-K    F0 as 4; F1 fp16 scale, F2 fp16 zero [D] per group of G slots (per channel, token groups)
Tensor-level scales (FP8 per-tensor/per-head, NVFP4 global) are folded: K's into the softmax scale,
V's into the output. Per-token FP8 scales multiply score columns and probabilities, never the
elements, so dequantized FP8/FP4 tiles are exact in bfloat16 and go to the tensor cores as they are;
tiles that are not (INT, the residual) and the probabilities are split into bfloat16 hi + lo parts.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvqref.kernels.codecs import INTERPRET, decode_f32, e8m0_to_f32

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _dot(a, b, A_SPLIT: tl.constexpr, B_SPLIT: tl.constexpr):
    """a [M, K] float32 @ b [K, N] float32 with float32 accumulation.

    Hardware: bfloat16 tensor cores on hi (+ lo) parts; a part that is exact in bfloat16 is not split.
    Interpreter: an exact float32 product (its bfloat16 arithmetic is not supported).
    """
    if INTERPRET:
        return tl.dot(a, b, input_precision="ieee")
    else:
        a_hi = a.to(tl.bfloat16)
        b_hi = b.to(tl.bfloat16)
        acc = tl.dot(a_hi, b_hi)
        if A_SPLIT:
            acc += tl.dot((a - a_hi.to(tl.float32)).to(tl.bfloat16), b_hi)
        if B_SPLIT:
            acc += tl.dot(a_hi, (b - b_hi.to(tl.float32)).to(tl.bfloat16))
        return acc


@triton.jit
def _unpack_interleave(byte, BITS: tl.constexpr, N: tl.constexpr, D: tl.constexpr):
    """[N, D*BITS/8] bytes -> [N, D] int32 fields, element d at bits (d*BITS) % 8 of byte d*BITS//8."""
    if BITS == 4:
        lo = byte & 0xF
        hi = (byte >> 4) & 0xF
        return tl.reshape(tl.join(lo, hi), (N, D))
    else:
        p0 = byte & 0x3
        p1 = (byte >> 2) & 0x3
        p2 = (byte >> 4) & 0x3
        p3 = (byte >> 6) & 0x3
        return tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), (N, D))


@triton.jit
def _load_tile(F0, F1, F2, slot, tmask, kvh, f0_s, f0_h, f1_s, f1_h, f2_s, f2_h,
               KIND: tl.constexpr, FMT: tl.constexpr, TOKEN_SCALE: tl.constexpr, QB: tl.constexpr,
               G: tl.constexpr, BITS: tl.constexpr, N: tl.constexpr, D: tl.constexpr):
    """Dequantize the tile of slots ``slot`` [N] (int64) for KV head ``kvh``: ([N, D] f32, row scale [N])."""
    m2 = tmask[:, None]
    d = tl.arange(0, D)
    row = tl.full((N,), 1.0, tl.float32)
    if KIND == 0:
        x = tl.load(F0 + slot[:, None] * f0_s + kvh * f0_h + d[None, :], mask=m2, other=0.0).to(tl.float32)
    elif KIND == 1:
        c = tl.load(F0 + slot[:, None] * f0_s + kvh * f0_h + d[None, :], mask=m2, other=0)
        x = decode_f32(c, FMT)
        if TOKEN_SCALE:
            row = tl.load(F1 + slot * f1_s + kvh * f1_h, mask=tmask, other=0.0)
    elif KIND == 2 or KIND == 3:
        HALF: tl.constexpr = D // 2
        i = tl.arange(0, HALF)
        c = tl.load(F0 + slot[:, None] * f0_s + kvh * f0_h + i[None, :], mask=m2, other=0).to(tl.int32)
        sc = tl.load(F1 + slot[:, None] * f1_s + kvh * f1_h + (i // (QB // 2))[None, :], mask=m2, other=0)
        if KIND == 2:
            s = e8m0_to_f32(sc)
        else:
            s = decode_f32(sc, 0)
        lo = decode_f32(c & 0xF, 4) * s
        hi = decode_f32(c >> 4, 4) * s
        x = tl.reshape(tl.join(lo, hi), (N, D))
    else:
        PACK: tl.constexpr = 8 // BITS
        i = tl.arange(0, D // PACK)
        c = tl.load(F0 + slot[:, None] * f0_s + kvh * f0_h + i[None, :], mask=m2, other=0).to(tl.int32)
        q = _unpack_interleave(c, BITS, N, D).to(tl.float32)
        if KIND == 4:
            so = slot[:, None] * f1_s + kvh * f1_h + (d // G)[None, :]
            zo = slot[:, None] * f2_s + kvh * f2_h + (d // G)[None, :]
        else:
            so = (slot // G)[:, None] * f1_s + kvh * f1_h + d[None, :]
            zo = (slot // G)[:, None] * f2_s + kvh * f2_h + d[None, :]
        scale = tl.load(F1 + so, mask=m2, other=0.0).to(tl.float32)
        zero = tl.load(F2 + zo, mask=m2, other=0.0).to(tl.float32)
        x = q * scale + zero
    return x, row


@triton.jit
def _load_mixed(F0, F1, F2, R, slot, t, tmask, plen, b, kvh, f0_s, f0_h, f1_s, f1_h, f2_s, f2_h, r_b, r_t, r_h,
                KIND: tl.constexpr, FMT: tl.constexpr, TOKEN_SCALE: tl.constexpr, QB: tl.constexpr,
                G: tl.constexpr, BITS: tl.constexpr, N: tl.constexpr, D: tl.constexpr):
    """Tokens ``t`` < ``plen`` from the pages, the rest from the float32 residual at ``t - plen``."""
    paged = tmask & (t < plen)
    x, row = _load_tile(F0, F1, F2, slot, paged, kvh, f0_s, f0_h, f1_s, f1_h, f2_s, f2_h,
                        KIND, FMT, TOKEN_SCALE, QB, G, BITS, N, D)
    rmask = tmask & (t >= plen)
    d = tl.arange(0, D)
    off = b * r_b + (t - plen)[:, None].to(tl.int64) * r_t + kvh * r_h + d[None, :]
    r = tl.load(R + off, mask=rmask[:, None], other=0.0)
    return tl.where(paged[:, None], x, r), tl.where(paged, row, 1.0)


@triton.jit
def _online_step(q, k, v, row_k, row_v, tmask, m_i, l_i, acc, qk_scale,
                 Q_SPLIT: tl.constexpr, K_SPLIT: tl.constexpr, V_SPLIT: tl.constexpr):
    """One tile of the online softmax (base 2)."""
    s = _dot(q, tl.trans(k), Q_SPLIT, K_SPLIT) * (qk_scale * row_k)[None, :]
    s = tl.where(tmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p * row_v[None, :], v, True, V_SPLIT)
    return m_new, l_i, acc


@triton.jit
def decode_split_kernel(
    Q, BT, SL, KL, VL, K0, K1, K2, V0, V1, V2, RK, RV, KS, VS, OP, LP,
    sm_scale, num_splits, tokens_per_split,
    stride_qb, stride_qh, stride_btb,
    k0_s, k0_h, k1_s, k1_h, k2_s, k2_h,
    v0_s, v0_h, v1_s, v1_h, v2_s, v2_h,
    r_b, r_t, r_h,
    op_b, op_h, op_s, lp_b, lp_h,
    QPK: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    KIND_K: tl.constexpr, FMT_K: tl.constexpr, TSC_K: tl.constexpr, QB_K: tl.constexpr, G_K: tl.constexpr,
    BITS_K: tl.constexpr,
    KIND_V: tl.constexpr, FMT_V: tl.constexpr, TSC_V: tl.constexpr, QB_V: tl.constexpr, G_V: tl.constexpr,
    BITS_V: tl.constexpr,
    HAS_RES: tl.constexpr, Q_SPLIT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    hh = tl.arange(0, BLOCK_H)
    hmask = hh < QPK
    qh = kvh * QPK + hh
    d = tl.arange(0, D)
    q = tl.load(Q + b * stride_qb + qh[:, None].to(tl.int64) * stride_qh + d[None, :], mask=hmask[:, None],
                other=0.0).to(tl.float32)
    qk_scale = sm_scale * tl.load(KS + kvh) * 1.4426950408889634
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    K_EXACT: tl.constexpr = KIND_K <= 3
    V_EXACT: tl.constexpr = KIND_V <= 3
    if split < num_splits:
        if HAS_RES:
            paged_len = tl.minimum(tl.load(KL + b), tl.load(VL + b))
        else:
            paged_len = tl.load(SL + b)
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, paged_len)
        for t0 in range(start, end, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            tmask = t < end
            page = tl.load(BT + b * stride_btb + t // PAGE, mask=tmask, other=0).to(tl.int64)
            slot = page * PAGE + (t % PAGE)
            k, row_k = _load_tile(K0, K1, K2, slot, tmask, kvh, k0_s, k0_h, k1_s, k1_h, k2_s, k2_h,
                                  KIND_K, FMT_K, TSC_K, QB_K, G_K, BITS_K, BLOCK_N, D)
            v, row_v = _load_tile(V0, V1, V2, slot, tmask, kvh, v0_s, v0_h, v1_s, v1_h, v2_s, v2_h,
                                  KIND_V, FMT_V, TSC_V, QB_V, G_V, BITS_V, BLOCK_N, D)
            m_i, l_i, acc = _online_step(q, k, v, row_k, row_v, tmask, m_i, l_i, acc, qk_scale,
                                         Q_SPLIT, not K_EXACT, not V_EXACT)
    if HAS_RES and split >= num_splits:
        # the tail [min(k_len, v_len), seq_len): KIVI keeps the newest keys and values in full precision
        # (float32 residuals [batch, W, kv_heads, D]); K and V switch to their residual at their own length
        kl = tl.load(KL + b)
        vl = tl.load(VL + b)
        seq_len = tl.load(SL + b)
        for t0 in range(tl.minimum(kl, vl), seq_len, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            tmask = t < seq_len
            page = tl.load(BT + b * stride_btb + t // PAGE, mask=tmask & (t < tl.maximum(kl, vl)), other=0)
            slot = page.to(tl.int64) * PAGE + (t % PAGE)
            k, row_k = _load_mixed(K0, K1, K2, RK, slot, t, tmask, kl, b, kvh, k0_s, k0_h, k1_s, k1_h, k2_s, k2_h,
                                   r_b, r_t, r_h, KIND_K, FMT_K, TSC_K, QB_K, G_K, BITS_K, BLOCK_N, D)
            v, row_v = _load_mixed(V0, V1, V2, RV, slot, t, tmask, vl, b, kvh, v0_s, v0_h, v1_s, v1_h, v2_s, v2_h,
                                   r_b, r_t, r_h, KIND_V, FMT_V, TSC_V, QB_V, G_V, BITS_V, BLOCK_N, D)
            m_i, l_i, acc = _online_step(q, k, v, row_k, row_v, tmask, m_i, l_i, acc, qk_scale,
                                         Q_SPLIT, True, True)
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = acc / safe_l[:, None] * tl.load(VS + kvh)
    lse2 = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
    base = b * op_b + qh[:, None].to(tl.int64) * op_h + split * op_s
    tl.store(OP + base + d[None, :], out, mask=hmask[:, None])
    tl.store(LP + b * lp_b + qh.to(tl.int64) * lp_h + split, lse2, mask=hmask)


@triton.jit
def merge_kernel(OP, LP, O, LSE, n_splits, op_b, op_h, op_s, lp_b, lp_h, o_b, o_h, lse_b,
                 D: tl.constexpr, S_PAD: tl.constexpr):
    """Merge split outputs by log-sum-exp; writes out [D] and the natural-log LSE of one (seq, head)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D)
    smask = s < n_splits
    lse = tl.load(LP + b * lp_b + h * lp_h + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_use)
    o = tl.load(OP + b * op_b + h * op_h + s[:, None] * op_s + d[None, :], mask=smask[:, None], other=0.0)
    wsum = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(wsum > 0, wsum, 1.0)
    tl.store(O + b * o_b + h * o_h + d, out)
    lse_nat = tl.where(wsum > 0, (m_use + tl.log2(wsum)) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + b * lse_b + h, lse_nat)


KIND_IDS = {"bf16": 0, "fp8": 1, "mxfp4": 2, "nvfp4": 3, "int_v": 4, "int_k": 5}


class CacheTiles:
    """How one of K or V is stored, as the kernel reads it: kind, constexprs, field tensors, scales.

    ``fields`` are up to three tensors whose first two axes are [slot (or slot group), kv_head];
    ``tensor_scale`` is a float32 [kv_heads] tensor folded into the softmax scale (K) or the output (V).
    """

    def __init__(self, kind: str, fields: list, tensor_scale, *, fmt: int = 0, token_scale: bool = False,
                 block: int = 16, group: int = 1, bits: int = 8) -> None:
        if kind not in KIND_IDS:
            raise ValueError(f"unknown tile kind {kind!r}; known: {sorted(KIND_IDS)}")
        self.kind, self.fields, self.tensor_scale = kind, list(fields), tensor_scale
        self.fmt, self.token_scale, self.block, self.group, self.bits = fmt, token_scale, block, group, bits

    def field_args(self) -> list:
        f = self.fields + [self.fields[0]] * (3 - len(self.fields))  # unused slots get a valid pointer
        return f

    def stride_args(self) -> list[int]:
        out: list[int] = []
        for t in self.field_args():
            out += [t.stride(0), t.stride(1)]
        return out



def choose_splits(batch: int, kv_heads: int, max_len: int, block_n: int, num_sms: int) -> tuple[int, int]:
    """(splits, tokens per split): enough programs to fill about two waves of the GPU, each split a
    whole number of tiles and at least 4 tiles long."""
    want = max(1, -(-2 * num_sms // max(1, batch * kv_heads)))
    most = max(1, -(-max_len // (4 * block_n)))
    splits = min(want, most)
    per = -(-max(max_len, 1) // splits)
    per = -(-per // block_n) * block_n
    return -(-max(max_len, 1) // per), per


def paged_decode(q, k: CacheTiles, v: CacheTiles, block_table, seq_lens, page_size: int, *,
                 sm_scale: float | None = None, residual=None, block_n: int = 64, num_splits: int | None = None,
                 max_seq_len: int | None = None, num_warps: int = 4, num_stages: int = 2):
    """Decode attention for q [batch, q_heads, D] over a paged cache; returns (out [B, Hq, D] float32,
    lse [B, Hq] float32, natural log).

    ``residual``: KIVI's full-precision tail, ``(k_res [B, W, Hkv, D] f32, v_res, k_lens [B], v_lens [B])``:
    token t of K is read from the pages while t < k_lens[b], else from ``k_res[b, t - k_lens[b]]`` (same
    for V); tensor scales must then be 1.
    """
    import torch

    batch, q_heads, head_dim = q.shape
    kv_heads = k.fields[0].shape[1]
    qpk = q_heads // kv_heads
    block_h = max(16, triton.next_power_of_2(qpk))
    if sm_scale is None:
        sm_scale = head_dim ** -0.5
    has_res = residual is not None
    if has_res:
        rk, rv, kl, vl = residual
        paged_max = int(torch.minimum(kl, vl).max().item()) if kl.numel() else 0
    else:
        rk = rv = torch.zeros(1, 1, 1, 1, dtype=torch.float32, device=q.device)
        kl = vl = seq_lens
        paged_max = None
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if seq_lens.numel() else 0
    if paged_max is None:
        paged_max = max_seq_len
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        num_splits, per = choose_splits(batch, kv_heads, paged_max, block_n, sms)
    else:
        per = -(-max(paged_max, 1) // num_splits)
        per = -(-per // block_n) * block_n
    total = num_splits + int(has_res)
    op = torch.empty(batch, q_heads, total, head_dim, dtype=torch.float32, device=q.device)
    lp = torch.empty(batch, q_heads, total, dtype=torch.float32, device=q.device)
    grid = (batch, kv_heads, total)
    decode_split_kernel[grid](
        q, block_table, seq_lens, kl, vl, *k.field_args(), *v.field_args(), rk, rv, k.tensor_scale, v.tensor_scale,
        op, lp, float(sm_scale), num_splits, per,
        q.stride(0), q.stride(1), block_table.stride(0),
        *k.stride_args(), *v.stride_args(),
        rk.stride(0), rk.stride(1), rk.stride(2),
        op.stride(0), op.stride(1), op.stride(2), lp.stride(0), lp.stride(1),
        QPK=qpk, BLOCK_H=block_h, D=head_dim, PAGE=page_size, BLOCK_N=block_n,
        KIND_K=KIND_IDS[k.kind], FMT_K=k.fmt, TSC_K=k.token_scale, QB_K=k.block, G_K=k.group, BITS_K=k.bits,
        KIND_V=KIND_IDS[v.kind], FMT_V=v.fmt, TSC_V=v.token_scale, QB_V=v.block, G_V=v.group, BITS_V=v.bits,
        HAS_RES=has_res, Q_SPLIT=q.dtype != torch.bfloat16,
        num_warps=num_warps, num_stages=num_stages,
    )
    out = torch.empty(batch, q_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, q_heads, dtype=torch.float32, device=q.device)
    merge_kernel[(batch, q_heads)](op, lp, out, lse, total, op.stride(0), op.stride(1), op.stride(2),
                                   lp.stride(0), lp.stride(1), out.stride(0), out.stride(1), lse.stride(0),
                                   D=head_dim, S_PAD=max(2, triton.next_power_of_2(total)))
    return out, lse
