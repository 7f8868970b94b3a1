"""A/B of two decode modules on one GPU in one call, timed as bench/decode_bench.py times (CUDA events, L2
flushed, median), with SDPA over dense BF16 and the bandwidth ceiling measured in the same run.

    git show 01ca884:kvqref/kernels/decode.py > bench/_ab_base_decode.py
    python3 bench/ab_decode.py --base bench/_ab_base_decode.py --schemes int4_kivi,int2_kivi --out ab.json

Variants, each launched through its module's ``plan_decode`` on the same cache and the same q: ``base`` (the
module given by ``--base``, its defaults) and the current kvqref/kernels/decode.py with each ``--variants``
entry, ``name=key=value,key=value;name2=...`` (keywords of ``plan_decode``: block_n, num_warps, num_stages,
num_splits, value_rows, ptx_unpack, maxnreg; ``new=`` is the current defaults). Rounds alternate the variants.
Each variant's output is compared with the base's (max |difference| over max |base output|) as a sanity
check. Prints one line per timing, then a table (median over rounds, x SDPA, GB/s, fraction of the
ceiling); writes everything to ``--out`` (JSON) after every timing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_bench import (  # noqa: E402
    bandwidth_ceiling_gbs,
    bench_ms,
    environment,
    make_cache,
    sdpa_case,
    side_bytes_per_token,
)

KIVI_VARIANTS = "new=;rows_off=value_rows=0;stages2=num_stages=2;warps4=num_warps=4;bn16=block_n=16"


def parse_variants(text: str) -> list[tuple[str, dict]]:
    """``name=key=value,key=value;...`` -> [(name, {key: value})]; values: int, or None for ``none``."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, _, kws = item.partition("=")
        opts = {}
        for kv in filter(None, kws.split(",")):
            k, _, v = kv.partition("=")
            opts[k.strip()] = None if v.strip().lower() == "none" else int(v)
        for k in ("value_rows", "ptx_unpack"):
            if opts.get(k) is not None:
                opts[k] = bool(opts[k])
        out.append((name.strip(), opts))
    return out


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("ab_base_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    import torch

    from kvqref.kernels import decode as cur

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="path of the baseline decode module")
    ap.add_argument("--schemes", default="int4_kivi,int2_kivi", help="labels of bench/decode_bench.py SCHEMES")
    ap.add_argument("--variants", default=KIVI_VARIANTS, help="variants of the current module (see above)")
    ap.add_argument("--precision", default="fast", help="comma-separated: fast, exact")
    ap.add_argument("--shape", default="32,32,8,128,8192", help="batch,q_heads,kv_heads,head_dim,tokens")
    ap.add_argument("--page", type=int, default=16, help="page size (KIVI runs with pages of 32, as decode_bench)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    base = load_module(args.base)
    variants = [("base", base, {})] + [(n, cur, o) for n, o in parse_variants(args.variants)]
    shape = tuple(int(v) for v in args.shape.split(","))
    batch, q_heads, kv_heads, head_dim, tokens = shape
    ceiling = bandwidth_ceiling_gbs()
    sdpa_us = sdpa_case(shape)["time_us"]
    doc = {"command": " ".join(sys.argv), "environment": environment(), "shape": shape, "ceiling_gbs": ceiling,
           "sdpa_bf16_us": sdpa_us, "base": args.base, "variants": {n: o for n, _, o in variants}, "rows": [],
           "checks": []}
    print(f"ceiling {ceiling:.0f} GB/s, SDPA-BF16 {sdpa_us:.1f} us", flush=True)
    out_path = Path(args.out)
    for label in args.schemes.split(","):
        dc, ks, vs = make_cache(label, shape, args.page)
        nbytes = batch * tokens * (side_bytes_per_token(ks, kv_heads, head_dim)
                                   + side_bytes_per_token(vs, kv_heads, head_dim)) + 2 * batch * q_heads * head_dim * 2
        dev = dc.block_table.device
        q = torch.randn(batch, q_heads, head_dim, device=dev, generator=torch.Generator(device=dev)
                        .manual_seed(1)).to(torch.bfloat16)
        residual = (dc.k_residual, dc.v_residual, dc.k_lens, dc.v_lens) if dc.has_residual else None
        for prec in args.precision.split(","):
            calls, ref = {}, None
            for name, mod, opts in variants:
                try:
                    launches, out, _ = mod.plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens,
                                                       dc.page_size, residual=residual, max_seq_len=tokens,
                                                       precision=prec, **opts)
                    for launch in launches:
                        launch()
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001 - report and go on (e.g. out of shared memory)
                    print(label, prec, name, "failed:", type(exc).__name__, str(exc)[:200], flush=True)
                    doc["checks"].append({"scheme": label, "precision": prec, "variant": name,
                                          "error": f"{type(exc).__name__}: {str(exc)[:500]}"})
                    continue
                if ref is None:
                    ref = out.clone()
                rel = float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                finite = bool(torch.isfinite(out).all())
                doc["checks"].append({"scheme": label, "precision": prec, "variant": name,
                                      "max_rel_diff_vs_first": rel, "finite": finite})
                print(label, prec, name, f"max |out - base| / max |base| = {rel:.2e}", "finite" if finite else
                      "NOT FINITE", flush=True)
                calls[name] = lambda launches=launches: [launch() for launch in launches]
            for r in range(args.rounds):
                for name, fn in calls.items():
                    us = bench_ms(fn) * 1e3
                    row = {"scheme": label, "precision": prec, "variant": name, "round": r, "time_us": us,
                           "vs_sdpa": sdpa_us / us, "gbs": nbytes / (us * 1e-6) / 1e9,
                           "of_ceiling": nbytes / (us * 1e-6) / 1e9 / ceiling, "bytes": nbytes}
                    doc["rows"].append(row)
                    print(label, prec, name, f"round {r}: {us:.1f} us ({sdpa_us / us:.2f}x SDPA)", flush=True)
                    out_path.write_text(json.dumps(doc, indent=1))
        del dc
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print()
    print(f"| scheme | precision | variant | median us | x SDPA ({sdpa_us:.0f} us) | GB/s | of ceiling | rounds |")
    print("|---|---|---|---|---|---|---|---|")
    keys = dict.fromkeys((r["scheme"], r["precision"], r["variant"]) for r in doc["rows"])
    summary = []
    for key in keys:
        ts = [r["time_us"] for r in doc["rows"] if (r["scheme"], r["precision"], r["variant"]) == key]
        med = statistics.median(ts)
        gbs = next(r["bytes"] for r in doc["rows"] if r["scheme"] == key[0]) / (med * 1e-6) / 1e9
        summary.append({"scheme": key[0], "precision": key[1], "variant": key[2], "median_us": med,
                        "vs_sdpa": sdpa_us / med, "gbs": gbs, "of_ceiling": gbs / ceiling, "times_us": ts})
        print(f"| {key[0]} | {key[1]} | {key[2]} | {med:.1f} | {sdpa_us / med:.2f}x | {gbs:.0f} | "
              f"{gbs / ceiling:.0%} | {', '.join(f'{t:.0f}' for t in ts)} |")
    doc["summary"] = summary
    out_path.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
