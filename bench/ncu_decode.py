"""Profile one decode launch per scheme with Nsight Compute (default configuration, batch 32 x 8,192).

    python3 bench/ncu_decode.py --scheme nvfp4 [--layout NHD]   # the process ncu wraps: warm-up, then one launch
    python3 bench/ncu_decode.py --scheme int4_kivi --plan kivi_value_subnormal_codes=0   # a plan_decode option
    bash bench/ncu_decode.sh OUTDIR nvfp4 mxfp4 ...       # ncu reports + per-SASS-instruction stall CSVs
    bash bench/ncu_decode.sh OUTDIR int4_kivi:--layout=HND,--plan=kivi_scalar_page_ids=1

The wrapped process runs the decode twice (compile + warm-up, then the profiled call, alone between
``cudaProfilerStart`` and ``cudaProfilerStop``); ncu (``--profile-from-start off --launch-count 1``) profiles that
call's first ``decode_split_kernel`` launch only (KIVI's calls make two split launches: the paged splits are the
first, the residual window's the second).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_bench import decode_setup  # noqa: E402


def main() -> int:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--scheme", required=True)
    ap.add_argument("--shape", default="32,32,8,128,8192")
    ap.add_argument("--precision", default="fast")
    ap.add_argument("--layout", choices=("HND", "NHD"), help="the cache's field layout (default: the bench's)")
    ap.add_argument("--plan", action="append", default=[], metavar="OPTION=VALUE",
                    help="a plan_decode option (VALUE a Python literal: 0, 1, 8, True), repeatable")
    args = ap.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    plan = {}
    for item in args.plan:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--plan takes OPTION=VALUE, got {item!r}")
        try:
            plan[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            ap.error(f"--plan {key}: {value!r} is not a Python literal")
    fn, _ = decode_setup(args.scheme, shape, 16, precision=args.precision, layout=args.layout, plan=plan)
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
