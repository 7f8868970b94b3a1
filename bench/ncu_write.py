"""Profile one quantize-on-write launch per scheme with Nsight Compute (the bench's write shape: 65,536 tokens x
8 KV heads x 128, bf16 input, default launch).

    python3 bench/ncu_write.py --scheme nvfp4 [--side v] [--rotation]   # the process ncu wraps
    bash bench/ncu_decode.sh OUTDIR --write nvfp4 int4_kivi ...          # reports + per-SASS stall CSVs

The wrapped process runs the write twice (compile + warm-up, with the probe launches that settle a shuffle
route's lanes, then the profiled call, alone between ``cudaProfilerStart`` and ``cudaProfilerStop``); ncu
(``--profile-from-start off``) profiles that call's ``quantize_write_kernel`` launch only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_bench import write_inputs  # noqa: E402


def main() -> int:
    import torch

    from kvqref.backends import triton_backend as tb

    ap = argparse.ArgumentParser()
    ap.add_argument("--scheme", required=True)
    ap.add_argument("--side", default="k", choices=("k", "v"))
    ap.add_argument("--rotation", action="store_true")
    ap.add_argument("--rotation-route", choices=("split", "sums", "gather", "shfl"),
                    help="the rotated butterflies' route (plan_write's rotation_route; default: the scheme's)")
    args = ap.parse_args()
    side, x, slots, _ = write_inputs(args.scheme, side=args.side, rotation=args.rotation)
    kw = {"rotation_route": args.rotation_route} if args.rotation_route else {}
    tb.quantize_write(side, x, slots, validate=False, **kw)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    tb.quantize_write(side, x, slots, validate=False, **kw)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
