"""Section 6 of the report: every accuracy-study configuration with and without the Hadamard rotation
(:mod:`kvqref.eval.rotation`, docs/rotation.md) on three kinds of synthetic cache: zero-mean outlier channels,
KIVI's structure, Gaussian. The full study (``python3 -m kvqref.eval.rotation --tokens 1024 --seeds 2``, about
4 minutes on 2 cores) is in bench/results/rotation_study.md; the report runs a smaller one."""

from __future__ import annotations

from kvqref.eval import rotation, study
from kvqref.report.progress import Progress
from kvqref.report.section import Context, Section
from kvqref.report.tables import write_table

TITLE = "6. Rotation (Hadamard) on synthetic caches"

COLUMNS = ("cache", "base", "rotated", "bits", "k_rel_rms", "v_rel_rms", "attn_rel_err", "top8_agree")


def build(ctx: Context) -> Section:
    quick = ctx.quick
    configs = study.configs_named(study.QUICK_CONFIGS) if quick else list(study.CONFIGS)
    tokens, heads, q_heads = (128, 2, 8) if quick else (256, 4, 16)
    progress = Progress(len(rotation.CACHE_KINDS) * len(configs), "rotation study", ctx.progress_stream)
    rows = rotation.run(configs=configs, progress=progress, tokens=tokens, kv_heads=heads, q_heads=q_heads,
                        queries=4, seeds=(0,))
    write_table(ctx.out, "rotation_synthetic", rows, COLUMNS, "Every configuration with and without rotation")
    body = [f"One cache per kind: {tokens} tokens, {heads} KV heads of 128, {q_heads} query heads, 4 decode "
            f"queries; `+H` = `rotation=\"hadamard\"` (K seed {rotation.K_SEED}, V seed {rotation.V_SEED}); "
            "metrics as in section 2; `+H / plain` = the attention error's ratio (< 1: rotation helps). On "
            "synthetic caches rotation helps per-token integer keys on KIVI-structured caches and hurts scales "
            "taken from the largest element (per-token FP8, NVFP4) on zero-mean outliers; what it does to a real "
            "model is measured by `kvqref eval --rotation both` (section 8, docs/rotation.md).", "",
            rotation.markdown(rows)]
    return Section(TITLE, "\n".join(body), {"rotation": rows})
