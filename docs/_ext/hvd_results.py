"""Sphinx directive ``.. hvd-heldout::``: the held-out suite's table, generated from its CSV.

The figures come from ``benchmarks/results/heldout/results.csv`` (written by
``python -m benchmarks.heldout``) through `hvd_lowcomm.heldout`, the module `--method auto`
reads, so the page, the CSV and auto's choice cannot disagree.
"""
from __future__ import annotations

from pathlib import Path

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

from hvd_lowcomm import heldout

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "heldout" / "results.csv"


def heldout_table(rows: list[dict[str, str]]) -> list[str]:
    """A list-table of the suite: one row per method (ddp, the reference, left out), one column
    per set, each cell the method's quality against ddp and its bytes as a multiple of ddp's."""
    sets = list(dict.fromkeys(r["set"] for r in rows))
    split = {r["set"]: r["split"] for r in rows}
    cells = heldout.cells(rows)
    lines = [".. list-table::", "   :header-rows: 1", "", "   * - method"]
    lines += [f"     - {name} ({split[name]})" for name in sets]
    for method in dict.fromkeys(r["method"] for r in rows):
        if method == "ddp":
            continue
        lines.append(f"   * - ``{method}``")
        lines += [f"     - {cells.get((method, name), '–')}" for name in sets]
    return lines


class HeldOutDirective(SphinxDirective):
    has_content = False

    def run(self) -> list[nodes.Node]:
        self.env.note_dependency(str(RESULTS))
        if not RESULTS.exists():
            raise self.error(f"hvd-heldout: {RESULTS} does not exist; run python -m benchmarks.heldout")
        lines = heldout_table(heldout.read_rows(RESULTS))
        container = nodes.section()
        nested_parse_with_titles(self.state, StringList(lines, source=self.get_source_info()[0]), container)
        return container.children


def setup(app):
    app.add_directive("hvd-heldout", HeldOutDirective)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
