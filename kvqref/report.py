"""``kvqref report`` and ``kvqref claims``: the formats, the accuracy study, conformance and (on a GPU) speed,
printed and written to a folder as markdown, CSV, JSON, LaTeX (booktabs) and, with matplotlib, PNG plots.

Every number is computed by the run that prints it; nothing is copied from elsewhere. Sections:

1. formats and schemes: bits per element with scale overhead, token capacity relative to BF16 and FP8
   (:mod:`kvqref.capacity`), dynamic range of each element format;
2. accuracy (:mod:`kvqref.study`) on synthetic caches with KIVI's structure and, when the optional MiniLM-L6
   weights are installed, on a real (encoder) model's K/V (:mod:`kvqref.minilm`);
3. conformance of every available backend (:mod:`kvqref.conformance`);
4. speed: only where torch sees a GPU, through ``bench/decode_bench.py`` (a short run).

The claims table (:func:`claims`) checks the statements of the source documents listed in papers/README.md.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from kvqref import __version__, capacity, formats, schemes, study

ROOT = Path(__file__).resolve().parents[1]
CAPACITY_SHAPE = {"memory": "80GiB", "layers": 32, "kv_heads": 8, "head_dim": 128}
#: (label, K scheme, V scheme) of the capacity table; KIVI's K/V roles are set by kvqref.capacity
CAPACITY_SCHEMES = ("bf16", "fp8_e4m3", "fp8_e5m2", ("fp8_e4m3", {"granularity": "token_head"}), "fp4_e2m1",
                    "mxfp4", "nvfp4", "int4_kivi", "int2_kivi")
NO_GPU_SPEED = "no GPU: speed section skipped (see bench/results for H100 numbers)"
NO_MPL = "install matplotlib for plots (pip install matplotlib, or pip install -e \".[report]\")"


# -- progress ------------------------------------------------------------------------------------------
class Progress:
    """A tiny progress printer: ``[#####-----] 5/10 label: item`` (one line, redrawn on a terminal; a line per
    step elsewhere, so CI logs stay readable)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, width: int = 24) -> None:
        self.total, self.label, self.width, self.done = max(total, 1), label, width, 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()

    def __call__(self, item: str = "") -> None:
        self.done += 1
        filled = int(self.width * min(self.done, self.total) / self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        text = f"[{bar}] {self.done}/{self.total} {self.label}: {item}"
        if self.tty:
            end = "\n" if self.done >= self.total else ""
            self.stream.write("\r" + text[:150].ljust(150) + end)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


# -- tables --------------------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (float, np.floating)):
        v = float(v)
        if math.isnan(v):
            return "n/a"
        if v.is_integer() and 1 <= abs(v) < 1e12:
            return f"{int(v):,}" if abs(v) >= 10000 else str(int(v))
        if 1e4 <= abs(v) < 1e12:
            return f"{v:,.1f}"
        if v == 0 or (1e-3 <= abs(v) < 1e4):
            return f"{v:.4g}"
        return f"{v:.3e}"
    if isinstance(v, (int, np.integer)):
        return f"{int(v):,}" if abs(int(v)) >= 10000 else str(int(v))
    return str(v)


def markdown(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")).replace("|", "\\|") for c in columns) + " |")
    return "\n".join(lines)


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "<": r"\textless{}",
        ">": r"\textgreater{}", "|": r"\textbar{}"}


def tex_escape(s: str) -> str:
    return "".join(_TEX.get(c, c) for c in s)


def latex(rows: Sequence[dict[str, Any]], columns: Sequence[str], caption: str = "", label: str = "") -> str:
    """A booktabs table (``\\usepackage{booktabs}``): numbers right-aligned, text left-aligned."""
    numeric = [all(isinstance(r.get(c), (int, float, np.integer, np.floating)) and not isinstance(r.get(c), bool)
                   for r in rows) for c in columns]
    long = [not n and max([len(c), *(len(_fmt(r.get(c, ""))) for r in rows)]) > 40
            for c, n in zip(columns, numeric, strict=True)]
    width = 0.85 / max(1, sum(long))  # long text columns wrap, sharing 85% of the line
    spec = "".join("r" if n else (f"p{{{width:.2f}\\linewidth}}" if lg else "l")
                   for n, lg in zip(numeric, long, strict=True))
    out = ["\\begin{table}[t]", "\\centering", f"\\begin{{tabular}}{{{spec}}}", "\\toprule",
           " & ".join(tex_escape(c) for c in columns) + " \\\\", "\\midrule"]
    for r in rows:
        out.append(" & ".join(tex_escape(_fmt(r.get(c, ""))) for c in columns) + " \\\\")
    out += ["\\bottomrule", "\\end{tabular}"]
    if caption:
        out.append(f"\\caption{{{tex_escape(caption)}}}")
    if label:
        out.append(f"\\label{{tab:{label}}}")
    out.append("\\end{table}")
    return "\n".join(out) + "\n"


def _jsonable(v: Any) -> Any:
    if isinstance(v, (np.floating, float)):
        return None if math.isnan(float(v)) else float(v)
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, np.bool_):
        return bool(v)
    return v


