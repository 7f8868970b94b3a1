"""kvqref: bit-exact reference codecs and fused kernels for quantized LLM KV caches."""

__version__ = "0.1.0"
