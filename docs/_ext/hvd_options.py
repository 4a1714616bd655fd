"""Sphinx directive ``.. hvd-options:: [SECTION ...]``: the option reference, generated.

Each option's name, type, default and help text come from the config dataclasses through
`hvd_lowcomm.config.describe_options`, the same source ``python -m hvd_lowcomm.train --help``
uses, so a new option appears here without anyone writing it twice. With no argument every
section is listed, each under its own heading; with section names ('train', 'ab'), those only.
"""

from __future__ import annotations

import re

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

from hvd_lowcomm.config import describe_options


def _cell(text: str) -> str:
    """Table cell text: help strings quote code in single backquotes, as docstrings do; here
    they become literals (reST would read them as titles), and a bare * is not emphasis."""
    text = re.sub(r"(?<!`)`([^`]+)`(?!`)", r"``\1``", text.replace("*", r"\*"))
    return text or "\\"


def option_table(options: list) -> list[str]:
    lines = [
        ".. list-table::",
        "   :header-rows: 1",
        "   :widths: 28 12 14 46",
        "",
        "   * - option",
        "     - type",
        "     - default",
        "     - meaning",
    ]
    for opt in options:
        meaning = opt.help + (f" (one of {', '.join(f'``{c}``' for c in opt.choices)})" if opt.choices else "")
        lines += [
            f"   * - ``--{opt.name}``",
            f"     - {opt.metavar}",
            f"     - ``{opt.default}``",
            f"     - {_cell(meaning)}",
        ]
    return lines


class OptionsDirective(SphinxDirective):
    optional_arguments = 20
    has_content = False

    def run(self) -> list[nodes.Node]:
        wanted = self.arguments
        by_section: dict[str, list] = {}
        for opt in describe_options():
            if not wanted or opt.section in wanted:
                by_section.setdefault(opt.section, []).append(opt)
        missing = sorted(set(wanted) - set(by_section))
        if missing:
            raise self.error(f"hvd-options: no option section(s) {', '.join(missing)}")
        lines: list[str] = []
        for section, options in by_section.items():
            if not wanted:  # the whole reference: one heading per section
                title = f"``{section}``"
                lines += [title, "~" * len(title), ""]
                if options[0].section_help:
                    lines += [options[0].section_help, ""]
            lines += option_table(options) + [""]
        container = nodes.section()  # a section so the generated headings may nest in the page
        nested_parse_with_titles(self.state, StringList(lines, source=self.get_source_info()[0]), container)
        return container.children


def setup(app):
    app.add_directive("hvd-options", OptionsDirective)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
