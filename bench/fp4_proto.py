"""Prototype (issue 16): NVFP4 decode by per-block partial dots, rows by (block, head), no per-element scale.

    python3 bench/fp4_proto.py --out $OUT/proto.json          # GPU: check against plan_decode, then time

Design under test (fast precision only): a K tile's E2M1 codes become float16 E2M1 * 2**-14 by bit placement
(no scale): the low nibbles (even channels) and high nibbles (odd channels) are two dots against q's even / odd
channels. q is laid out in rows (block b, head h), zero outside block b, so the [NB * H, N] product holds each
block's partial dot; the block scales multiply that float32 tile and a sum over b gives the scores. Values: p is
laid out in the same rows, times the block scale of (token, b) (p * s * 2**6 rounded once to float16), against
the unscaled E2M1 tile; output column d takes row (block of d, h). ``--level 0`` times the loads alone (codes and
scales of K and V through the block table, one xor-reduction), the roofline of this access pattern in Triton.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvqref.kernels.codecs import decode_f32, floor_log2_f32, pow2_f32  # noqa: E402
from kvqref.kernels.decode import _block_scales, _e2m1_nibbles_f16  # noqa: E402


@triton.jit
def _scale_f32(code, FMT: tl.constexpr):
    if FMT >= 8:
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return decode_f32(code, 0)


@triton.jit
def fp4_blocks_kernel(
    Q, BT, SL, KL, VL, K0, K1, K2, V0, V1, V2, RK, RV, KS, VS, OP, LP, sm_scale, num_splits, tokens_per_split,
    stride_qb, stride_qh, stride_btb, k0_s, k0_h, k1_s, k1_h, k2_s, k2_h, v0_s, v0_h, v1_s, v1_h, v2_s, v2_h,
    r_b, r_t, r_h, op_b, op_h, op_s, lp_b, lp_h,
    QPK: tl.constexpr, H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    QB: tl.constexpr, FMT: tl.constexpr, PTX: tl.constexpr, LEVEL: tl.constexpr, HF: tl.constexpr = False,
):
    NB: tl.constexpr = D // QB
    R: tl.constexpr = NB * H
    DH: tl.constexpr = D // 2
    b = tl.program_id(1 if HF else 0).to(tl.int64)
    kvh = tl.program_id(0 if HF else 1)
    split = tl.program_id(2)
    r = tl.arange(0, R)
    rb = r // H
    rh = r % H
    j = tl.arange(0, DH)
    rmask = rh < QPK
    qbase = b * stride_qb + (kvh * QPK + rh).to(tl.int64) * stride_qh
    inb = ((2 * j)[None, :] // QB) == rb[:, None]
    qm = rmask[:, None] & inb
    qe = tl.load(Q + qbase[:, None] + (2 * j)[None, :], mask=qm, other=0.0).to(tl.float32)
    qo = tl.load(Q + qbase[:, None] + (2 * j + 1)[None, :], mask=qm, other=0.0).to(tl.float32)
    qmax = tl.max(tl.max(tl.maximum(tl.abs(qe), tl.abs(qo)), 1), 0)
    eq = tl.where(qmax > 0, tl.minimum(14 - floor_log2_f32(qmax), 126), 0)
    qe16 = (qe * pow2_f32(eq)).to(tl.float16)
    qo16 = (qo * pow2_f32(eq)).to(tl.float16)
    sc_k = sm_scale * tl.load(KS + kvh) * 1.4426950408889634 * pow2_f32(-eq) * 16384.0
    m_i = tl.full((H,), float("-inf"), tl.float32)
    l_i = tl.zeros((H,), tl.float32)
    acc_lo = tl.zeros((R, DH), tl.float32)
    acc_hi = tl.zeros((R, DH), tl.float32)
    xr = tl.zeros((BLOCK_N,), tl.int32)
    paged_len = tl.load(SL + b)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, paged_len)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        page = tl.load(BT + b * stride_btb + t // PAGE, mask=tmask, other=0).to(tl.int64)
        slot = page * PAGE + (t % PAGE)
        kb = tl.load(K0 + slot[None, :] * k0_s + kvh * k0_h + j[:, None], mask=tmask[None, :], other=0)
        ksc = _block_scales(K1, slot, kvh, k1_s, k1_h, tmask, NB, True, True)  # [NB, N]
        vb = tl.load(V0 + slot[:, None] * v0_s + kvh * v0_h + j[None, :], mask=tmask[:, None], other=0)
        vsc = _block_scales(V1, slot, kvh, v1_s, v1_h, tmask, NB, True, True)  # [NB, N]
        if LEVEL == 0:
            xr = xr ^ tl.sum(kb.to(tl.int32), 0) ^ tl.sum(ksc.to(tl.int32), 0) ^ tl.sum(vb.to(tl.int32), 1)
            xr = xr ^ tl.sum(vsc.to(tl.int32), 0)
        else:
            klo, khi = _e2m1_nibbles_f16(kb, PTX)
            s2 = tl.dot(qe16, klo)
            s2 = tl.dot(qo16, khi, s2)  # [R, N]: row (b, h) holds block b's partial dot
            s3 = tl.reshape(s2, (NB, H, BLOCK_N)) * _scale_f32(ksc, FMT)[:, None, :]
            s = tl.sum(s3, 0) * sc_k  # [H, N]
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            pr = tl.reshape(p[None, :, :] * (_scale_f32(vsc, FMT) * 64.0)[:, None, :], (R, BLOCK_N)).to(tl.float16)
            ar = tl.reshape(tl.broadcast_to(alpha[None, :], (NB, H)), (R,))
            if LEVEL == 1:
                vlo, vhi = _e2m1_nibbles_f16(vb, PTX)
                acc_lo = tl.dot(pr, vlo, acc_lo * ar[:, None])
                acc_hi = tl.dot(pr, vhi, acc_hi * ar[:, None])
            else:  # LEVEL 2: keys and softmax only (value codes not read)
                acc_lo = acc_lo * ar[:, None] + tl.sum(pr.to(tl.float32), 1)[:, None]
    hq = tl.arange(0, H)
    hmask = hq < QPK
    base = b * op_b + (kvh * QPK + hq)[:, None].to(tl.int64) * op_h + split * op_s
    if LEVEL == 0:
        tl.store(OP + base + j[None, :], (tl.sum(xr, 0) + 0 * j[None, :] + 0 * hq[:, None]).to(tl.float32),
                 mask=hmask[:, None])
        tl.store(LP + b * lp_b + (kvh * QPK + hq).to(tl.int64) * lp_h + split, 0.0 * hq, mask=hmask)
    else:
        # rows (b, h) -> heads: column j of lo/hi (channel 2j / 2j + 1) takes row (block of the channel, h)
        sel_lo = (tl.arange(0, NB)[:, None, None] == ((2 * j) // QB)[None, None, :])
        lo = tl.sum(tl.where(sel_lo, tl.reshape(acc_lo, (NB, H, DH)), 0.0), 0)
        hi = tl.sum(tl.where(sel_lo, tl.reshape(acc_hi, (NB, H, DH)), 0.0), 0)
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        vs = tl.load(VS + kvh) * (16384.0 / 64.0)
        tl.store(OP + base + (2 * j)[None, :], lo / safe_l[:, None] * vs, mask=hmask[:, None])
        tl.store(OP + base + (2 * j + 1)[None, :], hi / safe_l[:, None] * vs, mask=hmask[:, None])
        lse2 = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(LP + b * lp_b + (kvh * QPK + hq).to(tl.int64) * lp_h + split, lse2, mask=hmask)


def proto_launches(base_launches, level: int, block_n: int, warps: int, stages: int, ptx: bool):
    """The plan_decode launches with the split kernel replaced by the prototype (same args, same grid)."""
    from kvqref.kernels.decode import Launch

    split = base_launches[-2]
    cx = split.constexprs
    assert cx["KIND_K"] == 3 and cx["KIND_V"] == 3, "prototype: NVFP4 only"
    new_cx = dict(QPK=cx["QPK"], H=triton.next_power_of_2(cx["QPK"]), D=cx["D"], PAGE=cx["PAGE"], BLOCK_N=block_n,
                  QB=cx["QB_K"], FMT=cx["FMT_K"], PTX=ptx, LEVEL=level, HF=cx.get("HF", False))
    new = Launch(fp4_blocks_kernel, split.grid, split.args, new_cx, {"num_warps": warps, "num_stages": stages})
    return [*base_launches[:-2], new, base_launches[-1]]


def main() -> int:
    import torch
    from decode_bench import ab_document, bench_ms, graph_replay, make_cache, side_bytes_per_token

    from kvqref.kernels.decode import plan_decode

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32,32,8,128,8192")
    ap.add_argument("--configs", default="64,4,2;64,2,2;32,2,3;64,4,3;128,4,2;64,8,2")
    ap.add_argument("--hf", default="0,1", help="heads_fast values (KV heads on the grid's fastest axis)")
    ap.add_argument("--levels", default="1,2,0")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    batch, q_heads, kv_heads, head_dim, tokens = shape
    doc = ab_document(shape)
    dc, ks, vs = make_cache("nvfp4", shape, 16)
    nbytes = batch * tokens * (side_bytes_per_token(ks, kv_heads, head_dim)
                               + side_bytes_per_token(vs, kv_heads, head_dim)) + 4 * batch * q_heads * head_dim
    q = torch.randn(batch, q_heads, head_dim, device="cuda").to(torch.bfloat16)
    calls = {}
    for bn, hf in [(bn, hf == "1") for bn in sorted({int(c.split(",")[0]) for c in args.configs.split(";")})
                   for hf in args.hf.split(",")]:
        base, ref, _ = plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, dc.page_size,
                                   max_seq_len=tokens, block_n=bn, heads_fast=hf)
        for launch in base:
            launch()
        ref = ref.clone()
        calls[f"base bn={bn} hf={int(hf)}"] = (base, 0.0)
        for c in args.configs.split(";"):
            bn2, w, s = (int(v) for v in c.split(","))
            if bn2 != bn:
                continue
            for level in [int(v) for v in args.levels.split(",")]:
                name = f"proto L{level} bn={bn} w={w} s={s} hf={int(hf)}"
                try:
                    ls = proto_launches(base, level, bn, w, s, True)
                    outs = ls[-1].args[2]
                    for launch in ls:
                        launch()
                    torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001 - report and go on
                    print(name, "failed:", type(exc).__name__, str(exc)[:300], flush=True)
                    continue
                diff = float((outs - ref).abs().max()) if level == 1 else float("nan")
                rel = float((outs - ref).abs().max() / ref.abs().max()) if level == 1 else float("nan")
                print(name, "max abs diff vs base", diff, "rel", rel, flush=True)
                calls[name] = (ls, diff)
    for name, (ls, diff) in calls.items():
        def fn(ls=ls):
            for launch in ls:
                launch()
        us = statistics.median([bench_ms(graph_replay(fn)) * 1e3 for _ in range(2)])
        row = {"variant": name, "time_us": us, "gbs": nbytes / (us * 1e-6) / 1e9, "vs_sdpa": doc["sdpa_bf16_us"] / us,
               "max_abs_diff_vs_base": diff}
        row["ceiling_fraction"] = row["gbs"] / doc["ceiling_gbs"]
        doc["rows"].append(row)
        print(f"{name}: {us:.1f} us, {row['vs_sdpa']:.2f}x SDPA, {100 * row['ceiling_fraction']:.0f}% of ceiling",
              flush=True)
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
