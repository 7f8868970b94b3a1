"""SASS instruction mix of the decode kernel's tile loop per scheme (sm_90 cubin, built on this CPU machine).

    python3 bench/sass_mix.py [--dump DIR]     # needs a process without TRITON_INTERPRET

Compiles each decode variant for sm_90 (as ``python3 -m kvqref.kernels.aot`` does), disassembles the
cubin with the ``cuobjdump`` shipped with Triton, finds the main tile loop (the first backward branch whose body
holds tensor-core instructions) and counts its instructions per thread by execution unit. Divided by
the elements each thread dequantizes per tile, that is the per-element cost the analysis in
bench/results/ANALYSIS.md compares with the issue budget. Registers per thread come from the cubin.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

UNITS = {
    "mma": ("HMMA", "HGMMA", "IMMA"),
    "fp32": ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FCHK", "FSWZADD"),
    "fp16x2": ("HADD2", "HMUL2", "HFMA2", "HMNMX2", "HSETP2"),
    "int": ("IMAD", "IADD3", "LOP3", "SHF", "LEA", "ISETP", "SEL", "PRMT", "IMNMX", "SGXT", "BMSK", "IABS",
            "POPC", "FLO", "BREV", "VIMNMX", "IADD", "SHL", "SHR", "LOP", "PLOP3", "P2R", "R2P", "MOV"),
    "cvt": ("F2F", "I2F", "F2I", "F2FP", "I2FP", "F2IP", "FRND"),
    "sfu": ("MUFU",),
    "ldg": ("LDG",),
    "smem": ("LDS", "STS", "LDSM", "STSM", "LDGSTS", "BAR", "LDGDEPBAR", "DEPBAR"),
    "shfl": ("SHFL",),
}

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?\s*([^;]*);")


def parse(sass: str) -> list[tuple[int, str, str, str]]:
    """(address, opcode, modifiers, operands) of each instruction."""
    return [(int(m.group(1), 16), m.group(2), m.group(3) or "", m.group(4)) for m in _LINE.finditer(sass)]


def tile_loop(ins: list[tuple[int, str, str, str]]) -> list[tuple[int, str, str, str]]:
    """Instructions of the main tile loop: the first backward-branch loop holding tensor-core instructions
    (KIVI's residual-window loop comes after it in the kernel)."""
    for addr, op, _mod, args in ins:
        m = re.search(r"0x([0-9a-f]+)", args) if op == "BRA" else None
        if m and int(m.group(1), 16) < addr:
            body = [i for i in ins if int(m.group(1), 16) <= i[0] <= addr]
            if any(i[1] in UNITS["mma"] for i in body):
                return body
    return []


def unit_counts(body) -> dict[str, int]:
    c: collections.Counter = collections.Counter()
    for _a, op, _m, _args in body:
        for unit, ops in UNITS.items():
            if op in ops:
                c[unit] += 1
                break
        else:
            c["other"] += 1
    return dict(c)


def sass_of(launch) -> tuple[str, int, int]:
    """(SASS text, registers per thread (-1 if not reported), shared bytes) of ``launch`` compiled for sm_90 and
    disassembled with the ``cuobjdump`` shipped with Triton."""
    import triton

    from kvqref.backends._aot import make_target
    from kvqref.kernels.aot import compile_launch

    ck = compile_launch(launch, make_target("cuda", 90))
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(ck.asm["cubin"])
    try:
        sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    regs = re.search(r"REG:(\d+)", res)
    return sass, int(regs.group(1)) if regs else -1, ck.metadata.shared


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", help="write each kernel's SASS here")
    ap.add_argument("--only", help="substring of the variant names to compile")
    args = ap.parse_args(argv)
    from kvqref.kernels.aot import DECODE_CASES, _launches

    cols = list(UNITS) + ["other"]
    print("| kernel | regs | loop instr. | " + " | ".join(cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    # the benchmark's configurations (bench/decode_bench.py): KIVI with G = 32 in pages of 32
    cases = [c for c in DECODE_CASES if "kivi" not in c[0]] + [(n, n, {}, n, {}) for n in ("nvfp4", "mxfp4")]
    kv = {"group_size": 32, "residual": 0}
    cases += [(n, n, {"role": "key", **kv}, n, {"role": "value", **kv}) for n in ("int4_kivi", "int2_kivi")]
    for name, launch in _launches("cuda:90", cases, page=32):
        if not name.startswith("decode") or (args.only and args.only not in name):
            continue
        sass, regs, _ = sass_of(launch)
        if args.dump:
            Path(args.dump).mkdir(parents=True, exist_ok=True)
            (Path(args.dump) / (re.sub(r"[^\w.-]+", "_", name) + ".sass")).write_text(sass)
        body = tile_loop(parse(sass))
        c = unit_counts(body)
        print(f"| {name} (BLOCK_N={launch.constexprs['BLOCK_N']}, warps={launch.options.get('num_warps')}) | "
              f"{regs if regs >= 0 else '?'} | {len(body)} | " + " | ".join(str(c.get(k, 0)) for k in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
