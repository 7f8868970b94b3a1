"""Which lane of a warp holds which element: the lane bases of Triton's distributed layouts, read from TTGIR.

A kernel that moves data between lanes by hand (``codecs.hadamard_rows``' warp shuffles, ROUTE 2 with
``SHFL_ASM``) is correct only for the layout Triton assigned to the shuffled tensor. Layouts are linear over
GF(2) for power-of-two shapes: flipping lane bit ``k`` of the lane id moves to the element whose coordinates are
XOR-ed with the lane basis ``k``. A ``#ttg.linear`` layout lists its bases; a ``#ttg.blocked`` layout gives them
by its ``sizePerThread``, ``threadsPerWarp`` and ``order`` (lane bits fill the dimensions fastest first, basis
``sizePerThread[d] << i`` in dimension ``d``, 0 where that passes the tensor's extent: the lanes are
replicated).
"""

from __future__ import annotations

import json
import re

_ALIAS = re.compile(r"^(#[\w.]+) = #ttg\.(blocked|linear)<\{(.*)\}>", re.M)
_SHFL_OP = re.compile(r'tt\.elementwise_inline_asm "shfl\.sync\.bfly[^"]*".*?-> tensor<([\dx]+)x\w+, (#[\w.]+)>')


def _int_lists(text: str, key: str) -> list:
    m = re.search(rf"\b{key} = (\[[\[\]\d, ]*\])", text)
    if m is None:
        raise ValueError(f"no {key} in layout {text!r}")
    return json.loads(m.group(1))


def lane_bases(layout: str, kind: str, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The lane bases (one coordinate tuple per lane-id bit, lowest bit first) of a layout attribute body
    ``layout`` (the text inside ``#ttg.blocked<{...}>`` or ``#ttg.linear<{...}>``) for a tensor of ``shape``."""
    if kind == "linear":
        return [tuple(b) for b in _int_lists(layout, "lane")]
    spt, tpw, order = (_int_lists(layout, k) for k in ("sizePerThread", "threadsPerWarp", "order"))
    bases = []
    for dim in order:
        for i in range(tpw[dim].bit_length() - 1):
            step = spt[dim] << i
            bases.append(tuple(step if d == dim and step < shape[d] else 0 for d in range(len(shape))))
    return bases


def shuffle_lane_bases(ttgir: str) -> list[tuple[tuple[int, ...], list[tuple[int, ...]]]]:
    """(shape, lane bases) of the tensor of every ``shfl.sync.bfly`` inline-asm op in a TTGIR module."""
    aliases = {m.group(1): (m.group(2), m.group(3)) for m in _ALIAS.finditer(ttgir)}
    out = []
    for m in _SHFL_OP.finditer(ttgir):
        shape = tuple(int(v) for v in m.group(1).split("x"))
        if m.group(2) not in aliases:
            raise ValueError(f"layout {m.group(2)} of a shuffle not defined in the module")
        kind, body = aliases[m.group(2)]
        out.append((shape, lane_bases(body, kind, shape)))
    return out


def row_lanes(bases: list[tuple[int, ...]], d: int) -> tuple[int, int]:
    """(lane_h, lane_n) of a ``[rows, d]`` tensor's lane bases: lane bit k (k < log2 lane_n) moves along the row by
    ``lane_h << k``, the longest such run from lane bit 0; (d, 1) where lane bit 0 does not move along the row."""
    if not bases or bases[0][0] != 0 or bases[0][1] <= 0 or bases[0][1] & (bases[0][1] - 1):
        return d, 1
    lane_h, n = bases[0][1], 1
    while n < len(bases) and bases[n] == (0, lane_h << n) and lane_h << n < d:
        n += 1
    return lane_h, 1 << n


def check_partner_layout(ttgir: str, lane_h: int, lane_n: int, d: int) -> int:
    """Raise RuntimeError unless every ``shfl.sync.bfly`` of the module acts on a ``[rows, d]`` tensor whose lane
    bit ``k`` moves along the row by exactly ``lane_h << k`` for every ``k < log2 lane_n`` (so lane mask
    ``h // lane_h`` reaches element ``j ^ h`` in the same register); returns the number of such shuffles."""
    found = shuffle_lane_bases(ttgir)
    for shape, bases in found:
        want = [(0, lane_h << k) for k in range(lane_n.bit_length() - 1)]
        if len(shape) != 2 or shape[1] != d or bases[:len(want)] != want:
            raise RuntimeError(f"warp-shuffle butterflies assume lane bit k moves a [rows, {d}] row by {lane_h} << k "
                               f"(k < {lane_n.bit_length() - 1}), but the compiled layout of shape {shape} has lane "
                               f"bases {bases}")
    return len(found)
