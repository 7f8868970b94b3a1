"""Does the Hadamard rotation remove the per-channel structure of a real model's keys that KIVI relies on?
(issue 13; docs/rotation.md, "When rotation helps, and when it does not").

SmolLM2-135M-Instruct's keys after RoPE (every layer, :func:`kvqref.hf.collect.collect_kv` on the first
``tokens`` tokens of :func:`kvqref.eval.texts.python_docs`), per (layer, KV head), without and with
``HadamardRotation(seed)`` (the exact float32 rule):

* ``range_spread``: the largest channel's range (max - min over tokens) over the median channel's: how much a
  few channels dominate (1 = every channel alike);
* ``offset_share``: the share of the keys' energy in the per-channel means, ``sum_c T mean_c^2 / sum x^2``:
  the part a per-channel zero point absorbs;
* ``int2/int4 per-channel`` and ``per-token``: the keys' relative RMS error through KIVI's integer codec with
  per-channel groups of 32 tokens (KIVI's keys: ``role="key"``) and with per-token groups of 32 channels
  (``role="value"`` applied to keys), all tokens quantized (no residual window).

Rows: the median over the (layer, head) pairs, and the max for the spread. Run:
``python -m kvqref.eval.channels [--tokens N] [--out FILE.md]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvqref import schemes
from kvqref.schemes.rotation import HadamardRotation

#: the rotation seed of K in :mod:`kvqref.eval.llm`'s rotated configurations
SEED = 1
CODECS = (("int2 per-channel", "int2_kivi", "key"), ("int2 per-token", "int2_kivi", "value"),
          ("int4 per-channel", "int4_kivi", "key"), ("int4 per-token", "int4_kivi", "value"))


def head_stats(k: np.ndarray) -> dict[str, float]:
    """The statistics of the module docstring for keys ``k`` ``[tokens, 1, head_dim]`` of one head."""
    x = k[:, 0].astype(np.float64)
    rng = x.max(0) - x.min(0)
    out = {"range_spread": float(rng.max() / np.median(rng)),
           "offset_share": float(x.shape[0] * (x.mean(0) ** 2).sum() / (x**2).sum())}
    for label, name, role in CODECS:
        out[label] = schemes.relative_rms(schemes.get(name, role=role, residual=0), k)
    return out


def measure(keys: Sequence[np.ndarray], seed: int = SEED) -> list[dict[str, Any]]:
    """Per (layer, head): :func:`head_stats` of the keys and of the rotated keys (``rotated`` False/True).
    ``keys``: per layer ``[tokens, kv_heads, head_dim]`` float32 (tokens a multiple of 32)."""
    rot = HadamardRotation(seed)
    rows = []
    for layer, k in enumerate(keys):
        kr = rot.rotate(k)
        for h in range(k.shape[1]):
            for rotated, x in ((False, k), (True, kr)):
                rows.append({"layer": layer, "head": h, "rotated": rotated, **head_stats(x[:, h:h + 1])})
    return rows


def summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Two rows (without, with rotation): medians over (layer, head), plus the largest range spread."""
    out = []
    for rotated in (False, True):
        sel = [r for r in rows if r["rotated"] == rotated]
        row: dict[str, Any] = {"keys": "rotated (+H)" if rotated else "as stored (after RoPE)"}
        row["range_spread median"] = float(np.median([r["range_spread"] for r in sel]))
        row["range_spread max"] = float(np.max([r["range_spread"] for r in sel]))
        row["offset_share median"] = float(np.median([r["offset_share"] for r in sel]))
        for label, _, _ in CODECS:
            row[f"{label} rel RMS"] = float(np.median([r[label] for r in sel]))
        out.append(row)
    return out


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    from kvqref.report.tables import markdown as table

    s = summary(rows)
    return table(s, list(s[0]))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the text (a multiple of 32)")
    ap.add_argument("--out", help="write the markdown here (with the command)")
    args = ap.parse_args(argv)
    if args.tokens < 32 or args.tokens % 32:
        ap.error(f"--tokens must be a positive multiple of 32, got {args.tokens}")
    from kvqref.eval import llm, texts
    from kvqref.hf import collect

    t0 = time.perf_counter()
    model, tok = llm.load_model()
    ids = collect.tokenize(tok, texts.python_docs(), args.tokens)
    kv = collect.collect_kv(model, ids, threads=1, progress=lambda d, n: print(f"prefill {d}/{n}", file=sys.stderr))
    rows = measure([k for k, _ in kv])
    md = markdown(rows)
    cmd = "python -m kvqref.eval.channels " + " ".join(argv if argv is not None else sys.argv[1:])
    doc = "\n".join([
        "# SmolLM2-135M keys: per-channel structure with and without the Hadamard rotation", "",
        f"Command: `{cmd.strip()}` ({time.perf_counter() - t0:.0f} s; {llm.machine()}). Keys after RoPE of all 30 "
        f"layers x 3 KV heads (head_dim 64), the first {args.tokens} tokens of {texts.python_docs_name()}; "
        f"rotation: HadamardRotation(seed={SEED}). Definitions: kvqref/eval/channels.py.", "", md, ""])
    print(doc)
    if args.out:
        with open(args.out, "w") as f:
            f.write(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
