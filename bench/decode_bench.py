"""Decode-attention and quantize-on-write benchmarks (GPU timing with CUDA events after warm-up).

Used by ``bench/test_bench.py`` (pytest-benchmark) and runnable on its own on the GPU machine, which has
no package index:

    python3 bench/decode_bench.py --out bench/results/h100.json
    python3 bench/decode_bench.py --rotation --out bench/results/rotation_h100.json   # issue 13's rows
    python3 bench/decode_bench.py --rotation-writes --out bench/results/rotation_writes_h100.json

``--layout`` (default HND): the device cache's field layout of the triton rows (``DeviceCache`` layouts: HND
head-major pages, NHD token-major as :class:`kvqref.paged.PagedKVCache`); the full run adds the batch-32 decode and
the write rows in the other layout, and the schemes other than KIVI (whose caches here hold whole key groups) at
``RAGGED`` (batch 32 x 8,190 tokens: each sequence ends inside a tile, which the aligned shapes never time; session
40 found fp4_e2m1 47% slower there, a rerun that only a partial tile set off).

Each result records the device, driver, torch and triton versions, the shape, scheme, layout, bytes moved,
achieved GB/s and the fraction of a bandwidth ceiling measured in the same run (a large device
reduction: bytes read / time). Times are medians of ``triton.testing.do_bench`` (which flushes L2
between rounds) over the replay of the call captured in a CUDA graph, as serving engines run decode
(``"timing": "cuda_graph"``; the torch backend's rows, which synchronize, are timed eager); every row also
records ``eager_time_us``, the call made from Python, which includes the host's launch overhead. The baseline, torch
SDPA over a dense BF16 cache, is timed before and after each shape's rows (the target shape also at the end of the
run, rows with ``"round"``); bench/tables.py computes every speed-up against the median of its shape's SDPA times.

``--rotation``: issue 13's comparison in one run: for fp8_e4m3, fp4_e2m1, nvfp4 and int4_kivi, decode at
batch 32 x 8192 (fast precision) and quantize-on-write, each unrotated and with the randomized Hadamard
rotation fused into the kernels (K seed 1, V seed 2; the write kernel with its default token block and with
16 tokens per program; KIVI also the value side, whose quantization differs from the keys'), timed alternately over
two rounds, beside SDPA and the ceiling; the summary rows (``op: "rotation_ratio"``, ``side`` "k" or "v") give
rotated / unrotated time per scheme (targets: decode <= 1.05, write <= 1.10).
``--rotation-writes``: the write rows of ``--rotation`` alone (default token block), unrotated and rotated with
each butterfly route of ``--rotation-routes`` (``plan_write``'s ``rotation_route``; default split, sums and shfl),
alternately over ``--rounds`` rounds (default 5), then the ratios: about a minute.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (batch, q_heads, kv_heads, head_dim, tokens)
SHAPES = [
    (32, 32, 8, 128, 8192),
    (8, 32, 8, 128, 32768),
    (1, 32, 8, 128, 131072),
    (128, 32, 8, 128, 4096),
    (64, 64, 8, 128, 16384),
]
#: the target shape with each sequence ending inside a tile (8,190 = 8,192 - 2 tokens): the full run times every scheme
#: there too (bench/results/ANALYSIS.md, session 40: an E8M0 check took the masked tokens' scale word 0 for code 0)
RAGGED = (32, 32, 8, 128, 8190)
SCHEMES: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    # label, scheme name, K options, V options
    ("bf16", "bf16", {}, {}),
    ("fp8_e4m3", "fp8_e4m3", {}, {}),
    ("fp8_e5m2", "fp8_e5m2", {}, {}),
    ("fp4_e2m1", "fp4_e2m1", {}, {}),
    ("mxfp4", "mxfp4", {}, {}),
    ("nvfp4", "nvfp4", {}, {}),
    ("int4_kivi", "int4_kivi", {"role": "key", "residual": 0}, {"role": "value", "residual": 0}),
    ("int2_kivi", "int2_kivi", {"role": "key", "residual": 0}, {"role": "value", "residual": 0}),
]


#: the device cache's field layout of every triton row (``--layout``): head-major pages (HND) measured faster on the
#: H100 (session 10, bench/results/ANALYSIS.md); ``run`` adds the batch-32 and write rows of the other layout
LAYOUT = "HND"
OTHER_LAYOUT = {"HND": "NHD", "NHD": "HND"}

#: issue 13's rotated rows: the schemes, and the rotation of K and V (different seeds)
ROTATION_LABELS = ("fp8_e4m3", "fp4_e2m1", "nvfp4", "int4_kivi")
ROTATION_K = {"rotation": "hadamard", "rotation_seed": 1}
ROTATION_V = {"rotation": "hadamard", "rotation_seed": 2}


def environment() -> dict[str, Any]:
    import torch
    import triton

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "numpy": np.__version__,
    }
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
        env["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = "unknown"
    else:
        env["device"] = platform.processor() or "cpu"
    return env


def bench_ms(fn) -> float:
    """Median milliseconds of ``fn`` on the GPU (CUDA events, L2 flushed between rounds)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def bandwidth_ceiling_gbs(gib: float = 4.0) -> float:
    """Read bandwidth of a large device reduction (bytes read / time), GB/s."""
    import torch

    x = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device="cuda").normal_()
    ms = bench_ms(lambda: x.sum(dtype=torch.float32))
    return x.numel() * 2 / (ms * 1e-3) / 1e9


