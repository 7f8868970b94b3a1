"""pytest-benchmark suites: decode attention and quantize-on-write, one run per backend.

    nox -s bench                                   # CPU: numpy and torch backends, small shapes
    python3 -m pytest bench/test_bench.py --benchmark-json=bench/results/run.json   # GPU machine (no index)

On a GPU the triton and torch backends run the issue's shapes; each result's ``extra_info`` records the
device, versions, shape, scheme, bytes moved, GB/s from a CUDA-event median (``triton.testing.do_bench``)
and the fraction of a bandwidth ceiling measured in the same session. On a CPU the numpy (oracle) and
torch backends run small shapes so that users without a GPU can run the suite; GPU numbers are the ones
the README quotes. Nothing here asserts a speed.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

torch = pytest.importorskip("torch")
pytest.importorskip("pytest_benchmark")

import decode_bench as db  # noqa: E402

GPU = torch.cuda.is_available()
GPU_SHAPES = [*db.SHAPES]  # -k "32x32x8x128x8192" selects the first
CPU_SHAPES = [(2, 8, 2, 128, 512)]
LABELS = [s[0] for s in db.SCHEMES]


@pytest.fixture(scope="session")
def ceiling() -> float:
    return db.bandwidth_ceiling_gbs() if GPU else float("nan")


@pytest.fixture(scope="session")
def env() -> dict:
    return db.environment()


def _record(benchmark, env, ceiling, row: dict) -> None:
    benchmark.extra_info.update(env)
    benchmark.extra_info.update(row)
    benchmark.extra_info["ceiling_gbs"] = ceiling
    if "gbs" in row:
        benchmark.extra_info["fraction_of_ceiling"] = row["gbs"] / ceiling if ceiling == ceiling else None


def _cpu_cache(label: str, shape):
    from kvqref import schemes
    from kvqref.paged import PagedKVCache

    batch, _, kv_heads, head_dim, tokens = shape
    _, name, kopt, vopt = next(s for s in db.SCHEMES if s[0] == label)
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        page = 32
        cache = PagedKVCache(
            schemes.get(name, **kopt),
            schemes.get(name, **vopt),
            batch * tokens // page,
            page,
            kv_heads,
            head_dim,
            batch=batch,
        )
        for b in range(batch):
            cache.append(
                b, rng.standard_normal((tokens, kv_heads, head_dim)), rng.standard_normal((tokens, kv_heads, head_dim))
            )
    return cache


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("shape", GPU_SHAPES if GPU else CPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("backend", ["triton", "torch"] if GPU else ["numpy", "torch"])
def test_decode(benchmark, backend, shape, label, env, ceiling):
    if GPU:
        if backend == "torch" and shape != GPU_SHAPES[0]:
            pytest.skip("the unfused baseline is measured at the first shape only (it materializes BF16)")
        call, rec = db.decode_setup(label, shape, 16, backend=backend)
        row = db.timed(call, rec, graph=backend == "triton")  # the torch backend synchronizes: timed eager

        def fn():
            call()
            torch.cuda.synchronize()
    else:
        from kvqref import backends

        cache = _cpu_cache(label, shape)
        b = backends.get(backend)
        state = b.prepare(cache)
        q = np.random.default_rng(1).standard_normal((shape[0], shape[1], shape[3])).astype(np.float32)
        qq = q if backend == "numpy" else torch.from_numpy(q)
        row = {"op": "decode", "backend": backend, "scheme": label, "shape": shape}

        def fn():
            b.decode(qq, state)

    benchmark.pedantic(fn, rounds=10 if GPU else 3, warmup_rounds=2 if GPU else 1)
    _record(benchmark, env, ceiling, row)


@pytest.mark.parametrize("label", LABELS)
def test_quantize_on_write(benchmark, label, env, ceiling):
    if not GPU:
        from kvqref import schemes

        _, name, kopt, _ = next(s for s in db.SCHEMES if s[0] == label)
        scheme = schemes.get(name, **kopt)
        x = np.random.default_rng(0).standard_normal((256, 8, 128)).astype(np.float32)
        benchmark.pedantic(lambda: scheme.quantize(x), rounds=3, warmup_rounds=1)
        _record(benchmark, env, ceiling, {"op": "write", "backend": "numpy", "scheme": label, "tokens": 256})
        return
    call, rec = db.write_setup(label)
    row = db.timed(call, rec)

    def fn():
        call()
        torch.cuda.synchronize()

    benchmark.pedantic(fn, rounds=10, warmup_rounds=2)
    _record(benchmark, env, ceiling, row)
