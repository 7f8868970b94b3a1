"""The safetensors file format, read and written directly (no dependency).

Layout (https://huggingface.co/docs/safetensors, "Format"): 8 bytes little-endian unsigned ``N``, then
``N`` bytes of UTF-8 JSON header, then the tensor bytes. The header maps each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of the header, byte
buffers back to back, little-endian, C order) and may hold ``"__metadata__"``: a str -> str map. The
writer pads the header with spaces to a multiple of 8 bytes and lays the tensors out sorted by name. The
``safetensors`` package sorts by dtype first, then by name, so for files of one dtype (kvqref writes
float32 only) and at most one metadata entry (it writes those in hash order) the bytes equal its
``save_file`` output (tested); any file either writes, the other reads.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np

DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
          "U8": "u1", "BOOL": "?"}
NAMES = {np.dtype(v).newbyteorder("<") if np.dtype(v).itemsize > 1 else np.dtype(v): k for k, v in DTYPES.items()}
MAX_HEADER = 100_000_000  # the safetensors package's limit on the header size


def _bf16_to_f32(raw: bytes) -> np.ndarray:
    return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)


def save(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (NumPy arrays of the dtypes in ``DTYPES``) and string ``metadata``."""
    header: dict[str, object] = {}
    if metadata:
        bad = [k for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
        if bad:
            raise ValueError(f"safetensors metadata must map str to str; bad entries: {bad}")
        header["__metadata__"] = dict(metadata)
    blobs, offset = [], 0
    for name in sorted(tensors):
        a = np.asarray(tensors[name])
        dt = a.dtype.newbyteorder("<") if a.dtype.itemsize > 1 else a.dtype
        if dt not in NAMES:
            raise ValueError(f"safetensors: tensor {name!r} has unsupported dtype {a.dtype}")
        b = a.astype(dt, copy=False).tobytes(order="C")
        header[name] = {"dtype": NAMES[dt], "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for b in blobs:
            f.write(b)


def load(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of a safetensors file; BF16 tensors are returned as float32 (exact).
    ValueError names the tensor or the header field at fault."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: not a safetensors file ({len(data)} bytes; the 8-byte header length is missing)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER or 8 + n > len(data):
        raise ValueError(f"{path}: header length {n} exceeds the file ({len(data)} bytes)")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: the header is not valid UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header must be a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError(f"{path}: __metadata__ must map str to str")
    body = data[8 + n:]
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        try:
            dtype, shape, (b, e) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {name!r}: header entry must hold dtype, shape and data_offsets "
                             f"[begin, end], got {info!r}") from None
        if dtype != "BF16" and dtype not in DTYPES:
            raise ValueError(f"{path}: tensor {name!r}: unsupported dtype {dtype!r}")
        item = 2 if dtype == "BF16" else np.dtype(DTYPES[dtype]).itemsize
        if any(d < 0 for d in shape) or not (0 <= b <= e <= len(body)) or e - b != item * int(np.prod(shape)):
            raise ValueError(f"{path}: tensor {name!r}: data_offsets [{b}, {e}] do not fit shape {shape} of "
                             f"{dtype} in a body of {len(body)} bytes")
        raw = body[b:e]
        arr = _bf16_to_f32(raw) if dtype == "BF16" else np.frombuffer(raw, DTYPES[dtype])
        out[name] = arr.reshape(shape).copy()
    return out, dict(meta)
