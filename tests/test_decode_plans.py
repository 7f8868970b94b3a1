"""Decode plans cached by what they read (``kvqref.kernels.decode.plan_decode``): a plan served from the cache
is the plan made afresh, launch for launch, and a change in anything the planner reads (an option, the longest
sequence, a field's alignment, the device's facts) makes a new one."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from kvqref import schemes

torch = pytest.importorskip("torch")

from launch_fakes import FakeCompiled, FakeDriver, check_direct_launch  # noqa: E402
from test_triton import DEVICE, GPU, build_cache, split_launch_of, tb  # noqa: E402

pytestmark = pytest.mark.gpu if GPU else pytest.mark.interpret

ROT = {"rotation": "hadamard", "rotation_seed": 3}
#: (K scheme, K options, V scheme, V options): every tile kind, KIVI with its residual window, rotated sides
PAIRS = [
    ("bf16", {}, "bf16", {}),
    ("fp8_e4m3", {}, "fp8_e5m2", {}),
    ("fp4_e2m1", {}, "fp4_e2m1", {}),
    ("mxfp4", {}, "mxfp4", {}),
    ("nvfp4", {}, "nvfp4", {}),
    ("mxfp4", {}, "nvfp4", ROT),
    ("fp8_e4m3", ROT, "fp8_e4m3", {}),
    ("int4_kivi", {"role": "key", "residual": 32}, "int4_kivi", {"role": "value", "residual": 32}),
    ("int2_kivi", {"role": "key", "residual": 32}, "int2_kivi", {"role": "value", "residual": 32}),
]
OPTIONS = [{}, {"precision": "exact"}, {"num_splits": 3}, {"hw_formats": {0, 1}}]


def device_cache(pair, q_heads: int, kv_heads: int = 2, head_dim: int = 128, layout: str = "HND", batch: int = 3,
                 tokens: int = 300, page_size: int = 32):
    """An empty device cache of ``pair`` and a random q (planning reads no values)."""
    kname, kopt, vname, vopt = pair
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ks, vs = schemes.get(kname, **kopt), schemes.get(vname, **vopt)
    dc = tb.uniform_device_cache(ks, vs, batch, tokens, page_size, kv_heads, head_dim, device=DEVICE, layout=layout)
    q = torch.randn(batch, q_heads, head_dim, device=DEVICE).to(torch.bfloat16)
    return dc, q


def plan(dc, q, k=None, v=None, **kw):
    from kvqref.kernels.decode import plan_decode

    return plan_decode(q, k or dc.k.tiles(), v or dc.v.tiles(), dc.block_table, dc.seq_lens, dc.page_size,
                       residual=dc.residual, **kw)


def launch_records(launches, inputs: set[int]) -> list[tuple]:
    """Each launch as (kernel, grid, constexprs, options, args) with every tensor argument as (shape, strides,
    dtype, its address where it is an input or a cached constant, else "new": the output tensors a call makes)."""
    def arg(a):
        if not torch.is_tensor(a):
            return a
        return tuple(a.shape), a.stride(), a.dtype, a.data_ptr() if a.data_ptr() in inputs else "new"

    return [(la.kernel, la.grid, la.constexprs, la.options, [arg(a) for a in la.args]) for la in launches]


def input_addresses(dc, q) -> set[int]:
    """Addresses of the call's tensors and of the planner's cached constants (rotation vectors, the unused residual
    pointer), which every call shares."""
    from kvqref.kernels import decode as dec

    ts = [q, dc.block_table, dc.seq_lens, *dc.k.fields.values(), *dc.v.fields.values(), dc.k.tensor_scale,
          dc.v.tensor_scale, *(dc.residual or ()), dec._unused_residual(str(q.device))]
    for side in (dc.k, dc.v):
        rot = side.tiles().rotation
        if rot is not None:
            ts += list(dec.rotation_vectors(rot.seed, q.shape[-1], q.device)[:2])
    return {t.data_ptr() for t in ts}


def same_plans(dc, q, **kw) -> tuple[list, list]:
    """(fresh, cached) records of one call: ``cache=False``, then the cache filled and served from."""
    from kvqref.kernels import decode as dec

    inputs = input_addresses(dc, q)
    fresh = launch_records(plan(dc, q, cache=False, **kw)[0], inputs)
    plan(dc, q, **kw)
    size = len(dec._PLANS)
    cached = launch_records(plan(dc, q, **kw)[0], inputs)
    assert len(dec._PLANS) == size  # served, not made again
    return fresh, cached


@pytest.mark.parametrize("nvidia", [False, True], ids=["device-as-is", "planned-as-nvidia"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("pair", PAIRS, ids=[f"{p[0]}{'-rot' if p[1].get('rotation') else ''}/{p[2]}"
                                             f"{'-rot' if p[3].get('rotation') else ''}" for p in PAIRS])
def test_cached_plan_is_the_fresh_plan(pair, layout, nvidia, monkeypatch):
    """At 1, 4 and 8 query heads per KV head, head_dim 64 and 128, and four option sets, the plan served from the
    cache launches what a fresh plan launches: the same kernels, grids, constexprs, options, scalar arguments and
    input tensors, with new output tensors of the same shapes."""
    from kvqref.kernels import decode as dec

    if nvidia:
        monkeypatch.setattr(dec, "_nvidia_cuda", lambda t: True)
        if not GPU:
            monkeypatch.setattr(dec, "_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    dec.clear_plan_cache()
    checked = 0
    for q_heads, head_dim in ((2, 128), (8, 128), (16, 64)):
        dc, q = device_cache(pair, q_heads, head_dim=head_dim, layout=layout)
        for kw in OPTIONS:
            try:
                fresh, cached = same_plans(dc, q, max_seq_len=300, **kw)
            except ValueError:  # an option this pair refuses (e.g. exact precision and a planned-only GPU option)
                with pytest.raises(ValueError):
                    plan(dc, q, max_seq_len=300, **kw)
                continue
            assert fresh == cached, (q_heads, head_dim, kw)
            checked += 1
    assert checked >= 6


def test_plan_cache_key_sees_what_the_plan_reads(monkeypatch):
    """Calls that differ in what the planner reads get their own plans, each the fresh plan: a value field one
    byte off its alignment (FP4 value words need rows aligned to 2 bytes), the longest sequence (the split count),
    an option, and the device's facts (``_nvidia_cuda``: inline PTX). Planted: a key without the fields' alignment
    serves the aligned field's value words to the unaligned one, and this test fails."""
    from kvqref.kernels import decode as dec

    dec.clear_plan_cache()
    dc, q = device_cache(("nvfp4", {}, "nvfp4", {}), 8, kv_heads=2, head_dim=128, layout="HND")
    k, v = dc.k.tiles(), dc.v.tiles()
    codes = v.fields[0]
    raw = torch.zeros(codes.numel() + 1, dtype=codes.dtype, device=codes.device)
    odd = raw[1:].view(codes.shape)  # the same shape and strides, one byte off
    assert odd.data_ptr() % 2 == 1 and odd.stride() == codes.stride()
    v_odd = dec.CacheTiles(v.kind, [odd, *v.fields[1:]], v.tensor_scale, fmt=v.fmt, token_scale=v.token_scale,
                           block=v.block, group=v.group, bits=v.bits, head_major=v.head_major)

    def split_cx(tiles_v, **kw):
        return split_launch_of(plan(dc, q, k=k, v=tiles_v, max_seq_len=300, **kw)[0]).constexprs

    aligned = split_cx(v)
    unaligned = split_cx(v_odd)
    fresh_unaligned = split_cx(v_odd, cache=False)
    assert aligned["VW"] and not fresh_unaligned["VW"]
    assert unaligned == fresh_unaligned
    # the longest sequence and an option
    assert split_cx(v, num_splits=2)["BLOCK_N"] == aligned["BLOCK_N"]
    assert plan(dc, q, k=k, v=v, max_seq_len=300, num_splits=2)[0][0].grid[2] == 2
    assert plan(dc, q, k=k, v=v, max_seq_len=300, num_splits=3)[0][0].grid[2] == 3
    grids = {T: [la.grid for la in plan(dc, q, k=k, v=v, max_seq_len=T)[0]] for T in (32, 300)}
    assert grids == {T: [la.grid for la in plan(dc, q, k=k, v=v, max_seq_len=T, cache=False)[0]] for T in (32, 300)}
    # the device's facts: planned as on an NVIDIA GPU after the same call planned as on this one
    before = split_cx(v)
    monkeypatch.setattr(dec, "_nvidia_cuda", lambda t: True)
    after = split_cx(v)
    assert after == split_cx(v, cache=False)
    if not GPU:
        assert before["PTX"] != after["PTX"]


