"""bench/tables.py: the SDPA baseline of a run with repeated SDPA timings."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import tables  # noqa: E402


def _row(backend, time_us, batch=32, **extra):
    return {"op": "decode", "backend": backend, "scheme": "bf16", "batch": batch, "q_heads": 32, "kv_heads": 8,
            "head_dim": 128, "tokens": 8192, "page_size": 0 if backend.startswith("torch-sdpa") else 16,
            "time_us": time_us, "gbs": 1.0, "fraction_of_ceiling": 0.5, **extra}


def test_speed_ups_are_against_the_median_sdpa_time():
    rows = [_row("torch-sdpa-dense", 370.0), _row("triton", 200.0, precision="fast", layout="HND"),
            _row("torch-sdpa-dense", 363.0), _row("torch-sdpa-dense", 364.0),
            _row("torch-sdpa-dense", 400.0, batch=1), _row("torch-sdpa-dense", 390.0, batch=1),
            _row("triton", 195.0, batch=1, precision="fast", layout="HND")]
    assert tables.sdpa_baselines(rows) == {(32, 32, 8192): 364.0, (1, 32, 8192): 390.0}  # median; lower middle
    md = tables.markdown({"environment": {"torch": "t", "triton": "t"}, "ceiling_gbs": 3000.0, "results": rows})
    assert "| 32x32x8x128x8192 | bf16 | triton | fast | HND | 200.0 |" in md
    assert "1.82x |" in md and "2.00x |" in md  # 364 / 200 and 390 / 195
    assert "32x32x8192: 363.0 / 364.0 / 370.0" in md and "1x32x8192: 390.0 / 390.0 / 400.0" in md


def test_a_single_sdpa_time_is_the_baseline():
    rows = [_row("torch-sdpa-dense", 363.2), _row("triton", 181.6, precision="fast", layout="HND")]
    md = tables.markdown({"environment": {"torch": "t", "triton": "t"}, "ceiling_gbs": 3000.0, "results": rows})
    assert "2.00x |" in md and "min / median / max" not in md


def test_the_plotted_speed_ups_are_the_tables():
    """The plot's speed-up panel: fast rows of the run's layout at page size 16 against the same baseline as the
    table; exact rows, other layouts and page sizes and rows of other ops (a
    --rotation run's ratios, which name no backend) are left out, and SDPA gets no speed-up of its own."""
    rows = [_row("torch-sdpa-dense", 370.0), _row("torch-sdpa-dense", 364.0),
            _row("triton", 182.0, precision="fast", layout="HND"),
            _row("triton", 400.0, precision="exact", layout="HND"),
            _row("triton", 300.0, precision="fast", layout="NHD"),
            _row("triton", 250.0, precision="fast", layout="HND", page_size=1),
            {"op": "rotation_ratio", "of": "decode", "scheme": "fp8_e4m3", "ratio": 1.02}]  # --rotation's summary rows
    by, ratio = tables.plotted_rows({"layout": "HND", "results": rows})
    assert ratio == {"triton:bf16": {(32, 32, 8192): 2.0}}  # 364 / 182
    assert sorted(by) == ["torch-sdpa-dense:bf16", "triton:bf16"] and len(by["triton:bf16"]) == 1
