"""What a report section is: a module with ``TITLE`` and ``build(ctx) -> Section``.

The driver (:func:`kvqref.report.run`) calls each section's ``build`` in order with one :class:`Context`;
a section reads earlier sections' data from ``ctx.data`` (the claims table reads the accuracy study's),
writes its tables into ``ctx.out`` (:func:`kvqref.report.tables.write_table`) and returns its markdown, its
data for report.json and the plots it wrote. A new evaluation is a new section module, not an edit of the
driver's body.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO


@dataclass
class Context:
    out: Path
    quick: bool = False
    progress_stream: TextIO | None = None
    options: dict[str, Any] = field(default_factory=dict)  # per-section options (backends, want_speed, llm)
    data: dict[str, Any] = field(default_factory=dict)  # report.json so far: earlier sections' data


@dataclass
class Section:
    title: str
    body: str  # markdown
    data: dict[str, Any] = field(default_factory=dict)  # merged into report.json (top-level keys)
    plots: list[str] = field(default_factory=list)  # PNG file names written into ctx.out
