"""Synthetic accuracy study of rotated caches: every configuration of the accuracy study with and without the
Hadamard rotation (docs/rotation.md), on three kinds of cache.

* ``outlier``: keys :func:`kvqref.schemes.outlier_tensor` (standard normal, channels 3, 37, 80 scaled by
  10, 30, 100: zero-mean outlier channels), values and queries standard normal (queries x 1.5);
* ``kivi``: :func:`kvqref.eval.study.kivi_synthetic` (KIVI's structure: 4 nearly constant 10-100x key channels per
  head, RoPE on keys and queries);
* ``gaussian``: keys, values and queries standard normal (nothing for a rotation to spread).

Metrics are those of :func:`kvqref.eval.study.measure` (all tokens quantized, float64 oracle attention on the
dequantized cache vs on the unquantized one). The rotated twin of a configuration uses
``rotation="hadamard"`` with seed :data:`K_SEED` for K and :data:`V_SEED` for V.
Run: ``python3 -m kvqref.eval.rotation`` (prints the markdown of docs/rotation.md's tables).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvqref import schemes
from kvqref.eval.study import CONFIGS, Cache, Config, kivi_synthetic, measure

K_SEED, V_SEED = 1, 2
CACHE_KINDS = ("outlier", "kivi", "gaussian")


def rotated(config: Config) -> Config:
    """``config`` with both sides rotated (label + `` +H``)."""
    k, v = config.k, config.v
    return Config(config.label + " +H", (k[0], {**k[1], "rotation": "hadamard", "rotation_seed": K_SEED}),
                  (v[0], {**v[1], "rotation": "hadamard", "rotation_seed": V_SEED}), config.engine)


def make_caches(kind: str, tokens: int = 1024, kv_heads: int = 8, head_dim: int = 128, q_heads: int = 32,
                queries: int = 8, seeds: Sequence[int] = (0, 1)) -> list[Cache]:
    """The caches of one ``kind`` (see the module docstring), one per seed."""
    out = []
    for seed in seeds:
        if kind == "kivi":
            out.append(kivi_synthetic(tokens, kv_heads, head_dim, q_heads, queries, seed=seed))
            continue
        rng = np.random.default_rng(1000 + seed)
        if kind == "outlier":
            k = schemes.outlier_tensor(tokens, kv_heads, head_dim, seed=seed)
        elif kind == "gaussian":
            k = rng.standard_normal((tokens, kv_heads, head_dim)).astype(np.float32)
        else:
            raise ValueError(f"cache kind must be one of {CACHE_KINDS}, got {kind!r}")
        v = rng.standard_normal((tokens, kv_heads, head_dim)).astype(np.float32)
        q = (1.5 * rng.standard_normal((queries, q_heads, head_dim))).astype(np.float32)
        out.append(Cache(f"{kind} seed {seed}", k, v, q))
    return out


def run(kinds: Sequence[str] = CACHE_KINDS, configs: Sequence[Config] = CONFIGS, topk: int = 8,
        progress: Callable[[str], None] | None = None, **cache_kw: Any) -> list[dict[str, Any]]:
    """One row per (cache kind, configuration, rotated or not): :func:`kvqref.eval.study.measure`'s metrics plus
    ``cache`` and ``rotated``."""
    rows = []
    for kind in kinds:
        caches = make_caches(kind, **cache_kw)
        for cfg in configs:
            for rot, c in ((False, cfg), (True, rotated(cfg))):
                row = measure(c, caches, topk)
                rows.append({"cache": kind, "rotated": rot, "base": cfg.label, **row})
            if progress:
                progress(f"{kind}: {cfg.label}")
    return rows


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """One table per cache kind: each configuration's errors without and with rotation, and their ratio."""
    topk = next(k for k in rows[0] if k.startswith("top") and k.endswith("_agree"))
    out = []
    for kind in dict.fromkeys(r["cache"] for r in rows):
        pairs: dict[str, dict[bool, dict[str, Any]]] = {}
        for r in rows:
            if r["cache"] == kind:
                pairs.setdefault(r["base"], {})[r["rotated"]] = r
        out += [f"**{kind}** caches", "",
                "| config | bits | K rel RMS | K rel RMS +H | V rel RMS | V rel RMS +H | attn rel err | "
                f"attn rel err +H | +H / plain | {topk} | {topk} +H |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for label, p in pairs.items():
            a, b = p[False], p[True]
            ratio = b["attn_rel_err"] / a["attn_rel_err"] if a["attn_rel_err"] else math.nan
            out.append(f"| {label} | {a['bits']:g} | {a['k_rel_rms']:.3e} | {b['k_rel_rms']:.3e} | "
                       f"{a['v_rel_rms']:.3e} | {b['v_rel_rms']:.3e} | {a['attn_rel_err']:.3e} | "
                       f"{b['attn_rel_err']:.3e} | {ratio:.2f} | {a[topk]:.3f} | {b[topk]:.3f} |")
        out.append("")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--seeds", type=int, default=2, help="caches per kind (seeds 0 .. n-1)")
    ap.add_argument("--kinds", default=",".join(CACHE_KINDS))
    args = ap.parse_args(argv)
    rows = run(args.kinds.split(","), tokens=args.tokens, seeds=tuple(range(args.seeds)),
               progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
