"""Section 5 of the report: a decoder LLM (SmolLM2-135M-Instruct) reading each quantized cache
(:mod:`kvqref.eval.llm`), and transformers' own quantized caches beside kvqref's (:mod:`kvqref.eval.builtin_caches`).

The report's default runs :data:`kvqref.eval.llm.REPORT_CONFIGS` with :data:`REPORT_SETTINGS` (sized to keep
the section within 3 minutes on 2 CPU cores); ``kvqref eval`` runs every configuration with the full settings
(its committed results: bench/results/llm_eval.md). Also the writers ``kvqref eval`` uses.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvqref.eval import llm
from kvqref.report.plotting import pyplot
from kvqref.report.progress import Progress
from kvqref.report.section import Context, Section
from kvqref.report.tables import jsonable, markdown, write_table

TITLE = "5. Decoder LLM (SmolLM2-135M)"
COLUMNS = ("label", "bits_per_element", "cache_bits", "ppl", "kl", "top1", "gen_agree", "gen_full", "passkey",
           "engine")
BUILTIN_COLUMNS = ("cache", "first prompt", "bits_per_element", "ppl", "kl", "top1", "what differs")
#: the report's default: sized for <= 3 minutes on 2 CPU cores, model load included (measured: docs/eval.md)
REPORT_SETTINGS = llm.Settings(tokens=384, prompts=3, gen_tokens=16, passkey_tokens=4096, depths=(0.5,))
SCOPE = ("SmolLM2-135M-Instruct is a 135M-parameter model (30 layers, 9 query heads, 3 KV heads of 64: GQA "
         "group 3; RoPE; Q4_1 GGUF weights dequantized to float32). The weights are identical for every row, so "
         "the differences are the cache's alone. What this shows: how each scheme's rounding of a trained "
         "decoder's real K/V (after RoPE, with its outlier channels) moves the next-token distribution, greedy "
         "text and long-context retrieval, relative to each other and to the unquantized model. What it does "
         "not show: the size of these effects on larger models (other K/V statistics, head_dim 128, more heads, "
         "deeper stacks), at contexts beyond the lengths tested, under sampling, or on downstream task "
         "accuracy; the perplexity of a small model on Python's documentation is not a benchmark figure.")


def markdown_tables(res: dict[str, Any]) -> str:
    """The rows as a markdown table, with the run's settings and the reference's own numbers."""
    ref = res["reference"]
    s = res["settings"]
    lines = [f"Text: {res['text']} (SHA-256 {res['text_sha256'][:16]}...), {s['tokens']} teacher-forced "
             f"positions; reference (unquantized) perplexity {ref['ppl']:.4g}."]
    if s["prompts"]:
        lines.append(f"Greedy generation: {s['prompts']} prompt(s), reference continuations of up to "
                     f"{s['gen_tokens']} tokens (mean {ref['gen_tokens']:.1f}); teacher forcing the unquantized "
                     f"model reproduces them for {ref['teacher_forced_gen_full'] * 100:.0f}% of prompts (a check "
                     "of the method: float32 SDPA with and without a cache).")
    if s["depths"]:
        lines.append(f"Passkey: {len(s['depths'])} depth(s) ({', '.join(f'{d:g}' for d in s['depths'])}) in "
                     f"prompts of {', '.join(map(str, ref['passkey_prompt_tokens']))} tokens; the unquantized model "
                     f"passes {ref['passkey'] * 100:.0f}%.")
    if any(r.get("rotated") for r in res["rows"]):
        from kvqref.report import llm_rotation

        lines += ["", "Without vs with the Hadamard rotation (docs/rotation.md):", "", llm_rotation.markdown_table(res),
                  "", "Every row:"]
    lines += ["", markdown(res["rows"], COLUMNS), "",
              "bits_per_element: stored bits per K/V element (K and V mean, scales counted, residual window not); "
              "cache_bits: bits the cache held per element after the text (KIVI's full-precision residual "
              "window included); kl: nats per token from the unquantized model; gen_agree: tokens reproduced "
              "before the first different greedy pick (mean); gen_full: prompts reproduced to the end; passkey: "
              "pass rate (n/a: not run)."]
    # a prompt has at most as many tokens as characters: an upper bound on prompt + continuation
    longest = s["gen_tokens"] + max((len(p) for p in llm.PROMPTS[:s["prompts"]]), default=0)
    windows = sorted({int(r.get("base", r["label"]).split("R=")[1]) for r in res["rows"] if "R=" in r["label"]} - {0})
    if s["prompts"] and windows and min(windows) > longest:
        lines.append(f"KIVI rows with a residual window ({', '.join(map(str, windows))} tokens) longer than a prompt "
                     "and its continuation never quantize in the greedy test: their gen_agree measures the window, "
                     "not the format (the R=0 rows measure the format).")
    if res.get("builtin"):
        lines += ["", builtin_markdown(res["builtin"])]
    return "\n".join(lines)


def builtin_markdown(b: dict[str, Any]) -> str:
    if b.get("skipped"):
        return f"transformers' QuantizedCache comparison: skipped: {b['skipped']}"
    out = [f"transformers {b['transformers']}'s own QuantizedCache beside kvqref's matching scheme: the first "
           f"{b['tokens']} tokens of the same text, decoded token by token after a first prompt (prefill) of the "
           "length shown; kl and top1 against the unquantized model at every position after the first prompt.",
           "", markdown(b["rows"], BUILTIN_COLUMNS)]
    if b.get("unavailable"):
        out += ["", "Not installed here: " + "; ".join(b["unavailable"]) + "."]
    if b.get("notes"):
        out += ["", *[f"- {n}" for n in b["notes"]]]
    return "\n".join(out)


def markdown_document(res: dict[str, Any], pngs: Sequence[str] = ()) -> str:
    """``kvqref eval --markdown``: the command, timing and machine, the scope, the tables and plots."""
    b = res.get("builtin") or {}
    seconds = res["seconds"] + (b.get("seconds") or 0)
    return "\n".join(["# kvqref eval: SmolLM2-135M-Instruct with quantized KV caches", "",
                      f"Command: `{res.get('command', 'kvqref eval')}`: {seconds:.0f} s ({res['threads']} torch "
                      f"thread(s); {res.get('machine', '')}).", "", SCOPE, "", markdown_tables(res), "",
                      *[f"![{p}]({p})" for p in pngs], ""])


def to_json(res: dict[str, Any]) -> str:
    return json.dumps(res, indent=1, default=jsonable) + "\n"


def plot(out: Path, rows: list[dict[str, Any]], name: str = "llm_kl.png") -> list[str]:
    """KL divergence against bits per element, one labelled point per configuration."""
    plt = pyplot()
    if plt is None or not rows:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {}
    placed: dict[float, int] = {}  # labels at one x go into a column to its right, ordered by KL
    for r in sorted(rows, key=lambda r: -(r["kl"] or 0)):
        kl = r["kl"] if r["kl"] and r["kl"] > 0 else math.nan
        x = r["bits_per_element"]
        c = colors.setdefault(r["scheme"], f"C{len(colors) % 10}")
        ax.scatter(x, kl, s=18, color=c)
        k = placed.get(x, 0)
        placed[x] = k + 1
        ax.annotate(r["label"], (x, kl), fontsize=6, color=c, xytext=(4, 2 - 7 * k), textcoords="offset points")
    ax.set_xlabel("bits per element (K and V mean, scales included)")
    ax.set_ylabel("KL divergence from the unquantized model (nats/token)")
    ax.set_yscale("log")
    ax.set_title("SmolLM2-135M: KL vs cache size")
    fig.tight_layout()
    fig.savefig(out / name, dpi=130)
    plt.close(fig)
    return [name]


def write(out: Path, res: dict[str, Any]) -> tuple[str, list[str]]:
    """llm.csv/.json/.tex (+ llm_builtin.*) and the plot into ``out``; returns (markdown, PNG names)."""
    write_table(out, "llm", res["rows"], COLUMNS, "SmolLM2-135M-Instruct with quantized KV caches")
    b = res.get("builtin") or {}
    if b.get("rows"):
        write_table(out, "llm_builtin", b["rows"], BUILTIN_COLUMNS,
                    "transformers' QuantizedCache beside kvqref's matching schemes")
    return markdown_tables(res), plot(out, res["rows"])


def build(ctx: Context) -> Section:
    """``ctx.options["llm"] is False``: skipped. Otherwise the model runs when installed (one line with the
    install command when it is not); ``ctx.options["llm_model"]``: a loaded (model, tokenizer) to use."""
    if ctx.options.get("llm") is False:
        return Section(TITLE, "skipped (--no-llm)", {"llm": None})
    why = llm.unavailable_reason()
    if why:
        return Section(TITLE, f"skipped: {why}", {"llm": None, "llm_reason": why})
    configs = llm.configs_named(llm.QUICK_CONFIGS if ctx.quick else llm.REPORT_CONFIGS)
    settings = llm.QUICK if ctx.quick else REPORT_SETTINGS
    t0 = time.perf_counter()
    model, tok = ctx.options.get("llm_model") or llm.load_model()
    ctx.options["llm_model"] = (model, tok)  # later sections (scale choices) reuse the loaded model
    load_seconds = time.perf_counter() - t0
    progress = Progress(llm.steps(configs, settings), "LLM", ctx.progress_stream)
    res = llm.evaluate(model, tok, configs, settings, progress=progress)
    from kvqref.eval import builtin_caches

    res["builtin"] = builtin_caches.compare(model, tok, quick=ctx.quick, progress_stream=ctx.progress_stream)
    res["load_seconds"] = load_seconds
    md, pngs = write(ctx.out, res)
    scope = (f"{'Quick report (--quick)' if ctx.quick else 'Default report'}: {len(configs)} configurations, "
             f"{llm.describe(settings)}; model loaded in {load_seconds:.0f} s, evaluation {res['seconds']:.0f} s, "
             f"comparison {res['builtin'].get('seconds', 0):.0f} s ({res['threads']} torch thread(s); "
             f"{res['machine']})"
             + f"; every configuration with the full settings: `kvqref eval` ({len(llm.CONFIGS)} configurations, "
             f"{llm.describe(llm.FULL)}), results in bench/results/llm_eval.md.")
    return Section(TITLE, "\n\n".join([SCOPE, scope, md]), {"llm": res}, pngs)
