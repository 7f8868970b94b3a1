"""Reference decode attention in float64: the oracle every kernel is compared with.

For one query token per sequence: ``s_j = sm_scale * q . k_j`` (float64), ``lse = log(sum_j exp(s_j))``
(natural log), ``out = sum_j exp(s_j - lse) * v_j``. GQA/MQA: ``q_heads % kv_heads == 0`` and query head
``h`` reads KV head ``h // (q_heads // kv_heads)``. ``sm_scale`` defaults to ``1 / sqrt(head_dim)``.
An empty sequence gives ``out = 0`` and ``lse = -inf``. The tolerance a float32 kernel must meet is
derived in docs/schemes.md ("Tolerance for kernels") and implemented by :func:`kernel_tolerance`.

Rotated caches (docs/rotation.md): :func:`decode_attention` works in the stored domain as a kernel does:
``q`` is rotated by the K rotation (``rotate_query``, float64), attention runs over the stored (rotated)
K and V values, and the output is un-rotated by the V rotation (``unrotate``); ``lse`` needs nothing.
:func:`rotated_kernel_tolerance` bounds a float32 kernel that does the same (docs/rotation.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
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


U_BF16 = 2.0**-8  # unit roundoff of bfloat16 (8-bit significand)
U_F16 = 2.0**-11  # unit roundoff of float16 (11-bit significand)


@dataclass(frozen=True)
class Rounding16:
    """The roundings a 16-bit ("fast") kernel adds to the float32 model (docs/kernels.md, "Precision"):

    * ``u_q``: relative error of ``q_d`` rounded once to 16 bits, against ``|q_d k_jd|``;
    * ``a_q``: absolute error of each rounded q element, in units of ``max_d |q_d|`` (float16 underflow);
    * ``u_qs``: relative error of KIVI's folded factor ``q_d * s_d`` (rounded once to float16 by key rows: 2**-11,
      plus 2**-24 for the float32 product of a float32 q; split in two bfloat16 parts otherwise: 2**-16), against
      ``|q_d| * kr_jd`` with ``kr`` the ``K_round`` magnitudes given to :func:`kernel_tolerance` (``|K - Z| = s *
      code``; ``|K|`` when not given);
    * ``a_qs``: absolute error of each rounded ``q_d * s_d`` (float16 underflow), in units of the largest
      ``|q_d * s_d|`` of its group (key rows scale each row by a power of two that puts that one in [2**14,
      2**15), so a float16 subnormal's half ulp 2**-25 is at most 2**-39 of it; with the key codes as float16
      subnormals, ``kivi_subnormal_codes``, an operand may be multiplied by 2**-dK once more, dK <= 4 for 4-bit and
      8 for 2-bit codes, which rounds it again below float16's normal range: 2**-39 (1 + 2**dK)), times the code
      ``kr / s``;
    * ``u_k``: relative error of the K tile (a float32 tile split in two bfloat16 parts: 2**-16);
    * ``u_p``, ``a_p``: relative and absolute (float16 underflow) error of each probability ``p_j <= 1``
      rounded to 16 bits before the P @ V product;
    * ``u_v``: relative error of the V tile (two-part split: 2**-16).

    The output term ``(u_p + u_v + u_p u_v) sum_j p_j |v_jd|`` is taken against the ``V_round`` magnitudes
    given to :func:`kernel_tolerance` when there are any (fast-mode KIVI values fold the token's group scale
    into p: ``p * s`` rounded once against the exact codes, so the rounding is relative to ``|V - Z| = s *
    code``; the residual tokens keep ``|V|``).
    """

    u_q: float = 0.0
    a_q: float = 0.0
    u_qs: float = 0.0
    a_qs: float = 0.0
    u_k: float = 0.0
    u_p: float = 0.0
    a_p: float = 0.0
    u_v: float = 0.0


def fast_rounding(k_scheme: Any, v_scheme: Any, q_dtype: str, *, kivi_key_rows: bool = True) -> Rounding16:
    """The :class:`Rounding16` of the Triton decode kernel's ``precision="fast"`` for these schemes and a
    ``q`` of dtype ``q_dtype`` ("bfloat16", "float16" or "float32"); derivation in docs/kernels.md.
    ``kivi_key_rows``: KIVI keys by key rows (the default layout: ``q * s`` rounded once to float16 per group row),
    else the key tiles or the folded float32 q (``key_rows=False``: ``q * s`` in two bfloat16 parts).

    Scores: q goes to the tensor cores as bfloat16 (bf16 and KIVI-residual tiles) or, scaled by a power of
    two, as float16 (FP8 and NVFP4 tiles; NVFP4 tiles are float16 E2M1 * scale * 2**-14, exact; E8M0 FP4
    tiles are bfloat16, exact); KIVI keys fold the per-channel scale into q: by key rows ``q_d * s_d`` is
    rounded once to float16 after a power of two per row (2**-11 of each product: float16, not bfloat16, whose
    2**-8 would no longer see one code step next to outlier channels), otherwise split in two bfloat16 parts
    from the bfloat16 q; float32 tiles (the KIVI residual) are split in two bfloat16 parts.
    Outputs: p is rounded to bfloat16, or (FP8 values with a tensor scale) ``p * 2**14`` to float16, or (NVFP4
    values) ``p * 2**14`` or, with fast NVFP4 keys (block rows), ``p * s_v * 2**7`` to float16, or (E8M0 values by
    block rows, ``e8m0_values_f16``) ``p * 2**(c - mc + 15)`` to float16, mc the split's reference code; the residual
    tiles are split in two bfloat16 parts; KIVI values fold the token's group scale into
    p (``p * s`` rounded once to bfloat16 against the exact integer codes, the zero term ``p * z`` in float32):
    pass ``V_round = V - Z`` (paged tokens) to :func:`kernel_tolerance`.
    """
    from kvqref.schemes import E8M0BlockScheme, FP8Scheme, KiviScheme, NVFP4Scheme
    from kvqref.schemes.rotation import storage_scheme

    k_scheme, v_scheme = storage_scheme(k_scheme), storage_scheme(v_scheme)  # a rotated side: its stored values
    if q_dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"q_dtype must be bfloat16, float16 or float32, got {q_dtype!r}")
    kivi_k, kivi_v = isinstance(k_scheme, KiviScheme), isinstance(v_scheme, KiviScheme)
    # float16 q: FP8 and FP4 keys (FP4 by block rows, the default where the rows fit 32; E8M0 keys otherwise meet q
    # in bfloat16, so for them both roundings are allowed: the larger u_q, and a_q)
    fp16_k = isinstance(k_scheme, (FP8Scheme, NVFP4Scheme, E8M0BlockScheme))
    fp16_v = isinstance(v_scheme, NVFP4Scheme) or (
        isinstance(v_scheme, FP8Scheme) and v_scheme.granularity != "token_head")
    rows_k = kivi_k and kivi_key_rows
    if fp16_k:
        e8m0_k = isinstance(k_scheme, E8M0BlockScheme)
        u_q, a_q = (0.0 if q_dtype in ("bfloat16", "float16") else (U_BF16 if e8m0_k else U_F16)), 2.0**-39
    else:  # (key rows round q * s, not q; the residual tokens still meet q rounded once to bfloat16)
        u_q, a_q = (0.0 if q_dtype == "bfloat16" else U_BF16), 0.0
    if rows_k:
        u_qs = U_F16 + (2.0**-24 * (1 + U_F16) if q_dtype == "float32" else 0.0)
    else:
        u_qs = 2.0**-16 * (1 + u_q) if kivi_k else 0.0  # q * s from the rounded q (|q~| <= (1 + u_q) |q|)
    return Rounding16(
        u_q=u_q,
        a_q=a_q,
        u_qs=u_qs,
        a_qs=2.0**-39 * (1 + 2.0 ** (4 if k_scheme.bits == 4 else 8)) if rows_k else 0.0,
        u_k=2.0**-16 if kivi_k and not rows_k else 0.0,
        u_p=U_F16 if fp16_v else U_BF16,
        # NVFP4 values: p * s_v * 2**7 rounded to float16 (the block rows of fast NVFP4 pairs), an absolute error of at
        # most 2**-25 / 2**7 per token times |E2M1| = |v| / s_v <= 2**9 |v|; FP8: p * 2**14, 2**-25 / 2**14; E8M0
        # values (block rows, ``e8m0_values_f16``): p * 2**(c - mc + 15) rounded to float16 with mc - 16 <= c <= mc,
        # 2**-25 * 2**(mc - c - 15) <= 2**-24 of p, plus the float32 underflow of p * 2**(142 - mc) (mc <= 240: at
        # most 2**-150 * 2**(c - 127) <= 2**-37 in p * 2**(c - mc + 15), 2**-36 of p): below 2**-23 (u_p stays
        # bfloat16's: the bfloat16 route remains where the codes spread further)
        a_p=(2.0**-23 if isinstance(v_scheme, (NVFP4Scheme, E8M0BlockScheme)) else (2.0**-39 if fp16_v else 0.0)),
        u_v=2.0**-16 if kivi_v else 0.0,
    )


def kernel_tolerance(q: Any, K_list: Sequence[Any], V_list: Sequence[Any], sm_scale: float | None = None,
                     c: float = 4.0, model: str = "probabilistic", *, fast: Rounding16 | None = None,
                     K_round: Sequence[Any] | None = None,
                     V_round: Sequence[Any] | None = None,
                     K_scale: Sequence[Any] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-element bounds ``(out_tol [B, Hq, D], lse_tol [B, Hq])`` for a float32-accumulating kernel run on
    the same dequantized values (docs/schemes.md, "Tolerance for kernels"). With ``g(n) = c * sqrt(n) * eps32``
    (``model="probabilistic"``: Higham & Mary's bound for sums of n rounded terms, holding with probability
    at least ``1 - 2 * exp(-c**2 / 2)`` per sum) or ``g(n) = n * eps32`` (``model="worst"``: the deterministic
    bound of serial summation):

    * logits: ``|ds_j| <= e_j = g(D + 2) * sm_scale * sum_d |q_d k_jd| + 2 * eps32 * |s_j|`` (float32
      dequantization, products and sums; the scaling by sm_scale and log2(e)),
    * ``lse``: ``|d lse| <= max_j e_j + g(T + 4) + 2 * eps32 * |lse|`` (exp, sum, log in float32),
    * ``out``: ``|d out_d| <= (2 * max_j e_j + g(T + 6)) * sum_j p_j |v_jd|``.

    ``fast``: the 16-bit roundings of a fast-mode kernel (:func:`fast_rounding`) are added:
    ``e_j += sm_scale * sum_d |q_d| ((u_q + u_k (1 + u_q)) |k_jd| + u_qs kr_jd) + sm_scale a_q max|q|
    sum_d |k_jd|`` and ``|d out_d| += (u_p + u_v + u_p u_v) sum_j p_j vr_jd + a_p sum_j |v_jd|``
    (``kr = K_round`` or ``|K|``; ``vr = |V_round|`` or ``|V|``). With ``K_round`` (KIVI keys: the codes' part
    ``sum q s c`` and the zero part ``sum q z`` are summed apart in float32) ``e_j += 2 g(D + 2) sm_scale sum_d
    |q_d| kr_jd``; with ``a_qs`` (key rows) ``e_j += sm_scale a_qs max_d |q_d s_jd| sum_d kr_jd / s_jd``, ``s =
    K_scale`` (each token's group scale per channel, 0 on the residual; required then).
    With ``V_round`` (KIVI values in fast mode:
    the codes' part ``sum p s c`` and the zero part ``sum p z`` are accumulated apart in float32, and
    ``|z| <= |v| + |s c|``), ``|d out_d| += 2 g(T + 7) sum_j p_j vr_jd`` too.
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
        aq, ak = np.abs(qa[b]), np.abs(Kq)
        e = g(D + 2) * scale * np.einsum("hd,thd->ht", aq, ak) + 2 * EPS32 * np.abs(s)
        if fast is not None:
            kr = ak if K_round is None else np.abs(np.asarray(K_round[b], dtype=np.float64))[:, kv_of, :]
            e += scale * ((fast.u_q + fast.u_k * (1 + fast.u_q)) * np.einsum("hd,thd->ht", aq, ak)
                          + fast.u_qs * np.einsum("hd,thd->ht", aq, kr)
                          + fast.a_q * aq.max(axis=1)[:, None] * ak.sum(axis=2).T)
            if K_round is not None:
                e += 2 * g(D + 2) * scale * np.einsum("hd,thd->ht", aq, kr)
            if fast.a_qs:
                if K_scale is None:
                    raise ValueError("fast.a_qs (KIVI key rows) needs K_scale, the keys' group scales")
                ks = np.abs(np.asarray(K_scale[b], dtype=np.float64))[:, kv_of, :]
                codes = np.divide(kr, ks, out=np.zeros_like(kr), where=ks > 0)
                e += scale * fast.a_qs * (aq[None] * ks).max(axis=2).T * codes.sum(axis=2).T
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        l = p.sum(axis=1, keepdims=True)
        p /= l
        lse = (m + np.log(l))[:, 0]
        emax = e.max(axis=1)
        lse_tol[b] = emax + g(T + 4) + 2 * EPS32 * np.abs(lse)
        pv = np.einsum("ht,thd->hd", p, np.abs(Vq))
        out_tol[b] = (2 * emax + g(T + 6))[:, None] * pv
        if fast is not None:
            pvr = pv if V_round is None else np.einsum(
                "ht,thd->hd", p, np.abs(np.asarray(V_round[b], dtype=np.float64))[:, kv_of, :])
            out_tol[b] += (fast.u_p + fast.u_v + fast.u_p * fast.u_v) * pvr
            if V_round is not None:
                out_tol[b] += 2 * g(T + 7) * pvr
            out_tol[b] += fast.a_p * np.abs(Vq).sum(axis=0)
    return out_tol, lse_tol


def rotated_kernel_tolerance(q: Any, cache: Any, sm_scale: float | None = None, *, fast: Rounding16 | None = None,
                             K_round: Sequence[Any] | None = None,
                             K_scale: Sequence[Any] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                             np.ndarray]:
    """``(out, lse, out_tol, lse_tol)``: :func:`decode_attention` of ``q`` over ``cache`` and the bounds a float32
    kernel reading the cache in its stored domain must meet (docs/rotation.md, "Where each step runs"):
    ``out_tol`` [B, Hq] bounds the 2-norm of each output row's error, ``lse_tol`` [B, Hq] the lse error.

    The kernel rotates q in float32 butterflies and folds ``1 / (D C_D)`` into ``sm_scale`` (one float32
    rounding), and un-rotates the output in float32 butterflies times ``f32(signs / (D C_D))``: each a relative
    2-norm error of at most ``r = (n + 2) 2**-24`` (n = log2 D butterfly stages, each relative ``2**-24`` in
    2-norm; one rounding of the constant; one of the product). With ``q'`` the exact rotated query and
    :func:`kernel_tolerance` ``(t_o, t_l)`` of ``q'`` over the stored values (``fast``, ``K_round`` as there):
    scores move by at most ``e_q = sm_scale r ||q'|| max_j ||k_j||`` (K rotated), the output by
    ``expm1(2 e_q) max_j ||v_j||`` (the softmax weights by a factor within ``e**(+-2 e_q)``), the un-rotation adds
    ``r ||out||`` (V rotated) and maps the stored-domain error ``||t_o||`` through an orthonormal matrix (norm
    ``1 + 2**-23`` at most). So ``out_tol = (1 + 2**-20) ||t_o|| + expm1(2 e_q) max||v|| + r ||out||`` and
    ``lse_tol = t_l + e_q``."""
    qa = _check_q(q)
    out, lse = decode_attention(qa, cache, sm_scale)
    k_rot, v_rot = cache.k.rotation, cache.v.rotation
    stored = cache.storage_view()
    Ks, Vs = zip(*(stored.dequantized(b) for b in range(cache.batch)), strict=True)
    qs = qa if k_rot is None else k_rot.rotate_query(qa)
    t_o, t_l = kernel_tolerance(qs, Ks, Vs, sm_scale, fast=fast, K_round=K_round, K_scale=K_scale)
    D = qa.shape[2]
    r = (D.bit_length() - 1 + 2) * EPS32
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    kmax = np.array([np.linalg.norm(K, axis=-1).max(initial=0.0) for K in Ks])[:, None]
    vmax = np.array([np.linalg.norm(V, axis=-1).max(initial=0.0) for V in Vs])[:, None]
    e_q = scale * r * np.linalg.norm(qs, axis=-1) * kmax if k_rot is not None else np.zeros(lse.shape)
    out_tol = (1 + 2.0**-20) * np.linalg.norm(t_o, axis=-1) + np.expm1(2 * e_q) * vmax
    if v_rot is not None:
        out_tol = out_tol + r * np.linalg.norm(out, axis=-1)
    return out, lse, out_tol, t_l + e_q
