"""Capacity planner: how many tokens of KV cache fit in a memory budget, scale buffers counted.

Memory = ``pages * page_bytes + fixed``: ``page_bytes`` is, summed over ``layers``, the bytes of one page of
K plus V with every field of the scheme (codes, per-token scales, per-group scales: KIVI's key scale/min
per ``G`` tokens); ``fixed`` holds, per layer, the tensor-level params (a per-tensor or per-head FP8 scale,
NVFP4's global scale: float32 each) and, for KIVI, every sequence's residual buffer: ``num_seqs`` times
``W_k + W_v`` tokens of float32 K/V per layer (``W`` = the residual window R, at least G, as
:meth:`kvqref.paged.PagedKVCache.export` allocates it). Tokens = ``pages * page_size``: tokens that sit in a
residual window are not counted (a conservative figure: a sequence holds up to R more).
"""

from __future__ import annotations

import math
import re
from typing import Any

from kvqref.schemes import Scheme
from kvqref.schemes import get as get_scheme

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str | int | float) -> int:
    """Bytes of ``'80GiB'`` (2**30 units), ``'80GB'`` (10**9 units), ``'512 MiB'``, ``'1.5TB'`` or a number."""
    if isinstance(text, (int, float)):
        if text < 0:
            raise ValueError(f"memory must be >= 0, got {text}")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse memory size {text!r}; use e.g. '80GiB', '80GB', '512MiB' or bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _scheme(s: Scheme | str, role: str) -> Scheme:
    if isinstance(s, Scheme):
        if role == "value" and getattr(s, "role", "value") == "key":  # v_scheme defaulted to a KIVI key scheme
            return get_scheme(s.name, role="value", group_size=s.group_size, residual=s.residual_window)
        return s
    return get_scheme(s, role=role) if s.endswith("_kivi") else get_scheme(s)


def _params_bytes(s: Scheme, kv_heads: int) -> int:
    gran = getattr(s, "granularity", None)
    if gran == "tensor" or s.name == "nvfp4":
        return 4
    if gran == "head":
        return 4 * kv_heads
    return 0


def plan(memory: str | int, layers: int, kv_heads: int, head_dim: int, k_scheme: Scheme | str,
         v_scheme: Scheme | str | None = None, page_size: int | None = None, num_seqs: int = 1) -> dict[str, Any]:
    """Full breakdown: ``tokens``, ``pages``, ``page_bytes``, ``fixed_bytes``, ``bytes_per_token``.
    ``page_size`` defaults to the least common multiple of 16 and the schemes' token groups."""
    ks = _scheme(k_scheme, "key")
    vs = _scheme(v_scheme if v_scheme is not None else k_scheme, "value")
    if page_size is None:
        page_size = math.lcm(16, ks.token_group, vs.token_group)
    if min(layers, kv_heads, head_dim, page_size) <= 0 or num_seqs < 0:
        raise ValueError("layers, kv_heads, head_dim and page_size must be > 0 and num_seqs >= 0")
    mem = parse_memory(memory)
    page_bytes = 0
    fixed = 0
    for s in (ks, vs):
        G = s.token_group
        if page_size % G:
            raise ValueError(f"page_size {page_size} is not a multiple of {s.name}'s token group {G}")
        for spec in s.fields(kv_heads, head_dim).values():
            rows = page_size if spec.per == "token" else page_size // G
            n = 1
            for d in spec.shape:
                n *= d
            page_bytes += rows * kv_heads * n * spec.dtype.itemsize
        fixed += _params_bytes(s, kv_heads)
        if s.residual_window:
            fixed += num_seqs * max(s.residual_window, G) * kv_heads * head_dim * 4
    page_bytes *= layers
    fixed *= layers
    pages = max(0, (mem - fixed) // page_bytes)
    return {"tokens": int(pages * page_size), "pages": int(pages), "page_bytes": int(page_bytes),
            "fixed_bytes": int(fixed), "bytes_per_token": page_bytes / page_size,
            "bits_per_element": (ks.bits_per_element(head_dim, kv_heads) + vs.bits_per_element(head_dim, kv_heads))
            / 2}


def tokens_that_fit(memory_bytes: str | int, layers: int, kv_heads: int, head_dim: int, k_scheme: Scheme | str,
                    v_scheme: Scheme | str | None = None, page_size: int | None = None, num_seqs: int = 1) -> int:
    """Tokens of K and V (all ``layers``) that fit in ``memory_bytes`` (bytes or '80GiB'); see :func:`plan`.
    ``v_scheme`` defaults to ``k_scheme`` (a name is built with role='value' for KIVI)."""
    return plan(memory_bytes, layers, kv_heads, head_dim, k_scheme, v_scheme, page_size, num_seqs)["tokens"]


def capacity_ratio(scheme: Scheme | str, baseline: Scheme | str = "bf16", head_dim: int = 128) -> float:
    """``bits(baseline) / bits(scheme)`` per element: fp4_e2m1 vs bf16 = 16 / 4.5 = 3.56; vs fp8 = 8 / 4.5 = 1.78."""
    return _scheme(baseline, "value").bits_per_element(head_dim) / _scheme(scheme, "value").bits_per_element(head_dim)
