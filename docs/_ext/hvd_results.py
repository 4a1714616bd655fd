"""Sphinx directives that render measured results from their CSVs at build time.

``.. hvd-results:: SET`` renders ``benchmarks/results/SET/results.csv`` as a table (SET may
name a sub-folder, ``diloco-lowrank-budget/mnist5k``)::

    .. hvd-results:: floor-mlp-1gbit
       :columns: method, final_test_acc, bytes_ratio_to_ddp, step_time_ratio_to_ddp
       :rows: np=2; method=ddp|powersgd
       :caption: MLP on MNIST-5k, 2 ranks, 1 Gbit/s

``:columns:`` picks CSV columns (default: the usual ones of compare's CSVs, else all);
``:rows:`` keeps the rows whose column equals one of the ``|``-separated values (filters
separated by ``;``); ``:file:`` reads another CSV of the set (``forms.csv``); ``:caption:``
may hold inline markup. Headers and number formats come from FORMATS, so a figure reaches the
page only through its CSV. A missing set, file, column or matching row is a build error.

``.. hvd-heldout::`` renders the held-out suite (``benchmarks/results/heldout/results.csv``)
through `hvd_lowcomm.heldout`, the module ``--method auto`` reads, so the page, the CSV and
auto's choice cannot disagree.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Callable

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

from hvd_lowcomm import heldout, time_to_quality
from hvd_lowcomm.metrics import human_bytes

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "benchmarks" / "results"
RESULTS = RESULTS_DIR / "heldout" / "results.csv"
MISSING = "–"


def _number(text: str) -> float | None:
    """The cell as a float, or None when it is empty, nan or not a number."""
    try:
        value = float(text)
    except ValueError:
        return None
    return None if math.isnan(value) else value


def _signed(value: float, digits: int) -> str:
    """A signed figure with a typographic minus."""
    return f"{value:+.{digits}f}".replace("-", "−")


def ratio(value: float) -> str:
    """A ratio to 3 significant figures (whole numbers from 100 up)."""
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:#.3g}".rstrip(".")


def fraction(value: float) -> str:
    """A share below 1 as 1/N (1/20.1), else as a ratio."""
    return f"1/{ratio(1 / value)}" if 0 < value < 1 else ratio(value)


def fixed(digits: int, suffix: str = "") -> Callable[[float], str]:
    """A formatter to a fixed number of decimals."""
    return lambda v: f"{v:,.{digits}f}{suffix}"


def percent(digits: int, signed: bool = False) -> Callable[[float], str]:
    """A formatter of a fraction (0.936) as a percentage (93.60 %)."""
    return lambda v: (_signed(100 * v, digits) if signed else f"{100 * v:.{digits}f}") + " %"


def delta(digits: int, suffix: str = "") -> Callable[[float], str]:
    """A formatter of a signed difference."""
    return lambda v: _signed(v, digits) + suffix


# column: (header, formatter of its numbers); strings are shown as they are, methods as code.
FORMATS: dict[str, tuple[str, Callable[[float], str] | None]] = {
    "np": ("np", fixed(0)),
    "groups": ("groups", fixed(0)),
    "method": ("method", None),
    "role": ("run", None),
    "final_test_acc": ("test acc.", percent(2)),
    "best_test_acc": ("best test acc.", percent(2)),
    "acc_diff_to_ddp_points": ("Δ acc. vs ddp (points)", delta(2)),
    "final_test_loss": ("val. loss", fixed(4)),
    "perplexity": ("perplexity", fixed(2)),
    "loss_diff_to_ddp_pct": ("Δ loss vs ddp", delta(2, " %")),
    "bytes_per_step": ("bytes/step", human_bytes),
    "world_bytes_per_step": ("inter-group bytes/step", human_bytes),
    "bytes_ratio_to_ddp": ("bytes × ddp", ratio),
    "world_bytes_ratio_to_ddp": ("inter-group bytes × ddp", ratio),
    "step_ms": ("step ms", fixed(1)),
    "step_time_ratio_to_ddp": ("step × ddp", ratio),
    "ratio_to_ddp": ("step × ddp", ratio),
    "quality_risk": ("quality risk (held-out suite)", None),
    "step_time_ratio_to_floor": ("step × floor", ratio),
    "time_to_target_ratio_to_ddp": ("time to ddp's quality × ddp", ratio),
    "seconds_to_90pct_of_ddp": ("s to 90 % of ddp", fixed(1)),
    "peak_rss_mb": ("peak RSS MB", fixed(0)),
    "compression_ratio": ("compression", lambda v: ratio(v) + "×"),
    "compression_bound": ("bound", lambda v: ratio(v) + "×"),
    "parameter_fraction": ("share of the model", percent(1)),
    "measured_vs_meter": ("counters vs meter", percent(1, signed=True)),
    "link_utilisation": ("link use", percent(0)),
    "agreement": ("agreement", None),
    # benchmarks.rank_dad_warmup's rows: one per set and seed
    "set": ("set", None),
    "seed": ("seed", fixed(0)),
    # diloco_forms' forms.csv
    "form": ("form", None),
    "quality": ("quality (loss or acc.)", fixed(4)),
    "ddp_quality": ("ddp's quality", fixed(4)),
    "quality_vs_fp32_diloco": ("Δ vs fp32 DiLoCo (loss % or acc. points)", delta(2)),
    "inter_bytes_x_fp32_diloco": ("inter-group bytes × fp32 DiLoCo", fraction),
    "inter_bytes_x_ddp": ("inter-group bytes × ddp", ratio),
    # hf_zoo, sil_sweep, costmodel checks, loader, data_prep_memory
    "arch": ("architecture", None),
    "parameters": ("parameters", fixed(0)),
    "first_loss": ("first loss", fixed(4)),
    "last_loss": ("last loss", fixed(4)),
    "loss_vs_ddp": ("loss vs ddp", percent(1, signed=True)),
    "bytes_vs_ddp": ("bytes × ddp", ratio),
    "code_accuracy": ("code acc.", percent(2)),
    "largest_partition_share": ("largest partition", percent(1)),
    "between_partitions_bytes": ("between partitions", human_bytes),
    "results": ("results set", None),
    "measured_ms": ("measured ms", fixed(1)),
    "predicted_ms": ("predicted ms", fixed(1)),
    "error": ("error", percent(1, signed=True)),
    "samples_per_s": ("samples/s", fixed(0)),
    "per_rank": ("per rank", fixed(0)),
    "x_memory": ("× in memory", ratio),
    "corpus_mb": ("corpus MB", fixed(0)),
    "seconds": ("seconds", fixed(1)),
}
DEFAULT_COLUMNS = [
    "np",
    "method",
    "final_test_acc",
    "final_test_loss",
    "acc_diff_to_ddp_points",
    "loss_diff_to_ddp_pct",
    "bytes_ratio_to_ddp",
    "step_time_ratio_to_ddp",
]


def cell(column: str, text: str) -> nodes.Node:
    """One table cell: a method as code, a number formatted for its column, else the text."""
    if column == "method" and text:
        return nodes.literal(text=text)
    value = _number(text)
    if value is None:
        return nodes.Text(MISSING if text.strip().lower() in ("", "nan") else text)
    form = FORMATS.get(column, (column, None))[1]
    if form is None:  # a column without a format: integers as they are, else 4 significant figures
        return nodes.Text(f"{value:.0f}" if value.is_integer() else f"{value:.4g}")
    return nodes.Text(form(value))


def parse_filters(spec: str) -> list[tuple[str, set[str]]]:
    """``np=2; method=ddp|powersgd`` as [(column, allowed values)]."""
    filters = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        column, sep, values = part.partition("=")
        if not sep:
            raise ValueError(f"row filter {part!r} is not column=value")
        filters.append((column.strip(), {v.strip() for v in values.split("|")}))
    return filters


def matches(text: str, allowed: set[str]) -> bool:
    """Whether a cell equals one of the allowed values (numbers compared as numbers: 2 = 2.0)."""
    value = _number(text)
    return text in allowed or value is not None and value in {_number(a) for a in allowed}


def build_table(header: list[str], rows: list[list[nodes.Node]], caption: list[nodes.Node]) -> nodes.table:
    """A docutils table of the given header texts, row cells and (parsed) caption."""
    table = nodes.table(classes=["hvd-results"])
    if caption:
        table += nodes.title("", "", *caption)
    group = nodes.tgroup(cols=len(header))
    table += group
    group.extend(nodes.colspec(colwidth=1) for _ in header)
    for part, content in ((nodes.thead(), [[nodes.Text(h) for h in header]]), (nodes.tbody(), rows)):
        for cells in content:
            row = nodes.row()
            for item in cells:
                row += nodes.entry("", nodes.paragraph("", "", item))
            part += row
        group += part
    return table


class ResultsDirective(SphinxDirective):
    """``.. hvd-results:: SET``: a results set's CSV as a table."""

    required_arguments = 1
    has_content = False
    option_spec = {
        "columns": directives.unchanged_required,
        "rows": directives.unchanged_required,
        "caption": directives.unchanged,
        "file": directives.unchanged_required,
    }

    def run(self) -> list[nodes.Node]:
        name = self.arguments[0].strip("/")
        path = RESULTS_DIR / name / self.options.get("file", "results.csv")
        shown = path.relative_to(ROOT)
        self.env.note_dependency(str(path))
        if not path.is_file():
            raise self.error(f"hvd-results: {shown} does not exist (see ls benchmarks/results/)")
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            available, data = list(reader.fieldnames or []), list(reader)
        if "columns" in self.options:
            columns = [c.strip() for c in self.options["columns"].split(",") if c.strip()]
        else:
            columns = [c for c in DEFAULT_COLUMNS if c in available]
            if "method" not in columns:  # another layout (hf_zoo, loader...): every column
                columns = available
        try:
            filters = parse_filters(self.options.get("rows", ""))
        except ValueError as err:
            raise self.error(f"hvd-results {name}: {err}") from None
        unknown = [c for c in columns + [c for c, _ in filters] if c not in available]
        if unknown:
            raise self.error(
                f"hvd-results {name}: no column {', '.join(unknown)} in {shown} (it has: {', '.join(available)})"
            )
        data = [r for r in data if all(matches(r[c], allowed) for c, allowed in filters)]
        if not data:
            raise self.error(f"hvd-results {name}: no row matches {self.options.get('rows', '')!r}")
        header = [FORMATS.get(c, (c, None))[0] for c in columns]
        caption, messages = self.state.inline_text(self.options.get("caption", ""), self.lineno)
        table = build_table(header, [[cell(c, r[c] or "") for c in columns] for r in data], caption)
        source = nodes.paragraph("", "Generated from ", nodes.literal(text=str(shown)), classes=["hvd-results-source"])
        return [table, source, *messages]


