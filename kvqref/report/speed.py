"""Section 4 of the report: speed, only where torch sees a GPU, through a short run of
``bench/decode_bench.py``; and the committed GPU results in bench/results that the claims table reads."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from kvqref.report.section import Context, Section
from kvqref.report.tables import write_table

TITLE = "4. Speed"
ROOT = Path(__file__).resolve().parents[2]
NO_GPU_SPEED = "no GPU: speed section skipped (see bench/results for H100 numbers)"
SPEED_COLUMNS = ("op", "backend", "scheme", "batch", "q_heads", "kv_heads", "head_dim", "tokens", "time_us", "gbs",
                 "fraction_of_ceiling")


def speed(stream: TextIO | None = None) -> tuple[list[dict[str, Any]] | None, str]:
    """A short run of bench/decode_bench.py on the GPU; (None, reason) without one."""
    try:
        import torch
    except ImportError:
        return None, NO_GPU_SPEED
    if not torch.cuda.is_available():
        return None, NO_GPU_SPEED
    path = ROOT / "bench" / "decode_bench.py"
    if not path.exists():
        return None, f"speed section skipped: {path} not found (run from a source checkout of kvqref)"
    spec = importlib.util.spec_from_file_location("kvqref_decode_bench", path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # the bench prints a JSON line per case; the table says it
        doc = mod.run(quick=True)
    return doc["results"], f"GPU: {torch.cuda.get_device_name(0)}; bench/decode_bench.py run(quick=True)"


def bench_results() -> list[tuple[Path, dict[str, Any]]]:
    """The benchmark JSON files committed in bench/results (GPU runs), if any."""
    d = ROOT / "bench" / "results"
    out = []
    for p in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            out.append((p, json.loads(p.read_text())))
        except (OSError, ValueError):
            continue
    return out


def fused_gap(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Unfused (torch backend) time / fused (triton) time, per (scheme, shape) measured with both."""
    key = ("scheme", "batch", "q_heads", "kv_heads", "head_dim", "tokens", "page_size", "layout")
    fused = {tuple(r.get(k) for k in key): r for r in results
             if r.get("op") == "decode" and r.get("backend") == "triton"}
    rows = []
    for r in results:
        if r.get("op") == "decode" and r.get("backend") == "torch":
            f = fused.get(tuple(r.get(k) for k in key))
            if f and f.get("time_us"):
                rows.append({"scheme": r["scheme"], "batch": r["batch"], "tokens": r["tokens"],
                             "unfused us": r["time_us"], "fused us": f["time_us"],
                             "unfused / fused": r["time_us"] / f["time_us"]})
    return rows


def build(ctx: Context) -> Section:
    """``ctx.options["want_speed"]``: False skips the section even on a GPU."""
    speed_rows, note = (None, NO_GPU_SPEED)
    if ctx.options.get("want_speed") is not False:
        speed_rows, note = speed(ctx.progress_stream)
    body = note
    if speed_rows:
        body += "\n\n" + write_table(ctx.out, "speed", speed_rows, SPEED_COLUMNS, "Decode and write speed")
    return Section(TITLE, body, {"speed": speed_rows, "speed_note": note})
