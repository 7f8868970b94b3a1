"""Host time of an eager ``triton_backend.decode`` call, and how much of it the decode plan cache saves.

    python3 bench/host_overhead.py [--schemes bf16,fp8_e4m3,...] [--calls 300] [--profile] [--out F.json]

Batch 32, 32 query / 8 KV heads, head_dim 128, 8,192 tokens, head-major pages of 16 tokens (32 for KIVI), as the
headline row of bench/decode_bench.py. For each scheme, microseconds of host time per call, median of 5 rounds of
``--calls`` calls:

* ``plan_us`` / ``plan_uncached_us``: ``plan_decode`` with its plan cache (a plan made once per shape and options,
  then bound to the call's tensors) and without (``cache=False``: every choice made again, as before session 46);
* on a GPU also ``call_us`` / ``call_jit_us`` / ``call_uncached_us``: the whole eager call,
  ``decode(validate=False, max_seq_len=...)`` issued without synchronizing: the plan served from its cache and its
  compiled kernels launched directly (``decode.LaunchHandle``, the default), the same plan launched through
  Triton's ``kernel[grid]`` (its argument binding, specialization and cache lookup per launch;
  ``decode.DIRECT_LAUNCH = False``), and a plan made every call, whose launches go through ``kernel[grid]``; and
  ``gpu_us``: one call between two CUDA events after a synchronize (L2 not flushed), which holds the host's time
  until the first launch is issued plus the kernels' (an eager call's latency, not the kernels' time).

The write of one decode step (one bfloat16 token per sequence into V) likewise: ``write_plan_us`` /
``write_plan_uncached_us`` (``plan_write`` with its plan kept, and ``cache=False``), and on a GPU ``write_call_us`` /
``write_call_jit_us`` / ``write_call_uncached_us`` (the eager ``quantize_write(validate=False)``: directly launched,
through ``kernel[grid]``, planned every call).

Without a GPU the plan is timed on this machine's CPU over empty CPU tensors (planning reads no values; the split
counts are those of 4 multiprocessors). ``--profile`` prints a cProfile of the cached calls.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import decode_bench as db  # noqa: E402

SHAPE = (32, 32, 8, 128, 8192)
PAGE = 16


def per_call_us(fn, calls: int, rounds: int = 5, sync=None) -> float:
    """Median over ``rounds`` of the host microseconds per call of ``calls`` calls of ``fn`` (``sync`` after each
    round, outside the timed region)."""
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
        if sync is not None:
            sync()
    return statistics.median(times)


def cpu_cache(label: str, shape, page_size: int, layout: str = db.LAYOUT):
    """An empty device cache of scheme ``label`` on the CPU, laid out as bench/decode_bench.py's (no values: a plan
    reads none)."""
    import warnings

    from kvqref import schemes
    from kvqref.backends import triton_backend as tb

    batch, _, kv_heads, head_dim, tokens = shape
    _, name, kopt, vopt = next(s for s in db.SCHEMES if s[0] == label)
    page_size = max(page_size, 32) if name.endswith("kivi") else page_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ks, vs = schemes.get(name, **kopt), schemes.get(name, **vopt)
    params = {"scale": 6.0 / 448.0} if name.startswith("fp8") else None
    return tb.uniform_device_cache(ks, vs, batch, tokens, page_size, kv_heads, head_dim, device="cpu", layout=layout,
                                   k_params=params, v_params=params)


def measure(label: str, calls: int, profile: bool) -> dict[str, Any]:
    import torch

    from kvqref.backends import triton_backend as tb
    from kvqref.kernels import decode as dec
    from kvqref.kernels.decode import clear_plan_cache, plan_decode

    batch, q_heads, _, head_dim, tokens = SHAPE
    gpu = torch.cuda.is_available()
    if gpu:
        dc, _, _ = db.make_cache(label, SHAPE, PAGE, layout=db.LAYOUT)
    else:
        dc = cpu_cache(label, SHAPE, PAGE)
    q = torch.randn(batch, q_heads, head_dim, device="cuda" if gpu else "cpu").to(torch.bfloat16)
    clear_plan_cache()

    def plan(cache: bool):
        return plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, dc.page_size,
                           residual=dc.residual, max_seq_len=tokens, cache=cache)

    row: dict[str, Any] = {"scheme": label, "shape": list(SHAPE), "page_size": dc.page_size, "layout": db.LAYOUT,
                           "calls": calls}
    for cache in (True, False):
        plan(cache)
        row["plan_us" if cache else "plan_uncached_us"] = per_call_us(lambda c=cache: plan(c), calls)
    if gpu:
        def call(cache: bool):
            return tb.decode(q, dc, validate=False, max_seq_len=tokens, cache=cache)

        for name, cache, direct in (("call_us", True, True), ("call_jit_us", True, False),
                                    ("call_uncached_us", False, True)):
            dec.DIRECT_LAUNCH = direct
            for _ in range(20):
                call(cache)
            torch.cuda.synchronize()
            row[name] = per_call_us(lambda c=cache: call(c), calls, sync=torch.cuda.synchronize)
        dec.DIRECT_LAUNCH = True
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        gpu_ms = []
        for _ in range(20):
            start.record()
            call(True)
            end.record()
            torch.cuda.synchronize()
            gpu_ms.append(start.elapsed_time(end))
        row["gpu_us"] = statistics.median(gpu_ms) * 1e3
    measure_writes(row, dc, calls, gpu)
    if profile:
        def profiled():
            return tb.decode(q, dc, validate=False, max_seq_len=tokens) if gpu else plan(True)

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            profiled()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
        print(text.getvalue()[:5000], flush=True)
    return row


def measure_writes(row: dict[str, Any], dc, calls: int, gpu: bool) -> None:
    """The write of one decode step into V (one token per sequence: x [batch, kv_heads, head_dim] bfloat16): host us
    per ``plan_write`` with its plan kept and without (``write_plan_us``, ``write_plan_uncached_us``), and on a GPU
    the whole eager ``quantize_write(validate=False)`` directly launched, through ``kernel[grid]``, and planned every
    call (``write_call_us``, ``write_call_jit_us``, ``write_call_uncached_us``)."""
    import torch

    from kvqref.backends import triton_backend as tb
    from kvqref.kernels import decode as dec

    batch, _, kv_heads, head_dim, _ = SHAPE
    device = "cuda" if gpu else "cpu"
    x = torch.randn(batch, kv_heads, head_dim, device=device).to(torch.bfloat16)
    slots = torch.arange(batch, dtype=torch.int64, device=device)
    tb.clear_write_plan_cache()
    for cache in (True, False):
        tb.plan_write(dc.v, x, slots, cache=cache)
        key = "write_plan_us" if cache else "write_plan_uncached_us"
        row[key] = per_call_us(lambda c=cache: tb.plan_write(dc.v, x, slots, cache=c), calls)
    if not gpu:
        return
    for name, cache, direct in (("write_call_us", True, True), ("write_call_jit_us", True, False),
                                ("write_call_uncached_us", False, True)):
        dec.DIRECT_LAUNCH = direct
        for _ in range(20):
            tb.quantize_write(dc.v, x, slots, validate=False, cache=cache)
        torch.cuda.synchronize()
        row[name] = per_call_us(lambda c=cache: tb.quantize_write(dc.v, x, slots, validate=False, cache=c), calls,
                                sync=torch.cuda.synchronize)
    dec.DIRECT_LAUNCH = True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", default=",".join(s[0] for s in db.SCHEMES))
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    labels = [s for s in args.schemes.split(",") if s]
    known = [s[0] for s in db.SCHEMES]
    if not labels or any(s not in known for s in labels):
        ap.error(f"--schemes takes labels of {known}, got {args.schemes!r}")
    if args.calls < 1:
        ap.error("--calls must be positive")
    rows = []
    for i, label in enumerate(labels, 1):
        row = measure(label, args.calls, args.profile)
        rows.append(row)
        keys = [k for k in ("plan_us", "plan_uncached_us", "call_us", "call_jit_us", "call_uncached_us", "gpu_us",
                            "write_plan_us", "write_plan_uncached_us", "write_call_us", "write_call_jit_us",
                            "write_call_uncached_us") if k in row]
        print(f"[{i}/{len(labels)}] {label}: " + ", ".join(f"{k} {row[k]:.1f}" for k in keys), flush=True)
    result = {"command": "python3 bench/host_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "environment": db.environment(), "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
