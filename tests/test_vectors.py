"""The committed golden vectors equal what the codecs produce now, and what an independent peer says."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

from kvqref import vectors
from kvqref.cli import main

GOLDEN = Path(__file__).parent / "golden" / "golden_vectors.json"


def test_committed_vectors_are_current():
    assert GOLDEN.read_text() == vectors.dumps(vectors.generate()), (
        "tests/golden/golden_vectors.json is stale: regenerate with `kvqref vectors --out tests/golden`")


def test_vectors_cover_ties_edges_and_agree_with_ml_dtypes_where_it_is_single_rounding():
    doc = json.loads(GOLDEN.read_text())
    assert set(doc["formats"]) >= {"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                   "float4_e2m1fn", "float8_e8m0fnu"}
    for name, entry in doc["formats"].items():
        if name in ("float8_e8m0fnu", "float4_e2m1fn"):
            continue
        case = next(c for c in entry["cases"] if c["input_dtype"] == "float32" and c["saturate"] is False)
        x = np.array([int(h, 16) for h in case["inputs"]], np.uint32).view(np.float32)
        codes = np.array([int(h, 16) for h in case["codes"].split()], np.uint8)
        assert len(codes) == len(x) > 500
        assert np.isinf(x).any() and np.isnan(x).any() and (x == 0).any()
        np.testing.assert_array_equal(codes, x.astype(getattr(ml_dtypes, name)).view(np.uint8), err_msg=name)


def test_cli_exports_vectors(tmp_path, capsys):
    assert main(["vectors", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "golden_vectors.json").read_text() == GOLDEN.read_text()


def test_cli_formats_table(capsys):
    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    for fact in ("float8_e4m3fn", "448", "0x7E (0.1111.110)", "float8_e4m3fnuz", "240", "0x7F (0.1111.111)",
                 "57344", "float4_e2m1fn", "float8_e8m0fnu"):
        assert fact in out
