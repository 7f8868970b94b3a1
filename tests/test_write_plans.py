"""Write plans kept by what they read (``kvqref.backends.triton_backend.plan_write``): a launch bound from a kept
plan is the launch made afresh, a change in anything the choices read makes a new plan, each call's own tensors are
bound, and the kept plan's compiled kernel is launched directly after its first call."""

from __future__ import annotations

import warnings

import pytest

from kvqref import schemes

torch = pytest.importorskip("torch")

from launch_fakes import FakeDriver, check_direct_launch  # noqa: E402
from test_triton import DEVICE, GPU, tb  # noqa: E402

pytestmark = pytest.mark.gpu if GPU else pytest.mark.interpret

ROT = {"rotation": "hadamard", "rotation_seed": 5}
#: (scheme, options): every write kind, SGLang's float scale (a reciprocal bound per call), an explicit model dtype
#: (float32 input converted per call), per-token FP8 scales, KIVI keys and values, rotated sides
CASES = [
    ("bf16", {}), ("fp8_e4m3", {}), ("fp8_e4m3", {"granularity": "token_head"}),
    ("fp8_e4m3", {"profile": "sglang", "scale": 0.3, "sglang_scale": "float"}),
    ("fp8_e4m3", {"profile": "rocm", "scale": 0.05, "model_dtype": "float16"}),
    ("fp4_e2m1", {}), ("mxfp4", {}), ("nvfp4", {}),
    ("int4_kivi", {"role": "value", "group_size": 32, "residual": 0}),
    ("int2_kivi", {"role": "key", "group_size": 32, "residual": 0}),
    ("fp8_e4m3", ROT), ("nvfp4", ROT), ("int4_kivi", {"role": "key", "group_size": 32, "residual": 0, **ROT}),
]
IDS = ["-".join([n, *(str(v) for k, v in o.items() if k not in ("rotation_seed", "residual"))]) for n, o in CASES]


def side_of(name: str, opts: dict, layout: str = "HND", kv_heads: int = 2, head_dim: int = 128, pages: int = 4,
            page_size: int = 32):
    """K's side of an empty device cache of scheme ``name``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = schemes.get(name, **opts)
    bt, sl = torch.zeros(1, pages, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    return tb.empty_device_cache(s, s, pages, page_size, kv_heads, head_dim, bt, sl, device=DEVICE, layout=layout).k


def call_tensors(tokens: int = 32, kv_heads: int = 2, head_dim: int = 128, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    return x, torch.arange(tokens, dtype=torch.int64, device=DEVICE)


def records(launch, inputs: set[int]) -> tuple:
    """(kernel, grid, constexprs, options, args), each tensor argument as (shape, strides, dtype, and its address where
    it is one of ``inputs``, else its values: a tensor the binding made, such as a converted x or a reciprocal)."""
    def arg(a):
        if not torch.is_tensor(a):
            return a
        ident = a.data_ptr() if a.data_ptr() in inputs else tuple(a.detach().cpu().reshape(-1).tolist())
        return tuple(a.shape), a.stride(), a.dtype, ident

    return launch.kernel, launch.grid, launch.constexprs, launch.options, [arg(a) for a in launch.args]


def inputs_of(side, x, slots) -> set[int]:
    """Addresses of the call's tensors and of the cached rotation signs, which every call shares."""
    ts = [x, slots, *side.fields.values(), side.tensor_scale]
    rot = side.tiles().rotation
    if rot is not None:
        ts.append(tb.rotation_signs(rot, x.shape[-1], x.device))
    return {t.data_ptr() for t in ts}


def kept_and_fresh(side, x, slots, **kw) -> tuple:
    """(fresh, kept) records of one call: ``cache=False``, then a plan kept and a launch bound from it."""
    inputs = inputs_of(side, x, slots)
    fresh = records(tb.plan_write(side, x, slots, cache=False, **kw), inputs)
    tb.plan_write(side, x, slots, **kw)
    size = len(tb._WRITE_PLANS)
    kept = records(tb.plan_write(side, x, slots, **kw), inputs)
    assert len(tb._WRITE_PLANS) == size  # served, not made again
    return fresh, kept


