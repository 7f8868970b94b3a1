"""Host time of an eager ``triton_backend.decode`` call on the GPU machine, and where it goes.

    python3 bench/host_overhead.py [--profile]

For fp8_e4m3 and nvfp4 (batch 32, 32 q / 8 KV heads, D 128): the host microseconds per call (300 calls issued
without synchronizing), optionally a cProfile of them (``--profile``), then the batch 32 x 8,192 row of
bench/decode_bench.py (CUDA-graph and eager times). Session 5 on the H100: 218 / 156 us per call in one run,
224 / 403 us in another (the device machine's host time varies from call to call), spent in Triton's launch
path (two launches: argument specialization and the launcher) and plan_decode's own Python
(bench/results/history/h100-session5-host-profile.log).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import decode_bench as db  # noqa: E402


def main() -> int:
    import torch

    from kvqref.backends import triton_backend as tb

    tokens = 1024
    for label in ("fp8_e4m3", "nvfp4"):
        dc, _, _ = db.make_cache(label, (32, 32, 8, 128, tokens), 16)
        q = torch.randn(32, 32, 128, device="cuda").to(torch.bfloat16)

        def fn(dc=dc, q=q):
            return tb.decode(q, dc, validate=False, max_seq_len=tokens)

        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        n = 300
        t = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t) / n * 1e6
        torch.cuda.synchronize()
        print(label, "host us/call (no sync):", round(host, 1), flush=True)
        if "--profile" in sys.argv:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(n):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            print(text.getvalue()[:6000])
        row = db.decode_case(label, (32, 32, 8, 128, 8192), 16)
        print(label, "batch 32 x 8192: graph", round(row["time_us"], 1), "us, eager",
              round(row["eager_time_us"], 1), "us", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
