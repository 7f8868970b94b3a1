"""Instruction mix of the compiled decode kernel per scheme (PTX for sm_90, built on this CPU machine).

    python3 bench/ptx_mix.py          # needs a process without TRITON_INTERPRET

Counts PTX instructions by kind in the whole kernel (the tile loop dominates): tensor-core MMAs, type
conversions, integer/bit operations, float arithmetic, global/shared memory operations. Used to explain
where the FP4 and INT kernels spend their issue slots (bench/results/ANALYSIS.md).
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KINDS = {
    "mma": re.compile(r"^\s*(mma|wgmma)\."),
    "cvt": re.compile(r"^\s*cvt\."),
    "int/bit": re.compile(
        r"^\s*(and|or|xor|shl|shr|lop3|prmt|bfe|bfi|selp|not|setp\.\w+\.[su]\d+"
        r"|add\.[su]\d+|mul\.lo|mad\.lo|min\.[su]|max\.[su])"
    ),
    "float": re.compile(r"^\s*(fma|mul|add|sub|ex2|lg2|max|min|rcp|div|neg|abs)\.(rn\.)?(f32|f16|bf16|ftz)"),
    "ld.global": re.compile(r"^\s*ld\.global"),
    "st/ld.shared": re.compile(r"^\s*(st|ld)\.shared|^\s*ldmatrix"),
}


def mix(ptx: str) -> dict[str, int]:
    c: collections.Counter = collections.Counter()
    for line in ptx.splitlines():
        for k, rx in KINDS.items():
            if rx.search(line):
                c[k] += 1
                break
    return dict(c)


def main() -> int:
    from kvqref.backends._aot import make_target
    from kvqref.kernels.aot import _launches, compile_launch

    tgt = make_target("cuda", 90)
    print("| kernel | " + " | ".join(KINDS) + " |")
    print("|---|" + "---|" * len(KINDS))
    for name, launch in _launches("cuda:90"):
        if not name.startswith("decode"):
            continue
        ck = compile_launch(launch, tgt)
        m = mix(ck.asm["ptx"])
        counts = " | ".join(str(m.get(k, 0)) for k in KINDS)
        print(f"| {name} (BLOCK_N={launch.constexprs['BLOCK_N']}) | {counts} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
