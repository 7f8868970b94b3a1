"""Probe for the fused rotation (issue 13): a Triton butterfly helper (reshape/permute/split/join, the plan in
docs/rotation.md) against the oracle's exact float32 rule, bit for bit, with and without FP fusion.

Run: `python3 bench/rotation_probe.py` (GPU) or `TRITON_INTERPRET=1 python3 bench/rotation_probe.py`.
Not a kvqref kernel: kvqref/kernels stays untouched until the rotation is fused there.
"""

import numpy as np
import torch
import triton
import triton.language as tl

from kvqref.schemes.rotation import HadamardRotation, norm_f32


@triton.jit
def _hadamard(x, ROWS: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr):
    for s in tl.static_range(LOG2D):  # stage h = 1 << s (a constexpr cannot be reassigned in compiled Triton)
        x4 = tl.reshape(x, (ROWS, D // (2 << s), 2, 1 << s))
        x4 = tl.permute(x4, (0, 1, 3, 2))
        a, b = tl.split(x4)
        x4 = tl.join(a + b, a - b)
        x = tl.reshape(tl.permute(x4, (0, 1, 3, 2)), (ROWS, D))
    return x


@triton.jit
def rotate_kernel(X, Y, SIGNS, c, n, ROWS: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, D)
    m = (r < n)[:, None]
    x = tl.load(X + r[:, None] * D + d[None, :], mask=m, other=0.0)
    s = tl.load(SIGNS + d)
    y = _hadamard(x * s[None, :], ROWS, D, LOG2D) * c
    tl.store(Y + r[:, None] * D + d[None, :], y, mask=m)


dev = "cuda" if torch.cuda.is_available() else "cpu"
rng = np.random.default_rng(0)
bad = 0
for D in (16, 32, 64, 128, 256):
    for seed in (0, 7, 2**64 - 1):
        rot = HadamardRotation(seed)
        n = 1000
        x = (rng.standard_normal((n, D)) * np.exp2(rng.integers(-30, 30, (n, D)))).astype(np.float32)
        x[:50] = (x[:50].astype(np.float64) * 2.0**-120).astype(np.float32)  # subnormal region
        want = rot.rotate(x)
        xt = torch.from_numpy(x).to(dev)
        yt = torch.empty_like(xt)
        st = torch.from_numpy(rot.signs(D)).to(dev)
        ROWS = 16
        for fusion in (True, False):
            rotate_kernel[(triton.cdiv(n, ROWS),)](xt, yt, st, float(norm_f32(D)), n, ROWS=ROWS, D=D,
                                                  LOG2D=D.bit_length() - 1, enable_fp_fusion=fusion)
            got = yt.cpu().numpy()
            diff = int((got.view(np.uint32) != want.view(np.uint32)).sum())
            bad += diff
            print(dev, torch.cuda.get_device_name(0) if dev == "cuda" else "interpreter", "triton", triton.__version__,
                  "D", D, "seed", seed, "fusion", fusion, "mismatching elements", diff, "of", want.size, flush=True)
print("TOTAL mismatches", bad)
