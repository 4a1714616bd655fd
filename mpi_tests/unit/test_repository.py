"""The tree holds code, docs and reports; run output stays out of git (benchmarks/results/ is
ignored, but for the CSVs a docs page renders or cites, added with git add -f)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    ROOT / "README.rst",
    *sorted((ROOT / "docs").rglob("*.rst")),
    *sorted((ROOT / "benchmarks" / "reports").glob("*.md")),
]
RENDERED = re.compile(r"^([ \t]*)\.\. hvd-results:: (\S+)\n((?:\1   :.*\n)*)", re.M)
FIGURE = re.compile(r"\.\. (?:figure|image):: (\S+)")


def tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def results_the_pages_use() -> tuple[set[str], set[str]]:
    """(CSVs a docs page renders, results sets the pages cite by path)."""
    rendered, cited = {"benchmarks/results/heldout/results.csv", "benchmarks/results/heldout/corpora.csv"}, set()
    for page in PAGES:
        text = page.read_text()
        for match in RENDERED.finditer(text):
            file = re.search(r":file: (\S+)", match.group(3))
            rendered.add(f"benchmarks/results/{match.group(2).strip('/')}/{file.group(1) if file else 'results.csv'}")
        cited |= set(re.findall(r"benchmarks/results/([A-Za-z0-9_.\-]+)", text))
    return rendered, cited


def test_benchmarks_hold_code_reports_and_the_csvs_the_docs_use():
    rendered, cited = results_the_pages_use()
    allowed = re.compile(r"benchmarks/([a-z_]+\.py|configs/[^/]+|reports/[A-Za-z0-9_.\-]+\.md)")
    stray = [
        f
        for f in tracked()
        if f.startswith("benchmarks/")
        and not allowed.fullmatch(f)
        and f not in rendered
        and not (f.endswith(".csv") and f.split("/")[2] in cited)
    ]
    assert not stray, f"run output in git (keep it under the ignored benchmarks/results/, or render it): {stray[:10]}"


def test_images_live_beside_the_docs_and_each_is_shown():
    shown = {(page.parent / path).resolve() for page in PAGES for path in FIGURE.findall(page.read_text())}
    images = [f for f in tracked() if f.rsplit(".", 1)[-1] in ("png", "jpg", "svg", "pdf")]
    assert all(f.startswith("docs/figures/") for f in images), [f for f in images if not f.startswith("docs/figures/")]
    unshown = [f for f in images if (ROOT / f).resolve() not in shown]
    assert not unshown, f"images no page shows: {unshown}"
