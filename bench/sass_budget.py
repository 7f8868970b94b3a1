"""Each scheme's decode tile loop as an instruction budget (static, sm_90, on the CPU), against a run's times.

    python3 bench/sass_budget.py [--results bench/results/h100.json] [--schemes bf16,fp8_e4m3,...] [--clock-mhz 1980]

For every scheme, the default split launch at 4 query heads per KV head in head-major pages (planned and compiled
as ``bench/sass_lines.py`` does: ``default_split_launch``, Triton's ``nvdisasm -g``) gives the main tile loop's
instructions per thread per tile, by class of opcode (:data:`CLASSES`), and per cache element: a tile holds
``BLOCK_N`` tokens of K and of V, ``D`` elements each, read by ``num_warps * 32`` threads, so one element costs
``loop * threads / (2 * BLOCK_N * D)`` thread instructions. At the bench's shape (batch 32 x 8,192 tokens, 8 KV
heads) the loop runs ``batch * kv_heads * tokens / BLOCK_N`` times with ``num_warps`` warps each; an H100 issues at
most one warp instruction per scheduler per clock (132 multiprocessors x 4 schedulers x ``--clock-mhz``), which
gives the **issue floor**: the time the loop's instructions take at full issue rate, every other cost left out.
With ``--results`` (a ``bench/decode_bench.py`` json) the table sets that floor beside the run's measured time and
the bytes floor (the row's bytes at the run's ceiling): the measured time over the larger floor says how far a
scheme sits from what bounds it. The loop excludes each split's prologue and epilogue (a few percent at 8,192
tokens); the clock is the H100 SXM's maximum boost unless given.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sass_lines import TENSOR_OPS, default_split_launch, loop_body, sm90_sass  # noqa: E402

#: opcode classes (SASS opcodes without modifiers, as bench/sass_lines.py reads them)
CLASSES: dict[str, tuple[str, ...]] = {
    "tensor": TENSOR_OPS,
    "memory": ("LDG", "LDGSTS", "LDGDEPBAR", "LDS", "LDSM", "STS", "STSM", "LDL", "STL", "BAR", "DEPBAR", "SHFL"),
    "float32": ("FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "MUFU", "FCHK"),
    "16-bit float": ("HADD2", "HMUL2", "HFMA2", "HMNMX2", "F2FP", "F2F"),
    "bit logic": ("LOP3", "PRMT", "SHF", "SGXT", "BMSK", "POPC", "FLO"),
    "integer / address": ("IMAD", "IADD3", "LEA", "VIADD", "IABS", "IMNMX", "VIMNMX", "I2F", "F2I"),
    "control / predicate": ("ISETP", "SEL", "PLOP3", "BRA", "UISETP", "USEL", "UIADD3", "ULEA", "USHF", "NOP", "MOV",
                            "CS2R", "S2R", "S2UR", "R2UR", "UMOV", "WARPSYNC", "BSSY", "BSYNC", "ELECT"),
}

DEFAULT_SCHEMES = ("bf16", "fp8_e4m3", "fp4_e2m1", "mxfp4", "nvfp4", "int4_kivi", "int2_kivi")
#: the bench's shape of the table (decode_bench.py's batch-32 row)
SHAPE = {"batch": 32, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "tokens": 8192}


def classify(op: str) -> str:
    """The class of a SASS opcode without its modifiers (:data:`CLASSES`; "other" if none)."""
    return next((name for name, ops in CLASSES.items() if op in ops), "other")


def per_element_factor(block_n: int, num_warps: int) -> float:
    """What turns a count per thread per tile into thread instructions per cache element: a tile holds ``block_n``
    tokens of K and of V, ``head_dim`` elements each, read by ``num_warps * 32`` threads."""
    return num_warps * 32 / (2 * block_n * SHAPE["head_dim"])


def loop_budget(scheme: str) -> dict:
    """The default split launch's loop of ``scheme`` (4 q heads per KV head, head-major): its launch parameters,
    instructions per thread per tile in total and by class, and thread instructions per cache element."""
    launch = default_split_launch(scheme, 4, "HND")
    body, _ = loop_body(sm90_sass(launch))
    if not body:
        raise RuntimeError(f"{scheme}: no tile loop with tensor-core instructions found")
    by_class = collections.Counter(classify(op) for _a, op, _w, _x in body)
    block_n = int(launch.constexprs["BLOCK_N"])
    warps = int(launch.options.get("num_warps", 4))
    return {"scheme": scheme, "block_n": block_n, "num_warps": warps, "loop": len(body),
            "by_class": dict(by_class), "per_element": len(body) * per_element_factor(block_n, warps)}


def issue_floor_us(b: dict, clock_mhz: float, sms: int = 132) -> float:
    """Microseconds the loop's warp instructions take at the bench's shape at one per scheduler per clock."""
    tiles = SHAPE["batch"] * SHAPE["kv_heads"] * SHAPE["tokens"] / b["block_n"]
    return tiles * b["loop"] * b["num_warps"] / (sms * 4 * clock_mhz)


def measured_row(results: dict, scheme: str) -> dict | None:
    """The triton head-major batch-32 row of ``scheme`` in a decode_bench json (None if absent)."""
    for r in results["results"]:
        if (r.get("op") == "decode" and r.get("backend") == "triton" and r.get("scheme") == scheme
                and r.get("batch") == SHAPE["batch"] and r.get("tokens") == SHAPE["tokens"]
                and r.get("page_size") == 16 and r.get("layout", results.get("layout")) == "HND"
                and r.get("precision", "fast") == "fast" and r.get("q_heads") == SHAPE["q_heads"]):
            return r
    return None


def table(budgets: list[dict], clock_mhz: float, results: dict | None) -> str:
    """A markdown table of the budgets, with the run's floors and times where ``results`` is given."""
    names = list(CLASSES) + ["other"]
    head = ["scheme", "BLOCK_N / warps", "loop instr. / thread / tile", "per element"]
    head += [f"{n} / elem." for n in names] + ["issue floor (us)"]
    if results:
        head += ["bytes floor (us)", "measured (us)", "measured / larger floor"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in budgets:
        scale = per_element_factor(b["block_n"], b["num_warps"])
        issue = issue_floor_us(b, clock_mhz)
        cells = [b["scheme"], f"{b['block_n']} / {b['num_warps']}", f"{b['loop']:,}", f"{b['per_element']:.2f}"]
        cells += [f"{b['by_class'].get(n, 0) * scale:.2f}" for n in names] + [f"{issue:.1f}"]
        if results:
            r = measured_row(results, b["scheme"])
            if r is None:
                cells += ["", "", ""]
            else:
                floor = r["bytes"] / (r["ceiling_gbs"] * 1e3)
                cells += [f"{floor:.1f}", f"{r['time_us']:.1f}", f"{r['time_us'] / max(floor, issue):.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES))
    ap.add_argument("--results", help="a bench/decode_bench.py json whose times and ceiling to set beside")
    ap.add_argument("--clock-mhz", type=float, default=1980.0, help="the multiprocessors' clock (H100 SXM boost)")
    ap.add_argument("--json", help="also write the budgets here")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    if args.clock_mhz <= 0:
        ap.error("--clock-mhz must be positive")
    results = json.loads(Path(args.results).read_text()) if args.results else None
    budgets = [loop_budget(s) for s in args.schemes.split(",") if s]
    print(table(budgets, args.clock_mhz, results))
    if args.json:
        Path(args.json).write_text(json.dumps({"clock_mhz": args.clock_mhz, "shape": SHAPE, "budgets": budgets},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
