"""kvqref.testing: the docs/testing.md example runs as a test; the assertions report planted bugs usefully."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings

from kvqref import schemes
from kvqref.testing import assert_attention_close, assert_codes_equal, kv_tensors, page_tables, ragged_lengths

torch = pytest.importorskip("torch")

DOC = Path(__file__).resolve().parents[1] / "docs" / "testing.md"


def _doc_example() -> dict:
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    ns: dict = {}
    exec(compile(code, str(DOC), "exec"), ns)
    return ns


def test_docs_example_runs():
    ns = _doc_example()
    ns["test_toy_fp8_matches_the_oracle"]()
    ns["test_attention_over_the_toy_cache"]()


def test_planted_bug_is_reported():
    """The toy quantizer with the E4M3FNUZ maximum (240) in place of E4M3FN's (448): the message names the
    index, the expected and actual codes in hex and the input, exactly as docs/testing.md shows."""
    x = np.array([[[1.0, -2.0, 300.0, 0.5]]], np.float32)
    bug = torch.from_numpy(x).clamp(-240.0, 240.0).to(torch.float8_e4m3fn).view(torch.uint8)
    want = schemes.get("fp8_e4m3", scale=1.0).quantize(x).fields["codes"]
    with pytest.raises(AssertionError) as e:
        assert_codes_equal(bug, want, inputs=x)
    msg = str(e.value)
    assert "1 of 4 elements differ" in msg
    assert "at index [0, 0, 2]: expected 0x79, actual 0x77; input 300.0 (float32, bits 0x43960000)" in msg
    assert msg in DOC.read_text()


def test_codes_equal_on_packed_codes_shows_the_input_row_and_float_values():
    x = np.random.default_rng(1).standard_normal((3, 2, 32)).astype(np.float32)
    q = schemes.get("fp4_e2m1").quantize(x)
    bad = q.fields["codes"].copy()
    bad[1, 0, 5] ^= 0x10
    with pytest.raises(AssertionError, match=r"at index \[1, 0, 5\]: expected 0x[0-9A-F]{2}, actual 0x[0-9A-F]{2}; "
                                             r"inputs\[1, 0\]"):
        assert_codes_equal(bad, q.fields["codes"], inputs=x)
    assert_codes_equal(q.fields["codes"], q.fields["codes"].copy())
    with pytest.raises(AssertionError, match=r"values 1\.0 vs 1\.5"):
        assert_codes_equal(np.array([1.5], np.float32), np.array([1.0], np.float32))
    with pytest.raises(AssertionError, match="shape mismatch"):
        assert_codes_equal(np.zeros(3, np.uint8), np.zeros(4, np.uint8))
    nan = np.array([np.nan], np.float32)
    assert_codes_equal(nan, nan.copy())  # NaN codes compare by their bits


def test_attention_close_reports_the_worst_element():
    ref = np.zeros((1, 2, 4))
    out = ref.copy()
    out[0, 1, 3] = 1e-3
    assert_attention_close(out, None, ref, None, 2e-3, 0.0)
    with pytest.raises(AssertionError, match=r"out: 1 of 8 beyond tolerance; worst at index \[0, 1, 3\]"):
        assert_attention_close(out, np.zeros((1, 2)), ref, np.zeros((1, 2)), 1e-4, 1e-6)
    with pytest.raises(AssertionError, match="lse: non-finite"):
        assert_attention_close(ref, np.array([[np.nan, 0.0]]), ref, np.zeros((1, 2)), 1.0, 1.0)


@settings(max_examples=15, deadline=None)
@given(x=kv_tensors(tokens=(1, 40), head_dim=(64,), specials=True), pt=page_tables(), lens=ragged_lengths(3, 50))
def test_strategies_draw_valid_inputs(x, pt, lens):
    assert x.dtype == np.float32 and x.ndim == 3 and x.shape[2] == 64 and np.isfinite(x).all()
    assert lens.shape == (3,) and lens.min() >= 0 and lens.max() <= 50
    P, table = pt["page_size"], pt["block_table"]
    used = table[table >= 0]
    assert len(set(used.tolist())) == used.size and used.max(initial=-1) < pt["num_pages"]
    for b, n in enumerate(pt["seq_lens"]):
        assert (table[b] >= 0).sum() == -(-int(n) // P)
