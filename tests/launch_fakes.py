"""A stand-in for a compiled Triton kernel, for the tests of kept plans' direct launches (``LaunchHandle``)."""


class FakeCompiled:
    """A compiled kernel's launcher as ``LaunchHandle`` calls it, recording the arguments."""

    def __init__(self) -> None:
        self.function, self.packed_metadata, self.calls = object(), object(), []

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, g0, g1, g2, stream, function, packed_metadata, launch_metadata, enter, exit_, *args):
        assert function is self.function and packed_metadata is self.packed_metadata
        self.calls.append(((g0, g1, g2), stream, args))
