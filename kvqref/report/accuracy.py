"""Section 2 of the report: the K/V accuracy study (:mod:`kvqref.eval.study`) on synthetic KIVI-structured
caches and, when its weights are installed, on MiniLM-L6 activations (:mod:`kvqref.eval.minilm`); KIVI's
per-channel keys finding and E4M3 against E5M2."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from kvqref.eval import minilm, study
from kvqref.report.plotting import pyplot
from kvqref.report.progress import Progress
from kvqref.report.section import Context, Section
from kvqref.report.tables import write_table

TITLE = "2. Accuracy"

ACC_COLUMNS = ("config", "bits", "k_rel_rms", "v_rel_rms", "attn_rel_err", "top8_agree", "engine")
KIVI_COLUMNS = ("data", "bits", "k_rel_rms per-channel", "k_rel_rms per-token", "k_rel_rms ratio",
                "attn_rel_err per-channel", "attn_rel_err per-token", "attn_rel_err ratio",
                "top8_agree per-channel", "top8_agree per-token", "per-channel better")


def synthetic_caches(quick: bool) -> list[study.Cache]:
    if quick:
        return [study.kivi_synthetic(256, 4, 128, 16, 4, seed=0)]
    return [study.kivi_synthetic(1024, 8, 128, 32, 8, seed=s) for s in range(4)]


def synthetic_description(quick: bool) -> str:
    n, T, H, Hq, nq = (1, 256, 4, 16, 4) if quick else (4, 1024, 8, 32, 8)
    return (f"{n} cache(s) of {T} tokens, {H} KV heads of 128 (queries: {nq} decode steps x {Hq} heads); keys: 4 "
            "channels per head of magnitude U(10, 100), nearly constant over tokens, RoPE applied; values: "
            "standard normal")


def accuracy(quick: bool, progress_stream: TextIO | None = None) -> dict[str, Any]:
    """The accuracy study: synthetic rows, MiniLM rows (or the reason they are missing), the KIVI finding."""
    configs = study.configs_named(study.QUICK_CONFIGS) if quick else list(study.CONFIGS)
    res: dict[str, Any] = {"synthetic_description": synthetic_description(quick)}
    caches = synthetic_caches(quick)
    res["synthetic"] = study.run(caches, configs, progress=Progress(len(configs), "accuracy, synthetic",
                                                                       progress_stream))
    why = minilm.unavailable_reason()
    res["minilm_reason"] = why
    res["minilm"] = None
    if why is None:
        try:
            mcaches = minilm.caches(1, 128, layers=[0, 5], queries=16) if quick else minilm.caches(2, 256)
        except Exception as e:  # a broken install: say so, keep the rest of the report
            res["minilm_reason"] = f"MiniLM-L6 could not be run: {type(e).__name__}: {e}"
        else:
            res["minilm_description"] = (f"MiniLM-L6 (all-MiniLM-L6-v2, an ENCODER: bidirectional, no RoPE), "
                                         f"{len(mcaches)} (layer, text chunk) caches of {mcaches[0].k.shape[0]} "
                                         f"tokens, 12 heads of 32, {mcaches[0].q.shape[0]} queries each")
            res["minilm"] = study.run(mcaches, configs, progress=Progress(len(configs), "accuracy, MiniLM-L6",
                                                                          progress_stream))
    kivi = [{"data": "synthetic", **r} for r in study.kivi_finding(res["synthetic"])]
    if res["minilm"]:
        kivi += [{"data": "MiniLM-L6", **r} for r in study.kivi_finding(res["minilm"])]
    res["kivi"] = kivi
    return res


def e4m3_vs_e5m2(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    by = {r["config"]: r for r in rows}
    a, b = by["fp8_e4m3"], by["fp8_e5m2"]
    metrics = {m: (a[m], b[m]) for m in ("k_rel_rms", "v_rel_rms", "attn_rel_err")}
    return {"metrics": metrics, "holds": all(x < y for x, y in metrics.values()),
            "text": "; ".join(f"{m} {x:.3g} vs {y:.3g}" for m, (x, y) in metrics.items())}


def plots(out: Path, acc: dict[str, Any]) -> list[str]:
    """Accuracy against size per data set, and KIVI's keys bar chart; the PNG names written (none without
    matplotlib)."""
    plt = pyplot()
    if plt is None:
        return []
    written = []
    for data, rows in (("synthetic", acc["synthetic"]), ("minilm", acc.get("minilm"))):
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in rows:
            ax.scatter(r["bits"], r["attn_rel_err"], s=18)
            ax.annotate(r["config"], (r["bits"], r["attn_rel_err"]), fontsize=6, xytext=(3, 2),
                        textcoords="offset points")
        ax.set_xlabel("bits per element (K and V mean, scales included)")
        ax.set_ylabel("attention output relative error")
        ax.set_yscale("log")
        ax.set_title(f"Accuracy vs size ({data})")
        fig.tight_layout()
        name = f"accuracy_{data}.png"
        fig.savefig(out / name, dpi=130)
        plt.close(fig)
        written.append(name)
    if acc["kivi"]:
        fig, ax = plt.subplots(figsize=(7, 4))
        labels = [f"{r['data']}\n{r['bits']} bits" for r in acc["kivi"]]
        x = np.arange(len(labels))
        ax.bar(x - 0.2, [r["attn_rel_err per-channel"] for r in acc["kivi"]], 0.4, label="keys per channel (KIVI)")
        ax.bar(x + 0.2, [r["attn_rel_err per-token"] for r in acc["kivi"]], 0.4, label="keys per token")
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylabel("attention output relative error")
        ax.set_title("KIVI: per-channel vs per-token key quantization")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "kivi_keys.png", dpi=130)
        plt.close(fig)
        written.append("kivi_keys.png")
    return written


def build(ctx: Context) -> Section:
    out = ctx.out
    acc = accuracy(ctx.quick, ctx.progress_stream)
    s_md = write_table(out, "accuracy_synthetic", acc["synthetic"], ACC_COLUMNS,
                       "Accuracy on synthetic KIVI-structured caches")
    body = ["Metrics: relative RMS error of K and V; relative error (2-norm) of the attention output of the "
            "float64 oracle on the dequantized cache against the float64 oracle on the unquantized one; mean "
            "fraction of the 8 highest-weight tokens kept (top8_agree). Every token is quantized (no KIVI "
            "residual window). bits: K and V mean, scales included.", "",
            f"(a) Synthetic: {acc['synthetic_description']}.", "", s_md, ""]
    if acc["minilm"]:
        m_md = write_table(out, "accuracy_minilm", acc["minilm"], ACC_COLUMNS,
                           "Accuracy on MiniLM-L6 (encoder) K/V activations")
        body += [f"(b) Real activations: {acc['minilm_description']}. MiniLM-L6 is an encoder, not a decoder "
                 "LLM: these are trained K/V statistics, not a serving cache.", "", m_md, ""]
    else:
        body += [f"(b) Real activations: skipped: {acc['minilm_reason']}.", ""]
    k_md = write_table(out, "kivi_keys", acc["kivi"], KIVI_COLUMNS,
                       "KIVI: keys quantized per channel vs per token (ratio = per-token / per-channel)")
    body += ["KIVI's finding (keys per channel vs per token, same format and group size 32; 'per token' is the "
             "value-role grouping applied to keys; ratio = per-token error / per-channel error):", "", k_md, ""]
    for data, rows_ in (("synthetic", acc["synthetic"]), ("MiniLM-L6", acc["minilm"])):
        if rows_:
            c = e4m3_vs_e5m2(rows_)
            body.append(f"E4M3 vs E5M2 ({data}, per-tensor scales): {c['text']}: E4M3 "
                        f"{'is' if c['holds'] else 'is NOT'} more accurate on every metric.")
    return Section(TITLE, "\n".join(body), {"accuracy": acc}, plots(out, acc))
