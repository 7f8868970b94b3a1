"""What the decode kernel's loads alone reach: codes and scales of K and V through the block table, no math.

    python3 bench/loads_roofline.py --schemes nvfp4,fp8_e4m3,bf16 --out $OUT/loads.json     # GPU

A kernel with the decode launch's grid (one program per sequence, KV head and split, as ``plan_decode`` plans it)
reads every field row of its tokens, ``[BLOCK_N, bytes]`` per field and side, pipelined as the decode tiles are,
and xor-reduces them (so nothing is dropped); its time against the ceiling is the roofline of this access
pattern in Triton: the part of a decode kernel's gap that no arithmetic change can close. ``--hf`` also times the
grid with the KV heads on its fastest axis (``plan_decode(heads_fast=True)``). Timed as bench/decode_bench.py
times (CUDA graph replay, L2 flushed, median), beside SDPA over BF16 and the ceiling measured in the same run.
KIVI's per-group key fields are not covered.
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


@triton.jit
def _rows_xor(F, page, off, kvh, f_p, f_o, f_h, tmask, W: tl.constexpr):
    """xor over the W bytes of each token's row of field F (uint8 view), as int32 [N]; the row of (page, offset
    in the page, head) starts at ``page * f_p + off * f_o + kvh * f_h``."""
    w = tl.arange(0, W)
    x = tl.load(F + (page * f_p + off * f_o + kvh * f_h)[:, None] + w[None, :], mask=tmask[:, None], other=0)
    return tl.xor_sum(x.to(tl.int32), 1)


@triton.jit
def loads_kernel(
    BT, SL, K0, K1, V0, V1, OUT, tokens_per_split, stride_btb, k0_p, k0_o, k0_h, k1_p, k1_o, k1_h, v0_p, v0_o,
    v0_h, v1_p, v1_o, v1_h,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, WK0: tl.constexpr, WK1: tl.constexpr, WV0: tl.constexpr,
    WV1: tl.constexpr, HF: tl.constexpr,
):
    b = tl.program_id(1 if HF else 0).to(tl.int64)
    kvh = tl.program_id(0 if HF else 1)
    split = tl.program_id(2)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, tl.load(SL + b))
    acc = tl.zeros((BLOCK_N,), tl.int32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        page = tl.load(BT + b * stride_btb + t // PAGE, mask=tmask, other=0).to(tl.int64)
        off = t % PAGE
        acc ^= (_rows_xor(K0, page, off, kvh, k0_p, k0_o, k0_h, tmask, WK0)
                ^ _rows_xor(V0, page, off, kvh, v0_p, v0_o, v0_h, tmask, WV0))
        if WK1 > 0:
            acc ^= _rows_xor(K1, page, off, kvh, k1_p, k1_o, k1_h, tmask, WK1)
        if WV1 > 0:
            acc ^= _rows_xor(V1, page, off, kvh, v1_p, v1_o, v1_h, tmask, WV1)
    pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + split
    tl.store(OUT + pid, tl.xor_sum(acc, 0))


@triton.jit
def _page_xor(desc, page, kvh, PAGE: tl.constexpr, W: tl.constexpr, FLAT: tl.constexpr):
    """xor over one page's rows of one head through a tensor descriptor (TMA on sm_90): the head-major field
    as [pages, heads, PAGE * W] (``FLAT``, rows of fewer than 16 bytes) or [pages, heads, PAGE, W]."""
    if FLAT:
        x = tl.reshape(desc.load([page, kvh, 0]), (PAGE * W // 16, 16))
    else:
        x = tl.reshape(desc.load([page, kvh, 0, 0]), (PAGE, W))
    return tl.xor_sum(tl.xor_sum(x.to(tl.int32), 1), 0)


@triton.jit
def loads_tma_kernel(
    BT, SL, K0, K1, V0, V1, OUT, tokens_per_split, stride_btb,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, WK0: tl.constexpr, WK1: tl.constexpr, WV0: tl.constexpr,
    WV1: tl.constexpr, FK0: tl.constexpr, FK1: tl.constexpr, FV0: tl.constexpr, FV1: tl.constexpr,
):
    """The loads of :func:`loads_kernel` over head-major fields, one tensor-descriptor load per (page, field)."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, tl.load(SL + b))
    acc = tl.zeros((), tl.int32)
    for t0 in range(start, end, BLOCK_N):
        for j in tl.static_range(BLOCK_N // PAGE):
            page = tl.load(BT + b * stride_btb + t0 // PAGE + j)
            x = _page_xor(K0, page, kvh, PAGE, WK0, FK0) ^ _page_xor(V0, page, kvh, PAGE, WV0, FV0)
            if WK1 > 0:
                x ^= _page_xor(K1, page, kvh, PAGE, WK1, FK1)
            if WV1 > 0:
                x ^= _page_xor(V1, page, kvh, PAGE, WV1, FV1)
            acc ^= tl.where(t0 + j * PAGE < end, x, 0)
    pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + split
    tl.store(OUT + pid, acc)


def tma_descriptor(field, page: int):
    """A tensor descriptor of a head-major field ([pages, page, heads, W] with head-major strides) as
    [pages, heads, page * W] where a row is under 16 bytes, else [pages, heads, page, W]; and whether flat."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    hm = field.permute(0, 2, 1, 3)
    if not hm.is_contiguous():
        raise ValueError("TMA loads need head-major fields")
    w = hm.shape[3]
    if w < 16:
        flat = hm.reshape(hm.shape[0], hm.shape[1], page * w)
        return TensorDescriptor.from_tensor(flat, [1, 1, page * w]), True
    return TensorDescriptor.from_tensor(hm, [1, 1, page, w]), False


def byte_fields(tiles, page: int, layout: str) -> list:
    """The side's code field and its per-token scale field (if any), as uint8 tensors with their (page, offset,
    head) strides: ``nhd`` the cache's own [pages, page, heads, bytes]; ``hnd`` a head-major copy [pages, heads,
    page, bytes] (each head's rows of a page contiguous, as FlashInfer's HND layout)."""
    import torch

    out = []
    for f in tiles.fields[:2]:
        if f.dim() < 3 or f.shape[-1] * f.element_size() < 2:
            continue
        b = f.contiguous().view(torch.uint8).view(f.shape[0] // page, page, f.shape[1], -1)
        if layout == "hnd":
            b = b.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
        out.append((b, (b.stride(0), b.stride(1), b.stride(2))))
    return out


def launch_loads(dc, block_n: int, warps: int, stages: int, hf: bool, splits_grid, layout: str = "nhd"):
    """A closure launching the loads-only kernel over ``dc`` on ``splits_grid`` (batch, kv_heads, splits, per);
    layout ``tma``: head-major fields read by tensor descriptors (:func:`loads_tma_kernel`)."""
    import torch

    if layout == "tma":
        return launch_loads_tma(dc, block_n, warps, stages, splits_grid)

    batch, kv_heads, splits, per = splits_grid
    k, v = byte_fields(dc.k.tiles(), dc.page_size, layout), byte_fields(dc.v.tiles(), dc.page_size, layout)
    if len(k) > 2 or len(v) > 2 or not k or not v:
        raise ValueError("loads_roofline covers code + block/token-scale fields only")
    k1 = k[1] if len(k) > 1 else k[0]
    v1 = v[1] if len(v) > 1 else v[0]
    out = torch.empty(batch * kv_heads * splits, dtype=torch.int32, device="cuda")
    grid = (kv_heads, batch, splits) if hf else (batch, kv_heads, splits)
    args = [dc.block_table, dc.seq_lens, k[0][0], k1[0], v[0][0], v1[0], out, per, dc.block_table.stride(0),
            *k[0][1], *k1[1], *v[0][1], *v1[1]]
    cx = dict(PAGE=dc.page_size, BLOCK_N=block_n, WK0=k[0][0].shape[3], WK1=k[1][0].shape[3] if len(k) > 1 else 0,
              WV0=v[0][0].shape[3], WV1=v[1][0].shape[3] if len(v) > 1 else 0, HF=hf)
    for w in (cx["WK0"], cx["WK1"], cx["WV0"], cx["WV1"]):
        if w and w & (w - 1):
            raise ValueError(f"row of {w} bytes: a power of two is needed")

    def fn():
        loads_kernel[grid](*args, **cx, num_warps=warps, num_stages=stages)

    return fn


def launch_loads_tma(dc, block_n: int, warps: int, stages: int, splits_grid):
    """:func:`launch_loads` for the ``tma`` layout."""
    import torch

    batch, kv_heads, splits, per = splits_grid
    page = dc.page_size
    k, v = byte_fields(dc.k.tiles(), page, "hnd"), byte_fields(dc.v.tiles(), page, "hnd")
    descs = [tma_descriptor(f, page) for f, _ in (k[0], k[1] if len(k) > 1 else k[0], v[0],
                                                   v[1] if len(v) > 1 else v[0])]
    out = torch.empty(batch * kv_heads * splits, dtype=torch.int32, device="cuda")
    cx = dict(PAGE=page, BLOCK_N=block_n, WK0=k[0][0].shape[3], WK1=k[1][0].shape[3] if len(k) > 1 else 0,
              WV0=v[0][0].shape[3], WV1=v[1][0].shape[3] if len(v) > 1 else 0,
              FK0=descs[0][1], FK1=descs[1][1], FV0=descs[2][1], FV1=descs[3][1])

    def fn():
        loads_tma_kernel[(batch, kv_heads, splits)](dc.block_table, dc.seq_lens, *(d for d, _ in descs), out, per,
                                                    dc.block_table.stride(0), **cx, num_warps=warps,
                                                    num_stages=stages)

    return fn


def main() -> int:
    import torch
    from decode_bench import ab_document, bench_ms, graph_replay, make_cache, side_bytes_per_token

    from kvqref.kernels.decode import _multiprocessors, choose_splits, whole_tile_splits

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", default="nvfp4")
    ap.add_argument("--shape", default="32,32,8,128,8192")
    ap.add_argument("--configs", default="64,2,2;128,4,2;32,2,3",
                    help="BLOCK_N,warps,stages[,splits];... (splits: default choose_splits' default rule)")
    ap.add_argument("--hf", default="0,1", help="heads_fast values")
    ap.add_argument("--layouts", default="nhd",
                    help="nhd, hnd, tma (head-major by tensor descriptors): the field layouts the loads read")
    ap.add_argument("--pages", default="16", help="page sizes")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    batch, q_heads, kv_heads, head_dim, tokens = shape
    doc = ab_document(shape)
    for label, page in ((lb, int(p)) for lb in args.schemes.split(",") for p in args.pages.split(",")):
        dc, ks, vs = make_cache(label, shape, page)
        nbytes = batch * tokens * (side_bytes_per_token(ks, kv_heads, head_dim)
                                   + side_bytes_per_token(vs, kv_heads, head_dim))
        for c, layout in ((c, lay) for c in args.configs.split(";") for lay in args.layouts.split(",")):
            bn, w, s, *sp = (int(x) for x in c.split(","))
            if sp:  # a given split count, whole tiles per split
                splits, per = whole_tile_splits(tokens, sp[0], bn)
            else:
                splits, per = choose_splits(batch, kv_heads, tokens, bn, _multiprocessors("cuda"))
            for hf in (v == "1" for v in args.hf.split(",") if not (v == "1" and layout == "tma")):
                fn = launch_loads(dc, bn, w, s, hf, (batch, kv_heads, splits, per), layout)
                fn()
                torch.cuda.synchronize()
                us = statistics.median([bench_ms(graph_replay(fn)) * 1e3 for _ in range(2)])
                row = {"scheme": label, "page_size": page, "layout": layout, "block_n": bn, "num_warps": w,
                       "num_stages": s, "heads_fast": hf,
                       "splits": splits, "time_us": us, "gbs": nbytes / (us * 1e-6) / 1e9,
                       "vs_sdpa": doc["sdpa_bf16_us"] / us}
                row["ceiling_fraction"] = row["gbs"] / doc["ceiling_gbs"]
                doc["rows"].append(row)
                print(f"{label} page={page} {layout} loads-only bn={bn} w={w} s={s} splits={splits} hf={int(hf)}: "
                      f"{us:.1f} us, "
                      f"{row['vs_sdpa']:.2f}x SDPA, "
                      f"{100 * row['ceiling_fraction']:.0f}% of the ceiling", flush=True)
                Path(args.out).write_text(json.dumps(doc, indent=1))
        del dc
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
