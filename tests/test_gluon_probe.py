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
    # no shared memory but PREFETCH 2's ring: 3 stages of a tile's key and value code bytes (32 tokens x 64)
    assert all(b["shared"] == (3 * 2 * 32 * 64 if b["prefetch"] >= 2 else 0) and b["num_warps"] == 1
               for b in builds), builds


# bench/gluon_kivi_probe.py: the KIVI codes' PTX (keys as float16 subnormals, values as bfloat16 subnormals of the
# two tokens of an operand register), against the codes' definition (LSB first along channels, ``bits`` per code)

import gluon_kivi_probe as kivi  # noqa: E402


def _f16_value(half: int) -> float:
    return float(np.array([half], np.uint16).view(np.float16)[0])


def _bf16_value(half: int) -> float:
    return float(np.array([half << 16], np.uint32).view(np.float32)[0])


def _words_with(rng, bits: int, position: int, code: int) -> int:
    """A random 32-bit word of codes with ``code`` at code ``position`` (LSB first)."""
    w = int(rng.integers(0, 2**32))
    mask = (1 << bits) - 1
    return (w & ~(mask << bits * position) & 0xFFFFFFFF) | code << bits * position


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_key_codes_ptx(bits):
    """Register i holds (low half-word's code i, high half-word's code i) as float16 ``code * 2**(bits pos_i) *
    2**-24`` (:func:`kivi.key_pos`), for every code value in every position of the word, the others random."""
    asm, n = kivi.key_codes_ptx(bits), 16 // bits
    rng = np.random.default_rng(bits)
    for position in range(2 * n):
        for code in range(1 << bits):
            w = _words_with(rng, bits, position, code)
            got = run_ptx(asm, {f"${n}": w})
            for i in range(n):
                scale = 2.0 ** (bits * kivi.key_pos(bits, i) - 24)
                for half in range(2):
                    want = ((w >> (16 * half + bits * i)) & ((1 << bits) - 1)) * scale
                    assert _f16_value((got[f"${i}"] >> 16 * half) & 0xFFFF) == want, (position, code, i, half)


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_value_codes_ptx(bits):
    """Register w n + i holds (token A's code i of half-word w, token B's) as bfloat16 ``code * 2**(bits pos) *
    2**-133`` (:func:`kivi.value_pos`), for every code value in every position of either token's word."""
    asm, n = kivi.value_codes_ptx(bits), 16 // bits
    rng = np.random.default_rng(10 + bits)
    for token in range(2):
        for position in range(2 * n):
            for code in range(1 << bits):
                a, b = int(rng.integers(0, 2**32)), int(rng.integers(0, 2**32))
                if token == 0:
                    a = _words_with(rng, bits, position, code)
                else:
                    b = _words_with(rng, bits, position, code)
                got = run_ptx(asm, {f"${2 * n}": a, f"${2 * n + 1}": b})
                for w in range(2):
                    for i in range(n):
                        scale = 2.0 ** (bits * kivi.value_pos(bits, i) - 133)
                        for half, word in enumerate((a, b)):
                            want = ((word >> (16 * w + bits * i)) & ((1 << bits) - 1)) * scale
                            reg = (got[f"${w * n + i}"] >> 16 * half) & 0xFFFF
                            assert _bf16_value(reg) == want, (token, position, code, w, i, half)