@pytest.mark.parametrize("nvidia", [False, True], ids=["device-as-is", "planned-as-nvidia"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_kept_write_plan_is_the_fresh_plan(case, layout, nvidia, monkeypatch):
    """For every write kind, both layouts, 16-bit and float32 input, planned on this device and as on an NVIDIA
    GPU, the launch bound from a kept plan is the launch made afresh: the same kernel, grid, constexprs, options,
    scalars and input tensors, and the same values where the binding makes a tensor (x converted to an explicit
    model dtype, SGLang's reciprocal scale)."""
    name, opts = case
    if nvidia:
        monkeypatch.setattr(tb, "_nvidia_gpu", lambda device: True)
    kw = {}
    if nvidia and not GPU:  # planned only: no warp shuffles in the interpreter, no hardware FP8 query on a CPU
        kw = {"hw_fp8": False, **({"rotation_route": "gather"} if opts.get("rotation") else {})}
    side = side_of(name, opts, layout)
    for dtype in (torch.float16 if "model_dtype" in opts else torch.bfloat16, torch.float32):
        x, slots = call_tensors(dtype=dtype)
        fresh, kept = kept_and_fresh(side, x, slots, **kw)
        assert fresh == kept, dtype


def test_write_plan_key_sees_what_the_plan_reads(monkeypatch):
    """Calls that differ in what the choices read get their own plans, each the fresh one: x two bytes off a
    32-bit word (rotated NVFP4 input as words only where aligned), the token count (the grid), an option, the
    scheme, and the device's facts. Planted: a key without x's alignment serves the aligned call's word loads to the
    unaligned one, and this test fails."""
    monkeypatch.setattr(tb, "_nvidia_gpu", lambda device: True)
    side = side_of("nvfp4", ROT)
    x, slots = call_tensors()
    raw = torch.zeros(x.numel() + 1, dtype=x.dtype, device=x.device)
    odd = raw[1:].view(x.shape)  # the same shape and strides, two bytes off
    odd.copy_(x)
    assert odd.data_ptr() % 4 == 2 and odd.stride() == x.stride()
    kw = {} if GPU else {"rotation_route": "gather", "hw_fp8": False}

    def cx(xx, **more):
        return tb.plan_write(side, xx, slots[: xx.shape[0]], **kw, **more).constexprs

    aligned, unaligned = cx(x), cx(odd)
    assert aligned["WORD_LOAD"] and not unaligned["WORD_LOAD"]
    assert unaligned == tb.plan_write(side, odd, slots, cache=False, **kw).constexprs
    # the token count, an option, another scheme object
    assert tb.plan_write(side, x[:8], slots[:8], **kw).grid == tb.plan_write(side, x[:8], slots[:8], cache=False,
                                                                             **kw).grid
    assert tb.plan_write(side, x[:8], slots[:8], **kw).grid != tb.plan_write(side, x, slots, **kw).grid
    assert cx(x, word_load=False)["WORD_LOAD"] is False
    other = side_of("nvfp4", {**ROT, "rotation_seed": 6})
    assert tb.plan_write(other, x, slots, **kw).args[-2].data_ptr() != tb.plan_write(side, x, slots,
                                                                                    **kw).args[-2].data_ptr()
    # the device's facts: planned as on this device after the same call planned as on an NVIDIA GPU
    monkeypatch.setattr(tb, "_nvidia_gpu", lambda device: GPU)
    if not GPU:
        assert cx(x)["F16_CVT"] != aligned["F16_CVT"]
    assert cx(x) == tb.plan_write(side, x, slots, cache=False, **kw).constexprs


def test_write_plan_binds_each_calls_tensors():
    """A kept plan binds the call's own x, slots, fields and tensor scale: after the fields are replaced (a cache
    that grew in place of another of the same shape) and a new tensor scale is set, the bound launch reads those, and
    SGLang's float scale binds the reciprocal of the new scale."""
    side = side_of("fp8_e4m3", {"profile": "sglang", "scale": 0.3, "sglang_scale": "float"})
    x, slots = call_tensors()
    first = tb.plan_write(side, x, slots)
    x2, slots2 = call_tensors(seed=1)
    side.fields = {f: torch.zeros_like(t) for f, t in side.fields.items()}
    side.tensor_scale = torch.full_like(side.tensor_scale, 0.25)
    second = tb.plan_write(side, x2, slots2)
    assert len(tb._WRITE_PLANS) == 1 and second.handle is first.handle
    assert second.args[0] is x2 and second.args[1] is slots2
    codes = side.fields["codes"]
    assert second.args[2] is codes and first.args[2] is not codes
    assert torch.equal(second.args[5], torch.full_like(side.tensor_scale, 4.0))
    assert second.args[6:8] == [32, 2]


def test_write_plan_cache_keeps_the_most_recent(monkeypatch):
    """At most ``WRITE_PLAN_CACHE_SIZE`` plans stay, the least recently used leaving first; a launch planned for one
    call (``cache=False``) keeps nothing."""
    monkeypatch.setattr(tb, "WRITE_PLAN_CACHE_SIZE", 2)
    side = side_of("fp8_e4m3", {})
    for n in (8, 16, 24):
        tb.plan_write(side, *call_tensors(n))
    assert [key[3][0][0] for key in tb._WRITE_PLANS] == [16, 24]
    tb.plan_write(side, *call_tensors(16))  # used again: now the most recent
    tb.plan_write(side, *call_tensors(32))
    assert [key[3][0][0] for key in tb._WRITE_PLANS] == [16, 32]
    launch = tb.plan_write(side, *call_tensors(40), cache=False)
    assert launch.handle is None and [key[3][0][0] for key in tb._WRITE_PLANS] == [16, 32]


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[7], CASES[9], CASES[11]],
                         ids=["bf16", "fp8-sglang-float", "nvfp4", "int2_kivi-k", "nvfp4-rot"])
