"""The command line: report (quick), claims, check, capacity, and errors a person can act on (exit status 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvqref import backends
from kvqref.cli import main

torch = pytest.importorskip("torch")
GPU = torch.cuda.is_available()


def test_report_quick_writes_every_output(tmp_path, capsys):
    out = tmp_path / "rep"
    # the LLM section has its own tests (tests/test_eval_tiny.py, tests/test_eval_llm.py)
    assert main(["report", "--quick", "--out", str(out), "--no-llm"]) == 0
    printed = capsys.readouterr().out
    for title in ("1. Formats and schemes", "2. Accuracy", "3. Conformance", "4. Speed",
                  "5. Decoder LLM (SmolLM2-135M)", "Claims checked"):
        assert f"== {title} ==" in printed
    assert "skipped (--no-llm)" in printed
    assert "the claims hold" in printed and "3.5556x" in printed and "1.7778x" in printed
    for name in ("report.md", "report.json", "claims.csv", "claims.json", "claims.tex", "capacity.csv",
                 "formats.tex", "accuracy_synthetic.csv", "kivi_keys.tex", "conformance.csv"):
        assert (out / name).exists(), name
    tex = (out / "claims.tex").read_text()
    assert "\\toprule" in tex and "\\midrule" in tex and "\\bottomrule" in tex
    rep = json.loads((out / "report.json").read_text())
    kivi = [r for r in rep["accuracy"]["kivi"] if r["data"] == "synthetic"]
    assert {r["bits"] for r in kivi} == {4, 2} and all(r["per-channel better"] for r in kivi)
    assert all(v["failed"] == 0 for v in rep["conformance_summary"].values())
    assert "numpy" in rep["conformance_summary"] and "torch" in rep["conformance_summary"]
    assert set(rep["section_seconds"]) >= {"1. Formats and schemes", "Claims checked"}
    md = (out / "report.md").read_text()
    if rep["plots"]:
        assert all((out / p).exists() for p in rep["plots"])
    else:
        assert "install matplotlib for plots" in md
    if not GPU:
        assert "no GPU: speed section skipped" in md


def test_claims_command(tmp_path):
    assert main(["claims", "--quick", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "claims.md").read_text()
    assert "kvqref claims --out" in text and "3.56x" in text and "E4M3 is more accurate than E5M2" in text
    assert (tmp_path / "claims.tex").read_text().count("\\toprule") == 1


@pytest.mark.parametrize("name", ["numpy", "torch", "triton"])
def test_check_backend_passes(name, capsys):
    if backends.available()[name]:
        pytest.skip(backends.available()[name])
    assert main(["check", "--backend", name]) == 0
    printed = capsys.readouterr().out
    assert f"{name}: " in printed and " passed, 0 failed" in printed and "FAIL" not in printed


def test_check_unknown_and_unavailable_backend(capsys, monkeypatch):
    assert main(["check", "--backend", "cuda-magic"]) == 2
    err = capsys.readouterr().err
    assert "unknown backend 'cuda-magic'" in err and "numpy, torch, triton" in err
    if not GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert main(["check", "--backend", "triton"]) == 2
        err = capsys.readouterr().err
        assert "no GPU" in err and "TRITON_INTERPRET=1" in err


def test_capacity(capsys):
    assert main(["capacity", "--memory", "80GiB", "--layers", "32", "--kv-heads", "8", "--head-dim", "128"]) == 0
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("| fp4_e2m1 "))
    assert "3.556" in row and "1.778" in row
    assert "| bf16 | 16 |" in printed


def test_capacity_errors_list_what_is_known(capsys):
    assert main(["capacity", "--schemes", "fp8_e4m3,fp3_magic"]) == 2
    err = capsys.readouterr().err
    assert "unknown KV cache scheme 'fp3_magic'" in err and "int4_kivi" in err and "nvfp4" in err
    assert main(["capacity", "--memory", "80 GiBs"]) == 2
    assert "cannot parse memory size" in capsys.readouterr().err
    assert main(["capacity", "--layers", "0"]) == 2


def test_report_errors(capsys, tmp_path):
    assert main(["report", "--quick", "--out", str(tmp_path), "--backend", "nope"]) == 2
    assert "known backends: numpy, torch, triton" in capsys.readouterr().err
    if not GPU:
        assert main(["report", "--quick", "--out", str(tmp_path), "--speed"]) == 2
        assert "--speed needs a GPU" in capsys.readouterr().err


def test_console_errors_have_no_traceback():
    env = dict(os.environ, TRITON_INTERPRET="0")
    p = subprocess.run([sys.executable, "-m", "kvqref.cli", "check", "--backend", "nope"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "known backends" in p.stderr
