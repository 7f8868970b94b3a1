"""The ``"kvqref"`` attention implementation (registered with transformers' ``AttentionInterface`` on import
of :mod:`kvqref.hf`) and the prefill attention over a cache whose state changes while a prompt is written.

Decode steps (one new token per sequence) call the backend's decode on the quantized cache itself.
A chunk of ``m > 1`` tokens (a prompt) attends per query ``t`` over keys ``j <= t`` whose values are the
quantized ones for ``j < thr(t)`` and the full-precision ones from there on, with ``thr`` by prefill mode:

* ``as_decoded``: ``thr(t) = scheme.paged_tokens(t + 1)``: the cache as it stood when token ``t`` would have
  been decoded (its own token written), so one forward over a text equals decoding it token by token;
* ``full``: ``thr(t) = `` the tokens quantized before the chunk: the chunk itself in full precision;
* ``dequantized``: ``thr(t) = `` the tokens quantized after the chunk: the final stored state.

Keys and values have their own ``thr`` (their schemes' windows differ, e.g. KIVI's).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch


@functools.lru_cache(maxsize=256)
def _as_decoded(scheme: Any, start: int, m: int) -> np.ndarray:
    return np.array([scheme.paged_tokens(t + 1) for t in range(start, start + m)], np.int64)


def thresholds(scheme: Any, start: int, m: int, mode: str, before: int, after: int) -> np.ndarray:
    """``thr(t)`` for the queries ``t = start .. start + m - 1`` (module docstring), clipped to ``t + 1``."""
    if mode == "as_decoded":
        thr = _as_decoded(scheme, start, m)
    elif mode == "full":
        thr = np.full(m, before, np.int64)
    elif mode == "dequantized":
        thr = np.full(m, after, np.int64)
    else:
        raise ValueError(f"unknown prefill mode {mode!r}")
    return np.minimum(thr, np.arange(start + 1, start + m + 1))


def _uniform(thr: np.ndarray, start: int) -> int | None:
    """``c`` if ``thr(t) == min(c, t + 1)`` for every query (one key set serves all), else None."""
    c = int(thr[-1])
    return c if np.array_equal(thr, np.minimum(c, np.arange(start + 1, start + len(thr) + 1))) else None


def _heads(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    """[T, Hkv, D] -> [Hq, T, D] (each KV head serving its group of query heads)."""
    return x.transpose(0, 1).repeat_interleave(q_heads // x.shape[1], dim=0)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA of queries ``q`` ``[Hq, m, D]`` at the last ``m`` of the ``N`` positions of ``k``/``v``
    ``[N, Hkv, D]``, causal: ``[Hq, m, D]``."""
    m, N = q.shape[1], k.shape[0]
    # 4D: torch's CPU flash kernel takes no 3D input (a 10x slower math path)
    q, k, v = q[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if m == N:  # the fused causal kernel
        return _sdpa(q, k, v, None, scale, is_causal=True)[0]
    mask = torch.from_numpy(np.arange(N)[None, :] <= np.arange(N - m, N)[:, None]).to(q.device)
    return _sdpa(q, k, v, mask, scale)[0]


def prefill_attention(q: torch.Tensor, kq: torch.Tensor, vq: torch.Tensor, ktail: torch.Tensor,
                      vtail: torch.Tensor, kb: int, vb: int, kthr: np.ndarray, vthr: np.ndarray, scale: float,
                      block: int = 256) -> torch.Tensor:
    """Attention of one sequence's ``m`` new queries ``q`` ``[Hq, m, D]`` (positions ``N - m .. N - 1``).

    ``kq``/``vq`` ``[N, Hkv, D]``: the stored state after the chunk, dequantized; ``ktail``/``vtail``: the
    full-precision tokens ``kb..N-1`` / ``vb..N-1``; ``kthr``/``vthr`` from :func:`thresholds`. Returns
    ``[m, Hq, D]`` in ``q``'s dtype.

    Queries are taken in groups (at most ``block``) that share one key threshold, so one key set serves the
    group. Value thresholds still differ inside a group, over a band ``[lo, hi)``: those positions appear
    twice, with the full-precision value and with the quantized one, each copy masked to the queries that read
    it (the two copies have the same key, so the softmax is exactly the per-query one); then one SDPA call
    per group over a buffer updated in place as the thresholds grow."""
    Hq, m, _ = q.shape
    N = kq.shape[0]
    start = N - m
    ck, cv = _uniform(kthr, start), _uniform(vthr, start)
    if ck is not None and cv is not None:  # one key/value set for all queries: causal SDPA
        k = torch.cat([kq[:ck], ktail[ck - kb:]]) if ck < N else kq
        v = torch.cat([vq[:cv], vtail[cv - vb:]]) if cv < N else vq
        return causal_sdpa(q, k, v, scale).transpose(0, 1)
    out = torch.empty(m, Hq, q.shape[2], dtype=q.dtype, device=q.device)
    cuts = [0, *(np.flatnonzero(np.diff(kthr)) + 1).tolist(), m]
    groups = [(a, min(a + block, e)) for s_, e in zip(cuts[:-1], cuts[1:], strict=True) for a in range(s_, e, block)]
    W = max(int(vthr[e - 1] - vthr[a]) for a, e in groups)  # the widest value band
    # [Hkv, W + N, D]: room for a group's duplicated band, then positions 0..N-1 holding the quantized values
    # below the current thresholds and the full-precision ones above (thresholds only grow, group by group)
    kbuf = torch.cat([kq[:W], kq[:kb], ktail]).transpose(0, 1).contiguous()
    vbuf = torch.cat([vq[:W], vq[:vb], vtail]).transpose(0, 1).contiguous()
    kdone, vdone = kb, vb
    for a, e in groups:
        T = start + e  # keys 0 .. T-1 cover the group's queries
        c, lo, hi = int(kthr[a]), int(vthr[a]), int(vthr[e - 1])
        if c > kdone:
            kbuf[:, W + kdone: W + c] = kq[kdone:c].transpose(0, 1)
            kdone = c
        if lo > vdone:
            vbuf[:, W + vdone: W + lo] = vq[vdone:lo].transpose(0, 1)
            vdone = lo
        w = hi - lo  # band: position j holds the full-precision value, its copy at W - w + (j - lo) the quantized
        kbuf[:, W - w: W] = kbuf[:, W + lo: W + hi]
        vbuf[:, W - w: W] = vq[lo:hi].transpose(0, 1)
        # the mask in NumPy: ~50x faster than torch's broadcasting on a busy 2-core CPU
        t = np.arange(start + a, start + e)[:, None]
        j = np.arange(T)[None, :]
        vt = vthr[a:e, None]
        main = (j >= vt) & (j <= t)  # full-precision value (j >= thr(t)), causal ...
        main[:, :lo] = True  # ... and below the band the quantized value, for every query of the group
        mask = torch.from_numpy(np.concatenate([np.arange(lo, hi)[None, :] < vt, main], 1)).to(q.device)
        o = _sdpa(q[None, :, a:e], kbuf[None, :, W - w: W + T], vbuf[None, :, W - w: W + T], mask, scale)
        out[a:e] = o[0].transpose(0, 1)
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
          is_causal: bool = False) -> torch.Tensor:
    """SDPA with K/V heads shared by groups of query heads (``enable_gqa``; a copy on torch < 2.5)."""
    kw = dict(attn_mask=mask, scale=scale, is_causal=is_causal)
    if q.shape[1] == k.shape[1]:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)
    try:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    except TypeError:
        g = q.shape[1] // k.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(g, 1),
                                                                v.repeat_interleave(g, 1), **kw)


