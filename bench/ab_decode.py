"""A/B of decode-kernel variants on one GPU, timed as bench/decode_bench.py times (CUDA events, L2 flushed,
median), with SDPA over dense BF16 and the bandwidth ceiling measured in the same run.

    git show HEAD~1:kvqref/kernels/decode.py > bench/_ab_base_decode.py
    python3 bench/ab_decode.py --base bench/_ab_base_decode.py --schemes nvfp4,mxfp4 \
        --variants "base; cur; cur bn=64 w=2 s=3; cur wide=0" --out ab.json

A variant is a module (``base``: the file given by ``--base``; ``cur``: kvqref/kernels/decode.py) and
launch options: ``bn`` (BLOCK_N), ``w`` (warps), ``s`` (stages), ``sp`` (splits), ``ptx`` (0/1: inline-PTX
unpacking), ``wide`` (0/1: FP4 block scales read as one word per token), ``rows`` (0/1: KIVI values with
score rows by channel group), ``kt4`` (0/1: FP4 key tiles with tokens as rows), ``ktile`` (0/1: fast KIVI
keys as c * s + z tiles against the bfloat16 q), ``nreg`` (a register cap), ``p`` (precision: fast/exact).
Every variant is launched through its module's ``plan_decode`` on the same cache and q; its output is
compared with the first variant's (max abs difference printed); rounds alternate the variants. Each variant's
launches are timed as the replay of their CUDA graph (as bench/decode_bench.py does; ``--eager``: the Python
launches), ``hf=1`` puts the KV heads on the grid's fastest axis (``heads_fast``), ``blk`` (0/1): fast FP4
by block rows (``block_rows``), ``vw`` (0/1): their value tiles as 16-bit words (``value_words``), ``kr``
(0/1): fast KIVI keys by token-group rows (``key_rows``), ``rl`` (0/1): the residual split as its own launch
(``residual_launch``), ``hnd`` (0/1): the cache's fields head-major (``DeviceCache.with_layout("HND")``, a copy
made once), ``ch`` (0/1): block rows by channel halves (``channel_halves``), ``kw`` (0/1): KIVI codes as words of
eight (``kivi_words``), ``merge`` (0/1): ``merge=0`` times the split launches without the merge launch (the
output is then not the attention: for measuring what the merge costs inside the graph), ``mw``: warps per program
of the merge launch (``merge_warps``), ``mdb``: channels per merge program (``merge_channels``), ``vw8`` (0/1):
FP8 value tiles as 16-bit words (``fp8_value_words``), ``kp`` (0/1): the KIVI key-rows loop pipelined by one tile
(``kivi_pipeline``), ``kch`` (1/2): KIVI key words' accumulation chains
(``kivi_key_chains``), ``do`` (0/1): one split writing the outputs itself, no merge launch (``direct_output``),
``ksub`` (0/1): KIVI key codes as float16 subnormals (``kivi_subnormal_codes``), ``e8c`` (0/1): fast FP4 block
rows' E8M0 scales as bare exponent fields after one check per tile (``e8m0_tile_check``), ``ev16`` (0/1): their
E8M0 value products in float16 against each split's reference scale code (``e8m0_values_f16``), ``t2d`` (0/1):
per-element FP4 tiles as [bytes, tokens] with each byte's scale code from its token's word (``fp4_tiles_2d``),
``pdl`` (0/1): the merge as a programmatic dependent launch of the split launch (``pdl``), ``pida`` (0/1): each
next tile's page ids read one step ahead (``page_ids_ahead``), ``vch``: KIVI key words' value products in this many
token chunks (``kivi_value_chunks``), ``vsw`` (0/1): KIVI value scales and zeros as one word per token
(``kivi_value_scale_words``), ``csm``: a softmax state per KIVI value chunk, its tokens dealt in runs of this many
(0: off; ``kivi_chunk_softmax``), ``rj`` (0/1): the KIVI key rows' two row terms moved as one tensor
(``kivi_joined_row_terms``), ``vsub`` (0/1): KIVI value codes as bfloat16 subnormals
(``kivi_value_subnormal_codes``), ``spg`` (0/1): KIVI tiles' page ids as scalars (``kivi_scalar_page_ids``),
``kpt`` (0/1): FP4 block rows' key products transposed (``key_products_transposed``), ``e8f`` (0/1): their E8M0
scales as exponent fields straight from the scale words (``e8m0_scale_fields``), ``qld`` (strided / transposed /
contiguous): how their q rows are read (``q_rows_load``), ``po`` (random / sequential): the order of the cache's
pages, a property of the cache and not a launch option (bench/decode_bench.py's ``make_cache(page_order=...)``:
``sequential`` is a second cache with the same tokens and values, each sequence's pages contiguous).
KIVI caches carry their residual window, as in bench/decode_bench.py.
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

from decode_bench import ab_document, bench_ms, graph_replay, make_cache, side_bytes_per_token  # noqa: E402

KEYS = {"bn": ("block_n", int), "w": ("num_warps", int), "s": ("num_stages", int), "sp": ("num_splits", int),
        "ptx": ("ptx_unpack", lambda v: v == "1"), "wide": ("wide_scale_loads", lambda v: v == "1"),
        "rows": ("value_rows", lambda v: v == "1"), "nreg": ("maxnreg", int), "p": ("precision", str),
        "kt4": ("fp4_keys_by_token", lambda v: v == "1"), "ktile": ("key_tile", lambda v: v == "1"),
        "hf": ("heads_fast", lambda v: v == "1"), "blk": ("block_rows", lambda v: v == "1"),
        "vw": ("value_words", lambda v: v == "1"), "kr": ("key_rows", lambda v: v == "1"),
        "rl": ("residual_launch", lambda v: v == "1"), "hnd": ("layout", lambda v: "HND" if v == "1" else "NHD"),
        "ch": ("channel_halves", lambda v: v == "1"), "kw": ("kivi_words", lambda v: v == "1"),
        "merge": ("merge", lambda v: v == "1"), "mw": ("merge_warps", int),
        "mdb": ("merge_channels", int), "vw8": ("fp8_value_words", lambda v: v == "1"),
        "kch": ("kivi_key_chains", int), "kp": ("kivi_pipeline", lambda v: v == "1"),
        "do": ("direct_output", lambda v: v == "1"), "ksub": ("kivi_subnormal_codes", lambda v: v == "1"),
        "e8c": ("e8m0_tile_check", lambda v: v == "1"), "ev16": ("e8m0_values_f16", lambda v: v == "1"),
        "t2d": ("fp4_tiles_2d", lambda v: v == "1"),
        "pdl": ("pdl", lambda v: v == "1"), "pida": ("page_ids_ahead", lambda v: v == "1"),
        "vch": ("kivi_value_chunks", int), "vsw": ("kivi_value_scale_words", lambda v: v == "1"),
        "csm": ("kivi_chunk_softmax", int), "rj": ("kivi_joined_row_terms", lambda v: v == "1"),
        "vsub": ("kivi_value_subnormal_codes", lambda v: v == "1"),
        "spg": ("kivi_scalar_page_ids", lambda v: v == "1"),
        "kpt": ("key_products_transposed", lambda v: v == "1"),
        "e8f": ("e8m0_scale_fields", lambda v: v == "1"), "qld": ("q_rows_load", str),
        "po": ("page_order", str)}


def parse_variant(text: str) -> tuple[str, str, dict]:
    words = text.split()
    mod, kw = words[0], {}
    for w in words[1:]:
        k, v = w.split("=")
        name, conv = KEYS[k]
        kw[name] = conv(v)
    return " ".join(words), mod, kw


def main() -> int:
    import torch

    from kvqref.kernels import decode as cur

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="path of the baseline decode module")
    ap.add_argument("--schemes", default="nvfp4,mxfp4,fp4_e2m1")
    ap.add_argument("--variants", default="base; cur")
    ap.add_argument("--shape", default="32,32,8,128,8192")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--page", type=int, default=16, help="page size in tokens (default 16; KIVI pages as decode_bench)")
    ap.add_argument("--eager", action="store_true", help="time the Python launches (default: their CUDA graph)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    mods = {"cur": cur}
    if args.base:
        spec = importlib.util.spec_from_file_location("base_decode", args.base)
        mods["base"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods["base"])
    variants = [parse_variant(v) for v in args.variants.split(";") if v.strip()]
    shape = tuple(int(v) for v in args.shape.split(","))
    batch, q_heads, kv_heads, head_dim, tokens = shape
    doc = ab_document(shape)
    for label in args.schemes.split(","):
        dc, ks, vs = make_cache(label, shape, args.page)
        nbytes = batch * tokens * (side_bytes_per_token(ks, kv_heads, head_dim)
                                   + side_bytes_per_token(vs, kv_heads, head_dim)) + 4 * batch * q_heads * head_dim
        q = torch.randn(batch, q_heads, head_dim, device="cuda").to(torch.bfloat16)
        calls, ref, laid = {}, None, {("random", "NHD"): dc}
        for name, mod, kw in variants:
            try:
                kw = dict(kw)
                layout = kw.pop("layout", "NHD")
                merge = kw.pop("merge", True)
                order = kw.pop("page_order", "random")
                if (order, "NHD") not in laid:
                    laid[order, "NHD"] = make_cache(label, shape, args.page, page_order=order)[0]
                if (order, layout) not in laid:
                    laid[order, layout] = laid[order, "NHD"].with_layout(layout)
                lc = laid[order, layout]
                residual = lc.residual
                launches, out, _ = mods[mod].plan_decode(q, lc.k.tiles(), lc.v.tiles(), lc.block_table, lc.seq_lens,
                                                         lc.page_size, max_seq_len=tokens, residual=residual, **kw)
                if not merge:  # the split launches alone (timing only)
                    launches = [la for la in launches if la.kernel is not mods[mod].merge_kernel]
                for launch in launches:
                    launch()
                torch.cuda.synchronize()
                split = next(la for la in launches if "BLOCK_N" in la.constexprs)
                print(label, name, "splits", split.grid, "warps", split.options.get("num_warps"), flush=True)
            except Exception as exc:  # noqa: BLE001 - report and go on (e.g. shared memory, unknown option)
                print(label, name, "failed:", type(exc).__name__, str(exc)[:120], flush=True)
                continue
            diff = 0.0 if ref is None else float((out - ref).abs().max())
            ref = out.clone() if ref is None else ref
            fn = lambda launches=launches: [launch() for launch in launches]  # noqa: E731
            # the graph's replay keeps the graph, not the buffers its launches write: keep ``fn`` (which holds them)
            replay = fn if args.eager else graph_replay(fn)
            calls[name] = (lambda replay=replay, fn=fn: replay(), diff)
        times: dict[str, list[float]] = {n: [] for n in calls}
        for _ in range(args.rounds):
            for name, (fn, _diff) in calls.items():
                times[name].append(bench_ms(fn) * 1e3)
        for name, (_fn, diff) in calls.items():
            us = statistics.median(times[name])
            row = {"scheme": label, "variant": name, "times_us": times[name], "time_us": us,
                   "gbs": nbytes / (us * 1e-6) / 1e9, "vs_sdpa": doc["sdpa_bf16_us"] / us,
                   "max_abs_diff_vs_first": diff}
            row["ceiling_fraction"] = row["gbs"] / doc["ceiling_gbs"]
            doc["rows"].append(row)
            Path(args.out).write_text(json.dumps(doc, indent=1))
        del dc, laid, lc
        torch.cuda.empty_cache()
    print("| scheme | variant | us (rounds) | x SDPA | % ceiling | max diff |\n|---|---|---|---|---|---|")
    for row in doc["rows"]:
        ts = " / ".join(f"{t:.0f}" for t in row["times_us"])
        print(f"| {row['scheme']} | {row['variant']} | {row['time_us']:.1f} ({ts}) | {row['vs_sdpa']:.2f} | "
              f"{100 * row['ceiling_fraction']:.0f}% | {row['max_abs_diff_vs_first']:.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
