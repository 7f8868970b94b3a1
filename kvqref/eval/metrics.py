"""Metrics the evaluations share.

Attention (:mod:`kvqref.eval.study`): :func:`attention_weights`, :func:`topk_agreement`.

Next-token distributions (:mod:`kvqref.eval.llm`), over positions ``t`` with reference logits ``r_t`` (the
unquantized model), logits ``l_t`` (the model reading a quantized cache) and the text's next token ``y_t``,
all in float64 from ``log_softmax``:

* ``nll = mean_t -log softmax(l_t)[y_t]`` and ``ppl = exp(nll)`` (perplexity, natural log);
* ``kl = mean_t sum_v p_t(v) (log p_t(v) - log q_t(v))``, ``p = softmax(r)``, ``q = softmax(l)``: the KL
  divergence of the quantized model's distribution from the reference's, in nats per token;
* ``top1 = mean_t [argmax r_t == argmax l_t]`` (the first index on a tie, as ``torch.argmax``).

Greedy generation: :func:`first_divergence` counts the tokens a model reproduces before it first picks a
different token than the reference continuation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


def attention_weights(q: np.ndarray, k: np.ndarray, sm_scale: float | None = None) -> np.ndarray:
    """float64 softmax weights ``[n, Hq, T]`` of queries ``q`` [n, Hq, D] over keys ``k`` [T, H, D] (GQA)."""
    n, Hq, D = q.shape
    H = k.shape[1]
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    kq = k.astype(np.float64)[:, np.arange(Hq) // (Hq // H), :]
    s = scale * np.einsum("nhd,thd->nht", q.astype(np.float64), kq)
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    return p / p.sum(axis=-1, keepdims=True)


def topk_agreement(p_ref: np.ndarray, p: np.ndarray, k: int) -> float:
    """Mean over rows of |top-k(p_ref) & top-k(p)| / k (rows: every axis but the last)."""
    k = min(k, p.shape[-1])
    a = np.argpartition(-p_ref, k - 1, axis=-1)[..., :k].reshape(-1, k)
    b = np.argpartition(-p, k - 1, axis=-1)[..., :k].reshape(-1, k)
    hits = [len(np.intersect1d(x, y, assume_unique=True)) for x, y in zip(a, b, strict=True)]
    return float(np.mean(hits) / k)


@dataclass
class LogitStats:
    """Sums of the next-token metrics (module docstring) over every position added; :meth:`result` gives the
    means. ``add`` takes ``[..., V]`` logits and ``[...]`` targets; rows are processed ``chunk`` at a time in
    float64 so a long text's logits need not be held in float64 at once."""

    n: int = 0
    nll: float = 0.0
    ref_nll: float = 0.0
    kl: float = 0.0
    top1: int = 0
    chunk: int = 256

    def add(self, ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        if ref_logits.shape != logits.shape or logits.shape[:-1] != targets.shape:
            raise ValueError(f"shapes differ: reference logits {tuple(ref_logits.shape)}, logits "
                             f"{tuple(logits.shape)}, targets {tuple(targets.shape)}")
        r_all = ref_logits.reshape(-1, ref_logits.shape[-1])
        l_all = logits.reshape(-1, logits.shape[-1])
        y_all = targets.reshape(-1).long()
        for i in range(0, r_all.shape[0], self.chunk):
            r = torch.log_softmax(r_all[i:i + self.chunk].double(), -1)
            q = torch.log_softmax(l_all[i:i + self.chunk].double(), -1)
            y = y_all[i:i + self.chunk, None]
            if not (torch.isfinite(q).all() and torch.isfinite(r).all()):
                raise FloatingPointError("non-finite logits: the model produced NaN or Inf (a cache that "
                                         "overflowed?)")
            self.nll -= float(q.gather(-1, y).sum())
            self.ref_nll -= float(r.gather(-1, y).sum())
            self.kl += float((r.exp() * (r - q)).sum())
            self.top1 += int((r.argmax(-1) == q.argmax(-1)).sum())
            self.n += r.shape[0]

    def result(self) -> dict[str, float]:
        """``ppl``, ``ref_ppl``, ``kl`` (nats/token), ``top1`` (fraction) and ``tokens`` (positions counted)."""
        if self.n == 0:
            raise ValueError("no positions were added")
        return {"ppl": math.exp(self.nll / self.n), "ref_ppl": math.exp(self.ref_nll / self.n),
                "kl": self.kl / self.n, "top1": self.top1 / self.n, "tokens": self.n}


def first_divergence(reference: torch.Tensor, logits: torch.Tensor) -> int:
    """Tokens of a greedy continuation reproduced before the first different pick.

    ``reference`` [N]: the reference model's greedy continuation; ``logits`` [N, V]: the other model's logits
    at the positions that predict those tokens, with the reference tokens fed (teacher forced). Greedy
    decoding of the other model emits ``argmax logits[t]``; while every earlier pick equals the reference,
    its inputs are the reference tokens, so teacher forcing gives exactly its logits up to and including the
    first different pick. Returns that pick's index, or N if there is none."""
    picks = logits.argmax(-1)
    differ = torch.nonzero(picks != reference.to(picks.device)).flatten()
    return int(differ[0]) if differ.numel() else int(reference.numel())
