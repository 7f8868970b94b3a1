"""Reading and writing calibrated K/V scales in the files the engines load.

* ``sglang``: the JSON of SGLang's ``--quantization-param-path``, as validated by
  ``python/sglang/srt/model_loader/weight_utils.py: kv_cache_scales_loader`` with the pydantic schemas
  ``QuantParamSchema {model_type: str | None, kv_cache: KVCacheQuantSchema}`` and
  ``KVCacheQuantSchema {dtype: str, scaling_factor: Dict[int, Dict[int, float]]}`` (copied from vLLM's
  ``model_executor/layers/quantization/schema.py``; sgl-project/sglang commit 57003beaaa7b):
  ``{"model_type": ..., "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {rank: {layer: s}}}}``.
  Its validators demand ``dtype == "float8_e4m3fn"``, one entry per TP rank, every layer on every rank.
  Each model's ``load_kv_cache_scales`` sets ``attn.k_scale = attn.v_scale = s``: ONE per-tensor factor for
  K and V, so the writer stores ``max(k_scale, v_scale)`` per layer (neither side clips more than
  calibrated) and the same factor for every TP rank (a per-tensor scale does not depend on the shard).
* ``vllm``: checkpoint tensors ``model.layers.{i}.self_attn.k_scale`` / ``.v_scale`` (float32, safetensors),
  the names llm-compressor / compressed-tensors save and vLLM's
  ``model_executor/model_loader/weight_utils.py: maybe_remap_kv_scale_name`` maps to
  ``...self_attn.attn.k_scale`` (it also accepts ModelOpt's ``self_attn.k_proj.k_scale``, read here too).
  Shapes as compressed-tensors' ``initialize_qparams`` makes them: per tensor ``[1]`` (strategy ``tensor``),
  per head ``[num_kv_heads, 1, 1]`` (strategy ``attn_head``; vLLM docs v0.25.0, "Quantized KV Cache":
  ``k/v_scale = [num_kv_heads]``, FlashAttention backend only). The reader accepts ``[]``, ``[1]``,
  ``[H]`` and ``[H, 1, 1]``. vLLM uses the tensors when the checkpoint's ``config.json`` has a
  ``quantization_config`` with ``kv_cache_scheme`` ``{"num_bits": 8, "type": "float", "strategy":
  "tensor" | "attn_head", "dynamic": false, "symmetric": true}`` (validated in
  ``compressed_tensors.py: CompressedTensorsKVCacheMethod.validate_kv_cache_scheme``); the writer puts that
  fragment in the file's ``__metadata__`` (key ``kv_cache_scheme``) and :func:`vllm_config_fragment`.
  Its ``BaseKVCacheMethod.process_weights_after_loading`` replaces missing scales by 1.0.
  For ``nvfp4`` the tensors carry the NVFP4 global (decode) scale ``amax / 2688``; which engine reads
  NVFP4 KV global scales from these names is not verified here.
* ``kvqref``: JSON with every scale, its granularity and how it was made (lossless).

JSON numbers are the float32 values exactly (the shortest decimal of the value widened to a double).

Every reader raises ValueError naming the layer or key at fault.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from kvqref.calibration import st_format
from kvqref.calibration.scales import GRANULARITIES, SCHEMES, ScaleSet

FORMATS = ("sglang", "vllm", "kvqref")
SGLANG_DTYPE = "float8_e4m3fn"
KVQREF_FORMAT = "kvqref-kv-scales"
KVQREF_VERSION = 1
_VLLM_KEY = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:([kv])_proj\.)?([kv])_scale$")


def _positive(where: str, value: Any) -> np.ndarray:
    try:
        a = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: scale must be a number, got {value!r}") from None
    if a.size == 0 or not (np.isfinite(a).all() and (a > 0).all()):
        raise ValueError(f"{where}: scale must be positive and finite, got {value!r}")
    return a.astype(np.float32)


def _f32_text(x: np.ndarray) -> Any:
    """float32 scalar or array as JSON numbers equal to the float32 value exactly when read as doubles
    (Python's shortest repr of the widened value): SGLang holds the factor as a Python float and takes
    ``1 / s`` from it, so a shorter float32-only decimal would give it a slightly different number."""
    a = np.asarray(x, dtype=np.float32)
    conv = [float(v) for v in a.ravel()]
    return conv[0] if a.ndim == 0 else conv


# -- SGLang ---------------------------------------------------------------------------------------
def sglang_json(scales: ScaleSet, *, tp_size: int = 1, model_type: str | None = None) -> dict[str, Any]:
    """The ``--quantization-param-path`` document for ``scales`` (fp8_e4m3, per tensor)."""
    if scales.scheme != "fp8_e4m3":
        raise ValueError(f"SGLang's schema accepts dtype {SGLANG_DTYPE} only (scheme fp8_e4m3), not {scales.scheme}")
    if scales.granularity != "tensor":
        raise ValueError("SGLang's --quantization-param-path holds one per-tensor factor per layer; "
                         "calibrate with --granularity tensor (or write --format vllm for per-head scales)")
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    table = {str(i): _f32_text(np.maximum(k, v)) for i, (k, v) in enumerate(zip(scales.k, scales.v, strict=True))}
    doc: dict[str, Any] = {"kv_cache": {"dtype": SGLANG_DTYPE, "scaling_factor": {str(r): dict(table)
                                                                                  for r in range(tp_size)}}}
    if model_type is not None:
        doc = {"model_type": model_type, **doc}
    return doc


def _sglang_table(path: str | os.PathLike, data: Any) -> dict[str, Any]:
    if not isinstance(data, dict) or not isinstance(data.get("kv_cache"), dict) \
            or not isinstance(data["kv_cache"].get("scaling_factor"), dict):
        raise ValueError(f"{path}: expected {{'kv_cache': {{'dtype': ..., 'scaling_factor': {{rank: {{layer: s}}}}}}}}")
    return data["kv_cache"]


def read_sglang(path: str | os.PathLike, rank: int = 0, num_layers: int | None = None) -> ScaleSet:
    """The scales of TP ``rank`` (K = V = the layer's factor), checked as SGLang's validators check them:
    dtype float8_e4m3fn, every layer 0..n-1 present (``num_layers`` if given), positive finite factors."""
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    kv = _sglang_table(path, data)
    if kv.get("dtype") != SGLANG_DTYPE:
        raise ValueError(f"{path}: kv_cache.dtype must be {SGLANG_DTYPE!r} (SGLang's KVCacheQuantSchema), "
                         f"got {kv.get('dtype')!r}")
    ranks = {str(r): t for r, t in kv["scaling_factor"].items()}
    if str(rank) not in ranks:
        raise ValueError(f"{path}: no scales for TP rank {rank}; ranks present: {sorted(ranks)}")
    layers = ranks[str(rank)]
    if not isinstance(layers, dict):
        raise ValueError(f"{path}: rank {rank}: expected {{layer: scale}}, got {type(layers).__name__}")
    try:
        table = {int(k): v for k, v in layers.items()}
    except ValueError:
        raise ValueError(f"{path}: rank {rank}: layer keys must be integers, got {sorted(layers)}") from None
    n = num_layers if num_layers is not None else (max(table) + 1 if table else 0)
    missing = [i for i in range(n) if i not in table]
    if missing or not table:
        raise ValueError(f"{path}: rank {rank}: no scale for layer {missing[0] if missing else 0} "
                         f"({len(table)} layers present, {n} expected)")
    extra = sorted(i for i in table if not 0 <= i < n)
    if extra:
        raise ValueError(f"{path}: rank {rank}: layer {extra[0]} is beyond the model's {n} layers")
    vals = [_positive(f"{path}: rank {rank} layer {i}", table[i]) for i in range(n)]
    for i, v in enumerate(vals):
        if v.ndim:
            raise ValueError(f"{path}: rank {rank} layer {i}: scale must be one number, got {table[i]!r}")
    return ScaleSet("fp8_e4m3", "tensor", [v.copy() for v in vals], [v.copy() for v in vals],
                    {"source": f"sglang:{path}", "rank": rank, **({"model_type": data["model_type"]}
                                                                 if data.get("model_type") else {})})


def load_sglang_scales(path: str | os.PathLike, rank: int, layer: int) -> float:
    """The KV factor of ``layer`` on TP ``rank`` from SGLang's ``--quantization-param-path`` JSON (one
    factor for K and V). Only the looked-up entry is checked (see :func:`read_sglang` for the whole file)."""
    with open(path) as f:
        data = json.load(f)
    ranks = {str(k): v for k, v in _sglang_table(path, data)["scaling_factor"].items()}
    if str(rank) not in ranks:
        raise ValueError(f"{path}: no scales for TP rank {rank}; ranks present: {sorted(ranks)}")
    layers = {str(k): v for k, v in ranks[str(rank)].items()}
    if str(layer) not in layers:
        raise ValueError(f"{path}: rank {rank} has no scale for layer {layer}")
    return float(_positive(f"{path}: rank {rank} layer {layer}", layers[str(layer)]))


# -- vLLM (checkpoint tensors) -----------------------------------------------------------------------
def vllm_config_fragment(scales: ScaleSet) -> dict[str, Any]:
    """``quantization_config.kv_cache_scheme`` of a compressed-tensors checkpoint for these scales."""
    return {"num_bits": 8 if scales.scheme != "nvfp4" else 4, "type": "float",
            "strategy": "tensor" if scales.granularity == "tensor" else "attn_head",
            "dynamic": False, "symmetric": True}


def vllm_tensors(scales: ScaleSet) -> dict[str, np.ndarray]:
    """``model.layers.{i}.self_attn.{k,v}_scale`` float32, shape [1] (tensor) or [H, 1, 1] (head)."""
    out = {}
    for i in range(scales.num_layers):
        for side, arrs in (("k", scales.k), ("v", scales.v)):
            a = arrs[i]
            out[f"model.layers.{i}.self_attn.{side}_scale"] = a.reshape(1) if a.ndim == 0 else a.reshape(-1, 1, 1)
    return out


def write_vllm(path: str | os.PathLike, scales: ScaleSet) -> None:
    meta = {"format": "pt", "kv_cache_scheme": json.dumps(vllm_config_fragment(scales)),
            "kvqref": json.dumps({"scheme": scales.scheme, "granularity": scales.granularity, **scales.meta},
                                 default=str)}
    st_format.save(path, vllm_tensors(scales), meta)


def read_vllm(path: str | os.PathLike, scheme: str | None = None) -> ScaleSet:
    """K/V scales from a safetensors file (a whole checkpoint shard is fine: other tensors are ignored).
    Layers must be 0..n-1 with both K and V; all per tensor or all per head (same head count)."""
    tensors, meta = st_format.load(path)
    found: dict[int, dict[str, np.ndarray]] = {}
    for name, arr in tensors.items():
        m = _VLLM_KEY.match(name)
        if not m:
            continue
        proj, side = m.group(2), m.group(3)
        if proj is not None and proj != side:
            raise ValueError(f"{path}: tensor {name!r}: a {side}_scale under {proj}_proj")
        layer = found.setdefault(int(m.group(1)), {})
        if side in layer:
            raise ValueError(f"{path}: layer {m.group(1)} has two {side}_scale tensors (e.g. {name!r})")
        if arr.ndim > 3 or (arr.ndim >= 2 and arr.shape[1:] != (1,) * (arr.ndim - 1)):
            raise ValueError(f"{path}: tensor {name!r}: shape {list(arr.shape)} is not [], [1], [H] or [H, 1, 1]")
        layer[side] = _positive(f"{path}: tensor {name!r}", arr.reshape(-1))
    if not found:
        raise ValueError(f"{path}: no tensors named model.layers.N.self_attn.k_scale / v_scale")
    n = max(found) + 1
    for i in range(n):
        for side in "kv":
            if side not in found.get(i, {}):
                raise ValueError(f"{path}: layer {i} has no {side}_scale (expected model.layers.{i}.self_attn."
                                 f"{side}_scale; layers present: 0..{n - 1})")
    k0 = found[0]["k"].size
    for i in range(n):
        for side in "kv":
            if found[i][side].size != k0:
                raise ValueError(f"{path}: tensor 'model.layers.{i}.self_attn.{side}_scale' has {found[i][side].size} "
                                 f"entries but layer 0's k_scale has {k0}: every layer needs the same granularity")
    per_head = k0 != 1
    info = json.loads(meta.get("kvqref", "{}") or "{}")
    sch = scheme or info.get("scheme", "fp8_e4m3")
    if sch not in SCHEMES:
        raise ValueError(f"{path}: scheme {sch!r} is not one of {SCHEMES}")

    def get(i: int, s: str) -> np.ndarray:
        a = found[i][s]
        return a.copy() if per_head else a.reshape(())

    return ScaleSet(sch, "head" if per_head else "tensor", [get(i, "k") for i in range(n)],
                    [get(i, "v") for i in range(n)], {"source": f"vllm:{path}",
                                                      **{k: v for k, v in info.items() if k not in ("scheme",
                                                                                                    "granularity")}})


# -- kvqref JSON -------------------------------------------------------------------------------------
def kvqref_json(scales: ScaleSet) -> dict[str, Any]:
    return {"format": KVQREF_FORMAT, "version": KVQREF_VERSION, "scheme": scales.scheme,
            "granularity": scales.granularity, "meta": scales.meta,
            "layers": [{"layer": i, "k_scale": _f32_text(k), "v_scale": _f32_text(v)}
                       for i, (k, v) in enumerate(zip(scales.k, scales.v, strict=True))]}


def read_kvqref(path: str | os.PathLike) -> ScaleSet:
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict) or d.get("format") != KVQREF_FORMAT:
        raise ValueError(f"{path}: not a kvqref scales file (\"format\" must be {KVQREF_FORMAT!r})")
    if d.get("version") != KVQREF_VERSION:
        raise ValueError(f"{path}: version {d.get('version')!r} is not supported (this reader knows {KVQREF_VERSION})")
    for key, allowed in (("scheme", SCHEMES), ("granularity", GRANULARITIES)):
        if d.get(key) not in allowed:
            raise ValueError(f"{path}: {key!r} must be one of {allowed}, got {d.get(key)!r}")
    layers = d.get("layers")
    if not isinstance(layers, list) or not layers:
        raise ValueError(f"{path}: 'layers' must be a non-empty list")
    ks, vs = [], []
    for i, entry in enumerate(layers):
        if not isinstance(entry, dict) or entry.get("layer") != i:
            raise ValueError(f"{path}: layers[{i}] must be {{'layer': {i}, 'k_scale': ..., 'v_scale': ...}}, "
                             f"got {entry!r}")
        for key, out in (("k_scale", ks), ("v_scale", vs)):
            if key not in entry:
                raise ValueError(f"{path}: layer {i} has no {key}")
            a = _positive(f"{path}: layer {i} {key}", entry[key])
            if (d["granularity"] == "tensor") != (a.ndim == 0) or a.ndim > 1:
                raise ValueError(f"{path}: layer {i} {key}: shape {a.shape} does not fit granularity "
                                 f"{d['granularity']!r}")
            out.append(a)
    heads = {a.size for a in ks + vs}
    if len(heads) != 1:
        raise ValueError(f"{path}: layers disagree on the number of KV heads ({sorted(heads)})")
    return ScaleSet(d["scheme"], d["granularity"], ks, vs, dict(d.get("meta") or {}))


# -- any format ---------------------------------------------------------------------------------------
def save(path: str | os.PathLike, scales: ScaleSet, fmt: str, **options: Any) -> None:
    """Write ``scales`` as ``fmt`` (``sglang`` takes ``tp_size``, ``model_type``)."""
    if fmt == "sglang":
        Path(path).write_text(json.dumps(sglang_json(scales, **options), indent=1) + "\n")
    elif fmt == "vllm":
        write_vllm(path, scales)
    elif fmt == "kvqref":
        Path(path).write_text(json.dumps(kvqref_json(scales), indent=1, default=str) + "\n")
    else:
        raise ValueError(f"unknown scales format {fmt!r}; known formats: {', '.join(FORMATS)}")


def load(path: str | os.PathLike, fmt: str | None = None, **options: Any) -> ScaleSet:
    """Read ``path`` as ``fmt`` (guessed when None: ``.safetensors`` is vllm; JSON with ``"format":
    "kvqref-kv-scales"`` is kvqref; other JSON is sglang)."""
    if fmt is None:
        if str(path).endswith(".safetensors"):
            fmt = "vllm"
        else:
            try:
                fmt = "kvqref" if json.loads(Path(path).read_text()).get("format") == KVQREF_FORMAT else "sglang"
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                raise ValueError(f"{path}: neither safetensors (by name) nor a JSON object") from None
    readers = {"sglang": read_sglang, "vllm": read_vllm, "kvqref": read_kvqref}
    if fmt not in readers:
        raise ValueError(f"unknown scales format {fmt!r}; known formats: {', '.join(FORMATS)}")
    return readers[fmt](path, **options)
