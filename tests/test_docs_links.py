"""Relative links in the project's markdown (README, docs/, papers/, bench/results/ANALYSIS.md) name files that
exist: results, logs and pages are cited by path, and a cited file that is missing is a claim without evidence."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`[^`\n]*`")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "papers").glob("*.md")),
            ROOT / "bench" / "results" / "ANALYSIS.md"]


def missing_links(md: Path) -> list[str]:
    """The relative link targets of ``md`` (outside inline code, anchors dropped) that name no file or folder."""
    out = []
    for m in LINK.finditer(CODE.sub("", md.read_text())):
        target = m.group(1).split("#")[0]
        if target and not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not (md.parent / target).exists():
            out.append(target)
    return out


def test_relative_links_name_existing_files():
    missing = {str(md.relative_to(ROOT)): bad for md in markdown_files() if (bad := missing_links(md))}
    assert not missing, missing


def test_a_missing_link_is_found(tmp_path):
    md = tmp_path / "x.md"
    (tmp_path / "here.json").write_text("{}")
    md.write_text("[ok](here.json) [gone](history/gone.json) `kernel[grid](...)` [web](https://example.org) [a](#b)")
    assert missing_links(md) == ["history/gone.json"]
