"""Conformance of a backend against the NumPy oracle: the bytes it stores and the attention it computes.

``check(backend_name)`` runs a quick sample (``quick=True``: small ragged caches, every scheme and engine
profile the kernels implement) and returns one :class:`Result` per (case, check). What each backend is
held to:

* ``numpy`` (the oracle itself, through the paged cache): the bytes in the pages equal
  ``scheme.quantize`` of each whole sequence with the cache's frozen params, and ``decode_attention``
  equals :func:`kvqref.reference.attention` on the dequantized whole sequences (within the float32-kernel
  tolerance, which an exact match trivially meets).
* ``torch`` (dequantize, then SDPA): it stores no bytes of its own, so "values": its float32 dequantization
  of every stored slot is within 1 float32 ulp of the oracle's values (NVFP4 rounds ``e4m3(s) * g`` to
  float32 before the element product, so a few values differ by 1 ulp; the count is reported);
  "attention": its SDPA run in float32 is within :func:`kvqref.reference.kernel_tolerance` of the oracle
  (the bfloat16 default's relative error is reported alongside: a precision choice, not a bug).
* ``triton``: "bytes": its quantize-on-write kernel writes the oracle's bytes into a shuffled paged cache;
  "attention": its fused decode (``precision="exact"``) is within :func:`kvqref.reference.kernel_tolerance`
  of the oracle.

Without a GPU the triton backend needs ``TRITON_INTERPRET=1`` in the environment before Python starts.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvqref import reference, schemes
from kvqref.paged import PagedKVCache

#: (label, K scheme, K options, V scheme, V options): the attention cases
PAIRS: tuple[tuple[str, str, dict[str, Any], str, dict[str, Any]], ...] = (
    ("bf16", "bf16", {}, "bf16", {}),
    ("fp8_e4m3 (vllm)", "fp8_e4m3", {}, "fp8_e4m3", {}),
    ("fp8_e4m3 head / fp8_e5m2 token_head", "fp8_e4m3", {"granularity": "head"},
     "fp8_e5m2", {"granularity": "token_head"}),
    ("fp8 rocm (e4m3fnuz / e5m2fnuz)", "fp8_e4m3", {"profile": "rocm"}, "fp8_e5m2", {"profile": "rocm"}),
    ("fp8_e4m3 sglang", "fp8_e4m3", {"profile": "sglang", "scale": 1.0},
     "fp8_e4m3", {"profile": "sglang", "scale": 0.02}),
    ("fp4_e2m1 ocp / sglang", "fp4_e2m1", {}, "fp4_e2m1", {"profile": "sglang"}),
    ("mxfp4 / nvfp4", "mxfp4", {}, "nvfp4", {}),
    ("int4_kivi", "int4_kivi", {"role": "key", "group_size": 16, "residual": 32},
     "int4_kivi", {"role": "value", "group_size": 16, "residual": 32}),
    ("int2_kivi", "int2_kivi", {"role": "key", "group_size": 16, "residual": 16},
     "int2_kivi", {"role": "value", "group_size": 32, "residual": 16}),
)

#: (scheme, options): the quantize-on-write cases (one side of a cache each)
WRITES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("bf16", {}), ("fp8_e4m3", {}), ("fp8_e5m2", {"granularity": "head"}),
    ("fp8_e4m3", {"granularity": "token_head"}), ("fp8_e4m3", {"profile": "rocm", "scale": 0.03}),
    ("fp8_e5m2", {"profile": "rocm"}), ("fp8_e4m3", {"profile": "sglang", "scale": 0.004}),
    ("fp4_e2m1", {}), ("fp4_e2m1", {"profile": "sglang"}), ("mxfp4", {}), ("nvfp4", {}),
    ("int4_kivi", {"role": "value", "group_size": 32}), ("int2_kivi", {"role": "value", "group_size": 16}),
    ("int4_kivi", {"role": "key", "group_size": 16}), ("int2_kivi", {"role": "key", "group_size": 32}),
)

QUICK = dict(batch=3, kv_heads=2, q_heads=4, head_dim=64, page_size=16, lens=(1, 37, 70), write_tokens=64)
FULL = dict(batch=4, kv_heads=8, q_heads=32, head_dim=128, page_size=16, lens=(1, 300, 1000, 2500),
            write_tokens=256)


@dataclass
class Result:
    backend: str
    check: str  # "bytes", "values" or "attention"
    case: str
    passed: bool
    detail: str
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _opts(o: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in o.items())


def write_label(name: str, opts: dict[str, Any]) -> str:
    return f"{name} ({_opts(opts)})" if opts else name


def kv_tensor(rng: np.random.Generator, n: int, kv_heads: int, head_dim: int, outliers: bool) -> np.ndarray:
    """float32 K/V tokens: Gaussian, optionally with three 10-100x outlier channels (KIVI's key structure)."""
    x = rng.standard_normal((n, kv_heads, head_dim))
    if outliers:
        x[:, :, rng.choice(head_dim, 3, replace=False)] *= rng.uniform(10, 100, 3)
    return x.astype(np.float32)


def build_cache(pair, shape: dict[str, Any], rng: np.random.Generator, chunks: int = 3):
    """A paged cache filled by ragged appends in several chunks (crossing page and group boundaries), pages
    drawn from a shuffled free list. Returns the cache and, per sequence, the whole (K, V) appended."""
    _, kname, kopt, vname, vopt = pair
    batch, kvh, d, page = shape["batch"], shape["kv_heads"], shape["head_dim"], shape["page_size"]
    lens = list(shape["lens"])[:batch]
    per_seq_pages = -(-max(lens) // page) + 1
    npages = batch * per_seq_pages + 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = PagedKVCache(schemes.get(kname, **kopt), schemes.get(vname, **vopt), npages, page, kvh, d,
                             batch=batch, max_pages=per_seq_pages,
                             free_pages=[int(p) for p in rng.permutation(npages)])
        whole = []
        for b, T in enumerate(lens):
            cuts = np.sort(rng.choice(np.arange(1, T), min(chunks - 1, T - 1), replace=False)) if T > 1 else []
            ks, vs = [], []
            for lo, hi in zip([0, *cuts], [*cuts, T], strict=True):
                k = kv_tensor(rng, hi - lo, kvh, d, outliers=True)
                v = kv_tensor(rng, hi - lo, kvh, d, outliers=False)
                cache.append(b, k, v)
                ks.append(k)
                vs.append(v)
            whole.append((np.concatenate(ks), np.concatenate(vs)))
    return cache, whole


def kivi_key_round(cache: PagedKVCache, Ks):
    """For KIVI keys, the magnitudes whose product with q a fast-mode kernel rounds (``K_round`` of
    :func:`kvqref.reference.kernel_tolerance`): ``K - Z = s * code`` on the paged tokens (Z: the group's zero
    point), K on the residual tokens; None for other schemes. ``Ks``: the values the kernel reads (the stored
    domain of ``cache``: pass ``cache.storage_view()``'s for a rotated cache)."""
    from kvqref.schemes.rotation import storage_scheme

    codec = storage_scheme(cache.k.scheme)
    if not isinstance(codec, schemes.KiviScheme):
        return None
    out = []
    for b, K in enumerate(Ks):
        qz = cache.quantized(b, "k")
        z = np.repeat(qz.fields["zero"].astype(np.float64), codec.group_size, axis=0)
        out.append(K - np.concatenate([z, np.zeros((K.shape[0] - z.shape[0], *K.shape[1:]))]))
    return out


def kivi_key_scale(cache: PagedKVCache, Ks):
    """For KIVI keys, each token's group scale per channel (``K_scale`` of
    :func:`kvqref.reference.kernel_tolerance`: the factor key rows fold into q), 0 on the residual tokens; None
    for other schemes. ``Ks`` as for :func:`kivi_key_round` (only their shapes are read)."""
    from kvqref.schemes.rotation import storage_scheme

    codec = storage_scheme(cache.k.scheme)
    if not isinstance(codec, schemes.KiviScheme):
        return None
    out = []
    for b, K in enumerate(Ks):
        s = np.repeat(cache.quantized(b, "k").fields["scale"].astype(np.float64), codec.group_size, axis=0)
        out.append(np.concatenate([s, np.zeros((K.shape[0] - s.shape[0], *K.shape[1:]))]))
    return out


def _oracle_attention(cache: PagedKVCache, q64: np.ndarray):
    Ks, Vs = zip(*(cache.dequantized(b) for b in range(cache.batch)), strict=True)
    out, lse = reference.attention(q64, Ks, Vs)
    tol_o, tol_l = reference.kernel_tolerance(q64, Ks, Vs)
    return out, lse, tol_o, tol_l


def _attention_detail(out, ref, tol) -> tuple[bool, str]:
    if not np.isfinite(out).all():
        return False, "non-finite output"
    err = np.abs(out - ref)
    bad = int((err > tol).sum())
    return bad == 0, f"max |err| {err.max():.3g}; {bad} of {err.size} beyond tolerance"


# -- numpy ---------------------------------------------------------------------------------------
def _numpy_bytes(cache: PagedKVCache, whole) -> tuple[bool, str]:
    differ = 0
    total = 0
    for b, (k, v) in enumerate(whole):
        for which, side, x in (("k", cache.k, k), ("v", cache.v, v)):
            n = int(side.paged[b])
            if not n:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                want = side.scheme.quantize(x[:n], params=side.params)
            got = cache.quantized(b, which)
            for f in want.fields:
                a, e = np.ascontiguousarray(got.fields[f]), np.ascontiguousarray(want.fields[f])
                d = a.view(np.uint8) != e.view(np.uint8)
                differ += int(d.sum())
                total += d.size
    return differ == 0, f"{differ} of {total} bytes differ"


def _numpy_attention(cache: PagedKVCache, whole, q64: np.ndarray) -> tuple[bool, str]:
    Ks, Vs = [], []
    for b, (k, v) in enumerate(whole):
        parts = []
        for side, x in ((cache.k, k), (cache.v, v)):
            n = int(side.paged[b])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                deq = side.scheme.dequantize(side.scheme.quantize(x[:n], params=side.params)) if n else \
                    np.zeros((0, *x.shape[1:]))
            parts.append(np.concatenate([deq, x[n:].astype(np.float64)]))
        Ks.append(parts[0])
        Vs.append(parts[1])
    ref, _ = reference.attention(q64, Ks, Vs)
    tol, _ = reference.kernel_tolerance(q64, Ks, Vs)
    out, _ = reference.decode_attention(q64, cache)
    return _attention_detail(out, ref, tol)


# -- torch / triton --------------------------------------------------------------------------------
def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _torch_values(cache: PagedKVCache) -> tuple[bool, str]:
    from kvqref.backends import get
    from kvqref.backends.torch_backend import dequantize, gather

    dc = get("torch").prepare(cache)
    k, v, _ = gather(dc, dequantize(dc.k), dequantize(dc.v))
    one_ulp = beyond = total = 0
    for s in range(cache.batch):
        K, V = cache.dequantized(s)
        T = K.shape[0]
        for got, want in ((k, K), (v, V)):
            g = np.ascontiguousarray(got[s, :, :T].transpose(0, 1).cpu().numpy().astype(np.float32))
            w = np.ascontiguousarray(np.float32(want))
            ulps = np.abs(g.view(np.int32).astype(np.int64) - w.view(np.int32).astype(np.int64))
            one_ulp += int((ulps == 1).sum())
            beyond += int((ulps > 1).sum())
            total += ulps.size
    return beyond == 0, (f"{total - one_ulp - beyond} of {total} float32 values equal the oracle's; "
                         f"{one_ulp} differ by 1 ulp; {beyond} by more")


def _torch_attention(cache: PagedKVCache, q: np.ndarray) -> tuple[bool, str]:
    import torch

    from kvqref.backends import get
    from kvqref.backends.torch_backend import decode

    b = get("torch")
    dc = b.prepare(cache)
    qt = torch.from_numpy(q).to(b.device())
    out32, _ = decode(qt, dc, dtype=torch.float32)
    out16, _ = b.decode(qt, dc)
    ref, _, tol, _ = _oracle_attention(cache, q.astype(np.float64))
    ok, detail = _attention_detail(out32.cpu().numpy().astype(np.float64), ref, tol)
    rel16 = np.abs(out16.cpu().numpy().astype(np.float64) - ref).max() / np.abs(ref).max()
    return ok, f"float32 SDPA: {detail}; bfloat16 SDPA (the default): max |err| / max |out| = {rel16:.2g}"


def _triton_attention(cache: PagedKVCache, q: np.ndarray) -> tuple[bool, str]:
    import torch

    from kvqref.backends import triton_backend as tb

    dev = _device()
    dc = tb.DeviceCache.from_cache(cache, dev)
    out, lse = tb.decode(torch.from_numpy(q).to(dev), dc, precision="exact")  # the float32 tolerance
    out = out.cpu().numpy().astype(np.float64)
    lse = lse.cpu().numpy().astype(np.float64)
    ref, ref_lse, tol_o, tol_l = _oracle_attention(cache, q.astype(np.float64))
    ok, detail = _attention_detail(out, ref, tol_o)
    lse_bad = int((np.abs(lse - ref_lse) > tol_l).sum())
    return ok and lse_bad == 0, f"{detail}; lse: {lse_bad} beyond tolerance"


def triton_write_matches(name: str, opts: dict[str, Any], x: np.ndarray, page_size: int,
                         rng: np.random.Generator, dtype: str = "float32",
                         launch: dict[str, Any] | None = None, layout: str = "NHD") -> tuple[bool, str]:
    """Quantize ``x`` into a shuffled paged cache with the oracle and with the triton write kernel; compare
    every stored byte as integers. Returns (all equal, what differed). ``dtype``: the input is given to both
    as that dtype (``x`` must hold values of it: bfloat16, float16 or float32); ``launch``: launch options of
    the write kernel (``triton_backend.plan_write``'s keywords); ``layout``: the device cache's field layout
    (``"NHD"`` or ``"HND"``), read back slot by slot."""
    import torch

    from kvqref.backends import triton_backend as tb
    from kvqref.schemes.rotation import storage_scheme

    dev = _device()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scheme = schemes.get(name, **opts)
    T, H, D = x.shape
    npages = -(-T // page_size) + 1
    is_key = getattr(scheme, "role", None) == "key"
    dummy = schemes.get("bf16")
    if getattr(scheme, "residual_window", 0):
        scheme.residual_window = storage_scheme(scheme).residual_window = 0
    cache = PagedKVCache(scheme if is_key else dummy, dummy if is_key else scheme, npages, page_size, H, D,
                         free_pages=[int(p) for p in rng.permutation(npages)])
    if dtype == "bfloat16":
        import ml_dtypes  # only here: the conformance command itself needs no ml_dtypes

        xin = x.astype(ml_dtypes.bfloat16)
    else:
        xin = x.astype({"float16": np.float16, "float32": np.float32}[dtype])
    if not np.array_equal(xin.astype(np.float64), x.astype(np.float64)):
        raise ValueError(f"triton_write_matches: x holds values that are not {dtype} values")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache.append(0, xin, xin)
    side_np = cache.k if is_key else cache.v
    n = int(side_np.paged[0])
    dc = tb.DeviceCache.from_cache(cache, dev, layout=layout)
    side = dc.k if is_key else dc.v
    for t in side.fields.values():
        t.zero_()
    slots = torch.from_numpy(cache.slot_mapping(0, 0, n)).to(dev)
    tb.quantize_write(side, torch.from_numpy(np.ascontiguousarray(x[:n], np.float32)).to(getattr(torch, dtype))
                      .to(dev), slots, **(launch or {}))
    differ = total = 0
    for f, store in side_np.storage.items():
        got = side.slot_rows(f).cpu()
        got = got.view(torch.int16) if got.dtype == torch.bfloat16 else got
        want = store.reshape(-1, *store.shape[2:])
        want = torch.from_numpy(want.view(np.int16) if want.dtype == np.uint16 else want)
        d = got.contiguous().view(torch.uint8) != want.contiguous().view(torch.uint8)
        differ += int(d.sum())
        total += d.numel()
    return differ == 0, f"{differ} of {total} bytes differ"


def write_input(rng: np.random.Generator, tokens: int, kv_heads: int = 2, head_dim: int = 64) -> np.ndarray:
    """K/V tokens for the write checks, with planted edge cases: an all-zero token (zero blocks, constant
    groups), E2M1 ties, and a deep-underflow element."""
    x = kv_tensor(rng, tokens, kv_heads, head_dim, outliers=True)
    x[3, 0] = 0.0
    x[7, 1, :16] = np.array([2.5, -5.0, 0.25, 0.75, 1.25, 1.75, 3.5, 5.0] * 2) * 2.0**3
    x[9, 0, 4] = 1e-30
    return x


# -- driver ------------------------------------------------------------------------------------------
def check(backend_name: str, quick: bool = True, seed: int = 0,
          progress: Callable[[str], None] | None = None) -> list[Result]:
    """Run the conformance sample for ``backend_name`` (which must be available: see
    :func:`kvqref.backends.get`). ``progress(label)`` is called after every result."""
    from kvqref import backends

    backends.get(backend_name)  # KeyError / RuntimeError with the reason, before any work
    shape = QUICK if quick else FULL
    results: list[Result] = []

    def record(check_name: str, case: str, fn: Callable[[], tuple[bool, str]]) -> None:
        t0 = time.perf_counter()
        try:
            ok, detail = fn()
        except Exception as e:  # a backend that crashes on a case fails that case, and says how
            ok, detail = False, f"{type(e).__name__}: {e}"
        results.append(Result(backend_name, check_name, case, bool(ok), detail, time.perf_counter() - t0))
        if progress:
            progress(f"{backend_name} {check_name} {case}")

    for i, pair in enumerate(PAIRS):
        rng = np.random.default_rng([seed, i])
        cache, whole = build_cache(pair, shape, rng)
        q = rng.standard_normal((shape["batch"], shape["q_heads"], shape["head_dim"])).astype(np.float32)
        label = pair[0]
        if backend_name == "numpy":
            record("bytes", label, lambda c=cache, w=whole: _numpy_bytes(c, w))
            record("attention", label, lambda c=cache, w=whole, q=q: _numpy_attention(c, w, q.astype(np.float64)))
        elif backend_name == "torch":
            record("values", label, lambda c=cache: _torch_values(c))
            record("attention", label, lambda c=cache, q=q: _torch_attention(c, q))
        elif backend_name == "triton":
            record("attention", label, lambda c=cache, q=q: _triton_attention(c, q))
        else:
            raise KeyError(f"no conformance checks for backend {backend_name!r}")
    if backend_name == "triton":
        for j, (name, opts) in enumerate(WRITES):
            rng = np.random.default_rng([seed, 100 + j])
            x = write_input(rng, shape["write_tokens"])
            page = max(16, opts.get("group_size", 1))
            record("bytes", write_label(name, opts), lambda n=name, o=opts, x=x, p=page, r=rng:
                   triton_write_matches(n, o, x, p, r))
    return results


def expected_count(backend_name: str) -> int:
    """Number of results :func:`check` returns for ``backend_name``."""
    return len(PAIRS) + len(WRITES) if backend_name == "triton" else 2 * len(PAIRS)


def summary(results: list[Result]) -> dict[str, dict[str, int]]:
    """{backend: {"passed": n, "failed": m}}."""
    out: dict[str, dict[str, int]] = {}
    for r in results:
        d = out.setdefault(r.backend, {"passed": 0, "failed": 0})
        d["passed" if r.passed else "failed"] += 1
    return out


#: (model dtype, float32 bits per step of that dtype near a normal value): the dtypes engine profiles serve
_DTYPE_STEP = {"bfloat16": 1 << 16, "float32": 1}
SMALLEST_SUBNORMAL = {"bfloat16": 2.0**-133, "float16": 2.0**-24, "float32": 2.0**-149}
BINADE_EXPONENTS = {"bfloat16": (-40, -34, -33, -20, -1, 0, 6, 60, 125),
                    "float16": (-20, -16, -14, -1, 0, 6, 13),
                    "float32": (-40, -34, -33, -1, 0, 6, 100, 125)}


def dtype_neighbours(v: float, dtype: str) -> list[float]:
    """[previous, v, next]: ``v`` (positive, representable in ``dtype``) and its neighbours in ``dtype``,
    from adjacent bit patterns."""
    if dtype == "float16":
        bits = np.array([v], np.float16).view(np.uint16)
        return [float((bits + d).view(np.float16)[0]) if d >= 0 else float((bits - 1).view(np.float16)[0])
                for d in (-1, 0, 1)]
    bits = np.array([v], np.float32).view(np.uint32)
    step = np.uint32(_DTYPE_STEP[dtype])
    return [float((bits - step).view(np.float32)[0]), float(v), float((bits + step).view(np.float32)[0])]


def to_dtype_values(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``x`` moved to values representable in ``dtype`` (bfloat16: low 16 bits cleared; float16: via
    NumPy's float16), as float32."""
    x = np.asarray(x, np.float32)
    if dtype == "bfloat16":
        return (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    return x


def binade_edge_blocks(dtype: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """FP4 blocks of 16 whose amax / 6 sits at a power of two 2**k and one ``dtype`` step above and below it
    (amax = the neighbours of 6 * 2**k in ``dtype``, for k in ``BINADE_EXPONENTS[dtype]``), every value
    representable in ``dtype``. Returns (x float32 [blocks, 1, 16], (k, step) per block, step in -1, 0, 1).
    Element 0 is +-amax; element 6 the dtype's smallest subnormal, negated; the others are random in
    (-amax, amax), one of them tiny and negative."""
    rows, tags = [], []
    for k in BINADE_EXPONENTS[dtype]:
        for step, amax in zip((-1, 0, 1), dtype_neighbours(6.0 * 2.0**k, dtype), strict=True):
            blk = rng.uniform(-1, 1, 16) * amax
            blk[0] = amax if len(rows) % 2 == 0 else -amax
            blk[5] = -amax * 2.0**-20
            blk[6] = -SMALLEST_SUBNORMAL[dtype]  # a float32 subnormal for bfloat16 and float32 input
            rows.append(to_dtype_values(np.clip(blk, -amax, amax), dtype))
            tags.append((k, step))
    return np.stack(rows)[:, None, :], np.array(tags)
