"""The claims table: each statement of the source documents (papers/README.md), what kvqref computes for it,
and whether it holds. Reads the accuracy study's and (when run) the speed section's data."""

from __future__ import annotations

from typing import Any

from kvqref.report.accuracy import e4m3_vs_e5m2
from kvqref.report.formats import e4m3_range, sglang_fp4_claim
from kvqref.report.section import Context, Section
from kvqref.report.speed import ROOT, bench_results, fused_gap
from kvqref.report.tables import write_table

TITLE = "Claims checked"


CLAIM_COLUMNS = ("claim", "source", "kvqref measures", "holds", "command")


def claims(acc: dict[str, Any], speed_rows: list[dict[str, Any]] | None = None,
           llm: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The claims table: each source statement, what kvqref computes for it, and whether it holds. ``llm``:
    the LLM section's result (:func:`kvqref.eval.llm.evaluate`), when it ran."""
    fp4 = sglang_fp4_claim()
    rng = e4m3_range()
    rows = []
    for base, claim in (("BF16", 3.56), ("FP8", 1.78)):
        bits = fp4[f"vs {base} with scale"]
        rows.append({"claim": f"FP4 (block 16) holds ~{claim}x the tokens of {base}",
                     "source": "SGLang docs, quantized_kv_cache.md",
                     "kvqref measures": f"{bits:.4f}x with the E8M0 scale counted (4.5 bits); "
                                        f"{fp4[f'vs {base} elements only']:.2f}x without it; "
                                        f"{fp4[f'vs {base} tokens (capacity plan)']:.4f}x tokens in 80 GiB "
                                        "(32 layers, 8 KV heads, head_dim 128)",
                     "holds": abs(round(bits, 2) - claim) < 1e-9,
                     "command": "kvqref capacity --memory 80GiB --layers 32 --kv-heads 8 --head-dim 128"})
    rows.append({"claim": "E4M3 range is +-240", "source": "SGLang docs (and vLLM v0.6.6/v0.11.2 docs)",
                 "kvqref measures": f"E4M3FN (OCP, CUDA) max {rng['float8_e4m3fn']:g}; E4M3FNUZ (ROCm MI300) max "
                                    f"{rng['float8_e4m3fnuz']:g}",
                 "holds": "yes" if rng["float8_e4m3fn"] == 240 else
                 f"no: {rng['float8_e4m3fnuz']:g} is E4M3FNUZ's max, not E4M3FN's",
                 "command": "kvqref formats"})
    for r in acc["kivi"]:
        rows.append({"claim": f"per-channel keys beat per-token at {r['bits']} bits ({r['data']})",
                     "source": "KIVI (Liu et al., 2024)",
                     "kvqref measures": f"K rel. RMS {r['k_rel_rms per-channel']:.3g} vs {r['k_rel_rms per-token']:.3g}"
                                        f" ({r['k_rel_rms ratio']:.2f}x); attention error "
                                        f"{r['attn_rel_err per-channel']:.3g} vs {r['attn_rel_err per-token']:.3g} "
                                        f"({r['attn_rel_err ratio']:.2f}x)",
                     "holds": r["per-channel better"], "command": "kvqref claims"})
    for data, rows_ in (("synthetic", acc["synthetic"]), ("MiniLM-L6", acc.get("minilm"))):
        if not rows_:
            continue
        c = e4m3_vs_e5m2(rows_)
        rows.append({"claim": f"E4M3 is more accurate than E5M2 ({data})", "source": "SGLang and vLLM docs",
                     "kvqref measures": "E4M3 vs E5M2: " + c["text"],
                     "holds": c["holds"], "command": "kvqref claims"})
    by = {r["label"]: r for r in (llm or {}).get("rows", [])}
    if "fp8_e4m3" in by and "fp8_e5m2" in by:
        a, b = by["fp8_e4m3"], by["fp8_e5m2"]
        rows.append({"claim": "E4M3 is more accurate than E5M2 (SmolLM2-135M)", "source": "SGLang and vLLM docs",
                     "kvqref measures": f"per-tensor scales, {llm['tokens']} tokens: KL {a['kl']:.3g} vs "
                                        f"{b['kl']:.3g} nats/token, top-1 {a['top1']:.4f} vs {b['top1']:.4f}",
                     "holds": bool(a["kl"] < b["kl"] and a["top1"] >= b["top1"]), "command": "kvqref eval"})
    gap = fused_gap(speed_rows or [])
    src = "this run (GPU)"
    if not gap:
        for p, doc in bench_results():
            gap = fused_gap(doc.get("results", []))
            if gap:
                src = str(p.relative_to(ROOT))
                break
    if gap:
        text = "; ".join(f"{g['scheme']} B={g['batch']} T={g['tokens']}: {g['unfused / fused']:.2f}x" for g in gap)
        rows.append({"claim": "fused decode is faster than dequantize-then-attend", "source": "SGLang docs",
                     "kvqref measures": f"unfused/fused time ({src}): {text}",
                     "holds": all(g["unfused / fused"] > 1 for g in gap),
                     "command": "python3 bench/decode_bench.py --out bench/results/NAME.json (GPU)"})
    else:
        rows.append({"claim": "fused decode is faster than dequantize-then-attend", "source": "SGLang docs",
                     "kvqref measures": "not measured here: needs a GPU run of bench/decode_bench.py "
                                        "(bench/results/, README)",
                     "holds": "not measured",
                     "command": "python3 bench/decode_bench.py --out bench/results/NAME.json (GPU)"})
    return rows


def build(ctx: Context) -> Section:
    cl = claims(ctx.data["accuracy"], ctx.data.get("speed"), ctx.data.get("llm"))
    return Section(TITLE, write_table(ctx.out, "claims", cl, CLAIM_COLUMNS, "Claims kvqref reproduces or checks"),
                   {"claims": cl})
