"""The ``triton`` backend: fused quantize-on-write and decode attention over the quantized paged cache.

Same kernel source on NVIDIA (CUDA) and AMD (ROCm); on a CPU it runs under ``TRITON_INTERPRET=1``.

Rotated schemes (docs/rotation.md): a :class:`Side` keeps its scheme as given (a ``RotatedScheme``), so the
rotation travels with the stored fields; ``Side.codec`` is the scheme that encodes the stored (rotated)
values. :func:`quantize_write` rotates in the write kernel; :func:`decode` rotates q and un-rotates the
output (``kvqref.kernels.decode.plan_decode`` reads the rotations from the :class:`CacheTiles`), so rotated
keys never meet an unrotated query.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvqref.kernels.kept_plans import KeptPlans
from kvqref.schemes import BF16Scheme, E8M0BlockScheme, FP8Scheme, KiviScheme, NVFP4Scheme, RotatedScheme, Scheme
from kvqref.schemes.rotation import norm_f32, rotation_of, storage_scheme

TILE_KINDS = {BF16Scheme: "bf16", FP8Scheme: "fp8", E8M0BlockScheme: "mxfp4", NVFP4Scheme: "nvfp4"}
#: the scheme fields each kernel kind reads, in the order of its F0, F1, F2 arguments
FIELD_ORDER = {"bf16": ("data",), "fp8": ("codes", "scale"), "mxfp4": ("codes", "scales"),
               "nvfp4": ("codes", "scales"), "int_v": ("codes", "scale", "zero"),
               "int_k": ("codes", "scale", "zero")}


def _torch():
    import torch

    return torch


def kernel_config(scheme: Scheme) -> dict[str, Any]:
    """The decode/write kernel constexprs of ``scheme`` (raises ValueError if the backend lacks it); a rotated
    scheme has its inner scheme's plus ``rotation`` (a ``HadamardRotation``)."""
    from kvqref.kernels.codecs import FMT_IDS

    if isinstance(scheme, RotatedScheme):
        return {**kernel_config(scheme.inner), "rotation": scheme.rotation}
    if isinstance(scheme, KiviScheme):
        return {"kind": "int_k" if scheme.role == "key" else "int_v", "group": scheme.group_size,
                "bits": scheme.bits}
    for cls, kind in TILE_KINDS.items():
        if isinstance(scheme, cls):
            cfg: dict[str, Any] = {"kind": kind}
            if isinstance(scheme, FP8Scheme):
                sglang = 0 if scheme.profile != "sglang" else (2 if scheme.sglang_scale == "float" else 1)
                if sglang == 2 and scheme.granularity == "token_head":
                    raise ValueError("triton backend: sglang_scale='float' needs a static tensor or head scale")
                cfg.update(fmt=FMT_IDS[scheme.format], token_scale=scheme.granularity == "token_head",
                           sglang=sglang, saturate=scheme.saturate)
            if isinstance(scheme, E8M0BlockScheme):
                if scheme.scale_rule == "ceil" and scheme.rounding != "away" or (
                        scheme.scale_rule == "floor" and scheme.rounding != "even"):
                    raise ValueError(f"triton backend: {scheme!r} mixes the ocp and sglang rules; only the two "
                                     "profiles' combinations are implemented")
                cfg.update(block=scheme.block, sglang=scheme.profile == "sglang")
            return cfg
    raise ValueError(f"triton backend: no kernel for scheme {scheme!r}")


#: field layouts of a device cache: token-major pages (the paged cache's own, vLLM's) or head-major (FlashInfer's HND)
LAYOUTS = ("NHD", "HND")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _laid_out(t, layout: str):
    """A field as the paged cache stores it, [pages, rows, H, ...], in ``layout``: NHD ``[pages * rows, H, ...]``
    (a view), HND ``[pages, H, rows, ...]`` (a copy: each head's rows of a page contiguous)."""
    if layout == "NHD":
        return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])
    out = t.new_empty((t.shape[0], t.shape[2], t.shape[1], *t.shape[3:]))  # row-major strides, size-1 axes too
    return out.copy_(t.transpose(1, 2))


@dataclass
class Side:
    """K or V of a device cache: the scheme, its field tensors and tensor scale. Fields are token-major
    (``head_major=False``, NHD: [slots, kv_heads, ...], the paged cache's arrays flattened over pages) or
    head-major (HND: [pages, kv_heads, rows per page, ...]); the bytes of every (slot, head) row are the same."""

    scheme: Scheme  # as given: a RotatedScheme for a rotated side
    fields: dict[str, Any]
    tensor_scale: Any  # float32 [kv_heads]
    params: dict[str, Any]
    head_major: bool = False

    @property
    def codec(self) -> Scheme:
        """The scheme that encodes the stored values (the inner scheme of a rotated one)."""
        return storage_scheme(self.scheme)

    @property
    def num_slots(self) -> int:
        """Token slots of the cache (pages x page size)."""
        t = next(iter(self.fields.values()))  # the code field: one row per slot
        return t.shape[0] * t.shape[2] if self.head_major else t.shape[0]

    def slot_rows(self, name: str):
        """Field ``name`` as [slots, kv_heads, ...] (slot = page * rows per page + row), whatever the layout (a
        copy where head-major)."""
        t = self.fields[name]
        if not self.head_major:
            return t
        return t.transpose(1, 2).reshape(t.shape[0] * t.shape[2], t.shape[1], *t.shape[3:])

    def tiles(self):
        """The side as the kernels read it (``kernels.decode.CacheTiles``). Made once and kept while the side holds
        the same scheme, field tensors, tensor scale and layout (compared by identity; the kept tiles hold them, so
        no other object can take their identities): an eager decode call asks for both sides' tiles, about 10 us
        each to make. The kept object is shared: read it, do not change it."""
        from kvqref.kernels.decode import CacheTiles

        key = (id(self.scheme), id(self.tensor_scale), self.head_major,
               tuple((n, id(t)) for n, t in self.fields.items()))
        kept = self.__dict__.get("_kept_tiles")
        if kept is not None and kept[0] == key:
            return kept[2]
        cfg = kernel_config(self.scheme)
        fields = [self.fields[f] for f in FIELD_ORDER[cfg["kind"]] if f in self.fields]
        tiles = CacheTiles(cfg["kind"], fields, self.tensor_scale, fmt=cfg.get("fmt", 0),
                           token_scale=cfg.get("token_scale", False), block=cfg.get("block", 16),
                           group=cfg.get("group", 1), bits=cfg.get("bits", 8), rotation=cfg.get("rotation"),
                           head_major=self.head_major)
        self.__dict__["_kept_tiles"] = (key, (self.scheme, dict(self.fields)), tiles)  # (the keyed objects held)
        return tiles


def _tensor_scale(scheme: Scheme, params: dict[str, Any], kv_heads: int) -> np.ndarray:
    """The float32 [kv_heads] scale folded into the kernels (1 where the scheme has none, or where the cache
    is still empty and its params are not set yet); the params of a rotated scheme are its inner scheme's."""
    scheme = storage_scheme(scheme)
    if not params:
        return np.ones(kv_heads, np.float32)
    params = scheme.check_params(params, kv_heads)
    if isinstance(scheme, FP8Scheme) and scheme.granularity != "token_head":
        s = np.asarray(params["scale"], np.float32)
        return np.broadcast_to(s, (kv_heads,)).astype(np.float32)
    if isinstance(scheme, NVFP4Scheme):
        return np.full(kv_heads, np.float32(params["global_scale"]), np.float32)
    return np.ones(kv_heads, np.float32)


def field_tensor(a: np.ndarray):
    """A stored field as a CPU torch tensor of the kernels' dtype: uint16 fields are bfloat16 bit patterns (the
    ``bf16`` scheme), every other dtype is taken as it is."""
    torch = _torch()
    a = np.ascontiguousarray(a)
    if a.dtype == np.uint16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


