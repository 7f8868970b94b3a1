"""transformers integration: :class:`QuantizedKVCache` and the ``"kvqref"`` attention (docs/hf.md).

Importing this package registers the attention implementation ``"kvqref"`` with transformers'
``AttentionInterface`` (and its mask with ``AttentionMaskInterface``), so
``AutoModelForCausalLM.from_pretrained(..., attn_implementation="kvqref")`` decodes over the quantized
cache with the backend's decode kernel. transformers is imported only inside this package; it is the
``llm`` extra (``pip install "kvqref[llm]"``).
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("kvqref.hf needs transformers: pip install 'kvqref[llm]' (transformers, gguf, accelerate)") from e

from transformers import AttentionInterface

from kvqref.hf.attention import kvqref_attention, kvqref_mask
from kvqref.hf.cache import PREFILL_MODES, QuantizedKVCache, QuantizedKVLayer, TritonQuantizedKVLayer
from kvqref.hf.model import (
    SMOLLM2_INSTALL,
    cache_kwargs,
    load_smollm2,
    random_model,
    set_attention,
    smollm2_path,
    tiny_config,
)

ATTENTION_NAME = "kvqref"


def register() -> None:
    """Register the ``"kvqref"`` attention and mask with transformers (done on import; idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvqref_attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # transformers without mask interfaces: the model builds its default 4D mask
        return
    AttentionMaskInterface.register(ATTENTION_NAME, kvqref_mask)


register()

__all__ = ["ATTENTION_NAME", "PREFILL_MODES", "SMOLLM2_INSTALL", "QuantizedKVCache", "QuantizedKVLayer",
           "TritonQuantizedKVLayer", "cache_kwargs", "kvqref_attention", "load_smollm2", "random_model", "register",
           "set_attention", "smollm2_path", "tiny_config"]
