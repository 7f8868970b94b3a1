"""transformers' own ``QuantizedCache`` beside kvqref's matching scheme, on the same model and text.

Both are run the way transformers' caches are used: a first prompt of ``P`` tokens (prefill), then one
token at a time. transformers' caches hand the prefill full-precision K/V (they quantize after attention),
so kvqref's cache runs with ``prefill="full"`` for the first prompt and ``"as_decoded"`` after it (one
forward that equals decoding token by token). Scores: KL divergence from the unquantized model, top-1
agreement and perplexity at the positions every row decodes (after the longest first prompt).

The FP8 pair shows what a tensor-level scale frozen at the first update does: transformers' ``fp8`` backend
and kvqref's ``fp8_e4m3`` per tensor both take ``amax / 448`` of the first chunk (every head), so a one-token
first prompt freezes the scale at one token's amax, and every later element beyond ``448 * scale``
saturates. :func:`saturation` measures how often that happens; per-(token, head) scales do not freeze.
"""

from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from kvqref import schemes
from kvqref.eval import texts
from kvqref.eval.llm import REFERENCE_ATTENTION, attention, reference_logits, torch_threads
from kvqref.eval.metrics import LogitStats


@dataclass(frozen=True)
class Row:
    """One cache of the comparison: ``kind`` "transformers" (``backend`` + ``options`` of QuantizedCache) or
    "kvqref" (``backend`` is the scheme name, ``options`` its K and V options)."""

    kind: str
    backend: str
    first_prompt: int
    options: dict[str, Any] = field(default_factory=dict)
    differs: str = ""

    @property
    def name(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items() if k != "role")
        return f"{self.kind} {self.backend}" + (f" ({opts})" if opts else "")


TF_FP8 = ("E4M3; one scale per layer for K and one for V, amax/448 over the first update (all heads), then "
          "frozen; later states cast by torch (saturating); every step dequantizes the whole cache")
KV_FP8 = ("E4M3, vLLM's rule (float32 amax/448, RNE, saturating); scale calibrated per layer on the first "
          "quantized chunk (all heads), then frozen: the same rule as transformers' fp8")
KV_FP8_TH = "E4M3 with a scale per (token, head): nothing to freeze (8.5 bits with the scale)"
TF_INT = ("transformers' defaults: {nbits} bits, axis_key 0, axis_value 0, q_group_size 64, residual_length "
          "128; when the residual window fills, the whole cache is dequantized and re-quantized")
KV_KIVI = ("KIVI: keys per channel and values per token, groups of 32, float16 scale and zero, residual window "
           "128 kept in float32; tokens quantized once, when they leave the window")


def fp8_rows(first_prompts: Sequence[int]) -> list[Row]:
    rows = []
    for p in first_prompts:
        rows += [Row("transformers", "fp8", p, {}, TF_FP8), Row("kvqref", "fp8_e4m3", p, {}, KV_FP8)]
    rows.append(Row("kvqref", "fp8_e4m3", min(first_prompts), {"granularity": "token_head"}, KV_FP8_TH))
    return rows


def int_rows(first_prompt: int, backends: Sequence[str] = ("quanto", "hqq")) -> list[Row]:
    rows = [Row("transformers", b, first_prompt, {"nbits": 4}, TF_INT.format(nbits=4)) for b in backends]
    rows.append(Row("kvqref", "int4_kivi", first_prompt, {}, KV_KIVI))
    return rows


@dataclass(frozen=True)
class Plan:
    tokens: int
    rows: tuple[Row, ...]


QUICK = Plan(48, tuple(fp8_rows((1, 16))))
REPORT = Plan(80, tuple(fp8_rows((1, 32))))
FULL = Plan(256, tuple(fp8_rows((1, 64)) + int_rows(64)))


def unavailable_reason() -> str | None:
    """None when transformers (the llm extra) is installed, else the install command."""
    if importlib.util.find_spec("transformers") is None:
        return "needs transformers: pip install 'kvqref[llm]'"
    return None