def test_plan_cache_keeps_the_most_recent(monkeypatch):
    """At most ``PLAN_CACHE_SIZE`` plans stay, the least recently used leaving first; an option that cannot be a key
    (a list) plans every call and keeps nothing."""
    from kvqref.kernels import decode as dec

    dec.clear_plan_cache()
    monkeypatch.setattr(dec, "PLAN_CACHE_SIZE", 2)
    dc, q = device_cache(("fp8_e4m3", {}, "fp8_e4m3", {}), 4)
    for T in (32, 64, 96):
        plan(dc, q, max_seq_len=T)
    assert [key[-2] for key in dec._PLANS] == [64, 96]
    plan(dc, q, max_seq_len=64)  # used again: now the most recent
    plan(dc, q, max_seq_len=128)
    assert [key[-2] for key in dec._PLANS] == [64, 128]
    launches = plan(dc, q, max_seq_len=64, hw_formats=[0, 1])[0]
    assert len(dec._PLANS) == 2 and [key[-2] for key in dec._PLANS] == [64, 128]
    assert launches[0].constexprs == plan(dc, q, max_seq_len=64, hw_formats={0, 1}, cache=False)[0][0].constexprs


def test_cached_plan_decodes_the_same_bits():
    """The decode of a filled fp8 cache (interpreter on the CPU, the kernels on a GPU): the call served from the
    cache returns the bits of the call planned afresh, and a new output each call."""
    rng = np.random.default_rng(7)
    shape = dict(batch=2, kv_heads=2, q_heads=4, head_dim=64, page_size=16, lens=(5, 40))
    cache, _ = build_cache(("fp8_e4m3", {}, "fp8_e4m3", {}), shape, rng)
    dc = tb.DeviceCache.from_cache(cache, DEVICE)
    q = torch.from_numpy(rng.standard_normal((2, 4, 64), dtype=np.float32)).to(DEVICE, torch.bfloat16)
    fresh = tb.decode(q, dc, cache=False)
    first = tb.decode(q, dc)
    second = tb.decode(q, dc)
    for a, b, c in zip(fresh, first, second, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)) and torch.equal(b.view(torch.int32),
                                                                                     c.view(torch.int32))
    assert first[0].data_ptr() != second[0].data_ptr()
    assert np.isfinite(first[0].cpu().numpy()).all() and float(first[0].abs().max()) > 0


