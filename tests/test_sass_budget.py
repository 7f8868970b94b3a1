"""bench/sass_budget.py: opcode classes, the issue floor and the table against a run's rows (no compilation)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import sass_budget as sb  # noqa: E402


def _budget(scheme="fp4_e2m1", block_n=32, warps=1, ops=None):
    ops = ops or {"HMMA": 64, "LOP3": 128, "FMUL": 64, "LDS": 16}
    by_class: dict[str, int] = {}
    for op, n in ops.items():
        by_class[sb.classify(op)] = by_class.get(sb.classify(op), 0) + n
    loop = sum(ops.values())
    return {"scheme": scheme, "block_n": block_n, "num_warps": warps, "loop": loop, "by_class": by_class,
            "per_element": loop * warps * 32 / (2 * block_n * 128)}


def test_opcodes_fall_in_their_classes():
    assert sb.classify("HMMA") == "tensor"
    assert sb.classify("LDGSTS") == "memory" and sb.classify("SHFL") == "memory"
    assert sb.classify("FMNMX") == "float32" and sb.classify("HADD2") == "16-bit float"
    assert sb.classify("PRMT") == "bit logic" and sb.classify("IMAD") == "integer / address"
    assert sb.classify("ISETP") == "control / predicate"
    assert sb.classify("WHATEVER") == "other"
    assert sb.classify("HMMAX") == "other"  # whole opcodes only, not prefixes


def test_issue_floor_counts_every_tile_of_the_bench_shape():
    b = _budget(block_n=32, warps=1)  # 272 instructions per thread per tile
    tiles = 32 * 8 * 8192 / 32
    assert sb.issue_floor_us(b, 1000.0, sms=1) == pytest.approx(tiles * 272 / 4 / 1000.0)
    assert sb.issue_floor_us(_budget(block_n=64, warps=2), 1980.0) == pytest.approx(sb.issue_floor_us(b, 1980.0))


def test_table_sets_the_floors_beside_the_measured_row():
    b = _budget()
    per_class = {c: n * 32 / (2 * 32 * 128) for c, n in b["by_class"].items()}
    row = {"op": "decode", "backend": "triton", "scheme": "fp4_e2m1", "batch": 32, "q_heads": 32, "kv_heads": 8,
           "head_dim": 128, "tokens": 8192, "page_size": 16, "layout": "HND", "precision": "fast",
           "time_us": 150.0, "bytes": 3.0e8, "ceiling_gbs": 3000.0}
    other = {**row, "layout": "NHD", "time_us": 999.0}
    md = sb.table([b], 1980.0, {"results": [other, row, {"op": "write", "backend": "triton"}]})
    line = next(x for x in md.splitlines() if x.startswith("| fp4_e2m1"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "32 / 1" and cells[2] == "272" and cells[3] == f"{b['per_element']:.2f}"
    assert cells[4] == f"{per_class['tensor']:.2f}" and cells[8] == f"{per_class['bit logic']:.2f}"
    issue = sb.issue_floor_us(b, 1980.0)
    assert cells[-4] == f"{issue:.1f}"
    assert cells[-3] == "100.0" and cells[-2] == "150.0"  # 3e8 bytes at 3,000 GB/s; the HND row, not the NHD one
    assert cells[-1] == f"{150.0 / max(100.0, issue):.2f}"
    assert "measured" not in sb.table([b], 1980.0, None)


def test_loop_lines_keep_their_files():
    """bench/sass_lines.py: a line of Triton's standard.py is not counted as the kernel file's line of that number."""
    import sass_lines

    text = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        ".L_x_0:",
        '        //## File "/k/decode.py", line 263',
        "        /*0010*/                   HMMA.16816.F32 R4, R8, R12, R4 ;",
        '        //## File "/t/standard.py", line 263',
        "        /*0020*/                   FADD R2, R2, R3 ;",
        "        /*0030*/                   FADD R2, R2, R5 ;",
        '        //## File "/k/decode.py", line 100',
        "        /*0040*/              @P0   BRA `(.L_x_0) ;",
    ])
    total, per, named = sass_lines.loop_by_line(text)
    assert total == 4 and named == "/k/decode.py"
    assert per[("/k/decode.py", 263)] == {"HMMA": 1}
    assert per[("/t/standard.py", 263)] == {"FADD": 2}
    assert per[("/k/decode.py", 100)] == {"BRA": 1}
