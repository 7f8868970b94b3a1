"""Element formats of quantized KV caches: bit-exact NumPy codecs (the oracles).

``get(name)`` returns a codec; names follow ml_dtypes. Facts, bit patterns and the behaviour at every
edge case are in ``docs/formats.md`` and printed by ``kvqref formats``.
"""

from __future__ import annotations

from kvqref.formats.e8m0 import ROUNDINGS, E8M0Codec
from kvqref.formats.minifloat import MinifloatCodec, as_exact_float
from kvqref.formats.spec import FormatSpec

SPECS: dict[str, FormatSpec] = {
    s.name: s
    for s in (
        FormatSpec("float8_e4m3fn", 4, 3, 7, "all_ones",
                   description="OCP FP8 E4M3 (NVIDIA, Intel Gaudi 3, AMD MI350): max 448 = 0x7E"),
        FormatSpec("float8_e5m2", 5, 2, 15, "ieee", description="OCP FP8 E5M2, IEEE-like: max 57344 = 0x7B"),
        FormatSpec("float8_e4m3fnuz", 4, 3, 8, "negative_zero",
                   description="AMD MI300 FP8 E4M3: bias 8, max 240 = 0x7F, NaN 0x80"),
        FormatSpec("float8_e5m2fnuz", 5, 2, 16, "negative_zero",
                   description="AMD MI300 FP8 E5M2: bias 16, max 57344 = 0x7F, NaN 0x80"),
        FormatSpec("float4_e2m1fn", 2, 1, 1, "none",
                   description="OCP MX FP4 E2M1: values 0, 0.5, 1, 1.5, 2, 3, 4, 6"),
        FormatSpec("float8_e8m0fnu", 8, 0, 127, "all_ones", signed=False, subnormals=False,
                   description="OCP MX shared scale: 2**(c-127), NaN 0xFF"),
    )
}

_CODECS: dict[str, MinifloatCodec] = {
    name: (E8M0Codec(spec) if name == "float8_e8m0fnu" else MinifloatCodec(spec)) for name, spec in SPECS.items()
}


def names() -> list[str]:
    """Names of every element format."""
    return list(_CODECS)


def get(name: str) -> MinifloatCodec:
    """The codec of format ``name`` (e.g. ``"float8_e4m3fn"``); KeyError lists the known names."""
    try:
        return _CODECS[name]
    except KeyError:
        raise KeyError(f"unknown format {name!r}; known formats: {', '.join(_CODECS)}") from None


__all__ = ["ROUNDINGS", "SPECS", "E8M0Codec", "FormatSpec", "MinifloatCodec", "as_exact_float", "get", "names"]