def side_bytes_per_token(scheme, kv_heads: int, head_dim: int) -> float:
    """Stored bytes per token of one of K or V (group fields amortised), all KV heads."""
    total = 0.0
    for spec in scheme.fields(kv_heads, head_dim).values():
        n = np.dtype(spec.dtype).itemsize * int(np.prod(spec.shape, dtype=np.int64)) * kv_heads
        total += n / (scheme.token_group if spec.per == "group" else 1)
    return total


def make_cache(label: str, shape, page_size: int, seed: int = 0, rotation: bool = False, layout: str = "NHD",
               page_order: str = "random"):
    """A device cache of random K/V (keys with outlier channels) written by the Triton write kernel;
    ``rotation``: K and V rotated (``ROTATION_K``, ``ROTATION_V``), the rotation fused into the write;
    ``layout``: the fields' layout (``"NHD"`` token-major pages, ``"HND"`` head-major); ``page_order``:
    ``"random"`` (the bench's: the pool's pages dealt to the sequences in a random permutation, as a serving
    engine's free list leaves them after churn) or ``"sequential"`` (sequence b holds pages b * P .. b * P + P - 1:
    the same tokens with the same values, each sequence's pages contiguous; for measuring what the scatter costs)."""
    if page_order not in ("random", "sequential"):
        raise ValueError(f"page_order must be 'random' or 'sequential', not {page_order!r}")
    import torch

    from kvqref import schemes
    from kvqref.backends import triton_backend as tb

    batch, q_heads, kv_heads, head_dim, tokens = shape
    _, name, kopt, vopt = next(s for s in SCHEMES if s[0] == label)
    if name.endswith("kivi"):
        page_size = max(page_size, 32)  # KIVI key groups (G=32 tokens) live inside one page
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ks = schemes.get(name, **kopt, **(ROTATION_K if rotation else {}))
        vs = schemes.get(name, **vopt, **(ROTATION_V if rotation else {}))
    pages_per_seq = -(-tokens // page_size)
    num_pages = batch * pages_per_seq
    g = torch.Generator(device="cuda").manual_seed(seed)
    perm = torch.randperm(num_pages, device="cuda", generator=g).to(torch.int32)  # drawn either way: same K/V
    if page_order == "sequential":
        perm = torch.arange(num_pages, device="cuda", dtype=torch.int32)
    block_table = perm.view(batch, pages_per_seq)
    seq_lens = torch.full((batch,), tokens, dtype=torch.int32)
    params = {}
    if name.startswith("fp8"):
        params = {"scale": np.float32(6.0 / 448.0)}
    elif name == "nvfp4":
        params = {"global_scale": np.float32(6.0 / 2688.0)}
    dc = tb.empty_device_cache(
        ks, vs, num_pages, page_size, kv_heads, head_dim, block_table, seq_lens, k_params=params, v_params=params,
        layout=layout,
    )
    t = torch.arange(tokens, device="cuda")
    chunk = max(1, 2**24 // (kv_heads * head_dim))  # write in chunks of ~16M elements
    for b in range(batch):
        slots = block_table[b, t // page_size].long() * page_size + t % page_size
        for lo in range(0, tokens, chunk):
            hi = min(tokens, lo + chunk)
            for side, outl in ((dc.k, True), (dc.v, False)):
                x = torch.randn(hi - lo, kv_heads, head_dim, device="cuda", generator=g)
                if outl:
                    x[:, :, ::37] *= 20.0
                x = x.clamp(-6.0, 6.0) if outl is False else x.clamp(-100, 100)
                tb.quantize_write(side, x.to(torch.bfloat16), slots[lo:hi], validate=False)
    return dc, ks, vs


def graph_replay(fn):
    """``fn`` captured once in a CUDA graph (after a warm-up call on a side stream, as torch's CUDA-graph
    notes do); returns the graph's ``replay`` (which keeps the graph alive)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def timed(fn, record: dict[str, Any], graph: bool = True) -> dict[str, Any]:
    """``record`` (which holds ``bytes``) completed with the median time of ``fn`` and the GB/s.

    ``graph=True``: ``time_us`` is the replay of ``fn`` captured in a CUDA graph, as serving engines run
    decode (vLLM, SGLang, TensorRT-LLM), so it is the GPU time of the launches without Python's launch
    overhead; ``eager_time_us`` is ``fn`` called from Python (the two differ where the host cannot issue the
    launches as fast as the GPU runs them). ``graph=False``: ``time_us`` is the eager time (calls that
    synchronize, e.g. the torch backend)."""
    eager = bench_ms(fn)
    ms = bench_ms(graph_replay(fn)) if graph else eager
    return {**record, "time_us": ms * 1e3, "timing": "cuda_graph" if graph else "eager",
            "eager_time_us": eager * 1e3, "gbs": record["bytes"] / (ms * 1e-3) / 1e9}


def decode_case(label: str, shape, page_size: int, backend: str = "triton", precision: str = "fast",
                rotation: bool = False, layout: str | None = None) -> dict[str, Any]:
    """One timed decode row (page_size is the one asked for; KIVI runs with pages of 32)."""
    return timed(*decode_setup(label, shape, page_size, backend, precision, rotation, layout),
                 graph=backend == "triton")


def decode_setup(label: str, shape, page_size: int, backend: str = "triton", precision: str = "fast",
                 rotation: bool = False, layout: str | None = None, plan: dict | None = None):
    """(the decode call to time, its record without times): a device cache written by the kernel;
    ``precision``: the triton kernel's ("fast" or "exact"; the torch backend's bfloat16 or float32);
    ``rotation``: a rotated cache (q rotated and the output un-rotated by the kernels); ``layout``: the triton
    cache's field layout (default ``LAYOUT``; the torch backend reads token-major fields only); ``plan``: options of
    the triton kernel's ``plan_decode`` (default: none, the planned defaults)."""
    import torch

    from kvqref.backends import torch_backend, triton_backend

    batch, q_heads, kv_heads, head_dim, tokens = shape
    layout = "NHD" if backend != "triton" else layout or LAYOUT
    dc, ks, vs = make_cache(label, shape, page_size, rotation=rotation, layout=layout)
    q = torch.randn(batch, q_heads, head_dim, device="cuda").to(torch.bfloat16)
    if backend == "triton":
        triton_backend.validate_decode(q, dc)  # once, outside the timed region (it synchronizes)

        def fn():
            return triton_backend.decode(q, dc, validate=False, max_seq_len=tokens, precision=precision,
                                         **(plan or {}))
    else:

        def fn():
            return torch_backend.decode(q, dc, precision=precision)

    per_tok = side_bytes_per_token(ks, kv_heads, head_dim) + side_bytes_per_token(vs, kv_heads, head_dim)
    nbytes = batch * tokens * per_tok + 2 * q.numel() * 2
    return fn, {
        "op": "decode",
        "backend": backend,
        "precision": precision,
        "scheme": label,
        "rotation": rotation_label(rotation),
        "batch": batch,
        "q_heads": q_heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "tokens": tokens,
        "page_size": page_size,
        "layout": layout,
        "bytes": nbytes,
    }


def ab_document(shape) -> dict[str, Any]:
    """The head of an A/B run's JSON (bench/ab_decode.py, bench/ab_rotation_decode.py): the command, environment
    and shape, with the bandwidth ceiling and SDPA over BF16 measured now (and printed); ``rows`` to fill."""
    doc = {"command": " ".join(sys.argv), "environment": environment(), "shape": shape,
           "ceiling_gbs": bandwidth_ceiling_gbs(), "sdpa_bf16_us": sdpa_case(shape)["time_us"], "rows": []}
    print("ceiling", round(doc["ceiling_gbs"]), "GB/s; sdpa", round(doc["sdpa_bf16_us"], 1), "us", flush=True)
    return doc


def sdpa_case(shape) -> dict[str, Any]:
    """torch SDPA over a contiguous BF16 cache: the baseline the targets are relative to."""
    import torch

    batch, q_heads, kv_heads, head_dim, tokens = shape
    k = torch.randn(batch, kv_heads, tokens, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, q_heads, 1, head_dim, device="cuda", dtype=torch.bfloat16)

    def fn():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    eager = bench_ms(fn)
    ms = bench_ms(graph_replay(fn))
    nbytes = 2 * k.numel() * 2 + 2 * q.numel() * 2
    return {
        "op": "decode",
        "backend": "torch-sdpa-dense",
        "scheme": "bf16",
        "batch": batch,
        "q_heads": q_heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "tokens": tokens,
        "page_size": 0,
        "time_us": ms * 1e3,
        "timing": "cuda_graph",
        "eager_time_us": eager * 1e3,
        "bytes": nbytes,
        "gbs": nbytes / (ms * 1e-3) / 1e9,
    }


def write_case(label: str, tokens: int = 65536, kv_heads: int = 8, head_dim: int = 128, rotation: bool = False,
               block_t: int | None = None, layout: str | None = None) -> dict[str, Any]:
    """One timed quantize-on-write row."""
    return timed(*write_setup(label, tokens, kv_heads, head_dim, rotation, block_t, layout=layout))


def rotation_label(rotation: bool) -> str | None:
    return f"K {ROTATION_K}, V {ROTATION_V}" if rotation else None


def parse_launches(text: str) -> list[tuple[str, dict[str, int | str]]]:
    """The write launches of a ``--launches`` option, ``'k=v,k=v;k=v'``: (each launch's text, its keyword
    arguments), integer values as ints and the others (``rotation_route=shfl``) as strings."""
    out = []
    for item in (t.replace(" ", "") for t in text.split(";") if t.strip()):
        out.append((item, {k: int(v) if v.lstrip("-").isdigit() else v
                           for k, v in (kv.split("=") for kv in item.split(","))}))
    return out


def write_inputs(label: str, tokens: int = 65536, kv_heads: int = 8, head_dim: int = 128, side: str = "k",
                 seed: int = 0, device: str = "cuda", rotation: bool = False, layout: str | None = None):
    """(the cache side to write, x, slot mapping, the record without times) of one quantize-on-write row:
    bf16 input, pages of 32 slots in random order (KIVI: consecutive slots, keys in whole groups); ``side``:
    "k" or "v" (KIVI keys and values differ; the other schemes are the same on both sides); ``rotation``:
    the side rotated (``ROTATION_K``/``ROTATION_V``; the rotation fused into the write kernel); ``layout``: the
    cache's field layout (default ``LAYOUT``)."""
    import torch

    from kvqref import schemes
    from kvqref.backends import triton_backend as tb

    _, name, kopt, vopt = next(s for s in SCHEMES if s[0] == label)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scheme = schemes.get(name, **(kopt if side == "k" else vopt),
                             **((ROTATION_K if side == "k" else ROTATION_V) if rotation else {}))
    params = {}
    if name.startswith("fp8"):
        params = {"scale": np.float32(6.0 / 448.0)}
    elif name == "nvfp4":
        params = {"global_scale": np.float32(6.0 / 2688.0)}
    page = 32
    num_pages = tokens // page
    table = torch.arange(num_pages, dtype=torch.int32)[None, :]
    dc = tb.empty_device_cache(scheme, scheme, num_pages, page, kv_heads, head_dim, table,
                               torch.tensor([tokens], dtype=torch.int32), k_params=params, v_params=params,
                               device=device, layout=layout or LAYOUT)
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, kv_heads, head_dim, device=device, generator=g).to(torch.bfloat16)
    slots = (
        torch.randperm(tokens // page, device=device, generator=g).repeat_interleave(page) * page
        + torch.arange(tokens, device=device) % page
    )
    if label.endswith("kivi"):
        slots = torch.arange(tokens, device=device)
    nbytes = x.numel() * 2 + slots.numel() * 8 + tokens * side_bytes_per_token(scheme, kv_heads, head_dim)
    record = {"op": "write", "backend": "triton", "scheme": label + ("" if side == "k" else "-v"),
              "tokens": tokens, "kv_heads": kv_heads, "head_dim": head_dim, "layout": layout or LAYOUT,
              "bytes": nbytes}
    return dc.k if side == "k" else dc.v, x, slots, record


def write_setup(label: str, tokens: int = 65536, kv_heads: int = 8, head_dim: int = 128, rotation: bool = False,
                block_t: int | None = None, rotation_route: str | None = None, layout: str | None = None,
                side: str = "k"):
    """(the write call to time, its record without times): pages in random order, bf16 input; ``rotation``:
    the side rotated (the rotation fused into the write kernel); ``block_t``: tokens per program (default: the
    kernel's); ``rotation_route``: the rotated butterflies' data movement (``plan_write``; None: the scheme's
    default); ``side``: "k" or "v" (:func:`write_inputs`)."""
    from kvqref.backends import triton_backend as tb

    side, x, slots, record = write_inputs(label, tokens, kv_heads, head_dim, side=side, rotation=rotation,
                                          layout=layout)

    kw = {} if block_t is None else {"block_t": block_t}
    if rotation_route is not None:
        kw["rotation_route"] = rotation_route

    def fn():
        tb.quantize_write(side, x, slots, validate=False, **kw)

    return fn, {**record, "rotation": rotation_label(rotation), "block_t": block_t,
            "rotation_route": rotation_route}


def emitter(env: dict[str, Any], ceiling: float, results: list[dict[str, Any]], out: Path | None):
    """``emit(row)``: the row completed with the ceiling and its fraction (rows with GB/s), appended to
    ``results``, printed as JSON, and with ``out`` the document so far written there (``"partial": true``)."""

    def emit(r: dict[str, Any]) -> None:
        if "gbs" in r:
            r["ceiling_gbs"] = ceiling
            r["fraction_of_ceiling"] = r["gbs"] / ceiling
        results.append(r)
        print(json.dumps(r), flush=True)
        if out is not None:
            doc = {"environment": env, "ceiling_gbs": ceiling, "results": results, "partial": True,
                   "command": " ".join(["python3", *sys.argv])}
            out.write_text(json.dumps(doc, indent=1) + "\n")

    return emit


def run(quick: bool = False, out: Path | None = None) -> dict[str, Any]:
    """Every benchmark row; with ``out``, the document so far is rewritten after each row (``"partial":
    true`` until the end), so a run cut short keeps what it measured."""
    env = environment()
    ceiling = bandwidth_ceiling_gbs()
    results: list[dict[str, Any]] = []
    emit = emitter(env, ceiling, results, out)

    labels = [s[0] for s in SCHEMES]
    sdpa_rounds: dict[tuple, int] = {}

    def baseline(shape) -> None:
        """SDPA over BF16 at ``shape``, once more: the run times it before and after each shape's rows (and the
        target shape once more at the end), and bench/tables.py takes the ratios against the median, because one
        timing of it varied by 2% between runs on one machine (363 / 370 us, bench/results/ANALYSIS.md, session
        16)."""
        row = sdpa_case(shape)
        row["round"] = sdpa_rounds.get(shape, 0)
        sdpa_rounds[shape] = row["round"] + 1
        emit(row)

    def shape_rows(shape) -> None:
        baseline(shape)
        for label in labels:
            emit(decode_case(label, shape, 16))
        baseline(shape)

    # the target rows first (batch 32, its exact-mode and page-1 rows, batch 1), then the other shapes
    shape_rows(SHAPES[0])
    for label in labels:  # the other field layout at the target shape
        emit(decode_case(label, SHAPES[0], 16, layout=OTHER_LAYOUT[LAYOUT]))
    for label in labels[1:]:  # the float32-exact products, for comparison
        emit(decode_case(label, SHAPES[0], 16, precision="exact"))
    if not quick:
        for label in ("bf16", "fp8_e4m3", "fp4_e2m1"):
            emit(decode_case(label, SHAPES[0], 1))
        shape_rows(SHAPES[2])
        for shape in SHAPES[1:2] + SHAPES[3:]:
            shape_rows(shape)
        baseline(RAGGED)
        for label in labels:  # (the bench's KIVI caches hold whole key groups, residual 0: not at RAGGED)
            if not label.endswith("kivi"):
                emit(decode_case(label, RAGGED, 16))
        baseline(RAGGED)
        for label in ("bf16", "fp8_e4m3"):
            emit(decode_case(label, SHAPES[0], 16, backend="torch"))
        for label in labels:
            emit(write_case(label))
            emit(write_case(label, layout=OTHER_LAYOUT[LAYOUT]))
        baseline(SHAPES[0])
    return {"environment": env, "ceiling_gbs": ceiling, "layout": LAYOUT, "results": results}


def run_rotation(out: Path | None = None, rounds: int = 2) -> dict[str, Any]:
    """Issue 13's rows (module docstring, ``--rotation``): unrotated and rotated decode and write of
    ``ROTATION_LABELS``, alternately over ``rounds`` rounds, then the ratios of the median times."""
    import torch

    env = environment()
    ceiling = bandwidth_ceiling_gbs()
    results: list[dict[str, Any]] = []
    emit = emitter(env, ceiling, results, out)

    shape = SHAPES[0]
    sdpa = sdpa_case(shape)
    emit(sdpa)
    for label in ROTATION_LABELS:
        variants = {"decode": [decode_setup(label, shape, 16, rotation=r) for r in (False, True)]}
        writes = [(False, None), (True, None)] + ([] if label.endswith("kivi") else [(True, 16)])  # KIVI keys: G
        variants["write"] = [write_setup(label, rotation=r, block_t=bt) for r, bt in writes]
        if label.endswith("kivi"):  # KIVI values are quantized otherwise than keys: their write too
            variants["write_v"] = [write_setup(label, rotation=r, side="v") for r in (False, True)]
        times: dict[tuple[str, int], list[float]] = {}
        for rnd in range(rounds):
            for op, setups in variants.items():
                for i, (fn, rec) in enumerate(setups):
                    row = timed(fn, {**rec, "round": rnd})
                    row["ratio_to_sdpa"] = row["time_us"] / sdpa["time_us"] if op == "decode" else None
                    times.setdefault((op, i), []).append(row["time_us"])
                    emit(row)
        for op, setups in variants.items():
            base = float(np.median(times[(op, 0)]))
            for i in range(1, len(setups)):
                rot = float(np.median(times[(op, i)]))
                emit({"op": "rotation_ratio", "of": "write" if op.startswith("write") else op, "scheme": label,
                      "side": "v" if op == "write_v" else "k", "block_t": setups[i][1].get("block_t"),
                      "unrotated_us": base, "rotated_us": rot, "ratio": rot / base,
                      "target": 1.05 if op == "decode" else 1.10})
        del variants
        torch.cuda.empty_cache()
    return {"environment": env, "ceiling_gbs": ceiling, "results": results}


def run_rotation_writes(out: Path | None = None, rounds: int = 5,
                        routes: tuple[str, ...] = ("split", "sums", "shfl"),
                        labels: tuple[str, ...] = ROTATION_LABELS) -> dict[str, Any]:
    """``--rotation-writes``: unrotated writes of ``ROTATION_LABELS`` (default token block) and rotated ones by each
    butterfly route of ``routes``, timed alternately over ``rounds`` rounds, then the ratios of the median times
    per scheme and route (target <= 1.10)."""
    import torch

    env = environment()
    ceiling = bandwidth_ceiling_gbs()
    results: list[dict[str, Any]] = []
    emit = emitter(env, ceiling, results, out)
    for label in labels:
        setups = [write_setup(label), *(write_setup(label, rotation=True, rotation_route=r) for r in routes)]
        times: list[list[float]] = [[] for _ in setups]
        for rnd in range(rounds):
            for i, (fn, rec) in enumerate(setups):
                row = timed(fn, {**rec, "round": rnd})
                times[i].append(row["time_us"])
                emit(row)
        base, *rots = (float(np.median(t)) for t in times)
        for (_, rec), rot in zip(setups[1:], rots, strict=True):
            emit({"op": "rotation_ratio", "of": "write", "scheme": label, "block_t": None, "rounds": rounds,
                  "rotation_route": rec["rotation_route"], "unrotated_us": base, "rotated_us": rot,
                  "ratio": rot / base, "target": 1.10})
        del setups
        torch.cuda.empty_cache()
    return {"environment": env, "ceiling_gbs": ceiling, "results": results}


def main() -> int:
    global LAYOUT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layout", choices=sorted(OTHER_LAYOUT), default=LAYOUT,
                    help=f"the triton rows' device-cache field layout (default {LAYOUT})")
    ap.add_argument("--rotation", action="store_true", help="issue 13's rotated vs unrotated rows only")
    ap.add_argument("--rotation-writes", action="store_true",
                    help="issue 13's unrotated vs rotated write rows only, alternating over --rounds rounds")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of --rotation-writes (default 5)")
    ap.add_argument("--rotation-routes", default="split,sums,shfl",
                    help="butterfly routes of --rotation-writes (plan_write's rotation_route; default split,sums,shfl)")
    ap.add_argument("--rotation-schemes", default=",".join(ROTATION_LABELS),
                    help=f"schemes of --rotation-writes (default {','.join(ROTATION_LABELS)})")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    LAYOUT = args.layout
    if args.rotation_writes:
        doc = run_rotation_writes(args.out, args.rounds, tuple(args.rotation_routes.split(",")),
                                  tuple(args.rotation_schemes.split(",")))
    else:
        doc = run_rotation(args.out) if args.rotation else run(args.quick, args.out)
    doc["command"] = " ".join(["python3", *sys.argv])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
