"""Section 8 of the report: SmolLM2-135M reading each quantized cache with and without the Hadamard rotation
(:mod:`kvqref.eval.llm` with :func:`~kvqref.eval.llm.with_rotation`, docs/rotation.md), and the writers of
``kvqref eval --rotation`` (the with/without table as markdown, CSV, JSON, LaTeX and a plot).

The report runs a short version (:data:`REPORT_CONFIGS` on :data:`REPORT_SETTINGS`: teacher-forced text only);
the committed full run (every metric, 2,048 tokens, :data:`kvqref.eval.llm.ROTATION_CONFIGS`) is
bench/results/llm_eval_rotation.md, made by the command in that file.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvqref.eval import llm
from kvqref.report.plotting import pyplot
from kvqref.report.progress import Progress
from kvqref.report.section import Context, Section
from kvqref.report.tables import markdown, write_table

TITLE = "8. Rotation (Hadamard) on SmolLM2-135M"
#: metrics compared with and without rotation (those of the LLM table)
METRICS = ("ppl", "kl", "top1", "gen_agree", "gen_full", "passkey")
#: the report's short run: the formats where rotation moves KL most either way (measured: bench/results)
REPORT_CONFIGS = ("fp8_e4m3", "fp4_e2m1", "nvfp4", "int4_kivi R=0", "int2_kivi R=0")
REPORT_SETTINGS = llm.Settings(tokens=256, prompts=0, depths=())
FULL_RESULTS = "bench/results/llm_eval_rotation.md"


def pair_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per base configuration evaluated both ways: ``bits_per_element``, each metric without rotation
    and with it (``<metric> +H``), and ``kl +H/plain`` (< 1: rotation helps). Configurations evaluated one
    way only are left out."""
    plain = {r["base"]: r for r in rows if not r.get("rotated")}
    out = []
    for r in rows:
        if not r.get("rotated") or r["base"] not in plain:
            continue
        p = plain[r["base"]]
        row: dict[str, Any] = {"config": r["base"], "bits_per_element": p["bits_per_element"]}
        for m in METRICS:
            if m in p or m in r:
                row[m] = p.get(m, math.nan)
                row[m + " +H"] = r.get(m, math.nan)
        row["kl +H/plain"] = r["kl"] / p["kl"] if p.get("kl") else math.nan
        out.append(row)
    return out


def pair_columns(pairs: Sequence[dict[str, Any]]) -> list[str]:
    """The columns the pair rows have, in order."""
    cols = ["config", "bits_per_element"]
    for m in METRICS:
        if pairs and m in pairs[0]:
            cols += [m, m + " +H"]
    return cols + ["kl +H/plain"]


def markdown_table(res: dict[str, Any]) -> str:
    """The with/without table and how to read it."""
    pairs = pair_rows(res["rows"])
    if not pairs:
        return "(no configuration was evaluated both with and without rotation)"
    return "\n".join([
        markdown(pairs, pair_columns(pairs)), "",
        f"`+H`: K and V stored rotated (`rotation=\"hadamard\"`, K seed {llm.ROTATION_K_SEED}, V seed "
        f"{llm.ROTATION_V_SEED}; the same bits per element); `kl +H/plain` < 1: rotation lowers the KL divergence "
        "from the unquantized model. Tensor-level scales (FP8 per tensor, NVFP4's global scale) are calibrated on "
        "the rotated values."])


def plot(out: Path, rows: Sequence[dict[str, Any]], name: str = "llm_rotation_kl.png") -> list[str]:
    """KL without and with rotation per configuration (bars, log scale), the ratio above each pair."""
    plt = pyplot()
    pairs = pair_rows(rows)
    if plt is None or not pairs:
        return []
    fig, ax = plt.subplots(figsize=(max(6.0, 0.75 * len(pairs) + 2), 4.5))
    xs = range(len(pairs))
    w = 0.38

    def positive(v: Any) -> float:
        return v if isinstance(v, (int, float)) and v > 0 else math.nan

    plain = [positive(p["kl"]) for p in pairs]
    rot = [positive(p["kl +H"]) for p in pairs]
    ax.bar([x - w / 2 for x in xs], plain, w, label="without rotation", color="C0")
    ax.bar([x + w / 2 for x in xs], rot, w, label="with Hadamard rotation (+H)", color="C1")
    for x, a, b in zip(xs, plain, rot, strict=True):
        if a > 0 and b > 0:
            ax.annotate(f"x{b / a:.2f}", (x, max(a, b)), ha="center", xytext=(0, 3), textcoords="offset points",
                        fontsize=7, color="C3" if b > a else "C2")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([p["config"] for p in pairs], rotation=35, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("KL divergence from the unquantized model (nats/token)")
    ax.set_title("SmolLM2-135M: KL without vs with rotation (x = +H / plain)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / name, dpi=130)
    plt.close(fig)
    return [name]


def write(out: Path, res: dict[str, Any], name: str = "llm_rotation",
          plot_name: str = "llm_rotation_kl.png") -> tuple[str, list[str]]:
    """``name``.csv/.json/.tex (the with/without table) and the plot ``plot_name`` into ``out``; returns
    (markdown, PNG names)."""
    pairs = pair_rows(res["rows"])
    if pairs:
        write_table(out, name, pairs, pair_columns(pairs),
                    "SmolLM2-135M-Instruct: each KV cache scheme without and with the Hadamard rotation")
    return markdown_table(res), plot(out, res["rows"], plot_name)


def build(ctx: Context) -> Section:
    """Skipped with ``--no-llm``, in ``--quick`` and without the model; otherwise :data:`REPORT_CONFIGS` with and
    without rotation on :data:`REPORT_SETTINGS` (reusing the model the LLM section loaded)."""
    if ctx.options.get("llm") is False:
        return Section(TITLE, "skipped (--no-llm)", {"llm_rotation": None})
    why = llm.unavailable_reason()
    if why:
        return Section(TITLE, f"skipped: {why}", {"llm_rotation": None})
    if ctx.quick:
        return Section(TITLE, "skipped in --quick (run `kvqref eval --rotation both` or the full report)",
                       {"llm_rotation": None})
    model, tok = ctx.options.get("llm_model") or llm.load_model()
    ctx.options["llm_model"] = (model, tok)
    configs = llm.with_rotation(llm.configs_named(REPORT_CONFIGS), "both")
    settings = REPORT_SETTINGS
    t0 = time.perf_counter()
    res = llm.evaluate(model, tok, configs, settings,
                       progress=Progress(llm.steps(configs, settings), "LLM rotation", ctx.progress_stream))
    md, pngs = write(ctx.out, res)
    body = [f"{len(configs) // 2} configurations without and with rotation, {llm.describe(settings)} "
            f"({time.perf_counter() - t0:.0f} s, {res['threads']} torch thread(s)); full run (2,048 tokens, greedy "
            f"generation and passkey, {len(llm.ROTATION_CONFIGS)} configurations): {FULL_RESULTS}, discussed in "
            f"docs/rotation.md. {settings.tokens} positions make a noisy KL: a ratio near 1 here can go either way "
            "(read the full run for the size of each effect).", "", md]
    return Section(TITLE, "\n".join(body), {"llm_rotation": pair_rows(res["rows"])}, pngs)