def heldout_table(rows: list[dict[str, str]]) -> list[str]:
    """A list-table of the suite: one row per method (ddp, the reference, left out), one column
    per set, each cell the method's quality against ddp and its bytes as a multiple of ddp's;
    and the equal-time verdict beside them: its worst time to ddp's quality on a slow link, as a
    multiple of the no-communication limit (hvd_lowcomm.time_to_quality)."""
    sets = list(dict.fromkeys(r["set"] for r in rows))
    split = {r["set"]: r["split"] for r in rows}
    cells = heldout.cells(rows)
    lines = [".. list-table::", "   :header-rows: 1", "", "   * - method"]
    lines += [f"     - {name} ({split[name]})" for name in sets]
    lines.append("     - equal time, slow link")
    for method in dict.fromkeys(r["method"] for r in rows):
        if method == "ddp":
            continue
        lines.append(f"   * - ``{method}``")
        lines += [f"     - {cells.get((method, name), '–')}" for name in sets]
        lines.append(f"     - {equal_time_cell(method)}")
    return lines


def equal_time_cell(method: str) -> str:
    """`method`'s time to ddp's quality given ddp's time, on the judged sets where the link
    slows ddp: its worst multiple of the limit, 'not reached', or '–' (not measured)."""
    found = time_to_quality.measured().get(method)
    if found is None:
        return "–"
    if not math.isfinite(found.time_vs_limit):
        return "not reached ✗"
    return f"{found.time_vs_limit:.2f} × limit" + ("" if found.time_vs_limit <= 1 else " ✗")


class HeldOutDirective(SphinxDirective):
    """``.. hvd-heldout::``: the held-out suite's verdict table."""

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
    app.add_directive("hvd-results", ResultsDirective)
    app.add_directive("hvd-heldout", HeldOutDirective)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
