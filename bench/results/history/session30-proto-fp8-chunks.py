"""Prototype (timing and closeness only, not a kernel of the library): fast FP8 decode whose tiles are split into
per-warp token chunks by a batched ``tl.dot``, so that 128-token tiles run on 4 warps with a softmax state per warp.

    python3 bench/results/history/session30-proto-fp8-chunks.py --variants "4,32,2,3" --out $OUT/proto.json  # GPU

(Kept in history, not a bench tool: measured in session 30 at 972-12,586 us against the library's 146 us, its
rank-3 products compiled to 255 registers and 368-392 bytes of stack per thread; bench/results/ANALYSIS.md, 201.)

Why: on the H200 a kernel that only loads the FP8 cache through the page table (``bench/loads_roofline.py``) reads
batch 32 x 8,192 in 145.9 us with the decode launch's 64-token tiles on 2 warps but in 133.2 us with 128-token tiles on
4 warps (bench/results/ANALYSIS.md, session 30), while the decode kernel itself loses at 128-token tiles (172-210 us):
its 4 warps split one [16, tokens] score tile, so the softmax reduces across warps. Here a tile is [C chunks, CN
tokens] and every product is batched over the chunks (``tl.dot`` of [C, 16, D] x [C, D, CN]: Triton puts each batch
entry on its own warp), each chunk keeps its own running maximum and sum, and the chunks merge once after the loop,
as the merge launch merges splits. Arithmetic as fast mode's: q and the FP8 tiles in float16 (E4M3 -> float16 is
exact), p rounded once to float16, float32 softmax and accumulation; the tensor scales fold into the score scale and
the output. The output is compared with ``triton_backend.decode``'s (max abs difference printed).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository


@triton.jit
def fp8_chunks_split_kernel(Q, K, V, BT, SL, OP, LP, qk_scale, v_scale, tokens_per_split, stride_qb, stride_qh,
                            k_p, k_h, k_r, v_p, v_h, v_r, stride_btb, op_b, op_h, op_s, lp_b, lp_h,
                            QPK: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, C: tl.constexpr,
                            CN: tl.constexpr, BH: tl.constexpr, STAGES: tl.constexpr):
    """One (sequence, KV head, split): tiles of C x CN tokens, chunk c of a tile the tokens c * CN .. c * CN + CN - 1;
    writes the split's output rows and base-2 LSE as ``decode_split_kernel`` does (for ``merge_kernel``)."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(SL + b)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    h = tl.arange(0, BH)
    hmask = h < QPK
    qh = kvh * QPK + h
    d = tl.arange(0, D)
    q = tl.load(Q + b * stride_qb + qh[:, None] * stride_qh + d[None, :], mask=hmask[:, None], other=0.0)
    q3t = tl.broadcast_to(tl.trans(q.to(tl.float16))[None, :, :], (C, D, BH))
    c = tl.arange(0, C)
    n = tl.arange(0, CN)
    m_i = tl.full((C, BH), float("-inf"), tl.float32)
    l_i = tl.zeros((C, BH), tl.float32)
    acc = tl.zeros((C, BH, D), tl.float32)
    for t0 in tl.range(start, end, C * CN, num_stages=STAGES):
        t = t0 + c[:, None] * CN + n[None, :]
        tmask = t < end
        page = tl.load(BT + b * stride_btb + t // PAGE, mask=tmask, other=0).to(tl.int64)
        off = t % PAGE
        row_k = tl.reshape(page * k_p + kvh * k_h + off * k_r, (C * CN,))
        row_m = tl.reshape(tmask, (C * CN,))
        k8 = tl.reshape(tl.load(K + row_k[:, None] + d[None, :], mask=row_m[:, None], other=0), (C, CN, D))
        s = tl.trans(tl.dot(k8.to(tl.float8e4nv, bitcast=True).to(tl.float16), q3t), (0, 2, 1)) * qk_scale
        s = tl.where(tmask[:, None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 2))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, :, None])
        l_i = l_i * alpha + tl.sum(p, 2)
        row_v = tl.reshape(page * v_p + kvh * v_h + off * v_r, (C * CN,))
        v8 = tl.reshape(tl.load(V + row_v[:, None] + d[None, :], mask=row_m[:, None], other=0), (C, CN, D))
        acc = acc * alpha[:, :, None] + tl.dot(p.to(tl.float16), v8.to(tl.float8e4nv, bitcast=True).to(tl.float16))
        m_i = m_new
    mm = tl.max(m_i, 0)
    mm_use = tl.where(mm == float("-inf"), 0.0, mm)
    w = tl.exp2(m_i - mm_use[None, :])
    ll = tl.sum(l_i * w, 0)
    out = tl.sum(acc * w[:, :, None], 0)
    safe = tl.where(ll > 0, ll, 1.0)
    tl.store(OP + b * op_b + qh[:, None] * op_h + split * op_s + d[None, :], out / safe[:, None] * v_scale,
             mask=hmask[:, None])
    tl.store(LP + b * lp_b + qh * lp_h + split, tl.where(ll > 0, mm_use + tl.log2(safe), float("-inf")), mask=hmask)


