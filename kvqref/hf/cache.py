"""``QuantizedKVCache``: a transformers ``Cache`` whose layers hold K and V in a kvqref scheme's stored form.

Layers follow transformers' ``cache_utils.py`` conventions: one layer class per storage policy, ``update()``
the entry point. :class:`QuantizedKVLayer` (backends ``numpy`` and ``torch``) writes with the NumPy oracle,
so the stored bytes are the oracle's by construction; :class:`TritonQuantizedKVLayer` (backend ``triton``)
writes with the fused Triton kernel into the same layout on the device. Both keep keys after RoPE, exactly
the fields :class:`kvqref.paged.PagedKVCache` stores (see :mod:`kvqref.hf.storage`). Semantics, prefill
modes and limits: docs/hf.md.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvqref import backends
from kvqref.calibration.scales import ScaleSet
from kvqref.hf import attention as attn
from kvqref.hf.storage import DeviceIndex, SideStore, page_size_for
from kvqref.schemes import KiviScheme, Scheme
from kvqref.schemes import get as get_scheme
from kvqref.schemes.rotation import rotation_of, storage_scheme

PREFILL_MODES = ("as_decoded", "full", "dequantized")


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:  # older transformers
        return get()


def check_model_config(config: Any) -> tuple[int, int, int, int]:
    """(layers, q_heads, kv_heads, head_dim) of a decoder config; ValueError naming what is unsupported."""
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("QuantizedKVCache: encoder-decoder models (cross-attention caches) are not supported")
    for attr in ("kv_lora_rank", "q_lora_rank"):
        if getattr(config, attr, None):
            raise ValueError(f"QuantizedKVCache: multi-head latent attention (MLA, config.{attr}) is not supported")
    types = set(getattr(config, "layer_types", None) or [])
    bad = types - {"full_attention"}
    if bad:
        raise ValueError(f"QuantizedKVCache: only full-attention layers are supported; this model has {sorted(bad)}")
    sw = getattr(config, "sliding_window", None)
    if sw and getattr(config, "use_sliding_window", True):
        raise ValueError(f"QuantizedKVCache: sliding-window attention (config.sliding_window={sw}) is not supported")
    if getattr(config, "attention_chunk_size", None):
        raise ValueError("QuantizedKVCache: chunked local attention (config.attention_chunk_size) is not supported")
    n_layers = config.num_hidden_layers
    q_heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or q_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // q_heads
    if q_heads % kv_heads:
        raise ValueError(f"QuantizedKVCache: {q_heads} query heads are not a multiple of {kv_heads} KV heads")
    return n_layers, q_heads, kv_heads, head_dim


def build_schemes(scheme: str | tuple[Scheme, Scheme], k_options: dict | None,
                  v_options: dict | None, rotation: str | None = None,
                  rotation_seed: Any = None) -> tuple[Scheme, Scheme]:
    """(K scheme, V scheme) from a scheme name (+ per-side options; KIVI gets role="key"/"value"; ``rotation`` /
    ``rotation_seed``: both sides rotated, the same seed) or a pair of Schemes (rotated ones included)."""
    both = {k: v for k, v in (("rotation", rotation), ("rotation_seed", rotation_seed)) if v is not None}
    if isinstance(scheme, str):
        ko, vo = dict(k_options or {}), dict(v_options or {})
        for label, o in (("k_options", ko), ("v_options", vo)):
            clash = sorted(set(both) & set(o))
            if clash:
                raise ValueError(f"QuantizedKVCache: {clash[0]} given both as an argument and in {label}; give it "
                                 "once (the argument applies to K and V, the options to one side)")
            o.update(both)
        if get_scheme(scheme, **({"role": "value"} if "kivi" in scheme else {})).__class__ is KiviScheme:
            ko.setdefault("role", "key")
            vo.setdefault("role", "value")
        return get_scheme(scheme, **ko), get_scheme(scheme, **vo)
    if isinstance(scheme, (tuple, list)) and len(scheme) == 2 and all(isinstance(s, Scheme) for s in scheme):
        if k_options or v_options or both:
            raise ValueError("QuantizedKVCache: k_options/v_options/rotation/rotation_seed apply to a scheme name, "
                             "not to Scheme objects (build rotated ones with kvqref.schemes.get(name, "
                             "rotation='hadamard', rotation_seed=S))")
        return scheme[0], scheme[1]
    raise TypeError(f"QuantizedKVCache: scheme must be a scheme name or a (K, V) pair of Schemes, got {scheme!r}")


def layer_params(name: str, given: Any, scheme: Scheme, side: str, num_layers: int,
                 kv_heads: int) -> list[dict[str, Any] | None]:
    """Per-layer tensor-level params from ``given`` (``k_params``/``v_params`` of :class:`QuantizedKVCache`):
    ``None`` (every layer calibrates on its first quantized chunk), one params dict for every layer, a list
    of one dict per layer, or a :class:`kvqref.calibration.ScaleSet` (its ``params(layer, side)``). Each
    layer's params are checked by ``scheme.check_params(params, kv_heads)``; ValueError names the layer."""
    if given is None:
        return [None] * num_layers
    if isinstance(given, ScaleSet):
        if rotation_of(scheme) is not None:
            raise ValueError(f"QuantizedKVCache: {name} is a ScaleSet of {given.scheme} scales for unrotated K/V, but "
                             f"the {side.upper()} scheme is rotated ({scheme.name}): its static scale applies to the "
                             "rotated values (docs/rotation.md); give params calibrated on rotated K/V as a dict or "
                             "a list of one dict per layer")
        if given.scheme != scheme.name:
            raise ValueError(f"QuantizedKVCache: {name} holds {given.scheme} scales, but the {side.upper()} "
                             f"scheme is {scheme.name}")
        if given.num_layers != num_layers:
            raise ValueError(f"QuantizedKVCache: {name} covers {given.num_layers} layers, the model has {num_layers}")
        per_layer = [given.params(i, side) for i in range(num_layers)]
    elif isinstance(given, dict):
        per_layer = [given] * num_layers
    elif isinstance(given, (list, tuple)):
        if len(given) != num_layers:
            raise ValueError(f"QuantizedKVCache: {name} has {len(given)} entries, the model has {num_layers} layers "
                             "(give one params dict per layer, or one dict for all)")
        per_layer = list(given)
    else:
        raise TypeError(f"QuantizedKVCache: {name} must be a params dict, a list of one dict per layer or a "
                        f"kvqref.calibration.ScaleSet, got {type(given).__name__}")
    out = []
    for i, p in enumerate(per_layer):
        if not isinstance(p, dict):
            raise TypeError(f"QuantizedKVCache: {name} of layer {i} must be a params dict, got {type(p).__name__}")
        try:
            out.append(scheme.check_params(p, kv_heads))
        except (TypeError, ValueError) as e:
            raise type(e)(f"QuantizedKVCache: {name} of layer {i}: {e}") from None
    return out


