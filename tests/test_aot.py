"""Ahead-of-time compilation of every kernel for MI300 (gfx942), MI350 (gfx950), H100 (sm_90), B200 (sm_100).

No AMD GPU runs the tests: compiling the real launches to AMDGCN is the project's ROCm evidence. The
compiler cannot run in the interpreting test process, so it runs in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.aot


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvqref.kernels.aot", *args], capture_output=True, text=True,
                          env=_env(), timeout=1200)


def _compile_all_targets(targets: tuple[str, ...]) -> tuple[list[dict], int]:
    """Every target's results of ``python -m kvqref.kernels.aot --json``: one process per group of targets, as many
    groups as cores (at most one per target), run side by side (a cold build of one target takes minutes); and the
    largest exit code."""
    n = max(1, min(len(targets), os.cpu_count() or 1))
    procs = [subprocess.Popen([sys.executable, "-m", "kvqref.kernels.aot", "--json", "--targets",
                               ",".join(targets[i::n])], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env()) for i in range(n)]
    results: list[dict] = []
    rc = 0
    try:
        for p in procs:
            out, err = p.communicate(timeout=1800)
            assert out, err[-2000:]
            results += json.loads(out.strip().splitlines()[-1])
            rc = max(rc, p.returncode)
    finally:  # (a timeout or a failed group: no compiler left running)
        for p in procs:
            p.kill()
    return results, rc


def test_every_kernel_compiles_for_rocm_and_cuda_targets():
    from kvqref.kernels.aot import DECODE_CASES, DIRECT_CASES, SHARED_KERNELS, TARGETS, WRITE_CASES

    results, returncode = _compile_all_targets(TARGETS)
    failed = [r for r in results if not r["ok"]]
    assert not failed, failed[:3]
    per_target = {t: [r for r in results if r["target"] == t] for t in TARGETS}
    for t, rows in per_target.items():
        # 2 precisions; + the merge kernel, q's rotation and the rotated merge; on CUDA + the inline-PTX FP4
        # unpacking of each FP4 case (``ptx_unpack``)
        ptx = sum("fp4" in c[1] + c[3] for c in DECODE_CASES) if t.startswith("cuda") else 0
        # + the KIVI write cases with float16 roundings by conversion instructions (``f16_cvt``)
        f16cvt = sum("kivi" in c[0] for c in WRITE_CASES)
        # + fast-mode KIVI values in the value-row layout that is not the default (``value_rows``)
        rows_off = sum("kivi" in c[3] for c in DECODE_CASES)
        # + FP4 keys with tokens as rows (``fp4_keys_by_token``), every target
        kt4 = sum("fp4" in c[1] for c in DECODE_CASES)
        # + fast-mode KIVI keys with the scale folded into q (``key_tile=False``)
        ktile_off = sum("kivi" in c[1] for c in DECODE_CASES)
        # + fast-mode KIVI keys by token-group rows (``key_rows``) where the values are KIVI too: the paged splits
        # and the residual split, its own launch (``residual_launch``), and the key rows with the codes as bytes
        # (``kivi_words=False``)
        key_rows = sum("kivi" in c[1] and "kivi" in c[3] for c in DECODE_CASES)
        # + the rotated write cases by their other butterfly routes (``rotation_route``): split/join or sums (the
        # one that is not the default), gather, and on CUDA the warp shuffles
        sums = sum("rotation" in c[1] for c in WRITE_CASES) * (3 if t.startswith("cuda") else 2)
        # + rotated FP4 and KIVI writes loading element pairs as 32-bit words (``word_load``): the portable default
        # route, and for the FP4 kinds on CUDA the warp shuffles
        word_loads = sum("rotation" in c[1] and c[0] in ("fp4_e2m1", "mxfp4", "nvfp4") for c in WRITE_CASES) * (
            2 if t.startswith("cuda") else 1) + sum("rotation" in c[1] and "kivi" in c[0] for c in WRITE_CASES)
        # + unrotated NVFP4 writes with whole blocks per thread (``nvfp4_blocks``), every target
        nvb = sum(c[0] == "nvfp4" and "rotation" not in c[1] for c in WRITE_CASES)
        # + unrotated KIVI key writes by channel blocks: block_d 64 (1 warp, store_as_loaded), block_d 32 (2 warps)
        blocks = 2 * sum(c[1].get("role") == "key" and "rotation" not in c[1] for c in WRITE_CASES)
        # + FP4 block rows whose values (blocks of 16: 32 rows at 4 query heads per KV head) split into channel
        # halves read as words by default: their byte tiles (``value_words=False``)
        vw_off = sum("fp4" in c[1] and c[3] in ("fp4_e2m1", "nvfp4") for c in DECODE_CASES)
        # + FP8 values as 16-bit words (``fp8_value_words``; V without token scales): by inline PTX on CUDA where
        # the format converts in hardware (OCP), portable elsewhere
        vw8 = sum(c[3].startswith("fp8") and c[4].get("granularity") != "token_head" for c in DECODE_CASES)
        # + on CUDA the same at 64-token tiles (fast FP8's default on the H200 since session 28)
        bn64 = vw8 if t.startswith("cuda") else 0
        # + one split writing the outputs itself (``direct_output``): bf16 (at the NVIDIA launch, ``BF16_WIDE``), FP8
        # and rotated FP8 (its V un-rotated by the split kernel)
        direct = sum(c[0] in DIRECT_CASES for c in DECODE_CASES)
        # + on CUDA the key rows with the codes unpacked by inline PTX (their default on NVIDIA GPUs)
        kr_ptx = key_rows if t.startswith("cuda") else 0
        # + on CUDA the KIVI write cases by float16 pairs in inline PTX (``kivi_f16x2``, their default on NVIDIA GPUs)
        x2 = f16cvt if t.startswith("cuda") else 0
        # + per-element FP4 tiles as two-axis tiles (``fp4_tiles_2d``): NVFP4 on every target, fp4_e2m1 on CUDA
        t2d = 2 if t.startswith("cuda") else 1
        # + on CUDA a split launch letting the merge start early (``GDC``, plan_decode's ``pdl``); the merge waiting
        # for it (merge[pdl]) is one of SHARED_KERNELS, compiled for CUDA targets only
        gdc = 1 if t.startswith("cuda") else 0
        # + fp8_e4m3 (per-tile loop) and int4 KIVI key rows (head-major pages) with each next tile's page ids read
        # one step ahead (``page_ids_ahead``), nvfp4 (block rows; ahead by default) with them read in the step, every
        # target
        pida = 3
        # + 2-bit KIVI key words' value products in 4 chunks at 2 warps (``kivi_value_chunks``; default: one per warp),
        # and their value scales as words (``kivi_value_scale_words``, value groups of 32) with the page ids ahead
        vch = 2
        # + 4-bit KIVI key words with a softmax state per value chunk (``kivi_chunk_softmax``, value groups of 32)
        csm = 1
        # + fp4_e2m1 and nvfp4 block rows with the key products transposed or not, whichever their default is not
        # (``key_products_transposed``), every target
        kpt = 2
        # + the same two with q's block rows read at a stride of 2 (``q_rows_load``), every target
        qld = 2
        assert len(rows) == (2 * len(DECODE_CASES) + len(SHARED_KERNELS) - (1 - gdc) + len(WRITE_CASES) + ptx + f16cvt
                             + rows_off + kt4 + ktile_off + 3 * key_rows + sums + nvb + blocks + vw_off + vw8
                             + direct + kr_ptx + word_loads + x2 + bn64 + t2d + gdc + pida + vch + csm + kpt
                             + qld), t
        assert sum(",kpt=" in r["kernel"] and r["ok"] for r in rows) == kpt, t
        assert sum(",qld=strided]" in r["kernel"] and r["ok"] for r in rows) == qld, t
        assert sum(r["kernel"] in ("decode[int2_kivi,kr=1,vch=4]", "decode[int2_kivi,kr=1,vsw=1,pida=1]") and r["ok"]
                   for r in rows) == vch, t
        assert sum(r["kernel"] == "decode[int4_kivi,kr=1,kw=1,csm=8]" and r["ok"] for r in rows) == csm, t
        pida_rows = ("decode[fp8_e4m3,pida=1]", "decode[nvfp4,pida=0]", "decode[int4_kivi,kr=1,pida=1]")
        assert sum(r["kernel"] in pida_rows and r["ok"] for r in rows) == pida, t
        facts = {r["kernel"]: r.get("ptx_facts", {}) for r in rows}
        gdc_rows = [k for k in facts if k.endswith(",gdc]")]
        assert len(gdc_rows) == gdc, t
        if gdc:  # the instructions are there, and only in these launches
            assert facts["merge[pdl]"]["gdc_wait"] >= 1 and facts[gdc_rows[0]]["gdc_launch"] >= 1, t
            assert sum(f["gdc_wait"] + f["gdc_launch"] for k, f in facts.items()
                       if k not in ("merge[pdl]", gdc_rows[0])) == 0, t
        assert sum(r["kernel"].endswith(",t2d]") and r["ok"] for r in rows) == t2d, t
        assert sum(r["kernel"].endswith(",x2]") and r["ok"] for r in rows) == x2, t
        assert word_loads and sum(",words," in r["kernel"] and r["ok"] for r in rows) == word_loads, t
        assert sum(r["kernel"].endswith(",kr=1,ptx]") and r["ok"] for r in rows) == kr_ptx, t
        assert sum(r["kernel"].endswith(",direct]") and r["ok"] for r in rows) == direct == 3, t
        assert sum(",vw=0" in r["kernel"] for r in rows) == vw_off, t
        words = [r["kernel"] for r in rows if ",vw8=" in r["kernel"] and not r["kernel"].endswith(",bn=64]")]
        assert len(words) == vw8 and all(r["ok"] for r in rows if ",vw8=" in r["kernel"]), t
        assert sum(r["kernel"].endswith(",bn=64]") and r["ok"] for r in rows) == bn64, t
        assert ("decode[fp8_e4m3,vw8=2]" in words) == t.startswith("cuda"), (t, words)
        assert key_rows and sum(r["kernel"].endswith(",kr=1]") and r["ok"] for r in rows) == key_rows, t
        assert sum(r["kernel"].endswith(",kr=1,part=2]") and r["ok"] for r in rows) == key_rows, t
        assert sum(r["kernel"].endswith(",kr=1,kw=0]") and r["ok"] for r in rows) == key_rows, t
        assert nvb and all(r["ok"] for r in rows if r["kernel"].endswith(",blocks]")), t
        assert blocks and sum(",block_d=" in r["kernel"] for r in rows) == blocks, t
        assert {r["kernel"] for r in rows} >= {*(k for k in SHARED_KERNELS if k != "merge[pdl]" or gdc),
                                               "decode[fp8_e4m3+H]", "write[fp4_e2m1-hadamard-5]"}
        assert all(r["code_bytes"] > 1000 for r in rows)
        shfl = [r for r in rows if r["kernel"].endswith(",shfl]")]  # lane masks checked against each layout
        assert all(r["shuffles_checked"] > 0 for r in shfl) and len(shfl) == (7 if t.startswith("cuda") else 0), t
        if t.startswith("cuda"):  # the write kernel's bytes rest on IEEE float32 (docs/kernels.md, write kernel)
            for r in (r for r in rows if r["kernel"].startswith("write[")):
                facts = r["ptx_facts"]
                assert facts["ftz"] == 0 and facts["neg_by_sub"] == 0, (t, r["kernel"], facts)
                # only KIVI divides by an approximate reciprocal (any r within 2**-21 of 1/scale, corrected)
                assert facts["approx_div"] == 0 or "kivi" in r["kernel"], (t, r["kernel"], facts)
    assert returncode == 0


def test_ptx_facts_find_what_breaks_exact_float32():
    """The PTX checks above can fail: Triton 3.6's unary minus (``0.0 - x`` through a zero register), an
    approximate division, flush-to-zero; the grid dependency control instructions are counted (comments left out)."""
    from kvqref.kernels.aot import ptx_facts

    ptx = """
        mov.b32 	%r14, 0f00000000;
        sub.f32 	%r15, %r14, %r9;     // -x
        sub.f32 	%r16, %r9, %r14;     // x - 0: not a negation
        div.full.f32 	%r17, %r15, %r16;
        add.rn.ftz.f32 	%r18, %r17, %r17;
        fma.rn.f32 	%r19, %r18, %r17, %r16;
    """
    assert ptx_facts(ptx) == {"approx_div": 1, "ftz": 1, "neg_by_sub": 1, "gdc_wait": 0, "gdc_launch": 0}
    # and the grid dependency control of the programmatic dependent merge launch (plan_decode's ``pdl``)
    gdc = ptx_facts("griddepcontrol.launch_dependents;\n    griddepcontrol.wait; // griddepcontrol.wait\n")
    assert (gdc["gdc_launch"], gdc["gdc_wait"]) == (1, 1), gdc


def test_a_target_that_cannot_compile_fails_loudly():
    """A target the compiler cannot build for gives a nonzero exit and a FAIL line per variant (two variants here,
    ``--only``: every variant took about two minutes on CI's two cores); ``--only`` matching no variant is an error,
    not an empty success."""
    proc = _run("--targets", "hip:gfx000", "--only", "decode[bf16")
    assert proc.returncode != 0 and proc.stdout.count("FAIL hip:gfx000") >= 2, proc.stdout[-2000:]
    proc = _run("--targets", "hip:gfx942", "--only", "no-such-kernel")
    assert proc.returncode == 2 and "no kernel variant matches" in proc.stderr


_NVFP4_SHARED = """
import warnings, numpy as np, torch
from kvqref import schemes
from kvqref.backends import triton_backend as tb
from kvqref.backends._aot import make_target
from kvqref.kernels import decode
from kvqref.kernels.aot import _hw_formats, compile_launch
from kvqref.paged import PagedKVCache
decode._nvidia_cuda = lambda t: True  # planned as for an NVIDIA GPU
rng = np.random.default_rng(0)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    cache = PagedKVCache(schemes.get("nvfp4"), schemes.get("nvfp4"), 24, 16, 2, 128, batch=2)
    for b in range(2):
        cache.append(b, rng.standard_normal((140, 2, 128)), rng.standard_normal((140, 2, 128)))
    dc = tb.DeviceCache.from_cache(cache, "cpu").with_layout("HND")
    q = torch.zeros(2, 16, 128, dtype=torch.bfloat16)  # 8 query heads per KV head
    for t2d in (None, True):
        launches, _, _ = decode.plan_decode(q, dc.k.tiles(), dc.v.tiles(), dc.block_table, dc.seq_lens, 16,
                                            max_seq_len=140, num_splits=1, hw_formats=_hw_formats("cuda:90"),
                                            ptx_unpack=True, fp4_tiles_2d=t2d)
        split = next(la for la in launches if la.kernel is decode.decode_split_kernel)
        assert not split.constexprs["BLK"] and split.constexprs["BLOCK_N"] == 128
        print(int(split.constexprs["T2D"]), compile_launch(split, make_target("cuda", 90)).metadata.shared)
"""


def test_nvfp4_per_element_halves_share_one_shared_memory_buffer():
    """NVFP4 per element (8 query heads per KV head: 128-token tiles, 2 warps) multiplies the low and the high
    nibbles' float16 tiles one after the other; each half must be built right before its product so that their
    layout conversions reuse one [128, 64] shared-memory buffer (16 KB). Built both first (session 29, unnoticed), the
    program took 58 KB instead of 42 on sm_90 and decoded 64 q / 8 KV heads x 16,384 in 1,122 us instead of 948 (H200,
    bench/results/ANALYSIS.md, session 30): the bound below fails that kernel. Default and two-axis tiles."""
    proc = subprocess.run([sys.executable, "-c", _NVFP4_SHARED], capture_output=True, text=True, env=_env(),
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shared = dict(tuple(map(int, line.split())) for line in proc.stdout.split("\n") if line.strip())
    assert set(shared) == {0, 1}
    assert all(v <= 48 * 1024 for v in shared.values()), shared
