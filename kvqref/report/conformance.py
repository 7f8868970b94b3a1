"""Section 3 of the report: conformance of every available backend against the oracle
(:mod:`kvqref.conformance`, the quick sample)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TextIO

from kvqref import backends
from kvqref import conformance as conf
from kvqref.report.progress import Progress
from kvqref.report.section import Context, Section
from kvqref.report.tables import markdown, write_table

TITLE = "3. Conformance"


def conformance(names: Sequence[str], stream: TextIO | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """Results of :func:`kvqref.conformance.check` for each available backend in ``names``; and a line per
    unavailable backend saying why."""
    rows: list[dict[str, Any]] = []
    skipped = []
    av = backends.available()
    for n in names:
        if av.get(n):
            skipped.append(f"{n}: skipped: {av[n]}")
            continue
        res = conf.check(n, progress=Progress(conf.expected_count(n), f"conformance {n}", stream))
        rows += [r.as_dict() for r in res]
    return rows, skipped


def build(ctx: Context) -> Section:
    """``ctx.options["backends"]``: the backend names to check (default: every registered one)."""
    out = ctx.out
    names = list(ctx.options.get("backends") or backends.names())
    conf_rows, skipped = conformance(names, ctx.progress_stream)
    summ = conf.summary([conf.Result(**r) for r in conf_rows])
    summary_rows = [{"backend": b, **v} for b, v in summ.items()]
    write_table(out, "conformance", conf_rows, ("backend", "check", "case", "passed", "detail"),
                "Conformance against the oracle")
    cs_md = write_table(out, "conformance_summary", summary_rows, ("backend", "passed", "failed"),
                        "Conformance: pass/fail counts")
    failed = [r for r in conf_rows if not r["passed"]]
    body = [cs_md, *([""] + skipped if skipped else [])]
    if failed:
        body += ["", "Failures:", "", markdown(failed, ("backend", "check", "case", "detail"))]
    body += ["", "Every case: conformance.csv / conformance.json (quick sample; `kvqref check --backend NAME`)."]
    return Section(TITLE, "\n".join(body), {"conformance": conf_rows, "conformance_summary": summ})
