"""bench/gluon_fp4_probe.py without a GPU: its token-pair unpacking PTX on the CPU emulator against the portable
E2M1 rule, and its kernels built for sm_90 (every layout conversion in them is asserted to move no data between
threads when compiling, so a relabelling that would fails the build). The kernels' arithmetic runs on a GPU only
(``python3 bench/gluon_fp4_probe.py --check``: the float64 oracle with the fast mode's tolerance)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import gluon_fp4_probe as probe  # noqa: E402
from ptx_emulator import run_ptx  # noqa: E402


def _f16_e2m1(nibble: int) -> int:
    """The portable rule (``decode._e2m1_f16``): E2M1 bits in float16's, value x 2**-14."""
    return ((nibble & 7) << 9) | ((nibble & 8) << 12)


def _want(a: list[int], b: list[int]) -> dict[str, int]:
    """$0 .. $7 of ``TOKEN_PAIRS_PTX``: register 4 w + 2 n + j holds byte 2 w + j of tokens A (low half) and B (high
    half), nibble n (0 low, 1 high)."""
    out = {}
    for w in range(2):
        for n in range(2):
            for j in range(2):
                byte = 2 * w + j
                lo = _f16_e2m1((a[byte] >> 4 * n) & 15)
                hi = _f16_e2m1((b[byte] >> 4 * n) & 15)
                out[f"${4 * w + 2 * n + j}"] = lo | hi << 16
    return out


@pytest.mark.parametrize("token", ["A", "B"])
def test_token_pairs_ptx_unpacks_both_tokens(token):
    """Every byte value in every position of one token's word (the other token's and the other bytes random): each
    output register holds the float16 E2M1 * 2**-14 of the same byte of both tokens."""
    asm = probe.TOKEN_PAIRS_PTX.value
    rng = np.random.default_rng(0 if token == "A" else 1)
    for pos in range(4):
        for byte in range(256):
            a = [int(v) for v in rng.integers(0, 256, 4)]
            b = [int(v) for v in rng.integers(0, 256, 4)]
            (a if token == "A" else b)[pos] = byte
            got = run_ptx(asm, {"$8": sum(v << 8 * i for i, v in enumerate(a)),
                                "$9": sum(v << 8 * i for i, v in enumerate(b))})
            want = _want(a, b)
            assert {k: got[k] for k in want} == want, (pos, byte, a, b)


def test_probe_kernels_build_for_sm90_with_no_shared_memory():
    """The probe's design claim: the code bytes go from their loads to the mma operands in registers, every
    conversion between layouts asserted at compile time to move no data between threads (a relabelling that puts an
    element in another lane fails the build: planted, the key bytes' t and c axes swapped), no shared memory. The
    compiler cannot run in the interpreting test process, so it runs in a subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(BENCH / "gluon_fp4_probe.py"), "--compile-only"], capture_output=True,
                         text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    builds = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [b["build"] for b in builds] == list(probe.BUILDS)
    assert all(b["shared"] == 0 and b["num_warps"] == 1 for b in builds), builds