@pytest.mark.parametrize("pair", [PAIRS[0], PAIRS[5], PAIRS[6], PAIRS[7]],
                         ids=["bf16", "mxfp4/nvfp4-rot", "fp8-rot/fp8", "int4_kivi"])
def test_direct_launch_passes_the_bound_arguments(pair, monkeypatch):
    """A cached plan's launch through its ``LaunchHandle`` gives the compiled kernel's launcher what
    ``JITFunction.run`` gives it: every parameter of the kernel in order, the call's arguments, then the constexprs,
    else the defaults (as Python's ``Signature.bind`` and ``apply_defaults``), over the grid, on the current stream,
    for every launch kind (split, merge, the rotation of q ahead of rotated FP8 keys, KIVI's residual split);
    on another device, or without a compiled kernel, nothing (Triton's own launch then). Planted: the constexprs
    and defaults in another order fail it."""
    from kvqref.kernels import decode as dec

    driver = FakeDriver()
    driver.install(monkeypatch)
    dec.clear_plan_cache()
    dc, q = device_cache(pair, 8)
    launches = plan(dc, q, max_seq_len=300)[0]
    assert all(la.handle is not None for la in launches) and len({id(la.handle) for la in launches}) == len(launches)
    for la in launches:
        check_direct_launch(la, driver)
    # the next call's launches share the plan's handles, so they launch directly
    again = plan(dc, q, max_seq_len=300)[0]
    assert [la.handle for la in again] == [la.handle for la in launches]
    assert all(la.handle.compiled is not None for la in again)