class QuantizedKVLayer(CacheLayerMixin):
    """One attention layer's K and V in a scheme's stored form, written by the NumPy oracle.

    ``update()`` writes the new tokens (keys after RoPE) and returns K/V for any attention implementation:
    the dequantized cache in the model dtype (see the prefill modes in docs/hf.md). With the ``"kvqref"``
    attention, ``update()`` only records the new tokens; the attention writes them (padding dropped) and
    attends over the quantized cache itself.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True
    writer = "oracle"

    def __init__(self, cache: QuantizedKVCache, layer_idx: int) -> None:
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.reset()

    @property
    def read_how(self) -> str:
        return "oracle" if self.cache.backend.name == "numpy" else "torch"

    # -- transformers' layer API ------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        c = self.cache
        if (H, D) != (c.kv_heads, c.head_dim):
            raise ValueError(f"QuantizedKVCache layer {self.layer_idx}: got K of {H} heads x {D}, the config says "
                             f"{c.kv_heads} x {c.head_dim}")
        if value_states.shape != key_states.shape:
            raise ValueError(f"QuantizedKVCache: K {tuple(key_states.shape)} and V {tuple(value_states.shape)} differ "
                             "(different K and V head dims are not supported)")
        self.dtype, self.device = key_states.dtype, key_states.device
        P = page_size_for(c.k_scheme, c.v_scheme)
        index = c.device_index(self.device)
        i = self.layer_idx
        self.k = SideStore("K", c.k_scheme, B, H, D, P, self.device, self.writer, index, c.k_params[i])
        self.v = SideStore("V", c.v_scheme, B, H, D, P, self.device, self.writer, index, c.v_params[i])
        self.lens = np.zeros(B, np.int64)  # tokens stored per sequence (padding excluded with "kvqref" attention)
        self.kept = torch.zeros(B, 0, dtype=torch.bool, device=self.device)  # positions stored, per sequence
        self.mode = "kvqref" if c.attention_is_kvqref() else "standard"
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``key_states``/``value_states`` ``[batch, kv_heads, n, head_dim]``; return what attention reads."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.k.batch:
            raise ValueError(f"QuantizedKVCache: batch {key_states.shape[0]} != the cache's {self.k.batch}")
        mode = "kvqref" if self.cache.attention_is_kvqref() else "standard"
        if mode != self.mode:
            raise RuntimeError(f"QuantizedKVCache: the model's attention changed from {self.mode!r} to {mode!r} "
                               "while the cache holds tokens; use a new cache")
        if self.pending is not None:
            raise RuntimeError("QuantizedKVCache: the 'kvqref' attention did not consume the previous update of layer "
                               f"{self.layer_idx}; is the model's attn_implementation 'kvqref'?")
        n = key_states.shape[2]
        self.positions += n
        if self.mode == "kvqref":
            self.pending = (key_states, value_states)
            key_states._kvqref_layer = self  # the attention finds its layer through the tensor it receives
            return key_states, value_states
        return self._update_standard(key_states, value_states)

    def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self, *args: Any) -> int:
        return self.positions

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if hasattr(self, "cache"):
            self.cache.__dict__.pop("_keep_memo", None)
        self.is_initialized = False
        self.keys = self.values = None
        self.positions = 0
        self.pending = None
        self.k = self.v = None

    def offload(self) -> None:
        raise NotImplementedError("QuantizedKVCache: offloading is not supported")

    def prefetch(self) -> None:
        return None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: sequence ``b`` becomes a copy of sequence ``beam_idx[b]`` (codes, scales and residual)."""
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        self.cache.__dict__.pop("_keep_memo", None)
        idx = torch.as_tensor(indices, device=self.device)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        for s in (self.k, self.v):
            s.select(idx)
        self.lens = self.lens[idx.cpu().numpy()].copy()
        self.kept = self.kept.index_select(0, idx.long())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.batch_select_indices(torch.arange(self.k.batch).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` positions (a positive value is the length to keep, as older
        transformers pass it). Only tokens still in the scheme's state as decoding would leave it can go:
        a KIVI residual that was already quantized cannot be restored, which raises ValueError."""
        if not self.is_initialized:
            return
        keep_len = tokens_to_remove if tokens_to_remove >= 0 else self.positions + tokens_to_remove
        if keep_len >= self.positions:
            return
        if keep_len < 0:
            raise ValueError(f"QuantizedKVCache.crop: cannot remove {-tokens_to_remove} of {self.positions} tokens")
        self.cache.__dict__.pop("_keep_memo", None)  # a later forward may reach the same length again
        kept = self.kept[:, :keep_len]
        new_lens = kept.sum(1).cpu().numpy().astype(np.int64)
        targets = []
        for s in (self.k, self.v):
            target = np.array([s.scheme.paged_tokens(int(n)) for n in new_lens])
            if ((target < s.paged) & (target < new_lens)).any():  # would need full precision it no longer has
                raise ValueError(f"QuantizedKVCache.crop: {s.scheme!r} ({s.label}) already quantized tokens that "
                                 f"a cache of {keep_len} positions would hold in full precision; cannot crop there")
            targets.append(target)
        self.k.paged, self.v.paged = np.minimum(self.k.paged, targets[0]), np.minimum(self.v.paged, targets[1])
        self.lens, self.kept, self.positions = new_lens, kept.contiguous(), keep_len

    # -- bytes --------------------------------------------------------------------------------------
    def nbytes(self, detail: bool = False) -> int | dict[str, int]:
        """Bytes held by this layer (K + V): stored fields + float32 residual window + tensor-level params;
        ``detail=True``: the three parts per side."""
        if not self.is_initialized:
            return {} if detail else 0
        parts = {f"{s.label}_{k}": v for s in (self.k, self.v) for k, v in s.nbytes(self.lens).items()}
        return parts if detail else sum(parts.values())

    # -- writing and reading ------------------------------------------------------------------------
    def _update_standard(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Non-kvqref attention: every position (padding included) is stored; return dequantized K/V."""
        n = key_states.shape[2]
        L = int(self.lens[0])
        ks, vs = key_states.transpose(1, 2), value_states.transpose(1, 2)
        outs = []
        for side, new in ((self.k, ks), (self.v, vs)):
            if side.W:  # the tails come back in the stored domain: un-rotated for a standard attention
                before, tails = side.append(list(new.unbind(0)), self.lens, validate=True)
                work = torch.float64 if self.read_how == "oracle" else torch.float32
                tails = [side.to_original(t.to(work)) for t in tails]
            else:
                before, tails = np.full(side.batch, side.append_uniform(new, L)), list(new.to(torch.float32).unbind(0))
            outs.append((side, before, tails))
        self.lens = self.lens + n
        self.kept = torch.cat([self.kept, torch.ones(self.k.batch, n, dtype=torch.bool, device=self.device)], 1)
        total = L + n
        mode = self.cache.prefill if n > 1 else "dequantized"
        result = []
        for side, before, tails in outs:
            q = side.dequantized_all(total, self.read_how, self.dtype)
            if mode == "full":
                pb = int(before[0])
                q = torch.cat([q[:, :pb], torch.stack(tails).to(self.dtype)], 1)
            elif mode == "as_decoded":
                thr = attn.thresholds(side.scheme, L, n, "as_decoded", int(before[0]), int(side.paged[0]))
                if not np.array_equal(thr, np.minimum(int(side.paged[0]), np.arange(L + 1, total + 1))):
                    raise ValueError(
                        f"QuantizedKVCache: prefill='as_decoded' with {side.scheme!r} needs each prompt token to see "
                        "a different cache state, which a standard attention cannot express: load the model with "
                        "attn_implementation='kvqref' (import kvqref.hf), or use prefill='full' or 'dequantized'")
            result.append(q.transpose(1, 2))
        return result[0], result[1]

    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
        """The ``"kvqref"`` attention of ``query`` ``[batch, q_heads, n, head_dim]`` after :meth:`update`:
        write the recorded tokens (dropping padding), attend; returns ``[batch, n, q_heads, head_dim]``."""
        if self.pending is None:
            raise RuntimeError(f"kvqref attention: layer {self.layer_idx} has no update to attend over")
        key_states, value_states = self.pending
        self.pending = None
        B, Hq, n, D = query.shape
        dtype = query.dtype
        scale = D**-0.5 if scaling is None else float(scaling)
        L = self.positions - n
        allowed = attn.allowed_mask(attention_mask, B, n, self.positions, self.device)
        if allowed is None:
            keep = torch.ones(B, n, dtype=torch.bool, device=self.device)
        else:  # the positions some query may read: the same for every layer of this forward, so computed once
            key = (id(attention_mask), attention_mask.data_ptr(), tuple(attention_mask.shape), self.positions)
            memo = self.cache.__dict__.setdefault("_keep_memo", {})
            if key not in memo:
                memo.clear()
                memo[key] = allowed.any(dim=1)[:, L:]
            keep = memo[key]
        kept = torch.cat([self.kept, keep], 1)
        if n == 1 and (allowed is None or self.layer_idx != 0 or bool(keep.all())):
            if allowed is not None and self.layer_idx == 0:
                attn.check_decode_mask(allowed, kept)
            self.kept = kept
            ks, vs = key_states[:, :, 0], value_states[:, :, 0]
            self.k.append_one(ks, self.lens)
            self.v.append_one(vs, self.lens)
            self.lens = self.lens + 1
            return self.decode(query[:, :, 0], scale)[:, None].to(query.dtype)
        if allowed is not None and self.layer_idx == 0:  # every layer gets the same mask
            attn.check_prefill_mask(allowed, kept, L)
        self.kept = kept
        keep_np = keep.cpu().numpy()
        ks, vs = key_states.transpose(1, 2), value_states.transpose(1, 2)
        every = keep_np.all(axis=1)
        idx = [torch.from_numpy(np.nonzero(keep_np[b])[0]).to(self.device) for b in range(B)]

        def kept_rows(x: torch.Tensor, b: int, dim: int = 0) -> torch.Tensor:
            return x[b] if every[b] else x[b].index_select(dim, idx[b])

        lens_before = self.lens.copy()
        kb, ktails = self.k.append([kept_rows(ks, b) for b in range(B)], lens_before)
        vb, vtails = self.v.append([kept_rows(vs, b) for b in range(B)], lens_before)
        self.lens = lens_before + np.array([len(i) for i in idx])
        cdt = torch.float64 if self.cache.backend.name == "numpy" else torch.float32
        rotated = self.k.rotation is not None or self.v.rotation is not None
        query = self.rotate_query(query.to(cdt)) if rotated else query  # stored-domain attention, as decode
        out = torch.zeros(B, n, Hq, D, dtype=cdt if rotated else query.dtype, device=query.device)
        kdeq = None if self.read_how == "oracle" else self.k.dequantized_slots(cdt)
        vdeq = None if self.read_how == "oracle" else self.v.dequantized_slots(cdt)
        for b in range(B):
            m = len(idx[b])
            if m == 0:
                continue
            N = int(self.lens[b])
            kq = self.k.dequantized(b, N, self.read_how, cdt, kdeq)
            vq = self.v.dequantized(b, N, self.read_how, cdt, vdeq)
            q = kept_rows(query, b, 1).to(cdt)  # [Hq, m, D]
            kthr = attn.thresholds(self.k.scheme, N - m, m, self.cache.prefill, int(kb[b]), int(self.k.paged[b]))
            vthr = attn.thresholds(self.v.scheme, N - m, m, self.cache.prefill, int(vb[b]), int(self.v.paged[b]))
            o = attn.prefill_attention(q, kq, vq, ktails[b].to(cdt), vtails[b].to(cdt), int(kb[b]), int(vb[b]),
                                       kthr, vthr, scale)  # [m, Hq, D]
            if every[b]:
                out[b] = o.to(out.dtype)
            else:
                out[b].index_copy_(0, idx[b], o.to(out.dtype))
        return self.v.to_original(out).to(dtype) if rotated else out

    def rotate_query(self, q: torch.Tensor) -> torch.Tensor:
        """``q`` (float64 or float32) in the stored domain of K: ``rotate_query`` of K's rotation (float64 by the
        oracle, float32 butterflies by the torch backend's), unchanged for unrotated keys."""
        rot = self.k.rotation
        if rot is None:
            return q
        if q.dtype == torch.float64:
            return torch.from_numpy(rot.rotate_query(q.detach().cpu().numpy())).to(q.device)
        from kvqref.backends.torch_backend import rotate_query

        return rotate_query(q, rot)

    def device_cache(self, rotated: bool = False):
        """This layer as the backends' :class:`~kvqref.backends.triton_backend.DeviceCache` (``rotated``: its
        sides carry the rotated schemes, as the Triton kernels read a rotated cache)."""
        from kvqref.backends.triton_backend import DeviceCache

        dev = self.device
        pages = max(self.k.max_pages, self.v.max_pages, -(-int(self.lens.max()) // self.k.page_size))
        self.k.grow(pages, exact=True)  # one block table for K and V: same pages on both sides
        self.v.grow(pages, exact=True)
        seq = self.k.index("lens", self.lens.astype(np.int32))
        sides, res, lens = [], [], []
        for s in (self.k, self.v):
            sides.append(s.side(rotated))
            if s.W:
                res.append(s.residual)
                lens.append(s.index("paged", s.paged.astype(np.int32)))
            else:
                res.append(torch.zeros(s.batch, 1, s.kv_heads, s.head_dim, dtype=torch.float32, device=dev))
                lens.append(seq)
        has_res = bool(self.k.W or self.v.W)
        return DeviceCache(sides[0], sides[1], self.k.page_size, self.k.block_table(), seq, lens[0], lens[1],
                           res[0], res[1], has_res)

    def decode_state(self):
        """What the backend's ``decode`` reads: :meth:`device_cache` (the stored values), wrapped with the K and V
        rotations in a :class:`~kvqref.backends.torch_backend.RotatedDeviceCache` when a side is rotated (the form
        the torch backend's ``prepare`` gives a rotated paged cache)."""
        from kvqref.backends.torch_backend import RotatedDeviceCache

        dc = self.device_cache()
        if self.k.rotation is None and self.v.rotation is None:
            return dc
        return RotatedDeviceCache(dc, self.k.rotation, self.v.rotation)

    def decode(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Decode attention of ``q`` ``[batch, q_heads, head_dim]`` over the stored cache (float32 out)."""
        name = self.cache.backend.name
        if name == "numpy":
            from kvqref.reference import attention

            # the stored domain (rotated keys and values: q rotated, the output un-rotated, as the oracle's
            # decode_attention reads a rotated paged cache)
            Ks = [self.k.dequantized(b, int(n), "oracle", torch.float64).cpu().numpy() for b, n in enumerate(self.lens)]
            Vs = [self.v.dequantized(b, int(n), "oracle", torch.float64).cpu().numpy() for b, n in enumerate(self.lens)]
            out, _ = attention(self.rotate_query(q.detach().double()).cpu().numpy(), Ks, Vs, scale)
            return self.v.to_original(torch.from_numpy(out)).to(q.device)
        if name == "torch":
            from kvqref.backends.torch_backend import decode

            return decode(q, self.decode_state(), scale, precision=self.cache.precision)[0]
        return self._fused_decode(q, scale)

    def _fused_decode(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        raise RuntimeError(f"{type(self).__name__} has no fused decode; use backend='triton'")


class TritonQuantizedKVLayer(QuantizedKVLayer):
    """The same storage on the backend's device, written by the fused Triton kernel
    (:func:`kvqref.backends.triton_backend.quantize_write`); ``"kvqref"`` decode steps run the fused decode
    kernel (:func:`kvqref.backends.triton_backend.decode`) on it."""

    writer = "triton"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        want = torch.device(self.cache.backend.device())
        if key_states.device.type != want.type:
            raise ValueError(f"QuantizedKVCache(backend='triton'): the fused kernels run on {want.type}, but the "
                             f"model's K/V are on {key_states.device.type}: move the model there "
                             f"(model.to('{want.type}')) or use backend='torch'")
        super().lazy_initialization(key_states, value_states)

    def _fused_decode(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        first = not getattr(self, "_validated", False)
        self._validated = True
        q = q if q.dtype in (torch.float32, torch.bfloat16, torch.float16) else q.float()  # the kernel's q dtypes
        # through the backend: its kernels rotate q and un-rotate the output of a rotated side (docs/rotation.md)
        out, _ = self.cache.backend.decode(q, self.device_cache(rotated=True), scale, validate=first,
                                           max_seq_len=int(self.lens.max()), precision=self.cache.precision)
        return out


class QuantizedKVCache(Cache):
    """A transformers ``Cache`` holding K and V in a kvqref scheme's stored form (docs/hf.md).

    ``scheme``: a name of :mod:`kvqref.schemes` (``"fp8_e4m3"``, ``"int4_kivi"``, ...; ``k_options`` /
    ``v_options`` go to ``kvqref.schemes.get`` for K and V, KIVI gets ``role="key"``/``"value"``) or a
    ``(K scheme, V scheme)`` pair. ``backend``: ``"numpy"`` (oracle writes, float64 oracle attention),
    ``"torch"`` (oracle writes, torch dequantize + SDPA) or ``"triton"`` (fused write and decode kernels).
    ``prefill``: how a chunk of more than one token attends (``"as_decoded"``, ``"full"``, ``"dequantized"``;
    docs/hf.md). Tensor-level scales (FP8 per tensor/head, NVFP4's global scale) are calibrated per layer on
    the first chunk that is quantized (all sequences of the batch) and then frozen, unless ``k_params`` /
    ``v_params`` give them: one params dict for every layer (FP8 ``{"scale": scalar or [kv_heads]}``, NVFP4
    ``{"global_scale": g}``), a list of one dict per layer, or a :class:`kvqref.calibration.ScaleSet`
    (``kvqref calibrate``); they are checked here, before the first token. ``precision``: the decode
    step's arithmetic (docs/kernels.md, "Precision"): ``"fast"`` (default; the fused kernel's 16-bit operands,
    float32 accumulation; the torch backend's bfloat16 SDPA) or ``"exact"`` (float32 products; float32 SDPA).
    ``rotation="hadamard"`` (+ ``rotation_seed``, an int, default 0): K and V of a scheme name stored rotated
    (docs/rotation.md; per side: ``k_options={"rotation": ...}``; or pass rotated Scheme objects); the stored
    bytes are the rotated scheme's, queries are rotated and outputs un-rotated by the backend (numpy, torch,
    triton), ``nbytes()`` is unchanged, and given ``k_params``/``v_params`` scale the
    rotated values.
    """

    def __init__(self, config: Any, scheme: str | tuple[Scheme, Scheme], *, backend: str = "torch",
                 k_options: dict | None = None, v_options: dict | None = None, prefill: str = "as_decoded",
                 precision: str = "fast", k_params: Any = None, v_params: Any = None, rotation: str | None = None,
                 rotation_seed: Any = None) -> None:
        if prefill not in PREFILL_MODES:
            raise ValueError(f"QuantizedKVCache: prefill must be one of {PREFILL_MODES}, got {prefill!r}")
        if precision not in ("fast", "exact"):
            raise ValueError(f"QuantizedKVCache: precision must be 'fast' or 'exact', got {precision!r}")
        self.precision = precision
        self.config = config
        text = _text_config(config)
        self.num_layers, self.q_heads, self.kv_heads, self.head_dim = check_model_config(text)
        self.k_scheme, self.v_scheme = build_schemes(scheme, k_options, v_options, rotation, rotation_seed)
        if getattr(self.k_scheme, "role", "key") != "key" or getattr(self.v_scheme, "role", "value") != "value":
            raise ValueError("QuantizedKVCache: KIVI schemes need role='key' for K and role='value' for V")
        for label, s in (("K", self.k_scheme), ("V", self.v_scheme)):
            try:
                s.fields(self.kv_heads, self.head_dim)
            except ValueError as e:
                raise ValueError(f"QuantizedKVCache: the {label} scheme does not fit this model "
                                 f"({self.kv_heads} KV heads x head_dim {self.head_dim}): {e}") from None
        self.k_params = layer_params("k_params", k_params, self.k_scheme, "k", self.num_layers, self.kv_heads)
        self.v_params = layer_params("v_params", v_params, self.v_scheme, "v", self.num_layers, self.kv_heads)
        self.backend = backends.get(backend)
        try:  # the backend's own refusal of a rotated cache it cannot read, before the first token
            self.backend.check_rotation(SimpleNamespace(k=SimpleNamespace(scheme=self.k_scheme),
                                                        v=SimpleNamespace(scheme=self.v_scheme)))
        except ValueError as e:
            raise ValueError(f"QuantizedKVCache: {e}") from None
        if backend == "triton":
            from kvqref.backends.triton_backend import kernel_config

            for s in (self.k_scheme, self.v_scheme):
                kernel_config(storage_scheme(s))  # the stored values' kernels (rotated tokens arrive rotated)
            windowed = any(s.residual_window or s.token_group > 1 for s in (self.k_scheme, self.v_scheme))
            scaled = [s for s in (self.k_scheme, self.v_scheme) if s.calibrate(np.zeros((1, self.kv_heads,
                                                                                       self.head_dim)))]
            if windowed and scaled:
                raise ValueError(f"QuantizedKVCache: the triton decode kernel reads a residual window only with "
                                 f"tensor scales of 1; {scaled[0]!r} has a tensor-level scale (pair it with a "
                                 "scheme without a window, or use backend='torch')")
            if self.head_dim & (self.head_dim - 1):
                raise ValueError(f"QuantizedKVCache: the triton backend needs a power-of-two head_dim, got "
                                 f"{self.head_dim}")
        self.prefill = prefill
        layer_cls = TritonQuantizedKVLayer if backend == "triton" else QuantizedKVLayer
        try:
            super().__init__(layers=[layer_cls(self, i) for i in range(self.num_layers)])
        except TypeError as e:
            raise RuntimeError("QuantizedKVCache needs a transformers version whose Cache takes layers= "
                               f"(>= 4.56): {e}") from None

    def device_index(self, device: torch.device) -> DeviceIndex:
        """The index tensors shared by this cache's layers on ``device``."""
        memo = self.__dict__.setdefault("_device_index", {})
        if str(device) not in memo:
            memo[str(device)] = DeviceIndex(device)
        return memo[str(device)]

    def attention_is_kvqref(self) -> bool:
        """Whether the model attends with the ``"kvqref"`` attention (from the config passed in)."""
        return getattr(self.config, "_attn_implementation", None) == "kvqref"

    def nbytes(self, detail: bool = False) -> int | dict[str, int]:
        """Bytes held by every layer (see :meth:`QuantizedKVLayer.nbytes`)."""
        if not detail:
            return sum(layer.nbytes() for layer in self.layers)
        total: dict[str, int] = {}
        for layer in self.layers:
            for k, v in layer.nbytes(detail=True).items():
                total[k] = total.get(k, 0) + v
        return total

    def bits_per_element(self) -> float:
        """Stored bits per quantized K/V element: field bytes over the tokens in pages (residual-window tokens
        and tensor-level params excluded, as ``scheme.bits_per_element`` counts them)."""
        d = self.nbytes(detail=True)
        live = [layer for layer in self.layers if layer.is_initialized]
        tokens = sum(int(layer.k.paged.sum() + layer.v.paged.sum()) for layer in live)
        fields = d.get("K_fields", 0) + d.get("V_fields", 0)
        return 8 * fields / (tokens * self.kv_heads * self.head_dim) if tokens else float("nan")

    def __repr__(self) -> str:
        return (f"QuantizedKVCache(K={self.k_scheme!r}, V={self.v_scheme!r}, backend={self.backend.name!r}, "
                f"prefill={self.prefill!r}, layers={self.num_layers})")

