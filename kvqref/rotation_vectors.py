"""Golden vectors of rotated caches (the ``"rotations"`` section of ``kvqref vectors``).

* ``cases``: the exact float32 outputs of the Hadamard rotation (docs/rotation.md) for head_dim 2 ... 256:
  per case the seed, its sign vector (``+``/``-``), and the input and output float32 bit patterns (hex),
  ``tokens`` vectors of ``head_dim`` elements, row-major.
* ``schemes``: the stored fields of rotated schemes for one fixed ``[tokens, kv_heads, head_dim]`` input:
  every element as the hex bit pattern of its field's dtype (uint8: 2 digits, float16: 4, float32: 8),
  C order; ``params`` likewise.

Inputs come from SplitMix64 through integer arithmetic only (no NumPy RNG, no sort), so the document is
byte-identical on every platform and NumPy version.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvqref import schemes
from kvqref.schemes.rotation import HadamardRotation, splitmix64

RULE = ("z = f32(f32_butterflies(f32(x) * signs) * C_D): butterfly stages h = 1, 2, ..., D/2, each "
        "(y[j], y[j+h]) <- (f32(y[j] + y[j+h]), f32(y[j] - y[j+h])) for j & h == 0; C_D = f32(1/sqrt(D)); "
        "signs[i] = -1 iff bit 63 of the i-th SplitMix64 output of the seed is set; see docs/rotation.md")
HEAD_DIMS = (2, 4, 8, 16, 32, 64, 128, 256)
#: (scheme, options) of the scheme cases; each rotated with SCHEME_SEED
SCHEME_CASES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("bf16", {}), ("fp8_e4m3", {}), ("fp8_e4m3", {"granularity": "token_head"}), ("fp8_e5m2", {}),
    ("fp4_e2m1", {}), ("fp4_e2m1", {"profile": "sglang"}), ("mxfp4", {}), ("nvfp4", {}),
    ("int4_kivi", {"role": "key", "group_size": 4, "residual": 4}), ("int4_kivi", {"role": "value"}),
    ("int2_kivi", {"role": "key", "group_size": 4, "residual": 4}), ("int2_kivi", {"role": "value"}),
)
SCHEME_SEED = 7
SCHEME_SHAPE = (4, 2, 64)


def spread_inputs(stream: int, n: int) -> np.ndarray:
    """``n`` float32 values from SplitMix64 output ``u`` of seed ``stream``: ``m * 2**(e - 23)`` with
    ``m = (u >> 40) - 2**23`` (a 24-bit signed integer) and ``e = ((u >> 32) & 7) - 3``: exact in float32,
    magnitudes from ~2**-26 to 2**4, so the butterflies round."""
    vals = [((u >> 40) - (1 << 23)) * 2.0 ** ((((u >> 32) & 7) - 3) - 23) for u in splitmix64(stream, n)]
    return np.array(vals, dtype=np.float32)


def _hex(arr: np.ndarray) -> str:
    a = np.ascontiguousarray(arr)
    width = {1: 2, 2: 4, 4: 8}[a.dtype.itemsize]
    bits = a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]).ravel()
    return " ".join(f"{int(b):0{width}x}" for b in bits)


def rotation_inputs(head_dim: int) -> np.ndarray:
    """float32 [3, D]: spread values; the same with one outlier channel (1000.0); tiny values (subnormal
    float32 included: the spread values times 2**-130)."""
    base = spread_inputs(head_dim, 3 * head_dim).reshape(3, head_dim)
    base[1, head_dim // 3] = np.float32(1000.0)
    base[2] = (base[2].astype(np.float64) * 2.0**-130).astype(np.float32)
    return base


def generate() -> dict[str, Any]:
    """The ``"rotations"`` section (deterministic)."""
    cases = []
    for D in HEAD_DIMS:
        for seed in (D, 2**64 - 1):
            rot = HadamardRotation(seed)
            x = rotation_inputs(D)
            cases.append({"seed": str(seed), "head_dim": D, "tokens": int(x.shape[0]),
                          "signs": "".join("-" if s < 0 else "+" for s in rot.signs(D)),
                          "inputs": _hex(x), "outputs": _hex(rot.rotate(x))})
    T, H, D = SCHEME_SHAPE
    x = spread_inputs(1, T * H * D).reshape(T, H, D)
    x[:, :, 5] *= np.float32(50.0)  # an outlier channel
    scheme_cases = []
    for name, opts in SCHEME_CASES:
        s = schemes.get(name, rotation="hadamard", rotation_seed=SCHEME_SEED, **opts)
        q = s.quantize(x)
        scheme_cases.append({
            "scheme": name, "options": opts, "rotation_seed": SCHEME_SEED, "shape": list(SCHEME_SHAPE),
            "inputs": _hex(x), "fields": {f: _hex(a) for f, a in q.fields.items()},
            "params": {p: _hex(np.asarray(v, np.float32)) for p, v in q.params.items()},
        })
    return {"rule": RULE, "layout": "hex bit patterns, space-separated, row-major; seeds are decimal strings",
            "cases": cases, "schemes": scheme_cases}
