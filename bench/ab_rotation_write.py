"""Rotated quantize-on-write over tiles and warps: issue 13's write rows (65,536 tokens x 8 heads x 128, bf16
in, pages of 32 in random order; KIVI keys in whole groups) timed as bench/decode_bench.py times them (CUDA
graph replay, L2 flushed, median), the unrotated write at its default launch beside each, in one process.

    python3 bench/ab_rotation_write.py --out $OUT/rot_write_sweep.json        # GPU
    python3 bench/ab_rotation_write.py --schemes int4_kivi --side v \
        --launches "rotation_route=shfl;rotation_route=shfl,word_load=1" --out $OUT/rot_kivi_values.json
    python3 bench/ab_rotation_write.py --unrotated --schemes int4_kivi --launches "maxnreg=96;num_warps=1" \
        --out $OUT/write_launches.json

Each rotated launch's bytes are first compared, as integers, with the rotated write at the default launch (a
difference stops the run); the summary prints the best launch per scheme and its ratio to the unrotated write.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_bench import (  # noqa: E402
    ROTATION_LABELS,
    bandwidth_ceiling_gbs,
    bench_ms,
    environment,
    graph_replay,
    parse_launches,
    write_inputs,
)


def _bytes(side) -> list:
    import torch

    return [t.clone().view(torch.uint8) if t.element_size() == 1 else t.clone() for t in side.fields.values()]


def time_write(side, x, slots, kw: dict) -> float:
    """Median microseconds of the write's CUDA-graph replay (two medians of do_bench, their median)."""
    from kvqref.backends import triton_backend as tb

    def fn():
        tb.quantize_write(side, x, slots, validate=False, **kw)

    replay = graph_replay(fn)
    return statistics.median(bench_ms(replay) * 1e3 for _ in range(2))


def sweep(label: str, args, doc: dict) -> bool:
    """Time ``label``'s unrotated default write and its rotated write (``--unrotated``: its unrotated write) over the
    launches; False if a launch's bytes differ from the default launch's."""
    import torch

    from kvqref.backends import triton_backend as tb

    side0, x0, slots0, rec = write_inputs(label, layout=args.layout, side=args.side)
    base_us = time_write(side0, x0, slots0, {})
    side, x, slots, _ = write_inputs(label, rotation=not args.unrotated, layout=args.layout, side=args.side)
    tb.quantize_write(side, x, slots, validate=False)
    want = _bytes(side)
    launches = [{}]
    if args.launches:  # given launches instead of the tile sweep
        launches += [kw for _, kw in parse_launches(args.launches)]
    else:
        for bt in [None] if label.endswith("kivi") else [int(v) for v in args.block_t.split(",")]:
            for bh in (int(v) for v in args.block_h.split(",")):
                for w in (int(v) for v in args.warps.split(",")):
                    launches.append({k: v for k, v in (("block_t", bt), ("block_h", bh), ("num_warps", w))
                                     if v is not None})
    best = None
    for kw in launches:
        try:
            for t in side.fields.values():
                t.zero_()
            tb.quantize_write(side, x, slots, validate=False, **kw)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a launch that does not fit (shared memory, lanes): go on
            print(label, kw, "failed:", type(exc).__name__, str(exc)[:100], flush=True)
            continue
        if any(not torch.equal(a, b) for a, b in zip(_bytes(side), want, strict=True)):
            print(label, kw, "bytes differ from the default launch", flush=True)
            return False
        us = time_write(side, x, slots, kw)
        row = {"scheme": label, "side": args.side, "launch": kw or "default", "rotated_us": us,
               "unrotated_us": base_us,
               "ratio": us / base_us, "gbs": rec["bytes"] / (us * 1e-6) / 1e9}
        row["ceiling_fraction"] = row["gbs"] / doc["ceiling_gbs"]
        doc["rows"].append(row)
        print(json.dumps(row), flush=True)
        best = row if best is None or us < best["rotated_us"] else best
        Path(args.out).write_text(json.dumps(doc, indent=1))
    if best:
        print(f"best {label}: {best['launch']} {best['rotated_us']:.1f} us, unrotated {base_us:.1f} us, "
              f"ratio {best['ratio']:.2f}", flush=True)
    return True


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", default=",".join(ROTATION_LABELS))
    ap.add_argument("--block-t", default="1,2,4,8", help="tokens per program (KIVI keys: their group, fixed)")
    ap.add_argument("--block-h", default="1,2,8", help="KV heads per program")
    ap.add_argument("--warps", default="1,2,4,8")
    ap.add_argument("--layout", default="HND")
    ap.add_argument("--side", default="k", choices=("k", "v"),
                    help="the cache side written (KIVI keys and values differ)")
    ap.add_argument("--launches", default="",
                    help="launches to time instead of the tile sweep, each 'k=v,k=v' (plan_write's arguments; ints or "
                         "strings) and separated by ';'")
    ap.add_argument("--unrotated", action="store_true",
                    help="time the launches on the unrotated write instead (ratios then to its default launch)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    doc = {"command": " ".join(["python3", *sys.argv]), "environment": environment(),
           "ceiling_gbs": bandwidth_ceiling_gbs(), "rows": []}
    for label in args.schemes.split(","):
        if not sweep(label, args, doc):
            return 1
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
