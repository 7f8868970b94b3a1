"""Host time of the first rotated write per scheme (compilation, and for the warp-shuffle route the settling of its
lane masks against the compiled layout) and of the second (compiled, cached), on a CUDA GPU.

    python3 bench/write_first_call.py

Prints per scheme the two wall times (4,096 tokens x 8 heads x 128, bf16 input, the default launch, device sync
included) and whether the default route is the warp-shuffle one.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_bench import write_inputs  # noqa: E402


def main() -> int:
    import torch

    from kvqref.backends import triton_backend as tb

    for label in ("fp8_e4m3", "nvfp4", "fp4_e2m1"):
        side, x, slots, _ = write_inputs(label, tokens=4096, rotation=True)
        times = []
        for _ in range(2):
            t = time.perf_counter()
            tb.quantize_write(side, x, slots)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        shfl = tb.plan_write(side, x, slots).constexprs["ROT_SHFL"]
        print(f"{label} first call (compiles + settles) {times[0]:.2f} s, second {times[1]:.4f} s {shfl}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
