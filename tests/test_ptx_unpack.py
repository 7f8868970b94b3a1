"""The inline PTX of the NVFP4 nibble unpacking (kvqref.kernels.decode._e2m1_pairs), executed on the CPU by
a small emulator of the instructions it uses, against the portable rule (``_e2m1_f16``: E2M1 bits placed in
float16's, value x 2**-14) on every byte value in every position of the packed register. The GPU test
tests/test_triton.py::test_ptx_unpacking_equals_the_portable_one runs the real thing on a device."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("triton")

from ptx_emulator import run_ptx  # noqa: E402

from kvqref import formats  # noqa: E402
from kvqref.kernels import decode  # noqa: E402


def _asm_text(ptx=None) -> str:
    return (ptx or decode.E2M1_PAIRS_PTX).value.strip().removeprefix("{").removesuffix("}")


def _portable(nibble: int) -> int:
    return ((nibble & 7) << 9) | ((nibble & 8) << 12)


def _portable_bf16(nibble: int) -> int:
    """The bfloat16 rule of ``_e2m1_pairs(byte, True)``: E2M1 bits in bfloat16's lowest exponent bits (value x
    2**-126)."""
    return ((nibble & 7) << 6) | ((nibble & 8) << 12)


def _bf16_value(bits: int) -> float:
    return float(np.array([bits << 16], np.uint32).view(np.float32)[0])


def _every_byte_in_every_position(asm: str, seed: int, inp: str = "$4"):
    """(position, byte, the register's 4 bytes, the registers after ``asm``) for every byte value at every position
    of the input register ``inp``, the other bytes random."""
    rng = np.random.default_rng(seed)
    for pos in range(4):
        for byte in range(256):
            bs = [int(v) for v in rng.integers(0, 256, 4)]
            bs[pos] = byte
            yield pos, byte, bs, run_ptx(asm, {inp: sum(v << 8 * i for i, v in enumerate(bs))})


def _f16_value(bits: int) -> float:
    return float(np.array([bits], np.uint16).view(np.float16)[0])


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("f16,magic_number", [(True, True), (False, True), (True, False)],
                         ids=["float16", "bfloat16", "float16-subnormal"])
def test_int_code_ptx_places_every_code_in_the_magic_number(bits, f16, magic_number):
    """``_int_phases`` (KIVI codes by inline PTX): phase p of byte i is half i % 2 of register $(2p + i // 2), and
    that half is the magic number (float16 1024 = 0x6400, bfloat16 128 = 0x4300) plus code << k with k =
    ``int_code_bit`` below the float's mantissa width, so the caller's ``x * 2**-k - magic * 2**-k`` is the code,
    exactly; without the magic number (``kivi_subnormal_codes``) the half is code << k alone, the float16 subnormal
    code * 2**(k - 24); on every byte in every position."""
    asm = decode._int_codes_ptx(bits, f16, magic_number).strip().removeprefix("{").removesuffix("}")
    phases, magic = 8 // bits, (0x6400 if f16 else 0x4300) if magic_number else 0
    ks = [decode.int_code_bit(bits, p, f16) for p in range(phases)]
    assert all(k + bits <= (10 if f16 else 7) for k in ks)  # inside the mantissa: the exponent stays the magic's
    for pos, byte, bs, regs in _every_byte_in_every_position(asm, 2, f"${2 * phases}"):
        for p in range(phases):
            got = [(regs[f"${2 * p + i // 2}"] >> 16 * (i % 2)) & 0xFFFF for i in range(4)]
            assert got == [magic | ((v >> p * bits) & ((1 << bits) - 1)) << ks[p] for v in bs], (pos, byte, p)
            if not magic_number:
                assert [_f16_value(h) for h in got] == [((v >> p * bits) & ((1 << bits) - 1)) * 2.0 ** (ks[p] - 24)
                                                        for v in bs]


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("f16,magic_number", [(True, True), (False, True), (True, False)],
                         ids=["float16", "bfloat16", "float16-subnormal"])
def test_int_word_ptx_places_every_code(bits, f16, magic_number):
    """``_int_word_phases`` (KIVI code words by inline PTX, ``_int_words_ptx``): output $p holds code p of the first
    word in its low half and of the second in its high half, as the magic number | code << k (k = ``int_code_bit`` of
    the code's phase p % (8 / bits) for 4-bit codes, whose two codes per byte share a prmt, p for 2-bit), or without
    the magic number code << k, the float16 subnormal code * 2**(k - 24) (``_int_codes_sub``'s rule); every code value
    at every position of both words, the other codes random."""
    asm = decode._int_words_ptx(bits, f16, magic_number).strip().removeprefix("{").removesuffix("}")
    magic = (0x6400 if f16 else 0x4300) if magic_number else 0
    mask, q = (1 << bits) - 1, 2 if bits == 4 else 8
    ks = [decode.int_code_bit(bits, p % q, f16) for p in range(8)]
    rng = np.random.default_rng(bits)
    width = 8 * bits  # bits per word: 32 (4-bit codes), 16 (2-bit)
    for p in range(8):
        for v in range(1 << bits):
            w1, w2 = (int(x) for x in rng.integers(0, 1 << width, 2))
            w1 = w1 & ~(mask << p * bits) | v << p * bits
            w2 = w2 & ~(mask << (7 - p) * bits) | (mask - v) << (7 - p) * bits
            inputs = {"$8": w1, "$9": w2} if bits == 4 else {"$8": w1 | w2 << 16}
            regs = run_ptx(asm, inputs)
            for i in range(8):
                got = regs[f"${i}"]
                want = [magic | ((w >> i * bits) & mask) << ks[i] for w in (w1, w2)]
                assert [got & 0xFFFF, got >> 16] == want, (p, v, i)
                if not magic_number:
                    assert [_f16_value(h) for h in want] == [((w >> i * bits) & mask) * 2.0 ** (ks[i] - 24)
                                                             for w in (w1, w2)]


def test_int_word_ptx_catches_a_planted_field_error():
    """The word check above fails when a subnormal field is off by one bit (the test can fail)."""
    asm = decode._int_words_ptx(4, True, False).replace("0x00F000F0", "0x00780078")
    regs = run_ptx(asm.strip().removeprefix("{").removesuffix("}"), {"$8": 0xFFFFFFFF, "$9": 0xFFFFFFFF})
    assert (regs["$1"] & 0xFFFF) != 0xF << decode.int_code_bit(4, 1, True)


def test_int_code_ptx_catches_a_planted_field_error():
    """The check above fails when one phase's field is off by one bit (the test can fail)."""
    asm = decode._int_codes_ptx(4, True).replace("0x00F000F0", "0x00780078")
    regs = run_ptx(asm.strip().removeprefix("{").removesuffix("}"), {"$4": 0xF0F0F0F0})
    assert (regs["$2"] & 0xFFFF) != (0x6400 | 0xF << decode.int_code_bit(4, 1, True))


@pytest.mark.parametrize("ptx,rule", [(decode.E2M1_PAIRS_PTX, _portable), (decode.E2M1_PAIRS_BF16_PTX, _portable_bf16)],
                         ids=["float16", "bfloat16"])
def test_ptx_unpacking_matches_the_portable_rule_on_every_byte(ptx, rule):
    for pos, byte, bs, regs in _every_byte_in_every_position(_asm_text(ptx), 0):
        lo = [(regs[f"${i // 2}"] >> 16 * (i % 2)) & 0xFFFF for i in range(4)]
        hi = [(regs[f"${2 + i // 2}"] >> 16 * (i % 2)) & 0xFFFF for i in range(4)]
        assert lo == [rule(v & 15) for v in bs] and hi == [rule(v >> 4) for v in bs], (pos, byte)


@pytest.mark.parametrize("ptx,rule", [(decode.E2M1_QUADS_PTX, _portable), (decode.E2M1_QUADS_BF16_PTX, _portable_bf16)],
                         ids=["float16", "bfloat16"])
def test_quads_ptx_matches_the_portable_rule_on_every_byte(ptx, rule):
    """``_e2m1_quads``: two 16-bit words per register (bytes 0, 1 and 2, 3); output k holds channel k (nibble k of
    each word) of both words, in the word's half."""
    for pos, byte, bs, regs in _every_byte_in_every_position(_asm_text(ptx), 1):
        words = [bs[0] | bs[1] << 8, bs[2] | bs[3] << 8]
        for k in range(4):
            got = [(regs[f"${k}"] >> 16 * w) & 0xFFFF for w in range(2)]
            assert got == [rule((words[w] >> 4 * k) & 15) for w in range(2)], (pos, byte, k)


def test_the_portable_rule_is_e2m1_times_2_to_the_minus_14():
    """_portable's float16 bits, read as float16, are the oracle's E2M1 values x 2**-14 (all 16 codes)."""
    vals = np.array([_portable(c) for c in range(16)], np.uint16).view(np.float16).astype(np.float64) * 2.0**14
    want = np.asarray(formats.get("float4_e2m1fn").decode(np.arange(16, dtype=np.uint8)), np.float64)
    assert np.array_equal(vals, want) and np.array_equal(np.signbit(vals), np.signbit(want))


def _mx_scale_bits(c: int) -> int:
    """``_mx_tile_bf16``'s bfloat16 bits of the E8M0 scale of code ``c``: ``c << 7``, or-ed with 0x40 where
    ``(c + 1) & 255 < 2`` (codes 0 and 255)."""
    return (c << 7) | (0x40 if ((c + 1) & 255) < 2 else 0)


def test_the_bf16_rule_times_the_e8m0_factors_is_e2m1_times_the_scale():
    """``_mx_tile_bf16``'s arithmetic: bfloat16 E2M1 x 2**-126 times 2**126 times the scale's bfloat16 bits
    (:func:`_mx_scale_bits`) equals E2M1 x 2**(c - 127) for every code pair, exactly (products of bfloat16 values by
    powers of two with float32's exponent range: exact unless they overflow, which the float32 route does as
    well; code 0 is the subnormal 2**-127); code 0xFF gives NaN. A planted scale rule without the code-0 fix (bits
    0 for code 0) fails it."""
    e2m1 = np.asarray(formats.get("float4_e2m1fn").decode(np.arange(16, dtype=np.uint8)), np.float64)

    def mismatches(scale_bits) -> int:
        bad = 0
        for c in range(256):
            fc = _bf16_value(scale_bits(c))
            for n in range(16):
                with np.errstate(over="ignore", invalid="ignore"):
                    got = np.float32(np.float32(_bf16_value(_portable_bf16(n))) * np.float32(2.0**126)) * np.float32(fc)
                want = e2m1[n] * 2.0 ** (c - 127)
                if c == 255:
                    bad += not np.isnan(got)
                elif abs(want) < 3.4e38:
                    bad += not (got == want and np.signbit(got) == np.signbit(want))
                else:
                    bad += not (np.isinf(got) and np.sign(got) == np.sign(want))
        return bad

    assert _bf16_value(0x7E80) == 2.0**126
    assert mismatches(_mx_scale_bits) == 0
    assert mismatches(lambda c: c << 7) > 0  # code 0 as +0 and code 255 as inf: wrong


def test_a_planted_lut_error_is_caught():
    asm = _asm_text().replace("0xEC", "0xEA", 1)  # the first lop3: the high nibbles of bytes 0 and 1 ($2)
    regs = run_ptx(asm, {"$4": 0x000000F0})  # code 15 = -6: needs the sign from the second operand
    assert regs["$2"] & 0xFFFF != _portable(15)
    assert run_ptx(_asm_text(), {"$4": 0x000000F0})["$2"] & 0xFFFF == _portable(15)


def test_ptx_unpacking_is_refused_on_rocm(monkeypatch):
    """Inline PTX cannot run on ROCm: asking for it there is an error before launch, not a silent fallback."""
    torch = pytest.importorskip("torch")
    from kvqref import conformance
    from kvqref.backends import triton_backend as tb

    shape = dict(batch=1, kv_heads=2, q_heads=4, head_dim=64, page_size=16, lens=(20,))
    cache, _ = conformance.build_cache(("", "mxfp4", {}, "mxfp4", {}), shape, np.random.default_rng(1), 1)
    dc = tb.DeviceCache.from_cache(cache, "cpu")
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    with pytest.raises(ValueError, match="ptx_unpack"):
        tb.decode(torch.zeros(1, 4, 64), dc, ptx_unpack=True)
