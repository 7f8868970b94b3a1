"""The Triton write kernel with static (calibrated-like) per-tensor and per-head FP8 scales on the device:
every stored byte against the oracle (kvqref.conformance.triton_write_matches), for the vllm, sglang
(tensor and float scale, saturating) and rocm profiles, E4M3 and E5M2. Scales are amax / 448 times a
random non-power-of-two factor in [2^-2, 2^0.25] (what amax / percentile / MSE calibration produce).

    python bench/static_scale_write.py        # on a GPU (or TRITON_INTERPRET=1 on a CPU: slow)
"""

import time

import numpy as np
import torch

from kvqref.conformance import triton_write_matches

PROFILES = (("vllm", {}), ("sglang", {"saturate": True}), ("sglang", {"sglang_scale": "float", "saturate": True}),
            ("rocm", {}))


def main() -> None:
    print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", torch.__version__)
    rng = np.random.default_rng(31)
    bad = n = 0
    t0 = time.time()
    for trial in range(3):
        x = (rng.standard_normal((512, 4, 128)) * (1 + np.arange(4))[None, :, None]).astype(np.float32)
        x[:, :, 5] *= 40
        amax = np.abs(x).max(axis=(0, 2)).astype(np.float32)
        for gran in ("tensor", "head"):
            stat = amax if gran == "head" else amax.max()
            base = np.asarray(stat / np.float32(448), np.float32)
            s = (base * np.float32(2.0 ** rng.uniform(-2, 0.25))).astype(np.float32)
            for prof, extra in PROFILES:
                for name in ("fp8_e4m3", "fp8_e5m2"):
                    ok, d = triton_write_matches(name, {"granularity": gran, "scale": s, "profile": prof, **extra},
                                                 x, 16, rng)
                    n += 1
                    bad += not ok
                    print(trial, gran, prof, extra, name, "OK" if ok else "FAIL " + d, flush=True)
    print(n, "cases,", bad, "differ,", round(time.time() - t0), "s")


if __name__ == "__main__":
    main()
