"""A stand-in for a compiled Triton kernel and the driver it launches on, for the tests of kept plans' direct
launches (``LaunchHandle``)."""

from __future__ import annotations

import inspect
import types


class FakeCompiled:
    """A compiled kernel's launcher as ``LaunchHandle`` calls it, recording the arguments."""

    def __init__(self) -> None:
        self.function, self.packed_metadata, self.calls = object(), object(), []

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, g0, g1, g2, stream, function, packed_metadata, launch_metadata, enter, exit_, *args):
        assert function is self.function and packed_metadata is self.packed_metadata
        self.calls.append(((g0, g1, g2), stream, args))


class FakeDriver:
    """Triton's active driver as ``LaunchHandle`` asks it: the current device (``device``, settable) and its stream
    (1000 + the device)."""

    def __init__(self) -> None:
        self.device = 0

    def install(self, monkeypatch) -> None:
        """Make this the active driver of the kernels' Triton, with the interpreter off."""
        from kvqref.kernels import decode as dec

        active = types.SimpleNamespace(get_current_device=lambda: self.device,
                                       get_current_stream=lambda device: 1000 + device)
        monkeypatch.setattr(dec, "INTERPRET", False)
        monkeypatch.setattr(dec.triton.runtime, "driver", types.SimpleNamespace(active=active))


def check_direct_launch(la, driver: FakeDriver) -> FakeCompiled:
    """Keep a fake compiled kernel in launch ``la``'s handle (none kept before), launch it directly, and assert that
    the launcher got every parameter of the kernel in order (the call's arguments, then the constexprs, else the
    defaults: ``Signature.bind`` and ``apply_defaults``) over the grid, on device 0's stream; then that nothing is
    launched on another device. Returns the fake, holding the one call."""
    compiled = FakeCompiled()
    assert not la.handle.launch(la.grid, la.args)  # nothing kept yet
    la.handle.capture(la.kernel, compiled, la.args, la.constexprs)
    bound = inspect.signature(la.kernel.fn).bind(*la.args, **la.constexprs)
    bound.apply_defaults()
    assert la.handle.launch(la.grid, la.args)
    assert len(compiled.calls) == 1
    grid, stream, args = compiled.calls[0]
    assert grid == (*la.grid, 1, 1)[:3] and stream == 1000
    want = list(bound.arguments.values())
    assert len(args) == len(want) and all(a is b or a == b for a, b in zip(args, want, strict=True)), la.kernel
    driver.device = 1
    assert not la.handle.launch(la.grid, la.args) and len(compiled.calls) == 1
    driver.device = 0
    return compiled
