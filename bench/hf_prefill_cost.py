"""CPU cost of a teacher-forced forward through kvqref.hf.QuantizedKVCache (``prefill="as_decoded"``, the
"kvqref" attention), the path the LLM evaluation runs, against the same forward with SDPA and no cache.

    python bench/hf_prefill_cost.py --json bench/results/hf_prefill_cost_cpu.json

SmolLM2-135M-Instruct (the installed GGUF; ``--random`` for random weights of the same architecture), one
sequence of ``--tokens`` random ids (seed 0), float32, wall-clock (perf_counter) of one forward per row,
the reference measured first and last. On a shared CPU the times vary with the other processes' load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = [("bf16", {}), ("fp8_e4m3", {}), ("fp8_e4m3", {"granularity": "token_head"}), ("fp4_e2m1", {}),
        ("nvfp4", {}), ("int4_kivi", {"residual": 128}), ("int2_kivi", {"residual": 0})]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--random", action="store_true", help="random weights instead of the GGUF")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import transformers

    import kvqref.hf as H

    model = H.random_model("smollm2") if args.random else H.load_smollm2()[0]
    ids = torch.randint(3, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    out = {"command": "python bench/hf_prefill_cost.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "device": f"cpu ({os.cpu_count()} cores visible, {torch.get_num_threads()} torch threads)",
           "versions": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__},
           "model": "random SmolLM2 architecture" if args.random else "SmolLM2-135M-Instruct (GGUF)",
           "tokens": args.tokens, "backend": args.backend, "rows": []}

    def timed(label: str, options: dict, fn) -> None:
        t = time.perf_counter()
        with torch.no_grad():
            fn()
        dt = time.perf_counter() - t
        out["rows"].append({"forward": label, "options": options, "seconds": dt})
        print(f"{label:36s} {json.dumps(options):28s} {dt:7.2f} s", flush=True)

    H.set_attention(model, "sdpa")
    timed("sdpa, no cache", {}, lambda: model(ids, use_cache=False))
    H.set_attention(model, "kvqref")
    for scheme, opts in ROWS:
        timed(f"kvqref as_decoded {scheme}", opts, lambda s=scheme, o=opts: model(
            ids, **H.cache_kwargs(model, H.QuantizedKVCache(model.config, s, backend=args.backend, k_options=o,
                                                            v_options=o))))
    H.set_attention(model, "sdpa")
    timed("sdpa, no cache (again)", {}, lambda: model(ids, use_cache=False))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
