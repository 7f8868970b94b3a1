"""Reference decode attention in float64: the oracle every kernel is compared with.

For one query token per sequence: ``s_j = sm_scale * q . k_j`` (float64), ``lse = log(sum_j exp(s_j))``
(natural log), ``out = sum_j exp(s_j - lse) * v_j``. GQA/MQA: ``q_heads % kv_heads == 0`` and query head
``h`` reads KV head ``h // (q_heads // kv_heads)``. ``sm_scale`` defaults to ``1 / sqrt(head_dim)``.
An empty sequence gives ``out = 0`` and ``lse = -inf``. The tolerance a float32 kernel must meet is
derived in docs/schemes.md ("Tolerance for kernels") and implemented by :func:`kernel_tolerance`.

Rotated caches (docs/rotation.md): :func:`decode_attention` works in the stored domain as a kernel does:
``q`` is rotated by the K rotation (``rotate_query``, float64), attention runs over the stored (rotated)
K and V values, and the output is un-rotated by the V rotation (``unrotate``); ``lse`` needs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

EPS32 = 2.0**-24  # unit roundoff of float32


def _check_q(q: Any) -> np.ndarray:
    qa = np.asarray(q, dtype=np.float64)
    if qa.ndim != 3:
        raise ValueError(f"q must be [batch, q_heads, head_dim], got shape {qa.shape}")
    if not np.isfinite(qa).all():
        raise ValueError("q holds NaN or Inf")
    return qa


def attention(q: Any, K_list: Sequence[Any], V_list: Sequence[Any],
              sm_scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Ragged decode attention: ``q`` [B, Hq, D]; ``K_list[b]``, ``V_list[b]`` [T_b, Hkv, D].
    Returns ``out`` float64 [B, Hq, D] and ``lse`` float64 [B, Hq]."""
    qa = _check_q(q)
    B, Hq, D = qa.shape
    if len(K_list) != B or len(V_list) != B:
        raise ValueError(f"need {B} K and V arrays (one per sequence), got {len(K_list)} and {len(V_list)}")
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    out = np.zeros((B, Hq, D))
    lse = np.full((B, Hq), -np.inf)
    for b in range(B):
        K = np.asarray(K_list[b], dtype=np.float64)
        V = np.asarray(V_list[b], dtype=np.float64)
        if K.ndim != 3 or K.shape != V.shape or K.shape[2] != D:
            raise ValueError(f"sequence {b}: K {K.shape} and V {V.shape} must both be [T, kv_heads, {D}]")
        Hkv = K.shape[1]
        if Hkv == 0 or Hq % Hkv:
            raise ValueError(f"q_heads {Hq} is not a multiple of kv_heads {Hkv}")
        if not (np.isfinite(K).all() and np.isfinite(V).all()):
            raise ValueError(f"sequence {b}: the (dequantized) cache holds NaN or Inf")
        if K.shape[0] == 0:
            continue
        kv_of = np.arange(Hq) // (Hq // Hkv)
        s = scale * np.einsum("hd,thd->ht", qa[b], K[:, kv_of, :])  # [Hq, T]
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        l = p.sum(axis=1, keepdims=True)
        out[b] = np.einsum("ht,thd->hd", p / l, V[:, kv_of, :])
        lse[b] = (m + np.log(l))[:, 0]
    return out, lse


def decode_attention(q: Any, cache: Any, sm_scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Decode attention of ``q`` [batch, q_heads, head_dim] over a :class:`kvqref.paged.PagedKVCache`
    (dequantized paged part + residual window of every sequence). A rotated side is read in its stored domain:
    ``q`` rotated by K's rotation, the output un-rotated by V's (see the module docstring)."""
    qa = _check_q(q)
    if qa.shape[0] != cache.batch or qa.shape[2] != cache.head_dim:
        raise ValueError(f"q {qa.shape} does not match the cache (batch {cache.batch}, head_dim {cache.head_dim})")
    if qa.shape[1] % cache.kv_heads:
        raise ValueError(f"q_heads {qa.shape[1]} is not a multiple of kv_heads {cache.kv_heads}")
    k_rot, v_rot = cache.k.rotation, cache.v.rotation
    stored = cache.storage_view()
    Ks, Vs = zip(*(stored.dequantized(b) for b in range(cache.batch)), strict=True)
    out, lse = attention(qa if k_rot is None else k_rot.rotate_query(qa), Ks, Vs, sm_scale)
    return (out if v_rot is None else v_rot.unrotate(out)), lse


def kernel_tolerance(q: Any, K_list: Sequence[Any], V_list: Sequence[Any], sm_scale: float | None = None,
                     c: float = 4.0, model: str = "probabilistic") -> tuple[np.ndarray, np.ndarray]:
    """Per-element bounds ``(out_tol [B, Hq, D], lse_tol [B, Hq])`` for a float32-accumulating kernel run on
    the same dequantized values (docs/schemes.md, "Tolerance for kernels"). With ``g(n) = c * sqrt(n) * eps32``
    (``model="probabilistic"``: Higham & Mary's bound for sums of n rounded terms, holding with probability
    at least ``1 - 2 * exp(-c**2 / 2)`` per sum) or ``g(n) = n * eps32`` (``model="worst"``: the deterministic
    bound of serial summation):

    * logits: ``|ds_j| <= e_j = g(D + 2) * sm_scale * sum_d |q_d k_jd| + 2 * eps32 * |s_j|`` (float32
      dequantization, products and sums; the scaling by sm_scale and log2(e)),
    * ``lse``: ``|d lse| <= max_j e_j + g(T + 4) + 2 * eps32 * |lse|`` (exp, sum, log in float32),
    * ``out``: ``|d out_d| <= (2 * max_j e_j + g(T + 6)) * sum_j p_j |v_jd|``.
    """
    if model not in ("probabilistic", "worst"):
        raise ValueError(f"model must be 'probabilistic' or 'worst', got {model!r}")

    def g(n: int) -> float:
        return (c * math.sqrt(n) if model == "probabilistic" else n) * EPS32

    qa = _check_q(q)
    B, Hq, D = qa.shape
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    out_tol = np.zeros((B, Hq, D))
    lse_tol = np.zeros((B, Hq))
    for b in range(B):
        K = np.asarray(K_list[b], dtype=np.float64)
        V = np.asarray(V_list[b], dtype=np.float64)
        T, Hkv = K.shape[0], K.shape[1]
        if T == 0:
            continue
        kv_of = np.arange(Hq) // (Hq // Hkv)
        Kq, Vq = K[:, kv_of, :], V[:, kv_of, :]
        s = scale * np.einsum("hd,thd->ht", qa[b], Kq)
        e = g(D + 2) * scale * np.einsum("hd,thd->ht", np.abs(qa[b]), np.abs(Kq)) + 2 * EPS32 * np.abs(s)
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        l = p.sum(axis=1, keepdims=True)
        p /= l
        lse = (m + np.log(l))[:, 0]
        emax = e.max(axis=1)
        lse_tol[b] = emax + g(T + 4) + 2 * EPS32 * np.abs(lse)
        pv = np.einsum("ht,thd->hd", p, np.abs(Vq))
        out_tol[b] = (2 * emax + g(T + 6))[:, None] * pv
    return out_tol, lse_tol