@dataclass
class DeviceCache:
    """A :class:`kvqref.paged.PagedKVCache` copied to torch tensors on one device."""

    k: Side
    v: Side
    page_size: int
    block_table: Any
    seq_lens: Any
    k_lens: Any
    v_lens: Any
    k_residual: Any
    v_residual: Any
    has_residual: bool

    @property
    def layout(self) -> str:
        """``"HND"`` where the fields are head-major, else ``"NHD"``."""
        return "HND" if self.k.head_major else "NHD"

    @property
    def num_pages(self) -> int:
        return self.k.num_slots // self.page_size

    @property
    def residual(self) -> tuple | None:
        """The residual windows and their lengths as :func:`kvqref.kernels.decode.plan_decode` takes them,
        ``(k_residual, v_residual, k_lens, v_lens)``, or None where the cache has no residual window."""
        return (self.k_residual, self.v_residual, self.k_lens, self.v_lens) if self.has_residual else None

    def with_layout(self, layout: str) -> DeviceCache:
        """This cache with its fields in ``layout`` (``"NHD"`` or ``"HND"``): the fields copied (none where the
        layout is already ``layout``), block table, lengths and residual windows shared."""
        _check_layout(layout)
        if layout == self.layout:
            return self
        pages, sides = self.num_pages, []
        for side in (self.k, self.v):
            fields = {}
            for f in side.fields:
                rows = side.slot_rows(f)
                fields[f] = _laid_out(rows.view(pages, rows.shape[0] // pages, *rows.shape[1:]), layout)
            sides.append(Side(side.scheme, fields, side.tensor_scale, side.params, head_major=layout == "HND"))
        return DeviceCache(sides[0], sides[1], self.page_size, self.block_table, self.seq_lens, self.k_lens,
                           self.v_lens, self.k_residual, self.v_residual, self.has_residual)

    @classmethod
    def from_cache(cls, cache, device: str = "cpu", layout: str = "NHD") -> DeviceCache:
        """``cache`` (a :class:`kvqref.paged.PagedKVCache`) on ``device``: its stored domain (pages and residual
        windows rotated for a rotated side: ``export()`` is ``storage_view().export()``), its schemes as they
        are (a rotated side keeps its ``RotatedScheme``, hence its rotation). ``layout``: ``"NHD"`` (the paged
        cache's token-major pages) or ``"HND"`` (head-major pages: each head's rows of a page contiguous)."""
        torch = _torch()
        _check_layout(layout)
        ex = cache.storage_view().export()
        sides = []
        for tag, side in (("k", cache.k), ("v", cache.v)):
            fields = {}
            for f in side.specs:
                fields[f] = _laid_out(field_tensor(ex[f"{tag}_{f}"]).to(device), layout)
            params = {p[len(tag) + 7:]: ex[p] for p in ex if p.startswith(f"{tag}_param_")}
            ts = torch.from_numpy(_tensor_scale(side.scheme, params, cache.kv_heads)).to(device)
            sides.append(Side(side.scheme, fields, ts, params, head_major=layout == "HND"))
        has_res = any(isinstance(s.codec, KiviScheme) for s in sides)

        def t32(name: str):
            return torch.from_numpy(ex[name].astype(np.int32)).to(device)

        return cls(sides[0], sides[1], cache.page_size, t32("block_table"), t32("seq_lens"), t32("k_lens"),
                   t32("v_lens"), torch.from_numpy(ex["k_residual"]).to(device),
                   torch.from_numpy(ex["v_residual"]).to(device), has_res)


def empty_device_cache(k_scheme: Scheme, v_scheme: Scheme, num_pages: int, page_size: int, kv_heads: int,
                       head_dim: int, block_table, seq_lens, *, k_params: dict[str, Any] | None = None,
                       v_params: dict[str, Any] | None = None, device: str = "cuda",
                       layout: str = "NHD") -> DeviceCache:
    """A zeroed device cache laid out as :class:`kvqref.paged.PagedKVCache` stores it (``layout="NHD"``) or with
    head-major pages (``"HND"``), to be filled by :func:`quantize_write` (used by the benchmarks, whose caches
    are too large for the NumPy oracle). KIVI residuals are empty (every token in pages). Rotated schemes store
    rotated values (as the paged cache)."""
    torch = _torch()
    _check_layout(layout)
    sides = []
    for scheme, params in ((k_scheme, k_params or {}), (v_scheme, v_params or {})):
        fields = {}
        for f, spec in scheme.fields(kv_heads, head_dim).items():
            rows = page_size if spec.per == "token" else page_size // scheme.token_group
            tdt = {np.dtype(np.uint8): torch.uint8, np.dtype(np.float16): torch.float16,
                   np.dtype(np.float32): torch.float32, np.dtype(np.uint16): torch.bfloat16}[spec.dtype]
            shape = (num_pages * rows, kv_heads) if layout == "NHD" else (num_pages, kv_heads, rows)
            fields[f] = torch.zeros(*shape, *spec.shape, dtype=tdt, device=device)
        ts = torch.from_numpy(_tensor_scale(scheme, params, kv_heads)).to(device)
        sides.append(Side(scheme, fields, ts, params, head_major=layout == "HND"))
    has_res = any(isinstance(s.codec, KiviScheme) for s in sides)
    bt = block_table.to(device=device, dtype=torch.int32)
    sl = seq_lens.to(device=device, dtype=torch.int32)
    empty = torch.zeros(bt.shape[0], 1, kv_heads, head_dim, dtype=torch.float32, device=device)
    return DeviceCache(sides[0], sides[1], page_size, bt, sl, sl, sl, empty, empty, has_res)


def uniform_device_cache(k_scheme: Scheme, v_scheme: Scheme, batch: int, tokens: int, page_size: int, kv_heads: int,
                         head_dim: int, **kw: Any) -> DeviceCache:
    """:func:`empty_device_cache` of ``batch`` sequences of ``tokens`` tokens each, sequence b on pages
    ``b * P .. b * P + P - 1`` in order (P = tokens / page_size rounded up); ``kw`` as there (``device``, ``layout``,
    ``k_params``, ``v_params``). For planning and host-time measurements, which read no values."""
    torch = _torch()
    pages = -(-tokens // page_size)
    table = torch.arange(batch * pages, dtype=torch.int32).reshape(batch, pages)
    lens = torch.full((batch,), tokens, dtype=torch.int32)
    return empty_device_cache(k_scheme, v_scheme, batch * pages, page_size, kv_heads, head_dim, table, lens, **kw)


def decode(q, dc: DeviceCache, sm_scale: float | None = None, validate: bool = True, *,
           precision: str = "fast", **kw: Any):
    """Fused decode attention: (out [B, Hq, D] float32, lse [B, Hq] float32, natural log).

    ``precision="fast"`` (default): 16-bit tensor-core operands (q and the probabilities rounded once to
    16 bits, float32 softmax and accumulation); ``"exact"``: float32 products (docs/kernels.md gives both
    error bounds; :func:`kvqref.reference.kernel_tolerance` implements them). ``validate=False`` skips the
    host-side checks (they synchronize with the device); a serving loop validates once and passes
    ``max_seq_len`` too. A rotated side (docs/rotation.md): q is rotated by K's rotation before the split kernel
    (one small launch) and the output un-rotated by V's in the merge kernel (with one split and no residual window,
    in the split kernel); ``out`` is in the original domain,
    ``lse`` needs nothing."""
    from kvqref.kernels.decode import PRECISIONS, paged_decode

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if validate:
        validate_decode(q, dc)
    residual = dc.residual
    return paged_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, dc.page_size,
                        sm_scale=sm_scale, residual=residual, precision=precision, **kw)


def validate_decode(q, dc: DeviceCache) -> None:
    """Host-side checks before launch: shapes, dtypes, devices, page indices in range."""
    torch = _torch()
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, q_heads, head_dim], got shape {tuple(q.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q must be bfloat16, float16 or float32, got {q.dtype}")
    batch, q_heads, head_dim = q.shape
    first = next(iter(dc.k.fields.values()))
    kv_heads = first.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    if head_dim not in (64, 128, 256) and head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two (64, 128, 256), got {head_dim}")
    if dc.block_table.shape[0] != batch or dc.seq_lens.shape[0] != batch:
        raise ValueError(f"batch of q ({batch}) != block table rows ({dc.block_table.shape[0]}) / seq_lens "
                         f"({dc.seq_lens.shape[0]})")
    for t in [*dc.k.fields.values(), *dc.v.fields.values(), dc.block_table, dc.seq_lens]:
        if t.device != q.device:
            raise ValueError(f"all tensors must be on {q.device}; found one on {t.device}")
    num_pages = dc.num_pages  # (K and V in one layout: plan_decode checks it)
    paged = torch.maximum(dc.k_lens, dc.v_lens) if dc.has_residual else dc.seq_lens
    pages_needed = (paged.to(torch.int64) + dc.page_size - 1) // dc.page_size
    if int(pages_needed.max().item() if batch else 0) > dc.block_table.shape[1]:
        raise ValueError("a sequence is longer than its block table row covers")
    cols = torch.arange(dc.block_table.shape[1], device=q.device)[None, :]
    used = dc.block_table.masked_select(cols < pages_needed[:, None])
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
        raise ValueError(f"block table holds page indices outside [0, {num_pages})")


#: the write kernel's QDT constexpr: the dtype an FP8 quotient is rounded to (0: none, i.e. float32)
QDT_IDS = {"float32": 0, "bfloat16": 1, "float16": 2}


def _model_input(scheme: Scheme, x):
    """(x as the model dtype's tensor, the QDT constexpr): the same model-dtype rule as the scheme's oracle
    (``resolve_model_dtype``: ValueError for a dtype the engine does not accept or that contradicts the
    scheme's ``model_dtype``); float32 input is rounded (RNE) to an explicit ``model_dtype`` first."""
    torch = _torch()
    resolve = getattr(scheme, "resolve_model_dtype", None)
    if resolve is None:
        return x, 0
    md = resolve(str(x.dtype).removeprefix("torch."))
    if md != "float32" and x.dtype == torch.float32:
        x = x.to(getattr(torch, md))
    if not isinstance(scheme, FP8Scheme):
        return x, 0
    return x, QDT_IDS[scheme.quotient_dtype(md)]


def _rotated_dtypes(codec: Scheme) -> tuple[int, int]:
    """(RDT, QDT) of a rotated write: the inner scheme quantizes the float32 rotated values as a float32 input
    (``RotatedScheme.quantize``), so its model dtype is what it resolves for float32 input (an explicit
    ``model_dtype``: the rotated values are rounded to it in the kernel, RDT)."""
    resolve = getattr(codec, "resolve_model_dtype", None)
    md = resolve("float32") if resolve is not None else "float32"
    qdt = QDT_IDS[codec.quotient_dtype(md)] if isinstance(codec, FP8Scheme) else 0
    return QDT_IDS[md], qdt


def rotation_signs(rotation, head_dim: int, device):
    """The float32 [D] signs of ``rotation`` on ``device`` (made once per rotation, D and device)."""
    from kvqref.kernels.decode import rotation_vectors

    return rotation_vectors(rotation.seed, head_dim, device)[0]


def _check_rotated_input(side: Side, x, rdt: int) -> None:
    """The oracle's errors for a rotated write (``HadamardRotation.rotate``, the inner scheme's model dtype):
    NaN/Inf input, and rotated values (or butterfly sums) that overflow float32 or the model dtype. Exact and
    cheap: only if ``max|x| * D`` (a bound of every butterfly sum) comes near the limit are the rotated values
    computed (by ``torch_backend.hadamard``, bit-identical to the kernel's butterflies) and checked."""
    torch = _torch()
    D = x.shape[-1]
    if not torch.isfinite(x).all():
        raise ValueError(f"{side.scheme.name}: input holds NaN or Inf, which a rotation spreads over the head")
    limit = 65504.0 if rdt == QDT_IDS["float16"] else 3.0e38
    if x.numel() == 0 or float(x.abs().max()) * D * 1.01 < limit:
        return
    y, z, md = _rotated_values(side, x, rdt)
    if not (torch.isfinite(y).all() and torch.isfinite(z.to(getattr(torch, md))).all()):
        raise ValueError(f"{side.scheme.name}: the rotated values overflow {md}")


def _rotated_values(side: Side, x, rdt: int):
    """(butterfly sums, rotated values ``z``, the model dtype's name) of a rotated write's input ``x``, in float32 by
    ``torch_backend.hadamard``, bit-identical to the kernel's butterflies; ``z`` before its rounding to the model
    dtype ``rdt``."""
    from kvqref.backends.torch_backend import hadamard

    D = x.shape[-1]
    y = hadamard(x.float() * rotation_signs(rotation_of(side.scheme), D, x.device))
    return y, y * float(norm_f32(D)), {v: k for k, v in QDT_IDS.items()}[rdt]


#: below this max|x| every float16 value and every group range max - min of a KIVI write is finite (2 x 32752 < 65520)
KIVI_SAFE_ABS = 32752.0


def _check_kivi_range(side: Side, x, slot_mapping) -> None:
    """The oracle's errors for a KIVI write (``KiviScheme._input16`` / ``_quant_groups``: KIVI computes in float16):
    values that round to Inf in float16, and a group whose range ``max - min`` of float16 values does (the kernel would
    store the codes of an infinite range). A rotated scheme's values are its rotated ones (``torch_backend.hadamard``,
    bit-identical to the kernel's butterflies, rounded to the model dtype). Key groups leave rows of slot -1 out, as the
    kernel does. Cheap: only if max|x| (rotated: times D, a bound of every rotated value) reaches KIVI_SAFE_ABS are the
    values rounded and the groups reduced."""
    torch = _torch()
    codec, rotation = side.codec, rotation_of(side.scheme)
    n, H, D = x.shape
    bound = float(x.abs().max()) * (D if rotation is not None else 1) if x.numel() else 0.0
    if bound < KIVI_SAFE_ABS:
        return
    z = x.float()
    if rotation is not None:
        _, z, md = _rotated_values(side, x, _rotated_dtypes(codec)[0])
        z = z.to(getattr(torch, md)).float()
    x16 = z.to(torch.float16).double()
    if torch.isinf(x16).any():
        raise ValueError(f"{codec.name}: input exceeds the float16 range (KIVI computes in float16)")
    G = codec.group_size
    if codec.role == "value":
        g = x16.view(n, H, D // G, G)
        rng = g.amax(-1) - g.amin(-1)
    else:  # whole groups of G tokens (plan_write checked n); rows of slot -1 left out
        g = x16.view(n // G, G, H, D)
        kept = (slot_mapping >= 0).view(n // G, G, 1, 1)
        rng = torch.where(kept, g, -torch.inf).amax(1) - torch.where(kept, g, torch.inf).amin(1)
    if (rng >= 65520).any():  # RN16 of the range is Inf (exact in float64: float16 values differ by < 2**41 ulps)
        raise ValueError(f"{codec.name}: a group's range max - min overflows float16")


#: tuned write launch (bench/ab_write.py on the H100): elements per program and warps; KIVI keys take the
#: group size G as BLOCK_T and one head per program
WRITE_TILE_ELEMS = 4096
WRITE_WARPS = 4
#: KIVI keys (one head, G tokens per program): 2 warps (H100, int4 keys 0.32 -> 0.63 of the ceiling with
#: float16 roundings by conversion; bench/results/history/ab-h100-session5-write-sweep.log)
WRITE_WARPS_KIVI_KEYS = 2
WRITE_MAX_BLOCK_H = 8
#: NVFP4 writes of bfloat16 input (unrotated) with whole 16-element blocks per thread (plan_write's ``nvfp4_blocks``,
#: the kernel's NV_BLOCKS) take tiles of about this many elements (2 tokens x 8 heads x 128; session 7, token-major
#: pages: 48 registers on sm_90 at one block per thread with 4 warps, 80 with two blocks per thread)
NVFP4_BLOCKS_TILE_ELEMS = 2048
#: ... and this many warps (two blocks per thread; H100, head-major pages: 74.1 -> 70.1 us, 0.76 -> 0.80 of the
#: ceiling; 4 tokens x 4 heads 69.8, 8 x 2 70.0: bench/results/history/ab-h100-session14-write.log)
NVFP4_BLOCKS_WARPS = 2
#: ... with head-major pages, at most this many heads per tile (4 tokens x 4 heads: a head's 4 code rows and their
#: 32 bytes of block scales are contiguous there; H100 69.8-70.0 us against 70.1-70.7 for 2 x 8 in three A/Bs,
#: 0.81 of the ceiling: history/ab-h100-session14-write.log, ab-h100-session14-write-2.log)
NVFP4_BLOCKS_HEADS_HND = 4


def nvfp4_blocks_default(device) -> bool:
    """Whether NVFP4 writes of bfloat16 input take whole blocks per thread (``NV_BLOCKS``) by default: on NVIDIA
    GPUs (static sm_90 SASS: 20.1 instead of 27.2 instructions per element, 48 instead of 72 registers; H100:
    85.3 -> 70.8 us, 0.66 -> 0.80 of the ceiling, bench/results/history/ab-h100-session7-write-nvfp4-blocks.log;
    not measured on ROCm)."""
    return _nvidia_gpu(device)


def kivi_key_blocks_default(bits: int, head_dim: int, device) -> tuple[int, int, bool] | None:
    """(block_d, num_warps, store_as_loaded) of unrotated KIVI key writes by the portable quantization
    (``kivi_f16x2=False``; by float16 pairs, NVIDIA's default, keys take whole heads) by default, or None for whole
    heads (WRITE_WARPS_KIVI_KEYS warps, stores converted): on NVIDIA GPUs 4-bit keys of head_dim > 64 by 64-channel
    blocks, one warp, stores in the load's layout (H100: int4 keys 92.6 -> 82.4 us, 0.62 -> 0.70 of the ceiling;
    2-bit keys gained nothing, 88.9 us whole against 89.4 at best by blocks:
    bench/results/history/ab-h100-session7-write-kivi-key-blocks.log); not measured on ROCm."""
    if bits == 4 and head_dim > 64 and head_dim % 64 == 0 and _nvidia_gpu(device):
        return 64, 1, True
    return None
#: KIVI key writes of whole heads (2-bit keys by default) on NVIDIA GPUs: at most 96 registers per thread (H100, int2
#: keys 86.2 -> 82.8 us, 0.61 -> 0.63 of the ceiling; 4-bit keys by 64-channel blocks gained nothing from a cap:
#: bench/results/history/ab-h100-session14-write.log)
WRITE_MAXNREG_KIVI_KEYS = 96
#: KIVI value writes on NVIDIA GPUs: at most 64 registers per thread (Triton's ``maxnreg``); H100, int4 values with
#: the reciprocal quotient and three-reduction min/max: 72.8 us (66 registers) -> 70.6 us = 0.82 of the ceiling
#: (bench/results/history/ab-h100-session6-write-maxnreg.log)
WRITE_MAXNREG_KIVI_VALUES = 64


def write_tile(kind: str, kv_heads: int, head_dim: int, group: int = 1) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_H) of the write kernel: all heads of a token in one program where they fit (rows
    of one slot are consecutive in the cache), about WRITE_TILE_ELEMS elements per program."""
    if kind == "int_k":
        return group, 1
    block_h = min(1 << max(kv_heads - 1, 0).bit_length(), WRITE_MAX_BLOCK_H)
    return max(1, WRITE_TILE_ELEMS // (block_h * head_dim)), block_h


def _nvidia_gpu(device) -> bool:
    """Whether ``device`` is a CUDA device of an NVIDIA build (not ROCm) running compiled kernels (not the
    interpreter)."""
    torch = _torch()
    from kvqref.kernels.codecs import INTERPRET

    return bool(not INTERPRET and getattr(device, "type", None) == "cuda" and not getattr(torch.version, "hip", None))


#: rotated E8M0 writes (fp4_e2m1, mxfp4; OCP rule) with word loads take tiles of about this many elements (H100,
#: 65,536 x 8 x 128, session 21: 8 tokens x 8 heads; fp4_e2m1 86.0 -> 82.7 us, mxfp4 85.9 -> 80.5 against the default
#: launch without word loads; word loads at 4 x 8 lost, 87.7 / 89.3;
#: bench/results/history/ab-h100-session21-rotation-write-e8m0-sweep.json)
ROTATED_E8M0_WORDS_TILE_ELEMS = 8192


def rotated_word_load_default(kind: str, bits: int, device, sglang: int = 0) -> bool:
    """Whether rotated writes of cache tile kind ``kind`` ("mxfp4", "nvfp4", "int_k", "int_v"; ``bits`` per code) of
    bfloat16 input load each pair of elements as one 32-bit word by default (the write kernel's ``WORD_LOAD``; the
    same bytes): the load then has the shape of a 4-bit code store, [tokens, heads, D / 2], and Triton gives both its
    layout (FP4: 32 elements per thread, 2 of the 7 butterfly stages across lanes instead of 4, no conversion before
    the store). Where it measured faster, on NVIDIA GPUs (H100, 65,536 x 8 x 128, rotated write, by the default
    butterflies): NVFP4 121.0 -> 110.8 us, 4-bit KIVI keys 127.0 -> 115.5 (split/join), 4-bit KIVI values 95.0 ->
    89.2 (shuffles). Lost there: 2-bit KIVI keys 128.5 -> 129.6, values 94.5 -> 97.1
    (bench/results/history/rotation-writes-h100-session20-word-loads.json, -no-word-loads.json,
    ab-h100-session20-rotation-write-kivi-keys.json, -values.json). E8M0 tiles (fp4_e2m1, mxfp4) of the OCP rule
    (``sglang`` 0) since session 21, with tiles of ROTATED_E8M0_WORDS_TILE_ELEMS elements: at the default tile they
    lost (session 20: fp4_e2m1 90.8 -> 92.1, mxfp4 89.3 -> 97.1). Not measured on ROCm."""
    return (kind == "nvfp4" or (kind == "mxfp4" and not sglang)
            or (kind in ("int_k", "int_v") and bits == 4)) and _nvidia_gpu(device)


def hardware_fp8_encode(device) -> bool:
    """Whether the write kernel converts float32 to the OCP FP8 formats in hardware: NVIDIA sm_89+
    (``cvt.rn.satfinite``, exact RNE; the kernel handles overflow and NaN). Not on ROCm, not in the
    interpreter."""
    return _nvidia_gpu(device) and _torch().cuda.get_device_capability(device) >= (8, 9)


def kivi_f16x2_default(kind: str, device) -> bool:
    """Whether KIVI writes (``kind`` "int_k" or "int_v") quantize float16 pairs by default (the write kernel's
    ``KIVI_X2``: each element pair one 32-bit word, every per-element step one packed or conversion instruction in
    inline PTX; the same bytes): on NVIDIA GPUs. Not on ROCm nor in the interpreter (the PTX does not run there)."""
    return kind in ("int_k", "int_v") and _nvidia_gpu(device)


def write_evict_first_default(kind: str, bits: int, rotated: bool, device) -> bool:
    """Whether the write kernel loads x with ``evict_first`` by default (x is read once; its lines then leave L2
    first): on NVIDIA GPUs, every write but the unrotated bf16, FP8 and 4-bit KIVI value writes, where it measured
    slower (H100, session 24, 3 alternating rounds: int2 KIVI keys 66.9 -> 65.5 us, int2 values 64.7 -> 62.5,
    fp4_e2m1 68.1 -> 66.7, mxfp4 68.0 -> 66.5, nvfp4 70.5 -> 68.7, int4 keys 69.2 -> 69.0, rotated writes 0.2-2.3%
    faster; bf16 98.0 -> 99.2, fp8 74.7 -> 75.3, int4 values 67.5 -> 67.9: bench/results/ANALYSIS.md)."""
    slower = not rotated and (kind in ("bf16", "fp8") or (kind == "int_v" and bits == 4))
    return not slower and _nvidia_gpu(device)


def kivi_x2_code_words(kind: str, bits: int) -> bool:
    """Whether KIVI writes by float16 pairs store their code bytes as 32-bit words of four (``X2_WORDS``: four pairs'
    codes gathered by ``prmt``): where that measured fewer instructions (sm_90 SASS, bench/sass_write.py: keys 16.3 per
    element against 23.7 by bytes at 64-channel blocks, 2-bit values 18.7 against 19.5); else one byte per store
    element (4-bit values: 13.2 against 18.3)."""
    return kind == "int_k" or bits == 2


#: KIVI writes by float16 pairs (``kivi_f16x2``) on NVIDIA GPUs: registers per thread (Triton's ``maxnreg``). Keys
#: take whole heads (no channel blocks) at WRITE_WARPS_KIVI_KEYS warps. H100, 65,536 x 8 x 128, head-major pages
#: (bench/results/history/ab-h100-session23-x2-*.json): unrotated keys at 64 registers int4 78.4 us (64-channel
#: blocks, one warp, no cap) -> 71.2 (0.81 of the ceiling), int2 72.3 (96) -> 68.4; values at 48 int2 65.9 (64) ->
#: 64.7, int4 66.9 -> 67.2 (noise); rotated keys at 96 int4 95.9 (no cap) -> 91.4, int2 97.3 -> 91.3 (80: 109.6 /
#: 106.9, 112: 96.6 / 94.8). Session 41 (bench/results/history/ab-write-h100-session41-int2k-*.json): unrotated
#: int2 keys uncapped 62.3 us (HND) / 63.3 (NHD) against 65.2 / 65.4 at 64 registers and 64.3 / 63.7 at 80, so
#: int2 keys take no cap (WRITE_MAXNREG_KIVI_X2_INT2_KEYS = None); int4 keys keep 64
WRITE_MAXNREG_KIVI_X2_KEYS = 64
WRITE_MAXNREG_KIVI_X2_INT2_KEYS = None
WRITE_MAXNREG_KIVI_X2_VALUES = 48
WRITE_MAXNREG_KIVI_X2_ROTATED_KEYS = 96


#: the butterfly route of rotated KIVI key writes by float16 pairs (``kivi_f16x2``), without word loads: sm_90 SASS
#: (bench/sass_write.py), int4 keys 32.2 instructions per element against 53.5 by split/join and 44.7 by sums (37.7
#: for the portable quantization's default, split/join with word loads), int2 32.1 against 68.0 and 44.6
ROTATED_KIVI_X2_KEYS_ROUTE = "shfl"


def f16_cvt_default(device) -> bool:
    """Whether the write kernel rounds to float16 by conversion instructions by default: on NVIDIA GPUs
    (``cvt.rn.f16.f32``: round to nearest even, subnormals kept, overflow to infinity, as IEEE and the float
    arithmetic route); not on ROCm (not measured there) nor in the interpreter."""
    return _nvidia_gpu(device)


#: the butterflies' data movement of a rotated write (``codecs.hadamard_rows``' ROUTE): "split" (split/join of the
#: pair axis), "sums" (two sums over the pair axis), "gather" (the partner ``x[j ^ h]`` of each cross-thread
#: stage by ``tl.gather``, then one fused multiply-add by +-1), "shfl" (the same with the partner by one CUDA
#: ``shfl.sync.bfly``: NVIDIA only, checked against the compiled layout, :func:`check_partner_layout`)
ROTATION_ROUTES = {"split": 0, "sums": 1, "gather": 2, "shfl": 2}


#: the default butterfly route of a rotated write, by cache tile kind: measured on the H100 (65,536 x 8 x 128 bf16,
#: rotated / unrotated write time, bench/results/rotation_writes_routes_h100.json, session 6): split/join, sums,
#: warp shuffles: fp8 1.44 / 1.42 / 1.22, fp4_e2m1 2.25 / 1.61 / 1.29, nvfp4 2.23 / 1.66 / 1.39, int4_kivi keys
#: 1.39 / 2.04 / 1.49. Warp shuffles on NVIDIA GPUs where they won; elsewhere (ROCm, the interpreter) the best of
#: the portable routes as timed on the H100. KIVI values (session 20, `bench/ab_rotation_write.py --side v`,
#: bench/results/history/ab-h100-session20-rotation-write-kivi-values.json): split/join 426.1 / 71.2 us (5.99),
#: sums 1.65, shuffles 1.34 (int4; int2 6.04 / 1.70 / 1.37).
ROTATION_SHFL_KINDS = frozenset({"fp8", "mxfp4", "nvfp4", "int_v"})
ROTATION_SUMS_KINDS = frozenset({"mxfp4", "nvfp4", "int_v"})


def rotation_route_default(kind: str, device=None) -> str:
    """The butterfly route of a rotated write of cache tile kind ``kind`` (``kernel_config``) on ``device`` by
    default: "shfl" for :data:`ROTATION_SHFL_KINDS` on an NVIDIA GPU, else "sums" for
    :data:`ROTATION_SUMS_KINDS`, else "split" (the measured choices)."""
    if device is not None and kind in ROTATION_SHFL_KINDS and _nvidia_gpu(device):
        return "shfl"
    return "sums" if kind in ROTATION_SUMS_KINDS else "split"


#: (constexprs, options, x dtype, device type) -> (LANE_H, LANE_N) of a settled shuffle-route write launch
_PARTNER_LANES: dict = {}


def _ttgir_of(launch, device) -> str:
    """The TTGIR of ``launch`` as it runs on ``device``: the JIT's own build on a CUDA device (``warmup``: compiled,
    not launched), else the sm_90 ahead-of-time build (``kernels.aot``, for the static study and CI)."""
    if getattr(device, "type", None) == "cuda":
        ck = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.constexprs, **launch.options)
        return ck.asm["ttgir"]
    from kvqref.backends._aot import make_target
    from kvqref.kernels.aot import compile_launch

    return compile_launch(launch, make_target("cuda", 90)).asm["ttgir"]


class LanesUnsettled(RuntimeError):
    """No lane run of the warp-shuffle butterflies matches the compiled layout (``cached``: known from an earlier
    attempt for the same configuration, which already said so)."""

    def __init__(self, message: str, cached: bool = False) -> None:
        super().__init__(message)
        self.cached = cached


def _arch_of(device) -> tuple:
    """The device type and, on a GPU, its compute capability (a layout is a property of the target)."""
    torch = _torch()
    dev = torch.device(device)
    return (dev.type, torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None)


#: tokens of the probe input of :func:`write_launches_agree` (a multiple of every write tile and KIVI group)
PROBE_TOKENS = 64


def write_launches_agree(launch, other_constexprs: dict, device) -> bool:
    """Whether the write ``launch`` and the same launch with ``other_constexprs`` write the same bytes on a probe
    input (PROBE_TOKENS random tokens of the launch's dtype, wide magnitudes, one page-aligned run of slots, into
    zeroed fields of the launch's own strides), compared as integers. Runs both on ``device``."""
    torch = _torch()
    x, slots, f0, f1, f2 = launch.args[:5]
    cx = launch.constexprs
    head_major = cx["PAGE_SLOTS"] != cx["PAGE"]
    n = max(PROBE_TOKENS, cx["BLOCK_T"], cx["G"], cx["PAGE"])
    n = -(-n // cx["PAGE"]) * cx["PAGE"]
    rows = n // cx["PAGE"] if head_major else n  # leading rows of each probe field (pages where head-major)
    g = torch.Generator(device=device).manual_seed(1234)
    mag = torch.exp2(torch.randint(-8, 9, (n, x.shape[1], 1), generator=g, device=device).float())
    xp = (torch.randn(n, *x.shape[1:], generator=g, device=device) * mag).to(x.dtype)
    sp = torch.arange(n, dtype=slots.dtype, device=device)
    outs = []
    for extra in ({}, other_constexprs):
        fields = {}
        for t in (f0, f1, f2):  # aliases (schemes with fewer fields) stay aliases
            fields.setdefault(id(t), torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=device))
        fp = [fields[id(t)] for t in (f0, f1, f2)]
        args = [xp, sp, *fp, *launch.args[5:6], n, *launch.args[7:]]
        grid = (-(-n // cx["BLOCK_T"]), *launch.grid[1:])
        launch.kernel[grid](*args, **{**cx, **extra}, **launch.options)
        outs.append([t.view(torch.uint8) for t in fields.values()])  # every byte, as integers
    return all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


def settle_partner_lanes(launch, device, d: int):
    """Fix a shuffle-route write launch's ``ROT_LANE_H``/``ROT_LANE_N`` to the lanes the compiled kernel actually
    gives the butterflies' rows (``kernels/layout.py``): compile, read the lane bases of the shuffled tensor,
    recompile with them until they agree (the layout is Triton's choice over the whole kernel: lanes start at
    column 16 for FP8 on sm_90 at D = 128), else the lane runs up to the row's top, fewest shuffled stages first,
    until one is checked (FP4 and KIVI keys at D = 128: lanes from column 8), each shuffle checked against it.
    On an NVIDIA GPU the settled launch is then run on a probe input beside the portable partner route (``gather``,
    the same arithmetic) and must write the same bytes (:func:`write_launches_agree`). LanesUnsettled if no lane
    run is checked or the bytes differ (the failure cached too); cached per constexprs, options, x dtype and
    target."""
    from kvqref.kernels.layout import check_partner_layout, row_lanes, shuffle_lane_bases

    cx = launch.constexprs
    key = (tuple(sorted((k, v) for k, v in cx.items() if k not in ("ROT_LANE_H", "ROT_LANE_N"))),
           tuple(sorted(launch.options.items())), launch.args[0].dtype, _arch_of(device))
    if key in _PARTNER_LANES:
        if _PARTNER_LANES[key] is None:
            raise LanesUnsettled("no lane run of the warp-shuffle butterflies matched the compiled layout", cached=True)
        cx["ROT_LANE_H"], cx["ROT_LANE_N"] = _PARTNER_LANES[key]
        return launch

    def settles(lanes) -> bool:
        cx["ROT_LANE_H"], cx["ROT_LANE_N"] = lanes
        ttgir = _ttgir_of(launch, device)
        try:
            check_partner_layout(ttgir, *lanes, d)
        except RuntimeError:
            found = shuffle_lane_bases(ttgir)
            tried.append((lanes, row_lanes(found[0][1], d) if found else None))
            return False
        if _nvidia_gpu(device) and not write_launches_agree(launch, {"ROT_SHFL": False}, device):
            # the lane bases fit, yet the compiled kernel wrote other bytes than the same butterflies with their
            # partners by tl.gather (H100, triton 3.6: bfloat16 input, 2-token x 2-head tiles at 1 warp, FP4 codes)
            _PARTNER_LANES[key] = None
            raise LanesUnsettled(f"the warp-shuffle butterflies fit the compiled layout by their lane bases but wrote "
                                 f"other bytes than rotation_route='gather' on a probe input (lanes {lanes})")
        _PARTNER_LANES[key] = lanes
        return True

    tried: list = []
    lanes = (cx["ROT_LANE_H"], cx["ROT_LANE_N"])
    for _ in range(3):  # the lanes the compiled kernel reports, until they agree
        if settles(lanes):
            return launch
        if tried[-1][1] is None or tried[-1][1] == lanes:
            break
        lanes = tried[-1][1]
    # the layout moves with the stages chosen: try the lane runs that reach the row's top (the last stages all by
    # shuffle, so no split/join converts a layout after them), fewest shuffled stages first
    for n in (2, 4, 8, 16, 32):
        if n <= d and (d // n, n) not in (t[0] for t in tried) and settles((d // n, n)):
            return launch
    _PARTNER_LANES[key] = None
    raise LanesUnsettled(f"no lane run of the warp-shuffle butterflies matched the compiled layout (tried {tried}); "
                         "use rotation_route='gather'")


def choose_write_launch(side: Side, x, slot_mapping, *, block_t: int | None = None, block_h: int | None = None,
                        num_warps: int | None = None, hw_fp8: bool | None = None, f16_cvt: bool | None = None,
                        rotation_route: str | None = None, nvfp4_blocks: bool | None = None,
                        block_d: int | None = None, store_as_loaded: bool | None = None,
                        word_load: bool | None = None, maxnreg: int | None = None, kivi_f16x2: bool | None = None,
                        heads_fast: bool | None = None, x_evict_first: bool | None = None):
    """The launch of :func:`quantize_write` made from scratch (checked on the host first; :func:`plan_write` keeps
    it). ``maxnreg``: a register cap per thread
    (Triton's CUDA option; NVIDIA GPUs only, for tuning; 0: no cap on any device; default: the measured caps below,
    else none).
    ``block_t``/``block_h``/``num_warps``: the tile and warps (default :func:`write_tile`, WRITE_WARPS; KIVI keys
    always take BLOCK_T = G);
    ``hw_fp8``: OCP FP8 codes by the hardware conversion (default: :func:`hardware_fp8_encode` of x's
    device); ``f16_cvt``: KIVI/float16 roundings by conversion instructions (IEEE round-to-nearest-even, the
    same bits as the float arithmetic) instead of float arithmetic; default: on NVIDIA GPUs (:func:`f16_cvt_default`),
    where it measured faster (int4 values 0.62 -> 0.77 of the ceiling, keys 0.55 -> 0.63). ``rotation_route``: how
    a rotated side's butterflies move their data (:data:`ROTATION_ROUTES`), the same bits
    (``codecs.hadamard_rows``); default :func:`rotation_route_default`. ``nvfp4_blocks``: NVFP4 writes of bfloat16
    input (unrotated; ignored otherwise) with whole 16-element blocks per thread, the same bytes (default
    :func:`nvfp4_blocks_default`; its default tile: NVFP4_BLOCKS_TILE_ELEMS elements, NVFP4_BLOCKS_WARPS warps).
    ``block_d`` (KIVI keys, unrotated): channels per program, a power of two dividing head_dim (per-channel
    statistics: each program then quantizes [G tokens, block_d channels] of one head, the grid gains an axis of
    head_dim // block_d channel blocks, the same bytes). ``store_as_loaded`` (KIVI keys): each thread stores the code
    bytes it packed and its channels' scales and zeros (the stores take the load's layout: no layout conversion
    through shared memory; the same bytes). Defaults of both, and of the warps with them:
    :func:`kivi_key_blocks_default` (else head_dim, stores converted, and on NVIDIA GPUs at most
    WRITE_MAXNREG_KIVI_KEYS registers per thread). ``word_load`` (rotated FP4 kinds, bfloat16 input at a 4-byte
    aligned address): each pair of elements loaded as one 32-bit word (the same bytes; default
    :func:`rotated_word_load_default`; rotated E8M0 writes with word loads take tiles of
    ROTATED_E8M0_WORDS_TILE_ELEMS elements unless ``block_t`` is given). ``kivi_f16x2`` (KIVI writes, NVIDIA GPUs):
    float16 element pairs, one 32-bit word each, quantized by packed and conversion instructions in inline PTX (the
    same bytes; default :func:`kivi_f16x2_default`); unrotated bfloat16 input is then loaded as words.
    ``heads_fast``: the grid's fastest axis walks the head blocks (grid ``(head blocks, token blocks)``), so that the
    programs running together read whole token rows of x (the same bytes; needs at most 65,535 token blocks);
    default: unrotated KIVI keys on NVIDIA GPUs (one head per program), where it measured faster.
    ``x_evict_first``: x loaded with the ``evict_first`` cache policy (the same bytes; default
    :func:`write_evict_first_default`)."""
    import triton

    from kvqref.kernels.codecs import INTERPRET
    from kvqref.kernels.decode import KIND_IDS, Launch
    from kvqref.kernels.write import quantize_write_kernel

    torch = _torch()
    if x.dim() != 3:
        raise ValueError(f"x must be [tokens, kv_heads, head_dim], got shape {tuple(x.shape)}")
    if slot_mapping.shape != (x.shape[0],):
        raise ValueError(f"slot_mapping must have one entry per token ({x.shape[0]}), got {tuple(slot_mapping.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    rotation = rotation_of(side.scheme)
    if rotation_route is not None and rotation is None:
        raise ValueError(f"rotation_route needs a rotated scheme, got {side.scheme.name} (no butterflies to run)")
    route_given = rotation_route is not None
    kind = kernel_config(side.codec)["kind"]
    x2_wanted = kivi_f16x2_default(kind, x.device) if kivi_f16x2 is None else bool(kivi_f16x2)
    if rotation_route is None:
        rotation_route = "split" if rotation is None else rotation_route_default(kind, x.device)
        if rotation is not None and kind == "int_k" and x2_wanted:
            rotation_route = ROTATED_KIVI_X2_KEYS_ROUTE
    if rotation_route not in ROTATION_ROUTES:
        raise ValueError(f"rotation_route must be one of {sorted(ROTATION_ROUTES)}, got {rotation_route!r}")
    # (an ahead-of-time build for a CUDA target plans on CPU tensors outside the interpreter: allowed)
    if rotation_route == "shfl" and (INTERPRET or getattr(torch.version, "hip", None) and x.device.type == "cuda"):
        raise ValueError("rotation_route='shfl' runs CUDA warp shuffles (inline PTX): not in the interpreter nor "
                         "on ROCm (use 'gather', the same arithmetic in portable Triton)")
    if x.device != slot_mapping.device or x.device != next(iter(side.fields.values())).device:
        raise ValueError("x, slot_mapping and the cache must be on one device")
    cfg = kernel_config(side.scheme)
    args = write_args(side, x, slot_mapping, cfg.get("sglang") == 2)
    x = args[0]
    rdt, qdt = (0, _model_input(side.scheme, x)[1]) if rotation is None else _rotated_dtypes(side.codec)
    n, kv_heads, head_dim = x.shape
    tiles = side.tiles()
    page = tiles.fields[0].shape[2] if side.head_major else 1  # tokens per page (field 0 is per token); NHD: unused
    dt, dh = write_tile(cfg["kind"], kv_heads, head_dim, cfg.get("group", 1))
    tile_given = block_t is not None
    nv_blocks = False
    if cfg["kind"] == "int_k":
        block_t, block_h = dt, block_h or dh
        if n % block_t:
            raise ValueError(f"{side.scheme.name} keys are written in whole groups of {block_t} tokens, got {n}")
    else:
        nv_blocks = nvfp4_blocks_default(x.device) if nvfp4_blocks is None else bool(nvfp4_blocks)
        nv_blocks = nv_blocks and cfg["kind"] == "nvfp4" and x.dtype == torch.bfloat16 and rotation is None
        block_h = block_h or (min(dh, NVFP4_BLOCKS_HEADS_HND) if nv_blocks and side.head_major else dh)
        block_t = block_t or (max(1, NVFP4_BLOCKS_TILE_ELEMS // (block_h * head_dim)) if nv_blocks else dt)
    if block_d is None and cfg["kind"] == "int_k" and rotation is None and not x2_wanted:
        chosen = kivi_key_blocks_default(cfg["bits"], head_dim, x.device)
        if chosen is not None:
            block_d, num_warps = chosen[0], num_warps or chosen[1]
            store_as_loaded = chosen[2] if store_as_loaded is None else store_as_loaded
    if block_d is not None and block_d != head_dim:
        if cfg["kind"] != "int_k" or rotation is not None:
            raise ValueError(f"block_d: KIVI keys without rotation only (per-channel statistics), got "
                             f"{side.scheme.name}")
        if not (isinstance(block_d, int) and 0 < block_d < head_dim and head_dim % block_d == 0
                and block_d & (block_d - 1) == 0 and block_d * cfg["bits"] % 8 == 0):
            raise ValueError(f"block_d must be a power of two dividing head_dim {head_dim} into whole code bytes, "
                             f"got {block_d!r}")
    else:
        block_d = head_dim
    hw = hardware_fp8_encode(x.device) if hw_fp8 is None else hw_fp8
    # rotated FP4 and KIVI kinds of bfloat16 input at a 4-byte aligned address: element pairs as 32-bit words
    words = ((rotated_word_load_default(cfg["kind"], cfg.get("bits", 4), x.device, cfg.get("sglang", 0))
              if word_load is None else bool(word_load)) and rotation is not None and x.dtype == torch.bfloat16
             and cfg["kind"] in ("mxfp4", "nvfp4", "int_k", "int_v") and not nv_blocks and x.data_ptr() % 4 == 0)
    is_kivi = cfg["kind"] in ("int_k", "int_v")
    if kivi_f16x2 and (INTERPRET or not _nvidia_gpu(x.device) and x.device.type == "cuda"):
        raise ValueError("kivi_f16x2 runs CUDA inline PTX: not in the interpreter nor on ROCm")
    if kivi_f16x2 and not is_kivi:
        raise ValueError(f"kivi_f16x2: KIVI schemes only, got {side.scheme.name}")
    # (pairs of whole value groups; the program's code bytes in whole 32-bit words)
    x2_fits = is_kivi and (cfg["kind"] == "int_k" or cfg["group"] % 2 == 0) and block_d * cfg.get("bits", 8) % 32 == 0
    if kivi_f16x2 and not x2_fits:
        raise ValueError(f"kivi_f16x2 needs value groups of an even size and the program's code bytes in whole 32-bit "
                         f"words (head_dim or block_d times the code bits a multiple of 32); got {side.scheme.name}, "
                         f"group {cfg.get('group')}, {block_d} channels")
    x2 = x2_wanted and x2_fits
    if x2 and rotation is None and word_load is not False:  # unrotated bfloat16 pairs loaded as words
        words = x.dtype == torch.bfloat16 and x.data_ptr() % 4 == 0
    elif x2 and rotation is not None and cfg["kind"] == "int_k" and word_load is None:
        words = False  # (rotated keys by pairs: ROTATED_KIVI_X2_KEYS_ROUTE without word loads)
    if words and cfg["kind"] == "mxfp4" and not tile_given:  # (measured with word loads: ROTATED_E8M0_WORDS_...)
        block_t = max(1, ROTATED_E8M0_WORDS_TILE_ELEMS // (block_h * head_dim))
    cx = dict(KIND=KIND_IDS[cfg["kind"]], FMT=cfg.get("fmt", 0), SGLANG=int(cfg.get("sglang", 0)), QDT=qdt,
              SATURATE=bool(cfg.get("saturate", True)),
              TOKEN_SCALE=cfg.get("token_scale", False), QB=cfg.get("block", 16), G=cfg.get("group", 1),
              BITS=cfg.get("bits", 8), D=head_dim, BLOCK_T=block_t, BLOCK_H=block_h,
              HW_FP8=bool(hw and cfg.get("fmt", 0) in (0, 1)),
              F16_CVT=f16_cvt_default(x.device) if f16_cvt is None else bool(f16_cvt),
              ROTATE=rotation is not None, RDT=rdt, ROT_ROUTE=ROTATION_ROUTES[rotation_route],
              ROT_LANE_H=16, ROT_LANE_N=8, ROT_SHFL=rotation_route == "shfl",
              NV_BLOCKS=nv_blocks, BLOCK_D=0 if block_d == head_dim else block_d,
              STORE_AS_LOADED=bool(store_as_loaded), PAGE=page, PAGE_SLOTS=tiles.page_slots(page),
              WORD_LOAD=words, KIVI_X2=x2, X2_WORDS=x2 and kivi_x2_code_words(cfg["kind"], cfg.get("bits", 4)))
    # rotated: no FP contraction anywhere in the kernel, so the float32 rotation is the oracle's bit for bit
    # whatever consumes it (docs/rotation.md; the butterflies themselves hold no multiply to contract)
    options = {"num_warps": num_warps or (WRITE_WARPS_KIVI_KEYS if cfg["kind"] == "int_k" else
                                          NVFP4_BLOCKS_WARPS if nv_blocks else WRITE_WARPS)}
    if rotation is not None:
        options["enable_fp_fusion"] = False
    if x2 and _nvidia_gpu(x.device) and (cfg["kind"] == "int_v" or block_d == head_dim):
        cap = (WRITE_MAXNREG_KIVI_X2_VALUES if cfg["kind"] == "int_v" else
               WRITE_MAXNREG_KIVI_X2_ROTATED_KEYS if rotation is not None else
               WRITE_MAXNREG_KIVI_X2_INT2_KEYS if cfg["bits"] == 2 else WRITE_MAXNREG_KIVI_X2_KEYS)
        if cap is not None:
            options["maxnreg"] = cap
    elif cfg["kind"] == "int_v" and _nvidia_gpu(x.device):
        options["maxnreg"] = WRITE_MAXNREG_KIVI_VALUES
    elif cfg["kind"] == "int_k" and rotation is None and block_d == head_dim and _nvidia_gpu(x.device):
        options["maxnreg"] = WRITE_MAXNREG_KIVI_KEYS
    if maxnreg == 0 and not isinstance(maxnreg, bool):  # no cap, whatever the default
        options.pop("maxnreg", None)
    elif maxnreg is not None:
        if not _nvidia_gpu(x.device) or isinstance(maxnreg, bool) or not isinstance(maxnreg, int) or maxnreg < 16:
            raise ValueError(f"maxnreg (registers per thread, an int >= 16, or 0 for none) needs an NVIDIA GPU; got "
                             f"{maxnreg!r} on {x.device}")
        options["maxnreg"] = maxnreg
    t_blocks, h_blocks = triton.cdiv(n, block_t), triton.cdiv(kv_heads, block_h)
    if heads_fast is None:  # unrotated KIVI keys by head on NVIDIA GPUs (H100, session 24: int4 keys 71.1 -> 69.0 us,
        # int2 68.2 -> 66.8; values, rotated and other writes unchanged: bench/results/ANALYSIS.md)
        hf = (cfg["kind"] == "int_k" and rotation is None and h_blocks > 1 and t_blocks <= 65535
              and _nvidia_gpu(x.device))
    else:
        hf = bool(heads_fast)
    if hf and t_blocks > 65535:
        raise ValueError(f"heads_fast puts the {t_blocks} token blocks on the grid's second axis (at most 65,535)")
    cx["HEADS_FAST"] = hf
    if x_evict_first is None:
        x_evict_first = write_evict_first_default(cfg["kind"], cfg.get("bits", 8), rotation is not None, x.device)
    cx["X_EVICT"] = "evict_first" if x_evict_first else ""
    grid = (h_blocks, t_blocks) if hf else (t_blocks, h_blocks)
    if block_d != head_dim:
        grid += (head_dim // block_d,)
    launch = Launch(quantize_write_kernel, grid, args, cx, options)
    if rotation_route == "shfl":  # the lane masks must match the layout Triton gives the rows: read it back
        try:
            settle_partner_lanes(launch, x.device, head_dim)
        except LanesUnsettled as err:
            if route_given:
                raise
            portable = rotation_route_default(cfg["kind"])  # the same bytes by another route, said once per config
            if not err.cached:
                warnings.warn(f"{side.scheme.name}: the default warp-shuffle butterflies do not fit this kernel's "
                              f"layout ({err}); writing by rotation_route={portable!r} instead (the same bytes, "
                              "slower)", RuntimeWarning, stacklevel=2)
            return choose_write_launch(side, x, slot_mapping, block_t=block_t, block_h=block_h,
                                       num_warps=num_warps, hw_fp8=hw_fp8, f16_cvt=f16_cvt,
                                       rotation_route=portable, block_d=block_d, store_as_loaded=store_as_loaded,
                                       word_load=word_load, maxnreg=maxnreg, kivi_f16x2=kivi_f16x2,
                                       heads_fast=heads_fast, x_evict_first=x_evict_first)
    return launch


def write_args(side: Side, x, slot_mapping, reciprocal_scale: bool) -> list:
    """The write kernel's positional arguments for ``x`` [tokens, kv_heads, D] into ``side`` at ``slot_mapping``:
    x in the model dtype (unrotated: :func:`_model_input`; a rotated write reads the input as given), contiguous;
    the slots as int64; the fields in :data:`FIELD_ORDER` (the unused ones alias the first); the tensor scale
    (``reciprocal_scale``, SGLang's float scale: ``1 / s`` rounded to float32 once, torch's ``x * (1 / s)``);
    tokens, heads and the strides of x and of the fields' rows; the rotation's signs and C_D (unused without a
    rotation: the tensor scale and 1.0)."""
    torch = _torch()
    rotation = rotation_of(side.scheme)
    if rotation is None:
        x = _model_input(side.scheme, x)[0]
    x = x.contiguous()
    tiles = side.tiles()
    sc = side.tensor_scale
    if reciprocal_scale:
        sc = (1.0 / sc.double()).float()
    signs, c_d = sc, 1.0
    if rotation is not None:
        signs, c_d = rotation_signs(rotation, x.shape[2], x.device), float(norm_f32(x.shape[2]))
    return [x, slot_mapping.to(torch.int64).contiguous(), *tiles.field_args(), sc, x.shape[0], x.shape[1],
            x.stride(0), x.stride(1), *tiles.stride_args(), signs, c_d]


class WritePlan(NamedTuple):
    """A kept write launch (:func:`plan_write`): everything but its tensor arguments, which :func:`write_args`
    binds per call, and the :class:`~kvqref.kernels.decode.LaunchHandle` that launches its compiled kernel
    directly after the first call."""

    kernel: Any
    grid: tuple
    constexprs: dict
    options: dict
    handle: Any


#: write plans by :func:`write_plan_key` (:func:`plan_write`)
_WRITE_PLANS = KeptPlans()
#: how many write plans :func:`plan_write` keeps (a decode step writes one shape per layer kind: a few)
WRITE_PLAN_CACHE_SIZE = 256


def clear_write_plan_cache() -> None:
    """Forget every kept write plan (:func:`plan_write`)."""
    _WRITE_PLANS.forget()


def write_plan_key(side: Side, x, slot_mapping, options: dict) -> tuple:
    """The key of a write plan: everything :func:`choose_write_launch` reads: the side's scheme (the object) and
    tiles (every attribute; the fields' and tensor scale's shapes, strides, dtypes and alignment), x's and the
    slots' shapes, strides, dtypes and alignment, the devices, whether they are NVIDIA GPUs running compiled
    kernels (the device facts the defaults ask for are the device's) and the options; TypeError for an option that
    cannot be a key."""
    from kvqref.kernels.codecs import INTERPRET
    from kvqref.kernels.decode import _tensor_key

    tiles = side.tiles()
    env = (str(x.device), str(slot_mapping.device), str(tiles.fields[0].device), _nvidia_gpu(x.device), INTERPRET)
    key = (env, side.scheme, tiles.plan_key(), _tensor_key(x), _tensor_key(slot_mapping),
           tuple(sorted(options.items())))
    hash(key)
    return key


def plan_write(side: Side, x, slot_mapping, *, cache: bool = True, **options: Any):
    """The launch of :func:`quantize_write`: ``options`` are :func:`choose_write_launch`'s. With ``cache``
    (default) the launch's choices are made once per :func:`write_plan_key` and kept (the last
    :data:`WRITE_PLAN_CACHE_SIZE`), then bound to each call's tensors (:func:`write_args`), and the kept plan's
    compiled kernel is launched directly after its first call (``kernels.decode.LaunchHandle``), as a decode plan's:
    a decode step's writes then skip both the choices (52-77 us of host time on this project's CPU) and Triton's
    per-launch argument binding. The tuning constants of this module are read when a plan is made:
    :func:`clear_write_plan_cache` after changing one."""
    from kvqref.kernels.decode import Launch, LaunchHandle

    key = KeptPlans.key_of(write_plan_key, side, x, slot_mapping, options) if cache else None
    plan = _WRITE_PLANS.serve(key)
    if plan is None:
        launch = choose_write_launch(side, x, slot_mapping, **options)
        if key is None:
            return launch
        plan = WritePlan(launch.kernel, launch.grid, launch.constexprs, launch.options, LaunchHandle())
        _WRITE_PLANS.keep(key, plan, WRITE_PLAN_CACHE_SIZE)
        args = launch.args
    else:
        args = write_args(side, x, slot_mapping, plan.constexprs["SGLANG"] == 2)
    return Launch(plan.kernel, plan.grid, args, dict(plan.constexprs), plan.options, plan.handle)


def quantize_write(side: Side, x, slot_mapping, *, validate: bool = True, **launch: Any) -> None:
    """Quantize ``x`` [tokens, kv_heads, D] into ``side``'s fields at ``slot_mapping`` [tokens] (int64;
    -1 skips a token), in place, with the scheme's exact rounding (bytes equal the oracle's). KIVI keys:
    tokens come in whole, slot-consecutive groups of G. E2M1 and KIVI schemes reject NaN/Inf input, and KIVI input
    that rounds beyond float16's range or a group whose range does (:func:`_check_kivi_range`), as the oracle does;
    ``validate=False`` skips these checks (reductions and a device sync) in a serving loop. A rotated scheme:
    the kernel rotates each (token, head) vector first (the bytes of ``RotatedScheme.quantize``); NaN/Inf
    input and rotated values that overflow are rejected as the oracle rejects them. ``launch``: the launch
    options of :func:`plan_write`."""
    torch = _torch()
    needs_finite = isinstance(side.codec, (E8M0BlockScheme, NVFP4Scheme, KiviScheme))
    if validate and rotation_of(side.scheme) is not None and x.dim() == 3:
        _check_rotated_input(side, x, _rotated_dtypes(side.codec)[0])
    if validate and needs_finite and not torch.isfinite(x).all():
        raise ValueError(f"{side.scheme.name}: input holds NaN or Inf")
    if validate and side.params:  # the scales the kernel divides by: once per call, on the host
        side.scheme.check_params(side.params, x.shape[1] if x.dim() == 3 else None)
    plan = plan_write(side, x, slot_mapping, **launch)
    if validate and isinstance(side.codec, KiviScheme):
        _check_kivi_range(side, x, slot_mapping)
    if validate and slot_mapping.numel():  # a slot beyond the cache would be written out of bounds
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= side.num_slots:
            raise ValueError(f"slot_mapping holds slots outside [-1, {side.num_slots}) (-1 skips a token): "
                             f"min {lo}, max {hi}")
    if validate and plan.constexprs["SGLANG"] == 1 and plan.constexprs["QDT"] == QDT_IDS["float16"]:
        s16 = side.tensor_scale.to(torch.float16)
        if not (torch.isfinite(s16).all() and (s16 > 0).all()):
            raise ValueError(f"{side.scheme.name}: a scale is 0 or Inf in float16, which SGLang's division in "
                             "the model dtype turns into NaN/Inf")
    plan()
