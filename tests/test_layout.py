"""kvqref.kernels.layout: lane bases read from TTGIR text (blocked and linear layouts) and the check that guards
the warp-shuffle butterflies (a wrong lane run must raise, not pass)."""

from __future__ import annotations

import pytest

from kvqref.kernels.layout import check_partner_layout, lane_bases, row_lanes, shuffle_lane_bases

#: the shape of the sm_90 TTGIR of a rotated FP8 write (triton 3.6): a blocked load layout, the butterflies'
#: rows in a linear one, one shuffle per stage h = 16, 32, 64
TTGIR = """#blocked = #ttg.blocked<{sizePerThread = [1, 1, 16], threadsPerWarp = [4, 1, 8], warpsPerCTA = [1, 4, 1], order = [2, 0, 1]}>
#linear = #ttg.linear<{register = [[0, 1], [0, 2], [0, 4], [0, 8], [4, 0]], lane = [[0, 16], [0, 32], [0, 64], [8, 0], [16, 0]], warp = [[1, 0], [2, 0]], block = []}>
    %b = tt.elementwise_inline_asm "shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;" {constraints = "=r,r,r", packed_element = 1 : i32, pure = true} %a, %c : tensor<32x128xi32, #linear>, tensor<32x128xi32, #linear> -> tensor<32x128xi32, #linear> loc(#loc1)
"""  # noqa: E501


def test_blocked_lane_bases_fill_the_fastest_dimension_first():
    body = "sizePerThread = [1, 1, 16], threadsPerWarp = [4, 1, 8], warpsPerCTA = [1, 4, 1], order = [2, 0, 1]"
    assert lane_bases(body, "blocked", (4, 8, 128)) == [(0, 0, 16), (0, 0, 32), (0, 0, 64), (1, 0, 0), (2, 0, 0)]
    # lanes past the tensor's extent are replicated: basis 0
    assert lane_bases(body, "blocked", (4, 8, 32)) == [(0, 0, 16), (0, 0, 0), (0, 0, 0), (1, 0, 0), (2, 0, 0)]


def test_shuffle_layout_is_read_and_checked():
    found = shuffle_lane_bases(TTGIR)
    assert found == [((32, 128), [(0, 16), (0, 32), (0, 64), (8, 0), (16, 0)])]
    assert row_lanes(found[0][1], 128) == (16, 8)
    assert row_lanes([(8, 0), (0, 16)], 128) == (128, 1)  # lane bit 0 moves rows: no lane run along the row
    assert check_partner_layout(TTGIR, 16, 8, 128) == 1
    for lane_h, lane_n in ((8, 16), (32, 4), (16, 16)):  # other lane runs: the masks would fetch other columns
        with pytest.raises(RuntimeError, match="warp-shuffle butterflies assume"):
            check_partner_layout(TTGIR, lane_h, lane_n, 128)
    with pytest.raises(RuntimeError, match="warp-shuffle butterflies assume"):
        check_partner_layout(TTGIR, 16, 8, 256)  # rows of another length
    assert check_partner_layout(TTGIR.replace("shfl.sync.bfly", "mov"), 8, 16, 128) == 0  # nothing to check
