"""kvqref.eval.metrics on hand-made logits, and the LLM evaluation's pieces that need no model (configurations,
settings, the passkey prompt)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.special import log_softmax, rel_entr

from kvqref.eval import llm, texts
from kvqref.eval.metrics import LogitStats, first_divergence


def test_logit_stats_hand_computed():
    # row 0: p = (1/2, 1/4, 1/4), q = (1/4, 1/2, 1/4), target 1: KL = 1/2 ln 2 - 1/4 ln 2, argmaxes differ,
    # -log q[1] = ln 2; row 1: identical distributions, target 0: KL 0, argmaxes agree, -log q[0] = ln 4;
    # q is shifted by 7 (a shift changes nothing)
    ref = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25]], dtype=torch.float64))
    q = torch.log(torch.tensor([[0.25, 0.5, 0.25], [0.25, 0.5, 0.25]], dtype=torch.float64)) + 7.0
    s = LogitStats()
    s.add(ref, q, torch.tensor([1, 0]))
    r = s.result()
    assert r["tokens"] == 2
    assert r["kl"] == pytest.approx(0.25 * math.log(2) / 2, rel=1e-12)
    assert r["top1"] == 0.5
    assert r["ppl"] == pytest.approx(math.exp((math.log(2) + math.log(4)) / 2), rel=1e-12)
    assert r["ref_ppl"] == pytest.approx(math.exp((math.log(4) + math.log(4)) / 2), rel=1e-12)


def test_identical_logits_give_zero_kl_and_full_agreement():
    x = torch.randn(5, 11, generator=torch.Generator().manual_seed(3))
    s = LogitStats()
    s.add(x, x.clone(), torch.arange(5))
    r = s.result()
    assert r["kl"] == 0.0 and r["top1"] == 1.0 and r["ppl"] == r["ref_ppl"]


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 9), st.integers(2, 40), st.integers(0, 2**31 - 1), st.integers(1, 7))
def test_logit_stats_match_scipy(rows, vocab, seed, chunk):
    """KL and NLL against scipy's rel_entr / log_softmax in float64 (an independent peer), any chunking."""
    rng = np.random.default_rng(seed)
    r, q = rng.normal(0, 3, (2, rows, vocab))
    y = rng.integers(0, vocab, rows)
    s = LogitStats(chunk=chunk)
    s.add(torch.from_numpy(r).float(), torch.from_numpy(q).float(), torch.from_numpy(y))
    rf, qf = r.astype(np.float32).astype(np.float64), q.astype(np.float32).astype(np.float64)
    lp, lq = log_softmax(rf, -1), log_softmax(qf, -1)
    kl = rel_entr(np.exp(lp), np.exp(lq)).sum(-1).mean()
    nll = -lq[np.arange(rows), y].mean()
    res = s.result()
    assert res["kl"] == pytest.approx(kl, rel=1e-9, abs=1e-12)
    assert res["ppl"] == pytest.approx(math.exp(nll), rel=1e-9)
    assert res["top1"] == pytest.approx(np.mean(rf.argmax(-1) == qf.argmax(-1)))


def test_logit_stats_accumulate_across_calls():
    g = torch.Generator().manual_seed(0)
    r, q = torch.randn(2, 6, 9, generator=g)
    y = torch.randint(0, 9, (6,), generator=g)
    whole, parts = LogitStats(), LogitStats()
    whole.add(r, q, y)
    parts.add(r[:2], q[:2], y[:2])
    parts.add(r[2:], q[2:], y[2:])
    assert whole.result() == pytest.approx(parts.result(), rel=1e-12)


def test_logit_stats_bad_input():
    s = LogitStats()
    with pytest.raises(ValueError, match="no positions"):
        s.result()
    with pytest.raises(ValueError, match="shapes differ"):
        s.add(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2))
    with pytest.raises(FloatingPointError, match="NaN"):
        s.add(torch.zeros(2, 3), torch.tensor([[0.0, float("nan"), 0.0], [0, 0, 0]]), torch.zeros(2))


def test_first_divergence():
    ref = torch.tensor([2, 0, 1])
    eye = torch.eye(3)
    assert first_divergence(ref, eye[[2, 0, 1]]) == 3
    assert first_divergence(ref, eye[[2, 1, 1]]) == 1
    assert first_divergence(ref, eye[[0, 0, 1]]) == 0
    assert first_divergence(torch.tensor([], dtype=torch.long), torch.zeros(0, 3)) == 0


def test_configs_cover_the_issue_and_resolve_by_label_or_scheme():
    labels = [c.label for c in llm.CONFIGS]
    assert len(set(labels)) == len(labels)
    for name in ("bf16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "mxfp4", "nvfp4", "int4_kivi", "int2_kivi"):
        assert any(c.scheme == name for c in llm.CONFIGS), name
    for g in ("head", "token_head"):
        for f in ("fp8_e4m3", "fp8_e5m2"):
            assert any(c.scheme == f and c.k_options.get("granularity") == g for c in llm.CONFIGS)
    assert {c.k_options.get("residual") for c in llm.CONFIGS if "kivi" in c.scheme} == {0, 128}
    assert [c.label for c in llm.configs_named(["int2_kivi"])] == ["int2_kivi R=128", "int2_kivi R=0"]
    assert llm.configs_named(["nvfp4", "nvfp4"]) == [llm.CONFIGS[labels.index("nvfp4")]]
    with pytest.raises(ValueError, match="unknown configuration 'fp3'.*known: bf16"):
        llm.configs_named(["fp3"])
    for group in (llm.QUICK_CONFIGS, llm.REPORT_CONFIGS):
        llm.configs_named(group)
    kivi = llm.configs_named(["int4_kivi R=0"])[0]
    assert kivi.options_text() == "K: role=key, residual=0; V: role=value, residual=0"
    assert llm.configs_named(["fp8_e4m3 head"])[0].options_text() == "granularity=head"
    # bits: scales counted (KIVI: 4 bits + two float16 per group of 32), SmolLM2's head_dim 64 and 3 KV heads
    assert kivi.bits_per_element(64, 3) == 5.0
    assert llm.configs_named(["fp8_e4m3 token_head"])[0].bits_per_element(64, 3) == 8.5


def test_settings_reject_bad_values():
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        llm.Settings(tokens=0)
    with pytest.raises(ValueError, match="prompts must be between"):
        llm.Settings(prompts=len(llm.PROMPTS) + 1)
    with pytest.raises(ValueError, match="depths must lie in"):
        llm.Settings(depths=(1.5,))


def test_passkey_prompt_reaches_the_length_and_places_the_needle():
    def encode(text: str) -> list[int]:  # one "token" per word
        return [hash(w) % 1000 for w in text.split()]

    for depth in (0.0, 0.5, 1.0):
        ids = llm.passkey_prompt(encode, 12345, depth, 300)
        assert 300 <= len(ids) < 300 + len(encode(llm.PASSKEY_FILLER)) + 1
    text_words = (llm.PASSKEY_INTRO + llm.PASSKEY_FILLER * 10).split()
    assert len(encode(" ".join(text_words))) == len(text_words)


def test_python_docs_text_is_long_and_stable():
    t = texts.python_docs()
    assert len(t) > 100_000 and t == texts.python_docs() and texts.sha256(t) == texts.sha256(t)
    assert "The Zen of Python" in texts.stdlib_docstrings()
