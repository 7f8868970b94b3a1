"""A/B of the FP4 tile path (issue 16, second round) on one GPU, timed as bench/decode_bench.py times
(CUDA events, L2 flushed, median), with SDPA over dense BF16 and the bandwidth ceiling in the same run.

    python3 bench/ab_fp4_unpack.py --base bench/_ab_base_decode.py --out ab.json

Variants, each launched through its module's ``plan_decode`` (same caches, same q): ``base``: the decode
module given by ``--base`` (the previous commit's kvqref/kernels/decode.py, software E4M3 block scales);
``hw``: the current module (NVFP4 E4M3 block scales converted in hardware); ``hw+ptx``: the current module
with ``ptx_unpack=True`` (inline-PTX nibble unpacking). Rounds alternate the variants.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_bench import bandwidth_ceiling_gbs, bench_ms, environment, make_cache, sdpa_case  # noqa: E402


def main() -> int:
    import torch

    from kvqref.kernels import decode as cur

    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="path of the baseline decode module")
    ap.add_argument("--schemes", default="nvfp4,mxfp4,fp4_e2m1")
    ap.add_argument("--shape", default="32,32,8,128,8192")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("base_decode", args.base)
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    shape = tuple(int(v) for v in args.shape.split(","))
    batch, q_heads, kv_heads, head_dim, tokens = shape
    doc = {"environment": environment(), "shape": shape, "ceiling_gbs": bandwidth_ceiling_gbs(),
           "sdpa_bf16_us": sdpa_case(shape)["time_us"], "rows": []}
    print("ceiling", doc["ceiling_gbs"], "sdpa_us", doc["sdpa_bf16_us"], flush=True)
    for label in args.schemes.split(","):
        dc, _, _ = make_cache(label, shape, 16)
        q = torch.randn(batch, q_heads, head_dim, device="cuda").to(torch.bfloat16)
        variants = []
        for prec in ("fast", "exact") if label == "nvfp4" else ("fast",):
            variants += [(prec, "base", base, {}), (prec, "hw", cur, {})]
            if prec == "fast":
                variants.append((prec, "hw+ptx", cur, {"ptx_unpack": True}))
        calls = {}
        for prec, name, mod, kw in variants:
            launches, _, _ = mod.plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, dc.page_size,
                                             max_seq_len=tokens, precision=prec, **kw)
            calls[(prec, name)] = lambda launches=launches: [launch() for launch in launches]
        for r in range(args.rounds):
            for key, fn in calls.items():
                us = bench_ms(fn) * 1e3
                row = {"scheme": label, "precision": key[0], "variant": key[1], "round": r, "time_us": us,
                       "vs_sdpa": doc["sdpa_bf16_us"] / us}
                doc["rows"].append(row)
                print(row, flush=True)
                Path(args.out).write_text(json.dumps(doc, indent=1))
        del dc
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