def write_table(out: Path, name: str, rows: Sequence[dict[str, Any]], columns: Sequence[str],
                caption: str = "") -> str:
    """Write ``name``.csv, .json and .tex into ``out``; return the markdown table."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: _jsonable(r.get(c, "")) for c in columns})
    (out / f"{name}.json").write_text(json.dumps([{k: _jsonable(v) for k, v in r.items()} for r in rows],
                                                 indent=1) + "\n")
    (out / f"{name}.tex").write_text(latex(rows, columns, caption, name))
    return markdown(rows, columns)


# -- section 1: formats and schemes --------------------------------------------------------------------
def formats_rows() -> list[dict[str, Any]]:
    rows = []
    for name in formats.names():
        c = formats.get(name)
        smallest = c.min_subnormal if c.spec.subnormals else c.min_normal
        rows.append({"format": name, "bits": c.bits, "E": c.spec.ebits, "M": c.spec.mbits, "bias": c.bias,
                     "max finite": float(c.max_finite), "min normal": float(c.min_normal),
                     "min subnormal": float(c.min_subnormal) if c.spec.subnormals else math.nan,
                     "range (binades)": math.log2(float(c.max_finite) / float(smallest))})
    return rows


def _cap_scheme(entry) -> tuple[str, Any]:
    if isinstance(entry, tuple):
        name, opts = entry
        return f"{name} ({', '.join(f'{k}={v}' for k, v in opts.items())})", schemes.get(name, **opts)
    return entry, entry


def capacity_rows(memory: str | int = "80GiB", layers: int = 32, kv_heads: int = 8, head_dim: int = 128,
                  names: Sequence[Any] = CAPACITY_SCHEMES, num_seqs: int = 1) -> list[dict[str, Any]]:
    """Per scheme: bits/element (elements only, and with scales), bytes per token (all layers, K+V), tokens
    that fit (:func:`kvqref.capacity.plan`) and capacity relative to BF16 and FP8 (E4M3, per-tensor)."""
    plans = {}
    for entry in ("bf16", "fp8_e4m3", *names):
        label, s = _cap_scheme(entry)
        plans[label] = (plan_of(s, memory, layers, kv_heads, head_dim, num_seqs), s)
    base_bf16, base_fp8 = plans["bf16"][0], plans["fp8_e4m3"][0]
    rows = []
    for entry in names:
        label, _ = _cap_scheme(entry)
        p, s = plans[label]
        elem = _element_bits(s)
        rows.append({"scheme": label, "element bits": elem, "bits/elem with scales": p["bits_per_element"],
                     "scale overhead bits": p["bits_per_element"] - elem,
                     "bytes/token (all layers, K+V)": p["bytes_per_token"], "tokens": p["tokens"],
                     "x BF16 (bits)": 16 / p["bits_per_element"], "x FP8 (bits)": 8 / p["bits_per_element"],
                     "x BF16 (tokens)": p["tokens"] / base_bf16["tokens"],
                     "x FP8 (tokens)": p["tokens"] / base_fp8["tokens"]})
    return rows


def plan_of(s: Any, memory, layers, kv_heads, head_dim, num_seqs=1) -> dict[str, Any]:
    return capacity.plan(memory, layers, kv_heads, head_dim, s, None, num_seqs=num_seqs)


def _element_bits(s: Any) -> float:
    """Bits of the element code alone (no scale): the width of the element format."""
    sch = capacity._scheme(s, "value") if isinstance(s, str) else s
    name = sch.name
    if name == "bf16":
        return 16.0
    if name.startswith("fp8"):
        return 8.0
    if name in ("fp4_e2m1", "mxfp4", "nvfp4"):
        return 4.0
    return float(sch.bits)


def sglang_fp4_claim(head_dim: int = 128) -> dict[str, Any]:
    """SGLang's "~3.56x BF16, ~1.78x FP8" for FP4 block 16, recomputed from the scheme's layout."""
    s = schemes.get("fp4_e2m1")
    with_scale = s.bits_per_element(head_dim)
    elem = _element_bits(s)
    bf16, fp8 = schemes.get("bf16").bits_per_element(head_dim), schemes.get("fp8_e4m3").bits_per_element(head_dim)
    p = {n: plan_of(n, **{k: CAPACITY_SHAPE[k] for k in ("memory", "layers", "kv_heads")}, head_dim=head_dim)
         for n in ("bf16", "fp8_e4m3", "fp4_e2m1")}
    return {"bits with E8M0 scale": with_scale, "element bits": elem,
            "vs BF16 with scale": bf16 / with_scale, "vs FP8 with scale": fp8 / with_scale,
            "vs BF16 elements only": bf16 / elem, "vs FP8 elements only": fp8 / elem,
            "vs BF16 tokens (capacity plan)": p["fp4_e2m1"]["tokens"] / p["bf16"]["tokens"],
            "vs FP8 tokens (capacity plan)": p["fp4_e2m1"]["tokens"] / p["fp8_e4m3"]["tokens"]}


def e4m3_range() -> dict[str, float]:
    return {"float8_e4m3fn": float(formats.get("float8_e4m3fn").max_finite),
            "float8_e4m3fnuz": float(formats.get("float8_e4m3fnuz").max_finite)}


# -- section 2: accuracy -----------------------------------------------------------------------------
ACC_COLUMNS = ("config", "bits", "k_rel_rms", "v_rel_rms", "attn_rel_err", "top8_agree", "engine")
KIVI_COLUMNS = ("data", "bits", "k_rel_rms per-channel", "k_rel_rms per-token", "k_rel_rms ratio",
                "attn_rel_err per-channel", "attn_rel_err per-token", "attn_rel_err ratio",
                "top8_agree per-channel", "top8_agree per-token", "per-channel better")


def synthetic_caches(quick: bool) -> list[study.Cache]:
    if quick:
        return [study.kivi_synthetic(256, 4, 128, 16, 4, seed=0)]
    return [study.kivi_synthetic(1024, 8, 128, 32, 8, seed=s) for s in range(4)]


def synthetic_description(quick: bool) -> str:
    n, T, H, Hq, nq = (1, 256, 4, 16, 4) if quick else (4, 1024, 8, 32, 8)
    return (f"{n} cache(s) of {T} tokens, {H} KV heads of 128 (queries: {nq} decode steps x {Hq} heads); keys: 4 "
            "channels per head of magnitude U(10, 100), nearly constant over tokens, RoPE applied; values: "
            "standard normal")


def accuracy(quick: bool, progress_stream: TextIO | None = None) -> dict[str, Any]:
    """The accuracy study: synthetic rows, MiniLM rows (or the reason they are missing), the KIVI finding."""
    from kvqref import minilm

    configs = study.configs_named(study.QUICK_CONFIGS) if quick else list(study.CONFIGS)
    res: dict[str, Any] = {"synthetic_description": synthetic_description(quick)}
    caches = synthetic_caches(quick)
    res["synthetic"] = study.run(caches, configs, progress=Progress(len(configs), "accuracy, synthetic",
                                                                       progress_stream))
    why = minilm.unavailable_reason()
    res["minilm_reason"] = why
    res["minilm"] = None
    if why is None:
        try:
            mcaches = minilm.caches(1, 128, layers=[0, 5], queries=16) if quick else minilm.caches(2, 256)
        except Exception as e:  # a broken install: say so, keep the rest of the report
            res["minilm_reason"] = f"MiniLM-L6 could not be run: {type(e).__name__}: {e}"
        else:
            res["minilm_description"] = (f"MiniLM-L6 (all-MiniLM-L6-v2, an ENCODER: bidirectional, no RoPE), "
                                         f"{len(mcaches)} (layer, text chunk) caches of {mcaches[0].k.shape[0]} "
                                         f"tokens, 12 heads of 32, {mcaches[0].q.shape[0]} queries each")
            res["minilm"] = study.run(mcaches, configs, progress=Progress(len(configs), "accuracy, MiniLM-L6",
                                                                          progress_stream))
    kivi = [{"data": "synthetic", **r} for r in study.kivi_finding(res["synthetic"])]
    if res["minilm"]:
        kivi += [{"data": "MiniLM-L6", **r} for r in study.kivi_finding(res["minilm"])]
    res["kivi"] = kivi
    return res


def e4m3_vs_e5m2(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    by = {r["config"]: r for r in rows}
    a, b = by["fp8_e4m3"], by["fp8_e5m2"]
    metrics = {m: (a[m], b[m]) for m in ("k_rel_rms", "v_rel_rms", "attn_rel_err")}
    return {"metrics": metrics, "holds": all(x < y for x, y in metrics.values()),
            "text": "; ".join(f"{m} {x:.3g} vs {y:.3g}" for m, (x, y) in metrics.items())}


# -- section 3: conformance -----------------------------------------------------------------------------
def conformance(names: Sequence[str], stream: TextIO | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """Results of :func:`kvqref.conformance.check` for each available backend in ``names``; and a line per
    unavailable backend saying why."""
    from kvqref import backends
    from kvqref import conformance as conf

    rows: list[dict[str, Any]] = []
    skipped = []
    av = backends.available()
    for n in names:
        if av.get(n):
            skipped.append(f"{n}: skipped: {av[n]}")
            continue
        res = conf.check(n, progress=Progress(conf.expected_count(n), f"conformance {n}", stream))
        rows += [r.as_dict() for r in res]
    return rows, skipped


# -- section 4: speed -------------------------------------------------------------------------------------
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
    key = ("scheme", "batch", "q_heads", "kv_heads", "head_dim", "tokens", "page_size")
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


# -- claims --------------------------------------------------------------------------------------------------
CLAIM_COLUMNS = ("claim", "source", "kvqref measures", "holds", "command")


def claims(acc: dict[str, Any], speed_rows: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The claims table: each source statement, what kvqref computes for it, and whether it holds."""
    fp4 = sglang_fp4_claim()
    rng = e4m3_range()
    rows = []
    for base, claim in (("BF16", 3.56), ("FP8", 1.78)):
        bits = fp4[f"vs {base} with scale"]
        rows.append({"claim": f"FP4 (block 16) holds ~{claim}x the tokens of {base}",
                     "source": "SGLang docs, quantized_kv_cache.md",
                     "kvqref measures": f"{bits:.4f}x with the E8M0 scale counted (4.5 bits); "
                                        f"{fp4[f'vs {base} elements only']:.2f}x without it; "
                                        f"{fp4[f'vs {base} tokens (capacity plan)']:.4f}x tokens in 80 GiB "
                                        "(32 layers, 8 KV heads, head_dim 128)",
                     "holds": abs(round(bits, 2) - claim) < 1e-9,
                     "command": "kvqref capacity --memory 80GiB --layers 32 --kv-heads 8 --head-dim 128"})
    rows.append({"claim": "E4M3 range is +-240", "source": "SGLang docs (and vLLM v0.6.6/v0.11.2 docs)",
                 "kvqref measures": f"E4M3FN (OCP, CUDA) max {rng['float8_e4m3fn']:g}; E4M3FNUZ (ROCm MI300) max "
                                    f"{rng['float8_e4m3fnuz']:g}",
                 "holds": "yes" if rng["float8_e4m3fn"] == 240 else
                 f"no: {rng['float8_e4m3fnuz']:g} is E4M3FNUZ's max, not E4M3FN's",
                 "command": "kvqref formats"})
    for r in acc["kivi"]:
        rows.append({"claim": f"per-channel keys beat per-token at {r['bits']} bits ({r['data']})",
                     "source": "KIVI (Liu et al., 2024)",
                     "kvqref measures": f"K rel. RMS {r['k_rel_rms per-channel']:.3g} vs {r['k_rel_rms per-token']:.3g}"
                                        f" ({r['k_rel_rms ratio']:.2f}x); attention error "
                                        f"{r['attn_rel_err per-channel']:.3g} vs {r['attn_rel_err per-token']:.3g} "
                                        f"({r['attn_rel_err ratio']:.2f}x)",
                     "holds": r["per-channel better"], "command": "kvqref claims"})
    for data, rows_ in (("synthetic", acc["synthetic"]), ("MiniLM-L6", acc.get("minilm"))):
        if not rows_:
            continue
        c = e4m3_vs_e5m2(rows_)
        rows.append({"claim": f"E4M3 is more accurate than E5M2 ({data})", "source": "SGLang and vLLM docs",
                     "kvqref measures": "E4M3 vs E5M2: " + c["text"],
                     "holds": c["holds"], "command": "kvqref claims"})
    gap = fused_gap(speed_rows or [])
    src = "this run (GPU)"
    if not gap:
        for p, doc in bench_results():
            gap = fused_gap(doc.get("results", []))
            if gap:
                src = str(p.relative_to(ROOT))
                break
    if gap:
        text = "; ".join(f"{g['scheme']} B={g['batch']} T={g['tokens']}: {g['unfused / fused']:.2f}x" for g in gap)
        rows.append({"claim": "fused decode is faster than dequantize-then-attend", "source": "SGLang docs",
                     "kvqref measures": f"unfused/fused time ({src}): {text}",
                     "holds": all(g["unfused / fused"] > 1 for g in gap),
                     "command": "python3 bench/decode_bench.py --out bench/results/NAME.json (GPU)"})
    else:
        rows.append({"claim": "fused decode is faster than dequantize-then-attend", "source": "SGLang docs",
                     "kvqref measures": "not measured here: needs a GPU run of bench/decode_bench.py "
                                        "(bench/results/, README)",
                     "holds": "not measured",
                     "command": "python3 bench/decode_bench.py --out bench/results/NAME.json (GPU)"})
    return rows


