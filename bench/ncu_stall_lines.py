"""Warp-stall samples of an Nsight Compute SASS export attributed to source lines, through the cubin's line table.

    python3 bench/ncu_stall_lines.py SCHEME-sass.csv KERNEL.cubin [N] [--list FILE:LINE]

``SCHEME-sass.csv``: ``bash bench/ncu_decode.sh`` (per SASS instruction: address, stall samples by reason);
``KERNEL.cubin``: the profiled kernel's cubin, e.g. copied from Triton's cache on the device after the profiled
run (``~/.triton/cache/*/decode_split_kernel.cubin``; the one whose opcodes match the export's, reported as
``opcode mismatches 0``). Each instruction's offset from the kernel's first is looked up in ``nvdisasm
--print-line-info`` of the cubin (the ``nvdisasm`` shipped with Triton). Prints the total, then the N (default 30)
source lines with the most samples and their three largest stall reasons; ``--list FILE:LINE`` (e.g.
``standard.py:293``, Triton's reductions) instead lists that line's instructions: offset, samples, times executed,
the instruction. Source lines are the innermost ones (inlined helpers report their own lines).
"""

from __future__ import annotations

import collections
import csv
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sass_mix import _LINE  # noqa: E402  (one SASS instruction: address, opcode, modifiers, operands)


def _nvdisasm() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm")


def line_table(cubin: str) -> tuple[dict[int, tuple[str, int]], dict[int, str]]:
    """(offset -> (file name, line), offset -> opcode) of every instruction of ``cubin``."""
    out = subprocess.run([_nvdisasm(), "--print-line-info", "-c", cubin], capture_output=True, text=True,
                         check=True).stdout
    loc: dict[int, tuple[str, int]] = {}
    ops: dict[int, str] = {}
    cur = ("?", 0)
    for text in out.splitlines():
        if "//##" in text:
            m = re.search(r'File "([^"]+)", line (\d+)', text)
            if m:
                cur = (Path(m.group(1)).name, int(m.group(2)))
            continue
        m = _LINE.search(text)
        if m:
            loc[int(m.group(1), 16)] = cur
            ops[int(m.group(1), 16)] = m.group(2)
    return loc, ops


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    rows = list(csv.reader(open(argv[0])))
    hdr, data = rows[1], rows[2:]
    i_addr, i_src = hdr.index("Address"), hdr.index("Source")
    i_samples, i_exec = hdr.index("Warp Stall Sampling (All Samples)"), hdr.index("Instructions Executed")
    stall_cols = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]

    def num(text: str) -> int:
        return int(text) if text.isdigit() else 0

    loc, ops = line_table(argv[1])
    base = int(data[0][i_addr], 16)
    total, mismatches = 0, 0
    by_line: collections.Counter = collections.Counter()
    reasons: dict = collections.defaultdict(collections.Counter)
    listing = []
    want = argv[argv.index("--list") + 1] if "--list" in argv else None
    for r in data:
        off = int(r[i_addr], 16) - base
        words = [w for w in r[i_src].split() if not w.startswith("@")]
        if off in ops and words and not ops[off].startswith(words[0].split(".")[0]):
            mismatches += 1
        where = loc.get(off, ("?", 0))
        samples = num(r[i_samples])
        total += samples
        by_line[where] += samples
        for i in stall_cols:
            reasons[where][hdr[i][6:]] += num(r[i])
        if want and f"{where[0]}:{where[1]}" == want:
            listing.append(f"{off:6x} {samples:6d} {num(r[i_exec]):8d} {r[i_src].strip()}")
    print(f"total samples {total}, opcode mismatches {mismatches}")
    if want:
        print("\n".join(listing))
        return 0
    n = int(argv[2]) if len(argv) > 2 and argv[2].isdigit() else 30
    for where, samples in by_line.most_common(n):
        top = dict(reasons[where].most_common(3))
        print(f"{samples:6d} {100 * samples / max(total, 1):5.1f}% {where[0]}:{where[1]} {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
