"""Compile every kernel ahead of time for GPUs this machine does not have (the project's ROCm evidence).

    python3 -m kvqref.kernels.aot [--targets hip:gfx942,hip:gfx950,cuda:90,cuda:100] [--json]

For every scheme the backend supports (decode in both precisions), the real launch records
(:class:`kvqref.kernels.decode.Launch`, built by the same host code that launches on a GPU, from a small
cache on the CPU) are compiled with ``triton.compile`` for each target, and the output is checked:
AMDGCN and an ELF ``hsaco`` for HIP, PTX and an ELF ``cubin`` for CUDA. Must run in a process where
``TRITON_INTERPRET`` is not set.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import warnings
from typing import Any

TARGETS = ("hip:gfx942", "hip:gfx950", "cuda:90", "cuda:100")

# (label, K scheme, K options, V scheme, V options)
DECODE_CASES: list[tuple[str, str, dict, str, dict]] = [
    ("bf16", "bf16", {}, "bf16", {}),
    ("fp8_e4m3", "fp8_e4m3", {}, "fp8_e4m3", {}),
    ("fp8_e5m2-token_head", "fp8_e5m2", {"granularity": "token_head"}, "fp8_e5m2", {"granularity": "token_head"}),
    ("fp8-rocm-fnuz", "fp8_e4m3", {"profile": "rocm"}, "fp8_e5m2", {"profile": "rocm"}),
    ("fp4_e2m1", "fp4_e2m1", {}, "fp4_e2m1", {}),
    ("mxfp4/nvfp4", "mxfp4", {}, "nvfp4", {}),
    ("nvfp4", "nvfp4", {}, "nvfp4", {}),  # fast mode: block rows (``block_rows``), the default for NVFP4 pairs
    ("mxfp4", "mxfp4", {}, "mxfp4", {}),  # fast mode: block rows with value tiles as 16-bit words (``value_words``)
    ("int4_kivi", "int4_kivi", {"role": "key", "group_size": 16, "residual": 16},
     "int4_kivi", {"role": "value", "group_size": 16, "residual": 16}),
    ("int2_kivi", "int2_kivi", {"role": "key", "group_size": 16, "residual": 16},
     "int2_kivi", {"role": "value", "group_size": 16, "residual": 16}),
    # rotated caches (docs/rotation.md): float32 q from the rotate_q launch, un-rotation in the merge kernel
    ("fp8_e4m3+H", "fp8_e4m3", {"rotation": "hadamard", "rotation_seed": 1},
     "fp8_e4m3", {"rotation": "hadamard", "rotation_seed": 2}),
    ("int4_kivi+H", "int4_kivi", {"role": "key", "group_size": 16, "residual": 16, "rotation": "hadamard"},
     "int4_kivi", {"role": "value", "group_size": 16, "residual": 16, "rotation": "hadamard", "rotation_seed": 3}),
]
#: the cases also compiled as one split writing the outputs itself (``direct_output``)
DIRECT_CASES = ("bf16", "fp8_e4m3", "fp8_e4m3+H")
#: kernels compiled once, whatever the scheme: the merge kernel, q's rotation (float32 q', and bfloat16 q' for the
#: keys that meet q in bfloat16 in fast mode), the merge kernel un-rotating, the merge by channel blocks
#: (``merge_channels``), and on CUDA the merge as a programmatic dependent launch (``pdl``)
SHARED_KERNELS = ("merge", "rotate_q", "rotate_q[bf16]", "merge[rotated]", "merge[channels]", "merge[pdl]")
WRITE_CASES: list[tuple[str, dict]] = [
    ("bf16", {}), ("fp8_e4m3", {}), ("fp8_e4m3", {"granularity": "token_head"}),
    ("fp8_e4m3", {"profile": "sglang", "scale": 1.0}), ("fp8_e4m3", {"profile": "rocm"}),
    ("fp8_e4m3", {"profile": "sglang", "scale": 1.0, "model_dtype": "float16"}),
    ("fp8_e4m3", {"profile": "sglang", "scale": 1.0, "sglang_scale": "float", "model_dtype": "float32"}),
    ("fp8_e4m3", {"profile": "rocm", "model_dtype": "float16"}),
    ("fp4_e2m1", {}), ("fp4_e2m1", {"profile": "sglang"}),
    ("fp4_e2m1", {"profile": "sglang", "model_dtype": "float16"}),
    ("mxfp4", {}), ("nvfp4", {}),
    ("int4_kivi", {"role": "value", "group_size": 16}), ("int2_kivi", {"role": "key", "group_size": 16}),
    # rotated writes (ROTATE; RDT: rotated values rounded to an explicit model dtype)
    *[(n, {**o, "rotation": "hadamard", "rotation_seed": 5}) for n, o in (
        ("bf16", {}), ("fp8_e4m3", {"profile": "sglang", "scale": 1.0, "model_dtype": "float16"}),
        ("fp4_e2m1", {}), ("nvfp4", {}), ("int2_kivi", {"role": "key", "group_size": 16}))],
]


def _hw_formats(target: str) -> set[int]:
    """FP8 formats with hardware conversion on ``target`` (as ``hardware_fp8_formats`` on a device)."""
    if target == "hip:gfx942":
        return {2, 3}
    if target == "hip:gfx950":
        return {0, 1}
    return {0, 1}


def _signature(launch) -> tuple[dict[str, str], dict[str, Any], list[str]]:
    """Triton signature strings for ``launch.args`` (by the kernel's parameter names), its constexprs, and
    the names of arguments the JIT would mark 16-divisible."""
    import torch

    tmap = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.uint8: "*u8",
            torch.int32: "*i32", torch.int64: "*i64", torch.int16: "*i16"}
    names = [n for n in launch.kernel.arg_names if n not in launch.constexprs]
    sig: dict[str, str] = {}
    div: list[str] = []
    for name, a in zip(names, launch.args, strict=True):
        if isinstance(a, torch.Tensor):
            sig[name] = tmap[a.dtype]
            div.append(name)
        elif isinstance(a, bool):
            sig[name] = "i1"
        elif isinstance(a, int):
            sig[name] = "i64" if abs(a) >= 2**31 else "i32"
            if a % 16 == 0 and a != 0:
                div.append(name)
        else:
            sig[name] = "fp32"
    return sig, dict(launch.constexprs), div


def _launches(target: str, cases: list | None = None, page: int = 16) -> list[tuple[str, Any]]:
    """(name, Launch) for every kernel variant (``cases``: DECODE_CASES), built on the CPU with the target's
    FP8 conversions, in pages of ``page`` tokens."""
    import numpy as np
    import torch

    from kvqref import schemes
    from kvqref.backends import triton_backend as tb
    from kvqref.kernels.decode import (
        BF16_WIDE,
        PRECISIONS,
        Launch,
        decode_split_kernel,
        merge_kernel,
        plan_decode,
        rotate_q_kernel,
    )
    from kvqref.paged import PagedKVCache

    def split(launches):
        return next(launch for launch in launches if launch.kernel is decode_split_kernel)

    def device_cache(kn, ko, vn, vo):  # two sequences of 40 tokens, 2 KV heads, head_dim 128
        cache = PagedKVCache(schemes.get(kn, **ko), schemes.get(vn, **vo), 8, page, 2, 128, batch=2)
        for b in range(2):
            cache.append(b, rng.standard_normal((40, 2, 128)), rng.standard_normal((40, 2, 128)))
        return tb.DeviceCache.from_cache(cache, "cpu")

    out = []
    shared: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for label, kn, ko, vn, vo in DECODE_CASES if cases is None else cases:
            dc = device_cache(kn, ko, vn, vo)
            q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
            residual = dc.residual
            default = {}  # the split launch of each precision's defaults
            for precision in PRECISIONS:
                launches, _, _ = plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, page,
                                             residual=residual, max_seq_len=40, num_splits=2,
                                             hw_formats=_hw_formats(target), precision=precision)
                default[precision] = split(launches)
                out.append((f"decode[{label}]" if precision == "fast" else f"decode[{label},{precision}]",
                            default[precision]))
            if target.startswith("cuda") and "fp4" in kn + vn:  # FP4 nibbles unpacked by inline PTX (ptx_unpack)
                launches, _, _ = plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, page,
                                             max_seq_len=40, num_splits=2, hw_formats=_hw_formats(target),
                                             ptx_unpack=True)
                out.append((f"decode[{label},ptx]", split(launches)))
            if (target.startswith("cuda") and label == "fp4_e2m1") or label == "nvfp4":  # per-element FP4 tiles (no
                # block rows: fp4_e2m1's default at 8 query heads per KV head, by PTX) as two-axis tiles
                # (``fp4_tiles_2d``); NVFP4's on every target (an option: it loses there)
                launches, _, _ = plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, page,
                                             max_seq_len=40, num_splits=2, hw_formats=_hw_formats(target),
                                             ptx_unpack=target.startswith("cuda"), block_rows=False,
                                             fp4_tiles_2d=True)
                out.append((f"decode[{label},t2d]", split(launches)))
            fast = default["fast"].constexprs
            if fast.get("BLK") and label in ("fp4_e2m1", "nvfp4"):  # block rows' key products transposed
                # (``key_products_transposed``) or not, whichever the default launch is not (nvfp4's default here
                # transposes them, fp4_e2m1's does not)
                kpt = not fast["KPT"]
                launches, _, _ = plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, page,
                                             max_seq_len=40, num_splits=2, hw_formats=_hw_formats(target),
                                             ptx_unpack=target.startswith("cuda"), key_products_transposed=kpt)
                out.append((f"decode[{label},kpt={int(kpt)}]", split(launches)))
                # q's block rows at a stride of 2 (``q_rows_load``): the defaults here read them transposed
                # (fp4_e2m1) and contiguously (nvfp4); mxfp4's default reads them at the stride
                launches, _, _ = plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, page,
                                             max_seq_len=40, num_splits=2, hw_formats=_hw_formats(target),
                                             ptx_unpack=target.startswith("cuda"), q_rows_load="strided")
                out.append((f"decode[{label},qld=strided]", split(launches)))
            if fast.get("BLK") and fast["VW"] and fast["HALF_V"]:  # block rows'
                # value tiles by channel halves as bytes (``value_words=False``), where words are the default
                launches, _, _ = plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, page,
                                             max_seq_len=40, num_splits=2, hw_formats=_hw_formats(target),
                                             value_words=False, ptx_unpack=target.startswith("cuda"))
                out.append((f"decode[{label},vw=0{',ptx' if target.startswith('cuda') else ''}]", split(launches)))
            if vn.startswith("fp8") and not vo.get("granularity") == "token_head":  # FP8 value words
                # (fp8_value_words; the default on NVIDIA GPUs): the PTX halves on CUDA targets, portable elsewhere
                # (on CUDA also at 64-token tiles: fast FP8's default on the H200, ``FP8_FAST_BLOCK_N``)
                for bn in (None, 64) if target.startswith("cuda") and kn.startswith("fp8") else (None,):
                    launches, _, _ = plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, page,
                                                 max_seq_len=40, num_splits=2, hw_formats=_hw_formats(target),
                                                 fp8_value_words=True, ptx_unpack=target.startswith("cuda"),
                                                 block_n=bn)
                    words = split(launches)
                    out.append((f"decode[{label},vw8={words.constexprs['VW8']}{',bn=64' if bn else ''}]", words))
            if label in ("fp8_e4m3", "nvfp4"):  # each next tile's page ids read one step ahead (``page_ids_ahead``)
                # or in the step, whichever is not the default: the per-tile loop (FP8: ahead, an option) and the
                # block rows' loop (NVFP4 at 4 query heads per KV head: in the step at 2 stages)
                ahead = label == "fp8_e4m3"
                launches, _, _ = plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, page,
                                             max_seq_len=40, num_splits=2, hw_formats=_hw_formats(target),
                                             page_ids_ahead=ahead, **({} if ahead else {"num_stages": 2}))
                out.append((f"decode[{label},pida={int(ahead)}]", split(launches)))
            if label == "int4_kivi":  # the key rows reading their page ids ahead (the default for 4-bit key words in
                # head-major pages), in head-major pages, the codes unpacked as on the target's GPUs
                hd = dc.with_layout("HND")
                launches, _, _ = plan_decode(q, hd.k.tiles(), hd.v.tiles(), hd.block_table, hd.seq_lens, page,
                                             residual=hd.residual,
                                             max_seq_len=40, num_splits=2, hw_formats=_hw_formats(target),
                                             value_rows=True, key_rows=True, page_ids_ahead=True,
                                             ptx_unpack=target.startswith("cuda"))
                out.append((f"decode[{label},kr=1,pida=1]", split(launches)))
                # 4-bit key words (value channel groups of 32: 16 value rows) with a softmax state per value chunk
                # (``kivi_chunk_softmax``, their default at 4 query heads per KV head), head-major pages
                wd = device_cache(kn, ko, vn, {**vo, "group_size": 32}).with_layout("HND")
                launches, _, _ = plan_decode(q, wd.k.tiles(), wd.v.tiles(), wd.block_table, wd.seq_lens, page,
                                             residual=wd.residual, max_seq_len=40, num_splits=2,
                                             hw_formats=_hw_formats(target), value_rows=True, key_rows=True,
                                             ptx_unpack=target.startswith("cuda"))
                words = split(launches)
                out.append((f"decode[{label},kr=1,kw={int(words.constexprs['KW'])},csm={words.constexprs['CSM']}]",
                            words))
            if label in DIRECT_CASES:  # one split writing the outputs itself (``direct_output``; a rotated V
                # un-rotated by the split kernel, ``ROT_V``)
                wide = dict(zip(("block_n", "num_warps", "num_stages"), BF16_WIDE, strict=True))
                launches, _, _ = plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, page,
                                             max_seq_len=40, num_splits=1, hw_formats=_hw_formats(target),
                                             direct_output=True, **(wide if label == "bf16" else {}))
                out.append((f"decode[{label},direct]", split(launches)))
            if "fp4" in kn:  # FP4 keys with tokens as rows (fp4_keys_by_token; default on CUDA for blocks of 16)
                launches, _, _ = plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, page,
                                             max_seq_len=40, num_splits=2, hw_formats=_hw_formats(target),
                                             fp4_keys_by_token=True)
                out.append((f"decode[{label},kt4]", split(launches)))
            if "kivi" in vn:  # fast-mode KIVI values in the value-row layout that is not the default here
                kw = dict(residual=residual, max_seq_len=40, num_splits=2, hw_formats=_hw_formats(target))
                launches, _, _ = plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, page, **kw)
                rows = not split(launches).constexprs["HV"]
                launches, _, _ = plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, page,
                                             value_rows=rows, **kw)
                out.append((f"decode[{label},rows={int(rows)}]", split(launches)))
            if "kivi" in kn:  # fast-mode KIVI keys with the scale folded into q (``key_rows=False, key_tile=False``)
                launches, _, _ = plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, page,
                                             residual=residual, max_seq_len=40, num_splits=2,
                                             hw_formats=_hw_formats(target), key_tile=False, key_rows=False)
                out.append((f"decode[{label},ktile=0,kr=0]", split(launches)))
                if "kivi" in vn:  # key rows (``key_rows``; needs the value rows)
                    launches, _, _ = plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, page,
                                                 residual=residual, max_seq_len=40, num_splits=2,
                                                 hw_formats=_hw_formats(target), value_rows=True, key_rows=True)
                    out.append((f"decode[{label},kr=1]", split(launches)))
                    # the residual split as its own launch (``residual_launch``, the default with key rows)
                    parts = [launch for launch in launches if launch.kernel is decode_split_kernel]
                    out.append((f"decode[{label},kr=1,part={parts[-1].constexprs.get('PART', 0)}]", parts[-1]))
                    # key rows with the codes as bytes (``kivi_words=False``; words are the default where they apply)
                    launches, _, _ = plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, page,
                                                 residual=residual, max_seq_len=40, num_splits=2,
                                                 hw_formats=_hw_formats(target), value_rows=True, key_rows=True,
                                                 kivi_words=False)
                    out.append((f"decode[{label},kr=1,kw=0]", split(launches)))
                    if label == "int2_kivi":  # the key words' value products in more chunks than warps
                        # (``kivi_value_chunks``; default one per warp: 2 here)
                        launches, _, _ = plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, page,
                                                     residual=residual, max_seq_len=40, num_splits=2,
                                                     hw_formats=_hw_formats(target), value_rows=True, key_rows=True,
                                                     kivi_value_chunks=4)
                        out.append((f"decode[{label},kr=1,vch=4]", split(launches)))
                        # value scales and zeros as one word per token (``kivi_value_scale_words``; 4 groups of 32
                        # channels: words need 1, 2 or 4) with the page ids read ahead, token-major pages (their
                        # default there at 2-4 query heads per KV head)
                        wd = device_cache(kn, ko, vn, {**vo, "group_size": 32})
                        launches, _, _ = plan_decode(q, wd.k.tiles(), wd.v.tiles(), wd.block_table, wd.seq_lens, page,
                                                     residual=wd.residual,
                                                     max_seq_len=40, num_splits=2, hw_formats=_hw_formats(target),
                                                     value_rows=True, key_rows=True, kivi_value_scale_words=True,
                                                     page_ids_ahead=True)
                        out.append((f"decode[{label},kr=1,vsw=1,pida=1]", split(launches)))
                    if target.startswith("cuda"):  # the codes unpacked by inline PTX: the GPU's default key rows
                        launches, _, _ = plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, page,
                                                     residual=residual, max_seq_len=40, num_splits=2,
                                                     hw_formats=_hw_formats(target), value_rows=True, key_rows=True,
                                                     ptx_unpack=True)
                        out.append((f"decode[{label},kr=1,ptx]", split(launches)))
            for launch in launches:  # the merge kernel does not depend on the scheme, nor rotate_q
                name = (("rotate_q[bf16]" if launch.args[2].dtype == torch.bfloat16 else "rotate_q")
                        if launch.kernel is rotate_q_kernel else None if launch.kernel is not merge_kernel
                        else "merge[rotated]" if launch.constexprs["ROT_V"] else "merge")
                if name is not None:
                    shared.setdefault(name, launch)
            if target.startswith("cuda") and "merge[pdl]" not in shared and "merge" in shared:  # the merge as a
                # programmatic dependent launch of the split launch (plan_decode's ``pdl``: NVIDIA sm_90+), and a
                # split launch that lets it start (``GDC``; the default on such GPUs, planned here on the CPU)
                merge = shared["merge"]
                shared["merge[pdl]"] = Launch(merge.kernel, merge.grid, merge.args, {**merge.constexprs, "GDC": True},
                                              {**merge.options, "launch_pdl": True})
                sp = default["fast"]
                out.append((f"decode[{label},gdc]", Launch(sp.kernel, sp.grid, sp.args, {**sp.constexprs, "GDC": True},
                                                           sp.options)))
            if "merge[channels]" not in shared and not dc.v.tiles().rotation:  # merge by channel blocks
                launches, _, _ = plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, page,
                                             residual=residual, max_seq_len=40, num_splits=2,
                                             hw_formats=_hw_formats(target), merge_channels=64)
                shared["merge[channels]"] = next(la for la in launches if la.kernel is merge_kernel)
        for name, opts in WRITE_CASES:
            scheme = schemes.get(name, **opts)
            cache = PagedKVCache(scheme if opts.get("role") == "key" else schemes.get("bf16"),
                                 schemes.get("bf16") if opts.get("role") == "key" else scheme, 4, 16, 2, 128)
            dc = tb.DeviceCache.from_cache(cache, "cpu")
            side = dc.k if opts.get("role") == "key" else dc.v
            x = torch.zeros(16, 2, 128, dtype=getattr(torch, opts.get("model_dtype", "bfloat16")))  # QDT, X type
            label = name + "".join(f"-{v}" for v in opts.values())
            hw = target.startswith("cuda")  # OCP FP8 codes by the sm_89+ conversion instruction
            out.append((f"write[{label}]", tb.plan_write(side, x, torch.arange(16), hw_fp8=hw)))
            if "kivi" in name:  # float16 roundings by conversion instructions (plan_write's f16_cvt)
                out.append((f"write[{label},f16cvt]", tb.plan_write(side, x, torch.arange(16), f16_cvt=True)))
                if hw:  # float16 pairs by inline PTX (plan_write's kivi_f16x2: NVIDIA's default)
                    out.append((f"write[{label},x2]", tb.plan_write(  # (unrotated keys: the GPU's grid order;
                        # x loaded with evict_first, as NVIDIA's default for these writes)
                        side, x, torch.arange(16), f16_cvt=True, kivi_f16x2=True, x_evict_first=True,
                        heads_fast=opts.get("role") == "key" and "rotation" not in opts)))
            if name == "nvfp4" and "rotation" not in opts:  # whole blocks per thread (plan_write's nvfp4_blocks)
                out.append((f"write[{label},blocks]", tb.plan_write(side, x, torch.arange(16), hw_fp8=hw,
                                                                    nvfp4_blocks=True)))
            if opts.get("role") == "key" and "rotation" not in opts:  # KIVI keys by channel blocks (block_d): 64
                # channels, one warp, stores in the load's layout (NVIDIA's default for 4-bit keys), and 32 / 2 warps
                for bd, nw, sal in ((64, 1, True), (32, 2, False)):
                    out.append((f"write[{label},block_d={bd},w{nw}{',sal' if sal else ''}]",
                                tb.plan_write(side, x, torch.arange(16), f16_cvt=True, block_d=bd, num_warps=nw,
                                              store_as_loaded=sal)))
            if "rotation" in opts:  # the butterflies' other routes (plan_write's rotation_route): the portable ones,
                # and on CUDA the warp shuffles (their lanes settled on sm_90's layout and checked per target below)
                default = tb.rotation_route_default(tb.kernel_config(side.codec)["kind"])
                for route in [r for r in ("split", "sums") if r != default] + ["gather"] + (["shfl"] if hw else []):
                    out.append((f"write[{label},{route}]", tb.plan_write(side, x, torch.arange(16), hw_fp8=hw,
                                                                         rotation_route=route)))
                if name in ("fp4_e2m1", "mxfp4", "nvfp4") or "kivi" in name:  # element pairs loaded as 32-bit words
                    # (word_load; NVIDIA's default for NVFP4 and 4-bit KIVI): the portable default route, and for the
                    # FP4 kinds on CUDA the shuffles (checked per target as the others)
                    for route in [default] + (["shfl"] if hw and "kivi" not in name else []):
                        out.append((f"write[{label},words,{route}]",
                                    tb.plan_write(side, x, torch.arange(16), hw_fp8=hw, rotation_route=route,
                                                  word_load=True)))
    return out + [(name, shared[name]) for name in SHARED_KERNELS if name in shared]


#: PTX instructions counted per CUDA kernel: float instructions whose results are not IEEE round-to-nearest (or not
#: sign-exact), approximate division/reciprocal (Triton's ``/`` on float32) and flush-to-zero; and grid dependency
#: control
PTX_FACTS = {
    "approx_div": re.compile(r"\b(?:div\.full\.f32|div\.approx\S*|rcp\.approx\S*)\s"),
    "ftz": re.compile(r"\b(?:add|sub|mul|fma|div|rcp|sqrt|min|max|cvt)\S*\.ftz\S*\s"),
    # grid dependency control (programmatic dependent launch, ``pdl``): the merge's wait, the split's trigger
    "gdc_wait": re.compile(r"\bgriddepcontrol\.wait\b"),
    "gdc_launch": re.compile(r"\bgriddepcontrol\.launch_dependents\b"),
}
_ZERO_MOV = re.compile(r"\bmov\.b32\s+(%\w+),\s*0f[08]0000000;")
_SUB = re.compile(r"\bsub(?:\.rn)?\.f32\s+%\w+,\s*(%\w+|0f[08]0000000),")


def ptx_facts(ptx: str) -> dict[str, int]:
    """Counts of :data:`PTX_FACTS` in ``ptx`` (comments left out), and ``neg_by_sub``: float32 negations compiled
    as ``0.0 - x`` (a ``sub.f32`` from a zero constant or a register holding one; Triton <= 3.6's unary minus),
    which give +0.0 for x = +0.0."""
    code = "\n".join(line.split("//")[0] for line in ptx.splitlines())
    facts = {k: len(p.findall(code)) for k, p in PTX_FACTS.items()}
    zeros = set(_ZERO_MOV.findall(code))
    facts["neg_by_sub"] = sum(a in zeros or a.startswith("0f") for a in _SUB.findall(code))
    return facts


def compile_launch(launch, tgt):
    """Compile one launch record for the GPUTarget ``tgt`` as the JIT would build it (minus FP fusion)."""
    from kvqref.backends._aot import compile_for_target

    sig, cx, div = _signature(launch)
    return compile_for_target(launch.kernel, sig, cx, tgt, divisible_by_16=div,
                              options={**launch.options, "enable_fp_fusion": False})


def compile_all(targets: tuple[str, ...] = TARGETS, only: str | None = None) -> list[dict[str, Any]]:
    """Compile every kernel variant for every target (``only``: the variants whose names contain it); one result dict
    per (variant, target)."""
    from kvqref.backends._aot import expected_asm_keys, make_target
    from kvqref.kernels.layout import check_partner_layout

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("AOT compilation needs a process without TRITON_INTERPRET=1")
    results = []
    for target in targets:
        backend, arch = target.split(":")
        tgt = make_target(backend, arch if backend == "hip" else int(arch))
        for name, launch in _launches(target):
            if only is not None and only not in name:
                continue
            t0 = time.perf_counter()
            rec: dict[str, Any] = {"target": target, "kernel": name}
            try:
                ck = compile_launch(launch, tgt)
                text, binary = expected_asm_keys(ck.metadata.target)
                ok = bool(ck.asm.get(text)) and ck.asm.get(binary, b"")[:4] == b"\x7fELF"
                if backend == "hip":
                    ok = ok and arch in ck.asm[text]
                rec.update(ok=ok, seconds=round(time.perf_counter() - t0, 2), shared=ck.metadata.shared,
                           num_warps=ck.metadata.num_warps, code_bytes=len(ck.asm[binary]))
                if launch.constexprs.get("ROT_SHFL"):  # the shuffles' lane masks match this target's layout
                    rec["shuffles_checked"] = check_partner_layout(
                        ck.asm["ttgir"], launch.constexprs["ROT_LANE_H"], launch.constexprs["ROT_LANE_N"],
                        launch.constexprs["D"])
                if backend == "cuda":
                    rec["ptx_facts"] = ptx_facts(ck.asm["ptx"])
            except Exception as exc:  # noqa: BLE001 - reported per variant
                rec.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            results.append(rec)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--only", help="compile only the kernel variants whose names contain this text, e.g. "
                    "'decode[fp4_e2m1'")
    args = ap.parse_args(argv)
    results = compile_all(tuple(args.targets.split(",")), args.only)
    if not results:
        print(f"no kernel variant matches --only {args.only!r}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(results))
    else:
        for r in results:
            status = "ok " if r["ok"] else "FAIL"
            print(f"{status} {r['target']:12s} {r['kernel']:40s} {r.get('seconds', '')} {r.get('error', '')}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
