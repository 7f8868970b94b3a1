"""Capacity planner: byte accounting from the field layouts, scale buffers and KIVI residuals counted."""

from __future__ import annotations

import pytest

from kvqref import schemes
from kvqref.capacity import capacity_ratio, parse_memory, plan, tokens_that_fit

GIB = 2**30


@pytest.mark.parametrize("text,value", [("80GiB", 80 * GIB), ("80GB", 80 * 10**9), ("512 MiB", 512 * 2**20),
                                        ("1.5TB", 1.5e12), ("4096", 4096), (1000, 1000), ("2kib", 2048)])
def test_parse_memory(text, value):
    assert parse_memory(text) == value


@pytest.mark.parametrize("bad", ["80 GiBs", "", "-1GB", "eighty"])
def test_parse_memory_errors(bad):
    with pytest.raises(ValueError, match="cannot parse"):
        parse_memory(bad)


def test_bf16_by_hand():
    # 32 layers x 8 heads x 128 dims x 2 bytes x (K + V) = 131072 bytes per token
    assert tokens_that_fit("80GiB", 32, 8, 128, "bf16") == 80 * GIB // 131072
    assert tokens_that_fit(131072 * 16 - 1, 32, 8, 128, "bf16") == 0  # whole pages only


def test_fp4_ratios_include_the_scale_bytes():
    bf16 = tokens_that_fit("80GiB", 32, 8, 128, "bf16")
    fp8 = tokens_that_fit("80GiB", 32, 8, 128, "fp8_e4m3")
    fp4 = tokens_that_fit("80GiB", 32, 8, 128, "fp4_e2m1")
    assert fp4 / bf16 == pytest.approx(16 / 4.5, rel=1e-4) and fp4 / fp8 == pytest.approx(8 / 4.5, rel=1e-4)
    assert fp4 / bf16 < 3.6  # a planner that forgot the scale bytes would say 4.0
    assert tokens_that_fit("80GiB", 32, 8, 128, "nvfp4") == fp4  # + one float32 global scale per layer
    assert tokens_that_fit("80GiB", 32, 8, 128, "mxfp4") > fp4
    assert capacity_ratio("fp4_e2m1") == pytest.approx(3.5556, abs=1e-4)
    assert capacity_ratio("fp4_e2m1", "fp8_e4m3") == pytest.approx(1.7778, abs=1e-4)


def test_fp8_scale_granularity_costs():
    tensor = plan("1GiB", 4, 8, 128, "fp8_e4m3")
    token_head = plan("1GiB", 4, 8, 128, schemes.get("fp8_e4m3", granularity="token_head"))
    assert tensor["fixed_bytes"] == 4 * 2 * 4  # one float32 scale per layer for K and for V
    assert token_head["page_bytes"] == tensor["page_bytes"] * (128 + 4) // 128
    assert token_head["tokens"] < tensor["tokens"]


def test_kivi_residual_is_reserved_per_sequence():
    one = plan("8GiB", 32, 8, 128, "int4_kivi", num_seqs=1)
    many = plan("8GiB", 32, 8, 128, "int4_kivi", num_seqs=64)
    assert one["page_bytes"] // 32 == 2 * 32 * 8 * (128 // 2 + 2 * 128 // 32 * 2) // 1  # per layer, K + V
    assert many["fixed_bytes"] - one["fixed_bytes"] == 63 * 32 * 2 * 128 * 8 * 128 * 4
    assert many["tokens"] < one["tokens"]
    assert one["bits_per_element"] == 5


def test_errors():
    with pytest.raises(ValueError, match="page_size 16 is not a multiple"):
        plan("1GiB", 1, 1, 128, "int4_kivi", page_size=16)
    with pytest.raises(ValueError, match="must be > 0"):
        plan("1GiB", 0, 1, 128, "bf16")
    with pytest.raises(KeyError, match="known schemes"):
        plan("1GiB", 1, 1, 128, "fp6")
