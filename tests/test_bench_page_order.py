"""bench/decode_bench.py's page order and bench/ab_decode.py's ``po`` variant key (ANALYSIS 307)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import ab_decode  # noqa: E402
import decode_bench  # noqa: E402


def test_page_order_is_a_variant_key_of_the_cache():
    name, mod, kw = ab_decode.parse_variant("cur hnd=1 po=sequential")
    assert (name, mod, kw) == ("cur hnd=1 po=sequential", "cur", {"layout": "HND", "page_order": "sequential"})


@pytest.mark.parametrize("order", ["sorted", "Sequential", ""])
def test_an_unknown_page_order_is_refused_before_any_cache_is_made(order):
    """No silent fallback to the random order (the check comes before anything touches a GPU)."""
    with pytest.raises(ValueError, match="page_order must be 'random' or 'sequential'"):
        decode_bench.make_cache("bf16", (1, 1, 1, 128, 16), 16, page_order=order)
