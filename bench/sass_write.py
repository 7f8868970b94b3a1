"""SASS instruction mix of the quantize-on-write kernel per scheme (sm_90 cubin, built on this CPU machine).

    python3 bench/sass_write.py [--cases nvfp4,int4_kivi-k] [--tile BT,BH] [--warps W] [--dump DIR]
                                [--routes none,split,sums,gather,shfl] [--block-d 128,64,32]
                                [--store-as-loaded] [--lines N]

Builds each write launch of ``bench/ab_write.py`` (the same host code, bf16 input, 8 KV heads x 128, the
default tile and warps unless given) on the CPU, compiles it for sm_90 as ``python3 -m kvqref.kernels.aot``
does, disassembles the cubin with the ``cuobjdump`` shipped with Triton and counts the whole kernel's
instructions per thread by execution unit (the write kernel is straight-line code: one tile per program).
Divided by the elements each thread quantizes, that is the per-element issue cost; registers per thread and
shared memory per program come from the compiled kernel. ``--routes``: each case unrotated (``none``) and/or
rotated (K seed 1) with the butterflies by each ``plan_write`` ``rotation_route`` (default: ``none`` only).
``fast path`` column: the instructions one thread executes on the common path (:func:`fast_path`), per element;
checked against ncu on the H100 for today's NVFP4 kernel (870 per thread = 27.19 per element, ncu 27.19).
``--block-d``: KIVI keys by channel blocks of each of these sizes (``plan_write``'s ``block_d``; other cases
and rotated ones keep the whole head_dim); ``--store-as-loaded``: KIVI keys' stores in the load's layout
(``plan_write``'s ``store_as_loaded``). ``bar``: barrier instructions (``BAR``: cross-warp exchanges through
shared memory); ``warps/SM``: the resident warps an sm_90 SM allows for the registers, warps and shared memory
(:func:`resident_warps`).
Needs a process without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sass_mix import UNITS, parse, sass_of, unit_counts  # noqa: E402

_PRED_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?(U?P\w+)\s+)?([A-Z][A-Z0-9_]*)(?:\.[A-Z0-9_.]+)?\s*([^;]*);")


def fast_path(sass: str) -> int:
    """Instructions executed by a thread on the write kernel's common path: from the entry, unconditional branches
    taken, a branch on an ``FCHK`` predicate taken (``div_rn``'s check: skip its slow-path call), every other
    conditional branch not taken (``if fast:`` blocks, the tile's in-range stores), up to the first unconditional
    ``EXIT``."""
    ins = [(int(m.group(1), 16), m.group(2), m.group(3), m.group(4)) for m in _PRED_LINE.finditer(sass)]
    at = {a: i for i, (a, *_rest) in enumerate(ins)}
    setter: dict[str, str] = {}
    i = n = 0
    while True:
        _a, pred, op, args = ins[i]
        n += 1
        for p in re.findall(r"\bP\d\b", args.split(",")[0]):  # predicates this instruction writes
            setter[p] = op
        if op == "EXIT" and pred is None:
            return n
        if op == "BRA" and (pred is None or setter.get(pred) == "FCHK"):
            i = at[int(re.search(r"0x([0-9a-f]+)", args).group(1), 16)]
        else:
            i += 1

#: bench/ab_write.py's cases: (row label, decode_bench scheme label, side)
CASES = [("bf16", "bf16", "k"), ("fp8_e4m3", "fp8_e4m3", "k"), ("fp4_e2m1", "fp4_e2m1", "k"),
         ("mxfp4", "mxfp4", "k"), ("nvfp4", "nvfp4", "k"),
         ("int4_kivi-k", "int4_kivi", "k"), ("int4_kivi-v", "int4_kivi", "v"),
         ("int2_kivi-k", "int2_kivi", "k"), ("int2_kivi-v", "int2_kivi", "v")]


#: sm_90 (H100) per-SM limits: registers, warps, thread blocks, shared memory (bytes, with 1 KiB reserved per block)
SM90 = {"regs": 65536, "warps": 64, "blocks": 32, "smem": 228 * 1024, "smem_reserved": 1024}


def resident_warps(regs: int, warps: int, smem: int, sm: dict = SM90) -> int:
    """Warps of ``warps``-warp programs resident on one SM: registers are allocated per warp in units of 256
    (8 per thread) from 4 sub-partitions of a quarter of the file each; at most ``blocks`` programs and ``warps``
    warps; shared memory per program plus the reserve."""
    per_warp = -(-regs // 8) * 8 * 32
    by_regs = 4 * ((sm["regs"] // 4) // per_warp) // warps
    by_smem = sm["smem"] // (smem + sm["smem_reserved"])
    return min(by_regs, sm["blocks"], by_smem, sm["warps"] // warps) * warps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(c[0] for c in CASES))
    ap.add_argument("--tile", help="BLOCK_T,BLOCK_H (default: the backend's)")
    ap.add_argument("--warps", type=int)
    ap.add_argument("--nvfp4-blocks", choices=("0", "1"), default="1",
                    help="plan_write's nvfp4_blocks (default 1, as on an NVIDIA GPU)")
    ap.add_argument("--maxnreg", type=int, help="Triton's CUDA option maxnreg (registers per thread cap)")
    ap.add_argument("--f16-cvt", action="store_true", help="KIVI float16 roundings by conversion instructions")
    ap.add_argument("--word-load", action="store_true",
                    help="rotated writes: element pairs loaded as 32-bit words (plan_write's word_load)")
    ap.add_argument("--cx", default="", help="extra kernel constexprs NAME=INT,... (A/B variants)")
    ap.add_argument("--dump", help="write each kernel's SASS here")
    ap.add_argument("--lines", type=int, default=0,
                    help="also print the N source lines with the most instructions (nvdisasm's line table)")
    ap.add_argument("--routes", default="none", help="none (unrotated) and/or rotated by rotation_route: "
                    "split, sums, gather, shfl (comma-separated)")
    ap.add_argument("--block-d", default="", help="KIVI keys: channels per program (comma-separated; plan_write's "
                    "block_d; default the whole head_dim)")
    ap.add_argument("--store-as-loaded", action="store_true", help="KIVI keys: stores in the load's layout")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("needs a process without TRITON_INTERPRET=1")
    from decode_bench import write_inputs

    from kvqref.backends import triton_backend as tb

    cols = list(UNITS) + ["other"]
    print("| kernel | route | tile | warps | regs | smem B | warps/SM | instr. | per elem. | fast path "
          "| fast per elem. | bar | " + " | ".join(cols) + " |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(cols))
    block_ds = [int(v) for v in args.block_d.split(",") if v] or [None]
    for (label, scheme_label, side_name), route, bd in (
            (c, r, b) for c in CASES if c[0] in args.cases.split(",") for r in args.routes.split(",")
            for b in (block_ds if c[0].endswith("kivi-k") and r == "none" else [None])):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            side, x, slots, _ = write_inputs(scheme_label, tokens=256, side=side_name, device="cpu",
                                             rotation=route != "none")
        kw = {} if route == "none" else {"rotation_route": route}
        kw["nvfp4_blocks"] = args.nvfp4_blocks == "1"
        if args.word_load:
            kw["word_load"] = True
        if bd is not None:
            kw["block_d"] = bd
        if args.store_as_loaded and label.endswith("kivi-k") and route == "none":
            kw["store_as_loaded"] = True
        if args.tile:
            kw["block_t"], kw["block_h"] = (int(v) for v in args.tile.split(","))
        launch = tb.plan_write(side, x, slots, num_warps=args.warps, hw_fp8=True, f16_cvt=args.f16_cvt, **kw)
        launch.constexprs.update({k: int(v) for k, v in (c.split('=') for c in args.cx.split(',') if c)})
        if args.maxnreg:
            launch.options["maxnreg"] = args.maxnreg
        sass, regs, smem = sass_of(launch)
        if args.dump:
            Path(args.dump).mkdir(parents=True, exist_ok=True)
            variant = (('' if route == 'none' else '-' + route) + ('' if bd is None else f'-d{bd}')
                       + ('-sal' if kw.get("store_as_loaded") else ''))
            (Path(args.dump) / f"write_{label}{variant}-w{launch.options['num_warps']}.sass").write_text(sass)
        body = parse(sass)
        fast = fast_path(sass)
        c = unit_counts(body)
        cx = launch.constexprs
        warps = launch.options["num_warps"]
        width = cx.get("BLOCK_D") or cx["D"]
        per_thread = cx["BLOCK_T"] * cx["BLOCK_H"] * width / (32 * warps)
        bars = sum(op == "BAR" for _a, op, _m, _args in body)
        print(f"| {label} | {route} | {cx['BLOCK_T']}x{cx['BLOCK_H']}x{width} | {warps} | {regs} | {smem} | "
              f"{resident_warps(regs, warps, smem)} | {len(body)} | {len(body) / per_thread:.1f} | {fast} | "
              f"{fast / per_thread:.2f} | {bars} | "
              + " | ".join(str(c.get(k, 0)) for k in cols) + " |", flush=True)
        if args.lines:
            print_source_lines(launch, args.lines, per_thread)
    return 0


def print_source_lines(launch, n: int, per_thread: float) -> None:
    """The ``n`` source lines (innermost, inlined helpers by their own lines) with the most instructions of the whole
    kernel, per thread and per element, by ``nvdisasm --print-line-info`` of its sm_90 cubin."""
    import collections
    import tempfile

    from ncu_stall_lines import line_table

    from kvqref.backends._aot import make_target
    from kvqref.kernels.aot import compile_launch

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compile_launch(launch, make_target("cuda", 90)).asm["cubin"])
        f.flush()
        loc, ops = line_table(f.name)
    count: collections.Counter = collections.Counter(loc.values())
    mix: dict = collections.defaultdict(collections.Counter)
    for off, where in loc.items():
        mix[where][ops[off].split(".")[0]] += 1
    for (name, line), k in count.most_common(n):
        print(f"    {k:5d} ({k / per_thread:5.2f} per element) {name}:{line} {dict(mix[(name, line)].most_common(4))}")


if __name__ == "__main__":
    sys.exit(main())
