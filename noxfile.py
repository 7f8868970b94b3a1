"""nox sessions. Where no package index is reachable (the GPU machine), run `nox --no-venv -s NAME`:
the install steps are then skipped and the session uses the interpreter's own packages."""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "tests"]
# torch is pinned to the CPU build that CI installs; an unpinned torch pulls a multi-GB CUDA build.
TORCH = "torch==2.13.0"


def _install(session: nox.Session, *extras: str) -> None:
    if session.venv_backend == "none":
        session.log("no virtualenv: using the packages already installed")
        return
    session.install(TORCH)
    session.install("-e", f".[{','.join(extras)}]" if extras else ".")


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (what .ci/run runs, one pytest-xdist worker per core): CPU, Triton interpreter and AOT tests;
    GPU tests skip without one."""
    _install(session, "test")
    session.run("python", "-m", "pytest", "-q", "-n", "auto", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check."""
    if session.venv_backend != "none":
        session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session
def gpu(session: nox.Session) -> None:
    """The GPU suite (marker `gpu`); needs a CUDA or ROCm device."""
    _install(session, "test")
    session.run("python", "-m", "pytest", "-q", "-m", "gpu", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """pytest-benchmark suites (bench/test_bench.py); JSON into bench/results/. GPU machine without an
    index: `nox --no-venv -s bench` or `python3 -m pytest bench/test_bench.py --benchmark-json=...`."""
    _install(session, "test")
    session.run("python", "-m", "pytest", "bench/test_bench.py", "-q",
                "--benchmark-json=bench/results/pytest-benchmark.json", *session.posargs)