@torch.no_grad()
def transformers_logits(model: Any, ids: torch.Tensor, row: Row) -> tuple[torch.Tensor, Any]:
    """Logits ``[T, V]``: ``row.first_prompt`` tokens prefilled into transformers' QuantizedCache, then one
    token per forward (SDPA attention over what the cache returns)."""
    from kvqref import hf
    from kvqref.hf import builtin_caches

    cache = builtin_caches.quantized_cache(model.config, row.backend, **row.options)
    p = row.first_prompt
    with attention(model, REFERENCE_ATTENTION):
        out = [model(ids[:, :p], **hf.cache_kwargs(model, cache), use_cache=True).logits[0]]
        for t in range(p, ids.shape[1]):
            out.append(model(ids[:, t:t + 1], **hf.cache_kwargs(model, cache), use_cache=True).logits[0])
    return torch.cat(out).float(), cache


@torch.no_grad()
def kvqref_logits(model: Any, ids: torch.Tensor, row: Row) -> tuple[torch.Tensor, Any]:
    """Logits ``[T, V]``: ``row.first_prompt`` tokens prefilled (``prefill="full"``, as transformers' caches
    attend), then the rest decoded through the cache (``"as_decoded"``: equal to one token per forward)."""
    from kvqref import hf

    cache = hf.QuantizedKVCache(model.config, row.backend, k_options=row.options, v_options=row.options,
                                prefill="full", precision="exact")
    p = row.first_prompt
    with attention(model, "kvqref"):
        first = model(ids[:, :p], **hf.cache_kwargs(model, cache), use_cache=True).logits[0]
        cache.prefill = "as_decoded"
        rest = (model(ids[:, p:], **hf.cache_kwargs(model, cache), use_cache=True).logits[0] if ids.shape[1] > p
                else first[:0])
    return torch.cat([first, rest]).float(), cache


def bits_per_element(row: Row, head_dim: int, kv_heads: int) -> float:
    if row.kind == "kvqref":
        ks = schemes.get(row.backend, **{**row.options, **({"role": "key"} if "kivi" in row.backend else {})})
        vs = schemes.get(row.backend, **{**row.options, **({"role": "value"} if "kivi" in row.backend else {})})
        return (ks.bits_per_element(head_dim, kv_heads) + vs.bits_per_element(head_dim, kv_heads)) / 2
    if row.backend == "fp8":
        return 8.0
    # quanto / hqq: nbits codes + a scale and a zero (2 x 16 bits here: float32 model, but stored per group of
    # 64 as the model dtype; counted as float16 to compare with KIVI's float16 pair)
    return row.options.get("nbits", 4) + 32 / 64


@torch.no_grad()
def saturation(model: Any, ids: torch.Tensor, first_prompt: int) -> dict[str, float]:
    """For a per-tensor FP8 scale frozen on the first ``first_prompt`` tokens (amax/448, every head): the
    fraction of later K and V elements beyond ``448 * scale`` (they saturate), and the median over layers of
    (scale from the whole text) / (frozen scale)."""
    from kvqref.hf import builtin_caches

    states, _ = builtin_caches.reference_states(model, ids)
    out: dict[str, float] = {}
    for i, side in enumerate(("K", "V")):
        over = total = 0
        ratios = []
        for layer in states:
            x = layer[i].float()
            frozen = x[:, :, :first_prompt].abs().amax()
            later = x[:, :, first_prompt:].abs()
            over += int((later > frozen).sum())
            total += later.numel()
            ratios.append(float(x.abs().amax() / frozen))
        out[f"{side} saturated"] = over / max(total, 1)
        out[f"{side} scale ratio"] = float(torch.tensor(ratios).median())
    return out


def notes(rows: Sequence[dict[str, Any]], sat: dict[str, dict[str, float]]) -> list[str]:
    """What the FP8 rows show, in words: the frozen scale's saturation per first-prompt length, then
    transformers' fp8 against kvqref's fp8_e4m3 at each length."""
    out = []
    for p, s in sat.items():
        out.append(f"A per-tensor scale frozen on the first {p} token(s): the whole text's amax is "
                   f"{s['K scale ratio']:.3g}x (K) and {s['V scale ratio']:.3g}x (V) the frozen one (median over "
                   f"layers); {s['K saturated'] * 100:.3g}% of later K elements and {s['V saturated'] * 100:.3g}% "
                   "of V elements exceed 448 x scale and saturate.")
    by = {(r["cache"], str(r["first prompt"])): r for r in rows}
    for p in sat:
        a, b = by.get(("transformers fp8", p)), by.get(("kvqref fp8_e4m3", p))
        if a and b:
            out.append(f"First prompt {p}: transformers fp8 KL {a['kl']:.3g} vs kvqref fp8_e4m3 {b['kl']:.3g} "
                       f"(top-1 {a['top1']:.3f} vs {b['top1']:.3f}): one scale rule, one result; what remains "
                       "different is the rounding path (torch's float32 division and cast vs the oracle's) and "
                       "the attention (SDPA over the dequantized cache vs kvqref's).")
    tok = [r for r in rows if r["cache"] == "kvqref fp8_e4m3 (granularity=token_head)"]
    if tok and sat:
        out.append(f"kvqref fp8_e4m3 with a scale per (token, head) has nothing to freeze: KL {tok[0]['kl']:.3g} "
                   f"with a first prompt of {tok[0]['first prompt']} token(s), for 0.5 more bits per element.")
    return out