# -- plots -----------------------------------------------------------------------------------------------------
def plots(out: Path, acc: dict[str, Any]) -> list[str]:
    """PNG plots if matplotlib is importable; returns the file names written (empty without matplotlib)."""
    if importlib.util.find_spec("matplotlib") is None:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for data, rows in (("synthetic", acc["synthetic"]), ("minilm", acc.get("minilm"))):
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in rows:
            ax.scatter(r["bits"], r["attn_rel_err"], s=18)
            ax.annotate(r["config"], (r["bits"], r["attn_rel_err"]), fontsize=6, xytext=(3, 2),
                        textcoords="offset points")
        ax.set_xlabel("bits per element (K and V mean, scales included)")
        ax.set_ylabel("attention output relative error")
        ax.set_yscale("log")
        ax.set_title(f"Accuracy vs size ({data})")
        fig.tight_layout()
        name = f"accuracy_{data}.png"
        fig.savefig(out / name, dpi=130)
        plt.close(fig)
        written.append(name)
    if acc["kivi"]:
        fig, ax = plt.subplots(figsize=(7, 4))
        labels = [f"{r['data']}\n{r['bits']} bits" for r in acc["kivi"]]
        x = np.arange(len(labels))
        ax.bar(x - 0.2, [r["attn_rel_err per-channel"] for r in acc["kivi"]], 0.4, label="keys per channel (KIVI)")
        ax.bar(x + 0.2, [r["attn_rel_err per-token"] for r in acc["kivi"]], 0.4, label="keys per token")
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylabel("attention output relative error")
        ax.set_title("KIVI: per-channel vs per-token key quantization")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "kivi_keys.png", dpi=130)
        plt.close(fig)
        written.append("kivi_keys.png")
    return written


