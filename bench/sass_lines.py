"""The decode tile loop's sm_90 SASS grouped by the source line each instruction came from (static, on the CPU).

    python3 bench/sass_lines.py [--scheme fp4_e2m1] [--qpk 4] [--layout HND] [--top 40] \
        [--plan key_products_transposed=true] [--spread 20]

Plans the scheme's default decode launch as on an H200 (``bench/sass_defaults.py``'s ``load_decode``: 2 KV heads,
head_dim 128, 140 tokens in pages of 16, KIVI pages of 32), compiles the split launch for sm_90 as ``python3 -m
kvqref.kernels.aot`` does, disassembles the cubin with Triton's ``nvdisasm -g`` (the line table Triton writes) and
counts the main tile loop's instructions (the first backward branch whose body holds tensor-core instructions, as
``bench/sass_mix.py`` finds it) per line of kvqref/kernels/decode.py, with each line's commonest opcodes. The line
table is the compiler's: an instruction it moved or merged may be charged to a neighbouring line (a register copy
into an MMA operand is charged to the ``tl.dot``), so read a line's count with its opcodes. Needs a process without
TRITON_INTERPRET; a cold Triton cache takes about a minute per launch.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_LABEL = re.compile(r"\s*(\.L_x_\d+):")
_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([^;]*);")

#: where an instruction came from, by the line table: (source file, line)
Where = tuple[str | None, int | None]
#: one instruction: (address, opcode, where, operands)
Row = tuple[int, str, Where, str]
#: the tensor-core opcodes (the tile loop is the backward-branch loop holding one)
TENSOR_OPS = ("HMMA", "HGMMA", "IMMA")


def lines_of(body: list[Row]) -> dict[Where, collections.Counter]:
    """{(source file, line): opcode counts} of a loop body. The file matters: Triton's own helpers (``tl.sum``'s and
    ``tl.max``'s combine functions in triton/language/standard.py) carry their own lines."""
    per: dict[Where, collections.Counter] = collections.defaultdict(collections.Counter)
    for _a, o, where, _args in body:
        per[where][o] += 1
    return dict(per)


def loop_by_line(text: str) -> tuple[int, dict[Where, collections.Counter], str | None]:
    """(loop instructions, :func:`lines_of` its body, the source file the line table names most) of the first
    backward-branch loop holding tensor-core instructions in ``nvdisasm -g`` text (branch targets are labels there,
    not addresses)."""
    body, named = loop_body(text)
    return len(body), lines_of(body), named


#: opcode classes of :func:`spread`
SPREAD_CLASSES = {"tensor": TENSOR_OPS, "shared/barrier": ("LDS", "LDSM", "STS", "STSM", "BAR"),
                  "global": ("LDG", "LDGSTS")}


