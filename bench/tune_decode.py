"""Sweep decode-kernel launch parameters (BLOCK_N, warps, stages, splits) for a few schemes on the GPU.

    python3 bench/tune_decode.py [--shape B,Hq,Hkv,D,T]
Prints one line per configuration: scheme, block_n, num_warps, num_stages, splits, microseconds.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_bench import bench_ms, make_cache  # noqa: E402


def main() -> int:
    import torch

    from kvqref.backends import triton_backend as tb

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="32,32,8,128,8192")
    ap.add_argument("--schemes", default="bf16,fp8_e4m3,fp4_e2m1,int4_kivi")
    ap.add_argument("--once", action="store_true", help="one decode per scheme (for a profiler)")
    ap.add_argument("--grid", default="32,64,128/4,8/2,3,4", help="block_n list / warps list / stages list")
    args = ap.parse_args()
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
        base = None
        for bn, nw, ns, sp, kt in itertools.product(
            *[tuple(int(v) for v in part.split(",")) for part in args.grid.split("/")], (None,), (True,)
        ):
            if label.endswith("kivi") and bn > 32:
                continue
            try:
                ms = bench_ms(
                    lambda q=q, dc=dc, bn=bn, nw=nw, ns=ns, sp=sp, kt=kt: tb.decode(
                        q,
                        dc,
                        validate=False,
                        max_seq_len=shape[4],
                        block_n=bn,
                        num_warps=nw,
                        num_stages=ns,
                        num_splits=sp,
                    )
                )
            except Exception as exc:  # noqa: BLE001 - report and go on (e.g. out of shared memory)
                print(label, bn, nw, ns, sp, kt, "failed", type(exc).__name__, str(exc)[:80], flush=True)
                continue
            base = ms if base is None else min(base, ms)
            print(label, bn, nw, ns, sp, kt, f"{ms * 1e3:.1f}", flush=True)
        print(label, "best", f"{base * 1e3:.1f}", flush=True)
    return 0


if __name__ == "__main__" and "--write" not in sys.argv:
    sys.exit(main())


def tune_write(labels=("fp8_e4m3", "fp4_e2m1", "nvfp4", "int4_kivi")) -> None:
    """Quantize-on-write time for a few tokens-per-program values (block_t) and warp counts."""
    import torch

    from kvqref.backends import triton_backend as tb

    for label in labels:
        dc, _, _ = make_cache(label, (1, 8, 8, 128, 65536), 32)
        x = torch.randn(65536, 8, 128, device="cuda").to(torch.bfloat16)
        slots = torch.arange(65536, device="cuda")
        for bt in (16, 32, 64, 128):
            if label.endswith("kivi") and bt != 32:
                continue
            for nw in (1, 2, 4, 8):
                launch = tb.plan_write(dc.k, x, slots, block_t=bt)
                launch.options = {"num_warps": nw}
                print("write", label, bt, nw, f"{bench_ms(launch) * 1e3:.1f}", flush=True)


if __name__ == "__main__" and "--write" in sys.argv:
    tune_write()