def plan(q, dc, tokens: int, chunks: int, chunk_tokens: int, splits: int, stages: int):
    """A closure launching the prototype's split kernel and the library's merge kernel; returns (fn, out)."""
    import torch

    from kvqref.kernels.decode import merge_kernel

    batch, q_heads, head_dim = q.shape
    k = next(iter(dc.k.fields.values()))
    v = next(iter(dc.v.fields.values()))
    kv_heads = k.shape[1]
    qpk = q_heads // kv_heads
    tile = chunks * chunk_tokens
    per = math.ceil(math.ceil(tokens / splits) / tile) * tile
    splits = -(-tokens // per)
    op = torch.empty(batch, q_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    lp = torch.empty(batch, q_heads, splits, dtype=torch.float32, device=q.device)
    out = torch.empty(batch, q_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, q_heads, dtype=torch.float32, device=q.device)
    ks = float(dc.k.tensor_scale[0])
    vs = float(dc.v.tensor_scale[0])
    qk_scale = ks / math.sqrt(head_dim) * math.log2(math.e)
    vsq = torch.ones(head_dim, dtype=torch.float32, device=q.device)

    def fn():
        fp8_chunks_split_kernel[(batch, kv_heads, splits)](
            q, k, v, dc.block_table, dc.seq_lens, op, lp, qk_scale, vs, per, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), dc.block_table.stride(0),
            op.stride(0), op.stride(1), op.stride(2), lp.stride(0), lp.stride(1),
            QPK=qpk, D=head_dim, PAGE=dc.page_size, C=chunks, CN=chunk_tokens, BH=max(16, qpk), STAGES=stages,
            num_warps=chunks, num_stages=stages)
        merge_kernel[(batch, q_heads, 1)](op, lp, out, lse, splits, op.stride(0), op.stride(1), op.stride(2),
                                          lp.stride(0), lp.stride(1), out.stride(0), out.stride(1), lse.stride(0),
                                          vsq, D=head_dim, S_PAD=max(2, triton.next_power_of_2(splits)),
                                          DB=head_dim, ROT_V=False, num_warps=1)

    return fn, out


def main(argv: list[str] | None = None) -> int:
    import statistics

    import torch
    from decode_bench import ab_document, bench_ms, graph_replay, make_cache, side_bytes_per_token

    from kvqref.backends import triton_backend

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32,32,8,128,8192")
    ap.add_argument("--variants", default="4,32,2,3;4,32,3,3;4,32,4,3;2,64,4,3;4,32,2,4;2,32,4,3",
                    help="chunks,chunk_tokens,splits,stages;...")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    batch, q_heads, kv_heads, head_dim, tokens = shape
    doc = ab_document(shape)
    dc, ks, vs = make_cache("fp8_e4m3", shape, 16, layout="HND")
    nbytes = batch * tokens * (side_bytes_per_token(ks, kv_heads, head_dim) + side_bytes_per_token(vs, kv_heads,
                                                                                                     head_dim))
    q = torch.randn(batch, q_heads, head_dim, device="cuda").to(torch.bfloat16)
    ref_out = triton_backend.decode(q, dc, max_seq_len=tokens)[0]
    calls = {"library default": (graph_replay(lambda: triton_backend.decode(q, dc, validate=False,
                                                                            max_seq_len=tokens)), 0.0)}
    for spec in args.variants.split(";"):
        ch, cn, sp, st = (int(x) for x in spec.split(","))
        fn, out = plan(q, dc, tokens, ch, cn, sp, st)
        fn()
        torch.cuda.synchronize()
        calls[f"chunks {ch} x {cn}, {sp} splits, {st} stages"] = (graph_replay(fn), float((out - ref_out).abs().max()))
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(args.rounds):
        for name, (fn, _) in calls.items():
            times[name].append(bench_ms(fn) * 1e3)
    for name, (_, diff) in calls.items():
        us = statistics.median(times[name])
        row = {"variant": name, "times_us": times[name], "time_us": us, "gbs": nbytes / (us * 1e-6) / 1e9,
               "vs_sdpa": doc["sdpa_bf16_us"] / us, "max_abs_diff_vs_library": diff}
        row["ceiling_fraction"] = row["gbs"] / doc["ceiling_gbs"]
        doc["rows"].append(row)
        print(f"| {name} | {us:.1f} | {row['vs_sdpa']:.2f}x | {100 * row['ceiling_fraction']:.0f}% | {diff:.2e} |",
              flush=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
