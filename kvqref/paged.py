"""A paged KV cache that stores exactly the fields of a scheme, slot by slot, as serving engines do.

Storage of K (and likewise V): for every field of the scheme, an array
``[num_pages, page_size, kv_heads, *field.shape]`` (per-token fields) or
``[num_pages, page_size // G, kv_heads, *field.shape]`` (fields shared by a group of G tokens: KIVI keys;
``page_size % G == 0`` is required). Token ``t`` of sequence ``b`` lives in slot
``block_table[b, t // page_size] * page_size + t % page_size``; its token group in group slot
``block_table[b, t // page_size] * (page_size // G) + (t % page_size) // G``.

Input precision: :meth:`PagedKVCache.append` rounds K and V to float32 (RNE) first, as an engine's
activations are float32 or narrower; the residual window is stored in float32 (KIVI keeps float16).
The model dtype is kept: float16 and bfloat16 (ml_dtypes) input reach ``scheme.quantize`` as arrays of
that dtype (exactly: float32 holds them), so engine profiles compute in the model's dtype; every append
must then use the dtype of the first one.

Rotated schemes (docs/rotation.md): the cache stores the rotated domain everywhere: pages hold the inner
scheme's fields of ``rotate(x)`` and the residual window holds ``rotate(x)`` (float32, the exact rotation
rule), so a backend gets one domain from :meth:`PagedKVCache.export`; :meth:`PagedKVCache.dequantized`
returns original-domain values and :meth:`PagedKVCache.storage_view` the stored ones.

Tensor-level params (a per-tensor or per-head FP8 scale, NVFP4's global scale) are per cache: given at
creation (``k_params`` / ``v_params``) or else computed by ``scheme.calibrate`` from the first chunk that
is quantized, then frozen; every later token is quantized with them. So appending a tensor in pieces
gives the same bytes as ``scheme.quantize(whole, params=cache.k_params)``.

Lengths (int32 ``[batch]``): ``seq_lens`` = tokens of each sequence; ``k_lens`` / ``v_lens`` = tokens
stored in pages (equal to ``seq_lens`` for every scheme without a residual window). For KIVI the rest,
tokens ``[k_lens, seq_lens)`` of K and ``[v_lens, seq_lens)`` of V, are in the residual (see
:meth:`kvqref.schemes.Scheme.paged_tokens` for the rule).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from kvqref.formats import as_exact_float
from kvqref.schemes import Quantized, Scheme
from kvqref.schemes import get as get_scheme
from kvqref.schemes.rotation import rotation_of, storage_scheme
from kvqref.schemes.validate import check_real_input


class OutOfPagesError(RuntimeError):
    """The free list is empty."""


class _Side:
    """Storage, params and residuals of K or of V."""

    def __init__(self, label: str, scheme: Scheme, num_pages: int, page_size: int, kv_heads: int,
                 head_dim: int, batch: int, params: dict[str, Any] | None) -> None:
        self.label, self.scheme = label, scheme
        self.rotation, self.codec = rotation_of(scheme), storage_scheme(scheme)  # codec: encodes stored values
        G = scheme.token_group
        if page_size % G:
            raise ValueError(f"{label}: page_size {page_size} is not a multiple of {scheme.name}'s token group {G}")
        self.specs = scheme.fields(kv_heads, head_dim)
        self.storage: dict[str, np.ndarray] = {}
        for f, spec in self.specs.items():
            rows = page_size if spec.per == "token" else page_size // G
            self.storage[f] = np.zeros((num_pages, rows, kv_heads, *spec.shape), dtype=spec.dtype)
        self.params = None if params is None else scheme.check_params(params, kv_heads)
        self.paged = np.zeros(batch, dtype=np.int64)
        self.residual = [np.zeros((0, kv_heads, head_dim), np.float32) for _ in range(batch)]

    def to_storage(self, x: np.ndarray) -> np.ndarray:
        """float32 tokens in the stored domain (rotated for a rotated scheme)."""
        return self.scheme.rotate_input(x) if self.rotation is not None else x

    def storage_side(self) -> _Side:
        """This side seen by its codec: same arrays, no rotation."""
        side = copy.copy(self)
        side.scheme, side.rotation = self.codec, None
        return side


class PagedKVCache:
    """Paged K/V storage through two schemes. Sequences are ``seq_id`` in ``[0, batch)``."""

    def __init__(self, k_scheme: Scheme | str, v_scheme: Scheme | str, num_pages: int, page_size: int,
                 kv_heads: int, head_dim: int, *, batch: int = 1, max_pages: int | None = None,
                 k_params: dict[str, Any] | None = None, v_params: dict[str, Any] | None = None,
                 free_pages: list[int] | None = None) -> None:
        for nm, val in (("num_pages", num_pages), ("page_size", page_size), ("kv_heads", kv_heads),
                        ("head_dim", head_dim), ("batch", batch)):
            if int(val) != val or val <= 0:
                raise ValueError(f"PagedKVCache: {nm} must be a positive integer, got {val!r}")
        if isinstance(k_scheme, str):
            k_scheme = get_scheme(k_scheme, role="key") if k_scheme.endswith("_kivi") else get_scheme(k_scheme)
        if isinstance(v_scheme, str):
            v_scheme = get_scheme(v_scheme, role="value") if v_scheme.endswith("_kivi") else get_scheme(v_scheme)
        if getattr(k_scheme, "role", "key") != "key" or getattr(v_scheme, "role", "value") != "value":
            raise ValueError("PagedKVCache: KIVI schemes need role='key' for K and role='value' for V")
        self.num_pages, self.page_size = num_pages, page_size
        self.kv_heads, self.head_dim, self.batch = kv_heads, head_dim, batch
        self.max_pages = num_pages if max_pages is None else max_pages
        self.k = _Side("K", k_scheme, num_pages, page_size, kv_heads, head_dim, batch, k_params)
        self.v = _Side("V", v_scheme, num_pages, page_size, kv_heads, head_dim, batch, v_params)
        self.block_table = np.full((batch, self.max_pages), -1, dtype=np.int32)
        self.seq_lens = np.zeros(batch, dtype=np.int32)
        #: "float16" / "bfloat16" / "float32" (float32 and float64 input), fixed by the first append
        self.model_dtype: str | None = None
        order = list(range(num_pages)) if free_pages is None else [int(p) for p in free_pages]
        if sorted(order) != list(range(num_pages)):
            raise ValueError("PagedKVCache: free_pages must be a permutation of range(num_pages)")
        self.free = order

    # -- properties -----------------------------------------------------------------------------
    @property
    def k_scheme(self) -> Scheme:
        return self.k.scheme

    @property
    def v_scheme(self) -> Scheme:
        return self.v.scheme

    @property
    def k_params(self) -> dict[str, Any] | None:
        return self.k.params

    @property
    def v_params(self) -> dict[str, Any] | None:
        return self.v.params

    def pages_of(self, seq_id: int) -> np.ndarray:
        """The pages held by ``seq_id``, in order."""
        row = self.block_table[self._seq(seq_id)]
        return row[row >= 0]

    def _seq(self, seq_id: int) -> int:
        if not (0 <= int(seq_id) < self.batch) or int(seq_id) != seq_id:
            raise ValueError(f"seq_id must be an integer in [0, {self.batch}), got {seq_id!r}")
        return int(seq_id)

    # -- addressing -----------------------------------------------------------------------------
    def slot_mapping(self, seq_id: int, start: int, n: int) -> np.ndarray:
        """int64 slots ``page * page_size + offset`` of tokens ``[start, start + n)`` of ``seq_id``."""
        b = self._seq(seq_id)
        if start < 0 or n < 0:
            raise ValueError(f"slot_mapping: start and n must be >= 0, got {start}, {n}")
        pos = np.arange(start, start + n, dtype=np.int64)
        pidx = pos // self.page_size
        if n and pidx[-1] >= self.max_pages:
            raise ValueError(f"slot_mapping: token {start + n - 1} is beyond {self.max_pages} pages per sequence")
        pages = self.block_table[b, pidx].astype(np.int64)
        if (pages < 0).any():
            raise ValueError(f"slot_mapping: tokens [{start}, {start + n}) of sequence {b} are not all allocated")
        return pages * self.page_size + pos % self.page_size

    def _group_slots(self, b: int, start: int, n_groups: int, G: int) -> np.ndarray:
        pos = start + G * np.arange(n_groups, dtype=np.int64)
        pages = self.block_table[b, pos // self.page_size].astype(np.int64)
        return pages * (self.page_size // G) + (pos % self.page_size) // G

    # -- writing --------------------------------------------------------------------------------
    def _check_chunk(self, name: str, x: Any) -> np.ndarray:
        arr = check_real_input(f"append: {name}", x)
        if arr.ndim != 3 or arr.shape[1:] != (self.kv_heads, self.head_dim):
            raise ValueError(f"append: {name} must be [tokens, {self.kv_heads}, {self.head_dim}], got {arr.shape}")
        return as_exact_float(arr).astype(np.float32)

    def _model_dtype(self, kdt: np.dtype, vdt: np.dtype) -> np.dtype | None:
        """The 16-bit model dtype of K/V (None for float32/float64 input); the same for every append."""
        if kdt != vdt:
            raise ValueError(f"append: k is {kdt} and v is {vdt}; a model has one dtype")
        md = kdt if kdt.name in ("float16", "bfloat16") else None
        name = md.name if md is not None else "float32"
        if self.model_dtype is not None and self.model_dtype != name:
            raise ValueError(f"append: k/v are {kdt} but earlier appends were {self.model_dtype}; a model has one "
                             "dtype")
        self.model_dtype = name
        return md

    def append(self, seq_id: int, k: Any, v: Any) -> None:
        """Append tokens ``k``, ``v`` ``[n, kv_heads, head_dim]`` to ``seq_id``, quantizing the tokens that
        leave the residual window and writing their fields into slots; pages come from the free list."""
        b = self._seq(seq_id)
        k32, v32 = self._check_chunk("k", k), self._check_chunk("v", v)
        model_dtype = self._model_dtype(np.asarray(k).dtype, np.asarray(v).dtype)
        if k32.shape[0] != v32.shape[0]:
            raise ValueError(f"append: k has {k32.shape[0]} tokens and v has {v32.shape[0]}")
        total = int(self.seq_lens[b]) + k32.shape[0]
        plans = []
        for side, new in ((self.k, k32), (self.v, v32)):
            pending = np.concatenate([side.residual[b], side.to_storage(new)])  # tokens [paged, total), stored
            now = int(side.paged[b])
            target = side.scheme.paged_tokens(total)
            if target < now:
                raise AssertionError(f"{side.label}: paged_tokens decreased")  # a scheme bug, not user input
            chunk = pending[: target - now]
            params = side.params
            quant = None
            if len(chunk):
                if model_dtype is not None and side.rotation is None:
                    chunk = chunk.astype(model_dtype)  # exact: the values came from that dtype
                # (rotated values are float32, quantized as float32 input, as RotatedScheme.quantize does)
                if params is None:
                    params = side.codec.calibrate(chunk)
                quant = side.codec.quantize(chunk, params=params)
            plans.append((side, now, target, quant, params, pending[target - now:]))
        need = -(-max(p[2] for p in plans) // self.page_size)
        have = int((self.block_table[b] >= 0).sum())
        if need > self.max_pages:
            raise ValueError(f"append: sequence {b} would need {need} pages; max_pages is {self.max_pages}")
        if need - have > len(self.free):
            raise OutOfPagesError(f"append: sequence {b} needs {need - have} more pages, {len(self.free)} free")
        for i in range(have, need):
            self.block_table[b, i] = self.free.pop(0)
        for side, now, target, quant, params, rest in plans:
            side.params = params
            if quant is not None:
                self._write(side, b, now, target, quant)
            side.paged[b] = target
            side.residual[b] = rest.copy()
        self.seq_lens[b] = total

    def _write(self, side: _Side, b: int, start: int, stop: int, q: Quantized) -> None:
        slots = self.slot_mapping(b, start, stop - start)
        G = side.scheme.token_group
        for f, spec in side.specs.items():
            store = side.storage[f]
            if spec.per == "token":
                store.reshape(-1, *store.shape[2:])[slots] = q.fields[f]
            else:
                if start % G or stop % G:
                    raise AssertionError(f"{side.label}: group field written at an unaligned token range")
                gs = self._group_slots(b, start, (stop - start) // G, G)
                store.reshape(-1, *store.shape[2:])[gs] = q.fields[f]

    # -- reading --------------------------------------------------------------------------------
    def quantized(self, seq_id: int, which: str) -> Quantized:
        """The paged part of K (``which="k"``) or V of ``seq_id`` gathered back into a container."""
        b = self._seq(seq_id)
        side = {"k": self.k, "v": self.v}[which]
        n = int(side.paged[b])
        slots = self.slot_mapping(b, 0, n)
        G = side.scheme.token_group
        fields = {}
        for f, spec in side.specs.items():
            store = side.storage[f]
            flat = store.reshape(-1, *store.shape[2:])
            fields[f] = flat[slots] if spec.per == "token" else flat[self._group_slots(b, 0, n // G, G)]
        return Quantized(side.scheme.name, (n, self.kv_heads, self.head_dim), fields, dict(side.params or {}))

    def dequantized(self, seq_id: int) -> tuple[np.ndarray, np.ndarray]:
        """float64 ``(K, V)`` ``[seq_len, kv_heads, head_dim]``: the paged part, then the residual (original
        domain: a rotated side's values are un-rotated)."""
        b = self._seq(seq_id)
        out = []
        for which, side in (("k", self.k), ("v", self.v)):
            q = self.quantized(b, which)
            paged = side.scheme.dequantize(q) if q.shape[0] else np.zeros((0, self.kv_heads, self.head_dim))
            res = side.residual[b].astype(np.float64)
            out.append(np.concatenate([paged, res if side.rotation is None else side.rotation.unrotate(res)]))
        return out[0], out[1]

    def storage_view(self) -> PagedKVCache:
        """A read-only view of this cache (it shares every array) whose schemes are the codecs of the stored
        values: a rotated scheme is replaced by the scheme it wraps, so ``dequantized`` gives the stored
        (rotated-domain) values. The identity for a cache without rotation. Never append to a view."""
        view = copy.copy(self)
        view.k, view.v = self.k.storage_side(), self.v.storage_side()
        return view

    def export(self) -> dict[str, np.ndarray]:
        """Every array a backend needs, flat: ``k_<field>``, ``v_<field>`` (the page storage),
        ``k_param_<name>``/``v_param_<name>``, ``block_table`` int32 [batch, max_pages] (-1 unused),
        ``seq_lens``, ``k_lens``, ``v_lens`` int32 [batch], ``k_residual``/``v_residual`` float32
        [batch, W, kv_heads, head_dim] (W = the largest residual a scheme can hold) and
        ``k_residual_lens``/``v_residual_lens`` int32 [batch]. Everything is in the stored domain (rotated for a
        rotated scheme)."""
        out: dict[str, np.ndarray] = {"block_table": self.block_table.copy(), "seq_lens": self.seq_lens.copy()}
        for tag, side in (("k", self.k), ("v", self.v)):
            for f, arr in side.storage.items():
                out[f"{tag}_{f}"] = arr.copy()
            for p, val in (side.params or {}).items():
                out[f"{tag}_param_{p}"] = np.asarray(val).copy()
            out[f"{tag}_lens"] = side.paged.astype(np.int32)
            W = max(1, side.scheme.residual_window, side.scheme.token_group)
            res = np.zeros((self.batch, W, self.kv_heads, self.head_dim), np.float32)
            lens = np.zeros(self.batch, np.int32)
            for b, r in enumerate(side.residual):
                res[b, : len(r)] = r
                lens[b] = len(r)
            out[f"{tag}_residual"], out[f"{tag}_residual_lens"] = res, lens
        return out

    def bytes_per_page(self) -> int:
        """Bytes of one page of K plus V storage (one layer)."""
        return sum(a[0].nbytes for s in (self.k, self.v) for a in s.storage.values())
