"""Section 1 of the report: element formats (range) and schemes (bits per element with scales, token
capacity against BF16 and FP8 through :mod:`kvqref.capacity`), with SGLang's FP4 capacity claim checked."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvqref import capacity, formats, schemes
from kvqref.report.section import Context, Section
from kvqref.report.tables import write_table

TITLE = "1. Formats and schemes"
CAPACITY_SHAPE = {"memory": "80GiB", "layers": 32, "kv_heads": 8, "head_dim": 128}
#: (label, K scheme, V scheme) of the capacity table; KIVI's K/V roles are set by kvqref.capacity
CAPACITY_SCHEMES = ("bf16", "fp8_e4m3", "fp8_e5m2", ("fp8_e4m3", {"granularity": "token_head"}), "fp4_e2m1",
                    "mxfp4", "nvfp4", "int4_kivi", "int2_kivi")
FORMAT_COLUMNS = ("format", "bits", "E", "M", "bias", "max finite", "min normal", "min subnormal", "range (binades)")
CAPACITY_COLUMNS = ("scheme", "element bits", "bits/elem with scales", "scale overhead bits",
                    "bytes/token (all layers, K+V)", "tokens", "x BF16 (bits)", "x FP8 (bits)", "x BF16 (tokens)",
                    "x FP8 (tokens)")


def formats_rows() -> list[dict[str, Any]]:
    rows = []
    for name in formats.names():
        c = formats.get(name)
        smallest = c.min_subnormal if c.spec.subnormals else c.min_normal
        rows.append({"format": name, "bits": c.bits, "E": c.spec.ebits, "M": c.spec.mbits, "bias": c.bias,
                     "max finite": float(c.max_finite), "min normal": float(c.min_normal),
                     "min subnormal": float(c.min_subnormal) if c.spec.subnormals else math.nan,
                     "range (binades)": math.log2(float(c.max_finite) / float(smallest))})
    return rows


def _cap_scheme(entry) -> tuple[str, Any]:
    if isinstance(entry, tuple):
        name, opts = entry
        return f"{name} ({', '.join(f'{k}={v}' for k, v in opts.items())})", schemes.get(name, **opts)
    return entry, entry


def capacity_rows(memory: str | int = "80GiB", layers: int = 32, kv_heads: int = 8, head_dim: int = 128,
                  names: Sequence[Any] = CAPACITY_SCHEMES, num_seqs: int = 1) -> list[dict[str, Any]]:
    """Per scheme: bits/element (elements only, and with scales), bytes per token (all layers, K+V), tokens
    that fit (:func:`kvqref.capacity.plan`) and capacity relative to BF16 and FP8 (E4M3, per-tensor)."""
    plans = {}
    for entry in ("bf16", "fp8_e4m3", *names):
        label, s = _cap_scheme(entry)
        plans[label] = (plan_of(s, memory, layers, kv_heads, head_dim, num_seqs), s)
    base_bf16, base_fp8 = plans["bf16"][0], plans["fp8_e4m3"][0]
    rows = []
    for entry in names:
        label, _ = _cap_scheme(entry)
        p, s = plans[label]
        elem = _element_bits(s)
        rows.append({"scheme": label, "element bits": elem, "bits/elem with scales": p["bits_per_element"],
                     "scale overhead bits": p["bits_per_element"] - elem,
                     "bytes/token (all layers, K+V)": p["bytes_per_token"], "tokens": p["tokens"],
                     "x BF16 (bits)": 16 / p["bits_per_element"], "x FP8 (bits)": 8 / p["bits_per_element"],
                     "x BF16 (tokens)": p["tokens"] / base_bf16["tokens"],
                     "x FP8 (tokens)": p["tokens"] / base_fp8["tokens"]})
    return rows


def plan_of(s: Any, memory, layers, kv_heads, head_dim, num_seqs=1) -> dict[str, Any]:
    return capacity.plan(memory, layers, kv_heads, head_dim, s, None, num_seqs=num_seqs)


def _element_bits(s: Any) -> float:
    """Bits of the element code alone (no scale): the width of the element format."""
    sch = capacity._scheme(s, "value") if isinstance(s, str) else s
    name = sch.name
    if name == "bf16":
        return 16.0
    if name.startswith("fp8"):
        return 8.0
    if name in ("fp4_e2m1", "mxfp4", "nvfp4"):
        return 4.0
    return float(sch.bits)


def sglang_fp4_claim(head_dim: int = 128) -> dict[str, Any]:
    """SGLang's "~3.56x BF16, ~1.78x FP8" for FP4 block 16, recomputed from the scheme's layout."""
    s = schemes.get("fp4_e2m1")
    with_scale = s.bits_per_element(head_dim)
    elem = _element_bits(s)
    bf16, fp8 = schemes.get("bf16").bits_per_element(head_dim), schemes.get("fp8_e4m3").bits_per_element(head_dim)
    p = {n: plan_of(n, **{k: CAPACITY_SHAPE[k] for k in ("memory", "layers", "kv_heads")}, head_dim=head_dim)
         for n in ("bf16", "fp8_e4m3", "fp4_e2m1")}
    return {"bits with E8M0 scale": with_scale, "element bits": elem,
            "vs BF16 with scale": bf16 / with_scale, "vs FP8 with scale": fp8 / with_scale,
            "vs BF16 elements only": bf16 / elem, "vs FP8 elements only": fp8 / elem,
            "vs BF16 tokens (capacity plan)": p["fp4_e2m1"]["tokens"] / p["bf16"]["tokens"],
            "vs FP8 tokens (capacity plan)": p["fp4_e2m1"]["tokens"] / p["fp8_e4m3"]["tokens"]}


def e4m3_range() -> dict[str, float]:
    return {"float8_e4m3fn": float(formats.get("float8_e4m3fn").max_finite),
            "float8_e4m3fnuz": float(formats.get("float8_e4m3fnuz").max_finite)}


def build(ctx: Context) -> Section:
    out = ctx.out
    f_md = write_table(out, "formats", formats_rows(), FORMAT_COLUMNS,
                       "Element formats: range; range in binades = log2(max finite / smallest positive)")
    cap = capacity_rows(**CAPACITY_SHAPE)
    c_md = write_table(out, "capacity", cap, CAPACITY_COLUMNS,
                       "Token capacity in 80 GiB, 32 layers, 8 KV heads, head_dim 128")
    fp4 = sglang_fp4_claim()
    holds = round(fp4["vs BF16 with scale"], 2) == 3.56 and round(fp4["vs FP8 with scale"], 2) == 1.78
    rng = e4m3_range()
    body = "\n".join([
        f_md, "", f"Capacity, {CAPACITY_SHAPE['memory']}, {CAPACITY_SHAPE['layers']} layers, "
        f"{CAPACITY_SHAPE['kv_heads']} KV heads, head_dim {CAPACITY_SHAPE['head_dim']} (K and V, every field "
        "counted; KIVI: one sequence's residual window reserved; FP8 'x' columns are against fp8_e4m3 per-tensor):",
        "", c_md, "",
        f"SGLang's claim for block-16 FP4 (3.56x BF16, 1.78x FP8): with the E8M0 scale counted "
        f"({fp4['bits with E8M0 scale']:g} bits/element) the ratios are {fp4['vs BF16 with scale']:.4f}x and "
        f"{fp4['vs FP8 with scale']:.4f}x, which round to "
        f"{fp4['vs BF16 with scale']:.2f}x and {fp4['vs FP8 with scale']:.2f}x: "
        f"{'the claims hold' if holds else 'the claims do NOT hold'}"
        f" (elements only, without the scale, they would be {fp4['vs BF16 elements only']:.2f}x and "
        f"{fp4['vs FP8 elements only']:.2f}x). In whole pages of the capacity plan: "
        f"{fp4['vs BF16 tokens (capacity plan)']:.4f}x and {fp4['vs FP8 tokens (capacity plan)']:.4f}x.",
        "",
        f"E4M3's range: E4M3FN (OCP; CUDA; torch.float8_e4m3fn) max {rng['float8_e4m3fn']:g}; E4M3FNUZ (AMD "
        f"MI300) max {rng['float8_e4m3fnuz']:g}. SGLang's docs page gives +-240 for E4M3, which is the FNUZ "
        "figure (docs/engines.md)."])
    return Section(TITLE, body, {"capacity": cap, "sglang_fp4": fp4, "e4m3_range": rng})