def spread(body: list[Row], parts: int) -> list[dict[str, int]]:
    """Per consecutive part (``parts`` of about equal length) of the loop body, in program order, how many of its
    instructions fall in each class of SPREAD_CLASSES: where in the loop the tensor-core products, the shared-memory
    traffic and the global loads sit."""
    n = len(body)
    return [{c: sum(op in ops for _a, op, _l, _x in body[i * n // parts:(i + 1) * n // parts])
             for c, ops in SPREAD_CLASSES.items()} for i in range(parts)]


def loop_body(text: str) -> tuple[list[Row], str | None]:
    """The instructions (address, opcode, (source file, line), operands), in order, of :func:`loop_by_line`'s loop,
    and the source file the line table names most (empty and None when there is no such loop)."""
    files: collections.Counter = collections.Counter()
    labels: dict[str, int] = {}
    pending: list[str] = []
    rows: list[Row] = []
    where: Where = (None, None)
    for row in text.splitlines():
        if m := _LABEL.match(row):
            pending.append(m.group(1))
        elif m := _LINE.search(row):
            where = (m.group(1), int(m.group(2)))
            files[m.group(1)] += 1
        elif m := _INSTR.search(row):
            addr = int(m.group(1), 16)
            labels.update((label, addr) for label in pending)
            pending = []
            rows.append((addr, m.group(2), where, m.group(3)))
    for addr, op, _line, args in rows:
        target = labels.get(m.group(1)) if op == "BRA" and (m := re.search(r"(\.L_x_\d+)", args)) else None
        if target is not None and target < addr:
            body = [r for r in rows if target <= r[0] <= addr]
            if any(r[1] in TENSOR_OPS for r in body):
                return body, files.most_common(1)[0][0] if files else None
    return [], None


def default_split_launch(scheme: str, qpk: int, layout: str, plan: dict | None = None):
    """The default split launch of ``scheme`` planned as on an H200 (:func:`sass_defaults.load_decode`), with
    ``plan``'s keyword arguments of ``plan_decode`` over the defaults."""
    import numpy as np
    import torch
    from sass_defaults import load_decode

    from kvqref import schemes
    from kvqref.backends import triton_backend as tb
    from kvqref.kernels.aot import _hw_formats
    from kvqref.paged import PagedKVCache

    mod = load_decode("kvqref.kernels.decode")
    kivi = "kivi" in scheme
    ko = {"role": "key", "residual": 0} if kivi else {}
    vo = {"role": "value", "residual": 0} if kivi else {}
    page = 32 if kivi else 16
    rng = np.random.default_rng(0)
    cache = PagedKVCache(schemes.get(scheme, **ko), schemes.get(scheme, **vo), 24, page, 2, 128, batch=2)
    for b in range(2):
        cache.append(b, rng.standard_normal((140, 2, 128)), rng.standard_normal((140, 2, 128)))
    dc = tb.DeviceCache.from_cache(cache, "cpu").with_layout(layout)
    q = torch.zeros(2, 2 * qpk, 128, dtype=torch.bfloat16)
    launches, _, _ = mod.plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, page,
                                     residual=dc.residual, max_seq_len=140, hw_formats=_hw_formats("cuda:90"),
                                     **(plan or {}))
    return next(la for la in launches if "BLOCK_N" in la.constexprs)


def sm90_sass(launch) -> str:
    """``nvdisasm -g`` text (with Triton's line table) of ``launch`` compiled for sm_90 as ``kvqref.kernels.aot``
    compiles it."""
    from kvqref.backends._aot import make_target
    from kvqref.kernels.aot import compile_launch

    return cubin_tool_text(compile_launch(launch, make_target("cuda", 90)).asm["cubin"], "nvdisasm", "-g", "-c")


def cubin_tool_text(cubin: bytes, tool: str, *args: str) -> str:
    """The standard output of Triton's bundled CUDA ``tool`` (``nvdisasm``, ``cuobjdump``) with ``args`` on
    ``cubin`` (written to a temporary file)."""
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([str(path), *args, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def plan_option(text: str) -> tuple[str, int | bool]:
    """``key=value`` of ``--plan``: ``true`` / ``false`` as booleans, anything else as an integer."""
    key, _, value = text.partition("=")
    if not key or not value:
        raise argparse.ArgumentTypeError(f"--plan wants key=value, got {text!r}")
    low = value.lower()
    return key, (low == "true") if low in ("true", "false") else int(value)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", default="fp4_e2m1")
    ap.add_argument("--qpk", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--layout", default="HND", choices=("HND", "NHD"))
    ap.add_argument("--top", type=int, default=40, help="lines to print, the most instructions first")
    ap.add_argument("--plan", type=plan_option, action="append", default=[],
                    help="a plan_decode keyword over the defaults, key=int or key=true/false (repeatable)")
    ap.add_argument("--spread", type=int, default=0,
                    help="also print, per this many consecutive parts of the loop, its tensor-core, shared-memory / "
                         "barrier and global-load instructions")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    from kvqref.kernels import decode

    launch = default_split_launch(args.scheme, args.qpk, args.layout, dict(args.plan))
    body, named = loop_body(sm90_sass(launch))
    per = lines_of(body)
    # (Triton's cache may hold this kernel compiled from an identical copy of decode.py elsewhere: its lines then)
    path = Path(named) if named and Path(named).exists() else Path(decode.__file__)
    sources: dict[str | None, list[str]] = {}

    def text_of(where: Where) -> str:
        """The line's file (its name, where not the kernel's) and text."""
        file, line = where
        here = path if file == named else Path(file) if file else None
        if file not in sources:
            sources[file] = here.read_text().splitlines() if here and here.exists() else []
        src = sources[file]
        label = "" if file == named else f"{Path(file).name if file else '?'}:"
        return f"{label}L{line}: " + (src[line - 1].strip()[:80] if line and line <= len(src) else "?")

    whole = collections.Counter(op for _a, op, _w, _x in body)
    print(f"{args.scheme}, {args.qpk} q heads per KV head, {args.layout}: {launch.options}; loop {len(body)} "
          f"instructions (local loads / stores {whole['LDL']} / {whole['STL']}, barriers {whole['BAR']}); lines of "
          f"{path}")
    ranked = sorted(per.items(), key=lambda kv: -sum(kv[1].values()))[:args.top]
    for where, ops in ranked:
        print(f"{sum(ops.values()):5d}  {text_of(where)}  {dict(ops.most_common(6))}")
    if args.spread:
        parts = spread(body, args.spread)
        print(f"per {len(parts)} parts of the loop in program order ({', '.join(SPREAD_CLASSES)}):")
        print(" ".join("/".join(str(p[c]) for c in SPREAD_CLASSES) for p in parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
