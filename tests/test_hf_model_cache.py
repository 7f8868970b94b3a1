"""The converted SmolLM2 kept on disk (kvqref.hf.model.smollm2_folder, save_converted, load_smollm2(cache=)):
checked on the tiny random Llama with a small word-level tokenizer standing in for the GGUF's, so that these
tests convert in a second; the real GGUF's conversion is checked by save_converted itself wherever it runs."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
torch = pytest.importorskip("torch")

from kvqref.hf import model as M  # noqa: E402

WORDS = ["the", "capital", "of", "France", "is", "Paris", ".", "hi", "user", "12345"]


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<|im_start|>", "<|im_end|>", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    return tok


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    """A stand-in GGUF file and loader: smollm2_path() is a small file, _load_gguf gives the tiny Llama (seed 3)
    and the word-level tokenizer, and counts its calls."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF stand-in " * 100)
    calls = []

    def load(dtype, attn_implementation):
        calls.append(dtype)
        return M.random_model("tiny", dtype=dtype, seed=3, attn_implementation=attn_implementation), tiny_tokenizer()

    monkeypatch.setattr(M, "smollm2_path", lambda: str(gguf))
    monkeypatch.setattr(M, "_load_gguf", load)
    monkeypatch.setenv("KVQREF_CACHE_DIR", str(tmp_path / "cache"))
    return gguf, calls


def test_save_converted_round_trip_keeps_every_bit(tmp_path):
    model, tok = M.random_model("tiny", seed=1), tiny_tokenizer()
    M.save_converted(model, tok, tmp_path / "m")
    back = M._from_pretrained(str(tmp_path / "m"), torch.float32, "sdpa").eval()
    ids = torch.tensor([[1, 4, 5, 6, 7, 2]])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
    assert back.lm_head.weight.data_ptr() != back.model.embed_tokens.weight.data_ptr()  # tiny: untied, both kept


def test_save_converted_fails_on_a_changed_weight(tmp_path, monkeypatch):
    """Planted: the file written holds one weight with one element changed by one ulp."""
    import safetensors.torch as st

    real = st.save_model

    def save_perturbed(model, path, metadata=None):
        w = model.model.layers[1].mlp.up_proj.weight
        keep = w.data.clone()
        w.data[3, 5] = torch.nextafter(w.data[3, 5], torch.tensor(float("inf")))
        try:
            real(model, path, metadata=metadata)
        finally:
            w.data.copy_(keep)

    monkeypatch.setattr(st, "save_model", save_perturbed)
    with pytest.raises(RuntimeError, match="layers.1.mlp.up_proj.weight"):
        M.save_converted(M.random_model("tiny", seed=1), tiny_tokenizer(), tmp_path / "m")


def test_save_converted_fails_on_a_changed_tokenizer(tmp_path, monkeypatch):
    """Planted: the saved tokenizer's vocabulary swaps two words' ids."""
    tok = tiny_tokenizer()
    real = type(tok).save_pretrained

    def save_swapped(self, folder, *a, **kw):
        out = real(self, folder, *a, **kw)
        path = Path(folder) / "tokenizer.json"
        d = json.loads(path.read_text())
        vocab = d["model"]["vocab"]
        vocab["Paris"], vocab["France"] = vocab["France"], vocab["Paris"]
        path.write_text(json.dumps(d))
        return out

    monkeypatch.setattr(type(tok), "save_pretrained", save_swapped)
    with pytest.raises(RuntimeError, match="tokenizer"):
        M.save_converted(M.random_model("tiny", seed=1), tok, tmp_path / "m")


def test_folder_is_made_once_and_named_by_content_and_version(tiny_gguf, tmp_path):
    import transformers

    gguf, calls = tiny_gguf
    first = M.smollm2_folder()
    assert calls == [torch.float32]
    assert first.name == f"smollm2-{M._sha256(str(gguf))[:16]}-transformers-{transformers.__version__}"
    assert M.smollm2_folder() == first and len(calls) == 1  # kept: no second conversion
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name, first.name + ".lock"]  # no part left
    gguf.write_bytes(b"another GGUF")  # new content: a new folder
    assert M.smollm2_folder() != first and len(calls) == 2


def test_load_smollm2_reads_the_folder_in_the_asked_dtype(tiny_gguf):
    _, calls = tiny_gguf
    model, tok = M.load_smollm2(torch.bfloat16, attn_implementation="eager")
    assert calls == [torch.float32]  # converted in float32 once, loaded as asked
    assert model.dtype == torch.bfloat16 and not model.training
    assert model.config._attn_implementation == "eager"
    ref = M.random_model("tiny", dtype=torch.bfloat16, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True))
    assert tok("the capital of France is Paris")["input_ids"] == tiny_tokenizer()("the capital of France is Paris")[
        "input_ids"]
    M.load_smollm2()
    assert len(calls) == 1


def test_cache_off_and_cache_false_read_the_gguf(tiny_gguf, tmp_path, monkeypatch):
    _, calls = tiny_gguf
    M.load_smollm2(cache=False)
    monkeypatch.setenv("KVQREF_CACHE_DIR", "off")
    assert M.cache_root() is None
    M.load_smollm2()
    with pytest.raises(ValueError, match="KVQREF_CACHE_DIR is off"):
        M.smollm2_folder()
    assert calls == [torch.float32, torch.float32] and not (tmp_path / "cache").exists()


def test_unwritable_cache_warns_and_reads_the_gguf(tiny_gguf, tmp_path, monkeypatch):
    _, calls = tiny_gguf
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KVQREF_CACHE_DIR", str(blocker / "kvqref"))
    with pytest.warns(UserWarning, match="cannot keep the converted SmolLM2"):
        model, _ = M.load_smollm2()
    assert len(calls) == 1 and model is not None


def test_a_failed_conversion_leaves_nothing(tiny_gguf, tmp_path, monkeypatch):
    def broken(model, tok, folder):
        (Path(folder) / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("planted")

    monkeypatch.setattr(M, "save_converted", broken)
    with pytest.raises(RuntimeError, match="planted"):
        M.smollm2_folder()
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_parallel_callers_convert_once(tiny_gguf, monkeypatch):
    _, calls = tiny_gguf
    load = M._load_gguf

    def slow(dtype, attn_implementation):
        time.sleep(0.5)
        return load(dtype, attn_implementation)

    monkeypatch.setattr(M, "_load_gguf", slow)
    out = []
    threads = [threading.Thread(target=lambda: out.append(M.smollm2_folder())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(out)) == 1 and len(out) == 3