# -- the report ----------------------------------------------------------------------------------------------
def run(out: Path, quick: bool = False, backends_: Sequence[str] | None = None, want_speed: bool | None = None,
        echo: Callable[[str], None] = print, progress_stream: TextIO | None = None) -> dict[str, Any]:
    """Compute every section, print it through ``echo`` and write the files into ``out``."""
    from kvqref import backends

    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md: list[str] = [f"# kvqref report{' (quick)' if quick else ''}", "",
                     f"kvqref {__version__}, Python {platform.python_version()}, numpy {np.__version__}, "
                     f"{platform.machine()} {platform.system()}.", ""]

    def section(title: str, body: str) -> None:
        md.extend([f"## {title}", "", body, ""])
        echo(f"\n== {title} ==\n{body}")

    # 1
    f_md = write_table(out, "formats", formats_rows(), ("format", "bits", "E", "M", "bias", "max finite",
                                                        "min normal", "min subnormal", "range (binades)"),
                       "Element formats: range; range in binades = log2(max finite / smallest positive)")
    cap = capacity_rows(**CAPACITY_SHAPE)
    c_md = write_table(out, "capacity", cap, ("scheme", "element bits", "bits/elem with scales",
                                              "scale overhead bits", "bytes/token (all layers, K+V)", "tokens",
                                              "x BF16 (bits)", "x FP8 (bits)", "x BF16 (tokens)", "x FP8 (tokens)"),
                       "Token capacity in 80 GiB, 32 layers, 8 KV heads, head_dim 128")
    fp4 = sglang_fp4_claim()
    holds = round(fp4["vs BF16 with scale"], 2) == 3.56 and round(fp4["vs FP8 with scale"], 2) == 1.78
    rng = e4m3_range()
    section("1. Formats and schemes", "\n".join([
        f_md, "", f"Capacity, {CAPACITY_SHAPE['memory']}, {CAPACITY_SHAPE['layers']} layers, "
        f"{CAPACITY_SHAPE['kv_heads']} KV heads, head_dim {CAPACITY_SHAPE['head_dim']} (K and V, every field "
        "counted; KIVI: one sequence's residual window reserved; FP8 'x' columns are against fp8_e4m3 per-tensor):",
        "", c_md, "",
        f"SGLang's claim for block-16 FP4 (3.56x BF16, 1.78x FP8): with the E8M0 scale counted "
        f"({fp4['bits with E8M0 scale']:g} bits/element) the ratios are {fp4['vs BF16 with scale']:.4f}x and "
        f"{fp4['vs FP8 with scale']:.4f}x, which round to "
        f"{fp4['vs BF16 with scale']:.2f}x and {fp4['vs FP8 with scale']:.2f}x: "
        f"{'the claims hold' if holds else 'the claims do NOT hold'}"
        f" (elements only, without the scale, they would be {fp4['vs BF16 elements only']:.2f}x and "
        f"{fp4['vs FP8 elements only']:.2f}x). In whole pages of the capacity plan: "
        f"{fp4['vs BF16 tokens (capacity plan)']:.4f}x and {fp4['vs FP8 tokens (capacity plan)']:.4f}x.",
        "",
        f"E4M3's range: E4M3FN (OCP; CUDA; torch.float8_e4m3fn) max {rng['float8_e4m3fn']:g}; E4M3FNUZ (AMD "
        f"MI300) max {rng['float8_e4m3fnuz']:g}. SGLang's docs page gives +-240 for E4M3, which is the FNUZ "
        "figure (docs/engines.md)."]))

    # 2
    acc = accuracy(quick, progress_stream)
    s_md = write_table(out, "accuracy_synthetic", acc["synthetic"], ACC_COLUMNS,
                       "Accuracy on synthetic KIVI-structured caches")
    body = ["Metrics: relative RMS error of K and V; relative error (2-norm) of the attention output of the "
            "float64 oracle on the dequantized cache against the float64 oracle on the unquantized one; mean "
            "fraction of the 8 highest-weight tokens kept (top8_agree). Every token is quantized (no KIVI "
            "residual window). bits: K and V mean, scales included.", "",
            f"(a) Synthetic: {acc['synthetic_description']}.", "", s_md, ""]
    if acc["minilm"]:
        m_md = write_table(out, "accuracy_minilm", acc["minilm"], ACC_COLUMNS,
                           "Accuracy on MiniLM-L6 (encoder) K/V activations")
        body += [f"(b) Real activations: {acc['minilm_description']}. MiniLM-L6 is an encoder, not a decoder "
                 "LLM: these are trained K/V statistics, not a serving cache.", "", m_md, ""]
    else:
        body += [f"(b) Real activations: skipped: {acc['minilm_reason']}.", ""]
    k_md = write_table(out, "kivi_keys", acc["kivi"], KIVI_COLUMNS,
                       "KIVI: keys quantized per channel vs per token (ratio = per-token / per-channel)")
    body += ["KIVI's finding (keys per channel vs per token, same format and group size 32; 'per token' is the "
             "value-role grouping applied to keys; ratio = per-token error / per-channel error):", "", k_md, ""]
    for data, rows_ in (("synthetic", acc["synthetic"]), ("MiniLM-L6", acc["minilm"])):
        if rows_:
            c = e4m3_vs_e5m2(rows_)
            body.append(f"E4M3 vs E5M2 ({data}, per-tensor scales): {c['text']}: E4M3 "
                        f"{'is' if c['holds'] else 'is NOT'} more accurate on every metric.")
    section("2. Accuracy", "\n".join(body))

    # 3
    names = list(backends_) if backends_ else backends.names()
    conf_rows, skipped = conformance(names, progress_stream)
    from kvqref import conformance as conf

    summ = conf.summary([conf.Result(**r) for r in conf_rows])
    summary_rows = [{"backend": b, **v} for b, v in summ.items()]
    write_table(out, "conformance", conf_rows, ("backend", "check", "case", "passed", "detail"),
                "Conformance against the oracle")
    cs_md = write_table(out, "conformance_summary", summary_rows, ("backend", "passed", "failed"),
                        "Conformance: pass/fail counts")
    failed = [r for r in conf_rows if not r["passed"]]
    body = [cs_md, *([""] + skipped if skipped else [])]
    if failed:
        body += ["", "Failures:", "", markdown(failed, ("backend", "check", "case", "detail"))]
    body += ["", "Every case: conformance.csv / conformance.json (quick sample; `kvqref check --backend NAME`)."]
    section("3. Conformance", "\n".join(body))

    # 4
    speed_rows, note = (None, NO_GPU_SPEED)
    if want_speed is not False:
        speed_rows, note = speed(progress_stream)
    if speed_rows:
        cols = ("op", "backend", "scheme", "batch", "q_heads", "kv_heads", "head_dim", "tokens", "time_us", "gbs",
                "fraction_of_ceiling")
        section("4. Speed", note + "\n\n" + write_table(out, "speed", speed_rows, cols, "Decode and write speed"))
    else:
        section("4. Speed", note)

    # claims and plots
    cl = claims(acc, speed_rows)
    section("Claims checked", write_table(out, "claims", cl, CLAIM_COLUMNS, "Claims kvqref reproduces or checks"))
    pngs = plots(out, acc)
    md.extend(["## Plots", ""] + ([f"![{p}]({p})" for p in pngs] if pngs else [NO_MPL]) + [""])
    echo("\nplots: " + (", ".join(pngs) if pngs else NO_MPL))
    elapsed = time.perf_counter() - t0
    md.append(f"Generated by `kvqref report{' --quick' if quick else ''}` in {elapsed:.1f} s.")
    (out / "report.md").write_text("\n".join(md) + "\n")
    summary = {"quick": quick, "seconds": elapsed, "capacity": cap, "sglang_fp4": fp4, "e4m3_range": rng,
               "accuracy": acc, "conformance": conf_rows, "conformance_summary": summ,
               "speed": speed_rows, "speed_note": note, "claims": cl, "plots": pngs}
    (out / "report.json").write_text(json.dumps(summary, indent=1, default=_jsonable) + "\n")
    echo(f"\nwrote {out}/report.md (+ CSV, JSON, LaTeX{', PNG' if pngs else ''}) in {elapsed:.1f} s")
    return summary


def run_claims(out: Path, quick: bool = False, echo: Callable[[str], None] = print,
               progress_stream: TextIO | None = None) -> list[dict[str, Any]]:
    """Only what the claims table needs; writes claims.md / .csv / .json / .tex into ``out``."""
    out = Path(out)
    acc = accuracy(quick, progress_stream)
    cl = claims(acc)
    table = write_table(out, "claims", cl, CLAIM_COLUMNS, "Claims kvqref reproduces or checks")
    text = (f"# Claims checked by kvqref{' (quick sample)' if quick else ''}\n\nRegenerate: "
            f"`kvqref claims --out {out}{' --quick' if quick else ''}`. Synthetic data: "
            f"{acc['synthetic_description']}. Real activations: "
            f"{acc.get('minilm_description') or 'skipped: ' + str(acc['minilm_reason'])}.\n\n{table}\n")
    (out / "claims.md").write_text(text)
    echo(table)
    echo(f"\nwrote {out}/claims.md, claims.csv, claims.json, claims.tex")
    return cl
