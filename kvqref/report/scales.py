"""Section 7 of the report: what each choice of FP8 K/V scale (the 1.0 default, vLLM's first-batch scale, a
frozen first-prefill amax, calibrated static scales, per-token scales) costs SmolLM2's predictions
(:mod:`kvqref.eval.scales`; definitions in :mod:`kvqref.calibration.compare`). The report runs a short version;
the committed full run (1,024 + 1,024 tokens) is bench/results/scale_choice_smollm2.md, made by
``python -m kvqref.eval.scales --threads 1 --out bench/results/scale_choice_smollm2.md``."""

from __future__ import annotations

from kvqref.eval import llm, scales
from kvqref.report.progress import Progress
from kvqref.report.section import Context, Section
from kvqref.report.tables import write_table

TITLE = "7. Choice of FP8 scale on SmolLM2-135M"

#: (calibration tokens, evaluation tokens, short first prompt, long first prompt) of the report's run
REPORT_SETTINGS = (256, 256, 16, 128)


def build(ctx: Context) -> Section:
    if ctx.options.get("llm") is False:
        return Section(TITLE, "skipped (--no-llm)", {"scale_choices": None})
    why = llm.unavailable_reason()
    if why:
        return Section(TITLE, f"skipped: {why}", {"scale_choices": None})
    if ctx.quick:
        return Section(TITLE, "skipped in --quick (run `kvqref eval --scales` or the full report)",
                       {"scale_choices": None})
    from kvqref.calibration.command import calibration_text
    from kvqref.hf import collect

    model, tok = ctx.options.get("llm_model") or llm.load_model()
    ctx.options["llm_model"] = (model, tok)
    calib, n_eval, short, long = REPORT_SETTINGS
    ids = collect.tokenize(tok, calibration_text(None), calib + n_eval)
    res = scales.evaluate(model, ids[:calib], ids[calib:], short=short, long=long,
                          progress=Progress(scales.steps(), "scale choices", ctx.progress_stream))
    rows = [{"choice": r["choice"], "granularity": r["granularity"], "ppl": r["ppl"], "kl": r["kl"],
             "top1": r["top1"], "k_saturated": r["k"]["saturated"], "v_saturated": r["v"]["saturated"],
             "k_rel_err": r["k"]["rel_err"], "v_rel_err": r["v"]["rel_err"]} for r in res["rows"]]
    write_table(ctx.out, "scale_choices", rows, tuple(rows[0]), "fp8_e4m3 K/V scale choices on SmolLM2-135M")
    body = [f"fp8_e4m3 (vLLM profile): static scales calibrated on tokens [0, {calib}) of Python's bundled prose, "
            f"evaluated teacher forced on the next {n_eval} tokens as a fresh prompt; first-batch and "
            f"first-prefill choices from its first {short} and {long} tokens; KL and top-1 against the unquantized "
            "model; saturated = elements beyond 448 x scale. Read differences against the noise-floor rows (scale "
            "1.0 x 0.97 / 1.01 / 1.03). Full run: bench/results/scale_choice_smollm2.md; docs/calibration.md.",
            "", scales.markdown(res)]
    return Section(TITLE, "\n".join(body), {"scale_choices": rows})
