"""The SASS instructions with the most warp-stall samples in an Nsight Compute source export.

    python3 bench/ncu_top_stalls.py SCHEME-sass.csv [N]     # from bench/ncu_decode.sh
    python3 bench/ncu_top_stalls.py SCHEME-sass.csv --ops ELEMENTS

Prints the kernel's stall-reason shares, then the N (default 25) instructions with the most samples: samples,
times executed, the instruction and its three largest stall reasons. ``--ops ELEMENTS``: instead, the executed
instruction mix by opcode, in thread instructions per element (warp instructions x 32 / ELEMENTS; the bench's
write quantizes 65,536 x 8 x 128 = 67,108,864 elements).
"""

from __future__ import annotations

import csv
import sys
from collections import Counter


def main(argv: list[str]) -> int:
    rows = list(csv.reader(open(argv[0])))
    hdr, data = rows[1], rows[2:]
    i_src = hdr.index("Source")
    i_samples = hdr.index("Warp Stall Sampling (All Samples)")
    i_exec = hdr.index("Instructions Executed")
    stall_cols = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]

    def num(text: str) -> int:
        return int(text) if text.isdigit() else 0

    if len(argv) > 2 and argv[1] == "--ops":
        return op_mix(data, hdr.index("Source"), i_exec, num, float(argv[2]))
    total = sum(num(r[i_samples]) for r in data)
    reasons: Counter = Counter()
    for r in data:
        for i in stall_cols:
            reasons[hdr[i]] += num(r[i])
    print("total samples", total, {k: round(v / max(total, 1), 3) for k, v in reasons.most_common(8)})
    ranked = sorted(data, key=lambda r: -num(r[i_samples]))
    for r in ranked[: int(argv[1]) if len(argv) > 1 else 25]:
        top = sorted(((num(r[i]), hdr[i][6:]) for i in stall_cols), reverse=True)[:3]
        print(f"{num(r[i_samples]):6d} {r[i_exec]:>8} {r[i_src].strip()[:70]:70s} {top}")
    return 0


def op_mix(data: list[list[str]], i_src: int, i_exec: int, num, elements: float) -> int:
    """Executed thread instructions per element, in all and per opcode (predicates and modifiers dropped)."""
    ops: Counter = Counter()
    for r in data:
        words = [w for w in r[i_src].split() if not w.startswith("@")]
        if words:
            ops[words[0].split(".")[0]] += num(r[i_exec])
    total = sum(ops.values())
    print(f"warp instructions {total}, thread instructions per element {total * 32 / elements:.2f}")
    print(", ".join(f"{op} {n * 32 / elements:.2f}" for op, n in ops.most_common(25)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
