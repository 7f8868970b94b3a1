"""Texts the evaluations read. All ship with Python itself, so no run needs a download.

* :func:`stdlib_docstrings`: the Zen of Python and the module docstrings of a few standard-library modules
  (short English prose; the MiniLM-L6 study);
* :func:`python_docs`: Python's own language-reference documentation as plain text, the ``topics`` of
  ``pydoc_data.topics`` (what ``help("if")`` prints; about 465,000 characters on Python 3.11), topics in
  sorted order: the LLM evaluation's default text. It differs between Python versions: results record the
  Python version and the text's SHA-256.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import importlib
import io
import platform

PYTHON_DOCS_NAME = "Python's language reference (pydoc_data.topics, sorted by topic)"
TEXT_MODULES = ("argparse", "json", "textwrap", "difflib", "heapq", "fractions", "shlex", "pickle", "logging",
                "unittest", "email", "http")


def zen() -> str:
    """The Zen of Python (module ``this``, stored rot13-encoded)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # (prints the Zen on first import)
    return codecs.decode(this.s, "rot13")


def stdlib_docstrings(modules: tuple[str, ...] = TEXT_MODULES) -> str:
    """The Zen of Python, then each module's docstring with its whitespace collapsed, joined by blank lines."""
    parts = [zen()]
    for m in modules:
        doc = importlib.import_module(m).__doc__
        if doc:
            parts.append(" ".join(doc.split()))
    return "\n\n".join(parts)


def python_docs() -> str:
    """Python's language-reference topics (``pydoc_data.topics.topics``), sorted by topic name, each with its
    lines' trailing whitespace removed, joined by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join("\n".join(line.rstrip() for line in topics[k].strip().splitlines()) for k in sorted(topics))


def python_docs_name() -> str:
    return f"{PYTHON_DOCS_NAME}, Python {platform.python_version()}"


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
