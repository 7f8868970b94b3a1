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
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=8,
                             min_new_tokens=8, do_sample=False, top_p=None, top_k=None, temperature=None)
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
