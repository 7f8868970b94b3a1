"""The K/V accuracy study of ``kvqref report``: every scheme and engine profile on K/V caches.

For each configuration (a K scheme and a V scheme, :data:`CONFIGS`) and each cache (K, V ``[T, H, D]`` and
queries ``[n, Hq, D]``), all T tokens are quantized (no residual window) and measured against the
unquantized cache:

* ``k_rel_rms`` / ``v_rel_rms``: ``sqrt(sum (deq - x)^2 / sum x^2)`` of K and of V, pooled over caches;
* ``attn_rel_err``: ``||out_q - out|| / ||out||`` (2-norm over every query, head and channel, pooled), where
  ``out`` is the float64 oracle (:func:`kvqref.reference.attention`) on the unquantized cache and ``out_q``
  the same oracle on the dequantized one: the error the cache format causes, with no kernel error in it;
* ``topk_agree``: for every query and head, the fraction of the ``k`` tokens with the largest attention
  weights on the unquantized cache that are also among the ``k`` largest on the dequantized one (mean).

Synthetic caches (:func:`kivi_synthetic`) follow the structure the KIVI paper (Liu et al., 2024) reports:
keys have a few fixed channels of 10-100x magnitude, and RoPE is applied to keys and queries; values have
no channel outliers. The KIVI finding is measured by running the KIVI integer format on keys both ways:
per channel (``role="key"``: groups of G tokens of one channel, KIVI's choice) and per token
(``role="value"`` applied to keys: groups of G channels of one token).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvqref import reference, schemes
from kvqref.eval.metrics import attention_weights, topk_agreement


@dataclass(frozen=True)
class Config:
    label: str
    k: tuple[str, dict[str, Any]]
    v: tuple[str, dict[str, Any]]
    engine: str

    def schemes(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return schemes.get(self.k[0], **self.k[1]), schemes.get(self.v[0], **self.v[1])


def _kv(name: str, k_opts: dict[str, Any] | None = None, v_opts: dict[str, Any] | None = None):
    return (name, dict(k_opts or {})), (name, dict(v_opts or k_opts or {}))


CONFIGS: tuple[Config, ...] = (
    Config("bf16", *_kv("bf16"), "baseline"),
    Config("fp8_e4m3", *_kv("fp8_e4m3"), "vLLM CUDA, per-tensor scale amax/448"),
    Config("fp8_e4m3 head", *_kv("fp8_e4m3", {"granularity": "head"}), "vLLM, per-head scale"),
    Config("fp8_e4m3 token_head", *_kv("fp8_e4m3", {"granularity": "token_head"}),
           "vLLM per-token-head scale"),
    Config("fp8_e4m3 sglang", *_kv("fp8_e4m3", {"profile": "sglang", "saturate": True}),
           "SGLang set_kv_buffer, default scale 1.0 (torch >= 2.12: saturating)"),
    Config("fp8_e4m3 rocm", *_kv("fp8_e4m3", {"profile": "rocm"}), "vLLM ROCm MI300, E4M3FNUZ"),
    Config("fp8_e5m2", *_kv("fp8_e5m2"), "vLLM CUDA, per-tensor scale amax/57344"),
    Config("fp8_e5m2 rocm", *_kv("fp8_e5m2", {"profile": "rocm"}), "vLLM ROCm MI300, E5M2FNUZ"),
    Config("fp4_e2m1", *_kv("fp4_e2m1"), "OCP MX rule, block 16"),
    Config("fp4_e2m1 sglang", *_kv("fp4_e2m1", {"profile": "sglang"}), "SGLang FP4 KV (block 16)"),
    Config("mxfp4", *_kv("mxfp4"), "OCP MXFP4, block 32"),
    Config("nvfp4", *_kv("nvfp4"), "NVFP4 (TensorRT-LLM / FlashInfer convention)"),
    Config("int4_kivi", ("int4_kivi", {"role": "key"}), ("int4_kivi", {"role": "value"}),
           "KIVI: keys per channel, values per token"),
    Config("int4 per-token keys", ("int4_kivi", {"role": "value"}), ("int4_kivi", {"role": "value"}),
           "KIVI format, keys per token (ablation)"),
    Config("int2_kivi", ("int2_kivi", {"role": "key"}), ("int2_kivi", {"role": "value"}),
           "KIVI: keys per channel, values per token"),
    Config("int2 per-token keys", ("int2_kivi", {"role": "value"}), ("int2_kivi", {"role": "value"}),
           "KIVI format, keys per token (ablation)"),
)

QUICK_CONFIGS = ("bf16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "nvfp4", "int4_kivi", "int4 per-token keys",
                 "int2_kivi", "int2 per-token keys")


@dataclass
class Cache:
    """One K/V cache and the queries that read it. ``causal=False``: every query sees every token."""

    name: str
    k: np.ndarray  # [T, H, D] float32
    v: np.ndarray
    q: np.ndarray  # [n, Hq, D] float32
    sm_scale: float | None = None


def rope(x: np.ndarray, positions: np.ndarray, base: float = 10000.0) -> np.ndarray:
    """Rotary position embedding, "rotate half" convention (Llama, NeoX): channel ``i < D/2`` is paired with
    ``i + D/2`` and the pair is rotated by ``positions * base**(-2i/D)``. ``x`` is ``[T, H, D]``."""
    D = x.shape[-1]
    half = D // 2
    theta = base ** (-np.arange(half) * 2.0 / D)
    ang = positions[:, None].astype(np.float64) * theta[None, :]  # [T, half]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def kivi_synthetic(tokens: int = 1024, kv_heads: int = 8, head_dim: int = 128, q_heads: int = 32,
                   queries: int = 8, outlier_channels: int = 4, seed: int = 0) -> Cache:
    """A cache with the structure the KIVI paper reports.

    Keys (before RoPE): standard normal, except ``outlier_channels`` channels per head, drawn from the
    lower-frequency half of the rotary pairs (``D/4 <= i < D/2``), whose values are ``m * s * (1 + 0.1 z)``
    with a fixed magnitude ``m ~ U(10, 100)`` and sign ``s`` per (head, channel): large, and nearly constant
    over tokens. RoPE (base 10000) is then applied at positions ``0..T-1``. Values: standard normal, no
    channel outliers. Queries: ``1.5 z`` rotated to the decode positions ``T..T+n-1``.
    """
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((tokens, kv_heads, head_dim))
    for h in range(kv_heads):
        chans = rng.choice(np.arange(head_dim // 4, head_dim // 2), outlier_channels, replace=False)
        mags = rng.uniform(10, 100, outlier_channels) * rng.choice([-1.0, 1.0], outlier_channels)
        k[:, h, chans] = mags * (1 + 0.1 * rng.standard_normal((tokens, outlier_channels)))
    k = rope(k, np.arange(tokens))
    v = rng.standard_normal((tokens, kv_heads, head_dim))
    q = rope(1.5 * rng.standard_normal((queries, q_heads, head_dim)), np.arange(tokens, tokens + queries))
    return Cache(f"synthetic seed {seed}", k.astype(np.float32), v.astype(np.float32), q.astype(np.float32))


def _deq(scheme, x: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return scheme.dequantize(scheme.quantize(x))


def measure(config: Config, caches: Sequence[Cache], topk: int = 8) -> dict[str, Any]:
    """The four metrics of ``config`` over ``caches`` (see the module docstring)."""
    ks, vs = config.schemes()
    sums = {"k_err": 0.0, "k_ref": 0.0, "v_err": 0.0, "v_ref": 0.0, "o_err": 0.0, "o_ref": 0.0}
    agree = []
    for c in caches:
        K, V = c.k.astype(np.float64), c.v.astype(np.float64)
        Kq, Vq = _deq(ks, c.k), _deq(vs, c.v)
        sums["k_err"] += float(np.sum((Kq - K) ** 2))
        sums["k_ref"] += float(np.sum(K**2))
        sums["v_err"] += float(np.sum((Vq - V) ** 2))
        sums["v_ref"] += float(np.sum(V**2))
        if not (np.isfinite(Kq).all() and np.isfinite(Vq).all()):
            sums["o_err"] = math.nan
            agree.append(math.nan)
            continue
        n = c.q.shape[0]
        out, _ = reference.attention(c.q, [K] * n, [V] * n, c.sm_scale)
        out_q, _ = reference.attention(c.q, [Kq] * n, [Vq] * n, c.sm_scale)
        sums["o_err"] += float(np.sum((out_q - out) ** 2))
        sums["o_ref"] += float(np.sum(out**2))
        agree.append(topk_agreement(attention_weights(c.q, K, c.sm_scale), attention_weights(c.q, Kq, c.sm_scale),
                                    topk))
    D, H = caches[0].k.shape[2], caches[0].k.shape[1]
    return {"config": config.label, "k_scheme": _name(config.k), "v_scheme": _name(config.v),
            "engine": config.engine,
            "bits": (ks.bits_per_element(D, H) + vs.bits_per_element(D, H)) / 2,
            "k_rel_rms": math.sqrt(sums["k_err"] / sums["k_ref"]),
            "v_rel_rms": math.sqrt(sums["v_err"] / sums["v_ref"]),
            "attn_rel_err": math.sqrt(sums["o_err"] / sums["o_ref"]) if sums["o_ref"] else math.nan,
            f"top{topk}_agree": float(np.mean(agree))}


def _name(side: tuple[str, dict[str, Any]]) -> str:
    name, opts = side
    return name + (" (" + ", ".join(f"{k}={v}" for k, v in opts.items()) + ")" if opts else "")


def run(caches: Sequence[Cache], configs: Sequence[Config] = CONFIGS, topk: int = 8,
        progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    rows = []
    for cfg in configs:
        rows.append(measure(cfg, caches, topk))
        if progress:
            progress(cfg.label)
    return rows


def kivi_finding(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-channel vs per-token keys at 4 and 2 bits, from :func:`run`'s rows: the errors and their ratios
    (per-token / per-channel; > 1 means per-channel is better)."""
    by = {r["config"]: r for r in rows}
    out = []
    for bits in (4, 2):
        ch, tok = by.get(f"int{bits}_kivi"), by.get(f"int{bits} per-token keys")
        if not ch or not tok:
            continue
        row: dict[str, Any] = {"bits": bits}
        for m in ("k_rel_rms", "attn_rel_err"):
            row[f"{m} per-channel"] = ch[m]
            row[f"{m} per-token"] = tok[m]
            row[f"{m} ratio"] = tok[m] / ch[m] if ch[m] else math.inf
        tk = next(k for k in ch if k.startswith("top") and k.endswith("_agree"))
        row[f"{tk} per-channel"] = ch[tk]
        row[f"{tk} per-token"] = tok[tk]
        row["per-channel better"] = bool(ch["k_rel_rms"] < tok["k_rel_rms"]
                                         and ch["attn_rel_err"] < tok["attn_rel_err"])
        out.append(row)
    return out


def configs_named(labels: Sequence[str]) -> list[Config]:
    by = {c.label: c for c in CONFIGS}
    return [by[label] for label in labels]
