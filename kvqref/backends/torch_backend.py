"""The ``torch`` backend: dequantize the whole cache to bfloat16, then ``scaled_dot_product_attention``.

This is the unfused path SGLang's documentation warns about ("can be extremely slow"), kept to measure
the fused kernels against. Dequantization uses torch's own float8 dtypes and lookup tables, so it is also
an independent peer of the NumPy oracle for the stored values.

Rotated caches (docs/rotation.md): :func:`prepare` copies the stored (rotated-domain) values and keeps the
rotations beside them (:class:`RotatedDeviceCache`); :func:`decode` rotates ``q`` once, runs SDPA over the
stored values and un-rotates the output once, in float32 butterflies (:func:`hadamard`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvqref.backends.triton_backend import DeviceCache, Side, kernel_config
from kvqref.schemes.rotation import HadamardRotation, norm_f32, rotation_of


def _torch():
    import torch

    return torch


_FP8_DTYPES = {0: "float8_e4m3fn", 1: "float8_e5m2", 2: "float8_e4m3fnuz", 3: "float8_e5m2fnuz"}
_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _unpack(codes, bits: int):
    """[..., n] uint8 -> [..., n * 8 // bits] int codes, LSB first."""
    torch = _torch()
    per = 8 // bits
    parts = [(codes >> (j * bits)) & ((1 << bits) - 1) for j in range(per)]
    return torch.stack(parts, dim=-1).reshape(*codes.shape[:-1], codes.shape[-1] * per)


def dequantize(side: Side, dtype=None):
    """Every slot of ``side`` dequantized: [slots, kv_heads, D] (float32 unless ``dtype``); the fields read slot by
    slot whatever their layout (``Side.slot_rows``: head-major fields are copied to [slot, kv_head, ...] first)."""
    torch = _torch()
    cfg = kernel_config(side.scheme)
    f = {name: side.slot_rows(name) for name in side.fields}
    kind = cfg["kind"]
    if kind == "bf16":
        x = f["data"].float()
    elif kind == "fp8":
        x = f["codes"].view(getattr(torch, _FP8_DTYPES[cfg["fmt"]])).float()
        x = x * (f["scale"][..., None] if cfg["token_scale"] else side.tensor_scale[None, :, None])
    elif kind in ("mxfp4", "nvfp4"):
        lut = torch.tensor(_E2M1, dtype=torch.float32, device=f["codes"].device)
        el = lut[_unpack(f["codes"], 4).long()]
        if kind == "mxfp4":
            c = f["scales"]  # E8M0: 2**(c - 127), 0xFF NaN (the codec's rule; exp2 would give +Inf)
            s = torch.where(c == 255, float("nan"), torch.exp2(c.float() - 127))
        else:
            s = f["scales"].view(torch.float8_e4m3fn).float()
        x = (el.unflatten(-1, (s.shape[-1], -1)) * s[..., None]).flatten(-2)  # E2M1 x block scale: exact in float32
        if kind == "nvfp4":  # then x global scale, one rounding (E2M1 x (block x global) would round twice)
            x = x * side.tensor_scale[None, :, None]
    else:
        q = _unpack(f["codes"], cfg["bits"]).float()
        G = cfg["group"]
        if kind == "int_v":
            x = (q.unflatten(-1, (-1, G)) * f["scale"].float()[..., None] + f["zero"].float()[..., None]).flatten(-2)
        else:
            s = f["scale"].float().repeat_interleave(G, dim=0)
            z = f["zero"].float().repeat_interleave(G, dim=0)
            x = q * s + z
    return x if dtype is None else x.to(dtype)


def gather(dc: DeviceCache, deq_k, deq_v):
    """Per-sequence K and V, padded: ([B, Hkv, T, D], [B, Hkv, T, D], valid mask [B, T])."""
    torch = _torch()
    P = dc.page_size
    T = int(dc.seq_lens.max().item())
    t = torch.arange(T, device=deq_k.device)
    bt = dc.block_table.long().clamp(min=0)
    slot = bt[:, (t // P).clamp(max=bt.shape[1] - 1)] * P + (t % P)[None, :]  # [B, T]
    k = deq_k[slot]  # [B, T, H, D]
    v = deq_v[slot]
    if dc.has_residual:
        for b in range(slot.shape[0]):
            for res, lens, out in ((dc.k_residual, dc.k_lens, k), (dc.v_residual, dc.v_lens, v)):
                lo, hi = int(lens[b]), int(dc.seq_lens[b])
                out[b, lo:hi] = res[b, : hi - lo].to(out.dtype)
    valid = t[None, :] < dc.seq_lens[:, None].long()
    return k.transpose(1, 2), v.transpose(1, 2), valid


@dataclass
class RotatedDeviceCache:
    """A device cache of stored (rotated-domain) values and the rotations of its K and V (None: unrotated)."""

    storage: DeviceCache
    k_rotation: HadamardRotation | None
    v_rotation: HadamardRotation | None


def prepare(cache, device: str = "cpu") -> DeviceCache | RotatedDeviceCache:
    """A :class:`kvqref.paged.PagedKVCache` on ``device``; a rotated one as a :class:`RotatedDeviceCache`."""
    if cache.k.rotation is None and cache.v.rotation is None:
        return DeviceCache.from_cache(cache, device)
    return RotatedDeviceCache(DeviceCache.from_cache(cache.storage_view(), device), cache.k.rotation,
                              cache.v.rotation)


def hadamard(x):
    """``x @ H`` along the last axis (float32 tensors: float32 butterflies in the oracle's stage order
    ``h = 1, 2, ..., D/2``, so the bits equal :func:`kvqref.schemes.rotation.butterflies`)."""
    torch = _torch()
    D = x.shape[-1]
    h = 1
    while h < D:
        v = x.unflatten(-1, (D // (2 * h), 2, h))
        a, b = v[..., 0, :], v[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return x


def _signs(rot: HadamardRotation, D: int, device):
    return _torch().from_numpy(rot.signs(D)).to(device)


def rotate(x, rot: HadamardRotation):
    """float32 ``x @ M = f32(butterflies(x * signs) * C_D)``: the stored values of a rotated scheme, the float32
    rule of :meth:`kvqref.schemes.rotation.HadamardRotation.rotate` bit for bit (no finiteness check here)."""
    torch = _torch()
    D = x.shape[-1]
    c = torch.tensor(float(norm_f32(D)), dtype=torch.float32, device=x.device)
    return hadamard(x.float() * _signs(rot, D, x.device)) * c


def rotate_query(q, rot: HadamardRotation):
    """float32 ``q @ M^-T = ((q * signs) @ H) / (D * C_D)``."""
    D = q.shape[-1]
    return hadamard(q.float() * _signs(rot, D, q.device)) * float(1 / (D * float(norm_f32(D))))


def unrotate(z, rot: HadamardRotation):
    """float32 ``z @ M^-1 = ((z @ H) * signs) / (D * C_D)``."""
    D = z.shape[-1]
    return hadamard(z.float()) * (_signs(rot, D, z.device) * float(1 / (D * float(norm_f32(D)))))


def decode(q, dc: DeviceCache | RotatedDeviceCache, sm_scale: float | None = None, dtype=None, *,
           precision: str = "fast", **_: Any):
    """Unfused decode: dequantize everything to ``dtype``, SDPA; (out, None). ``dtype`` defaults to the
    ``precision``: bfloat16 for ``"fast"`` (the default), float32 for ``"exact"``.
    A :class:`RotatedDeviceCache` (or a device cache whose sides keep rotated schemes, as the triton backend's
    do): ``q`` rotated before, the output un-rotated after (float32)."""
    torch = _torch()
    if precision not in ("fast", "exact"):
        raise ValueError(f"precision must be 'fast' or 'exact', got {precision!r}")
    dtype = dtype or (torch.bfloat16 if precision == "fast" else torch.float32)
    if isinstance(dc, RotatedDeviceCache):
        k_rot, v_rot, dc = dc.k_rotation, dc.v_rotation, dc.storage
    else:
        k_rot, v_rot = rotation_of(dc.k.scheme), rotation_of(dc.v.scheme)
    if k_rot is not None:
        q = rotate_query(q, k_rot)
    k, v, valid = gather(dc, dequantize(dc.k, dtype), dequantize(dc.v, dtype))
    out = torch.nn.functional.scaled_dot_product_attention(
        q.to(dtype)[:, :, None, :], k, v, attn_mask=valid[:, None, None, :], scale=sm_scale, enable_gqa=True)
    out = out[:, :, 0, :].float()
    return (out if v_rot is None else unrotate(out, v_rot)), None
