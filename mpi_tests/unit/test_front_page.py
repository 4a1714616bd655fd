"""The README is the front page: short, and every figure in it is its results' current output."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import front_page
from hvd_lowcomm import heldout


ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.rst"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.rst"))]


def paragraphs(text: str) -> list[str]:
    """Prose paragraphs: blank-line separated blocks that are not code, tables, lists or directives."""
    out, in_block = [], False
    for block in re.split(r"\n\s*\n", text):
        first = block.lstrip("\n").split("\n")[0]
        if in_block and first.startswith(" "):
            continue
        in_block = first.rstrip().endswith("::") or first.startswith("..")
        if first.startswith((" ", "*", "=", "..", "$")) or set(first.strip()) <= set("=-~ "):
            continue
        out.append(block)
    return out


def test_readme_decision_table_is_the_generated_one():
    assert front_page.readme_table(README.read_text()) == front_page.decision_table(), (
        "README.rst's decision table differs from its results: run python -m benchmarks.front_page --write"
    )


def test_decision_table_figures_come_from_the_heldout_summary():
    powersgd = heldout.Measured("powersgd", 7, True, "x", "+1.7 % loss", 0.123)
    diloco = heldout.Measured("diloco", 4, False, "y", "-3.0 points", 0.0042)
    table = front_page.decision_table({"powersgd": powersgd, "diloco": diloco})
    assert "  0.123  " in table and "+1.7 % validation loss" in table
    assert "-3.0 accuracy points on y, past the bound" in table and "  0.0042  " in table


def test_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 120
    long = [p for p in paragraphs(text) if len(p.split()) > 80]
    assert not long, f"paragraphs over 80 words: {[p[:60] for p in long]}"
    assert text.index(".. code-block:: python") < text.index("Which method for your cluster")


def test_readme_has_at_most_ten_measured_figures():
    table = front_page.readme_table(README.read_text())
    rows = table.split("=\n", 2)[-1]  # the table's body, after its header
    body = rows[: rows.index("\nBound:")]
    assert len(re.findall(r"[+-]?\d+\.\d+", body)) <= 10


def test_readme_figures_are_only_in_the_generated_table():
    text = README.read_text().replace(front_page.readme_table(README.read_text()), "")
    prose = "\n".join(line for line in text.splitlines() if not line.startswith(" "))
    assert not re.findall(r"\d(?:\.\d+)?\s?(?:%|×|points\b)[^\n]*", prose)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_results_sets_exist(page):
    cited = set(re.findall(r"benchmarks/results/([A-Za-z0-9_.\-]+\*?)", page.read_text()))
    missing = sorted(name for name in cited if not list((ROOT / "benchmarks" / "results").glob(name)))
    assert not missing, f"{page.name} cites results sets that do not exist: {missing}"
