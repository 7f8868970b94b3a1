"""Per-layer quantized K/V storage in the paged cache's layout, as torch tensors (no transformers import).

One :class:`SideStore` holds K or V of one attention layer for ``batch`` sequences: the scheme's fields
flattened to slots exactly as :class:`kvqref.paged.PagedKVCache` and
:func:`kvqref.backends.triton_backend.empty_device_cache` lay them out (``[slots, kv_heads, *field]``, group
fields ``[slot groups, kv_heads, *field]``), a float32 residual window ``[batch, W, kv_heads, head_dim]`` and
the tensor-level params: given to the store (calibrated offline) or computed from the first quantized chunk,
then frozen. Pages are page-major: page ``i`` of sequence
``b`` is ``i * batch + b``, so growing appends pages and a beam reorder is an ``index_select`` on the batch
axis of the ``[max_pages, batch, rows, ...]`` view.

Rotated schemes (docs/rotation.md): the store holds the rotated domain everywhere, as
:class:`kvqref.paged.PagedKVCache` does: a token is rotated once, when it arrives (:meth:`SideStore.to_storage`:
the float32 rule of :meth:`kvqref.schemes.rotation.HadamardRotation.rotate`, bit for bit), the fields are the
inner scheme's (``codec``) of the rotated values and the residual window holds the rotated float32 values, so
the backends' decode reads one domain (:class:`kvqref.backends.torch_backend.RotatedDeviceCache`). Readers
ask for ``domain="stored"`` (rotated; the attention rotates queries and un-rotates outputs) or
``"original"`` (un-rotated: what a standard attention reads).

Writing (:meth:`SideStore.append`) follows the scheme's ``paged_tokens`` rule per sequence: the tokens that
leave the residual window are quantized, either by the NumPy oracle (``writer="oracle"``: the bytes are the
oracle's by construction) or by the fused Triton kernel (``writer="triton"``,
:func:`kvqref.backends.triton_backend.quantize_write`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvqref.backends import torch_backend, triton_backend
from kvqref.schemes import Quantized, Scheme
from kvqref.schemes.rotation import rotation_of, storage_scheme

_TORCH_OF = {np.dtype(np.uint8): torch.uint8, np.dtype(np.float16): torch.float16,
             np.dtype(np.float32): torch.float32, np.dtype(np.uint16): torch.bfloat16}


def page_size_for(*schemes: Scheme, at_least: int = 64) -> int:
    """The page size: the smallest multiple of every scheme's token group that is >= ``at_least``."""
    p = 1
    for s in schemes:
        p = int(np.lcm(p, s.token_group))
    return p * -(-at_least // p)


def residual_capacity(scheme: Scheme) -> int:
    """Rows of the residual buffer: the most full-precision tokens the scheme keeps (0 without a window)."""
    if scheme.paged_tokens(1) == 1 and scheme.residual_window == 0 and scheme.token_group == 1:
        return 0
    return max(1, scheme.residual_window, scheme.token_group)


class DeviceIndex:
    """Small host index arrays (slots, lengths, block tables) copied to the device once and shared by every
    layer of a cache: each layer of a decode step asks for the same ones, and a host-to-device copy per layer
    would stall the launch queue."""

    def __init__(self, device: torch.device, keep: int = 32) -> None:
        self.device, self.keep = device, keep
        self._memo: dict[tuple, torch.Tensor] = {}

    def __call__(self, tag: str, a: np.ndarray) -> torch.Tensor:
        a = np.ascontiguousarray(a)
        key = (tag, a.dtype.str, a.shape, a.tobytes())
        t = self._memo.get(key)
        if t is None:
            if len(self._memo) >= self.keep:
                self._memo.pop(next(iter(self._memo)))
            t = self._memo[key] = torch.from_numpy(a).to(self.device)
        return t


def _to_numpy(t: torch.Tensor, spec_dtype: np.dtype) -> np.ndarray:
    t = t.detach().cpu()
    if spec_dtype == np.uint16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


class SideStore:
    """K or V of one layer: fields, residual window, lengths and params (see the module docstring)."""

    def __init__(self, label: str, scheme: Scheme, batch: int, kv_heads: int, head_dim: int, page_size: int,
                 device: torch.device, writer: str, index: DeviceIndex | None = None,
                 params: dict[str, Any] | None = None) -> None:
        self.label, self.scheme, self.writer = label, scheme, writer
        #: the rotation (None: unrotated) and the scheme that encodes the stored values (the inner one if rotated)
        self.rotation, self.codec = rotation_of(scheme), storage_scheme(scheme)
        self.index = index or DeviceIndex(device)
        self.batch, self.kv_heads, self.head_dim, self.page_size = batch, kv_heads, head_dim, page_size
        self.device = device
        self.specs = scheme.fields(kv_heads, head_dim)
        self.G = scheme.token_group
        self.max_pages = 0
        self.fields: dict[str, torch.Tensor] = {}
        for f, spec in self.specs.items():
            self.fields[f] = torch.zeros(0, kv_heads, *spec.shape, dtype=_TORCH_OF[spec.dtype], device=device)
        self.W = residual_capacity(scheme)
        # one spare row: a decoded token sits there until the oldest one is flushed to the pages
        self.residual = torch.zeros(batch, self.W + 1, kv_heads, head_dim, dtype=torch.float32, device=device)
        self.paged = np.zeros(batch, np.int64)  # tokens of each sequence in pages
        self.params: dict[str, Any] | None = None
        self.tensor_scale = torch.ones(kv_heads, dtype=torch.float32, device=device)
        self._sides: dict[bool, triton_backend.Side] = {}  # (side(): kept per rotated flag)
        if params is not None:  # given (calibrated) params; otherwise _write calibrates on the first chunk
            self.set_params(scheme.check_params(params, kv_heads))
        self.grow(1)  # the backends' gathers index page 0 even while every token is in the residual

    # -- addressing -----------------------------------------------------------------------------
    def rows(self, f: str) -> int:
        return self.page_size if self.specs[f].per == "token" else self.page_size // self.G

    def slots(self, b: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Slot of token ``t`` of sequence ``b`` (arrays of equal shape)."""
        P = self.page_size
        return ((t // P) * self.batch + b) * P + t % P

    def group_slots(self, b: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Group slot of the token group holding token ``t`` of sequence ``b``."""
        P, G = self.page_size, self.G
        return ((t // P) * self.batch + b) * (P // G) + (t % P) // G

    def block_table(self) -> torch.Tensor:
        """int32 ``[batch, max_pages]``: page ``i`` of sequence ``b`` is ``i * batch + b``."""
        i = np.arange(max(self.max_pages, 1), dtype=np.int32)
        return self.index("block_table", i[None, :] * self.batch + np.arange(self.batch, dtype=np.int32)[:, None])

    def grow(self, pages: int, exact: bool = False) -> None:
        """Make room for ``pages`` pages per sequence (at least doubling unless ``exact``)."""
        if pages <= self.max_pages:
            return
        new = pages if exact else max(pages, 2 * self.max_pages)
        for f, t in self.fields.items():
            extra = torch.zeros((new - self.max_pages) * self.batch * self.rows(f), *t.shape[1:], dtype=t.dtype,
                                device=t.device)
            self.fields[f] = torch.cat([t, extra])
        self.max_pages = new

    def select(self, idx: torch.Tensor) -> None:
        """Keep sequences ``idx`` (a beam reorder or batch selection; repeats copy the sequence)."""
        idx_np = idx.detach().cpu().numpy().astype(np.int64)
        idx_d = idx.to(self.device, torch.int64)
        nb = len(idx_np)
        for f, t in self.fields.items():
            v = t.view(self.max_pages, self.batch, self.rows(f), *t.shape[1:])
            self.fields[f] = v.index_select(1, idx_d).reshape(self.max_pages * nb * self.rows(f), *t.shape[1:])
        self.residual = self.residual.index_select(0, idx_d)
        self.paged = self.paged[idx_np].copy()
        self.batch = nb

    # -- writing --------------------------------------------------------------------------------
    def set_params(self, params: dict[str, Any]) -> None:
        self.params = params
        self._sides.clear()
        dc = triton_backend.empty_device_cache(self.codec, self.codec, 1, self.page_size, self.kv_heads,
                                               self.head_dim, torch.zeros(1, 1, dtype=torch.int32),
                                               torch.zeros(1, dtype=torch.int32), k_params=params,
                                               device=str(self.device))
        self.tensor_scale = dc.k.tensor_scale

    def side(self, rotated: bool = False) -> triton_backend.Side:
        """This store as the backends' :class:`~kvqref.backends.triton_backend.Side`: the stored values (the
        codec's fields) with the codec as its scheme, or with ``rotated`` the store's scheme (a rotated one
        carries its rotation, so the fused decode rotates queries and un-rotates outputs). Made once per
        ``rotated`` and kept until the params change (:meth:`set_params`): the side holds this store's fields dict
        itself, so fields that grow or are reordered are read through it, and its kept tiles
        (``Side.tiles()``) are made again only then; a decode step asks for each side three times per layer."""
        kept = self._sides.get(rotated)
        if kept is None:
            kept = self._sides[rotated] = triton_backend.Side(self.scheme if rotated else self.codec, self.fields,
                                                              self.tensor_scale, dict(self.params or {}))
        return kept

    def to_storage(self, x: torch.Tensor, validate: bool = True) -> torch.Tensor:
        """float32 ``x`` in the stored domain: unchanged, or rotated by the exact float32 rule (ValueError for
        NaN/Inf input or an overflowing result, as the oracle's ``rotate``; the triton writer skips the check,
        a device synchronization, when ``validate`` is False)."""
        x = x.to(torch.float32)
        if self.rotation is None:
            return x
        check = validate or self.writer == "oracle"
        if check and not bool(torch.isfinite(x).all()):
            raise ValueError(f"{self.scheme.name} ({self.label}): input holds NaN or Inf, which a rotation spreads "
                             "over the head")
        z = torch_backend.rotate(x, self.rotation)
        if check and not bool(torch.isfinite(z).all()):
            raise ValueError(f"{self.scheme.name} ({self.label}): the rotated values overflow float32")
        return z

    def to_original(self, z: torch.Tensor) -> torch.Tensor:
        """Stored-domain values in the original domain (un-rotated: float64 by the oracle's ``unrotate`` for
        float64 input, float32 butterflies otherwise); unchanged for an unrotated store."""
        if self.rotation is None:
            return z
        if z.dtype == torch.float64:
            return torch.from_numpy(self.rotation.unrotate(z.detach().cpu().numpy())).to(z.device)
        return torch_backend.unrotate(z, self.rotation).to(z.dtype)

    def append(self, new: list[torch.Tensor], lens: np.ndarray,
               validate: bool = True) -> tuple[np.ndarray, list[torch.Tensor]]:
        """Append ``new[b]`` (``[m_b, kv_heads, head_dim]``, any float dtype) to sequence ``b`` whose length is
        ``lens[b]``. Tokens that leave the residual window are quantized and written; the rest stay in the
        float32 residual. Returns the paged counts before the append and, per sequence, the full-precision
        tokens from there on (float32 ``[lens[b] + m_b - before[b], kv_heads, head_dim]``, stored domain)."""
        before = self.paged.copy()
        tails = []
        x_parts, b_parts, t_parts = [], [], []
        for b, nb in enumerate(new):
            total = int(lens[b]) + nb.shape[0]
            target = self.scheme.paged_tokens(total)
            now = int(self.paged[b])
            rl = int(lens[b]) - now
            if self.W:
                pending = torch.cat([self.residual[b, :rl], self.to_storage(nb, validate)])
            else:
                pending = self.to_storage(nb, validate)
            tails.append(pending)
            c = target - now
            if c:
                x_parts.append(pending[:c])
                b_parts.append(np.full(c, b, np.int64))
                t_parts.append(np.arange(now, target, dtype=np.int64))
            rest = pending[c:]
            if rest.shape[0] > self.W:
                raise AssertionError(f"{self.label}: residual of {rest.shape[0]} tokens exceeds {self.W}")
            if self.W and rest.shape[0]:
                self.residual[b, : rest.shape[0]] = rest
            self.paged[b] = target
        if x_parts:
            self._write(torch.cat(x_parts), np.concatenate(b_parts), np.concatenate(t_parts), validate)
        return before, tails

    def append_one(self, new: torch.Tensor, lens: np.ndarray, validate: bool = False) -> None:
        """Append one token ``new[b]`` (``[batch, kv_heads, head_dim]``) to every sequence (lengths ``lens``):
        the vectorized decode step of :meth:`append`."""
        B = self.batch
        ar = np.arange(B, dtype=np.int64)
        lens = np.asarray(lens, np.int64)
        new = self.to_storage(new, validate)
        if not self.W:  # every token goes to the pages
            self._write(new, ar, lens, validate)
            self.paged = lens + 1
            return
        target = np.array([self.scheme.paged_tokens(int(n) + 1) for n in lens], np.int64)
        c = target - self.paged
        rl = lens - self.paged
        self.residual[self.index("seq", ar), self.index("rl", rl)] = new
        flush = np.nonzero(c)[0]
        if len(flush):
            cs = set(c[flush].tolist())
            if len(cs) != 1:
                raise AssertionError(f"{self.label}: flush sizes differ across sequences: {sorted(cs)}")
            n = cs.pop()
            fi = self.index("flush", flush)
            res = self.residual.index_select(0, fi)
            b = np.repeat(flush, n)
            t = (self.paged[flush][:, None] + np.arange(n)[None, :]).reshape(-1)
            self._write(res[:, :n].reshape(-1, self.kv_heads, self.head_dim), b, t, validate)
            shifted = torch.zeros_like(res)
            shifted[:, : self.W + 1 - n] = res[:, n:]
            self.residual[fi] = shifted
        self.paged = target

    def append_uniform(self, new: torch.Tensor, length: int, validate: bool = True) -> int:
        """Append ``new`` ``[batch, n, kv_heads, head_dim]`` to every sequence, all of length ``length``
        (the vectorized path of :meth:`append`); returns the paged count before."""
        if self.W or len(set(self.paged.tolist())) > 1:
            return int(self.append(list(new.unbind(0)), np.full(self.batch, length), validate)[0][0])
        B, n = new.shape[:2]
        now = int(self.paged[0])
        b = np.repeat(np.arange(B, dtype=np.int64), n)
        t = np.tile(np.arange(now, now + n, dtype=np.int64), B)
        self._write(self.to_storage(new.reshape(B * n, *new.shape[2:]), validate), b, t, validate)
        self.paged[:] = now + n
        return now

    def _write(self, x: torch.Tensor, b: np.ndarray, t: np.ndarray, validate: bool) -> None:
        """Quantize ``x`` [N, H, D] float32 (stored domain) into token ``t[i]`` of sequence ``b[i]`` by the codec."""
        self.grow(int(t.max()) // self.page_size + 1)
        if self.params is None:
            self.set_params(self.codec.calibrate(x.detach().cpu().numpy()))
        slots = self.slots(b, t)
        if self.writer == "triton":
            triton_backend.quantize_write(self.side(), x.contiguous(), self.index("slots", slots), validate=validate)
            return
        q = self.codec.quantize(x.detach().cpu().numpy(), params=self.params)
        for f, spec in self.specs.items():
            val = triton_backend.field_tensor(q.fields[f]).to(self.device)
            if spec.per == "token":
                idx = slots
            else:  # one entry per group of G tokens (whole, aligned groups: the scheme's paged_tokens rule)
                first = np.arange(0, len(t), self.G)
                idx = self.group_slots(b[first], t[first])
            self.fields[f][torch.from_numpy(idx).to(self.device)] = val

    # -- reading --------------------------------------------------------------------------------
    def quantized(self, b: int, stored: bool = False) -> Quantized:
        """The paged part of sequence ``b`` gathered into the oracle's container: of the store's scheme
        (``scheme.dequantize`` gives original-domain values), or with ``stored=True`` of the codec (the
        stored values: rotated for a rotated scheme)."""
        n = int(self.paged[b])
        t = np.arange(n, dtype=np.int64)
        bb = np.full(n, b, np.int64)
        fields = {}
        for f, spec in self.specs.items():
            if spec.per == "token":
                idx = self.slots(bb, t)
            else:
                idx = self.group_slots(bb[:: self.G], t[:: self.G])
            fields[f] = _to_numpy(self.fields[f][torch.from_numpy(idx).to(self.device)], spec.dtype)
        name = self.codec.name if stored else self.scheme.name
        return Quantized(name, (n, self.kv_heads, self.head_dim), fields, dict(self.params or {}))

    def dequantized(self, b: int, length: int, how: str, dtype: torch.dtype,
                    all_slots: torch.Tensor | None = None) -> torch.Tensor:
        """Sequence ``b``'s ``length`` tokens in the stored domain (rotated for a rotated scheme):
        ``[length, kv_heads, head_dim]`` in ``dtype``; ``how="oracle"``: the codec's float64 dequantize;
        ``"torch"``: the torch backend's dequantize (``all_slots``: :meth:`dequantized_slots`, to reuse across
        sequences)."""
        n = int(self.paged[b])
        if how == "oracle":
            paged = torch.from_numpy(self.codec.dequantize(self.quantized(b, stored=True))) if n else \
                torch.zeros(0, self.kv_heads, self.head_dim, dtype=torch.float64)
            paged = paged.to(self.device, dtype)
        else:
            all_slots = self.dequantized_slots(dtype) if all_slots is None else all_slots
            idx = self.slots(np.full(n, b, np.int64), np.arange(n, dtype=np.int64))
            paged = all_slots[torch.from_numpy(idx).to(self.device)]
        if length == n:
            return paged
        return torch.cat([paged, self.residual[b, : length - n].to(dtype)])

    def dequantized_slots(self, dtype: torch.dtype) -> torch.Tensor:
        """The slots of the pages in use, dequantized by the torch backend (stored domain):
        ``[slots, kv_heads, head_dim]`` (pages are page-major, so the pages in use come first)."""
        pages = max(1, -(-int(self.paged.max()) // self.page_size)) * self.batch
        side = triton_backend.Side(self.codec, {f: t[: pages * self.rows(f)] for f, t in self.fields.items()},
                                   self.tensor_scale, dict(self.params or {}))  # (a new side: the kept one reads all)
        return torch_backend.dequantize(side, dtype)

    def dequantized_all(self, length: int, how: str, dtype: torch.dtype, domain: str = "original") -> torch.Tensor:
        """Every sequence, all of length ``length``: ``[batch, length, kv_heads, head_dim]`` in ``dtype``, in the
        ``"original"`` domain (a rotated store un-rotated in float64 for ``how="oracle"``, float32 for
        ``"torch"``, before the cast to ``dtype``) or the ``"stored"`` one."""
        if domain not in ("original", "stored"):
            raise ValueError(f"domain must be 'original' or 'stored', got {domain!r}")
        unrotate = domain == "original" and self.rotation is not None
        work = (torch.float64 if how == "oracle" else torch.float32) if unrotate else dtype
        if how == "oracle" or self.W:
            deq = None if how == "oracle" else self.dequantized_slots(work)
            x = torch.stack([self.dequantized(b, length, how, work, deq) for b in range(self.batch)])
        else:
            B = self.batch
            idx = self.slots(np.repeat(np.arange(B, dtype=np.int64), length), np.tile(np.arange(length), B))
            deq = self.dequantized_slots(work)
            x = deq[torch.from_numpy(idx).to(self.device)].view(B, length, self.kv_heads, self.head_dim)
        return (self.to_original(x) if unrotate else x).to(dtype)

    def nbytes(self, lens: np.ndarray) -> dict[str, int]:
        """Bytes held for sequences of lengths ``lens``: ``fields`` (the stored tokens' codes and scales),
        ``residual`` (float32 residual-window tokens), ``params`` (tensor-level scales)."""
        per_token = sum(int(np.prod(s.shape, dtype=np.int64)) * s.dtype.itemsize * self.kv_heads
                        for s in self.specs.values() if s.per == "token")
        per_group = sum(int(np.prod(s.shape, dtype=np.int64)) * s.dtype.itemsize * self.kv_heads
                        for s in self.specs.values() if s.per == "group")
        fields = int(self.paged.sum()) * per_token + int((self.paged // self.G).sum()) * per_group
        residual = int((np.asarray(lens) - self.paged).sum()) * self.kv_heads * self.head_dim * 4
        params = sum(np.asarray(v).nbytes for v in (self.params or {}).values())
        return {"fields": fields, "residual": residual, "params": params}