def test_direct_launch_off_in_the_interpreter_and_by_switch(monkeypatch):
    """Under the interpreter (no compiled kernel to keep) and with ``DIRECT_LAUNCH`` off, a handle keeps nothing and
    every launch goes through ``kernel[grid]``; a plan made for one call has no handles."""
    from kvqref.kernels import decode as dec

    dec.clear_plan_cache()
    dc, q = device_cache(PAIRS[1], 4)
    la = plan(dc, q, max_seq_len=300)[0][0]
    monkeypatch.setattr(dec, "INTERPRET", True)
    la.handle.capture(la.kernel, FakeCompiled(), la.args, la.constexprs)
    assert la.handle.compiled is None
    monkeypatch.setattr(dec, "DIRECT_LAUNCH", False)
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append(grid) or FakeCompiled()

    launch = dec.Launch(Kernel(), (2, 3), [], {}, {}, dec.LaunchHandle())
    launch()
    launch()
    assert seen == [(2, 3), (2, 3)] and launch.handle.compiled is None
    # a plan made for one call (``cache=False``) keeps no handles: its launches go through ``kernel[grid]``
    assert all(la.handle is None for la in plan(dc, q, max_seq_len=300, cache=False)[0])


@pytest.mark.skipif(not GPU, reason="the compiled kernels' launchers need a GPU")
def test_direct_launch_decodes_the_same_bits(monkeypatch):
    """On the GPU: after a cached plan's first call every launch of the plan holds its compiled kernel, and later
    calls launch them without Triton's ``JITFunction.run`` (made to fail here) and decode the bits of a plan launched
    through it (``cache=False``), for FP8, mxfp4 keys with rotated NVFP4 values (un-rotated at the output) and KIVI
    with its residual window."""
    from kvqref.kernels import decode as dec

    rng = np.random.default_rng(11)
    shape = dict(batch=2, kv_heads=2, q_heads=8, head_dim=128, page_size=32, lens=(37, 300))
    for pair in (PAIRS[1], PAIRS[5], PAIRS[7]):
        cache, _ = build_cache(pair, shape, rng)
        dc = tb.DeviceCache.from_cache(cache, DEVICE)
        q = torch.from_numpy(rng.standard_normal((2, 8, 128), dtype=np.float32)).to(DEVICE, torch.bfloat16)
        dec.clear_plan_cache()
        fresh = tb.decode(q, dc, cache=False)
        first = tb.decode(q, dc)
        plans = list(dec._PLANS.values())
        assert len(plans) == 1 and all(h.compiled is not None for h in plans[0].handles), pair
        with monkeypatch.context() as m:
            m.setattr(type(dec.decode_split_kernel), "run", lambda *a, **kw: pytest.fail("JIT launch"))
            second = tb.decode(q, dc)
            torch.cuda.synchronize()
        for a, b, c in zip(fresh, first, second, strict=True):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), pair
            assert torch.equal(a.view(torch.int32), c.view(torch.int32)), pair
        assert np.isfinite(second[0].cpu().numpy()).all() and float(second[0].abs().max()) > 0


def test_side_tiles_kept_while_the_side_holds_the_same_tensors():
    """``Side.tiles()`` returns the same ``CacheTiles`` while the side holds the same scheme, fields, tensor scale and
    layout, and a new one, equal to a fresh one, once any of them is replaced (a field, the tensor scale, the scheme,
    the layout flag); the kept tiles hold the tensors they were made of."""
    dc, _ = device_cache(PAIRS[4], 4)
    side = dc.k
    first = side.tiles()
    assert side.tiles() is first
    name = next(iter(side.fields))
    old = side.fields[name]
    side.fields[name] = old.clone()
    second = side.tiles()
    assert second is not first and second.fields[0] is side.fields[name] and first.fields[0] is old
    side.tensor_scale = side.tensor_scale.clone()
    third = side.tiles()
    assert third is not second and third.tensor_scale is side.tensor_scale
    side.scheme = schemes.get("nvfp4")
    assert side.tiles() is not third and side.tiles() is side.tiles()
    before = side.tiles()
    side.head_major = not side.head_major
    flipped = side.tiles()
    side.head_major = not side.head_major
    assert flipped is not before and flipped.head_major != before.head_major
    assert side.tiles().plan_key() == type(side)(side.scheme, dict(side.fields), side.tensor_scale, side.params,
                                                 side.head_major).tiles().plan_key()