def compare(model: Any, tokenizer: Any, plan: Plan | None = None, quick: bool = False, text: str | None = None,
            progress_stream: TextIO | None = None, threads: int | None = None) -> dict[str, Any]:
    """Every row of ``plan`` (default: :data:`QUICK` or :data:`REPORT`) on the first ``plan.tokens`` tokens of the
    text; rows whose transformers backend is not installed are listed under ``unavailable``. ``threads``: as
    :func:`kvqref.eval.llm.evaluate`'s."""
    with torch_threads(threads) as n:
        res = _compare(model, tokenizer, plan, quick, text, progress_stream)
    res["threads"] = n
    return res


def _compare(model: Any, tokenizer: Any, plan: Plan | None, quick: bool, text: str | None,
             progress_stream: TextIO | None) -> dict[str, Any]:
    from kvqref.hf import builtin_caches
    from kvqref.report.progress import Progress

    why = unavailable_reason()
    if why:
        return {"skipped": why}
    plan = plan or (QUICK if quick else REPORT)
    t0 = time.perf_counter()
    text = text if text is not None else texts.python_docs()
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"][:plan.tokens]])
    if ids.shape[1] < plan.tokens:
        raise ValueError(f"the text has {ids.shape[1]} tokens; the comparison needs {plan.tokens}")
    ref = reference_logits(model, ids)[0]
    start = max(r.first_prompt for r in plan.rows)
    cfg = model.config
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    unavailable = sorted({builtin_caches.unavailable_reason(r.backend) for r in plan.rows if r.kind == "transformers"}
                         - {None})
    todo = [r for r in plan.rows if r.kind == "kvqref" or not builtin_caches.unavailable_reason(r.backend)]
    progress = Progress(len(todo), "transformers caches", progress_stream)
    rows = []
    for r in todo:
        ts = time.perf_counter()
        try:
            logits, _ = (transformers_logits if r.kind == "transformers" else kvqref_logits)(model, ids, r)
        except Exception as e:  # a third-party backend that breaks here: record it, keep the other rows
            rows.append({"cache": r.name, "first prompt": r.first_prompt, "ppl": math.nan, "kl": math.nan,
                         "top1": math.nan, "what differs": f"FAILED: {type(e).__name__}: {e}"[:300],
                         "bits_per_element": bits_per_element(r, head_dim, kv_heads)})
            progress(f"{r.name}: failed")
            continue
        stats = LogitStats()
        stats.add(ref[start - 1:-1], logits[start - 1:-1], ids[0, start:])
        res = stats.result()
        rows.append({"cache": r.name, "first prompt": r.first_prompt,
                     "bits_per_element": bits_per_element(r, head_dim, kv_heads), "ppl": res["ppl"],
                     "kl": res["kl"], "top1": res["top1"], "what differs": r.differs,
                     "seconds": time.perf_counter() - ts})
        progress(f"{r.name}, first prompt {r.first_prompt}")
    fp8_prompts = sorted({r.first_prompt for r in todo if r.backend in ("fp8", "fp8_e4m3") and not r.options})
    sat = {str(p): saturation(model, ids, p) for p in fp8_prompts}
    return {"transformers": builtin_caches.version(), "tokens": plan.tokens, "scored_from": start, "rows": rows,
            "unavailable": unavailable, "saturation": sat, "notes": notes(rows, sat),
            "seconds": time.perf_counter() - t0, "reference_ppl": math.exp(
                float(-torch.log_softmax(ref[start - 1:-1].double(), -1).gather(-1, ids[0, start:, None]).mean()))}
