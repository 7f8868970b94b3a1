"""Generation speed through kvqref.hf.QuantizedKVCache + the "kvqref" attention against transformers' SDPA
with its DynamicCache, on SmolLM2-135M's architecture with random weights (same cost per token as the trained
model; the 93 MB GGUF cannot travel to the GPU machine).

For each batch size and scheme: a prompt of ``--prompt`` random tokens is prefilled, then ``--tokens`` greedy
decode steps are timed (CUDA events after a warm-up run of the same configuration and an L2 flush; on the
CPU, perf_counter). Reported per row: time per output token (one decode step of the whole batch), tokens/s
(batch x steps / time), the cache bytes held at the end, the cache read rate (mean cache bytes / time per
step: every step reads the whole cache once; the rest of the step is the model's weights) and the ratio to
SDPA + DynamicCache in bf16 at the same batch. The JSON records the device, versions and shapes.

GPU (the lead's command; about 2 minutes on an H100):
    python bench/hf_generate_bench.py --json bench/results/hf_generate_h100.json
CPU smoke run (seconds; checks that the script works before the GPU run):
    TRITON_INTERPRET=1 python bench/hf_generate_bench.py --device cpu --tiny --tokens 4 --prompt 16
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMES = {"bf16": {}, "fp8_e4m3": {}, "fp4_e2m1": {}, "int4_kivi": {"residual": 128}}


def _versions() -> dict[str, str]:
    import transformers

    v = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = "not installed"
    return v


class Timer:
    """CUDA events on a GPU (after an L2 flush), perf_counter on the CPU; milliseconds."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device) if self.cuda else None

    def __enter__(self) -> Timer:
        if self.cuda:
            self.flush.zero_()
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.end.record()
            torch.cuda.synchronize()
            self.ms = self.start.elapsed_time(self.end)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


def decode_run(model, make_cache, prompt: torch.Tensor, steps: int, timer: Timer | None):
    """Prefill ``prompt``, then ``steps`` greedy decode steps (timed when ``timer``); returns (ms, cache)."""
    from kvqref.hf import cache_kwargs

    cache = make_cache()
    kw = cache_kwargs(model, cache)
    with torch.no_grad():
        out = model(prompt, **kw, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        if timer is None:
            for _ in range(steps):
                nxt = model(nxt, **kw, use_cache=True).logits[:, -1:].argmax(-1)
            return None, cache
        with timer:
            for _ in range(steps):
                nxt = model(nxt, **kw, use_cache=True).logits[:, -1:].argmax(-1)
    return timer.ms, cache


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="the tiny 2-layer test Llama instead of SmolLM2's shape")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per sequence")
    ap.add_argument("--tokens", type=int, default=128, help="timed decode steps")
    ap.add_argument("--backend", default=None, help="kvqref backend (default: triton on a GPU, torch on the CPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import transformers
    from transformers import DynamicCache

    import kvqref.hf as H

    device = args.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    backend = args.backend or ("triton" if device.startswith("cuda") else "torch")
    model = H.random_model("tiny" if args.tiny else "smollm2", dtype=dtype, seed=0, device=device)
    cfg = model.config
    timer = Timer(device)
    result = {
        "command": "python bench/hf_generate_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or "cpu",
        "versions": _versions(), "model": "tiny" if args.tiny else "SmolLM2-135M architecture, random weights",
        "shapes": {"layers": cfg.num_hidden_layers, "q_heads": cfg.num_attention_heads,
                   "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "prompt": args.prompt,
                   "decode_steps": args.tokens, "dtype": str(dtype).replace("torch.", "")},
        "backend": backend, "rows": [],
    }
    print(f"# {result['device']}  transformers {transformers.__version__}  torch {torch.__version__}  "
          f"backend {backend}", flush=True)
    g = torch.Generator().manual_seed(0)
    for batch in [int(b) for b in args.batches.split(",")]:
        prompt = torch.randint(3, cfg.vocab_size, (batch, args.prompt), generator=g).to(device)
        configs = [("sdpa", "bf16 (DynamicCache)", lambda: DynamicCache())]
        for name in args.schemes.split(","):
            opts = SCHEMES.get(name, {})
            configs.append(("kvqref", name, lambda name=name, opts=opts: H.QuantizedKVCache(
                cfg, name, backend=backend, k_options=opts, v_options=opts)))
        base_ms = None
        for attn, label, make in configs:
            H.set_attention(model, attn)
            row = {"batch": batch, "attention": attn, "cache": label}
            try:
                decode_run(model, make, prompt, min(3, args.tokens), None)  # warm-up (Triton compiles here)
                ms, cache = decode_run(model, make, prompt, args.tokens, timer)
            except Exception as e:  # record and go on: one failing scheme must not lose the others' timings
                row["error"] = f"{type(e).__name__}: {e}"
                print(f"batch {batch:3d} {label:22s} ERROR {row['error']}", flush=True)
                result["rows"].append(row)
                continue
            per_tok = ms / args.tokens
            base_ms = per_tok if attn == "sdpa" else base_ms
            row.update(ms_per_token=per_tok, tokens_per_s=batch * args.tokens / (ms / 1e3),
                       speedup_vs_sdpa_dynamic=(base_ms / per_tok) if base_ms else None)
            if hasattr(cache, "nbytes"):
                row["cache_bytes"] = cache.nbytes()
            else:  # DynamicCache: bf16 K and V of every layer
                row["cache_bytes"] = sum(t.numel() * t.element_size() for layer in getattr(cache, "layers", [])
                                         for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                                         if isinstance(t, torch.Tensor))
            # each step reads the whole cache once; its mean size over the timed steps, scaled from the end
            total = args.prompt + args.tokens
            mean_bytes = row["cache_bytes"] * (args.prompt + args.tokens / 2) / total
            row["cache_read_GBps"] = mean_bytes / (per_tok * 1e-3) / 1e9
            result["rows"].append(row)
            print(f"batch {batch:3d} {label:22s} {per_tok:8.3f} ms/token  {row['tokens_per_s']:9.1f} tokens/s  "
                  f"x{row['speedup_vs_sdpa_dynamic'] or 1:.2f} vs SDPA", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
