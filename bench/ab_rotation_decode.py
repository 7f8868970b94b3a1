"""Where a rotated cache's decode time goes (issue 13): rotated against unrotated decode in one process, rounds
alternating, with the pieces separated, timed as bench/decode_bench.py times (CUDA events, L2 flushed, median).

    python3 bench/ab_rotation_decode.py --schemes fp8_e4m3,fp4_e2m1,nvfp4,int4_kivi --rounds 4 --out ab_rot.json

Variants per scheme (batch 32 x 8,192 by default, page 16, fast mode):

* ``plain``: the unrotated cache (K and V written unrotated), q in bfloat16;
* ``rotated``: the rotated cache (K seed 1, V seed 2, as ``decode_bench.py --rotation``): q rotated by one
  small launch, the output un-rotated in the merge kernel;
* ``rotated-data-plain-code``: the rotated cache's bytes decoded as if unrotated (its sides given their inner
  schemes): the same kernels as ``plain`` over the rotated data, so a difference to ``plain`` is the data's;
* ``plain-q-f32``: the unrotated cache with q passed in float32 (the dtype the rotated path hands the split
  kernel), so a difference to ``plain`` is the query dtype's.

Besides the end-to-end times, each launch of ``plain`` and ``rotated`` (rotate_q, split kernels, merge kernel,
planned as ``tb.decode`` plans them, KIVI's residual window included) is timed alone. ``--graph``: every call and
launch replayed from a CUDA graph, as bench/decode_bench.py times its rows (eager calls include the host's launch
overhead, which at these sizes can exceed a launch's GPU time). ``--layout``: the fields' layout (the committed
runs' HND by default). Output: JSON rows and a printed summary of medians per variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_bench import ab_document, bench_ms, graph_replay, make_cache  # noqa: E402


def unrotated_view(dc):
    """``dc`` with each side's scheme replaced by the scheme that encodes its bytes (no rotation)."""
    return replace(dc, k=replace(dc.k, scheme=dc.k.codec), v=replace(dc.v, scheme=dc.v.codec))


def main() -> int:
    import torch

    from kvqref.backends import triton_backend as tb
    from kvqref.kernels.decode import plan_decode

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", default="fp8_e4m3,fp4_e2m1,nvfp4,int4_kivi")
    ap.add_argument("--shape", default="32,32,8,128,8192")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (as decode_bench.py)")
    ap.add_argument("--layout", default="HND", choices=("HND", "NHD"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    def timing(fn) -> float:
        return bench_ms(graph_replay(fn) if args.graph else fn) * 1e3

    shape = tuple(int(v) for v in args.shape.split(","))
    batch, q_heads, kv_heads, head_dim, tokens = shape
    doc = ab_document(shape)
    doc.update(graph=args.graph, layout=args.layout)
    for label in args.schemes.split(","):
        plain, _, _ = make_cache(label, shape, 16, layout=args.layout)
        rot, _, _ = make_cache(label, shape, 16, rotation=True, layout=args.layout)
        q = torch.randn(batch, q_heads, head_dim, device="cuda").to(torch.bfloat16)
        q32 = q.float()
        calls = {
            "plain": (plain, q),
            "rotated": (rot, q),
            "rotated-data-plain-code": (unrotated_view(rot), q),
            "plain-q-f32": (plain, q32),
        }
        fns = {}
        for name, (dc, qq) in calls.items():
            def fn(dc=dc, qq=qq):
                return tb.decode(qq, dc, validate=False, max_seq_len=tokens)
            fn()
            fns[name] = fn
        torch.cuda.synchronize()
        ref = fns["plain"]()[0]
        for name in ("rotated", "rotated-data-plain-code", "plain-q-f32"):
            print(label, name, "max |out - plain|", float((fns[name]()[0] - ref).abs().max()), flush=True)
        times: dict[str, list[float]] = {n: [] for n in fns}
        for rnd in range(args.rounds):
            for name, fn in fns.items():
                us = timing(fn)
                times[name].append(us)
                doc["rows"].append({"scheme": label, "variant": name, "round": rnd, "time_us": us})
        for name in ("plain", "rotated"):  # each launch alone
            dc = calls[name][0]
            residual = dc.residual
            launches, _, _ = plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens,
                                         dc.page_size, residual=residual, max_seq_len=tokens)
            for i, launch in enumerate(launches):
                us = timing(launch)
                kname = getattr(launch.kernel, "__name__", str(i))
                doc["rows"].append({"scheme": label, "variant": name, "launch": i, "kernel": kname,
                                    "time_us": us})
                print(f"{label:10s} {name:8s} launch {i} {kname}: {us:8.1f} us", flush=True)
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"{label:10s} {name:24s} median {med:8.1f} us  rounds {[round(t, 1) for t in ts]}  "
                  f"/plain {med / statistics.median(times['plain']):.3f}", flush=True)
            doc["rows"].append({"scheme": label, "variant": name, "median_us": med,
                                "ratio_to_plain": med / statistics.median(times["plain"])})
        del plain, rot, calls, fns
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
