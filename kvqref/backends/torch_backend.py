"""The ``torch`` backend: dequantize the whole cache to bfloat16, then ``scaled_dot_product_attention``.

This is the unfused path SGLang's documentation warns about ("can be extremely slow"), kept to measure
the fused kernels against. Dequantization uses torch's own float8 dtypes and lookup tables, so it is also
an independent peer of the NumPy oracle for the stored values.
"""

from __future__ import annotations

from typing import Any

from kvqref.backends.triton_backend import DeviceCache, Side, kernel_config


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
    """Every slot of ``side`` dequantized: [slots, kv_heads, D] (float32 unless ``dtype``)."""
    torch = _torch()
    cfg = kernel_config(side.scheme)
    f = side.fields
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
            s = torch.exp2(f["scales"].float() - 127)
        else:
            s = f["scales"].view(torch.float8_e4m3fn).float() * side.tensor_scale[None, :, None]
        x = (el.unflatten(-1, (s.shape[-1], -1)) * s[..., None]).flatten(-2)
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


def decode(q, dc: DeviceCache, sm_scale: float | None = None, dtype=None, *, precision: str = "fast",
           **_: Any):
    """Unfused decode: dequantize everything to ``dtype``, SDPA; (out, None). ``dtype`` defaults to the
    ``precision``: bfloat16 for ``"fast"`` (the default), float32 for ``"exact"``."""
    torch = _torch()
    if precision not in ("fast", "exact"):
        raise ValueError(f"precision must be 'fast' or 'exact', got {precision!r}")
    dtype = dtype or (torch.bfloat16 if precision == "fast" else torch.float32)
    k, v, valid = gather(dc, dequantize(dc.k, dtype), dequantize(dc.v, dtype))
    out = torch.nn.functional.scaled_dot_product_attention(
        q.to(dtype)[:, :, None, :], k, v, attn_mask=valid[:, None, None, :], scale=sm_scale, enable_gqa=True)
    return out[:, :, 0, :].float(), None
