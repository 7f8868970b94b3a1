"""Ahead-of-time (AOT) compilation of ``@triton.jit`` kernels without a GPU.

``compile_for_target`` lowers a kernel for an explicit ``GPUTarget`` on a machine
that has no GPU and no GPU driver (a CPU-only CI box is enough): Triton's wheel
bundles everything it needs (``ptxas`` for CUDA, an in-process LLD for HIP).
It is used to check that kernels still lower for every shipped target, e.g.::

    from triton.backends.compiler import GPUTarget
    ck = compile_for_target(
        my_kernel,
        {"x_ptr": "*fp32", "y_ptr": "*u8", "n": "i32"},
        {"BLOCK": 256},
        GPUTarget("hip", "gfx942", 64),
    )
    assert set(expected_asm_keys(ck.metadata.target)) <= set(ck.asm)

Signature strings are Triton's type names: pointers ``"*fp32"``, ``"*bf16"``,
``"*fp16"``, ``"*u8"``, ``"*i32"``; scalars ``"i32"``, ``"i64"``, ``"u32"``,
``"fp32"``; compile-time arguments ``"constexpr"`` (filled in automatically for
every name in ``constexprs``).

Works with the ``constexprs=``/``attrs=dict`` API of current Triton (checked on
3.6 and 3.9) and falls back to the older ``constants=``/``AttrsDescriptor`` API
(checked on 3.2, CUDA only). The API is picked by feature detection, not by
version number. The module imports nothing from the rest of the project.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["compile_for_target", "expected_asm_keys", "make_target"]

_ASM_KEYS = {"cuda": ("ptx", "cubin"), "hip": ("amdgcn", "hsaco")}


def make_target(backend: str, arch: int | str, warp_size: int | None = None) -> Any:
    """Build a ``triton.backends.compiler.GPUTarget``.

    ``arch`` is the CUDA compute capability as an int (``90``, ``100``) or the
    AMD gfx name (``"gfx942"``). ``warp_size`` defaults to 32 for CUDA and 64
    for HIP (CDNA).
    """
    from triton.backends.compiler import GPUTarget

    if backend == "cuda":
        arch = int(arch)
    if warp_size is None:
        warp_size = 32 if backend == "cuda" else 64
    return GPUTarget(backend, arch, warp_size)


def expected_asm_keys(target: Any) -> tuple[str, ...]:
    """Return the ``CompiledKernel.asm`` keys that hold the final code for ``target``.

    ``("ptx", "cubin")`` for CUDA and ``("amdgcn", "hsaco")`` for HIP. Every
    target also has ``"ttir"``, ``"ttgir"`` and ``"llir"``.
    """
    return _ASM_KEYS[target.backend]


def _unwrap_jit(fn: Any) -> Any:
    from triton.runtime.jit import JITFunction

    if isinstance(fn, JITFunction):
        return fn
    # Autotuner/Heuristics wrappers keep the JITFunction in ``.fn``.
    inner = getattr(fn, "fn", None)
    if isinstance(inner, JITFunction):
        return inner
    if type(fn).__name__ == "InterpretedFunction" or type(inner).__name__ == "InterpretedFunction":
        raise TypeError(
            "compile_for_target needs a JITFunction, but the kernel was decorated while "
            "TRITON_INTERPRET=1 was set (it is an InterpretedFunction). Run AOT compilation "
            "in a process where TRITON_INTERPRET is unset when the kernel module is imported."
        )
    raise TypeError(f"expected a @triton.jit function, got {type(fn).__name__}")


def compile_for_target(
    fn: Any,
    signature: Mapping[str, str],
    constexprs: Mapping[str, Any],
    target: Any,
    *,
    divisible_by_16: Iterable[str] = (),
    options: Mapping[str, Any] | None = None,
) -> Any:
    """Compile ``fn`` for ``target`` without a GPU and return the ``CompiledKernel``.

    Args:
        fn: a ``@triton.jit`` function (or an autotuner/heuristics wrapper of one).
            It must not have been decorated under ``TRITON_INTERPRET=1``.
        signature: Triton type string for each runtime argument, by name
            (``{"x_ptr": "*fp32", "n": "i32"}``). Names in ``constexprs`` may be
            left out or given as ``"constexpr"``.
        constexprs: value of each ``tl.constexpr`` argument, by name. Parameters
            with a Python default that are missing from both mappings get that
            default as a constexpr value.
        target: a ``GPUTarget`` (see :func:`make_target`), e.g.
            ``GPUTarget("hip", "gfx942", 64)`` or ``GPUTarget("cuda", 90, 32)``.
        divisible_by_16: names of pointer/integer arguments to assume 16-divisible
            (what the JIT specializes on for aligned tensors; enables vector loads).
        options: backend options such as ``num_warps``, ``num_stages``,
            ``enable_fp_fusion``; keys a backend does not know are ignored by it.

    Returns:
        ``triton.compiler.CompiledKernel``: ``.asm`` maps stage names
        (``"ttir"``, ``"ttgir"``, ``"llir"``, then ``"ptx"``/``"cubin"`` or
        ``"amdgcn"``/``"hsaco"``) to text or bytes; ``.metadata`` has
        ``name``, ``num_warps``, ``shared`` and ``target``.
    """
    import triton
    from triton.compiler import ASTSource

    jit_fn = _unwrap_jit(fn)
    arg_names: list[str] = list(jit_fn.arg_names)
    consts = dict(constexprs)
    unknown = (set(signature) | set(consts)) - set(arg_names)
    if unknown:
        raise ValueError(f"not parameters of {jit_fn.__name__}: {sorted(unknown)}")

    params = inspect.signature(jit_fn.fn).parameters
    sig: dict[str, str] = {}
    for name in arg_names:
        if name not in consts and signature.get(name, "constexpr") == "constexpr":
            default = params[name].default
            if default is inspect.Parameter.empty:
                raise ValueError(f"{jit_fn.__name__}: no type or constexpr value for argument {name!r}")
            consts[name] = getattr(default, "value", default)  # unwrap tl.constexpr defaults
        sig[name] = "constexpr" if name in consts else signature[name]

    hint_idx = [arg_names.index(n) for n in divisible_by_16]
    src_params = inspect.signature(ASTSource.__init__).parameters
    if "constexprs" in src_params:  # current API (3.6, 3.9): dict attrs keyed by argument path
        attrs = {(i,): [["tt.divisibility", 16]] for i in hint_idx}
        src = ASTSource(fn=jit_fn, signature=sig, constexprs=consts, attrs=attrs)
    else:  # older API (3.2): constants= and an AttrsDescriptor
        from triton.backends.compiler import AttrsDescriptor

        attrs_desc = AttrsDescriptor.from_hints({i: 16 for i in hint_idx})
        src = ASTSource(fn=jit_fn, signature=sig, constants=consts, attrs=attrs_desc)
    return triton.compile(src, target=target, options=dict(options or {}))
