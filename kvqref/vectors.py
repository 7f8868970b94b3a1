"""Golden vectors: language-neutral test vectors (JSON) of every element format and overflow policy.

Inputs are IEEE bit patterns in hex (float32, and float64 for the single-rounding cases), outputs are
codes in hex, so a C++, Rust or CUDA implementation can test against kvqref without Python. The
inputs are chosen from the definitions: every code's value, every midpoint between neighbouring
values (ties), the points just beside each midpoint, zeros, subnormals, the overflow boundary,
+-Inf, NaN, and a fixed-seed random sample (SplitMix64, integer arithmetic). Each format's inputs are
distinct bit patterns in ascending unsigned order (:func:`canonical`), so the document depends on no
library's sort, hash or random stream. The ``"rotations"`` section holds the exact float32 outputs of
the Hadamard rotation and the fields of rotated schemes (:mod:`kvqref.rotation_vectors`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from kvqref import formats, rotation_vectors
from kvqref.schemes.rotation import splitmix64

VERSION = 2
_SEED = 20261122


def _sample(stream: int, n: int, e_lo: int, e_hi: int) -> np.ndarray:
    """``n`` float32 values ``+-m * 2**(e - 23)``: 24-bit significand m in [2**23, 2**24), exponent e
    uniform in [e_lo, e_hi], sign: bits of SplitMix64 outputs seeded with ``_SEED + stream`` (exact)."""
    vals = []
    for z in splitmix64(_SEED + stream, n):
        m = (1 << 23) | (z & ((1 << 23) - 1))
        e = e_lo + (z >> 23) % (e_hi - e_lo + 1)
        vals.append((-1.0 if (z >> 63) else 1.0) * float(np.ldexp(float(m), int(e) - 23)))
    return np.array(vals, np.float64)


def canonical(values: np.ndarray) -> np.ndarray:
    """The distinct bit patterns of float32 or float64 ``values``, in ascending order of the unsigned bit
    pattern: +0, positive values ascending, +Inf, NaN, then -0, negative values by ascending magnitude,
    -Inf, -NaN. Sorting integers makes the result independent of the input order and of numpy's sort
    algorithm (+0.0 and -0.0 compare equal as floats, so a float sort or unique may keep either)."""
    uint = {4: np.uint32, 8: np.uint64}[values.dtype.itemsize]
    return np.unique(np.ascontiguousarray(values).view(uint)).view(values.dtype)


def _candidate_inputs(codec: formats.MinifloatCodec) -> tuple[np.ndarray, np.ndarray]:
    """float32 and float64 inputs that exercise every rounding and edge of ``codec`` (with repeats, in
    construction order; :func:`canonical` makes the published order)."""
    vals = codec.decode(np.arange(codec.num_codes, dtype=np.uint8)).astype(np.float64)
    # +0.0 only (never -0.0): the positive values, distinct as floats, so sorting them is unambiguous
    pos = np.unique(vals[np.isfinite(vals) & (vals >= 0) & ~np.signbit(vals)])
    mids = (pos[:-1] + pos[1:]) / 2
    top = pos[-1]
    gap = top - pos[-2]
    edges = [0.0, pos[1] / 4, pos[1] / 2, pos[1], top + gap / 2, top + gap, top * 2, 1e30, np.inf, np.nan]
    f32 = np.concatenate([pos, mids, np.nextafter(mids.astype(np.float32), np.float32(np.inf)),
                          np.nextafter(mids.astype(np.float32), np.float32(0)), np.array(edges)])
    e_small = int(np.frexp(pos[1])[1]) - 1  # floor(log2) of the smallest positive value
    e_top = int(np.frexp(top)[1]) - 1
    f32 = np.concatenate([f32, _sample(0, 48, e_small, e_top + 1), _sample(1, 16, e_small - 2, e_small + 2)])
    with np.errstate(over="ignore"):
        f32 = f32.astype(np.float32)
    f32 = np.concatenate([f32, -f32])
    # float64 inputs one float64 ulp beside each midpoint: a double rounding via float32 gets them wrong.
    m = mids[mids > 0]
    f64 = np.concatenate([np.nextafter(m, np.inf), np.nextafter(m, 0)])
    f64 = np.concatenate([f64, -f64])
    if codec.spec.name == "float8_e8m0fnu":
        f32 = f32[~(f32 < 0)]
        f64 = f64[f64 > 0]
    if not codec.spec.has_nan:
        f32 = f32[~np.isnan(f32)]
    return f32, f64


def _interesting_inputs(codec: formats.MinifloatCodec) -> tuple[np.ndarray, np.ndarray]:
    """The published inputs of ``codec``: :func:`canonical` of :func:`_candidate_inputs`."""
    f32, f64 = _candidate_inputs(codec)
    return canonical(f32), canonical(f64)


def _hex(arr: np.ndarray, width: int) -> list[str]:
    return [f"0x{int(v):0{width}x}" for v in arr]


def generate() -> dict[str, Any]:
    """Build the golden-vector document (deterministic)."""
    doc: dict[str, Any] = {
        "kvqref_golden_vectors": VERSION,
        "rule": "round to nearest, ties to even, one rounding from the exact input; see docs/formats.md",
        "layout": "inputs are distinct IEEE bit patterns (hex) in ascending unsigned order; codes are "
                  "space-separated hex bytes, one per input",
        "formats": {},
    }
    for name in formats.names():
        codec = formats.get(name)
        f32, f64 = _interesting_inputs(codec)
        entry: dict[str, Any] = {"bits": codec.bits, "bias": codec.bias, "max_finite": codec.max_finite,
                                 "behaviour": codec.describe(), "cases": []}
        policies: list[dict[str, Any]]
        if isinstance(codec, formats.E8M0Codec):
            policies = [{"saturate": s, "rounding": r} for s in (True, False) for r in formats.ROUNDINGS]
        else:
            policies = [{"saturate": True}, {"saturate": False}]
        for kwargs in policies:
            for dtype, arr, width in (("float32", f32, 8), ("float64", f64, 16)):
                bits = arr.view(np.uint32 if dtype == "float32" else np.uint64)
                entry["cases"].append({
                    **kwargs, "input_dtype": dtype,
                    "inputs": _hex(bits, width),
                    "codes": " ".join(f"{int(c):02x}" for c in codec.encode(arr, **kwargs)),
                })
        doc["formats"][name] = entry
    doc["rotations"] = rotation_vectors.generate()
    return doc


def dumps(doc: dict[str, Any]) -> str:
    """JSON with one line per case, so diffs stay readable."""
    head = {k: v for k, v in doc.items() if k not in ("formats", "rotations")}
    lines = ["{"] + [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()] + [' "formats": {']
    names = list(doc["formats"])
    for i, name in enumerate(names):
        entry = doc["formats"][name]
        lines.append(f"  {json.dumps(name)}: {{")
        lines += [f"   {json.dumps(k)}: {json.dumps(v)}," for k, v in entry.items() if k != "cases"]
        lines.append('   "cases": [')
        cases = entry["cases"]
        lines += [f"    {json.dumps(c, separators=(',', ':'))}" + ("," if j < len(cases) - 1 else "")
                  for j, c in enumerate(cases)]
        lines.append("   ]")
        lines.append("  }" + ("," if i < len(names) - 1 else ""))
    lines.append(" }" + ("," if "rotations" in doc else ""))
    if "rotations" in doc:
        rot = doc["rotations"]
        lines.append(' "rotations": {')
        lines += [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in rot.items() if k not in ("cases", "schemes")]
        for key, last in (("cases", False), ("schemes", True)):
            lines.append(f"  {json.dumps(key)}: [")
            rows = rot[key]
            lines += [f"   {json.dumps(c, separators=(',', ':'))}" + ("," if j < len(rows) - 1 else "")
                      for j, c in enumerate(rows)]
            lines.append("  ]" + ("" if last else ","))
        lines.append(" }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def write(out_dir: str | Path) -> Path:
    """Write ``golden_vectors.json`` into ``out_dir`` and return its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "golden_vectors.json"
    path.write_text(dumps(generate()))
    return path
