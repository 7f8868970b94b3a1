"""A tiny progress printer for long work (the report's sections, ``kvqref check``, ``kvqref eval``)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """A tiny progress printer: ``[#####-----] 5/10 label: item`` (one line, redrawn on a terminal; a line per
    step elsewhere, so CI logs stay readable)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, width: int = 24) -> None:
        self.total, self.label, self.width, self.done = max(total, 1), label, width, 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()

    def __call__(self, item: str = "") -> None:
        self.done += 1
        filled = int(self.width * min(self.done, self.total) / self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        text = f"[{bar}] {self.done}/{self.total} {self.label}: {item}"
        if self.tty:
            end = "\n" if self.done >= self.total else ""
            self.stream.write("\r" + text[:150].ljust(150) + end)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0
