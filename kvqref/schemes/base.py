"""What a KV cache scheme is: element codes plus scales, grouped and packed in a fixed layout.

A scheme quantizes a K or V tensor of shape ``[tokens, kv_heads, head_dim]`` into a
:class:`Quantized` container and dequantizes it back. The container's ``fields`` are per-token arrays
whose first two axes are ``[tokens, kv_heads]`` (or ``[tokens // G, kv_heads]`` for fields shared by a
group of G tokens, as KIVI's key scales); ``params`` hold tensor-level values (a per-tensor FP8 scale,
NVFP4's global scale). The paged cache stores exactly these fields with ``tokens`` replaced by slots, so
a kernel that writes a slot must produce the bytes the oracle's ``quantize`` produces for that token.
The layout of every scheme is documented in docs/schemes.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvqref.schemes.validate import check_real_input


@dataclass(frozen=True)
class FieldSpec:
    """One stored array: ``shape`` after the leading ``[tokens (or token groups), kv_heads]`` axes."""

    shape: tuple[int, ...]
    dtype: np.dtype
    per: str = "token"  # "token", or "group" (shared by `token_group` consecutive tokens)


@dataclass
class Quantized:
    """A quantized K or V tensor: per-token ``fields`` and tensor-level ``params``."""

    scheme: str
    shape: tuple[int, int, int]  # [tokens, kv_heads, head_dim] of the original tensor
    fields: dict[str, np.ndarray]
    params: dict[str, Any] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes stored: every field plus array-valued params."""
        n = sum(a.nbytes for a in self.fields.values())
        return n + sum(np.asarray(v).nbytes for v in self.params.values() if isinstance(v, np.ndarray))


class Scheme(ABC):
    """Element dtype + scale granularity + packing (+ residual window): one way to store K or V."""

    name: str = ""
    #: consecutive tokens that share a field ("group" fields); 1 for per-token schemes
    token_group: int = 1
    #: most recent tokens a cache keeps in full precision (KIVI's residual window R); 0 for the others
    residual_window: int = 0
    #: the engine profile whose arithmetic the scheme reproduces
    profile: str = "ocp"

    @abstractmethod
    def fields(self, kv_heads: int, head_dim: int) -> dict[str, FieldSpec]:
        """The stored arrays of one token (or token group) and their shapes after ``[., kv_heads]``."""

    @abstractmethod
    def quantize(self, x: np.ndarray, params: dict[str, Any] | None = None) -> Quantized:
        """Quantize ``x`` of shape ``[tokens, kv_heads, head_dim]``.

        ``params``: tensor-level parameters to use instead of computing them from ``x`` (a paged cache
        freezes them at its first append; see :meth:`calibrate`).
        """

    def calibrate(self, x: np.ndarray) -> dict[str, Any]:
        """Tensor-level parameters (scales shared by every token) that :meth:`quantize` would use for ``x``."""
        return {}

    def paged_tokens(self, total: int) -> int:
        """Of ``total`` tokens of a sequence, how many are quantized (the rest stay in the residual)."""
        return total

    @abstractmethod
    def dequantize(self, q: Quantized) -> np.ndarray:
        """The values the cache represents, float64, shape ``[tokens, kv_heads, head_dim]``."""

    @abstractmethod
    def bits_per_element(self, head_dim: int, kv_heads: int = 1) -> float:
        """Stored bits per K or V element, scale overhead included."""

    def check_params(self, params: dict[str, Any] | None, kv_heads: int | None = None) -> dict[str, Any]:
        """Check user-given tensor-level ``params`` (see :mod:`kvqref.schemes.validate`) and return them in
        the form :meth:`quantize` uses. Schemes without tensor-level parameters accept ``None`` or ``{}``."""
        if params:
            raise ValueError(f"{self.name}: takes no tensor-level params, got {sorted(params)}")
        return {}

    def check_input(self, x: Any) -> np.ndarray:
        """Validate ``[tokens, kv_heads, head_dim]`` real input; return it as a NumPy array. Integer input is
        taken as the values it holds; complex, boolean and non-numeric input raises TypeError."""
        arr = check_real_input(self.name, x)
        if arr.ndim != 3:
            raise ValueError(f"{self.name}: expected [tokens, kv_heads, head_dim], got shape {arr.shape}")
        return arr

    def describe(self) -> dict[str, str]:
        """One row of the schemes table in docs/schemes.md."""
        return {"scheme": self.name}

    def __repr__(self) -> str:
        return f"<scheme {self.name}>"
