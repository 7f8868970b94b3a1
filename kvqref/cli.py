"""The ``kvqref`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvqref import formats


def _bits_hex(codec: formats.MinifloatCodec, code: int) -> str:
    s = codec.spec
    bits = format(code, f"0{s.bits}b")
    sign = bits[0] + "." if s.signed else ""
    rest = bits[1:] if s.signed else bits
    mant = "." + rest[s.ebits:] if s.mbits else ""
    return f"0x{code:02X} ({sign}{rest[:s.ebits]}{mant})"


def formats_table() -> str:
    """Markdown table of every element format: bits, bias, range, and what overflow and NaN do."""
    head = ["format", "bits", "E", "M", "bias", "max finite", "max code", "min normal", "min subnormal",
            "overflow (saturate)", "overflow (no saturate)", "+-Inf (no saturate)", "NaN in", "-0"]
    rows = []
    for name in formats.names():
        c = formats.get(name)
        d = c.describe()
        rows.append([name, str(c.bits), str(c.spec.ebits), str(c.spec.mbits), str(c.bias), f"{c.max_finite:g}",
                     _bits_hex(c, c.spec.max_code), f"2^{c.spec.emin} = {c.min_normal:.6g}",
                     f"{c.min_subnormal:.6g}" if c.spec.subnormals else "none",
                     d["overflow, saturate=True"], d["overflow, saturate=False"], d["+-Inf, saturate=False"],
                     d["NaN"], d["-0"]])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def _cmd_formats(args: argparse.Namespace) -> int:
    print(formats_table())
    print("\nRounding: to nearest, ties to even, one rounding from the exact input (E8M0: floor, ceil or nearest,"
          " chosen by the caller). Details: docs/formats.md")
    return 0


def _cmd_vectors(args: argparse.Namespace) -> int:
    from kvqref import vectors

    path = vectors.write(args.out)
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvqref", description="Reference codecs and kernels for quantized KV caches")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("formats", help="table of every element format").set_defaults(func=_cmd_formats)
    v = sub.add_parser("vectors", help="export the golden test vectors (JSON)")
    v.add_argument("--out", required=True, help="output folder")
    v.set_defaults(func=_cmd_vectors)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
