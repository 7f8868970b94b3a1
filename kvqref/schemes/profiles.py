"""Engine profiles: which options of which scheme reproduce which engine's arithmetic, and where that was read.

``PROFILES`` is the one table of docs/schemes.md (``profiles_markdown()`` prints it). Engine facts, with the
evidence behind each: docs/engines.md.
"""

from __future__ import annotations

from typing import Any

#: engine, kvqref call, format, scale rule, rounding, overflow, packing, source (per model dtype: engines.md 8)
PROFILES: tuple[dict[str, Any], ...] = (
    {"engine": "vLLM (CUDA `reshape_and_cache_flash`)", "call": 'get("fp8_e4m3" | "fp8_e5m2", profile="vllm")',
     "format": "E4M3FN / E5M2",
     "scale rule": "per-tensor or per-head float32, static (checkpoint; missing -> 1.0 with warning) or amax/max",
     "rounding": "f32(x) / f32(scale), one IEEE float32 division; RNE to FP8",
     "overflow": "saturate +-448 / +-57344 (Inf too)", "packing": "codes (D,) u8",
     "source": "vllm csrc/cache_kernels.cu, csrc/quantization/fp8/nvidia/quant_utils.cuh (engines.md 1a)"},
    {"engine": "vLLM per-token-head FP8", "call": 'get("fp8_e4m3", granularity="token_head")',
     "format": "E4M3FN", "scale rule": "amax/448 per (token, head), float32, stored per token",
     "rounding": "as vllm", "overflow": "saturate", "packing": "codes (D,) u8; scale () f32",
     "source": "vllm `_reshape_cache_per_token_head` (engines.md 1a; exact rounding unverified there)"},
    {"engine": "vLLM on ROCm MI300", "call": 'get("fp8_e4m3", profile="rocm")', "format": "E4M3FNUZ (max 240)",
     "scale rule": "static OCP checkpoint scale x 2 (scale_fnuz = 2 * scale_ocp); computed: amax/240",
     "rounding": "f32(x) / f32(scale), RNE; float16 model: f16(f32(x) / f32(scale)) first (HIP `/=` on _Float16)",
     "overflow": "saturate +-240 (__HIP_SATFINITE)",
     "packing": "codes (D,) u8",
     "source": "vllm quantization/kv_cache.py process_weights_after_loading; amd/quant_utils.cuh (engines.md 1c-d)"},
    {"engine": "SGLang FP8 (`set_kv_buffer`)",
     "call": 'get("fp8_e4m3", profile="sglang", sglang_scale="tensor" | "float", saturate=False | True)',
     "format": "E4M3FN / E5M2",
     "scale rule": "static per-tensor (JSON `--quantization-param-path`: one factor for K and V; default 1.0)",
     "rounding": "in the model dtype m (bf16 / f16 / f32, the input's or model_dtype=): tensor scale: "
                 "m(f32(x) / f32(m(s))); float scale: m(f32(x) * f32(1/f32(s))); then RNE",
     "overflow": "torch <= 2.11: NaN code (default, with a warning); torch >= 2.12: saturate (saturate=True)",
     "packing": "codes (D,) u8 ([slots, H, D] uint8 pool)",
     "source": "sglang mem_cache/memory_pool.py MHATokenToKVPool.set_kv_buffer (engines.md 2)"},
    {"engine": "SGLang FP4 (`FP4MXBlock16KVQuantizeUtil`)", "call": 'get("fp4_e2m1", profile="sglang")',
     "format": "E2M1 + uint8 exponent (bias 127), block 16",
     "scale rule": "e = ceil(log2(max(f32(amax / 6), 1e-10))) (float32 on the input values of every model "
                   "dtype, as under torch.compile); zero block: 94",
     "rounding": "|x / 2^e| >= 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5: ties away; sign iff < 0",
     "overflow": "saturate 6 (cannot occur: |x / 2^e| <= 6)",
     "packing": "even elem low nibble; per token codes [H, D/2], scales [H*D/16] (`to_sglang_layout`)",
     "source": "sglang layers/quantization/kvfp4_tensor.py (engines.md 3)"},
    {"engine": "OCP MX (default of fp4_e2m1 / mxfp4)", "call": 'get("fp4_e2m1" | "mxfp4")',
     "format": "E2M1 + E8M0, block 16 / 32",
     "scale rule": "e = floor(log2 amax) - 2, clamp [-127, 127]; zero block: 0x00 (2^-127)",
     "rounding": "x / 2^e exact, RNE (microxcaling's default is half-away: rounding='away')",
     "overflow": "saturate +-6 (|x / 2^e| in [4, 8))", "packing": "codes (D/2,) u8 even=low; scales (D/B,) u8",
     "source": "OCP MX spec v1.0 via microsoft/microxcaling mx/mx_ops.py (engines.md 6)"},
    {"engine": "NVFP4 (TensorRT-LLM / FlashInfer convention)", "call": 'get("nvfp4")',
     "format": "E2M1 + E4M3FN block 16 + float32 global",
     "scale rule": "g = f32(amax / 2688); s = f32(f32(bamax / 6) / g) clamped [2^-6, 448], E4M3 RNE saturate",
     "rounding": "y = f32(x / f32(e4m3(s) * g)) (IEEE division), clamp +-6, RNE",
     "overflow": "clamp +-6", "packing": "codes (D/2,) u8 even=low; scales (D/16,) u8 E4M3; global_scale f32",
     "source": "TRT-LLM kernels/quantization.cuh cvt_warp_fp16_to_fp4; flashinfer fp4_kv_quantization.cu "
               "(engines.md 5; they use rcp.approx and no 2^-6 floor: not bit-exact)"},
    {"engine": "KIVI", "call": 'get("int4_kivi" | "int2_kivi", role="key" | "value")',
     "format": "uint4 / uint2 asymmetric, fp16 scale and min",
     "scale rule": "per group of G=32: keys per channel over tokens, values per token over channels; "
                   "residual R=128 full precision",
     "rounding": "fp16: scale = f16(f16(max-min)/(2^b-1)); q = rint(clamp(f16(f16(x-min)/scale), 0, 2^b-1))",
     "overflow": "clamp [0, 2^b - 1]; scale 0 -> codes 0",
     "packing": "kvqref: LSB-first along channels per token; KIVI: int32 words along the group axis "
                "(`to_kivi_layout`)",
     "source": "jy-yuan/KIVI quant/new_pack.py, models/llama_kivi.py (engines.md 4)"},
    {"engine": "baseline", "call": 'get("bf16")', "format": "bfloat16", "scale rule": "none",
     "rounding": "RNE from the input bits", "overflow": "+-Inf", "packing": "data (D,) u16",
     "source": "IEEE-style bfloat16 definition"},
)

COLUMNS = ("engine", "call", "format", "scale rule", "rounding", "overflow", "packing", "source")


def profiles_markdown() -> str:
    """The profile table as markdown."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in PROFILES:
        cells = [(f"`{row[c]}`" if c == "call" else str(row[c])).replace("|", "\\|") for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