def test_kivi_probe_builds_for_sm90_with_no_shared_memory():
    """As the FP4 probe's: both KIVI builds (int2, int4) compile for sm_90 with every layout conversion but the key
    rows' exchange asserted to move no data between threads, and no shared memory (the exchange by shuffles)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(BENCH / "gluon_kivi_probe.py"), "--compile-only"], capture_output=True,
                         text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    builds = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [b["build"] for b in builds] == ["int2_kivi", "int4_kivi", "int2_kivi-ring"]
    # the ring: 3 stages of a page's key and value code bytes (32 tokens x 32 bytes)
    assert all(b["shared"] == (3 * 2 * 32 * 32 if b["prefetch"] else 0) and b["num_warps"] == 1
               for b in builds), builds


def _codes(rows: np.ndarray, bits: int) -> np.ndarray:
    """[tokens, channels] codes of code bytes [tokens, bytes] (LSB first along channels)."""
    per = 8 // bits
    return np.stack([(rows >> bits * j) & ((1 << bits) - 1) for j in range(per)], axis=-1).reshape(rows.shape[0], -1)


def _words(row: np.ndarray) -> list[int]:
    return [int(w) for w in np.ascontiguousarray(row).view("<u4")]


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_key_operand_holds_each_channel_once(bits):
    """The key operand as the kernel builds it (the PTX per 4-byte word, each output's 4 elements the word's bytes,
    then ``KEY_ORDER``) replayed on the emulator: entry [k, n] is token n's code of channel ch(k) times
    2**(bits pos(k) - 24), ch(k) = 32 t + 2 N w + N b + 2 m + a and pos(k) as ``_k_digits`` state them (k = 16 (M w
    + m) + 8 a + 2 t + b), a bijection of the 128 channels."""
    n, m_out, w_n, db = 16 // bits, 8 // bits, bits, 16 * bits
    rng = np.random.default_rng(20 + bits)
    kb = rng.integers(0, 256, (32, db), dtype=np.uint8)
    o = np.zeros((32, db, m_out))
    for tok in range(32):
        for wi, word in enumerate(_words(kb[tok])):
            regs = run_ptx(kivi.key_codes_ptx(bits), {f"${n}": word})
            for m in range(m_out):
                for e in range(4):
                    o[tok, 4 * wi + e, m] = _f16_value((regs[f"${2 * m + e // 2}"] >> 16 * (e % 2)) & 0xFFFF)
    b_op = o.reshape(32, 4, w_n, 2, 2, m_out).transpose(kivi.KEY_ORDER.value).reshape(128, 32)
    k = np.arange(128)
    b, t, a, m, w = k % 2, (k // 2) % 4, (k // 8) % 2, (k // 16) % m_out, k // (16 * m_out)
    i = 2 * m + a
    ch = 32 * t + 2 * n * w + n * b + i
    pos = np.array([kivi.key_pos(bits, int(v)) for v in i])
    assert sorted(ch) == list(range(128))
    want = _codes(kb, bits)[:, ch].T * 2.0 ** (bits * pos - 24)[:, None]
    np.testing.assert_array_equal(b_op, want)


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_value_operand_columns(bits):
    """The value operand as the kernel builds it (token pairs through the PTX, then ``VALUE_ORDER``) replayed on the
    emulator: entry [token, c] is the token's code of channel 16 (c % 8) + c // 8 times 2**(bits pos - 133), pos =
    ((c // 8) % N) % (7 // bits): the epilogue's column rule."""
    n, db = 16 // bits, 16 * bits
    rng = np.random.default_rng(30 + bits)
    vb = rng.integers(0, 256, (32, db), dtype=np.uint8)
    o = np.zeros((16, db, n))
    for pair in range(16):
        for wi, (wa, wb) in enumerate(zip(_words(vb[2 * pair]), _words(vb[2 * pair + 1]), strict=True)):
            regs = run_ptx(kivi.value_codes_ptx(bits), {f"${2 * n}": wa, f"${2 * n + 1}": wb})
            for m in range(n):
                for e in range(4):
                    o[pair, 4 * wi + e, m] = _bf16_value((regs[f"${2 * m + e // 2}"] >> 16 * (e % 2)) & 0xFFFF)
    b_op = o.reshape(16, 8, bits // 2, 2, 2, n).transpose(kivi.VALUE_ORDER.value).reshape(32, 128)
    c = np.arange(128)
    ch = 16 * (c % 8) + c // 8
    pos = ((c // 8) % n) % (7 // bits)
    assert sorted(ch) == list(range(128))
    np.testing.assert_array_equal(b_op, _codes(vb, bits)[:, ch] * 2.0 ** (bits * pos - 133)[None, :])
