"""Which side does the rotation help on SmolLM2? Each configuration with K only, V only and both rotated
(teacher-forced text only: ppl, KL, top-1; :mod:`kvqref.eval.llm`), beside the unrotated one.

    python bench/llm_rotation_sides.py --tokens 2048 --out bench/results/llm_rotation_sides.md
"""

from __future__ import annotations

import argparse
import sys
import time

from kvqref.eval import llm
from kvqref.report.progress import Progress
from kvqref.report.tables import markdown

CONFIGS = ("bf16", "fp8_e4m3", "fp8_e4m3 token_head", "fp4_e2m1", "nvfp4", "int2_kivi R=0")


def sides(config: llm.LLMConfig) -> list[llm.LLMConfig]:
    """``config``, K rotated only, V rotated only, both (seeds of :func:`kvqref.eval.llm.rotated`)."""
    both = llm.rotated(config)
    return [config,
            llm.LLMConfig(config.label + " +H(K)", config.scheme, both.k_options, config.v_options, config.engine),
            llm.LLMConfig(config.label + " +H(V)", config.scheme, config.k_options, both.v_options, config.engine),
            both]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out")
    args = ap.parse_args()
    configs = [c for base in llm.configs_named(CONFIGS) for c in sides(base)]
    settings = llm.Settings(tokens=args.tokens, prompts=0, depths=())
    model, tok = llm.load_model()
    t0 = time.perf_counter()
    res = llm.evaluate(model, tok, configs, settings, threads=1, progress=Progress(llm.steps(configs, settings),
                                                                                 "sides"))
    rows = [{"config": r["label"], "ppl": r["ppl"], "kl": r["kl"], "top1": r["top1"]} for r in res["rows"]]
    doc = "\n".join([
        "# SmolLM2-135M: rotation of K only, V only, both", "",
        f"Command: `python bench/llm_rotation_sides.py {' '.join(sys.argv[1:])}` ({time.perf_counter() - t0:.0f} s; "
        f"{res['machine']}). {res['tokens']} teacher-forced positions of {res['text']}; reference perplexity "
        f"{res['reference']['ppl']:.4g}. `+H(K)`: keys rotated (seed {llm.ROTATION_K_SEED}), values not; `+H(V)`: "
        f"values rotated (seed {llm.ROTATION_V_SEED}); `+H`: both (the rows of llm_eval_rotation.md).", "",
        markdown(rows, ("config", "ppl", "kl", "top1")), ""])
    print(doc)
    if args.out:
        with open(args.out, "w") as f:
            f.write(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
