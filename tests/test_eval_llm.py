"""The LLM evaluation against the real SmolLM2-135M-Instruct GGUF (skipped when the llm extra or the model is not
installed; CI installs both). About 45 s on 2 CPU cores, most of it loading the model once."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from kvqref.eval import builtin_caches, llm  # noqa: E402
from kvqref.eval.metrics import first_divergence  # noqa: E402

pytestmark = pytest.mark.skipif(llm.unavailable_reason() is not None, reason=str(llm.unavailable_reason()))


@pytest.fixture(scope="module")
def smollm2():
    return llm.load_model()


@torch.no_grad()
def test_teacher_forcing_reproduces_generation_through_the_quantized_cache(smollm2):
    """The premise of gen_agree: generate() with a quantized cache picks exactly the tokens that one
    teacher-forced forward through a fresh cache of the same scheme predicts."""
    from kvqref import hf

    model, tok = smollm2
    config = llm.configs_named(["int4_kivi R=0"])[0]
    ids = torch.tensor([tok("The capital of France is", add_special_tokens=False)["input_ids"]])
    cache = hf.QuantizedKVCache(model.config, config.scheme, k_options=config.k_options,
                                v_options=config.v_options, prefill="as_decoded", precision="exact")
    with llm.attention(model, "kvqref"):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **hf.cache_kwargs(model, cache),
                             max_new_tokens=8, min_new_tokens=8, do_sample=False, top_p=None, top_k=None,
                             temperature=None)
    new = out[0, ids.shape[1]:]
    logits, _ = llm.quantized_logits(model, out[:, :-1], config, keep=new.numel())
    assert first_divergence(new, logits[0]) == new.numel()


def test_quick_evaluation_orders_the_schemes(smollm2):
    model, tok = smollm2
    settings = llm.Settings(tokens=96, prompts=1, gen_tokens=8, passkey_tokens=256, depths=(0.5,))
    res = llm.evaluate(model, tok, llm.configs_named(["bf16", "int2_kivi R=0"]), settings)
    ref = res["reference"]
    assert ref["passkey"] == 1.0 and ref["teacher_forced_gen_full"] == 1.0
    assert 5 < ref["ppl"] < 60  # the unquantized model on Python's docs (measured 18 at 128 tokens)
    rows = {r["label"]: r for r in res["rows"]}
    bf16, int2 = rows["bf16"], rows["int2_kivi R=0"]
    assert bf16["kl"] < 1e-3 and bf16["top1"] > 0.95 and bf16["gen_full"] == 1.0 and bf16["passkey"] == 1.0
    assert int2["kl"] > 20 * bf16["kl"] and int2["top1"] < bf16["top1"]
    assert bf16["cache_bits"] == pytest.approx(16.0, rel=1e-3)


def test_frozen_fp8_scale_matches_transformers(smollm2):
    model, tok = smollm2
    res = builtin_caches.compare(model, tok, builtin_caches.QUICK)
    by = {(r["cache"], r["first prompt"]): r for r in res["rows"]}
    per_token = by[("kvqref fp8_e4m3 (granularity=token_head)", 1)]
    for name in ("transformers fp8", "kvqref fp8_e4m3"):
        # a one-token first prompt freezes the per-tensor scale: far worse than per-(token, head) scales
        assert by[(name, 1)]["kl"] > 10 * per_token["kl"]
        assert by[(name, 16)]["kl"] < by[(name, 1)]["kl"] / 10
    # the same rule in transformers and kvqref gives the same damage (within 2x)
    a, b = by[("transformers fp8", 1)]["kl"], by[("kvqref fp8_e4m3", 1)]["kl"]
    assert 0.5 < a / b < 2
    assert res["saturation"]["1"]["V saturated"] > 0.01 > res["saturation"]["16"]["V saturated"]


def test_with_rotation_pairs_each_configuration_with_its_rotated_twin():
    base = llm.configs_named(["fp8_e4m3", "int4_kivi R=0"])
    assert llm.with_rotation(base, "none") == base
    both = llm.with_rotation(base, "both")
    assert [c.label for c in both] == ["fp8_e4m3", "fp8_e4m3 +H", "int4_kivi R=0", "int4_kivi R=0 +H"]
    rot = both[3]
    assert rot.k_options == {"role": "key", "residual": 0, "rotation": "hadamard",
                             "rotation_seed": llm.ROTATION_K_SEED}
    assert rot.v_options["rotation_seed"] == llm.ROTATION_V_SEED and llm.is_rotated(rot)
    assert rot.bits_per_element(64, 3) == base[1].bits_per_element(64, 3)
    assert [c.label for c in llm.with_rotation(base, "hadamard")] == ["fp8_e4m3 +H", "int4_kivi R=0 +H"]
    with pytest.raises(ValueError, match="rotation must be one of"):
        llm.with_rotation(base, "yes")
    with pytest.raises(ValueError, match="already rotated"):
        llm.rotated(rot)
    assert {c.label for c in llm.configs_named(llm.ROTATION_CONFIGS)} == set(llm.ROTATION_CONFIGS)


def test_rotated_evaluation_rows_table_and_files(smollm2, tmp_path):
    """fp4_e2m1 with and without rotation on SmolLM2 (text only): both rows, their pair in the with/without
    table, the files; rotation changes the logits (a rotated cache that stored the unrotated bytes would not)."""
    from kvqref.report import llm_rotation

    model, tok = smollm2
    configs = llm.with_rotation(llm.configs_named(["fp4_e2m1"]), "both")
    res = llm.evaluate(model, tok, configs, llm.Settings(tokens=96, prompts=0, depths=()))
    plain, rot = res["rows"]
    assert (plain["rotated"], rot["rotated"]) == (False, True) and rot["base"] == plain["label"] == "fp4_e2m1"
    assert rot["cache_bits"] == plain["cache_bits"] and rot["bits_per_element"] == plain["bits_per_element"]
    assert rot["kl"] != plain["kl"] and 0 < rot["kl"] < 1 and 0 < plain["kl"] < 1
    (pair,) = llm_rotation.pair_rows(res["rows"])
    assert pair["kl"] == plain["kl"] and pair["kl +H"] == rot["kl"]
    assert pair["kl +H/plain"] == pytest.approx(rot["kl"] / plain["kl"])
    assert "gen_agree" not in pair  # not run
    md, pngs = llm_rotation.write(tmp_path, res)
    assert "| fp4_e2m1 |" in md and "kl +H/plain" in md
    for ext in ("csv", "json", "tex"):
        assert (tmp_path / f"llm_rotation.{ext}").stat().st_size > 0
    assert all((tmp_path / p).exists() for p in pngs)
