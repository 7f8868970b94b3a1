"""Helpers for kernel authors' own test suites: hypothesis strategies and assertions against the oracle.

```python
from hypothesis import given
from kvqref import schemes
from kvqref.testing import assert_codes_equal, kv_tensors

@given(kv_tensors(head_dim=64))
def test_my_fp8_quantizer(x):
    want = schemes.get("fp8_e4m3", scale=1.0).quantize(x).fields["codes"]
    assert_codes_equal(my_kernel(x), want, inputs=x)
```

Strategies (need ``hypothesis``, in the ``test`` extra): :func:`kv_tensors` (K/V ``[tokens, kv_heads,
head_dim]`` float32 with outlier channels, optional RoPE and special values), :func:`ragged_lengths`,
:func:`page_tables` (a block table drawn from a shuffled free list). Assertions (NumPy only):
:func:`assert_codes_equal` (names the first differing element, its index, input, expected and actual bit
patterns) and :func:`assert_attention_close`. docs/testing.md has a worked example.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["assert_attention_close", "assert_codes_equal", "kv_tensors", "page_tables", "ragged_lengths"]


# -- assertions ---------------------------------------------------------------------------------------------
def _as_numpy(a: Any) -> np.ndarray:
    if hasattr(a, "detach"):  # a torch tensor (any device); float8/bfloat16 are viewed as raw bits
        t = a.detach().cpu()
        if t.dtype.is_floating_point and t.element_size() in (1, 2) and str(t.dtype) != "torch.float16":
            import torch

            t = t.view(torch.uint8 if t.element_size() == 1 else torch.int16)
        return t.numpy()
    return np.asarray(a)


def _bits(a: np.ndarray) -> np.ndarray:
    """The raw bit patterns of ``a`` as unsigned integers of the same width."""
    a = np.ascontiguousarray(a)
    if a.dtype == np.bool_:
        return a.view(np.uint8)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def _hex(v: Any, itemsize: int) -> str:
    return f"0x{int(v):0{2 * itemsize}X}"


def _describe_input(x: np.ndarray, idx: tuple[int, ...]) -> str:
    try:
        val = x[idx]
    except (IndexError, TypeError):
        return ""
    arr = np.asarray(val)
    if arr.ndim:
        return f"; inputs{list(idx)} = {np.array2string(arr, precision=6, threshold=8)}"
    return f"; input {float(val)!r} ({x.dtype}, bits {_hex(_bits(np.asarray(val)).item(), x.dtype.itemsize)})"


def assert_codes_equal(actual: Any, expected: Any, inputs: Any = None, max_report: int = 5) -> None:
    """Assert that two arrays hold the same bytes (codes, scales, any dtype; NaN codes compare by bits).

    On failure the AssertionError says how many elements differ and, for the first ``max_report`` of them:
    the index, the expected and actual bit patterns in hex (and values for float dtypes) and, when
    ``inputs`` is given, the input there (``inputs`` indexed with the same index, or with its leading axes
    when the codes are packed: e.g. codes ``[T, H, D/2]`` of input ``[T, H, D]`` show the input row).
    ``actual`` and ``expected`` may be NumPy arrays or torch tensors (any device).
    """
    a, e = _as_numpy(actual), _as_numpy(expected)
    if a.shape != e.shape:
        raise AssertionError(f"shape mismatch: actual {a.shape}, expected {e.shape}")
    if a.dtype.itemsize != e.dtype.itemsize:
        raise AssertionError(f"element size mismatch: actual {a.dtype} ({a.dtype.itemsize} bytes), "
                             f"expected {e.dtype} ({e.dtype.itemsize} bytes)")
    ab, eb = _bits(a), _bits(e)
    diff = np.argwhere(ab != eb)
    if not len(diff):
        return
    x = None if inputs is None else _as_numpy(inputs)
    lines = [f"{len(diff)} of {a.size} elements differ ({a.dtype}); first {min(len(diff), max_report)}:"]
    for raw in diff[:max_report]:
        idx = tuple(int(i) for i in raw)
        line = (f"  at index {list(idx)}: expected {_hex(eb[idx], e.dtype.itemsize)}, "
                f"actual {_hex(ab[idx], a.dtype.itemsize)}")
        if e.dtype.kind == "f":
            line += f" (values {float(e[idx])!r} vs {float(a[idx])!r})"
        if x is not None:
            key = idx if x.shape == a.shape else idx[: min(len(idx), x.ndim) - (1 if x.ndim == a.ndim else 0)]
            line += _describe_input(x, key)
        lines.append(line)
    raise AssertionError("\n".join(lines))


def assert_attention_close(out: Any, lse: Any, ref_out: Any, ref_lse: Any, tol_out: Any, tol_lse: Any) -> None:
    """Assert ``|out - ref_out| <= tol_out`` and ``|lse - ref_lse| <= tol_lse`` elementwise (tolerances may be
    scalars or arrays: :func:`kvqref.reference.kernel_tolerance` gives per-element ones). ``lse`` may be None
    (a kernel that returns none). Reports the count beyond tolerance and the worst element, with its index."""
    o, r = _as_numpy(out).astype(np.float64), _as_numpy(ref_out).astype(np.float64)
    if o.shape != r.shape:
        raise AssertionError(f"out shape {o.shape} != reference {r.shape}")
    problems = []
    for name, got, want, tol in (("out", o, r, tol_out), ("lse", lse, ref_lse, tol_lse)):
        if got is None:
            continue
        g = _as_numpy(got).astype(np.float64)
        w = _as_numpy(want).astype(np.float64)
        t = np.broadcast_to(np.asarray(_as_numpy(tol), dtype=np.float64), w.shape)
        if not np.isfinite(g).all():
            bad = np.argwhere(~np.isfinite(g))[0]
            problems.append(f"{name}: non-finite value at index {bad.tolist()}")
            continue
        err = np.abs(g - w)
        over = err > t
        if over.any():
            worst = np.unravel_index(np.argmax(np.where(over, err / np.maximum(t, 1e-300), 0)), err.shape)
            problems.append(f"{name}: {int(over.sum())} of {err.size} beyond tolerance; worst at index "
                            f"{[int(i) for i in worst]}: got {g[worst]!r}, reference {w[worst]!r}, "
                            f"|err| {err[worst]:.3g} > tol {t[worst]:.3g}")
    if problems:
        raise AssertionError("\n".join(problems))


# -- hypothesis strategies ---------------------------------------------------------------------------------
def _st():
    try:
        from hypothesis import strategies as st
    except ImportError as e:  # pragma: no cover - hypothesis is in the test extra
        raise ImportError("kvqref.testing strategies need hypothesis (pip install hypothesis)") from e
    return st


def kv_tensors(tokens: Any = (1, 64), kv_heads: Any = (1, 4), head_dim: int | tuple[int, ...] = (64, 128),
               outliers: bool = True, rope: bool | None = None, specials: bool = False):
    """A strategy for float32 K/V tensors ``[tokens, kv_heads, head_dim]``.

    ``tokens`` / ``kv_heads``: an int or an inclusive ``(lo, hi)`` range; ``head_dim``: an int or a tuple of
    choices. Values: standard normal times ``2**e`` (``e`` in [-12, 12]); with ``outliers``, up to four
    channels per head scaled 10-100x (KIVI's key structure); ``rope``: apply rotary embedding (None: drawn);
    ``specials``: plant zeros, subnormal-range and huge values, and E2M1 tie points.
    """
    st = _st()

    def _int(v):
        return st.just(int(v)) if isinstance(v, int) else st.integers(int(v[0]), int(v[1]))

    dims = st.just(head_dim) if isinstance(head_dim, int) else st.sampled_from(list(head_dim))

    @st.composite
    def build(draw):
        T, H, D = draw(_int(tokens)), draw(_int(kv_heads)), draw(dims)
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((T, H, D)) * 2.0 ** draw(st.integers(-12, 12))
        if outliers:
            n = draw(st.integers(0, min(4, D)))
            if n:
                chans = rng.choice(D, n, replace=False)
                x[:, :, chans] *= rng.uniform(10, 100, n)
        if rope if rope is not None else draw(st.booleans()):
            from kvqref.eval.study import rope as apply_rope

            x = apply_rope(x, np.arange(T))
        if specials:
            flat = x.reshape(-1)
            k = min(8, flat.size)
            where = rng.choice(flat.size, k, replace=False)
            flat[where] = rng.choice([0.0, -0.0, 1e-30, -3e-8, 2.5, -5.0, 0.25, 1e4], k)
        return x.astype(np.float32)

    return build()


def ragged_lengths(batch: Any = (1, 4), max_len: int = 300, min_len: int = 0):
    """A strategy for int32 sequence lengths ``[batch]`` in ``[min_len, max_len]``, including the edges."""
    st = _st()
    b = st.just(int(batch)) if isinstance(batch, int) else st.integers(int(batch[0]), int(batch[1]))
    one = st.one_of(st.sampled_from([min_len, max(min_len, 1), max_len]), st.integers(min_len, max_len))
    return b.flatmap(lambda n: st.lists(one, min_size=n, max_size=n)).map(lambda v: np.asarray(v, np.int32))


def page_tables(page_size: Any = (1, 32), batch: Any = (1, 4), max_len: int = 300, spare_pages: int = 3):
    """A strategy for paged-cache addressing: ``dict(page_size, seq_lens, block_table, num_pages)``.

    ``block_table`` is int32 ``[batch, max_pages]`` (-1 unused), filled from a shuffled free list of
    ``num_pages`` pages (``spare_pages`` more than needed), as a serving engine's allocator does; ``page_size``
    is an int or drawn from ``{1, 2, 4, ...}`` within the ``(lo, hi)`` range."""
    st = _st()
    if isinstance(page_size, int):
        ps = st.just(page_size)
    else:
        ps = st.sampled_from([p for p in (1, 2, 4, 8, 16, 32, 64, 128, 256) if page_size[0] <= p <= page_size[1]])

    @st.composite
    def build(draw):
        P = draw(ps)
        lens = draw(ragged_lengths(batch, max_len))
        need = [-(-int(n) // P) for n in lens]
        max_pages = max(1, max(need))
        num_pages = sum(need) + spare_pages
        order = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).permutation(num_pages)
        table = np.full((len(lens), max_pages), -1, np.int32)
        i = 0
        for b, n in enumerate(need):
            table[b, :n] = order[i:i + n]
            i += n
        return {"page_size": P, "seq_lens": lens, "block_table": table, "num_pages": int(num_pages)}

    return build()