def test_write_direct_launch_passes_the_bound_arguments(case, monkeypatch):
    """A kept write plan's launch through its ``LaunchHandle`` gives the compiled kernel's launcher every parameter
    of the write kernel in order (the call's arguments, then the constexprs, else the defaults, as
    ``Signature.bind`` and ``apply_defaults``), over the grid, on the current stream; on another device nothing.
    The next call's launch shares the handle and launches directly. Planted: the constexprs in another order fail
    it."""
    driver = FakeDriver()
    driver.install(monkeypatch)
    side = side_of(*case)
    x, slots = call_tensors()
    la = tb.plan_write(side, x, slots)
    assert la.handle is not None and tb.plan_write(side, x, slots, cache=False).handle is None
    compiled = check_direct_launch(la, driver)
    x2, _ = call_tensors(seed=3)
    again = tb.plan_write(side, x2, slots)
    assert again.handle is la.handle and again.handle.compiled is compiled
    again()  # launched directly: the fake launcher sees the new x
    assert len(compiled.calls) == 2 and compiled.calls[1][2][0] is again.args[0]


def _bytes(side) -> list:
    return [t.view(torch.uint8).clone() for t in side.fields.values()]


@pytest.mark.parametrize("case", [CASES[1], CASES[7], CASES[8], CASES[11]],
                         ids=["fp8", "nvfp4", "int4_kivi-v", "nvfp4-rot"])
def test_kept_write_plan_writes_the_same_bytes(case, monkeypatch):
    """Writes through a kept plan (its first call, then later calls of other tokens) store the bytes of the same
    writes planned afresh (``cache=False``), compared as integers; on a GPU the later calls launch without Triton's
    ``JITFunction.run`` (made to fail here)."""
    from kvqref.kernels.write import quantize_write_kernel

    fresh, kept = side_of(*case), side_of(*case)
    n = 8 if "rotation" in case[1] else 32  # (the interpreter's butterflies: 5 s per write of 32 tokens)
    for i, seed in enumerate((1, 2, 3)):
        x, _ = call_tensors(n, seed=seed)
        slots = torch.arange(n * i, n * i + n, dtype=torch.int64, device=DEVICE)
        tb.quantize_write(fresh, x, slots, validate=False, cache=False)
        if GPU and i:
            with monkeypatch.context() as m:
                m.setattr(type(quantize_write_kernel), "run", lambda *a, **kw: pytest.fail("JIT launch"))
                tb.quantize_write(kept, x, slots, validate=False)
                torch.cuda.synchronize()
        else:
            tb.quantize_write(kept, x, slots, validate=False)
    assert len(tb._WRITE_PLANS) == 1
    if GPU:
        assert next(iter(tb._WRITE_PLANS.values())).handle.compiled is not None
    for a, b in zip(_bytes(fresh), _bytes(kept), strict=True):
        assert torch.equal(a, b)
    assert any(int(t.count_nonzero()) for t in _bytes(kept))