def allowed_mask(mask: torch.Tensor | None, batch: int, n: int, kv_len: int, device: torch.device):
    """transformers' 4D mask ``[B|1, 1, n, kv]`` (bool, True = attend, or additive float) as bool ``[B, n, kv]``."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise ValueError(f"kvqref attention: expected a 4D attention mask, got {type(mask).__name__} "
                         f"{tuple(getattr(mask, 'shape', ()))}")
    allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] > torch.finfo(mask.dtype).min / 2
    if allowed.shape[-1] < kv_len:
        raise ValueError(f"kvqref attention: the mask covers {allowed.shape[-1]} keys, the cache {kv_len}")
    return allowed[..., :kv_len].expand(batch, n, kv_len).to(device)


def check_prefill_mask(allowed: torch.Tensor, kept: torch.Tensor, past: int) -> None:
    """The mask must be causal attention over the non-padding positions (``kept``), for every non-padding
    query; other masks (packed sequences, bidirectional, sliding windows) are not supported."""
    a, k = allowed.cpu().numpy(), kept.cpu().numpy()  # NumPy: far faster than torch's broadcasting on a CPU
    B, n, kv = a.shape
    expect = k[:, None, :] & (np.arange(kv)[None, None, :] <= np.arange(past, past + n)[None, :, None])
    rows = k[:, past:, None]
    if not np.array_equal(a & rows, expect & rows):
        raise ValueError("kvqref attention supports causal attention with padding only; this mask is different "
                         "(packed sequences, a sliding window or a custom mask)")


def check_decode_mask(allowed: torch.Tensor, kept: torch.Tensor) -> None:
    """A decode step must attend over exactly the stored (non-padding) positions."""
    if not torch.equal(allowed[:, 0], kept):
        raise ValueError("kvqref attention: the decode mask differs from the stored positions (padding in the "
                         "middle of a sequence or a custom mask are not supported)")


def kvqref_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function ``"kvqref"``: attends over the :class:`~kvqref.hf.QuantizedKVCache`
    layer that ``key`` came from (decode: the backend's decode kernel; prefill: :func:`prefill_attention`)."""
    for name, what in (("sliding_window", "sliding-window attention"), ("softcap", "logit soft-capping"),
                       ("s_aux", "attention sinks"), ("position_bias", "a position bias")):
        if kwargs.get(name) is not None:
            raise ValueError(f"kvqref attention: {what} ({name}) is not supported")
    if dropout:
        raise ValueError("kvqref attention: dropout is not supported (inference only)")
    if getattr(module, "is_causal", True) is False:
        raise ValueError("kvqref attention: only causal self-attention is supported (no encoder or cross-attention)")
    layer = getattr(key, "_kvqref_layer", None)
    if layer is None:
        raise ValueError("kvqref attention needs a kvqref.hf.QuantizedKVCache passed as the model's cache "
                         "(cache=, or past_key_values= in older transformers; kvqref.hf.cache_kwargs picks it) and "
                         "use_cache=True: it attends over the quantized cache")
    del key._kvqref_layer
    return layer.attend(query, attention_mask, scaling), None


def kvqref_mask(*args: Any, **kwargs: Any):
    """The mask of the ``"kvqref"`` attention: transformers' SDPA boolean mask, never skipped, so padding is
    always visible to the cache."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)
