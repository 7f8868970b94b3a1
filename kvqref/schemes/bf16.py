"""``bf16``: the unquantized baseline, stored as bfloat16 bit patterns."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvqref.schemes._num import bf16_value, round_bf16_bits
from kvqref.schemes.base import FieldSpec, Quantized, Scheme


class BF16Scheme(Scheme):
    """Fields ``{"data": (D,) uint16}``: bfloat16 bits, RNE from the exact float32/float64 input
    (one rounding, computed from the bits; overflow -> +-Inf, NaN -> ValueError). 16 bits/element."""

    name = "bf16"

    def fields(self, kv_heads: int, head_dim: int) -> dict[str, FieldSpec]:
        return {"data": FieldSpec((head_dim,), np.dtype(np.uint16))}

    def quantize(self, x: Any, params: dict[str, Any] | None = None) -> Quantized:
        self.check_params(params)
        arr = self.check_input(x)
        if np.isnan(arr.astype(np.float64)).any():
            raise ValueError(f"{self.name}: input holds NaN")
        return Quantized(self.name, arr.shape, {"data": round_bf16_bits(arr)}, {})

    def dequantize(self, q: Quantized) -> np.ndarray:
        return bf16_value(q.fields["data"]).astype(np.float64)

    def bits_per_element(self, head_dim: int, kv_heads: int = 1) -> float:
        return 16.0

    def describe(self) -> dict[str, str]:
        return {"scheme": self.name, "format": "bfloat16", "scale rule": "none",
                "rounding": "RNE (one rounding from the input bits)", "overflow": "+-Inf",
                "packing": "data (D,) uint16 bit patterns"}
