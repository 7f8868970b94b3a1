"""The report's writers: markdown tables, booktabs LaTeX, and :func:`write_table` (CSV + JSON + LaTeX)."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def _fmt(v: Any) -> str:
    if v is None:  # NaN after a JSON round trip
        return "n/a"
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


def jsonable(v: Any) -> Any:
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
            w.writerow({c: jsonable(r.get(c, "")) for c in columns})
    (out / f"{name}.json").write_text(json.dumps([{k: jsonable(v) for k, v in r.items()} for r in rows],
                                                 indent=1) + "\n")
    (out / f"{name}.tex").write_text(latex(rows, columns, caption, name))
    return markdown(rows, columns)
