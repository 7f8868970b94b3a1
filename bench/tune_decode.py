"""Sweep decode-kernel launch parameters (BLOCK_N, warps, stages, splits) for a few schemes on the GPU.

    python3 bench/tune_decode.py [--shape B,Hq,Hkv,D,T] [--schemes all] [--precision fast,exact]
        [--grid 32,64/2,4/2,3[/splits]] [--ptx-unpack auto,0,1]
Prints one line per configuration: scheme, precision, block_n, num_warps, num_stages, splits, maxnreg (0 / None:
the default choice), microseconds (the call's CUDA-graph replay as bench/decode_bench.py times it: median, L2
flushed), and per scheme and precision the best.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_bench import SCHEMES, bench_ms, graph_replay, make_cache  # noqa: E402


def main() -> int:
    import torch

    from kvqref.backends import triton_backend as tb

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="32,32,8,128,8192")
    ap.add_argument("--schemes", default="bf16,fp8_e4m3,fp4_e2m1,int4_kivi")
    ap.add_argument("--once", action="store_true", help="one decode per scheme (for a profiler)")
    ap.add_argument("--grid", default="32,64,128/4,8/2,3,4",
                    help="block_n list / warps list / stages list [/ splits list [/ maxnreg list]]; 0: default")
    ap.add_argument("--precision", default="fast", help="comma-separated: fast, exact")
    ap.add_argument("--ptx-unpack", default="auto",
                    help="comma-separated auto/0/1: FP4 nibbles unpacked with inline PTX (auto: the kernel's "
                         "default; printed last unless auto)")
    args = ap.parse_args()
    if args.schemes == "all":
        args.schemes = ",".join(s[0] for s in SCHEMES)
    grid = [tuple(int(v) for v in part.split(",")) for part in args.grid.split("/")]
    grid += [(0,)] * (5 - len(grid))
    shape = tuple(int(v) for v in args.shape.split(","))
    if args.once:
        for label in args.schemes.split(","):
            dc, _, _ = make_cache(label, shape, 16)
            q = torch.randn(shape[0], shape[1], shape[3], device="cuda").to(torch.bfloat16)
            tb.decode(q, dc, validate=False, max_seq_len=shape[4], block_n=32, num_splits=8)
            torch.cuda.synchronize()
        return 0
    for label in args.schemes.split(","):
        dc, _, _ = make_cache(label, shape, 16)
        q = torch.randn(shape[0], shape[1], shape[3], device="cuda").to(torch.bfloat16)
        for prec in args.precision.split(","):
            best = None
            for bn, nw, ns, sp, mr, pu in itertools.product(*grid, args.ptx_unpack.split(",")):
                bn, nw, ns, sp, mr = (v or None for v in (bn, nw, ns, sp, mr))
                tag = () if pu == "auto" else (f"ptx={pu}",)
                if label.endswith("kivi") and (bn or 0) > 32:
                    continue
                try:
                    ms = bench_ms(graph_replay(
                        lambda q=q, dc=dc, bn=bn, nw=nw, ns=ns, sp=sp, prec=prec, mr=mr, pu=pu: tb.decode(
                            q, dc, validate=False, max_seq_len=shape[4], block_n=bn, num_warps=nw,
                            num_stages=ns, num_splits=sp, precision=prec, maxnreg=mr,
                            ptx_unpack=None if pu == "auto" else pu == "1",
                        )
                    ))
                except Exception as exc:  # noqa: BLE001 - report and go on (e.g. out of shared memory)
                    print(label, prec, bn, nw, ns, sp, mr, *tag, "failed", type(exc).__name__, str(exc)[:80],
                          flush=True)
                    continue
                if best is None or ms < best[0]:
                    best = (ms, bn, nw, ns, sp, mr, *tag)
                print(label, prec, bn, nw, ns, sp, mr, *tag, f"{ms * 1e3:.1f}", flush=True)
            if best is not None:
                print(label, prec, "best", f"{best[0] * 1e3:.1f}", "at", *best[1:], flush=True)
        del dc
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__" and "--write" not in sys.argv:
    sys.exit(main())


def tune_write(labels=("fp8_e4m3", "fp4_e2m1", "nvfp4", "int4_kivi")) -> None:
    """Quantize-on-write time over tiles (BLOCK_T tokens x BLOCK_H heads per program) and warp counts, on the
    decode_bench write rows' input (bench/ab_write.py --sweep does the same for every scheme and KIVI side)."""
    from decode_bench import write_inputs

    from kvqref.backends import triton_backend as tb

    for label in labels:
        side, x, slots, _ = write_inputs(label)
        tiles = [(32, 1), (32, 2)] if label.endswith("kivi") else [(1, 8), (2, 8), (4, 8), (8, 8), (16, 1), (32, 1)]
        for (bt, bh), nw in itertools.product(tiles, (2, 4, 8)):
            launch = tb.plan_write(side, x, slots, block_t=bt, block_h=bh, num_warps=nw)
            print("write", label, bt, bh, nw, f"{bench_ms(launch) * 1e3:.1f}", flush=True)


if __name__ == "__main__" and "--write" in sys.argv:
    tune_write()
