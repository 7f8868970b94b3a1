"""Turn a ``decode_bench.py`` JSON file into the markdown table the README quotes (and a plot when
matplotlib is installed).

    python3 bench/tables.py bench/results/h100.json > bench/results/h100.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def eager(row: dict) -> str:
    """The row's eager time (us), ``eager`` where the row itself was timed eager, blank in older results."""
    if row.get("timing") == "eager":
        return "eager"
    return f"{row['eager_time_us']:.1f}" if "eager_time_us" in row else ""


def sdpa_times(rows: list[dict]) -> dict[tuple[int, int, int], list[float]]:
    """Every SDPA-over-BF16 time (us) of the run, by (batch, q_heads, tokens), in run order."""
    times: dict[tuple[int, int, int], list[float]] = {}
    for r in rows:
        if r["op"] == "decode" and r["backend"] == "torch-sdpa-dense":
            times.setdefault((r["batch"], r["q_heads"], r["tokens"]), []).append(r["time_us"])
    return times


def sdpa_baselines(rows: list[dict]) -> dict[tuple[int, int, int], float]:
    """The baseline of each shape: the median of its SDPA times; of an even count, the lower of the two middle
    ones (the faster baseline, so the stricter ratio)."""
    return {k: sorted(v)[(len(v) - 1) // 2] for k, v in sdpa_times(rows).items()}


def markdown(doc: dict) -> str:
    env = doc["environment"]
    rows = doc["results"]
    lines = [
        f"Device: {env.get('device')} (driver {env.get('driver', '?')}), torch {env['torch']}, "
        f"triton {env['triton']}. Bandwidth ceiling measured in the same run (bf16 reduction over 4 GiB): "
        f"{doc['ceiling_gbs']:.0f} GB/s. Command: `{doc.get('command', '?')}`.",
        "",
        "### Decode attention (page size 16; KIVI pages of 32), median of CUDA-event timings",
        "",
        "time: the call replayed from a CUDA graph (as serving engines run decode; `eager`: rows timed as "
        "Python calls); eager: the same call made from Python, host launch overhead included.",
        "",
        "layout: the device cache's fields, `HND` head-major pages, `NHD` token-major (blank: dense, or older "
        "results, which were NHD).",
        "",
        "| batch x q_heads x kv_heads x D x tokens | scheme | backend | precision | layout | time (us) | eager (us) "
        "| GB/s | of ceiling | speed-up vs SDPA bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = sdpa_baselines(rows)
    spread = {k: v for k, v in sdpa_times(rows).items() if len(v) > 1}
    if spread:
        lines[1:1] = [
            "",
            "SDPA over BF16 (the baseline) is timed more than once per shape (before and after the shape's rows); "
            "each speed-up is against the median of its shape's SDPA times (of an even count the lower middle one; "
            "min / median / max, us: "
            + "; ".join(f"{k[0]}x{k[1]}x{k[2]}: {min(v):.1f} / {base[k]:.1f} / {max(v):.1f}"
                        for k, v in spread.items()) + ").",
        ]
    for r in rows:
        if r["op"] != "decode":
            continue
        shape = f"{r['batch']}x{r['q_heads']}x{r['kv_heads']}x{r['head_dim']}x{r['tokens']}"
        if r["page_size"] == 1:
            shape += " (page 1)"
        b = base.get((r["batch"], r["q_heads"], r["tokens"]))
        sp = f"{b / r['time_us']:.2f}x" if b else ""
        lines.append(
            f"| {shape} | {r['scheme']} | {r['backend']} | {r.get('precision', '')} | {r.get('layout') or ''} | "
            f"{r['time_us']:.1f} | "
            f"{eager(r)} | {r['gbs']:.0f} | "
            f"{r['fraction_of_ceiling']:.0%} | {sp} |"
        )
    writes = [r for r in rows if r["op"] == "write"]
    if writes:
        lines += [
            "",
            "### Quantize-on-write (65,536 tokens x 8 heads x 128, bf16 in; bytes = read + written)",
            "",
            "| scheme | layout | time (us) | eager (us) | GB/s | of ceiling |",
            "|---|---|---|---|---|---|",
        ]
        for r in writes:
            lines.append(f"| {r['scheme']} | {r.get('layout') or ''} | {r['time_us']:.1f} | {eager(r)} | "
                         f"{r['gbs']:.0f} | "
                         f"{r['fraction_of_ceiling']:.0%} |")
    return "\n".join(lines) + "\n"


def plotted_rows(doc: dict) -> tuple[dict[str, list[tuple[int, float]]], dict[str, dict[tuple[int, int, int], float]]]:
    """The rows :func:`plot` draws: fast decode rows in the run's main layout at page size 16 (or dense), as
    ``{backend:scheme: [(batch x tokens, GB/s)]}`` and ``{backend:scheme: {(batch, q_heads, tokens): SDPA baseline
    time / time}}`` (the speed-up of each row over its shape's baseline, :func:`sdpa_baselines`; none for SDPA)."""
    rows = doc["results"]
    base = sdpa_baselines(rows)
    by: dict[str, list[tuple[int, float]]] = {}
    ratio: dict[str, dict[tuple[int, int, int], float]] = {}
    for r in rows:
        main_layout = r.get("backend") != "triton" or r.get("layout") in (None, doc.get("layout", r.get("layout")))
        if r["op"] == "decode" and r["page_size"] in (0, 16) and r.get("precision", "fast") != "exact" and main_layout:
            label = f"{r['backend']}:{r['scheme']}"
            by.setdefault(label, []).append((r["batch"] * r["tokens"], r["gbs"]))
            key = (r["batch"], r["q_heads"], r["tokens"])
            if key in base and r["backend"] != "torch-sdpa-dense":
                ratio.setdefault(label, {})[key] = base[key] / r["time_us"]
    return by, ratio


def plot(doc: dict, out: Path) -> bool:
    """Two panels of the fast decode rows in the run's main layout (page size 16 or dense): achieved GB/s against
    batch x tokens, and each scheme's speed-up over SDPA on BF16 per shape (1.0: the baseline; every series its own
    colour and marker). False where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    by, ratio = plotted_rows(doc)
    shapes = sorted({k for v in ratio.values() for k in v}, key=lambda k: (k[1], k[0] * k[2], k[0]))
    colors = plt.get_cmap("tab20").colors
    markers = "os^vD<>ph*X"
    style = {label: dict(color=colors[i % len(colors)], marker=markers[i % len(markers)])
             for i, label in enumerate(sorted(by))}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8))
    for label, pts in sorted(by.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **style[label])
    ax.axhline(doc["ceiling_gbs"], color="k", ls="--", label="measured ceiling")
    ax.set_xscale("log")
    ax.set_xlabel("batch x tokens")
    ax.set_ylabel("achieved GB/s (cache bytes / time)")
    ax.set_title("bandwidth", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    for label, per in sorted(ratio.items()):
        xs = [i for i, k in enumerate(shapes) if k in per]
        bx.plot(xs, [per[shapes[i]] for i in xs], label=label, **style[label])
    bx.axhline(1.0, color="k", ls="--", label="SDPA over BF16")
    bx.set_xticks(range(len(shapes)), [f"{b} x {t:,}\n{h} q heads" for b, h, t in shapes], fontsize=7)
    bx.set_ylabel("speed-up vs SDPA over BF16 (same run)")
    bx.set_title("speed-up per shape (batch x tokens)", fontsize=9)
    bx.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return True


def main() -> int:
    path = Path(sys.argv[1])
    doc = json.loads(path.read_text())
    sys.stdout.write(markdown(doc))
    if plot(doc, path.with_suffix(".png")):
        print(f"\n![achieved bandwidth]({path.with_suffix('.png').name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
